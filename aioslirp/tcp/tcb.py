"""The transmission control block (RFC 9293 3.3.1) of :class:`~aioslirp.tcp.connection.TcpConnection`:
its variables, the state names, the events for the glue and the protocol constants.

:class:`Tcb` declares every variable of a connection once (slots, with their types and
meaning) and holds the few steps that the input side (:mod:`aioslirp.tcp.arrival`), the
output side (:mod:`aioslirp.tcp.output`) and the user calls (:mod:`aioslirp.tcp.connection`)
all take: the receive window, the peer's MSS, queueing an RST, entering CLOSED. The three are
one object: ``TcpConnection(Arrival, Output)``, both of which derive from :class:`Tcb`.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from ..wire.tcp import ACK, RST, Segment
from .buffers import ChunkQueue, SendQueue
from .seq import SEQ_HALF as _HALF
from .seq import SEQ_MASK as _MASK

__all__ = [
    "LISTEN", "SYN_SENT", "SYN_RECEIVED", "ESTABLISHED", "FIN_WAIT_1", "FIN_WAIT_2", "CLOSE_WAIT",
    "CLOSING", "LAST_ACK", "TIME_WAIT", "CLOSED", "RECEIVING", "SENDING",
    "TcpEvent", "EstablishedEvent", "FinEvent", "ResetEvent", "ClosedEvent",
    "DEFAULT_MSS", "MIN_MSS", "MAX_WSCALE", "INITIAL_RTO", "SYN_TIMEOUT_RTO", "CLOCK_GRANULARITY",
    "DUPACK_THRESHOLD", "MAX_OOO_SEGMENTS", "MAX_DUPACKS_OUT", "Tcb",
]

# ------------------------------------------------------------------ states
# RFC 9293 state names, verbatim. A connection only ever holds these objects, so tcp/ compares
# them with ``is``; others may compare the strings.
LISTEN = "LISTEN"
SYN_SENT = "SYN-SENT"
SYN_RECEIVED = "SYN-RECEIVED"
ESTABLISHED = "ESTABLISHED"
FIN_WAIT_1 = "FIN-WAIT-1"
FIN_WAIT_2 = "FIN-WAIT-2"
CLOSE_WAIT = "CLOSE-WAIT"
CLOSING = "CLOSING"
LAST_ACK = "LAST-ACK"
TIME_WAIT = "TIME-WAIT"
CLOSED = "CLOSED"

#: States in which guest data is still accepted (no FIN received yet).
RECEIVING = frozenset((ESTABLISHED, FIN_WAIT_1, FIN_WAIT_2))
#: States in which we may (re)transmit data or our FIN.
SENDING = frozenset((ESTABLISHED, CLOSE_WAIT, FIN_WAIT_1, CLOSING, LAST_ACK))

# ------------------------------------------------------------------ constants
#: MSS assumed when the guest's SYN carries no MSS option (RFC 9293 3.7.1), bytes.
DEFAULT_MSS = 536
#: Smallest peer MSS we honour; smaller values are raised to this (bytes).
MIN_MSS = 64
#: Largest window-scale shift (RFC 7323 2.3).
MAX_WSCALE = 14
#: Initial retransmission timeout before any RTT sample (RFC 6298 2.1), seconds.
INITIAL_RTO = 1.0
#: RTO after a SYN or SYN-ACK had to be retransmitted (RFC 6298 5.7), seconds.
SYN_TIMEOUT_RTO = 3.0
#: Clock granularity G of RFC 6298 2, seconds.
CLOCK_GRANULARITY = 0.001
#: Duplicate ACKs that trigger a fast retransmit (RFC 5681 3.2).
DUPACK_THRESHOLD = 3
#: Most out-of-order segments kept at once.
MAX_OOO_SEGMENTS = 256
#: Most duplicate ACKs emitted by one segments_to_send() call.
MAX_DUPACKS_OUT = 16


# ------------------------------------------------------------------ events
class TcpEvent:
    """What :meth:`~aioslirp.tcp.connection.TcpConnection.next_event` returns: one of the
    subclasses below, which carry no data (frozen: they have no attributes at all).

    An event compares equal to the one-element tuple of its :attr:`name` (``("fin",)``), the
    shape events had before they were classes, and ``event[0]`` is that name, so code written
    for those keeps working.
    """

    __slots__ = ()
    #: ``"established"``, ``"fin"``, ``"reset"`` or ``"closed"`` (the trace event names).
    name: ClassVar[str] = ""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TcpEvent):
            return other.__class__ is self.__class__
        if isinstance(other, tuple):
            return other == (self.name,)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.name,))

    def __getitem__(self, index: int) -> str:
        return (self.name,)[index]

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class EstablishedEvent(TcpEvent):
    """The handshake completed (both SYNs acknowledged)."""

    __slots__ = ()
    name = "established"


class FinEvent(TcpEvent):
    """The guest half-closed: its FIN is next in sequence (glue: after draining the receive
    queue, ``shutdown(SHUT_WR)`` the host socket)."""

    __slots__ = ()
    name = "fin"


class ResetEvent(TcpEvent):
    """The guest reset the connection, or we gave up (retransmission, persist or linger
    timeout). Not emitted for the glue's own ``abort()``/``refuse()``."""

    __slots__ = ()
    name = "reset"


class ClosedEvent(TcpEvent):
    """The state became CLOSED; always the last event."""

    __slots__ = ()
    name = "closed"


# ------------------------------------------------------------------ the TCB
class Tcb:
    """Every variable of one connection (see the module docstring), and the steps all its parts share.

    Variables carry the RFC 9293 names in lower case; sequence numbers are 32-bit, times are
    absolute seconds on the caller's clock (``None``: timer not running).
    """

    __slots__ = (
        # configuration
        "mss", "rcv_buf", "snd_buf", "linger", "time_wait", "max_retries", "rto_min", "rto_max",
        "ack_delay", "max_segment", "_seg_max",
        # public state
        "state", "iss", "irs", "snd_una", "snd_nxt", "snd_max", "snd_wnd", "rcv_nxt",
        "fin_received", "reset", "established_at", "created_at",
        "bytes_received", "bytes_sent", "dropped_segments", "retransmitted_segments",
        "srtt", "rttvar", "rto", "_rto_base",
        # send side
        "_sq", "_smss", "_snd_wscale", "_rcv_wscale", "_wscale_ok", "_snd_wl1", "_snd_wl2",
        "_max_snd_wnd", "_ack_limit", "_fin_queued", "_fin_acked", "_syn_pending", "_syn_rexmit",
        "_accepted", "_rexmit_one", "_force_one", "_dupacks", "_in_recovery", "_recover",
        "_cwnd", "_ssthresh", "_rtt_seq", "_rtt_time", "_retries",
        "_persist_backoff", "_probes_unanswered", "_probe_pending",
        # receive side
        "_rq", "_rcv_adv", "_ack_pending", "_dupacks_out", "_ooo", "_ooo_bytes", "_ooo_fin",
        "_rcv_unacked", "_ack_now_at",
        # timers (absolute times or None)
        "_rto_at", "_persist_at", "_linger_at", "_ack_due",
        # output and events
        "_rst", "_events",
    )

    # --- configuration (see TcpConnection's arguments)
    mss: int
    rcv_buf: int
    snd_buf: int
    linger: float
    time_wait: float
    max_retries: int
    rto_min: float
    rto_max: float
    ack_delay: float
    max_segment: int | None
    #: Largest payload of one segment we emit: the effective MSS, or its largest multiple
    #: within ``max_segment`` (segmentation offload).
    _seg_max: int

    # --- public state
    #: RFC 9293 state name (one of the constants above).
    state: str
    #: Our initial sequence number.
    iss: int
    #: Initial receive sequence number (the guest's ISN), None before its SYN.
    irs: int | None
    snd_una: int
    #: The send pointer (goes back to ``snd_una`` after a retransmission timeout).
    snd_nxt: int
    #: Highest sequence number sent plus one (BSD ``snd_max``).
    snd_max: int
    #: Guest's receive window in bytes (already scaled).
    snd_wnd: int
    rcv_nxt: int
    #: The guest sent its FIN (glue: after draining peek(), shutdown(SHUT_WR) the host socket).
    fin_received: bool
    #: The connection ended with an RST (either direction, or our timeout/abort).
    reset: bool
    established_at: float | None
    created_at: float
    #: In-order payload bytes accepted from the guest.
    bytes_received: int
    #: Payload bytes sent to the guest, retransmissions excluded.
    bytes_sent: int
    #: Guest segments ignored (unacceptable, malformed or out of place).
    dropped_segments: int
    #: Segments sent again (timeout, fast retransmit, duplicate SYN).
    retransmitted_segments: int
    #: Smoothed RTT and its variation (RFC 6298), seconds; srtt None before a sample.
    srtt: float | None
    rttvar: float
    #: Current retransmission timeout, seconds.
    rto: float
    #: The RTO without backoff (what an ACK of new data returns to).
    _rto_base: float

    # --- send side
    #: Host bytes from ``snd_una`` on: unacknowledged, then unsent.
    _sq: SendQueue
    #: Effective send MSS: min(mss, the guest's MSS option).
    _smss: int
    _snd_wscale: int
    _rcv_wscale: int
    _wscale_ok: bool
    #: SND.WL1 / SND.WL2: sequence and ACK numbers of the last window update.
    _snd_wl1: int
    _snd_wl2: int
    _max_snd_wnd: int
    #: Highest sequence number an ACK may acknowledge (what we ever sent, probes included).
    _ack_limit: int
    _fin_queued: bool
    _fin_acked: bool
    #: A SYN or SYN-ACK is due (first time or retransmission).
    _syn_pending: bool
    _syn_rexmit: bool
    #: accept() was called (SYN-RECEIVED): the SYN-ACK may go out.
    _accepted: bool
    #: Fast retransmit (or a partial ACK in recovery) of the first unacknowledged segment is due.
    _rexmit_one: bool
    #: After a timeout: send one segment even beyond the window.
    _force_one: bool
    _dupacks: int
    _in_recovery: bool
    _recover: int
    #: Congestion window after a timeout (RFC 5681 3.1 slow start), None when not limited.
    _cwnd: int | None
    _ssthresh: int
    #: The sequence number being timed (RFC 6298; Karn's rule clears it) and when it went out.
    _rtt_seq: int | None
    _rtt_time: float
    #: Retransmission timeouts in a row.
    _retries: int
    _persist_backoff: int
    _probes_unanswered: int
    _probe_pending: bool

    # --- receive side
    #: In-order guest bytes not yet consumed by the host side.
    _rq: ChunkQueue
    #: Right edge of the window we advertised (never moves left).
    _rcv_adv: int
    #: An ACK is owed at the next segments_to_send().
    _ack_pending: bool
    #: Immediate duplicate ACKs owed (one per out-of-order segment, RFC 5681 4.2).
    _dupacks_out: int
    #: Out-of-order pieces ``(stream offset, bytes)``, sorted.
    _ooo: list[tuple[int, bytes]]
    _ooo_bytes: int
    #: Stream offset of an out-of-order FIN, if one was seen.
    _ooo_fin: int | None
    #: In-order bytes received since our last ACK (delayed ACK).
    _rcv_unacked: int
    #: Unacknowledged in-order bytes that force an ACK at once: two full-sized segments
    #: (RFC 1122 4.2.3.2), at most 16 KB so that a large MSS (MTU 65520) still gets ACKs often.
    _ack_now_at: int

    # --- timers (absolute times or None)
    _rto_at: float | None
    _persist_at: float | None
    #: FIN-WAIT-2 / CLOSING / LAST-ACK bound, or the end of TIME-WAIT.
    _linger_at: float | None
    #: When the delayed ACK is due.
    _ack_due: float | None

    # --- output and events
    #: An RST to send before anything else.
    _rst: Segment | None
    _events: deque[TcpEvent]

    # ------------------------------------------------------------------ shared steps

    @property
    def rcv_wnd(self) -> int:
        """RCV.WND: bytes past ``rcv_nxt`` the guest may send per our last advertisement."""
        w = (self._rcv_adv - self.rcv_nxt) & _MASK
        return 0 if w >= _HALF else w

    def _avail(self) -> int:
        """Receive space we could offer now (bytes), capped by what the window field can carry."""
        avail = self.rcv_buf - len(self._rq)
        cap = 0xFFFF << self._rcv_wscale
        return cap if avail > cap else avail

    def _sws_threshold(self) -> int:
        half = self.rcv_buf >> 1
        return half if half < self._smss else self._smss

    def _set_peer_mss(self, mss: int | None) -> None:
        if mss is None:
            mss = DEFAULT_MSS
        smss = self._smss = min(self.mss, max(MIN_MSS, mss))
        mx = self.max_segment
        # With segmentation offload: the largest multiple of the MSS that fits max_segment.
        self._seg_max = (mx // smss) * smss if mx is not None and mx > smss else smss

    def _queue_rst(self) -> None:
        if self.irs is None:
            self._rst = Segment(self.snd_max, 0, RST, 0)
        else:
            self._rst = Segment(self.snd_max, self.rcv_nxt, RST | ACK, 0)

    def _teardown(self, *, notify: bool, graceful: bool = False) -> None:
        """Enter CLOSED. ``notify``: emit a :class:`ResetEvent` first. Not graceful: buffers are dropped."""
        if not graceful:
            self.reset = True
            self._sq.clear()
            self._rq.clear()
            if notify:
                self._events.append(ResetEvent())
        self.state = CLOSED
        self._rto_at = self._persist_at = self._linger_at = None
        self._syn_pending = self._rexmit_one = self._force_one = self._probe_pending = False
        self._ack_pending = False
        self._ack_due = None
        self._dupacks_out = 0
        self._ooo.clear()
        self._ooo_bytes = 0
        self._events.append(ClosedEvent())
