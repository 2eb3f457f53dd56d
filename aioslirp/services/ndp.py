"""Sans-IO Neighbor Discovery for the virtual router (RFC 4861, SLAAC per RFC 4862, RDNSS per RFC 8106).

:class:`NdpResponder` plays the gateway's part of NDP on the guest link:

* **Neighbor Solicitation** (RFC 4861 7.2.3-7.2.4): answered with a Neighbor Advertisement
  only when the target is one of our addresses — ``gateway6``, ``dns6`` and the gateway's
  link-local address (the source of our RAs, hence the guest's default router, which the
  guest's neighbour unreachability detection probes). Every other target is left alone; in
  particular the guest's own tentative address during Duplicate Address Detection (NS from
  ``::``, RFC 4862 5.4.2) is never answered, so the guest's DAD succeeds. The NA carries R
  (for the gateway addresses), O, and the Target Link-Layer Address option; it is unicast
  with S=1 to the soliciting node, or — when the NS came from ``::``, i.e. someone runs DAD
  for *our* address — multicast to ``ff02::1`` with S=0 (RFC 4861 7.2.4).
* **Router Solicitation** (6.2.6): answered with a Router Advertisement (M=0, O=1 when DHCPv6
  is on, Router Lifetime ``router_lifetime``, Prefix Information with L and A, MTU, RDNSS
  pointing at ``dns6``, DNSSL when search domains are set, Source Link-Layer Address), from the
  link-local address, hop limit 255. Unicast to the solicitor when its source is specified
  (allowed by 6.2.6), else multicast to ``ff02::1`` at most once per 3 s (MIN_DELAY_BETWEEN_RAS).
* :meth:`NdpResponder.periodic_ra` builds the unsolicited multicast RA; the caller schedules
  it after :meth:`NdpResponder.next_ra_delay` seconds (RFC 4861 6.2.4).
* **Neighbor Advertisements** from the guest update :attr:`NdpResponder.neighbors`; RAs and
  Redirects from the guest are dropped (we are the only router).

Every message is validated first (hop limit 255, checksum, code 0, lengths, option lengths >
0, the unspecified-source rules of 6.1.1 / 7.1.1 / 7.1.2) and NDP inside a fragment is
refused (RFC 6980).

Outputs are **whole Ethernet frames** (``bytearray``, source MAC the gateway's) ready for
the inject queue's ``put``: :meth:`NdpResponder.handle` returns a list of them (possibly empty: a valid
message that needs no answer, counted in :attr:`NdpResponder.counters`) or a drop-reason
string. Nothing here raises on guest input, performs I/O or reads a clock.
"""

from __future__ import annotations

import random
import struct
from collections import Counter

from ..config.ipv6 import Ipv6Config
from ..wire.icmp import (ICMP6_ECHO_REQUEST, ND_NEIGHBOR_ADVERT, ND_NEIGHBOR_SOLICIT, ND_REDIRECT, ND_ROUTER_ADVERT,
                         ND_ROUTER_SOLICIT, build_icmp6_packet, echo_reply6)
from ..wire.ipv6 import (ALL_NODES, NH_ICMPV6, UNSPECIFIED, Ipv6, eth6, fragment6, is_multicast, l4_checksum_ok,
                         link_local_from_mac, multicast_mac, solicited_node)
from ..wire.neighbors import MAX_NEIGHBORS, NeighborCache
from .dhcpv6 import encode_domain_list

__all__ = ["NdpResponder"]

# Option types (RFC 4861 4.6, RFC 8106).
OPT_SLLA, OPT_TLLA, OPT_PREFIX, OPT_REDIRECTED, OPT_MTU = 1, 2, 3, 4, 5
OPT_RDNSS, OPT_DNSSL = 25, 31
NA_ROUTER, NA_SOLICITED, NA_OVERRIDE = 0x80000000, 0x40000000, 0x20000000
RA_MANAGED, RA_OTHER = 0x80, 0x40
PREFIX_ONLINK, PREFIX_AUTO = 0x80, 0x40
ND_HOP_LIMIT = 255
#: RA Cur Hop Limit advertised to the guest.
CUR_HOP_LIMIT = 64
MIN_DELAY_BETWEEN_RAS = 3.0  # RFC 4861 10
MAX_INITIAL_RTR_ADVERT_INTERVAL = 16.0
MAX_INITIAL_RTR_ADVERTISEMENTS = 3

_RA_HDR = struct.Struct("!BBHII")  # cur hop limit, flags, router lifetime, reachable, retrans
_PIO = struct.Struct("!BBBBIII16s")  # type, len, prefix len, flags, valid, preferred, reserved2, prefix
_MTU_OPT = struct.Struct("!BBHI")
_RDNSS_HDR = struct.Struct("!BBHI")
_I = struct.Struct("!I")


def parse_nd_options(msg, start: int):
    """Parse NDP options of ``msg`` from ``start`` (RFC 4861 4.6).

    Returns ``{type: first option body}`` (body without the 2-byte type/length) or a drop
    reason: ``ndp_bad_option`` for a zero length or an option running past the message.
    """
    opts: dict[int, bytes] = {}
    i, n = start, len(msg)
    while i < n:
        if i + 2 > n:
            return "ndp_bad_option"
        olen = msg[i + 1] << 3
        if olen == 0 or i + olen > n:
            return "ndp_bad_option"
        t = msg[i]
        if t not in opts:
            opts[t] = bytes(msg[i + 2:i + olen])
        i += olen
    return opts


def _lla(opts: dict, t: int) -> bytes | None:
    """The 6-byte MAC of a link-layer address option on Ethernet (length 1), or None."""
    body = opts.get(t)
    if body is None or len(body) != 6:
        return None
    return body


class NdpResponder:
    """The gateway's NDP state for one guest link.

    Args:
        config6: a validated :class:`~aioslirp.config.ipv6.Ipv6Config` (it is validated if not yet).
        gateway_mac: the gateway's 6-byte MAC (``NetworkConfig.gateway_mac_bytes``).
        rng: ``random.Random`` for the RA interval jitter (tests pass a seeded one).

    Attributes:
        link_local: our ``fe80::`` address (modified EUI-64 of ``gateway_mac``), source of RAs.
        ours: the addresses we answer for: ``{gateway6, dns6, link_local}`` (16-byte keys).
        neighbors: guest IPv6 address (16 bytes) -> MAC, learned from Source/Target Link-Layer
            Address options (a :class:`~aioslirp.wire.neighbors.NeighborCache`: at most
            ``MAX_NEIGHBORS`` = 1024, the same bound as the stack's IPv4 cache; the entry learned
            longest ago is forgotten first).
        counters: events that are not drops: ``na_sent``, ``na_sent_dad`` (defending our
            address), ``ra_sent_solicited``, ``ra_sent_unsolicited``, ``ra_rate_limited``,
            ``ns_dad_ignored`` (guest DAD for its own address), ``ns_other_target``,
            ``na_learned``, ``na_conflict`` (the guest claims one of our addresses),
            ``neighbors_evicted`` (an entry forgotten to make room).
    """

    __slots__ = ("config6", "mac", "rng", "link_local", "gateway", "dns", "ours", "_router", "neighbors", "counters",
                 "_last_mcast_ra", "_unsolicited", "_ra_body")

    config6: Ipv6Config
    mac: bytes
    rng: random.Random
    link_local: bytes
    gateway: bytes
    dns: bytes
    ours: set[bytes]
    #: The addresses router advertisements and redirects may come from (never the guest).
    _router: set[bytes]
    neighbors: NeighborCache
    counters: Counter
    _last_mcast_ra: float | None
    _unsolicited: int
    #: The router advertisement's ICMPv6 body (after the checksum field).
    _ra_body: bytes

    def __init__(self, config6: Ipv6Config, gateway_mac: bytes, rng: random.Random | None = None) -> None:
        if not hasattr(config6.cidr6, "network_address"):
            config6.validate()
        self.config6 = config6
        self.mac = bytes(gateway_mac)
        self.rng = rng if rng is not None else random.Random()
        self.link_local = link_local_from_mac(self.mac)
        self.gateway = config6.gateway6_bytes
        self.dns = config6.dns6_bytes
        self.ours = {self.gateway, self.dns, self.link_local}
        self._router = {self.gateway, self.link_local}
        self.neighbors = NeighborCache(MAX_NEIGHBORS)
        self.counters: Counter = Counter()
        self._last_mcast_ra: float | None = None
        self._unsolicited = 0
        self._ra_body = self._build_ra_body()

    # ------------------------------------------------------------------ input
    def handle(self, buf, ip: Ipv6, src_mac: bytes, now: float):
        """Process one ICMPv6 NDP message from the guest.

        ``buf``: the frame (or packet) ``ip`` was parsed from by
        :func:`~aioslirp.wire.ipv6.parse_ipv6`; ``ip.proto`` must be 58. ``src_mac``: the
        frame's Ethernet source. ``now``: seconds (any monotonic origin), for RA rate limiting.

        Returns a list of Ethernet frames to send to the guest (maybe empty), or a drop
        reason (``ndp_fragmented``, ``ndp_bad_hop_limit``, ``icmp6_bad_checksum``,
        ``ndp_bad_code``, ``ndp_truncated``, ``ndp_bad_option``, ``ndp_multicast_target``,
        ``ndp_ns_bad_dst``, ``ndp_sllao_from_unspecified``, ``ndp_na_solicited_multicast``,
        ``ndp_spoofed_src``, ``ndp_ra_from_guest``, ``ndp_redirect_from_guest``,
        ``ndp_not_nd``).
        """
        try:
            return self._handle(buf, ip, bytes(src_mac), now)
        except (IndexError, struct.error, ValueError):  # defensive: a bug here must not kill the stack
            return "ndp_malformed"

    def _handle(self, buf, ip: Ipv6, src_mac: bytes, now: float):
        if ip.proto != NH_ICMPV6:
            return "ndp_not_nd"
        if ip.frag is not None:
            return "ndp_fragmented"
        msg = memoryview(buf)[ip.l4:ip.end]
        n = len(msg)
        if n < 8:
            return "ndp_truncated"
        t = msg[0]
        if not ND_ROUTER_SOLICIT <= t <= ND_REDIRECT:
            return "ndp_not_nd"
        if ip.hlim != ND_HOP_LIMIT:
            return "ndp_bad_hop_limit"
        if not l4_checksum_ok(ip.src, ip.dst, NH_ICMPV6, msg):
            return "icmp6_bad_checksum"
        if msg[1] != 0:
            return "ndp_bad_code"
        if ip.src in self.ours:
            return "ndp_spoofed_src"
        if t == ND_NEIGHBOR_SOLICIT:
            return self._ns(msg, ip, src_mac)
        if t == ND_ROUTER_SOLICIT:
            return self._rs(msg, ip, src_mac, now)
        if t == ND_NEIGHBOR_ADVERT:
            return self._na(msg, ip)
        if t == ND_ROUTER_ADVERT:
            return "ndp_ra_from_guest"
        return "ndp_redirect_from_guest"

    def learn(self, addr: bytes, mac: bytes) -> bool:
        """Record ``addr`` (16 bytes) -> ``mac`` (6 bytes) in :attr:`neighbors` (most recent last).

        Returns True when the oldest entry was forgotten to make room (counted as ``neighbors_evicted``).
        """
        if self.neighbors.learn(addr, mac):
            self.counters["neighbors_evicted"] += 1
            return True
        return False

    def _ns(self, msg, ip: Ipv6, src_mac: bytes):
        if len(msg) < 24:
            return "ndp_truncated"
        target = bytes(msg[8:24])
        if is_multicast(target):
            return "ndp_multicast_target"
        opts = parse_nd_options(msg, 24)
        if type(opts) is str:
            return opts
        sllao = _lla(opts, OPT_SLLA)
        dad = ip.src == UNSPECIFIED
        if dad:
            if ip.dst != solicited_node(target):
                return "ndp_ns_bad_dst"
            if OPT_SLLA in opts:
                return "ndp_sllao_from_unspecified"
        elif ip.dst != solicited_node(target) and ip.dst != target:
            return "ndp_ns_bad_dst"
        if not dad and sllao is not None:
            self.learn(ip.src, sllao)
        if target not in self.ours:
            self.counters["ns_dad_ignored" if dad else "ns_other_target"] += 1
            return []
        flags = NA_OVERRIDE | (NA_ROUTER if target in self._router else 0)
        if dad:  # someone probes our address: defend it to all nodes, S=0 (RFC 4861 7.2.4)
            dst, dst_mac = ALL_NODES, multicast_mac(ALL_NODES)
            self.counters["na_sent_dad"] += 1
        else:
            flags |= NA_SOLICITED
            dst, dst_mac = ip.src, (sllao if sllao is not None else src_mac)
            self.counters["na_sent"] += 1
        body = _I.pack(flags) + target + bytes((OPT_TLLA, 1)) + self.mac
        return [self._frame(dst_mac, build_icmp6_packet(target, dst, ND_NEIGHBOR_ADVERT, 0, body, ND_HOP_LIMIT))]

    def _rs(self, msg, ip: Ipv6, src_mac: bytes, now: float):
        opts = parse_nd_options(msg, 8)
        if type(opts) is str:
            return opts
        sllao = _lla(opts, OPT_SLLA)
        if ip.src == UNSPECIFIED:
            if OPT_SLLA in opts:
                return "ndp_sllao_from_unspecified"
            if self._last_mcast_ra is not None and now - self._last_mcast_ra < MIN_DELAY_BETWEEN_RAS:
                self.counters["ra_rate_limited"] += 1
                return []
            self._last_mcast_ra = now
            self.counters["ra_sent_solicited"] += 1
            return [self._ra(ALL_NODES, multicast_mac(ALL_NODES))]
        if sllao is not None:
            self.learn(ip.src, sllao)
        self.counters["ra_sent_solicited"] += 1
        return [self._ra(ip.src, sllao if sllao is not None else src_mac)]

    def _na(self, msg, ip: Ipv6):
        if len(msg) < 24:
            return "ndp_truncated"
        target = bytes(msg[8:24])
        if is_multicast(target):
            return "ndp_multicast_target"
        flags = _I.unpack_from(msg, 4)[0]
        if is_multicast(ip.dst) and flags & NA_SOLICITED:
            return "ndp_na_solicited_multicast"
        opts = parse_nd_options(msg, 24)
        if type(opts) is str:
            return opts
        if target in self.ours:
            self.counters["na_conflict"] += 1
            return []
        tllao = _lla(opts, OPT_TLLA)
        if tllao is not None:
            self.learn(target, tllao)
            self.counters["na_learned"] += 1
        return []

    # ------------------------------------------------------------------ output
    def _frame(self, dst_mac: bytes, packet) -> bytearray:
        frame = bytearray(eth6(dst_mac, self.mac))
        frame += packet
        return frame

    def _build_ra_body(self) -> bytes:
        c = self.config6
        flags = RA_OTHER if c.dhcpv6 else 0
        body = bytearray(_RA_HDR.pack(CUR_HOP_LIMIT, flags, int(c.router_lifetime), 0, 0))
        body += bytes((OPT_SLLA, 1)) + self.mac
        body += _MTU_OPT.pack(OPT_MTU, 1, 0, c.mtu)
        body += _PIO.pack(OPT_PREFIX, 4, 64, PREFIX_ONLINK | PREFIX_AUTO, int(c.valid_lifetime),
                          int(c.preferred_lifetime), 0, c.prefix_bytes)
        life = c.rdnss_lifetime
        body += _RDNSS_HDR.pack(OPT_RDNSS, 3, 0, life) + c.dns6_bytes
        names = encode_domain_list(c.dns_search)
        if names:
            names += bytes(-len(names) % 8)
            body += _RDNSS_HDR.pack(OPT_DNSSL, 1 + len(names) // 8, 0, life) + names
        return bytes(body)

    def _ra(self, dst: bytes, dst_mac: bytes) -> bytearray:
        return self._frame(dst_mac, build_icmp6_packet(self.link_local, dst, ND_ROUTER_ADVERT, 0,
                                                       self._ra_body, ND_HOP_LIMIT))

    def periodic_ra(self, now: float) -> bytearray:
        """The unsolicited Router Advertisement to ``ff02::1`` (RFC 4861 6.2.4); call on the caller's timer."""
        self._last_mcast_ra = now
        self._unsolicited += 1
        self.counters["ra_sent_unsolicited"] += 1
        return self._ra(ALL_NODES, multicast_mac(ALL_NODES))

    def next_ra_delay(self) -> float:
        """Seconds until the next unsolicited RA: uniform in [MaxRtrAdvInterval/3, MaxRtrAdvInterval],
        at most 16 s for the first three (RFC 4861 6.2.4)."""
        hi = float(self.config6.ra_interval)
        delay = self.rng.uniform(hi / 3, hi)
        if self._unsolicited < MAX_INITIAL_RTR_ADVERTISEMENTS:
            delay = min(delay, MAX_INITIAL_RTR_ADVERT_INTERVAL)
        return delay

    def final_ra(self) -> bytearray:
        """An RA with Router Lifetime 0 and prefix lifetimes 0, for a clean shutdown (RFC 4861 6.2.5)."""
        body = bytearray(self._ra_body)
        struct.pack_into("!H", body, 2, 0)
        pio = body.find(bytes((OPT_PREFIX, 4)), 12)
        struct.pack_into("!II", body, pio + 4, 0, 0)
        return self._frame(multicast_mac(ALL_NODES), build_icmp6_packet(self.link_local, ALL_NODES,
                                                                        ND_ROUTER_ADVERT, 0, body, ND_HOP_LIMIT))

    def solicit(self, target: bytes) -> bytearray:
        """A Neighbor Solicitation for a guest address whose MAC we do not know (RFC 4861 7.2.2).

        Sent from ``gateway6`` (``link_local`` for a link-local target) to the target's
        solicited-node multicast, with our Source Link-Layer Address; the guest's NA then fills
        :attr:`neighbors`.
        """
        src = self.link_local if target[:2] == b"\xfe\x80" else self.gateway
        dst = solicited_node(target)
        body = bytes(4) + bytes(target) + bytes((OPT_SLLA, 1)) + self.mac
        return self._frame(multicast_mac(dst), build_icmp6_packet(src, dst, ND_NEIGHBOR_SOLICIT, 0, body, ND_HOP_LIMIT))

    def local_echo(self, buf, ip: Ipv6, src_mac: bytes):
        """Answer an ICMPv6 Echo Request to one of :attr:`ours` (RFC 4443 4.2) with whole frames.

        The reply carries the request's data whole, so one reassembled from fragments may be
        above the link MTU (``config6.mtu``): it is then fragmented (RFC 8200 4.5).

        Returns the list of frames (one unless fragmented) or a drop reason (see
        :func:`~aioslirp.wire.ipv6.echo_reply6`; ``icmp6_echo_not_local`` when the destination
        is not ours).
        """
        if ip.dst not in self.ours:
            return "icmp6_echo_not_local"
        if ip.l4 < ip.end and buf[ip.l4] != ICMP6_ECHO_REQUEST:
            return "icmp6_not_echo"
        reply = echo_reply6(buf, ip)
        if type(reply) is str:
            return reply
        return [self._frame(src_mac, p) for p in fragment6(reply, self.config6.mtu)]
