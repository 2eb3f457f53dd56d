"""The vhost-user-net back end against a front end written here (tests/support/vhost.py): guest
memory in a memfd, rings laid out by hand. Frames both ways byte for byte (one and several
descriptors, MRG_RXBUF, a guest without RX buffers), then hostile rings: descriptors outside the
memory table, lengths past a region, chains that loop, next indexes past the queue, indirect and
wrongly-writable descriptors (the chain dropped and counted, the queue goes on), avail index
jumps and heads past the queue (the queue marked broken, its error eventfd signalled, walked no
more until set up again), hostile memory tables and messages. Also run under ASan/UBSan
(tests/adversarial/test_native_sanitized.py)."""

from __future__ import annotations

import asyncio
import os
import struct
import time

import pytest

from aioslirp.transport import vhost_proto as vp
from aioslirp.transport import vhost_user as vu
from aioslirp.wire.offload import VNET, OffloadFrame

from support.native import need_vhost
from support.vhost import GPA, SIZE, UVA, FakeFrontEnd, ring_base

ETH = bytes.fromhex("525400123456 525500000202 0800")


def frame(n: int, seed: int = 0) -> bytes:
    return ETH + bytes((seed + i) & 0xFF for i in range(n - len(ETH)))


async def until(cond, timeout: float = 3.0):
    for _ in range(int(timeout / 0.01)):
        v = cond()
        if v:
            return v
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


@pytest.fixture
async def backend(tmp_path):
    need_vhost()
    path = str(tmp_path / "vu.sock")
    got: list = []
    t = vu.VhostUserTransport(path)
    await t.open(lambda frames, csum=None: got.append((list(frames), list(csum or []))))
    fes: list[FakeFrontEnd] = []

    async def connect(**kw) -> FakeFrontEnd:
        fe = FakeFrontEnd(path, **kw)
        fes.append(fe)
        await asyncio.to_thread(fe.setup)
        await until(lambda: t.running)
        return fe

    yield t, got, connect
    t.close()
    for fe in fes:
        fe.close()


def delivered(got) -> list[bytes]:
    return [bytes(f) for frames, _ in got for f in frames]


# ----------------------------------------------------------------------------- frames both ways
async def test_guest_frames_reach_the_sink_byte_exact_and_chains_go_back(backend):
    t, got, connect = backend
    fe = await connect()
    a, b, c = frame(60, 1), frame(1514, 2), frame(65000, 3)
    fe.send_frame(a, vnet=VNET.pack(1, 0, 0, 0, 34, 16, 0))  # NEEDS_CSUM: the guest vouches
    fe.send_frame(b, split=True)  # header and frame in two descriptors
    fe.send_frame(c)  # a 64 KB TSO segment (HOST_TSO4)
    await until(lambda: len(delivered(got)) == 3)
    assert delivered(got) == [a, b, c]
    assert [ok for _, csum in got for ok in csum] == [True, False, False]
    assert [h for h, _ in fe.used(1)] == [0, 1, 3]
    assert fe.calls(1) >= 1
    assert t.counters()["tx_frames"] == 3 and t.frames_in == 3


async def test_frames_for_the_guest_fill_its_buffers_with_num_buffers(backend):
    t, _, connect = backend
    fe = await connect()
    addrs = fe.post_rx(8, 2048)
    small = frame(100, 7)
    off = OffloadFrame(frame(5000, 9))
    off.vnet = VNET.pack(1, 1, 54, 1448, 34, 16, 0)  # a TSO4 segment, partial checksum
    t.send_frames([small, off])
    used = await until(lambda: fe.used(0) or None)
    assert used == [(0, 12 + 100), (1, 2048), (2, 2048), (3, 12 + 5000 - 2 * 2048)]
    assert fe.read(addrs[0], 112) == bytes(10) + struct.pack("<H", 1) + small
    hdr = fe.read(addrs[1], 12)
    assert hdr[:10] == off.vnet[:10] and struct.unpack("<H", hdr[10:])[0] == 3  # MRG_RXBUF: 3 buffers
    body = fe.read(addrs[1] + 12, 2048 - 12) + fe.read(addrs[2], 2048) + fe.read(addrs[3], 5000 + 12 - 4096)
    assert body == bytes(off)
    assert fe.calls(0) >= 1 and t.frames_out == 2


async def test_frames_wait_for_buffers_then_go_when_the_guest_posts_them(backend):
    t, _, connect = backend
    fe = await connect()
    frames = [frame(200, i) for i in range(5)]
    t.send_frames(frames)  # no RX buffer yet
    assert t.frames_out == 0 and t.bytes_buffered == 1000
    addrs = fe.post_rx(5, 2048)  # the guest's kick brings them out
    await until(lambda: t.frames_out == 5)
    assert [fe.read(a + 12, 200) for a in addrs] == frames and t.bytes_buffered == 0


async def test_a_front_end_that_outlived_its_back_end_is_resumed_where_the_rings_are(backend):
    """DPDK virtio_user (``server=1``) keeps its rings when the back end goes, and sends the next
    back end SET_VRING_BASE 0: the queues resume from the used ring's index; the old guest frames
    are not taken again, the RX ring (its avail index now past the queue size from 0) is not
    broken."""
    t, got, connect = backend
    fe = await connect()
    old = [frame(100, i) for i in range(3)]
    for f in old:
        fe.send_frame(f)
    await until(lambda: len(delivered(got)) == 3)
    fe.post_rx(fe.num, 2048)  # every RX buffer, as a polling driver posts them
    t.send_frames([frame(100, 9)])
    await until(lambda: t.frames_out == 1)
    assert fe.used(0) == [(0, 12 + 100)]
    fe.post_rx(1, 2048)  # the buffer given back, posted again: avail index num + 1
    fe.sock.close()  # the back end goes (sees EOF); the same front end comes back, rings as they were
    await until(lambda: not t.connected)
    await asyncio.to_thread(fe.resume, t.path)
    await until(lambda: t.running and t.front_ends == 2)
    assert not t.broken(), t.broken()
    new = frame(200, 5)
    fe.send_frame(new)
    await until(lambda: len(delivered(got)) >= 4)
    await asyncio.sleep(0.05)
    assert delivered(got) == [*old, new] and t.counters()["tx_frames"] == 4  # (counted across front ends)
    t.send_frames([frame(300, 7)])
    assert await until(lambda: fe.used(0)) == [(1, 12 + 300)]  # the next buffer
    assert not t.broken() and t.frames_out == 2 and t.counters()["rings_resumed"] == 2


# ----------------------------------------------------------------------------- hostile TX chains
def _hostile(fe: FakeFrontEnd, kind: str) -> None:
    q, n = 1, fe.num
    h = fe.next_desc[q] % n
    ok = fe.alloc(bytes(12) + frame(80))
    if kind == "desc_out_of_region":
        fe.put_desc(q, h, GPA + SIZE + 4096, 92)
    elif kind == "past_region_end":
        fe.put_desc(q, h, GPA + SIZE - 40, 92)  # starts inside, ends 52 bytes past
    elif kind == "below_region":
        fe.put_desc(q, h, GPA - 16, 92)
    elif kind == "huge_length":
        fe.put_desc(q, h, ok, 0xFFFFFFFF)
    elif kind == "chain_loop":
        fe.put_desc(q, h, ok, 12, 1, (h + 1) % n)
        fe.put_desc(q, (h + 1) % n, ok + 12, 10, 1, h)  # back to the head
    elif kind == "bad_next":
        fe.put_desc(q, h, ok, 12, 1, n + 5)
    elif kind == "indirect":
        fe.put_desc(q, h, ok, 16, 4)
    elif kind == "tx_writable":
        fe.put_desc(q, h, ok, 92, 2)
    elif kind == "tx_truncated":
        fe.put_desc(q, h, ok, 12)  # a header, no frame
    elif kind == "tx_too_large":
        fe.put_desc(q, h, ok, 12, 1, (h + 1) % n)
        fe.put_desc(q, (h + 1) % n, GPA, 70000)
    fe.next_desc[q] += 2
    fe.publish(q, [h])


COUNTED = {"desc_out_of_region": "desc_out_of_region", "past_region_end": "desc_out_of_region",
           "below_region": "desc_out_of_region", "huge_length": "desc_out_of_region", "chain_loop": "chain_loop",
           "bad_next": "bad_next", "indirect": "indirect", "tx_writable": "tx_writable",
           "tx_truncated": "tx_truncated", "tx_too_large": "tx_too_large"}


@pytest.mark.parametrize("kind", list(COUNTED))
async def test_a_hostile_tx_chain_is_dropped_counted_and_the_queue_goes_on(backend, kind):
    t, got, connect = backend
    fe = await connect()
    _hostile(fe, kind)
    good = frame(300, 5)
    await until(lambda: t.counters().get(COUNTED[kind]) == 1)
    fe.send_frame(good)
    await until(lambda: delivered(got))
    assert delivered(got) == [good]
    used = fe.used(1)
    assert used[0][1] == 0 and len(used) == 2  # the bad chain given back empty, then the good one
    assert t.broken() == {}


async def test_an_avail_index_jump_breaks_the_queue_until_it_is_set_up_again(backend):
    t, got, connect = backend
    fe = await connect()
    fe.send_frame(frame(100), kick=False)
    fe.publish(1, [], idx=fe.avail_idx[1] + fe.num + 1)  # more chains than the queue holds
    await until(lambda: t.broken())
    assert t.broken() == {1: "avail_jump"} and t.counters()["avail_jump"] == 1
    assert os.eventfd_read(fe.err[1]) == 1  # SET_VRING_ERR's eventfd told
    fe.publish(1, [], idx=fe.avail_idx[1])  # back to a sane index: still broken, not walked
    os.eventfd_write(fe.kick[1], 1)
    await asyncio.sleep(0.1)
    assert delivered(got) == [] and t.counters()["broken"] >= 1
    await asyncio.to_thread(fe.setup_ring, 1)  # the front end resets the queue
    good = frame(90, 3)
    fe.send_frame(good)
    await until(lambda: delivered(got))
    assert delivered(got) == [good] and t.broken() == {}


async def test_a_head_past_the_queue_breaks_it(backend):
    t, got, connect = backend
    fe = await connect()
    fe.publish(1, [fe.num + 3])
    await until(lambda: t.broken())
    assert t.broken() == {1: "bad_head"} and t.counters()["bad_head"] == 1 and delivered(got) == []


# ----------------------------------------------------------------------------- hostile RX buffers
@pytest.mark.parametrize("kind, counter", [("readonly", "rx_readonly"), ("outside", "desc_out_of_region"),
                                           ("tiny_first", "rx_hdr_split"), ("loop", "chain_loop")])
async def test_hostile_rx_buffers_drop_the_frame_and_are_counted(backend, kind, counter):
    t, _, connect = backend
    fe = await connect()
    q, h = 0, 0
    addr = fe.alloc(4096)
    if kind == "readonly":
        fe.put_desc(q, h, addr, 4096, 0)
    elif kind == "outside":
        fe.put_desc(q, h, GPA + SIZE, 4096, 2)
    elif kind == "tiny_first":
        fe.put_desc(q, h, addr, 4, 2)
    else:  # 0 -> 1 -> 0 -> ...: never enough room, the walk stops after the queue size
        fe.put_desc(q, h, addr, 16, 3, 1)
        fe.put_desc(q, 1, addr, 1, 3, 0)
    fe.next_desc[q] = 2
    fe.publish(q, [h])
    t.send_frames([frame(9000)])  # more than 128 turns of the loop hold
    await until(lambda: t.counters().get(counter))
    assert fe.used(0) == [(0, 0)] and t.counters()["rx_dropped"] == 1 and t.frames_out == 0


async def test_frames_no_buffer_of_the_guest_can_hold_are_dropped_not_kept(backend):
    t, _, connect = backend
    fe = await connect()
    fe.post_rx(fe.num, 16)  # the whole queue of 16-byte buffers: 4 KB in all
    t.send_frames([frame(9000)])
    await until(lambda: t.counters().get("rx_too_small"))
    assert fe.used(0) == [] and t.bytes_buffered == 0


# ----------------------------------------------------------------------------- hostile control messages
async def test_a_memory_region_past_the_end_of_its_file_is_refused(backend):
    t, _, connect = backend
    fe = FakeFrontEnd(t.path)
    try:
        fe.send(vp.SET_PROTOCOL_FEATURES, vp.U64.pack(vp.P_REPLY_ACK))
        table = fe.mem_table([(GPA, SIZE * 4, UVA, 0)])  # the memfd is SIZE bytes: a read past it is SIGBUS
        assert await asyncio.to_thread(fe.ack, vp.SET_MEM_TABLE, table, [fe.fd]) == 1
        assert await asyncio.to_thread(fe.ack, vp.SET_MEM_TABLE, fe.mem_table([(GPA, SIZE, UVA, 1 << 62)]),
                                       [fe.fd]) == 1
        assert t.counters().get("mem_tables", 0) == 0
        await asyncio.to_thread(fe.send, vp.SET_VRING_NUM, vp.VRING_STATE.pack(1, 256))
        base = ring_base(1)  # rings in memory never mapped: refused
        assert await asyncio.to_thread(fe.ack, vp.SET_VRING_ADDR,
                                       vp.VRING_ADDR.pack(1, 0, UVA + base, UVA + base + 0x2000, UVA + base + 0x1000,
                                                          0)) == 1
    finally:
        fe.close()


@pytest.mark.parametrize("kind", ["fds_mismatch", "payload_too_large", "bad_queue", "num_not_power_of_2"])
async def test_protocol_errors_drop_the_front_end_and_the_next_one_is_served(backend, kind):
    t, got, connect = backend
    fe = FakeFrontEnd(t.path)
    try:
        if kind == "fds_mismatch":
            fe.send(vp.SET_MEM_TABLE, fe.mem_table([(GPA, SIZE, UVA, 0), (GPA + SIZE, SIZE, UVA + SIZE, 0)]), [fe.fd])
        elif kind == "payload_too_large":
            fe.sock.sendall(vp.HEADER.pack(vp.SET_FEATURES, 1, 1 << 30))
        elif kind == "bad_queue":
            fe.send(vp.SET_VRING_NUM, vp.VRING_STATE.pack(7, 256))
        else:  # the 16-bit indexes wrap at 65536: ring positions index % num would jump
            fe.send(vp.SET_VRING_NUM, vp.VRING_STATE.pack(1, 100))
        await until(lambda: t.counters().get("protocol_errors") == 1)
        assert fe.sock.recv(1) == b""  # disconnected
    finally:
        fe.close()
    fe2 = await connect()  # the same transport serves the next front end
    good = frame(64, 9)
    fe2.send_frame(good)
    await until(lambda: delivered(got))
    assert delivered(got) == [good] and t.front_ends == 2


async def test_queue_count_and_unknown_requests(backend):
    t, _, connect = backend
    fe = await connect()
    assert await asyncio.to_thread(fe.call_u64, vp.GET_QUEUE_NUM) == 2
    assert await asyncio.to_thread(fe.ack, 99) == 1  # not handled: failure, with REPLY_ACK
    state = await asyncio.to_thread(lambda: (fe.send(vp.GET_VRING_BASE, vp.VRING_STATE.pack(1, 0)),
                                             fe.recv_reply(vp.GET_VRING_BASE))[1])
    assert vp.VRING_STATE.unpack(state) == (1, 0)
    assert t.counters()["unknown"] == 1


async def test_send_frames_never_raises_for_a_frame_that_is_not_bytes(backend):
    t, _, connect = backend
    fe = await connect()
    addrs = fe.post_rx(4, 2048)
    a, b = frame(100), frame(120, 4)
    t.send_frames([a, object(), b])  # type: ignore[list-item] - what a buggy caller might pass
    assert t.counters()["rx_dropped"] == 1 and t.frames_out == 2
    used = await until(lambda: fe.used(0) or None)
    assert used == [(0, 112), (1, 132)]
    assert fe.read(addrs[0] + 12, 100) == a and fe.read(addrs[1] + 12, 120) == b


async def test_a_disabled_ring_is_not_walked_until_enabled_again(backend):
    t, got, connect = backend
    fe = await connect()
    assert await asyncio.to_thread(fe.ack, vp.SET_VRING_ENABLE, vp.VRING_STATE.pack(1, 0)) == 0
    a = frame(70, 1)
    fe.send_frame(a)
    await asyncio.sleep(0.1)
    assert delivered(got) == []
    assert await asyncio.to_thread(fe.ack, vp.SET_VRING_ENABLE, vp.VRING_STATE.pack(1, 1)) == 0
    await until(lambda: delivered(got))
    assert delivered(got) == [a]


async def test_a_frame_waiting_for_more_buffers_than_posted_goes_when_the_guest_adds_them(backend):
    """EVENT_IDX as a Linux driver uses it: it kicks only when avail_event asks. A 5000-byte frame
    needs three 2048-byte buffers; with two posted it waits, and the third (the driver already past
    the index the device was at when it took nothing) must still draw a kick."""
    t, _, connect = backend
    fe = await connect()
    first = fe.post_rx(2, 2048, kick="event")
    big = frame(5000, 6)
    t.send_frames([big])
    await asyncio.sleep(0.05)
    assert fe.used(0) == [] and t.bytes_buffered == 5000
    more = fe.post_rx(1, 2048, kick="event")
    await until(lambda: t.frames_out == 1)
    assert fe.used(0) == [(0, 2048), (1, 2048), (2, 5012 - 4096)]
    got = fe.read(first[0] + 12, 2036) + fe.read(first[1], 2048) + fe.read(more[0], 5012 - 4096)
    assert got == big


async def test_a_device_waiting_for_buffers_does_not_spin(backend):
    """While the guest has too few buffers for the frame that waits, nothing is retried until it
    posts more: no busy loop on the event loop (measured as this process's CPU time)."""
    t, _, connect = backend
    fe = await connect()
    fe.post_rx(1, 2048, kick="event")
    t.send_frames([frame(9000)])
    cpu = time.process_time()
    await asyncio.sleep(0.3)
    cpu = time.process_time() - cpu
    assert t.frames_out == 0 and fe.used(0) == [] and t.bytes_buffered == 9000
    assert cpu < 0.1, f"{cpu:.3f} s of CPU in 0.3 s of waiting"


async def test_random_control_messages_never_raise_and_the_next_front_end_is_served(backend):
    """A front end sending random requests (any number 0..50, any payload up to 300 bytes, zero to
    two fds, NEED_REPLY at random): the transport answers or drops the connection, never raises
    into the loop, and serves a proper front end afterwards."""
    import random
    import socket as socket_mod

    t, got, connect = backend
    loop = asyncio.get_running_loop()
    errors: list = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    memfd = os.memfd_create("x", 0)
    os.ftruncate(memfd, 65536)
    try:
        for _ in range(30):
            s = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
            s.connect(t.path)
            s.setblocking(False)
            for _ in range(rnd.randrange(1, 20)):
                req = rnd.randrange(0, 51)
                payload = rnd.randbytes(rnd.choice([0, 4, 8, 12, 40, rnd.randrange(0, 300)]))
                flags = vp.VERSION | (vp.FLAG_NEED_REPLY if rnd.random() < 0.5 else 0)
                fds = [memfd] * rnd.randrange(0, 3)
                data = vp.HEADER.pack(req, flags, len(payload)) + payload
                anc = [(socket_mod.SOL_SOCKET, socket_mod.SCM_RIGHTS, bytes(struct.pack(f"{len(fds)}i", *fds)))] \
                    if fds else []
                try:
                    s.sendmsg([data], anc)
                except OSError:
                    break
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)
            s.close()
            await until(lambda: not t.connected)  # the transport saw it go
    finally:
        os.close(memfd)
        loop.set_exception_handler(None)
    assert errors == [], (seed, errors[:3])
    fe = await connect()
    good = frame(64, 1)
    fe.send_frame(good)
    await until(lambda: delivered(got))
    assert delivered(got) == [good]


async def test_ring_state_shows_who_waits_for_whom(backend):
    """The debug aid for a stalled guest (SIGUSR1 logs it): a frame waiting for RX buffers the
    guest has too few of, with a kick asked for at the index read; a TX chain made without a kick,
    not taken, no kick pending on its eventfd."""
    t, _, connect = backend
    fe = await connect()
    fe.post_rx(1, 2048, kick="event")
    t.send_frames([frame(9000)])
    fe.send_frame(frame(60), kick=False)
    await asyncio.sleep(0.05)
    state = t.ring_state()
    rx, tx = state["rx"], state["tx"]
    assert rx["pending"] == 1 and rx["avail_idx"] == rx["seen_avail"] == rx["avail_event"] == 1
    assert rx["last_avail"] == 0 and rx["not_taken"] == 1 and rx["started"] and rx["event_idx"] == 1
    assert tx["avail_idx"] == 1 and tx["last_avail"] == 0 and tx["not_taken"] == 1
    assert tx["kick_pending"] is False and tx["started"] and "broken" not in tx
    assert state["counters"]["tx_frames"] == 0
