"""Segment arrival (RFC 9293 3.10.7): what a guest segment does to a connection.

:class:`Arrival` is the input half of :class:`~aioslirp.tcp.connection.TcpConnection`, built on
the output half: one chain ``Tcb`` -> ``Output`` -> ``Arrival`` -> ``TcpConnection`` (the method
order of the former ``TcpConnection(Arrival, Output)``, with single inheritance so that the
compiled build makes each a native class, see docs/performance.md). Per
state (3.10.7.1 CLOSED, 3.10.7.2 LISTEN, 3.10.7.3 SYN-SENT, 3.10.7.4 the rest) a segment is
checked and used in the RFC's order; for the synchronized states each check is one method:

1. ``_check_acceptable`` -- sequence number acceptability (first check);
2. ``_on_rst`` -- the RST bit (second; RFC 5961 3.2);
3. ``_on_syn`` -- a SYN in a synchronized state (fourth; RFC 5961 4.2);
4. ``_on_ack`` -- the ACK field, duplicate ACKs, the window update (fifth);
5. ``_on_text`` -- segment text and FIN (seventh and eighth).

(The third check, security, does not apply; the sixth, URG, is ignored.) Nothing here sends:
a segment only queues what :meth:`~aioslirp.tcp.output.Output.segments_to_send` will emit
(an ACK owed, an RST, a retransmission) and events for the glue. Nothing raises on the
segment's content: a segment that cannot be used is counted in ``dropped_segments``.
"""

from __future__ import annotations

from bisect import bisect_left

from ..wire.tcp import ACK, FIN, RST, SYN, Segment
from .seq import SEQ_HALF as _HALF
from .seq import SEQ_MASK as _MASK
from .seq import SEQ_MOD as _MOD
from .tcb import (CLOCK_GRANULARITY, CLOSE_WAIT, CLOSED, CLOSING, DUPACK_THRESHOLD, ESTABLISHED, FIN_WAIT_1,
                  FIN_WAIT_2, LAST_ACK, LISTEN, MAX_OOO_SEGMENTS, MAX_WSCALE, RECEIVING, SYN_RECEIVED, SYN_SENT,
                  SYN_TIMEOUT_RTO, TIME_WAIT, EstablishedEvent, FinEvent)
from .output import Output

__all__ = ["Arrival", "wscale_for"]


def wscale_for(rcv_buf: int) -> int:
    """Smallest shift with ``rcv_buf >> shift <= 65535`` (at most 14), RFC 7323 2.3."""
    shift = 0
    while shift < MAX_WSCALE and (rcv_buf >> shift) > 0xFFFF:
        shift += 1
    return shift


class Arrival(Output):
    """Guest segments in, per RFC 9293 3.10.7 (see the module docstring)."""

    __slots__ = ()

    # ------------------------------------------------------------------ LISTEN, SYN-SENT, CLOSED

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
            self._rcv_wscale = wscale_for(self.rcv_buf)
        self.snd_wnd = seg.wnd
        self._max_snd_wnd = seg.wnd
        self._snd_wl1 = seq
        self.state = SYN_RECEIVED

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

    def _established(self, now: float) -> None:
        self.state = FIN_WAIT_1 if self._fin_queued else ESTABLISHED
        self.established_at = now
        self._events.append(EstablishedEvent())
        if self._syn_rexmit:
            # RFC 6298 5.7: the SYN (or SYN-ACK) timed out and no RTT sample exists.
            self.rto = self._rto_base = min(max(SYN_TIMEOUT_RTO, self.rto_min), self.rto_max)

    # ------------------------------------------------------------------ synchronized states

    def _sync_input(self, seg: Segment, now: float) -> None:
        """RFC 9293 3.10.7.4 for SYN-RECEIVED and every later state: its checks, in order."""
        flags = seg.flags
        if flags & SYN and self.state is SYN_RECEIVED and (seg.seq & _MASK) == self.irs and not flags & (ACK | RST):
            # The guest retransmitted its SYN: our SYN-ACK (if any) was lost.
            if self._accepted:
                self._syn_pending = True
            else:
                self.dropped_segments += 1
            return
        off = self._check_acceptable(seg, now)
        if off is None:
            return
        if flags & RST:
            self._on_rst(off)
        elif flags & SYN:
            self._on_syn()
        elif self._on_ack(seg, now) and (len(seg.payload) or flags & FIN):
            self._on_text(seg, off, now)

    def _check_acceptable(self, seg: Segment, now: float) -> int | None:
        """First check: sequence number acceptability (RFC 9293 3.10.7.4). A zero window still
        accepts a segment starting at RCV.NXT for its ACK/RST/FIN.

        Returns the segment's signed offset from RCV.NXT, or None for an unacceptable segment
        (counted; answered with an ACK unless it is an RST). Any segment but an RST restarts
        TIME-WAIT.
        """
        flags = seg.flags
        rcv_nxt = self.rcv_nxt
        off = (seg.seq - rcv_nxt) & _MASK
        if off >= _HALF:
            off -= _MOD
        wnd = (self._rcv_adv - rcv_nxt) & _MASK
        if wnd >= _HALF:
            wnd = 0
        seglen = len(seg.payload)
        if flags & SYN:
            seglen += 1
        if flags & FIN:
            seglen += 1
        w = wnd or 1
        if seglen:
            ok = off < w and off + seglen > 0
        else:
            ok = 0 <= off < w
        if self.state is TIME_WAIT and not flags & RST:
            # The guest is still talking (it lost our last ACK): restart TIME-WAIT.
            self._linger_at = now + self.time_wait
        if ok:
            return off
        self.dropped_segments += 1
        if not flags & RST:
            self._ack_pending = True
        return None

    def _on_rst(self, off: int) -> None:
        """Second check: RST (RFC 5961 3.2: an exact match resets, otherwise challenge ACK)."""
        state = self.state
        if off == 0:
            # In TIME-WAIT both directions were complete: close, but it is no reset.
            self._teardown(notify=state is not TIME_WAIT, graceful=state is TIME_WAIT)
        else:
            self.dropped_segments += 1
            if self._accepted or state is not SYN_RECEIVED:
                self._ack_pending = True

    def _on_syn(self) -> None:
        """Fourth check: a SYN in a synchronized state draws a challenge ACK (RFC 5961 4.2)."""
        self.dropped_segments += 1
        self._ack_pending = True

    def _on_ack(self, seg: Segment, now: float) -> bool:
        """Fifth check: the ACK field. False: drop the segment (or it closed the connection).

        An ACK of something never sent draws an ACK; one older than the largest window the
        guest offered draws a challenge ACK (RFC 5961 5.2). A duplicate ACK (RFC 5681 2)
        counts towards fast retransmit; an ACK of new data frees the send buffer. Then the
        window update (SND.WL1/SND.WL2 rule).
        """
        flags = seg.flags
        if not flags & ACK:
            self.dropped_segments += 1
            return False
        ack = seg.ack & _MASK
        if self.state is SYN_RECEIVED:
            return self._on_ack_of_syn(seg, ack, now)
        una = self.snd_una
        d = (ack - una) & _MASK
        if d >= _HALF:
            # An old ACK. Too old (RFC 5961 5.2) -> challenge ACK and drop.
            if ((una - ack) & _MASK) > self._max_snd_wnd:
                self.dropped_segments += 1
                self._ack_pending = True
                return False
        else:
            if d == 0:
                # RFC 5681 2: a duplicate ACK acknowledges nothing new, carries no data,
                # leaves the window unchanged, while data is outstanding.
                if (not len(seg.payload) and not flags & (SYN | FIN) and self.snd_max != una
                        and (seg.wnd << self._snd_wscale) == self.snd_wnd):
                    self._dupacks += 1
                    if self._dupacks == DUPACK_THRESHOLD and not self._in_recovery:
                        self._in_recovery = True
                        self._recover = self.snd_max
                        self._rexmit_one = True
                        self._rtt_seq = None  # Karn
            else:
                if d > ((self._ack_limit - una) & _MASK):
                    # Acknowledges something never sent: ACK and drop (RFC 9293).
                    self.dropped_segments += 1
                    self._ack_pending = True
                    return False
                self._new_ack(ack, d, now)
                if self.state is CLOSED:
                    return False
            # Window update (RFC 9293 3.10.7.4 fifth check, SND.WL1/SND.WL2 rule).
            seq = seg.seq & _MASK
            dw = (seq - self._snd_wl1) & _MASK
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
        self._probes_unanswered = 0
        if self.state is FIN_WAIT_2:
            self._linger_at = now + self.linger
        return True

    def _on_ack_of_syn(self, seg: Segment, ack: int, now: float) -> bool:
        """The fifth check in SYN-RECEIVED: the ACK of our SYN-ACK completes the handshake."""
        if not self._accepted or self.snd_max == self.iss or ack != self.snd_max:
            self.dropped_segments += 1
            if self._accepted:
                self._rst = Segment(ack, 0, RST, 0)
            return False
        self._syn_acked(now)
        wnd = seg.wnd << self._snd_wscale
        self.snd_wnd = wnd
        if wnd > self._max_snd_wnd:
            self._max_snd_wnd = wnd
        self._snd_wl1 = seg.seq & _MASK
        self._snd_wl2 = ack
        self._established(now)
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

    def _on_text(self, seg: Segment, off: int, now: float) -> None:
        """Seventh and eighth checks: segment text and FIN (RFC 9293 3.10.7.4), in the window.

        In-order bytes go to the receive queue, out-of-order ones are kept for later (each
        draws a duplicate ACK, RFC 5681 4.2); the ACK is owed at once or delayed (RFC 1122
        4.2.3.2, see "Delayed ACK" in :mod:`aioslirp.tcp.connection`).
        """
        if self.state not in RECEIVING:
            # A FIN was received already: ignore text (RFC 9293 3.10.7.4 seventh check).
            self.dropped_segments += 1
            self._ack_pending = True
            return
        payload = seg.payload
        plen = len(payload)
        rcv_nxt = self.rcv_nxt
        wnd = (self._rcv_adv - rcv_nxt) & _MASK
        if wnd >= _HALF:
            wnd = 0
        fin = seg.flags & FIN
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
        self._events.append(FinEvent())
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
