"""What the flows and the dispatch are handed by the stack: :class:`FlowContext` and :class:`Running`.

No flow, service glue or dispatch object reads the :class:`~aioslirp.stack.Stack`: what they
need of it comes in two halves, each complete when it is handed over.

* :class:`FlowContext`, made with the stack (``Stack.__init__``): the config and counters, the
  flow table, the guard, the inject queue, the task helpers, the tracer, the rate caps and the
  audit log. The parts that need it (the link, L3, L4, the families) are made with it.
* :class:`Running`, made all at once when the stack starts (``Stack.start``): the event loop and
  its clock, the DNS forwarder, the host poller. ``ctx.running`` is set then, once; no frame and
  no flow exists before (a flow takes what it needs of it at its creation).

So no field is ``None`` for half its life; the few that may be ``None`` are features that are
off (no tracer, no audit log, no rate cap).

The collaborators above this floor (the DNS forwarder in :mod:`aioslirp.services`, the host
poller in :mod:`aioslirp.nat`, the tracer and the audit log in :mod:`aioslirp.observe`) are
typed by the protocols they follow (:class:`Resolver`, :class:`ReadPoller`,
:class:`~aioslirp.flow.base.TracePoints`, :class:`~aioslirp.flow.base.AuditSink`), so that this
floor imports none of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from ..config import NetworkConfig
from ..config.identity import NO_IDENTITY, GuestIdentity
from ..fair import Share
from ..inject import Frame, InjectQueue
from ..ratelimit import ByteBucket
from .base import AuditSink, TracePoints
from .guard import Guard
from .table import FlowTable

__all__ = ["FlowContext", "NativeTcpPlane", "ReadPoller", "Resolver", "Running"]

log = logging.getLogger("aioslirp.stack")


class Resolver(Protocol):
    """The stack's DNS forwarder as the data path asks it (:class:`aioslirp.services.dns.DnsForwarder`)."""

    async def resolve(self, query: bytes, *, tcp: bool = False, now: float | None = None,
                      guest: Any = None) -> bytes | None:
        """The answer to one DNS message for the guest, or ``None`` (no answer)."""
        ...

    async def close(self) -> None:
        """Abort the queries in flight."""
        ...


class ReadPoller(Protocol):
    """Read readiness of the host sockets through one epoll (:class:`aioslirp.nat.hostsock.HostPoller`)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the poller's epoll is registered with."""
        ...

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever ``fd`` is readable."""
        ...

    def remove_reader(self, fd: int) -> bool:
        """Stop watching ``fd``; True when it was watched."""
        ...

    def close(self) -> int:
        """Stop, and return how many fds were still watched."""
        ...


class NativeTcpPlane(Protocol):
    """The native TCP engine as the dispatch asks it (:class:`aioslirp.nat.native_tcp.NativeTcp`)."""

    def adopt(self, fam: Any, key: tuple, remote: str, seg: Any, orig_header: bytes, now: float) -> bool:
        """Run an admitted guest SYN's flow natively; False: the Python path takes it."""
        ...


class Running:
    """What exists once the stack runs, made all at once by ``Stack.start`` (``ctx.running``).

    Args:
        loop: the event loop the stack runs on.
        dns: the DNS forwarder (:class:`Resolver`: DNS over UDP and TCP to the DNS address).
        host_poller: the one epoll reading the TCP flows' host sockets (:class:`ReadPoller`,
            closed by ``Stack.aclose``).
        share_up, share_down: the guest's :class:`~aioslirp.fair.Share` of the loop's fair
            scheduler each way (``share_up``: guest -> host), or ``None`` (``fair_weight`` None:
            not scheduled). TCP flows charge the bytes they move to them and wait their turn
            when told (:mod:`aioslirp.fair`).

    Attributes:
        time: ``loop.time``, bound: the one clock of the data path (seconds). A batch of guest
            frames reads it once (:meth:`Link.on_frames <aioslirp.dispatch.link.Link.on_frames>`)
            and hands that ``now`` down through L3, L4, the flows and their flush; timers, rate
            limiters and ``last_active`` read the same clock. No wall clock on the frame path.
    """

    __slots__ = ("loop", "time", "dns", "host_poller", "share_up", "share_down")

    loop: asyncio.AbstractEventLoop
    time: Callable[[], float]
    dns: Resolver
    host_poller: ReadPoller
    share_up: Share | None
    share_down: Share | None

    def __init__(self, loop: asyncio.AbstractEventLoop, dns: Resolver, host_poller: ReadPoller, *,
                 share_up: Share | None = None, share_down: Share | None = None) -> None:
        self.loop = loop
        self.time = loop.time
        self.dns = dns
        self.host_poller = host_poller
        self.share_up = share_up
        self.share_down = share_down


class NativeFlows(Protocol):
    """What the flows see of the native data plane's flows of one kind (``FlowContext.native_udp``:
    :class:`~aioslirp.nat.native_udp.NativeUdp`): a new flow is offered to it once admitted."""

    def adopt(self, flow: Any) -> None:
        """Move ``flow``'s datagrams to the native plane if it can take them; else nothing changes."""

    def take(self) -> None:
        """Bring the adopted flows' figures (bytes each way, last activity) and the stack's counters up
        to date with what the plane moved since the last call."""


class FlowContext:
    """The stack's parts as the flows and the dispatch see them (see the module documentation).

    Made by the stack's constructor, which sets every attribute below before any part uses it
    (:attr:`table`, :attr:`guard` and :attr:`tracer` right after this object, which the guard
    counts its drops through); :attr:`running` follows when the stack starts.

    Attributes:
        config: the validated :class:`~aioslirp.config.NetworkConfig`.
        counters: the stack's ``collections.Counter``.
        table: the :class:`~aioslirp.flow.table.FlowTable`.
        guard: the :class:`~aioslirp.flow.guard.Guard`.
        queue: the :class:`~aioslirp.inject.InjectQueue`; ``inject`` is its ``put(frame) -> bool``.
        tasks: the ``set`` of the flows' own tasks (``Stack.aclose`` cancels and awaits them).
        spawn: ``spawn(coro, name) -> Task``, an auxiliary task owned by the stack.
        tracer: the stack's :class:`~aioslirp.observe.tracing.Tracer`, or ``None`` (not traced): the
            flows tell it what they did (``if tr is not None: tr.record_...(...)``, after the work).
        audit: the stack's :class:`~aioslirp.observe.audit.AuditLog`, or ``None`` (no audit log;
            ``Stack.audit_records`` may start one later): ``audit.record(dict)`` for denials and DNS
            decisions; the flow table records each flow's end itself.
        rate_up, rate_down: the guest's :class:`~aioslirp.ratelimit.ByteBucket` each way
            (``rate_up`` guest -> host), or ``None`` (no cap): TCP flows pace against them,
            UDP flows drop what they do not hold.
        offload: the transport being served takes offload frames (a TAP with ``IFF_VNET_HDR``);
            set by ``Stack.serve`` per transport.
        native_udp: the :class:`~aioslirp.nat.native_udp.NativeUdp` of the transport being served
            (native UDP flows, issue 26), or ``None`` (off: the default); set by ``Stack.serve``. A
            new UDP NAT flow is offered to it (``native_udp.adopt(flow)``) once admitted.
        native_tcp: the native TCP engine of the transport being served
            (:class:`~aioslirp.nat.native_tcp.NativeTcp`, a :class:`NativeTcpPlane`), or ``None``:
            TCP NAT flows run in Python. Set by ``Stack.serve`` per transport.
        closed: the stack is closing: no new flow is started.
        identity: the stack's :class:`~aioslirp.config.identity.GuestIdentity` (name and labels;
            its ``log_prefix`` / ``log_extra`` go with the log lines about this guest).
        running: what exists once the stack runs (:class:`Running`), set once by ``Stack.start``
            (:meth:`start`); not there before (``AttributeError``; :attr:`is_started` says).
    """

    __slots__ = ("config", "counters", "table", "guard", "queue", "inject", "tasks", "spawn", "tracer", "audit",
                 "rate_up", "rate_down", "offload", "native_udp", "closed", "running", "identity", "native_tcp")

    config: NetworkConfig
    counters: dict[str, int]
    table: FlowTable
    guard: Guard
    queue: InjectQueue
    #: ``queue.put`` (:meth:`InjectQueue.put <aioslirp.inject.InjectQueue.put>`), bound once: every
    #: frame for the guest goes through it, one attribute look-up less each.
    inject: Callable[[Frame], bool]
    tasks: set[asyncio.Task]
    spawn: Callable[..., asyncio.Task]
    tracer: TracePoints | None
    audit: AuditSink | None
    rate_up: ByteBucket | None
    rate_down: ByteBucket | None
    offload: bool
    native_udp: NativeFlows | None
    closed: bool
    running: Running
    identity: GuestIdentity
    native_tcp: NativeTcpPlane | None

    def __init__(self, config: NetworkConfig, counters: dict[str, int], queue: InjectQueue, spawn: Callable[..., asyncio.Task],
                 *, rate_up: ByteBucket | None = None, rate_down: ByteBucket | None = None,
                 identity: GuestIdentity = NO_IDENTITY) -> None:
        # table and guard: set by the stack's constructor right after (the guard counts its drops
        # through this context, the table tells the guard), as is tracer (it reads the table)
        self.config = config
        self.counters = counters
        self.queue = queue
        self.inject = queue.put
        self.tasks = set()
        self.spawn = spawn
        self.tracer = None
        self.audit = None
        self.rate_up = rate_up
        self.rate_down = rate_down
        self.native_udp = None
        self.offload = False
        self.closed = False
        self.identity = identity
        self.native_tcp = None

    @property
    def is_started(self) -> bool:
        """:attr:`running` is set: the stack has started (and may have closed since)."""
        return hasattr(self, "running")

    def start(self, running: Running) -> None:
        """Hand over what exists once the stack runs (``Stack.start``, once). Raises
        ``RuntimeError`` the second time."""
        if self.is_started:
            raise RuntimeError("the stack was started already")
        self.running = running

    def drop(self, reason: str) -> None:
        """Count a dropped guest frame: ``drop.<reason>`` and ``frames_dropped``.

        Every guest frame ends with exactly one outcome: dropped here, or handled
        (:meth:`handled`), so that ``frames_in == frames_dropped + sum(handled.*)``
        (``Stack.frame_outcomes``). Drops that are not a guest frame's outcome (a frame for the
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

    def start_task(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        """A flow's own task on the running loop, held in :attr:`tasks` until it ends."""
        task = self.running.loop.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task
