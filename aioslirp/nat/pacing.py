"""What a :class:`~aioslirp.nat.tcp.TcpFlow` reports about itself at its end, and its pacing
under the guest's rate caps (``--rate-limit``) and fair shares (:mod:`aioslirp.fair`):
:class:`FlowPacing`, a mixin of ``TcpFlow``.

Rate caps: ``rate_up`` / ``rate_down`` are the guest's shared
:class:`~aioslirp.ratelimit.ByteBucket` each way. Towards the host, guest bytes are written
only while the bucket holds at least min(queued, :data:`RATE_MIN_WRITE`) bytes; the rest waits
in the connection (its receive window closes) and a loop timer writes it once the bucket has
refilled. Towards the guest, each host read is at most what the bucket holds (at least 4 KiB,
see :class:`~aioslirp.nat.hostsock.HostSocket`), it is spent from the bucket, and reading pauses
while the bucket is in debt, resumed by the same timer. Nothing is dropped.

Fair shares: the bytes moved each way are charged to the guest's ``share_up`` / ``share_down``
(:class:`~aioslirp.fair.Share`); when a charge says the guest is over its share, the flow stops
reading (``share_paused``) or writing (``share_held``) and the loop's scheduler calls it back on
the guest's turn (one turn callback per direction, each a bound method of the flow's pacing).
"""

from __future__ import annotations

import logging

__all__ = ["FlowPacing", "RATE_MIN_WRITE"]

log = logging.getLogger("aioslirp.tcp")

#: Smallest write towards the host a rate-capped flow waits for (bytes), unless less is queued.
RATE_MIN_WRITE = 16384


class FlowPacing:
    """Mixin of :class:`~aioslirp.nat.tcp.TcpFlow` (whose slots it uses: ``conn``, ``loop``,
    ``ctx``, ``transport``, ``rate_up``, ``rate_down``, ``rate_paused``, ``_rate_timer``,
    ``_rate_at``, ``_outcome``, ``_finished``...)."""

    __slots__ = ()

    _outcome: str | None  # TcpFlow's slot

    @property
    def bytes_up(self) -> int:
        """Payload bytes accepted in order from the guest."""
        return self.conn.bytes_received

    @property
    def bytes_down(self) -> int:
        """Payload bytes sent to the guest (retransmissions excluded)."""
        return self.conn.bytes_sent

    @property
    def outcome(self) -> str:
        """How the flow ended (see :class:`~aioslirp.flow.base.Flow`): ``"refused"``,
        ``"unreachable"``, ``"timeout"``, ``"evicted"`` when set on the way, else ``"reset"`` or
        ``"closed"`` from the connection."""
        return self._outcome or ("reset" if self.conn.reset else "closed")

    @outcome.setter
    def outcome(self, value: str) -> None:
        self._outcome = value

    # ----------------------------------------------------------------- rate caps
    def _rate_cut(self, rate, data):
        """``data`` cut to what the ``rate_up`` bucket holds, or ``None`` (nothing now: a wake-up
        is armed). Waits for at least min(len(data), 16 KiB) so that writes are not tiny."""
        now = self.loop.time()
        room = rate.available(now)
        need = len(data) if len(data) < RATE_MIN_WRITE else RATE_MIN_WRITE
        if room < need:
            if self._rate_timer is None:  # (counted once per hold)
                self.ctx.counters["tcp_rate_held_up"] += 1
            self._rate_wake(now + (need - room) / rate.rate)
            return None
        return data if room >= len(data) else data[:int(room)]

    def _rate_wake(self, at: float) -> None:
        """Make sure :meth:`_on_rate_timer` runs by loop time ``at``."""
        if self._rate_timer is not None:
            if self._rate_at <= at:
                return
            self._rate_timer.cancel()
        self._rate_at = at
        self._rate_timer = self.loop.call_at(at, self._on_rate_timer)

    def _on_rate_timer(self) -> None:
        self._rate_timer = None
        if self._finished:
            return
        try:
            now = self.loop.time()
            if self.rate_paused:
                wait = self.rate_down.wait(now)
                if wait > 0:  # other flows spent the refill meanwhile
                    self._rate_wake(now + wait)
                else:
                    self.rate_paused = False
                    tr = self.transport
                    if tr is not None and not self.host_closed and not self.reading_paused and not self.share_paused:
                        tr.resume_reading()
            self.flush(now)
        except Exception:
            log.exception("TCP flow %s rate timer failed", self.key)
            self.failed_internally()

    # ----------------------------------------------------------------- fair shares (aioslirp.fair)
    def _share_down_turn(self) -> None:
        """The guest's turn to read from the host again (the fair scheduler's pass)."""
        self.share_paused = False
        if self._finished:
            return
        try:
            tr = self.transport
            if tr is not None and not self.host_closed and not self.reading_paused and not self.rate_paused:
                tr.resume_reading()
        except Exception:
            log.exception("TCP flow %s: resuming its host reads failed", self.key)
            self.failed_internally()

    def _share_up_turn(self) -> None:
        """The guest's turn to write to the host again (the fair scheduler's pass)."""
        self.share_held = False
        if self._finished:
            return
        try:
            self.flush(self.loop.time())
        except Exception:
            log.exception("TCP flow %s: writing to the host on its turn failed", self.key)
            self.failed_internally()
