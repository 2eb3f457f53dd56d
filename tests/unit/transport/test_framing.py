"""QEMU transports without a VM: the sans-IO stream framer, StreamTransport and DgramTransport over
real socketpairs, QemuServer and ``aioslirp qemu`` against a scripted fake guest."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st

from aioslirp import NetworkConfig, Stack
from aioslirp.frontends.qemu import QemuServer, SocketInUse, transport_for_fd
from aioslirp.transport.base import MAX_FRAME
from aioslirp.transport.dgram import DgramTransport
from aioslirp.transport.framing import FrameTooLarge, StreamDecoder, encode_frames
from aioslirp.transport.stream import StreamTransport

from support.frames import GUEST_MAC

FRAMES = [b"", b"\x01", bytes(range(14)), os.urandom(1514), os.urandom(9000), os.urandom(MAX_FRAME)]


def wire(frames) -> bytes:
    return b"".join(bytes(b) for b in encode_frames(frames))


# ----------------------------------------------------------------------------- framer
def test_framer_whole_input():
    d = StreamDecoder()
    assert d.feed(wire(FRAMES)) == FRAMES
    assert d.pending == 0


def test_framer_byte_by_byte():
    d = StreamDecoder()
    data = wire(FRAMES[:5])
    out = []
    for i in range(len(data)):
        out += d.feed(data[i:i + 1])
    assert out == FRAMES[:5]
    assert d.pending == 0


def test_framer_trailing_bytes_kept_for_next_feed():
    d = StreamDecoder()
    data = wire(FRAMES[2:4]) + wire([b"tail-frame"])
    # everything but the last 5 bytes: two whole frames out, the rest pending
    assert d.feed(data[:-5]) == FRAMES[2:4]
    assert d.pending == 4 + len(b"tail-frame") - 5  # its prefix and 5 of its 10 bytes
    assert d.feed(data[-5:]) == [b"tail-frame"]
    assert d.pending == 0
    # a partial length prefix alone is trailing data too
    assert d.feed(b"\x00\x00") == []
    assert d.pending == 2
    assert d.feed(b"\x00\x03abc") == [b"abc"]


@given(st.lists(st.binary(max_size=3000), max_size=12), st.lists(st.integers(1, 5000), max_size=40))
@settings(max_examples=300, deadline=None)
def test_framer_any_split(frames, cuts):
    data = wire(frames)
    d = StreamDecoder()
    out, pos = [], 0
    for c in cuts:
        out += d.feed(data[pos:pos + c])
        pos += c
    out += d.feed(data[pos:])
    assert out == frames


def test_framer_oversized_length_fails_before_allocating():
    d = StreamDecoder(max_frame=2000)
    good = wire([b"x" * 2000])
    with pytest.raises(FrameTooLarge) as ei:
        d.feed(good + struct.pack("!I", 2001) + b"y" * 100)
    assert ei.value.length == 2001 and ei.value.max_frame == 2000
    assert d.pending == 0  # nothing of the bad frame was buffered
    with pytest.raises(FrameTooLarge):  # the stream cannot be resynchronised
        d.feed(b"\x00\x00\x00\x01z")
    # the same through a prefix split over two feeds, with a 4 GiB length
    d = StreamDecoder()
    assert d.feed(b"\xff\xff") == []
    with pytest.raises(FrameTooLarge) as ei:
        d.feed(b"\xff\xff" + b"z" * 10)
    assert ei.value.length == 0xFFFFFFFF
    assert d.pending == 0


def test_encode_frames_prefixes_big_endian():
    assert wire([b"ab", b""]) == b"\x00\x00\x00\x02ab\x00\x00\x00\x00"


# ----------------------------------------------------------------------------- StreamTransport
class CountingSocket(socket.socket):
    """A real socket that counts sendmsg calls."""

    sendmsg_calls = 0

    def sendmsg(self, *args, **kwargs):
        type(self).sendmsg_calls += 1
        return super().sendmsg(*args, **kwargs)


async def _open(transport) -> list:
    got: list = []
    await transport.open(lambda frames: got.append(list(frames)))
    return got


async def test_stream_transport_round_trip_and_one_sendmsg_per_batch():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sa = CountingSocket(fileno=a.detach())
    CountingSocket.sendmsg_calls = 0
    tr = StreamTransport(sa)
    got = await _open(tr)
    b.setblocking(False)
    # guest -> stack, many frames in one write, one split frame
    payload = wire(FRAMES[:5])
    await asyncio.get_running_loop().sock_sendall(b, payload[:-3])
    await asyncio.sleep(0.05)
    await asyncio.get_running_loop().sock_sendall(b, payload[-3:])
    await asyncio.sleep(0.05)
    assert [f for batch in got for f in batch] == FRAMES[:5]
    assert tr.frames_in == 5
    # stack -> guest: one batch = one sendmsg
    batch = [os.urandom(1500) for _ in range(100)]
    tr.send_frames(batch)
    assert CountingSocket.sendmsg_calls == 1
    d = StreamDecoder()
    out = []
    while len(out) < 100:
        out += d.feed(await asyncio.get_running_loop().sock_recv(b, 1 << 20))
    assert out == batch
    b.close()
    await asyncio.wait_for(tr.closed, 2)
    assert tr.close_reason == "eof"
    assert sa.fileno() == -1


async def test_stream_transport_backpressure_is_bounded_and_counted():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tr = StreamTransport(a, max_buffer=1 << 20)
    await _open(tr)
    frame = bytes(60000)
    for _ in range(200):  # 12 MB towards a guest that does not read (a blocking write would hang here)
        tr.send_frames([frame] * 4)
    assert tr.bytes_buffered <= 1 << 20
    assert tr.send_drops.get("full", 0) > 0
    sent_ok = tr.frames_out
    # the guest now reads everything: exactly the accepted frames arrive, stream in sync
    b.setblocking(False)
    d = StreamDecoder()
    out = []
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 10
    while len(out) < sent_ok and time.monotonic() < deadline:
        try:
            out += d.feed(await asyncio.wait_for(loop.sock_recv(b, 1 << 20), 1))
        except asyncio.TimeoutError:
            break
    assert len(out) == sent_ok and all(f == frame for f in out)
    assert tr.bytes_buffered == 0
    tr.close()
    b.close()


async def test_stream_transport_oversized_length_closes_with_logged_error(caplog):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tr = StreamTransport(a)
    got = await _open(tr)
    caplog.set_level(logging.ERROR, "aioslirp.transport.stream")
    b.sendall(wire([b"ok-frame"]) + struct.pack("!I", MAX_FRAME + 1) + b"junk")
    await asyncio.wait_for(tr.closed, 2)
    assert tr.close_reason == "frame_too_large"
    assert "frame length" in caplog.text and str(MAX_FRAME + 1) in caplog.text
    assert got == [] or got == [[b"ok-frame"]]
    assert b.recv(10) == b""  # our end is closed
    b.close()


# ----------------------------------------------------------------------------- DgramTransport
async def test_dgram_transport_connected_round_trip_and_peer_gone():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    tr = transport_for_fd(a.detach(), dgram=True)
    assert isinstance(tr, DgramTransport) and tr.connected
    got = await _open(tr)
    for f in FRAMES[1:5]:
        b.send(f)
    await asyncio.sleep(0.05)
    assert [f for batch in got for f in batch] == FRAMES[1:5]
    tr.send_frames([b"one", b"two"])
    assert b.recv(100) == b"one" and b.recv(100) == b"two"
    b.close()
    tr.send_frames([b"three"])  # ECONNREFUSED: the guest is gone
    await asyncio.wait_for(tr.closed, 2)


async def test_dgram_transport_bound_one_guest_at_a_time(tmp_path):
    path = str(tmp_path / "srv.sock")
    changes = []
    tr = DgramTransport.bind(path, probe_interval=0.05, on_guest_change=lambda old, new: changes.append((old, new)))
    got = await _open(tr)
    p1, p2 = str(tmp_path / "g1.sock"), str(tmp_path / "g2.sock")
    g1 = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    g1.bind(p1)
    g2 = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    g2.bind(p2)
    g1.sendto(b"from-g1", path)
    g2.sendto(b"from-g2", path)  # queued before g1 became the guest: read, dropped, counted
    await asyncio.sleep(0.05)
    assert [f for batch in got for f in batch] == [b"from-g1"]
    assert tr.drop_foreign == 1 and tr.peer == p1
    with pytest.raises(PermissionError):  # now the kernel refuses a second sender outright
        g2.sendto(b"refused", path)
    tr.send_frames([b"to-g1"])
    assert g1.recv(100) == b"to-g1"
    g1.close()  # guest 1 gone: found by the periodic check, then guest 2 is served
    os.unlink(p1)
    await asyncio.sleep(0.3)
    assert changes == [(None, p1), (p1, None)]
    g2.sendto(b"again-g2", path)
    await asyncio.sleep(0.05)
    assert [f for batch in got for f in batch] == [b"from-g1", b"again-g2"]
    assert changes[-1] == (None, p2)
    tr.send_frames([b"to-g2"])
    assert g2.recv(100) == b"to-g2"
    g2.close()
    tr.send_frames([b"lost"])  # a send to a dead guest: reported gone at once, transport stays open
    assert changes[-1] == (p2, None)
    assert not tr.closed.done()
    tr.close()
    assert not os.path.exists(path)


async def test_dgram_transport_waits_for_a_full_receiver_instead_of_dropping(tmp_path):
    path = str(tmp_path / "srv.sock")
    tr = DgramTransport.bind(path)
    await _open(tr)
    g = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    g.bind(str(tmp_path / "g.sock"))
    g.sendto(b"hello", path)
    await asyncio.sleep(0.05)
    frames = [i.to_bytes(4, "big") + bytes(1400) for i in range(500)]  # far more than max_dgram_qlen
    tr.send_frames(frames)
    assert tr.bytes_buffered > 0  # the receiver's queue is full: the rest waits
    g.setblocking(False)
    loop = asyncio.get_running_loop()
    out = []
    while len(out) < 500:
        out.append(await asyncio.wait_for(loop.sock_recv(g, 2000), 5))
    assert out == frames and tr.send_drops == {}
    tr.close()
    g.close()


# ----------------------------------------------------------------------------- QemuServer, fake guest
def arp_request() -> bytes:
    eth = b"\xff" * 6 + GUEST_MAC + b"\x08\x06"
    arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, GUEST_MAC, bytes([10, 0, 2, 15]), b"\0" * 6,
                      bytes([10, 0, 2, 2]))
    return eth + arp


async def _arp_roundtrip(sock: socket.socket) -> bytes:
    """Send an ARP request for the gateway; return the ARP reply (other frames, e.g. IPv6 RAs, skipped)."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, wire([arp_request()]))
    d = StreamDecoder()
    while True:
        data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
        assert data, "server closed the connection"
        for frame in d.feed(data):
            if frame[12:14] == b"\x08\x06":
                return frame


async def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, path)
    return s


async def test_qemu_server_one_guest_at_a_time_then_next(tmp_path):
    path = str(tmp_path / "q.sock")
    async with Stack(NetworkConfig()) as stack:
        server = QemuServer(stack, path=path)
        await server.start()
        task = asyncio.ensure_future(server.serve())
        g1 = await _connect(path)
        reply = await _arp_roundtrip(g1)
        assert reply[0:6] == GUEST_MAC and reply[20:22] == b"\x00\x02"  # ARP reply to guest 1
        g2 = await _connect(path)
        assert await asyncio.wait_for(asyncio.get_running_loop().sock_recv(g2, 100), 5) == b""  # refused at once
        assert server.refused == 1
        g2.close()
        g1.close()
        for _ in range(100):
            if server.transport is None:
                break
            await asyncio.sleep(0.02)
        g3 = await _connect(path)  # the next guest is served by the same stack
        reply = await _arp_roundtrip(g3)
        assert reply[20:22] == b"\x00\x02"
        assert server.guests == 2
        server.close()
        await asyncio.wait_for(task, 5)
        g3.close()
        assert not os.path.exists(path)


async def test_qemu_server_refuses_live_socket_and_replaces_stale(tmp_path):
    path = str(tmp_path / "q.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(1)
    async with Stack(NetworkConfig()) as stack:
        with pytest.raises(SocketInUse):
            await QemuServer(stack, path=path).start()
        live.close()  # the file stays: a stale socket now
        assert os.path.exists(path)
        server = QemuServer(stack, path=path)
        await server.start()
        server.close()
        await server.serve()
        assert not os.path.exists(path)


# ----------------------------------------------------------------------------- CLI, no VM
def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "aioslirp", "qemu", *args], stderr=subprocess.PIPE, text=True, **kw)


def _wait_path(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_qemu_stops_on_signal_and_removes_socket(tmp_path, sig):
    path = str(tmp_path / "cli.sock")
    p = _cli("--socket", path, "--log-level", "info")
    served = b""
    try:
        _wait_path(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(wire([arp_request()]))
            s.settimeout(20)
            served = s.recv(4)
            p.send_signal(sig)
            rc = p.wait(20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        err = p.stderr.read()
    assert served, err  # the ARP request was answered
    assert rc == 0, err
    assert not os.path.exists(path), err
    assert "stopping" in err


def test_cli_qemu_dgram_socket_and_fd(tmp_path):
    path = str(tmp_path / "dg.sock")
    p = _cli("--dgram", "--socket", path)
    try:
        _wait_path(path)
        g = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        g.bind(str(tmp_path / "guest.sock"))
        g.settimeout(5)
        g.sendto(arp_request(), path)
        while (frame := g.recv(2000))[12:14] != b"\x08\x06":  # skip e.g. IPv6 router advertisements
            pass
        assert frame[20:22] == b"\x00\x02"
        g.close()
        p.terminate()
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert not os.path.exists(path)
    # --fd: a connected stream socket; serving ends (exit 0) when the guest leaves
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    p = _cli("--fd", str(a.fileno()), pass_fds=[a.fileno()])
    a.close()
    try:
        b.sendall(wire([arp_request()]))
        b.settimeout(10)
        assert b.recv(4)
        b.close()
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("args, needle", [
    (["--socket", "/nonexistent-dir/x.sock"], "--socket"),
    (["--socket", "/" + "x" * 120], "--socket"),
    (["--fd", "987"], "--fd"),
    (["--fd", "abc"], "--fd"),
    (["--socket", "x.sock", "--ifname", "tap0"], "--ifname"),
    ([], "--socket"),
])
def test_cli_qemu_bad_options_exit_2(args, needle):
    p = subprocess.run([sys.executable, "-m", "aioslirp", "qemu", *args], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_cli_qemu_socket_in_use_exit_1(tmp_path):
    path = str(tmp_path / "busy.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(1)
    p = subprocess.run([sys.executable, "-m", "aioslirp", "qemu", "--socket", path], capture_output=True, text=True,
                       timeout=30)
    live.close()
    assert p.returncode == 1, p.stderr
    assert "in use" in p.stderr and len(p.stderr.strip().splitlines()) == 1
