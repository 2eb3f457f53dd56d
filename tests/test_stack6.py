"""IPv6 through the whole Stack in this process: frames in over a socketpair, frames out checked.

NDP, RAs, DHCPv6, ICMPv6 echo and errors, DNS over IPv6, TCP and UDP flows to host sockets on
``::1``, reassembly, Packet Too Big, and hostile IPv6 frames dropped and counted. Frames are
built with dpkt; answers are decoded with dpkt and checksums verified independently.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import dpkt
import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack

from hostservers import DnsUpstream
from test_stack import recv_frames
from ipv6_helpers import (DNS6, GUEST6, GUEST_LL, GUEST_MAC, GW6, GW_LL, GW_MAC, a6, checksum_valid, eth,
                          icmp6_frame, raw6, udp6_frame)

SLLA = bytes((1, 1)) + GUEST_MAC
ALL_DHCP = a6("ff02::1:2")


@pytest.fixture
async def s6():
    dns = DnsUpstream(aaaa="2001:db8::99")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", dns.port)], dns_timeout=1.0, tcp_connect_timeout=1.0)
    async with Stack(cfg) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        first = await recv_frames(a, 0.5)  # the RA sent when serving starts
        yield stack, a, first
        stack.close()
        await task
    a.close()
    dns.close()


def decode6(frame: bytes):
    """(Ethernet, IP6) of an IPv6 frame from the stack, its upper-layer checksum verified."""
    e = dpkt.ethernet.Ethernet(frame)
    assert e.type == 0x86DD
    ip = e.data
    if ip.nxt in (6, 17, 58):
        assert checksum_valid(ip.src, ip.dst, ip.nxt, frame[54:54 + ip.plen])
    return e, ip


def icmp6_of(frames, t):
    out = []
    for f in frames:
        if f[12:14] == b"\x86\xdd" and f[20] == 58 and f[54] == t:
            out.append(decode6(f))
    return out


def tcp6_frame(src, dst, sport, dport, flags, seq=1000, ack=0, opts=b"", data=b"") -> bytes:
    t = dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, ack=ack, flags=flags, win=65535, off=5 + len(opts) // 4,
                     opts=opts, data=data)
    ip = dpkt.ip6.IP6(src=src, dst=dst, nxt=6, hlim=64, plen=len(bytes(t)))
    ip.data = t
    return bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=GW_MAC, type=0x86DD, data=ip))


async def test_ra_when_serving_starts_and_ndp_through_the_stack(s6):
    stack, guest, first = s6
    (ra,) = icmp6_of(first, 134)
    e, ip = ra
    assert (e.dst, e.src, ip.src, ip.dst, ip.hlim) == (bytes.fromhex("333300000001"), GW_MAC, GW_LL, a6("ff02::1"), 255)
    assert stack.counters["ndp.ra_sent_unsolicited"] == 1
    # Neighbor Solicitation for the gateway -> NA; Router Solicitation -> unicast RA
    ns = icmp6_frame(GUEST_LL, a6("ff02::1:ff00:2"), 135, 0, bytes(4) + GW6 + SLLA)
    rs = icmp6_frame(GUEST_LL, a6("ff02::2"), 133, 0, bytes(4) + SLLA)
    guest.send(ns)
    guest.send(rs)
    out = await recv_frames(guest)
    (na,) = icmp6_of(out, 136)
    assert (na[0].dst, na[1].src, na[1].dst) == (GUEST_MAC, GW6, GUEST_LL)
    assert bytes(na[1].data)[8:24] == GW6 and bytes(na[1].data)[4] == 0xE0  # R, S, O
    (ra2,) = icmp6_of(out, 134)
    assert (ra2[0].dst, ra2[1].dst) == (GUEST_MAC, GUEST_LL)
    assert stack.counters["ndp.na_sent"] == 1 and stack.counters["ndp.ra_sent_solicited"] == 1
    # DAD for the guest's own tentative address is never answered
    dad = icmp6_frame(bytes(16), a6("ff02::1:ff12:3456"), 135, 0, bytes(4) + GUEST6)
    guest.send(dad)
    assert await recv_frames(guest, 0.3) == []
    assert stack.counters["ndp.ns_dad_ignored"] == 1
    assert stack.v6.ndp.neighbors[GUEST_LL] == GUEST_MAC


async def test_echo_to_gateway_dns_and_router(s6):
    stack, guest, _ = s6
    for dst in (GW6, DNS6, GW_LL):
        src = GUEST_LL if dst == GW_LL else GUEST6
        guest.send(icmp6_frame(src, dst, 128, 0, struct.pack("!HH", 77, 5) + b"ping6", hlim=64))
    out = await recv_frames(guest)
    replies = icmp6_of(out, 129)
    assert [(ip.src, ip.dst, bytes(ip.data)[4:]) for _e, ip in replies] == [
        (GW6, GUEST6, struct.pack("!HH", 77, 5) + b"ping6"),
        (DNS6, GUEST6, struct.pack("!HH", 77, 5) + b"ping6"),
        (GW_LL, GUEST_LL, struct.pack("!HH", 77, 5) + b"ping6")]
    assert all(e.dst == GUEST_MAC for e, _ip in replies)
    assert stack.counters["icmp6_echo_local"] == 3


async def test_dhcpv6_information_request_answered_from_link_local(s6):
    stack, guest, _ = s6
    duid = bytes.fromhex("000300015254001234560000")[:10]
    msg = bytes((11,)) + b"\x01\x02\x03" + struct.pack("!HH", 1, len(duid)) + duid + struct.pack("!HHH", 6, 2, 23)
    guest.send(udp6_frame(GUEST_LL, ALL_DHCP, 546, 547, msg, dst_mac=bytes.fromhex("333300010002")))
    out = await recv_frames(guest)
    (f,) = out
    e, ip = decode6(f)
    assert (e.dst, ip.src, ip.dst, ip.data.sport, ip.data.dport) == (GUEST_MAC, GW_LL, GUEST_LL, 547, 546)
    reply = ip.data.data
    assert reply[0] == 7 and reply[1:4] == b"\x01\x02\x03"
    assert struct.pack("!HH", 23, 16) + DNS6 in reply
    assert stack.counters["dhcpv6_replies"] == 1


async def test_dns_over_ipv6_udp_and_tcp(s6):
    stack, guest, _ = s6
    q = bytes(dpkt.dns.DNS(id=4242, qd=[dpkt.dns.DNS.Q(name="www.example.test", type=28, cls=1)]))
    guest.send(udp6_frame(GUEST6, DNS6, 40000, 53, q))
    out = await recv_frames(guest, 2.0)
    (f,) = out
    e, ip = decode6(f)
    assert (ip.src, ip.dst, ip.data.sport, ip.data.dport) == (DNS6, GUEST6, 53, 40000)
    ans = dpkt.dns.DNS(ip.data.data)
    assert ans.id == 4242 and [rr.ip6 for rr in ans.an] == [a6("2001:db8::99")]
    # TCP: SYN to [fd00::3]:53 is answered by the stack's DNS-over-TCP service, MSS = MTU - 60
    guest.send(tcp6_frame(GUEST6, DNS6, 40001, 53, dpkt.tcp.TH_SYN, opts=b"\x02\x04\x05\xa0"))
    out = await recv_frames(guest)
    (syn_ack,) = out
    _e, ip = decode6(syn_ack)
    assert ip.data.flags == dpkt.tcp.TH_SYN | dpkt.tcp.TH_ACK and ip.data.ack == 1001
    assert dict(dpkt.tcp.parse_opts(ip.data.opts))[dpkt.tcp.TCP_OPT_MSS] == struct.pack("!H", 1500 - 60)
    assert stack.flows[(6, GUEST6, 40001, DNS6, 53)].state == "SYN-RECEIVED"
    # another port of the DNS address: RST
    guest.send(tcp6_frame(GUEST6, DNS6, 40002, 80, dpkt.tcp.TH_SYN))
    (rst,) = await recv_frames(guest)
    _e, ip = decode6(rst)
    assert ip.data.flags == dpkt.tcp.TH_RST | dpkt.tcp.TH_ACK and ip.data.ack == 1001


async def test_tcp_and_udp_flows_to_host_loopback(s6):
    stack, guest, _ = s6
    lst = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    lst.bind(("::1", 0))
    lst.listen(1)
    lst.setblocking(False)
    port = lst.getsockname()[1]
    guest.send(tcp6_frame(GUEST6, GW6, 41000, port, dpkt.tcp.TH_SYN, opts=b"\x02\x04\x05\xb4"))
    loop = asyncio.get_running_loop()
    conn, peer = await asyncio.wait_for(loop.sock_accept(lst), 2)
    assert peer[0] == "::1"
    (syn_ack,) = await recv_frames(guest)
    _e, ip = decode6(syn_ack)
    assert (ip.src, ip.dst, ip.data.sport, ip.data.dport) == (GW6, GUEST6, port, 41000)
    isn = ip.data.seq
    guest.send(tcp6_frame(GUEST6, GW6, 41000, port, dpkt.tcp.TH_ACK, seq=1001, ack=isn + 1, data=b"hello6"))
    conn.setblocking(False)
    assert await asyncio.wait_for(loop.sock_recv(conn, 100), 2) == b"hello6"
    await loop.sock_sendall(conn, b"back6")
    out = await recv_frames(guest)
    data = [decode6(f)[1].data.data for f in out if f[20] == 6]
    assert b"back6" in data
    conn.close()
    lst.close()
    # UDP: a datagram to a closed ::1 port -> ICMPv6 port unreachable quoting it
    probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    probe.bind(("::1", 0))
    closed = probe.getsockname()[1]
    probe.close()
    guest.send(udp6_frame(GUEST6, GW6, 42000, closed, b"anyone?"))
    await asyncio.sleep(0.1)
    guest.send(udp6_frame(GUEST6, GW6, 42000, closed, b"anyone?"))
    out = await recv_frames(guest)
    errs = icmp6_of(out, 1)
    assert errs, out
    _e, ip = errs[0]
    assert bytes(ip.data)[1] == 4  # port unreachable
    quoted = bytes(ip.data)[8:]
    assert quoted[8:24] == GUEST6 and quoted[24:40] == GW6 and quoted[40:42] == struct.pack("!H", 42000)
    assert stack.counters["icmp6_errors_sent"] >= 1


async def test_fragmented_udp_reassembled_and_large_reply_fragmented(s6):
    stack, guest, _ = s6
    echo = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    echo.bind(("::1", 0))
    echo.setblocking(False)
    port = echo.getsockname()[1]
    payload = bytes(range(256)) * 12  # 3072 bytes: 3 fragments at MTU 1500
    udp = dpkt.udp.UDP(sport=43000, dport=port, ulen=8 + len(payload), sum=0, data=payload)
    ip = dpkt.ip6.IP6(src=GUEST6, dst=GW6, nxt=17, hlim=64, plen=len(bytes(udp)), data=udp)
    whole = bytes(ip)
    body = whole[40:]
    ident = 0x1234
    for off in range(0, len(body), 1448):
        chunk = body[off:off + 1448]
        more = 1 if off + 1448 < len(body) else 0
        frag = struct.pack("!BBHI", 17, 0, off | more, ident)
        guest.send(eth(raw6(GUEST6, GW6, 44, frag + chunk)))
    loop = asyncio.get_running_loop()
    data, addr = await asyncio.wait_for(loop.sock_recvfrom(echo, 65536), 2)
    assert data == payload
    await loop.sock_sendto(echo, data, addr)
    out = await recv_frames(guest)
    assert len(out) == 3 and all(len(f) <= 14 + 1500 for f in out)
    assert all(f[20] == 44 for f in out)  # Fragment header (RFC 8200 4.5)
    parts = sorted((struct.unpack_from("!H", f, 56)[0] & 0xFFF8, f[62:]) for f in out)
    assert b"".join(p for _o, p in parts)[8:] == payload
    assert stack.counters["ipv6_reassembled"] == 1 and stack.counters["ipv6_fragments"] == 2
    echo.close()


async def test_packet_too_big_for_datagram_above_mtu():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    async with Stack(NetworkConfig(mtu=1280, dns_upstreams=[("127.0.0.1", 9)])) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        await recv_frames(a, 0.3)
        a.send(udp6_frame(GUEST6, a6("2001:db8::77"), 44000, 9, bytes(1400)))
        out = await recv_frames(a)
        (ptb,) = icmp6_of(out, 2)
        _e, ip = ptb
        assert ip.src == GW6 and ip.dst == GUEST6
        assert struct.unpack_from("!I", bytes(ip.data), 4)[0] == 1280
        assert len(bytes(ip)) <= 1280
        assert stack.counters["drop.ipv6_too_big"] == 1
        stack.close()
        await task
    a.close()


HOSTILE = {
    "ipv6_truncated": eth(b"\x60" + bytes(20)),
    "ipv6_bad_length": eth(raw6(GUEST6, GW6, 17, bytes(8), plen=500)),
    "ipv6_ext_too_many": eth(raw6(GUEST6, GW6, 60, b"".join(bytes((60, 0)) + bytes(6) for _ in range(9)) + bytes(8))),
    "ipv6_hbh_not_first": eth(raw6(GUEST6, GW6, 60, bytes((0, 0)) + bytes(6) + bytes((17, 0)) + bytes(6))),
    "ipv6_routing_header": eth(raw6(GUEST6, GW6, 43, bytes((17, 0, 0, 1)) + bytes(4))),
    "ipv6_spoofed_src": udp6_frame(GW6, a6("2001:db8::1"), 1, 2, b"x"),
    "ipv6_bad_src": udp6_frame(a6("2001:db8::1"), GW6, 1, 2, b"x"),
    "udp6_bad_checksum": eth(raw6(GUEST6, GW6, 17, struct.pack("!HHHH", 1, 2, 9, 0) + b"x")),  # zero checksum
    "icmp6_bad_checksum": eth(raw6(GUEST6, a6("2001:db8::1"), 58, bytes((128, 0, 0, 0)) + bytes(8))),
    "ndp_bad_hop_limit": icmp6_frame(GUEST_LL, a6("ff02::1:ff00:2"), 135, 0, bytes(4) + GW6 + SLLA, hlim=64),
    "ndp_ra_from_guest": icmp6_frame(GUEST_LL, a6("ff02::1"), 134, 0, bytes(12)),
    "ipv6_unknown_proto": eth(raw6(GUEST6, GW6, 132, bytes(8))),
}


async def test_hostile_ipv6_frames_dropped_and_counted(s6):
    stack, guest, _ = s6
    for reason, frame in HOSTILE.items():
        before = stack.counters["drop." + reason]
        stack.process_guest_frame(frame)
        assert stack.counters["drop." + reason] == before + 1, reason
    assert stack.counters["drop.internal_error"] == 0
    assert not stack.flows


async def test_ipv6_off_drops_and_sends_no_ra():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    async with Stack(NetworkConfig(ipv6=False, mtu=1000)) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        assert stack.v6 is None
        a.send(icmp6_frame(GUEST_LL, a6("ff02::2"), 133, 0, bytes(4) + SLLA))
        assert await recv_frames(a, 0.3) == []
        assert stack.counters["drop.ipv6_disabled"] == 1
        stack.close()
        await task
    a.close()


async def test_unknown_neighbour_solicited_and_reset_forgets(s6):
    stack, guest, _ = s6
    other = a6("fd00::abcd")
    hdr = stack.eth_to(other)
    assert hdr[:6] == bytes.fromhex("3333ff00abcd")  # no guest MAC yet: its solicited-node MAC
    assert stack.eth_to(other) == hdr  # a second look-up within a second sends no second NS
    out = await recv_frames(guest)
    (ns,) = icmp6_of(out, 135)
    assert bytes(ns[1].data)[8:24] == other and ns[1].dst == a6("ff02::1:ff00:abcd")
    assert (ns[1].src, ns[1].hlim) == (GW6, 255)
    # once the guest spoke, its MAC is used for unknown addresses too, and learned for its own
    guest.send(icmp6_frame(GUEST6, GW6, 128, 0, struct.pack("!HH", 1, 1), hlim=64))
    await recv_frames(guest)
    assert stack.eth_to(GUEST6)[:6] == GUEST_MAC and stack.eth_to(a6("fd00::beef"))[:6] == GUEST_MAC
    stack.reset_flows()
    assert not stack.v6.ndp.neighbors and stack.v6.guest_mac is None


REMOTE6 = "2001:db8::56"  # documentation address (RFC 3849) on lo of pytest's loopback-only namespace


@pytest.fixture
def remote6():
    import subprocess

    subprocess.run(["ip", "-6", "addr", "add", f"{REMOTE6}/128", "dev", "lo", "nodad"], check=True)
    yield a6(REMOTE6)
    subprocess.run(["ip", "-6", "addr", "del", f"{REMOTE6}/128", "dev", "lo"], check=False)


@pytest.fixture(params=["ping", "raw"])
def echo_mode(request):
    """ICMPv6 ping sockets allowed (net.ipv4.ping_group_range covers every group) or not (raw, as root)."""
    path = "/proc/sys/net/ipv4/ping_group_range"
    old = open(path).read().strip()
    with open(path, "w") as f:
        f.write("0 2147483647" if request.param == "ping" else "1 0")
    yield request.param
    with open(path, "w") as f:
        f.write(old)


async def test_echo_to_remote_proxied(remote6, echo_mode):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        await recv_frames(a, 0.3)
        for seq in (1, 2):
            a.send(icmp6_frame(GUEST6, remote6, 128, 0, struct.pack("!HH", 4321, seq) + b"x" * 100, hlim=64))
        out = await recv_frames(a)
        replies = icmp6_of(out, 129)
        assert stack.icmp.mode6 == echo_mode
        assert [(ip.src, ip.dst, bytes(ip.data)[4:]) for _e, ip in replies] == [
            (remote6, GUEST6, struct.pack("!HH", 4321, seq) + b"x" * 100) for seq in (1, 2)]
        assert stack.flows[(58, GUEST6, 4321, remote6, 0)].proto == 58
        stack.close()
        await task
    assert stack.icmp.raw6 is None
    a.close()
