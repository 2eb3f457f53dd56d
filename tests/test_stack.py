"""The Stack in this process: hostile frames are counted, flows end cleanly, nothing leaks.

The in-process namespace tests run ``run_in_namespace`` on pytest's own event loop so the
test can inspect the very Stack that served the guest: its flow table, its tasks, and this
process's open file descriptors before and after.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct
import sys
import textwrap

import dpkt
import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.netns import run_in_namespace
from hostservers import DataServer, DnsUpstream, UdpEcho, pattern

GUEST_MAC = bytes.fromhex("525400123456")
GW_MAC = bytes.fromhex("52550a000202")
GUEST = socket.inet_aton("10.0.2.15")
GW = socket.inet_aton("10.0.2.2")


def ip_frame(payload_obj, proto, src=GUEST, dst=GW, **kw) -> bytes:
    ip = dpkt.ip.IP(src=src, dst=dst, p=proto, ttl=64, data=payload_obj, **kw)
    ip.len = 20 + len(bytes(payload_obj))
    ip.sum = 0
    return bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=GW_MAC, type=0x0800, data=ip))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
async def stack_pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], dns_timeout=0.2)
    async with Stack(cfg) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        yield stack, a
        stack.close()
        await task
    a.close()


async def recv_frames(sock, timeout=1.0):
    """Frames the stack sent to the guest end within ``timeout`` s (stops 50 ms after the last)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    out = []
    wait = timeout
    while True:
        try:
            out.append(await asyncio.wait_for(loop.sock_recv(sock, 70000), wait))
        except asyncio.TimeoutError:
            return out
        wait = 0.05


async def test_hostile_frames_are_dropped_and_counted(stack_pair):
    stack, guest = stack_pair
    good_tcp = dpkt.tcp.TCP(sport=40000, dport=9, seq=1, flags=dpkt.tcp.TH_SYN, win=1000)
    cases = {
        "truncated_eth": b"\x00" * 10,
        "unknown_ethertype": GW_MAC + GUEST_MAC + b"\x88\xcc" + b"\x00" * 40,
        "truncated_ip": GW_MAC + GUEST_MAC + b"\x08\x00" + b"\x45\x00",
        "bad_ip_length": GW_MAC + GUEST_MAC + b"\x08\x00" + b"\x45\x00\xff\xff" + b"\x00" * 40,
        "bad_src_ip": ip_frame(good_tcp, 6, src=socket.inet_aton("192.0.2.9")),
        "unknown_ip_proto": ip_frame(b"\x00" * 8, 99),
    }
    # lying IHL: header length 60 but packet only 40 bytes long
    raw = bytearray(ip_frame(good_tcp, 6))
    raw[14] = 0x4F
    cases["bad_ip_length_ihl"] = bytes(raw)
    # wrong IP checksum
    raw = bytearray(ip_frame(good_tcp, 6))
    raw[24] ^= 0xFF
    cases["bad_ip_checksum"] = bytes(raw)
    # wrong TCP checksum
    raw = bytearray(ip_frame(good_tcp, 6))
    raw[14 + 20 + 16] ^= 0xFF
    cases["bad_tcp_checksum"] = bytes(raw)
    # zero-length TCP option (kind 8 len 0) with valid checksum
    bad_opt = dpkt.tcp.TCP(sport=40001, dport=9, seq=1, flags=dpkt.tcp.TH_SYN, win=1000, off=6, opts=b"\x08\x00\x00\x00")
    cases["bad_tcp_header"] = ip_frame(bad_opt, 6)
    # UDP length larger than the packet
    u = bytearray(ip_frame(dpkt.udp.UDP(sport=1, dport=2, data=b"abcd"), 17))
    struct.pack_into("!H", u, 14 + 20 + 4, 500)
    cases["bad_udp_length"] = bytes(u)
    before = dict(stack.counters)
    for name, frame in cases.items():
        stack.process_guest_frame(frame)
    stack.flush()
    c = stack.counters
    for reason in ("truncated_eth", "unknown_ethertype", "truncated_ip", "bad_src_ip", "unknown_ip_proto",
                   "bad_ip_checksum", "bad_tcp_checksum", "bad_tcp_header"):
        assert c["drop." + reason] == before.get("drop." + reason, 0) + 1, reason
    # the total-length lie and the IHL lie (header longer than the packet)
    assert c["drop.bad_ip_length"] == before.get("drop.bad_ip_length", 0) + 2
    assert c["drop.bad_udp_length"] == 1
    assert c["drop.internal_error"] == 0
    assert not stack.flows


async def test_arp_and_local_ping_answered(stack_pair):
    stack, guest = stack_pair
    arp = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REQUEST, sha=GUEST_MAC, spa=GUEST, tha=b"\0" * 6, tpa=GW)
    guest.send(bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=b"\xff" * 6, type=0x0806, data=arp)))
    echo = dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=77, seq=3, data=b"ping!"))
    guest.send(ip_frame(echo, 1))
    frames = await recv_frames(guest)
    eths = [dpkt.ethernet.Ethernet(f) for f in frames]
    arps = [e.data for e in eths if e.type == 0x0806]
    assert arps and arps[0].op == dpkt.arp.ARP_OP_REPLY and arps[0].sha == GW_MAC and arps[0].spa == GW
    icmps = [e.data.data for e in eths if e.type == 0x0800 and e.data.p == 1]
    assert icmps and icmps[0].type == 0 and icmps[0].data.id == 77 and icmps[0].data.seq == 3
    assert icmps[0].data.data == b"ping!"


async def test_syn_to_closed_host_port_gets_rst(stack_pair):
    stack, guest = stack_pair
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    syn = dpkt.tcp.TCP(sport=41000, dport=port, seq=1000, flags=dpkt.tcp.TH_SYN, win=65535,
                       opts=b"\x02\x04\x05\xb4")
    guest.send(ip_frame(syn, 6))
    frames = await recv_frames(guest)
    tcps = [dpkt.ethernet.Ethernet(f).data.data for f in frames if f[12:14] == b"\x08\x00" and f[23] == 6]
    assert tcps, frames
    rst = tcps[0]
    assert rst.flags & dpkt.tcp.TH_RST and rst.flags & dpkt.tcp.TH_ACK and rst.ack == 1001
    await asyncio.sleep(0.05)
    assert not stack.flows
    assert stack.counters["tcp_connect_refused"] == 1


async def test_namespace_workload_leaves_no_fd_task_or_flow():
    """A real guest runs TCP, UDP, DNS and ICMP through a Stack in this process; afterwards
    the flow table is empty, every flow task is done and this process has no extra fd."""
    data, udp, dns = DataServer(), UdpEcho(), DnsUpstream()
    try:
        script = textwrap.dedent(f"""
            import socket, hashlib, subprocess, sys
            for i in range(20):
                s = socket.create_connection(("10.0.2.2", {data.port}), timeout=20)
                s.sendall(b"DOWN 100000 %d\\n" % i)
                buf = b""
                while True:
                    d = s.recv(65536)
                    if not d: break
                    buf += d
                s.close()
                assert hashlib.sha256(buf).hexdigest() == sys.argv[1 + i], i
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)
            u.sendto(b"x" * 100, ("10.0.2.2", {udp.port})); assert u.recv(200) == b"x" * 100
            assert socket.gethostbyname("leak.test") == "10.0.2.99"
            # a connection the guest resets
            s = socket.create_connection(("10.0.2.2", {data.port}), timeout=20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00")
            s.close()
        """)
        hashes = [hashlib.sha256(pattern(100000, i)).hexdigest() for i in range(20)]
        cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", dns.port)], udp_idle_timeout=0.5)
        stacks = []

        def factory(c):
            stacks.append(Stack(c))
            return stacks[-1]

        fds_before = fd_count()
        tasks_before = asyncio.all_tasks()
        rc = await run_in_namespace(cfg, [sys.executable, "-c", script, *hashes], stack_factory=factory)
        assert rc == 0
        stack = stacks[0]
        assert stack.counters["flows.tcp.opened"] >= 21
        assert stack.counters["flows.udp.opened"] >= 1
        assert stack.counters["drop.internal_error"] == 0
        assert not stack.flows
        assert all(t.done() for t in stack.tasks)
        await asyncio.sleep(0.05)
        assert asyncio.all_tasks() - tasks_before == set()
        assert fd_count() == fds_before
    finally:
        data.close()
        udp.close()
        dns.close()
