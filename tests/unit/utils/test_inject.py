"""The inject queue (aioslirp.inject): the bounded FIFO of frames for the guest and its one writer.

A transport that records each ``send_frames`` batch stands for the guest link; the writer task
runs on a real event loop (nothing else is on it). What is checked: the bound and its counter,
``hold`` / ``held()`` (puts that do not wake the writer, written at the end of the block),
batches of at most ``BATCH`` frames in queue order, ``drain``, ``stop``, frames for a transport
that is gone, and what a tracer is told.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from aioslirp.inject import BATCH, InjectQueue


class RecordingTransport:
    """A transport as the queue uses it: ``closed`` (a future, done once closed) and ``send_frames``."""

    def __init__(self) -> None:
        self.closed = Open()
        self.batches: list[list] = []

    def send_frames(self, frames) -> None:
        self.batches.append(list(frames))

    @property
    def frames(self) -> list:
        return [f for b in self.batches for f in b]


class Open:
    """A ``closed`` that is not done: the link is up (``Closed``: it went down)."""

    def done(self) -> bool:
        return False


class Closed:
    def done(self) -> bool:
        return True


class TracerCalls:
    def __init__(self) -> None:
        self.queued: list = []
        self.discarded: list[list] = []

    def record_frame_queued(self, frame) -> None:
        self.queued.append(frame)

    def record_discard(self, frames) -> None:
        self.discarded.append(list(frames))


def frames(n: int, start: int = 0) -> list[bytes]:
    return [b"f%05d" % i for i in range(start, start + n)]


def new_queue(maxsize: int = 1024, tracer=None) -> tuple[InjectQueue, collections.Counter, RecordingTransport]:
    counters: collections.Counter = collections.Counter()
    q = InjectQueue(maxsize, counters, tracer)
    q.transport = link = RecordingTransport()
    return q, counters, link


# ============================================================================ the bound
def test_put_beyond_the_bound_is_refused_and_counted():
    q, counters, _ = new_queue(maxsize=3)
    assert [q.put(f) for f in frames(5)] == [True, True, True, False, False]
    assert len(q) == 3 and q.room == 0
    assert counters["drop.inject_full"] == 2
    q.write_now()
    assert q.room == 3 and q.put(b"again")


def test_discard_forgets_the_queue_counted_as_no_transport():
    tracer = TracerCalls()
    q, counters, link = new_queue(tracer=tracer)
    for f in frames(4):
        q.put(f)
    assert q.discard() == 4
    assert len(q) == 0 and counters["drop.no_transport"] == 4 and link.batches == []
    assert tracer.queued == frames(4) and tracer.discarded == [frames(4)]


# ============================================================================ writing
def test_write_now_writes_in_batches_of_at_most_batch_frames_in_order():
    q, counters, link = new_queue(maxsize=1000)
    sent = frames(2 * BATCH + 5)
    for f in sent:
        q.put(f)
    q.write_now()
    assert [len(b) for b in link.batches] == [BATCH, BATCH, 5]
    assert link.frames == sent and len(q) == 0
    assert counters["frames_out"] == len(sent) and counters["bytes_out"] == sum(map(len, sent))


@pytest.mark.parametrize("gone", ["none", "closed"])
def test_frames_for_a_transport_that_is_gone_are_counted_not_written(gone):
    tracer = TracerCalls()
    q, counters, link = new_queue(tracer=tracer)
    if gone == "none":
        q.transport = None
    else:
        link.closed = Closed()
    for f in frames(3):
        q.put(f)
    q.write_now()
    assert link.batches == [] and len(q) == 0
    assert counters["drop.no_transport"] == 3 and counters["frames_out"] == 0
    assert tracer.discarded == [frames(3)]


def test_held_block_writes_what_it_queued_when_it_ends():
    """Inside ``held()`` puts do not wake the writer; the end of the block writes them all, in order."""

    async def main():
        q, counters, link = new_queue()
        q.start(asyncio.get_running_loop())
        await asyncio.sleep(0)  # the writer waits for a first frame
        with q.held() as held:
            assert held is q and q.hold
            for f in frames(3):
                q.put(f)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert link.batches == []  # the writer was not woken
        assert not q.hold
        assert link.batches == [frames(3)]  # written as the block ended, one batch
        with q.held():
            pass  # nothing queued: nothing written
        assert len(link.batches) == 1
        await q.stop()
        return counters

    counters = asyncio.run(main())
    assert counters["frames_out"] == 3


def test_writer_task_wakes_on_a_put_and_writes_in_batches():
    """Outside ``held()`` a put wakes the writer task, which writes the queue when it runs (not in
    the put), in batches of at most ``BATCH``; once the queue is empty it sleeps until the next put."""

    async def main():
        q, _, link = new_queue(maxsize=1000)
        task = q.start(asyncio.get_running_loop())
        assert task.get_name() == "aioslirp-writer"
        await asyncio.sleep(0)  # the writer waits for a first frame
        sent = frames(2 * BATCH + 1)
        for f in sent:
            q.put(f)
        assert link.batches == []  # put only wakes the writer
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [len(b) for b in link.batches] == [BATCH, BATCH, 1] and link.frames == sent
        q.put(b"later")  # the queue ran empty: the writer slept, this wakes it again
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert link.batches[-1] == [b"later"]
        await q.stop()
        assert task.done()

    asyncio.run(main())


def test_drain_writes_everything_and_stop_leaves_the_rest_queued():
    async def main():
        q, _, link = new_queue()
        q.start(asyncio.get_running_loop())
        await q.stop()  # no writer from here on
        for f in frames(3):
            q.put(f)
        await asyncio.sleep(0)
        assert link.batches == [] and len(q) == 3  # stopped: queued frames stay queued
        await q.drain()
        assert link.frames == frames(3) and len(q) == 0
        await q.stop()  # idempotent

    asyncio.run(main())


def test_the_writer_calls_before_write_before_each_batch_it_writes():
    """``before_write`` (the fair scheduler's safe point, aioslirp.fair) runs before every batch the
    writer task writes, seeing the frames still queued; ``write_now`` (a held block's end) does not
    call it."""

    async def main():
        q, _, link = new_queue(maxsize=1000)
        seen = []
        q.before_write = lambda: seen.append((len(q), len(link.batches)))
        q.start(asyncio.get_running_loop())
        await asyncio.sleep(0)
        for f in frames(BATCH + 1):
            q.put(f)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert seen == [(BATCH + 1, 0), (1, 1)]
        with q.held():
            q.put(b"x")
        assert len(seen) == 2 and link.batches[-1] == [b"x"]
        await q.stop()

    asyncio.run(main())


def test_the_writer_writes_nothing_when_before_write_wrote_the_queue_out():
    """What ``before_write`` runs may end a held batch of the same stack, which writes the whole
    queue (``write_now``): the writer then writes no empty batch and sleeps until the next put."""

    async def main():
        q, counters, link = new_queue()
        q.before_write = q.write_now
        q.start(asyncio.get_running_loop())
        await asyncio.sleep(0)
        q.put(b"a")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert link.batches == [[b"a"]] and counters["frames_out"] == 1
        await q.stop()

    asyncio.run(main())
