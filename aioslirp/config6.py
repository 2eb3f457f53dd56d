"""Old import path of :class:`~aioslirp.config.ipv6.Ipv6Config` (now in :mod:`aioslirp.config.ipv6`)."""

from .config.ipv6 import Ipv6Config

__all__ = ["Ipv6Config"]
