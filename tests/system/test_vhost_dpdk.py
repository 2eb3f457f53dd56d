"""A vhost-user front end no one here wrote: DPDK's virtio_user (``dpdk-testpmd``, DPDK 22.11 from
Debian's ``dpdk-dev``) on aioslirp's :class:`~aioslirp.transport.vhost_user.VhostUserTransport`.

testpmd's virtio-net driver shares its (memfd, ``--no-huge``) memory and rings with the back end;
``start tx_first N`` sends N bursts of UDP datagrams from the guest address to the gateway, which
aioslirp NATs to a UDP echo server on the host's loopback; the echoes come back through aioslirp's
RX ring into testpmd's port. Counted at every step: the datagrams the host socket got, testpmd's
port counters, the rings' and the stack's counters; the features virtio_user negotiated are
reported (``pytest -rP``). Then the other way round: testpmd listens (``server=1``), the back end
connects, the offloads are negotiated, frames loop between testpmd (``5tswap``) and the host echo
until testpmd is killed mid-run; a new testpmd on the same socket is served. Chained frames
(testpmd's small mbufs) both ways, MRG_RXBUF, a full RX ring drained on testpmd's kick; and a back
end restarted under a testpmd that kept running (it resumes from the rings' used indexes).

testpmd's counters and aioslirp's agree frame for frame; see tests/support/testpmd.py for how
testpmd is run (no hugepages, its prompt over a pipe).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os

import pytest

from aioslirp.config import NetworkConfig
from aioslirp.stack import Stack
from aioslirp.transport import vhost_proto as vp
from aioslirp.transport import vhost_user as vu
from aioslirp.transport.vhost_user import VhostUserTransport

from support import testpmd
from support.native import need_vhost
from support.prereqs import need
from support.servers import UdpEcho
from support.testpmd import Testpmd
from support.vms import report

pytestmark = [pytest.mark.slow]

FRAME = 64  # bytes: testpmd's txonly frames (--txpkts default), and the echoes (same UDP payload)

FEATURE_NAMES = {
    vp.F_CSUM: "CSUM", vp.F_GUEST_CSUM: "GUEST_CSUM", vp.F_GUEST_TSO4: "GUEST_TSO4", vp.F_GUEST_TSO6: "GUEST_TSO6",
    vp.F_HOST_TSO4: "HOST_TSO4", vp.F_HOST_TSO6: "HOST_TSO6", vp.F_MRG_RXBUF: "MRG_RXBUF",
    vp.F_EVENT_IDX: "EVENT_IDX", vp.F_PROTOCOL_FEATURES: "PROTOCOL_FEATURES", vp.F_VERSION_1: "VERSION_1",
}


@pytest.fixture(scope="module", autouse=True)
def dpdk():
    need_vhost()
    need(testpmd.TESTPMD is not None, "dpdk-testpmd is not installed (Debian: apt-get install dpdk-dev; "
         ".ci/prereqs installs it)")


@pytest.fixture
def echo():
    e = UdpEcho()
    yield e
    e.close()


def names(features: int) -> str:
    return " ".join(n for bit, n in sorted(FEATURE_NAMES.items()) if features & bit) or "none"


async def until(what: str, cond, timeout: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        ok = cond()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def check_features(pmd: Testpmd, transport: VhostUserTransport, request, tag: str) -> int:
    """What virtio_user set is what the back end took; reported by name."""
    negotiated = pmd.features()
    assert negotiated == transport.features & ~vp.F_PROTOCOL_FEATURES, (hex(negotiated), hex(transport.features))
    assert negotiated & ~vp.OFFERED_FEATURES == 0, hex(negotiated)
    assert negotiated & vp.F_VERSION_1 and negotiated & vp.F_MRG_RXBUF, names(negotiated)
    report(request, f"{tag}features", f"{negotiated:#x} ({names(negotiated)})")
    return negotiated


def check_clean(stack: Stack, transport: VhostUserTransport) -> dict:
    """No valid frame dropped: no ring drop reason, no stack drop, nothing refused for the guest
    but the frames made before a front end's rings ran (``send_not_ready``)."""
    c = transport.counters()
    assert not transport.broken(), transport.broken()
    drops = {k: v for k, v in c.items() if v and k not in ("tx_frames", "rx_frames", "calls", "kicks", "messages",
                                                              "mem_tables", "rings_resumed", "send_not_ready",
                                                              "send_front_end_gone", "tx_coalesced",
                                                              "tx_calls_deferred", "tx_calls_saved", "tx_calls_late")}
    assert drops == {}, c
    assert stack.counters.get("frames_dropped", 0) == 0, {k: v for k, v in stack.counters.items() if "drop" in k}
    return c


async def exchange(pmd: Testpmd, echo: UdpEcho, bursts: int, burst: int) -> dict[str, int]:
    """``start tx_first bursts`` in icmpecho mode: every datagram to the host echo and back; the
    port's counters once both ends have them all."""
    n = bursts * burst
    before = echo.count
    await pmd.cmd(f"start tx_first {bursts}")
    stats: dict[str, int] = {}

    async def back() -> bool:
        stats.update(await pmd.stats())
        return echo.count - before >= n and stats["RX-packets"] >= n

    try:
        await until(f"{n} datagrams to the host and back", back)
        await asyncio.sleep(0.3)  # nothing more should come
        stats.update(await pmd.stats())
    finally:
        await pmd.cmd("stop")
    assert echo.count - before == n
    return stats


async def test_udp_through_the_rings_both_ways(echo, tmp_path, request):
    """Server mode, the features virtio_user asks for by default: 4 bursts of 32 UDP datagrams to
    the host echo; the 128 echoes arrive in testpmd's port."""
    sock = str(tmp_path / "vu.sock")
    async with Stack(NetworkConfig()) as stack:
        transport = VhostUserTransport(sock)
        serving = asyncio.ensure_future(stack.serve(transport))
        pmd = None
        try:
            await until("the socket", lambda: transport.connected or (tmp_path / "vu.sock").exists())
            pmd = await Testpmd.start(sock, dport=echo.port, burst=32)
            await until("the rings running", lambda: transport.running)
            negotiated = check_features(pmd, transport, request, "default_")
            # DPDK's driver polls: it takes no EVENT_IDX (nor CSUM/TSO without --rx/--tx-offloads).
            assert not negotiated & (vp.F_EVENT_IDX | vp.F_GUEST_CSUM | vp.F_CSUM), names(negotiated)
            stats = await exchange(pmd, echo, 4, 32)
            c = check_clean(stack, transport)
            stack_counters = dict(stack.counters)
        finally:
            if pmd is not None:
                assert await pmd.close() == 0, pmd.tail()
            transport.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, 10)
    report(request, "testpmd_port_stats", stats)
    report(request, "ring_counters", c)
    assert stats["TX-packets"] == 128 and stats["TX-bytes"] == 128 * FRAME and stats["TX-errors"] == 0, stats
    assert echo.lengths == {FRAME - 42: 128}, echo.lengths  # UDP payloads: 64 - 14 - 20 - 8 bytes
    # every frame aioslirp wrote into the RX ring reached testpmd, and among them the 128 echoes
    assert stats["RX-packets"] == c["rx_frames"] >= 128, (stats, c)
    assert stats["RX-missed"] == stats["RX-errors"] == stats["RX-nombuf"] == 0, stats
    assert c["tx_frames"] == 128
    assert c["calls"] == 0, c  # testpmd polls: VRING_AVAIL_F_NO_INTERRUPT on both queues, honoured
    assert stack_counters["udp_datagrams_down"] == 128, stack_counters
    assert transport.front_ends == 1


async def test_client_mode_offloads_loop_killed_and_restarted(echo, tmp_path, request):
    """testpmd listens (``server=1``), the back end connects (client mode); with testpmd's checksum
    and TSO offloads on, virtio_user negotiates CSUM, GUEST_CSUM and the TSO features. 8 datagrams
    loop testpmd (5tswap) -> aioslirp -> host echo -> aioslirp -> testpmd ... until testpmd is
    killed mid-run; a new testpmd on the same path is connected to and served."""
    sock = str(tmp_path / "pmd.sock")
    ups: list[bool] = []
    async with Stack(NetworkConfig()) as stack:
        def front_end(up: bool) -> None:
            ups.append(up)
            if not up:
                stack.reset_flows()

        transport = VhostUserTransport(sock, server=False, reconnect=0.2, on_front_end=front_end)
        serving = asyncio.ensure_future(stack.serve(transport))
        pmd = pmd2 = None
        try:
            pmd = await Testpmd.start(sock, server=True, offloads=True, mode="5tswap", dport=echo.port, burst=8)
            await until("the rings running", lambda: transport.running)
            negotiated = check_features(pmd, transport, request, "offloads_")
            want = (vp.F_CSUM | vp.F_GUEST_CSUM | vp.F_HOST_TSO4 | vp.F_HOST_TSO6 | vp.F_GUEST_TSO4
                    | vp.F_GUEST_TSO6)
            assert negotiated & want == want, names(negotiated)

            await pmd.cmd("start tx_first 1")
            loop = asyncio.get_running_loop()
            t0, n0 = loop.time(), echo.count
            await until("the loop going", lambda: echo.count >= 8 * 20)
            await asyncio.sleep(1.0)
            rate = (echo.count - n0) / (loop.time() - t0)
            report(request, "loop_round_trips_per_s", round(rate))
            pmd.kill()  # mid-run: frames in flight both ways
            assert await pmd.proc.wait() != 0
            await until("the back end to see it go", lambda: ups[-1:] == [False])
            assert not transport.running
            await asyncio.sleep(0.3)  # the host echo has what was on its way
            looped = echo.count
            os.unlink(sock)  # virtio_user in server mode does not replace a stale socket file (QEMU does)
            pmd2 = await Testpmd.start(sock, server=True, offloads=True, dport=echo.port, burst=8)
            await until("the rings running again", lambda: transport.running)
            assert check_features(pmd2, transport, request, "restarted_") == negotiated
            await asyncio.sleep(0.3)
            assert echo.count == looped  # the old loop is gone with its front end
            stats = await exchange(pmd2, echo, 2, 8)
            c = check_clean(stack, transport)
        finally:
            for p in (pmd, pmd2):
                if p is not None:
                    await p.close()
            transport.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, 10)
    report(request, "restarted_port_stats", stats)
    assert looped >= 8 * 20
    assert stats["TX-packets"] == 16 and stats["RX-packets"] >= 16 and stats["RX-errors"] == 0, stats
    assert transport.front_ends == 2 and ups[:3] == [True, False, True], ups
    assert c["tx_frames"] >= looped + 16, c


BIG = 1400  # bytes: a frame of 5 testpmd segments (300 * 4 + 200), 1358 bytes of UDP payload


async def test_chained_frames_and_a_full_rx_ring(echo, tmp_path, request):
    """Small mbufs (512 bytes, 384 of them for data): 1400-byte frames leave testpmd as chains of
    5 segments and their echoes come back merged over 4 RX buffers (MRG_RXBUF). Then, testpmd
    stopped (its RX buffers not refilled), 1000 datagrams from the host for the guest: the RX
    ring fills, the rest waits in aioslirp (no drop) until testpmd polls again, refills and
    kicks: all 1000 arrive."""
    sock = str(tmp_path / "vu.sock")
    async with Stack(NetworkConfig()) as stack:
        transport = VhostUserTransport(sock)
        serving = asyncio.ensure_future(stack.serve(transport))
        pmd = None
        try:
            await until("the socket", lambda: (tmp_path / "vu.sock").exists())
            pmd = await Testpmd.start(sock, dport=echo.port, burst=8,
                                      extra=("--mbuf-size=512", "--enable-scatter", "--txpkts=300,300,300,300,200"))
            await until("the rings running", lambda: transport.running)
            big = await exchange(pmd, echo, 4, 8)
            c0 = transport.counters()

            stats0 = await pmd.stats()
            small = b"x" * 22  # a 64-byte frame
            down0 = stack.counters["udp_datagrams_down"]
            for _ in range(20):  # paced: the loop (aioslirp's too) reads its host socket in between
                for _ in range(50):
                    echo.sock.sendto(small, echo.peer)
                await asyncio.sleep(0.02)
            await until("aioslirp to have them all", lambda: stack.counters["udp_datagrams_down"] - down0 == 1000)
            await asyncio.sleep(0.3)
            in_ring = transport.counters()["rx_frames"] - c0["rx_frames"]
            waiting = transport.bytes_buffered
            assert (await pmd.stats())["RX-packets"] == stats0["RX-packets"]  # not polled while stopped
            await pmd.cmd("start")

            async def all_in() -> bool:
                return (await pmd.stats())["RX-packets"] - stats0["RX-packets"] >= 1000

            try:
                await until("the backlog in testpmd", all_in)
                await asyncio.sleep(0.3)
                stats = await pmd.stats()
            finally:
                await pmd.cmd("stop")
            c = check_clean(stack, transport)
        finally:
            if pmd is not None:
                assert await pmd.close() == 0, pmd.tail()
            transport.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, 10)
    report(request, "rx_ring_took_before_full", in_ring)
    assert echo.lengths[BIG - 42] == 32, echo.lengths
    assert big["TX-packets"] == 32 and big["TX-bytes"] == 32 * BIG, big
    # each echo spans 4 of testpmd's 384-byte RX buffers (12 + 1400 bytes): MRG_RXBUF (testpmd's
    # verbose dump says nb_segs=4; not parsed here: its prompt is written a character at a time,
    # interleaved with the forwarding core's dumps)
    assert big["RX-packets"] == 32 and big["RX-bytes"] == 32 * BIG and big["RX-nombuf"] == 0, big
    assert 0 < in_ring < 1000 and waiting >= (1000 - in_ring) * 64, (in_ring, waiting)
    # all 1000 (and an unsolicited RA or so, if one came meanwhile) went through the ring
    assert stats["RX-packets"] - stats0["RX-packets"] == c["rx_frames"] - c0["rx_frames"] >= 1000, (stats, c)
    assert stats["RX-nombuf"] == 0 and transport.bytes_buffered == 0, stats


async def test_a_restarted_back_end_resumes_testpmd_where_its_rings_are(echo, tmp_path, request):
    """testpmd listens and outlives the back end (``aioslirp vhost-user --client`` restarted):
    virtio_user sets the device up again for the next back end with SET_VRING_BASE 0 while its
    rings are further on. That back end resumes from the used indexes: testpmd's old frames are
    not sent again, the RX queue is not taken for broken, the echoes reach testpmd."""
    sock = str(tmp_path / "pmd.sock")
    pmd = None
    rounds = []
    try:
        for i in range(2):
            async with Stack(NetworkConfig()) as stack:
                transport = VhostUserTransport(sock, server=False, reconnect=0.2)
                serving = asyncio.ensure_future(stack.serve(transport))
                try:
                    if pmd is None:
                        pmd = await Testpmd.start(sock, server=True, dport=echo.port, burst=8)
                    await until("the rings running", lambda: transport.running)
                    await asyncio.sleep(0.3)  # anything taken again would be taken by now
                    stats = await exchange(pmd, echo, 1, 8)
                    rounds.append((stats, transport.counters(), dict(stack.counters), transport.broken()))
                    if i == 1:  # quit while a back end is there: without one, virtio_user may spin at exit
                        rc, pmd = await pmd.close(), pmd
                        assert rc == 0, pmd.tail()
                        pmd = None
                finally:
                    transport.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(serving, 10)
    finally:
        if pmd is not None:
            assert await pmd.close() == 0, pmd.tail()
    (s1, c1, k1, b1), (s2, c2, k2, b2) = rounds
    report(request, "second_back_end_counters", c2)
    assert c1["tx_frames"] == c1["rx_frames"] == 8 and "rings_resumed" not in c1 and not b1, c1
    assert c2.get("rings_resumed") == 2 and not b2, (c2, b2)
    assert c2["tx_frames"] == 8 and k2["frames_in"] == 8, (c2, k2)  # the 8 new frames, not the 8 old again
    assert c2["rx_frames"] == 8 and s2["RX-packets"] == 16 and s2["TX-packets"] == 16, (c2, s2)
    assert echo.count == 16
