"""One token bucket, for every rate the stack limits.

Used for the new-flow rate of :class:`aioslirp.limits.Guard` (``new_flow_rate`` /
``new_flow_burst``) and for the ICMP and ICMPv6 errors the stack sends, one bucket per family
(RFC 4443 2.4 (f), RFC 1812 4.3.2.8). The caller passes the time, in seconds on any one
monotonic clock, so the bucket never reads a clock itself.
"""

from __future__ import annotations

__all__ = ["ICMP_ERROR_BURST", "ICMP_ERROR_RATE", "TokenBucket"]

#: The rate limit of the ICMP and ICMPv6 errors we send: errors per second, and the burst
#: (the defaults of :class:`TokenBucket`).
ICMP_ERROR_RATE, ICMP_ERROR_BURST = 100.0, 50.0


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved; :meth:`take` spends one.

    The bucket starts full. ``now`` (seconds) is the time of that full bucket; ``None`` (the
    default) starts its clock at the first :meth:`take`. ``rate`` and ``burst`` default to the
    ICMP error limit (:data:`ICMP_ERROR_RATE`, :data:`ICMP_ERROR_BURST`).
    """

    __slots__ = ("rate", "burst", "tokens", "stamp")

    rate: float
    burst: float
    tokens: float
    stamp: float | None

    def __init__(self, rate: float = ICMP_ERROR_RATE, burst: float = ICMP_ERROR_BURST,
                 now: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        #: Time of the last refill (seconds), ``None`` until the first :meth:`take`.
        self.stamp = now

    def take(self, now: float) -> bool:
        """Spend one token at time ``now`` (seconds, the clock the caller always uses).

        Returns True when there was one, False when the bucket is empty (the event is over the rate).
        """
        stamp = self.stamp
        self.stamp = now
        tokens = self.tokens
        if stamp is not None:
            tokens += (now - stamp) * self.rate
            if tokens > self.burst:
                tokens = self.burst
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True

    #: The name the ICMP error paths use (``stack.icmp_errors.allow(now)``): the same method.
    allow = take
