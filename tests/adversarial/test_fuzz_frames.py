"""Property-based fuzzing of ``Stack.process_guest_frame`` (hypothesis).

Valid frames of every protocol the stack speaks are built with dpkt, then mutated (bytes
flipped, truncated, extended, fields set to extremes) and fed in random order. Properties:
nothing escapes ``process_guest_frame`` (no ``drop.internal_error``), every frame is counted,
and closing the stack leaves no flow and no task. Destinations stay inside 10.0.2.0/24 and
fd00::/64, are link-local or multicast, or are the gateway (host loopback, where nothing
listens on the fuzzed ports); pytest runs in a loopback-only namespace.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import dpkt
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.wire.checksum import checksum

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

GUEST_MAC = bytes.fromhex("525400123456")
GW_MAC = bytes.fromhex("52550a000202")
GUEST = socket.inet_aton("10.0.2.15")
DESTS = [socket.inet_aton(a) for a in ("10.0.2.2", "10.0.2.3", "10.0.2.15", "10.0.2.77", "10.0.2.255",
                                       "255.255.255.255", "127.0.0.1", "0.0.0.0")]
# IPv6: the gateway (host ::1), DNS, other addresses of the prefix, multicast, link-local, loopback.
GUEST6 = [socket.inet_pton(socket.AF_INET6, a) for a in ("fd00::5054:ff:fe12:3456", "fe80::5054:ff:fe12:3456", "::")]
DESTS6 = [socket.inet_pton(socket.AF_INET6, a) for a in ("fd00::2", "fd00::3", "fd00::77", "ff02::1", "ff02::2",
                                                          "ff02::1:2", "ff02::1:ff00:2", "fe80::5055:aff:fe00:202",
                                                          "::1")]


def eth(payload: bytes, ethertype: int = 0x0800, dst: bytes = GW_MAC) -> bytes:
    return dst + GUEST_MAC + struct.pack("!H", ethertype) + payload


def ip(l4, proto: int, dst: bytes) -> bytes:
    p = dpkt.ip.IP(src=GUEST, dst=dst, p=proto, ttl=64, id=1, data=l4)
    p.len = 20 + len(bytes(l4))
    p.sum = 0
    return bytes(p)


@st.composite
def valid_frame(draw) -> bytes:
    dst = draw(st.sampled_from(DESTS))
    kind = draw(st.sampled_from(["tcp", "udp", "icmp", "arp", "dhcp", "dns", "frag", "ipv6", "ipv6_valid"]))
    if kind == "ipv6_valid":
        return draw(valid_frame6())
    port = draw(st.sampled_from([1, 9, 53, 67, 80, 65535]))
    if kind == "tcp":
        flags = draw(st.integers(0, 0x3F))
        opts = draw(st.sampled_from([b"", b"\x02\x04\x05\xb4", b"\x02\x04\x05\xb4\x01\x03\x03\x07",
                                     b"\x04\x02\x01\x01", b"\x08\x0a" + b"\x00" * 8 + b"\x01\x01"]))
        t = dpkt.tcp.TCP(sport=draw(st.integers(1024, 1040)), dport=port, seq=draw(st.integers(0, 2**32 - 1)),
                         ack=draw(st.integers(0, 2**32 - 1)), flags=flags, win=draw(st.integers(0, 65535)),
                         off=5 + len(opts) // 4, opts=opts, data=draw(st.binary(max_size=64)))
        return eth(ip(t, 6, dst))
    if kind == "udp":
        u = dpkt.udp.UDP(sport=draw(st.integers(1024, 1040)), dport=port, data=draw(st.binary(max_size=200)))
        u.ulen = len(bytes(u))
        return eth(ip(u, 17, dst))
    if kind == "icmp":
        i = dpkt.icmp.ICMP(type=draw(st.sampled_from([0, 3, 8, 11, 13])), code=draw(st.integers(0, 15)),
                           data=dpkt.icmp.ICMP.Echo(id=draw(st.integers(0, 65535)), seq=1,
                                                    data=draw(st.binary(max_size=64))))
        return eth(ip(i, 1, dst))
    if kind == "arp":
        a = dpkt.arp.ARP(op=draw(st.sampled_from([1, 2, 3])), sha=GUEST_MAC, spa=GUEST, tha=b"\0" * 6, tpa=dst)
        return eth(bytes(a), 0x0806, b"\xff" * 6)
    if kind == "dhcp":
        d = dpkt.dhcp.DHCP(chaddr=GUEST_MAC, xid=draw(st.integers(0, 2**32 - 1)),
                           opts=[(dpkt.dhcp.DHCP_OPT_MSGTYPE, bytes([draw(st.integers(0, 9))]))])
        u = dpkt.udp.UDP(sport=68, dport=67, data=bytes(d))
        u.ulen = len(bytes(u))
        p = dpkt.ip.IP(src=b"\0" * 4, dst=b"\xff" * 4, p=17, ttl=64, data=u)
        p.len = 20 + len(bytes(u))
        return eth(bytes(p), dst=b"\xff" * 6)
    if kind == "dns":
        q = dpkt.dns.DNS(id=draw(st.integers(0, 65535)),
                         qd=[dpkt.dns.DNS.Q(name=draw(st.sampled_from(["a.test", "", "x" * 60])), type=1, cls=1)])
        raw = bytes(q)
        if draw(st.booleans()):  # compression loop: a name pointer pointing at itself
            raw = raw[:12] + b"\xc0\x0c" + raw[-4:]
        u = dpkt.udp.UDP(sport=draw(st.integers(1024, 1040)), dport=53, data=raw)
        u.ulen = len(bytes(u))
        return eth(ip(u, 17, socket.inet_aton("10.0.2.3")))
    if kind == "frag":
        payload = draw(st.binary(min_size=8, max_size=64))
        off = draw(st.integers(0, 8191))
        mf = draw(st.booleans())
        hdr = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 7,
                                    (0x2000 if mf else 0) | off, 64, 17, 0, GUEST, dst))
        struct.pack_into("!H", hdr, 10, checksum(hdr))
        return eth(bytes(hdr) + payload)
    # ipv6: header + random payload
    return eth(b"\x60" + draw(st.binary(min_size=39, max_size=80)), 0x86DD)


@st.composite
def valid_frame6(draw) -> bytes:
    """A well-formed IPv6 frame: TCP, UDP (DNS, DHCPv6, others), ICMPv6 (echo, NDP, MLD), a fragment,
    or extension headers in front; checksums computed by dpkt."""
    src = draw(st.sampled_from(GUEST6))
    dst = draw(st.sampled_from(DESTS6))
    kind = draw(st.sampled_from(["tcp", "udp", "icmp6", "ndp", "frag", "ext"]))
    port = draw(st.sampled_from([1, 9, 53, 547, 65535]))
    nxt, hlim = 17, 64
    if kind == "tcp":
        nxt = 6
        l4 = dpkt.tcp.TCP(sport=draw(st.integers(1024, 1040)), dport=port, seq=draw(st.integers(0, 2**32 - 1)),
                          flags=draw(st.integers(0, 0x3F)), win=1000, data=draw(st.binary(max_size=64)))
    elif kind in ("udp", "frag", "ext"):
        l4 = dpkt.udp.UDP(sport=draw(st.sampled_from([546, 1024, 1025])), dport=port, data=draw(st.binary(max_size=200)))
        l4.ulen = len(bytes(l4))
    else:
        nxt = 58
        if kind == "ndp":
            t, hlim = draw(st.sampled_from([133, 134, 135, 136, 137])), 255
            body = bytes(4) + draw(st.sampled_from(DESTS6)) + draw(st.sampled_from([b"", b"\x01\x01" + GUEST_MAC,
                                                                                     b"\x02\x01" + GUEST_MAC, b"\x01\x00"]))
        else:
            t = draw(st.sampled_from([128, 129, 1, 2, 130, 131, 143]))
            body = struct.pack("!HH", draw(st.integers(0, 65535)), 1) + draw(st.binary(max_size=64))
        l4 = dpkt.icmp6.ICMP6(type=t, code=draw(st.sampled_from([0, 0, 1])), data=body)
    ip6 = dpkt.ip6.IP6(src=src, dst=dst, nxt=nxt, hlim=hlim, plen=len(bytes(l4)), data=l4)
    packet = bytes(ip6)
    if kind == "frag":  # one fragment of the datagram (offset 0 or not, more or not)
        off = draw(st.sampled_from([0, 8, 1448]))
        more = draw(st.booleans())
        body = packet[40:][:draw(st.sampled_from([8, 16, 64]))]
        packet = packet[:6] + bytes((44,)) + packet[7:40] + struct.pack("!BBHI", nxt, 0, off | more, 9) + body
        packet = packet[:4] + struct.pack("!H", len(packet) - 40) + packet[6:]
    elif kind == "ext":  # Hop-by-Hop / Destination Options / Routing (Segments Left 0) in front
        ext = draw(st.sampled_from([(0, bytes(6)), (60, b"\x01\x04" + bytes(4)), (43, bytes((0, 0)) + bytes(4))]))
        hdr = bytes((nxt, 0)) + ext[1]
        packet = packet[:6] + bytes((ext[0],)) + packet[7:40] + hdr + packet[40:]
        packet = packet[:4] + struct.pack("!H", len(packet) - 40) + packet[6:]
    dst_mac = b"\x33\x33" + dst[12:] if dst[0] == 0xFF else GW_MAC
    return eth(packet, 0x86DD, dst_mac)


@st.composite
def mutated_frame(draw) -> bytes:
    f = bytearray(draw(valid_frame()))
    op = draw(st.sampled_from(["none", "flip", "truncate", "extend", "zero_len"]))
    if op == "flip" and f:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(f) - 1))
            f[i] ^= 1 << draw(st.integers(0, 7))
    elif op == "truncate":
        f = f[: draw(st.integers(0, len(f)))]
    elif op == "extend":
        f += draw(st.binary(max_size=64))
    elif op == "zero_len" and len(f) > 18:
        f[16:18] = b"\x00\x00"
    return bytes(f)


async def _feed(frames) -> Stack:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], dns_timeout=0.05, tcp_connect_timeout=0.2)
    try:
        async with Stack(cfg) as stack:
            serve = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            for f in frames:
                stack.process_guest_frame(f)
            stack.flush()
            await asyncio.sleep(0.01)
            stack.stop()
            await serve
    finally:
        a.close()
    return stack


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated_frame(), min_size=1, max_size=40))
def test_process_guest_frame_never_raises_and_counts_every_frame(frames):
    stack = asyncio.run(_feed(frames))
    c = stack.counters
    assert c["drop.internal_error"] == 0
    assert c["frames_in"] == len(frames)
    frames_in, handled, dropped = stack.frame_outcomes()  # one outcome per frame, each counted where it happens
    assert frames_in == handled + dropped, dict(c)
    assert not stack.parts.flows
    assert all(t.done() for t in stack.parts.tasks)
