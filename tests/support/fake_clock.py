"""A whole Stack on a fake clock: an event loop whose ``time()`` the test sets, a transport the test
feeds batches of frames, and decoders of what the stack sent (IPv4 TCP and UDP).

The event loop's clock (``loop.time()``) is the only clock of the data path, so a loop whose
clock only moves when the test says drives a real Stack through its timers in no time.
"""

from __future__ import annotations

import asyncio
import struct

from aioslirp.transport.base import Transport

START = 1000.0  # the fake clock's reading when the stack starts


class FakeClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock only moves when the test says so (``loop.now``)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = START

    def time(self) -> float:
        return self.now


class FakeTransport(Transport):
    """Hands the test's frames to the stack as batches; keeps what the stack sends (as bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []

    async def _start_reading(self) -> None:
        pass

    def deliver(self, *frames: bytes) -> None:
        self._on_frames(list(frames))

    def send_frames(self, frames) -> None:
        self.out.extend(bytes(f) for f in frames)

    def _close_io(self) -> None:
        pass


def tcp_out(frames: list[bytes]) -> list[tuple[int, int, int, bytes]]:
    """``(seq, ack, flags, payload)`` of the IPv4 TCP frames among ``frames``."""
    out = []
    for f in frames:
        if f[12:14] == b"\x08\x00" and f[23] == 6:
            ihl = (f[14] & 0x0F) * 4
            t = 14 + ihl
            seq, ack = struct.unpack_from("!II", f, t + 4)
            total = struct.unpack_from("!H", f, 16)[0]
            out.append((seq, ack, f[t + 13], f[t + ((f[t + 12] >> 4) * 4):14 + total]))
    return out


def udp_out(frames: list[bytes]) -> list[tuple[int, int, bytes]]:
    """``(sport, dport, payload)`` of the IPv4 UDP frames among ``frames``."""
    out = []
    for f in frames:
        if f[12:14] == b"\x08\x00" and f[23] == 17:
            t = 14 + (f[14] & 0x0F) * 4
            sport, dport, ulen = struct.unpack_from("!HHH", f, t)
            out.append((sport, dport, f[t + 8:t + ulen]))
    return out


async def settle(cond=None, turns: int = 2000) -> bool:
    """Let the loop run (fd events included, the clock standing still) until ``cond()``, or
    for 20 turns without a ``cond``."""
    if cond is None:
        for _ in range(20):
            await asyncio.sleep(0)
        return True
    for _ in range(turns):
        if cond():
            return True
        await asyncio.sleep(0)
    return cond()
