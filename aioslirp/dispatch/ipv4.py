"""IPv4 input: header checks, the source check, reassembly, ICMP; then the one L4.

A guest IPv4 packet is dropped and counted when its header is malformed (``truncated_ip``,
``bad_ip_header``, ``bad_ip_length``, ``bad_ip_checksum``) or its source is not a guest
address of our subnet (``bad_src_ip``; ``0.0.0.0`` is let through for DHCP). A valid source
teaches the ARP cache the frame's MAC (at most ``MAX_NEIGHBORS`` entries, the oldest learned
goes first: ``arp.neighbors_evicted``). Fragments are held by the bounded
:class:`~aioslirp.dispatch.reassembly.Reassembler` (``ip_fragments``, ``ip_reassembled``, its
``drop.frag_*`` reasons). Then by protocol: TCP and UDP to :mod:`aioslirp.dispatch.l4` as the
packet view; ICMP echo requests to the gateway or DNS address are answered here
(``icmp_echo_local``), to other addresses proxied (``L4.echo``); other ICMP is counted and
ignored (``icmp_ignored``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..flow.context import FlowContext
from ..wire.checksum import partial
from ..wire.icmp import ICMP, ICMP_ECHO, ICMP_ECHO_REPLY, build_icmp_packet
from ..wire.ip import PROTO_ICMP, PROTO_TCP, PROTO_UDP
from ..wire.ipv4 import IP_MF, IP_OFFMASK, IPV4
from ..wire.neighbors import NeighborCache
from ..wire.tcp import Segment
from .family import Family4
from .l4 import L4
from .reassembly import Reassembler

__all__ = ["Ipv4Input"]

_ZERO4 = b"\x00\x00\x00\x00"


class Ipv4Input:
    """IPv4 input of one stack (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        fam: its :class:`~aioslirp.dispatch.family.Family4` (addresses, ARP cache, output).
        l4: the :class:`~aioslirp.dispatch.l4.L4` dispatch.

    Attributes:
        reassembler: the :class:`~aioslirp.dispatch.reassembly.Reassembler` (new one per :meth:`reset`).
    """

    __slots__ = ("ctx", "fam", "counters", "drop", "neighbors", "net_int", "mask_int", "not_guest", "l4",
                 "reassembler")

    ctx: FlowContext
    fam: Family4
    counters: dict[str, int]
    #: ``ctx.drop``.
    drop: Callable[[str], None]
    neighbors: NeighborCache
    net_int: int
    mask_int: int
    not_guest: tuple[bytes, ...]
    #: The one L4: a packet goes on to ``l4.tcp``, ``l4.udp`` or ``l4.echo``.
    l4: L4
    reassembler: Reassembler

    def __init__(self, ctx: FlowContext, fam: Family4, l4: L4) -> None:
        self.ctx = ctx
        self.fam = fam
        self.counters = ctx.counters
        self.drop = ctx.drop
        self.neighbors = fam.neighbors
        self.net_int = fam.net_int
        self.mask_int = fam.mask_int
        #: Sources a guest frame must not have: our addresses and the subnet broadcast.
        self.not_guest = (fam.gw, fam.dns, fam.bcast)
        self.l4 = l4
        self.reassembler = Reassembler.from_config(ctx.config)

    def reset(self) -> None:
        """Forget fragments held for reassembly (``Stack.reset_flows``)."""
        self.reassembler = Reassembler.from_config(self.ctx.config)

    def input(self, frame: bytes | memoryview, src_mac: bytes, trusted: bool, now: float) -> None:
        """One guest Ethernet frame of EtherType IPv4 (``src_mac`` its source); see :mod:`aioslirp.dispatch.l4`
        for ``trusted`` and ``now``. Drops are counted, never raised."""
        flen = len(frame)
        if flen < 34:
            return self.drop("truncated_ip")
        ver_ihl, _tos, total, ident, flags_frag, _ttl, proto, _csum, src, dst = IPV4.unpack_from(frame, 14)
        ihl = (ver_ihl & 0x0F) << 2
        if ver_ihl >> 4 != 4 or ihl < 20:
            return self.drop("bad_ip_header")
        if total < ihl or 14 + total > flen:
            return self.drop("bad_ip_length")
        pkt = memoryview(frame)[14:14 + total]
        if partial(pkt[:ihl]) != 0:
            return self.drop("bad_ip_checksum")
        if src != _ZERO4 and not self.guest_source(src, src_mac):
            return
        l4 = pkt[ihl:]
        if flags_frag & (IP_MF | IP_OFFMASK):
            r = self.reassembler
            data = r.add((src, dst, proto, ident), (flags_frag & IP_OFFMASK) << 3, bool(flags_frag & IP_MF), l4, now)
            if r.drops:
                counters = self.counters
                for k, v in r.drops.items():
                    counters["drop." + k] += v
                r.drops.clear()
            if data is None:
                self.counters["ip_fragments"] += 1
                self.ctx.handled("ip_fragment_held")
                return
            self.counters["ip_reassembled"] += 1
            pkt = memoryview(bytes(pkt[:ihl]) + data)  # the completing fragment's header, the whole data
            l4 = pkt[ihl:]
        if proto == PROTO_TCP:
            self.l4.tcp(self.fam, src, dst, l4, pkt, trusted, now)
        elif proto == PROTO_UDP:
            self.l4.udp(self.fam, src, dst, l4, pkt, src_mac, trusted, now)
        elif proto == PROTO_ICMP:
            self.icmp(src, dst, l4, pkt, trusted, now)
        else:
            self.drop("unknown_ip_proto")

    def guest_source(self, src: bytes, src_mac: bytes) -> bool:
        """The source rule of a guest packet from ``src`` (4 bytes, not ``0.0.0.0``) in a frame from
        ``src_mac``: an address of our subnet other than ours and its broadcast, else dropped
        (``bad_src_ip``: False); a valid one teaches the ARP cache ``src_mac``."""
        if (int.from_bytes(src, "big") & self.mask_int) != self.net_int or src in self.not_guest:
            self.drop("bad_src_ip")
            return False
        neighbors = self.neighbors
        if neighbors.get(src) != src_mac and neighbors.learn(src, src_mac):
            self.counters["arp.neighbors_evicted"] += 1
        return True

    def syn(self, frame: bytes, sport: int, dport: int, l4_off: int, end: int, seg: Segment, now: float) -> bool:
        """A plain guest SYN of the SYN lane (:meth:`Link.syn <aioslirp.dispatch.link.Link.syn>`):
        ``frame`` an Ethernet frame whose IPv4 header (no fragment) ends at ``l4_off`` and packet at
        ``end``, checked as :meth:`input` checks them. What :meth:`input` does for it (the source
        rule: ``0.0.0.0`` goes to the L4, which drops it) and :meth:`L4.tcp_syn
        <aioslirp.dispatch.l4.L4.tcp_syn>`. False: a flow holds its 5-tuple, nothing done."""
        src = frame[26:30]
        dst = frame[30:34]
        l4 = self.l4
        key = (PROTO_TCP, src, sport, dst, dport)
        if l4.tcp_flow(key) is not None:
            return False
        if src != _ZERO4 and not self.guest_source(src, frame[6:12]):
            return True
        packet = frame[14:end]
        fam = self.fam
        return l4.tcp_syn(fam, key, seg, packet[l4_off - 14:], packet, fam.quote(packet), now)

    def icmp(self, src: bytes, dst: bytes, l4: memoryview, pkt: memoryview, trusted: bool, now: float) -> None:
        """A guest ICMP message: echo requests answered (our addresses) or proxied; others ignored."""
        if len(l4) < 8:
            return self.drop("truncated_icmp")
        if not trusted and partial(l4) != 0:
            return self.drop("bad_icmp_checksum")
        icmp_type, _code, _csum, rest = ICMP.unpack_from(l4, 0)
        ctx = self.ctx
        if icmp_type != ICMP_ECHO:
            self.counters["icmp_ignored"] += 1
            ctx.handled("icmp_ignored")
            return
        fam = self.fam
        if dst in fam.ours:
            self.counters["icmp_echo_local"] += 1
            ctx.handled("icmp_echo_local")
            fam.inject_ip(build_icmp_packet(dst, src, ICMP_ECHO_REPLY, 0, rest, l4[8:]), src)
            return
        self.l4.echo(fam, src, dst, rest >> 16, rest & 0xFFFF, bytes(l4[8:]), pkt, now)
