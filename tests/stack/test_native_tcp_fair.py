"""The loop's fair scheduler (aioslirp.fair) holding native TCP flows (aioslirp.nat.native_tcp): two
stacks on this loop, one with a native flow on a fake engine (no TAP, no kernel TCP), the other
busy: the native guest's bytes are charged to its share, over it the engine is held until its
turn, its turn resumes the held flow with the guest's credit, and no bound is left once it is
alone again."""

from __future__ import annotations

import asyncio
import contextlib

from aioslirp import NetworkConfig, Stack
from aioslirp.fair import QUANTUM_DOWN
from aioslirp.nat.native_tcp import ALONE_TURNS, NativeTcp

from support.frames import ACK, F4, GW_MAC, SYN, tcp_frame
from support.native import need_extension

PORT = 40010
WSCALE = b"\x01\x03\x03\x07"  # NOP, window scale 7: the guest's 0xFFFF is 8 MiB


def _payload(frames: list[bytes]) -> int:
    return sum(len(f) - 54 for f in frames)  # Ethernet, IPv4 and TCP headers without options


@contextlib.asynccontextmanager
async def native_beside_busy():
    """Two stacks on this loop: ``busy`` and ``guest``, the latter with a native flow on a fake
    engine (established, an 8 MiB window); yields ``(busy, guest, eng, plane, now, fd, iss)``."""
    ext = need_extension()
    busy, guest = Stack(NetworkConfig(), name="busy"), Stack(NetworkConfig(), name="native")
    await busy.start()
    await guest.start()
    ctx = guest.parts.ctx
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    eng.fake_connect_mode(0)
    plane = ctx.native_tcp = NativeTcp(ctx, eng)
    now = asyncio.get_running_loop().time  # the clock of the engine's poll()
    try:
        guest.parts.link.on_frames([tcp_frame(F4, PORT, 8080, SYN, seq=5, mss=1460, opts=WSCALE)])
        (synack,) = eng.fake_frames()
        iss = int.from_bytes(synack[38:42], "big")
        assert eng.input(tcp_frame(F4, PORT, 8080, ACK, seq=6, ack=iss + 1, win=0xFFFF), False, now())
        (fd,) = eng.fake_fds()
        yield busy, guest, eng, plane, now, fd, iss
    finally:
        plane.close()
        ctx.native_tcp = None
        await guest.aclose()
        await busy.aclose()


async def test_a_native_guest_over_its_share_is_held_until_its_turn():
    async with native_beside_busy() as (busy, guest, eng, plane, now, fd, iss):
        # the other guest moves bytes this round: contention
        assert busy.parts.ctx.running.share_down.charge(1000) is False
        eng.fake_host_send(fd, bytes(300_000), now())  # read at once (an 8 MiB window): 300 KB to the guest
        assert _payload(eng.fake_frames()) == 300_000
        plane.poll()  # charged: over its 64 KiB share, another guest busy: held down, waiting its turn
        assert guest.counters["tcp_fair_wait_down"] == 1
        eng.fake_host_send(fd, bytes(500_000), now())
        assert eng.fake_frames() == [] and eng.counters()["held_down"] == 1  # held: nothing read
        assert eng.fake_socket(fd)["unread"] == 800_000  # (nothing acknowledged yet either)
        ack = iss + 1 + 300_000
        assert eng.input(tcp_frame(F4, PORT, 8080, ACK, seq=6, ack=ack, win=0xFFFF), False, now())
        assert eng.fake_frames() == []  # a guest ACK does not lift the hold
        sent = [300_000]

        def take() -> int:  # the guest takes what came and acknowledges it all
            got = _payload(eng.fake_frames())
            if got:
                sent[0] += got
                eng.input(tcp_frame(F4, PORT, 8080, ACK, seq=6, ack=iss + 1 + sent[0], win=0xFFFF), False, now())
                if eng.pending():  # as the TAP reader does after a batch: the bytes it moved, charged
                    plane.take()
            return got

        turns = []
        for _ in range(200):  # the scheduler's passes: its turns, each about its credit
            await asyncio.sleep(0)
            got = take()
            if got:
                turns.append(got)
            if sum(turns) >= 500_000:
                break
        assert sum(turns) == 500_000 and len(turns) >= 3, turns  # every byte, in turns
        assert turns[0] <= QUANTUM_DOWN + 1460  # the first turn: the credit of one round, one segment over
        assert guest.counters["tcp_fair_wait_down"] >= 2  # it waited again after that turn
        assert busy.counters["tcp_fair_wait_down"] == 0
        # alone now (the other guest moves nothing): a few bounded turns, then no bound at all
        for _ in range(ALONE_TURNS + 4):
            eng.fake_host_send(fd, bytes(100_000), now())
            plane.poll()  # (the engine's epoll would wake the loop)
            for _ in range(20):
                await asyncio.sleep(0)
                take()
        assert sent[0] == 300_000 + 500_000 + (ALONE_TURNS + 4) * 100_000
        waits = guest.counters["tcp_fair_wait_down"]
        eng.fake_host_send(fd, bytes(900_000), now())  # read at once, no bound: no poll needed
        assert take() == 900_000
        plane.poll()
        assert guest.counters["tcp_fair_wait_down"] == waits and eng.counters()["held_down"] >= 2


async def test_each_charge_of_a_contended_turn_is_a_safe_point():
    """While another guest waits for its turn, every charge of a native guest's turn that leaves it
    credit is a safe point of the link (where the express lane runs the sparse guests' input), not
    only the charge that ends the turn: a sparse guest waits for one batch or poll of a busy guest,
    not for the rest of its quantum."""
    async with native_beside_busy() as (busy, guest, eng, plane, now, fd, iss):
        share = guest.parts.ctx.running.share_down
        link = share.link
        points: list[int] = []
        link.safe_point = lambda: points.append(1)
        other = busy.parts.ctx.running.share_down

        def busy_turn() -> None:  # the busy guest is always over its share again: it always waits
            other.charge(4 * QUANTUM_DOWN)
            other.wait(busy_turn)

        assert other.charge(1000) is False  # the other guest moves bytes this round: contention
        eng.fake_host_send(fd, bytes(300_000), now())
        got = _payload(eng.fake_frames())
        plane.poll()  # over its share beside a busy guest: held, a wait (and its safe point)
        assert guest.counters["tcp_fair_wait_down"] == 1
        assert other.charge(4 * QUANTUM_DOWN) is True  # the other guest over its share too: it waits
        other.wait(busy_turn)
        assert link.contended()
        for _ in range(3):  # passes: the native guest's turn comes (nothing to move then), the busy one waits on
            await asyncio.sleep(0)
        assert link.contended()
        before, waits = len(points), guest.counters["tcp_fair_wait_down"]
        eng.fake_host_send(fd, bytes(10_000), now())  # read in its turn: less than its credit
        got += _payload(eng.fake_frames())
        plane.poll()  # its charge: the turn goes on (no wait), a safe point
        assert got == 310_000
        assert guest.counters["tcp_fair_wait_down"] == waits
        assert len(points) == before + 1
