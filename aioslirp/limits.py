"""Bounds on what a guest may make the stack hold: the ``--limit`` fields and a token bucket.

Admission control (:class:`Guard`, :data:`DENIED`, :func:`fd_budgets`, :data:`FD_RESERVE`...)
lives in :mod:`aioslirp.flow.guard` and is re-exported here; its theory of operation is there.
Idle flows are reset or closed by the flow table's sweep (:mod:`aioslirp.flow.table`).
"""

from __future__ import annotations

import time

# Admission control moved to aioslirp.flow.guard; these names stay importable from here.
from .flow.guard import DENIED, FD_RESERVE, PRUNE_INTERVAL, Guard, fd_budgets, raise_fd_limit

__all__ = ["DENIED", "FD_RESERVE", "PRUNE_INTERVAL", "Guard", "LIMIT_FIELDS", "TokenBucket", "fd_budgets",
           "parse_limits", "raise_fd_limit"]


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved; :meth:`take` spends one (False: empty)."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float, now: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = time.monotonic() if now is None else now

    def take(self, now: float) -> bool:
        tokens = self.tokens + (now - self.stamp) * self.rate
        self.stamp = now
        if tokens > self.burst:
            tokens = self.burst
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True


#: ``NetworkConfig`` fields that ``--limit NAME=VALUE`` may set, with their types.
LIMIT_FIELDS = {
    "max_flows": int, "max_tcp_flows": int, "max_udp_flows": int, "max_icmp_flows": int,
    "max_pending_connects": int, "new_flow_rate": float, "new_flow_burst": int, "dns_max_inflight": int,
    "inject_queue_size": int, "tcp_buffer": int, "tcp_connect_timeout": float, "tcp_idle_timeout": float,
    "tcp_linger": float, "udp_idle_timeout": float, "icmp_idle_timeout": float,
    "reassembly_max_datagrams": int, "reassembly_max_fragments": int, "reassembly_max_bytes": int,
    "reassembly_timeout": float,
}


def parse_limits(values) -> dict:
    """``["max_flows=4096", "new_flow_rate=0"]`` -> ``{"max_flows": 4096, "new_flow_rate": 0.0}``.

    Raises :class:`~aioslirp.config.ConfigError` naming ``--limit`` for an unknown name or a bad number.
    """
    from .config import ConfigError

    out: dict = {}
    for text in values or ():
        name, sep, value = str(text).partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in LIMIT_FIELDS:
            raise ConfigError("--limit", f"{text!r}: expected NAME=VALUE with NAME one of {', '.join(LIMIT_FIELDS)}")
        kind = LIMIT_FIELDS[name]
        try:
            out[name] = kind(value.strip())
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ConfigError("--limit", f"{text!r}: {value.strip()!r} is not {what}") from None
    return out
