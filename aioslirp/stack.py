"""The :class:`Stack` facade: guest frames in, NAT flows and local services, frames out.

Theory of operation
-------------------
A :class:`Stack` builds and wires the parts of the data path, each given the collaborators it
needs at construction (a :class:`~aioslirp.flow.context.FlowContext`: config, counters, the flow
table, the guard, the inject queue, ``spawn``; and once the stack starts, ``ctx.running``: the
loop and its clock, the DNS forwarder, the host poller) and none reading the stack itself:

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
  (:mod:`aioslirp.nat.forward`).

The parts hold direct references to one another; the stack keeps them in one read-only
:class:`~aioslirp.stack_parts.StackParts` (``stack.parts``), which tests and debugging read
and no frame goes through.

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
import warnings
from collections import Counter

from .observe import tracing
from .compiled import notice as compiled_notice
from .native import status as native_status, yield_point as native_yield_point
from .config import NetworkConfig
from .config.identity import GuestIdentity
from .dispatch.family import Family4
from .dispatch.ipv4 import Ipv4Input
from .dispatch.l4 import L4
from .dispatch.link import Link
from .flow.context import FlowContext, Running
from .handlers.routes import Router
from .flow.guard import Guard
from .flow.info import FlowInfo, FlowRecords  # noqa: F401  (FlowInfo: the records of stack.flows())
from .flow.table import FlowTable
from .fair import Scheduler, Seat
from .heap import keep_freed_heap
from .inject import InjectQueue
from .nat.icmp import IcmpEcho
from .observe.events import EventLog
from .stack_parts import StackParts
from .ratelimit import ByteBucket
from .ratelimit import TokenBucket as NewFlowBucket
from .services.dhcp import DhcpServer
from .services.dns import DnsForwarder
from .nat.hostsock import HostPoller
from .nat.native_tcp import NativeTcp
from .nat.native_udp import NativeUdp
from .transport.trace import TraceTransport
from .wire.neighbors import MAX_NEIGHBORS, NeighborCache

log = logging.getLogger("aioslirp.stack")

__all__ = ["Stack", "RENAMED", "MOVED"]

#: :class:`Stack` names renamed in 0.2: old name -> new. The old name still works until the next
#: release, with a ``DeprecationWarning``; it is no longer listed by ``dir()`` nor in the reference.
RENAMED = {
    "close": "stop",  # asks serve() to return; aclose() tears everything down
    "spawn": "spawn_task",  # an auxiliary task, not aioslirp.spawn (a guest command)
    "flow_events": "audit_records",  # the audit log's records
    "flow_stats": 'stats()["flows"]',  # the same figures, one way to get them
}

#: Where the parts that were ``Stack`` attributes up to 0.1 are now (named in the AttributeError).
MOVED = {name: f"parts.{name}" for name in (
    "ctx", "table", "idle_order", "guard", "inject_queue", "tasks", "icmp", "router", "dns", "dhcp", "l4",
    "link", "ipv4", "family4", "v6", "family6", "neighbors", "reassembler", "audit", "loop", "closed", "offload")}
MOVED.update({
    "inject": "parts.inject_queue.put", "write_now": "parts.inject_queue.write_now",
    "inject_room": "parts.inject_queue.room", "on_frames": "parts.link.on_frames",
    "drop": "parts.ctx.drop", "handled": "parts.ctx.handled", "eth_to": "parts.family4.eth_to (IPv6: family6)",
    "inject_ip": "parts.family4.inject_ip", "inject_ip6": "parts.family6.inject_ip",
    "icmp_errors": "parts.family4.err_bucket", "gw_mac": "parts.family4.gw_mac", "gw_ip": "parts.family4.gw",
    "dns_ip": "parts.family4.dns", "guest_ip": "config.guest.packed", "mtu": "config.mtu",
    "_on_frames": "parts.link.on_frames",
})


class Stack:
    """A user-mode network stack serving one guest link.

    Usage::

        async with Stack(NetworkConfig()) as stack:
            await stack.serve(transport)   # returns when the transport closes (or stack.stop())

    Its names (docs/library.md says more of each):

    * lifecycle: ``async with`` (:meth:`start`, then :meth:`aclose`), :meth:`serve`,
      :meth:`stop`, :meth:`reset_flows`;
    * state: :attr:`config`, :attr:`identity`, :attr:`counters`, :meth:`stats`, :meth:`flows`,
      :meth:`frame_outcomes`;
    * events and audit: :meth:`events`, :meth:`on_event`, :attr:`event_log`,
      :meth:`audit_records`, :meth:`reopen_audit_log`;
    * egress and Python handlers: :attr:`policy`, :meth:`route`, :meth:`unroute`;
    * port forwards: :meth:`add_forward`, :meth:`remove_forward`, :meth:`forwards`;
    * frames without a transport: :meth:`process_guest_frame`, :meth:`flush`;
    * extension: :meth:`spawn_task`, :attr:`tracer`, :attr:`transport_wrappers`,
      :attr:`supports_offload`;
    * the internals, for tests and debugging: :attr:`parts`
      (:class:`~aioslirp.stack_parts.StackParts`).

    Renamed in 0.2 (:data:`RENAMED`; the old name works until the next release, with a
    ``DeprecationWarning``): ``close()`` is :meth:`stop`, ``spawn()`` is :meth:`spawn_task`,
    ``flow_events()`` is :meth:`audit_records`, ``flow_stats()`` is ``stats()["flows"]``;
    ``stack.flows`` is no longer the live table (a ``dict``; ``stack.parts.flows``).

    Attributes:
        config: the validated :class:`NetworkConfig`.
        counters: ``collections.Counter`` of events: ``frames_in``, ``frames_out``,
            ``bytes_in``, ``bytes_out``, ``drop.<reason>``, ``flows.<proto>.opened``...
            (the families: :meth:`stats`).
        event_log: the bounded record of lifecycle events
            (:class:`~aioslirp.observe.events.EventLog`: ``history()``, ``dropped``); see :meth:`events`.
        tracer: the stack's own :class:`~aioslirp.observe.tracing.Tracer` (its trace points as
            OpenTelemetry spans through ``tracer_provider``; ``end_all()``, ``errors``), or
            ``None``: not traced.
        transport_wrappers: callables ``wrap(transport) -> transport`` that :meth:`serve`
            applies in order (e.g. :class:`~aioslirp.transport.pcap.PcapTransport` for ``--pcap``).

    Args:
        config: the network (default: ``NetworkConfig()``).
        name: the guest's name (``None``, the default: none), non-empty printable text of at most
            64 characters; with ``labels`` (a mapping ``str -> str``, at most 32 pairs, keys like
            OpenTelemetry attribute names, values of at most 256 characters) it is the stack's
            :attr:`identity`, carried by its audit records (``guest_name``, ``labels``), spans
            (``aioslirp.guest.name``, ``aioslirp.guest.label.<key>``), events, :meth:`flows`
            records (``guest_name``) and log lines (``[name] `` first), so that one audit log or
            one tracer provider can serve many stacks (docs/observability.md).
        tracer_provider: an OpenTelemetry ``TracerProvider`` or a span sink (:mod:`aioslirp.observe.sink`):
            trace this stack through it at ``config.trace_level`` (docs/observability.md).
            ``None``: traced through the provider given to :func:`aioslirp.observe.tracing.enable`
            when that is in force, else not traced.
        audit: the audit log: an :class:`~aioslirp.observe.audit.AuditLog`, a path (``"-"``: stderr) or
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
        ConfigError: from the constructor when ``config``, ``name`` or ``labels`` is invalid (one
            line naming the field).
        OSError: from the constructor when the audit log's path cannot be opened.
    """

    #: Takes ``on_frames(frames, csum_ok)`` from a TAP with a virtio-net header and sends
    #: offload frames when the transport offers it (:mod:`aioslirp.wire.offload`). A stack of
    #: one's own given to ``spawn``/``attach`` says so with this name.
    supports_offload = True

    __slots__ = ("config", "counters", "event_log", "tracer", "transport_wrappers", "_parts", "_flows", "_aux_tasks",
                 "_transport", "_loop", "_closed", "_stopped", "_forwarder", "_own_audit", "_seat", "__weakref__")

    config: NetworkConfig
    counters: Counter
    #: The bounded record of lifecycle events (see :meth:`events`).
    event_log: EventLog
    #: The stack's tracer (``None``: not traced).
    tracer: object
    transport_wrappers: list
    _parts: StackParts
    _flows: FlowRecords
    _aux_tasks: set[asyncio.Task]
    _transport: object
    _loop: asyncio.AbstractEventLoop | None
    _closed: bool
    _stopped: asyncio.Future | None
    _forwarder: object
    _own_audit: bool  # (__weakref__: aioslirp.observe.metrics holds a stack by weak reference)
    _seat: Seat | None  # the guest's place in the loop's express lane (aioslirp.fair); None: not scheduled

    def __init__(self, config: NetworkConfig | None = None, *, name: str | None = None, labels=None,
                 tracer_provider=None, audit=None, policy=None, tcp_handler=None, udp_handler=None) -> None:
        self.config = cfg = (config if config is not None else NetworkConfig()).validate()
        identity = GuestIdentity(name, labels)
        self.counters: Counter = Counter()
        queue = InjectQueue(cfg.inject_queue_size, self.counters)
        ctx = FlowContext(cfg, self.counters, queue, self.spawn_task,
                          rate_up=ByteBucket(cfg.rate_up) if cfg.rate_up is not None else None,
                          rate_down=ByteBucket(cfg.rate_down) if cfg.rate_down is not None else None,
                          identity=identity)
        rate = float(cfg.new_flow_rate)
        new_bucket = functools.partial(NewFlowBucket, rate, max(1, int(cfg.new_flow_burst))) if rate > 0 else None
        guard = ctx.guard = Guard(cfg, ctx.drop, new_bucket, ctx=ctx, hook=policy)
        table = ctx.table = FlowTable(cfg, self.counters, guard)
        if tracer_provider is not None:
            tracer = tracing.Tracer(tracer_provider, table, queue, identity=identity)
        else:
            tracer = tracing.default_tracer(table, queue, identity=identity)
        # The trace level decides, once, who gets the tracer (docs/observability.md, "Trace
        # levels"): the flow table always (flow spans); the flows (ctx.tracer: the TCP timeline)
        # from "timeline"; the link, the inject queue and serve()'s TraceTransport (per-frame
        # spans and stamps) at "frames" only. A trace point left None costs its one branch.
        level = cfg.trace_level
        frame_tracer = tracer if level == "frames" else None
        self.tracer = table.tracer = tracer
        ctx.tracer = tracer if level != "flows" else None
        queue.tracer = frame_tracer
        self._aux_tasks: set[asyncio.Task] = set()
        icmp = IcmpEcho(ctx)
        if tcp_handler is None and cfg.upstream_proxy is not None:  # --upstream-proxy
            from .handlers.proxy import UpstreamProxy

            tcp_handler = UpstreamProxy.from_config(cfg)
        router = Router(self.counters, guard.policy, tcp_handler, udp_handler)
        if cfg.verify_sni:
            from .handlers.sni import SniVerifier

            router.set_verifier(SniVerifier(guard.policy, self.counters, tcp_handler,
                                            float(cfg.tcp_connect_timeout)))
        l4 = L4(ctx, icmp, router)
        neighbors = NeighborCache(MAX_NEIGHBORS)
        family4 = Family4(ctx, neighbors)
        ipv4 = Ipv4Input(ctx, family4, l4)
        v6 = family6 = None
        if cfg.ipv6:
            from .dispatch.ipv6 import Ipv6Path  # only with IPv6: NDP, DHCPv6, config6

            v6 = Ipv6Path(ctx, l4)
            family6 = v6.family
        link = Link(ctx, family4, ipv4, v6, tracer=frame_tracer)
        self._parts = StackParts(ctx=ctx, table=table, flows=table.flows, idle_order=table.idle_order, guard=guard,
                                 inject_queue=queue, tasks=ctx.tasks, icmp=icmp, router=router, link=link, l4=l4,
                                 ipv4=ipv4, family4=family4, v6=v6, family6=family6, neighbors=neighbors)
        self._flows = FlowRecords(table.flows, ctx, guest_name=identity.name)
        self._transport = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed, self._seat = False, None
        self._stopped: asyncio.Future | None = None
        #: Callables ``wrap(transport) -> transport`` applied in order by :meth:`serve`
        #: (e.g. :class:`~aioslirp.transport.pcap.PcapTransport` for ``--pcap``).
        self.transport_wrappers: list = []
        self._forwarder = None
        self._own_audit = False
        if audit is None:
            audit = cfg.audit_log
        if audit is not None:
            from .observe.audit import AuditLog

            self._own_audit = not isinstance(audit, AuditLog)
            self._set_audit(audit if isinstance(audit, AuditLog) else AuditLog(audit))
        #: The bounded record of lifecycle events (:class:`~aioslirp.observe.events.EventLog`); see :meth:`events`.
        self.event_log = EventLog(fields=identity.audit_fields)

    # ------------------------------------------------------------------ state
    @property
    def identity(self) -> GuestIdentity:
        """The guest's name and labels (:class:`~aioslirp.config.identity.GuestIdentity`:
        ``name``, ``None`` when not given; ``labels``, a read-only mapping, empty when none), as
        given to the constructor; what its records, spans, events and log lines carry."""
        return self._parts.ctx.identity

    @property
    def parts(self) -> StackParts:
        """The stack's internals, read-only (:class:`~aioslirp.stack_parts.StackParts`: ``ctx``,
        ``table``, ``flows``, ``guard``, ``dns``, ``link``, ...), for tests and debugging; not the
        embedder's interface (their names follow the code)."""
        return self._parts

    @property
    def flows(self) -> FlowRecords:
        """``stack.flows()``: a ``list`` of :class:`~aioslirp.flow.info.FlowInfo` records, one per
        flow at that moment, in table order: protocol, guest and destination ``(address, port)``,
        DNS name, state, bytes each way, age and idle time in seconds (what ``list_flows`` of the
        API socket reports). The live table itself is ``stack.parts.flows``; reading
        ``stack.flows`` as that ``dict`` (``len``, ``in``, ``[key]``, ``values()``...) still works
        until the next release, with a ``DeprecationWarning``."""
        return self._flows

    @property
    def policy(self):
        """The egress policy (:class:`~aioslirp.flow.egress.Egress`): ``add(rule, allow=True)``,
        ``remove(rule)``, ``list_rules()``, ``set_hook(callable)`` while the guest runs."""
        return self._parts.guard.policy

    def __getattr__(self, name: str):
        # only for names the class does not have: the renamed ones (warned), else a clear error
        new = RENAMED.get(name)
        if new is None:
            where = MOVED.get(name)
            hint = f": it is stack.{where} now (the internals are under stack.parts)" if where else ""
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}{hint}")
        warnings.warn(f"Stack.{name} is deprecated: it is now Stack.{new} (the old name goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        if name == "flow_stats":
            return self._flow_stats
        return getattr(self, new)

    # ------------------------------------------------------------------ Python handlers
    def route(self, match, handler):
        """Hand the new guest flows ``match`` covers to ``handler`` (first matching route wins,
        before ``tcp_handler`` / ``udp_handler``); the egress policy decides first.

        ``match``: a rule text like the egress rules' (``"*:80/tcp"``, ``"example.com:443"``,
        ``"10.0.0.0/8"``, ``"*.test/udp"``; without ``/udp`` a match covers TCP only), a list of
        them, or ``None`` (every TCP flow). ``handler``: ``async def handler(flow, reader,
        writer)`` (TCP) or ``async def handler(flow, datagrams)`` (UDP); see docs/handlers.md.
        Returns the :class:`~aioslirp.handlers.routes.Route`. Raises
        :class:`~aioslirp.errors.ConfigError` for a match that does not parse. Flows already
        open keep their host side.
        """
        route = self._parts.router.add(match, handler)
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
                log.warning("%sroute %r: %s is an address of the virtual network as the guest sees it; routes "
                            "match the host side (the gateway is the host's loopback, 127.0.0.1 or ::1), so "
                            "this one matches nothing", self.identity.log_prefix, route.match, guest_side[(r.family, r.net)],
                            extra=self.identity.log_extra)

    def unroute(self, what) -> int:
        """Remove routes: ``what`` is a :class:`~aioslirp.handlers.routes.Route`, a handler, or a match
        given to :meth:`route`. Returns how many went; flows already handled go on."""
        return self._parts.router.remove(what)

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Stack":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the writer task, the idle sweep and the services, and hand the parts what exists
        once the stack runs (``ctx.running``: the loop, DNS, the host poller, the guest's shares of
        the loop's fair scheduler, :mod:`aioslirp.fair`). Called by ``async
        with``; once per stack (``RuntimeError`` the second time)."""
        p = self._parts
        ctx = p.ctx
        loop = self._loop = asyncio.get_running_loop()
        keep_freed_heap()  # no page-fault churn around every bulk batch (aioslirp.heap)
        self._stopped = loop.create_future()
        p.inject_queue.start(loop)
        dns = DnsForwarder(self.config)
        # what exists once the stack runs, all at once: the loop and its clock, DNS, one epoll for the TCP
        # flows' host sockets, the guest's shares of the loop's fair scheduler and its seat (aioslirp.fair)
        weight, poller, up, down = self.config.fair_weight, HostPoller(loop), None, None
        if weight is not None:
            up, down, self._seat = Scheduler.for_loop(loop).enrol(weight, ctx.identity.name or "", self.counters,
                                                                  p.inject_queue, (poller.fd, poller.dispatch),
                                                                  yield_point=native_yield_point())
        ctx.start(Running(loop, dns, poller, share_up=up, share_down=down))
        p.guard.start(dns, now=loop.time())
        p.table.start(loop)
        if ctx.audit is not None:
            ctx.audit.bind(loop, self.counters)
        ident = ctx.identity
        log.info("%sstack started: guest %s, gateway %s", ident.log_prefix, self.config.guest, self.config.gateway,
                 extra=ident.log_extra)

    def stop(self) -> None:
        """Ask :meth:`serve` to return (it resets the guest's flows first while the guest is still
        there, then closes the transport); the stack stays usable: :meth:`serve` may be called
        again. Everything is torn down by :meth:`aclose`. Named ``close()`` up to 0.1."""
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    async def farewell(self) -> int:
        """End the guest's session cleanly while its link is still up: reset every flow towards
        it, withdraw the IPv6 router, write those frames out. Returns the flows torn down.

        :meth:`serve` runs it when the stack is asked to stop (:meth:`stop`: SIGINT/SIGTERM of
        ``aioslirp attach`` / ``aioslirp qemu``, the grace period of ``aioslirp run`` running out)
        with the transport still open. Every TCP flow is reset towards the guest (an RST its
        applications see as ECONNRESET instead of a connection that hangs until its own timeout)
        and its host socket closed with an RST to the host peer; UDP and ICMP flows close their
        sockets (counted in ``flows_reset_at_stop``); with IPv6 the final Router Advertisement
        withdraws the default route (RFC 4861 6.2.5). The frames are written to the transport at
        once (:meth:`InjectQueue.drain <aioslirp.inject.InjectQueue.drain>`), without waiting;
        closing the transport is the caller's job. Never raises for a flow that fails to shut down
        (logged by :meth:`reset_flows`). A guest that went away already has no one to tell:
        :meth:`aclose` and :meth:`reset_flows` tear its flows down without it.
        """
        n = self.reset_flows()
        self.counters["flows_reset_at_stop"] += n
        if self._parts.v6 is not None:
            self._parts.v6.final_ra()
        await self._parts.inject_queue.drain()  # written to the transport now, then one loop iteration
        return n

    async def aclose(self) -> None:
        """Reset every flow towards the guest, close all host sockets, stop all tasks."""
        if self._closed:
            return
        p = self._parts
        ctx = p.ctx
        self._closed = ctx.closed = True
        self.stop()
        if self._forwarder is not None:
            self._forwarder.close()
        p.table.close()
        p.table.shutdown_all()
        tasks = [t for t in p.tasks if not t.done()]
        for t in tasks:
            t.cancel()
        for t in list(self._aux_tasks):
            t.cancel()
        await asyncio.gather(*tasks, *self._aux_tasks, return_exceptions=True)
        if p.v6 is not None and self._loop is not None:
            p.v6.final_ra()  # withdraw the router and the prefix (RFC 4861 6.2.5)
        # write the final RSTs out while the guest is still there
        if self._loop is not None and self._transport is not None and not self._transport.closed.done():
            await p.inject_queue.drain()
        await p.inject_queue.stop()
        p.icmp.close()
        if ctx.is_started:
            await ctx.running.dns.close()
        if self._transport is not None:
            self._transport.close()
        p.table.clear()
        if ctx.is_started:  # every host socket left the poller as its flow ended
            if self._seat is not None:  # its fds before the poller closes, its shares (its flows are gone)
                self._seat.leave()
            ctx.running.host_poller.close()
        audit = ctx.audit
        if audit is not None:
            if self._own_audit:
                audit.close()
            else:
                audit.flush()
        self.event_log.close()
        ident = ctx.identity
        log.info("%sstack closed", ident.log_prefix, extra=ident.log_extra)
        tr = self.tracer
        if tr is not None:
            tr.record_stack_closed()

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
        p = self._parts
        n = p.table.shutdown_all()
        p.table.clear()
        p.l4.cancel_dns()
        p.neighbors.clear()
        p.ipv4.reset()
        if p.v6 is not None:
            p.v6.reset()
        p.family4.dhcp_server = DhcpServer(self.config)
        tr = self._transport
        if tr is None or tr.closed is None or tr.closed.done():
            p.inject_queue.discard()
        self.counters["flows_reset"] += n
        return n

    async def serve(self, transport) -> None:
        """Serve ``transport`` until it closes or :meth:`stop` is called.

        The transport is closed on return. One transport at a time; ``serve`` may be
        called again with a new transport once it returned (call :meth:`reset_flows`
        in between when the new transport is a different guest). Raises at once what the
        transport's ``preflight()`` raises, e.g. :class:`~aioslirp.transport.tapdev.TapError` for a
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
        p = self._parts
        untraced = transport  # the native plane's flows stay native when traced (they trace themselves)
        frame_tracer = p.inject_queue.tracer  # the stack's tracer at trace level "frames" only
        if frame_tracer is not None:  # the drain_to_guest / writer_wake trace points
            transport = TraceTransport(transport, frame_tracer)
        self._transport = p.inject_queue.transport = transport
        p.ctx.offload = bool(getattr(transport, "offload", False))
        native_udp = p.ctx.native_udp = NativeUdp.start(p.ctx, raw, untraced)  # UDP NAT flows in C (issue 26)
        info = {"transport": type(transport).__name__}
        if getattr(transport, "ifname", None):
            info["ifname"] = transport.ifname
        seen: list = []  # the first guest frame arrived
        try:
            await transport.open(self._first_frame_sink(transport, info, seen))
        except Exception as exc:
            self.event_log.emit("error", message=" ".join(f"{type(exc).__name__}: {exc}".split()), **info)
            raise
        # TCP NAT flows in C (a native TAP reader; its trace points at the stack's trace level)
        native_tcp = p.ctx.native_tcp = NativeTcp.start(p.ctx, untraced, frame_tracer is not None, p.link.syn)
        if self._seat is not None:  # the express lane may read the guest's frames (and engine's events) early
            self._seat.guest(raw, None if native_tcp is None else native_tcp.reader())
        self.event_log.emit("ready", **info)
        if p.v6 is not None:
            p.v6.start_ra()  # an RA at once, then periodically (RFC 4861 6.2.4)
        try:
            await asyncio.wait([transport.closed, self._stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if p.v6 is not None:
                p.v6.stop_ra()
            reason = "closed" if transport.closed.done() else "stopped"
            try:
                if self._stopped.done() and transport.closed is not None and not transport.closed.done():
                    await self.farewell()  # asked to stop, the guest still there: RST its flows first
            finally:
                if self._seat is not None:
                    self._seat.guest(None)  # (before the transport and the native engine close their fds)
                native_tcp, p.ctx.native_tcp = p.ctx.native_tcp, None
                if native_tcp is not None:  # its flows end (RST to the guest), its sockets close
                    native_tcp.close()
                transport.close()
                if native_udp is not None:  # its flows back to their Python readers
                    p.ctx.native_udp = None
                    native_udp.detach()
                exc = transport.closed.result() if transport.closed.done() else None
                hint = getattr(raw, "gone_before_first_frame", None)  # a Transport's; a duck-typed one may lack it
                gone = None if seen or reason != "closed" or hint is None else hint(
                    exc if isinstance(exc, BaseException) else None)
                if gone is not None:  # the guest's end is gone already: say why and what to check, now
                    ident = self.identity
                    log.error("%s%s", ident.log_prefix, gone, extra=ident.log_extra)
                    self.event_log.emit("error", message=gone, **info)
                elif isinstance(exc, BaseException):
                    self.event_log.emit("error", message=" ".join(f"{type(exc).__name__}: {exc}".split()), **info)
                self.event_log.emit("guest_link_down", reason=reason, **info)

    def _first_frame_sink(self, transport, info: dict, seen: list):
        """The sink ``transport`` is opened with: the first batch emits ``guest_link_up``, then the
        transport gets the link's ``on_frames`` itself (the wrapper stays only where it cannot be swapped)."""
        sink = self._parts.link.on_frames

        def first(*args):
            if not seen:
                seen.append(True)
                transport.swap_sink(first, sink)
                self.event_log.emit("guest_link_up", **info)
            return sink(*args)

        return first

    # ------------------------------------------------------------------ events
    def events(self, history: bool = True):
        """An async iterator of this stack's lifecycle events (:class:`~aioslirp.observe.events.Event`).

        Names: ``ready`` (:meth:`serve` started: the transport is open), ``guest_link_up`` (the
        first guest frame on it), ``guest_link_down`` (it closed: ``data["reason"]`` ``"closed"``
        when the guest went away, ``"stopped"`` after :meth:`stop`), ``error`` (serving failed, or
        the transport closed with an error; ``data["message"]`` is one line). With ``history``
        (the default) the events already kept come first, so a reader that starts late still sees
        ``ready``. At most :data:`~aioslirp.observe.events.EVENT_HISTORY` events are kept: a reader that
        falls further behind misses the oldest (counted in ``stack.event_log.dropped``); one that
        never reads holds nothing. The iterator ends when the stack closes (:meth:`aclose`).

        Usage::

            async for ev in stack.events():
                print(ev.name, ev.data)
        """
        return self.event_log.events(history)

    def on_event(self, callback):
        """Call ``callback(event)`` (:class:`~aioslirp.observe.events.Event`) synchronously for every
        lifecycle event from now on (see :meth:`events`); an exception it raises is logged.
        Returns a function of no arguments that removes the callback."""
        return self.event_log.on_event(callback)

    def spawn_task(self, coro, name: str | None = None) -> asyncio.Task:
        """Run ``coro`` as an auxiliary task owned by the stack: a failure is logged, and
        :meth:`aclose` cancels and awaits it. Needs a started stack. Named ``spawn()`` up to 0.1
        (not :func:`aioslirp.spawn`, which runs a command behind a stack)."""
        t = self._loop.create_task(coro, name=name)
        self._aux_tasks.add(t)
        t.add_done_callback(self._aux_done)
        return t

    def _aux_done(self, t: asyncio.Task) -> None:
        self._aux_tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            ident = self.identity
            log.error("%sauxiliary task %s failed", ident.log_prefix, t.get_name(), exc_info=t.exception(),
                      extra=ident.log_extra)

    # ------------------------------------------------------------------ frames
    def process_guest_frame(self, frame) -> None:
        """Process one guest Ethernet frame (bytes-like) without a transport, at loop time. Never
        raises for bad input: it is dropped and counted. The flows it touched send at the next
        :meth:`flush`. Needs a started stack (``RuntimeError``)."""
        self._parts.link.process(frame, False, self._now())

    def flush(self) -> None:
        """Let every flow touched since the last flush send what is due (one ACK, one socket write):
        what a transport's batch of frames does at its end, for :meth:`process_guest_frame`.
        Needs a started stack (``RuntimeError``)."""
        self._parts.table.flush(self._now())

    def _now(self) -> float:
        """Loop time, the data path's clock; ``RuntimeError`` before :meth:`start`."""
        ctx = self._parts.ctx
        if not ctx.is_started:
            raise RuntimeError("the Stack is not started: use it inside 'async with Stack(...)' (or await start())")
        return ctx.running.time()

    def frame_outcomes(self) -> tuple[int, int, int]:
        """``(frames_in, handled, dropped)``: frames received, and how many of them were handled
        (the sum of ``handled.<reason>``) or dropped (``frames_dropped``). Each frame has one
        outcome, so the first equals the sum of the other two."""
        c = self.counters
        handled = sum(v for k, v in c.items() if k.startswith("handled."))
        return c["frames_in"], handled, c["frames_dropped"]

    # -------------------------------------------------------------- port forwards
    def _forwards(self):
        """The :class:`~aioslirp.nat.forward.Forwarder` holding this stack's port forwards (made at the first)."""
        if self._forwarder is None:
            from .nat.forward import Forwarder

            p = self._parts
            self._forwarder = Forwarder(p.ctx, p.family4, p.family6)
        return self._forwarder

    async def add_forward(self, fwd):
        """Forward a host port into the guest; see :class:`~aioslirp.config.forward.PortForward`.

        Needs a started stack (inside ``async with``); may be called before or while
        :meth:`serve` runs. Returns the :class:`PortForward` as added, with its ``id``
        (1, 2, ... per stack) and the bound ``host_port`` (when 0 was asked). Raises
        :class:`~aioslirp.errors.ConfigError` for a bad field (proto, ports, a guest address
        outside the network) and :class:`~aioslirp.nat.forward.ForwardError` (an ``OSError``)
        when the host address/port cannot be bound, e.g. already in use.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("add_forward() needs a started, open Stack")
        return await self._forwards().add(fwd)

    def remove_forward(self, fwd):
        """Stop a forward, given its ``id`` or the :class:`PortForward` returned by
        :meth:`add_forward`: its host socket closes at once (new connections are
        refused); forwarded TCP connections already open carry on. Returns the removed
        :class:`PortForward`; raises :class:`~aioslirp.nat.forward.UnknownForwardError` naming the id
        when there is no such forward (a ``ForwardError``, and a ``KeyError`` as before)."""
        return self._forwards().remove(fwd if isinstance(fwd, int) else getattr(fwd, "id", None))

    def forwards(self) -> list:
        """The active :class:`PortForward` objects, in the order they were added."""
        return [] if self._forwarder is None else self._forwarder.list()

    # -------------------------------------------------------------- audit
    def _set_audit(self, audit) -> None:
        p = self._parts
        p.ctx.audit = p.table.audit = audit.for_guest(p.ctx.identity)  # the records carry the guest's name
        if self._loop is not None:
            audit.bind(self._loop, self.counters)

    def audit_records(self, maxlen: int = 4096):
        """An async iterator of the audit records from now on (``dict``: one per flow at its end,
        per denial, per DNS decision; fields in docs/audit.md), until the audit log closes
        (:meth:`aclose`, for a log the stack opened; an :class:`~aioslirp.observe.audit.AuditLog` passed
        in is only flushed there, and ends its readers at its own ``close()``).

        Bounded: it holds ``maxlen`` records; a reader that falls behind loses the oldest,
        counted ``audit.records_dropped``. Subscribed when called (before the first ``async
        for`` step); ``await it.aclose()`` unsubscribes. Without an audit log, one without a
        file is started. Named ``flow_events()`` up to 0.1.

        Usage::

            async for record in stack.audit_records():
                print(record["event"], record.get("dst"))
        """
        if self._parts.ctx.audit is None:
            from .observe.audit import AuditLog

            self._own_audit = True
            self._set_audit(AuditLog())
        return self._parts.ctx.audit.events(maxlen)

    def reopen_audit_log(self) -> None:
        """Reopen the audit log's file (log rotation; the CLI does it on SIGHUP). Nothing when off."""
        audit = self._parts.ctx.audit
        if audit is not None:
            audit.reopen()

    # -------------------------------------------------------------- stats
    def _flow_stats(self) -> dict:
        """Active flows by ``proto`` and TCP state: ``{"tcp": {"ESTABLISHED": 3}, "udp": 1, ...}``
        (``stats()["flows"]``; ``flow_stats()`` up to 0.1)."""
        out: dict = {}
        for f in self._parts.flows.values():
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
             "compiled": str,                                  # one line: is the compiled path loaded
             "native": str}                                    # "on" or "off (<reason>)": the native data plane

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
                  ``tcp_host_write_paused``, ``tcp_host_lost``: a host socket failed, e.g. the host
                  peer reset, the guest got a RST...; ``tcp_fair_wait_down`` / ``_up``: a flow
                  waited for the guest's turn in the loop's fair scheduler, :mod:`aioslirp.fair`; ``fair_express``:
                  its express lane read the guest's input early), ``udp_*`` (``udp_datagrams_up`` / ``_down``,
                  ``udp_idle_closed``), ``icmp_*`` (echo and error counts, ``icmp_errors_rate_limited``),
                  ``ip_fragments`` / ``ip_reassembled``, ``arp.*``, ``ndp.*`` / ``ra_*`` / ``na_*``
                  (IPv6 neighbour discovery), ``forward_*`` (port forwards), ``flow_errors``.
            flows: the flows open now: TCP by RFC 9293 state name, UDP and ICMP as one count
                each; ``{}`` when none. Per-flow detail: :attr:`flows() <flows>`.
            inject_queue: ``depth``, frames queued for the guest and not yet written to the
                transport; ``size``, the queue's capacity (``config.inject_queue_size``); frames
                beyond it are dropped (``drop.inject_full``).
            compiled: :func:`aioslirp.compiled.notice`, e.g. ``"compiled per-frame path: on (8/8
                modules)"``, or off and why (``AIOSLIRP_NO_EXTENSIONS``, not built, a stale build).
            native: :func:`aioslirp.native.status`: ``"on"``, or ``"off (<reason>)"`` (not switched
                on, ``AIOSLIRP_NO_EXTENSIONS``, not built, a stale build), for this process; whether
                this stack's transport reads natively is the transport's (``TapTransport.native``).
            native_tcp: only while a TAP read natively or a vhost-user device is served with TCP flows
                on the native plane (:mod:`aioslirp.nat.native_tcp`): the engine's counters (``frames``, ``frames_out``,
                drops by reason: ``bad_checksum``, ``out_of_window``, ``bad_ack``, ``syn_on_open``,
                ``rst_bad_seq``; ``dup_acks``, ``fast_retransmits``, ``rto``, ``zero_window_probes``,
                ``host_write_paused``, ``gathered``, ``rate_held_up``, ``rate_paused_down``, ``adopted``, ``ended``, ``live``, ``peek_off``).
        The counters are also exported as OpenTelemetry metrics by :func:`aioslirp.observe.metrics.register`.
        """
        return {
            "counters": {k: int(v) for k, v in sorted(self.counters.items())},
            "flows": self._flow_stats(),
            "inject_queue": {"depth": len(self._parts.inject_queue), "size": self.config.inject_queue_size},
            "compiled": compiled_notice(),
            "native": native_status(),
            **({"native_tcp": self._parts.ctx.native_tcp.counters()} if self._parts.ctx.native_tcp is not None else {}),
        }

