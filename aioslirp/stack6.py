"""The IPv6 half of the :class:`~aioslirp.stack.Stack`: dispatch of guest IPv6 frames and IPv6 output.

Theory of operation
-------------------
:class:`Ipv6Path` is created by the stack when ``NetworkConfig.ipv6`` is on; the stack hands
it every frame with EtherType 0x86DD (:meth:`Ipv6Path.dispatch`). It owns the IPv6 state of
the link: the fragment reassembler, the NDP responder (router advertisements, neighbour
cache), the stateless DHCPv6 server and the ICMPv6 error rate limiter. Flows stay in the
stack's one flow table, keyed as for IPv4 with 16-byte addresses:
``(proto, guest addr, guest port, remote addr, remote port)``.

A guest packet goes through :func:`~aioslirp.wire.ipv6.parse_ipv6` (a malformed header or
extension-header chain is a counted drop), the source check (an address of our prefix
other than ours, or link-local; ``::`` only for DAD and MLD), the neighbour cache (source
address -> source MAC), reassembly when it is a fragment, then by upper-layer protocol:

* ICMPv6: NDP (types 133-137) to :class:`~aioslirp.services.ndp.NdpResponder`; echo
  requests to our addresses answered at once, others proxied by
  :class:`~aioslirp.icmp.IcmpEcho` (ICMPv6 ping sockets, or a raw socket when privileged);
  MLD reports are counted and ignored (we are not a multicast router).
* UDP: port 547 to the DHCPv6 server; ``dns6`` port 53 to the DNS forwarder; everything
  else to a :class:`~aioslirp.udp.UdpFlow` (``gateway6`` reaches the host's ``::1``).
* TCP: like IPv4 — a SYN opens a :class:`~aioslirp.tcp.flow.TcpFlow` (towards the host, or
  to the DNS-over-TCP service for ``dns6`` port 53); a segment of no flow gets a RST.

Output: :meth:`Ipv6Path.eth_to` picks the guest's MAC from the neighbour cache; for an
address not yet known it uses the last MAC the guest sent from and sends a Neighbor
Solicitation (at most one per address and second) so the cache fills.
:meth:`Ipv6Path.inject_ip6` fragments to the link MTU (RFC 8200 4.5).
ICMPv6 errors (RFC 4443) are rate limited by a token bucket (2.4 (f)); a datagram the guest
sends above the link MTU to a remote gets Packet Too Big (RFC 8201) instead of being
forwarded.

Counters: drops under ``drop.<reason>`` (the wire layer's ``ipv6_*`` reasons, ``ndp_*``,
``icmp6_*``, ``udp6_*``, ``tcp6_*``, ``dhcpv6_*``), NDP events under ``ndp.<event>``,
and ``ipv6_fragments``, ``ipv6_reassembled``, ``icmp6_echo_local``, ``icmp6_errors_sent``,
``icmp6_errors_rate_limited``, ``mld_ignored``, ``dhcpv6_replies``.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

from .config6 import Ipv6Config
from .services.dhcpv6 import Dhcpv6Server
from .services.ndp import NdpResponder
from .tcp.flow import TcpFlow, parse_segment, reset_for  # module level: this runs for every guest TCP frame
from .udp import UdpFlow
from .limits import DENIED
from .wire.ethernet import ETH, ETHERTYPE_IPV6
from .wire.ipv6 import (ICMP6_DST_UNREACH, ICMP6_ECHO_REQUEST, ICMP6_PACKET_TOO_BIG, ND_REDIRECT,
                        ND_ROUTER_SOLICIT, NH_ICMPV6, NH_NONE, NH_TCP, NH_UDP, UNSPECIFIED, Ipv6Reassembler,
                        TokenBucket, build_icmp6_error, build_tcp6, build_udp6_packet, fragment6,
                        l4_checksum_ok, multicast_mac, parse_ipv6, solicited_node)

log = logging.getLogger("aioslirp.stack")

__all__ = ["Ipv6Path"]

_PORTS = struct.Struct("!HH")
_UDP = struct.Struct("!HHHH")
_ECHO_ID_SEQ = struct.Struct("!HH")
#: All_DHCP_Relay_Agents_and_Servers (RFC 8415 7.1).
ALL_DHCP = bytes.fromhex("ff020000000000000000000000010002")
#: MLDv1 query/report/done (RFC 2710), MLDv2 report (RFC 3810).
_MLD_TYPES = frozenset((130, 131, 132, 143))
#: ICMPv4 destination-unreachable codes used by the flows -> ICMPv6 codes (RFC 4443 3.1).
_V4_TO_V6_UNREACH = {0: 0, 1: 3, 3: 4, 13: 1}
_ICMP4_UNREACH = 3
#: Most of an offending packet an ICMPv6 error can quote (1280 - 40 - 8, RFC 4443 2.4 (c)).
_QUOTE = 1232
_MAX_SOURCES = 1024


class Ipv6Path:
    """IPv6 for one :class:`~aioslirp.stack.Stack` (see the module documentation).

    Attributes:
        config6: the validated :class:`~aioslirp.config6.Ipv6Config` (from the stack's config).
        ndp: the :class:`~aioslirp.services.ndp.NdpResponder`; ``ndp.neighbors`` is the
            neighbour cache (16-byte address -> 6-byte MAC).
        dhcp6: the :class:`~aioslirp.services.dhcpv6.Dhcpv6Server`.
        reassembler: the :class:`~aioslirp.wire.ipv6.Ipv6Reassembler`.
        gw6, dns6, link_local: our addresses (16 bytes).
        guest_mac: the MAC of the guest's last IPv6 frame (``None`` before the first).
    """

    def __init__(self, stack) -> None:
        self.stack = stack
        cfg = stack.config
        self.config6 = c6 = Ipv6Config.from_network(cfg)
        self.mtu = c6.mtu
        self.gw_mac = cfg.gateway_mac_bytes
        self.ndp = NdpResponder(c6, self.gw_mac)
        self.dhcp6 = Dhcpv6Server(c6, self.gw_mac)
        self.reassembler = Ipv6Reassembler.from_config(self.stack.config)
        self.err_bucket = TokenBucket()
        self.gw6 = c6.gateway6_bytes
        self.dns6 = c6.dns6_bytes
        self.link_local = self.ndp.link_local
        self.ours = self.ndp.ours
        self.host_loopback = not cfg.disable_host_loopback
        self.guest_mac: bytes | None = None
        self._good_src: set[bytes] = set()
        self._solicited: dict[bytes, float] = {}
        self._ra_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    def start_ra(self) -> None:
        """Start the unsolicited Router Advertisement task (called by ``Stack.serve``)."""
        self.stop_ra()
        self._ra_task = self.stack.spawn(self._ra_loop(), name="aioslirp-ra")

    def stop_ra(self) -> None:
        if self._ra_task is not None:
            self._ra_task.cancel()
            self._ra_task = None

    async def _ra_loop(self) -> None:
        """RFC 4861 6.2.4: an RA at once, then every ``next_ra_delay()`` seconds."""
        ndp = self.ndp
        while True:
            self.stack.inject(ndp.periodic_ra(time.monotonic()))
            self._merge_ndp()
            await asyncio.sleep(ndp.next_ra_delay())

    def final_ra(self) -> None:
        """Queue the RA that withdraws the router and the prefix (RFC 4861 6.2.5), on shutdown."""
        self.stack.inject(self.ndp.final_ra())

    def reset(self) -> None:
        """Forget the guest (``Stack.reset_flows``): neighbours, reassembly, learned sources."""
        self.ndp.neighbors.clear()
        self.reassembler = Ipv6Reassembler.from_config(self.stack.config)
        self.guest_mac = None
        self._good_src.clear()
        self._solicited.clear()

    def _merge_ndp(self) -> None:
        c = self.ndp.counters
        if c:
            counters = self.stack.counters
            for k, v in c.items():
                counters["ndp." + k] += v
            c.clear()

    # ------------------------------------------------------------------ output
    def eth_to(self, dst: bytes) -> bytes:
        """14-byte Ethernet header from the gateway to the guest's ``dst`` (16 bytes).

        Multicast goes to its ``33:33`` MAC. A unicast address missing from the neighbour
        cache goes to the guest's last MAC (or the solicited-node MAC before any frame) and
        triggers a Neighbor Solicitation (RFC 4861 7.2.2).
        """
        mac = self.ndp.neighbors.get(dst)
        if mac is None:
            if dst[0] == 0xFF:
                mac = multicast_mac(dst)
            else:
                mac = self.guest_mac or multicast_mac(solicited_node(dst))
                self._solicit(dst)
        return ETH.pack(mac, self.gw_mac, ETHERTYPE_IPV6)

    def _solicit(self, dst: bytes) -> None:
        now = time.monotonic()
        last = self._solicited.get(dst)
        if last is not None and now - last < 1.0:
            return
        if len(self._solicited) >= 256:
            self._solicited.clear()
        self._solicited[dst] = now
        self.stack.counters["ndp.ns_sent"] += 1
        self.stack.inject(self.ndp.solicit(dst))

    def inject_ip6(self, packet, dst: bytes) -> None:
        """Queue an IPv6 packet (no Ethernet header, no extension headers) for the guest's ``dst``,
        fragmented to the link MTU."""
        eth = self.eth_to(dst)
        inject = self.stack.inject
        if len(packet) <= self.mtu:
            inject(eth + packet)
            return
        for p in fragment6(packet, self.mtu):
            inject(eth + p)

    def send_icmp6_error(self, icmp_type: int, code: int, orig, param: int = 0, src: bytes | None = None) -> None:
        """ICMPv6 error ``icmp_type``/``code`` to the guest about ``orig`` (its IPv6 packet, maybe
        truncated), rate limited (RFC 4443 2.4 (f)); refused where 2.4 (e) says so.

        ``src``: our address sending it; default the original destination (the remote the
        guest tried, as libslirp does), or ``gateway6`` when that is multicast.
        """
        counters = self.stack.counters
        if not self.err_bucket.allow(time.monotonic()):
            counters["icmp6_errors_rate_limited"] += 1
            return
        orig = bytes(orig[:_QUOTE])
        if len(orig) < 40:
            return
        if src is None:
            src = orig[24:40]
            if src[0] == 0xFF:
                src = self.gw6
        pkt = build_icmp6_error(icmp_type, code, orig, src=src, param=param)
        if pkt is None:
            counters["icmp6_errors_suppressed"] += 1
            return
        counters["icmp6_errors_sent"] += 1
        self.inject_ip6(pkt, orig[8:24])

    def icmp_error_v4style(self, icmp_type: int, code: int, orig) -> None:
        """``Stack.send_icmp_error`` for an IPv6 ``orig``: ICMPv4 destination unreachable codes
        (net 0, host 1, port 3, admin 13) become ICMPv6 codes (no route 0, address 3, port 4, admin 1)."""
        if icmp_type != _ICMP4_UNREACH:
            return
        self.send_icmp6_error(ICMP6_DST_UNREACH, _V4_TO_V6_UNREACH.get(code, 3), orig)

    # ------------------------------------------------------------------ input
    def dispatch(self, frame, src_mac: bytes) -> None:
        """Process one guest Ethernet frame whose EtherType is IPv6. Drops are counted, never raised."""
        stack = self.stack
        ip = parse_ipv6(frame)
        if type(ip) is str:
            return stack.drop(ip)
        src = ip.src
        if src != UNSPECIFIED:
            if src not in self._good_src:
                reason = self.config6.check_guest_source(src)
                if reason is not None:
                    return stack.drop(reason)
                if len(self._good_src) >= _MAX_SOURCES:
                    self._good_src.clear()
                self._good_src.add(src)
            if self.ndp.neighbors.get(src) != src_mac and self.ndp.learn(src, src_mac):
                self._merge_ndp()  # ndp.neighbors_evicted, now rather than at the next NDP message
            self.guest_mac = src_mac
        buf = frame
        if ip.frag is not None:
            r = self.reassembler
            pkt = r.add(frame, ip, time.monotonic())
            if r.drops:
                for k, v in r.drops.items():
                    stack.counters["drop." + k] += v
                r.drops.clear()
            if pkt is None:
                stack.counters["ipv6_fragments"] += 1
                stack.handled("ip_fragment_held")
                return
            stack.counters["ipv6_reassembled"] += 1
            ip = parse_ipv6(pkt, 0)
            if type(ip) is str:  # pragma: no cover - the reassembler parsed it already
                return stack.drop(ip)
            buf = pkt
        elif ip.end - ip.off > self.mtu and ip.proto != NH_TCP and ip.dst[0] != 0xFF and ip.dst not in self.ours:
            # Above the link MTU and not for us: a router cannot forward it (RFC 8200 5, RFC 8201).
            # TCP is left alone: our MSS keeps the guest's segments within the MTU.
            self.send_icmp6_error(ICMP6_PACKET_TOO_BIG, 0, memoryview(frame)[ip.off:ip.end], param=self.mtu,
                                  src=self.gw6)
            return stack.drop("ipv6_too_big")
        proto = ip.proto
        if proto == NH_TCP:
            self._tcp(buf, ip)
        elif proto == NH_UDP:
            self._udp(buf, ip, src_mac)
        elif proto == NH_ICMPV6:
            self._icmp6(buf, ip, src_mac)
        elif proto == NH_NONE:
            stack.drop("ipv6_no_next_header")
        else:
            stack.drop("ipv6_unknown_proto")

    # -------------------------------------------------------------- ICMPv6
    def _icmp6(self, buf, ip, src_mac: bytes) -> None:
        stack = self.stack
        if ip.end - ip.l4 < 4:
            return stack.drop("icmp6_truncated")
        t = buf[ip.l4]
        if ND_ROUTER_SOLICIT <= t <= ND_REDIRECT:
            res = self.ndp.handle(buf, ip, src_mac, time.monotonic())
            self._merge_ndp()
            if type(res) is str:
                return stack.drop(res)
            stack.handled("ndp")
            for f in res:
                stack.inject(f)
            return
        if t == ICMP6_ECHO_REQUEST:
            if ip.src == UNSPECIFIED:
                return stack.drop("icmp6_echo_bad_src")
            if ip.dst in self.ours:
                res = self.ndp.local_echo(buf, ip, src_mac)
                if type(res) is str:
                    return stack.drop(res)
                stack.counters["icmp6_echo_local"] += 1
                stack.handled("icmp_echo_local")
                for f in res:
                    stack.inject(f)
                return
            return self._echo_proxy(buf, ip)
        if t in _MLD_TYPES:
            stack.counters["mld_ignored"] += 1
            return stack.handled("mld_ignored")
        stack.counters["icmp6_ignored"] += 1
        stack.handled("icmp_ignored")

    def _echo_proxy(self, buf, ip) -> None:
        stack = self.stack
        msg = memoryview(buf)[ip.l4:ip.end]
        if len(msg) < 8:
            return stack.drop("icmp6_truncated")
        if msg[1] != 0:
            return stack.drop("icmp6_bad_code")
        if not l4_checksum_ok(ip.src, ip.dst, NH_ICMPV6, msg):
            return stack.drop("icmp6_bad_checksum")
        remote = self.config6.remote_for(ip.dst, self.host_loopback)
        if remote is None:
            return stack.drop("icmp6_unroutable_dst")
        ident, seq = _ECHO_ID_SEQ.unpack_from(msg, 4)
        if (NH_ICMPV6, ip.src, ident, ip.dst, 0) not in stack.flows:  # a new echo flow (key of aioslirp/icmp.py)
            verdict = stack.guard.admit(NH_ICMPV6, remote)
            if verdict is not None:
                if verdict == DENIED:
                    self.send_icmp6_error(ICMP6_DST_UNREACH, 1, memoryview(buf)[ip.off:ip.end])
                return
        stack.icmp.echo6(ip.src, ip.dst, remote, ident, seq, bytes(msg[8:]))

    # -------------------------------------------------------------- UDP
    def _udp(self, buf, ip, src_mac: bytes) -> None:
        stack = self.stack
        l4 = ip.l4
        if ip.end - l4 < 8:
            return stack.drop("udp6_truncated")
        sport, dport, ulen, _csum = _UDP.unpack_from(buf, l4)
        if ulen < 8 or ulen > ip.end - l4:
            return stack.drop("udp6_bad_length")
        mv = memoryview(buf)
        src, dst = ip.src, ip.dst
        if not stack._l4_trusted and not l4_checksum_ok(src, dst, NH_UDP, mv[l4:l4 + ulen]):  # a zero checksum fails too (RFC 8200 8.1)
            return stack.drop("udp6_bad_checksum")
        if not (sport and dport):
            return stack.refuse_port_zero("udp", src, dst, sport, dport)
        payload = mv[l4 + 8:l4 + ulen]
        if dport == 547 and (dst == ALL_DHCP or dst in self.ours):
            return self._dhcp6(payload, src, sport, dst != ALL_DHCP, src_mac)
        if dst == self.dns6:
            if dport == 53:
                return self._dns_udp6(bytes(payload), src, sport)
            stack.handled("udp_port_unreachable")
            return self.send_icmp6_error(ICMP6_DST_UNREACH, 4, mv[ip.off:ip.end])
        if src == UNSPECIFIED:
            return stack.drop("udp6_from_unspecified")
        key = (NH_UDP, src, sport, dst, dport)
        flow = stack.flows.get(key)
        if flow is None:
            remote = self.config6.remote_for(dst, self.host_loopback)
            if remote is None:
                if dst == self.gw6:
                    stack.drop("host_loopback_disabled")
                    return self.send_icmp6_error(ICMP6_DST_UNREACH, 1, mv[ip.off:ip.end])
                return stack.drop("udp6_unroutable_dst")
            verdict = stack.guard.admit(NH_UDP, remote, dport)  # egress policy and bounds (aioslirp/limits.py)
            if verdict is not None:
                if verdict == DENIED:
                    self.send_icmp6_error(ICMP6_DST_UNREACH, 1, mv[ip.off:ip.end])
                return
            if not stack._make_room(NH_UDP):
                return stack.drop("flow_table_full")
            flow = UdpFlow(stack, key, remote)
            if flow.sock is None:  # counted by UdpFlow (drop.udp_socket_error / udp_connect_error)
                if flow.connect_error is not None:
                    self.icmp_error_v4style(_ICMP4_UNREACH, flow.connect_error, mv[ip.off:ip.end])
                return
        stack.counters["handled.udp"] += 1
        flow.send(payload, mv[ip.off:l4 + 8])

    def _dhcp6(self, payload, src: bytes, sport: int, unicast: bool, src_mac: bytes) -> None:
        stack = self.stack
        if src == UNSPECIFIED:
            return stack.drop("dhcpv6_from_unspecified")
        res = self.dhcp6.handle(payload, unicast)
        if type(res) is str:
            return stack.drop("dhcpv6_" + res)
        stack.counters["dhcpv6_replies"] += 1
        stack.handled("dhcpv6")
        pkt = build_udp6_packet(self.link_local, src, 547, sport, res)
        eth = ETH.pack(src_mac, self.gw_mac, ETHERTYPE_IPV6)
        for p in fragment6(pkt, self.mtu):
            stack.inject(eth + p)

    def _dns_udp6(self, query: bytes, src: bytes, sport: int) -> None:
        stack = self.stack
        if not stack.guard.dns_admit():
            return stack.drop("dns_too_many_queries")
        stack.counters["dns_queries_udp"] += 1
        stack.handled("dns")
        stack.guard.dns_track(stack.spawn(self._dns_answer6(query, src, sport), name="aioslirp-dns"))

    async def _dns_answer6(self, query: bytes, src: bytes, sport: int) -> None:
        reply = await self.stack.dns.resolve(query)
        if reply:
            self.inject_ip6(build_udp6_packet(self.dns6, src, 53, sport, reply), src)

    # -------------------------------------------------------------- TCP
    def _tcp(self, buf, ip) -> None:
        stack = self.stack
        mv = memoryview(buf)
        l4 = mv[ip.l4:ip.end]
        if len(l4) < 20:
            return stack.drop("tcp6_truncated")
        src, dst = ip.src, ip.dst
        if not stack._l4_trusted and not l4_checksum_ok(src, dst, NH_TCP, l4):
            return stack.drop("tcp6_bad_checksum")
        sport, dport = _PORTS.unpack_from(l4, 0)
        seg = parse_segment(l4)
        if seg is None:
            return stack.drop("bad_tcp_header")
        if not (sport and dport):
            return stack.refuse_port_zero("tcp", src, dst, sport, dport, seg, self._reset_unknown)
        key = (NH_TCP, src, sport, dst, dport)
        flow = stack.flows.get(key)
        if flow is not None:
            if flow.on_segment(seg):
                stack.counters["handled.tcp"] += 1
                return
            flow.retire()  # finished (TIME-WAIT/CLOSED) and this is a new SYN: make way (see TcpFlow.retire)
        if not (seg.flags & 0x02) or seg.flags & 0x14:  # need SYN without RST/ACK
            if not seg.flags & 0x04:
                self._reset_unknown(src, dst, sport, dport, seg)
            return stack.drop("tcp_no_flow")
        if src == UNSPECIFIED:
            return stack.drop("tcp6_from_unspecified")
        if dst[0] == 0xFF:
            return stack.drop("tcp6_multicast_dst")
        orig = bytes(mv[ip.off:min(ip.end, ip.off + _QUOTE)])
        if dst == self.dns6:
            if dport != 53:
                self._reset_unknown(src, dst, sport, dport, seg)
                return stack.drop("tcp_closed_port")
            remote = None
        else:
            remote = self.config6.remote_for(dst, self.host_loopback)
            if remote is None:
                if dst == self.gw6:
                    stack.drop("host_loopback_disabled")
                    return self._reset_unknown(src, dst, sport, dport, seg)
                self.send_icmp6_error(ICMP6_DST_UNREACH, 3, orig)
                return stack.drop("tcp6_unroutable_dst")
        verdict = stack.guard.admit(NH_TCP, remote, dport)  # egress policy and bounds (aioslirp/limits.py)
        if verdict is not None:
            if verdict == DENIED:
                self.send_icmp6_error(ICMP6_DST_UNREACH, 1, orig)
            else:
                self._reset_unknown(src, dst, sport, dport, seg)
            return
        if not stack._make_room(NH_TCP):
            self._reset_unknown(src, dst, sport, dport, seg)
            return stack.drop("flow_table_full")
        if not TcpFlow(stack, key, remote, seg, orig).no_socket:  # else refused, counted by the flow
            stack.handled("tcp_syn")

    def _reset_unknown(self, src, dst, sport, dport, seg) -> None:
        """RST for a segment that belongs to no flow (RFC 9293 3.10.7.1; see :func:`reset_for`)."""
        seq, ack, flags = reset_for(seg)
        self.stack.counters["tcp_rst_sent"] += 1
        self.stack.inject(build_tcp6(self.eth_to(src), dst, src, dport, sport, seq, ack, flags, 0))
