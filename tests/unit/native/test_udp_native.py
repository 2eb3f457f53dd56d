"""The native UDP pieces (aioslirp/native/dataplane.c), byte for byte against the Python path.

Host to guest, ``dp_udp_frames``: the frames carrying one host datagram to the guest are those
the Python path queues (``Family4``/``Family6.inject_ip`` of ``wire.udp.build_udp``: the
Ethernet header, then ``wire.ipv4.fragment`` / ``wire.ipv6.fragment6`` to the MTU), for any
payload size up to the largest datagram, any MTU, both families. Guest to host,
``dp_udp_checksum_ok``: the checksum rule of ``L4.udp`` (trusted frames pass; a zero checksum is
none over IPv4 and invalid over IPv6).
"""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioslirp.wire.checksum import partial
from aioslirp.wire.ethernet import ETH, ETHERTYPE_IPV4, ETHERTYPE_IPV6
from aioslirp.wire.ipv4 import fragment, pseudo_sum
from aioslirp.wire.ipv6 import fragment6, pseudo_sum6
from aioslirp.wire.udp import build_udp

from support.native import need_extension

GUEST_MAC, GW_MAC = bytes.fromhex("525400123456"), bytes.fromhex("52550a000202")
ADDRS = {4: (bytes([93, 184, 216, 34]), bytes([10, 0, 2, 15])),
         6: (bytes.fromhex("20010db8000000000000000000000001"), bytes.fromhex("fd00000000000000505400fffe123456"))}


def python_frames(v: int, sport: int, dport: int, payload: bytes, hlim: int, mtu: int) -> list[bytes]:
    """What the Python path queues for the guest (Family4/Family6.inject_ip of build_udp)."""
    src, dst = ADDRS[v]
    pkt = build_udp(src, dst, sport, dport, payload, hlim)
    eth = ETH.pack(GUEST_MAC, GW_MAC, ETHERTYPE_IPV4 if v == 4 else ETHERTYPE_IPV6)
    if v == 4:
        return [eth + bytes(p) for p in fragment(pkt, mtu)]
    return [eth + bytes(pkt)] if len(pkt) <= mtu else [eth + bytes(p) for p in fragment6(pkt, mtu)]


def native_frames(v: int, sport: int, dport: int, payload: bytes, hlim: int, mtu: int, ident4: int,
                  ident6: int) -> list[bytes]:
    ext = need_extension()
    src, dst = ADDRS[v]
    eth = ETH.pack(GUEST_MAC, GW_MAC, ETHERTYPE_IPV4 if v == 4 else ETHERTYPE_IPV6)
    return ext.udp_frames(eth, src, dst, sport, dport, payload, hlim, mtu, ident4, ident6)


def same(v, sport, dport, payload, hlim, mtu) -> list[bytes]:
    py = python_frames(v, sport, dport, payload, hlim, mtu)
    ident4 = struct.unpack_from("!H", py[0], 18)[0] if v == 4 else 0  # the identification build_udp took
    ident6 = struct.unpack_from("!I", py[0], 14 + 44)[0] if v == 6 and len(py) > 1 else 0
    c = native_frames(v, sport, dport, payload, hlim, mtu, ident4, ident6)
    assert [len(f) for f in c] == [len(f) for f in py]
    assert c == py
    return c


_sizes = st.one_of(st.integers(0, 64), st.integers(1200, 1600), st.integers(8900, 9100), st.integers(0, 65507),
                   st.sampled_from([65507, 65499, 65500, 1472, 1473, 1452, 1453, 1232, 1233]))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([4, 6]), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), _sizes, st.integers(0, 255),
       st.one_of(st.sampled_from([1280, 1500, 9000, 65520, 1281, 1287]), st.integers(1280, 65535)), st.randoms())
def test_host_datagram_frames_are_the_python_paths(v, sport, dport, size, hlim, mtu, rnd):
    if v == 6:
        size = min(size, 65527)
    payload = rnd.randbytes(size)
    same(v, sport, dport, payload, hlim, mtu)


@pytest.mark.parametrize("v", [4, 6])
def test_fragment_boundaries_and_the_largest_datagram(v):
    hdr = 20 if v == 4 else 40
    for size, n in ((1500 - hdr - 8, 1), (1500 - hdr - 7, 2)):
        assert len(same(v, 5353, 40000, os.urandom(size), 64, 1500)) == n
    big = same(v, 53, 40000, os.urandom(65507), 64, 1500)
    assert len(big) == (45 if v == 4 else 46)
    assert all(len(f) <= 14 + 1500 for f in big)
    assert len(same(4, 53, 40000, os.urandom(64), 64, 68)) == 2  # IPv4's smallest MTU: 48-byte pieces


def test_a_zero_sum_is_sent_as_ffff_and_out_of_range_is_refused():
    ext = need_extension()
    # find a payload whose checksum computes to 0 (sent as 0xFFFF, RFC 768)
    for i in range(1 << 16):
        frames = same(4, 1, 2, struct.pack("!H", i), 64, 1500)
        if frames[0][14 + 20 + 6:14 + 20 + 8] == b"\xff\xff":
            break
    else:
        raise AssertionError("no payload summed to 0")
    eth = bytes(14)
    src, dst = ADDRS[4]
    with pytest.raises(ValueError, match="payload too long or mtu"):
        ext.udp_frames(eth, src, dst, 1, 2, bytes(65508), 64, 1500, 0, 0)
    with pytest.raises(ValueError, match="payload too long or mtu"):
        ext.udp_frames(eth, *ADDRS[6], 1, 2, b"x", 64, 1279, 0, 0)
    with pytest.raises(ValueError, match="eth is 14 bytes"):
        ext.udp_frames(eth[:13], src, dst, 1, 2, b"x", 64, 1500, 0, 0)


def python_checksum_ok(v: int, src: bytes, dst: bytes, udp: bytes, trusted: bool) -> bool:
    """L4.udp's rule, on a datagram ``udp`` exactly as long as its length field."""
    if trusted:
        return True
    ulen = len(udp)
    if struct.unpack_from("!H", udp, 6)[0]:
        psum = pseudo_sum(src, dst, 17, ulen) if v == 4 else pseudo_sum6(src, dst, 17, ulen)
        return (partial(udp) + psum) % 0xFFFF == 0
    return v == 4


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from([4, 6]), st.binary(max_size=300), st.sampled_from(["good", "zero", "flip", "any"]),
       st.booleans(), st.binary(min_size=16, max_size=16), st.binary(min_size=16, max_size=16))
def test_guest_datagram_checksum_rule_is_the_dispatchs(v, payload, how, trusted, a, b):
    ext = need_extension()
    src, dst = (a[:4], b[:4]) if v == 4 else (a, b)
    udp = bytearray(bytes(build_udp(src, dst, 1234, 53, payload))[20 if v == 4 else 40:])
    if how == "zero":
        udp[6:8] = b"\0\0"
    elif how == "flip" and payload:
        udp[8] ^= 0x01
    elif how == "any":
        udp[6:8] = payload[:2].ljust(2, b"\x5a")
    want = python_checksum_ok(v, src, dst, bytes(udp), trusted)
    assert ext.udp_checksum_ok(src, dst, bytes(udp), trusted) is want
    if how == "good":
        assert want
