"""Admission control (aioslirp.flow.guard), the idle sweep's timer (aioslirp.flow.table) and the
egress policy (aioslirp.config.policy), sans-IO.

The :class:`~aioslirp.flow.guard.Guard` is driven through its own interface only
(``Guard(config, drop, new_bucket)``, ``start(dns, now)``, ``admit(..., now)``, the flow-table
hooks); times are passed explicitly, flows are plain objects with the attributes the guard
reads. The sweep is a :class:`~aioslirp.flow.table.FlowTable` on a fake loop. The whole-Stack
behaviour (RSTs, ICMP prohibited, real sockets) is in test_hardening.py; these tests pin down
the order of the checks, each bound at its edge, the counts and the sweep's timer. Cases found
untested by a mutation run (docs/testing.md).
"""

from __future__ import annotations

import collections
import functools
import logging
import tracemalloc
import types

import pytest

from aioslirp import NetworkConfig
from aioslirp.config.limits import parse_limits
from aioslirp.config.policy import DEFAULT_DENY, EgressPolicy, parse_rules
from aioslirp.errors import ConfigError
from aioslirp.flow import guard as guard_mod
from aioslirp.flow.guard import DENIED, FD_RESERVE, PRUNE_INTERVAL, Guard, fd_budgets
from aioslirp.flow.table import FlowTable, sweep_interval
from aioslirp.ratelimit import TokenBucket

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

TCP, UDP, ICMP, ICMP6 = 6, 17, 1, 58
HOST = "127.0.0.1"


class Timer:
    def __init__(self, when: float, callback) -> None:
        self.when, self.callback = when, callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """The two loop methods the flow table's sweep uses, on a fake clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback) -> Timer:
        t = Timer(self.now + delay, callback)
        self.timers.append(t)
        return t

    def armed(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]

    def fire(self) -> float:
        """Run the earliest armed timer at its time; returns that time."""
        t = min(self.armed(), key=lambda x: x.when)
        self.timers.remove(t)
        self.now = t.when
        t.callback()
        return t.when


class FakeStack:
    """What the stack hands the Guard: its config and ``drop()``, and what ``start()`` gets (``dns``)."""

    def __init__(self, **cfg) -> None:
        cfg.setdefault("ipv6", False)
        self.config = NetworkConfig(**cfg)
        self.counters: collections.Counter = collections.Counter()
        self.dns = None

    def drop(self, reason: str) -> None:
        self.counters["drop." + reason] += 1


class Done:
    def __init__(self, done: bool = False) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


class FakeFlow:
    """A flow as the guard and the flow table's sweep see it."""

    def __init__(self, proto_name="tcp", remote=HOST, dst_port=80, direction="outbound", transport=None,
                 last_active=0.0, key=None, timeout=None) -> None:
        self.proto_name = proto_name
        self.remote = remote
        self.dst_port = dst_port
        self.direction = direction
        self.transport = transport
        self.done = Done()
        self.last_active = last_active
        self.key = key
        self.timeout = timeout
        self.expired_at: list[float] = []

    def expire(self, now: float) -> bool:
        """The flow kind's own idle rule: idle strictly longer than ``timeout`` (None: never)."""
        self.expired_at.append(now)
        return self.timeout is not None and now - self.last_active > self.timeout


def new_bucket(config):
    """The new-flow rate limiter factory, as Stack makes it (None for no rate limit)."""
    rate = float(config.new_flow_rate)
    return functools.partial(TokenBucket, rate, max(1, int(config.new_flow_burst))) if rate > 0 else None


def guard(monkeypatch=None, soft: int | None = None, start: bool = True, **cfg) -> tuple[Guard, FakeStack]:
    """A Guard of a fake stack, started at time 0 (its rate limiter full then) unless ``start``
    is false; ``soft``: the open-file limit the guard's ``fd_limit`` reports (instead of raise_fd_limit's)."""
    stack = FakeStack(**cfg)
    fd_limit = None if soft is None else (lambda want: soft)
    g = Guard(stack.config, stack.drop, new_bucket(stack.config), fd_limit=fd_limit)
    if start:
        g.start(now=0.0)
    return g, stack


def drops(stack: FakeStack) -> dict:
    return {k: v for k, v in stack.counters.items() if k.startswith("drop.")}


# ============================================================================ fd_budgets


def test_fd_budgets_enough_for_both():
    assert fd_budgets(FD_RESERVE + 1100, 1000, 100) == (1000, 100)  # exactly enough
    assert fd_budgets(FD_RESERVE + 5000, 1000, 100) == (4900, 100)  # the rest goes to flows


def test_fd_budgets_cut_in_proportion():
    assert fd_budgets(FD_RESERVE + 110, 1000, 100) == (100, 10)
    assert fd_budgets(FD_RESERVE + 1099, 1000, 100) == (1000, 99)
    assert fd_budgets(FD_RESERVE + 5, 1000, 1) == (4, 1)  # at least one DNS query
    assert fd_budgets(FD_RESERVE + 5, 1000, 0) == (5, 0)  # no DNS, no share
    assert fd_budgets(FD_RESERVE, 1000, 10) == (0, 0)  # nothing left
    assert fd_budgets(10, 1000, 10) == (0, 0)  # below the reserve: never negative


def test_fd_budgets_clamp_negative_inputs_and_take_numbers():
    assert fd_budgets(FD_RESERVE + 44, -5, -3) == (44, 0)
    assert fd_budgets(FD_RESERVE + 2, 0, 3) == (0, 2)  # no flows: DNS gets what there is
    assert fd_budgets(float(FD_RESERVE + 110), 1000.0, 100.0) == (100, 10)


# ============================================================================ raise_fd_limit


def test_raise_fd_limit_raises_up_to_the_hard_limit_and_never_lowers():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 64:  # pragma: no cover
        pytest.skip("unlimited or tiny RLIMIT_NOFILE")
    low = hard - 10
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        assert guard_mod.raise_fd_limit(1) == low  # never lowers
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (low, hard)
        assert guard_mod.raise_fd_limit(low + 1) == low + 1
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (low + 1, hard)
        assert guard_mod.raise_fd_limit(hard + 1000) == hard  # never above the hard limit
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ============================================================================ TokenBucket


def test_token_bucket_edges():
    b = TokenBucket(rate=4, burst=2, now=0.0)
    assert b.tokens == 2.0 and b.rate == 4.0 and b.burst == 2.0
    assert b.take(0.0) and b.take(0.0)
    assert not b.take(0.0)
    assert b.take(0.25)  # exactly one token refilled
    assert not b.take(0.25)
    assert not b.take(0.375)  # half a token is kept...
    assert b.take(0.5)  # ...and completed
    assert b.take(100.0) and b.take(100.0) and not b.take(100.0)  # refill capped at the burst
    assert b.tokens == 0.0


def test_token_bucket_clock_starts_at_the_first_take_by_default():
    b = TokenBucket(rate=1, burst=2)
    assert b.stamp is None and b.tokens == 2.0
    assert b.take(50.0) and b.take(50.0)  # full at the first take, nothing refilled before it
    assert not b.take(50.5)
    assert b.take(51.5)
    assert TokenBucket(rate=1, burst=1, now=10.0).stamp == 10.0


# ============================================================================ Guard: construction


def test_guard_reads_its_config(monkeypatch):
    g, _ = guard(start=False, max_tcp_flows=3, max_udp_flows=4, max_icmp_flows=5, max_pending_connects=9,
                 new_flow_rate=7.5, new_flow_burst=2)
    assert g.bucket is None  # made by start()
    g.start(now=3.0)
    assert g.caps == {"tcp": 3, "udp": 4, "icmp": 5}
    assert g.config.max_tcp_flows == 3
    assert g.active == {"tcp": 0, "udp": 0, "icmp": 0}
    assert (g.max_pending, g.max_pending_dest) == (9, 2)
    assert (g.bucket.rate, g.bucket.burst, g.bucket.tokens, g.bucket.stamp) == (7.5, 2.0, 2.0, 3.0)
    assert g.pending == 0 and g.dns_inflight == 0
    assert guard(max_pending_connects=3)[0].max_pending_dest == 1  # at least one per destination
    assert guard(new_flow_rate=0)[0].bucket is None


def test_guard_fd_budgets_from_the_open_file_limit(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "aioslirp.limits")
    g, _ = guard(monkeypatch, soft=FD_RESERVE + 110, max_flows=1000, dns_max_inflight=100)
    assert (g.fd_budget, g.dns_fd_budget) == (100, 10)
    assert [r.getMessage() for r in caplog.records] == [
        "the open-file limit (ulimit -n) allows about 100 flows, below max_flows=1000: more are refused "
        "(drop.limit_fds)",
        "the open-file limit (ulimit -n) allows 10 DNS queries in flight, below dns_max_inflight=100: more get "
        "no answer (DNS overload)",
    ]
    caplog.clear()
    g, _ = guard(monkeypatch, soft=FD_RESERVE + 1100, max_flows=1000, dns_max_inflight=100)
    assert (g.fd_budget, g.dns_fd_budget) == (1000, 100)
    assert caplog.records == []


def test_guard_asks_for_flows_plus_dns_plus_reserve(monkeypatch):
    asked = []
    stack = FakeStack(max_flows=1000, dns_max_inflight=100)
    Guard(stack.config, stack.drop, fd_limit=lambda want: asked.append(want) or 1 << 20)
    assert asked == [1000 + 100 + FD_RESERVE]


# ============================================================================ Guard.admit: order


def test_admit_policy_first_then_caps_then_fds_then_pending_then_rate(monkeypatch):
    """The documented order: a denied destination is DENIED even when every bound is reached,
    a cap before the fd budget, both before the pending connects and the rate."""
    g, stack = guard(monkeypatch, soft=FD_RESERVE + 3, max_flows=2, dns_max_inflight=1, max_tcp_flows=1,
                     max_pending_connects=4, new_flow_rate=1, new_flow_burst=1, egress_deny=["192.0.2.0/24"])
    g.opened(FakeFlow())  # one TCP flow, pending: the cap is reached
    g.opened(FakeFlow("udp"))  # two flows: the fd budget (2) is reached too
    assert g.admit(TCP, "192.0.2.1", 80, 0.0) == DENIED
    assert g.admit(TCP, HOST, 80, 0.0) == "limit_tcp_flows"
    assert g.admit(UDP, HOST, 53, 0.0) == "limit_fds"
    assert drops(stack) == {"drop.egress_denied": 1, "drop.limit_tcp_flows": 1, "drop.limit_fds": 1}
    assert g.bucket.tokens == 1.0  # refused flows spend no token


def test_admit_remote_none_skips_the_policy(monkeypatch):
    g, stack = guard(egress_deny=["0.0.0.0/0", "::/0"])
    assert g.admit(TCP, None, 0, 0.0) is None  # DNS over TCP: a local service
    assert g.admit(UDP, "10.1.1.1", 9, 0.0) == DENIED
    assert stack.counters["drop.egress_denied"] == 1


def test_admit_empty_policy_allows_everything(monkeypatch):
    g, _ = guard(egress_deny_builtin=[])
    assert g.policy.empty
    assert g.admit(TCP, "169.254.169.254", 80, 0.0) is None


@pytest.mark.parametrize(("proto", "name"), [(TCP, "tcp"), (UDP, "udp"), (ICMP, "icmp"), (ICMP6, "icmp"), (99, "tcp")])
def test_admit_per_protocol_cap_at_its_edge(monkeypatch, proto, name):
    g, stack = guard(max_tcp_flows=2, max_udp_flows=2, max_icmp_flows=2, new_flow_rate=0)
    g.opened(FakeFlow(name, transport=object()))
    assert g.admit(proto, HOST, 7, 0.0) is None  # 1 of 2
    g.opened(FakeFlow(name, transport=object()))
    assert g.admit(proto, HOST, 7, 0.0) == f"limit_{name}_flows"
    assert drops(stack) == {f"drop.limit_{name}_flows": 1}
    others = {"tcp", "udp", "icmp"} - {name}
    for other in others:  # the other protocols are not capped by this one
        assert g.admit({"tcp": TCP, "udp": UDP, "icmp": ICMP}[other], HOST, 7, 0.0) is None


def test_admit_fd_budget_counts_all_protocols(monkeypatch):
    g, stack = guard(monkeypatch, soft=FD_RESERVE + 4, max_flows=3, dns_max_inflight=1, new_flow_rate=0)
    assert g.fd_budget == 3
    for name in ("tcp", "udp"):
        g.opened(FakeFlow(name, transport=object()))
    assert g.admit(ICMP, HOST, 0, 0.0) is None  # 2 of 3
    g.opened(FakeFlow("icmp"))
    assert g.admit(ICMP, HOST, 0, 0.0) == "limit_fds"
    assert stack.counters["drop.limit_fds"] == 1


# ============================================================================ pending connects


def test_pending_connects_per_destination_and_in_all(monkeypatch):
    g, stack = guard(max_pending_connects=8, new_flow_rate=0)  # 2 per (address, port)
    a1, a2 = FakeFlow(dst_port=1), FakeFlow(dst_port=1)
    g.opened(a1)
    assert g.admit(TCP, HOST, 1, 0.0) is None
    g.opened(a2)
    assert g.pending == 2
    assert g.admit(TCP, HOST, 1, 0.0) == "limit_pending_connects"
    assert g.admit(TCP, HOST, 2, 0.0) is None  # another port: its own quarter
    assert g.admit(TCP, "127.0.0.2", 1, 0.0) is None  # another address
    assert g.admit(UDP, HOST, 1, 0.0) is None  # only TCP connects are pending
    g.connected(a1)  # its host connect completed
    assert g.pending == 1
    assert g.admit(TCP, HOST, 1, 0.0) is None
    g.closed(a2)
    assert g.pending == 0
    for i in range(8):  # eight destinations, one pending each: the total bound
        g.opened(FakeFlow(dst_port=100 + i))
    assert g.admit(TCP, HOST, 200, 0.0) == "limit_pending_connects"
    assert stack.counters["drop.limit_pending_connects"] == 2


def test_pending_only_outbound_tcp_without_transport(monkeypatch):
    g, _ = guard(max_pending_connects=4)
    g.opened(FakeFlow(direction="inbound"))  # a port forward: we connect into the guest
    g.opened(FakeFlow(transport=object()))  # connected already
    g.opened(FakeFlow("udp"))
    g.opened(FakeFlow(remote=None))  # a local service
    assert g.pending == 0
    g.opened(FakeFlow(direction="outbound"))  # a guest-initiated connect still in progress
    assert g.pending == 1
    assert g.active == {"tcp": 4, "udp": 1, "icmp": 0}


def test_pending_set_swept_when_the_bound_is_reached(monkeypatch):
    """A pending connect that completed (transport set) or ended (done) without telling the
    guard is forgotten by the sweep, which runs at most every PRUNE_INTERVAL seconds."""
    g, _ = guard(max_pending_connects=4, new_flow_rate=0)  # 1 per destination
    a = FakeFlow(dst_port=1)
    g.opened(a)
    a.transport = object()  # connected, but connected() was not called
    assert g.admit(TCP, HOST, 1, now=0.0) is None  # the sweep at t=0 forgets it
    assert g.pending == 0
    b = FakeFlow(dst_port=2)
    g.opened(b)
    b.done = Done(True)  # ended
    assert g.admit(TCP, HOST, 2, now=PRUNE_INTERVAL / 2) == "limit_pending_connects"  # too soon for another sweep
    assert g.admit(TCP, HOST, 2, now=PRUNE_INTERVAL) is None  # exactly the interval later: swept
    assert g.pending == 0
    c = FakeFlow(dst_port=3)
    g.opened(c)  # still connecting
    assert g.admit(TCP, HOST, 3, now=1.0) == "limit_pending_connects"
    assert g.pending == 1


def test_pending_destination_count_survives_partial_forget(monkeypatch):
    g, _ = guard(max_pending_connects=12, new_flow_rate=0)  # 3 per destination
    flows = [FakeFlow(dst_port=5) for _ in range(3)]
    for f in flows:
        g.opened(f)
    assert g.admit(TCP, HOST, 5, 0.0) == "limit_pending_connects"
    g.connected(flows[0])
    g.connected(flows[0])  # twice: no effect
    assert g.admit(TCP, HOST, 5, 0.0) is None
    g.opened(FakeFlow(dst_port=5))
    assert g.admit(TCP, HOST, 5, 0.0) == "limit_pending_connects"
    g.closed(flows[1])
    g.closed(flows[2])
    assert g.pending == 1
    assert g.admit(TCP, HOST, 5, 0.0) is None


def test_closed_never_counts_below_zero(monkeypatch):
    g, _ = guard()
    g.closed(FakeFlow("udp"))
    g.closed(FakeFlow("forward"))  # not a guarded protocol
    assert g.active == {"tcp": 0, "udp": 0, "icmp": 0}
    g.opened(FakeFlow("udp"))
    g.opened(FakeFlow("udp"))
    g.closed(FakeFlow("udp"))
    assert g.active["udp"] == 1


# ============================================================================ new-flow rate


def test_new_flow_rate_is_the_last_check(monkeypatch):
    g, stack = guard(new_flow_rate=2, new_flow_burst=2)
    assert g.admit(UDP, HOST, 1, now=0.0) is None  # full at start (t=0)
    assert g.admit(UDP, HOST, 1, now=0.0) is None
    assert g.admit(UDP, HOST, 1, now=0.0) == "limit_new_flow_rate"
    assert g.admit(TCP, HOST, 1, now=0.5) is None  # one token
    assert g.admit(TCP, HOST, 1, now=0.5) == "limit_new_flow_rate"
    assert stack.counters["drop.limit_new_flow_rate"] == 2


# ============================================================================ logging


def test_each_bound_is_logged_once_naming_its_option(monkeypatch, caplog):
    caplog.set_level(logging.INFO, "aioslirp.limits")
    g, _ = guard(max_udp_flows=1, new_flow_rate=0)
    g.opened(FakeFlow("udp"))
    for _ in range(3):
        assert g.admit(UDP, HOST, 1, 0.0) == "limit_udp_flows"
    assert [r.getMessage() for r in caplog.records] == [
        "refusing new guest flows: the max_udp_flows bound is reached (counted as drop.limit_udp_flows; "
        "logged once; see --limit)"]
    assert caplog.records[0].levelno == logging.WARNING


def test_denied_destinations_logged_once_each_and_at_most_64(monkeypatch, caplog):
    caplog.set_level(logging.INFO, "aioslirp.limits")
    g, stack = guard(egress_deny=["10.0.0.0/8"])
    for _ in range(2):
        assert g.admit(UDP, "10.0.0.1", 9, 0.0) == DENIED
    assert [r.getMessage() for r in caplog.records] == ["egress policy: guest traffic to 10.0.0.1 denied (10.0.0.0/8)"]
    for i in range(100):
        g.admit(UDP, f"10.1.0.{i}", 9, 0.0)
    assert len(caplog.records) == 64
    assert stack.counters["drop.egress_denied"] == 102


# ============================================================================ DNS admission


def test_dns_admit_within_the_smaller_of_cap_and_fd_share(monkeypatch):
    g, _ = guard(monkeypatch, soft=FD_RESERVE + 110, max_flows=1000, dns_max_inflight=100)
    assert g.dns_fd_budget == 10
    tasks = []
    for _ in range(10):
        assert g.dns_admit()
        t = types.SimpleNamespace(callbacks=[])
        t.add_done_callback = t.callbacks.append
        g.dns_track(t)
        tasks.append(t)
    assert g.dns_inflight == 10
    assert not g.dns_admit()
    for t in tasks[:3]:
        (cb,) = t.callbacks
        cb(t)
    assert g.dns_inflight == 7
    assert g.dns_admit()
    g, _ = guard(monkeypatch, soft=1 << 20, dns_max_inflight=2)
    for _ in range(2):
        g.dns_track(types.SimpleNamespace(add_done_callback=lambda cb: None))
    assert not g.dns_admit()  # the configured cap when the fds allow more


def test_start_hooks_the_dns_forwarder(monkeypatch):
    g, stack = guard(monkeypatch, soft=FD_RESERVE + 110, max_flows=1000, dns_max_inflight=100)
    stack.dns = types.SimpleNamespace(policy=None, max_inflight=512)
    g.start(stack.dns, now=0.0)
    assert stack.dns.policy is g.policy
    assert stack.dns.max_inflight == 10
    g, stack = guard(monkeypatch, soft=1 << 20)
    stack.dns = types.SimpleNamespace(policy=None, max_inflight=5)
    g.start(stack.dns, now=0.0)
    assert stack.dns.max_inflight == 5  # never raised


# ============================================================================ the idle sweep (FlowTable)
# The sweep replaced the guard's TCP reaper; each flow kind's own idle rule (TCP reset both ways,
# ``tcp_idle_closed``...) is covered end to end by tests/stack/test_fake_clock_stack.py.


def table(**cfg) -> tuple[FlowTable, Guard, Loop]:
    """A FlowTable of a fake stack (its guard told of the flows) with its sweep armed on a fake loop."""
    g, stack = guard(**cfg)
    t = FlowTable(stack.config, stack.counters, g)
    loop = Loop()
    t.start(loop)
    return t, g, loop


@pytest.mark.parametrize(("timeout", "interval"), [(7200.0, 5.0), (8.0, 2.0), (0.1, 0.05)])
def test_sweep_interval(timeout, interval):
    """min(5 s, a quarter of the shortest idle timeout), at least 50 ms; armed by start()."""
    for cfg in ({"tcp_idle_timeout": timeout, "udp_idle_timeout": 7200.0, "icmp_idle_timeout": 7200.0},
                {"tcp_idle_timeout": 7200.0, "udp_idle_timeout": timeout, "icmp_idle_timeout": 7200.0},
                {"tcp_idle_timeout": 7200.0, "udp_idle_timeout": 7200.0, "icmp_idle_timeout": timeout}):
        assert sweep_interval(NetworkConfig(**cfg)) == pytest.approx(interval)
        t, _, loop = table(**cfg)
        (timer,) = loop.timers
        assert timer.when - loop.now == pytest.approx(interval)


def test_tcp_idle_timeout_off_leaves_the_other_kinds_interval():
    """tcp_idle_timeout=0 turns the TCP rule off, not the sweep (UDP/ICMP flows still expire)."""
    assert sweep_interval(NetworkConfig(tcp_idle_timeout=0, udp_idle_timeout=60.0, icmp_idle_timeout=40.0)) == 5.0
    assert sweep_interval(NetworkConfig(tcp_idle_timeout=0, udp_idle_timeout=8.0, icmp_idle_timeout=40.0)) == 2.0
    _, _, loop = table(tcp_idle_timeout=0, udp_idle_timeout=8.0, icmp_idle_timeout=40.0)
    assert len(loop.armed()) == 1


def test_sweep_expires_each_flow_by_its_own_rule_and_rearms():
    t, _, loop = table(tcp_idle_timeout=8.0, udp_idle_timeout=7200.0, icmp_idle_timeout=7200.0)
    at = loop.timers[0].when
    idle = [FakeFlow(last_active=at - 8.5, key=i, timeout=8.0) for i in range(2)]
    edge = FakeFlow(last_active=at - 8.0, key=2, timeout=8.0)  # exactly the timeout: not yet
    busy = FakeFlow(last_active=at - 1.0, key=3, timeout=8.0)
    udp = FakeFlow("udp", last_active=at - 100.0, key=4, timeout=None)  # its kind's rule says no
    every = idle + [edge, busy, udp]
    for f in every:
        t.flows[f.key] = f
    loop.fire()
    assert [f.expired_at for f in every] == [[at]] * 5  # every flow asked once, at loop time
    assert t.sweep(at) == 2  # the count of flows that expired
    (timer,) = loop.armed()  # re-armed
    assert timer.when == pytest.approx(at + 2.0)


def test_sweep_recounts_active_flows_from_the_table():
    t, g, loop = table(tcp_idle_timeout=8.0)
    g.opened(FakeFlow("udp"))  # a flow that left the table without closed()
    for i, name in enumerate(("tcp", "tcp", "icmp", "forward")):
        t.flows[i] = FakeFlow(name, last_active=loop.now + 10, key=i)
    loop.fire()
    assert g.active == {"tcp": 2, "udp": 0, "icmp": 1}


def test_sweep_stops_with_the_stack():
    t, _, loop = table(tcp_idle_timeout=8.0)
    t.flows[0] = f = FakeFlow(last_active=0.0, key=0, timeout=8.0)
    t.close()  # Stack.aclose
    assert loop.armed() == []
    assert f.expired_at == []
    t.close()  # idempotent
    t.start(loop)  # start() again arms exactly one timer
    t.start(loop)
    assert len(loop.armed()) == 1


# ============================================================================ parse_limits


def test_parse_limits_values():
    assert parse_limits(None) == {}
    assert parse_limits(["new-flow-rate = 2.5", "max_flows=7"]) == {"new_flow_rate": 2.5, "max_flows": 7}


@pytest.mark.parametrize(("text", "message"), [
    ("max_flows", "expected NAME=VALUE with NAME one of max_flows, "),
    ("bogus=1", "expected NAME=VALUE"),
    ("max_flows=1=2", "'max_flows=1=2': '1=2' is not a whole number"),
    ("new_flow_rate=fast", "'new_flow_rate=fast': 'fast' is not a number"),
])
def test_parse_limits_errors_name_the_option(text, message):
    with pytest.raises(ConfigError, match="^--limit: ") as err:
        parse_limits([text])
    assert message in str(err.value)
    assert err.value.field == "--limit"


# ============================================================================ policy: rules


def test_parse_rules_normalises():
    assert parse_rules(None, "f") == []
    assert parse_rules("192.0.2.7", "f") == ["192.0.2.7/32"]
    assert parse_rules([" 10.1.2.3/16 ", "2001:0db8::1/32", "::1"], "f") == ["10.1.0.0/16", "2001:db8::/32", "::1/128"]


def test_parse_rules_error_names_the_field():
    with pytest.raises(ConfigError) as err:
        parse_rules(["10.0.0.0/8", "bogus"], "egress_allow")
    assert str(err.value).startswith("egress_allow: 'bogus': expected a CIDR network "
                                     "(e.g. 192.0.2.0/24, 2001:db8::/32)")
    for kw, name in (("allow", "egress_allow"), ("deny", "egress_deny"), ("defaults", "egress_deny_builtin")):
        with pytest.raises(ConfigError) as err:
            EgressPolicy(**{kw: ["nope"]})
        assert err.value.field == name


def test_prefix_masks_at_their_edges():
    p = EgressPolicy(deny=["10.0.0.0/8", "192.0.2.128/25", "203.0.113.9/32", "2001:db8::/32", "::5/128"], defaults=())
    for addr, allowed in [("10.0.0.0", False), ("10.255.255.255", False), ("9.255.255.255", True), ("11.0.0.0", True),
                          ("192.0.2.128", False), ("192.0.2.255", False), ("192.0.2.127", True),
                          ("203.0.113.9", False), ("203.0.113.8", True), ("203.0.113.10", True),
                          ("2001:db8:ffff:ffff::1", False), ("2001:db9::", True), ("2001:db7:ffff::", True),
                          ("::5", False), ("::4", True), ("::6", True)]:
        assert p.allows(addr) is allowed, addr
    everything = EgressPolicy(deny=["0.0.0.0/0", "::/0"], defaults=())
    assert not everything.allows("1.2.3.4") and not everything.allows("2001:db8::1")


def test_defaults_cover_link_local_and_aws_metadata():
    p = EgressPolicy()
    assert DEFAULT_DENY == ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")
    for addr, allowed in [("169.254.169.254", False), ("169.255.0.1", True), ("fe80::1", False),
                          ("febf:ffff::1", False), ("fec0::1", True), ("fd00:ec2::254", False), ("fd00:ec2::253", True)]:
        assert p.allows(addr) is allowed, addr


def test_match_reports_the_deciding_rule():
    p = EgressPolicy(allow=["169.254.169.254/32"], deny=["198.51.100.0/24"])
    assert p.match("169.254.169.254") == (True, "169.254.169.254/32", False)
    assert p.match("169.254.1.1") == (False, "169.254.0.0/16", True)
    assert p.match("198.51.100.1") == (False, "198.51.100.0/24", False)
    assert p.match("fe80::1%eth0") == (False, "fe80::/10", True)  # scope ignored
    assert p.match("fe80::1%a%b") == (False, "fe80::/10", True)  # everything after the first %
    assert p.match("8.8.8.8") is None
    assert p.match("169.254.1.1", user_only=True) is None  # the default skipped
    assert p.match("not an address") is None and p.match("1.2.3.999") is None and p.match("fe80::zz") is None


def test_tie_at_one_prefix_length():
    """Longest prefix first; at one length a user rule beats a default and deny beats allow,
    whatever order the rules were given in."""
    assert EgressPolicy(allow=["169.254.0.0/16"]).match("169.254.1.1") == (True, "169.254.0.0/16", False)
    for allow, deny in ((["10.9.0.0/16"], ["10.9.0.0/16"]), (["10.9.0.0/16", "10.8.0.0/16"], ["10.9.0.0/16"])):
        assert EgressPolicy(allow=allow, deny=deny).match("10.9.1.1") == (False, "10.9.0.0/16", False)
    p = EgressPolicy(allow=["10.0.0.0/8", "10.1.1.0/24"], deny=["10.1.0.0/16"], defaults=())
    assert [p.allows(a) for a in ("10.2.0.1", "10.1.2.1", "10.1.1.1")] == [True, False, True]


def test_from_config_and_defaults():
    cfg = NetworkConfig(egress_allow=["192.0.2.0/24"], egress_deny=["0.0.0.0/0"], egress_deny_builtin=[], ipv6=False)
    p = EgressPolicy.from_config(cfg)
    assert p.describe() == ["allow 192.0.2.0/24", "deny 0.0.0.0/0"]
    bare = EgressPolicy.from_config(types.SimpleNamespace())  # an object without the fields: the defaults
    assert bare.describe() == EgressPolicy().describe()
    none = EgressPolicy.from_config(types.SimpleNamespace(egress_allow=None, egress_deny=None, egress_deny_builtin=None))
    assert none.empty and none.describe() == []


def test_describe_in_matching_order():
    p = EgressPolicy(allow=["169.254.169.254/32"], deny=["2001:db8::/32"])
    assert p.describe() == ["allow 169.254.169.254/32", "deny 169.254.0.0/16 (default)", "deny fd00:ec2::254/128 (default)",
                            "deny 2001:db8::/32", "deny fe80::/10 (default)"]


# ============================================================================ policy: verdict cache


def test_user_only_neither_reads_nor_fills_the_cache():
    p = EgressPolicy()
    assert p.allows("169.254.169.254", user_only=True)  # DNS upstream: defaults do not apply
    assert not p.allows("169.254.169.254")  # the first answer was not cached
    assert p.allows("169.254.169.254", user_only=True)  # and the cached False is not used
    assert not p.allows("169.254.169.254")


def test_empty_policy_allows_anything():
    p = EgressPolicy(defaults=())
    assert p.empty
    assert p.allows("169.254.169.254") and p.allows("not an address") and p.allows("10.0.0.1", user_only=True)


def test_verdict_cache_is_bounded():
    p = EgressPolicy()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(40000):
            assert p.allows(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - base < 1_000_000  # at most 4096 verdicts (40000 would be about 4 MB)
    assert not p.allows("169.254.169.254")  # still right after clearing


# ============================================================================ second mutation run (docs/testing.md)


def test_a_first_connect_to_a_destination_does_not_spend_the_sweep():
    """The pending-connect sweep runs only when a bound is reached: admitting the first
    connect to a destination does not run it, so a sweep that is needed soon after still
    happens. (Kills Guard.admit ``_pending_dest.get(dest, 1)``.)"""
    g, _ = guard(max_pending_connects=4, new_flow_rate=0)  # 1 per destination
    assert g.admit(TCP, HOST, 1, now=0.0) is None
    a = FakeFlow(dst_port=1)
    g.opened(a)
    a.transport = object()  # connected, but connected() was not called
    assert g.admit(TCP, HOST, 1, now=PRUNE_INTERVAL / 2) is None  # the first sweep forgets it
    assert g.pending == 0


def test_start_fills_the_rate_limiter_at_the_loop_time_given_and_needs_it():
    """start(now=...): the new-flow rate limiter is full at that loop time; there is no clock of
    its own to fall back on (the data path has one clock, the loop's)."""
    g, _ = guard(start=False, new_flow_rate=5, new_flow_burst=1)
    with pytest.raises(TypeError, match="now"):
        g.start()
    g.start(now=1234.5)
    assert g.bucket.stamp == 1234.5 and g.bucket.tokens == 1.0
