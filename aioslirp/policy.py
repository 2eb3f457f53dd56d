"""Old import path of the egress policy (now :mod:`aioslirp.config.policy`, where its theory of
operation is)."""

from .config.policy import DEFAULT_DENY, EgressPolicy, parse_rules

__all__ = ["DEFAULT_DENY", "EgressPolicy", "parse_rules"]
