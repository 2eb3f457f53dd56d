"""The fair scheduler's core (:class:`aioslirp.fair.FairLink`), sans-IO: passes are run by hand.

A "guest" here is a share with flows that each read ``chunk`` bytes per turn while they are not
waiting (the way a TCP flow charges its host reads); the test plays the loop: each iteration,
every running flow reads once, then the scheduled pass (if any) runs. No clock: DRR counts
rounds; the per-guest rate caps are :class:`~aioslirp.ratelimit.ByteBucket` on a fake clock.
"""

from __future__ import annotations

import pytest

from aioslirp import NetworkConfig
from aioslirp.errors import ConfigError
from aioslirp.fair import QUANTUM, FairLink
from aioslirp.ratelimit import ByteBucket

Q = 64 * 1024


class Loop:
    """call_soon for the link: the callbacks run at the end of the current iteration."""

    def __init__(self) -> None:
        self.soon: list = []

    def call_soon(self, fn) -> None:
        self.soon.append(fn)

    def run_soon(self) -> None:
        todo, self.soon = self.soon, []
        for fn in todo:
            fn()


class BacklogFlow:
    """A bulk flow: reads ``chunk`` bytes per iteration while not waiting."""

    def __init__(self, share, chunk: int, cap: ByteBucket | None = None) -> None:
        self.share = share
        self.chunk = chunk
        self.waiting = False
        self.moved = 0
        self.cap = cap

    def turn(self) -> None:
        self.waiting = False

    def step(self, now: float = 0.0) -> None:
        if self.waiting:
            return
        n = self.chunk
        if self.cap is not None:  # the guest's rate cap: read only what its bucket holds
            if self.cap.wait(now) > 0:
                return
            self.cap.spend(n, now)
        self.moved += n
        if self.share.charge(n):
            self.waiting = True
            self.share.wait(self.turn)


def run(loop: Loop, flows: list[Flow], iterations: int, dt: float = 0.0) -> None:
    now = 0.0
    for _ in range(iterations):
        for f in flows:
            f.step(now)
        loop.run_soon()
        now += dt


def moved(flows) -> int:
    return sum(f.moved for f in flows)


def test_a_guest_with_four_flows_gets_the_same_share_as_a_guest_with_one():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    a, b = link.join(name="a"), link.join(name="b")
    fa = [BacklogFlow(a, 256 * 1024) for _ in range(4)]
    fb = [BacklogFlow(b, 256 * 1024)]
    run(loop, fa + fb, 2000)
    ratio = moved(fb) / moved(fa)
    assert 0.95 <= ratio <= 1.05, ratio
    assert a.moved == moved(fa) and b.moved == moved(fb)
    # A's flows took turns: each moved about a quarter of A's bytes
    for f in fa:
        assert 0.2 <= f.moved / moved(fa) <= 0.3


def test_weights_divide_the_link_in_proportion():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    heavy, light = link.join(3.0), link.join(1.0)
    fh = [BacklogFlow(heavy, 128 * 1024) for _ in range(2)]
    fl = [BacklogFlow(light, 128 * 1024) for _ in range(2)]
    run(loop, fh + fl, 3000)
    assert 2.85 <= moved(fh) / moved(fl) <= 3.15, moved(fh) / moved(fl)


def test_a_capped_guest_moves_at_its_cap_and_the_others_share_the_rest():
    # one iteration = 1 ms; the capped guest's bucket gives 16 KiB/ms, a quarter of a round's quantum
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    capped, free1, free2 = link.join(), link.join(), link.join()
    cap = ByteBucket(16 * 1024 * 1000.0, burst=16 * 1024)
    fc = [BacklogFlow(capped, 16 * 1024, cap) for _ in range(4)]
    f1 = [BacklogFlow(free1, 256 * 1024) for _ in range(3)]
    f2 = [BacklogFlow(free2, 256 * 1024)]
    run(loop, fc + f1 + f2, 2000, dt=0.001)
    assert 16 * 1024 * 1990 <= moved(fc) <= 16 * 1024 * 2001  # at its cap: under its fair share it never waits
    assert capped.waits == 0
    assert 0.95 <= moved(f1) / moved(f2) <= 1.05  # the two uncapped guests split what is left
    assert moved(f2) > 3.5 * moved(fc)


def test_credit_carries_over_between_rounds():
    # reads of 100 and 40 KiB against a quantum of 64 KiB: the debt of one round is paid by the
    # next ones, the credit left by a round is used in the next (no read is cut to fit)
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    a, b = link.join(), link.join()
    fa, fb = [BacklogFlow(a, 100 * 1024)], [BacklogFlow(b, 40 * 1024) for _ in range(3)]
    run(loop, fa + fb, 3000)
    assert 0.97 <= moved(fa) / moved(fb) <= 1.03, moved(fa) / moved(fb)
    assert a.waits > 100 and b.waits > 100
    assert -100 * 1024 < a.deficit <= Q and -3 * 40 * 1024 < b.deficit <= Q


def test_an_idle_guest_hoards_no_credit():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    busy1, busy2, idle = link.join(), link.join(), link.join()
    run(loop, [BacklogFlow(busy1, 256 * 1024), BacklogFlow(busy2, 256 * 1024)], 1000)
    assert link.round > 1000  # many rounds went by while the idle guest moved nothing
    assert idle.available() == Q  # one quantum, not a thousand
    # back from idle: after one quantum it waits like the others
    assert idle.charge(Q - 1) is False
    assert idle.charge(2) is True


def test_a_new_guest_joining_gets_its_share_from_then_on():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    a = link.join()
    fa = [BacklogFlow(a, 256 * 1024) for _ in range(4)]
    run(loop, fa, 200)
    alone = moved(fa)
    assert alone == 200 * 4 * 256 * 1024  # alone, nothing ever waits
    assert a.waits == 0 and link.passes == 0
    b = link.join()
    assert b.available() == Q  # one quantum to start with, not the rounds before it
    fb = [BacklogFlow(b, 256 * 1024)]
    run(loop, fa + fb, 2000)
    ratio = moved(fb) / (moved(fa) - alone)
    assert 0.95 <= ratio <= 1.05, ratio


def test_a_light_guest_never_waits_beside_a_flood():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    flood, light = link.join(), link.join()
    fl = [BacklogFlow(flood, 256 * 1024) for _ in range(8)]
    small = BacklogFlow(light, 200)  # a request/response guest: 200 bytes an iteration
    run(loop, fl + [small], 2000)
    assert light.waits == 0 and small.moved == 2000 * 200
    assert flood.waits > 0


def test_a_guest_that_leaves_stops_waiting_and_the_rest_go_on():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    a, b = link.join(), link.join()
    fa, fb = [BacklogFlow(a, 256 * 1024) for _ in range(2)], [BacklogFlow(b, 256 * 1024)]
    run(loop, fa + fb, 50)
    assert link.shares == 2
    dropped = a.leave()
    assert a.leave() == []  # idempotent
    assert link.shares == 1
    assert len(dropped) == sum(f.waiting for f in fa)
    before = moved(fb)
    run(loop, fb, 100)  # alone now: reads every iteration
    assert moved(fb) - before == 100 * 256 * 1024


def test_a_failing_resume_callback_costs_the_others_nothing(caplog):
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    a, b = link.join(name="a"), link.join(name="b")
    a.charge(1)
    assert b.charge(2 * Q) is True
    b.wait(lambda: 1 / 0)
    fb = BacklogFlow(b, 1)
    b.wait(fb.turn)
    fb.waiting = True
    for _ in range(4):
        loop.run_soon()
    assert fb.waiting is False
    assert "resume callback failed (share b)" in caplog.text


def test_bad_weights_and_quanta_are_refused():
    link = FairLink(lambda fn: None)
    assert link.quantum == QUANTUM
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            link.join(bad)
    with pytest.raises(ValueError):
        FairLink(lambda fn: None, 0)


@pytest.mark.parametrize("bad", [0, -2, "x", float("inf"), True])
def test_fair_weight_errors_name_the_field(bad):
    with pytest.raises(ConfigError) as ei:
        NetworkConfig(fair_weight=bad).validate()
    assert str(ei.value).startswith("fair_weight: ") and "\n" not in str(ei.value)


def test_fair_weight_default_and_off():
    assert NetworkConfig().validate().fair_weight == 1.0
    assert NetworkConfig(fair_weight="2.5").validate().fair_weight == 2.5
    assert NetworkConfig(fair_weight=None).validate().fair_weight is None


def test_one_scheduler_per_loop_with_both_directions():
    import asyncio

    from aioslirp.fair import QUANTUM_DOWN, Scheduler

    loop, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        sched = Scheduler.for_loop(loop)
        assert Scheduler.for_loop(loop) is sched and Scheduler.for_loop(other) is not sched
        up, down = sched.join(2.0, "g")
        assert (up.link, down.link) == (sched.up, sched.down)
        assert up.quantum == 2 * QUANTUM and down.quantum == 2 * QUANTUM_DOWN
        assert up.name == down.name == "g" and sched.up.shares == sched.down.shares == 1
        # a pass goes through the loop: a second guest over its share waits for it
        other_up, _ = sched.join()
        up.charge(1)
        assert other_up.charge(3 * QUANTUM) is True
        turns = []
        other_up.wait(lambda: turns.append("turn"))
        loop.run_until_complete(asyncio.sleep(0))
        assert turns == ["turn"] and sched.up.passes == 1
    finally:
        loop.close()
        other.close()


# ------------------------------------------------------------------ the express lane (sparse guests first)
# The rule (Share.sparse) counts passes, the link's own clock: driven by hand as above. The lane
# polls real fds (socket pairs) but runs no loop: each test calls its safe point, serve(), itself.

from aioslirp.fair import SPARSE_PASSES, SparseLane  # noqa: E402


def backlog(loop: Loop, link: FairLink):
    """Two guests over their share on ``link``: both have a flow waiting for its turn."""
    a, b = link.join(name="a"), link.join(name="b")
    fa, fb = BacklogFlow(a, 4 * Q), BacklogFlow(b, 4 * Q)
    a.charge(1)  # both moved bytes this round: contention
    b.charge(1)
    fa.step()
    fb.step()
    assert fa.waiting and fb.waiting and link.contended()
    return (a, fa), (b, fb)


def test_a_guest_is_sparse_until_it_waits_and_again_sparse_passes_after_its_last_wait():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    (flood, ff), (other, fo) = backlog(loop, link)
    third = link.join(name="third")
    ft = BacklogFlow(third, 4 * Q)
    light = link.join(name="light")
    assert light.sparse and not flood.sparse and not other.sparse
    small = BacklogFlow(light, 200)
    run(loop, [ff, fo, ft, small], 500)  # the light guest never waits: it stays sparse throughout
    assert light.sparse and light.waits == 0 and link.passes > 100
    assert not third.sparse
    # the flood stops: its waiting flow is served once more, then reads nothing; it is not
    # sparse before SPARSE_PASSES passes of the link have gone by since its last wait
    for _ in range(1000):
        if not ff.waiting:
            break
        run(loop, [fo, ft], 1)
    assert not ff.waiting and not flood.queued
    last = flood.last_wait
    for _ in range(1000):
        if link.passes - last > SPARSE_PASSES:
            break
        assert not flood.sparse
        run(loop, [fo, ft], 1)
    assert flood.sparse
    assert not other.sparse and not third.sparse  # still flooding


def test_a_new_guest_is_sparse_until_it_first_overdraws_its_quantum():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    (a, fa), _ = backlog(loop, link)
    new = link.join(name="new")
    assert new.sparse
    assert new.charge(Q // 2) is False and new.sparse  # under its quantum: still sparse
    assert new.charge(Q) is True
    new.wait(lambda: None)
    assert not new.sparse and new.queued


def test_the_safe_point_runs_when_a_flow_begins_to_wait_and_at_each_pass_with_guests_waiting():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    calls = []
    link.safe_point = lambda: calls.append((link.passes, link.contended()))
    a, b = link.join(), link.join()
    a.charge(1)
    assert b.charge(Q // 2) is False and calls == []  # a charge under the share: no safe point
    fb = BacklogFlow(b, 2 * Q)
    fb.step()
    assert fb.waiting and calls == [(0, True)]  # the flow began to wait: a safe point, at once
    loop.run_soon()  # the pass: a safe point before it resumes the flow
    assert calls == [(0, True), (1, True)] and not fb.waiting
    loop.run_soon()  # nothing scheduled, nobody waits: no pass, no safe point
    assert len(calls) == 2


def test_a_backlogged_guests_flow_offers_a_safe_point_before_its_work_a_sparse_ones_does_not():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    calls = []
    (flood, _), _ = backlog(loop, link)
    light = link.join()
    link.safe_point = lambda: calls.append("sp")
    light.safe_point()
    assert calls == []  # sparse: goes on at once
    flood.safe_point()
    assert calls == ["sp"]
    while link.contended():
        loop.run_soon()
    calls.clear()
    flood.safe_point()  # no guest waits any more: nothing to let in
    assert calls == []


class Fds:
    """Socket pairs standing for guests' input fds: ``ready(i)`` makes fd ``i`` readable; each
    callback drains its fd (as a transport's reader does) and is recorded."""

    def __init__(self, n: int) -> None:
        import socket

        self.pairs = [socket.socketpair() for _ in range(n)]
        for r, _ in self.pairs:
            r.setblocking(False)
        self.ran: list[int] = []

    def fd(self, i: int) -> int:
        return self.pairs[i][0].fileno()

    def ready(self, i: int) -> None:
        self.pairs[i][1].send(b"x")

    def callback(self, i: int):
        def read() -> None:
            self.ran.append(i)
            try:
                self.pairs[i][0].recv(4096)
            except BlockingIOError:  # a spurious call: nothing to do
                pass
        return read

    def close(self) -> None:
        for r, w in self.pairs:
            r.close()
            w.close()


def test_the_lane_runs_only_the_sparse_guests_ready_input_and_only_under_contention():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    lane = SparseLane(link)
    fds = Fds(3)
    try:
        (flood, ff), (other, fo) = backlog(loop, link)
        light = link.join(name="light")
        counters: dict = {}
        seats = [lane.seat((s,), counters) for s in (flood, other, light)]
        for i, seat in enumerate(seats):
            seat.watch(fds.fd(i), fds.callback(i))
        assert lane.watched == 3
        for i in range(3):
            fds.ready(i)
        assert lane.serve() == 1 and fds.ran == [2]  # the light guest's input, not the floods'
        assert counters == {"fair_express": 1} and lane.served == 1
        assert lane.serve() == 0 and fds.ran == [2]  # drained: nothing ready for it any more
        # contention over (both floods served, nobody waits): the lane does not poll at all
        while link.contended():
            loop.run_soon()
        fds.ready(2)
        assert lane.serve() == 0 and fds.ran == [2]
        # a guest sparse on one link but waiting on the other is not served
        link2 = FairLink(loop.call_soon, Q)
        lane2 = SparseLane(link, link2)
        (busy2, _), _ = backlog(loop, link2)
        lane2.seat((light, busy2), {}).watch(fds.fd(2), fds.callback(2))
        assert lane2.serve() == 0 and fds.ran == [2]
        lane2.seat((light, link2.join()), {}).watch(fds.fd(2), fds.callback(2))  # (replaces the entry)
        assert lane2.serve() == 1 and fds.ran == [2, 2]
    finally:
        fds.close()


def test_the_lane_does_not_reenter_isolates_failures_and_keeps_the_watchers_context():
    import contextvars

    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    lane = SparseLane(link)
    fds = Fds(3)
    var = contextvars.ContextVar("var", default="none")
    try:
        backlog(loop, link)
        light = link.join()
        seat = lane.seat((light,), {})
        nested = []
        seat.watch(fds.fd(0), lambda: (fds.callback(0)(), nested.append(lane.serve())))
        seat.watch(fds.fd(1), lambda: 1 / 0)
        token = var.set("watcher")
        seen = []
        seat.watch(fds.fd(2), lambda: (fds.callback(2)(), seen.append(var.get())))
        var.reset(token)
        for i in range(3):
            fds.ready(i)
        assert lane.serve() == 3
        assert nested == [0]  # a safe point reached inside the lane does not poll again
        assert seen == ["watcher"] and var.get() == "none"
        assert sorted(fds.ran) == [0, 2]  # the failing callback cost the others nothing
    finally:
        fds.close()


def test_a_seat_watches_its_transport_stops_before_it_closes_and_leaves_with_its_shares():
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    lane = SparseLane(link)
    fds = Fds(3)
    try:
        backlog(loop, link)
        light = link.join()
        seat = lane.seat((light,), {})
        seat.watch(fds.fd(0), fds.callback(0))  # its host sockets' epoll

        class FakeTransport:
            def __init__(self, i):
                self.i = i

            def guest_reader(self):
                return fds.fd(self.i), fds.callback(self.i)

        seat.guest(FakeTransport(1))
        assert lane.watched == 2
        seat.guest(FakeTransport(2))  # a new transport replaces the old one's fd
        assert lane.watched == 2
        fds.ready(1)
        fds.ready(2)
        assert lane.serve() == 1 and fds.ran == [2]
        seat.guest(None)  # the transport closes
        seat.guest(object())  # one without guest_reader(): nothing to watch
        assert lane.watched == 1

        class Closed:
            def guest_reader(self):
                return 10 ** 6, fds.callback(0)  # (no such fd: EBADF)

        seat.guest(Closed())  # a transport whose fd is closed already: nothing watched, no error
        assert lane.watched == 1
        shares = link.shares
        seat.leave()
        seat.leave()  # idempotent
        assert lane.watched == 0 and link.shares == shares - 1 and light.left
        fds.ready(0)
        assert lane.serve() == 0
    finally:
        fds.close()


def test_a_seat_watches_the_guests_native_engine_beside_its_transport_and_stops_with_it():
    """``Seat.guest(transport, *readers)``: the native TCP engine's epoll (a reader of the guest's
    input beside its transport) is served early too, replaced by the next call, stopped by ``None``."""
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    lane = SparseLane(link)
    fds = Fds(4)
    try:
        backlog(loop, link)
        seat = lane.seat((link.join(),), {})

        class FakeTransport:
            def guest_reader(self):
                return fds.fd(0), fds.callback(0)

        seat.guest(FakeTransport(), (fds.fd(1), fds.callback(1)), None)  # (None: a transport without an engine)
        assert lane.watched == 2
        fds.ready(1)
        assert lane.serve() == 1 and fds.ran == [1]  # the engine's socket events, early
        seat.guest(FakeTransport(), (fds.fd(2), fds.callback(2)))  # served again: a new engine
        fds.ready(1)
        fds.ready(2)
        assert lane.serve() == 1 and fds.ran == [1, 2] and lane.watched == 2
        seat.guest(None)  # the transport and the engine close
        fds.ready(0)
        fds.ready(2)
        assert lane.watched == 0 and lane.serve() == 0
    finally:
        fds.close()


def test_a_seat_hooks_a_safe_point_after_each_batch_of_its_transport_and_unhooks_it():
    """``Seat.guest(transport)`` gives a transport with ``after_batch`` (the native TAP reader) the
    seat's :meth:`Seat.after_batch`: after each batch of a guest busy on a contended link, a safe
    point of that link; of a sparse guest, or with no contention, nothing. ``guest(None)``, a new
    transport and ``leave()`` take the hook back."""
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    points: list[int] = []
    link.safe_point = lambda: points.append(1)
    lane = SparseLane(link)

    class Batched:
        def __init__(self) -> None:
            self.hooks: list = []

        def after_batch(self, hook) -> None:
            self.hooks.append(hook)

    busy = link.join(name="busy")
    seat = lane.seat((busy,), {})
    first, second = Batched(), Batched()
    seat.guest(first)
    assert first.hooks == [seat.after_batch]
    seat.after_batch()  # no contention yet: nothing
    assert points == []
    (a, fa), _ = backlog(loop, link)
    busy.charge(1)
    BacklogFlow(busy, 4 * Q).step()  # the seat's guest waits too: busy on a contended link
    assert link.contended() and not busy.sparse
    before = len(points)  # (each wait was a safe point too)
    seat.after_batch()
    assert len(points) == before + 1
    light = link.join(name="light")
    light_seat = lane.seat((light,), {})
    assert light.sparse
    light_seat.after_batch()  # a sparse guest's batch is no safe point
    assert len(points) == before + 1
    seat.guest(second)  # a new transport: the old one's hook taken back
    assert first.hooks == [seat.after_batch, None] and second.hooks == [seat.after_batch]
    seat.guest(None)
    assert second.hooks == [seat.after_batch, None]
    seat.guest(second)
    seat.leave()
    assert second.hooks[-1] is None


def test_a_stale_unwatch_leaves_the_entry_of_the_guest_that_took_the_fd_number_since():
    # guest A's transport closed its fd on EOF; guest B's new transport got the same number and
    # is watched; A's stack then stops watching "its" fd: B's entry stays
    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    lane = SparseLane(link)
    fds = Fds(1)
    try:
        backlog(loop, link)
        a, b = lane.seat((link.join(),), {}), lane.seat((link.join(),), {})
        a.watch(fds.fd(0), fds.callback(0))
        b.watch(fds.fd(0), fds.callback(0))  # (the same number, now B's)
        a.unwatch(fds.fd(0))
        assert lane.watched == 1
        fds.ready(0)
        assert lane.serve() == 1
        b.unwatch(fds.fd(0))
        assert lane.watched == 0
    finally:
        fds.close()


def test_the_scheduler_wires_both_links_to_its_lane():
    import asyncio

    from aioslirp.fair import Scheduler

    loop = asyncio.new_event_loop()
    fds = Fds(1)
    try:
        sched = Scheduler.for_loop(loop)
        assert sched.up.safe_point == sched.lane.serve and sched.down.safe_point == sched.lane.serve

        class Queue:
            before_write = None

        q, counters = Queue(), {}
        up, down, seat = sched.enrol(1.0, "g", counters, q, (fds.fd(0), fds.callback(0)))
        assert q.before_write == sched.lane.serve and seat.shares == (up, down) and sched.lane.watched == 1
        seat.leave()
        assert sched.lane.watched == 0 and sched.up.shares == sched.down.shares == 0
    finally:
        fds.close()
        loop.close()


class FakeYield:
    """``set_yield`` of the native plane: records arming (fd, serve, interval) and disarming."""

    def __init__(self, accept: bool = True) -> None:
        self.calls: list = []
        self.armed = None
        self.accept = accept

    def __call__(self, fd: int, serve, every_us: float = 0.0) -> bool:
        self.calls.append("arm" if fd >= 0 else "disarm")
        if fd < 0:
            ok = self.armed is not None and self.armed[1] is serve
            self.armed = None if ok else self.armed
            return ok
        if not self.accept:
            return False
        self.armed = (fd, serve, every_us)
        return True


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def test_a_busy_guests_fds_are_dimmed_in_the_lane_and_lit_once_it_is_sparse_again():
    """The lane's epoll (what the native yield point polls) is readable only when a sparse guest's
    input waits: a guest that begins to wait has its seat dimmed, and it is lit at the first pass
    that finds it sparse again (no flow waiting for SPARSE_PASSES passes); fds a dimmed seat starts
    to watch are dimmed too, and a seat that leaves is lit (forgotten)."""
    from aioslirp.fair import YIELD_EVERY_US

    loop = Loop()
    link = FairLink(loop.call_soon, Q)
    lane = SparseLane(link)
    link.watcher = lane
    fy = FakeYield()
    lane.use_yield(fy)
    fds = Fds(4)
    try:
        a, b, light = link.join(name="a"), link.join(name="b"), link.join(name="light")
        seats = [lane.seat((s,), {}) for s in (a, b, light)]
        for i, seat in enumerate(seats):
            seat.watch(fds.fd(i), fds.callback(i))
        fa, fb = BacklogFlow(a, 4 * Q), BacklogFlow(b, 4 * Q)
        a.charge(1)
        b.charge(1)
        fa.step()
        fb.step()
        assert link.contended() and [s.dimmed for s in seats] == [True, True, False]
        assert lane.armed and fy.armed[1] == lane.serve and fy.armed[2] == YIELD_EVERY_US
        ep = fy.armed[0]
        fds.ready(0)
        fds.ready(1)
        assert not _readable(ep)  # the busy guests' input does not wake the yield point
        fds.ready(2)
        assert _readable(ep)
        assert lane.serve() == 1 and fds.ran == [2] and not _readable(ep)
        seats[0].watch(fds.fd(3), fds.callback(3))  # a dimmed seat's new fd: dimmed too
        fds.ready(3)
        assert not _readable(ep)
        # b stops (its flow has nothing more to send); a floods on beside c: b is lit once sparse again
        c = link.join(name="c")
        fc = BacklogFlow(c, 4 * Q)
        fb.step = lambda now=0.0: None
        for i in range(4 * SPARSE_PASSES):
            fa.step()
            fc.step()
            loop.run_soon()
            if not seats[1].dimmed:
                break
        assert b.sparse and not seats[1].dimmed and seats[0].dimmed and link.contended()
        assert link.passes > SPARSE_PASSES
        assert _readable(ep)  # b's fd is still readable: lit, it wakes the lane again
        seats[0].leave()
        assert not seats[0].dimmed
    finally:
        fds.close()


def test_the_yield_point_is_armed_while_a_link_is_contended():
    loop, loop_down = Loop(), Loop()  # (a loop each: the up link drains first)
    up, down = FairLink(loop.call_soon, Q), FairLink(loop_down.call_soon, Q)
    lane = SparseLane(up, down)
    up.watcher = down.watcher = lane
    fds = Fds(1)
    try:
        fy = FakeYield()
        lane.use_yield(fy)
        light = lane.seat((up.join(), down.join()), {})
        light.watch(fds.fd(0), fds.callback(0))
        assert not lane.armed and fy.calls == []
        (a, fa), (b, fb) = backlog(loop, up)
        assert lane.armed and fy.calls == ["arm"]
        backlog(loop_down, down)
        assert fy.calls == ["arm"]  # armed once
        for _ in range(10):  # the up link drains; down still waits: still armed
            loop.run_soon()
        assert not up.contended() and lane.armed and down.contended()
        for _ in range(10):
            loop_down.run_soon()
        assert not down.contended()
        assert not lane.armed and fy.calls == ["arm", "disarm"] and fy.armed is None
        # a lane another (thread's) lane holds the yield point for is not armed; use_yield(None) disarms
        lane2 = SparseLane(up)
        up.watcher = lane2
        lane2.seat((up.join(),), {}).watch(fds.fd(0), fds.callback(0))
        lane2.use_yield(FakeYield(accept=False))
        backlog(loop, up)
        assert not lane2.armed
        up.watcher = lane
        lane.began_waiting(a)
        assert lane.armed
        lane.use_yield(None)
        assert not lane.armed and fy.armed is None and not lane.yields
    finally:
        fds.close()


def test_the_scheduler_gives_its_lane_the_yield_point_once():
    import asyncio

    from aioslirp.fair import Scheduler

    loop = asyncio.new_event_loop()
    fds = Fds(2)
    try:
        sched = Scheduler.for_loop(loop)
        assert sched.up.watcher is sched.lane and sched.down.watcher is sched.lane

        class Queue:
            before_write = None

        fy, other = FakeYield(), FakeYield()
        _, _, s1 = sched.enrol(1.0, "g1", {}, Queue(), (fds.fd(0), fds.callback(0)), yield_point=fy)
        _, _, s2 = sched.enrol(1.0, "g2", {}, Queue(), (fds.fd(1), fds.callback(1)), yield_point=other)
        assert sched.lane.yields
        (a, _), _ = backlog(Loop(), sched.up)
        assert fy.calls == ["arm"] and other.calls == []  # the first stack's set_yield, kept
        s1.leave()
        s2.leave()
    finally:
        fds.close()
        loop.close()
