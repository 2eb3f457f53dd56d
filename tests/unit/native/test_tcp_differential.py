"""Two paths, one behaviour: the same guest, host and wire, once against the Python TCP path (the sans-IO
:class:`~aioslirp.tcp.connection.TcpConnection` the stack runs for a NAT flow, and the host's byte
stream behind it) and once against the native engine (aioslirp/native/tcpnat.c with a fake socket).

The guest is the sans-IO TCP itself in the guest's role (an active open, like the guest's kernel):
it sends ``up`` bytes and reads, the host sends ``down`` bytes; both close. The wire loses,
delays (reordering) and duplicates segments, from a seed Hypothesis draws. The two paths use
different algorithms (the Python one buffers and reassembles; the native one leaves bytes in
the kernel and drops what is out of order), so they are held equal on what reaches each end:

* the bytes the host received, and the bytes the guest received, are exactly ``up`` and
  ``down`` on both paths, and both connections end (closed; a late duplicate that meets an end
  already closed may be answered with a RST, after every byte was delivered);
* the native engine's segments keep seq/ack continuity: its ACK never goes back, new data
  starts at or below the highest byte sent (no hole), its FIN follows the last data byte, and no
  more is in flight than the guest's window allowed when it was sent.
"""

from __future__ import annotations

import random
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioslirp.tcp.connection import TcpConnection
from aioslirp.wire.tcp import ACK, FIN, RST, SYN, Segment

from support.frames import F4, F6, GUEST_MAC, GW_MAC, tcp_frame
from support.native import need_extension
from support.native_tcp import DPORT, decode
from support.tcp_conn import App, LossyWire, copy

MSS = 1460
GPORT = 40000
SEQ = 0xFFFFFFFF


class DupWire(LossyWire):
    """A :class:`LossyWire` that also duplicates segments (probability ``dup``)."""

    def __init__(self, rng: random.Random, loss: float, delay: float, jitter: float, dup: float) -> None:
        super().__init__(rng, loss, delay, jitter)
        self.dup = dup

    def put(self, now: float, segs) -> None:
        super().put(now, segs)
        for s in segs:
            if self.rng.random() < self.dup:
                self.queue.append((now + self.delay + self.rng.random() * self.jitter, copy(s)))


def guest_conn() -> TcpConnection:
    return TcpConnection(iss=2**32 - 700_000, mss=MSS, rcv_buf=256 * 1024, snd_buf=64 * 1024, now=0.0)


def wires(seed: int, loss: float, jitter: float, dup: float):
    rng = random.Random(seed)
    return rng, DupWire(rng, loss, 0.001, jitter, dup), DupWire(rng, loss, 0.001, jitter, dup)


def run_python(seed, up, down, loss, jitter, dup) -> tuple[bytes, bytes, TcpConnection]:
    """The Python path: the stack's TcpConnection and the host's byte stream behind it."""
    rng, to_stack, to_guest = wires(seed, loss, jitter, dup)
    stack = TcpConnection(iss=2**32 - 500_000, mss=MSS, rcv_buf=1 << 20, snd_buf=1 << 20, now=0.0)
    guest = guest_conn()
    host_app, guest_app = App(stack, down, rng), App(guest, up, rng)
    now = 0.0
    guest.connect(now)
    accepted = False
    for _ in range(400_000):
        for s in to_stack.due(now):
            if stack.state == "LISTEN":
                if s.flags & SYN:
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
        host_app.step()
        guest_app.step()
        to_guest.put(now, stack.segments_to_send(now))
        to_stack.put(now, guest.segments_to_send(now))
        if stack.state == "CLOSED" and guest.state == "CLOSED":
            break
        times = [t for t in (to_stack.next_time(), to_guest.next_time(), stack.get_timer(), guest.get_timer())
                 if t is not None]
        now = max(now, min(times)) if times else now + 0.01
    host_app.drain()
    guest_app.drain()
    assert stack.state == guest.state == "CLOSED"
    return bytes(host_app.received), bytes(guest_app.received), guest


def to_frame(fam, s: Segment) -> bytes:
    opts = b""
    if s.flags & SYN:
        if s.mss is not None:
            opts += bytes([2, 4, s.mss >> 8, s.mss & 0xFF])
        if s.wscale is not None:
            opts += bytes([1, 3, 3, s.wscale])
    return tcp_frame(fam, GPORT, DPORT, s.flags, seq=s.seq, ack=s.ack, data=bytes(s.payload), win=s.wnd, opts=opts)


def to_segment(seg) -> Segment:
    mss = wscale = None
    o = seg.opts
    i = 0
    while i < len(o):
        if o[i] == 0:
            break
        if o[i] == 1:
            i += 1
            continue
        if o[i] == 2:
            mss = (o[i + 2] << 8) | o[i + 3]
        elif o[i] == 3:
            wscale = o[i + 2]
        i += o[i + 1]
    return Segment(seg.seq, seg.ack, seg.flags, seg.wnd, seg.payload, mss, wscale, False)


class Continuity:
    """The invariants of the native engine's segments (see the module documentation)."""

    def __init__(self) -> None:
        self.ack: int | None = None
        self.snd_max: int | None = None
        self.fin: int | None = None

    def check(self, s: Segment, guest_una: int, guest_wnd_edge: int) -> None:
        if s.flags & RST:
            raise AssertionError(f"a RST to the guest: {s}")
        if self.ack is not None and s.flags & ACK:
            assert (s.ack - self.ack) & SEQ < 2**31, ("the ACK went back", self.ack, s)
        if s.flags & ACK:
            self.ack = s.ack
        if s.flags & SYN:
            self.snd_max = (s.seq + 1) & SEQ
            return
        end = (s.seq + len(s.payload)) & SEQ
        if s.payload:
            assert self.snd_max is not None and (self.snd_max - s.seq) & SEQ < 2**31, ("a hole", self.snd_max, s)
            assert (guest_wnd_edge - end) & SEQ < 2**31, ("past the guest's window", guest_wnd_edge, s)
            if (end - self.snd_max) & SEQ < 2**31:
                self.snd_max = end
        if s.flags & FIN:
            if self.fin is not None:
                assert end == self.fin, ("the FIN moved", self.fin, s)
            else:
                assert end == self.snd_max, ("a FIN before the last byte", self.snd_max, s)
                self.fin = end
                self.snd_max = (end + 1) & SEQ


def run_native(seed, up, down, loss, jitter, dup, v6: bool, piece: int = 0) -> tuple[bytes, bytes, TcpConnection, dict]:
    """The native path: the engine with a fake host socket that sends ``down`` and reads all.
    ``piece``: the guest's frames go in as the vhost-user walker hands them in place
    (``input_pieces``: parsed from a copy of the head, the payload sent from pieces of that many
    bytes; a frame of more pieces than the engine takes goes through ``input`` as before)."""
    ext = need_extension()
    fam = F6 if v6 else F4
    rng, to_stack, to_guest = wires(seed, loss, jitter, dup)
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 8, 1 << 20, 0.0, 10.0, 60.0, fake=True)
    guest = guest_conn()
    guest_app = App(guest, up, rng)
    host_got = bytearray()
    fd = None
    host_left = down
    eof_sent = False
    ended = None
    cont = Continuity()
    now = 0.0
    in_place = 0
    guest.connect(now)
    for step in range(400_000):
        for s in to_stack.due(now):
            if fd is None:
                if s.flags & SYN and not s.flags & ACK:
                    host = socket.inet_pton(fam.af, fam.loopback)
                    st, slot, gen = eng.adopt(v6, GUEST_MAC, fam.guest, GPORT, fam.gw, DPORT, host, DPORT, s.seq,
                                              2**32 - 500_000, -1 if s.mss is None else s.mss,
                                              -1 if s.wscale is None else s.wscale, s.wnd, now)
                    assert st == 0
                    fd = eng.fake_fds()[-1]
                continue
            frame = to_frame(fam, s)
            took = eng.input_pieces(frame, piece, now) if piece else -1
            in_place += took == 1
            if took < 0:
                eng.input(frame, False, now)
        for s in to_guest.due(now):
            guest.receive_segment(s, now)
        t = guest.get_timer()
        if t is not None and t <= now:
            guest.handle_timer(now)
        for rec in eng.poll(now):
            if rec[2] == 2:
                ended = rec
        if fd is not None:
            if host_left and rng.random() < 0.5:
                n = rng.randrange(1, 40000)
                eng.fake_host_send(fd, host_left[:n], now)
                host_left = host_left[n:]
            elif not host_left and not eof_sent:
                eng.fake_host_eof(fd, now)
                eof_sent = True
            host_got += eng.fake_received(fd)
        guest_app.step()
        edge = (guest.rcv_nxt + guest.rcv_wnd) & SEQ if hasattr(guest, "rcv_wnd") else None
        out = [to_segment(decode(f, v6)) for f in eng.fake_frames()]
        for s in out:
            cont.check(s, 0, edge if edge is not None else (s.seq + len(s.payload)) & SEQ)
        to_guest.put(now, out)
        to_stack.put(now, guest.segments_to_send(now))
        if ended is not None and guest.state == "CLOSED":
            break
        times = [t for t in (to_stack.next_time(), to_guest.next_time(), guest.get_timer()) if t is not None]
        now = max(now, min(times + [now + 0.05]))
    guest_app.drain()
    assert ended is not None and ended[3] in (1, 2), ("not over", ended, guest.state)  # closed (or reset, below)
    assert guest.state == "CLOSED"
    return bytes(host_got), bytes(guest_app.received), guest, dict(eng.counters(), in_place=in_place)


CASES = st.tuples(st.integers(0, 2**32), st.integers(0, 300_000), st.integers(0, 300_000),
                  st.sampled_from([0.0, 0.02, 0.1]), st.sampled_from([0.0, 0.003]), st.sampled_from([0.0, 0.05]),
                  st.booleans(), st.sampled_from([0, 0, 7, 60, 700]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_python_and_native_paths_deliver_the_same_bytes(case):
    seed, nup, ndown, loss, jitter, dup, v6, piece = case
    rng = random.Random(seed)
    up, down = rng.randbytes(nup), rng.randbytes(ndown)
    host_py, guest_py, _ = run_python(seed, up, down, loss, jitter, dup)
    host_nat, guest_nat, _, counters = run_native(seed, up, down, loss, jitter, dup, v6, piece)
    assert host_py == host_nat == up
    assert guest_py == guest_nat == down


@pytest.mark.parametrize("piece", [0, 33])
def test_heavy_loss_reordering_and_duplication_native_counts_its_recovery(piece):
    rng = random.Random(5)
    up, down = rng.randbytes(400_000), rng.randbytes(400_000)
    host, guest, conn, c = run_native(5, up, down, 0.1, 0.003, 0.05, False, piece)
    assert not conn.reset
    assert host == up and guest == down
    assert c["out_of_window"] > 0 and c["rto"] + c["fast_retransmits"] > 0 and c["dup_acks"] > 0
    assert (c["in_place"] > 100) == (piece > 0)  # (the frames of more than 64 pieces went through input())
