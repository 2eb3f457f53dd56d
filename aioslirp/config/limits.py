"""``--limit NAME=VALUE``: the resource bounds of :class:`~aioslirp.config.NetworkConfig` that
the command line may set, and their parsing.

The bounds themselves are enforced by :class:`aioslirp.flow.guard.Guard` (admission of new flows)
and the stack (see ``docs/security.md``); this module only turns text into typed values.
"""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["LIMIT_FIELDS", "parse_limits"]

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
