"""Wire layer: checksums, IPv4 building/fragmenting, reassembly bounds, TCP option parsing."""

from __future__ import annotations

import os
import socket

import dpkt
import pytest
from hypothesis import given, settings, strategies as st

from aioslirp.dispatch.reassembly import Reassembler
from aioslirp.wire.checksum import checksum, partial
from aioslirp.wire.ipv4 import IP_MF, fragment
from aioslirp.wire.tcp import build_tcp
from aioslirp.wire.udp import build_udp

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)


def ref_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum((data[i] << 8) | data[i + 1] for i in range(0, len(data), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF


@given(st.binary(min_size=1, max_size=3000))
@settings(max_examples=300)
def test_checksum_matches_rfc1071_reference(data):
    if not any(data):
        return
    c, r = checksum(data), ref_checksum(data)
    # 0x0000 and 0xFFFF are the two one's-complement zeros
    assert c == r or {c, r} == {0, 0xFFFF}


def test_built_tcp_frame_parses_and_verifies_with_dpkt():
    src, dst = socket.inet_aton("10.0.2.2"), socket.inet_aton("10.0.2.15")
    eth = b"\x52\x54\x00\x12\x34\x56" + b"\x52\x55\x0a\x00\x02\x02" + b"\x08\x00"
    payload = os.urandom(1001)
    frame = bytes(build_tcp(eth, src, dst, 80, 40000, 0xFFFFFFF0, 12345, 0x18, 512,
                            b"\x02\x04\x05\xb4", payload))
    e = dpkt.ethernet.Ethernet(frame)
    ip, tcp = e.data, e.data.data
    assert ip.src == src and ip.dst == dst and ip.len == 20 + 24 + 1001
    assert tcp.sport == 80 and tcp.dport == 40000 and tcp.seq == 0xFFFFFFF0 and tcp.ack == 12345
    assert tcp.win == 512 and tcp.flags == 0x18 and bytes(tcp.data) == payload
    assert partial(frame[14:34]) == 0  # IP header checksum verifies
    # recompute with dpkt and compare the TCP checksum
    want = tcp.sum
    tcp.sum = 0
    ip.sum = 0
    assert dpkt.ethernet.Ethernet(bytes(e)).data.data.sum == want


def test_fragment_and_reassemble_round_trip():
    src, dst = socket.inet_aton("10.0.2.2"), socket.inet_aton("10.0.2.15")
    payload = os.urandom(60000)
    pkt = build_udp(src, dst, 53, 5353, payload)
    frags = fragment(pkt, 1500)
    assert len(frags) == 41 and all(len(f) <= 1500 for f in frags)
    r = Reassembler()
    out = None
    for f in reversed(frags):  # out of order
        ff = int.from_bytes(f[6:8], "big")
        assert partial(f[:20]) == 0
        out = r.add((src, dst, 17, 1), (ff & 0x1FFF) << 3, bool(ff & IP_MF), memoryview(f)[20:], 0.0) or out
    assert out is not None and out[8:] == payload


def test_reassembly_overlap_and_bounds_are_counted():
    r = Reassembler(max_datagrams=2, timeout=1.0)
    k = ("a",)
    assert r.add(k, 0, True, b"x" * 16, 0.0) is None
    assert r.add(k, 8, True, b"y" * 16, 0.0) is None  # overlaps
    assert r.drops["frag_overlap"] == 1 and len(r) == 0
    assert r.add(k, 0, True, b"x" * 7, 0.0) is None  # non-final fragment not multiple of 8
    assert r.drops["frag_bad_length"] == 1
    assert r.add(k, 65520, False, b"x" * 100, 0.0) is None  # beyond 65535
    assert r.drops["frag_bad_length"] == 2
    for i in range(3):
        r.add((i,), 0, True, b"z" * 8, 0.0)
    assert len(r) == 2 and r.drops["frag_evicted"] == 1
    r.expire(5.0)
    assert len(r) == 0 and r.drops["frag_timeout"] == 2
