"""What L4 and the flows need that differs by IP family: :class:`Family4` and :class:`Family6`.

Theory of operation
-------------------
L3 is written per family (:mod:`aioslirp.dispatch.ipv4`, :mod:`aioslirp.dispatch.ipv6`), L4
once (:mod:`aioslirp.dispatch.l4`). What the one L4 and the flows must still do differently
for IPv4 and IPv6 is behind a *family* object, one of each per stack: the guest's Ethernet
header (:meth:`~Family4.eth_to`: ARP cache / NDP neighbour cache), IP output with
fragmentation to the link MTU (:meth:`~Family4.inject_ip`), ICMP errors (:meth:`~Family4.icmp_error`),
the host address a guest destination maps to (:meth:`~Family4.remote_for`), what an ICMP error
quotes (:meth:`~Family4.quote`), the frame builders, the pseudo-header checksum, the socket
family, the DHCP service port and the drop reasons whose names differ (:attr:`~Family4.reason`).
The family is chosen once per frame at L3 and once per flow at its creation (the flow keeps
it); nothing on the per-packet path asks which family it is.

Flows never speak ICMP codes: a flow that must tell the guest a destination is unreachable
(a host connect refused or unroutable, a UDP ``ECONNREFUSED``) names the *kind* --
``"net"``, ``"host"``, ``"port"`` or ``"admin"`` -- and its family maps it: ICMPv4 type 3
codes 0/1/3/13 (RFC 792, RFC 1812 5.2.7.1), ICMPv6 type 1 codes 0/3/4/1 (RFC 4443 3.1).
Errors are rate limited per family by a token bucket of 100 errors/s, burst 50 (RFC 1812
4.3.2.8, RFC 4443 2.4 (f)): ``icmp_errors_rate_limited`` / ``icmp6_errors_rate_limited``.

The ICMP types and codes, the kinds (``KIND_*``) and the kind maps (:data:`UNREACH4`,
:data:`UNREACH6`: kind -> ``(type, code)``) are defined once, in :mod:`aioslirp.wire.icmp`.
"""

from __future__ import annotations

import socket
import struct
from typing import TYPE_CHECKING, Any, Union

from ..flow.context import FlowContext
from ..services.dhcp import DhcpServer, reply_destination
from ..wire.checksum import checksum
from ..wire.ethernet import BROADCAST, ETH, ETHERTYPE_IPV4, ETHERTYPE_IPV6
from ..ratelimit import EventLimiter, TokenBucket
from ..wire.icmp import (ICMP6_ECHO_REPLY, ICMP6_ECHO_REQUEST, ICMP_ECHO, ICMP_ECHO_REPLY, UNREACH4, UNREACH6,
                         build_icmp6_error, build_icmp6_packet, build_icmp_packet)
from ..wire.ip import PROTO_ICMP
from ..wire.ipv4 import fragment, pseudo_sum
from ..wire.ipv6 import NH_ICMPV6, UNSPECIFIED, fragment6, multicast_mac, pseudo_sum6, solicited_node
from ..wire.tcp import build_tcp
from ..wire.udp import build_udp
from ..wire.neighbors import NeighborCache

if TYPE_CHECKING:  # imported only with IPv6 on (Stack): config6, NDP, DHCPv6
    from ..config.ipv6 import Ipv6Config
    from ..services.dhcpv6 import Dhcpv6Server
    from ..services.ndp import NdpResponder

__all__ = ["ALL_DHCP", "Family", "Family4", "Family6", "KINDS", "UNREACH4", "UNREACH6"]

#: The destination unreachable kinds a flow or L4 may raise (``aioslirp.wire.icmp.KIND_*``).
KINDS = tuple(UNREACH4)
#: All_DHCP_Relay_Agents_and_Servers (RFC 8415 7.1).
ALL_DHCP = bytes.fromhex("ff020000000000000000000000010002")
#: Most of an offending packet an ICMPv6 error can quote (1280 - 40 - 8, RFC 4443 2.4 (c)).
QUOTE6 = 1232
_ECHO = struct.Struct("!BBHHH")
_ID_SEQ = struct.Struct("!HH")
_LOOPBACK4 = "127.0.0.1"
_ZERO4 = b"\x00\x00\x00\x00"

#: Drop reasons of L4 whose IPv6 name differs (the IPv4 name is the key).
_REASONS6 = {
    "truncated_tcp": "tcp6_truncated", "bad_tcp_checksum": "tcp6_bad_checksum",
    "tcp_from_unspecified": "tcp6_from_unspecified", "tcp_unroutable_dst": "tcp6_unroutable_dst",
    "truncated_udp": "udp6_truncated", "bad_udp_length": "udp6_bad_length", "bad_udp_checksum": "udp6_bad_checksum",
    "udp_from_unspecified": "udp6_from_unspecified", "udp_unroutable_dst": "udp6_unroutable_dst",
    "icmp_unroutable_dst": "icmp6_unroutable_dst", "icmp_unsupported": "icmp6_unsupported",
}


class Family4:
    """IPv4 for one stack (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        neighbors: the ARP cache, IPv4 (4 bytes) -> guest MAC (filled by :mod:`~aioslirp.dispatch.link`).

    Attributes:
        gw, dns: our addresses (4 bytes); ``ours`` is both.
        reason: L4 drop reason -> the name counted for this family (IPv4: the same).
        err_bucket: the rate limiter of the ICMP errors we send (``stack.parts.family4.err_bucket``).
        dhcp_server: the :class:`~aioslirp.services.dhcp.DhcpServer` (a new one per ``Stack.reset_flows``).
    """

    __slots__ = ("ctx", "neighbors", "gw_mac", "gw", "dns", "ours", "bcast", "net_int", "mask_int", "mtu",
                 "host_loopback", "err_bucket", "dhcp_server")

    #: The stack's :class:`~aioslirp.flow.context.FlowContext`.
    ctx: FlowContext
    #: The ARP cache (a :class:`~aioslirp.wire.neighbors.NeighborCache`): IPv4 -> guest MAC.
    neighbors: NeighborCache
    gw_mac: bytes
    gw: bytes
    dns: bytes
    ours: tuple
    bcast: bytes
    net_int: int
    mask_int: int
    mtu: int
    host_loopback: bool
    err_bucket: EventLimiter
    dhcp_server: DhcpServer

    v6 = False
    af = socket.AF_INET
    #: Protocol number of echo flows in their keys, and for the ping/raw sockets.
    icmp_proto = PROTO_ICMP
    ipproto_icmp = socket.IPPROTO_ICMP
    echo_reply_type = ICMP_ECHO_REPLY
    unspecified = _ZERO4
    #: UDP port of the DHCP server; :meth:`dhcp` decides whether a datagram to it is ours.
    dhcp_port = 67
    reason = {k: k for k in _REASONS6}
    #: ``pseudo_sum(src, dst, proto, length)``: partial checksum of the pseudo-header (RFC 9293 3.1).
    pseudo_sum = staticmethod(pseudo_sum)
    #: Frame / packet builders (:mod:`aioslirp.wire.tcp`, :mod:`aioslirp.wire.udp`; the family follows from the
    #: address length).
    build_tcp = staticmethod(build_tcp)
    build_udp = staticmethod(build_udp)

    def __init__(self, ctx: FlowContext, neighbors: NeighborCache) -> None:
        # validated: its addresses and network are ipaddress objects (NetworkConfig types its
        # fields as a user may give them, text included)
        cfg: Any = ctx.config
        self.ctx = ctx
        self.neighbors = neighbors
        self.gw_mac = cfg.gateway_mac_bytes
        self.gw = cfg.gateway.packed
        self.dns = cfg.dns.packed
        self.ours = (self.gw, self.dns)
        self.bcast = cfg.cidr.broadcast_address.packed
        self.net_int = int(cfg.cidr.network_address)
        self.mask_int = int(cfg.cidr.netmask)
        self.mtu = cfg.mtu
        self.host_loopback = not cfg.disable_host_loopback
        self.err_bucket = TokenBucket()
        self.dhcp_server = DhcpServer(cfg)

    def in_subnet(self, ip4: bytes) -> bool:
        return (int.from_bytes(ip4, "big") & self.mask_int) == self.net_int

    # ------------------------------------------------------------------ output
    def eth_to(self, ip: bytes) -> bytes:
        """14-byte Ethernet header from the gateway to the guest owning ``ip`` (broadcast when unknown)."""
        return ETH.pack(self.mac_of(ip), self.gw_mac, ETHERTYPE_IPV4)

    def mac_of(self, ip: bytes) -> bytes:
        """The destination MAC of :meth:`eth_to` (6 bytes): the guest owning ``ip``, broadcast when unknown."""
        return self.neighbors.get(ip, BROADCAST)

    def inject_ip(self, packet, dst: bytes) -> None:
        """Queue an IPv4 packet (bytes-like, no Ethernet header) for the guest's ``dst``, fragmented to the MTU."""
        eth = self.eth_to(dst)
        inject = self.ctx.inject
        for p in fragment(packet, self.mtu):
            inject(eth + p)

    def icmp_error(self, kind: str, orig, now: float | None = None) -> None:
        """ICMP destination unreachable of ``kind`` (``"net"``, ``"host"``, ``"port"``, ``"admin"``)
        to the guest about ``orig``, its IPv4 packet (at least the header and 8 bytes)."""
        icmp_type, code = UNREACH4[kind]
        self.send_icmp_error(icmp_type, code, orig, now)

    def send_icmp_error(self, icmp_type: int, code: int, orig, now: float | None = None) -> None:
        """ICMP ``icmp_type``/``code`` to the guest about ``orig``; quotes its header + 8 bytes
        (RFC 792). Rate limited by :attr:`err_bucket` (``icmp_errors_rate_limited``)."""
        quoted = bytes(orig[:((orig[0] & 0x0F) << 2) + 8]) if len(orig) else b""
        if len(quoted) < 28:
            return
        counters = self.ctx.counters
        if not self.err_bucket.allow(self.ctx.running.time() if now is None else now):
            counters["icmp_errors_rate_limited"] += 1
            return
        src = quoted[12:16]
        counters["icmp_errors_sent"] += 1
        self.inject_ip(build_icmp_packet(quoted[16:20], src, icmp_type, code, 0, quoted), src)

    def echo_request(self, ident: int, seq: int, payload: bytes) -> bytearray:
        """An ICMP Echo Request message (checksum filled) for a ping or raw socket."""
        msg = bytearray(_ECHO.pack(ICMP_ECHO, 0, 0, ident, seq) + payload)
        struct.pack_into("!H", msg, 2, checksum(msg))
        return msg

    def echo_reply(self, src: bytes, dst: bytes, ident: int, seq: int, payload) -> bytearray:
        """An IPv4 packet carrying the Echo Reply from ``src`` to the guest's ``dst``."""
        return build_icmp_packet(src, dst, ICMP_ECHO_REPLY, 0, (ident << 16) | seq, payload)

    # ------------------------------------------------------------------ routing
    def remote_for(self, dst: bytes) -> str | None:
        """Host address (text) a guest destination maps to, or ``None`` when it must not be reached:
        the gateway -> host loopback (unless ``disable_host_loopback``); our subnet, broadcast,
        loopback, ``0/8`` and multicast/reserved -> ``None``; anything else -> itself."""
        if dst == self.gw:
            return _LOOPBACK4 if self.host_loopback else None
        if self.in_subnet(dst) or dst == b"\xff\xff\xff\xff":
            return None
        first = dst[0]
        if first == 127 or first == 0 or first >= 224:
            return None
        return socket.inet_ntoa(dst)

    def quote(self, pkt) -> bytes:
        """What an ICMP error about ``pkt`` (an IPv4 packet) quotes: its header + 8 bytes (RFC 792)."""
        return bytes(pkt[:((pkt[0] & 0x0F) << 2) + 8])

    # ------------------------------------------------------------------ services
    def dhcp(self, payload, src: bytes, sport: int, dst: bytes, src_mac: bytes, now: float) -> bool:
        """A guest UDP datagram to port 67: answer it when it comes from port 68 (DHCP, RFC 2131)
        and return True (handled or dropped, counted); False: not DHCP, an ordinary datagram."""
        if sport != 68:
            return False
        ctx = self.ctx
        res = self.dhcp_server.handle(bytes(payload), src_mac, now)
        ctx.handled("dhcp")
        if res is None:
            ctx.counters["dhcp_ignored"] += 1
            return True
        reply, broadcast = res
        ctx.counters["dhcp_replies"] += 1
        dst_ip = socket.inet_aton(reply_destination(reply, broadcast))
        if dst_ip == _ZERO4:
            dst_ip = b"\xff\xff\xff\xff"
        pkt = build_udp(self.gw, dst_ip, 67, 68, reply)
        eth = ETH.pack(BROADCAST if broadcast else src_mac, self.gw_mac, ETHERTYPE_IPV4)
        inject = ctx.inject
        for p in fragment(pkt, self.mtu):
            inject(eth + p)
        return True


class Family6:
    """IPv6 for one stack (see the module documentation); only with ``NetworkConfig.ipv6``.

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        config6: the :class:`~aioslirp.config.ipv6.Ipv6Config`.
        ndp: the :class:`~aioslirp.services.ndp.NdpResponder` (its ``neighbors`` cache, our addresses).
        dhcp6: the :class:`~aioslirp.services.dhcpv6.Dhcpv6Server`.

    Attributes:
        gw, dns: ``gateway6`` and ``dns6`` (16 bytes); ``ours``: every address of ours.
        guest_mac: the MAC of the guest's last IPv6 frame (``None`` before the first), set by L3.
        err_bucket: the rate limiter of the ICMPv6 errors we send.
    """

    __slots__ = ("ctx", "config6", "ndp", "dhcp6", "neighbors", "gw_mac", "gw", "dns", "link_local", "ours", "mtu",
                 "host_loopback", "err_bucket", "guest_mac", "_solicited")

    #: The stack's :class:`~aioslirp.flow.context.FlowContext`.
    ctx: FlowContext
    config6: Ipv6Config
    ndp: NdpResponder
    dhcp6: Dhcpv6Server
    #: The NDP cache: IPv6 -> guest MAC.
    neighbors: NeighborCache
    gw_mac: bytes
    gw: bytes
    dns: bytes
    link_local: bytes
    ours: set[bytes]
    mtu: int
    host_loopback: bool
    err_bucket: EventLimiter
    guest_mac: bytes | None
    #: Target address -> loop time of the last neighbor solicitation we sent for it.
    _solicited: dict[bytes, float]

    v6 = True
    af = socket.AF_INET6
    icmp_proto = NH_ICMPV6
    ipproto_icmp = socket.IPPROTO_ICMPV6
    echo_reply_type = ICMP6_ECHO_REPLY
    unspecified = UNSPECIFIED
    dhcp_port = 547
    reason = _REASONS6
    pseudo_sum = staticmethod(pseudo_sum6)
    build_tcp = staticmethod(build_tcp)
    build_udp = staticmethod(build_udp)

    def __init__(self, ctx: FlowContext, config6: Ipv6Config, ndp: NdpResponder, dhcp6: Dhcpv6Server) -> None:
        self.ctx = ctx
        self.config6 = config6
        self.ndp = ndp
        self.dhcp6 = dhcp6
        self.neighbors = ndp.neighbors
        self.gw_mac = ctx.config.gateway_mac_bytes
        self.gw = config6.gateway6_bytes
        self.dns = config6.dns6_bytes
        self.link_local = ndp.link_local
        self.ours = ndp.ours
        self.mtu = config6.mtu
        self.host_loopback = not ctx.config.disable_host_loopback
        self.err_bucket = TokenBucket()
        self.guest_mac: bytes | None = None
        self._solicited: dict[bytes, float] = {}

    def reset(self) -> None:
        """Forget the guest's MAC and the solicitations sent (``Stack.reset_flows``)."""
        self.guest_mac = None
        self._solicited.clear()

    # ------------------------------------------------------------------ output
    def eth_to(self, dst: bytes) -> bytes:
        """14-byte Ethernet header from the gateway to the guest's ``dst`` (16 bytes).

        Multicast goes to its ``33:33`` MAC. A unicast address missing from the neighbour
        cache goes to the guest's last MAC (or the solicited-node MAC before any frame) and
        triggers a Neighbor Solicitation (RFC 4861 7.2.2).
        """
        return ETH.pack(self.mac_of(dst), self.gw_mac, ETHERTYPE_IPV6)

    def mac_of(self, dst: bytes) -> bytes:
        """The destination MAC of :meth:`eth_to` (6 bytes; a Neighbor Solicitation as it says)."""
        mac = self.neighbors.get(dst)
        if mac is None:
            if dst[0] == 0xFF:
                mac = multicast_mac(dst)
            else:
                mac = self.guest_mac or multicast_mac(solicited_node(dst))
                self._solicit(dst)
        return mac

    def _solicit(self, dst: bytes) -> None:
        """At most one Neighbor Solicitation per address and second (``ndp.ns_sent``)."""
        now = self.ctx.running.time()
        last = self._solicited.get(dst)
        if last is not None and now - last < 1.0:
            return
        if len(self._solicited) >= 256:
            self._solicited.clear()
        self._solicited[dst] = now
        self.ctx.counters["ndp.ns_sent"] += 1
        self.ctx.inject(self.ndp.solicit(dst))

    def inject_ip(self, packet, dst: bytes) -> None:
        """Queue an IPv6 packet (no Ethernet header, no extension headers) for the guest's ``dst``,
        fragmented to the link MTU (RFC 8200 4.5)."""
        eth = self.eth_to(dst)
        inject = self.ctx.inject
        if len(packet) <= self.mtu:
            inject(eth + packet)
            return
        for p in fragment6(packet, self.mtu):
            inject(eth + p)

    def icmp_error(self, kind: str, orig, now: float | None = None) -> None:
        """ICMPv6 destination unreachable of ``kind`` (``"net"``, ``"host"``, ``"port"``,
        ``"admin"``) to the guest about ``orig``, its IPv6 packet (maybe truncated)."""
        icmp_type, code = UNREACH6[kind]
        self.send_icmp6_error(icmp_type, code, orig, now=now)

    def send_icmp6_error(self, icmp_type: int, code: int, orig, param: int = 0, src: bytes | None = None,
                         now: float | None = None) -> None:
        """ICMPv6 error ``icmp_type``/``code`` to the guest about ``orig`` (its IPv6 packet, maybe
        truncated), rate limited (RFC 4443 2.4 (f)); refused where 2.4 (e) says so.

        ``src``: our address sending it; default the original destination (the remote the
        guest tried, as libslirp does), or ``gateway6`` when that is multicast.
        """
        counters = self.ctx.counters
        if not self.err_bucket.allow(self.ctx.running.time() if now is None else now):
            counters["icmp6_errors_rate_limited"] += 1
            return
        orig = bytes(orig[:QUOTE6])
        if len(orig) < 40:
            return
        if src is None:
            src = orig[24:40]
            if src[0] == 0xFF:
                src = self.gw
        pkt = build_icmp6_error(icmp_type, code, orig, src=src, param=param)
        if pkt is None:
            counters["icmp6_errors_suppressed"] += 1
            return
        counters["icmp6_errors_sent"] += 1
        self.inject_ip(pkt, orig[8:24])

    def echo_request(self, ident: int, seq: int, payload: bytes) -> bytes:
        """An ICMPv6 Echo Request message; the kernel fills the checksum (ping and raw sockets, RFC 3542 3.1)."""
        return _ECHO.pack(ICMP6_ECHO_REQUEST, 0, 0, ident, seq) + payload

    def echo_reply(self, src: bytes, dst: bytes, ident: int, seq: int, payload) -> bytearray:
        """An IPv6 packet carrying the Echo Reply from ``src`` to the guest's ``dst``."""
        return build_icmp6_packet(src, dst, ICMP6_ECHO_REPLY, 0, _ID_SEQ.pack(ident, seq) + bytes(payload))

    # ------------------------------------------------------------------ routing
    def remote_for(self, dst: bytes) -> str | None:
        """Host address (text) a guest destination maps to, or ``None``
        (:meth:`Ipv6Config.remote_for <aioslirp.config.ipv6.Ipv6Config.remote_for>`)."""
        return self.config6.remote_for(dst, self.host_loopback)

    def quote(self, pkt) -> bytes:
        """What an ICMPv6 error about ``pkt`` (an IPv6 packet) quotes: as much as fits (RFC 4443 2.4 (c))."""
        return bytes(pkt[:QUOTE6])

    # ------------------------------------------------------------------ services
    def dhcp(self, payload, src: bytes, sport: int, dst: bytes, src_mac: bytes, now: float) -> bool:
        """A guest UDP datagram to port 547: answer it when it is for the DHCPv6 servers' group or
        one of our addresses (stateless DHCPv6, RFC 8415) and return True (handled or dropped,
        counted); False: an ordinary datagram."""
        unicast = dst != ALL_DHCP
        if unicast and dst not in self.ours:
            return False
        ctx = self.ctx
        if src == UNSPECIFIED:
            ctx.drop("dhcpv6_from_unspecified")
            return True
        res = self.dhcp6.handle(payload, unicast)
        if type(res) is str:
            ctx.drop("dhcpv6_" + res)
            return True
        ctx.counters["dhcpv6_replies"] += 1
        ctx.handled("dhcpv6")
        pkt = build_udp(self.link_local, src, 547, sport, res)
        eth = ETH.pack(src_mac, self.gw_mac, ETHERTYPE_IPV6)
        inject = ctx.inject
        for p in fragment6(pkt, self.mtu):
            inject(eth + p)
        return True


#: Either family: what L4 and the flows are handed with a packet or at their creation.
Family = Union[Family4, Family6]
