"""Token buckets, for every rate the stack limits.

:class:`TokenBucket` (events) is used for the new-flow rate of :class:`aioslirp.flow.guard.Guard` (``new_flow_rate`` /
``new_flow_burst``) and for the ICMP and ICMPv6 errors the stack sends, one bucket per family
(RFC 4443 2.4 (f), RFC 1812 4.3.2.8). The caller passes the time, in seconds on any one
monotonic clock, so the bucket never reads a clock itself. :class:`ByteBucket` (bytes) caps
the guest's traffic each way (``rate_up`` / ``rate_down``, ``--rate-limit``).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ByteBucket", "EventLimiter", "ICMP_ERROR_BURST", "ICMP_ERROR_RATE", "TokenBucket", "byte_burst"]

#: The rate limit of the ICMP and ICMPv6 errors we send: errors per second, and the burst
#: (the defaults of :class:`TokenBucket`).
ICMP_ERROR_RATE, ICMP_ERROR_BURST = 100.0, 50.0


class EventLimiter(Protocol):
    """What the ICMP error paths ask of their rate limiter (``family.err_bucket``): a
    :class:`TokenBucket`, or anything with its :meth:`~TokenBucket.allow` (a test's frozen clock)."""

    def allow(self, now: float) -> bool:
        """One more event at ``now`` (seconds): True when within the rate."""
        ...


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

    def allow(self, now: float) -> bool:
        """The name the ICMP error paths use (``family.err_bucket.allow(now)``): :meth:`take`.
        (A method, not ``allow = take``: mypyc compiles no method alias in a class body.)"""
        return self.take(now)


#: Smallest bucket depth of a byte rate, bytes (:func:`byte_burst`).
MIN_BYTE_BURST = 64 * 1024
#: Bucket depth of a byte rate in seconds of that rate, when that is more than MIN_BYTE_BURST.
BYTE_BURST_SECONDS = 0.010

def byte_burst(rate: float) -> float:
    """The bucket depth for a byte rate of ``rate`` bytes/s: the larger of
    :data:`MIN_BYTE_BURST` (64 KiB) and :data:`BYTE_BURST_SECONDS` (10 ms) of the rate, bytes."""
    return max(float(MIN_BYTE_BURST), rate * BYTE_BURST_SECONDS)


class ByteBucket:
    """A byte-rate cap: ``rate`` bytes per second, at most ``burst`` bytes saved (default
    :func:`byte_burst`), one per direction per guest (``rate_up``, ``rate_down``).

    Two ways of spending, both given the time ``now`` (seconds, the caller's one monotonic
    clock; the bucket never reads a clock):

    * :meth:`take` for datagrams: all ``n`` bytes or none (False: over the cap, drop it);
    * :meth:`spend` for a stream paced without loss: the bytes were moved (or are about to
      be), the balance may go below zero, and :meth:`wait` says how long the stream must
      hold off (seconds) until it is back to zero. A stream that sends only while
      :meth:`wait` is 0 passes at most ``burst`` + one chunk + ``rate * t`` bytes in any
      ``t`` seconds.

    The bucket starts full.
    """

    __slots__ = ("rate", "burst", "tokens", "stamp")

    rate: float
    burst: float
    #: Bytes that may pass now (negative: a debt of a stream, paid back at ``rate``).
    tokens: float
    #: Time of the last refill (seconds), ``None`` until first used.
    stamp: float | None

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else byte_burst(self.rate)
        self.tokens = self.burst
        self.stamp = None

    def _refill(self, now: float) -> float:
        # The stamp never moves back: a caller may pass a time older than the last one (a batch's
        # time after a fresh read of the clock), and moving the stamp back to it would refill the
        # interval between them twice (a stream paced over its cap: +20-35% seen).
        stamp = self.stamp
        tokens = self.tokens
        if stamp is None:
            self.stamp = now
        elif now > stamp:
            self.stamp = now
            tokens += (now - stamp) * self.rate
            if tokens > self.burst:
                tokens = self.burst
            self.tokens = tokens
        return tokens

    def available(self, now: float) -> float:
        """Bytes that may pass at ``now`` (<= 0: none)."""
        return self._refill(now)

    def take(self, n: float, now: float) -> bool:
        """Spend ``n`` bytes at ``now`` if the bucket holds them: True; else False and nothing spent."""
        tokens = self._refill(now)
        if tokens < n:
            return False
        self.tokens = tokens - n
        return True

    def spend(self, n: float, now: float) -> None:
        """``n`` bytes passed at ``now``, whatever the balance (it may go negative)."""
        self.tokens = self._refill(now) - n

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until the balance is back above zero (0.0: it is)."""
        tokens = self._refill(now)
        return 0.0 if tokens > 0 else (1.0 - tokens) / self.rate
