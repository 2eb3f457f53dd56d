"""The TAP transport's two readers, Python (``os.read`` per frame) and native (one ``Plane.read_tap``
call per readiness, aioslirp/native): the same frames, checksum flags, batches and ends.

Every scenario runs once per reader and the two outcomes must be equal and as expected: frames
written into real TAP devices (with and without the virtio-net header and checksum offload) by a
packet socket and by the kernel's UDP, frames longer than ``read_size``, the batch bound, EOF
and a read error (on sockets, which ``TapTransport`` also takes). The rest of the TAP tests run
on the native reader with ``AIOSLIRP_NATIVE=1`` in the environment (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
import subprocess

import pytest

from aioslirp.transport.tap import TapTransport
from aioslirp.transport.tapdev import create_tap

from support.native import need_extension

pytestmark = pytest.mark.netns

READERS = ("python", "native")
MARK = 0x88B5  # IEEE local experimental EtherType: frames the test wrote, not the kernel's own
GUEST_MAC = bytes.fromhex("525400123456")


def _transport(fd: int, reader: str, **kw) -> TapTransport:
    if reader == "native":
        try:
            need_extension()
        except BaseException:  # skipped (no extension): the fd was to be the transport's, close it here
            os.close(fd)
            raise
    t = TapTransport(fd, native=reader == "native", **kw)
    assert t.native is (reader == "native")
    return t


class Collect:
    """A sink that keeps every batch: ``[(bytes(frame), csum_ok), ...]`` per call."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[bytes, bool | None]]] = []

    def __call__(self, frames, csum_ok=None) -> None:
        oks = [None] * len(frames) if csum_ok is None else list(csum_ok)
        assert len(oks) == len(frames)
        self.batches.append([(bytes(f), ok) for f, ok in zip(frames, oks)])

    def frames(self, keep=lambda f: True) -> list[tuple[bytes, bool | None]]:
        return [x for b in self.batches for x in b if keep(x[0])]


async def _until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def _tap(vnet: bool):
    fd, name = create_tap("aiotr%d", 1500, vnet_hdr=vnet)
    for cmd in (["sysctl", "-qw", f"net.ipv6.conf.{name}.disable_ipv6=1"], ["ip", "link", "set", name, "up"],
                ["ip", "addr", "add", "10.77.0.1/24", "dev", name],
                ["ip", "neigh", "replace", "10.77.0.2", "lladdr", "52:54:00:12:34:56", "dev", name]):
        subprocess.run(cmd, check=True, capture_output=True)
    try:
        yield fd, name
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


def _marked(n: int, size: int) -> bytes:
    """A frame of ``size`` bytes of the test's EtherType, numbered ``n``."""
    head = GUEST_MAC + bytes.fromhex("020000000001") + struct.pack("!HI", MARK, n)
    return head + bytes((n + i) & 0xFF for i in range(size - len(head)))


def _is_marked(f: bytes) -> bool:
    return len(f) >= 14 and f[12:14] == struct.pack("!H", MARK)


def _is_test_udp(f: bytes) -> bool:
    return len(f) >= 38 and f[12:14] == b"\x08\x00" and f[23] == 17 and f[36:38] == struct.pack("!H", 9999)


async def _tap_scenario(reader: str, vnet: bool, read_size: int | None = None) -> list:
    """Marked frames by a packet socket, then UDP datagrams by the kernel, through one TAP."""
    with _tap(vnet) as (fd, name):
        kw = {} if read_size is None else {"read_size": read_size}
        t = _transport(fd, reader, **kw)
        sink = Collect()
        await t.open(sink)
        sizes = [60, 61, 1514, 200, 14 + 6]
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as ps:
            ps.bind((name, 0))
            for i, size in enumerate(sizes):
                ps.send(_marked(i, size))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as us:
            for i in range(3):
                us.sendto(b"udp%d" % i * (i + 1), ("10.77.0.2", 9999))
        await _until(lambda: len(sink.frames(_is_marked)) == len(sizes) and len(sink.frames(_is_test_udp)) == 3)
        out = sink.frames(lambda f: _is_marked(f) or _is_test_udp(f))
        t.close()
        assert t.frames_in >= len(out)
        return [(_norm(f), ok) for f, ok in out]


def _norm(f: bytes) -> bytes:
    """A frame of the test's UDP without what differs from one device and socket to the next (source
    MAC, IP identification, source port, checksums): destination MAC, EtherType, protocol,
    destination address and port, payload; the test's own frames as they are."""
    if not _is_test_udp(f):
        return f
    return f[0:6] + f[12:14] + f[23:24] + f[30:34] + f[36:38] + f[42:]


@pytest.mark.parametrize("vnet", [False, True], ids=["plain", "vnet"])
async def test_tap_frames_and_checksum_flags_are_the_same(vnet):
    outcomes = {reader: await _tap_scenario(reader, vnet) for reader in READERS}
    assert outcomes["python"] == outcomes["native"]
    got = outcomes["native"]
    marked = [f for f, _ in got if _is_marked(f)]
    assert marked == [_marked(i, size) for i, size in enumerate([60, 61, 1514, 200, 20])]
    udp = [(f, ok) for f, ok in got if not _is_marked(f)]
    assert [f[15:] for f, _ in udp] == [b"udp0", b"udp1udp1", b"udp2udp2udp2"]
    if vnet:  # checksum offload on: the kernel's UDP arrives with a partial checksum, flagged
        assert [ok for _, ok in udp] == [True, True, True]
        assert {ok for f, ok in got if _is_marked(f)} == {False}
    else:
        assert {ok for _, ok in got} == {None}


@pytest.mark.parametrize("vnet", [False, True], ids=["plain", "vnet"])
async def test_a_frame_longer_than_read_size_is_cut_the_same(vnet):
    outcomes = {reader: await _tap_scenario(reader, vnet, read_size=100) for reader in READERS}
    assert outcomes["python"] == outcomes["native"]
    marked = [f for f, _ in outcomes["native"] if _is_marked(f)]
    assert marked == [_marked(i, size)[:100] for i, size in enumerate([60, 61, 1514, 200, 20])]


async def _seqpacket_scenario(reader: str, batch: int, n: int, then_close: bool) -> tuple:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    t = _transport(b.detach(), reader, batch=batch)
    for i in range(n):
        a.send(_marked(i, 64 + i))
    sink = Collect()
    await t.open(sink)
    await _until(lambda: len(sink.frames()) == n)
    if then_close:
        a.close()
        exc = await asyncio.wait_for(t.closed, 5)
        result = (type(exc).__name__, str(exc), t.close_reason, t.fd)
    else:
        result = None
        t.close()
        a.close()
    return [len(x) for x in sink.batches], sink.frames(), result, t.frames_in


async def test_the_batch_bound_splits_a_backlog_the_same():
    outcomes = {reader: await _seqpacket_scenario(reader, 4, 10, False) for reader in READERS}
    assert outcomes["python"] == outcomes["native"]
    sizes, frames, _, frames_in = outcomes["native"]
    assert sizes == [4, 4, 2] and frames_in == 10
    assert frames == [(_marked(i, 64 + i), None) for i in range(10)]


async def test_a_batch_larger_than_the_native_buffer_is_one_call():
    """20 frames, batch 64: the native buffer holds 8 largest frames, so the call refills it
    twice; still one batch to the sink, as the Python reader gives."""
    outcomes = {reader: await _seqpacket_scenario(reader, 64, 20, False) for reader in READERS}
    assert outcomes["python"] == outcomes["native"]
    assert outcomes["native"][0] == [20]


async def test_eof_delivers_the_frames_then_closes_the_same():
    outcomes = {reader: await _seqpacket_scenario(reader, 64, 3, True) for reader in READERS}
    assert outcomes["python"] == outcomes["native"]
    _, frames, result, _ = outcomes["native"]
    assert len(frames) == 3
    assert result == ("EOFError", "TAP fd reached end of file", "error", -1)


async def _reset_scenario(reader: str) -> tuple:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        c = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # a RST: the next read fails with ECONNRESET
    t = _transport(c.detach(), reader)
    await t.open(Collect())
    exc = await asyncio.wait_for(t.closed, 5)
    return type(exc).__name__, exc.errno, t.close_reason, t.fd


async def test_a_read_error_closes_with_that_error_the_same():
    outcomes = {reader: await _reset_scenario(reader) for reader in READERS}
    assert outcomes["python"] == outcomes["native"] == ("ConnectionResetError", errno.ECONNRESET, "error", -1)


def test_native_false_or_no_extension_reads_in_python(monkeypatch, caplog):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a:
        t0 = TapTransport(os.dup(b.fileno()), native=False)
        assert t0.native is False
        t0.close()
        monkeypatch.setenv("AIOSLIRP_NATIVE", "1")
        from aioslirp import native

        t = TapTransport(os.dup(b.fileno()))
        assert t.native is (native.extension() is not None)
        t.close()
        monkeypatch.setattr(native, "_load", lambda: (None, "not built: no C compiler at install time"))
        native.log_fallback.cache_clear()
        with caplog.at_level("INFO", logger="aioslirp.native"):
            t2 = TapTransport(b.detach())
            t3 = TapTransport(os.dup(t2.fd))
        assert t2.native is False and t3.native is False
        lines = [r.getMessage() for r in caplog.records if r.name == "aioslirp.native"]
        assert lines == ["native data plane: off for the TAP reader (not built: no C compiler at install time); "
                         "the Python path runs"]
        t2.close()
        t3.close()
