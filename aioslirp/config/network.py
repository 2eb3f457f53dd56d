"""Network configuration of one :class:`~aioslirp.Stack`.

All addresses default to the slirp/QEMU user-networking layout (``10.0.2.0/24``,
gateway ``10.0.2.2``, DNS ``10.0.2.3``, guest ``10.0.2.15``) so that guests and
tools written for libslirp, slirp4netns or passt work unchanged.
"""

from __future__ import annotations

import functools
import ipaddress
import warnings
from dataclasses import dataclass, field

from ..errors import ConfigError, host_address, not_a_network
from .ipv6 import Ipv6Config
from .policy import parse_rules
from .upstream import parse_proxy_url
from .rates import parse_rate
from .records import HOST_NAME, parse_dns_records

__all__ = ["ConfigError", "NetworkConfig", "parse_hostport", "TRACE_LEVELS"]

#: Values of :attr:`NetworkConfig.trace_level`, from the least recorded to the most.
TRACE_LEVELS = ("flows", "timeline", "frames")

#: Locally administered MAC used by the virtual gateway and DNS (slirp's 52:55:<IPv4 of the gateway>).
DEFAULT_GATEWAY_MAC = "52:55:0a:00:02:02"


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
    #: Names the virtual DNS answers itself (``--dns-record NAME=ADDR``): ``{name: address or
    #: [addresses]}``, A records for IPv4 addresses, AAAA for IPv6, TTL 60 s; never sent upstream,
    #: not subject to the egress policy's name denials. ``host.aioslirp.internal`` is the gateway
    #: (both families) unless given here. Validated to ``{name: (ipaddress addresses)}``; a
    #: running stack's DNS answers from a new mapping of that shape assigned here (what
    #: :class:`aioslirp.Switch` does as guests join and leave).
    dns_records: dict = field(default_factory=dict)
    #: DHCP lease time in seconds.
    lease_time: int = 86400
    #: Addresses the DHCP pool holds, from ``guest`` up (the gateway and DNS addresses skipped);
    #: ``None``: up to the end of ``cidr``. An :class:`aioslirp.Switch` gives each guest's stack 1:
    #: it hands out that guest's address only.
    dhcp_pool_size: int | None = None
    #: MAC address of the gateway / DNS.
    gateway_mac: str = DEFAULT_GATEWAY_MAC
    #: Seconds to wait for a host ``connect()`` before answering the guest's SYN with ICMP unreachable.
    tcp_connect_timeout: float = 10.0
    #: Seconds of silence a flow may spend in FIN-WAIT-2 (no guest segment) or LAST-ACK / CLOSING
    #: (no ACK of new data) before it is reset; see docs/security.md.
    tcp_linger: float = 60.0
    #: Seconds a TCP flow may carry no segment before it is reset (0 disables).
    tcp_idle_timeout: float = 7200.0
    #: Seconds without a datagram before a UDP flow's host socket is closed.
    udp_idle_timeout: float = 60.0
    #: Seconds without an echo before an ICMP flow is closed.
    icmp_idle_timeout: float = 10.0
    #: Upper bound on simultaneously tracked flows (all protocols).
    max_flows: int = 16384
    #: Open flows per protocol (both address families); a new guest flow beyond is refused
    #: (TCP: RST; UDP/ICMP: dropped), see docs/security.md.
    max_tcp_flows: int = 12288
    max_udp_flows: int = 4096
    max_icmp_flows: int = 1024
    #: Guest TCP SYNs whose host connect() is still in progress; at most a quarter of it towards
    #: one (address, port). Beyond: RST.
    max_pending_connects: int = 1024
    #: New guest flows per second (token bucket refill; 0 disables) and the bucket's size: above the
    #: native data plane's connection rate on one core (about 13,000/s here), so that the bound stops
    #: a storm, not a guest's busy build (docs/security.md).
    new_flow_rate: float = 20000.0
    new_flow_burst: int = 20000
    #: DNS queries being forwarded at once (UDP and TCP); beyond, a query gets no answer.
    dns_max_inflight: int = 512
    #: Egress policy (``--allow`` / ``--deny``): rules ``TARGET[:PORTS][/PROTO]`` (a CIDR, matched against
    #: the host-side address, the gateway being 127.0.0.1 / ::1; a name ``pypi.org``; a wildcard
    #: ``*.example.org``) guest flows may / may not reach; the most specific wins (docs/security.md,
    #: :mod:`aioslirp.config.policy`).
    egress_allow: list[str] = field(default_factory=list)
    egress_deny: list[str] = field(default_factory=list)
    #: The built-in deny list, denied unless a more specific ``egress_allow`` CIDR rule overrides:
    #: link-local (cloud metadata) ranges. Not to be confused with ``egress_default``, the verdict
    #: for what no rule decides. Named ``egress_default_deny`` up to 0.1.0: that name still works,
    #: as keyword and attribute, with a ``DeprecationWarning``, until the release after next.
    egress_deny_builtin: list[str] = field(default_factory=lambda: ["169.254.0.0/16", "fe80::/10",
                                                                    "fd00:ec2::254/128"])
    #: Verdict for a flow no rule decides (``--egress-default``): ``"allow"`` or ``"deny"``. Under
    #: ``"deny"`` the virtual DNS answers NXDOMAIN for names no allow rule matches.
    egress_default: str = "allow"
    #: Seconds a DNS answer's address stays bound to the name asked: its TTL clamped to [min, max].
    dns_binding_ttl_min: float = 30.0
    dns_binding_ttl_max: float = 3600.0
    #: (address, name) bindings kept at most (the oldest is evicted, ``egress.dns_bindings_evicted``),
    #: and addresses bound from one DNS answer at most (more: ``egress.dns_bindings_capped``).
    max_dns_bindings: int = 4096
    max_dns_bindings_per_answer: int = 64
    #: Python policy hook: ``policy(request) -> bool | (bool, reason)``, sync or async, asked for a
    #: flow or a DNS name (``request.proto == "dns"``) no rule decides (see
    #: :class:`aioslirp.flow.egress.PolicyRequest`); ``None``: none.
    policy: object = None
    #: Seconds an async hook may take; then ``policy_timeout_verdict`` (``"allow"`` / ``"deny"``) applies.
    policy_timeout: float = 1.0
    policy_timeout_verdict: str = "deny"
    #: Seconds a hook's verdict is reused for the same (bound name, address, port, protocol) of a flow,
    #: or the same DNS name.
    policy_cache_ttl: float = 10.0
    #: Bytes buffered from the host socket per TCP flow towards the guest (and our receive window).
    tcp_buffer: int = 1 << 20
    #: Frames the inject queue holds before producers wait.
    inject_queue_size: int = 4096
    #: Fragment reassembly bounds, applied to IPv4 and to IPv6 alike (one reassembler each):
    #: datagrams in progress (a new one evicts the oldest, ``drop.frag_evicted``), fragments per
    #: datagram (``drop.frag_too_many``), bytes held across all datagrams in progress (a fragment
    #: over it is dropped, ``drop.frag_memory_full``) and seconds from a datagram's first fragment
    #: to its completion (``drop.frag_timeout``). See docs/security.md.
    reassembly_max_datagrams: int = 64
    reassembly_max_fragments: int = 64
    reassembly_max_bytes: int = 4 << 20
    reassembly_timeout: float = 15.0
    #: Longest delay of a pure ACK for guest data, seconds (0-0.5, RFC 1122 4.2.3.2; 0: ACK at
    #: once). A host answer within the delay carries the ACK: one frame per request/response.
    tcp_ack_delay: float = 0.001
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
    #: Cap of the guest's traffic, bytes per second, guest -> host (``rate_up``) and host ->
    #: guest (``rate_down``); ``None``: no cap (``--rate-limit up=RATE,down=RATE``). A string
    #: takes a unit (``"10mbit"``, ``"2MB"``, see :func:`~aioslirp.config.rates.parse_rate`).
    #: One bucket per direction for all the guest's flows, both families; TCP is paced (no
    #: loss), UDP datagrams over the cap are dropped (``drop.rate_limit_up`` / ``_down``).
    #: See docs/audit.md.
    rate_up: float | str | None = None
    rate_down: float | str | None = None
    #: The guest's weight in the fair scheduler of its event loop (:mod:`aioslirp.fair`): when
    #: several stacks share one loop, each host link direction is shared between the busy guests
    #: in proportion to their weights (deficit round robin per guest, not per flow). A positive
    #: number; ``None``: the guest takes no part (its flows are never held back, and it counts
    #: for no one's share). See docs/configuration.md, "Fair shares".
    fair_weight: float | None = 1.0
    #: The audit log (``--audit-log``): a path (``"-"``: stderr) or a text file object; one
    #: JSON line per flow at its end (docs/audit.md). ``None``: no audit log.
    audit_log: object = None
    #: Send the guest's TCP flows through an upstream proxy (``--upstream-proxy``):
    #: ``http://HOST:PORT`` (CONNECT) or ``socks5://HOST:PORT``; credentials in the URL or from
    #: ``AIOSLIRP_PROXY_USER`` / ``AIOSLIRP_PROXY_PASSWORD`` (see :mod:`aioslirp.config.upstream`).
    #: ``None``: NAT directly. Implemented as the stack's default TCP handler (docs/handlers.md).
    upstream_proxy: str | None = None
    #: Destinations that bypass ``upstream_proxy`` (``--no-proxy``), ``NO_PROXY`` syntax; ``None``:
    #: the ``NO_PROXY`` environment variable.
    no_proxy: str | None = None
    #: ``--verify-sni``: a TCP flow an egress *name* rule allowed is held until its TLS ClientHello's
    #: SNI (or HTTP/1 ``Host``) names an allowed name bound to its address; else it is reset
    #: (:mod:`aioslirp.handlers.sni`; its SYN is answered before the host connect).
    verify_sni: bool = False
    #: What a traced stack records (``--trace-level``; docs/observability.md, "Trace levels"):
    #: ``"flows"`` (default) one span per NAT flow and nothing per frame; ``"timeline"`` also the
    #: TCP timeline (the flow spans' events, the ``tcp.syn_ack`` span); ``"frames"`` also the
    #: per-frame trace points (``process_guest_frame``, ``drain_to_guest``, ``writer_wake``, the
    #: ``*.sent`` events). Read once, when the stack is made; no effect on an untraced stack.
    trace_level: str = "flows"

    def validate(self) -> "NetworkConfig":
        """Check every field and normalise addresses. Returns ``self``; raises :class:`ConfigError`."""
        try:
            net = ipaddress.IPv4Network(str(self.cidr).strip(), strict=False)
        except ValueError:
            raise ConfigError("cidr", not_a_network(self.cidr, 4)) from None
        if net.prefixlen > 29:
            raise ConfigError("cidr", f"prefix /{net.prefixlen} is too small (at most /29)")
        first = net.network_address.packed[0]
        if net.is_multicast or net.is_loopback or first == 0 or first >= 240:
            raise ConfigError("cidr", f"{net} is not a usable unicast network")
        self.cidr = net
        self.gateway = host_address("gateway", self.gateway, net, 2)
        self.dns = host_address("dns", self.dns, net, 3)
        self.guest = host_address("guest", self.guest, net, 15 if net.num_addresses > 16 else 4)
        if self.dns == self.gateway:
            raise ConfigError("dns", f"{self.dns} is the gateway address; they must differ")
        if self.guest in (self.gateway, self.dns):
            raise ConfigError("guest", f"{self.guest} is the gateway or DNS address; they must differ")
        if self.dhcp_pool_size is not None and (not isinstance(self.dhcp_pool_size, int) or self.dhcp_pool_size < 1):
            raise ConfigError("dhcp_pool_size", f"{self.dhcp_pool_size!r}: must be a positive whole number or None")
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65520:
            raise ConfigError("mtu", f"{self.mtu!r} is out of range 576-65520")
        if self.dns_upstreams is not None:
            ups = []
            for item in self.dns_upstreams:
                if isinstance(item, str):
                    item = parse_hostport(item, 53, "dns_upstreams")
                try:
                    host, port = item
                    host = str(ipaddress.ip_address(str(host)))
                    port = int(port)
                except (TypeError, ValueError):
                    raise ConfigError("dns_upstreams", f"{item!r} is not an (address, port) pair") from None
                if not 1 <= port <= 65535:
                    raise ConfigError("dns_upstreams", f"port {port} is out of range 1-65535")
                ups.append((host, port))
            self.dns_upstreams = ups
        parts = self.gateway_mac.split(":")
        if len(parts) != 6 or not all(len(p) == 2 for p in parts):
            raise ConfigError("gateway_mac", f"{self.gateway_mac!r} is not a MAC address")
        try:
            bytes.fromhex("".join(parts))
        except ValueError:
            raise ConfigError("gateway_mac", f"{self.gateway_mac!r} is not a MAC address") from None
        for name in ("lease_time", "max_flows", "tcp_buffer", "inject_queue_size", "max_tcp_flows",
                     "max_udp_flows", "max_icmp_flows", "max_pending_connects", "new_flow_burst",
                     "dns_max_inflight", "reassembly_max_datagrams", "reassembly_max_fragments",
                     "reassembly_max_bytes", "max_dns_bindings", "max_dns_bindings_per_answer"):
            try:
                value = int(getattr(self, name))
            except (TypeError, ValueError):
                raise ConfigError(name, f"{getattr(self, name)!r} is not a whole number") from None
            if value <= 0:
                raise ConfigError(name, "must be positive")
        for name in ("tcp_connect_timeout", "tcp_linger", "udp_idle_timeout", "icmp_idle_timeout", "dns_timeout",
                     "reassembly_timeout"):
            try:
                value = float(getattr(self, name))
            except (TypeError, ValueError):
                raise ConfigError(name, f"{getattr(self, name)!r} is not a number of seconds") from None
            if not value > 0 or value == float("inf"):  # NaN and inf fail too
                raise ConfigError(name, f"{getattr(self, name)!r}: must be a positive number of seconds")
        for domain in self.dns_search:
            labels = str(domain).rstrip(".").split(".")
            if not domain or len(str(domain)) > 253 or not all(
                    0 < len(lb) <= 63 and all(c.isalnum() or c in "-_" for c in lb) for lb in labels):
                raise ConfigError("dns_search", f"{domain!r} is not a domain name")
        if not 0 <= float(self.tcp_idle_timeout) < float("inf"):
            raise ConfigError("tcp_idle_timeout", f"{self.tcp_idle_timeout!r}: must be 0 (off) or a positive number of seconds")
        if not 0 <= float(self.new_flow_rate) < float("inf"):
            raise ConfigError("new_flow_rate", f"{self.new_flow_rate!r}: must be 0 (no limit) or a positive rate")
        self.egress_allow = parse_rules(self.egress_allow, "egress_allow")
        self.egress_deny = parse_rules(self.egress_deny, "egress_deny")
        self.egress_deny_builtin = parse_rules(self.egress_deny_builtin, "egress_deny_builtin")
        for name in ("egress_default", "policy_timeout_verdict"):
            value = str(getattr(self, name)).strip().lower()
            if value not in ("allow", "deny"):
                raise ConfigError(name, f"{getattr(self, name)!r} is not allow or deny")
            setattr(self, name, value)
        for name in ("dns_binding_ttl_min", "dns_binding_ttl_max", "policy_timeout", "policy_cache_ttl"):
            try:
                value = float(getattr(self, name))
            except (TypeError, ValueError):
                raise ConfigError(name, f"{getattr(self, name)!r} is not a number of seconds") from None
            if not 0 <= value < float("inf"):
                raise ConfigError(name, f"{getattr(self, name)!r}: must be a number of seconds >= 0")
            setattr(self, name, value)
        if not self.policy_cache_ttl > 0:
            # a held flow is replayed with the verdict the hook just gave: it must still be cached
            raise ConfigError("policy_cache_ttl", f"{self.policy_cache_ttl!r}: must be a number of seconds > 0")
        if self.dns_binding_ttl_min > self.dns_binding_ttl_max:
            raise ConfigError("dns_binding_ttl_min", f"{self.dns_binding_ttl_min} is above dns_binding_ttl_max")
        if self.policy is not None and not callable(self.policy):
            raise ConfigError("policy", f"{self.policy!r} is not callable")
        if not 0.0 <= float(self.tcp_ack_delay) <= 0.5:
            raise ConfigError("tcp_ack_delay", f"{self.tcp_ack_delay!r} is out of range 0-0.5 seconds")
        for name in ("rate_up", "rate_down"):
            if getattr(self, name) is not None:
                setattr(self, name, parse_rate(getattr(self, name), name))
        if self.fair_weight is not None:
            try:
                weight = float(self.fair_weight)
            except (TypeError, ValueError):
                weight = float("nan")
            if isinstance(self.fair_weight, bool) or not 0 < weight < float("inf"):
                raise ConfigError("fair_weight", f"{self.fair_weight!r}: must be a positive number (or None: not scheduled)")
            self.fair_weight = weight
        if self.upstream_proxy is not None:
            parse_proxy_url(self.upstream_proxy, "upstream_proxy")
        log_to = self.audit_log
        if log_to is not None and not (isinstance(log_to, str) and log_to.strip()) and not hasattr(log_to, "write"):
            if not hasattr(log_to, "__fspath__"):
                raise ConfigError("audit_log", f"{log_to!r} is neither a path nor a writable file object")
        level = str(self.trace_level).strip().lower()
        if level not in TRACE_LEVELS:
            raise ConfigError("trace_level", f"{self.trace_level!r} is not one of {', '.join(TRACE_LEVELS)}")
        self.trace_level = level
        self.ipv6 = bool(self.ipv6)
        if self.ipv6:
            c6 = Ipv6Config.from_network(self)
            self.cidr6, self.gateway6, self.dns6 = c6.cidr6, c6.gateway6, c6.dns6
        records = parse_dns_records(self.dns_records, "dns_records")
        if HOST_NAME not in records:
            gws = (self.gateway, self.gateway6) if self.ipv6 else (self.gateway,)
            records[HOST_NAME] = tuple(ipaddress.ip_address(str(g)) for g in gws)
        self.dns_records = records
        return self

    @property
    def egress_default_deny(self) -> list:
        """Deprecated name of :attr:`egress_deny_builtin` (``DeprecationWarning``)."""
        _renamed("egress_default_deny", "egress_deny_builtin", 2)
        return self.egress_deny_builtin

    @egress_default_deny.setter
    def egress_default_deny(self, value) -> None:
        _renamed("egress_default_deny", "egress_deny_builtin", 2)
        self.egress_deny_builtin = value

    @property
    def gateway_mac_bytes(self) -> bytes:
        """The gateway MAC as 6 bytes."""
        return bytes.fromhex(self.gateway_mac.replace(":", ""))

    @property
    def netmask(self) -> ipaddress.IPv4Address:
        return self.cidr.netmask  # type: ignore[union-attr]


#: Keywords of ``NetworkConfig`` that were renamed: old name -> new name (kept one release).
RENAMED = {"egress_default_deny": "egress_deny_builtin"}


def _renamed(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"NetworkConfig.{old} is deprecated: it is now {new} (the old name goes in the next "
                  "release)", DeprecationWarning, stacklevel=stacklevel + 1)


def _accept_renamed(init):
    """Wrap the dataclass ``__init__`` so that a renamed keyword still works, with a warning."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        for old, new in RENAMED.items():
            if old in kwargs:
                _renamed(old, new, 2)
                if new in kwargs:
                    raise ConfigError(old, f"given together with {new}, its new name: give only {new}")
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    return __init__


NetworkConfig.__init__ = _accept_renamed(NetworkConfig.__init__)  # type: ignore[method-assign]
