"""Sans-IO TCP endpoint that faces the guest.

Theory of operation
===================

aioslirp terminates every guest TCP connection itself and relays its byte stream to an
ordinary host socket. Towards the guest, one :class:`TcpConnection` plays the *remote
host*: it speaks RFC 9293 TCP with the guest's kernel, while the asyncio glue (the flow
coroutine) owns the host socket. The object never awaits, never reads a clock and never
touches a socket. Time comes in as ``now`` (seconds, any monotonic origin) on every call
that needs it. Everything it wants to say comes out of :meth:`TcpConnection.segments_to_send`;
everything the glue must act on comes out of :meth:`TcpConnection.next_event` and a few
status attributes.

The class is written in four parts: its variables and the steps every part shares
(:mod:`aioslirp.tcp.tcb`, with the state names, events and constants), segment arrival
(:mod:`aioslirp.tcp.arrival`, RFC 9293 3.10.7), output and timers (:mod:`aioslirp.tcp.output`),
and here the user calls; the send and receive buffers are :mod:`aioslirp.tcp.buffers`.

Inputs and outputs
------------------
Inputs: guest segments (:meth:`~TcpConnection.on_syn`, :meth:`~TcpConnection.receive_segment`),
host-side calls (:meth:`~TcpConnection.accept`, :meth:`~TcpConnection.refuse`,
:meth:`~TcpConnection.connect`, :meth:`~TcpConnection.send`,
:meth:`~TcpConnection.shutdown_write`, :meth:`~TcpConnection.consume`,
:meth:`~TcpConnection.abort`) and time (:meth:`~TcpConnection.handle_timer`).
After any of these the glue calls ``segments_to_send(now)`` once and transmits what it
returns, then re-arms its single timer from :meth:`~TcpConnection.get_timer`. The segments
are :class:`~aioslirp.wire.tcp.Segment` objects (parsed header fields, options and payload);
turning them into IP packets and back is the wire layer's job (:mod:`aioslirp.wire.tcp`).

States
------
The RFC 9293 state names are used verbatim (``"ESTABLISHED"``, ``"FIN-WAIT-1"``, ...), as the
module constants :data:`ESTABLISHED`, :data:`FIN_WAIT_1`, ... (from :mod:`aioslirp.tcp.tcb`).
A new connection starts in ``LISTEN``. Passive open (the guest connects out):
``on_syn`` records the guest's SYN and moves to ``SYN-RECEIVED`` *silently*: the SYN-ACK is
only sent by :meth:`~TcpConnection.accept`, once the glue's host ``connect()`` succeeded, so
the guest sees the real outcome (or an RST from :meth:`~TcpConnection.refuse`). Active open
(a host port forward into the guest): :meth:`~TcpConnection.connect` sends a SYN from
``LISTEN`` and moves to ``SYN-SENT``. Closing follows RFC 9293 3.6: the host's EOF
(:meth:`~TcpConnection.shutdown_write`) queues our FIN behind the data; the guest's FIN sets
:attr:`~TcpConnection.fin_received`. FIN-WAIT-2, CLOSING and LAST-ACK are bounded by
``linger`` seconds and then end with an RST: in FIN-WAIT-2 seconds of guest silence, in CLOSING
and LAST-ACK seconds without progress (the bound starts on entering CLOSING, or when the first
segment goes out in LAST-ACK, and moves forward on every ACK of new data, so a guest that
half-closed and reads a long answer slowly gets all of it; a zero window that never reopens
is no progress); TIME-WAIT lasts
``time_wait`` seconds after the guest's last segment (an RST in TIME-WAIT just ends it).
Once CLOSED, the object answers further guest segments with RSTs (RFC 9293 3.10.7.1).

Sequence space
--------------
All sequence numbers are 32-bit and compared modulo 2**32 (:mod:`aioslirp.tcp.seq`).
Variables carry the RFC names in lower case: ``snd_una``, ``snd_nxt``, ``snd_wnd``,
``rcv_nxt``, ``rcv_wnd``. As in BSD, ``snd_nxt`` is the send *pointer*: after a
retransmission timeout it goes back to ``snd_una`` ("go-back-N"), and ``snd_max``
remembers the highest sequence number ever sent, which bounds acceptable ACKs.

Sending (host -> guest)
-----------------------
:meth:`~TcpConnection.send` always accepts and appends to the send buffer, which holds
every byte from ``snd_una`` on (unacknowledged, then unsent). The glue throttles itself
on :attr:`~TcpConnection.send_space`. Output is limited by the guest's window
(``snd_wnd``, scaled by the guest's window-scale shift, RFC 7323) and cut at the effective
MSS. We do not model congestion on the virtual link: the guest's window is the only limit,
except that after a retransmission timeout we slow-start from one segment up to half the
flight (RFC 5681 3.1) so that a stalled guest is not flooded, then drop the limit again.
Retransmission follows RFC 6298 (SRTT/RTTVAR, Karn's rule, exponential backoff, at most
``max_retries`` timeouts in a row, then RST; as in BSD, an ACK of new data clears the
backoff). Three duplicate ACKs trigger a fast retransmit of the first unacknowledged
segment (RFC 5681 3.2); further partial ACKs in that recovery episode retransmit the
next hole at once (the RFC 6582 idea). A zero guest
window with data waiting starts the persist timer (RFC 9293 3.8.6.1): one-byte probes with
exponential backoff; the connection is never closed while the guest answers them.
Sender silly-window avoidance (RFC 9293 3.8.6.2.1): with data in flight, a segment shorter
than an MSS is held back until the usable window is at least half the largest window the
guest ever offered. There is no Nagle delay: bytes from the host go out at once.

Receiving (guest -> host)
-------------------------
In-order data goes to the receive buffer, read with :meth:`~TcpConnection.peek` and freed
with :meth:`~TcpConnection.consume`. The window we advertise is ``rcv_buf`` minus what we
hold, so a host socket that does not drain closes the window instead of making us drop
data: nothing we have acknowledged is ever discarded (unless the connection is reset).
The right edge of the window never moves left (RFC 9293 3.8.6.2.2): what was once offered
stays acceptable. With window scaling the field is rounded up when rounding down would pull
the edge left and the buffer has room for it; otherwise the advertised window retracts by
less than ``2**rcv_wscale`` bytes (RFC 7323 appendix F), so we never hold more than ``rcv_buf``.
Receiver silly-window avoidance: the edge
only advances by at least ``min(rcv_buf / 2, MSS)``; :meth:`~TcpConnection.consume`
schedules a window update when that lets the advertised window at least double.
Out-of-order segments inside the window are kept (bounded by the window) and merged when
the hole is filled; each one draws its own immediate (pure) duplicate ACK so that the
guest can fast-retransmit (RFC 5681 4.2). Otherwise ACKs are coalesced: any number of
segments received between two ``segments_to_send`` calls produce one ACK, and ACKs ride
on data when there is data.

Delayed ACK (RFC 1122 4.2.3.2, RFC 9293 3.8.6.3): with ``ack_delay > 0`` the pure ACK for
in-order data may wait up to ``ack_delay`` seconds (the timer in :meth:`~TcpConnection.get_timer`),
so that a host answer arriving meanwhile carries it (request/response traffic then costs
one frame per message instead of two). The ACK still goes out at once when at least two
full-sized segments (``2 * (mss - 40)`` bytes) are unacknowledged, for a segment that is
out of order, fills a hole or repeats old data, for the guest's FIN in FIN-WAIT-1/2 (in
ESTABLISHED the FIN's ACK waits like data: our FIN usually follows and carries it), for a window update
the guest may be waiting for (its remaining window below that threshold; otherwise the
update rides the delayed ACK) and for every challenge ACK. ``ack_delay = 0`` (the default)
ACKs at once.

Hostile input
-------------
The guest is untrusted. :meth:`~TcpConnection.receive_segment` never raises for any field
values: segments that cannot be used are counted in ``dropped_segments`` and, where RFC
9293 / RFC 5961 say so, answered with an ACK (or an RST). Calls that the *glue* makes out
of order (``accept`` twice, ``send`` after ``shutdown_write``) raise ``RuntimeError``.

Payload lifetime
----------------
Payloads returned by ``segments_to_send`` and the view returned by ``peek`` are
``memoryview`` slices of internal buffers. They are valid until the next call into the
connection and are released (raising ``ValueError`` on use) once the buffer changes.
Copy them (the frame builder does) if they must live longer.
"""

from __future__ import annotations

from collections import deque

from ..wire.tcp import ACK, RST, Segment
from .arrival import Arrival, wscale_for
from .buffers import ChunkQueue, SendQueue
from .seq import SEQ_MASK as _MASK
from .tcb import (CLOSE_WAIT, CLOSED, CLOSING, DEFAULT_MSS, ESTABLISHED, FIN_WAIT_1, FIN_WAIT_2, INITIAL_RTO,
                  LAST_ACK, LISTEN, MIN_MSS, RECEIVING, SYN_RECEIVED, SYN_SENT, TIME_WAIT, TcpEvent)

__all__ = [
    "TcpConnection",
    # the RFC 9293 states (defined in aioslirp.tcp.tcb, with the events)
    "LISTEN", "SYN_SENT", "SYN_RECEIVED", "ESTABLISHED", "FIN_WAIT_1", "FIN_WAIT_2", "CLOSE_WAIT",
    "CLOSING", "LAST_ACK", "TIME_WAIT", "CLOSED",
]


class TcpConnection(Arrival):
    """One TCP connection with the guest; we are the guest's remote peer. See the module docstring.

    Keyword arguments:

    ``iss``
        Our initial sequence number (RFC 9293 3.4.1), 0 .. 2**32 - 1.
    ``mss``
        Largest payload we send, and the MSS option we advertise, in bytes (MTU - 40 for
        IPv4, MTU - 60 for IPv6). The effective send MSS is ``min(mss, guest's MSS)``.
    ``rcv_buf``
        Bytes of guest data we hold for the host side; our receive window is ``rcv_buf``
        minus what :meth:`peek` still holds.
    ``snd_buf``
        Soft limit (bytes) for host data held here, unsent plus unacknowledged; see
        :attr:`send_space`.
    ``now``
        Current time, seconds.
    ``linger``
        Bound on FIN-WAIT-2 (guest silence), CLOSING and LAST-ACK (no ACK of new data), seconds.
    ``time_wait``
        Length of TIME-WAIT, seconds (only the flow entry lives that long).
    ``max_retries``
        Retransmission timeouts in a row (or unanswered window probes) before we give up
        with an RST.
    ``rto_min``, ``rto_max``
        Bounds on the retransmission timeout, seconds (RFC 6298 2.4, 2.5).
    ``ack_delay``
        Longest wait for a delayed ACK of in-order data, seconds (0: ACK at once; at most
        0.5, RFC 1122 4.2.3.2). See "Delayed ACK" in the module docstring.
    ``max_segment``
        Largest payload of one segment we emit, bytes (default: the effective MSS). A
        transport with TCP segmentation offload passes up to ~64 KB here: such a segment
        is cut into MSS-sized ones by the kernel (``gso_size`` = :attr:`effective_mss`).
        Segments are then multiples of the effective MSS except the last of a burst.
    """

    __slots__ = ()

    def __init__(
        self,
        *,
        iss: int,
        mss: int,
        rcv_buf: int,
        snd_buf: int,
        now: float,
        linger: float = 60.0,
        time_wait: float = 1.0,
        max_retries: int = 12,
        rto_min: float = 0.2,
        rto_max: float = 60.0,
        ack_delay: float = 0.0,
        max_segment: int | None = None,
    ) -> None:
        if not MIN_MSS <= mss <= 0xFFFF:
            raise ValueError(f"mss must be {MIN_MSS}..65535, got {mss}")
        if not 0.0 <= ack_delay <= 0.5:
            raise ValueError(f"ack_delay must be 0..0.5 seconds, got {ack_delay}")
        if max_segment is not None and not MIN_MSS <= max_segment <= 0xFFFF:
            raise ValueError(f"max_segment must be {MIN_MSS}..65535, got {max_segment}")
        self.ack_delay = ack_delay
        self.max_segment = max_segment
        if rcv_buf < 1 or snd_buf < 0:
            raise ValueError("rcv_buf must be >= 1 and snd_buf >= 0")
        if not 0 < rto_min <= rto_max:
            raise ValueError("need 0 < rto_min <= rto_max")
        self.mss = mss
        self.rcv_buf = rcv_buf
        self.snd_buf = snd_buf
        self.linger = linger
        self.time_wait = time_wait
        self.max_retries = max_retries
        self.rto_min = rto_min
        self.rto_max = rto_max

        iss &= _MASK
        self.state = LISTEN
        self.iss = iss
        self.irs = None
        self.snd_una = iss
        self.snd_nxt = iss
        self.snd_max = iss
        self.snd_wnd = 0
        self.rcv_nxt = 0
        self.fin_received = False
        self.reset = False
        self.established_at = None
        self.created_at = now
        self.bytes_received = 0
        self.bytes_sent = 0
        self.dropped_segments = 0
        self.retransmitted_segments = 0
        self.srtt = None
        self.rttvar = 0.0
        self.rto = self._rto_base = min(max(INITIAL_RTO, rto_min), rto_max)

        self._sq = SendQueue()
        self._smss = min(mss, DEFAULT_MSS)
        self._snd_wscale = 0
        self._rcv_wscale = 0
        self._wscale_ok = False
        self._snd_wl1 = 0
        self._snd_wl2 = 0
        self._max_snd_wnd = 0
        self._ack_limit = iss
        self._fin_queued = False
        self._fin_acked = False
        self._syn_pending = False
        self._syn_rexmit = False
        self._accepted = False
        self._rexmit_one = False
        self._force_one = False
        self._dupacks = 0
        self._in_recovery = False
        self._recover = iss
        self._cwnd = None
        self._ssthresh = 0
        self._rtt_seq = None
        self._rtt_time = 0.0
        self._retries = 0
        self._persist_backoff = 0
        self._probes_unanswered = 0
        self._probe_pending = False

        self._rq = ChunkQueue()
        self._rcv_adv = 0
        self._ack_pending = False
        self._dupacks_out = 0
        self._ooo = []
        self._ooo_bytes = 0
        self._ooo_fin = None
        self._rcv_unacked = 0
        self._ack_now_at = max(1, min(2 * (mss - 40), 16384))
        self._ack_due = None
        self._seg_max = self._smss

        self._rto_at = None
        self._persist_at = None
        self._linger_at = None

        self._rst = None
        self._events = deque()

    def __repr__(self) -> str:
        return (f"<TcpConnection {self.state} snd_una={self.snd_una} snd_nxt={self.snd_nxt} "
                f"snd_wnd={self.snd_wnd} rcv_nxt={self.rcv_nxt} rcv_wnd={self.rcv_wnd}>")

    # ------------------------------------------------------------------ status

    @property
    def send_space(self) -> int:
        """``snd_buf`` minus host bytes held (unsent + unacked); may be negative.

        The glue stops reading the host socket while this is ``<= 0``.
        """
        return self.snd_buf - len(self._sq)

    @property
    def send_buffered(self) -> int:
        """Host bytes held for the guest (unsent + unacknowledged), bytes: ``snd_buf - send_space``."""
        return len(self._sq)

    @property
    def recv_buffered(self) -> int:
        """Guest bytes received in order and not yet consumed by the host side, bytes (at most
        ``rcv_buf``: our window never offers more)."""
        return len(self._rq)

    @property
    def snd_wscale(self) -> int:
        """Shift applied to the guest's window fields (0 when scaling is off)."""
        return self._snd_wscale

    @property
    def rcv_wscale(self) -> int:
        """Shift applied to the window fields we send (0 when scaling is off)."""
        return self._rcv_wscale

    @property
    def effective_mss(self) -> int:
        """Largest payload we put in one segment: min(our mss, the guest's MSS option)."""
        return self._smss

    @property
    def recv_pending(self) -> int:
        """Guest bytes received in order and not yet consumed (what :meth:`peek` returns), bytes."""
        return self._rq.nbytes

    @property
    def has_events(self) -> bool:
        """True when :meth:`next_event` has something."""
        return bool(self._events)

    def next_event(self) -> TcpEvent | None:
        """Next event for the glue, oldest first, or None.

        :class:`~aioslirp.tcp.tcb.EstablishedEvent` handshake complete;
        :class:`~aioslirp.tcp.tcb.FinEvent` the guest half-closed;
        :class:`~aioslirp.tcp.tcb.ResetEvent` the guest reset us or we gave up (timeout) -- not
        emitted for the glue's own :meth:`abort`/:meth:`refuse`;
        :class:`~aioslirp.tcp.tcb.ClosedEvent` the state became CLOSED (always the last event).
        Each compares equal to its old tuple form (``("fin",)``...).
        """
        if self._events:
            return self._events.popleft()
        return None

    # ------------------------------------------------------------------ opening

    def accept(self, now: float) -> None:
        """The host connect succeeded: answer the guest's SYN with a SYN-ACK.

        The SYN-ACK carries our MSS option and, if negotiated, our window scale; it is
        retransmitted on RTO. Ignored if the guest already reset the connection.
        """
        if self.state is CLOSED:
            return
        if self.state is not SYN_RECEIVED or self._accepted:
            raise RuntimeError(f"accept() in state {self.state}")
        self._accepted = True
        self._syn_pending = True

    def refuse(self) -> None:
        """The host refused: send ``RST|ACK`` (seq 0, ack IRS+1) and close (RFC 9293 3.10.7.1)."""
        if self.state is CLOSED:
            return
        if self.state is not SYN_RECEIVED or self._accepted:
            raise RuntimeError(f"refuse() in state {self.state}")
        self._rst = Segment(0, self.rcv_nxt, RST | ACK, 0)
        self._teardown(notify=False)

    def connect(self, now: float) -> None:
        """Active open towards the guest (host port forward): send a SYN, enter SYN-SENT.

        The SYN offers our MSS and window scale; scaling is used only if the guest's
        SYN-ACK carries a window scale too (RFC 7323 1.3).
        """
        if self.state is not LISTEN:
            raise RuntimeError(f"connect() in state {self.state}")
        self._rcv_wscale = wscale_for(self.rcv_buf)
        self.state = SYN_SENT
        self._syn_pending = True

    # ------------------------------------------------------------------ host side

    def send(self, data) -> None:
        """Queue host bytes for the guest. Always accepted, even past ``snd_buf``.

        Ignored once the connection is CLOSED; ``RuntimeError`` after :meth:`shutdown_write`.
        """
        if self._fin_queued:
            raise RuntimeError("send() after shutdown_write()")
        if self.state is CLOSED or not len(data):
            return
        self._sq.append(data)

    def shutdown_write(self) -> None:
        """The host sent EOF: our FIN follows the queued data.

        ESTABLISHED -> FIN-WAIT-1, CLOSE-WAIT -> LAST-ACK; before the handshake completes
        the FIN waits for it (RFC 9293 3.10.4). Idempotent.
        """
        if self._fin_queued or self.state is CLOSED:
            return
        self._fin_queued = True
        state = self.state
        if state is ESTABLISHED:
            self.state = FIN_WAIT_1
        elif state is CLOSE_WAIT:
            self.state = LAST_ACK

    def abort(self) -> None:
        """The host side failed: send RST (seq = ``snd_max``, i.e. SND.NXT before any
        go-back) and close at once. Buffers are discarded. No :class:`~aioslirp.tcp.tcb.ResetEvent`."""
        state = self.state
        if state is CLOSED:
            return
        if state is SYN_RECEIVED and not self._accepted:
            self.refuse()
            return
        if state is not LISTEN:
            self._queue_rst()
        self._teardown(notify=False)

    def peek(self) -> memoryview | bytes:
        """Guest bytes received in order and not yet consumed (``b""`` when none).

        Valid until the next call into the connection.
        """
        return self._rq.joined()

    def peek_chunk(self) -> memoryview | bytes:
        """The oldest piece of what :meth:`peek` returns (``b""`` when none): a glue that writes
        piece by piece (``consume(len(piece))`` after each) avoids joining them into one buffer.

        Valid until the next call into the connection.
        """
        return self._rq.first()

    def consume(self, n: int) -> int:
        """The host socket took ``n`` bytes from the front of :meth:`peek`; returns the bytes
        still held (:attr:`recv_pending`).

        Frees receive window; schedules a window update when the advertised window can
        grow by at least ``min(rcv_buf / 2, MSS)`` and at least doubles.
        """
        rq = self._rq
        held = rq.nbytes
        if n < 0 or n > held:
            raise ValueError(f"consume({n}) with {held} bytes held")
        if not n:
            return held
        rq.drop(n)
        if self.state in RECEIVING and not self._ack_pending:
            avail = self._avail()
            cur = self.rcv_wnd
            if avail - cur >= self._sws_threshold() and cur * 2 <= avail:
                # A delayed ACK already due (within ack_delay) carries the new window, unless the
                # guest is nearly out of window and might be waiting for it.
                if self._ack_due is None or cur < self._ack_now_at:
                    self._ack_pending = True
        return held - n
