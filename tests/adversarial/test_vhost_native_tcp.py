"""The native TCP engine over the vhost-user rings (``TcpEngine(sink=transport.tcp_sink())``,
``transport.attach_tcp(engine)``), against the front end written here (tests/support/vhost.py) and a
real host socket on loopback: the guest's frames go to the engine in the ring walker (never to the
Python sink), the engine's frames go into the RX ring, wait in order while the guest has no
buffer and go when it posts some; a driver that did not accept GUEST_CSUM gets complete
checksums, one that did not accept GUEST_TSO4 no 64 KB segment (dropped, counted)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from aioslirp.transport import vhost_proto as vp

from support.frames import ACK, F4, GUEST_MAC, GW_MAC, SYN, tcp_frame
from support.native import need_extension, need_vhost
from support.native_tcp import decode
from support.stacks import until
from support.vhost import close_made, engine_device

IRS, ISS, GPORT = 1_000_000, 5_000_000, 40000
DATA_VALID = bytes([2]) + bytes(11)  # virtio_net_hdr_v1: the checksum is good


@pytest.fixture
async def flow(tmp_path):
    """``make(features)``: a transport with a front end, an engine on its rings, one adopted flow
    to a loopback listener: ``(transport, front end, engine, host socket, rx)`` where ``rx(fe)``
    returns the frames written to the guest since the last call (vnet header, frame)."""
    need_vhost()
    ext = need_extension()
    made: list = []

    async def make(features: int = vp.OFFERED_FEATURES):
        t, fe, lst, port, python_frames = await engine_device(str(tmp_path / "vu.sock"), made, features)
        engine = ext.TcpEngine(-1, True, True, GW_MAC, 1500, 16, 1 << 20, 60.0, 5.0, 1.0, sink=t.tcp_sink())
        t.attach_tcp(engine)
        made.append(engine)
        bufs: dict[int, int] = {}

        def post(n: int) -> None:
            first = fe.next_desc[0]
            for i, addr in enumerate(fe.post_rx(n, size=66 * 1024)):
                bufs[(first + i) % fe.num] = addr

        def rx() -> list[tuple[bytes, bytes]]:
            out = []
            for head, n in fe.used(0):
                data = fe.read(bufs[head], n)
                out.append((data[:12], data[12:]))
            return out

        post(2)
        loop = asyncio.get_running_loop()
        status, _, _ = engine.adopt(False, GUEST_MAC, F4.guest, GPORT, F4.gw, port, socket.inet_aton("127.0.0.1"),
                                    port, IRS, ISS, 1460, 7, 65535, loop.time())
        assert status == 0
        host, _ = lst.accept()
        return t, fe, engine, host, rx, post, python_frames

    yield make
    close_made(made)


async def test_guest_frames_go_to_the_engine_and_its_frames_wait_for_buffers_in_order(flow):
    t, fe, engine, host, rx, post, python_frames = await flow()
    ((hdr, syn_ack),) = rx()  # the SYN-ACK, written into the ring by the engine
    assert struct.unpack_from("<H", hdr, 10)[0] == 1  # num_buffers
    ip = 14
    assert syn_ack[ip + 33] == SYN | ACK and struct.unpack_from("!I", syn_ack, ip + 24)[0] == ISS
    # the guest's ACK with data: taken by the engine in the ring walker, not the Python sink
    fe.send_frame(tcp_frame(F4, GPORT, host.getsockname()[1], ACK, seq=IRS + 1, ack=ISS + 1, data=b"hello",
                            win=65535), vnet=DATA_VALID)
    assert await until(lambda: t.counters().get("tcp_frames_in") == 1, 5.0)
    host.settimeout(5)
    assert host.recv(100) == b"hello" and python_frames == []
    # 400 KB from the host: more 64 KB segments than the guest has buffers (1 left): they wait
    data = bytes(i * 7 & 0xFF for i in range(400_000))
    host.sendall(data)
    await asyncio.sleep(0.2)
    engine.poll()
    got = rx()
    c = t.counters()
    assert c["tcp_frames_waited"] > 0 and c["tcp_rx_bytes_waiting"] > 0, c
    post(64)  # buffers at last (kicked): what waited goes first, in order
    await asyncio.sleep(0.05)
    got += rx()
    seqs = [struct.unpack_from("!I", f, 14 + 24)[0] for _, f in got]
    assert seqs == sorted(seqs) and seqs[0] == ISS + 1, seqs
    assert any(h[1] == 1 for h, _ in got)  # GSO TCPV4: 64 KB segments (GUEST_TSO4 accepted)
    # the guest acknowledges what it got, the engine sends the rest: all of it, byte-exact
    segs: dict[int, bytes] = {}
    for _ in range(200):
        for _, f in got:
            segs[struct.unpack_from("!I", f, 14 + 24)[0]] = f[14 + 20 + (f[14 + 32] >> 4) * 4:]
        got = []
        payload, nxt = b"", ISS + 1
        while nxt in segs and segs[nxt]:
            payload += segs[nxt]
            nxt += len(segs[nxt])
        if len(payload) >= len(data):
            break
        post(max(0, 8 - (fe.next_desc[0] - fe.used_seen[0]) % 65536))
        fe.send_frame(tcp_frame(F4, GPORT, host.getsockname()[1], ACK, seq=IRS + 6, ack=nxt, win=65535),
                      vnet=DATA_VALID)
        await asyncio.sleep(0.02)
        engine.poll()
        got = rx()
    assert payload == data
    c = t.counters()
    assert c["tcp_rx_bytes_waiting"] == 0 and not c.get("tcp_rx_full") and not c.get("tcp_rx_dropped"), c
    assert python_frames == []


async def test_a_driver_without_guest_csum_and_tso_gets_complete_checksums_and_no_64k_segment(flow):
    features = vp.OFFERED_FEATURES & ~(vp.F_GUEST_CSUM | vp.F_GUEST_TSO4 | vp.F_GUEST_TSO6)
    t, fe, engine, host, rx, post, _ = await flow(features)
    ((hdr, syn_ack),) = rx()
    assert hdr[0] & 1 == 0  # no NEEDS_CSUM: completed here
    seg = decode(syn_ack, False)  # verifies the TCP checksum
    assert seg.flags == SYN | ACK and seg.seq == ISS
    fe.send_frame(tcp_frame(F4, GPORT, host.getsockname()[1], ACK, seq=IRS + 1, ack=ISS + 1, win=65535),
                  vnet=DATA_VALID)
    assert await until(lambda: t.counters().get("tcp_frames_in") == 1, 5.0)
    host.sendall(b"x" * 100_000)
    await asyncio.sleep(0.2)
    engine.poll()
    assert t.counters().get("tcp_gso_refused", 0) >= 1


async def test_a_python_frame_waiting_with_the_engines_goes_when_buffers_come(flow):
    """Both sides' frames wait for RX buffers (the engine's in C, a Python-path frame such as an
    ARP reply in the transport); the guest posts buffers and kicks once. The engine's go first,
    and the Python frame must go too in the buffers left: a Linux driver posts no more (it refills
    only when half its ring is used), so no other kick would come for it."""
    t, fe, engine, host, rx, post, python_frames = await flow()
    rx()  # the SYN-ACK
    fe.send_frame(tcp_frame(F4, GPORT, host.getsockname()[1], ACK, seq=IRS + 1, ack=ISS + 1, win=65535),
                  vnet=DATA_VALID)  # the guest's window: 8 MB (scaled)
    assert await until(lambda: t.counters().get("tcp_frames_in") == 1, 5.0)
    host.sendall(bytes(400_000))
    await asyncio.sleep(0.2)
    engine.poll()
    rx()
    assert t.counters()["tcp_frames_waited"] > 0
    arp_reply = bytes.fromhex("525400123456 525500000202 0806") + bytes(range(46))
    t.send_frames([arp_reply])
    assert t.bytes_buffered == len(arp_reply)  # no buffer: it waits
    post(32)
    assert await until(lambda: t.bytes_buffered == 0, 2.0), repr(t.ring_state())
    got = [f for _, f in rx()]
    assert got[-1] == arp_reply and t.counters()["tcp_rx_bytes_waiting"] == 0
    host.close()


async def test_a_segment_after_a_fragment_in_one_walk_goes_to_python_behind_it(flow):
    """The vhost-user TX walk, as the TAP reader (``reorders_later``): the last IPv4 fragment of a
    native flow's segment (Python reassembles it, then hands the segment to the engine) and the
    flow's next segment in the same walk. The next one went to the engine at once, ahead of the
    reassembled one, and was dropped as out of order (the guest had to send it again); it goes
    to Python behind the fragment now, and a plain walk after it is the engine's again."""
    t, fe, engine, host, rx, post, python_frames = await flow()
    try:
        rx()
        port = host.getsockname()[1]
        first = bytes(range(256)) * 4 + bytes(12)
        seg = tcp_frame(F4, GPORT, port, ACK, seq=IRS + 1, ack=ISS + 1, data=first, win=65535)[14 + 20:]
        cut = len(seg) - 8
        frag1 = F4.frame(F4.packet(seg[:cut], 6, id=5, mf=1, offset=0))
        frag2 = F4.frame(F4.packet(seg[cut:], 6, id=5, mf=0, offset=cut >> 3))
        nxt = tcp_frame(F4, GPORT, port, ACK, seq=IRS + 1 + len(first), ack=ISS + 1, data=b"next", win=65535)
        fe.send_frame(frag1, vnet=DATA_VALID, kick=False)
        fe.send_frame(frag2, vnet=DATA_VALID, kick=False)
        fe.send_frame(nxt, vnet=DATA_VALID)  # one kick: one walk takes all three
        assert await until(lambda: len(python_frames) >= 3, 5.0), python_frames
        assert python_frames == [frag1, frag2, nxt]
        assert not t.counters().get("tcp_frames_in")
        plain = tcp_frame(F4, GPORT, port, ACK, seq=IRS + 1, ack=ISS + 1, data=b"plain", win=65535)
        fe.send_frame(plain, vnet=DATA_VALID)
        assert await until(lambda: t.counters().get("tcp_frames_in") == 1, 5.0)
        host.settimeout(5)
        assert host.recv(100) == b"plain" and len(python_frames) == 3
    finally:
        host.close()
