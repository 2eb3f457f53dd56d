"""The native TAP reader's divert (``reorders_later`` in aioslirp/native/_dataplane.c read_batch)
against a hostile guest: the frames Python makes into a TCP segment only later (IPv4 fragments,
IPv6 extension headers) send the rest of that read to Python behind them, so a native flow's next
segment never overtakes the reassembled one (the engine drops what comes out of order).

A datagram socket pair stands for the TAP fd (one frame per read, as a TAP gives); the engine is
the fake one (``fake=True``: its host side is a byte log per flow)."""

from __future__ import annotations

import socket

from aioslirp import NetworkConfig, Stack
from aioslirp.nat.native_tcp import NativeTcp

from support.frames import ACK, F4, GW_MAC, PSH, SYN, tcp_frame
from support.native import need_extension


async def _stack_and_plane():
    ext = need_extension()
    stack = Stack(NetworkConfig())
    await stack.start()
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    eng.fake_connect_mode(0)
    stack.parts.ctx.native_tcp = NativeTcp(stack.parts.ctx, eng)
    plane = ext.Plane(65536, 64, False)
    plane.attach_tcp(eng)
    return stack, eng, plane


async def _close(stack, plane, *socks):
    plane.attach_tcp(None)
    for s in socks:
        s.close()
    stack.parts.ctx.native_tcp.close()
    stack.parts.ctx.native_tcp = None
    await stack.aclose()


def _open_flow(stack, eng, gport: int) -> int:
    stack.parts.link.on_frames([tcp_frame(F4, gport, 8080, SYN, seq=99, mss=1460)])
    (synack,) = eng.fake_frames()
    iss = int.from_bytes(synack[38:42], "big")
    assert eng.input(tcp_frame(F4, gport, 8080, ACK, seq=100, ack=iss + 1), False, 0.0)
    return iss


async def test_a_short_last_fragment_still_holds_back_the_segments_read_after_it():
    """The last fragment of a native flow's segment carries 8 bytes: a 42-byte frame, shorter than
    the 54 bytes the divert looked at (an IPv6 header's worth), so it was not diverted and the
    next segment of the flow, read after it, reached the engine ahead of the reassembled one and
    was dropped as out of order (the first fragment came in an earlier read: nothing else
    diverted this one)."""
    stack, eng, plane = await _stack_and_plane()
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    tap.setblocking(False)
    try:
        iss = _open_flow(stack, eng, 40021)
        first, second = bytes(range(256)) * 4 + bytes(12), b"after the short fragment" * 4
        seg = tcp_frame(F4, 40021, 8080, ACK | PSH, seq=100, ack=iss + 1, data=first)[14 + 20:]
        cut = len(seg) - 8  # (a multiple of 8: 20 + 1036 - 8 = 1048)
        assert cut % 8 == 0
        guest.send(F4.frame(F4.packet(seg[:cut], 6, id=7, mf=1, offset=0)))
        frames, *_ = plane.read_tap(tap.fileno())  # the first fragment in a read of its own
        assert len(frames) == 1
        stack.parts.link.on_frames(frames)
        last = F4.frame(F4.packet(seg[cut:], 6, id=7, mf=0, offset=cut >> 3))
        assert len(last) == 14 + 20 + 8
        guest.send(last)
        guest.send(tcp_frame(F4, 40021, 8080, ACK | PSH, seq=100 + len(first), ack=iss + 1, data=second))
        frames, *_ = plane.read_tap(tap.fileno())
        assert len(frames) == 2  # the last fragment and the segment after it, in order
        stack.parts.link.on_frames(frames)
        (fd,) = eng.fake_fds()
        assert eng.fake_received(fd) == first + second
    finally:
        await _close(stack, plane, tap, guest)


async def test_short_malformed_and_vlan_frames_before_a_native_segment_do_not_divert_or_crash():
    """Runts (an Ethernet header alone, a truncated IPv4 header claiming fragments), a VLAN-tagged
    frame (Python drops it) and an IPv6 frame cut inside its header: none is a fragment Python
    will reassemble, so the native segment after them still goes to the engine at once."""
    stack, eng, plane = await _stack_and_plane()
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    tap.setblocking(False)
    try:
        iss = _open_flow(stack, eng, 40022)
        seg = tcp_frame(F4, 40022, 8080, ACK | PSH, seq=100, ack=iss + 1, data=b"native")
        eth = seg[:12]
        junk = [seg[:14], seg[:14 + 7], eth + b"\x08\x00" + bytes([0x45, 0, 0, 20, 0, 0, 0x20, 0]),
                eth + b"\x81\x00\x00\x05" + seg[12:], eth + b"\x86\xdd" + bytes([0x60]) + bytes(5) + b"\x2c"]
        for j in junk:
            guest.send(j)
        guest.send(seg)
        frames, *_ = plane.read_tap(tap.fileno())
        assert frames == junk
        (fd,) = eng.fake_fds()
        assert eng.fake_received(fd) == b"native"
        stack.parts.link.on_frames(frames)  # and Python drops them without harm
    finally:
        await _close(stack, plane, tap, guest)
