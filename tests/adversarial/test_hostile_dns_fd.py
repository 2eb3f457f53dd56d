"""A hostile guest against DNS over TCP (buffering both ways) and against the open-file limit.

* DNS over TCP to 10.0.2.3:53: a guest that pipelines queries to a dead upstream, or that sends
  queries answered at once (FORMERR) while it advertises a zero window, holds at most
  ``tcp_buffer`` plus :data:`~aioslirp.services.dns_tcp.MAX_HELD` bytes per direction; the
  stack's receive window closes, and answers resume, in order, once the guest reads.
* A real low ``RLIMIT_NOFILE`` (in a child process, soft = hard, so the stack cannot raise it):
  a flood of DNS queries to a dead name stays within the stack's fd budget and a SYN after it
  is answered; with the fds really exhausted (EMFILE), a SYN gets a RST, a UDP datagram and an
  ICMP echo are dropped and counted, nothing is left in the flow table, and everything works
  again once fds are free.

The guest's TCP is driven by hand (:class:`GuestTcp`) over the socketpair of
``support.stacks.serving``; no timing is asserted, only bytes (SHA-256), counters and sizes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import struct
import subprocess
import sys

import dpkt

from aioslirp.flow.guard import FD_RESERVE
from aioslirp.services.dns_tcp import MAX_HELD, MAX_QUEUED
from aioslirp.services.dns import DnsTcpSession

from support.frames import ACK, DNS4, F4, GUEST4, GW4, RST, SYN, dns_query, echo_frame, ip_frame, udp_frame
from support.paths import TESTS
from support.stacks import GuestEnd, listener, serving, until

MSS = 1460
TCP_BUFFER = 65536
_M = 0xFFFFFFFF


class GuestTcp:
    """The guest's end of one TCP connection, driven by hand: the handshake, data sent within
    the window the stack advertises (no window scaling offered, so fields are bytes), and ACKs
    with the window :attr:`wnd` the guest chooses. Bytes from the stack are taken in order while
    :attr:`wnd` is open; out-of-order ones are kept, and answered with duplicate ACKs."""

    def __init__(self, guest: GuestEnd, sport: int, dst: bytes = DNS4, dport: int = 53) -> None:
        self.guest, self.sport, self.dst, self.dport = guest, sport, dst, dport
        self.iss = 1000
        self.snd_nxt = self.iss + 1
        self.snd_una = self.iss + 1  # what the stack ACKed
        self.peer_wnd = 0  # the last window the stack advertised
        self.rcv_nxt = 0
        self.wnd = 65535
        self.received = bytearray()
        self._ooo: dict[int, bytes] = {}
        self._queue: list[bytes] = []
        self.rst = False

    def frame(self, flags: int, seq: int, data: bytes = b"") -> bytes:
        t = dpkt.tcp.TCP(sport=self.sport, dport=self.dport, seq=seq & _M, ack=self.rcv_nxt & _M if flags & ACK else 0,
                         flags=flags, win=self.wnd, opts=struct.pack("!BBH", 2, 4, MSS) if flags & SYN else b"",
                         data=data)
        t.off = 5 + len(t.opts) // 4
        return ip_frame(F4, t, 6, dst=self.dst)

    async def flush(self) -> None:
        """Send the frames queued (waiting for room in the socketpair when it is full)."""
        loop = asyncio.get_running_loop()
        q, self._queue = self._queue, []
        for f in q:
            await loop.sock_sendall(self.guest.sock, f)

    async def ack(self) -> None:
        self._queue.append(self.frame(ACK, self.snd_nxt))
        await self.flush()

    def take(self, frames) -> int:
        """Process the stack's segments for this connection (ACKs queued); returns how many
        carried data."""
        n = 0
        for t in GuestEnd.tcp4(frames):
            if t.dport != self.sport:
                continue
            if t.flags & RST:
                self.rst = True
                continue
            if t.flags & ACK and 0 <= (t.ack - self.snd_una) & _M <= (self.snd_nxt - self.snd_una) & _M:
                self.snd_una = t.ack
                self.peer_wnd = t.win
            if t.data:
                n += 1
                if self.wnd:
                    off = (t.seq - self.rcv_nxt) & _M
                    if off == 0:
                        self.received += t.data
                        self.rcv_nxt += len(t.data)
                        while self.rcv_nxt & _M in self._ooo:
                            d = self._ooo.pop(self.rcv_nxt & _M)
                            self.received += d
                            self.rcv_nxt += len(d)
                    elif off < 1 << 31:
                        self._ooo[t.seq] = bytes(t.data)
        if n:  # one ACK per batch (also answering a zero-window probe, RFC 9293 3.8.6.1)
            self._queue += [self.frame(ACK, self.snd_nxt)] * (3 if self._ooo else 1)
        return n

    async def connect(self) -> None:
        self.guest.send(self.frame(SYN, self.iss))
        for t in GuestEnd.tcp4(await self.guest.recv()):
            if t.dport == self.sport and t.flags & (SYN | ACK) == SYN | ACK:
                self.rcv_nxt = t.seq + 1
                self.snd_una, self.peer_wnd = t.ack, t.win
        assert self.rcv_nxt, "no SYN-ACK"
        await self.ack()

    async def exchange(self, data: bytes, base: int, until_received: int = 0, rounds: int = 400) -> None:
        """Send ``data`` (stream offset 0 at sequence ``base``) within the stack's window and take
        what comes back, round by round, until all of ``data`` is ACKed and ``until_received``
        bytes arrived, or until nothing moves: the stack's window is shut (everything sent is
        ACKed, window 0) and nothing arrives."""
        for _ in range(rounds):
            off = (self.snd_nxt - base) & _M
            limit = min(len(data), ((self.snd_una - base) & _M) + self.peer_wnd)
            sent = off < limit
            while off < limit:
                chunk = data[off:min(off + MSS, limit)]
                self._queue.append(self.frame(ACK, base + off, chunk))
                off += len(chunk)
            self.snd_nxt = base + off
            await self.flush()
            got = self.take(await self.guest.recv(0.3))
            await self.flush()
            acked = (self.snd_una - base) & _M
            if acked >= len(data) and len(self.received) >= until_received:
                return
            if not sent and not got and self.snd_una == self.snd_nxt & _M and self.peer_wnd == 0:
                return
            if self.rst:
                return


def dns_flow(stack, sport: int):
    """The stack's flow of the guest's connection from ``sport`` to DNS:53."""
    return stack.parts.flows[(6, GUEST4, sport, DNS4, 53)]


# ---------------------------------------------------------------------------------- 1a
async def test_pipelined_queries_to_a_dead_upstream_close_the_window():
    """Queries pipelined to an upstream that never answers: the stack ACKs at most tcp_buffer
    (its receive queue) plus MAX_HELD bytes (the DNS responder's queue), then advertises a zero
    window; MAX_QUEUED messages wait, one of them at the upstream."""
    import socket

    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))  # never answers
    try:
        async with serving(dns_upstreams=[silent.getsockname()], dns_timeout=60.0, tcp_buffer=TCP_BUFFER) as (
                stack, guest):
            g = GuestTcp(guest, 45000)
            await g.connect()
            one = DnsTcpSession.frame(dns_query(qid=7))
            data = one * ((1 << 20) // len(one))  # 1 MiB of pipelined queries
            base = g.snd_nxt
            await g.exchange(data, base)
            acked = (g.snd_una - base) & _M
            assert acked <= TCP_BUFFER + MAX_HELD, acked
            assert g.peer_wnd == 0 and acked > TCP_BUFFER // 2
            flow = dns_flow(stack, 45000)
            host = flow.transport
            assert host.queued == MAX_QUEUED and host.held <= MAX_HELD
            assert acked == len(flow.conn.peek()) + host.held  # every ACKed byte is held, nowhere else
            assert stack.parts.dns.stats["queries"] == 1  # one at a time, in order: the first one waits
            assert stack.counters["tcp_host_write_paused"] >= 1
    finally:
        silent.close()


# ---------------------------------------------------------------------------------- 1b
def formerr(qid: int) -> bytes:
    """The 2-byte-framed FORMERR answer (QR, RD copied, RA, rcode 1, no sections) to query ``qid``."""
    return DnsTcpSession.frame(struct.pack("!HHHHHH", qid, 0x8181, 0, 0, 0, 0))


async def test_answers_stop_while_the_guest_window_is_shut_then_all_arrive_in_order():
    """Malformed queries (QDCOUNT 0, answered FORMERR at once) while the guest advertises a zero
    window: the send buffer fills to exactly tcp_buffer and no further answer is produced; the
    receive window closes. Once the guest opens its window, every query the stack took gets
    its answer, in order (SHA-256 of the whole stream), and the send buffer never exceeds
    tcp_buffer."""
    async with serving(tcp_buffer=TCP_BUFFER) as (stack, guest):
        g = GuestTcp(guest, 45001)
        await g.connect()
        g.wnd = 0
        await g.ack()
        n = 15000  # 210,000 bytes of queries, about 3 x tcp_buffer
        data = b"".join(DnsTcpSession.frame(struct.pack("!HHHHHH", i, 0x0100, 0, 0, 0, 0)) for i in range(n))
        base = g.snd_nxt
        await g.exchange(data, base)
        flow = dns_flow(stack, 45001)
        conn, host = flow.conn, flow.transport
        assert conn.send_space == 0  # tcp_buffer of answers held towards the guest, not more
        produced = -(-TCP_BUFFER // 14)  # answers produced: the last one only partly in the buffer
        assert stack.parts.dns.stats["malformed"] == produced
        assert 0 < host.unsent < 14 and not host.reading
        acked = (g.snd_una - base) & _M
        assert g.peer_wnd == 0 and acked <= produced * 14 + TCP_BUFFER + MAX_HELD
        assert host.queued == MAX_QUEUED
        await guest.recv(0.3)  # more time with the window shut: still nothing produced
        assert stack.parts.dns.stats["malformed"] == produced and conn.send_space == 0

        g.wnd = 65535
        await g.ack()  # window update
        lowest = 0
        for _ in range(200):
            await g.exchange(data, base, until_received=n * 14, rounds=1)
            lowest = min(lowest, conn.send_space)
            if len(g.received) >= n * 14 and (g.snd_una - base) & _M == len(data):
                break
        want = b"".join(formerr(i) for i in range(n))
        assert len(g.received) == len(want)
        assert hashlib.sha256(g.received).hexdigest() == hashlib.sha256(want).hexdigest()
        assert lowest == 0  # never more than tcp_buffer held towards the guest
        assert stack.parts.dns.stats["malformed"] == n and stack.counters["dns_queries_tcp"] == n
        assert stack.counters.get("drop.internal_error", 0) == 0


# ---------------------------------------------------------------------------------- 5
LIMIT = 400  # soft = hard RLIMIT_NOFILE of the child: FD_RESERVE + 144
PING_TARGET = "198.18.0.1"  # put on the child's own loopback (its own network namespace)


def _child(scenario: str) -> None:
    """Runs in a child process with a real low RLIMIT_NOFILE; prints one JSON line of results."""
    import resource
    import socket

    from aioslirp.host.isolate import isolate_network

    isolate_network()  # a namespace of its own, so that the ping target below is local to it
    ping = subprocess.run(["ip", "addr", "add", PING_TARGET + "/32", "dev", "lo"], capture_output=True).returncode == 0
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    errors: list[str] = []

    class Errors(logging.Handler):
        def emit(self, record):
            errors.append(self.format(record))

    logging.getLogger("aioslirp").addHandler(Errors(logging.ERROR))

    spare = [os.open("/dev/null", os.O_RDONLY)]  # lets nfds() count even when no fd is left

    def nfds() -> int:
        """Open fds (the spare one counted in place of the listing's own)."""
        os.close(spare.pop())
        n = len(os.listdir("/proc/self/fd"))
        spare.append(os.open("/dev/null", os.O_RDONLY))
        return n

    async def syn(guest, sport: int, port: int) -> list[int]:
        """Flags of the stack's answers to a SYN from ``sport`` to the gateway's ``port``."""
        g = GuestTcp(guest, sport, GW4, port)
        guest.send(g.frame(SYN, g.iss))
        return [t.flags for t in GuestEnd.tcp4(await guest.recv()) if t.dport == sport]

    async def flood() -> dict:
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        silent.bind(("127.0.0.1", 0))
        lst = listener()
        out: dict = {}
        async with serving(dns_upstreams=[silent.getsockname()], dns_timeout=20.0, max_flows=64) as (stack, guest):
            base = nfds()
            loop = asyncio.get_running_loop()
            for i in range(400):  # 400 queries to a name the dead upstream never answers
                query = dns_query("dead.test", qid=i)
                await loop.sock_sendall(guest.sock, udp_frame(F4, 30000 + i, 53, query, dst=DNS4))
            await until(lambda: stack.parts.dns.stats["queries"] == 400, 5.0)
            await guest.recv(0.3)
            out["held"] = nfds() - base  # fds held by the flood
            out["flags"] = await syn(guest, 46000, port=lst.getsockname()[1])
            out["flows"] = [f.state for f in stack.parts.flows.values()]
            out["counters"] = dict(stack.counters)
            out["overload"] = stack.parts.dns.stats["overload"]
            out["dns_fd_budget"] = getattr(stack.parts.guard, "dns_fd_budget", None)
            out["soft"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        silent.close()
        lst.close()
        return out

    async def emfile() -> dict:
        from support.servers import UdpEcho

        lst = listener()
        echo_srv = UdpEcho()
        out: dict = {"ping": ping}
        async with serving() as (stack, guest):
            hog = []
            try:
                while True:  # the real thing: every fd the limit allows, taken
                    hog.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as exc:
                out["errno"] = exc.errno
            port = lst.getsockname()[1]
            out["tcp"] = await syn(guest, 46001, port=port)
            guest.send(udp_frame(F4, 46002, echo_srv.port, b"udp-while-emfile"))
            guest.send(echo_frame(F4, 77, dst=socket.inet_aton(PING_TARGET)))
            await guest.recv(0.3)
            out["flows_while"] = len(stack.parts.flows)
            out["active_while"] = dict(stack.parts.guard.active)
            out["counters_while"] = dict(stack.counters)
            for fd in hog:
                os.close(fd)
            hog.clear()
            out["tcp_after"] = await syn(guest, 46001, port=port)  # the same port: nothing held it
            guest.send(udp_frame(F4, 46002, echo_srv.port, b"udp-after"))
            frames = await guest.recv(0.5)
            out["udp_after"] = [bytes(e.data.data.data).decode() for e in frames if e.type == 0x0800 and e.data.p == 17]
            guest.send(echo_frame(F4, 77, dst=socket.inet_aton(PING_TARGET)))
            frames = await guest.recv(1.0)
            out["icmp_after"] = [(socket.inet_ntoa(e.data.src), e.data.data.type) for e in frames
                                 if e.type == 0x0800 and e.data.p == 1]
            out["counters"] = dict(stack.counters)
        lst.close()
        echo_srv.close()
        return out

    result = asyncio.run(flood() if scenario == "flood" else emfile())
    result["errors"] = errors
    print(json.dumps(result))


def run_child(scenario: str) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))  # this module, run again in the child
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, str(TESTS), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", f"import test_hostile_dns_fd as t; t._child({scenario!r})"],
                       cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_dns_flood_stays_within_the_fd_budget_under_a_real_low_nofile_limit():
    """ulimit -n 400 (soft = hard): 400 queries to a dead upstream hold at most the DNS share of
    the fds beyond FD_RESERVE (the rest are dropped, counted as drop.dns_too_many_queries), so the SYN that
    follows gets its SYN-ACK and no internal error is logged."""
    r = run_child("flood")
    assert r["soft"] == LIMIT
    assert r["held"] <= LIMIT - FD_RESERVE, r["held"]  # flows + DNS stay within the budget
    assert r["errors"] == [] and r["counters"].get("drop.internal_error", 0) == 0
    assert r["flags"] == [SYN | ACK]
    assert r["flows"] == ["SYN-RECEIVED"]
    share = r["dns_fd_budget"]
    # the stack itself drops the queries beyond the DNS share (Guard.dns_admit), before the forwarder
    assert 0 < share < 400 and r["held"] >= share
    assert r["counters"].get("drop.dns_too_many_queries", 0) == 400 - share and r["overload"] == 0


def test_emfile_at_flow_creation_refuses_and_leaves_nothing_behind():
    """Every fd the (real, low) limit allows taken: a SYN gets a RST (drop.tcp_socket_error), a
    UDP datagram and an ICMP echo are dropped and counted, no flow is left and no internal
    error logged. With the fds back, the same SYN gets a SYN-ACK, the UDP datagram its echo
    and the echo its reply (the echo mechanism was not written off as unavailable)."""
    r = run_child("emfile")
    assert r["errno"] == 24  # EMFILE
    assert r["errors"] == [] and r["counters"].get("drop.internal_error", 0) == 0
    assert r["tcp"] == [RST | ACK]
    cw = r["counters_while"]
    assert cw["drop.tcp_socket_error"] == 1 and cw["drop.udp_socket_error"] == 1
    assert cw["drop.icmp_socket_error"] == 1
    assert r["flows_while"] == 0 and r["active_while"] == {"tcp": 0, "udp": 0, "icmp": 0}
    assert r["tcp_after"] == [SYN | ACK]
    assert r["udp_after"] == ["udp-after"]
    assert r["ping"]  # the child's own namespace got the ping target
    assert r["icmp_after"] == [[PING_TARGET, 0]]  # an echo reply from it
