"""What a connection sends, and when (RFC 9293 3.8; RFC 6298 retransmission; RFC 5681).

:class:`Output` is the output half of :class:`~aioslirp.tcp.connection.TcpConnection`:
:meth:`~Output.segments_to_send` turns what the input side and the user calls queued (an RST,
a SYN or SYN-ACK, an ACK owed, duplicate ACKs, a fast retransmit, a window probe) and the
send buffer into segments, within the guest's window; :meth:`~Output.get_timer` and
:meth:`~Output.handle_timer` are the timers (delayed ACK, retransmission, persist, linger and
TIME-WAIT, RFC 9293 3.10.8). See "Sending" and "Delayed ACK" in :mod:`aioslirp.tcp.connection`.
"""

from __future__ import annotations

from ..wire.tcp import ACK, FIN, PSH, SYN, Segment
from .seq import SEQ_HALF as _HALF
from .seq import SEQ_MASK as _MASK
from .tcb import (CLOSED, CLOSING, LAST_ACK, LISTEN, MAX_DUPACKS_OUT, SENDING, SYN_RECEIVED, SYN_SENT, TIME_WAIT,
                  Tcb)

__all__ = ["Output"]


class Output(Tcb):
    """Segments out and timers (see the module docstring)."""

    __slots__ = ()


    def segments_to_send(self, now: float) -> list[Segment]:
        """Everything due now, in order: RST, SYN/SYN-ACK, fast retransmit, data, FIN,
        window probe, and at most one pure ACK (only if nothing else carried it).

        Payloads are memoryviews valid until the next call into the connection.
        """
        out: list[Segment] = []
        sq = self._sq
        if sq.views:
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
            if state not in SENDING:
                return out
            off = (self.snd_nxt - self.snd_una) & _MASK
            sqlen = len(sq)
            if off > sqlen or (off == sqlen and not self._fin_queued):
                return out

        wnd = self._window_field()
        ack = self.rcv_nxt
        n0 = len(out)
        if state in SENDING:
            self._output(out, now, ack, wnd)
        if self._probe_pending:
            self._probe_pending = False
            off = (self.snd_nxt - self.snd_una) & _MASK
            if self.snd_wnd == 0 and off < len(sq) and state in SENDING:
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
        if (field << shift) < cur and ((field + 1) << shift) <= avail:
            field += 1  # round up rather than retract the edge already advertised, within the buffer
        # Otherwise the scaled field retracts the edge by less than 2**shift bytes (RFC 7323
        # appendix F): rounding up past the buffer would move the edge right on every ACK, for
        # ever. Segments up to the edge advertised before (_rcv_adv) are still accepted.
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
        if self.state not in SENDING or self.snd_wnd != 0:
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
