"""The IPv6 half of the stack moved to :mod:`aioslirp.dispatch.ipv6` (IPv6 input: NDP, MLD,
local echo, the RA task) and :mod:`aioslirp.dispatch.family` (IPv6 output); TCP and UDP are
dispatched once for both families by :mod:`aioslirp.dispatch.l4`. This module keeps the old
import path of :class:`Ipv6Path`."""

from .dispatch.ipv6 import Ipv6Path

__all__ = ["Ipv6Path"]
