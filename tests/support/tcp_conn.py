"""The sans-IO TCP endpoint (aioslirp.tcp.connection) driven by hand, for its tests.

Shape borrowed from smoltcp's socket tests: connections are built directly in the state a
test needs (by driving the real handshake, so no internals are poked), segments are written
from templates overridden field by field, and each step is ``send(c, seg)`` followed by
``assert recv(c) == [Segment(...)]``. Time is a plain float passed in; nothing sleeps.

Sequence numbers sit near the top of the 32-bit space (ISS, IRS below) so that ordinary
tests already cross the wrap; ``L(n)``/``R(n)`` are our/the guest's sequence number ``n``
bytes after the ISN.

:class:`LossyWire`, :class:`App` and :func:`run_transfer` simulate a lossy, reordering wire between
two endpoints (one plays the stack, one the guest) and the byte streams behind them.
"""

from __future__ import annotations

import random

from aioslirp.tcp.connection import TcpConnection
from aioslirp.tcp.seq import SEQ_MASK
from aioslirp.wire.tcp import ACK, FIN, SYN, Segment

ISS = 2**32 - 1000  # ours: L(1000) wraps to 0
IRS = 2**32 - 3000  # the guest's: R(3000) wraps to 0
MSS = 1460
RCV_BUF = 60000  # fits a 16-bit window: our shift is 0 even when the guest offers scaling
SND_BUF = 65536
GWS = 7  # the guest's window-scale shift (Linux default)
GWND = 512  # the guest's window field: 512 << 7 = 65536 bytes
X = b"x" * 100


def L(n: int) -> int:
    return (ISS + n) & SEQ_MASK


def R(n: int) -> int:
    return (IRS + n) & SEQ_MASK


def seg(seq=None, ack=None, flags=ACK, wnd=GWND, payload=b"", **opts) -> Segment:
    """A guest segment; defaults: the next in-order pure ACK right after the handshake."""
    return Segment(R(1) if seq is None else seq, L(1) if ack is None else ack, flags, wnd, payload, **opts)


def syn(**kw) -> Segment:
    fields = dict(seq=R(0), ack=0, flags=SYN, wnd=64240, payload=b"", mss=MSS, wscale=GWS, sack_perm=True)
    fields.update(kw)
    return Segment(**fields)


def copy(s: Segment) -> Segment:
    return Segment(s.seq, s.ack, s.flags, s.wnd, bytes(s.payload), s.mss, s.wscale, s.sack_perm)


def send(c: TcpConnection, s: Segment, t: float = 0.0) -> None:
    c.receive_segment(s, t)


def recv(c: TcpConnection, t: float = 0.0) -> list[Segment]:
    return [copy(s) for s in c.segments_to_send(t)]


def events(c: TcpConnection) -> list[tuple]:
    out = []
    while (e := c.next_event()) is not None:
        out.append(e)
    return out


def new_conn(**kw) -> TcpConnection:
    args = dict(iss=ISS, mss=MSS, rcv_buf=RCV_BUF, snd_buf=SND_BUF, now=0.0)
    args.update(kw)
    return TcpConnection(**args)


def established(*, syn_kw=None, **kw) -> TcpConnection:
    """A passive connection in ESTABLISHED at t=0 (RTT sample 0 -> RTO = rto_min = 0.2 s)."""
    c = new_conn(**kw)
    c.on_syn(syn(**(syn_kw or {})), 0.0)
    c.accept(0.0)
    out = recv(c)
    assert [s.flags for s in out] == [SYN | ACK]
    scaled = (syn_kw or {}).get("wscale", GWS) is not None
    send(c, seg(wnd=GWND if scaled else 65535))
    assert c.state == "ESTABLISHED"
    assert events(c) == [("established",)]
    assert recv(c) == []
    return c


def fin_wait_1(**kw) -> TcpConnection:
    c = established(**kw)
    c.shutdown_write()
    assert recv(c) == [Segment(L(1), R(1), ACK | FIN, RCV_BUF)]
    assert c.state == "FIN-WAIT-1"
    return c


def fin_wait_2(**kw) -> TcpConnection:
    c = fin_wait_1(**kw)
    send(c, seg(ack=L(2)))
    assert c.state == "FIN-WAIT-2"
    assert recv(c) == []
    return c


def close_wait(**kw) -> TcpConnection:
    c = established(**kw)
    send(c, seg(flags=ACK | FIN))
    assert recv(c) == [Segment(L(1), R(2), ACK, RCV_BUF)]
    assert c.state == "CLOSE-WAIT"
    assert events(c) == [("fin",)]
    return c


def active(irs: int = R(0), *, t: float = 0.25, **synack) -> TcpConnection:
    """ESTABLISHED by active open (RFC 9293 3.5): our SYN at t=0, the guest's SYN-ACK at ``t``."""
    c = new_conn(**{k: synack.pop(k) for k in ("rcv_buf",) if k in synack})
    c.connect(0.0)
    recv(c)
    fields = dict(wnd=65535, mss=MSS, wscale=GWS)
    fields.update(synack)
    send(c, Segment(irs, L(1), SYN | ACK, fields["wnd"], mss=fields["mss"], wscale=fields["wscale"]), t)
    assert c.state == "ESTABLISHED"
    assert events(c) == [("established",)]
    return c


class LossyWire:
    """One direction of a lossy virtual wire: latency plus random jitter (which reorders)."""

    def __init__(self, rng: random.Random, loss: float, delay: float, jitter: float = 0.0):
        self.rng, self.loss, self.delay, self.jitter = rng, loss, delay, jitter
        self.queue: list[tuple[float, Segment]] = []
        self.sent = self.lost = 0

    def put(self, now: float, segs: list[Segment]) -> None:
        for s in segs:
            self.sent += 1
            if self.rng.random() < self.loss:
                self.lost += 1
                continue
            self.queue.append((now + self.delay + self.rng.random() * self.jitter, copy(s)))

    def due(self, now: float) -> list[Segment]:
        out = [s for t, s in self.queue if t <= now]
        self.queue = [(t, s) for t, s in self.queue if t > now]
        return out

    def next_time(self):
        return min((t for t, _ in self.queue), default=None)


class App:
    """The byte stream behind one endpoint: writes `data` in random chunks, reads everything."""

    def __init__(self, conn: TcpConnection, data: bytes, rng: random.Random):
        self.conn, self.data, self.rng = conn, data, rng
        self.pos = 0
        self.received = bytearray()
        self.shut = False

    def step(self) -> None:
        c = self.conn
        if c.state in ("ESTABLISHED", "CLOSE-WAIT"):
            while self.pos < len(self.data) and c.send_space > 0:
                n = self.rng.randrange(1, 20000)
                c.send(self.data[self.pos:self.pos + n])
                self.pos += n
            if self.pos >= len(self.data) and not self.shut:
                c.shutdown_write()
                self.shut = True
        view = c.peek()
        if len(view):
            n = len(view) if self.rng.random() < 0.7 else self.rng.randrange(len(view) + 1)
            self.received += view[:n]
            c.consume(n)

    def drain(self) -> None:
        view = self.conn.peek()
        self.received += view
        self.conn.consume(len(view))


def run_transfer(stack: TcpConnection, guest: TcpConnection, to_stack: LossyWire, to_guest: LossyWire, apps,
                 on_step=None) -> float:
    """Drive ``guest``'s active open to ``stack`` (passive) and both apps until both are CLOSED
    (at most 200,000 steps); ``on_step(now, segs)`` sees the stack's segments of each step before
    they enter the link. Returns the simulated time at the end."""
    now = 0.0
    guest.connect(now)
    accepted = False
    for _ in range(200_000):
        for s in to_stack.due(now):
            if stack.state == "LISTEN":
                stack.on_syn(s, now)
            else:
                stack.receive_segment(s, now)
        for s in to_guest.due(now):
            guest.receive_segment(s, now)
        for c in (stack, guest):
            t = c.get_timer()
            if t is not None and t <= now:
                c.handle_timer(now)
        if stack.state == "SYN-RECEIVED" and not accepted:
            stack.accept(now)
            accepted = True
        for app in apps:
            app.step()
        out = stack.segments_to_send(now)
        if on_step is not None:
            on_step(now, out)
        to_guest.put(now, out)
        to_stack.put(now, guest.segments_to_send(now))
        if stack.state == "CLOSED" and guest.state == "CLOSED":
            break
        times = [t for t in (to_stack.next_time(), to_guest.next_time(), stack.get_timer(), guest.get_timer())
                 if t is not None]
        assert times, (stack, guest)
        now = max(now, min(times))
    return now
