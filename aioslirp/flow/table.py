"""The flow table: flows by key, the flush of dirty flows, eviction, and the one idle sweep.

Theory of operation
-------------------
Every flow of a stack, TCP, UDP and ICMP, both address families, guest-initiated or from a
port forward, lives in :attr:`FlowTable.flows` under its :func:`~aioslirp.flow.base.flow_key`.
A flow enters with :meth:`FlowTable.add` and leaves with :meth:`FlowTable.remove`, which count
``flows.<proto_name>.opened`` / ``.closed`` and tell the :class:`~aioslirp.flow.guard.Guard` (its
per-protocol counts stay exact) and the stack's tracer, if it has one.

* **Dirty set.** A flow that took a guest segment adds itself to :attr:`FlowTable.dirty`
  (:attr:`FlowTable.mark_dirty`); :meth:`FlowTable.flush` runs once at the end of the batch of
  guest frames with the batch's ``now`` and flushes each (``flow.flush(now)``), so many segments
  give one ACK and one socket write. A flush that raises is counted
  (``flow_errors``) and ends that flow alone (``flow.fail()``).
* **Room.** The table holds at most ``max_flows``. :meth:`FlowTable.make_room` makes a slot by
  evicting the UDP/ICMP flow idle the longest (``flows_evicted``), taken from
  :class:`IdleOrder` in O(log n) amortized; TCP flows are never evicted, so a table full of
  them refuses new flows.
* **One idle sweep.** A single loop timer (:meth:`FlowTable.start`) calls ``flow.expire(now)``
  on every flow every :func:`sweep_interval` seconds (min(5 s, a quarter of the shortest idle
  timeout), at least 50 ms); each flow kind applies its own rule (``tcp_idle_timeout``:
  reset both ways, ``tcp_idle_closed``; ``udp_idle_timeout``: ``udp_idle_closed``;
  ``icmp_idle_timeout``). No flow keeps a task or a timer of its own for expiry. The sweep also
  re-counts the guard's open flows from the table, so a flow that left it without
  :meth:`remove` (a failed shutdown, a wholesale clear) does not hold a slot for ever.
  ``last_active`` is loop time (``loop.time()``) for every flow kind.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from typing import Any

from .base import AuditSink, Flow, FlowWatch, TracePoints

__all__ = ["FlowTable", "IdleOrder", "sweep_interval"]

log = logging.getLogger("aioslirp.stack")

_PROTO_TCP = 6
#: The counters a flow of each ``proto_name`` bumps entering and leaving the table (made once).
_OPENED = {name: f"flows.{name}.opened" for name in ("tcp", "udp", "icmp")}
_CLOSED = {name: f"flows.{name}.closed" for name in ("tcp", "udp", "icmp")}


def sweep_interval(config) -> float:
    """Seconds between two idle sweeps: min(5 s, a quarter of the shortest positive idle
    timeout of ``config`` (``tcp_idle_timeout``, ``udp_idle_timeout``, ``icmp_idle_timeout``)),
    at least 0.05 s."""
    timeouts = [t for t in (float(config.tcp_idle_timeout), float(config.udp_idle_timeout),
                            float(config.icmp_idle_timeout)) if t > 0]
    return min(5.0, max(0.05, min(timeouts) / 4)) if timeouts else 5.0


class IdleOrder:
    """The flows that may be evicted (UDP and ICMP, both families; never TCP), longest idle first.

    :meth:`FlowTable.make_room` takes its victim here instead of scanning the flow table. A
    lazy min-heap of ``(stamp, seq, flow)``, ``stamp`` being the flow's ``last_active``
    (seconds, loop time) when the entry was pushed. Flows keep updating ``last_active`` on every
    datagram themselves -- nothing is called here per packet -- and ``last_active`` only grows,
    so a stamp is never above its flow's ``last_active``. :meth:`pop_idlest` looks at the top
    entry: a flow that left the table is discarded; a flow active since its push is pushed again
    with its current ``last_active``; otherwise no flow can have been idle longer (each one's
    ``last_active`` >= its stamp >= this one's), and it is the victim. An entry is pushed again
    at most once per activity of its flow, so an eviction costs O(log n) amortized. Entries of
    flows that left the table are compacted away once the heap exceeds twice the table + 64.

    Attributes:
        examined: heap entries :meth:`pop_idlest` looked at, in all (a cost counter).
    """

    __slots__ = ("_flows", "_heap", "_seq", "examined")

    _flows: dict[tuple, Flow]
    _heap: list[tuple[float, int, Flow]]
    _seq: itertools.count
    examined: int

    def __init__(self, flows: dict[tuple, Flow]) -> None:
        self._flows = flows  # the table; an entry counts while flows[flow.key] is its flow
        self._heap: list = []
        self._seq = itertools.count()
        self.examined = 0

    def __len__(self) -> int:
        """Heap entries, including those of flows that left the table and are not yet compacted."""
        return len(self._heap)

    def add(self, flow: Flow) -> None:
        """Track ``flow`` (just entered the table; it needs ``key`` and ``last_active``)."""
        heap = self._heap
        heapq.heappush(heap, (flow.last_active, next(self._seq), flow))
        if len(heap) > 2 * len(self._flows) + 64:
            flows = self._flows
            heap[:] = [e for e in heap if flows.get(e[2].key) is e[2]]
            heapq.heapify(heap)

    def pop_idlest(self) -> Flow | None:
        """Remove and return the flow in the table idle the longest, or ``None`` when there is none."""
        heap = self._heap
        flows = self._flows
        while heap:
            self.examined += 1
            stamp, _seq, flow = heap[0]
            held: Any = flows.get(flow.key)  # (Any: no narrowing of ``flow`` to ``Flow | None`` by ``is``)
            if held is not flow:
                heapq.heappop(heap)
            elif flow.last_active > stamp:
                heapq.heapreplace(heap, (flow.last_active, next(self._seq), flow))
            else:
                heapq.heappop(heap)
                return flow
        return None

    def clear(self) -> None:
        self._heap.clear()


class FlowTable:
    """The flows of one stack (see the module documentation).

    Args:
        config: the stack's ``NetworkConfig`` (``max_flows`` and the idle timeouts).
        counters: the stack's ``collections.Counter``.
        guard: the :class:`~aioslirp.flow.guard.Guard` (any :class:`~aioslirp.flow.base.FlowWatch`), told of
            every flow entering and leaving.
        tracer: the stack's :class:`~aioslirp.observe.tracing.Tracer`, or ``None``: told of every
            flow entering and leaving (after it did).

    Attributes:
        flows: ``dict`` key -> flow (see :class:`~aioslirp.flow.base.Flow`); records of it:
            :class:`~aioslirp.flow.info.FlowRecords`.
        get: ``flows.get``, bound (the per-segment look-up of :class:`~aioslirp.dispatch.l4.L4`).
        idle_order: the :class:`IdleOrder` of the evictable flows.
        dirty: flows to flush at the end of the batch (:meth:`flush`); a flow adds itself
            (:attr:`mark_dirty`).
    """

    __slots__ = ("max_flows", "counters", "guard", "flows", "get", "idle_order", "dirty", "mark_dirty", "interval",
                 "_loop", "_timer", "tracer", "audit")

    max_flows: int
    counters: dict[str, int]
    #: The :class:`~aioslirp.flow.guard.Guard`: told of every flow entering and leaving.
    guard: FlowWatch
    flows: dict[tuple, Flow]
    get: Callable[[tuple], Flow | None]
    idle_order: IdleOrder
    dirty: set[Flow]
    #: ``dirty.add``, bound once: a flow that took a guest segment marks itself with it (one
    #: attribute look-up less per segment than ``table.dirty.add``).
    mark_dirty: Callable[[Flow], None]
    #: Seconds between two idle sweeps (:func:`sweep_interval`).
    interval: float
    _loop: asyncio.AbstractEventLoop | None
    _timer: asyncio.TimerHandle | None
    #: The stack's tracer (``None``: not traced).
    tracer: TracePoints | None
    #: The stack's :class:`~aioslirp.observe.audit.AuditLog` (``None``: off): told of every flow leaving.
    audit: AuditSink | None

    def __init__(self, config, counters: dict[str, int], guard: FlowWatch, tracer: TracePoints | None = None) -> None:
        self.max_flows = int(config.max_flows)
        self.counters = counters
        self.guard = guard
        self.flows: dict[tuple, Flow] = {}
        self.get = self.flows.get
        self.idle_order = IdleOrder(self.flows)
        self.dirty: set[Flow] = set()
        self.mark_dirty = self.dirty.add
        self.interval = sweep_interval(config)
        self.tracer = tracer
        self.audit = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self.flows)

    # ------------------------------------------------------------------ membership
    def add(self, flow: Flow) -> None:
        """Enter ``flow`` under ``flow.key`` (counted ``flows.<proto_name>.opened``)."""
        self.flows[flow.key] = flow
        if flow.proto != _PROTO_TCP:
            self.idle_order.add(flow)
        name = flow.proto_name
        self.counters[_OPENED.get(name) or f"flows.{name}.opened"] += 1
        self.guard.opened(flow)
        tr = self.tracer
        if tr is not None:
            tr.record_flow_opened(flow)

    def remove(self, flow: Flow) -> None:
        """``flow`` leaves the table (counted ``flows.<proto_name>.closed`` if it was in it; then
        one audit record, :meth:`AuditLog.flow_ended <aioslirp.observe.audit.AuditLog.flow_ended>`, when
        :attr:`audit` is set). Idempotent."""
        held: Any = self.flows.get(flow.key)  # (Any: no narrowing of ``flow`` to ``Flow | None`` by ``is``)
        if held is flow:
            del self.flows[flow.key]
            name = flow.proto_name
            self.counters[_CLOSED.get(name) or f"flows.{name}.closed"] += 1
            self.guard.closed(flow)
            audit = self.audit
            if audit is not None:  # the one audit record of the flow's end
                audit.flow_ended(flow)
        self.dirty.discard(flow)
        tr = self.tracer
        if tr is not None:
            tr.record_flow_closed(flow)

    def rekey(self, flow: Flow, key: tuple) -> None:
        """Move ``flow`` (in the table) to ``key``, a key no guest packet looks up; ``flow.key`` is set."""
        del self.flows[flow.key]
        flow.key = key
        self.flows[key] = flow

    def make_room(self) -> bool:
        """Ensure a free slot; evicts the longest-idle UDP/ICMP flow if needed (:class:`IdleOrder`,
        O(log n) amortized, counted ``flows_evicted``). False when the table is full of TCP flows."""
        if len(self.flows) < self.max_flows:
            return True
        victim = self.idle_order.pop_idlest()
        if victim is None:
            return False
        self.counters["flows_evicted"] += 1
        victim.outcome = "evicted"
        victim.shutdown()
        return True

    def flush(self, now: float) -> None:
        """Let every flow marked dirty since the last flush send what is due at loop time ``now``
        (seconds: the batch's ``now``, handed to ``flow.flush(now)``): one ACK, one socket write."""
        dirty = self.dirty
        while dirty:
            flow = dirty.pop()
            try:
                flow.flush(now)
            except Exception:
                log.exception("flow %s failed in flush", flow.key)
                self.counters["flow_errors"] += 1
                flow.fail()

    def shutdown_all(self) -> int:
        """Shut every flow down (stack exit, reset; each leaves the table as it does). Returns how
        many there were. A flow whose shutdown raises is logged and left; :meth:`clear` forgets it."""
        n = 0
        for flow in list(self.flows.values()):
            n += 1
            try:
                flow.shutdown()
            except Exception:  # pragma: no cover - defensive
                log.exception("flow shutdown failed")
        return n

    def clear(self) -> None:
        """Forget every flow (no shutdown, no counters)."""
        self.flows.clear()
        self.idle_order.clear()
        self.dirty.clear()

    # ------------------------------------------------------------------ the idle sweep
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Arm the idle sweep on ``loop`` (``Stack.start``): every :attr:`interval` seconds."""
        self._loop = loop
        self.close()
        self._timer = loop.call_later(self.interval, self._on_timer)

    def close(self) -> None:
        """Disarm the idle sweep (``Stack.aclose``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        # a loop timer, not a task: nothing is left running once the stack is closed
        loop = self._loop
        assert loop is not None  # armed by start(loop)
        self._timer = None
        self.sweep(loop.time())
        self._timer = loop.call_later(self.interval, self._on_timer)

    def sweep(self, now: float) -> int:
        """Expire idle flows at loop time ``now`` (each by ``flow.expire(now)``), then re-count the
        guard's open flows from the table. Returns how many flows expired."""
        n = 0
        for flow in list(self.flows.values()):
            try:
                if flow.expire(now):
                    n += 1
            except Exception:  # pragma: no cover - defensive
                log.exception("idle flow %s: shutdown failed", flow.key)
        self.guard.recount(self.flows.values())
        return n
