"""Hostile-guest cases of the TCP NAT flow (issue 13): buffering, port reuse, the closing linger.

* A flow that moves to an asyncio transport while host reading is paused keeps its send
  buffer bounded by ``tcp_buffer`` (plus at most one host read), on uvloop and on asyncio.
* A new guest SYN on the 4-tuple of a finished flow whose acknowledged guest bytes the host
  has not read yet: the old flow leaves the 4-tuple, still drains every byte to the host and
  closes it with a FIN (not a RST); the new connection works. IPv4 and IPv6.
* The LAST-ACK / CLOSING linger measures time without progress (sans-IO with a fake clock,
  then through a whole Stack): a slow reader gets the whole answer, a silent one is reset.

Stack tests run a real Stack in this process over a socketpair (the guest end is driven frame
by frame here) and real host sockets on 127.0.0.1 / ::1.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import struct

import pytest
import uvloop

from aioslirp.nat.hostsock import READ_SIZE, TransportHost
from aioslirp.wire.tcp import ACK, FIN, PSH, RST, SYN, build_tcp

from support.frames import GUEST4, GUEST6, GUEST_MAC, GW4, GW6, GW_MAC
from support.stacks import fd_count, listener, serving, until
from support.tcp_conn import L, R, close_wait, established, events, recv, seg, send

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

# ============================================================================ linger, sans-IO

ANSWER = bytes(range(256)) * 160  # 40,960 bytes
SMALL_WND = 16  # window field with the guest's shift 7: 2,048 bytes


def _closing_with_answer(state: str, linger: float):
    """A connection in LAST-ACK or CLOSING at t=0 with ANSWER queued behind our FIN and the guest's
    window at 2 KiB: it takes ~20 round trips to deliver."""
    if state == "LAST-ACK":
        c = close_wait(linger=linger)
        send(c, seg(seq=R(2), wnd=SMALL_WND))
        c.send(ANSWER)
        c.shutdown_write()
    else:
        c = established(linger=linger)
        send(c, seg(wnd=SMALL_WND))
        c.send(ANSWER)
        c.shutdown_write()
        assert c.state == "FIN-WAIT-1"
        send(c, seg(flags=ACK | FIN, wnd=SMALL_WND))  # the guest's FIN crosses our data
    assert c.state == state
    events(c)
    return c


def _guest_reads(c, t: float, got: dict) -> None:
    """At time ``t``: fire due timers, take what we send, ACK it all (window still 2 KiB).
    ``got`` maps stream offset -> payload."""
    c.handle_timer(t)
    acked = None
    for s in recv(c, t):
        off = (s.seq - L(1)) & 0xFFFFFFFF
        if s.payload:
            got[off] = s.payload
        end = off + len(s.payload) + (1 if s.flags & FIN else 0)
        acked = end if acked is None or end > acked else acked
    if acked is not None:
        send(c, seg(seq=R(2), ack=L(1 + acked), wnd=SMALL_WND), t)


@pytest.mark.parametrize("state", ["LAST-ACK", "CLOSING"])
def test_linger_moves_forward_on_every_ack_of_new_data(state):
    """Each 2 KiB of the answer is ACKed 4 s after the previous one (linger 5 s): the whole
    answer arrives over ~80 s and the connection closes gracefully, without an RST."""
    c = _closing_with_answer(state, linger=5.0)
    got: dict = {}
    t = 0.0
    while c.state != "CLOSED" and t < 400.0:
        _guest_reads(c, t, got)
        t += 4.0
    assert c.state == "CLOSED" and not c.reset
    assert t > 10 * 5.0  # took many lingers
    data = b"".join(bytes(got[k]) for k in sorted(got))
    assert hashlib.sha256(data).digest() == hashlib.sha256(ANSWER).digest()
    assert ("reset",) not in events(c)


@pytest.mark.parametrize("state", ["LAST-ACK", "CLOSING"])
def test_linger_still_resets_a_guest_that_goes_silent(state):
    """Progress for a while, then no ACK at all: RST exactly one linger after the last ACK of new data."""
    c = _closing_with_answer(state, linger=5.0)
    got: dict = {}
    for t in (0.0, 4.0, 8.0):
        _guest_reads(c, t, got)
    last_progress = 8.0
    assert 0 < sum(len(v) for v in got.values()) < len(ANSWER)
    # silence: only our timers run (retransmissions, then the linger)
    t = last_progress
    while c.state != "CLOSED":
        t = c.get_timer()
        assert t is not None and t <= last_progress + 5.0
        c.handle_timer(t)
        out = recv(c, t)
    assert t == pytest.approx(last_progress + 5.0)
    assert c.reset
    assert out[-1].flags & RST
    assert events(c)[-2:] == [("reset",), ("closed",)]


# ============================================================================ a guest, frame by frame
M32 = 0xFFFFFFFF


def _after(a: int, b: int) -> bool:
    """Sequence number ``a`` lies after ``b`` (mod 2**32)."""
    return 0 < ((a - b) & M32) < 0x80000000


class GuestConn:
    """The guest end of one TCP connection, written frame by frame on the stack's socketpair.

    No window scaling (windows are plain 16-bit fields), MSS 1460. The guest application holds
    at most ``rcvbuf`` bytes unread: the window advertised is what is left of it, and
    :meth:`read` empties it (with a window update). Every in-order byte from the stack lands in
    ``received``; each segment is ACKed at once, as a kernel does. ``rsts`` counts RSTs seen.
    Frames for other connections are dropped, so one GuestConn pumps the socket at a time.
    """

    def __init__(self, sock, sport: int, dport: int, *, v6: bool = False, isn: int = 1000,
                 rcvbuf: int = 65535) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.sport, self.dport, self.v6 = sport, dport, v6
        self.src, self.dst = (GUEST6, GW6) if v6 else (GUEST4, GW4)
        self.eth = GW_MAC + GUEST_MAC + (b"\x86\xdd" if v6 else b"\x08\x00")
        self.build = build_tcp  # the family follows from the addresses
        self.snd_nxt = isn
        self.rcv_nxt: int | None = None
        self.peer_ack = isn
        self.peer_wnd = 0
        self.rcvbuf = rcvbuf
        self.unread = 0
        self.received = bytearray()
        self.fin_received = False
        self.rsts = 0

    def window(self) -> int:
        return max(0, min(0xFFFF, self.rcvbuf - self.unread))

    def send(self, flags: int, payload: bytes = b"", opts: bytes = b"") -> None:
        ack = 0
        if self.rcv_nxt is not None:
            flags |= ACK
            ack = self.rcv_nxt
        frame = self.build(self.eth, self.src, self.dst, self.sport, self.dport, self.snd_nxt, ack, flags,
                           self.window(), opts, payload)
        self.sock.send(bytes(frame))
        self.snd_nxt = (self.snd_nxt + len(payload) + (1 if flags & (SYN | FIN) else 0)) & M32

    def connect(self) -> None:
        self.send(SYN, opts=b"\x02\x04\x05\xb4")

    def pump(self) -> None:
        """Take every frame the stack sent so far; ACK new in-order data or a FIN at once."""
        ack_due = False
        while True:
            try:
                f = self.sock.recv(70000)
            except (BlockingIOError, InterruptedError):
                break
            if not f:
                break
            if self.v6:
                if f[12:14] != b"\x86\xdd" or f[20] != 6:
                    continue
                l4 = f[54:54 + struct.unpack_from("!H", f, 18)[0]]
            else:
                if f[12:14] != b"\x08\x00" or f[23] != 6:
                    continue
                l4 = f[14 + (f[14] & 15) * 4:14 + struct.unpack_from("!H", f, 16)[0]]
            sport, dport, seq, ack, offf, wnd = struct.unpack_from("!HHIIHH", l4)
            if (sport, dport) != (self.dport, self.sport):
                continue
            flags = offf & 0x3F
            payload = l4[(offf >> 12) * 4:]
            if flags & RST:
                self.rsts += 1
                continue
            if flags & SYN:
                if self.rcv_nxt is None and flags & ACK:
                    self.rcv_nxt = (seq + 1) & M32
                    self.peer_ack, self.peer_wnd = ack, wnd
                    ack_due = True
                continue
            if flags & ACK and not _after(self.peer_ack, ack):
                self.peer_ack, self.peer_wnd = ack, wnd
            if self.rcv_nxt is None:
                continue
            if payload or flags & FIN:
                ack_due = True
            if seq != self.rcv_nxt:
                continue  # old (a retransmission) or out of order: the ACK says what we have
            n = min(len(payload), self.window())
            if n:
                self.received += payload[:n]
                self.unread += n
                self.rcv_nxt = (self.rcv_nxt + n) & M32
            if flags & FIN and n == len(payload) and not self.fin_received:
                self.fin_received = True
                self.rcv_nxt = (self.rcv_nxt + 1) & M32
        if ack_due:
            self.send(ACK)

    async def until(self, cond, timeout: float = 20.0, step=None) -> bool:
        """Pump (and call ``step()``, when given) until ``cond()``; False after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.pump()
            if step is not None:
                step()
            if cond():
                return True
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.001)

    async def establish(self) -> None:
        self.connect()
        assert await self.until(lambda: self.rcv_nxt is not None, 5.0), "no SYN-ACK"

    def room(self) -> int:
        """Bytes the stack's last window lets us send now."""
        return self.peer_wnd - ((self.snd_nxt - self.peer_ack) & M32)

    def push(self, data: bytes, pos: int, upto: int | None = None) -> int:
        """Send ``data[pos:upto]`` as far as the window allows (1400-byte segments); the new ``pos``."""
        end = len(data) if upto is None else upto
        while pos < end:
            n = min(1400, self.room(), end - pos)
            if n <= 0:
                break
            self.send(ACK | PSH, data[pos:pos + n])
            pos += n
        return pos

    def all_acked(self) -> bool:
        return self.peer_ack == self.snd_nxt

    def read(self) -> None:
        """The guest application reads everything it holds: a window update goes out."""
        if self.unread:
            self.unread = 0
            self.send(ACK)


LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


# ============================================================================ paused reading survives the move
async def _bidirectional_bulk_with_a_slow_guest_reader() -> None:
    tcp_buffer = 128 * 1024
    bound = tcp_buffer + READ_SIZE  # what may be buffered: tcp_buffer, plus at most one host read
    down = random.Random(2).randbytes(3 << 20)
    up = random.Random(3).randbytes(2 << 20)
    loop = asyncio.get_running_loop()
    lst = listener()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # the host reads into small buffers
    lst.setblocking(False)
    try:
        async with serving(tcp_buffer=tcp_buffer) as (stack, guest):
            port = lst.getsockname()[1]
            g = GuestConn(guest.sock, 40200, port)
            g.connect()
            host, _ = await asyncio.wait_for(loop.sock_accept(lst), 5)
            host.setblocking(False)
            try:
                assert await g.until(lambda: g.rcv_nxt is not None, 5)
                flow = stack.parts.flows[(6, GUEST4, 40200, GW4, port)]
                # the flow's host socket takes little, so a guest bulk upload soon meets a partial send()
                flow.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
                high = [0]

                def sample() -> None:
                    high[0] = max(high[0], tcp_buffer - flow.conn.send_space)

                # 1. The host sends in bulk; the guest reads nothing (its window closes after 64 KiB):
                #    tcp_buffer fills and reading from the host pauses.
                async def host_send() -> None:
                    await loop.sock_sendall(host, down)
                    host.shutdown(socket.SHUT_WR)

                sender = asyncio.ensure_future(host_send())
                assert await g.until(lambda: stack.counters["tcp_host_read_paused"] >= 1 and flow.conn.send_space <= 0 and g.window() < 1460,
                                     step=sample), (stack.counters, flow.conn.send_space, g.window(), len(g.received))
                assert stack.counters["tcp_bulk_transport"] == 0 and g.window() < 1460
                # 2. The guest uploads in bulk, the host does not read: a partial send() moves the flow to
                #    an asyncio transport while reading is paused.
                pos = [0]

                def upload() -> None:
                    sample()
                    pos[0] = g.push(up, pos[0])

                assert await g.until(lambda: stack.counters["tcp_bulk_transport"] == 1, step=upload)
                assert await g.until(lambda: isinstance(flow.transport, TransportHost), step=upload)
                assert flow.reading_paused
                # 3. Still no guest read for a while: the buffered bytes stay bounded (before the fix,
                #    uvloop read on and buffered everything the host sent).
                for _ in range(300):
                    upload()
                    assert tcp_buffer - flow.conn.send_space <= bound
                    await asyncio.sleep(0.001)
                    g.pump()
                # 4. The guest reads everything, the host reads everything: no byte lost either way.
                got_up = bytearray()

                async def host_recv() -> None:
                    while True:
                        d = await loop.sock_recv(host, 1 << 20)
                        if not d:
                            return
                        got_up.extend(d)

                receiver = asyncio.ensure_future(host_recv())
                fin_sent = [False]

                def read_and_upload() -> None:
                    upload()
                    g.read()
                    if pos[0] == len(up) and not fin_sent[0]:
                        fin_sent[0] = True
                        g.send(ACK | FIN)

                assert await g.until(lambda: g.fin_received and fin_sent[0] and g.all_acked(), 60, step=read_and_upload)
                await asyncio.wait_for(asyncio.gather(sender, receiver), 10)
                assert high[0] <= bound, high[0]
                assert hashlib.sha256(g.received).digest() == hashlib.sha256(down).digest()
                assert hashlib.sha256(got_up).digest() == hashlib.sha256(up).digest()
                assert g.rsts == 0
            finally:
                host.close()
    finally:
        lst.close()


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_flow_moved_to_a_transport_while_reading_is_paused_stays_bounded(loop_kind):
    """Bidirectional bulk, the guest reading nothing (zero window) while a partial send() moves
    the flow to an asyncio transport: the bytes held for the guest never exceed tcp_buffer plus
    one host read, on uvloop (the loop the CLI uses) and on asyncio; then every byte arrives."""
    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
        runner.run(_bidirectional_bulk_with_a_slow_guest_reader())


# ============================================================================ linger, through a Stack
async def test_half_closed_guest_reading_a_long_answer_slowly_gets_all_of_it():
    """The guest sends its request and FIN, then reads the 200 KB answer 20 KB at a time, one read
    every 0.2 s (~2 s in all) with tcp_linger 1 s: LAST-ACK lasts longer than the linger, yet the
    guest gets the whole answer and a FIN, no RST (before the fix: a RST after ~1 s)."""
    answer = random.Random(4).randbytes(200_000)
    loop = asyncio.get_running_loop()
    lst = listener()
    lst.setblocking(False)
    try:
        async with serving(tcp_linger=1.0) as (stack, guest):
            port = lst.getsockname()[1]
            g = GuestConn(guest.sock, 40300, port, rcvbuf=20_000)
            g.connect()
            host, _ = await asyncio.wait_for(loop.sock_accept(lst), 5)
            host.setblocking(False)
            try:
                assert await g.until(lambda: g.rcv_nxt is not None, 5)
                g.send(ACK | PSH, b"GET /big\n")
                g.send(ACK | FIN)  # half-close: the guest only reads from now on
                request = b""
                while True:
                    d = await asyncio.wait_for(loop.sock_recv(host, 100), 5)
                    if not d:
                        break
                    request += d
                assert request == b"GET /big\n"
                await loop.sock_sendall(host, answer)
                host.close()  # the host's EOF: LAST-ACK behind 200 KB the guest has yet to read
                flow = stack.parts.flows[(6, GUEST4, 40300, GW4, port)]
                assert await g.until(lambda: flow.state == "LAST-ACK", 5)
                reads = 0
                while not g.fin_received and g.rsts == 0 and reads < 100:
                    await asyncio.sleep(0.2)
                    g.pump()
                    g.read()
                    reads += 1
                    g.pump()
                assert g.rsts == 0 and g.fin_received, (reads, len(g.received))
                assert reads * 0.2 > 1.0  # the answer took longer than one linger
                assert hashlib.sha256(g.received).digest() == hashlib.sha256(answer).digest()
                assert await until(lambda: not stack.parts.flows)  # our FIN ACKed: the flow is over
                assert stack.counters["tcp_resets"] == 0
            finally:
                host.close()
    finally:
        lst.close()


# ============================================================================ port reuse after a finished flow
def _listener(v6: bool) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # the host reads into small buffers
    s.bind(("::1" if v6 else "127.0.0.1", 0))
    s.listen(4)
    s.setblocking(False)
    return s


async def _upload_then_reuse_the_port(stack, guest, lst, v6: bool, hosts: list):
    """The host half-closes at once; the guest uploads until the window stays shut (the host
    reads nothing), sends its FIN (the flow is in TIME-WAIT: the guest closed second) and
    reuses its port for a new SYN at once. Returns (guest's upload ACKed, old flow, new GuestConn);
    the host sockets (old, new) are appended to ``hosts``."""
    loop = asyncio.get_running_loop()
    port = lst.getsockname()[1]
    sport = 40400
    key = (6, GUEST6 if v6 else GUEST4, sport, GW6 if v6 else GW4, port)
    g = GuestConn(guest.sock, sport, port, v6=v6)
    g.connect()
    host, _ = await asyncio.wait_for(loop.sock_accept(lst), 5)
    hosts.append(host)
    host.setblocking(False)
    assert await g.until(lambda: g.rcv_nxt is not None, 5)
    old = stack.parts.flows[key]
    host.shutdown(socket.SHUT_WR)
    assert await g.until(lambda: g.fin_received and old.state == "FIN-WAIT-2", 5)
    up = random.Random(5).randbytes(32 << 20)  # more than the host's and our buffers hold
    pos = [0]

    def upload() -> None:
        pos[0] = g.push(up, pos[0])

    assert await g.until(lambda: pos[0] > 1 << 20 and g.all_acked() and g.peer_wnd == 0, 120, step=upload)
    acked = up[:pos[0]]
    g.send(ACK | FIN)
    assert await g.until(g.all_acked, 5)
    assert old.state == "TIME-WAIT"
    assert len(old.conn.peek()) > 0  # ACKed to the guest, not yet taken by the host socket
    # a new connection from the same port, at once
    g2 = GuestConn(guest.sock, sport, port, v6=v6, isn=(g.snd_nxt + 1_000_000) & M32)
    g2.connect()
    host2, _ = await asyncio.wait_for(loop.sock_accept(lst), 5)
    hosts.append(host2)
    host2.setblocking(False)
    assert await g2.until(lambda: g2.rcv_nxt is not None, 5)
    assert stack.parts.flows[key] is not old
    return acked, old, g2


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
async def test_new_syn_on_a_finished_flow_still_delivers_every_acked_byte(v6):
    """Port reuse while the host has not read what the guest saw ACKed: the host still reads
    every byte (SHA-256) and then EOF, not a RST; the new connection works; the old flow ends
    on its own and stops counting in the limits."""
    loop = asyncio.get_running_loop()
    lst = _listener(v6)
    hosts: list = []
    try:
        async with serving(ipv6=v6, tcp_buffer=256 * 1024) as (stack, guest):
            acked, old, g2 = await _upload_then_reuse_the_port(stack, guest, lst, v6, hosts)
            host, host2 = hosts
            still = (not old.task.done(), len(stack.parts.flows), stack.parts.guard.active["tcp"])
            got = bytearray()
            while True:  # a RST would raise ConnectionResetError here
                d = await asyncio.wait_for(loop.sock_recv(host, 1 << 20), 10)
                if not d:
                    break
                got += d
            assert len(got) == len(acked)
            assert hashlib.sha256(got).digest() == hashlib.sha256(acked).digest()
            assert still == (True, 2, 2)  # the old flow drained on its own, counted in the limits
            assert old.retired
            g2.send(ACK | PSH, b"ping")
            assert await asyncio.wait_for(loop.sock_recv(host2, 100), 5) == b"ping"
            await loop.sock_sendall(host2, b"pong")
            assert await g2.until(lambda: bytes(g2.received) == b"pong", 5)
            assert await until(lambda: old.task.done() and len(stack.parts.flows) == 1, 5)
            assert stack.parts.guard.active["tcp"] == 1
            assert stack.counters["tcp_retired_draining"] == 1 and stack.counters["flows.tcp.closed"] == 1
            assert g2.rsts == 0  # the old flow sent nothing on the reused 4-tuple
    finally:
        for h in hosts:
            h.close()
        lst.close()


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
async def test_flow_draining_after_port_reuse_ends_with_the_stack(v6):
    """The host never reads: the old flow drains for ever, counted in the limits, until the
    Stack exits; then no task, flow or socket of it is left."""
    fds0 = fd_count()
    lst = _listener(v6)
    hosts: list = []
    try:
        async with serving(ipv6=v6, tcp_buffer=256 * 1024) as (stack, guest):
            _acked, old, g2 = await _upload_then_reuse_the_port(stack, guest, lst, v6, hosts)
            for _ in range(50):
                await asyncio.sleep(0.01)
                g2.pump()
            assert not old.task.done() and old.retired
            assert len(stack.parts.flows) == 2 and stack.parts.guard.active["tcp"] == 2  # the old flow still counts
        assert old.task.done()
        assert all(t.done() for t in stack.parts.tasks) and not stack.parts.flows
    finally:
        for h in hosts:
            h.close()
        lst.close()
    assert fd_count() == fds0


async def test_guest_fin_and_new_syn_in_one_batch_close_the_host_with_a_fin():
    """The host's kernel took the whole upload (nothing left in the connection) but the host has
    read none of it, and the guest's FIN and its new SYN arrive in one batch: the host socket
    is closed with a FIN, so the host still reads every byte and then EOF."""
    loop = asyncio.get_running_loop()
    lst = _listener(False)
    hosts: list = []
    try:
        async with serving() as (stack, guest):
            port = lst.getsockname()[1]
            g = GuestConn(guest.sock, 40500, port)
            g.connect()
            host, _ = await asyncio.wait_for(loop.sock_accept(lst), 5)
            hosts.append(host)
            host.setblocking(False)
            assert await g.until(lambda: g.rcv_nxt is not None, 5)
            old = stack.parts.flows[(6, GUEST4, 40500, GW4, port)]
            host.shutdown(socket.SHUT_WR)
            assert await g.until(lambda: g.fin_received and old.state == "FIN-WAIT-2", 5)
            up = random.Random(6).randbytes(60_000)
            pos = [0]

            def upload() -> None:
                pos[0] = g.push(up, pos[0])

            assert await g.until(lambda: pos[0] == len(up) and g.all_acked(), 5, step=upload)
            assert len(old.conn.peek()) == 0  # all of it is in the host socket's kernel buffer
            g.send(ACK | FIN)  # no loop iteration in between: the stack reads both in one batch
            g2 = GuestConn(guest.sock, 40500, port, isn=(g.snd_nxt + 1_000_000) & M32)
            g2.connect()
            got = bytearray()
            while True:  # a RST would raise ConnectionResetError here
                d = await asyncio.wait_for(loop.sock_recv(host, 1 << 20), 10)
                if not d:
                    break
                got += d
            assert hashlib.sha256(got).digest() == hashlib.sha256(up).digest()
            host2, _ = await asyncio.wait_for(loop.sock_accept(lst), 5)
            hosts.append(host2)
            assert await g2.until(lambda: g2.rcv_nxt is not None, 5)
            assert stack.counters["tcp_retired_draining"] == 0  # nothing was left to drain
    finally:
        for h in hosts:
            h.close()
        lst.close()
