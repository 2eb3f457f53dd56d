"""The Stack in this process, one test per behaviour, run for IPv4 and for IPv6.

Frames go in over a socketpair and what comes back is decoded and checked (checksums
verified independently): echo answered locally and proxied, TCP and UDP flows to host
sockets on loopback, RST and port unreachable for closed ports, DNS over UDP and TCP,
fragments reassembled and large replies fragmented, hostile frames dropped and counted.
Each test takes ``fam`` (tests/support/frames.py: addresses, frame builders, ICMP types and
counter names of one family), as smoltcp runs its interface tests per medium with
``#[case]``. What only one family has is in tests/stack/test_dispatch_l3.py.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess

import dpkt
import pytest

from aioslirp import NetworkConfig

from support.frames import (ACK, DNS_AAAA, F4, F6, FAMILIES, GUEST_LL, GUEST_MAC, GW_MAC, RST, SYN, a6, echo_frame,
                            eth6_frame, icmp6_frame, icmp_of, of_proto, raw6, tcp_frame, udp6_frame, udp_frame)
from support.servers import DnsUpstream
from support.stacks import icmp_echo_mode, icmp_raw_socket, recv_frames, served_stack

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)


@pytest.fixture(params=FAMILIES, ids=lambda f: f.name)
def fam(request):
    return request.param


@pytest.fixture
async def served():
    """(stack, guest socket) of a Stack whose DNS upstream answers A and AAAA; the RA sent when
    serving starts is already read."""
    dns = DnsUpstream(aaaa=DNS_AAAA)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", dns.port)], dns_timeout=1.0, tcp_connect_timeout=1.0)
    try:
        async with served_stack(cfg) as (stack, guest, _first):
            yield stack, guest
    finally:
        dns.close()


async def test_echo_to_local_addresses_answered(served, fam):
    stack, guest = served
    for src, dst in fam.local_echo:
        guest.send(echo_frame(fam, 77, 5, b"ping!", src=src, dst=dst))
    replies = icmp_of(fam, await recv_frames(guest), fam.echo_reply)
    assert [(ip.src, ip.dst, msg[4:]) for _e, ip, msg in replies] == [
        (dst, src, struct.pack("!HH", 77, 5) + b"ping!") for src, dst in fam.local_echo]
    assert all(e.dst == GUEST_MAC and e.src == GW_MAC for e, _ip, _m in replies)
    assert stack.counters[fam.counter["echo_local"]] == len(fam.local_echo)


async def test_syn_to_closed_host_port_gets_rst(served, fam):
    stack, guest = served
    s = socket.socket(fam.af)
    s.bind((fam.loopback, 0))
    port = s.getsockname()[1]
    s.close()
    guest.send(tcp_frame(fam, 41000, port, SYN, opts=b"\x02\x04\x05\xb4"))
    tcps = of_proto(fam, await recv_frames(guest), 6)
    assert tcps
    rst = tcps[0][1].data
    assert rst.flags & RST and rst.flags & ACK and rst.ack == 1001
    await asyncio.sleep(0.05)
    assert not stack.parts.flows
    assert stack.counters["tcp_connect_refused"] == 1


async def test_tcp_and_udp_flows_to_host_loopback(served, fam):
    stack, guest = served
    lst = socket.socket(fam.af, socket.SOCK_STREAM)
    lst.bind((fam.loopback, 0))
    lst.listen(1)
    lst.setblocking(False)
    port = lst.getsockname()[1]
    guest.send(tcp_frame(fam, 41000, port, SYN, opts=b"\x02\x04\x05\xb4"))
    loop = asyncio.get_running_loop()
    conn, peer = await asyncio.wait_for(loop.sock_accept(lst), 2)
    assert peer[0] == fam.loopback
    (syn_ack,) = await recv_frames(guest)
    _e, ip = fam.decode(syn_ack)
    assert (ip.src, ip.dst, ip.data.sport, ip.data.dport) == (fam.gw, fam.guest, port, 41000)
    isn = ip.data.seq
    guest.send(tcp_frame(fam, 41000, port, ACK, seq=1001, ack=isn + 1, data=b"hello"))
    conn.setblocking(False)
    assert await asyncio.wait_for(loop.sock_recv(conn, 100), 2) == b"hello"
    await loop.sock_sendall(conn, b"back")
    data = [ip.data.data for _e, ip in of_proto(fam, await recv_frames(guest), 6)]
    assert b"back" in data
    conn.close()
    lst.close()
    # UDP: a datagram to a closed loopback port -> port unreachable quoting it (the host's
    # ICMP error reaches the flow's socket after the first send; the second send reports it)
    probe = socket.socket(fam.af, socket.SOCK_DGRAM)
    probe.bind((fam.loopback, 0))
    closed = probe.getsockname()[1]
    probe.close()
    guest.send(udp_frame(fam, 42000, closed, b"anyone?"))
    await asyncio.sleep(0.1)
    guest.send(udp_frame(fam, 42000, closed, b"anyone?"))
    out = await recv_frames(guest)
    errs = icmp_of(fam, out, fam.port_unreachable[0])
    assert errs, out
    _e, ip, msg = errs[0]
    assert msg[1] == fam.port_unreachable[1]
    assert fam.quoted(msg) == (fam.guest, fam.gw, struct.pack("!H", 42000))
    assert stack.counters[fam.counter["errors_sent"]] >= 1


async def test_dns_over_udp_and_tcp(served, fam):
    stack, guest = served
    q = bytes(dpkt.dns.DNS(id=4242, qd=[dpkt.dns.DNS.Q(name="www.example.test", type=fam.dns_qtype, cls=1)]))
    guest.send(udp_frame(fam, 40000, 53, q, dst=fam.dns))
    (f,) = await recv_frames(guest, 2.0)
    _e, ip = fam.decode(f)
    assert (ip.src, ip.dst, ip.data.sport, ip.data.dport) == (fam.dns, fam.guest, 53, 40000)
    ans = dpkt.dns.DNS(ip.data.data)
    assert ans.id == 4242 and [rr.rdata for rr in ans.an] == [fam.dns_answer]
    # TCP: a SYN to the DNS address port 53 is answered by the stack's DNS-over-TCP service
    guest.send(tcp_frame(fam, 40001, 53, SYN, opts=b"\x02\x04\x05\xa0", dst=fam.dns))
    (syn_ack,) = await recv_frames(guest)
    _e, ip = fam.decode(syn_ack)
    assert ip.data.flags == SYN | ACK and ip.data.ack == 1001
    assert dict(dpkt.tcp.parse_opts(ip.data.opts))[dpkt.tcp.TCP_OPT_MSS] == struct.pack("!H", 1500 - fam.mss_overhead)
    assert stack.parts.flows[(6, fam.guest, 40001, fam.dns, 53)].state == "SYN-RECEIVED"
    # another port of the DNS address: RST
    guest.send(tcp_frame(fam, 40002, 80, SYN, dst=fam.dns))
    (rst,) = await recv_frames(guest)
    _e, ip = fam.decode(rst)
    assert ip.data.flags == RST | ACK and ip.data.ack == 1001


async def test_fragmented_udp_reassembled_and_large_reply_fragmented(served, fam):
    stack, guest = served
    echo = socket.socket(fam.af, socket.SOCK_DGRAM)
    echo.bind((fam.loopback, 0))
    echo.setblocking(False)
    port = echo.getsockname()[1]
    payload = bytes(range(256)) * 12  # 3072 bytes: 3 fragments at MTU 1500
    for f in fam.udp_fragments(43000, port, payload, ident=0x1234):
        guest.send(f)
    loop = asyncio.get_running_loop()
    data, addr = await asyncio.wait_for(loop.sock_recvfrom(echo, 65536), 2)
    assert data == payload
    await loop.sock_sendto(echo, data, addr)
    out = await recv_frames(guest)
    assert len(out) == 3 and all(len(f) <= 14 + 1500 for f in out)
    assert all(fam.is_fragment(f) for f in out)
    assert b"".join(p for _o, p in fam.fragment_parts(out))[8:] == payload
    assert stack.counters[fam.counter["reassembled"]] == 1 and stack.counters[fam.counter["fragments"]] == 2
    echo.close()


def _hostile4() -> list:
    """(reason, frame) of hostile IPv4 frames; a reason may appear more than once."""
    good_tcp = dpkt.tcp.TCP(sport=40000, dport=9, seq=1, flags=SYN, win=1000)
    tcp_frame4 = F4.frame(F4.packet(good_tcp, 6))
    cases = [
        ("truncated_eth", b"\x00" * 10),
        ("unknown_ethertype", GW_MAC + GUEST_MAC + b"\x88\xcc" + b"\x00" * 40),
        ("truncated_ip", GW_MAC + GUEST_MAC + b"\x08\x00" + b"\x45\x00"),
        ("bad_ip_length", GW_MAC + GUEST_MAC + b"\x08\x00" + b"\x45\x00\xff\xff" + b"\x00" * 40),
        ("bad_src_ip", F4.frame(F4.packet(good_tcp, 6, src=socket.inet_aton("192.0.2.9")))),
        ("unknown_ip_proto", F4.frame(F4.packet(b"\x00" * 8, 99))),
    ]
    raw = bytearray(tcp_frame4)
    raw[14] = 0x4F  # lying IHL: header length 60 but packet only 40 bytes long
    cases.append(("bad_ip_length", bytes(raw)))
    raw = bytearray(tcp_frame4)
    raw[24] ^= 0xFF
    cases.append(("bad_ip_checksum", bytes(raw)))
    raw = bytearray(tcp_frame4)
    raw[14 + 20 + 16] ^= 0xFF
    cases.append(("bad_tcp_checksum", bytes(raw)))
    # zero-length TCP option (kind 8 len 0) with valid checksum
    bad_opt = dpkt.tcp.TCP(sport=40001, dport=9, seq=1, flags=SYN, win=1000, off=6, opts=b"\x08\x00\x00\x00")
    cases.append(("bad_tcp_header", F4.frame(F4.packet(bad_opt, 6))))
    u = bytearray(F4.frame(F4.packet(dpkt.udp.UDP(sport=1, dport=2, data=b"abcd"), 17)))
    struct.pack_into("!H", u, 14 + 20 + 4, 500)  # UDP length larger than the packet
    cases.append(("bad_udp_length", bytes(u)))
    return cases


def _hostile6() -> list:
    gw6, other = F6.gw, a6("2001:db8::1")
    slla = bytes((1, 1)) + GUEST_MAC
    return [
        ("ipv6_truncated", eth6_frame(b"\x60" + bytes(20))),
        ("ipv6_bad_length", eth6_frame(raw6(F6.guest, gw6, 17, bytes(8), plen=500))),
        ("ipv6_ext_too_many", eth6_frame(raw6(F6.guest, gw6, 60, b"".join(bytes((60, 0)) + bytes(6) for _ in range(9))
                                       + bytes(8)))),
        ("ipv6_hbh_not_first",
         eth6_frame(raw6(F6.guest, gw6, 60, bytes((0, 0)) + bytes(6) + bytes((17, 0)) + bytes(6)))),
        ("ipv6_routing_header", eth6_frame(raw6(F6.guest, gw6, 43, bytes((17, 0, 0, 1)) + bytes(4)))),
        ("ipv6_spoofed_src", udp6_frame(gw6, other, 1, 2, b"x")),
        ("ipv6_bad_src", udp6_frame(other, gw6, 1, 2, b"x")),
        # zero checksum
        ("udp6_bad_checksum", eth6_frame(raw6(F6.guest, gw6, 17, struct.pack("!HHHH", 1, 2, 9, 0) + b"x"))),
        ("icmp6_bad_checksum", eth6_frame(raw6(F6.guest, other, 58, bytes((128, 0, 0, 0)) + bytes(8)))),
        ("ndp_bad_hop_limit", icmp6_frame(GUEST_LL, a6("ff02::1:ff00:2"), 135, 0, bytes(4) + gw6 + slla, hlim=64)),
        ("ndp_ra_from_guest", icmp6_frame(GUEST_LL, a6("ff02::1"), 134, 0, bytes(12))),
        ("ipv6_unknown_proto", eth6_frame(raw6(F6.guest, gw6, 132, bytes(8)))),
    ]


async def test_hostile_frames_are_dropped_and_counted(served, fam):
    """Each hostile frame is counted under its reason at once; none makes a flow or an internal error."""
    stack, _guest = served
    cases = _hostile4() if fam is F4 else _hostile6()
    before = dict(stack.counters)
    for reason, frame in cases:
        n = stack.counters["drop." + reason]
        stack.process_guest_frame(frame)
        assert stack.counters["drop." + reason] == n + 1, reason
    stack.flush()
    reasons = [r for r, _f in cases]
    for reason in set(reasons):
        assert stack.counters["drop." + reason] == before.get("drop." + reason, 0) + reasons.count(reason), reason
    assert stack.counters["drop.internal_error"] == 0
    assert not stack.parts.flows


@pytest.fixture
def remote(fam):
    """``fam.remote`` put on lo of pytest's namespace: a destination that is not the gateway."""
    subprocess.run(fam.add_remote_cmd(), check=True)
    yield socket.inet_pton(fam.af, fam.remote)
    subprocess.run(fam.del_remote_cmd(), check=False)


@pytest.fixture(params=["ping", "raw"])
def echo_mode(request):
    """ICMP ping sockets allowed (net.ipv4.ping_group_range covers every group, for both
    families) or not (raw sockets, as root)."""
    path = "/proc/sys/net/ipv4/ping_group_range"
    old = open(path).read().strip()
    with open(path, "w") as f:
        f.write("0 2147483647" if request.param == "ping" else "1 0")
    yield request.param
    with open(path, "w") as f:
        f.write(old)


async def test_echo_to_remote_proxied(fam, remote, echo_mode):
    async with served_stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)]), settle=0.3) as (stack, guest, _f):
        for seq in (1, 2):
            guest.send(echo_frame(fam, 4321, seq, b"x" * 100, dst=remote))
        replies = icmp_of(fam, await recv_frames(guest), fam.echo_reply)
        assert icmp_echo_mode(stack, fam) == echo_mode
        assert [(ip.src, ip.dst, msg[4:]) for _e, ip, msg in replies] == [
            (remote, fam.guest, struct.pack("!HH", 4321, seq) + b"x" * 100) for seq in (1, 2)]
        assert stack.parts.flows[(fam.icmp_proto, fam.guest, 4321, remote, 0)].proto == fam.icmp_proto
    assert icmp_raw_socket(stack, fam) is None
