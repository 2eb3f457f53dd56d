"""Network configuration of one :class:`~aioslirp.Stack`.

All addresses default to the slirp/QEMU user-networking layout (``10.0.2.0/24``,
gateway ``10.0.2.2``, DNS ``10.0.2.3``, guest ``10.0.2.15``) so that guests and
tools written for libslirp, slirp4netns or passt work unchanged.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

__all__ = ["ConfigError", "NetworkConfig", "parse_hostport"]

#: Locally administered MAC used by the virtual gateway and DNS (slirp's 52:55:<IPv4 of the gateway>).
DEFAULT_GATEWAY_MAC = "52:55:0a:00:02:02"


class ConfigError(ValueError):
    """A configuration value is invalid. ``str(err)`` is one line naming the field."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


def parse_hostport(text: str, default_port: int, field_name: str) -> tuple[str, int]:
    """Parse ``ADDR``, ``ADDR:PORT``, ``[V6ADDR]:PORT`` or a bare IPv6 address.

    Returns ``(address, port)``. Raises :class:`ConfigError` naming ``field_name``.
    """
    text = text.strip()
    host, port = text, default_port
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ConfigError(field_name, f"unterminated '[' in {text!r}")
        host = text[1:end]
        rest = text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(field_name, f"expected ':PORT' after ']' in {text!r}")
            port = _port(rest[1:], field_name)
    elif text.count(":") == 1:
        host, p = text.split(":")
        port = _port(p, field_name)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(field_name, f"{host!r} is not an IP address") from None
    return host, port


def _port(text: str, field_name: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ConfigError(field_name, f"port {text!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise ConfigError(field_name, f"port {port} is out of range 1-65535")
    return port


@dataclass
class NetworkConfig:
    """Validated settings of the virtual network.

    Construct with keyword arguments, then call :meth:`validate` (``Stack`` does it
    for you). Addresses may be given as strings; after validation they are
    :mod:`ipaddress` objects. Raises :class:`ConfigError` naming the bad field.
    """

    #: IPv4 network of the virtual LAN (``--cidr``).
    cidr: str | ipaddress.IPv4Network = "10.0.2.0/24"
    #: Gateway address; reaches host loopback unless ``disable_host_loopback``. Default: network + 2.
    gateway: str | ipaddress.IPv4Address | None = None
    #: Virtual DNS server address. Default: network + 3.
    dns: str | ipaddress.IPv4Address | None = None
    #: First DHCP lease, also the address ``aioslirp run`` gives the namespace. Default: network + 15.
    guest: str | ipaddress.IPv4Address | None = None
    #: MTU of the guest link in bytes (576-65520; ``--mtu``).
    mtu: int = 1500
    #: Refuse guest traffic to the gateway that would reach host loopback (``--disable-host-loopback``).
    disable_host_loopback: bool = False
    #: DNS upstreams as ``(address, port)``; ``None`` reads ``/etc/resolv.conf`` (``--dns``).
    dns_upstreams: list[tuple[str, int]] | None = None
    #: Search domains handed out by DHCP (option 119) and written to the namespace's resolv.conf.
    dns_search: list[str] = field(default_factory=list)
    #: DHCP lease time in seconds.
    lease_time: int = 86400
    #: MAC address of the gateway / DNS.
    gateway_mac: str = DEFAULT_GATEWAY_MAC
    #: Seconds to wait for a host ``connect()`` before answering the guest's SYN with ICMP unreachable.
    tcp_connect_timeout: float = 10.0
    #: Seconds a flow may stay in FIN-WAIT-2 / LAST-ACK / CLOSING before it is freed.
    tcp_linger: float = 60.0
    #: Seconds a TCP flow may carry no segment before it is reset (0 disables).
    tcp_idle_timeout: float = 7200.0
    #: Seconds without a datagram before a UDP flow's host socket is closed.
    udp_idle_timeout: float = 60.0
    #: Seconds without an echo before an ICMP flow is closed.
    icmp_idle_timeout: float = 10.0
    #: Upper bound on simultaneously tracked flows (all protocols).
    max_flows: int = 16384
    #: Bytes buffered from the host socket per TCP flow towards the guest (and our receive window).
    tcp_buffer: int = 1 << 20
    #: Frames the inject queue holds before producers wait.
    inject_queue_size: int = 4096
    #: Seconds a DNS query waits for one upstream before trying the next.
    dns_timeout: float = 2.0
    #: Serve IPv6 too (``--ipv6/--no-ipv6``): RAs for SLAAC, NDP, DHCPv6, ICMPv6, TCP/UDP NAT over IPv6.
    #: Needs ``mtu >= 1280`` (RFC 8200 section 5). When False the stack drops IPv6 frames.
    ipv6: bool = True
    #: IPv6 prefix of the virtual LAN, advertised for SLAAC; must be a /64 (RFC 4862 5.5.3).
    cidr6: str | ipaddress.IPv6Network = "fd00::/64"
    #: IPv6 gateway; reaches the host's ``::1`` unless ``disable_host_loopback``. Default: prefix + 2.
    gateway6: str | ipaddress.IPv6Address | None = None
    #: IPv6 virtual DNS server (RA RDNSS option, DHCPv6). Default: prefix + 3.
    dns6: str | ipaddress.IPv6Address | None = None

    def validate(self) -> "NetworkConfig":
        """Check every field and normalise addresses. Returns ``self``; raises :class:`ConfigError`."""
        try:
            net = ipaddress.IPv4Network(str(self.cidr), strict=False)
        except ValueError as exc:
            raise ConfigError("cidr", str(exc)) from None
        if net.prefixlen > 29:
            raise ConfigError("cidr", f"prefix /{net.prefixlen} is too small (at most /29)")
        self.cidr = net

        def addr(name: str, value, offset: int) -> ipaddress.IPv4Address:
            if value is None:
                return net.network_address + offset
            try:
                a = ipaddress.IPv4Address(str(value))
            except ValueError as exc:
                raise ConfigError(name, str(exc)) from None
            if a not in net or a in (net.network_address, net.broadcast_address):
                raise ConfigError(name, f"{a} is not a host address in {net}")
            return a

        self.gateway = addr("gateway", self.gateway, 2)
        self.dns = addr("dns", self.dns, 3)
        self.guest = addr("guest", self.guest, 15 if net.num_addresses > 16 else 4)
        if len({self.gateway, self.dns, self.guest}) != 3:
            raise ConfigError("guest", "gateway, dns and guest addresses must differ")
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65520:
            raise ConfigError("mtu", f"{self.mtu!r} is out of range 576-65520")
        if self.dns_upstreams is not None:
            ups = []
            for item in self.dns_upstreams:
                if isinstance(item, str):
                    item = parse_hostport(item, 53, "dns")
                ups.append((str(ipaddress.ip_address(item[0])), int(item[1])))
            self.dns_upstreams = ups
        parts = self.gateway_mac.split(":")
        if len(parts) != 6 or not all(len(p) == 2 for p in parts):
            raise ConfigError("gateway_mac", f"{self.gateway_mac!r} is not a MAC address")
        try:
            bytes.fromhex("".join(parts))
        except ValueError:
            raise ConfigError("gateway_mac", f"{self.gateway_mac!r} is not a MAC address") from None
        for name in ("lease_time", "max_flows", "tcp_buffer", "inject_queue_size"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(name, "must be positive")
        for name in ("tcp_connect_timeout", "tcp_linger", "udp_idle_timeout", "icmp_idle_timeout", "dns_timeout"):
            if float(getattr(self, name)) <= 0:
                raise ConfigError(name, "must be positive")
        if float(self.tcp_idle_timeout) < 0:
            raise ConfigError("tcp_idle_timeout", "must not be negative")
        self.ipv6 = bool(self.ipv6)
        if self.ipv6:
            from .config6 import Ipv6Config

            c6 = Ipv6Config.from_network(self)
            self.cidr6, self.gateway6, self.dns6 = c6.cidr6, c6.gateway6, c6.dns6
        return self

    @property
    def gateway_mac_bytes(self) -> bytes:
        """The gateway MAC as 6 bytes."""
        return bytes.fromhex(self.gateway_mac.replace(":", ""))

    @property
    def netmask(self) -> ipaddress.IPv4Address:
        return self.cidr.netmask  # type: ignore[union-attr]
