"""TX completion deferral over vhost-user (``VhostUserTransport(tx_defer=)``, ``--tx-defer``).

After a walk of the TX ring that took less than 4 KiB, the call that tells the guest its buffers
are used waits up to ``tx_defer`` seconds. A Linux driver takes the buffers back by itself when it
next receives (its RX poll cleans the TX queue) or sends, and moves ``used_event`` past them
(EVENT_IDX, virtio 1.1 2.7.10): the call is then no longer owed and is never made
(``tx_calls_saved``). A call still owed at the deadline goes then (``tx_calls_late``); a walk of
4 KiB or more, a quarter of the ring unsignalled, ``tx_defer=0`` and a driver without EVENT_IDX
get their call at once, as before.

The front end here is the tests' own (:class:`support.vhost.FakeFrontEnd`): it plays the driver's
part of the protocol by hand (taking used entries back, moving ``used_event``).
"""

from __future__ import annotations

import asyncio

import pytest

from aioslirp.transport import vhost_proto as vp

from support.frames import F4, udp_frame
from support.native import need_vhost
from support.stacks import until
from support.vhost import NUM, close_made, engine_device

SMALL = udp_frame(F4, 40000, 7, b"request")


@pytest.fixture
async def device(tmp_path):
    """``make(features=..., **transport_options)``: a transport with a front end whose first TX
    walk (the one that sets the device's bookkeeping, always called) is done and its call read.
    Returns ``(transport, front end, send)``: ``send(frame)`` puts a frame on the TX ring and waits
    until the walker handed it on."""
    need_vhost()
    made: list = []

    async def make(features: int = vp.OFFERED_FEATURES, **options):
        t, fe, _lst, _port, python_frames = await engine_device(str(tmp_path / "vu.sock"), made, features,
                                                                **options)

        async def send(frame: bytes = SMALL) -> None:
            n = len(python_frames)
            fe.send_frame(frame)
            assert await until(lambda: len(python_frames) > n, 5.0), t.counters()

        await send()
        assert await until(lambda: fe.calls(1) > 0, 5.0)
        fe.used(1)
        fe.set_used_event(1, fe.used_idx(1))  # the driver took entry 0 back: call me for the next one
        return t, fe, send

    yield make
    close_made(made)


async def test_the_call_waits_and_is_saved_when_the_driver_takes_the_buffer_back(device):
    t, fe, send = await device(tx_defer=0.05)
    await send()
    assert fe.used_idx(1) == 2, "the used entry is published at once"
    assert fe.calls(1) == 0, "the call waits"
    assert t.counters()["tx_calls_deferred"] == 1
    fe.used(1)
    fe.set_used_event(1, fe.used_idx(1))  # as a Linux RX poll does: entry 1 taken back
    assert await until(lambda: t.counters().get("tx_calls_saved", 0) == 1, 5.0), t.counters()
    await asyncio.sleep(0.1)  # two deadlines on
    assert fe.calls(1) == 0
    assert t.counters().get("tx_calls_late", 0) == 0


async def test_a_call_still_owed_goes_at_the_deadline(device):
    t, fe, send = await device(tx_defer=0.3)
    await send()
    assert fe.calls(1) == 0 and t.counters()["tx_calls_deferred"] == 1
    assert await until(lambda: fe.calls(1) > 0, 5.0), t.counters()
    c = t.counters()
    assert c["tx_calls_late"] == 1 and c.get("tx_calls_saved", 0) == 0, c


async def test_request_response_takes_no_tx_call(device):
    """Twenty small frames, each followed by the driver taking its buffer back (what a guest's RX
    poll does when the reply comes): every call is saved, none is made."""
    t, fe, send = await device(tx_defer=0.2)
    for _ in range(20):
        await send()
        fe.used(1)
        fe.set_used_event(1, fe.used_idx(1))
    assert await until(lambda: t.counters().get("tx_calls_saved", 0) >= 1, 5.0)
    await asyncio.sleep(0.5)
    c = t.counters()
    assert fe.calls(1) == 0, c
    assert c["tx_calls_deferred"] == 20 and c.get("tx_calls_late", 0) == 0, c


async def test_a_walk_of_4_kib_or_more_is_completed_at_once(device):
    t, fe, send = await device(tx_defer=1.0)
    await send(udp_frame(F4, 40000, 7, b"x" * 4096))
    assert fe.calls(1) == 1
    assert t.counters().get("tx_calls_deferred", 0) == 0


async def test_a_quarter_of_the_ring_unsignalled_is_called_at_once(device):
    t, fe, send = await device(tx_defer=1.0)
    for k in range(NUM // 4):
        await send()
        if k < NUM // 4 - 1:
            assert fe.calls(1) == 0, k
    assert fe.calls(1) == 1  # the 64th entry: called without waiting for the deadline
    c = t.counters()
    assert c["tx_calls_deferred"] == NUM // 4 - 1 and c.get("tx_calls_late", 0) == 0, c


async def test_tx_defer_0_calls_every_walk_at_once(device):
    t, fe, send = await device(tx_defer=0)
    for _ in range(3):
        await send()
        assert fe.calls(1) == 1
        fe.used(1)
        fe.set_used_event(1, fe.used_idx(1))
    assert t.counters().get("tx_calls_deferred", 0) == 0


async def test_without_event_idx_every_walk_is_called_at_once(device):
    t, fe, send = await device(features=vp.OFFERED_FEATURES & ~vp.F_EVENT_IDX, tx_defer=1.0)
    for _ in range(3):
        await send()
        assert fe.calls(1) == 1
    assert t.counters().get("tx_calls_deferred", 0) == 0


@pytest.mark.parametrize("value", [-0.001, 1.5, float("nan")])
def test_bad_tx_defer_is_refused_naming_the_field(value):
    need_vhost()
    from aioslirp.transport.vhost_user import VhostUserTransport

    with pytest.raises(ValueError, match=r"^tx_defer: .* not within 0\.\.1"):
        VhostUserTransport("unused.sock", tx_defer=value)
