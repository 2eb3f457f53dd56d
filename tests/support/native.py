"""The native data plane's extension for the tests that drive it (aioslirp/native), and the
reference its frame classifier is held to.

:func:`reference` classifies a frame with the Python side's own parsers and checks, in the
dispatch's order (``Link.dispatch``, ``Ipv4Input.input``, ``parse_ipv6``, ``L4.tcp`` and
``L4.udp`` with ``parse_segment`` and the ``UDP`` struct); :func:`check` classifies in C and
asserts the record agrees (tests/unit/native/test_classify.py, the corpus replay, the fuzzer
``fuzz/fuzz_native.py``).

:func:`need_extension` returns ``aioslirp.native._dataplane``, or skips (fails under CI) with how
to build it: ``pip install -e .`` builds it with the rest, ``AIOSLIRP_NO_MYPYC=1 python setup.py
build_ext --inplace`` alone (a second or two). Under ``AIOSLIRP_NO_EXTENSIONS=1`` (the pure pass
of .ci/run, which runs only ``-m perframe``) these tests are not selected.
"""

from __future__ import annotations

import struct

from aioslirp import native
from aioslirp.wire.checksum import partial
from aioslirp.wire.ethernet import ETH, ETHERTYPE_ARP, ETHERTYPE_IPV4, ETHERTYPE_IPV6
from aioslirp.wire.ipv4 import IP_MF, IP_OFFMASK, IPV4
from aioslirp.wire.ipv6 import parse_ipv6
from aioslirp.wire.tcp import parse_segment
from aioslirp.wire.udp import UDP

from .prereqs import need

BUILD_HINT = ("the native data plane is not usable here ({why}): build it with pip install -e . or "
              "AIOSLIRP_NO_MYPYC=1 python setup.py build_ext --inplace")


def need_vhost():
    """The vhost-user rings' extension ``aioslirp.native._vhost`` (skip, or fail under CI, when it is
    not usable)."""
    from aioslirp.native import vhost

    need(vhost.extension() is not None, BUILD_HINT.format(why=vhost.why_not()))
    return vhost.extension()


def need_extension():
    """The extension module (skip, or fail under CI, when it is not usable)."""
    need(native.extension() is not None, BUILD_HINT.format(why=native.why_not()))
    return native.extension()


#: parse_ipv6 reasons the C core gives too (it does not walk extension headers: ``not_native``).
_IPV6_BASE = {"ipv6_truncated", "ipv6_bad_version", "ipv6_jumbogram", "ipv6_bad_length", "ipv6_bad_src"}
_V6_NAMES = {"truncated_tcp": "tcp6_truncated", "truncated_udp": "udp6_truncated", "bad_udp_length": "udp6_bad_length"}


def _l4(proto: int, l4: memoryview, base: int, l4_off: int, end: int, v6: bool) -> dict:
    """The TCP/UDP part of the reference, ``l4`` exactly the packet's transport bytes."""
    name = (lambda r: "drop:" + _V6_NAMES.get(r, r)) if v6 else (lambda r: "drop:" + r)
    n = len(l4)
    if proto == 6:
        if n < 20:
            return {"kind": name("truncated_tcp")}
        seg = parse_segment(l4)
        if seg is None:
            return {"kind": name("bad_tcp_header")}
        sport, dport = struct.unpack_from("!HH", l4, 0)
        return {"kind": "tcp", "sport": sport, "dport": dport, "tcp_flags": seg.flags, "l4_off": l4_off,
                "payload_off": l4_off + n - len(seg.payload), "payload_len": len(seg.payload), "end": end}
    if n < 8:
        return {"kind": name("truncated_udp")}
    sport, dport, ulen, _csum = UDP.unpack_from(l4, 0)
    if ulen < 8 or ulen > n:
        return {"kind": name("bad_udp_length")}
    return {"kind": "udp", "sport": sport, "dport": dport, "l4_off": l4_off, "payload_off": l4_off + 8,
            "payload_len": ulen - 8, "end": end}


def reference(buf: bytes, vnet: bool) -> dict:
    """What the Python side makes of ``buf`` (with a leading virtio-net header when ``vnet``): the
    fields of a :class:`~aioslirp.native.FrameRecord` it determines."""
    base = 0
    if vnet:
        if len(buf) <= 12:  # TapTransport: a header without a frame is skipped
            return {"kind": "drop:truncated_vnet"}
        base = 12
    frame = buf[base:]
    if len(frame) < 14:
        return {"kind": "drop:truncated_eth"}
    _dst, src_mac, ethertype = ETH.unpack_from(frame, 0)
    if src_mac[0] & 1:
        return {"kind": "drop:bad_src_mac"}
    if ethertype == ETHERTYPE_ARP:
        return {"kind": "not_native:arp"}
    if ethertype == ETHERTYPE_IPV4:
        if len(frame) < 34:
            return {"kind": "drop:truncated_ip"}
        ver_ihl, _tos, total, _id, flags_frag, _ttl, proto, _csum, src, dst = IPV4.unpack_from(frame, 14)
        ihl = (ver_ihl & 0x0F) << 2
        if ver_ihl >> 4 != 4 or ihl < 20:
            return {"kind": "drop:bad_ip_header"}
        if total < ihl or 14 + total > len(frame):
            return {"kind": "drop:bad_ip_length"}
        pkt = memoryview(frame)[14:14 + total]
        if partial(pkt[:ihl]) != 0:
            return {"kind": "drop:bad_ip_checksum"}
        common = {"src": src, "dst": dst, "proto": proto}
        if flags_frag & (IP_MF | IP_OFFMASK):
            return {"kind": "not_native:fragment", **common}
        if proto == 1:
            return {"kind": "not_native:icmp", **common}
        if proto not in (6, 17):
            return {"kind": "drop:unknown_ip_proto"}
        out = _l4(proto, pkt[ihl:], base, base + 14 + ihl, base + 14 + total, False)
        return {**out, **common} if out["kind"] in ("tcp", "udp") else out
    if ethertype == ETHERTYPE_IPV6:
        r = parse_ipv6(frame)
        if isinstance(r, str):
            if r == "ipv6_jumbogram" and frame[18:20] != b"\0\0":  # a Jumbo Payload option in a
                return {"kind": "not_native:ipv6_ext"}            # hop-by-hop header: Python's to drop
            return {"kind": "drop:" + r} if r in _IPV6_BASE else {"kind": "not_native:ipv6_ext"}
        common = {"src": r.src, "dst": r.dst}
        if r.ext or r.proto not in (6, 17, 58):
            return {"kind": "not_native:ipv6_ext", **common}
        if r.proto == 58:
            return {"kind": "not_native:icmp", **common}
        out = _l4(r.proto, memoryview(frame)[r.l4:r.end], base, base + r.l4, base + r.end, True)
        return {**out, **common, "proto": r.proto} if out["kind"] in ("tcp", "udp") else out
    return {"kind": "drop:unknown_ethertype"}


def check(buf: bytes, vnet: bool = False) -> native.FrameRecord:
    """Classify ``buf`` in C and assert the record agrees with :func:`reference` and its own
    invariants; returns the record."""
    need_extension()
    rec = native.classify(buf, vnet)
    ref = reference(buf, vnet)
    got = {k: getattr(rec, k) for k in ref}
    assert got == ref, (buf.hex(), vnet)
    if rec.kind in ("tcp", "udp"):
        base = 12 if vnet else 0
        assert rec.l2_off == base and rec.l3_off == base + 14
        assert rec.l3_off < rec.l4_off < rec.payload_off <= rec.payload_off + rec.payload_len <= rec.end <= len(buf)
        assert rec.flags & 1 == (bool(buf[0] & 3) if vnet else 0)
        assert len(rec.src) == len(rec.dst) == (16 if rec.flags & 4 else 4)
    return rec
