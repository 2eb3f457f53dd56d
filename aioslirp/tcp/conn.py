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

Inputs and outputs
------------------
Inputs: guest segments (:meth:`~TcpConnection.on_syn`, :meth:`~TcpConnection.receive_segment`),
host-side calls (:meth:`~TcpConnection.accept`, :meth:`~TcpConnection.refuse`,
:meth:`~TcpConnection.connect`, :meth:`~TcpConnection.send`,
:meth:`~TcpConnection.shutdown_write`, :meth:`~TcpConnection.consume`,
:meth:`~TcpConnection.abort`) and time (:meth:`~TcpConnection.handle_timer`).
After any of these the glue calls ``segments_to_send(now)`` once and transmits what it
returns, then re-arms its single timer from :meth:`~TcpConnection.get_timer`. The segments
are :class:`Segment` objects (parsed header fields, options and payload); turning them into
IP packets and back is the wire layer's job.

States
------
The RFC 9293 state names are used verbatim (``"ESTABLISHED"``, ``"FIN-WAIT-1"``, ...).
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
The right edge of the window never moves left (RFC 9293 3.8.6.2.2; with window scaling
the field is rounded *up* when rounding down would shrink it, so we may hold up to
``2**rcv_wscale - 1`` bytes past ``rcv_buf``). Receiver silly-window avoidance: the edge
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

from bisect import bisect_left, bisect_right
from collections import deque

from ..wire.tcp import ACK, FIN, PSH, RST, SYN, URG, Segment

__all__ = [
    "ACK",
    "FIN",
    "PSH",
    "RST",
    "SYN",
    "URG",
    "Segment",
    "TcpConnection",
]

_MASK = 0xFFFFFFFF
_HALF = 0x80000000
_MOD = 0x100000000

# RFC 9293 state names.
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
_RECEIVING = frozenset((ESTABLISHED, FIN_WAIT_1, FIN_WAIT_2))
#: States in which we may (re)transmit data or our FIN.
_SENDING = frozenset((ESTABLISHED, CLOSE_WAIT, FIN_WAIT_1, CLOSING, LAST_ACK))

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


class _SendQueue:
    """The send buffer: a FIFO of immutable chunks (the ``bytes`` objects the host socket
    produced, kept as they are) with views at any offset.

    Appending copies nothing for ``bytes`` (anything else is copied once); dropping the
    acknowledged head frees whole chunks without moving bytes. :meth:`view` returns a zero-copy
    ``memoryview`` when the range lies in one chunk, else a view of the joined pieces. Views
    handed out are released (``ValueError`` on use) by :meth:`release_views`, which the
    connection calls on its next output: payloads are valid until the next call, as documented.
    """

    __slots__ = ("_chunks", "_ends", "_i0", "_base", "_total", "_views")

    def __init__(self) -> None:
        self._chunks: list = []
        self._ends: list[int] = []  # absolute stream offset just past each chunk
        self._i0 = 0  # first live chunk
        self._base = 0  # absolute offset of the head (bytes dropped so far)
        self._total = 0  # absolute offset of the tail
        self._views: list[memoryview] = []

    def __len__(self) -> int:
        return self._total - self._base

    def release_views(self) -> None:
        for v in self._views:
            try:
                v.release()
            except BufferError:  # pragma: no cover - someone holds a raw buffer of it
                pass
        self._views.clear()

    def append(self, data) -> None:
        n = len(data)
        if not n:
            return
        if self._views:
            self.release_views()  # "valid until the next call into the connection"
        if data.__class__ is not bytes:
            data = bytes(data)
        self._chunks.append(data)
        self._total += n
        self._ends.append(self._total)

    def view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` counted from the head (``0 <= start < end <= len``)."""
        a = self._base + start
        b = self._base + end
        ends = self._ends
        k = bisect_right(ends, a, self._i0)
        chunk = self._chunks[k]
        cend = ends[k]
        cstart = cend - len(chunk)
        if b <= cend:
            v = memoryview(chunk)[a - cstart:b - cstart]
        else:
            parts = [memoryview(chunk)[a - cstart:]]
            while cend < b:
                k += 1
                chunk = self._chunks[k]
                cstart, cend = cend, ends[k]
                parts.append(memoryview(chunk)[:b - cstart] if b < cend else chunk)
            v = memoryview(b"".join(parts))
        self._views.append(v)
        return v

    def drop(self, n: int) -> None:
        """Forget the first ``n`` bytes."""
        base = self._base = self._base + n
        ends = self._ends
        chunks = self._chunks
        i = self._i0
        last = len(ends)
        while i < last and ends[i] <= base:
            chunks[i] = None
            i += 1
        if i >= 64 and i * 2 >= last:
            del chunks[:i]
            del ends[:i]
            i = 0
        self._i0 = i

    def clear(self) -> None:
        self.release_views()
        self._chunks.clear()
        self._ends.clear()
        self._i0 = 0
        self._base = self._total = 0


class _ChunkQueue:
    """A FIFO of bytes kept as a list of immutable chunks (the receive queue).

    Appending keeps a read-only ``memoryview`` of a ``bytes`` object as it is (what a TAP
    read produces: the bytes cannot change under us) and copies anything else once into its
    own ``bytes`` (the caller's buffer may be reused); nothing is ever re-copied to grow a
    buffer, and :meth:`first` hands the oldest chunk out as is, so a consumer that writes
    chunk by chunk (the flow, to the host socket) copies nothing more. :meth:`joined` merges
    everything into one chunk when asked. Chunks are immutable: views of them stay valid.
    A list with a start index rather than a deque: an idle flow's empty queue stays small.
    """

    __slots__ = ("_chunks", "_i0", "_head", "_len")

    def __init__(self) -> None:
        self._chunks: list = []
        self._i0 = 0  # first live chunk
        self._head = 0  # bytes of the first live chunk already consumed
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, data) -> None:
        n = len(data)
        if n:
            if data.__class__ is not bytes and not (
                    data.__class__ is memoryview and data.readonly and data.obj.__class__ is bytes):
                data = bytes(data)
            self._chunks.append(data)
            self._len += n

    def first(self) -> memoryview | bytes:
        """The oldest unconsumed piece (``b""`` when empty)."""
        if not self._len:
            return b""
        c = self._chunks[self._i0]
        h = self._head
        return memoryview(c)[h:] if h else c

    def joined(self) -> bytes:
        """Everything held, as one ``bytes`` (merging the chunks into one)."""
        if not self._len:
            return b""
        chunks = self._chunks
        i0 = self._i0
        if len(chunks) - i0 > 1 or self._head or chunks[i0].__class__ is not bytes:
            whole = b"".join(chunks[i0:])[self._head:]
            chunks.clear()
            chunks.append(whole)
            self._i0 = self._head = 0
        return chunks[self._i0]

    def drop(self, n: int) -> None:
        """Forget the first ``n`` bytes (``0 <= n <= len``)."""
        left = self._len = self._len - n
        chunks = self._chunks
        if not left:
            chunks.clear()
            self._i0 = self._head = 0
            return
        i = self._i0
        h = self._head + n
        while h >= len(chunks[i]):
            h -= len(chunks[i])
            chunks[i] = None
            i += 1
        if i >= 64 and i * 2 >= len(chunks):
            del chunks[:i]
            i = 0
        self._i0 = i
        self._head = h

    def clear(self) -> None:
        self._chunks.clear()
        self._i0 = self._head = self._len = 0


def _wscale_for(rcv_buf: int) -> int:
    """Smallest shift with ``rcv_buf >> shift <= 65535`` (at most 14), RFC 7323 2.3."""
    shift = 0
    while shift < MAX_WSCALE and (rcv_buf >> shift) > 0xFFFF:
        shift += 1
    return shift


class TcpConnection:
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
        #: RFC 9293 state name.
        self.state = LISTEN
        self.iss = iss
        #: Initial receive sequence number (the guest's ISN), None before its SYN.
        self.irs: int | None = None
        self.snd_una = iss
        self.snd_nxt = iss
        #: Highest sequence number sent plus one (BSD ``snd_max``).
        self.snd_max = iss
        #: Guest's receive window in bytes (already scaled).
        self.snd_wnd = 0
        self.rcv_nxt = 0
        #: The guest sent its FIN (glue: after draining peek(), shutdown(SHUT_WR) the host socket).
        self.fin_received = False
        #: The connection ended with an RST (either direction, or our timeout/abort).
        self.reset = False
        self.established_at: float | None = None
        self.created_at = now
        #: In-order payload bytes accepted from the guest.
        self.bytes_received = 0
        #: Payload bytes sent to the guest, retransmissions excluded.
        self.bytes_sent = 0
        #: Guest segments ignored (unacceptable, malformed or out of place).
        self.dropped_segments = 0
        #: Segments sent again (timeout, fast retransmit, duplicate SYN).
        self.retransmitted_segments = 0
        #: Smoothed RTT and its variation (RFC 6298), seconds; srtt None before a sample.
        self.srtt: float | None = None
        self.rttvar = 0.0
        #: Current retransmission timeout, seconds.
        self.rto = self._rto_base = min(max(INITIAL_RTO, rto_min), rto_max)

        self._sq = _SendQueue()
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
        self._cwnd: int | None = None
        self._ssthresh = 0
        self._rtt_seq: int | None = None
        self._rtt_time = 0.0
        self._retries = 0
        self._persist_backoff = 0
        self._probes_unanswered = 0
        self._probe_pending = False

        self._rq = _ChunkQueue()
        self._rcv_adv = 0
        self._ack_pending = False
        self._dupacks_out = 0
        self._ooo: list[tuple[int, bytes]] = []
        self._ooo_bytes = 0
        self._ooo_fin: int | None = None
        self._rcv_unacked = 0
        #: Unacknowledged in-order bytes that force an ACK at once: two full-sized segments
        #: (RFC 1122 4.2.3.2), at most 16 KB so that a large MSS (MTU 65520) still gets ACKs often.
        self._ack_now_at = max(1, min(2 * (mss - 40), 16384))
        self._ack_due: float | None = None
        self._seg_max = self._smss

        self._rto_at: float | None = None
        self._persist_at: float | None = None
        self._linger_at: float | None = None

        self._rst: Segment | None = None
        self._events: deque[tuple] = deque()

    def __repr__(self) -> str:
        return (f"<TcpConnection {self.state} snd_una={self.snd_una} snd_nxt={self.snd_nxt} "
                f"snd_wnd={self.snd_wnd} rcv_nxt={self.rcv_nxt} rcv_wnd={self.rcv_wnd}>")

    # ------------------------------------------------------------------ status

    @property
    def rcv_wnd(self) -> int:
        """RCV.WND: bytes past ``rcv_nxt`` the guest may send per our last advertisement."""
        w = (self._rcv_adv - self.rcv_nxt) & _MASK
        return 0 if w >= _HALF else w

    @property
    def send_space(self) -> int:
        """``snd_buf`` minus host bytes held (unsent + unacked); may be negative.

        The glue stops reading the host socket while this is ``<= 0``.
        """
        return self.snd_buf - len(self._sq)

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

    def next_event(self) -> tuple | None:
        """Next event for the glue, oldest first, or None.

        ``("established",)`` handshake complete; ``("fin",)`` the guest half-closed;
        ``("reset",)`` the guest reset us or we gave up (timeout) -- not emitted for the
        glue's own :meth:`abort`/:meth:`refuse`; ``("closed",)`` the state became CLOSED
        (always the last event).
        """
        if self._events:
            return self._events.popleft()
        return None

    # ------------------------------------------------------------------ opening

    def on_syn(self, seg: Segment, now: float) -> None:
        """The guest's SYN for a new flow (passive open), RFC 9293 3.10.7.2.

        Records the guest's ISN, MSS (536 when absent) and window scale (we scale only
        if the guest offered it) and moves to SYN-RECEIVED without sending anything: the
        glue connects the host socket first, then calls :meth:`accept` or :meth:`refuse`.
        Payload and FIN on the SYN are ignored (not acknowledged; the guest resends them).
        In any other state this is :meth:`receive_segment` (a retransmitted SYN before
        :meth:`accept` is ignored, after it draws a SYN-ACK again).
        """
        if self.state is not LISTEN:
            self.receive_segment(seg, now)
            return
        flags = seg.flags
        if flags & (RST | ACK) or not flags & SYN:
            self.dropped_segments += 1
            if flags & ACK and not flags & RST:
                self._rst = Segment(seg.ack & _MASK, 0, RST, 0)
            return
        seq = seg.seq & _MASK
        self.irs = seq
        self.rcv_nxt = self._rcv_adv = (seq + 1) & _MASK
        self._set_peer_mss(seg.mss)
        if seg.wscale is not None:
            self._wscale_ok = True
            self._snd_wscale = min(max(seg.wscale, 0), MAX_WSCALE)
            self._rcv_wscale = _wscale_for(self.rcv_buf)
        self.snd_wnd = seg.wnd
        self._max_snd_wnd = seg.wnd
        self._snd_wl1 = seq
        self.state = SYN_RECEIVED

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
        self._rcv_wscale = _wscale_for(self.rcv_buf)
        self.state = SYN_SENT
        self._syn_pending = True

    def _set_peer_mss(self, mss: int | None) -> None:
        if mss is None:
            mss = DEFAULT_MSS
        smss = self._smss = min(self.mss, max(MIN_MSS, mss))
        mx = self.max_segment
        # With segmentation offload: the largest multiple of the MSS that fits max_segment.
        self._seg_max = (mx // smss) * smss if mx is not None and mx > smss else smss

    def _established(self, now: float) -> None:
        self.state = FIN_WAIT_1 if self._fin_queued else ESTABLISHED
        self.established_at = now
        self._events.append(("established",))
        if self._syn_rexmit:
            # RFC 6298 5.7: the SYN (or SYN-ACK) timed out and no RTT sample exists.
            self.rto = self._rto_base = min(max(SYN_TIMEOUT_RTO, self.rto_min), self.rto_max)

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
        go-back) and close at once. Buffers are discarded. No ``("reset",)`` event."""
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

    def consume(self, n: int) -> None:
        """The host socket took ``n`` bytes from the front of :meth:`peek`.

        Frees receive window; schedules a window update when the advertised window can
        grow by at least ``min(rcv_buf / 2, MSS)`` and at least doubles.
        """
        rq = self._rq
        if n < 0 or n > len(rq):
            raise ValueError(f"consume({n}) with {len(rq)} bytes held")
        if not n:
            return
        rq.drop(n)
        if self.state in _RECEIVING and not self._ack_pending:
            avail = self._avail()
            cur = self.rcv_wnd
            if avail - cur >= self._sws_threshold() and cur * 2 <= avail:
                # A delayed ACK already due (within ack_delay) carries the new window, unless the
                # guest is nearly out of window and might be waiting for it.
                if self._ack_due is None or cur < self._ack_now_at:
                    self._ack_pending = True

    def _avail(self) -> int:
        """Receive space we could offer now (bytes), capped by what the window field can carry."""
        avail = self.rcv_buf - len(self._rq)
        cap = 0xFFFF << self._rcv_wscale
        return cap if avail > cap else avail

    def _sws_threshold(self) -> int:
        half = self.rcv_buf >> 1
        return half if half < self._smss else self._smss

    # ------------------------------------------------------------------ input

    def receive_segment(self, seg: Segment, now: float) -> None:
        """Process one segment from the guest (RFC 9293 3.10.7), never raising on its content."""
        state = self.state
        if state is SYN_SENT:
            self._syn_sent_input(seg, now)
        elif state is LISTEN:
            if seg.flags & SYN and not seg.flags & (ACK | RST):
                self.on_syn(seg, now)
            else:
                self.dropped_segments += 1
                if seg.flags & ACK and not seg.flags & RST:
                    self._rst = Segment(seg.ack & _MASK, 0, RST, 0)
        elif state is CLOSED:
            self._closed_input(seg)
        else:
            self._sync_input(seg, now)

    def _closed_input(self, seg: Segment) -> None:
        """RFC 9293 3.10.7.1: answer anything but an RST with an RST."""
        self.dropped_segments += 1
        flags = seg.flags
        if flags & RST:
            return
        if flags & ACK:
            self._rst = Segment(seg.ack & _MASK, 0, RST, 0)
        else:
            seglen = len(seg.payload) + (1 if flags & SYN else 0) + (1 if flags & FIN else 0)
            self._rst = Segment(0, (seg.seq + seglen) & _MASK, RST | ACK, 0)

    def _syn_sent_input(self, seg: Segment, now: float) -> None:
        """RFC 9293 3.10.7.3: our SYN is out; expect SYN-ACK (or RST, or a simultaneous SYN)."""
        flags = seg.flags
        ack_ok = False
        if flags & ACK:
            ack = seg.ack & _MASK
            if self.snd_max == self.iss or ack != self.snd_max:  # it must ack exactly our SYN
                self.dropped_segments += 1
                if not flags & RST:
                    self._rst = Segment(ack, 0, RST, 0)
                return
            ack_ok = True
        if flags & RST:
            if ack_ok:
                self._teardown(notify=True)  # connection refused by the guest
            else:
                self.dropped_segments += 1
            return
        if not flags & SYN:
            self.dropped_segments += 1
            return
        seq = seg.seq & _MASK
        self.irs = seq
        self.rcv_nxt = (seq + 1) & _MASK
        self._rcv_adv = (self.rcv_nxt + min(self.rcv_buf, 0xFFFF)) & _MASK
        self._set_peer_mss(seg.mss)
        if seg.wscale is not None:
            self._wscale_ok = True
            self._snd_wscale = min(max(seg.wscale, 0), MAX_WSCALE)
        else:
            self._rcv_wscale = 0
        self.snd_wnd = self._max_snd_wnd = seg.wnd
        self._snd_wl1 = seq
        self._snd_wl2 = seg.ack & _MASK
        if ack_ok:
            self._syn_acked(now)
            self._established(now)
            self._ack_pending = True
        else:
            # Simultaneous open (RFC 9293 3.5): answer with SYN-ACK.
            self.state = SYN_RECEIVED
            self._accepted = True
            self._syn_pending = True

    def _syn_acked(self, now: float) -> None:
        una = self.snd_una = (self.iss + 1) & _MASK
        self.snd_nxt = una
        rs = self._rtt_seq
        if rs is not None and rs == una:
            self._rtt_sample(now - self._rtt_time)
        self._rtt_seq = None
        self._rto_at = None
        self._retries = 0
        self._syn_pending = False

    def _sync_input(self, seg: Segment, now: float) -> None:
        """RFC 9293 3.10.7.4 for SYN-RECEIVED and every later state."""
        flags = seg.flags
        seq = seg.seq & _MASK
        payload = seg.payload
        plen = len(payload)
        state = self.state
        rcv_nxt = self.rcv_nxt

        if flags & SYN and state is SYN_RECEIVED and seq == self.irs and not flags & (ACK | RST):
            # The guest retransmitted its SYN: our SYN-ACK (if any) was lost.
            if self._accepted:
                self._syn_pending = True
            else:
                self.dropped_segments += 1
            return

        # First: sequence number acceptability (RFC 9293 3.10.7.4, first check). A zero
        # window still accepts a segment starting at RCV.NXT for its ACK/RST/FIN.
        off = (seq - rcv_nxt) & _MASK
        if off >= _HALF:
            off -= _MOD
        wnd = (self._rcv_adv - rcv_nxt) & _MASK
        if wnd >= _HALF:
            wnd = 0
        seglen = plen
        if flags & SYN:
            seglen += 1
        if flags & FIN:
            seglen += 1
        w = wnd or 1
        if seglen:
            ok = off < w and off + seglen > 0
        else:
            ok = 0 <= off < w
        if state is TIME_WAIT and not flags & RST:
            # The guest is still talking (it lost our last ACK): restart TIME-WAIT.
            self._linger_at = now + self.time_wait
        if not ok:
            self.dropped_segments += 1
            if not flags & RST:
                self._ack_pending = True
            return

        # Second: RST (RFC 5961 3.2: exact match resets, otherwise challenge ACK).
        if flags & RST:
            if off == 0:
                # In TIME-WAIT both directions were complete: close, but it is no reset.
                self._teardown(notify=state is not TIME_WAIT, graceful=state is TIME_WAIT)
            else:
                self.dropped_segments += 1
                if self._accepted or state is not SYN_RECEIVED:
                    self._ack_pending = True
            return

        # Fourth: SYN in a synchronized state -> challenge ACK (RFC 5961 4.2).
        if flags & SYN:
            self.dropped_segments += 1
            self._ack_pending = True
            return

        # Fifth: ACK.
        if not flags & ACK:
            self.dropped_segments += 1
            return
        ack = seg.ack & _MASK
        if state is SYN_RECEIVED:
            if not self._accepted or self.snd_max == self.iss or ack != self.snd_max:
                self.dropped_segments += 1
                if self._accepted:
                    self._rst = Segment(ack, 0, RST, 0)
                return
            self._syn_acked(now)
            wnd_field = seg.wnd << self._snd_wscale
            self.snd_wnd = wnd_field
            if wnd_field > self._max_snd_wnd:
                self._max_snd_wnd = wnd_field
            self._snd_wl1 = seq
            self._snd_wl2 = ack
            self._established(now)
            state = self.state
        elif not self._ack_input(seg, seq, ack, plen, flags, now):
            return
        else:
            state = self.state
            if state is CLOSED:
                return
            if state is FIN_WAIT_2:
                self._linger_at = now + self.linger

        if not plen and not flags & FIN:
            return

        # Seventh: segment text; eighth: FIN.
        if state not in _RECEIVING:
            # A FIN was received already: ignore text (RFC 9293 3.10.7.4 seventh check).
            self.dropped_segments += 1
            self._ack_pending = True
            return
        fin = flags & FIN
        start = -off if off < 0 else 0
        end = plen
        limit = wnd - off  # payload index where our advertised window ends
        if end > limit:
            end = limit
            fin = 0  # the FIN lies beyond data we cut off
        if off > 0:
            # RFC 5681 4.2: one immediate duplicate ACK per out-of-order segment.
            self._ack_pending = True
            self._dupacks_out += 1
            self._ooo_store(self.bytes_received + off, payload, start, end, fin)
            return
        n = end - start
        if n > 0:
            self._dupacks_out = 0
            self._rq.append(payload if n == plen else payload[start:end])
            self.rcv_nxt = (rcv_nxt + n) & _MASK
            self.bytes_received += n
        if fin:
            # Also forgets out-of-order data (it lay past the FIN). ACKed at once, except an in-order
            # FIN in ESTABLISHED with delayed ACKs on: see _fin_input.
            self._fin_input(now, delay_ack=bool(self.ack_delay) and start == 0 and not self._ooo
                            and self._ooo_fin is None)
        elif n > 0 and (self._ooo or self._ooo_fin is not None):
            self._ack_pending = True  # fills (part of) a hole: ACK at once (RFC 5681 4.2)
            self._ooo_pull(now)
        elif n <= 0 or not self.ack_delay or start:
            self._ack_pending = True  # old data again (our ACK was lost), or no delayed ACKs
        else:
            # Delayed ACK (RFC 1122 4.2.3.2): at once for every second full-sized segment.
            unacked = self._rcv_unacked + n
            self._rcv_unacked = unacked
            if unacked >= self._ack_now_at:
                self._ack_pending = True
            elif self._ack_due is None:
                self._ack_due = now + self.ack_delay

    def _ack_input(self, seg: Segment, seq: int, ack: int, plen: int, flags: int, now: float) -> bool:
        """ACK field processing in synchronized states; False means drop the segment."""
        una = self.snd_una
        d = (ack - una) & _MASK
        if d == 0:
            # RFC 5681 2: a duplicate ACK acknowledges nothing new, carries no data,
            # leaves the window unchanged, while data is outstanding.
            if (not plen and not flags & (SYN | FIN) and self.snd_max != una
                    and (seg.wnd << self._snd_wscale) == self.snd_wnd):
                self._dupacks += 1
                if self._dupacks == DUPACK_THRESHOLD and not self._in_recovery:
                    self._in_recovery = True
                    self._recover = self.snd_max
                    self._rexmit_one = True
                    self._rtt_seq = None  # Karn
        elif d < _HALF:
            if d > ((self._ack_limit - una) & _MASK):
                # Acknowledges something never sent: ACK and drop (RFC 9293).
                self.dropped_segments += 1
                self._ack_pending = True
                return False
            self._new_ack(ack, d, now)
            if self.state is CLOSED:
                return True
        else:
            # An old ACK. Too old (RFC 5961 5.2) -> challenge ACK and drop.
            if ((una - ack) & _MASK) > self._max_snd_wnd:
                self.dropped_segments += 1
                self._ack_pending = True
                return False
            self._probes_unanswered = 0
            return True
        self._probes_unanswered = 0
        # Window update (RFC 9293 3.10.7.4 fifth check, SND.WL1/SND.WL2 rule).
        wl1 = self._snd_wl1
        dw = (seq - wl1) & _MASK
        if (0 < dw < _HALF) or (dw == 0 and ((ack - self._snd_wl2) & _MASK) < _HALF):
            wnd = seg.wnd << self._snd_wscale
            self.snd_wnd = wnd
            self._snd_wl1 = seq
            self._snd_wl2 = ack
            if wnd > self._max_snd_wnd:
                self._max_snd_wnd = wnd
            if wnd and self._persist_at is not None:
                self._persist_at = None
                self._persist_backoff = 0
        return True

    def _new_ack(self, ack: int, acked: int, now: float) -> None:
        """SND.UNA < ack <= what we sent: free data, time RTT, restart/stop the RTO timer."""
        self._dupacks = 0
        if self._retries:
            # Progress: forget the backoff, as BSD does (RTO returns to the SRTT-based value).
            self._retries = 0
            self.rto = self._rto_base
        sq = self._sq
        n = acked
        sqlen = len(sq)
        if n > sqlen:
            self._fin_acked = True  # the extra sequence number is our FIN
            n = sqlen
        if n:
            sq.drop(n)
        self.snd_una = ack
        if 0 < ((ack - self.snd_nxt) & _MASK) < _HALF:
            self.snd_nxt = ack
        beyond = (ack - self.snd_max) & _MASK
        if 0 < beyond < _HALF:  # a window probe byte was accepted
            self.bytes_sent += beyond
            self.snd_max = ack
        rs = self._rtt_seq
        if rs is not None and ((ack - rs) & _MASK) < _HALF:
            self._rtt_sample(now - self._rtt_time)
            self._rtt_seq = None
        self._rto_at = None if self.snd_max == ack else now + self.rto
        cwnd = self._cwnd
        if cwnd is not None:
            cwnd += acked if acked < self._smss else self._smss
            self._cwnd = None if cwnd >= self._ssthresh else cwnd
        if self._in_recovery:
            if 0 < ((self._recover - ack) & _MASK) < _HALF:
                self._rexmit_one = True  # partial ACK: the next hole is lost too
                self._rtt_seq = None
            else:
                self._in_recovery = False
        if self._fin_acked:
            state = self.state
            if state is FIN_WAIT_1:
                self.state = FIN_WAIT_2
                self._linger_at = now + self.linger
            elif state is CLOSING:
                self.state = TIME_WAIT
                self._linger_at = now + self.time_wait
            elif state is LAST_ACK:
                self._teardown(notify=False, graceful=True)
        elif self.state is LAST_ACK or self.state is CLOSING:
            # Progress: the linger bounds a guest that stops acknowledging, not the length of
            # the answer it is still reading (the same rule as FIN-WAIT-2's guest silence).
            self._linger_at = now + self.linger

    def _rtt_sample(self, r: float) -> None:
        """RFC 6298 2.2/2.3: update SRTT, RTTVAR and RTO from one measurement (seconds)."""
        if r < 0:
            r = 0.0
        srtt = self.srtt
        if srtt is None:
            srtt = r
            rttvar = r / 2
        else:
            rttvar = 0.75 * self.rttvar + 0.25 * abs(srtt - r)
            srtt = 0.875 * srtt + 0.125 * r
        self.srtt = srtt
        self.rttvar = rttvar
        var = 4 * rttvar
        rto = srtt + (var if var > CLOCK_GRANULARITY else CLOCK_GRANULARITY)
        if rto < self.rto_min:
            rto = self.rto_min
        elif rto > self.rto_max:
            rto = self.rto_max
        self.rto = self._rto_base = rto

    def _fin_input(self, now: float, delay_ack: bool = False) -> None:
        """The guest's FIN is next in sequence: consume it (RFC 9293 3.10.7.4 eighth check).

        ``delay_ack``: in ESTABLISHED (-> CLOSE-WAIT) the ACK may wait ``ack_delay`` seconds, so
        that our own FIN, which usually follows at once (the host peer closes when it reads
        EOF), carries it: one frame instead of two, as Linux does for a FIN received in
        ESTABLISHED (it enters delayed-ACK "pingpong" mode). The guest's close() does not wait
        for this ACK. In FIN-WAIT-1/2 the ACK goes at once (the guest's close completes on it).
        """
        self.rcv_nxt = (self.rcv_nxt + 1) & _MASK
        self.fin_received = True
        if delay_ack and self.state is ESTABLISHED and not self._ack_pending:
            if self._ack_due is None:
                self._ack_due = now + self.ack_delay
        else:
            self._ack_pending = True
        self._events.append(("fin",))
        self._ooo.clear()
        self._ooo_bytes = 0
        self._ooo_fin = None
        state = self.state
        if state is ESTABLISHED:
            self.state = CLOSE_WAIT
        elif state is FIN_WAIT_1:
            if self._fin_acked:  # pragma: no cover - FIN-WAIT-1 with our FIN acked is FIN-WAIT-2
                self.state = TIME_WAIT
                self._linger_at = now + self.time_wait
            else:
                self.state = CLOSING
                self._linger_at = now + self.linger
        elif state is FIN_WAIT_2:
            self.state = TIME_WAIT
            self._linger_at = now + self.time_wait

    def _ooo_store(self, start_abs: int, payload, start: int, end: int, fin: int) -> None:
        """Keep an out-of-order piece (stream offset ``start_abs``) for later; bounded by the window."""
        n = end - start
        if fin:
            pos = start_abs + n
            if self._ooo_fin is None or pos < self._ooo_fin:
                self._ooo_fin = pos
        if n <= 0:
            return
        ooo = self._ooo
        if len(ooo) >= MAX_OOO_SEGMENTS or self._ooo_bytes + n > self.rcv_wnd:
            return
        i = bisect_left(ooo, (start_abs,))
        if i < len(ooo) and ooo[i][0] == start_abs:
            if len(ooo[i][1]) >= n:
                return
            self._ooo_bytes -= len(ooo[i][1])
            del ooo[i]
        ooo.insert(i, (start_abs, bytes(payload[start:end])))
        self._ooo_bytes += n

    def _ooo_pull(self, now: float) -> None:
        """Move out-of-order pieces that became contiguous into the receive buffer."""
        ooo = self._ooo
        got = self.bytes_received
        fin_at = self._ooo_fin
        while ooo and ooo[0][0] <= got:
            start, data = ooo.pop(0)
            self._ooo_bytes -= len(data)
            dend = start + len(data)
            if fin_at is not None and dend > fin_at:
                dend = fin_at  # nothing is accepted past the guest's FIN
            if dend > got:
                self._rq.append(memoryview(data)[got - start:dend - start])
                self.rcv_nxt = (self.rcv_nxt + dend - got) & _MASK
                got = dend
        self.bytes_received = got
        if fin_at is not None and fin_at == got:
            self._fin_input(now)

    # ------------------------------------------------------------------ output

    def segments_to_send(self, now: float) -> list[Segment]:
        """Everything due now, in order: RST, SYN/SYN-ACK, fast retransmit, data, FIN,
        window probe, and at most one pure ACK (only if nothing else carried it).

        Payloads are memoryviews valid until the next call into the connection.
        """
        out: list[Segment] = []
        sq = self._sq
        if sq._views:
            sq.release_views()
        rst = self._rst
        if rst is not None:
            self._rst = None
            out.append(rst)
        state = self.state
        if state is CLOSED or state is LISTEN:
            self._ack_pending = False
            return out
        if state is SYN_SENT:
            if self._syn_pending:
                self._syn_pending = False
                out.append(Segment(self.iss, 0, SYN, min(self.rcv_buf, 0xFFFF),
                                   mss=self.mss, wscale=self._rcv_wscale))
                self._syn_sent(now)
            return out
        if self._syn_pending:  # SYN-RECEIVED, accepted
            self._syn_pending = False
            self._ack_pending = False
            w = self._avail()
            if w > 0xFFFF:
                w = 0xFFFF
            self._rcv_adv = (self.rcv_nxt + w) & _MASK
            out.append(Segment(self.iss, self.rcv_nxt, SYN | ACK, w, mss=self.mss,
                               wscale=self._rcv_wscale if self._wscale_ok else None))
            self._syn_sent(now)
            return out
        if state is SYN_RECEIVED:
            self._ack_pending = False  # nothing may be sent before our SYN-ACK
            return out
        if not (self._ack_pending or self._dupacks_out or self._probe_pending or self._rexmit_one):
            # Quick exit (most calls: after a pure ACK from the guest): no ACK owed, and no new
            # data or FIN to send (all of the send queue is out, FIN too if queued).
            if state not in _SENDING:
                return out
            off = (self.snd_nxt - self.snd_una) & _MASK
            sqlen = len(sq)
            if off > sqlen or (off == sqlen and not self._fin_queued):
                return out

        wnd = self._window_field()
        ack = self.rcv_nxt
        n0 = len(out)
        if state in _SENDING:
            self._output(out, now, ack, wnd)
        if self._probe_pending:
            self._probe_pending = False
            off = (self.snd_nxt - self.snd_una) & _MASK
            if self.snd_wnd == 0 and off < len(sq) and state in _SENDING:
                seq = self.snd_nxt
                out.append(Segment(seq, ack, ACK, wnd, sq.view(off, off + 1)))
                end = (seq + 1) & _MASK
                if 0 < ((end - self._ack_limit) & _MASK) < _HALF:
                    self._ack_limit = end
        k = self._dupacks_out
        if k:
            # Duplicate ACKs must be pure ACKs to count as such at the guest (RFC 5681 2).
            self._dupacks_out = 0
            self._ack_pending = False
            una = self.snd_max
            for _ in range(k if k < MAX_DUPACKS_OUT else MAX_DUPACKS_OUT):
                out.append(Segment(una, ack, ACK, wnd))
        elif len(out) > n0:
            self._ack_pending = False
        elif self._ack_pending:
            self._ack_pending = False
            out.append(Segment(self.snd_max, ack, ACK, wnd))
        else:
            return out
        # Every segment above carries RCV.NXT: no delayed ACK is owed any more.
        self._ack_due = None
        self._rcv_unacked = 0
        # A window was advertised: commit its right edge (it never moves left).
        edge = (ack + (wnd << self._rcv_wscale)) & _MASK
        if 0 < ((edge - self._rcv_adv) & _MASK) < _HALF:
            self._rcv_adv = edge
        if self._linger_at is None and (state is LAST_ACK or state is CLOSING):
            self._linger_at = now + self.linger
        return out

    def _syn_sent(self, now: float) -> None:
        """Bookkeeping after a SYN or SYN-ACK went out."""
        end = (self.iss + 1) & _MASK
        if self.snd_max == self.iss:
            self.snd_nxt = self.snd_max = self._ack_limit = end
            self._rtt_seq = end
            self._rtt_time = now
        else:
            self.retransmitted_segments += 1
            self._syn_rexmit = True
            self._rtt_seq = None  # Karn: never time a retransmitted SYN
        if self._rto_at is None:
            self._rto_at = now + self.rto

    def _window_field(self) -> int:
        """The window field for our next segment (right-shifted), RFC 9293 3.8.6.2.2 / RFC 7323 2.4."""
        cur = self.rcv_wnd
        avail = self._avail()
        if self.fin_received:
            wnd = avail if avail > cur else cur  # no more data can come: SWS avoidance is moot
        else:
            wnd = avail if avail - cur >= self._sws_threshold() else cur
        shift = self._rcv_wscale
        field = wnd >> shift
        if (field << shift) < cur:
            field += 1  # round up rather than shrink the edge already advertised
        return field if field < 0xFFFF else 0xFFFF

    def _output(self, out: list[Segment], now: float, ack: int, wnd: int) -> None:
        """Data and FIN from the send buffer, within SND.WND (and the post-timeout cwnd)."""
        sq = self._sq
        sqlen = len(sq)
        una = self.snd_una
        off = (self.snd_nxt - una) & _MASK
        off_max = (self.snd_max - una) & _MASK
        smss = self._smss
        seg_max = self._seg_max
        fin_q = self._fin_queued
        sent = False

        if self._rexmit_one:
            # Fast retransmit (or a partial ACK): resend the first unacknowledged segment.
            self._rexmit_one = False
            if off_max:
                n = off_max if off_max < smss else smss
                if n > sqlen:
                    n = sqlen
                flags = ACK
                if n == sqlen:
                    flags |= PSH if n else 0
                    if fin_q and off_max > sqlen:
                        flags |= FIN
                if n or flags & FIN:
                    out.append(Segment(una, ack, flags, wnd, sq.view(0, n) if n else b""))
                    self.retransmitted_segments += 1
                    sent = True

        limit = self.snd_wnd
        cwnd = self._cwnd
        if cwnd is not None and cwnd < limit:
            limit = cwnd
        force = self._force_one
        self._force_one = False
        while True:
            if off < sqlen:
                n = sqlen - off
                if n > seg_max:
                    n = seg_max
                room = limit - off
                if n > room and not force:
                    if room <= 0:
                        break
                    if off and room < smss and room < (self._max_snd_wnd >> 1):
                        break  # sender SWS avoidance: wait for ACKs to open more
                    n = room
                    if n > smss:
                        n -= n % smss  # whole segments only; the rest waits for the window
                elif force and n > smss:
                    n = smss  # after a timeout: one segment (the guest may be stalled)
                end = off + n
                flags = ACK
                if end == sqlen:
                    flags = ACK | PSH
                    if fin_q:
                        flags = ACK | PSH | FIN
                out.append(Segment((una + off) & _MASK, ack, flags, wnd, sq.view(off, end)))
                if end > off_max:
                    self.bytes_sent += end - (off if off > off_max else off_max)
                    if off >= off_max and self._rtt_seq is None and not self._in_recovery:
                        self._rtt_seq = (una + end) & _MASK
                        self._rtt_time = now
                if off < off_max:
                    self.retransmitted_segments += 1
                sent = True
                force = False
                off = end
                if flags & FIN:
                    off += 1
                    break
            elif fin_q and off == sqlen:
                out.append(Segment((una + off) & _MASK, ack, ACK | FIN, wnd))
                if off < off_max:
                    self.retransmitted_segments += 1
                off += 1
                sent = True
                break
            else:
                break

        if sent:
            self.snd_nxt = (una + off) & _MASK
            if off > off_max:
                self.snd_max = self.snd_nxt
                if 0 < ((self.snd_nxt - self._ack_limit) & _MASK) < _HALF:
                    self._ack_limit = self.snd_nxt
            if self._rto_at is None:
                self._rto_at = now + self.rto
        elif (self.snd_wnd == 0 and off < sqlen and self._persist_at is None
              and self.snd_max == una):
            # Zero window, data waiting, nothing in flight: start the persist timer.
            self._persist_at = now + self._persist_interval()

    def _persist_interval(self) -> float:
        t = self.rto * (1 << self._persist_backoff) if self._persist_backoff < 16 else self.rto_max
        return t if t < self.rto_max else self.rto_max

    # ------------------------------------------------------------------ time

    def get_timer(self) -> float | None:
        """Absolute time (seconds) of the earliest pending timer, or None."""
        t = self._rto_at
        p = self._persist_at
        if p is not None and (t is None or p < t):
            t = p
        p = self._linger_at
        if p is not None and (t is None or p < t):
            t = p
        p = self._ack_due
        if p is not None and (t is None or p < t):
            t = p
        return t

    def handle_timer(self, now: float) -> None:
        """Fire every timer due at ``now``: delayed ACK, retransmission, persist, linger, TIME-WAIT."""
        t = self._ack_due
        if t is not None and now >= t:
            self._ack_due = None
            self._ack_pending = True
        t = self._rto_at
        if t is not None and now >= t:
            self._rto_at = None
            self._on_rto(now)
        t = self._persist_at
        if t is not None and now >= t:
            self._persist_at = None
            self._on_persist(now)
        t = self._linger_at
        if t is not None and now >= t:
            self._linger_at = None
            if self.state is TIME_WAIT:
                self._teardown(notify=False, graceful=True)
            elif self.state is not CLOSED:
                self._queue_rst()
                self._teardown(notify=True)

    def _on_rto(self, now: float) -> None:
        """RFC 6298 5.4-5.6: back off, retransmit from SND.UNA; give up after max_retries."""
        state = self.state
        if self.snd_max == self.snd_una and not self._syn_pending and state is not SYN_SENT:
            return  # nothing outstanding (defensive)
        if self._retries >= self.max_retries:
            self._queue_rst()
            self._teardown(notify=True)
            return
        self._retries += 1
        rto = self.rto * 2
        self.rto = rto if rto < self.rto_max else self.rto_max
        self._rtt_seq = None
        self._rto_at = now + self.rto
        if state is SYN_SENT or state is SYN_RECEIVED:
            self._syn_pending = True
            return
        flight = (self.snd_max - self.snd_una) & _MASK
        smss = self._smss
        self._ssthresh = max(flight >> 1, 2 * smss)
        self._cwnd = smss
        self.snd_nxt = self.snd_una  # go back N
        self._force_one = True
        self._rexmit_one = False
        self._in_recovery = False
        self._dupacks = 0

    def _on_persist(self, now: float) -> None:
        """RFC 9293 3.8.6.1: probe a zero window with one byte; back off; keep going while answered."""
        if self.state not in _SENDING or self.snd_wnd != 0:
            self._persist_backoff = 0
            return
        if self._probes_unanswered >= self.max_retries:
            self._queue_rst()
            self._teardown(notify=True)
            return
        self._probes_unanswered += 1
        self._probe_pending = True
        self._persist_backoff += 1
        self._persist_at = now + self._persist_interval()

    # ------------------------------------------------------------------ teardown

    def _queue_rst(self) -> None:
        if self.irs is None:
            self._rst = Segment(self.snd_max, 0, RST, 0)
        else:
            self._rst = Segment(self.snd_max, self.rcv_nxt, RST | ACK, 0)

    def _teardown(self, *, notify: bool, graceful: bool = False) -> None:
        """Enter CLOSED. ``notify``: emit ("reset",) first. Not graceful: buffers are dropped."""
        if not graceful:
            self.reset = True
            self._sq.clear()
            self._rq.clear()
            if notify:
                self._events.append(("reset",))
        self.state = CLOSED
        self._rto_at = self._persist_at = self._linger_at = None
        self._syn_pending = self._rexmit_one = self._force_one = self._probe_pending = False
        self._ack_pending = False
        self._ack_due = None
        self._dupacks_out = 0
        self._ooo.clear()
        self._ooo_bytes = 0
        self._events.append(("closed",))
