"""The shared switch: several guests on one virtual L2 network, each behind a stack of its own
(:class:`Switch`, :class:`GuestPort`; the sans-IO switching rules: :mod:`aioslirp.switch.l2`).
See docs/switch.md."""

from .guests import GuestPort, Switch

__all__ = ["Switch", "GuestPort"]
