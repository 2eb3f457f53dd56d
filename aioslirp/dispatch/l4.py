"""L4 dispatch, written once for both families: TCP, UDP, DNS, DHCP and the ICMP echo proxy.

Each L3 (:mod:`aioslirp.dispatch.ipv4`, :mod:`aioslirp.dispatch.ipv6`) hands a packet over as
its *packet view*, positional arguments in this order:

* ``fam``: the :class:`~aioslirp.dispatch.family.Family4` / ``Family6`` of the packet;
* ``src``, ``dst``: the guest's source and the destination address (bytes, 4 or 16);
* ``l4``: a ``memoryview`` of the transport header and payload (exactly the packet's);
* ``pkt``: a ``memoryview`` of the whole IP packet, ``l4`` being its tail (quoted by ICMP
  errors through ``fam``); for a reassembled packet, the last fragment's header and the data;
* (UDP only) ``src_mac``: the frame's Ethernet source, for DHCP;
* ``trusted``: the guest's kernel flagged the L4 checksum as valid or partial (offload TAP):
  it is not verified;
* ``now``: loop time of the batch of guest frames.

The views are valid during the call only: whatever outlives it is copied.

TCP: a segment of a known flow goes to it (``handled.tcp``); a SYN opens a
:class:`~aioslirp.nat.tcp.TcpFlow` (towards the host, to a Python handler the
:class:`~aioslirp.handlers.routes.Router` picks, or to the DNS service for the DNS address's
port 53) once the :class:`~aioslirp.flow.guard.Guard` admits it; anything else gets a RST
(RFC 9293 3.10.7.1). UDP: DHCP (``fam.dhcp``), DNS (answered by a task), a handler's
:class:`~aioslirp.handlers.udp.HandledUdpFlow` or a :class:`~aioslirp.nat.udp.UdpFlow`. Echo requests to remote addresses go to
:class:`~aioslirp.nat.icmp.IcmpEcho`. Every refusal is a counted drop; the reasons whose name
differs by family come from ``fam.reason``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Union, cast

from ..flow.base import flow_key
from ..flow.context import FlowContext
from ..flow.guard import DENIED, HELD, Guard
from ..flow.table import FlowTable
from ..handlers.routes import Router
from ..handlers.streams import run_handler
from ..handlers.udp import HandledUdpFlow
from ..nat.icmp import IcmpEcho
from ..nat.tcp import HostFactory, TcpFlow
from ..nat.udp import UdpFlow  # module level: an import under EMFILE (the first UDP flow) would fail
from ..services.dns_tcp import DnsTcpHost
from ..wire.checksum import partial
from ..wire.icmp import KIND_ADMIN, KIND_HOST, KIND_PORT
from ..wire.ip import PROTO_TCP, PROTO_UDP
from ..wire.tcp import ACK, RST, SYN, Segment, parse_segment, reset_for
from ..wire.udp import UDP
from .family import Family

if TYPE_CHECKING:  # made by a port forward (nat.forward is imported with the first one)
    from ..nat.forward import UdpForwardFlow

log = logging.getLogger("aioslirp.stack")

__all__ = ["L4"]

_PORTS = struct.Struct("!HH")  # source and destination port of a TCP/UDP header

#: What a UDP key of the flow table holds: a NAT flow, a Python handler's, or a port forward's.
GuestUdpFlow = Union[UdpFlow, HandledUdpFlow, "UdpForwardFlow"]


class L4:
    """TCP/UDP/echo dispatch over the packet view (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        icmp: the :class:`~aioslirp.nat.icmp.IcmpEcho` proxy (echo requests to remote addresses).
        router: the :class:`~aioslirp.handlers.routes.Router` choosing Python handlers for new
            flows (inactive: none).
    """

    __slots__ = ("ctx", "counters", "drop", "handled", "table", "tcp_flow", "udp_flow", "guard", "icmp", "router",
                 "dns_tasks")

    ctx: FlowContext
    counters: dict[str, int]
    #: ``ctx.drop`` and ``ctx.handled``: a guest frame's outcome.
    drop: Callable[[str], None]
    handled: Callable[[str], None]
    #: The :class:`~aioslirp.flow.table.FlowTable`.
    table: FlowTable
    #: The table's look-up (:attr:`FlowTable.get <aioslirp.flow.table.FlowTable.get>`, bound once:
    #: one attribute look-up less per segment), typed by what a key of the protocol holds: under a
    #: TCP key a :class:`~aioslirp.nat.tcp.TcpFlow` (L4 and the port forwards put them there).
    tcp_flow: Callable[[tuple], TcpFlow | None]
    #: The same look-up for a UDP key: a :class:`~aioslirp.nat.udp.UdpFlow`, a handler's
    #: :class:`~aioslirp.handlers.udp.HandledUdpFlow` or a port forward's ``UdpForwardFlow``.
    udp_flow: Callable[[tuple], GuestUdpFlow | None]
    #: The :class:`~aioslirp.flow.guard.Guard`.
    guard: Guard
    icmp: IcmpEcho
    router: Router
    dns_tasks: set[asyncio.Task]

    def __init__(self, ctx: FlowContext, icmp: IcmpEcho, router: Router) -> None:
        self.ctx = ctx
        self.counters = ctx.counters
        self.drop = ctx.drop
        self.handled = ctx.handled
        self.table = table = ctx.table
        # the table holds Flows; which kind a key holds follows from its protocol (cast once, here)
        self.tcp_flow = cast("Callable[[tuple], TcpFlow | None]", table.get)
        self.udp_flow = cast("Callable[[tuple], GuestUdpFlow | None]", table.get)
        self.guard = ctx.guard
        self.icmp = icmp
        self.router = router
        #: DNS-over-UDP queries being answered (cancelled by ``Stack.reset_flows``).
        self.dns_tasks: set[asyncio.Task] = set()

    # -------------------------------------------------------------- TCP
    def tcp(self, fam: Family, src: bytes, dst: bytes, l4: memoryview, pkt: memoryview, trusted: bool,
            now: float) -> None:
        """One guest TCP segment."""
        n = len(l4)
        if n < 20:
            return self.drop(fam.reason["truncated_tcp"])
        if not trusted and (partial(l4) + fam.pseudo_sum(src, dst, PROTO_TCP, n)) % 0xFFFF != 0:
            return self.drop(fam.reason["bad_tcp_checksum"])
        sport, dport = _PORTS.unpack_from(l4, 0)
        key = (PROTO_TCP, src, sport, dst, dport)  # flow_key(), inlined: this runs for every segment
        seg = parse_segment(l4)
        if seg is None:
            return self.drop("bad_tcp_header")
        if not (sport and dport):
            return self.refuse_port_zero("tcp", fam, src, dst, sport, dport, seg)
        flow = self.tcp_flow(key)
        if flow is not None:
            try:  # (no cost in CPython >= 3.11 while nothing raises)
                taken = flow.on_segment(seg, now)
            except Exception:  # a failing flow ends itself alone: RST both ways, the stack carries on
                log.exception("TCP flow %s failed on a guest segment", key)
                self.counters["flow_errors"] += 1
                flow.fail()
                return self.drop("tcp_flow_failed")
            if taken:
                self.counters["handled.tcp"] += 1
                return
            # flow was finished (TIME-WAIT/CLOSED) and this is a new SYN: the old one drains
            # what the host has not read yet under a key of its own (or ends), the SYN proceeds
            flow.retire()
        # A segment of no flow: a SYN opens one, anything else gets a RST. (Not a method of its
        # own: one call less per connection.)
        if not (seg.flags & SYN) or seg.flags & (RST | ACK):  # need SYN without RST/ACK
            if not seg.flags & RST:
                self.reset_unknown(fam, src, dst, sport, dport, seg)
            return self.drop("tcp_no_flow")
        self.open_tcp(fam, key, seg, l4, pkt, fam.quote(pkt), now)

    def tcp_syn(self, fam: Family, key: tuple, seg: Segment, l4: bytes | memoryview, pkt: bytes | memoryview,
                orig: bytes, now: float) -> bool:
        """A guest SYN of the SYN lane (:meth:`Link.syn <aioslirp.dispatch.link.Link.syn>`): what
        :meth:`tcp` does with a segment of SYN alone, of ports both non-zero and a checksum checked
        (the lane's C made those checks and parsed ``seg``), under ``key`` (``flow_key()``'s
        tuple). False, with nothing done, when a flow holds ``key`` (:meth:`tcp` takes the frame:
        the flow may want it); True when it went to :meth:`open_tcp` (admitted or refused, counted)."""
        if self.tcp_flow(key) is not None:
            return False
        self.open_tcp(fam, key, seg, l4, pkt, orig, now)
        return True

    def open_tcp(self, fam: Family, key: tuple, seg: Segment, l4: bytes | memoryview, pkt: bytes | memoryview,
                 orig: bytes, now: float) -> None:
        """A guest SYN (without ACK or RST) of no flow under ``key``: the checks of the
        destination, the :class:`~aioslirp.flow.guard.Guard`'s admission, the flow table's room, a
        Python handler's route, then the flow (native, Python, or the DNS service's); a RST, an ICMP
        error or a drop otherwise, each counted. ``l4``, ``pkt``: the packet view (the module
        documentation; or ``bytes``, the SYN lane's); ``orig``: what an ICMP error about it quotes (``fam.quote(pkt)``); ``now``:
        loop time."""
        _, src, sport, dst, dport = key
        if src == fam.unspecified:
            return self.drop(fam.reason["tcp_from_unspecified"])
        if fam.v6 and dst[0] == 0xFF:  # IPv6 only; an IPv4 multicast destination is unroutable below
            return self.drop("tcp6_multicast_dst")
        host: HostFactory | None = None
        if dst == fam.dns:
            if dport != 53:
                self.reset_unknown(fam, src, dst, sport, dport, seg)
                return self.drop("tcp_closed_port")
            remote = None
            host = functools.partial(DnsTcpHost, forwarder=self.ctx.running.dns, counters=self.counters,
                                     tasks=self.ctx.tasks)  # the DNS service stands where a host socket would
        else:
            remote = fam.remote_for(dst)
            if remote is None:
                if dst == fam.gw:
                    self.drop("host_loopback_disabled")
                    self.reset_unknown(fam, src, dst, sport, dport, seg)
                    return
                fam.icmp_error(KIND_HOST, orig, now)
                return self.drop(fam.reason["tcp_unroutable_dst"])
        verdict = self.guard.admit(PROTO_TCP, remote, dport, now, (src, sport), dst)  # egress policy and bounds
        if verdict is not None:
            if verdict == DENIED:
                fam.icmp_error(KIND_ADMIN, orig, now)
            elif verdict == HELD:  # an async policy hook decides: answer nothing until then
                self._hold(PROTO_TCP, remote, dport, now, (src, sport), dst, orig, fam,
                           (self.tcp, fam, src, dst, bytes(l4), bytes(pkt), True))
            else:
                self.reset_unknown(fam, src, dst, sport, dport, seg)
            return
        if not self.table.make_room():
            self.reset_unknown(fam, src, dst, sport, dport, seg)
            return self.drop("flow_table_full")
        router = self.router
        if router.active and remote is not None:  # a Python handler takes it?
            got = router.pick(PROTO_TCP, remote, dport, now, self.guard.decision)
            if got is not None:
                self.counters["handler_flows.tcp"] += 1
                host = functools.partial(run_handler, got[0], got[1], router.failed)
        if host is None and remote is not None:
            plane = self.ctx.native_tcp
            if plane is not None and plane.adopt(fam, key, remote, seg, orig, now):  # the C engine runs it
                return self.handled("tcp_syn")
        if not TcpFlow(self.ctx, fam, key, remote, seg, orig, now, host).no_socket:  # else refused, counted
            self.handled("tcp_syn")

    def _hold(self, proto: int, remote: str | None, port: int, now: float, guest: tuple, seen: bytes, quote: bytes,
              fam: Family, replay: tuple | None) -> None:
        """A new flow an async policy hook must decide (:data:`~aioslirp.flow.guard.HELD`): nothing is
        answered until the verdict; then a denial gets ICMP administratively prohibited (quoting
        ``quote``) and an allowed TCP SYN is handled again (``replay``: the call and its arguments,
        the verdict now cached). A UDP datagram or echo request is dropped meanwhile (the guest
        retries; its next one finds the verdict cached). Counted as ``drop.egress_held``."""
        self.drop("egress_held")
        self.ctx.spawn(self._held(proto, remote, port, now, guest, seen, quote, fam, replay), name="aioslirp-policy")

    async def _held(self, proto, remote, port, now, guest, seen, quote, fam, replay) -> None:
        allowed = await self.guard.ask(proto, remote, port, now, guest, seen)
        if self.ctx.closed:
            return
        t = self.ctx.running.time()
        if not allowed:
            fam.icmp_error(KIND_ADMIN, quote, t)
        elif replay is not None:
            fn, *args = replay
            fn(*args, t)

    def reset_unknown(self, fam: Family, src: bytes, dst: bytes, sport: int, dport: int, seg: Segment) -> None:
        """RST for a segment that belongs to no flow (RFC 9293 3.10.7.1; see :func:`reset_for`)."""
        seq, ack, flags = reset_for(seg)
        self.counters["tcp_rst_sent"] += 1
        self.ctx.inject(fam.build_tcp(fam.eth_to(src), dst, src, dport, sport, seq, ack, flags, 0))

    def refuse_port_zero(self, l4_name: str, fam: Family, src: bytes, dst: bytes, sport: int, dport: int,
                         seg: Segment | None = None) -> None:
        """Drop a guest TCP segment or UDP datagram from or to port 0.

        Port 0 is reserved (RFC 6335 6): no endpoint has it, so the packet is never NATed (a host
        socket would connect to or be bound at a random port) and never answered by a service;
        it is counted as ``drop.<l4_name>_port_zero`` (``l4_name``: ``"tcp"`` or ``"udp"``).
        A TCP segment (``seg``) to port 0 from a real port is answered as a closed port would
        be (RFC 9293 3.10.7.1: a RST unless it is one), so the guest's connect fails at once;
        nothing is ever sent towards port 0.
        """
        self.drop(l4_name + "_port_zero")
        if seg is not None and sport and not seg.flags & RST:
            self.reset_unknown(fam, src, dst, sport, dport, seg)

    # -------------------------------------------------------------- UDP
    def udp(self, fam: Family, src: bytes, dst: bytes, l4: memoryview, pkt: memoryview, src_mac: bytes,
            trusted: bool, now: float) -> None:
        """One guest UDP datagram."""
        n = len(l4)
        if n < 8:
            return self.drop(fam.reason["truncated_udp"])
        sport, dport, ulen, csum = UDP.unpack_from(l4, 0)
        if ulen < 8 or ulen > n:
            return self.drop(fam.reason["bad_udp_length"])
        if not trusted:
            if csum:
                if (partial(l4[:ulen]) + fam.pseudo_sum(src, dst, PROTO_UDP, ulen)) % 0xFFFF != 0:
                    return self.drop(fam.reason["bad_udp_checksum"])
            elif fam.v6:  # a zero checksum is none over IPv4, invalid over IPv6 (RFC 8200 8.1)
                return self.drop("udp6_bad_checksum")
        if not (sport and dport):
            return self.refuse_port_zero("udp", fam, src, dst, sport, dport)
        payload = l4[8:ulen]
        if dport == fam.dhcp_port and fam.dhcp(payload, src, sport, dst, src_mac, now):
            return
        if dst == fam.dns:
            if dport == 53:
                return self.dns_udp(fam, bytes(payload), src, sport, now)
            self.handled("udp_port_unreachable")
            return fam.icmp_error(KIND_PORT, pkt, now)
        if src == fam.unspecified:
            return self.drop(fam.reason["udp_from_unspecified"])
        key = (PROTO_UDP, src, sport, dst, dport)  # flow_key(), inlined: this runs for every datagram
        flow = self.udp_flow(key)
        if flow is None:  # an existing flow (e.g. a port forward's, from the gateway) routes as is
            flow = self._udp_open(fam, key, dst, dport, pkt, now)
            if flow is None:
                return
        self.counters["handled.udp"] += 1
        flow.send(payload, pkt[:len(pkt) - n + 8], now)  # the IP header(s) + 8 bytes, for ICMP errors

    def _udp_open(self, fam: Family, key: tuple, dst: bytes, dport: int, pkt: memoryview,
                  now: float) -> UdpFlow | HandledUdpFlow | None:
        """The first datagram of a flow: its new :class:`UdpFlow`, or ``None`` (refused, counted)."""
        remote = fam.remote_for(dst)
        if remote is None:
            if dst == fam.gw:
                self.drop("host_loopback_disabled")
                fam.icmp_error(KIND_ADMIN, pkt, now)
                return None
            self.drop(fam.reason["udp_unroutable_dst"])
            return None
        verdict = self.guard.admit(PROTO_UDP, remote, dport, now, (key[1], key[2]), dst)  # egress policy and bounds
        if verdict is not None:
            if verdict == DENIED:
                fam.icmp_error(KIND_ADMIN, pkt, now)
            elif verdict == HELD:
                self._hold(PROTO_UDP, remote, dport, now, (key[1], key[2]), dst, bytes(pkt), fam, None)
            return None
        if not self.table.make_room():
            self.drop("flow_table_full")
            return None
        router = self.router
        if router.active:  # a Python handler takes it?
            got = router.pick(PROTO_UDP, remote, dport, now, self.guard.decision)
            if got is not None:
                self.counters["handler_flows.udp"] += 1
                return HandledUdpFlow(self.ctx, fam, key, remote, now, got[0], got[1], router.failed)
        flow = UdpFlow(self.ctx, fam, key, remote, now)
        if flow.sock is None:  # counted by UdpFlow (drop.udp_socket_error / udp_connect_error)
            if flow.connect_error is not None:
                fam.icmp_error(flow.connect_error, pkt, now)
            return None
        native = self.ctx.native_udp
        if native is not None:  # the native data plane moves its datagrams from now on (issue 26)
            native.adopt(flow)
        return flow

    # -------------------------------------------------------------- DNS over UDP
    def dns_udp(self, fam: Family, query: bytes, src: bytes, sport: int, now: float) -> None:
        """A query to the DNS address: answered by a task, at most ``dns_max_inflight`` at a time
        (``now``: the batch's loop time, for the DNS name bindings)."""
        guard = self.guard
        if not guard.dns_admit():
            return self.drop("dns_too_many_queries")
        self.counters["dns_queries_udp"] += 1
        self.handled("dns")
        task = self.ctx.spawn(self._dns_answer(fam, query, src, sport, now), name="aioslirp-dns")
        guard.dns_track(task)
        self.dns_tasks.add(task)
        task.add_done_callback(self.dns_tasks.discard)

    async def _dns_answer(self, fam: Family, query: bytes, src: bytes, sport: int, now: float) -> None:
        reply = await self.ctx.running.dns.resolve(query, now=now, guest=(src, sport))
        if reply:
            fam.inject_ip(fam.build_udp(fam.dns, src, 53, sport, reply), src)

    def cancel_dns(self) -> None:
        """Cancel the DNS-over-UDP answers in progress (a guest that went away)."""
        for t in list(self.dns_tasks):
            t.cancel()

    # -------------------------------------------------------------- ICMP echo
    def echo(self, fam: Family, src: bytes, dst: bytes, ident: int, seq: int, payload: bytes, pkt: memoryview,
             now: float) -> None:
        """An echo request (already checked by its L3) to a remote address: proxied by
        :class:`~aioslirp.nat.icmp.IcmpEcho`, once the guard admits its flow."""
        remote = fam.remote_for(dst)
        if remote is None:
            return self.drop(fam.reason["icmp_unroutable_dst"])
        if flow_key(fam.icmp_proto, src, ident, dst, 0) not in self.table.flows:  # a new echo flow
            verdict = self.guard.admit(fam.icmp_proto, remote, 0, now, (src, ident), dst)
            if verdict is not None:
                if verdict == DENIED:
                    fam.icmp_error(KIND_ADMIN, pkt, now)
                elif verdict == HELD:
                    self._hold(fam.icmp_proto, remote, 0, now, (src, ident), dst, bytes(pkt), fam, None)
                return
        self.icmp.echo(fam, src, dst, remote, ident, seq, payload, now)
