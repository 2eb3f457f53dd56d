"""A transport whose other end is gone when ``Stack.serve()`` starts is one clear ``error`` event
and one log line, at once: the cause and what to check (issue 18, item 4). Public API only.

A guest that sent frames and then left, a ``Stack.close()`` and a transport closed by its owner
are ordinary ends: no error.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

import aioslirp

GONE = "closed before the guest sent a frame"


async def serve_collect(transport, *, ipv6: bool = False, timeout: float = 2.0, then=None):
    """Serve ``transport`` on a new stack; returns (events as (name, data), seconds serve took)."""
    async with aioslirp.Stack(aioslirp.NetworkConfig(ipv6=ipv6)) as stack:
        events = []
        stack.on_event(lambda ev: events.append((ev.name, ev.data)))
        t0 = time.monotonic()
        task = asyncio.ensure_future(stack.serve(transport))
        if then is not None:
            await then(stack, transport)
        await asyncio.wait_for(task, timeout)
        return events, time.monotonic() - t0


def errors(events):
    return [data["message"] for name, data in events if name == "error"]


def one_error_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1, lines
    return lines[0]


async def test_socketpair_peer_closed_is_one_error_at_once(caplog):
    caplog.set_level(logging.INFO)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()  # e.g. the VM manager closed the guest's end before handing it over
    events, took = await serve_collect(aioslirp.SocketPairTransport(ours))
    assert took < 1.0
    assert [name for name, _ in events] == ["ready", "error", "guest_link_down"]
    (msg,) = errors(events)
    assert msg.startswith("SocketPairTransport " + GONE)
    assert "EOF" in msg and "check that the other socket of the pair stays open" in msg
    assert "\n" not in msg
    assert one_error_line(caplog) == msg


async def test_a_transport_subclass_names_its_own_peer(caplog):
    """The hint is the transport's (``Transport.gone_hint``), not looked up by class name: an
    embedder's own transport tells its users what to check."""

    class VmmTransport(aioslirp.SocketPairTransport):
        gone_hint = "the VM manager (vmm) still holds the guest's end"

    caplog.set_level(logging.INFO)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()
    events, _ = await serve_collect(VmmTransport(ours))
    (msg,) = errors(events)
    assert msg == ("VmmTransport closed before the guest sent a frame: the other end closed (EOF); "
                   "check that the VM manager (vmm) still holds the guest's end")
    assert one_error_line(caplog) == msg


async def test_qemu_stream_socket_closed_at_once_names_qemu(caplog):
    caplog.set_level(logging.INFO)
    ours, qemu = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    qemu.close()  # QEMU (-netdev stream) exited, or was never connected
    events, took = await serve_collect(aioslirp.StreamTransport(ours))
    assert took < 1.0
    (msg,) = errors(events)
    assert GONE in msg and "EOF" in msg and "-netdev stream" in msg
    assert one_error_line(caplog) == msg


async def test_qemu_dgram_peer_gone_names_the_cause(caplog):
    caplog.set_level(logging.INFO)
    ours, qemu = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    qemu.close()
    # the IPv6 router's first Router Advertisement, sent at once, finds the peer gone
    events, took = await serve_collect(aioslirp.DgramTransport(ours), ipv6=True)
    assert took < 1.0
    (msg,) = errors(events)
    assert GONE in msg and "Connection refused" in msg and "-netdev dgram" in msg
    assert one_error_line(caplog) == msg


async def test_dgram_socketpair_peer_gone_found_by_the_first_send(caplog):
    caplog.set_level(logging.INFO)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    theirs.close()
    events, took = await serve_collect(aioslirp.SocketPairTransport(ours), ipv6=True)
    assert took < 1.0
    (msg,) = errors(events)
    assert msg.startswith("SocketPairTransport " + GONE) and "Connection refused" in msg


async def test_guest_that_sent_frames_then_left_is_no_error(caplog):
    caplog.set_level(logging.INFO)
    ours, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    async def talk_then_leave(stack, transport):
        await asyncio.sleep(0.05)
        guest.send(b"\xff" * 6 + b"\x52\x54\x00\x12\x34\x56" + b"\x08\x06" + bytes(46))  # an Ethernet frame
        await asyncio.sleep(0.05)
        guest.close()

    events, _ = await serve_collect(aioslirp.SocketPairTransport(ours), then=talk_then_leave)
    assert [name for name, _ in events] == ["ready", "guest_link_up", "guest_link_down"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("how", ["stack.stop", "transport.close"])
async def test_stopping_before_any_frame_is_no_error(how, caplog):
    caplog.set_level(logging.INFO)
    ours, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    async def stop(stack, transport):
        await asyncio.sleep(0.05)
        stack.stop() if how == "stack.stop" else transport.close()

    try:
        events, _ = await serve_collect(aioslirp.SocketPairTransport(ours), then=stop)
    finally:
        guest.close()
    assert not errors(events), events
    assert [name for name, _ in events] == ["ready", "guest_link_down"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
