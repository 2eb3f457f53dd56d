"""Local DNS records (``--dns-record NAME=ADDR``, ``NetworkConfig.dns_records``): parsing and checks.

The virtual DNS answers these names itself (A for IPv4 addresses, AAAA for IPv6, RFC 1035 3.2.2 /
RFC 3596), never asks an upstream for them, and does not put them under the egress policy's name
denials (:mod:`aioslirp.services.dns_local`). Unless the user names it, :data:`HOST_NAME` is the
gateway (both families), the way ``host.docker.internal`` / ``host.containers.internal`` are.
"""

from __future__ import annotations

import ipaddress

from ..errors import ConfigError

__all__ = ["HOST_NAME", "check_name", "parse_dns_record", "parse_dns_records"]

#: The name of the host (the gateway) answered by default.
HOST_NAME = "host.aioslirp.internal"


def check_name(text, field_name: str) -> str:
    """``text`` as a DNS name: lower case, no trailing dot. Raises :class:`ConfigError` naming
    ``field_name`` unless it has 1-127 labels of 1-63 letters, digits, ``-`` or ``_`` (253
    characters at most, RFC 1035 2.3.4) and is not an address."""
    name = str(text).strip().rstrip(".").lower()
    labels = name.split(".")
    if not name or len(name) > 253 or not all(
            0 < len(lb) <= 63 and all(c.isascii() and (c.isalnum() or c in "-_") for c in lb) for lb in labels):
        raise ConfigError(field_name, f"{text!r} is not a DNS name")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name
    raise ConfigError(field_name, f"{text!r} is an address, not a DNS name")


def _address(value, name: str, field_name: str):
    try:
        a = ipaddress.ip_address(str(value).strip().strip("[]"))
    except ValueError:
        raise ConfigError(field_name, f"{name}: {value!r} is not an IPv4 or IPv6 address") from None
    if a.is_unspecified or a.is_multicast:
        raise ConfigError(field_name, f"{name}: {a} is not a unicast address")
    return a


def parse_dns_record(text: str, field_name: str = "--dns-record") -> tuple[str, object]:
    """``"NAME=ADDR"`` -> ``(name, ipaddress address)``. Raises :class:`ConfigError` naming
    ``field_name`` (one line) for a missing ``=``, a bad name or a bad address."""
    name, sep, addr = str(text).partition("=")
    if not sep:
        raise ConfigError(field_name, f"{text!r} is not NAME=ADDR (like host.aioslirp.internal=10.0.2.2)")
    name = check_name(name, field_name)
    return name, _address(addr, name, field_name)


def parse_dns_records(records, field_name: str = "dns_records") -> dict:
    """``{name: address or [addresses]}`` (or an iterable of ``"NAME=ADDR"`` / ``(name, addr)``)
    -> ``{name: (ipaddress addresses, deduplicated, in order)}``. Raises :class:`ConfigError`
    naming ``field_name``."""
    out: dict = {}
    if records is None:
        return out
    if isinstance(records, dict):
        items = []
        for name, addrs in records.items():
            if isinstance(addrs, (str, bytes, ipaddress.IPv4Address, ipaddress.IPv6Address)):
                addrs = [addrs]
            try:
                items.extend((name, a) for a in addrs)
            except TypeError:
                raise ConfigError(field_name, f"{name!r}: {addrs!r} is not an address or a list of them") from None
    elif isinstance(records, str):
        raise ConfigError(field_name, f"{records!r}: a dict {{name: address}} is needed")
    else:
        items = []
        for item in records:
            if isinstance(item, str):
                items.append(parse_dns_record(item, field_name))
            else:
                try:
                    items.append(tuple(item))
                except TypeError:
                    raise ConfigError(field_name, f"{item!r} is not NAME=ADDR") from None
    for item in items:
        if len(item) != 2:
            raise ConfigError(field_name, f"{item!r} is not a (name, address) pair")
        name = check_name(item[0], field_name)
        a = _address(item[1], name, field_name)
        have = out.setdefault(name, [])
        if a not in have:
            have.append(a)
    return {n: tuple(v) for n, v in out.items()}
