"""IPv6 input: header checks, the source check, reassembly, NDP/MLD, local echo, the RA task.

Theory of operation
-------------------
:class:`Ipv6Path` is created by the stack when ``NetworkConfig.ipv6`` is on; the link hands it
every frame with EtherType 0x86DD (:meth:`Ipv6Path.dispatch`). It owns the IPv6 state of the
link: the fragment reassembler, the NDP responder (router advertisements, neighbour cache)
and the stateless DHCPv6 server; its :class:`~aioslirp.dispatch.family.Family6` (``family``)
does the IPv6 output: neighbour look-up and solicitation, fragmentation, ICMPv6 errors. Flows
stay in the stack's one flow table, keyed as for IPv4 with 16-byte addresses:
``(proto, guest addr, guest port, remote addr, remote port)``.

A guest packet goes through :func:`~aioslirp.wire.ipv6.parse_ipv6` (a malformed header or
extension-header chain is a counted drop), the source check (an address of our prefix
other than ours, or link-local; ``::`` only for DAD and MLD), the neighbour cache (source
address -> source MAC), reassembly when it is a fragment, then by upper-layer protocol:

* ICMPv6: NDP (types 133-137) to :class:`~aioslirp.services.ndp.NdpResponder`; echo
  requests to our addresses answered at once, others proxied by
  :class:`~aioslirp.nat.icmp.IcmpEcho` (through ``L4.echo``); MLD reports are counted and ignored
  (we are not a multicast router).
* TCP and UDP: the one L4 (:mod:`aioslirp.dispatch.l4`), as for IPv4; UDP port 547 is the
  DHCPv6 server (``Family6.dhcp``), ``dns6`` port 53 the DNS forwarder, ``gateway6`` reaches
  the host's ``::1``.

A datagram the guest sends above the link MTU to a remote gets Packet Too Big (RFC 8201)
instead of being forwarded (TCP is left alone: our MSS keeps the guest's segments within it).
Router Advertisements go out at once when a transport is served, then periodically (RFC 4861
6.2.4), and a final one withdraws the router on shutdown (6.2.5).

Counters: drops under ``drop.<reason>`` (the wire layer's ``ipv6_*`` reasons, ``ndp_*``,
``icmp6_*``, ``udp6_*``, ``tcp6_*``, ``dhcpv6_*``), NDP events under ``ndp.<event>``,
and ``ipv6_fragments``, ``ipv6_reassembled``, ``icmp6_echo_local``, ``icmp6_errors_sent``,
``icmp6_errors_rate_limited``, ``mld_ignored``, ``dhcpv6_replies``.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

from ..config.ipv6 import Ipv6Config
from ..flow.context import FlowContext
from ..services.dhcpv6 import Dhcpv6Server
from ..services.ndp import NdpResponder
from ..wire.icmp import ICMP6_ECHO_REQUEST, ICMP6_PACKET_TOO_BIG, ND_REDIRECT, ND_ROUTER_SOLICIT
from ..wire.ipv6 import NH_ICMPV6, NH_NONE, NH_TCP, NH_UDP, UNSPECIFIED, l4_checksum_ok, parse_ipv6
from .family import Family6
from .l4 import L4
from .reassembly import Ipv6Reassembler

__all__ = ["Ipv6Path"]

_ECHO_ID_SEQ = struct.Struct("!HH")
#: MLDv1 query/report/done (RFC 2710), MLDv2 report (RFC 3810).
_MLD_TYPES = frozenset((130, 131, 132, 143))
_MAX_SOURCES = 1024


class Ipv6Path:
    """IPv6 for one :class:`~aioslirp.stack.Stack` (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        l4: the :class:`~aioslirp.dispatch.l4.L4` dispatch.

    Attributes:
        config6: the validated :class:`~aioslirp.config.ipv6.Ipv6Config` (from the stack's config).
        family: the :class:`~aioslirp.dispatch.family.Family6` (IPv6 output).
        ndp: the :class:`~aioslirp.services.ndp.NdpResponder`; ``ndp.neighbors`` is the
            neighbour cache (16-byte address -> 6-byte MAC).
        dhcp6: the :class:`~aioslirp.services.dhcpv6.Dhcpv6Server`.
        reassembler: the :class:`~aioslirp.wire.ipv6.Ipv6Reassembler`.
        gw6, dns6, link_local: our addresses (16 bytes).
    """

    __slots__ = ("ctx", "counters", "drop", "config6", "mtu", "ndp", "dhcp6", "family", "reassembler", "gw6", "dns6",
                 "link_local", "ours", "l4", "_good_src", "_ra_task")

    ctx: FlowContext
    counters: dict[str, int]
    #: ``ctx.drop``.
    drop: Callable[[str], None]
    config6: Ipv6Config
    mtu: int
    ndp: NdpResponder
    dhcp6: Dhcpv6Server
    family: Family6
    reassembler: Ipv6Reassembler
    gw6: bytes
    dns6: bytes
    link_local: bytes
    ours: set[bytes]
    #: The one L4: a packet goes on to ``l4.tcp``, ``l4.udp`` or ``l4.echo``.
    l4: L4
    #: Guest source addresses already checked.
    _good_src: set[bytes]
    #: The periodic router advertisement task.
    _ra_task: asyncio.Task | None

    def __init__(self, ctx: FlowContext, l4: L4) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.counters = ctx.counters
        self.drop = ctx.drop
        self.config6 = c6 = Ipv6Config.from_network(cfg)
        self.mtu = c6.mtu
        self.ndp = NdpResponder(c6, cfg.gateway_mac_bytes)
        self.dhcp6 = Dhcpv6Server(c6, cfg.gateway_mac_bytes)
        self.family = Family6(ctx, c6, self.ndp, self.dhcp6)
        self.reassembler = Ipv6Reassembler.from_config(cfg)
        self.gw6 = c6.gateway6_bytes
        self.dns6 = c6.dns6_bytes
        self.link_local = self.ndp.link_local
        self.ours = self.ndp.ours
        self.l4 = l4
        self._good_src: set[bytes] = set()
        self._ra_task: asyncio.Task | None = None

    @property
    def guest_mac(self) -> bytes | None:
        """The MAC of the guest's last IPv6 frame (``None`` before the first)."""
        return self.family.guest_mac

    @property
    def err_bucket(self):
        """The rate limiter of the ICMPv6 errors we send (RFC 4443 2.4 (f))."""
        return self.family.err_bucket

    @err_bucket.setter
    def err_bucket(self, bucket) -> None:
        self.family.err_bucket = bucket

    # ------------------------------------------------------------------ lifecycle
    def start_ra(self) -> None:
        """Start the unsolicited Router Advertisement task (called by ``Stack.serve``)."""
        self.stop_ra()
        self._ra_task = self.ctx.spawn(self._ra_loop(), name="aioslirp-ra")

    def stop_ra(self) -> None:
        if self._ra_task is not None:
            self._ra_task.cancel()
            self._ra_task = None

    async def _ra_loop(self) -> None:
        """RFC 4861 6.2.4: an RA at once, then every ``next_ra_delay()`` seconds."""
        ndp = self.ndp
        clock = self.ctx.running.time
        while True:
            self.ctx.inject(ndp.periodic_ra(clock()))
            self._merge_ndp()
            await asyncio.sleep(ndp.next_ra_delay())

    def final_ra(self) -> None:
        """Queue the RA that withdraws the router and the prefix (RFC 4861 6.2.5), on shutdown."""
        self.ctx.inject(self.ndp.final_ra())

    def reset(self) -> None:
        """Forget the guest (``Stack.reset_flows``): neighbours, reassembly, learned sources."""
        self.ndp.neighbors.clear()
        self.reassembler = Ipv6Reassembler.from_config(self.ctx.config)
        self.family.reset()
        self._good_src.clear()

    def _merge_ndp(self) -> None:
        c = self.ndp.counters
        if c:
            counters = self.counters
            for k, v in c.items():
                counters["ndp." + k] += v
            c.clear()

    # ------------------------------------------------------------------ input
    def dispatch(self, frame: bytes | memoryview, src_mac: bytes, trusted: bool, now: float) -> None:
        """One guest Ethernet frame of EtherType IPv6 (see :mod:`aioslirp.dispatch.l4` for
        ``trusted`` and ``now``). Drops are counted, never raised."""
        drop = self.drop
        ip = parse_ipv6(frame)
        if type(ip) is str:
            return drop(ip)
        src = ip.src
        if src != UNSPECIFIED and not self.guest_source(src, src_mac):
            return
        buf = frame
        if ip.frag is not None:
            r = self.reassembler
            pkt = r.add(frame, ip, now)
            if r.drops:
                counters = self.counters
                for k, v in r.drops.items():
                    counters["drop." + k] += v
                r.drops.clear()
            if pkt is None:
                self.counters["ipv6_fragments"] += 1
                self.ctx.handled("ip_fragment_held")
                return
            self.counters["ipv6_reassembled"] += 1
            ip = parse_ipv6(pkt, 0)
            if type(ip) is str:  # pragma: no cover - the reassembler parsed it already
                return drop(ip)
            buf = pkt
        elif ip.end - ip.off > self.mtu and ip.proto != NH_TCP and ip.dst[0] != 0xFF and ip.dst not in self.ours:
            # Above the link MTU and not for us: a router cannot forward it (RFC 8200 5, RFC 8201).
            # TCP is left alone: our MSS keeps the guest's segments within the MTU.
            self.family.send_icmp6_error(ICMP6_PACKET_TOO_BIG, 0, memoryview(frame)[ip.off:ip.end], param=self.mtu,
                                         src=self.gw6, now=now)
            return drop("ipv6_too_big")
        proto = ip.proto
        if proto == NH_TCP:
            mv = memoryview(buf)
            self.l4.tcp(self.family, ip.src, ip.dst, mv[ip.l4:ip.end], mv[ip.off:ip.end], trusted, now)
        elif proto == NH_UDP:
            mv = memoryview(buf)
            self.l4.udp(self.family, ip.src, ip.dst, mv[ip.l4:ip.end], mv[ip.off:ip.end], src_mac, trusted, now)
        elif proto == NH_ICMPV6:
            self._icmp6(buf, ip, src_mac, now)
        elif proto == NH_NONE:
            drop("ipv6_no_next_header")
        else:
            drop("ipv6_unknown_proto")

    def guest_source(self, src: bytes, src_mac: bytes) -> bool:
        """The source rule of a guest packet from ``src`` (16 bytes, not ``::``) in a frame from
        ``src_mac`` (:meth:`Ipv6Config.check_guest_source
        <aioslirp.config.ipv6.Ipv6Config.check_guest_source>`): False when dropped (counted by its
        reason); a valid one teaches the neighbour cache ``src_mac``, which becomes the guest's MAC."""
        if src not in self._good_src:
            reason = self.config6.check_guest_source(src)
            if reason is not None:
                self.drop(reason)
                return False
            if len(self._good_src) >= _MAX_SOURCES:
                self._good_src.clear()
            self._good_src.add(src)
        if self.ndp.neighbors.get(src) != src_mac and self.ndp.learn(src, src_mac):
            self._merge_ndp()  # ndp.neighbors_evicted, now rather than at the next NDP message
        self.family.guest_mac = src_mac
        return True

    def syn(self, frame: bytes, sport: int, dport: int, l4_off: int, end: int, seg, now: float) -> bool:
        """A plain guest SYN of the SYN lane (:meth:`Link.syn <aioslirp.dispatch.link.Link.syn>`):
        ``frame`` an Ethernet frame whose IPv6 header (no extension header) ends at ``l4_off`` and
        packet at ``end``, checked as :meth:`dispatch` checks them. What :meth:`dispatch` does
        for it (the source rule) and :meth:`L4.tcp_syn <aioslirp.dispatch.l4.L4.tcp_syn>`. False: a
        flow holds its 5-tuple, nothing done."""
        src = frame[22:38]
        dst = frame[38:54]
        l4 = self.l4
        key = (NH_TCP, src, sport, dst, dport)
        if l4.tcp_flow(key) is not None:
            return False
        if src != UNSPECIFIED and not self.guest_source(src, frame[6:12]):
            return True
        packet = frame[14:end]
        fam = self.family
        return l4.tcp_syn(fam, key, seg, packet[l4_off - 14:], packet, fam.quote(packet), now)

    def _icmp6(self, buf, ip, src_mac: bytes, now: float) -> None:
        ctx = self.ctx
        if ip.end - ip.l4 < 4:
            return ctx.drop("icmp6_truncated")
        t = buf[ip.l4]
        if ND_ROUTER_SOLICIT <= t <= ND_REDIRECT:
            res = self.ndp.handle(buf, ip, src_mac, now)
            self._merge_ndp()
            if type(res) is str:
                return ctx.drop(res)
            ctx.handled("ndp")
            for f in res:
                ctx.inject(f)
            return
        if t == ICMP6_ECHO_REQUEST:
            if ip.src == UNSPECIFIED:
                return ctx.drop("icmp6_echo_bad_src")
            if ip.dst in self.ours:
                res = self.ndp.local_echo(buf, ip, src_mac)
                if type(res) is str:
                    return ctx.drop(res)
                self.counters["icmp6_echo_local"] += 1
                ctx.handled("icmp_echo_local")
                for f in res:
                    ctx.inject(f)
                return
            return self._echo_proxy(buf, ip, now)
        if t in _MLD_TYPES:
            self.counters["mld_ignored"] += 1
            return ctx.handled("mld_ignored")
        self.counters["icmp6_ignored"] += 1
        ctx.handled("icmp_ignored")

    def _echo_proxy(self, buf, ip, now: float) -> None:
        mv = memoryview(buf)
        msg = mv[ip.l4:ip.end]
        if len(msg) < 8:
            return self.drop("icmp6_truncated")
        if msg[1] != 0:
            return self.drop("icmp6_bad_code")
        if not l4_checksum_ok(ip.src, ip.dst, NH_ICMPV6, msg):
            return self.drop("icmp6_bad_checksum")
        ident, seq = _ECHO_ID_SEQ.unpack_from(msg, 4)
        self.l4.echo(self.family, ip.src, ip.dst, ident, seq, bytes(msg[8:]), mv[ip.off:ip.end], now)
