"""The guest's upload over vhost-user without a copy of its payload, and TX interrupt moderation.

In place: a guest frame of a native TCP flow whose checksum the guest vouched for (NEEDS_CSUM or
DATA_VALID) has only its first ``TCPSINK_ZC_HEAD`` (160) bytes copied out; the headers are parsed
from that copy and the payload goes from guest memory to the host socket (``tcp_frames_in_place``).
Frames split anywhere (headers across descriptors), a frame of more pieces than the engine takes
(copied whole) and one without a vouched checksum (copied whole: the checksum is verified) all
reach the host byte-exact, in order.

Moderation (``tx_coalesce``): a walk that took at least that many bytes and found the ring empty
asks for no kick (the driver's ``avail_event`` stays where it was, ``tx_coalesced`` counts it);
the ring is walked again after ``tx_interval`` and that walk, finding it empty, asks again.
A small frame (request/response) is never moderated: it is kicked for at once.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from aioslirp.transport import vhost_proto as vp

from support.frames import ACK, F4, GUEST_MAC, GW_MAC
from support.frames import tcp_frame as make_frame
from support.native import need_extension, need_vhost
from support.stacks import until
from support.vhost import close_made, engine_device, ring_base

IRS, ISS, GPORT = 7_000_000, 9_000_000, 41000
DATA_VALID = bytes([2]) + bytes(11)  # virtio_net_hdr_v1: the checksum is good
NO_WORD = bytes(12)  # no checksum word: verified by the engine


def avail_event(fe, q: int = 1) -> int:
    """The device's avail_event for queue ``q`` (EVENT_IDX: kick me past this index)."""
    return struct.unpack_from("<H", fe.mem, ring_base(q) + 0x2000 + 4 + 8 * fe.num)[0]


@pytest.fixture
async def upload(tmp_path):
    """``make(**transport_options)``: a transport with a front end, an engine on its rings and one
    adopted, established flow to a loopback listener. Returns ``(transport, front end, engine,
    host socket, send)`` where ``send(data, wait=True, **kw)`` puts the guest's next segment of
    ``data`` on the TX ring (``kw`` to ``send_frame``) and, with ``wait``, waits until the walker
    took it; it returns the frame."""
    need_vhost()
    ext = need_extension()
    made: list = []

    async def make(**options):
        t, fe, lst, port, python_frames = await engine_device(str(tmp_path / "vu.sock"), made,
                                                              vp.OFFERED_FEATURES, **options)
        engine = ext.TcpEngine(-1, True, True, GW_MAC, 1500, 16, 1 << 20, 60.0, 5.0, 1.0, sink=t.tcp_sink())
        t.attach_tcp(engine)
        made.append(engine)
        fe.post_rx(8, size=66 * 1024)
        loop = asyncio.get_running_loop()
        status, _, _ = engine.adopt(False, GUEST_MAC, F4.guest, GPORT, F4.gw, port, socket.inet_aton("127.0.0.1"),
                                    port, IRS, ISS, 1460, 7, 65535, loop.time())
        assert status == 0
        host, _ = lst.accept()
        made.append(host)
        host.setblocking(False)
        seq = [IRS + 1]

        async def send(data: bytes, wait: bool = True, **kw) -> bytes:
            f = make_frame(F4, GPORT, port, ACK, seq=seq[0], ack=ISS + 1, data=data, win=65535)
            seq[0] += len(data)
            n = t.counters().get("tcp_frames_in", 0)
            fe.send_frame(f, **{"vnet": DATA_VALID, **kw})
            if wait:
                assert await until(lambda: t.counters().get("tcp_frames_in", 0) > n, 5.0), t.counters()
            return f

        await send(b"")  # the handshake's last ACK
        assert python_frames == []
        return t, fe, engine, host, send

    yield make
    close_made(made)


async def recv_exactly(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    out = b""
    while len(out) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, n - len(out)), 5.0)
        assert chunk, f"the host socket closed after {len(out)} of {n} bytes"
        out += chunk
    return out


@pytest.mark.parametrize("pieces", [None, [7], [14, 6, 30], [54, 1], [100, 3, 3, 1000], [1] * 60],
                         ids=["one", "7", "headers-split", "payload-from-54", "odd", "60-pieces"])
async def test_segments_in_pieces_reach_the_host_byte_exact_from_guest_memory(upload, pieces):
    t, fe, engine, host, send = await upload()
    sent = b""
    for k in range(5):
        data = bytes((k * 31 + i) & 0xFF for i in range(1400))
        await send(data, pieces=pieces)
        sent += data
    assert await recv_exactly(host, len(sent)) == sent
    c = t.counters()
    assert c["tcp_frames_in"] == 6 and c["tcp_frames_in_place"] == 6, c  # (the handshake's ACK too)


async def test_a_frame_of_more_pieces_than_the_engine_takes_is_copied_whole(upload):
    t, fe, engine, host, send = await upload()
    data = bytes(range(200)) * 5
    await send(data, pieces=[10] + [1] * 70)  # 72 pieces after the header's: over 64
    await send(b"tail" * 10)
    assert await recv_exactly(host, len(data) + 40) == data + b"tail" * 10
    c = t.counters()
    assert c["tcp_frames_in"] == 3 and c["tcp_frames_in_place"] == 2, c  # the handshake's ACK and the tail


async def test_a_frame_without_a_vouched_checksum_is_copied_and_verified(upload):
    t, fe, engine, host, send = await upload()
    good = await send(b"A" * 500, vnet=NO_WORD)  # a correct checksum: verified, taken
    assert await recv_exactly(host, 500) == b"A" * 500
    bad = bytearray(good)
    bad[-1] ^= 0xFF  # the next segment's place, one payload byte changed: a bad checksum
    struct.pack_into("!I", bad, 14 + 20 + 4, IRS + 501)
    n = t.counters()["tcp_frames_in"]
    fe.send_frame(bytes(bad), vnet=NO_WORD)
    assert await until(lambda: t.counters()["tcp_frames_in"] == n + 1, 5.0)
    assert engine.counters()["bad_checksum"] == 1
    await send(b"B" * 300, vnet=NO_WORD, pieces=[20, 30])
    assert await recv_exactly(host, 300) == b"B" * 300
    c = t.counters()
    assert c["tcp_frames_in"] == 4 and c["tcp_frames_in_place"] == 1, c  # the handshake's ACK only


async def test_a_bulk_walk_asks_for_no_kick_and_the_next_empty_walk_asks_again(upload):
    t, fe, engine, host, send = await upload(tx_coalesce=4000, tx_interval=0.3)
    ev0 = avail_event(fe)
    assert ev0 == fe.avail_idx[1]  # the handshake's walk asked for a kick
    sent = b""
    for k in range(4):  # 5,600 bytes in one walk: over the threshold
        data = bytes([65 + k]) * 1400
        await send(data, wait=k == 3, kick=k == 3)
        sent += data
    assert await recv_exactly(host, len(sent)) == sent
    assert t.counters()["tx_coalesced"] == 1
    assert avail_event(fe) == ev0 != fe.avail_idx[1]  # no kick asked: not moved to the index read
    # the walk after the interval finds the ring empty and asks for a kick at the index read
    assert await until(lambda: avail_event(fe) == fe.avail_idx[1], 2.0)
    assert t.counters()["tx_coalesced"] == 1


async def test_frames_made_while_moderated_are_taken_by_the_interval_walk_without_a_kick(upload):
    t, fe, engine, host, send = await upload(tx_coalesce=4000, tx_interval=0.3)
    for k in range(4):
        await send(bytes([97 + k]) * 1400, wait=k == 3, kick=k == 3)
    assert (await recv_exactly(host, 5600))[-1:] == b"d"
    kicks = t.counters()["kicks"]
    await send(b"late" * 100, kick="event")  # as a driver does: a kick only if avail_event asks
    assert await recv_exactly(host, 400) == b"late" * 100
    assert t.counters()["kicks"] == kicks  # none asked, none made: the interval's walk took it


async def test_request_response_frames_are_never_moderated(upload):
    t, fe, engine, host, send = await upload(tx_coalesce=4000, tx_interval=5.0)
    for k in range(20):
        await send(b"q" * 100, kick="event")
        assert await recv_exactly(host, 100) == b"q" * 100
        assert avail_event(fe) == fe.avail_idx[1]  # a kick asked for at once, every time
    assert t.counters()["tx_coalesced"] == 0


async def test_moderation_off_asks_for_a_kick_after_every_walk(upload):
    t, fe, engine, host, send = await upload(tx_coalesce=0)
    for k in range(4):
        await send(bytes([65 + k]) * 1400, wait=k == 3, kick=k == 3)
    assert (await recv_exactly(host, 5600))[:1400] == b"A" * 1400
    assert avail_event(fe) == fe.avail_idx[1] and t.counters()["tx_coalesced"] == 0


@pytest.mark.parametrize("kw, field", [({"tx_coalesce": -1}, "tx_coalesce"), ({"tx_interval": 0}, "tx_interval")])
def test_bad_moderation_options_name_the_field(tmp_path, kw, field):
    need_vhost()
    from aioslirp.transport import vhost_user as vu

    with pytest.raises(ValueError, match=field):
        vu.VhostUserTransport(str(tmp_path / "x.sock"), **kw)
