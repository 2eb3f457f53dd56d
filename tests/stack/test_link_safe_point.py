"""The Python link's safe points inside a batch of guest frames (aioslirp.dispatch.link,
``SAFE_POINT_FRAMES``): a backlogged guest's long batch (an upload: up to 64 segments of 64 KB)
lets the light guests' input in every few frames while the upload link is contended; a light
(sparse) guest's batch, or any batch without contention, offers none."""

from __future__ import annotations

import asyncio

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.dispatch.link import SAFE_POINT_FRAMES
from aioslirp.fair import QUANTUM, Scheduler

from support.frames import GUEST_MAC, GW_MAC


def _frames(n: int) -> list[bytes]:
    # frames of an EtherType the stack does not serve (IEEE 802 local experimental): each is
    # dispatched and dropped, touching no flow and no share (only the batch's safe points do)
    return [GW_MAC + GUEST_MAC + b"\x88\xb5" + bytes(46) for _ in range(n)]


@pytest.fixture
async def guests():
    """Two started stacks on this loop, the upload link's safe points recorded (one entry each)."""
    a, b = Stack(NetworkConfig(), name="a"), Stack(NetworkConfig(), name="b")
    await a.start()
    await b.start()
    up = Scheduler.for_loop(asyncio.get_running_loop()).up
    calls: list[int] = []
    before = up.safe_point
    up.safe_point = lambda: calls.append(1)
    try:
        yield a, b, up, calls
    finally:
        up.safe_point = before
        await a.aclose()
        await b.aclose()


def _backlog(stack: Stack, other: Stack) -> None:
    """The stack's upload share over its quantum while ``other`` moves bytes too, waiting its
    turn (not sparse)."""
    other.parts.ctx.running.share_up.charge(1)  # the other guest is active this round
    share = stack.parts.ctx.running.share_up
    assert share.charge(2 * QUANTUM) is True
    share.wait(lambda: None)
    assert not share.sparse


async def test_a_backlogged_guests_batch_offers_a_safe_point_every_few_frames(guests):
    a, b, up, calls = guests
    _backlog(a, b)
    _backlog(b, a)  # two guests wait: the link is contended
    assert up.contended()
    calls.clear()  # (a flow that begins to wait is a safe point of its own)
    a.parts.link.on_frames(_frames(3 * SAFE_POINT_FRAMES + 1))
    assert len(calls) == 3


async def test_a_sparse_guests_batch_and_an_uncontended_one_offer_none(guests):
    a, b, up, calls = guests
    a.parts.link.on_frames(_frames(4 * SAFE_POINT_FRAMES))  # nobody waits: no contention
    assert calls == []
    _backlog(b, a)  # contended now, but guest a is light (sparse)
    assert up.contended() and a.parts.ctx.running.share_up.sparse
    calls.clear()
    a.parts.link.on_frames(_frames(4 * SAFE_POINT_FRAMES))
    assert calls == []
