"""The native TCP engine's frames written in place in the vhost-user RX ring (issue 27: one copy,
the host socket peeked straight into the guest's buffers; tcpsink.h reserve/commit/release,
vring.c vr_rx_reserve), against the front end written here (tests/support/vhost.py) and a real
host socket on loopback.

The guest here posts chains as a Linux driver does (4 KB mergeable buffers; or, without
MRG_RXBUF, a 12-byte header descriptor and pages), reads every used entry, rebuilds the frames
(num_buffers) and acknowledges what came in order. Each test checks the download byte for byte,
which path carried it (``tcp_frames_direct``: in place; the rest through the copying writer),
and that no byte was written past any buffer the guest posted (a guard after each)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from aioslirp.transport import vhost_proto as vp

from support.frames import ACK, F4, F6, GUEST_MAC, GW_MAC, SYN, tcp_frame
from support.native import need_extension, need_vhost
from support.vhost import GPA, FakeFrontEnd, close_made, engine_device, ring_base

IRS, ISS, GPORT = 1_000_000, 5_000_000, 40000
DATA_VALID = bytes([2]) + bytes(11)  # virtio_net_hdr_v1: the checksum is good
GUARD = b"\xa5" * 64
WSCALE = 7


class RxDriver:
    """The guest's RX side: chains posted (each a list of (gpa, size)), used entries read back."""

    def __init__(self, fe: FakeFrontEnd, mrg: bool) -> None:
        self.fe = fe
        self.mrg = mrg
        self.chains: dict[int, list[tuple[int, int]]] = {}
        self.guards: dict[int, list[int]] = {}  # head: the guards after its buffers
        self.outstanding = 0  # descriptors posted and not yet used
        self.bad_used = 0  # used entries of length 0 (chains given back unfilled)

    def post(self, n: int, sizes=(4096,), bad: dict | None = None) -> None:
        """``n`` chains of descriptors ``sizes``; ``bad``: {index in this call: (gpa, len, flags)}
        for the chain's first descriptor (a hostile chain)."""
        fe, heads = self.fe, []
        for c in range(n):
            head = fe.next_desc[0] % fe.num
            descs, guards = [], []
            for j, size in enumerate(sizes):
                i = fe.next_desc[0] % fe.num
                addr = fe.alloc(size + len(GUARD))
                fe.mem[addr - GPA + size:addr - GPA + size + len(GUARD)] = GUARD
                guards.append(addr + size)
                flags = 2 | (1 if j < len(sizes) - 1 else 0)
                if bad and c in bad and j == 0:
                    addr, size, flags = bad[c][0], bad[c][1], bad[c][2] | (flags & 1)
                fe.put_desc(0, i, addr, size, flags, (fe.next_desc[0] + 1) % fe.num)
                fe.next_desc[0] += 1
                descs.append((addr, size))
            self.chains[head] = descs
            self.guards[head] = guards
            heads.append(head)
        self.outstanding += n * len(sizes)
        fe.publish(0, heads)

    def guards_intact(self) -> bool:
        return all(self.fe.read(a, len(GUARD)) == GUARD for guards in self.guards.values() for a in guards)

    def frames(self) -> list[tuple[bytes, bytes]]:
        """(vnet header, frame) of every frame published since the last call."""
        entries = []
        for head, n in self.fe.used(0):
            descs = self.chains[head]
            self.outstanding -= len(descs)
            data = b""
            for a, s in descs:
                if len(data) >= n:
                    break
                data += self.fe.read(a, min(s, n - len(data)))
            entries.append(data)
        out, i = [], 0
        while i < len(entries):
            data = entries[i]
            i += 1
            if not data:
                self.bad_used += 1
                continue
            hdr, frame = data[:12], data[12:]
            nb = struct.unpack_from("<H", hdr, 10)[0] if self.mrg else 1
            assert nb >= 1 and i + nb - 1 <= len(entries), (nb, i, len(entries))
            for _ in range(nb - 1):
                frame += entries[i]
                i += 1
            out.append((hdr, frame))
        return out


@pytest.fixture
async def flow(tmp_path):
    """``make(features, direct=True)``: a transport with a front end, an engine on its rings, one
    adopted flow to a loopback listener; returns (transport, front end, engine, host socket)."""
    need_vhost()
    ext = need_extension()
    made: list = []

    async def make(features: int = vp.OFFERED_FEATURES, direct: bool = True, fam=F4, peek_off: bool = True,
                   num: int = 256):
        t, fe, lst, port, _ = await engine_device(str(tmp_path / "vu.sock"), made, features, af=fam.af,
                                                  loopback=fam.loopback, setup=lambda fe: fe.setup(num=num))
        t._dev.set_rx_direct(direct)
        engine = ext.TcpEngine(-1, True, True, GW_MAC, 1500, 16, 1 << 20, 60.0, 5.0, 1.0, sink=t.tcp_sink(),
                               peek_off=peek_off)
        t.attach_tcp(engine)
        made.append(engine)
        loop = asyncio.get_running_loop()
        status, _, _ = engine.adopt(fam is F6, GUEST_MAC, fam.guest, GPORT, fam.gw, port,
                                    socket.inet_pton(fam.af, fam.loopback), port, IRS, ISS, 1460, WSCALE, 65535,
                                    loop.time())
        assert status == 0
        host, _ = lst.accept()
        made.append(host)
        return t, fe, engine, host

    yield make
    close_made(made)


def payload_of(frame: bytes) -> tuple[int, bytes]:
    ip = 14
    if frame[ip] >> 4 == 6:
        t, total = ip + 40, 40 + struct.unpack_from("!H", frame, ip + 4)[0]
    else:
        t, total = ip + (frame[ip] & 0xF) * 4, struct.unpack_from("!H", frame, ip + 2)[0]
    assert len(frame) == ip + total, (len(frame), total)  # nothing past the IP datagram: no garbage
    return struct.unpack_from("!I", frame, t + 4)[0], frame[t + (frame[t + 12] >> 4) * 4:]


def _sum16(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def check_offload(hdr: bytes, frame: bytes) -> None:
    """The vnet header as a driver reads it (NEEDS_CSUM: csum_start/offset; GSO above the MSS) and
    the TCP checksum once the driver completes it."""
    flags, gso, hdr_len, gso_size, start, off = struct.unpack_from("<BBHHHH", hdr)
    v6 = frame[14] >> 4 == 6
    iphl = 40 if v6 else 20
    assert flags == 1 and start == 14 + iphl and off == 16, (flags, start, off)
    seg = bytearray(frame[start:])
    plen = len(seg) - (seg[12] >> 4) * 4
    mss = 1500 - iphl - 20
    assert (gso, gso_size) == (((4 if v6 else 1), mss) if plen > mss else (0, 0)), (gso, gso_size, plen)
    c = (~_sum16(bytes(seg))) & 0xFFFF  # what the driver writes at start + off
    struct.pack_into("!H", seg, 16, c)
    ip = frame[14:]
    src, dst = (ip[8:24], ip[24:40]) if v6 else (ip[12:16], ip[16:20])
    pseudo = src + dst + (struct.pack("!IxxxB", len(seg), 6) if v6 else struct.pack("!xBH", 6, len(seg)))
    assert _sum16(pseudo + bytes(seg)) == 0xFFFF


async def download(t, fe, engine, host, guest: RxDriver, size: int, *, window: int, post, rounds: int = 600,
                   fam=F4) -> bytes:
    """The host sends ``size`` bytes; the guest posts buffers with ``post(guest)`` each round,
    reads the frames, acknowledges what came in order with ``window`` bytes of window. Returns what
    the guest got in order."""
    data = bytes((i * 7 + (i >> 12)) & 0xFF for i in range(size))
    sender = asyncio.ensure_future(asyncio.to_thread(host.sendall, data))
    segs: dict[int, bytes] = {}
    nxt, got = ISS + 1, b""
    # the SYN-ACK first (the copying writer: a SYN's options)
    for _ in range(100):
        frames = guest.frames()
        if frames:
            break
        await asyncio.sleep(0.01)
    ((_, syn_ack),) = frames
    assert syn_ack[14 + (53 if fam is F6 else 33)] == SYN | ACK
    for _ in range(rounds):
        if len(got) >= size:
            break
        post(guest)
        fe.send_frame(tcp_frame(fam, GPORT, host.getsockname()[1], ACK, seq=IRS + 1, ack=nxt,
                                win=window >> WSCALE), vnet=DATA_VALID)
        await asyncio.sleep(0.005)
        engine.poll()
        await asyncio.sleep(0.005)
        for hdr, frame in guest.frames():
            check_offload(hdr, frame)
            seq, pay = payload_of(frame)
            if pay:
                segs[seq] = pay
        while nxt in segs:
            pay = segs.pop(nxt)
            got += pay
            nxt += len(pay)
    await sender
    return got


def topup(n: int, sizes=(4096,)):
    """A driver that keeps n descriptors of its ring posted."""
    def post(guest: RxDriver) -> None:
        per = len(sizes)
        want = (n - guest.outstanding) // per
        if want > 0:
            guest.post(want, sizes)
    return post


@pytest.mark.parametrize(("direct", "fam", "peek_off"), [(True, F4, True), (False, F4, True), (True, F6, True),
                                                         (True, F4, False)],
                         ids=["in_place", "copied", "in_place_ipv6", "in_place_without_peek_off"])
async def test_a_download_into_mergeable_4k_buffers_is_byte_exact_in_place_and_copied(flow, direct, fam, peek_off):
    t, fe, engine, host = await flow(direct=direct, fam=fam, peek_off=peek_off)
    guest = RxDriver(fe, mrg=True)
    guest.post(8)
    size = 3_000_000
    got = await download(t, fe, engine, host, guest, size, window=200_000, post=topup(200), fam=fam)
    assert len(got) == size and got == bytes((i * 7 + (i >> 12)) & 0xFF for i in range(size))
    c = t.counters()
    assert guest.guards_intact() and guest.bad_used == 0
    assert not c.get("tcp_rx_dropped") and not c.get("tcp_rx_full"), c
    if direct:  # (all but the handshake's and the ACKs: in place)
        assert c["tcp_frames_direct"] >= size // 65495 and c["tcp_frames_direct"] >= c["tcp_frames_out"] // 2, c
    else:
        assert c["tcp_frames_direct"] == 0, c


async def test_without_mrg_rxbuf_a_chain_of_header_and_pages_takes_a_64k_frame_in_place(flow):
    """Linux without MRG_RXBUF (big packets): each chain is a 12-byte header descriptor and pages."""
    t, fe, engine, host = await flow(vp.OFFERED_FEATURES & ~vp.F_MRG_RXBUF)
    guest = RxDriver(fe, mrg=False)
    sizes = (12,) + (4096,) * 17
    guest.post(2, sizes)
    size = 1_000_000
    got = await download(t, fe, engine, host, guest, size, window=150_000, post=topup(4 * len(sizes), sizes))
    assert got == bytes((i * 7 + (i >> 12)) & 0xFF for i in range(size))
    c = t.counters()
    assert guest.guards_intact() and c["tcp_frames_direct"] >= size // 65495, c


async def test_too_few_buffers_then_more_the_frames_wait_in_order_and_all_arrive(flow):
    """A ring short of buffers (fewer than one 64 KB frame needs): no reservation; the copying
    writer keeps the frames, in order, until buffers come; then in place again."""
    t, fe, engine, host = await flow()
    guest = RxDriver(fe, mrg=True)
    guest.post(4)
    rounds = {"n": 0}

    def post(g: RxDriver) -> None:
        rounds["n"] += 1
        if rounds["n"] > 10:  # 10 rounds starved (3 buffers at a time), then plenty
            topup(200)(g)
        elif g.outstanding < 3:
            g.post(3 - g.outstanding)

    size = 1_500_000
    got = await download(t, fe, engine, host, guest, size, window=300_000, post=post)
    assert got == bytes((i * 7 + (i >> 12)) & 0xFF for i in range(size))
    c = t.counters()
    assert c["tcp_frames_waited"] > 0 and c["tcp_direct_short"] > 0 and c["tcp_frames_direct"] > 0, c
    assert guest.guards_intact() and not c.get("tcp_rx_dropped"), c


async def test_buffers_too_small_without_mrg_are_not_reserved_and_the_frame_is_dropped_and_counted(flow):
    t, fe, engine, host = await flow(vp.OFFERED_FEATURES & ~vp.F_MRG_RXBUF)
    guest = RxDriver(fe, mrg=False)
    guest.post(1, (2048,))  # the SYN-ACK's
    await asyncio.sleep(0.05)
    assert len(guest.frames()) == 1
    guest.post(16, (2048,))
    fe.send_frame(tcp_frame(F4, GPORT, host.getsockname()[1], ACK, seq=IRS + 1, ack=ISS + 1, win=2000),
                  vnet=DATA_VALID)
    host.sendall(b"x" * 200_000)
    await asyncio.sleep(0.1)
    engine.poll()
    await asyncio.sleep(0.05)
    c = t.counters()
    assert c["tcp_frames_direct"] == 0 and c.get("rx_too_small", 0) >= 1 and c.get("tcp_rx_dropped", 0) >= 1, c
    assert guest.frames() == [] and guest.guards_intact()


OUTSIDE = [
    (GPA - 8192, 4096, 2),  # below the region
    (GPA + 4 * 1024 * 1024 - 100, 4096, 2),  # across the region's end
    (GPA + 16 * 1024 * 1024, 4096, 2),  # past it
    (GPA + 0x300000, 4096, 0),  # read-only
    (2**64 - 2048, 4096, 2),  # wraps around
]


@pytest.mark.parametrize("bad", OUTSIDE, ids=["below", "across_end", "past", "read_only", "wraps"])
async def test_a_hostile_chain_among_reserved_ones_is_never_written_and_the_download_completes(flow, bad):
    """A bad chain lies among the ones a reservation would take (after enough for the first 64 KB
    frame): the reservation stops before it (nothing written through it), the frame reserved goes
    in place, the copying writer meets the bad chain, gives it back empty and counts it, and TCP
    retransmits the frame it dropped: the download is whole."""
    t, fe, engine, host = await flow()
    guest = RxDriver(fe, mrg=True)
    guest.post(8)
    state = {"n": 0}

    def post(g: RxDriver) -> None:
        state["n"] += 1
        if state["n"] == 3:
            g.post(40, bad={20: bad})  # 20 good (80 KB: one 64 KB frame), the bad one, 19 good
        else:
            topup(200)(g)

    size = 1_000_000
    got = await download(t, fe, engine, host, guest, size, window=200_000, post=post)
    assert got == bytes((i * 7 + (i >> 12)) & 0xFF for i in range(size))
    c = t.counters()
    why = "rx_readonly" if bad[2] == 0 else "desc_out_of_region"
    # (the copying writer gives back every chain it took for the frame it dropped: the bad one too)
    assert c.get(why) == 1 and guest.bad_used >= 1 and c["tcp_frames_direct"] > 0, c
    assert guest.guards_intact() and t._dev.broken(0) is None


async def test_buffers_reserved_and_not_filled_go_back_unseen_and_are_taken_next_in_order(flow):
    """A short read into a reservation of several frames: one frame is published (one 4 KB buffer),
    the other buffers reserved go back: the used ring shows nothing else, and the next frame takes
    the very next buffer."""
    t, fe, engine, host = await flow()
    guest = RxDriver(fe, mrg=True)
    guest.post(1)
    await asyncio.sleep(0.05)
    assert len(guest.frames()) == 1  # the SYN-ACK
    first = fe.next_desc[0] % fe.num
    guest.post(100)
    fe.send_frame(tcp_frame(F4, GPORT, host.getsockname()[1], ACK, seq=IRS + 1, ack=ISS + 1, win=2000),
                  vnet=DATA_VALID)  # 256 KB of window: a reservation of 4 frames
    await asyncio.sleep(0.05)
    for i, chunk in enumerate((b"a" * 1000, b"b" * 3000)):
        host.sendall(chunk)
        await asyncio.sleep(0.05)
        engine.poll()
        await asyncio.sleep(0.02)
        used = fe.used(0)
        assert [h for h, _ in used] == [(first + i) % fe.num], used  # the next buffer, only it
        ((head, n),) = used
        data = fe.read(guest.chains[head][0][0], n)
        assert struct.unpack_from("<H", data, 10)[0] == 1 and payload_of(data[12:])[1] == chunk
    c = t.counters()
    assert c["tcp_frames_direct"] == 2 and guest.guards_intact(), c


@pytest.mark.parametrize("part", ["desc", "avail", "used"])
async def test_a_chain_over_the_rx_ring_itself_harms_only_that_guest(flow, part):
    """A chain among the reserved ones whose buffer is the RX queue's own descriptor table, avail
    ring or used ring (inside guest memory: a valid buffer). The host's bytes are peeked over it in
    place; whatever the ring says from then on (an avail index that jumps, heads or descriptors of
    host bytes, used entries the driver misreads) is checked as any guest's: the queue breaks or
    its chains are dropped, counted, or the frames go on; no crash, nothing written outside guest
    memory (the sanitizer run). What the guest then reads is its own doing: not checked."""
    t, fe, engine, host = await flow()
    guest = RxDriver(fe, mrg=True)
    guest.post(8)
    at = GPA + ring_base(0) + {"desc": 0, "avail": 0x1000, "used": 0x2000}[part]
    state: dict = {"n": 0}
    seen: dict = {}
    used = fe.used

    def spy(q):  # the used entries as published (before the driver's own reading of them)
        out = used(q)
        for h, n in out:
            seen.setdefault(h, []).append(n)
        return out

    def post(g: RxDriver) -> None:
        state["n"] += 1
        if state["n"] == 1:
            state["bad"] = (fe.next_desc[0] + 20) % fe.num
            g.post(40, bad={20: (at, 4096, 2)})
        else:
            topup(200)(g)

    fe.used = spy
    try:
        await download(t, fe, engine, host, guest, 400_000, window=200_000, post=post, rounds=60)
    except AssertionError:
        pass  # the driver read back a ring of host bytes
    finally:
        fe.used = used
    c = t.counters()
    assert seen.get(state["bad"]) == [4096], (seen.get(state["bad"]), c)  # peeked into the ring, committed
    assert c["tcp_frames_direct"] > 0 and t._dev.ready(0), c


@pytest.mark.parametrize("mrg", [True, False], ids=["mrg_rxbuf", "without_mrg_rxbuf"])
async def test_a_ring_of_one_takes_the_download_in_place_a_frame_at_a_time(flow, mrg):
    """Queues of size 1 (both): one chain of one buffer at a time; a reservation holds that one
    chain, never more (vr_rx_reserve: the queue's arrays have one entry). Byte-exact."""
    features = vp.OFFERED_FEATURES if mrg else vp.OFFERED_FEATURES & ~vp.F_MRG_RXBUF
    t, fe, engine, host = await flow(features=features, num=1)
    guest = RxDriver(fe, mrg=mrg)
    size = 400_000

    def post(g: RxDriver) -> None:
        if g.outstanding == 0:
            g.post(1, (12 + 14 + 20 + 20 + 65536,))

    post(guest)  # (for the SYN-ACK)
    got = await download(t, fe, engine, host, guest, size, window=200_000, post=post)
    assert got == bytes((i * 7 + (i >> 12)) & 0xFF for i in range(size))
    c = t.counters()
    assert c["tcp_frames_direct"] > 0 and guest.guards_intact() and t._dev.broken(0) is None, c
