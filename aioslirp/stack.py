"""The :class:`Stack` facade: guest frames in, NAT flows and local services, frames out.

Theory of operation
-------------------
A :class:`Stack` builds and wires the parts of the data path, each given the collaborators it
needs at construction (a :class:`~aioslirp.flow.base.FlowContext`: config, counters, the loop
once started, the flow table, the inject queue, ``spawn``) and none reading the stack itself:

* :mod:`aioslirp.dispatch`: the guest link (:class:`~aioslirp.dispatch.link.Link`, the sink the
  transport delivers batches of frames to: Ethernet demux, ARP), L3 per family
  (:class:`~aioslirp.dispatch.ipv4.Ipv4Input`, :class:`~aioslirp.dispatch.ipv6.Ipv6Path`) and
  the one L4 (:class:`~aioslirp.dispatch.l4.L4`: TCP, UDP, DNS, DHCP, the echo proxy) over the
  per-family :class:`~aioslirp.dispatch.family.Family4` / ``Family6``;
* :mod:`aioslirp.flow`: the flow table (look-up by ``(proto, guest addr, guest port, remote
  addr, remote port)``, the flush of the flows a batch touched, eviction, the one idle sweep)
  and the :class:`~aioslirp.flow.guard.Guard` admitting new flows;
* :mod:`aioslirp.inject`: the bounded queue of frames for the guest and its writer;
* the services (DHCP, DNS, NDP, DHCPv6) and the ICMP echo proxy; the port forwards
  (:mod:`aioslirp.forward`).

A batch of guest frames is processed with one clock reading (``loop.time()``), the TCP flows it
touched are flushed once at its end (many guest segments give one ACK and one socket write),
and the frames it produced are written to the transport in the same loop iteration.

Malformed or hostile input never raises out of :meth:`Stack.process_guest_frame`: it is
dropped and counted under ``drop.<reason>`` in :attr:`Stack.counters`; every guest frame has
exactly one outcome (:meth:`Stack.frame_outcomes`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter

from . import tracing
from .compiled import notice as compiled_notice
from .config import NetworkConfig
from .dispatch.family import Family4
from .dispatch.ipv4 import Ipv4Input
from .dispatch.l4 import L4
from .dispatch.link import Link
from .flow.base import FlowContext
from .handlers.routes import Router
from .flow.guard import Guard
from .flow.info import FlowInfo, FlowMap  # noqa: F401  (FlowInfo: the records of stack.flows())
from .flow.table import FlowTable, IdleOrder  # noqa: F401  (IdleOrder: importable from here as before)
from .icmp import IcmpEcho
from .heap import keep_freed_heap
from .inject import InjectQueue
from .lifecycle import EventLog, farewell, gone_before_first_frame
from .ratelimit import ByteBucket
from .ratelimit import TokenBucket as NewFlowBucket
from .services.dhcp import DhcpServer
from .services.dns import DnsForwarder
from .services.dns_tcp import DnsTcpHost
from .tcp.hostsock import HostPoller
from .transport.trace import TraceTransport
from .wire.neighbors import MAX_NEIGHBORS, NeighborCache

log = logging.getLogger("aioslirp.stack")

__all__ = ["Stack"]


class Stack:
    """A user-mode network stack serving one guest link.

    Usage::

        async with Stack(NetworkConfig()) as stack:
            await stack.serve(transport)   # returns when the transport closes

    Attributes:
        config: the validated :class:`NetworkConfig`.
        counters: ``collections.Counter`` of events: ``frames_in``, ``frames_out``,
            ``bytes_in``, ``bytes_out``, ``drop.<reason>``, ``flows.<proto>.opened``...
        flows: the flow table, ``dict`` key -> flow (:class:`~aioslirp.flow.base.Flow`). Called,
            ``stack.flows()`` returns a ``list`` of :class:`~aioslirp.flow.info.FlowInfo` records, one
            per flow at that moment: protocol, guest and remote ``(address, port)``, DNS name (``None``
            for now), state, bytes each way, age and idle time in seconds (what ``list_flows`` of the
            API socket reports).
        idle_order: the :class:`~aioslirp.flow.table.IdleOrder` of its UDP/ICMP flows (the
            eviction candidates).
        table: the :class:`~aioslirp.flow.table.FlowTable` holding :attr:`flows`.
        guard: the :class:`~aioslirp.flow.guard.Guard` (egress policy and bounds).
        inject_queue: the :class:`~aioslirp.inject.InjectQueue`; :attr:`inject` is its ``put``.
        neighbors: the ARP cache, IPv4 (4 bytes) -> guest MAC (a
            :class:`~aioslirp.wire.neighbors.NeighborCache` of at most ``MAX_NEIGHBORS`` = 1024,
            as for IPv6; one more forgets the entry learned longest ago, ``arp.neighbors_evicted``).
        family4: the :class:`~aioslirp.dispatch.family.Family4`.
        v6: the IPv6 half (:class:`~aioslirp.dispatch.ipv6.Ipv6Path`: NDP/RA, DHCPv6, IPv6
            input), ``None`` when ``config.ipv6`` is off; ``family6`` its family.
        dns, icmp: the DNS forwarder (``None`` until started) and the ICMP echo proxy.
        tasks: the flows' own tasks.
        tracer: the stack's own :class:`~aioslirp.tracing.Tracer` (its trace points as
            OpenTelemetry spans through ``tracer_provider``), or ``None``: not traced.
        audit: the :class:`~aioslirp.audit.AuditLog`, or ``None`` (off; :meth:`flow_events`
            starts one without a file).

    Args:
        config: the network (default: ``NetworkConfig()``).
        tracer_provider: an OpenTelemetry ``TracerProvider``: trace this stack through it.
            ``None``: traced through the provider given to :func:`aioslirp.tracing.enable`
            when that is in force, else not traced.
        audit: the audit log: an :class:`~aioslirp.audit.AuditLog`, a path (``"-"``: stderr) or
            a text file object; default ``config.audit_log``; ``None`` and no ``audit_log``: off.
            A log the stack opened from a path or file object is closed by :meth:`aclose`.
        policy: a Python egress hook (sync or async callable given a
            :class:`~aioslirp.flow.egress.PolicyRequest`, returning allow/deny), asked for the
            flows and DNS names no rule decided; default ``config.policy``. See docs/security.md.
        tcp_handler: ``async def handler(flow, reader, writer)`` taking every admitted guest TCP
            flow no route (:meth:`route`) takes; ``udp_handler``: ``async def handler(flow,
            datagrams)`` for UDP flows. ``None``: NAT (or, for TCP, ``config.upstream_proxy``'s
            :class:`~aioslirp.handlers.proxy.UpstreamProxy`). A handled flow's SYN is answered at
            once, with no host connect (see docs/handlers.md).

    Raises:
        ConfigError: from the constructor when ``config`` is invalid.
        OSError: from the constructor when the audit log's path cannot be opened.
    """

    #: Takes ``on_frames(frames, csum_ok)`` from a TAP with a virtio-net header and sends
    #: offload frames when the transport offers it (:mod:`aioslirp.wire.offload`).
    supports_offload = True

    __slots__ = ("config", "counters", "ctx", "guard", "table", "flows", "idle_order", "inject_queue", "inject",
                 "write_now", "tasks", "_aux_tasks", "icmp", "dns", "l4", "neighbors", "family4", "ipv4", "v6",
                 "family6", "link", "on_frames", "_on_frames", "gw_mac", "gw_ip", "dns_ip", "guest_ip", "mtu",
                 "_transport", "_loop", "_closed", "_stopped", "transport_wrappers", "_forwarder", "tracer", "audit", "_own_audit",
                 "event_log", "router",
                 # aioslirp.metrics holds a stack by weak reference
                 "__weakref__")

    config: NetworkConfig
    counters: Counter
    ctx: FlowContext
    guard: Guard
    table: FlowTable
    flows: dict
    idle_order: IdleOrder
    inject_queue: InjectQueue
    inject: object
    write_now: object
    tasks: set[asyncio.Task]
    _aux_tasks: set[asyncio.Task]
    icmp: IcmpEcho
    dns: object
    l4: L4
    neighbors: NeighborCache
    family4: Family4
    ipv4: Ipv4Input
    v6: object
    family6: object
    link: Link
    on_frames: object
    _on_frames: object
    gw_mac: bytes
    gw_ip: bytes
    dns_ip: bytes
    guest_ip: bytes
    mtu: int
    _transport: object
    _loop: asyncio.AbstractEventLoop | None
    _closed: bool
    _stopped: asyncio.Future | None
    transport_wrappers: list
    _forwarder: object
    #: The stack's tracer (``None``: not traced).
    tracer: object
    #: The audit log (``None``: off).
    audit: object
    #: The bounded record of lifecycle events (see :meth:`events`).
    event_log: EventLog
    _own_audit: bool
    #: The routes to Python flow handlers (:class:`~aioslirp.handlers.routes.Router`).
    router: Router

    def __init__(self, config: NetworkConfig | None = None, *, tracer_provider=None, audit=None,
                 policy=None, tcp_handler=None, udp_handler=None) -> None:
        self.config = cfg = (config if config is not None else NetworkConfig()).validate()
        self.counters: Counter = Counter()
        ctx = self.ctx = FlowContext(cfg, self.counters)
        rate = float(cfg.new_flow_rate)
        new_bucket = functools.partial(NewFlowBucket, rate, max(1, int(cfg.new_flow_burst))) if rate > 0 else None
        self.guard = ctx.guard = Guard(cfg, ctx.drop, new_bucket, ctx=ctx, hook=policy)
        self.table = ctx.table = FlowTable(cfg, self.counters, self.guard)
        self.flows: FlowMap = self.table.flows
        self.idle_order: IdleOrder = self.table.idle_order
        self.inject_queue = ctx.queue = InjectQueue(cfg.inject_queue_size, self.counters)
        if tracer_provider is not None:
            tracer = tracing.Tracer(tracer_provider, self.table, self.inject_queue)
        else:
            tracer = tracing.default_tracer(self.table, self.inject_queue)
        # handed to whoever records a trace point (the Link reads ctx.tracer)
        self.tracer = ctx.tracer = self.table.tracer = self.inject_queue.tracer = tracer
        #: Queue one frame for the guest (:meth:`InjectQueue.put <aioslirp.inject.InjectQueue.put>`):
        #: False (counted ``drop.inject_full``) when the queue is full.
        self.inject = ctx.inject = self.inject_queue.put
        #: Write every queued frame now (:meth:`InjectQueue.write_now <aioslirp.inject.InjectQueue.write_now>`).
        self.write_now = self.inject_queue.write_now
        self.tasks: set[asyncio.Task] = ctx.tasks
        self._aux_tasks: set[asyncio.Task] = set()
        ctx.spawn = self.spawn
        self.icmp = ctx.icmp = IcmpEcho(ctx)
        if tcp_handler is None and cfg.upstream_proxy is not None:  # --upstream-proxy
            from .handlers.proxy import UpstreamProxy

            tcp_handler = UpstreamProxy.from_config(cfg)
        self.router = ctx.router = Router(self.counters, self.guard.policy, tcp_handler, udp_handler)
        if cfg.verify_sni:
            from .handlers.sni import SniVerifier

            self.router.set_verifier(SniVerifier(self.guard.policy, self.counters, tcp_handler,
                                                 float(cfg.tcp_connect_timeout)))
        self.dns = None
        self.l4 = L4(ctx)
        self.neighbors = NeighborCache(MAX_NEIGHBORS)
        self.family4 = Family4(ctx, self.neighbors)
        self.ipv4 = Ipv4Input(ctx, self.family4, self.l4)
        self.v6 = self.family6 = None
        if cfg.ipv6:
            from .dispatch.ipv6 import Ipv6Path  # only with IPv6: NDP, DHCPv6, config6

            self.v6 = Ipv6Path(ctx, self.l4)
            self.family6 = self.v6.family
        self.link = link = Link(ctx, self.family4, self.ipv4.input, self.v6.dispatch if self.v6 is not None else None)
        #: The transport's sink, a batch of guest frames (:meth:`aioslirp.dispatch.link.Link.on_frames`).
        self.on_frames = self._on_frames = link.on_frames
        self.gw_mac = cfg.gateway_mac_bytes
        self.gw_ip = self.family4.gw
        self.dns_ip = self.family4.dns
        self.guest_ip = cfg.guest.packed
        self.mtu = cfg.mtu
        self._transport = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._stopped: asyncio.Future | None = None
        #: Callables ``wrap(transport) -> transport`` applied in order by :meth:`serve`
        #: (e.g. :class:`~aioslirp.transport.pcap.PcapTransport` for ``--pcap``).
        self.transport_wrappers: list = []
        self._forwarder = None
        if cfg.rate_up is not None:
            ctx.rate_up = ByteBucket(cfg.rate_up)
        if cfg.rate_down is not None:
            ctx.rate_down = ByteBucket(cfg.rate_down)
        self.audit = None
        self._own_audit = False
        if audit is None:
            audit = cfg.audit_log
        if audit is not None:
            from .audit import AuditLog

            self._own_audit = not isinstance(audit, AuditLog)
            self._set_audit(audit if isinstance(audit, AuditLog) else AuditLog(audit))
        #: The bounded record of lifecycle events (:class:`~aioslirp.lifecycle.EventLog`); see :meth:`events`.
        self.event_log = EventLog()

    # ------------------------------------------------------------------ state
    @property
    def policy(self):
        """The egress policy (:class:`~aioslirp.flow.egress.Egress`): ``add(rule, allow=True)``,
        ``remove(rule)``, ``list_rules()``, ``set_hook(callable)`` while the guest runs."""
        return self.guard.policy

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the stack runs on (``None`` before :meth:`start`)."""
        return self._loop

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` began."""
        return self._closed

    @property
    def offload(self) -> bool:
        """The transport being served offers checksum/TCP segmentation offload (a TAP with
        ``IFF_VNET_HDR``): TCP flows opened while it is served send ~64 KB segments with
        partial checksums (:mod:`aioslirp.wire.offload`). Set by :meth:`serve`."""
        return self.ctx.offload

    @property
    def dhcp(self):
        """The :class:`~aioslirp.services.dhcp.DhcpServer` (``None`` until started; a new one per
        :meth:`reset_flows`)."""
        return self.family4.dhcp_server

    @property
    def reassembler(self):
        """The IPv4 fragment :class:`~aioslirp.wire.reassembly.Reassembler`."""
        return self.ipv4.reassembler

    @property
    def icmp_errors(self):
        """Rate limiter of the ICMP errors we send (RFC 1812 4.3.2.8): the same class and rate as
        the ICMPv6 one (100 errors/s, burst 50); over the rate, ``icmp_errors_rate_limited``."""
        return self.family4.err_bucket

    @icmp_errors.setter
    def icmp_errors(self, bucket) -> None:
        self.family4.err_bucket = bucket

    @property
    def _l4_trusted(self) -> bool:
        """False: whether a frame's L4 checksum is trusted is an argument of each frame's dispatch
        (``csum_ok``), never state left between frames (kept for callers that checked it)."""
        return False

    # ------------------------------------------------------------------ Python handlers
    def route(self, match, handler):
        """Hand the new guest flows ``match`` covers to ``handler`` (first matching route wins,
        before ``tcp_handler`` / ``udp_handler``); the egress policy decides first.

        ``match``: a rule text like the egress rules' (``"*:80/tcp"``, ``"example.com:443"``,
        ``"10.0.0.0/8"``, ``"*.test/udp"``; without ``/udp`` a match covers TCP only), a list of
        them, or ``None`` (every TCP flow). ``handler``: ``async def handler(flow, reader,
        writer)`` (TCP) or ``async def handler(flow, datagrams)`` (UDP); see docs/handlers.md.
        Returns the :class:`~aioslirp.handlers.routes.Route`. Raises
        :class:`~aioslirp.config.ConfigError` for a match that does not parse. Flows already
        open keep their host side.
        """
        route = self.router.add(match, handler)
        self._warn_guest_side(route)
        return route

    def _warn_guest_side(self, route) -> None:
        """One warning for a route whose address is the gateway or DNS server as the guest sees it:
        routes (like egress rules) match the host side (``127.0.0.1`` / ``::1`` for the gateway), so
        such a route would silently match nothing."""
        cfg = self.config
        guest_side = {(a.version, int(a)): str(a) for a in (cfg.gateway, cfg.dns, cfg.gateway6, cfg.dns6)
                      if a is not None}
        for r in route.rules:
            if r.kind == 0 and r.plen == (32 if r.family == 4 else 128) and (r.family, r.net) in guest_side:
                log.warning("route %r: %s is an address of the virtual network as the guest sees it; routes "
                            "match the host side (the gateway is the host's loopback, 127.0.0.1 or ::1), so "
                            "this one matches nothing", route.match, guest_side[(r.family, r.net)])

    def unroute(self, what) -> int:
        """Remove routes: ``what`` is a :class:`~aioslirp.handlers.routes.Route`, a handler, or a match
        given to :meth:`route`. Returns how many went; flows already handled go on."""
        return self.router.remove(what)

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Stack":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the writer task, the idle sweep and the services. Called by ``async with``."""
        loop = self._loop = self.ctx.loop = asyncio.get_running_loop()
        keep_freed_heap()  # no page-fault churn around every bulk batch (aioslirp.heap)
        self._stopped = loop.create_future()
        self.inject_queue.start(loop)
        self.family4.dhcp_server = DhcpServer(self.config)
        self.dns = self.ctx.dns = DnsForwarder(self.config)
        self.ctx.dns_host = functools.partial(DnsTcpHost, forwarder=self.dns, counters=self.counters,
                                              tasks=self.tasks)
        self.ctx.host_poller = HostPoller(loop)  # one epoll for the TCP flows' host sockets
        self.guard.start(self.dns, loop.time())
        self.table.start(loop)
        if self.audit is not None:
            self.audit.bind(loop, self.counters)

    def close(self) -> None:
        """Ask :meth:`serve` to return; flows are torn down by :meth:`aclose`."""
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    async def aclose(self) -> None:
        """Reset every flow towards the guest, close all host sockets, stop all tasks."""
        if self._closed:
            return
        self._closed = self.ctx.closed = True
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
        # write the final RSTs out while the guest is still there
        if self._loop is not None and self._transport is not None and not self._transport.closed.done():
            await self.inject_queue.drain()
        await self.inject_queue.stop()
        self.icmp.close()
        if self.dns is not None:
            await self.dns.close()
        if self._transport is not None:
            self._transport.close()
        self.table.clear()
        if self.ctx.host_poller is not None:  # every host socket left it as its flow ended
            self.ctx.host_poller.close()
        if self.audit is not None:
            if self._own_audit:
                self.audit.close()
            else:
                self.audit.flush()
        self.event_log.close()
        tr = self.tracer
        if tr is not None:
            tr.on_stack_closed()

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
        n = self.table.shutdown_all()
        self.table.clear()
        self.l4.cancel_dns()
        self.neighbors.clear()
        self.ipv4.reset()
        if self.v6 is not None:
            self.v6.reset()
        if self.family4.dhcp_server is not None:
            self.family4.dhcp_server = DhcpServer(self.config)
        tr = self._transport
        if tr is None or tr.closed is None or tr.closed.done():
            self.inject_queue.discard()
        self.counters["flows_reset"] += n
        return n

    async def serve(self, transport) -> None:
        """Serve ``transport`` until it closes or :meth:`close` is called.

        The transport is closed on return. One transport at a time; ``serve`` may be
        called again with a new transport once it returned (call :meth:`reset_flows`
        in between when the new transport is a different guest). Raises at once what the
        transport's ``preflight()`` raises, e.g. :class:`~aioslirp.transport.tap.TapError` for a
        TAP that is down (``TAP tap0 is down ...: bring it up first (ip link set tap0 up) ...``),
        and what its ``open()`` raises; both are also an ``error`` event (:meth:`events`). A
        transport whose other end is gone before the guest's first frame (EOF, a failed read or
        write) returns at once with one ``error`` event and one log line naming the cause and
        what to check.
        """
        if self._loop is None:
            await self.start()
        preflight = getattr(transport, "preflight", None)
        if preflight is not None:  # e.g. a TAP that is down: one clear error now, not a silent hang
            try:
                preflight()
            except Exception as exc:
                info = {"transport": type(transport).__name__, "message": " ".join(str(exc).split())}
                self.event_log.emit("error", **info)
                raise
        raw = transport
        for wrap in self.transport_wrappers:
            transport = wrap(transport)
        if self.tracer is not None:  # the drain_to_guest / writer_wake trace points
            transport = TraceTransport(transport, self.tracer)
        self._transport = self.inject_queue.transport = transport
        self.ctx.offload = bool(getattr(transport, "offload", False))
        info = {"transport": type(transport).__name__}
        if getattr(transport, "ifname", None):
            info["ifname"] = transport.ifname
        seen: list = []  # the first guest frame arrived
        try:
            await transport.open(self._first_frame_sink(transport, info, seen))
        except Exception as exc:
            self.event_log.emit("error", message=" ".join(f"{type(exc).__name__}: {exc}".split()), **info)
            raise
        self.event_log.emit("ready", **info)
        if self.v6 is not None:
            self.v6.start_ra()  # an RA at once, then periodically (RFC 4861 6.2.4)
        try:
            await asyncio.wait([transport.closed, self._stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self.v6 is not None:
                self.v6.stop_ra()
            reason = "closed" if transport.closed.done() else "stopped"
            try:
                if self._stopped.done() and transport.closed is not None and not transport.closed.done():
                    await farewell(self)  # asked to stop, the guest still there: RST its flows first
            finally:
                transport.close()
                exc = transport.closed.result() if transport.closed.done() else None
                gone = None if seen or reason != "closed" else gone_before_first_frame(
                    raw, exc if isinstance(exc, BaseException) else None)
                if gone is not None:  # the guest's end is gone already: say why and what to check, now
                    log.error("%s", gone)
                    self.event_log.emit("error", message=gone, **info)
                elif isinstance(exc, BaseException):
                    self.event_log.emit("error", message=" ".join(f"{type(exc).__name__}: {exc}".split()), **info)
                self.event_log.emit("guest_link_down", reason=reason, **info)

    def _first_frame_sink(self, transport, info: dict, seen: list):
        """The sink ``transport`` is opened with: the first batch emits ``guest_link_up``, then the
        transport gets :attr:`on_frames` itself (the wrapper stays only where it cannot be swapped)."""
        sink = self.on_frames

        def first(*args):
            if not seen:
                seen.append(True)
                transport.swap_sink(first, sink)
                self.event_log.emit("guest_link_up", **info)
            return sink(*args)

        return first

    # ------------------------------------------------------------------ events
    def events(self, history: bool = True):
        """An async iterator of this stack's lifecycle events (:class:`~aioslirp.lifecycle.Event`).

        Names: ``ready`` (:meth:`serve` started: the transport is open), ``guest_link_up`` (the
        first guest frame on it), ``guest_link_down`` (it closed: ``data["reason"]`` ``"closed"``
        when the guest went away, ``"stopped"`` after :meth:`close`), ``error`` (serving failed, or
        the transport closed with an error; ``data["message"]`` is one line). With ``history``
        (the default) the events already kept come first, so a reader that starts late still sees
        ``ready``. At most :data:`~aioslirp.lifecycle.EVENT_HISTORY` events are kept: a reader that
        falls further behind misses the oldest (counted in ``stack.event_log.dropped``); one that
        never reads holds nothing. The iterator ends when the stack closes (:meth:`aclose`).

        Usage::

            async for ev in stack.events():
                print(ev.name, ev.data)
        """
        return self.event_log.events(history)

    def on_event(self, callback):
        """Call ``callback(event)`` (:class:`~aioslirp.lifecycle.Event`) synchronously for every
        lifecycle event from now on (see :meth:`events`); an exception it raises is logged.
        Returns a function of no arguments that removes the callback."""
        return self.event_log.on_event(callback)

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

    # ------------------------------------------------------------------ frames
    def process_guest_frame(self, frame) -> None:
        """Process one guest Ethernet frame (bytes-like). Never raises: bad input is dropped and
        counted. The flows it touched send at the next :meth:`flush`."""
        self.link.process(frame)

    def flush(self) -> None:
        """Let every flow touched since the last flush send what is due (one ACK, one socket write)."""
        self.table.flush()

    def inject_room(self) -> int:
        """Free slots in the inject queue."""
        return self.inject_queue.room

    def eth_to(self, ip: bytes) -> bytes:
        """Ethernet header from the gateway to the guest owning ``ip`` (4 bytes: IPv4; 16: IPv6,
        see :meth:`Family6.eth_to <aioslirp.dispatch.family.Family6.eth_to>`)."""
        return (self.family6 if len(ip) == 16 else self.family4).eth_to(ip)

    def inject_ip(self, packet, dst_ip: bytes) -> None:
        """Queue an IPv4 packet (bytes-like, no Ethernet header) for the guest, fragmenting to the MTU."""
        self.family4.inject_ip(packet, dst_ip)

    def inject_ip6(self, packet, dst_ip: bytes) -> None:
        """Queue an IPv6 packet (bytes-like, no Ethernet header) for the guest's ``dst_ip`` (16 bytes),
        fragmenting to the MTU. Only with ``config.ipv6`` on."""
        self.family6.inject_ip(packet, dst_ip)

    # ------------------------------------------------------------------ outcomes
    def drop(self, reason: str) -> None:
        """Count a dropped guest frame: ``drop.<reason>`` and ``frames_dropped``
        (:meth:`FlowContext.drop <aioslirp.flow.base.FlowContext.drop>`)."""
        self.ctx.drop(reason)

    def handled(self, reason: str) -> None:
        """Count a guest frame that was handled as ``handled.<reason>``; see :meth:`drop`."""
        self.ctx.handled(reason)

    def frame_outcomes(self) -> tuple[int, int, int]:
        """``(frames_in, handled, dropped)``: frames received, and how many of them were handled
        (the sum of ``handled.<reason>``) or dropped (``frames_dropped``). Each frame has one
        outcome, so the first equals the sum of the other two."""
        c = self.counters
        handled = sum(v for k, v in c.items() if k.startswith("handled."))
        return c["frames_in"], handled, c["frames_dropped"]

    # -------------------------------------------------------------- port forwards
    @property
    def forwarder(self):
        """The :class:`~aioslirp.forward.Forwarder` holding this stack's port forwards."""
        if self._forwarder is None:
            from .forward import Forwarder
            self._forwarder = Forwarder(self.ctx, self.family4, self.family6)
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

    # -------------------------------------------------------------- audit
    def _set_audit(self, audit) -> None:
        self.audit = self.ctx.audit = self.table.audit = audit
        if self._loop is not None:
            audit.bind(self._loop, self.counters)

    def flow_events(self, maxlen: int = 4096):
        """An async iterator of the audit records from now on (``dict``: one per flow at its end,
        per denial, per DNS decision; fields in docs/audit.md), until the audit log closes
        (:meth:`aclose`, for a log the stack opened; an :class:`~aioslirp.audit.AuditLog` passed
        in is only flushed there, and ends its readers at its own ``close()``).

        Bounded: it holds ``maxlen`` records; a reader that falls behind loses the oldest,
        counted ``audit.records_dropped``. Subscribed when called (before the first ``async
        for`` step); ``await it.aclose()`` unsubscribes. Without an audit log, one without a
        file is started.
        """
        if self.audit is None:
            from .audit import AuditLog

            self._own_audit = True
            self._set_audit(AuditLog())
        return self.audit.events(maxlen)

    def reopen_audit_log(self) -> None:
        """Reopen the audit log's file (log rotation; the CLI does it on SIGHUP). Nothing when off."""
        if self.audit is not None:
            self.audit.reopen()

    # -------------------------------------------------------------- stats
    def flow_stats(self) -> dict:
        """Active flows by ``proto`` and TCP state: ``{"tcp": {"ESTABLISHED": 3}, "udp": 1, ...}``."""
        out: dict = {}
        for f in self.flows.values():
            if f.proto_name == "tcp":
                d = out.setdefault("tcp", {})
                d[f.state] = d.get(f.state, 0) + 1
            else:
                out[f.proto_name] = out.get(f.proto_name, 0) + 1
        return out

    def stats(self) -> dict:
        """A JSON-ready snapshot of the stack's state (the API socket's ``get_stats`` is built from the same counters).

        Shape::

            {"counters": {NAME: int, ...},                     # every counter, sorted by name
             "flows": {"tcp": {STATE: int, ...}, "udp": int, "icmp": int},   # flows open now
             "inject_queue": {"depth": int, "size": int},      # frames queued for the guest / capacity
             "compiled": str}                                  # one line: is the compiled path loaded

        Fields:
            counters: every entry of :attr:`counters` (monotonic event counts since the stack
                was made; a name appears once it is first counted). The families:

                * ``frames_in`` / ``frames_out``: Ethernet frames from / to the guest;
                  ``bytes_in`` / ``bytes_out``: their bytes (frames, not payload);
                * ``frames_dropped`` and ``drop.<reason>``: guest frames dropped, by reason
                  (``drop.bad_checksum``, ``drop.inject_full``, ``drop.egress_denied``...);
                  ``handled.<reason>``: guest frames handled, by kind; ``frames_in ==
                  frames_dropped + sum(handled.*)`` (:meth:`frame_outcomes`);
                * ``flows.<proto>.opened`` / ``flows.<proto>.closed`` (``tcp``, ``udp``, ``icmp``):
                  flows entered into and removed from the flow table; ``flows_reset``,
                  ``flows_reset_at_stop``: flows torn down by :meth:`reset_flows` / at a stop;
                * ``tcp_*`` (``tcp_resets``, ``tcp_rst_sent``, ``tcp_idle_closed``,
                  ``tcp_connect_refused``, ``tcp_connect_unreachable``, ``tcp_host_read_paused``,
                  ``tcp_host_write_paused``...), ``udp_*`` (``udp_datagrams_up`` / ``_down``,
                  ``udp_idle_closed``), ``icmp_*`` (echo and error counts, ``icmp_errors_rate_limited``),
                  ``ip_fragments`` / ``ip_reassembled``, ``arp.*``, ``ndp.*`` / ``ra_*`` / ``na_*``
                  (IPv6 neighbour discovery), ``forward_*`` (port forwards), ``flow_errors``.
            flows: the flows open now (:meth:`flow_stats`): TCP by RFC 9293 state name, UDP and
                ICMP as one count each; ``{}`` when none. Per-flow detail: :meth:`flows() <flows>`.
            inject_queue: ``depth``, frames queued for the guest and not yet written to the
                transport; ``size``, the queue's capacity (``config.inject_queue_size``); frames
                beyond it are dropped (``drop.inject_full``).
            compiled: :func:`aioslirp.compiled.notice`, e.g. ``"compiled per-frame path: on (8/8
                modules)"``, or off and why (``AIOSLIRP_NO_EXTENSIONS``, not built, a stale build).

        The counters are also exported as OpenTelemetry metrics by :func:`aioslirp.metrics.register`.
        """
        return {
            "counters": {k: int(v) for k, v in sorted(self.counters.items())},
            "flows": self.flow_stats(),
            "inject_queue": {"depth": len(self.inject_queue), "size": self.config.inject_queue_size},
            "compiled": compiled_notice(),
        }

