"""Hostile guests against the stack's dispatch (issue 13, items 6-10), through a whole Stack in this process.

* flow-table eviction: the longest-idle UDP/ICMP flow goes, found without scanning the table;
* neighbour caches: bounded the same way for IPv4 (ARP) and IPv6 (NDP);
* our own ICMPv6 echo reply above the link MTU: fragmented (RFC 8200 4.5);
* TCP and UDP from or to port 0: dropped and counted, never NATed nor answered;
* ICMPv4 errors: rate limited like the ICMPv6 ones (RFC 1812 4.3.2.8, RFC 4443 2.4 (f)).

Frames go in over a socketpair (helpers of tests/support/stacks.py); host peers are real sockets
on 127.0.0.1 / ::1 inside the test namespace.
"""

from __future__ import annotations

import asyncio
import hashlib
import select
import socket
import struct

import dpkt
import pytest

from aioslirp.ratelimit import TokenBucket
from aioslirp.wire.neighbors import MAX_NEIGHBORS

from support.frames import (ACK, DNS4, DNS6, F4, F6, GUEST6, GW4, GW6, RST, SYN, a6, checksum_valid, dns_query,
                            eth6_frame, icmp6_frame, ip_frame, raw6, tcp_frame, udp6_frame, udp_frame)
from support.servers import DnsUpstream
from support.stacks import GuestEnd, listener, serving, until

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

GW4_16 = socket.inet_aton("10.0.0.2")  # the gateway of 10.0.0.0/16


async def send_all(guest: GuestEnd, frames) -> None:
    """Send every frame, waiting when the socketpair is full (thousands of frames)."""
    loop = asyncio.get_running_loop()
    for f in frames:
        await loop.sock_sendall(guest.sock, f)


async def processed(stack, n: int) -> None:
    """Wait until the stack has taken ``n`` guest frames in all (each one is handled when taken)."""
    assert await until(lambda: stack.counters["frames_in"] >= n, 5.0), stack.counters["frames_in"]


def udp_sink(family=socket.AF_INET, host="127.0.0.1") -> socket.socket:
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.bind((host, 0))
    s.setblocking(False)
    return s


def readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


# ---------------------------------------------------------------------------------- 6: eviction
def udp_flow_ports(stack) -> list[int]:
    return sorted(f.guest_port for f in stack.parts.flows.values() if f.proto_name == "udp")


async def test_eviction_takes_the_longest_idle_udp_flow_never_tcp_and_looks_at_few_entries():
    sink = udp_sink()
    lst = listener()
    port = sink.getsockname()[1]
    try:
        async with serving(max_flows=8) as (stack, guest):
            # two TCP flows first: the oldest activity in the table, but never evicted
            guest.send(tcp_frame(F4, 40000, lst.getsockname()[1], SYN, mss=1460),
                       tcp_frame(F4, 40001, lst.getsockname()[1], SYN, mss=1460))
            assert await until(lambda: len(stack.parts.flows) == 2)
            guest.send(*(udp_frame(F4, 41000 + i, port, b"open") for i in range(6)))
            assert await until(lambda: len(stack.parts.flows) == 8)
            # 41000, 41001 active again
            guest.send(udp_frame(F4, 41000, port, b"again"), udp_frame(F4, 41001, port, b"again"))
            await processed(stack, 10)
            assert stack.parts.idle_order.examined == 0
            guest.send(udp_frame(F4, 41006, port, b"new"))  # table full: 41002 has been idle longest
            await processed(stack, 11)
            assert udp_flow_ports(stack) == [41000, 41001, 41003, 41004, 41005, 41006]
            guest.send(udp_frame(F4, 41007, port, b"new"))
            await processed(stack, 12)
            assert udp_flow_ports(stack) == [41000, 41001, 41004, 41005, 41006, 41007]
            assert sorted(f.guest_port for f in stack.parts.flows.values() if f.proto_name == "tcp") == [40000, 40001]
            assert stack.counters["flows_evicted"] == 2
            # A flow enters the heap when created, stamped with the loop time of its batch, which its
            # first datagram (same batch) does not move: it is taken without being pushed again.
            # First eviction: 41000, 41001 pushed again (their "again" datagrams), 41002 taken (3);
            # second: 41003 taken (1). A scan of the table looks at 8 flows each time.
            assert stack.parts.idle_order.examined == 4
    finally:
        sink.close()
        lst.close()


async def test_eviction_costs_one_heap_entry_per_eviction_amortized():
    sink = udp_sink()
    port = sink.getsockname()[1]
    n = 64
    try:
        async with serving(max_flows=n) as (stack, guest):
            await send_all(guest, [udp_frame(F4, 42000 + i, port, b"open") for i in range(n)])
            assert await until(lambda: len(stack.parts.flows) == n)
            # every flow active again
            await send_all(guest, [udp_frame(F4, 42000 + i, port, b"touch") for i in range(n)])
            await processed(stack, 2 * n)
            await send_all(guest, [udp_frame(F4, 43000 + i, port, b"new") for i in range(n)])  # n evictions
            await processed(stack, 3 * n)
            assert stack.counters["flows_evicted"] == n
            assert udp_flow_ports(stack) == list(range(43000, 43000 + n))
            # the first eviction pushes every active flow again (n), then each one takes the top (n)
            assert stack.parts.idle_order.examined == 2 * n
            # flows with one datagram each (stamped with their batch's time): taken at once (1 per eviction)
            await send_all(guest, [udp_frame(F4, 44000 + i, port, b"new") for i in range(n)])
            await processed(stack, 4 * n)
            assert stack.counters["flows_evicted"] == 2 * n
            assert udp_flow_ports(stack) == list(range(44000, 44000 + n))
            assert stack.parts.idle_order.examined == 3 * n
            assert len(stack.parts.idle_order) == n
    finally:
        sink.close()


async def test_eviction_refused_when_only_tcp_flows_and_heap_stays_bounded():
    sink = udp_sink()
    lst = listener()
    try:
        async with serving(max_flows=4) as (stack, guest):
            guest.send(*(tcp_frame(F4, 40100 + i, lst.getsockname()[1], SYN, mss=1460) for i in range(4)))
            assert await until(lambda: len(stack.parts.flows) == 4)
            await guest.recv(0.3)
            guest.send(udp_frame(F4, 41100, sink.getsockname()[1], b"x"))
            await processed(stack, 5)
            assert stack.counters["drop.flow_table_full"] == 1 and stack.counters["flows.udp.opened"] == 0
            guest.send(tcp_frame(F4, 40200, lst.getsockname()[1], SYN, mss=1460))
            (rst,) = [seg for seg in GuestEnd.tcp4(await guest.recv()) if seg.flags & RST]
            assert rst.flags & RST and rst.dport == 40200
            assert stack.counters["drop.flow_table_full"] == 2 and stack.counters["flows_evicted"] == 0
        # flows that close by themselves (no eviction) leave the heap compacted, not growing
        async with serving(max_flows=16384) as (stack, guest):
            for i in range(300):
                guest.send(udp_frame(F4, 45000 + i, sink.getsockname()[1], b"x"))
                await processed(stack, i + 1)
                for f in list(stack.parts.flows.values()):
                    f.shutdown()
                assert len(stack.parts.idle_order) <= 2 * 1 + 64  # at most 1 flow at a time here
            assert stack.counters["flows.udp.opened"] == stack.counters["flows.udp.closed"] == 300
    finally:
        sink.close()
        lst.close()


# ---------------------------------------------------------------------------------- 7: neighbours
async def test_ipv4_and_ipv6_neighbour_caches_share_one_bound_and_count_evictions():
    n = MAX_NEIGHBORS + 76
    async with serving(cidr="10.0.0.0/16", ipv6=True) as (stack, guest):
        assert MAX_NEIGHBORS == 1024
        srcs = [socket.inet_aton(f"10.0.{10 + i // 250}.{1 + i % 250}") for i in range(n)]
        # an unknown IP protocol: dropped after the source is learned, no answer
        await send_all(guest, [ip_frame(F4, b"\x00" * 8, 99, src=s, dst=GW4_16) for s in srcs])
        await processed(stack, n)
        assert stack.counters["drop.unknown_ip_proto"] == n
        assert len(stack.parts.neighbors) == MAX_NEIGHBORS
        assert stack.counters["arp.neighbors_evicted"] == n - MAX_NEIGHBORS
        assert list(stack.parts.neighbors) == srcs[n - MAX_NEIGHBORS:]  # the oldest learned went first

        srcs6 = [a6(f"fd00::1:{i:x}") for i in range(n)]
        await send_all(guest, [eth6_frame(raw6(s, GW6, 59, b"")) for s in srcs6])  # No Next Header: dropped
        await processed(stack, 2 * n)
        nb6 = stack.parts.v6.ndp.neighbors
        assert len(nb6) == MAX_NEIGHBORS and list(nb6) == srcs6[n - MAX_NEIGHBORS:]
        assert stack.counters["ndp.neighbors_evicted"] == n - MAX_NEIGHBORS
        assert stack.parts.neighbors.max_entries == nb6.max_entries == MAX_NEIGHBORS


async def test_arp_from_spoofed_addresses_bounded_too():
    n = MAX_NEIGHBORS + 10
    mac = bytes.fromhex("525400123456")
    async with serving(cidr="10.0.0.0/16") as (stack, guest):
        frames = []
        for i in range(n):
            spa = socket.inet_aton(f"10.0.{10 + i // 250}.{1 + i % 250}")
            arp = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REPLY, sha=mac, spa=spa, tha=b"\xff" * 6, tpa=spa)
            frames.append(bytes(dpkt.ethernet.Ethernet(src=mac, dst=b"\xff" * 6, type=0x0806, data=arp)))
        await send_all(guest, frames)
        await processed(stack, n)
        assert len(stack.parts.neighbors) == MAX_NEIGHBORS
        assert stack.counters["arp.neighbors_evicted"] == 10


# ---------------------------------------------------------------------------------- 8: ICMPv6 echo > MTU
def fragments6(src: bytes, dst: bytes, nh: int, body: bytes, ident: int, step: int = 1448) -> list[bytes]:
    out = []
    for off in range(0, len(body), step):
        more = 1 if off + step < len(body) else 0
        frag = struct.pack("!BBHI", nh, 0, off | more, ident) + body[off:off + step]
        out.append(eth6_frame(raw6(src, dst, 44, frag)))
    return out


def reassemble6(frames: list[bytes]) -> tuple[int, bytes]:
    """(Next Header, fragmentable part) of the fragments in ``frames`` (RFC 8200 4.5), checked whole."""
    parts, nhs, idents = [], set(), set()
    for f in frames:
        assert f[12:14] == b"\x86\xdd" and f[20] == 44
        nh, offflags, ident = struct.unpack_from("!BxHI", f, 54)
        nhs.add(nh)
        idents.add(ident)
        parts.append((offflags & 0xFFF8, offflags & 1, f[62:14 + 40 + struct.unpack_from("!H", f, 18)[0]]))
    parts.sort()
    assert len(nhs) == 1 and len(idents) == 1
    assert [m for _o, m, _d in parts] == [1] * (len(parts) - 1) + [0]
    data = b""
    for off, _m, d in parts:
        assert off == len(data)
        data += d
    return nhs.pop(), data


@pytest.mark.parametrize("dst", [GW6, DNS6], ids=["gateway6", "dns6"])
async def test_echo6_to_us_above_the_mtu_is_answered_in_fragments(dst):
    payload = bytes((i * 7) & 0xFF for i in range(3000))
    async with serving(ipv6=True) as (stack, guest):
        icmp = dpkt.icmp6.ICMP6(type=128, code=0, sum=0, data=struct.pack("!HH", 0x4242, 9) + payload)
        ip = dpkt.ip6.IP6(src=GUEST6, dst=dst, nxt=58, hlim=64, plen=len(bytes(icmp)), data=icmp)
        guest.send(*fragments6(GUEST6, dst, 58, bytes(ip)[40:], 0x77))
        out = [bytes(e) for e in await guest.recv()]
        assert len(out) == 3 and all(len(f) <= 14 + stack.config.mtu for f in out)
        nh, msg = reassemble6(out)
        assert nh == 58 and all(f[22:38] == dst and f[38:54] == GUEST6 for f in out)
        assert msg[0] == 129 and msg[1] == 0 and struct.unpack_from("!HH", msg, 4) == (0x4242, 9)
        assert checksum_valid(dst, GUEST6, 58, msg)
        assert hashlib.sha256(msg[8:]).hexdigest() == hashlib.sha256(payload).hexdigest()
        assert stack.counters["icmp6_echo_local"] == 1 and stack.counters["ipv6_reassembled"] == 1


@pytest.mark.netns
def test_ping6_gateway_with_3000_bytes_in_a_real_guest():
    from support.guests import run_guest

    dns = DnsUpstream()
    try:
        # The guest's TAP takes a frame above its MTU too, so the ping alone would pass: the
        # guest's own reassembly counter (RFC 4293 ipSystemStatsReasmOKs) shows the reply came
        # in fragments.
        p = run_guest({"dns": dns}, "", cmd=["sh", "-c", "ping -6 -c 1 -W 3 -s 3000 fd00::2 && "
                                                          "grep -E '^Ip6Reasm(OKs|Fails) ' /proc/net/snmp6"])
    finally:
        dns.close()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 packets transmitted, 1 received" in p.stdout
    assert "3008 bytes from fd00::2" in p.stdout
    snmp = dict(line.split() for line in p.stdout.splitlines() if line.startswith("Ip6Reasm"))
    assert snmp == {"Ip6ReasmOKs": "1", "Ip6ReasmFails": "0"}, p.stdout


# ---------------------------------------------------------------------------------- 9: port 0
async def probe_echo4(guest: GuestEnd, ident: int) -> list:
    """Send an echo to the gateway and return every frame up to its reply (the stack answers in order)."""
    guest.send(ip_frame(F4, dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=ident, seq=1, data=b"p")), 1, dst=GW4))
    frames = await guest.recv()
    is_reply = [e.type == 0x0800 and e.data.p == 1 and e.data.data.type == 0 for e in frames]
    assert is_reply.count(True) == 1 and frames[is_reply.index(True)].data.data.data.id == ident
    return [e for e, r in zip(frames, is_reply) if not r]


async def test_ipv4_tcp_and_udp_from_or_to_port_zero_dropped_never_natted():
    lst = listener()
    lst.setblocking(False)
    sink = udp_sink()
    up = DnsUpstream()
    try:
        async with serving(dns_upstreams=[("127.0.0.1", up.port)]) as (stack, guest):
            # from port 0: no RST towards port 0 either
            guest.send(tcp_frame(F4, 0, lst.getsockname()[1], SYN, mss=1460))
            guest.send(tcp_frame(F4, 0, lst.getsockname()[1], ACK, ack=5))  # no flow, would be a RST to port 0
            assert await probe_echo4(guest, 1) == []
            guest.send(tcp_frame(F4, 40300, 0, SYN, mss=1460))  # to port 0: refused like a closed port
            (rst,) = [e.data.data for e in await probe_echo4(guest, 2)]
            assert rst.flags == RST | ACK and (rst.sport, rst.dport) == (0, 40300) and rst.ack == 1001
            assert stack.counters["drop.tcp_port_zero"] == 3
            guest.send(udp_frame(F4, 0, sink.getsockname()[1], b"from zero"))
            guest.send(udp_frame(F4, 40301, 0, b"to zero"))
            guest.send(udp_frame(F4, 0, 53, dns_query(), dst=DNS4))  # the DNS forwarder does not answer port 0
            guest.send(udp_frame(F4, 0, 9, b"closed", dst=DNS4))  # nor does an ICMP error go to it
            assert await probe_echo4(guest, 3) == []
            await asyncio.sleep(0.1)
            assert not readable(sink) and not readable(lst)
            c = stack.counters
            assert c["drop.udp_port_zero"] == 4
            assert c["flows.tcp.opened"] == c["flows.udp.opened"] == 0 and not stack.parts.flows
            assert c["dns_queries_udp"] == 0 and up.udp_queries == 0 and c["icmp_errors_sent"] == 0
    finally:
        lst.close()
        sink.close()
        up.close()


async def test_ipv6_tcp_and_udp_from_or_to_port_zero_dropped_never_natted():
    lst = socket.socket(socket.AF_INET6)
    lst.bind(("::1", 0))
    lst.listen(4)
    lst.setblocking(False)
    sink = udp_sink(socket.AF_INET6, "::1")
    up = DnsUpstream()

    async def probe6(ident: int) -> list:
        guest.send(icmp6_frame(GUEST6, GW6, 128, 0, struct.pack("!HH", ident, 1), hlim=64))
        frames = [bytes(e) for e in await guest.recv()]
        icmp6_type = [f[54] if f[12:14] == b"\x86\xdd" and f[20] == 58 else None for f in frames]
        assert icmp6_type.count(129) == 1
        return [f for f, t in zip(frames, icmp6_type) if t not in (129, 134)]  # an RA may come any time

    try:
        async with serving(ipv6=True, dns_upstreams=[("127.0.0.1", up.port)]) as (stack, guest):
            guest.send(tcp_frame(F6, 0, lst.getsockname()[1], SYN, dst=GW6),
                       tcp_frame(F6, 0, lst.getsockname()[1], ACK, dst=GW6))
            assert await probe6(1) == []
            guest.send(tcp_frame(F6, 40400, 0, SYN, dst=GW6))
            (rst,) = [dpkt.ethernet.Ethernet(f).data.data for f in await probe6(2)]
            assert rst.flags == RST | ACK and (rst.sport, rst.dport) == (0, 40400) and rst.ack == 1001
            assert stack.counters["drop.tcp_port_zero"] == 3
            guest.send(udp6_frame(GUEST6, GW6, 0, sink.getsockname()[1], b"from zero"))
            guest.send(udp6_frame(GUEST6, GW6, 40401, 0, b"to zero"))
            guest.send(udp6_frame(GUEST6, DNS6, 0, 53, dns_query()))
            guest.send(udp6_frame(GUEST6, DNS6, 0, 9, b"closed"))
            assert await probe6(3) == []
            await asyncio.sleep(0.1)
            assert not readable(sink) and not readable(lst)
            c = stack.counters
            assert c["drop.udp_port_zero"] == 4
            assert c["flows.tcp.opened"] == c["flows.udp.opened"] == 0 and not stack.parts.flows
            assert c["dns_queries_udp"] == 0 and up.udp_queries == 0 and c["icmp6_errors_sent"] == 0
    finally:
        lst.close()
        sink.close()
        up.close()


# ---------------------------------------------------------------------------------- 10: ICMPv4 errors
async def test_icmpv4_errors_rate_limited_by_the_ipv6_limiter_class():
    async with serving(ipv6=True) as (stack, guest):
        # one rule for both families: the same class with the same rate and burst
        assert type(stack.parts.family4.err_bucket) is type(stack.parts.v6.err_bucket) is TokenBucket
        b4, b6 = stack.parts.family4.err_bucket, stack.parts.v6.err_bucket
        assert (b4.rate, b4.burst) == (b6.rate, b6.burst) == (100.0, 50.0)
        stack.parts.family4.err_bucket = TokenBucket(rate=0.0, burst=5)  # no refill: the count is exact
        await send_all(guest, [udp_frame(F4, 40500 + i, 9, b"closed port", dst=DNS4) for i in range(20)])
        await processed(stack, 20)
        frames = await guest.recv(0.3)
        errs = [e.data.data for e in frames if e.type == 0x0800 and e.data.p == 1]
        assert [(e.type, e.code) for e in errs] == [(3, 3)] * 5
        # each quotes its datagram: ICMP header (8), IPv4 header (20), then the UDP source port
        assert [struct.unpack_from("!H", bytes(e), 28)[0] for e in errs] == list(range(40500, 40505))
        assert stack.counters["icmp_errors_sent"] == 5
        assert stack.counters["icmp_errors_rate_limited"] == 15
