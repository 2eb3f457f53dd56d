"""Egress policy, admission bounds, timers and clean stop, through a whole Stack in this process.

Frames go in over a socketpair and the answers are decoded with dpkt. Host peers are real
sockets on 127.0.0.1 (pytest runs in a loopback-only namespace); crafted destinations are the
gateway (host loopback), the link-local metadata address 169.254.169.254 (denied by default, so
nothing is ever sent to it) and AWS's IPv6 metadata address fd00:ec2::254 (likewise).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys

import dpkt
import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.config.policy import EgressPolicy
from aioslirp.ratelimit import TokenBucket

from support.frames import ACK, DNS4, F4, F6, RST, SYN, a6, dns_query, echo_frame, tcp_frame, udp_frame
from support.paths import TESTS
from support.servers import DnsUpstream, UdpEcho
from support.stacks import GuestEnd, listener, serving, until


METADATA = socket.inet_aton("169.254.169.254")


# ---------------------------------------------------------------------------------- policy unit
def test_policy_longest_prefix_wins_and_ties():
    p = EgressPolicy(allow=["169.254.169.254/32", "192.0.2.0/24"], deny=["0.0.0.0/0", "192.0.2.128/25"])
    assert not p.allows("169.254.1.1")  # default deny /16
    assert p.allows("169.254.169.254")  # /32 allow beats the /16 default
    assert not p.allows("198.51.100.7")  # only the /0 deny matches
    assert p.allows("192.0.2.5")  # /24 allow beats /0 deny
    assert not p.allows("192.0.2.200")  # /25 deny beats /24 allow
    assert p.allows("::1") and not p.allows("fe80::1%eth0") and not p.allows("fd00:ec2::254")
    # same prefix: a user rule beats a default, deny beats allow
    assert EgressPolicy(allow=["169.254.0.0/16"]).allows("169.254.169.254")
    assert not EgressPolicy(allow=["10.9.0.0/16"], deny=["10.9.0.0/16"]).allows("10.9.1.1")
    # DNS upstreams: only the user's rules
    assert EgressPolicy().allows("169.254.169.254", user_only=True)
    assert not EgressPolicy(deny=["169.254.169.254/32"]).allows("169.254.169.254", user_only=True)
    assert EgressPolicy(defaults=()).empty and EgressPolicy(defaults=()).allows("169.254.169.254")
    assert EgressPolicy().describe() == ["deny 169.254.0.0/16 (default)", "deny fd00:ec2::254/128 (default)",
                                      "deny fe80::/10 (default)"]


def test_token_bucket():
    b = TokenBucket(rate=10, burst=2, now=0.0)
    assert b.take(0.0) and b.take(0.0) and not b.take(0.0)
    assert not b.take(0.05)  # half a token
    assert b.take(0.1)
    assert b.take(10.0) and b.take(10.0) and not b.take(10.0)  # never more than the burst


# ---------------------------------------------------------------------------------- policy, whole stack
async def test_metadata_endpoint_denied_by_default_all_protocols():
    async with serving() as (stack, guest):
        guest.send(tcp_frame(F4, 40000, 80, SYN, dst=METADATA, mss=1460))
        guest.send(udp_frame(F4, 40001, 53, b"q", dst=METADATA))
        guest.send(echo_frame(F4, 77, dst=METADATA))
        frames = await guest.recv()
        errs = GuestEnd.icmp4(frames)
        assert [(e.type, e.code) for e in errs] == [(3, 13)] * 3
        quoted = [dpkt.ip.IP(bytes(e.data.data)) for e in errs]
        assert [q.dst for q in quoted] == [METADATA] * 3
        assert [q.p for q in quoted] == [6, 17, 1]
        assert struct.unpack("!HH", bytes(quoted[0].data)[:4]) == (40000, 80)
        c = stack.counters
        assert c["drop.egress_denied"] == 3
        # refused locally: no flow, no socket, no connect attempt
        assert not stack.parts.flows
        assert c["flows.tcp.opened"] == c["flows.udp.opened"] == c["flows.icmp.opened"] == 0
        assert c["tcp_connect_unreachable"] == c["tcp_connect_refused"] == 0


async def test_ipv6_metadata_denied_with_icmpv6_admin_prohibited():
    async with serving(ipv6=True) as (stack, guest):
        guest.send(tcp_frame(F6, 40000, 80, SYN, dst=a6("fd00:ec2::254")))
        frames = await guest.recv()
        errs = [e.data.data for e in frames if e.type == 0x86DD and e.data.nxt == 58 and e.data.data.type == 1]
        assert [(e.type, e.code) for e in errs] == [(1, 1)]
        assert stack.counters["drop.egress_denied"] == 1 and not stack.parts.flows


async def test_deny_host_loopback_then_allow_more_specific():
    lst = listener()
    lst.setblocking(False)
    port = lst.getsockname()[1]
    try:
        async with serving(egress_deny=["127.0.0.0/8"]) as (stack, guest):
            guest.send(tcp_frame(F4, 40010, port, SYN, mss=1460))
            errs = GuestEnd.icmp4(await guest.recv())
            assert [(e.type, e.code) for e in errs] == [(3, 13)]
            with pytest.raises(BlockingIOError):
                lst.accept()  # nothing reached the host
        async with serving(egress_deny=["127.0.0.0/8"], egress_allow=["127.0.0.1/32"]) as (stack, guest):
            guest.send(tcp_frame(F4, 40011, port, SYN, mss=1460))
            (synack,) = GuestEnd.tcp4(await guest.recv())
            assert synack.flags & (SYN | ACK) == SYN | ACK and synack.ack == 1001
            assert stack.counters["drop.egress_denied"] == 0
    finally:
        lst.close()


async def test_dns_upstream_denied_by_user_rule_gets_servfail():
    up = DnsUpstream()
    try:
        async with serving(dns_upstreams=[("127.0.0.1", up.port)], egress_deny=["127.0.0.1/32"]) as (stack, guest):
            assert stack.parts.dns.allow_upstream(("169.254.169.254", 53))  # defaults do not apply to upstreams
            guest.send(udp_frame(F4, 40020, 53, dns_query(), dst=DNS4))
            frames = await guest.recv()
            (reply,) = [dpkt.dns.DNS(e.data.data.data) for e in frames if e.type == 0x0800 and e.data.p == 17]
            assert reply.id == 0x1234 and reply.rcode == dpkt.dns.DNS_RCODE_SERVFAIL
            assert stack.parts.dns.stats["upstream_denied"] == 1
            assert up.udp_queries == 0
    finally:
        up.close()


# ---------------------------------------------------------------------------------- bounds
async def test_per_protocol_caps_refuse_new_flows_and_keep_existing():
    lst = listener()
    echo_srv = UdpEcho()
    try:
        async with serving(max_tcp_flows=1, max_udp_flows=1) as (stack, guest):
            port = lst.getsockname()[1]
            guest.send(tcp_frame(F4, 40030, port, SYN, mss=1460))
            (synack,) = GuestEnd.tcp4(await guest.recv())
            assert synack.flags & SYN
            guest.send(tcp_frame(F4, 40031, port, SYN, mss=1460))
            (rst,) = GuestEnd.tcp4(await guest.recv())
            assert rst.flags & RST and rst.ack == 1001
            assert stack.counters["drop.limit_tcp_flows"] == 1
            guest.send(udp_frame(F4, 40032, echo_srv.port, b"one"))
            assert [e.data.data.data for e in await guest.recv() if e.type == 0x0800 and e.data.p == 17] == [b"one"]
            guest.send(udp_frame(F4, 40033, echo_srv.port, b"two"))  # a second UDP flow: refused, dropped
            assert await guest.recv(0.3) == []
            assert stack.counters["drop.limit_udp_flows"] == 1
            guest.send(udp_frame(F4, 40032, echo_srv.port, b"again"))  # the existing flow carries on
            assert [e.data.data.data for e in await guest.recv() if e.type == 0x0800 and e.data.p == 17] == [b"again"]
            assert stack.parts.guard.active == {"tcp": 1, "udp": 1, "icmp": 0}
    finally:
        lst.close()
        echo_srv.close()


async def test_new_flow_rate_token_bucket():
    async with serving(new_flow_rate=0.5, new_flow_burst=2) as (stack, guest):
        guest.send(*(udp_frame(F4, 40040 + i, 9, b"x") for i in range(4)))
        await guest.recv(0.2)
        assert stack.counters["flows.udp.opened"] == 2
        assert stack.counters["drop.limit_new_flow_rate"] == 2


async def test_dns_inflight_bound():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))  # an upstream that never answers
    try:
        async with serving(dns_upstreams=[silent.getsockname()], dns_timeout=1.0, dns_max_inflight=2) as (stack, guest):
            guest.send(*(udp_frame(F4, 40050 + i, 53, dns_query(qid=i), dst=DNS4) for i in range(3)))
            await guest.recv(0.2)
            assert stack.counters["dns_queries_udp"] == 2
            assert stack.counters["drop.dns_too_many_queries"] == 1
            assert stack.parts.guard.dns_inflight == 2
    finally:
        silent.close()


async def test_pending_connects_bound_per_destination_and_guest_rst_frees_the_slot():
    hole = listener(backlog=1)  # never accepts: after 2 queued connections every connect stays pending
    live = listener()
    try:
        async with serving(max_pending_connects=8) as (stack, guest):  # 2 per destination
            port = hole.getsockname()[1]
            synacks = rsts = 0
            for i in range(8):
                guest.send(tcp_frame(F4, 41000 + i, port, SYN, seq=5000 + i, mss=1460))
                for seg in GuestEnd.tcp4(await guest.recv(0.15, 0.02)):
                    synacks += bool(seg.flags & SYN)
                    rsts += bool(seg.flags & RST)
            pending = [f for f in stack.parts.flows.values() if f.transport is None]
            assert len(pending) == 2, stack.parts.flows
            assert synacks + 2 + rsts == 8 and rsts >= 4
            assert stack.counters["drop.limit_pending_connects"] == rsts
            # another destination is not blocked by the black hole
            guest.send(tcp_frame(F4, 41100, live.getsockname()[1], SYN, mss=1460))
            (synack,) = GuestEnd.tcp4(await guest.recv())
            assert synack.flags & SYN
            # the guest gives up on a pending SYN: its slot (flow, socket, task) goes at once
            f = pending[0]
            guest.send(tcp_frame(F4, f.guest_port, port, RST, seq=5000 + f.guest_port - 41000 + 1))
            assert await until(lambda: f.key not in stack.parts.flows, 0.5)
            assert f.task.done()
            await asyncio.sleep(0.01)
            guest.send(tcp_frame(F4, 41200, port, SYN, mss=1460))  # admitted again: pending, not refused
            assert GuestEnd.tcp4(await guest.recv(0.2)) == []
            assert len([f for f in stack.parts.flows.values() if f.transport is None]) == 2
    finally:
        hole.close()
        live.close()


async def test_half_open_aborted_by_guest_rst_frees_slot_at_once():
    lst = listener()
    lst.settimeout(2)
    try:
        async with serving() as (stack, guest):
            guest.send(tcp_frame(F4, 42000, lst.getsockname()[1], SYN, seq=9000, mss=1460))
            (synack,) = GuestEnd.tcp4(await guest.recv())
            assert synack.flags & (SYN | ACK) == SYN | ACK
            conn, _ = lst.accept()  # the host side did connect
            assert stack.parts.guard.active["tcp"] == 1
            guest.send(tcp_frame(F4, 42000, lst.getsockname()[1], RST, seq=9001))
            assert await until(lambda: not stack.parts.flows, 0.2)
            assert stack.parts.guard.active["tcp"] == 0
            conn.settimeout(2)
            with pytest.raises(ConnectionResetError):  # the guest's RST stays a RST
                conn.recv(10)
            conn.close()
    finally:
        lst.close()


async def test_tcp_idle_timeout_resets_both_sides():
    lst = listener()
    lst.settimeout(2)
    try:
        async with serving(tcp_idle_timeout=0.3) as (stack, guest):
            port = lst.getsockname()[1]
            guest.send(tcp_frame(F4, 42100, port, SYN, seq=100, mss=1460))
            (synack,) = GuestEnd.tcp4(await guest.recv())
            guest.send(tcp_frame(F4, 42100, port, ACK, seq=101, ack=synack.seq + 1))
            conn, _ = lst.accept()
            flows = stack.parts.flows
            assert await until(lambda: flows and next(iter(flows.values())).state == "ESTABLISHED")
            frames = await guest.recv(1.5)
            assert any(s.flags & RST for s in GuestEnd.tcp4(frames))
            assert stack.counters["tcp_idle_closed"] == 1 and not stack.parts.flows
            conn.settimeout(2)
            with pytest.raises(ConnectionResetError):
                conn.recv(10)
            conn.close()
    finally:
        lst.close()


async def test_stop_resets_guest_flows_before_the_link_closes():
    lst = listener()
    lst.settimeout(2)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    guest = GuestEnd(a)
    try:
        async with Stack(NetworkConfig(ipv6=False, dns_upstreams=[("127.0.0.1", 9)])) as stack:
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            port = lst.getsockname()[1]
            guest.send(tcp_frame(F4, 42200, port, SYN, seq=100, mss=1460))
            (synack,) = GuestEnd.tcp4(await guest.recv())
            guest.send(tcp_frame(F4, 42200, port, ACK, seq=101, ack=synack.seq + 1))
            conn, _ = lst.accept()
            await asyncio.sleep(0.05)
            stack.stop()
            await task
            segs = GuestEnd.tcp4(await guest.recv(0.3))
            assert [s.flags & RST for s in segs] == [RST] and segs[0].seq == synack.seq + 1
            assert stack.counters["flows_reset_at_stop"] == 1 and not stack.parts.flows
            conn.settimeout(2)
            with pytest.raises(ConnectionResetError):
                conn.recv(10)
            conn.close()
    finally:
        lst.close()
        a.close()


#: Run in a child process (its RLIMIT_NOFILE is lowered for real; pytest's stays as it is):
#: soft 100, hard FD_RESERVE + 4. The stack raises the soft limit to the hard one, which
#: leaves 4 fds beyond the reserve: 1 for DNS queries (its share is at least one,
#: aioslirp.flow.guard.fd_budgets) and 3 for flows: 3 SYNs get a SYN-ACK (a real host socket each), the 4th a RST.
FD_LIMIT_CHILD = r"""
import asyncio, json, resource, sys

sys.path.insert(0, sys.argv[1])
from aioslirp.flow.guard import FD_RESERVE
from support.frames import F4, RST, SYN, tcp_frame
from support.stacks import GuestEnd, listener, serving

resource.setrlimit(resource.RLIMIT_NOFILE, (100, FD_RESERVE + 4))


async def main():
    lst = listener()
    port = lst.getsockname()[1]
    out = {}
    try:
        async with serving() as (stack, guest):
            out["soft_limit"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_RESERVE
            out["fd_budget"] = stack.parts.guard.fd_budget
            out["dns_fd_budget"] = stack.parts.guard.dns_fd_budget
            flags = []
            for i in range(4):
                guest.send(tcp_frame(F4, 43000 + i, port, SYN, mss=1460))
                flags.append(GuestEnd.tcp4(await guest.recv())[0].flags & (SYN | RST))
            out["answers"] = ["syn-ack" if f == SYN else "rst" if f == RST else f for f in flags]
            out["limit_fds"] = stack.counters["drop.limit_fds"]
            out["internal_error"] = stack.counters.get("drop.internal_error", 0)
    finally:
        lst.close()
    print(json.dumps(out))


asyncio.run(main())
"""


def test_open_file_limit_refuses_beyond_it():
    """A real RLIMIT_NOFILE (soft raised to the hard limit by the stack, docs/security.md):
    flows beyond it less FD_RESERVE get a RST, counted as drop.limit_fds."""
    p = subprocess.run([sys.executable, "-c", FD_LIMIT_CHILD, str(TESTS)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout) == {"soft_limit": 4, "fd_budget": 3, "dns_fd_budget": 1,
                                    "answers": ["syn-ack"] * 3 + ["rst"],
                                    "limit_fds": 1, "internal_error": 0}


async def test_qemu_stop_resets_guest_flows_and_removes_the_socket(tmp_path):
    """`aioslirp qemu` stopping (what SIGINT/SIGTERM do): the QEMU guest gets a RST for its open
    connection on the stream before it closes, and the socket path is removed."""
    from aioslirp.frontends.qemu import QemuServer

    lst = listener()
    lst.settimeout(2)
    path = str(tmp_path / "vm.sock")
    loop = asyncio.get_running_loop()
    try:
        async with Stack(NetworkConfig(ipv6=False, dns_upstreams=[("127.0.0.1", 9)])) as stack:
            server = QemuServer(stack, path=path)
            await server.start()
            serving_task = asyncio.ensure_future(server.serve())
            qemu = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            qemu.setblocking(False)
            await loop.sock_connect(qemu, path)

            async def frames(timeout: float) -> list:
                buf, out = b"", []
                end = loop.time() + timeout
                while loop.time() < end:
                    try:
                        chunk = await asyncio.wait_for(loop.sock_recv(qemu, 65536), end - loop.time())
                    except asyncio.TimeoutError:
                        break
                    if not chunk:
                        out.append(None)  # EOF
                        break
                    buf += chunk
                    while len(buf) >= 4 and len(buf) >= 4 + struct.unpack("!I", buf[:4])[0]:
                        n = struct.unpack("!I", buf[:4])[0]
                        out.append(dpkt.ethernet.Ethernet(buf[4:4 + n]))
                        buf = buf[4 + n:]
                return out

            def send(frame: bytes) -> None:
                qemu.send(struct.pack("!I", len(frame)) + frame)

            port = lst.getsockname()[1]
            send(tcp_frame(F4, 44000, port, SYN, seq=100, mss=1460))
            (synack,) = GuestEnd.tcp4([f for f in await frames(0.5) if f is not None])
            send(tcp_frame(F4, 44000, port, ACK, seq=101, ack=synack.seq + 1))
            conn, _ = lst.accept()
            await asyncio.sleep(0.05)
            server.close()
            out = await frames(2.0)
            assert out[-1] is None  # the stream closed
            rsts = [s for s in GuestEnd.tcp4([f for f in out if f is not None]) if s.flags & RST]
            assert len(rsts) == 1 and rsts[0].seq == synack.seq + 1
            await serving_task
            qemu.close()
            assert not os.path.exists(path)
            conn.settimeout(2)
            with pytest.raises(ConnectionResetError):
                conn.recv(10)
            conn.close()
    finally:
        lst.close()
