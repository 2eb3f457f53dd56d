"""The :class:`Stack` facade: guest frames in, NAT flows and local services, frames out.

Theory of operation
-------------------
A transport hands batches of guest Ethernet frames to :meth:`Stack._on_frames`. Each
frame goes through :meth:`Stack.process_guest_frame`, which parses the headers with
precompiled structs and dispatches:

* ARP requests for the gateway / DNS addresses are answered at once;
* UDP to port 67 goes to the DHCP server, UDP/TCP to DNS:53 to the DNS forwarder;
* ICMP echo to the gateway / DNS is answered locally, elsewhere proxied by an echo flow;
* every other TCP/UDP packet belongs to a NAT flow, looked up in the flow table by
  ``(proto, guest addr, guest port, remote addr, remote port)``; a TCP SYN or a first
  UDP datagram creates one. Each flow owns one task and one host socket.
* IPv6 frames go to :class:`~aioslirp.stack6.Ipv6Path` (NDP/RA, DHCPv6, ICMPv6, and the
  same flows with 16-byte addresses in their keys).

Frames for the guest go into the inject queue (a bounded :class:`asyncio.Queue`); a
single writer task drains it in batches into ``Transport.send_frames``. TCP flows touched
by a batch of guest frames are flushed once at the end of the batch, so many guest
segments produce one ACK and one socket write.

Malformed or hostile input never raises out of :meth:`process_guest_frame`: it is
dropped and counted under ``drop.<reason>`` in :attr:`Stack.counters`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct
import time
from collections import Counter

from .config import NetworkConfig
from .wire.arp import ARP_REPLY, ARP_REQUEST, build_arp, parse_arp
from .wire.checksum import partial
from .wire.ethernet import BROADCAST, ETH, ETHERTYPE_ARP, ETHERTYPE_IPV4, ETHERTYPE_IPV6
from .wire.ipv4 import (ICMP, IP_MF, IP_OFFMASK, IPV4, PROTO_ICMP, PROTO_TCP, PROTO_UDP, UDP,
                        build_icmp_packet, build_tcp, build_udp_packet, fragment, pseudo_sum)
from .wire.ipv6 import TokenBucket
from .wire.neighbors import MAX_NEIGHBORS, NeighborCache
from .wire.reassembly import Reassembler
from . import tracing
from .services.dhcp import reply_destination
from .flow.guard import DENIED, Guard
from .flow.table import FlowTable, IdleOrder  # noqa: F401  (IdleOrder: importable from here as before)
from .limits import TokenBucket as NewFlowBucket
from .lifecycle import farewell
from .inject import InjectQueue
# At module level: an import statement inside _tcp ran for every guest TCP frame (~1-2 us each;
# benchmarks showed -12% CPU per GB guest->host). aioslirp.tcp.flow does not import this module.
from .tcp.flow import TcpFlow, parse_segment, reset_for
from .udp import UdpFlow  # module level: an import under EMFILE (the first UDP flow) would fail

log = logging.getLogger("aioslirp.stack")

__all__ = ["Stack"]

_LOOPBACK4 = "127.0.0.1"
_PORTS = struct.Struct("!HH")  # source and destination port of a TCP/UDP header
_UNTRUSTED = itertools.repeat(False)  # csum_ok of a transport without checksum flags
ICMP_ECHO_REPLY, ICMP_UNREACH, ICMP_ECHO = 0, 3, 8
UNREACH_NET, UNREACH_HOST, UNREACH_PORT, UNREACH_ADMIN = 0, 1, 3, 13


class Stack:
    """A user-mode network stack serving one guest link.

    Usage::

        async with Stack(NetworkConfig()) as stack:
            await stack.serve(transport)   # returns when the transport closes

    Attributes:
        config: the validated :class:`NetworkConfig`.
        counters: ``collections.Counter`` of events: ``frames_in``, ``frames_out``,
            ``bytes_in``, ``bytes_out``, ``drop.<reason>``, ``flows.<proto>.opened``...
        flows: the flow table, ``dict`` key -> flow object.
        idle_order: the :class:`IdleOrder` of its UDP/ICMP flows (the eviction candidates).

    Raises:
        ConfigError: from the constructor when ``config`` is invalid.
    """

    #: Takes ``on_frames(frames, csum_ok)`` from a TAP with a virtio-net header and sends
    #: offload frames when the transport offers it (:mod:`aioslirp.wire.offload`).
    supports_offload = True

    def __init__(self, config: NetworkConfig | None = None) -> None:
        self.config = (config if config is not None else NetworkConfig()).validate()
        cfg = self.config
        self.counters: Counter = Counter()
        rate = float(cfg.new_flow_rate)
        #: Admission control for new guest flows: egress policy and bounds (:mod:`aioslirp.flow.guard`).
        self.guard = Guard(cfg, self.drop, NewFlowBucket(rate, max(1, int(cfg.new_flow_burst))) if rate > 0 else None)
        #: The :class:`~aioslirp.flow.table.FlowTable` (look-up, flush, eviction, idle sweep).
        self.table = FlowTable(cfg, self.counters, self.guard, self)
        self.flows: dict = self.table.flows
        self.idle_order: IdleOrder = self.table.idle_order
        self.gw_mac = cfg.gateway_mac_bytes
        self.gw_ip = cfg.gateway.packed
        self.dns_ip = cfg.dns.packed
        self.guest_ip = cfg.guest.packed
        self.net_int = int(cfg.cidr.network_address)
        self.mask_int = int(cfg.cidr.netmask)
        self.bcast_ip = cfg.cidr.broadcast_address.packed
        self.mtu = cfg.mtu
        #: IPv4 (4 bytes) -> guest MAC, learned from the guest's frames: a
        #: :class:`~aioslirp.wire.neighbors.NeighborCache` (at most ``MAX_NEIGHBORS`` = 1024, as
        #: for IPv6; one more forgets the entry learned longest ago, ``arp.neighbors_evicted``).
        self.neighbors = NeighborCache(MAX_NEIGHBORS)
        self.reassembler = Reassembler.from_config(self.config)
        #: Rate limiter of the ICMP errors we send (RFC 1812 4.3.2.8), see :meth:`send_icmp_error`.
        self.icmp_errors = TokenBucket()
        #: The IPv6 half (:class:`~aioslirp.stack6.Ipv6Path`: NDP/RA, DHCPv6, IPv6 dispatch);
        #: ``None`` when ``config.ipv6`` is off.
        self.v6 = None
        if cfg.ipv6:
            from .stack6 import Ipv6Path

            self.v6 = Ipv6Path(self)
        self._transport = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The :class:`~aioslirp.inject.InjectQueue` of frames for the guest (and its writer task).
        self.inject_queue = InjectQueue(cfg.inject_queue_size, self.counters, self)
        #: Queue one frame for the guest (:meth:`InjectQueue.put <aioslirp.inject.InjectQueue.put>`):
        #: False (counted ``drop.inject_full``) when the queue is full.
        self.inject = self.inject_queue.put
        #: Write every queued frame now (:meth:`InjectQueue.write_now <aioslirp.inject.InjectQueue.write_now>`).
        self.write_now = self.inject_queue.write_now
        self._aux_tasks: set[asyncio.Task] = set()
        #: The transport being served offers checksum/TCP segmentation offload (a TAP with
        #: ``IFF_VNET_HDR``): TCP flows opened while it is served send ~64 KB segments with
        #: partial checksums (:mod:`aioslirp.wire.offload`). Set by :meth:`serve`.
        self.offload = False
        #: True while the frame being processed was flagged by the guest's kernel as having a
        #: partial/valid L4 checksum (offload TAP): its TCP/UDP/ICMP checksum is not verified.
        self._l4_trusted = False
        self._closed = False
        self._stopped: asyncio.Future | None = None
        self.dhcp = None
        self.dns = None
        self.icmp = None
        self.tasks: set[asyncio.Task] = set()
        #: Callables ``wrap(transport) -> transport`` applied in order by :meth:`serve`
        #: (e.g. :class:`~aioslirp.transport.pcap.PcapTransport` for ``--pcap``).
        self.transport_wrappers: list = []
        self._forwarder = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the stack runs on (``None`` before :meth:`start`)."""
        return self._loop

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` began."""
        return self._closed

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Stack":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the writer task and the services. Called by ``async with``."""
        from .services.dhcp import DhcpServer
        from .services.dns import DnsForwarder
        from .icmp import IcmpEcho

        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self.inject_queue.start(self._loop)
        self.dhcp = DhcpServer(self.config)
        self.dns = DnsForwarder(self.config)
        self.icmp = IcmpEcho(self)
        self.guard.start(self.dns)
        self.table.start(self._loop)

    def close(self) -> None:
        """Ask :meth:`serve` to return; flows are torn down by :meth:`aclose`."""
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    async def aclose(self) -> None:
        """Reset every flow towards the guest, close all host sockets, stop all tasks."""
        if self._closed:
            return
        self._closed = True
        self.close()
        if self._forwarder is not None:
            self._forwarder.close()
        self.table.close()
        self.table.shutdown_all()
        tasks = [t for t in self.tasks if not t.done()]
        for t in tasks:
            t.cancel()
        for t in list(self._aux_tasks):
            t.cancel()
        await asyncio.gather(*tasks, *self._aux_tasks, return_exceptions=True)
        if self.v6 is not None and self._loop is not None:
            self.v6.final_ra()  # withdraw the router and the prefix (RFC 4861 6.2.5)
        # let the writer drain the final RSTs
        if self._loop is not None and self._transport is not None and not self._transport.closed.done():
            await self.inject_queue.drain()
        await self.inject_queue.stop()
        if self.icmp is not None:
            self.icmp.close()
        if self.dns is not None:
            await self.dns.close()
        if self._transport is not None:
            self._transport.close()
        self.table.clear()
        if tracing.enabled:
            tracing.stack_closed(self)

    def reset_flows(self) -> int:
        """Forget the guest: tear down every flow and the per-guest state. Returns flows torn down.

        For a guest that went away (QEMU exited) before the next one is served by this same
        stack: every flow is shut down (RST towards the old guest, host socket closed, task
        cancelled; the tasks finish on the next loop iterations), pending DNS answers are
        cancelled, and learned neighbours, DHCP leases and fragment reassembly state are
        cleared, so the next guest starts from a clean table and gets the first address
        again. When the transport is already closed, frames still queued for the old guest
        are discarded (counted as ``drop.no_transport``). Port forwards and counters stay.
        """
        from .services.dhcp import DhcpServer

        n = self.table.shutdown_all()
        self.table.clear()
        for t in list(self._aux_tasks):
            if t.get_name() == "aioslirp-dns":
                t.cancel()
        self.neighbors.clear()
        self.reassembler = Reassembler.from_config(self.config)
        if self.v6 is not None:
            self.v6.reset()
        if self.dhcp is not None:
            self.dhcp = DhcpServer(self.config)
        tr = self._transport
        if tr is None or tr.closed is None or tr.closed.done():
            self.inject_queue.discard()
        self.counters["flows_reset"] += n
        return n

    async def serve(self, transport) -> None:
        """Serve ``transport`` until it closes or :meth:`close` is called.

        The transport is closed on return. One transport at a time; ``serve`` may be
        called again with a new transport once it returned (call :meth:`reset_flows`
        in between when the new transport is a different guest).
        """
        if self._loop is None:
            await self.start()
        for wrap in self.transport_wrappers:
            transport = wrap(transport)
        self._transport = self.inject_queue.transport = transport
        self.offload = bool(getattr(transport, "offload", False))
        await transport.open(self._on_frames)
        if self.v6 is not None:
            self.v6.start_ra()  # an RA at once, then periodically (RFC 4861 6.2.4)
        try:
            await asyncio.wait([transport.closed, self._stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self.v6 is not None:
                self.v6.stop_ra()
            try:
                if self._stopped.done() and transport.closed is not None and not transport.closed.done():
                    await farewell(self)  # asked to stop, the guest still there: RST its flows first
            finally:
                transport.close()

    def spawn(self, coro, name: str | None = None) -> asyncio.Task:
        """Run an auxiliary coroutine owned by the stack (cancelled by :meth:`aclose`)."""
        t = self._loop.create_task(coro, name=name)
        self._aux_tasks.add(t)
        t.add_done_callback(self._aux_done)
        return t

    def _aux_done(self, t: asyncio.Task) -> None:
        self._aux_tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("auxiliary task %s failed", t.get_name(), exc_info=t.exception())

    # ------------------------------------------------------------------ output
    def inject_room(self) -> int:
        """Free slots in the inject queue."""
        return self.inject_queue.room

    def eth_to(self, ip: bytes) -> bytes:
        """Ethernet header from the gateway to the guest owning ``ip`` (4 bytes: IPv4; 16: IPv6,
        see :meth:`~aioslirp.stack6.Ipv6Path.eth_to`)."""
        if len(ip) == 16:
            return self.v6.eth_to(ip)
        return ETH.pack(self.neighbors.get(ip, BROADCAST), self.gw_mac, ETHERTYPE_IPV4)

    def inject_ip(self, packet, dst_ip: bytes) -> None:
        """Queue an IPv4 packet (bytes-like, no Ethernet header) for the guest, fragmenting to the MTU."""
        eth = self.eth_to(dst_ip)
        for p in fragment(packet, self.mtu):
            self.inject(eth + p)

    def inject_ip6(self, packet, dst_ip: bytes) -> None:
        """Queue an IPv6 packet (bytes-like, no Ethernet header) for the guest's ``dst_ip`` (16 bytes),
        fragmenting to the MTU. Only with ``config.ipv6`` on."""
        self.v6.inject_ip6(packet, dst_ip)

    def send_icmp_error(self, icmp_type: int, code: int, orig_ip_packet) -> None:
        """Send ICMP ``icmp_type``/``code`` to the guest about ``orig_ip_packet`` (its header + 8 bytes, RFC 792).

        Rate limited (RFC 1812 4.3.2.8) by :attr:`icmp_errors`, a token bucket of the same class
        and rate as the ICMPv6 one (100 errors/s, burst 50): an error over the rate is not sent
        and is counted as ``icmp_errors_rate_limited``. For an IPv6 ``orig_ip_packet`` the
        ICMPv6 equivalent is sent instead, under the ICMPv6 limiter (destination unreachable
        codes net/host/port/admin -> 0/3/4/1, RFC 4443 3.1).
        """
        orig = bytes(orig_ip_packet)
        if len(orig) < 28:
            return
        if orig[0] >> 4 == 6:  # an IPv6 packet: the ICMPv6 equivalent (RFC 4443 3.1)
            if self.v6 is not None:
                self.v6.icmp_error_v4style(icmp_type, code, orig)
            return
        if not self.icmp_errors.allow(time.monotonic()):
            self.counters["icmp_errors_rate_limited"] += 1
            return
        ihl = (orig[0] & 0x0F) * 4
        quoted = orig[: ihl + 8]
        src = orig[12:16]
        dst = orig[16:20]
        self.counters["icmp_errors_sent"] += 1
        self.inject_ip(build_icmp_packet(dst, src, icmp_type, code, 0, quoted), src)

    # ------------------------------------------------------------------ input
    def _on_frames(self, frames, csum_ok=None) -> None:
        """A batch of guest frames from the transport. ``csum_ok`` (offload TAP only): per frame,
        True when the guest's kernel flagged its L4 checksum partial or valid (``NEEDS_CSUM`` /
        ``DATA_VALID``): such frames are trusted, as passt does, instead of verified."""
        q = self.inject_queue
        q.hold = True
        try:
            if tracing.enabled:
                process = self.process_guest_frame
                try:
                    for f, ok in zip(frames, _UNTRUSTED if csum_ok is None else csum_ok):
                        self._l4_trusted = ok
                        process(f)
                finally:
                    self._l4_trusted = False
            else:
                # process_guest_frame inlined (one call less per frame; counters per batch)
                counters = self.counters
                counters["frames_in"] += len(frames)
                counters["bytes_in"] += sum(map(len, frames))
                dispatch = self._dispatch
                try:
                    for f, ok in zip(frames, _UNTRUSTED if csum_ok is None else csum_ok):
                        self._l4_trusted = ok
                        try:
                            dispatch(f)
                        except Exception:
                            self.drop("internal_error")
                            log.exception("internal error processing a guest frame")
                finally:
                    self._l4_trusted = False
            self.table.flush()
        finally:
            q.hold = False
        self.write_now()

    def flush(self) -> None:
        """Let every flow touched since the last flush send what is due (one ACK, one socket write)."""
        self.table.flush()

    def mark_dirty(self, flow) -> None:
        self.table.dirty.add(flow)

    def drop(self, reason: str) -> None:
        """Count a dropped guest frame: ``drop.<reason>`` and ``frames_dropped``.

        Every guest frame ends with exactly one outcome: dropped here, or handled
        (:meth:`handled`), so that ``frames_in == frames_dropped + sum(handled.*)``
        (:meth:`frame_outcomes`). Drops that are not a guest frame's outcome (a frame for the
        guest the inject queue had no room for, fragments evicted after they were held) are
        counted as ``drop.<reason>`` alone.
        """
        counters = self.counters
        counters["drop." + reason] += 1
        counters["frames_dropped"] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dropped guest frame: %s", reason)

    def handled(self, reason: str) -> None:
        """Count a guest frame that was handled (answered, NATed, held for reassembly...) as
        ``handled.<reason>``; see :meth:`drop`."""
        self.counters["handled." + reason] += 1

    def frame_outcomes(self) -> tuple[int, int, int]:
        """``(frames_in, handled, dropped)``: frames received, and how many of them were handled
        (the sum of ``handled.<reason>``) or dropped (``frames_dropped``). Each frame has one
        outcome, so the first equals the sum of the other two."""
        c = self.counters
        handled = sum(v for k, v in c.items() if k.startswith("handled."))
        return c["frames_in"], handled, c["frames_dropped"]

    def process_guest_frame(self, frame) -> None:
        """Process one guest Ethernet frame (bytes-like). Never raises: bad input is dropped and counted."""
        self.counters["frames_in"] += 1
        self.counters["bytes_in"] += len(frame)
        try:
            if tracing.enabled:
                tracing.guest_frame(self, frame)
            else:
                self._dispatch(frame)
        except Exception:
            self.drop("internal_error")
            log.exception("internal error processing a guest frame")

    def _dispatch(self, frame) -> None:
        if len(frame) < 14:
            return self.drop("truncated_eth")
        dst_mac, src_mac, ethertype = ETH.unpack_from(frame, 0)
        if src_mac[0] & 1:
            return self.drop("bad_src_mac")
        if ethertype == ETHERTYPE_IPV4:
            self._ipv4(frame, src_mac)
        elif ethertype == ETHERTYPE_ARP:
            self._arp(frame, src_mac)
        elif ethertype == ETHERTYPE_IPV6:
            if self.v6 is not None:
                self.v6.dispatch(frame, src_mac)
            else:
                self.drop("ipv6_disabled")
        else:
            self.drop("unknown_ethertype")

    def _arp(self, frame, src_mac: bytes) -> None:
        arp = parse_arp(frame)
        if arp is None:
            return self.drop("bad_arp")
        oper, sha, spa, tha, tpa = arp
        if self._in_subnet(spa) and spa not in (self.gw_ip, self.dns_ip) and self.neighbors.get(spa) != sha:
            self._learn_neighbor(spa, sha)
        self.handled("arp")
        if oper != ARP_REQUEST:
            return
        if tpa == spa:  # gratuitous ARP / DAD probe announcements
            return
        if tpa in (self.gw_ip, self.dns_ip):
            self.counters["arp_replies"] += 1
            self.inject(build_arp(ARP_REPLY, self.gw_mac, tpa, sha, spa))

    def _learn_neighbor(self, ip4: bytes, mac: bytes) -> None:
        if self.neighbors.learn(ip4, mac):
            self.counters["arp.neighbors_evicted"] += 1

    def _in_subnet(self, ip4: bytes) -> bool:
        return (int.from_bytes(ip4, "big") & self.mask_int) == self.net_int

    def _ipv4(self, frame, src_mac: bytes) -> None:
        flen = len(frame)
        if flen < 34:
            return self.drop("truncated_ip")
        ver_ihl, _tos, total, ident, flags_frag, _ttl, proto, _csum, src, dst = IPV4.unpack_from(frame, 14)
        ihl = (ver_ihl & 0x0F) << 2
        if ver_ihl >> 4 != 4 or ihl < 20:
            return self.drop("bad_ip_header")
        if total < ihl or 14 + total > flen:
            return self.drop("bad_ip_length")
        mv = memoryview(frame)
        if partial(mv[14:14 + ihl]) != 0:
            return self.drop("bad_ip_checksum")
        if src != b"\x00\x00\x00\x00":
            if ((int.from_bytes(src, "big") & self.mask_int) != self.net_int  # _in_subnet, inlined
                    or src in (self.gw_ip, self.dns_ip, self.bcast_ip)):
                return self.drop("bad_src_ip")
            if self.neighbors.get(src) != src_mac:
                self._learn_neighbor(src, src_mac)
        l4 = mv[14 + ihl:14 + total]
        if flags_frag & (IP_MF | IP_OFFMASK):
            data = self.reassembler.add((src, dst, proto, ident), (flags_frag & IP_OFFMASK) << 3,
                                        bool(flags_frag & IP_MF), l4, time.monotonic())
            if self.reassembler.drops:
                for k, v in self.reassembler.drops.items():
                    self.counters["drop." + k] += v
                self.reassembler.drops.clear()
            if data is None:
                self.counters["ip_fragments"] += 1
                self.handled("ip_fragment_held")
                return
            self.counters["ip_reassembled"] += 1
            l4 = memoryview(data)
            header = bytes(mv[14:14 + ihl])
        else:
            header = None
        if proto == PROTO_TCP:
            self._tcp(mv, ihl, l4, src, dst, src_mac)
        elif proto == PROTO_UDP:
            self._udp(mv, ihl, l4, src, dst, src_mac, header)
        elif proto == PROTO_ICMP:
            self._icmp(mv, ihl, l4, src, dst)
        else:
            self.drop("unknown_ip_proto")

    def _remote_for(self, dst: bytes) -> str | None:
        """Host address a guest destination maps to, or None when it must not be reached."""
        if dst == self.gw_ip:
            return None if self.config.disable_host_loopback else _LOOPBACK4
        if self._in_subnet(dst) or dst == b"\xff\xff\xff\xff":
            return None
        first = dst[0]
        if first == 127 or first == 0 or first >= 224:
            return None
        return socket.inet_ntoa(dst)

    # -------------------------------------------------------------- UDP
    def _udp(self, mv, ihl: int, l4, src: bytes, dst: bytes, src_mac: bytes, frag_header) -> None:
        if len(l4) < 8:
            return self.drop("truncated_udp")
        sport, dport, ulen, csum = UDP.unpack_from(l4, 0)
        if ulen < 8 or ulen > len(l4):
            return self.drop("bad_udp_length")
        if csum and not self._l4_trusted and (partial(l4[:ulen]) + pseudo_sum(src, dst, PROTO_UDP, ulen)) % 0xFFFF != 0:
            return self.drop("bad_udp_checksum")
        if not (sport and dport):
            return self.refuse_port_zero("udp", src, dst, sport, dport)
        payload = l4[8:ulen]
        if dport == 67 and sport == 68:
            return self._dhcp(payload, src_mac)
        if dst == self.dns_ip:
            if dport == 53:
                return self._dns_udp(bytes(payload), src, sport)
            self.handled("udp_port_unreachable")
            return self._port_unreachable(mv, ihl, l4, frag_header)
        if src == b"\x00\x00\x00\x00":
            return self.drop("udp_from_unspecified")
        key = (PROTO_UDP, src, sport, dst, dport)
        flow = self.flows.get(key)
        if flow is None:  # an existing flow (e.g. a port forward's, from the gateway) routes as is
            remote = self._remote_for(dst)
            if remote is None:
                if dst == self.gw_ip:
                    self.drop("host_loopback_disabled")
                    return self._port_unreachable(mv, ihl, l4, frag_header, UNREACH_ADMIN)
                return self.drop("udp_unroutable_dst")
            verdict = self.guard.admit(PROTO_UDP, remote, dport)  # egress policy and bounds (aioslirp/limits.py)
            if verdict is not None:
                if verdict == DENIED:
                    self._port_unreachable(mv, ihl, l4, frag_header, UNREACH_ADMIN)
                return
            if not self._make_room(PROTO_UDP):
                return self.drop("flow_table_full")
            flow = UdpFlow(self, key, remote)
            if flow.sock is None:  # counted by UdpFlow (drop.udp_socket_error / udp_connect_error)
                if flow.connect_error is not None:
                    self._port_unreachable(mv, ihl, l4, frag_header, flow.connect_error)
                return
        self.counters["handled.udp"] += 1
        flow.send(payload, mv[14:14 + ihl + 8] if frag_header is None else frag_header + bytes(l4[:8]))

    def _port_unreachable(self, mv, ihl, l4, frag_header, code: int = UNREACH_PORT) -> None:
        orig = bytes(mv[14:14 + ihl]) + bytes(l4[:8]) if frag_header is None else frag_header + bytes(l4[:8])
        self.send_icmp_error(ICMP_UNREACH, code, orig)

    def _dhcp(self, payload, src_mac: bytes) -> None:
        res = self.dhcp.handle(bytes(payload), src_mac, time.monotonic())
        self.handled("dhcp")
        if res is None:
            self.counters["dhcp_ignored"] += 1
            return
        reply, broadcast = res
        self.counters["dhcp_replies"] += 1
        dst_ip = socket.inet_aton(reply_destination(reply, broadcast))
        if dst_ip == b"\x00\x00\x00\x00":
            dst_ip = b"\xff\xff\xff\xff"
        pkt = build_udp_packet(self.gw_ip, dst_ip, 67, 68, reply)
        dst_mac = BROADCAST if broadcast else src_mac
        for p in fragment(pkt, self.mtu):
            self.inject(ETH.pack(dst_mac, self.gw_mac, ETHERTYPE_IPV4) + p)

    def _dns_udp(self, query: bytes, src: bytes, sport: int) -> None:
        if not self.guard.dns_admit():
            return self.drop("dns_too_many_queries")
        self.counters["dns_queries_udp"] += 1
        self.handled("dns")
        self.guard.dns_track(self.spawn(self._dns_answer(query, src, sport), name="aioslirp-dns"))

    async def _dns_answer(self, query: bytes, src: bytes, sport: int) -> None:
        reply = await self.dns.resolve(query)
        if reply:
            self.inject_ip(build_udp_packet(self.dns_ip, src, 53, sport, reply), src)

    # -------------------------------------------------------------- ICMP
    def _icmp(self, mv, ihl: int, l4, src: bytes, dst: bytes) -> None:
        if len(l4) < 8:
            return self.drop("truncated_icmp")
        if not self._l4_trusted and partial(l4) != 0:
            return self.drop("bad_icmp_checksum")
        icmp_type, code, _csum, rest = ICMP.unpack_from(l4, 0)
        if icmp_type != ICMP_ECHO:
            self.counters["icmp_ignored"] += 1
            self.handled("icmp_ignored")
            return
        if dst in (self.gw_ip, self.dns_ip):
            self.counters["icmp_echo_local"] += 1
            self.handled("icmp_echo_local")
            self.inject_ip(build_icmp_packet(dst, src, ICMP_ECHO_REPLY, 0, rest, l4[8:]), src)
            return
        remote = self._remote_for(dst)
        if remote is None:
            return self.drop("icmp_unroutable_dst")
        if (PROTO_ICMP, src, rest >> 16, dst, 0) not in self.flows:  # a new echo flow (key of aioslirp/icmp.py)
            verdict = self.guard.admit(PROTO_ICMP, remote)
            if verdict is not None:
                if verdict == DENIED:
                    self.send_icmp_error(ICMP_UNREACH, UNREACH_ADMIN, bytes(mv[14:14 + ihl]) + bytes(l4[:8]))
                return
        self.icmp.echo(src, dst, remote, rest >> 16, rest & 0xFFFF, bytes(l4[8:]), bytes(mv[14:14 + ihl]) + bytes(l4[:8]))

    # -------------------------------------------------------------- TCP
    def _tcp(self, mv, ihl: int, l4, src: bytes, dst: bytes, src_mac: bytes) -> None:
        n = len(l4)
        if n < 20:
            return self.drop("truncated_tcp")
        if not self._l4_trusted and (partial(l4) + pseudo_sum(src, dst, PROTO_TCP, n)) % 0xFFFF != 0:
            return self.drop("bad_tcp_checksum")
        sport, dport = _PORTS.unpack_from(l4, 0)
        key = (PROTO_TCP, src, sport, dst, dport)
        seg = parse_segment(l4)
        if seg is None:
            return self.drop("bad_tcp_header")
        if not (sport and dport):
            return self.refuse_port_zero("tcp", src, dst, sport, dport, seg, self._tcp_reset_unknown)
        flow = self.flows.get(key)
        if flow is not None:
            if flow.on_segment(seg):
                self.counters["handled.tcp"] += 1
                return
            # flow was finished (TIME-WAIT/CLOSED) and this is a new SYN: the old one drains
            # what the host has not read yet under a key of its own (or ends), the SYN proceeds
            flow.retire()
        if not (seg.flags & 0x02) or seg.flags & 0x14:  # need SYN without RST/ACK
            if not seg.flags & 0x04:
                self._tcp_reset_unknown(src, dst, sport, dport, seg)
            return self.drop("tcp_no_flow")
        if src == b"\x00\x00\x00\x00":
            return self.drop("tcp_from_unspecified")
        orig = bytes(mv[14:14 + ihl]) + bytes(l4[:8])
        if dst == self.dns_ip:
            if dport != 53:
                self._tcp_reset_unknown(src, dst, sport, dport, seg)
                return self.drop("tcp_closed_port")
            remote = None
        else:
            remote = self._remote_for(dst)
            if remote is None:
                if dst == self.gw_ip:
                    self.drop("host_loopback_disabled")
                    self._tcp_reset_unknown(src, dst, sport, dport, seg)
                    return
                self.send_icmp_error(ICMP_UNREACH, UNREACH_HOST, orig)
                return self.drop("tcp_unroutable_dst")
        verdict = self.guard.admit(PROTO_TCP, remote, dport)  # egress policy and bounds (aioslirp/limits.py)
        if verdict is not None:
            if verdict == DENIED:
                self.send_icmp_error(ICMP_UNREACH, UNREACH_ADMIN, orig)
            else:
                self._tcp_reset_unknown(src, dst, sport, dport, seg)
            return
        if not self._make_room(PROTO_TCP):
            self._tcp_reset_unknown(src, dst, sport, dport, seg)
            return self.drop("flow_table_full")
        if not TcpFlow(self, key, remote, seg, orig).no_socket:  # else refused, counted by the flow
            self.handled("tcp_syn")

    def _tcp_reset_unknown(self, src, dst, sport, dport, seg) -> None:
        """RST for a segment that belongs to no flow (RFC 9293 3.10.7.1; see :func:`reset_for`)."""
        seq, ack, flags = reset_for(seg)
        self.counters["tcp_rst_sent"] += 1
        self.inject(build_tcp(self.eth_to(src), dst, src, dport, sport, seq, ack, flags, 0))

    def refuse_port_zero(self, l4_name: str, src: bytes, dst: bytes, sport: int, dport: int, seg=None,
                         reset=None) -> None:
        """Drop a guest TCP segment or UDP datagram from or to port 0, for both address families.

        Port 0 is reserved (RFC 6335 6): no endpoint has it, so the packet is never NATed (a host
        socket would connect to or be bound at a random port) and never answered by a service;
        it is counted as ``drop.<l4_name>_port_zero`` (``l4_name``: ``"tcp"`` or ``"udp"``).
        A TCP segment (``seg``) to port 0 from a real port is answered as a closed port would
        be (RFC 9293 3.10.7.1: a RST unless it is one; ``reset(src, dst, sport, dport, seg)``
        sends it), so the guest's connect fails at once; nothing is ever sent towards port 0.
        """
        self.drop(l4_name + "_port_zero")
        if seg is not None and sport and not seg.flags & 0x04:
            reset(src, dst, sport, dport, seg)

    # -------------------------------------------------------------- flow table
    def _make_room(self, proto: int = 0) -> bool:
        """:meth:`FlowTable.make_room <aioslirp.flow.table.FlowTable.make_room>`."""
        return self.table.make_room()

    def add_flow(self, flow) -> None:
        self.table.add(flow)

    def remove_flow(self, flow) -> None:
        self.table.remove(flow)

    # -------------------------------------------------------------- port forwards
    @property
    def forwarder(self):
        """The :class:`~aioslirp.forward.Forwarder` holding this stack's port forwards."""
        if self._forwarder is None:
            from .forward import Forwarder
            self._forwarder = Forwarder(self)
        return self._forwarder

    async def add_forward(self, fwd):
        """Forward a host port into the guest; see :class:`~aioslirp.forward.PortForward`.

        Needs a started stack (inside ``async with``); may be called before or while
        :meth:`serve` runs. Returns the :class:`PortForward` as added, with its ``id``
        (1, 2, ... per stack) and the bound ``host_port`` (when 0 was asked). Raises
        :class:`~aioslirp.config.ConfigError` for a bad field (proto, ports, a guest address
        outside the network) and :class:`~aioslirp.forward.ForwardError` (an ``OSError``)
        when the host address/port cannot be bound, e.g. already in use.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("add_forward() needs a started, open Stack")
        return await self.forwarder.add(fwd)

    def remove_forward(self, fwd):
        """Stop a forward, given its ``id`` or the :class:`PortForward` returned by
        :meth:`add_forward`: its host socket closes at once (new connections are
        refused); forwarded TCP connections already open carry on. Returns the removed
        :class:`PortForward`; raises ``KeyError`` when there is no such forward."""
        fid = fwd if isinstance(fwd, int) else getattr(fwd, "id", None)
        if fid is None or self._forwarder is None:
            raise KeyError(fwd)
        return self._forwarder.remove(fid)

    def forwards(self) -> list:
        """The active :class:`PortForward` objects, in the order they were added."""
        return [] if self._forwarder is None else self._forwarder.list()

    def flow_stats(self) -> dict:
        """Active flows by ``proto`` and TCP state: ``{"tcp": {"ESTABLISHED": 3}, "udp": 1, ...}``."""
        out: dict = {}
        for f in self.flows.values():
            if f.proto == PROTO_TCP:
                d = out.setdefault("tcp", {})
                d[f.state] = d.get(f.state, 0) + 1
            else:
                out[f.proto_name] = out.get(f.proto_name, 0) + 1
        return out

    def stats(self) -> dict:
        """A JSON-ready snapshot of the stack's state, for the API socket's ``get_stats``.

        Shape: ``{"counters": {name: int}, "flows": flow_stats(), "inject_queue": {"depth": int,
        "size": int}}``. ``counters`` holds every :attr:`counters` entry (``frames_in``,
        ``frames_out``, ``bytes_in``, ``bytes_out``, ``drop.<reason>``, ``flows.<proto>.opened``
        / ``.closed``...); the same values are exported as OpenTelemetry metrics by
        :func:`aioslirp.metrics.register`.
        """
        q = self.inject_queue
        return {
            "counters": {k: int(v) for k, v in sorted(self.counters.items())},
            "flows": self.flow_stats(),
            "inject_queue": {"depth": len(q), "size": self.config.inject_queue_size},
        }
