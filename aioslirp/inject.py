"""The inject queue: every frame for the guest, and the one writer that hands them to the transport.

Theory of operation
-------------------
Everything the stack sends to the guest (TCP segments, UDP datagrams, ARP and NDP answers,
ICMP) goes through :meth:`InjectQueue.put`: a bounded FIFO of ``NetworkConfig.inject_queue_size``
frames; a frame beyond is dropped and counted as ``drop.inject_full`` (``put`` returns False).
Frames leave in queue order by one of two ways, in batches of at most :data:`BATCH` frames
(``Transport.send_frames``):

* the writer task (started by :meth:`InjectQueue.start`) sleeps on a wake-up future of its own
  while the queue is empty; the first :meth:`~InjectQueue.put` after that wakes it;
* :meth:`InjectQueue.write_now` writes the whole queue at once. A batch of guest frames
  (:mod:`aioslirp.dispatch.link`) and a small host read (:mod:`aioslirp.nat.hostsock`) run
  while :attr:`~InjectQueue.hold` is set (the :meth:`~InjectQueue.held` context): their puts do
  not wake the writer, and the end of the batch writes what they queued in the same event-loop
  iteration (measured: see docs/performance.md, "third push"). Same FIFO, same thread: the
  frames' order is the queue's order either way.

Both go through one batch function (``_write_batch``); :meth:`InjectQueue.drain`
(stack stop, :meth:`Stack.farewell() <aioslirp.stack.Stack.farewell>`) is :meth:`write_now` and one
loop iteration.

Why not :class:`asyncio.Queue`: its ``get()`` looks the running loop up each time it has to
wait, which in CPython 3.11 costs a ``getpid()`` system call (2% of the CPU of
connect/request/response traffic, where the writer waits once per frame), and skipping its
generic bookkeeping meant reaching into its private members. A ``deque`` with a future of our
own does the same with public APIs only (a deque plus a wake-up measured 0.14-0.18 us a frame,
against 0.43-0.62 us for ``asyncio.Queue``).

Counters (in the stack's ``counters``): ``frames_out``, ``bytes_out`` (frames handed to the
transport), ``drop.inject_full``, ``drop.no_transport`` (frames for a guest whose transport is
gone or not there yet).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, Union

__all__ = ["BATCH", "Frame", "FrameWriter", "InjectQueue", "QueueTrace"]

#: Most frames handed to ``Transport.send_frames`` in one call.
BATCH = 128

#: One Ethernet frame for the guest, as the frame builders make it.
Frame = Union[bytes, bytearray, memoryview]


class FrameWriter(Protocol):
    """Where the frames go (:class:`aioslirp.transport.base.Transport`; this module is on a floor
    below the transports, so it names only what it uses)."""

    @property
    def closed(self) -> asyncio.Future | None:
        """Done once the transport closed; ``None`` before it is opened."""
        ...

    def send_frames(self, frames: Sequence[Frame]) -> None:
        """Write ``frames`` to the guest, in order."""
        ...


class QueueTrace(Protocol):
    """The trace points of the queue (:class:`aioslirp.observe.tracing.Tracer`)."""

    def record_frame_queued(self, frame: Frame) -> None:
        """``frame`` was queued (its enqueue time is stamped)."""
        ...

    def record_discard(self, frames: list[Frame] | None) -> None:
        """``frames`` were dropped unwritten."""
        ...


class InjectQueue:
    """The bounded queue of frames (bytes-like Ethernet frames) for the guest, and its writer.

    Args:
        maxsize: most frames held (``NetworkConfig.inject_queue_size``, > 0).
        counters: the stack's ``collections.Counter``.
        tracer: the stack's :class:`~aioslirp.observe.tracing.Tracer`, or ``None``: told of every frame
            queued (``record_frame_queued``) and dropped unwritten (``record_discard``).

    Attributes:
        transport: the :class:`~aioslirp.transport.base.Transport` frames are written to (set by
            ``Stack.serve``); ``None`` or closed: written frames are counted as
            ``drop.no_transport`` and discarded.
        hold: while True, :meth:`put` does not wake the writer task; whoever set it calls
            :meth:`write_now` when done (see :meth:`held`). Not re-entrant.
        before_write: called (no arguments) by the writer task before each batch it writes, or
            ``None``: the fair scheduler's safe point (``SparseLane.serve`` of
            :mod:`aioslirp.fair`, set by ``Stack.start``), where the light guests' input may run
            before a bulk guest's write.

    Not thread-safe: every method runs on the event loop's thread.
    """

    __slots__ = ("maxsize", "transport", "hold", "_q", "_counters", "tracer", "_loop", "_waiter", "_task",
                 "before_write")

    maxsize: int
    transport: FrameWriter | None
    hold: bool
    _q: deque[Frame]
    _counters: dict[str, int]
    _loop: asyncio.AbstractEventLoop | None
    _waiter: asyncio.Future | None
    _task: asyncio.Task | None
    #: The stack's tracer (``None``: not traced).
    tracer: QueueTrace | None
    before_write: Callable[[], object] | None

    def __init__(self, maxsize: int, counters: dict[str, int], tracer: QueueTrace | None = None) -> None:
        self.maxsize = int(maxsize)
        self.transport = None
        self.hold = False
        self._q: deque[Frame] = deque()
        self._counters = counters
        self.tracer = tracer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self.before_write = None

    def __len__(self) -> int:
        """Frames queued now."""
        return len(self._q)

    @property
    def room(self) -> int:
        """Free slots (``maxsize - len(self)``)."""
        return self.maxsize - len(self._q)

    # ------------------------------------------------------------------ input
    def put(self, frame: Frame) -> bool:
        """Queue one Ethernet frame for the guest. Returns False (counted ``drop.inject_full``)
        when the queue is full. Wakes the writer task unless :attr:`hold` is set."""
        q = self._q
        if len(q) >= self.maxsize:
            self._counters["drop.inject_full"] += 1
            return False
        q.append(frame)
        if not self.hold:
            w = self._waiter
            if w is not None:  # the writer waits: its first wake-up since it found the queue empty
                self._waiter = None
                w.set_result(None)
        t = self.tracer
        if t is not None:
            t.record_frame_queued(frame)
        return True

    def discard(self) -> int:
        """Forget every queued frame (a guest that went away), counted as ``drop.no_transport``.
        Returns how many."""
        q = self._q
        n = len(q)
        t = self.tracer
        dropped = list(q) if t is not None else None
        q.clear()
        self._counters["drop.no_transport"] += n
        if t is not None:
            t.record_discard(dropped)
        return n

    # ------------------------------------------------------------------ output
    def held(self) -> "InjectQueue":
        """The context ``with queue.held(): ...``: frames queued inside do not wake the writer
        task, and are written to the transport when the block ends (:meth:`write_now`)."""
        return self

    def __enter__(self) -> "InjectQueue":
        self.hold = True
        return self

    def __exit__(self, *exc) -> None:
        self.hold = False
        if self._q:
            self.write_now()

    def write_now(self) -> None:
        """Write every queued frame to the transport now, in batches of up to :data:`BATCH`.

        Called at the end of each batch of guest frames and of each small host read, so that
        the frames they produced leave in the same event-loop iteration instead of waking the
        writer task (measured: see docs/performance.md, "third push").
        """
        q = self._q
        while q:
            self._write_batch()

    def _write_batch(self) -> None:
        """Take up to :data:`BATCH` frames off the queue and hand them to the transport, counted."""
        q = self._q
        if len(q) <= BATCH:
            batch = list(q)
            q.clear()
        else:
            batch = [q.popleft() for _ in range(BATCH)]
        counters = self._counters
        tr = self.transport
        if tr is None or tr.closed is None or tr.closed.done():
            counters["drop.no_transport"] += len(batch)
            t = self.tracer
            if t is not None:
                t.record_discard(batch)
            return
        tr.send_frames(batch)  # a traced stack's transport is a TraceTransport (aioslirp.transport.trace)
        counters["frames_out"] += len(batch)
        counters["bytes_out"] += sum(map(len, batch))

    async def drain(self) -> None:
        """Write what is queued (:meth:`write_now`), then give the transport one loop iteration."""
        self.write_now()
        await asyncio.sleep(0)

    # ------------------------------------------------------------------ the writer task
    def start(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task:
        """Start the writer task on ``loop`` (``Stack.start``); returns it."""
        self._loop = loop
        self._task = loop.create_task(self._writer(), name="aioslirp-writer")
        return self._task

    async def stop(self) -> None:
        """Cancel the writer task and wait for it (frames still queued stay queued)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _writer(self) -> None:
        q = self._q
        loop = self._loop
        assert loop is not None, "InjectQueue.start() first"
        try:
            while True:
                if not q:
                    w = self._waiter = loop.create_future()
                    await w
                    continue
                # One batch of at most BATCH frames per turn. (Putting the frame back and calling
                # write_now(), which drains the whole queue, measured host->guest throughput
                # -30%: 4.2-4.7 against 6.0-6.9 Gbit/s.)
                hook = self.before_write
                if hook is not None:
                    hook()
                    if not q:  # what it ran wrote the queue out (a held batch's end)
                        continue
                self._write_batch()
        finally:
            self._waiter = None
