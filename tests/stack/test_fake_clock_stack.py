"""A whole Stack on a fake clock: one ``now`` per batch, one idle sweep, no real waiting.

The event loop's clock (``loop.time()``) is the only clock of the data path: the batch of guest
frames, the flows' ``last_active``, the TCP timers, the rate limiters and the flow table's idle
sweep all read it. So a loop whose ``time()`` is a number the test moves drives a real Stack --
a fake transport in front, real sockets on 127.0.0.1 behind -- through a UDP flow's and a TCP
flow's idle timeouts (30 s and 100 s here) in no time, and the instant each flow ends is exact:
the first sweep (every ``FlowTable.interval`` seconds from the stack's start) at or past its
timeout.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.flow.base import Flow

from support.fake_clock import START, FakeClockLoop, FakeTransport, settle, tcp_out, udp_out
from support.frames import ACK, F4, GUEST4, GW4, RST, SYN, tcp_frame, udp_frame

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)


def test_fake_clock_drives_udp_and_tcp_idle_expiry_exactly():
    cfg = NetworkConfig(ipv6=False, dns_upstreams=[("127.0.0.1", 9)], udp_idle_timeout=30.0,
                        tcp_idle_timeout=100.0, icmp_idle_timeout=10.0)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    lst.settimeout(5)
    tport = lst.getsockname()[1]
    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind(("127.0.0.1", 0))
    echo.settimeout(5)
    uport = echo.getsockname()[1]
    loop = FakeClockLoop()
    out: dict = {}

    async def advance_to(t: float) -> None:
        loop.now = t
        await settle()

    async def main() -> None:
        async with Stack(cfg) as stack:
            tr = FakeTransport()
            serving = asyncio.ensure_future(stack.serve(tr))
            await settle()
            interval = stack.parts.table.interval
            assert interval == 2.5  # a quarter of the shortest idle timeout (icmp 10 s)

            # -- a TCP connection to a real listener, at fake time START + 1
            loop.now = START + 1
            tr.deliver(tcp_frame(F4, 40000, tport, SYN, seq=100, mss=1460))
            assert await settle(lambda: tcp_out(tr.out))
            ((iss, ack, flags, _),) = tcp_out(tr.out)
            assert flags == SYN | ACK and ack == 101
            conn, _ = lst.accept()
            conn.settimeout(5)
            tr.out.clear()
            tr.deliver(tcp_frame(F4, 40000, tport, ACK, seq=101, ack=iss + 1),
                       tcp_frame(F4, 40000, tport, ACK, seq=101, ack=iss + 1, data=b"hello"))
            assert conn.recv(100) == b"hello"
            conn.sendall(b"world")
            assert await settle(lambda: any(p for *_, p in tcp_out(tr.out)))
            ((seq, ack, flags, payload),) = tcp_out(tr.out)
            assert (seq, ack, payload) == (iss + 1, 106, b"world")  # the host's bytes carry our ACK
            tr.out.clear()
            loop.now = START + 2
            tr.deliver(tcp_frame(F4, 40000, tport, ACK, seq=106, ack=iss + 6))  # the guest's last segment
            tcp_flow = stack.parts.flows[(6, GUEST4, 40000, GW4, tport)]
            assert tcp_flow.state == "ESTABLISHED" and tcp_flow.last_active == START + 2

            # -- a UDP flow to a real socket, at fake time START + 3
            loop.now = START + 3
            tr.deliver(udp_frame(F4, 41000, uport, b"ping"))
            data, peer = echo.recvfrom(100)
            assert data == b"ping"
            udp_flow = stack.parts.flows[(17, GUEST4, 41000, GW4, uport)]
            assert udp_flow.last_active == START + 3  # the batch's now, taken once in on_frames
            echo.sendto(b"pong", peer)
            assert await settle(lambda: udp_out(tr.out))
            assert udp_out(tr.out) == [(uport, 41000, b"pong")]
            assert udp_flow.last_active == START + 3  # the reply came at the same (frozen) loop time
            assert isinstance(tcp_flow, Flow) and isinstance(udp_flow, Flow)  # what the table, API and tracing read

            # -- the sweep runs every 2.5 s from START; the UDP flow goes at the first sweep at or
            # past START + 3 + 30, i.e. START + 35, not before
            c = stack.counters
            t = START
            while t < START + 32.5:
                t += interval
                await advance_to(t)
            assert udp_flow.key in stack.parts.flows and c["udp_idle_closed"] == 0  # swept at +32.5: 29.5 s idle
            await advance_to(START + 35.0)
            assert udp_flow.key not in stack.parts.flows and udp_flow.sock is None
            assert c["udp_idle_closed"] == 1 and c["flows.udp.closed"] == 1
            assert tcp_flow.key in stack.parts.flows and c["tcp_idle_closed"] == 0
            out["udp_gone_at"] = loop.now

            # -- the TCP flow goes at the first sweep past START + 2 + 100 (strictly past), START + 102.5
            tr.out.clear()
            t = START + 35.0
            while t < START + 100.0:
                t += interval
                await advance_to(t)
            assert tcp_flow.key in stack.parts.flows and c["tcp_idle_closed"] == 0  # swept at +100: 98 s idle
            await advance_to(START + 102.5)
            assert tcp_flow.key not in stack.parts.flows and c["tcp_idle_closed"] == 1 and c["flows.tcp.closed"] == 1
            rsts = [s for s in tcp_out(tr.out) if s[2] & RST]
            assert rsts == [(iss + 6, 106, RST | ACK, b"")]  # reset towards the guest, at our next sequence
            try:
                got = conn.recv(10)
            except ConnectionResetError:
                got = "reset"
            assert got == "reset"  # and towards the host peer (SO_LINGER 0)
            conn.close()
            out["tcp_gone_at"] = loop.now

            assert c["frames_in"] == 5 and stack.frame_outcomes() == (5, 5, 0)
            assert {k: v for k, v in c.items() if k.startswith("handled.")} == {
                "handled.tcp_syn": 1, "handled.tcp": 3, "handled.udp": 1}
            assert c["flows.tcp.opened"] == c["flows.udp.opened"] == 1 and not stack.parts.flows
            assert stack.parts.guard.active == {"tcp": 0, "udp": 0, "icmp": 0}
            stack.stop()
            await serving

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        lst.close()
        echo.close()
    # every expiry happened on the fake clock: 102.5 fake seconds went by
    assert out == {"udp_gone_at": START + 35.0, "tcp_gone_at": START + 102.5}


class CountingClockLoop(FakeClockLoop):
    """A fake clock that counts how often it is read."""

    def __init__(self) -> None:
        super().__init__()
        self.readings = 0

    def time(self) -> float:
        self.readings += 1
        return self.now


def test_a_batch_reads_the_clock_once_and_its_now_reaches_the_flush():
    """``now`` goes down through the flush (``FlowTable.flush(now)`` -> ``flow.flush(now)`` ->
    ``_emit(now)``): a batch of guest segments to an established TCP flow reads the loop's clock
    exactly once (``Link.on_frames``), however many flows and segments it touches."""
    cfg = NetworkConfig(ipv6=False, dns_upstreams=[("127.0.0.1", 9)])
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    lst.settimeout(5)
    port = lst.getsockname()[1]
    loop = CountingClockLoop()
    out: dict = {}

    async def main() -> None:
        async with Stack(cfg) as stack:
            tr = FakeTransport()
            serving = asyncio.ensure_future(stack.serve(tr))
            await settle()
            tr.deliver(tcp_frame(F4, 40000, port, SYN, seq=100))
            assert await settle(lambda: tcp_out(tr.out))
            ((iss, _ack, _flags, _),) = tcp_out(tr.out)
            conn, _ = lst.accept()
            conn.settimeout(5)
            tr.deliver(tcp_frame(F4, 40000, port, ACK, seq=101, ack=iss + 1))
            tr.out.clear()
            loop.now = START + 7
            loop.readings = 0
            tr.deliver(tcp_frame(F4, 40000, port, ACK, seq=101, ack=iss + 1, data=b"ab"),
                       tcp_frame(F4, 40000, port, ACK, seq=103, ack=iss + 1, data=b"cd"))
            out["readings"] = loop.readings
            out["data"] = conn.recv(100)
            out["last_active"] = stack.parts.flows[(6, GUEST4, 40000, GW4, port)].last_active
            conn.close()
            stack.stop()
            await serving

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        lst.close()
    assert out == {"readings": 1, "data": b"abcd", "last_active": START + 7}
