"""Errors of the configuration layer, the one-line wording of a bad address or network, and the
check of a host address in a network that both families' settings use.

This module sits at the bottom of the package: it imports nothing of aioslirp, so the config
modules (:mod:`aioslirp.config`), the policy and every layer above can raise and catch
:class:`ConfigError` without importing one another.
"""

from __future__ import annotations

import ipaddress
from typing import overload

__all__ = ["ConfigError", "host_address", "not_a_network", "not_an_address"]


class ConfigError(ValueError):
    """A configuration value is invalid. ``str(err)`` is one line naming the field: ``"FIELD:
    DETAIL"`` (``err.field``, ``err.detail``)."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        self.detail = message
        super().__init__(f"{field_name}: {message}")


def not_a_network(value, version: int) -> str:
    """One line saying why ``value`` is not an IPv4 (``version`` 4) or IPv6 network, without
    :mod:`ipaddress`'s wording: names the other family when ``value`` is one of its networks."""
    text = str(value).strip()
    example = "10.0.2.0/24" if version == 4 else "fd00::/64"
    try:
        other = ipaddress.ip_network(text, strict=False).version
    except ValueError:
        other = version
    if other != version:
        return f"{text!r} is an IPv{other} network; an IPv{version} network is needed (like {example})"
    return f"{text!r} is not an IPv{version} network (like {example})"


def not_an_address(value, version: int) -> str:
    """One line saying why ``value`` is not an IPv4 / IPv6 address (no :mod:`ipaddress` wording)."""
    text = str(value).strip()
    try:
        other = ipaddress.ip_address(text).version
    except ValueError:
        other = version
    if other != version:
        return f"{text!r} is an IPv{other} address; an IPv{version} address is needed"
    return f"{text!r} is not an IPv{version} address"


@overload
def host_address(field_name: str, value, net: ipaddress.IPv4Network, offset: int) -> ipaddress.IPv4Address: ...


@overload
def host_address(field_name: str, value, net: ipaddress.IPv6Network, offset: int) -> ipaddress.IPv6Address: ...


def host_address(field_name, value, net, offset):
    """``value`` (text or address; ``None``: ``net``'s network address + ``offset``) as a host
    address of ``net`` (an :class:`ipaddress.IPv4Network` or ``IPv6Network``), in its family.

    Raises :class:`ConfigError` naming ``field_name`` when ``value`` is not an address of
    ``net``'s family (:func:`not_an_address`) or not a host address in ``net``: outside it, its
    network address, or (IPv4) its broadcast address."""
    if value is None:
        return net.network_address + offset
    try:
        a = type(net.network_address)(str(value).strip())
    except ValueError:
        raise ConfigError(field_name, not_an_address(value, net.version)) from None
    if a not in net or a == net.network_address or (net.version == 4 and a == net.broadcast_address):
        raise ConfigError(field_name, f"{a} is not a host address in {net}")
    return a
