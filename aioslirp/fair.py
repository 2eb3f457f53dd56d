"""Per-guest fairness of one event loop: deficit round robin over the guests (stacks) sharing it.

Theory of operation
-------------------
Many :class:`~aioslirp.stack.Stack` objects may share one asyncio loop. Without a scheduler,
each host socket or transport read callback gets one turn per loop iteration, so a guest with
4 bulk flows gets 4 turns for a neighbour's 1 (measured: a neighbour's single download fell
from ~9.3 to ~1.5 Gbit/s). The :class:`Scheduler` of a loop (one per loop,
:meth:`Scheduler.for_loop`) gives each guest a :class:`Share` of each host link direction:
:attr:`Scheduler.down` (host -> guest: bytes read from the guest's host sockets) and
:attr:`Scheduler.up` (guest -> host: bytes written to them). Each direction is a
:class:`FairLink`, deficit round robin (DRR, Shreedhar and Varghese 1995) over the shares,
charged after the fact:

* A share has a *deficit* (bytes it may still move) and a *quantum*: :data:`QUANTUM` (up) or
  :data:`QUANTUM_DOWN` (down) times its weight (``NetworkConfig.fair_weight``). Every byte the
  guest moves is :meth:`charged <Share.charge>` to it. While the deficit stays above zero the
  guest's flows go on as before (nothing else happens on the hot path: one subtraction).
* A charge that leaves the deficit at or below zero, while another guest has moved bytes in the
  same round (contention), answers True: the flow that read or wrote pauses and waits
  (:meth:`Share.wait`, a callback). A guest alone on the loop is credited at once and never
  waits, so a single stack runs as without a scheduler.
* One *pass* per loop iteration (``loop.call_soon``, only while some flow waits) serves the
  waiting guests: when none of them has credit left it advances the round counter by the
  fewest rounds that give one of them credit again (no empty loop iterations); each share gets
  ``quantum`` per round. The first waiting guest with credit then resumes *one* of its waiting
  flows (round robin among the guest's flows, in the order they began to wait) and goes to the
  end of the line, so that the guests take turns, a guest's flows take turns, and a loop
  iteration holds about one bulk read whatever the number of guests: the latency a flood adds
  to a light guest's request is about one read's work, not one read per flooding flow.
* Credit is given lazily, by round: a share catches up ``(round - seen) * quantum`` when next
  charged or served, capped at one quantum, so an idle guest hoards no credit, and a guest that
  joins late starts with one quantum like the others.

The express lane (sparse guests first)
--------------------------------------
The rounds decide who moves bytes, but not *when* a guest's work runs: a light guest's
request (its TAP fd readable, then its host socket's reply) waits for the loop to reach its
callback, behind the backlogged guests' work already running or due in the same iteration
(a bulk turn: one host read of up to 256 KiB, its frames, the writer's TAP write, the guest's
ACKs: about 200 us of this machine's CPU, not preemptible). So, as fq_codel serves a new
(sparse) flow before the old ones (RFC 8290 4.1), the loop's :class:`SparseLane` serves the
*sparse* guests' input ahead of that work: it watches each guest's input fds (its transport's,
its host sockets' epoll and its native TCP engine's: :meth:`Scheduler.enrol`, :meth:`Seat.guest`)
in an epoll of its own, and at the
*safe points* of a bulk turn (a flow made to wait, :meth:`FairLink.wait`; the start of each
pass; the stacks' writer before each batch, ``InjectQueue.before_write``; a backlogged guest's
flow before it builds frames, :meth:`Share.safe_point`) it polls that epoll
(no wait) and runs the ready callbacks of the guests that are sparse: a guest is sparse
(:attr:`Share.sparse`) while none of its flows waits for its turn in either direction and none
was made to wait in the last :data:`SPARSE_PASSES` passes. A backlogged guest is never served
early, a guest that starts to flood is sparse until it first overdraws its quantum (then it
waits like the others), and the lane only runs while some guest waits (no contention: no poll,
a test per link). What the lane runs is what the loop would have run a little later (the
same callback, in the context it was registered in); the bytes it moves are charged as usual.
Measured: the light guest's loaded request latency about halved, throughput unchanged
(docs/performance.md, "Per-guest fairness").

The yield point (native data plane)
-----------------------------------
A busy guest's turn on the native plane is one C call (a TAP batch, an engine poll), which a safe
point before or after it cannot split (measured: a lane poll every 57 us during an upload flood).
So while some guest waits on a link, the native plane gets a *yield point*
(:meth:`SparseLane.use_yield`): between two frames of a TAP batch and two socket events of an
engine's poll, at most every :data:`YIELD_EVERY_US`, C polls the lane's epoll and, when it is
readable, calls :meth:`SparseLane.serve`; a busy guest is *dimmed* in that epoll
(:meth:`SparseLane.dim`, by the :class:`LinkWatcher` calls) so that only a sparse guest's input
makes it readable. The interrupted plane and engine are not entered again meanwhile, and one
``sendmsg`` gathers at most 64 KiB. Without contention: one compare per frame.

So over any stretch of rounds every backlogged guest moves ``quantum * weight`` bytes a round,
within one read per flow (a flow reads at most :data:`~aioslirp.nat.hostsock.READ_SIZE`), whatever
its number of flows; a guest that moves little (request/response) always has credit and never
waits. The per-guest rate caps (``rate_up`` / ``rate_down``, :class:`~aioslirp.ratelimit.ByteBucket`)
apply on top: a capped guest moves less, the others share the rest (DRR is work-conserving).

Bounded state: a share holds at most one waiting callback per flow and direction (each flow
keeps a flag of its own: ``share_paused`` / ``share_held`` of :class:`~aioslirp.nat.tcp.TcpFlow`,
so the number of the guest's flows is the bound), a link lists each waiting share once, and a
closed stack's shares leave their links with their callbacks (:meth:`Share.leave`).

Sans-IO: :class:`FairLink` reads no clock and schedules its pass through the ``schedule``
callable it is given (``loop.call_soon`` in :class:`Scheduler`), so tests drive it by hand.
Not thread-safe: everything on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import select
import weakref
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["FairLink", "LinkWatcher", "QUANTUM", "QUANTUM_DOWN", "SPARSE_PASSES", "Scheduler", "Seat", "Share",
           "SparseLane", "YIELD_EVERY_US"]

log = logging.getLogger("aioslirp.fair")

#: Bytes a share of weight 1 may move per round (a round: every backlogged guest served once),
#: guest -> host (:attr:`Scheduler.up`): a flow's writes stop once its guest is over its share,
#: so this is about the most one turn writes (a smaller one measured lower latency for a light
#: guest and lower throughput: docs/performance.md).
QUANTUM = 256 * 1024
#: The same, host -> guest (:attr:`Scheduler.down`). A turn there is one host read (up to 256 KiB,
#: ``READ_SIZE`` of :mod:`aioslirp.nat.hostsock` and uvloop's read size) charged after the fact,
#: whatever the quantum; a smaller quantum makes finer rounds, which measured better both ways
#: than 256 KiB (docs/performance.md, "Per-guest fairness").
QUANTUM_DOWN = 64 * 1024
#: Passes of its link after a guest's last wait before it counts as sparse again
#: (:attr:`Share.sparse`): a backlogged guest waits every few passes, a light one never.
SPARSE_PASSES = 8
#: Most ready fds the :class:`SparseLane` takes from its epoll per poll.
LANE_MAX_EVENTS = 64
#: The least time between two polls of the express lane at the native plane's yield point
#: (microseconds; :meth:`SparseLane.use_yield`): the longest a light guest's input waits there
#: behind a busy guest's frame or socket event, for one ``poll()`` of about 1 us each time.
YIELD_EVERY_US = 20.0


class BatchWriter(Protocol):
    """What :meth:`Scheduler.enrol` sets on a stack's writer (``aioslirp.inject.InjectQueue``, on
    the same floor as this module: it names only what it uses)."""

    before_write: Callable[[], object] | None


class LinkWatcher(Protocol):
    """What a :class:`FairLink` tells its :attr:`~FairLink.watcher` (the :class:`SparseLane`)."""

    def began_waiting(self, share: Share) -> None:
        """``share``'s guest has a flow waiting for its turn now (it was not queued before)."""

    def passed(self) -> None:
        """A pass of the link begins (some guest waits)."""

    def drained(self) -> None:
        """No guest waits on the link any more."""


class Share:
    """One guest's share of one :class:`FairLink` (made by :meth:`FairLink.join`).

    Attributes:
        weight: the guest's weight (> 0); its quantum is ``link.quantum * weight`` bytes a round.
        deficit: bytes the guest may still move before it waits (<= 0: in debt), as of round
            :attr:`seen`.
        moved: bytes charged in all (a counter).
        waits: times one of its flows was made to wait (a counter).
        last_wait: the link's :attr:`~FairLink.passes` when a flow of it last began to wait.
        name: a label for log lines and the benchmark (the stack's name).
    """

    __slots__ = ("link", "weight", "quantum", "deficit", "seen", "mark", "waiters", "queued", "moved", "waits",
                 "name", "left", "last_wait", "seat")

    link: FairLink
    weight: float
    quantum: float
    deficit: float
    seen: int
    #: The last round in which the guest moved bytes (counted in the link's ``active``).
    mark: int
    #: Callbacks of the flows waiting for credit, served in this order.
    waiters: deque[Callable[[], None]]
    #: In the link's list of waiting shares.
    queued: bool
    moved: int
    waits: int
    name: str
    #: :meth:`leave` ran: charges are counted but never wait.
    left: bool
    last_wait: int
    #: The guest's :class:`Seat` in the loop's express lane (:meth:`SparseLane.seat`), or None.
    seat: Seat | None

    def __init__(self, link: FairLink, weight: float, name: str = "") -> None:
        self.link = link
        self.weight = weight
        self.quantum = link.quantum * weight
        self.deficit = self.quantum
        self.seen = link.round
        self.mark = -1
        self.waiters = deque()
        self.queued = False
        self.moved = 0
        self.waits = 0
        self.name = name
        self.left = False
        self.last_wait = -SPARSE_PASSES - 1  # never waited: sparse
        self.seat = None

    def charge(self, n: int) -> bool:
        """``n`` bytes moved for this guest (or about to be). True: the guest is over its share
        for now; the caller stops moving bytes and calls :meth:`wait`."""
        link = self.link
        r = link.round
        if self.seen != r:
            link.catch_up(self)
        if self.mark != r:
            self.mark = r
            link.active += 1
        d = self.deficit - n
        self.deficit = d
        self.moved += n
        if d > 0:  # the hot path: one subtraction, no call
            return False
        return link.overdrawn(self)

    @property
    def sparse(self) -> bool:
        """The guest is light on this link: no flow of it waits for its turn, and none began to
        wait in the last :data:`SPARSE_PASSES` passes (fq_codel's new flows, RFC 8290 4.1). The
        :class:`SparseLane` serves only guests sparse on both links."""
        return not self.queued and self.link.passes - self.last_wait > SPARSE_PASSES

    def safe_point(self) -> bool:
        """A flow of this guest is about to do a chunk of work (``TcpFlow.flush``: the frames
        its host bytes make): while the link is contended and this guest is not sparse, a safe
        point of the link (:attr:`FairLink.safe_point`), where the sparse guests' input runs
        first, and True. Nothing else (a sparse guest, no contention: two tests), and False."""
        link = self.link
        if link.contended() and not self.sparse:
            sp = link.safe_point
            if sp is not None:
                sp()
            return True
        return False

    def available(self) -> float:
        """Bytes the guest may move now before it is over its share (<= 0: none)."""
        return self.link.catch_up(self)

    def wait(self, resume: Callable[[], None]) -> None:
        """Call ``resume()`` (no arguments, on the loop) once the guest has credit again and it
        is this callback's turn among the guest's waiting flows. Each callback is called once;
        a caller keeps one registered at a time (a flag of its own)."""
        self.link.wait(self, resume)

    def leave(self) -> list[Callable[[], None]]:
        """The guest is gone (its stack closed): stop taking part. Returns the callbacks that
        were waiting (not called). Idempotent."""
        return self.link.leave(self)


class FairLink:
    """Deficit round robin over the :class:`Share` of each guest, for one direction of the host
    link (see the module documentation).

    Args:
        quantum: bytes a round for weight 1 (default :data:`QUANTUM`), > 0.
        schedule: ``schedule(fn)`` runs ``fn()`` soon, once (``loop.call_soon``); called once per
            needed pass.
    """

    __slots__ = ("quantum", "round", "_schedule", "_waiting", "_pending", "active", "_active_before", "shares",
                 "passes", "safe_point", "watcher")

    quantum: float
    #: Rounds elapsed (each gave every share one quantum).
    round: int
    _schedule: Callable[[Callable[[], None]], object]
    #: Shares with waiting flows, in the order they began to wait.
    _waiting: list[Share]
    #: A pass is scheduled.
    _pending: bool
    #: Shares charged since :attr:`round` last moved (:meth:`Share.charge` counts itself).
    active: int
    #: Shares charged between the two moves of :attr:`round` before.
    _active_before: int
    #: How many shares are joined.
    shares: int
    #: Passes run (a counter).
    passes: int
    #: Called (no arguments) at each safe point of a bulk turn: after a flow began to wait
    #: (:meth:`wait`) and at the start of a pass with guests waiting; ``None``: nothing.
    #: :class:`Scheduler` sets its :meth:`SparseLane.serve` here.
    safe_point: Callable[[], object] | None
    #: Told when a guest begins to wait, at each pass and when no guest waits any more
    #: (:class:`LinkWatcher`); :class:`Scheduler` sets its :class:`SparseLane` here.
    watcher: LinkWatcher | None

    def __init__(self, schedule: Callable[[Callable[[], None]], object], quantum: float = QUANTUM) -> None:
        if not quantum > 0:
            raise ValueError(f"quantum: {quantum!r} must be > 0")
        self.quantum = float(quantum)
        self.round = 0
        self._schedule = schedule
        self._waiting = []
        self._pending = False
        self.active = 0
        self._active_before = 0
        self.shares = 0
        self.passes = 0
        self.safe_point = None
        self.watcher = None

    def join(self, weight: float = 1.0, name: str = "") -> Share:
        """A new guest's share (``weight`` > 0); it starts with one quantum of credit."""
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"weight: {weight!r} must be a positive number")
        self.shares += 1
        return Share(self, float(weight), name)

    def leave(self, share: Share) -> list[Callable[[], None]]:
        """See :meth:`Share.leave`."""
        if share.left:
            return []
        share.left = True
        self.shares -= 1
        if share.queued:
            share.queued = False
            self._waiting.remove(share)
            if not self._waiting and self.watcher is not None:
                self.watcher.drained()
        left = list(share.waiters)
        share.waiters.clear()
        return left

    def catch_up(self, share: Share) -> float:
        """``share``'s deficit as of the current round (credit of the rounds it missed, at most
        one quantum in all); returns it."""
        seen = share.seen
        d = share.deficit
        if seen != self.round:
            d += (self.round - seen) * share.quantum
            if d > share.quantum:
                d = share.quantum
            share.deficit = d
            share.seen = self.round
        return d

    def overdrawn(self, share: Share) -> bool:
        """``share`` was charged to zero or below (:meth:`Share.charge`): True when it must wait
        its turn; else (no contention) it is credited at once and False."""
        if share.left:
            return False
        if self.alone():  # no contention: credit now (a guest alone on the loop never waits)
            self._advance(self._rounds_for(share))
            self.catch_up(share)
            share.mark = self.round
            self.active = 1
            return False
        return True

    def wait(self, share: Share, resume: Callable[[], None]) -> None:
        """See :meth:`Share.wait`."""
        if share.left:
            self._schedule(resume)
            return
        share.waiters.append(resume)
        share.waits += 1
        share.last_wait = self.passes
        if not share.queued:
            share.queued = True
            self._waiting.append(share)
            if self.watcher is not None:
                self.watcher.began_waiting(share)
        if not self._pending:
            self._pending = True
            self._schedule(self.run_pass)
        sp = self.safe_point
        if sp is not None:  # a bulk turn is over its share: let the sparse guests in first
            sp()

    def alone(self) -> bool:
        """At most one guest (the one just charged) moved bytes this round and the one before, and
        none waits: a guest charged to zero now is credited at once (:meth:`overdrawn`)."""
        return self.active <= 1 and self._active_before <= 1 and not self._waiting

    def contended(self) -> bool:
        """Some guest's flow waits for its turn (the link is contended)."""
        return bool(self._waiting)

    def _rounds_for(self, share: Share) -> int:
        """Rounds until ``share`` (caught up) has credit above zero again (>= 1)."""
        return max(1, math.floor(-share.deficit / share.quantum) + 1)

    def _advance(self, k: int) -> None:
        self.round += k
        self._active_before = self.active
        self.active = 0

    def run_pass(self) -> None:
        """One pass (the scheduled callback): give the waiting guests their rounds and resume one
        waiting flow of each guest that has credit. Schedules the next pass while flows wait."""
        self._pending = False
        self.passes += 1
        waiting = self._waiting
        if not waiting:
            return
        watcher = self.watcher
        if watcher is not None:
            watcher.passed()
        sp = self.safe_point
        if sp is not None:  # the sparse guests' input first, then the next bulk turn
            sp()
            if not waiting:  # (their callbacks may close a waiting guest's stack)
                return
        catch_up = self.catch_up
        if all(catch_up(s) <= 0 for s in waiting):  # nobody has credit: the fewest rounds that give some
            self._advance(min(self._rounds_for(s) for s in waiting))
        for s in list(waiting):
            if catch_up(s) <= 0:
                continue
            resume = s.waiters.popleft()
            waiting.remove(s)
            if s.waiters:  # to the end of the line: the next pass serves the next guest first
                waiting.append(s)
            else:
                s.queued = False
            try:
                resume()
            except Exception:  # one flow's failure does not cost the others their turn
                log.exception("fair scheduler: a resume callback failed (share %s)", s.name)
            break  # one flow a pass: the loop polls again before the next guest's read
        if waiting and not self._pending:
            self._pending = True
            self._schedule(self.run_pass)
        elif not waiting and watcher is not None:
            watcher.drained()


class SparseLane:
    """The express lane of one loop: the sparse guests' input callbacks, run at the safe points of
    the backlogged guests' turns (see the module documentation, "The express lane").

    Each watched fd is one a guest's input arrives on (its transport's, the epoll of its host
    sockets), with the callback the loop runs when it is readable and the guest's shares. The
    lane's own epoll watches the same fds (level-triggered, ``EPOLLIN``); a callback run early
    finds its fd drained when the loop reaches it, which every watched callback takes as
    nothing to do (a read answered ``EAGAIN``, an empty poll).

    Args:
        links: the links whose waiting guests make the lane run (:meth:`FairLink.contended`).

    Attributes:
        served: callbacks run early (a counter).

    Bounded state: one entry per watched fd (two per guest); the epoll exists while some fd is
    watched. Not re-entrant by design: a callback run by the lane that reaches a safe point
    itself does not poll again. Not thread-safe: everything on the loop's thread.
    """

    __slots__ = ("links", "_ep", "_watched", "_busy", "served", "_dimmed", "_yield", "_serve", "_armed")

    links: tuple[FairLink, ...]
    _ep: select.epoll | None
    #: fd -> (callback, the guest's shares, the context it runs in).
    _watched: dict[int, tuple[Callable[[], None], tuple[Share, ...], contextvars.Context]]
    #: :meth:`serve` is running (its callbacks do not poll again).
    _busy: bool
    served: int
    #: The seats whose fds are dimmed in the epoll (:meth:`dim`).
    _dimmed: list[Seat]
    #: The native plane's ``set_yield`` (:meth:`use_yield`), or None.
    _yield: Callable[..., object] | None
    #: :meth:`serve`, bound once (the yield point knows it by identity).
    _serve: Callable[[], int]
    #: The yield point is armed with :meth:`serve`.
    _armed: bool

    def __init__(self, *links: FairLink) -> None:
        self.links = links
        self._ep = None
        self._watched = {}
        self._busy = False
        self.served = 0
        self._dimmed = []
        self._yield = None
        self._serve = self.serve
        self._armed = False

    @property
    def watched(self) -> int:
        """How many fds are watched."""
        return len(self._watched)

    def watch(self, fd: int, callback: Callable[[], None], shares: tuple[Share, ...], dimmed: bool = False) -> None:
        """Run ``callback()`` early when ``fd`` is readable at a safe point and every share in
        ``shares`` (the guest's) is :attr:`~Share.sparse`; ``callback`` is the one the loop runs
        for ``fd`` (it must take a spurious call as nothing to do). It runs in the context current
        here (as ``loop.add_reader`` does). ``dimmed``: its guest's seat is dimmed (:meth:`dim`).
        Watching an fd again replaces its entry. Raises ``OSError`` from ``epoll_ctl`` (a closed
        fd: ``EBADF``)."""
        ep = self._ep
        if ep is None:
            ep = self._ep = select.epoll()
        events = 0 if dimmed else select.EPOLLIN
        try:
            ep.register(fd, events)
        except FileExistsError:
            ep.modify(fd, events)
        except BaseException:
            if not self._watched:
                self._close()
            raise
        self._watched[fd] = (callback, tuple(shares), contextvars.copy_context())

    def unwatch(self, fd: int, callback: Callable[[], None] | None = None) -> bool:
        """Stop watching ``fd`` (before it is closed); True when it was watched. With ``callback``,
        only when ``fd`` is watched with that callback: a guest whose fd was closed under it (a
        transport that met EOF) and whose number another guest's new fd took since leaves the
        other guest's entry in place."""
        entry = self._watched.get(fd)
        if entry is None or (callback is not None and entry[0] is not callback):
            return False
        del self._watched[fd]
        ep = self._ep
        if ep is not None:
            try:
                ep.unregister(fd)
            except (OSError, ValueError):  # closed already
                pass
            if not self._watched:
                self._close()
        return True

    def seat(self, shares: tuple[Share, ...], counters: dict[str, int]) -> Seat:
        """A guest's :class:`Seat` (its shares, its stack's counters)."""
        return Seat(self, tuple(shares), counters)

    def _close(self) -> None:
        self._disarm()
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.close()

    # ------------------------------------------------ dimmed seats and the native yield point
    def dim(self, seat: Seat, on: bool) -> None:
        """Take ``seat``'s fds out of the epoll's readiness (``on``: events 0, its guest is busy) or
        put them back (sparse again): the epoll is readable only for a sparse guest's input, what
        the native yield point polls for. Idempotent; a closed fd is skipped."""
        if seat.dimmed == on:
            return
        seat.dimmed = on
        (self._dimmed.append if on else self._dimmed.remove)(seat)
        ep = self._ep
        if ep is None:
            return
        events = 0 if on else select.EPOLLIN
        for fd in seat.fds:
            try:
                ep.modify(fd, events)
            except (OSError, ValueError):
                pass

    def began_waiting(self, share: Share) -> None:
        """:class:`LinkWatcher`: ``share``'s guest is busy: its seat is dimmed, the yield point armed."""
        seat = share.seat
        if seat is not None and not seat.dimmed:
            self.dim(seat, True)
        self.passed()  # (contention again after a lull: the seats sparse since are lit)
        self._arm()

    def passed(self) -> None:
        """:class:`LinkWatcher`: at each pass, the dimmed seats whose guest is sparse again are lit."""
        for seat in list(self._dimmed):
            if all(s.sparse for s in seat.shares):
                self.dim(seat, False)

    def drained(self) -> None:
        """:class:`LinkWatcher`: a link has no waiting guest; none on any link: the yield point is disarmed."""
        for link in self.links:
            if link.contended():
                return
        self._disarm()

    def use_yield(self, set_yield: Callable[..., object] | None) -> None:
        """Arm the native plane's yield point (module documentation) with :meth:`serve` while a link
        is contended: ``set_yield(fd, serve, every_us)`` arms it (truthy: armed), ``set_yield(-1,
        serve)`` disarms it (``aioslirp.native.yield_point()``). ``None``: no yield point."""
        self._disarm()
        self._yield = set_yield

    def _arm(self) -> None:
        set_yield, ep = self._yield, self._ep
        if set_yield is not None and not self._armed and ep is not None:
            self._armed = bool(set_yield(ep.fileno(), self._serve, YIELD_EVERY_US))

    def _disarm(self) -> None:
        set_yield = self._yield
        if self._armed and set_yield is not None:
            self._armed = False
            set_yield(-1, self._serve)

    @property
    def yields(self) -> bool:
        """:meth:`use_yield` gave this lane a yield point."""
        return self._yield is not None

    @property
    def armed(self) -> bool:
        """The native yield point is armed with this lane's :meth:`serve`."""
        return self._armed

    def serve(self) -> int:
        """A safe point: while some guest waits on a link, run the callbacks of the watched fds
        that are readable now and whose guest is sparse; returns how many ran. A failing callback
        is logged, the others still run."""
        ep = self._ep
        if ep is None or self._busy:
            return 0
        for link in self.links:
            if link.contended():
                break
        else:
            return 0
        self._busy = True
        ran = 0
        try:
            try:
                events = ep.poll(0, LANE_MAX_EVENTS)
            except (InterruptedError, ValueError):
                return 0
            watched = self._watched
            for fd, _ in events:
                entry = watched.get(fd)
                if entry is None:  # unwatched by an earlier callback of this poll
                    continue
                callback, shares, ctx = entry
                if not all(s.sparse for s in shares):
                    continue
                ran += 1
                try:
                    ctx.run(callback)
                except Exception:  # one guest's failure does not cost the others their turn
                    log.exception("fair scheduler: an express-lane callback failed (fd %d)", fd)
        finally:
            self._busy = False
            self.served += ran
        return ran


class Seat:
    """One guest's place in a :class:`SparseLane` (:meth:`SparseLane.seat`): its input fds, watched
    with its shares; each callback run early is counted in ``counters["fair_express"]``."""

    __slots__ = ("lane", "shares", "counters", "fds", "_guest_fds", "_batched", "dimmed")

    lane: SparseLane
    shares: tuple[Share, ...]
    counters: dict[str, int]
    #: The fds watched for this guest -> the callback the lane runs (its counting wrapper).
    fds: dict[int, Callable[[], None]]
    #: The fds watched by :meth:`guest` (its transport's, its native engine's).
    _guest_fds: list[int]
    #: The transport whose batches end in :meth:`after_batch` (:meth:`guest`), or None.
    _batched: object | None
    #: Its fds are dimmed in the lane's epoll (:meth:`SparseLane.dim`): its guest is busy.
    dimmed: bool

    def __init__(self, lane: SparseLane, shares: tuple[Share, ...], counters: dict[str, int]) -> None:
        self.lane = lane
        self.shares = shares
        self.counters = counters
        self.fds = {}
        self._guest_fds = []
        self._batched = None
        self.dimmed = False
        for share in shares:
            share.seat = self

    def after_batch(self) -> None:
        """A batch of the guest's input was taken (the native TAP reader's hook, ``after_batch``):
        while a link is contended and this guest is busy on it (not sparse), a safe point of that
        link (:meth:`Share.safe_point`), so that a light guest's input waits for one batch of a
        busy guest, not for its whole turn. Nothing else: two tests per share."""
        for share in self.shares:
            if share.safe_point():  # (one safe point: both links have the same)
                return

    def _unhook(self) -> None:
        """Take :meth:`after_batch` back from the transport :meth:`guest` gave it to."""
        batched, self._batched = self._batched, None
        if batched is not None:
            batched.after_batch(None)  # type: ignore[attr-defined]

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """:meth:`SparseLane.watch` for this guest."""
        counters = self.counters

        def express() -> None:
            counters["fair_express"] = counters.get("fair_express", 0) + 1
            callback()

        self.lane.watch(fd, express, self.shares, self.dimmed)
        self.fds[fd] = express

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed)."""
        express = self.fds.pop(fd, None)
        if express is not None:
            self.lane.unwatch(fd, express)

    def guest(self, transport: object | None, *readers: tuple[int, Callable[[], None]] | None) -> None:
        """Watch the fd of the guest's ``transport`` (its ``guest_reader()``: ``(fd, callback)``, or
        ``None`` or no such method: nothing; a closed fd: nothing, logged at DEBUG) and ``readers``
        (more ``(fd, callback)`` pairs of the guest's input while the transport is served: its native
        TCP engine's epoll; ``None`` entries skipped), in place of those before; ``None``: stop
        watching them (before the transport and the engine close their fds)."""
        for fd in self._guest_fds:
            self.unwatch(fd)
        self._guest_fds = []
        self._unhook()
        if transport is None:
            return
        after_batch = getattr(transport, "after_batch", None)
        if after_batch is not None:  # a safe point after each of its batches (the native TAP reader)
            after_batch(self.after_batch)
            self._batched = transport
        reader = getattr(transport, "guest_reader", None)
        for found in (reader() if reader is not None else None, *readers):
            if found is None:
                continue
            try:
                self.watch(*found)
            except OSError as exc:  # closed meanwhile: nothing to serve early
                log.debug("fair scheduler: guest %s's fd %d not watched: %s", self.shares[0].name, found[0], exc)
                continue
            self._guest_fds.append(found[0])

    def leave(self) -> None:
        """The guest is gone (its stack closes): stop watching its fds, and its shares leave their
        links (:meth:`Share.leave`; the callbacks still waiting are dropped). Idempotent."""
        for fd, express in self.fds.items():
            self.lane.unwatch(fd, express)
        self.fds.clear()
        self._guest_fds = []
        self._unhook()
        self.lane.dim(self, False)
        for share in self.shares:
            share.leave()
            share.seat = None


#: The scheduler of each event loop (:meth:`Scheduler.for_loop`), forgotten with the loop.
_SCHEDULERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Scheduler]" = weakref.WeakKeyDictionary()


class Scheduler:
    """The fair scheduler of one event loop: :attr:`down` (host -> guest) and :attr:`up`
    (guest -> host), each a :class:`FairLink` whose passes run through ``loop.call_soon``, and
    :attr:`lane`, the :class:`SparseLane` both links call at their safe points.

    Made on first use by :meth:`for_loop` (a :class:`~aioslirp.stack.Stack` enrols when it
    starts, with its ``NetworkConfig.fair_weight`` (:meth:`enrol`), and leaves when it closes).
    """

    __slots__ = ("loop", "up", "down", "lane", "__weakref__")

    loop: asyncio.AbstractEventLoop
    up: FairLink
    down: FairLink
    lane: SparseLane

    def __init__(self, loop: asyncio.AbstractEventLoop, quantum_up: float = QUANTUM,
                 quantum_down: float = QUANTUM_DOWN) -> None:
        self.loop = loop
        self.up = FairLink(loop.call_soon, quantum_up)
        self.down = FairLink(loop.call_soon, quantum_down)
        self.lane = SparseLane(self.up, self.down)
        self.up.safe_point = self.down.safe_point = self.lane.serve
        self.up.watcher = self.down.watcher = self.lane

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "Scheduler":
        """The scheduler of ``loop`` (made on first use, forgotten with the loop)."""
        sched = _SCHEDULERS.get(loop)
        if sched is None:
            sched = _SCHEDULERS[loop] = cls(loop)
        return sched

    def join(self, weight: float = 1.0, name: str = "") -> tuple[Share, Share]:
        """A new guest's shares ``(up, down)`` of weight ``weight`` (> 0; ``ValueError`` else)."""
        return self.up.join(weight, name), self.down.join(weight, name)

    def enrol(self, weight: float, name: str, counters: dict[str, int], queue: BatchWriter,
              *readers: tuple[int, Callable[[], None]],
              yield_point: Callable[..., object] | None = None) -> tuple[Share, Share, Seat]:
        """A stack's place in the scheduler: its shares ``(up, down)`` (:meth:`join`) and its
        :class:`Seat` in :attr:`lane`, watching ``readers`` (``(fd, callback)`` pairs); the writer
        of ``queue`` (its ``InjectQueue``) calls the lane before each batch (``before_write``).
        ``yield_point``: the native plane's ``set_yield`` (:meth:`SparseLane.use_yield`, once per
        loop), or None."""
        if yield_point is not None and not self.lane.yields:
            self.lane.use_yield(yield_point)
        up, down = self.join(weight, name)
        seat = self.lane.seat((up, down), counters)
        for fd, callback in readers:
            seat.watch(fd, callback)
        queue.before_write = self.lane.serve
        return up, down, seat
