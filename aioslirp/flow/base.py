"""What every flow is: the :class:`Flow` protocol and its key, :func:`flow_key`.

A flow is one NAT conversation of the guest (or of a host client of a port forward) that
holds host resources: a TCP connection (:class:`~aioslirp.nat.tcp.TcpFlow`), a UDP flow
(:class:`~aioslirp.nat.udp.UdpFlow`, :class:`~aioslirp.nat.forward.UdpForwardFlow`) or an ICMP echo
flow (:class:`~aioslirp.nat.icmp.IcmpFlow`), IPv4 or IPv6. The stack's
:class:`~aioslirp.flow.table.FlowTable` finds it by its key, flushes it at the end of a batch
of guest frames, sweeps it when idle and evicts it when room is needed; the API socket and the
trace points read it through the attributes below. Nothing else about a flow is assumed.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

__all__ = ["Flow", "FlowContext", "admission", "flow_key"]

log = logging.getLogger("aioslirp.stack")


def flow_key(proto: int, guest_ip: bytes, guest_port: int, remote_ip: bytes, remote_port: int) -> tuple:
    """The flow-table key ``(proto, guest addr, guest port, remote addr, remote port)``.

    ``proto``: 6, 17, 1 or 58 (IP protocol / IPv6 next header); addresses 4 bytes (IPv4) or
    16 bytes (IPv6), as on the wire; ports 0-65535. The remote side is what the guest sees:
    the address and port it sent to (for a port forward, the gateway and the source port the
    stack chose). An echo flow has the echo identifier as guest port and 0 as remote port.
    The per-segment look-ups of :mod:`aioslirp.dispatch.l4` build the same tuple inline.
    """
    return (proto, guest_ip, guest_port, remote_ip, remote_port)


def admission(ctx, flow, remote: str | None) -> tuple[str | None, str | None]:
    """``(name, rule)`` for a flow being created (its :attr:`Flow.name` and :attr:`Flow.rule`):
    what the egress policy said when :meth:`Guard.admit <aioslirp.flow.guard.Guard.admit>` let
    it through (:meth:`Guard.admitted <aioslirp.flow.guard.Guard.admitted>`); ``(None, None)``
    with no guard, for an inbound flow or a local service (``remote`` ``None``)."""
    guard = getattr(ctx, "guard", None)
    if guard is None or remote is None:
        return None, None
    return guard.admitted(flow, remote)


@runtime_checkable
class Flow(Protocol):
    """The interface of a flow in the :class:`~aioslirp.flow.table.FlowTable`.

    Attributes:
        key: its :func:`flow_key` (a retired TCP flow appends a serial, see ``TcpFlow.retire``).
        proto: 6, 17, 1 or 58.
        proto_name: ``"tcp"``, ``"udp"`` or ``"icmp"`` (both families); counters
            ``flows.<proto_name>.opened`` / ``.closed``.
        direction: ``"outbound"`` (the guest opened it) or ``"inbound"`` (a port forward).
        state: the RFC 9293 state name of a TCP flow, ``"OPEN"`` for the others.
        guest_ip, dst_ip: the guest's address and the remote address it sees (bytes, 4 or 16).
        guest_port, dst_port: the ports (``None`` for echo flows, which have none).
        remote: the host side as text (the address connected to, or ``host:port`` of a port
            forward's client), ``None`` when not kept (UDP flows) or a local service (DNS over TCP).
        forward_id: the id of the port forward it belongs to, or ``None``.
        last_active: loop time (seconds, ``loop.time()``) of its last activity.
        bytes_up, bytes_down: payload bytes guest -> host and host -> guest (TCP: in-order
            payload accepted from the guest / sent to it, retransmissions excluded), ``None``
            when not counted (echo flows).
        started: loop time (seconds) the flow was created.
        outcome: how it ended, read when it leaves the table (the audit log's ``end``): TCP
            ``"closed"``, ``"reset"``, ``"refused"``, ``"unreachable"``, ``"timeout"`` (connect
            or idle timeout), ``"evicted"``; UDP and echo flows ``"idle"``, ``"evicted"``,
            ``"closed"``. Settable (the flow table sets ``"evicted"``).
        name: the DNS name (lower case, no trailing dot) whose binding to the destination address
            let the flow through the egress policy (the virtual DNS answered it to the guest), or
            ``None`` (no name decided, an inbound flow, a local service). Set at creation.
        rule: the text of the egress rule that allowed the flow (``"pypi.org:443"``,
            ``"10.0.0.0/8"``, ``"policy hook: ..."``), or ``None`` when no rule decided (``egress_default
            allow``, inbound flows, local services). Set at creation (:func:`admission`).
    """

    key: tuple
    proto: int
    proto_name: str
    direction: str
    state: str
    guest_ip: bytes
    guest_port: int | None
    dst_ip: bytes
    dst_port: int | None
    remote: str | None
    forward_id: int | None
    last_active: float
    bytes_up: int | None
    bytes_down: int | None
    started: float
    outcome: str
    name: str | None
    rule: str | None

    def flush(self) -> None:
        """Send what is due (called once per batch of guest frames for a flow marked dirty)."""

    def fail(self) -> None:
        """End the flow after an internal error of its own (a failed :meth:`flush`)."""

    def shutdown(self) -> None:
        """End now (stack exit, reset, eviction, idle): host resources released, table left."""

    def expire(self, now: float) -> bool:
        """Idle sweep at loop time ``now``: shut down (and count) when idle past the flow kind's
        timeout; True when it did."""


class FlowContext:
    """The stack's collaborators as the flows and the dispatch see them, handed over at creation.

    No flow, service glue or dispatch object reads the :class:`~aioslirp.stack.Stack`: what
    they need is here, set once by the stack (``loop``, ``dns`` and ``dns_host`` when it
    starts, ``offload`` per served transport, ``closed`` when it closes).

    Attributes:
        config: the validated ``NetworkConfig``.
        counters: the stack's ``collections.Counter``.
        loop: the event loop (``None`` until ``Stack.start``). ``loop.time()`` is the one clock
            of the data path: ``last_active``, timers, rate limiters.
        table: the :class:`~aioslirp.flow.table.FlowTable`.
        guard: the :class:`~aioslirp.flow.guard.Guard`.
        queue: the :class:`~aioslirp.inject.InjectQueue`; ``inject`` is its ``put(frame) -> bool``.
        tasks: the ``set`` of the flows' own tasks (``Stack.aclose`` cancels and awaits them).
        spawn: ``spawn(coro, name) -> Task``, an auxiliary task owned by the stack.
        icmp: the :class:`~aioslirp.nat.icmp.IcmpEcho` proxy.
        dns: the :class:`~aioslirp.services.dns.DnsForwarder` (``None`` until started).
        dns_host: ``dns_host(flow)``: the host side of a TCP flow to the DNS address
            (:class:`~aioslirp.services.dns_tcp.DnsTcpHost`), so ``tcp/`` needs no service.
        host_poller: the :class:`~aioslirp.nat.hostsock.HostPoller` (one epoll) reading the TCP
            flows' host sockets (``None`` until ``Stack.start``; closed by ``Stack.aclose``).
        offload: the transport being served takes offload frames (a TAP with ``IFF_VNET_HDR``).
        closed: the stack is closing: no new flow is started.
        tracer: the stack's :class:`~aioslirp.observe.tracing.Tracer`, or ``None`` (not traced): the
            flows tell it what they did (``if tr is not None: tr.on_...(...)``, after the work).
        audit: the stack's :class:`~aioslirp.observe.audit.AuditLog`, or ``None`` (no audit log):
            ``audit.record(dict)`` for denials and DNS decisions; the flow table records each
            flow's end itself.
        rate_up, rate_down: the guest's :class:`~aioslirp.ratelimit.ByteBucket` each way
            (``rate_up`` guest -> host), or ``None`` (no cap): TCP flows pace against them,
            UDP flows drop what they do not hold.
        router: the :class:`~aioslirp.handlers.routes.Router` choosing Python handlers for new
            flows (``None``: none).
    """

    __slots__ = ("config", "counters", "loop", "table", "guard", "queue", "inject", "tasks", "spawn", "icmp",
                 "dns", "dns_host", "host_poller", "offload", "closed", "tracer", "audit", "rate_up", "rate_down", "router")

    config: object
    counters: dict[str, int]
    loop: object
    table: object
    guard: object
    queue: object
    inject: object
    tasks: set
    spawn: object
    icmp: object
    dns: object
    dns_host: object
    host_poller: object
    offload: bool
    closed: bool
    #: The stack's tracer (``None``: not traced).
    tracer: object
    #: The stack's audit log (``None``: off).
    audit: object
    #: The guest's byte-rate caps (``None``: none).
    rate_up: object
    rate_down: object
    #: The stack's :class:`~aioslirp.handlers.routes.Router` (flows to Python handlers), or ``None``.
    router: object

    def __init__(self, config, counters) -> None:
        self.config = config
        self.counters = counters
        self.loop = None
        self.table = self.guard = self.queue = self.inject = self.spawn = self.icmp = None
        self.dns = self.dns_host = self.host_poller = None
        self.tasks: set = set()
        self.offload = False
        self.closed = False
        self.tracer = None
        self.audit = None
        self.rate_up = self.rate_down = None
        self.router = None

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

    def start_task(self, coro, name: str):
        """A flow's own task on :attr:`loop`, held in :attr:`tasks` until it ends."""
        task = self.loop.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def handled(self, reason: str) -> None:
        """Count a guest frame that was handled (answered, NATed, held for reassembly...) as
        ``handled.<reason>``; see :meth:`drop`."""
        self.counters["handled." + reason] += 1
