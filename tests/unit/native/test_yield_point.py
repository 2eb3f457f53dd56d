"""The fair scheduler's yield point in the native plane (``set_yield`` in aioslirp/native/_dataplane.c):
between two frames of a TAP reader's batch and two socket events of a TCP engine's poll, at most
once per interval, the express lane's epoll is polled and, when readable, its ``serve()`` runs
there; while it runs, the interrupted plane and engine are not entered again.

A pipe stands for the lane's epoll (readable while it holds a byte), a SEQPACKET pair for the TAP
fd, a loopback listener for the host; the engine is a real one (its epoll, real sockets)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest

from aioslirp.wire.ethernet import ETH, ETHERTYPE_IPV4
from aioslirp.wire.udp import build_udp

from support.frames import ACK, F4, GUEST_MAC, GW_MAC, tcp_frame
from support.native import need_extension

GUEST, GW = bytes([10, 0, 2, 15]), bytes([10, 0, 2, 2])


def _frame(n: int) -> bytes:
    pkt = build_udp(GUEST, GW, 40000 + n, 9, b"x" * 10)
    return ETH.pack(GW_MAC, GUEST_MAC, ETHERTYPE_IPV4) + bytes(pkt)


@pytest.fixture
def ext():
    ext = need_extension()
    yield ext
    for serve in list(_armed):
        ext.set_yield(-1, serve)
    _armed.clear()


_armed: list = []


def _arm(ext, fd: int, serve, every_us: float = 0.0) -> bool:
    ok = ext.set_yield(fd, serve, every_us)
    if ok:
        _armed.append(serve)
    return ok


@pytest.fixture
def lane():
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    os.close(r)
    os.close(w)


def test_one_lane_arms_it_and_only_its_serve_disarms_it(ext, lane):
    r, _ = lane

    def serve1() -> None: ...

    def serve2() -> None: ...

    assert _arm(ext, r, serve1) is True
    assert ext.set_yield(r, serve2, 0.0) is False  # another lane's: refused, nothing changed
    assert ext.set_yield(-1, serve2) is False
    assert ext.set_yield(r, serve1, 50.0) is True  # the same serve again: its interval changes
    assert ext.set_yield(-1, serve1) is True
    assert ext.set_yield(-1, serve1) is False  # off already
    with pytest.raises(ValueError, match="callable"):
        ext.set_yield(r, 5, 0.0)
    with pytest.raises(ValueError, match="every_us"):
        ext.set_yield(r, serve1, -1.0)


def test_a_readable_lane_is_served_between_two_frames_of_a_batch(ext, lane):
    """Three frames in one batch; the lane readable before the first: serve() runs once, before
    the batch's frames reach Python (it drained the lane: the later frames' polls find nothing),
    and the plane's own reader, called from inside it, does nothing (its frames stay in the batch)."""
    r, w = lane
    plane = ext.Plane(2048, 16, False)
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tap.setblocking(False)
    order: list = []

    def ready() -> object:
        return plane.ready(tap.fileno(), time.monotonic, lambda frames, *a: order.append(("deliver", len(frames))),
                           None, None)

    def serve() -> None:
        os.read(r, 1)
        order.append(("serve", ready()))  # its own reader: not entered again

    try:
        for n in range(3):
            guest.send(_frame(n))
        os.write(w, b"!")
        polls, served = ext.yield_counters()
        assert _arm(ext, r, serve, 0.0)
        ready()
        assert order == [("serve", None), ("deliver", 3)]
        polls2, served2 = ext.yield_counters()
        assert (polls2 - polls, served2 - served) == (3, 1)
        # not readable: polled, not served; disarmed: not even polled
        guest.send(_frame(4))
        ready()
        assert order[-1] == ("deliver", 1) and ext.yield_counters() == (polls2 + 1, served2)
        ext.set_yield(-1, serve)
        os.write(w, b"!")
        guest.send(_frame(5))
        ready()
        assert order[-1] == ("deliver", 1) and ext.yield_counters() == (polls2 + 1, served2)
    finally:
        tap.close()
        guest.close()


def test_the_interval_spaces_the_polls(ext, lane):
    r, _ = lane
    plane = ext.Plane(2048, 64, False)
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tap.setblocking(False)
    try:
        assert _arm(ext, r, lambda: None, 1e6)  # one second: one poll in a batch of 20 frames
        for n in range(20):
            guest.send(_frame(n))
        polls, _ = ext.yield_counters()
        plane.ready(tap.fileno(), time.monotonic, lambda *a: None, None, None)
        assert ext.yield_counters()[0] - polls <= 1
    finally:
        tap.close()
        guest.close()


def test_a_failing_serve_is_reported_and_the_batch_goes_on(ext, lane, monkeypatch):
    r, w = lane
    plane = ext.Plane(2048, 16, False)
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tap.setblocking(False)
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))

    def serve() -> None:
        raise OSError("lane")

    try:
        os.write(w, b"!")
        guest.send(_frame(1))
        guest.send(_frame(2))
        assert _arm(ext, r, serve, 0.0)
        got: list = []
        plane.ready(tap.fileno(), time.monotonic, lambda frames, *a: got.extend(frames), None, None)
        assert len(got) == 2 and len(seen) == 2 and all(str(e) == "lane" for e in seen)
    finally:
        tap.close()
        guest.close()


def test_another_threads_batches_do_not_yield(ext, lane):
    r, w = lane
    called: list = []
    armed = threading.Event()

    def arm() -> None:
        _arm(ext, r, lambda: called.append(1), 0.0)
        armed.set()

    th = threading.Thread(target=arm)
    th.start()
    th.join()
    assert armed.is_set()
    plane = ext.Plane(2048, 16, False)
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tap.setblocking(False)
    try:
        os.write(w, b"!")
        guest.send(_frame(1))
        plane.ready(tap.fileno(), time.monotonic, lambda *a: None, None, None)
        assert called == []
    finally:
        tap.close()
        guest.close()


async def test_an_engine_poll_yields_between_socket_events_and_is_not_entered_again(ext, lane):
    """A real engine with one flow to a loopback server that has sent bytes: its poll reads them
    (one socket event), then yields. Inside serve() the engine's poll and records say None
    ("later") and its stack's NativeTcp takes that as nothing to do, its other calls refuse, and
    the plane it is attached to does nothing; after the poll the bytes are on the TAP."""
    from aioslirp import NetworkConfig, Stack
    from aioslirp.nat.native_tcp import NativeTcp

    r, w = lane
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tap.setblocking(False)
    guest.settimeout(5)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stack = Stack(NetworkConfig())
    await stack.start()
    engine = ext.TcpEngine(tap.fileno(), False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 60.0)
    native = NativeTcp(stack.parts.ctx, engine)
    plane = ext.Plane(2048, 16, False)
    plane.attach_tcp(engine)
    inside: list = []

    def serve() -> None:
        os.read(r, 1)
        inside.append(engine.poll())
        inside.append(engine.records())
        inside.append((native.poll(), native.take()))
        with pytest.raises(RuntimeError, match="yields"):
            engine.counters()
        with pytest.raises(RuntimeError, match="yields"):
            engine.close()
        inside.append(plane.ready(tap.fileno(), time.monotonic, lambda *a: inside.append("deliver"), None, None))

    try:
        st, slot, gen = engine.adopt(False, GUEST_MAC, F4.guest, 40000, F4.gw, port, socket.inet_aton("127.0.0.1"),
                                     port, 1000, 5000, 1460, 7, 65535, time.monotonic())
        assert st == 0
        synack = guest.recv(2048)
        iss = int.from_bytes(synack[38:42], "big")
        assert engine.input(tcp_frame(F4, 40000, port, ACK, seq=1001, ack=iss + 1), False, time.monotonic())
        conn, _ = listener.accept()
        conn.sendall(b"from the host")
        time.sleep(0.05)
        os.write(w, b"!")
        assert _arm(ext, r, serve, 0.0)
        engine.poll()
        assert inside == [None, None, (None, None), None]
        frame = guest.recv(2048)
        assert frame.endswith(b"from the host")
        conn.close()
    finally:
        ext.set_yield(-1, serve)
        plane.attach_tcp(None)
        native.close()
        await stack.aclose()
        listener.close()
        tap.close()
        guest.close()
