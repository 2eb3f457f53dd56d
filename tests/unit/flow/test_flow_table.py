"""The flow table (aioslirp.flow.table), sans-IO: membership and its counters, eviction through
:class:`~aioslirp.flow.table.IdleOrder`, the flush of dirty flows, and the one idle sweep on an
event loop whose clock the test sets (no real waiting).

The flows are stand-ins with the attributes the table reads (``key``, ``proto``, ``proto_name``,
``last_active``) and the methods it calls (``expire``, ``shutdown``, ``flush``, ``fail``); the
guard is a recorder of ``opened``/``closed``/``recount``. The guard's own rules and the timer's
interval are in test_guard.py; a whole Stack's flows expiring on a fake clock in
tests/stack/test_fake_clock_stack.py.
"""

from __future__ import annotations

import asyncio
import collections

from aioslirp.config import NetworkConfig
from aioslirp.flow.table import FlowTable, IdleOrder

from support.fake_clock import START, FakeClockLoop


class GuardCalls:
    """What the table tells the guard, in order: ``("opened"|"closed", key)`` and the recounts."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.recounts: list[list] = []

    def opened(self, flow) -> None:
        self.calls.append(("opened", flow.key))

    def closed(self, flow) -> None:
        self.calls.append(("closed", flow.key))

    def recount(self, flows) -> None:
        self.recounts.append(sorted(f.key for f in flows))


class FakeFlow:
    """A flow as the table sees it; ``timeout``: idle seconds after which ``expire`` ends it (None: never)."""

    PROTO = {"tcp": 6, "udp": 17, "icmp": 1}

    def __init__(self, table: FlowTable, key, proto_name: str = "udp", last_active: float = 0.0,
                 timeout: float | None = None) -> None:
        self.table, self.key, self.proto_name = table, key, proto_name
        self.proto = self.PROTO[proto_name]
        self.last_active = last_active
        self.timeout = timeout
        self.outcome = None
        self.expired_at: list[float] = []
        self.flushes = 0
        self.failed = False
        self.broken_flush = False

    def expire(self, now: float) -> bool:
        self.expired_at.append(now)
        if self.timeout is None or now - self.last_active < self.timeout:
            return False
        self.outcome = "idle"
        self.shutdown()
        return True

    def shutdown(self) -> None:
        self.table.remove(self)

    def flush(self, now: float) -> None:
        self.flushes += 1
        if self.broken_flush:
            raise RuntimeError("flush failed")

    def fail(self) -> None:
        self.failed = True
        self.table.remove(self)


def new_table(**cfg) -> tuple[FlowTable, GuardCalls, collections.Counter]:
    cfg.setdefault("ipv6", False)
    counters: collections.Counter = collections.Counter()
    guard = GuardCalls()
    return FlowTable(NetworkConfig(**cfg), counters, guard), guard, counters


# ============================================================================ IdleOrder
def test_idle_order_gives_the_longest_idle_flow_first():
    flows: dict = {}
    order = IdleOrder(flows)
    stamps = {"a": 5.0, "b": 1.0, "c": 3.0}
    for key, t in stamps.items():
        flows[key] = f = FakeFlow(None, key, last_active=t)
        order.add(f)
    assert [order.pop_idlest().key for _ in range(3)] == ["b", "c", "a"]  # still in the table: popped in order
    assert order.pop_idlest() is None and len(order) == 0


def test_idle_order_takes_activity_since_the_push_into_account():
    """A flow active since it was pushed (its ``last_active`` grew) is not the victim: it is pushed
    again with its new stamp and the next idlest one is returned."""
    flows: dict = {}
    order = IdleOrder(flows)
    old, mid = FakeFlow(None, "old", last_active=1.0), FakeFlow(None, "mid", last_active=2.0)
    for f in (old, mid):
        flows[f.key] = f
        order.add(f)
    old.last_active = 10.0  # a datagram at t=10: nothing is told, the flow updates its own stamp
    assert order.pop_idlest() is mid
    assert order.examined == 2  # "old" looked at once (pushed again), then "mid"
    assert order.pop_idlest() is old


def test_idle_order_skips_flows_that_left_the_table():
    flows: dict = {}
    order = IdleOrder(flows)
    gone, kept = FakeFlow(None, "gone", last_active=0.0), FakeFlow(None, "kept", last_active=9.0)
    for f in (gone, kept):
        flows[f.key] = f
        order.add(f)
    del flows["gone"]
    flows["kept"] = FakeFlow(None, "kept", last_active=20.0)  # another flow under the old key, not tracked
    assert order.pop_idlest() is None  # "gone" left; "kept"'s entry is another flow's now
    assert order.examined == 2


def test_idle_order_heap_stays_within_twice_the_table():
    """Entries of flows that left the table are compacted once the heap exceeds 2 * table + 64."""
    flows: dict = {}
    order = IdleOrder(flows)
    for i in range(1000):
        f = FakeFlow(None, i, last_active=float(i))
        flows[i] = f
        order.add(f)
        assert len(order) <= 2 * len(flows) + 64  # checked when an entry is pushed
        if i >= 10:
            del flows[i - 10]  # a churn of short flows: ten stay in the table
    assert len(flows) == 10 and len(order) <= 2 * 11 + 64
    assert order.pop_idlest().key == 990


# ============================================================================ membership
def test_add_and_remove_count_by_protocol_and_tell_the_guard_once():
    table, guard, counters = new_table()
    tcp, udp = FakeFlow(table, "t", "tcp"), FakeFlow(table, "u", "udp")
    table.add(tcp)
    table.add(udp)
    assert len(table) == 2 and table.get("t") is tcp
    table.remove(udp)
    table.remove(udp)  # idempotent: counted and told once
    assert counters == {"flows.tcp.opened": 1, "flows.udp.opened": 1, "flows.udp.closed": 1}
    assert guard.calls == [("opened", "t"), ("opened", "u"), ("closed", "u")]
    assert len(table.idle_order) == 1  # only the UDP flow was ever evictable


def test_remove_of_a_flow_replaced_under_its_key_leaves_the_new_one():
    table, guard, counters = new_table()
    first, second = FakeFlow(table, "k"), FakeFlow(table, "k")
    table.add(first)
    table.flows["k"] = second  # what a rekey of another flow into this key would do
    table.remove(first)
    assert table.get("k") is second and counters["flows.udp.closed"] == 0


# ============================================================================ eviction
def test_make_room_evicts_the_longest_idle_udp_or_icmp_flow_never_tcp():
    table, _, counters = new_table(max_flows=3)
    tcp = FakeFlow(table, "t", "tcp", last_active=0.0)  # idle the longest, but TCP
    udp = FakeFlow(table, "u", "udp", last_active=2.0)
    icmp = FakeFlow(table, "i", "icmp", last_active=1.0)
    for f in (tcp, udp, icmp):
        table.add(f)
    assert table.make_room()
    assert icmp.outcome == "evicted" and "i" not in table.flows and counters["flows_evicted"] == 1
    assert table.make_room()  # a free slot now: nothing evicted
    assert counters["flows_evicted"] == 1


def test_make_room_refuses_when_the_table_is_full_of_tcp_flows():
    table, _, counters = new_table(max_flows=2)
    for k in ("a", "b"):
        table.add(FakeFlow(table, k, "tcp"))
    assert not table.make_room()
    assert len(table) == 2 and counters["flows_evicted"] == 0


# ============================================================================ flush
def test_flush_flushes_each_dirty_flow_once_and_ends_a_failing_one_alone():
    table, _, counters = new_table()
    good, bad = FakeFlow(table, "g"), FakeFlow(table, "b")
    bad.broken_flush = True
    for f in (good, bad):
        table.add(f)
        table.dirty.add(f)
    table.dirty.add(good)  # marked twice in the batch: one flush
    table.flush(0.0)
    assert (good.flushes, bad.flushes) == (1, 1)
    assert bad.failed and not good.failed and table.get("g") is good and table.get("b") is None
    assert counters["flow_errors"] == 1 and not table.dirty
    table.flush(0.0)  # nothing dirty since
    assert good.flushes == 1


# ============================================================================ the idle sweep, on a fake clock
def run_sweeps(table: FlowTable, loop: FakeClockLoop, until: float) -> None:
    """Move the loop's clock to ``until`` one sweep interval at a time, letting it run its timers."""

    async def turns() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    while loop.now + table.interval <= until + 1e-9:
        loop.now += table.interval
        loop.run_until_complete(turns())


def test_sweep_expires_idle_flows_at_the_first_sweep_past_their_timeout():
    """Sweeps every ``interval`` s of loop time (a quarter of the shortest timeout, 2.5 s here); a
    flow idle for its timeout at a sweep is ended then, at exactly that loop time; the guard's
    counts are re-taken from the table after each sweep."""
    loop = FakeClockLoop()
    try:
        table, guard, _ = new_table(udp_idle_timeout=10.0, tcp_idle_timeout=100.0, icmp_idle_timeout=30.0)
        assert table.interval == 2.5
        quiet = FakeFlow(table, "quiet", last_active=START, timeout=10.0)
        late = FakeFlow(table, "late", last_active=START + 1.0, timeout=10.0)
        forever = FakeFlow(table, "forever", "tcp", last_active=START)
        for f in (quiet, late, forever):
            table.add(f)
        table.start(loop)
        run_sweeps(table, loop, START + 10.0)
        assert quiet.expired_at == [START + 2.5, START + 5.0, START + 7.5, START + 10.0]
        assert quiet.outcome == "idle" and table.get("quiet") is None
        assert table.get("late") is late  # idle 9 s at the sweep of t=10
        run_sweeps(table, loop, START + 12.5)
        assert late.outcome == "idle" and late.expired_at[-1] == START + 12.5
        assert len(forever.expired_at) == 5 and table.get("forever") is forever
        assert guard.recounts[-2:] == [["forever", "late"], ["forever"]]
        table.close()  # Stack.aclose: no sweep any more
        run_sweeps(table, loop, START + 25.0)
        assert len(forever.expired_at) == 5
    finally:
        loop.close()


def test_sweep_keeps_a_flow_active_before_each_sweep():
    loop = FakeClockLoop()
    try:
        table, _, _ = new_table(udp_idle_timeout=10.0, tcp_idle_timeout=10.0, icmp_idle_timeout=10.0)
        busy = FakeFlow(table, "busy", last_active=START, timeout=10.0)
        table.add(busy)
        table.start(loop)
        for t in range(1, 41):
            busy.last_active = START + t  # a datagram every second
            run_sweeps(table, loop, START + t)
        assert table.get("busy") is busy and busy.outcome is None and len(busy.expired_at) == 16
        assert table.sweep(START + 50.0) == 1  # idle 10 s: the next sweep ends it
    finally:
        table.close()
        loop.close()
