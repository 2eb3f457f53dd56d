"""IPv6 settings of the virtual network (RFC 4861 router variables, RFC 4862 SLAAC, RFC 8106 RDNSS).

Defaults follow slirp/QEMU: prefix ``fd00::/64``, gateway ``fd00::2`` (also reaches the host's
``::1``), DNS ``fd00::3``. The guest configures itself by SLAAC from our Router Advertisements
(prefix with the A flag, M=0) and asks stateless DHCPv6 for DNS (O=1).

The user-facing fields (``ipv6``, ``cidr6``, ``gateway6``, ``dns6``) live in
:class:`~aioslirp.config.NetworkConfig`; :meth:`Ipv6Config.from_network` builds the validated
:class:`Ipv6Config` the stack's IPv6 services use from them (plus the MTU and search domains),
and carries the router variables (lifetimes, RA interval) that have no option of their own.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ..errors import ConfigError, host_address, not_a_network

__all__ = ["Ipv6Config"]

_LOOPBACK6 = "::1"
_SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")


@dataclass
class Ipv6Config:
    """Validated IPv6 settings. Construct with keywords, then :meth:`validate` (raises :class:`ConfigError`).

    After validation ``cidr6`` is an :class:`ipaddress.IPv6Network` and ``gateway6`` / ``dns6``
    are :class:`ipaddress.IPv6Address`; the ``*_bytes`` attributes hold the 16-byte forms.
    """

    #: Serve IPv6 at all (``--ipv6/--no-ipv6``). When False the stack drops IPv6 frames.
    ipv6: bool = True
    #: On-link prefix advertised for SLAAC; must be a /64 (RFC 4862 5.5.3 with 64-bit Ethernet interface ids).
    cidr6: str | ipaddress.IPv6Network = "fd00::/64"
    #: Gateway address (answers NDP, ping; TCP/UDP to it reach the host's ``::1``). Default: prefix + 2.
    gateway6: str | ipaddress.IPv6Address | None = None
    #: Virtual DNS server address (RDNSS, DHCPv6 option 23). Default: prefix + 3.
    dns6: str | ipaddress.IPv6Address | None = None
    #: Link MTU in bytes, advertised in the RA MTU option; IPv6 needs at least 1280 (RFC 8200 5).
    mtu: int = 1500
    #: Search domains for the RA DNSSL option (RFC 8106 5.2) and DHCPv6 option 24.
    dns_search: list[str] = field(default_factory=list)
    #: Answer DHCPv6 Information-request and set the RA "O" flag (RFC 4861 4.2, RFC 8415).
    dhcpv6: bool = True
    #: RA Router Lifetime in seconds (AdvDefaultLifetime, 0-9000, RFC 4861 6.2.1).
    router_lifetime: int = 1800
    #: MaxRtrAdvInterval in seconds (4-1800); unsolicited RAs come every [max/3, max] seconds.
    ra_interval: float = 600.0
    #: Prefix valid / preferred lifetimes in seconds (RFC 4861 4.6.2).
    valid_lifetime: int = 86400
    preferred_lifetime: int = 14400
    #: RDNSS / DNSSL lifetime in seconds; ``None``: 3 x ``ra_interval`` (RFC 8106 5.1).
    dns_lifetime: int | None = None
    #: DHCPv6 Information Refresh Time in seconds (RFC 8415 21.23).
    info_refresh_time: int = 86400

    def validate(self) -> "Ipv6Config":
        """Check every field and normalise addresses. Returns ``self``; raises :class:`ConfigError`."""
        try:
            net = ipaddress.IPv6Network(str(self.cidr6).strip(), strict=False)
        except ValueError:
            raise ConfigError("cidr6", not_a_network(self.cidr6, 6)) from None
        if net.prefixlen != 64:
            raise ConfigError("cidr6", f"prefix /{net.prefixlen} must be /64 for SLAAC")
        if net.is_multicast or net.is_link_local or net.is_loopback:
            raise ConfigError("cidr6", f"{net} is not a unicast prefix")
        self.cidr6 = net
        self.gateway6 = host_address("gateway6", self.gateway6, net, 2)
        self.dns6 = host_address("dns6", self.dns6, net, 3)
        if self.gateway6 == self.dns6:
            raise ConfigError("dns6", "gateway6 and dns6 must differ")
        if not isinstance(self.mtu, int) or not 1280 <= self.mtu <= 65520:
            raise ConfigError("mtu", f"{self.mtu!r} is below the IPv6 minimum of 1280 (or above 65520); "
                              "raise the MTU or turn IPv6 off")
        if not 0 <= int(self.router_lifetime) <= 9000:
            raise ConfigError("router_lifetime", f"{self.router_lifetime!r} is out of range 0-9000")
        if not 4 <= float(self.ra_interval) <= 1800:
            raise ConfigError("ra_interval", f"{self.ra_interval!r} is out of range 4-1800")
        if self.router_lifetime and self.router_lifetime < self.ra_interval:
            raise ConfigError("router_lifetime", "must be at least ra_interval (RFC 4861 6.2.1)")
        if not 0 < int(self.preferred_lifetime) <= int(self.valid_lifetime) <= 0xFFFFFFFF:
            raise ConfigError("preferred_lifetime", "need 0 < preferred_lifetime <= valid_lifetime")
        if self.dns_lifetime is not None and not 0 <= int(self.dns_lifetime) <= 0xFFFFFFFF:
            raise ConfigError("dns_lifetime", "out of range")
        if not 600 <= int(self.info_refresh_time) <= 0xFFFFFFFF:
            raise ConfigError("info_refresh_time", "must be at least 600 (RFC 8415 21.23)")
        self.dns_search = [str(d) for d in self.dns_search]
        return self

    @classmethod
    def from_network(cls, cfg, **overrides) -> "Ipv6Config":
        """A validated :class:`Ipv6Config` taking ``ipv6``, ``cidr6``, ``gateway6``, ``dns6``, ``mtu``
        and ``dns_search`` from ``cfg`` (a NetworkConfig), then ``overrides``. Raises :class:`ConfigError`."""
        kw = {"mtu": cfg.mtu, "dns_search": list(cfg.dns_search)}
        for name in ("ipv6", "cidr6", "gateway6", "dns6"):
            if hasattr(cfg, name):
                kw[name] = getattr(cfg, name)
        kw.update(overrides)
        return cls(**kw).validate()

    # ------------------------------------------------------------------ derived values
    @property
    def prefix_bytes(self) -> bytes:
        """The 16-byte network address of ``cidr6``."""
        return self.cidr6.network_address.packed  # type: ignore[union-attr]

    @property
    def gateway6_bytes(self) -> bytes:
        return self.gateway6.packed  # type: ignore[union-attr]

    @property
    def dns6_bytes(self) -> bytes:
        return self.dns6.packed  # type: ignore[union-attr]

    @property
    def rdnss_lifetime(self) -> int:
        """Lifetime in seconds for RDNSS/DNSSL options: ``dns_lifetime`` or 3 x ``ra_interval``."""
        return int(self.dns_lifetime) if self.dns_lifetime is not None else int(3 * self.ra_interval)

    def in_prefix(self, addr: bytes) -> bool:
        """True when the 16-byte ``addr`` is inside ``cidr6`` (the first 8 bytes match)."""
        return addr[:8] == self.prefix_bytes[:8]

    def check_guest_source(self, src: bytes) -> str | None:
        """``None`` when ``src`` is an acceptable source for a guest packet, else a drop reason.

        Accepted: an address in ``cidr6`` other than the subnet-router anycast (prefix::0,
        RFC 4291 2.6.1), ``gateway6`` and ``dns6``; or a link-local ``fe80::/64`` address. The
        unspecified address is the caller's to allow (DAD and MLD use it) or refuse.
        """
        if self.in_prefix(src):
            if src == self.prefix_bytes or src == self.gateway6_bytes or src == self.dns6_bytes:
                return "ipv6_spoofed_src"
            return None
        if src[:8] == b"\xfe\x80\x00\x00\x00\x00\x00\x00":
            return None
        return "ipv6_bad_src"

    def remote_for(self, dst: bytes, host_loopback: bool = True) -> str | None:
        """Host address (text) that a guest destination ``dst`` (16 bytes) maps to, or ``None``.

        ``gateway6`` -> ``"::1"`` when ``host_loopback``; other addresses of our prefix, the DNS
        address (served locally), multicast, link-local, loopback, unspecified, IPv4-mapped
        (``::ffff:0:0/96``), IPv4-compatible and site-local (``fec0::/10``) -> ``None``; any
        other address -> itself (NAT through the host's IPv6 routing).
        """
        if dst == self.gateway6_bytes:
            return _LOOPBACK6 if host_loopback else None
        if self.in_prefix(dst):
            return None
        a = ipaddress.IPv6Address(bytes(dst))
        if (a.is_multicast or a.is_link_local or a.is_loopback or a.is_unspecified or a.ipv4_mapped is not None
                or dst[:12] == bytes(12) or a in _SITE_LOCAL):
            return None
        return a.compressed
