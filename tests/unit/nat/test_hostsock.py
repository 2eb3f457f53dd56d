"""The host side of a TCP flow (aioslirp.nat.hostsock) and its move to an asyncio transport.

A Stack in this process serves a transport that only collects frames; the test plays the
guest (frames built with ``build_tcp``) and the host peer (a real listening socket on
127.0.0.1), and calls the host socket's read callback itself, like
``benchmarks/micro_crr.py``. Checked: a bulk sender on the host (a full 256 KiB read) and a
bulk receiver (a partial ``send``) each move the flow from HostSocket to an asyncio transport
(``tcp_bulk_transport``) without losing or reordering a byte either way, a guest RST while that
happens reaches the host as a RST, and no socket is left.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import select
import socket
import struct

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.nat.hostsock import READ_SIZE, HostSocket, TransportHost
from aioslirp.wire.tcp import build_tcp

from support.frames import ACK, FIN, GUEST4, GUEST_MAC, GW4, GW_MAC, PSH, RST, SYN
# fd_count: after a gc, so that earlier tests' garbage does not close mid-count
from support.stacks import CollectTransport as Collect, fd_count

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

ETH = GW_MAC + GUEST_MAC + b"\x08\x00"
SEQ_ACK = struct.Struct("!II")


async def _session(body) -> None:
    fds0 = fd_count()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    try:
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
            tr = Collect()
            serving = asyncio.ensure_future(stack.serve(tr))
            await asyncio.sleep(0)

            on_frames = stack.parts.link.on_frames

            def guest(sport, seq, ack, flags, payload=b"", wnd=65535):
                on_frames([build_tcp(ETH, GUEST4, GW4, sport, port, seq, ack, flags, wnd, b"", payload)], [True])

            sport = 40100
            guest(sport, 1000, 0, SYN)
            iss = SEQ_ACK.unpack_from(tr.out[-1], 38)[0]
            host, _ = srv.accept()
            guest(sport, 1001, iss + 1, ACK)
            flow = stack.parts.flows[(6, GUEST4, sport, GW4, port)]
            assert isinstance(flow.transport, HostSocket)
            # room for full 256 KiB reads at once (what receive autotuning gives a bulk flow)
            flow.transport.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            try:
                await body(stack, tr, flow, host, guest, sport, iss)
            finally:
                host.close()
            stack.stop()
            await serving
        assert not stack.parts.flows
    finally:
        srv.close()
    assert fd_count() == fds0


def _read_until_upgrade(flow) -> None:
    """Call the HostSocket's read callback until a read comes back full (the kernel may hand the
    first bytes over in smaller pieces)."""
    for _ in range(50):
        if flow._upgrading or not isinstance(flow.transport, HostSocket):
            return
        flow.transport._on_readable()


def _payload_to_guest(frames) -> bytes:
    """The TCP payload of our frames to the guest, in order (IPv4, no options on data segments)."""
    out = bytearray()
    for f in frames:
        doff = (f[46] >> 4) * 4
        total = struct.unpack_from("!H", f, 16)[0]
        out += bytes(f[34 + doff:14 + total])
    return bytes(out)


def test_bulk_sender_moves_to_a_transport_and_no_byte_is_lost():
    async def body(stack, tr, flow, host, guest, sport, iss):
        down = os.urandom(3 * READ_SIZE)
        host.setblocking(True)
        host.sendall(down[:2 * READ_SIZE])  # more than one full read is waiting
        tr.out.clear()
        _read_until_upgrade(flow)  # a full 256 KiB read: the flow asks for a transport
        assert flow.transport is None and flow._upgrading
        # guest bytes arriving meanwhile wait in the connection, nothing is written nor dropped
        guest(sport, 1001, iss + 1, ACK | PSH, b"up-1")
        for _ in range(20):
            await asyncio.sleep(0)
            if isinstance(flow.transport, TransportHost):
                break
        assert isinstance(flow.transport, TransportHost)
        assert stack.counters["tcp_bulk_transport"] == 1
        guest(sport, 1005, iss + 1, ACK | PSH, b"up-2")
        host.sendall(down[2 * READ_SIZE:])
        got = bytearray(_payload_to_guest(tr.out))
        acked = iss + 1
        deadline = asyncio.get_running_loop().time() + 10
        while len(got) < len(down):
            assert asyncio.get_running_loop().time() < deadline, len(got)
            acked = iss + 1 + len(got)
            tr.out.clear()
            guest(sport, 1009, acked, ACK, wnd=65535)  # the guest reads and opens its window
            await asyncio.sleep(0.005)
            got += _payload_to_guest(tr.out)
        assert hashlib.sha256(got).digest() == hashlib.sha256(down).digest()
        host.settimeout(5)
        assert host.recv(100) == b"up-1up-2"

    asyncio.run(_session(body))


def test_guest_reset_while_moving_to_a_transport_resets_the_host():
    async def body(stack, tr, flow, host, guest, sport, iss):
        host.setblocking(True)
        host.sendall(os.urandom(2 * READ_SIZE))
        _read_until_upgrade(flow)
        assert flow._upgrading
        guest(sport, 1001, iss + 1, RST)  # before the transport exists
        for _ in range(20):
            await asyncio.sleep(0)
        assert not stack.parts.flows
        host.settimeout(5)
        try:
            while host.recv(65536):
                pass
            reset = False
        except ConnectionResetError:
            reset = True
        assert reset

    asyncio.run(_session(body))


def test_bulk_receiver_moves_to_a_transport_and_no_byte_is_lost():
    """Guest -> host in bulk while the host does not read: a partial send() moves the flow."""
    async def body(stack, tr, flow, host, guest, sport, iss):
        up = os.urandom(8 << 20)
        pos = 0
        deadline = asyncio.get_running_loop().time() + 20
        while stack.counters["tcp_bulk_transport"] == 0:
            assert pos < len(up) and asyncio.get_running_loop().time() < deadline, pos
            # send what our last segment's window allows (no window scale: at most 64 KiB ahead)
            last = tr.out[-1]
            ack, = struct.unpack_from("!I", last, 42)
            wnd, = struct.unpack_from("!H", last, 48)
            limit = (ack - 1001) + wnd
            while pos < limit and pos < len(up):
                chunk = up[pos:min(pos + 1400, limit)]
                guest(sport, 1001 + pos, iss + 1, ACK, chunk)
                pos += len(chunk)
            await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
            if isinstance(flow.transport, TransportHost):
                break
        assert isinstance(flow.transport, TransportHost)
        # the rest, then read everything on the host side
        while pos < len(up):
            last = tr.out[-1]
            ack, = struct.unpack_from("!I", last, 42)
            wnd, = struct.unpack_from("!H", last, 48)
            limit = (ack - 1001) + wnd
            if pos >= limit:  # the window is closed: the host reads a little
                await asyncio.sleep(0.001)
                if _readable(host):
                    received.extend(host.recv(1 << 20))
                continue
            chunk = up[pos:min(pos + 1400, limit)]
            guest(sport, 1001 + pos, iss + 1, ACK, chunk)
            pos += len(chunk)
        guest(sport, 1001 + pos, iss + 1, ACK | FIN)
        while True:  # never block here: the stack needs the loop to write the rest
            assert asyncio.get_running_loop().time() < deadline + 20
            await asyncio.sleep(0.001)
            if _readable(host):
                chunk = host.recv(1 << 20)
                if not chunk:
                    break
                received.extend(chunk)
        assert hashlib.sha256(received).digest() == hashlib.sha256(up).digest()

    received = bytearray()
    asyncio.run(_session(body))


def _readable(sock) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_host_peer_gone_mid_write_on_a_transport_is_counted_not_logged(caplog, loop):
    """Guest -> host in bulk on an asyncio transport (what iperf3 -R through a forward does), and
    the host peer resets while guest segments keep coming: asyncio's transport would log
    ``socket.send() raised exception.`` for each write after the 5th to the lost connection,
    naming no flow. The flow stops writing once the transport is closing, the loss is counted
    (``tcp_host_lost``), the guest gets a RST, and the asyncio logger stays quiet."""
    import logging

    caplog.set_level(logging.DEBUG, logger="asyncio")

    async def body(stack, tr, flow, host, guest, sport, iss):
        pos = 0
        chunk = os.urandom(1400)
        # the host does not read: a partial send moves the flow to a transport
        deadline = asyncio.get_running_loop().time() + 20
        while not isinstance(flow.transport, TransportHost):
            assert asyncio.get_running_loop().time() < deadline, pos
            last = tr.out[-1]
            ack, = struct.unpack_from("!I", last, 42)
            wnd, = struct.unpack_from("!H", last, 48)
            while pos < (ack - 1001) + wnd:
                guest(sport, 1001 + pos, iss + 1, ACK, chunk)
                pos += len(chunk)
            await asyncio.sleep(0)
        while flow.transport.tr.get_write_buffer_size() or _readable(host):  # drain it all:
            assert asyncio.get_running_loop().time() < deadline  # the next write goes to the kernel
            while _readable(host) and host.recv(1 << 20):
                pass
            await asyncio.sleep(0.001)
        host.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        host.close()  # RST to the stack's host socket (on loopback: there before close() returns)
        tr.out.clear()
        for _ in range(40):  # segments in one go, before the loop sees the reset on the read side
            guest(sport, 1001 + pos, iss + 1, ACK, chunk)
            pos += len(chunk)
        for _ in range(20):
            await asyncio.sleep(0)
        seen["lost"] = stack.counters["tcp_host_lost"]
        seen["rst"] = any(f[47] & RST for f in tr.out)  # the guest hears the host side is gone

    seen = {}
    if loop == "uvloop":  # what the CLI runs on
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_first_broken_pipe())
            runner.run(_session(body))
    else:
        asyncio.run(_session(body))
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not [m for m in lines if "socket.send() raised exception" in m], lines
    assert seen == {"lost": 1, "rst": True}


async def _first_broken_pipe() -> None:
    """uvloop opens a descriptor (``/dev/null``) for good the first time a transport of its loop
    loses its connection on a write: do that once before a session, on the session's loop, so
    that the session's fd comparison sees only what it opened itself."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    srv.close()
    tr, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=c)
    peer.close()
    while not tr.is_closing():
        tr.write(b"x" * 65536)
        await asyncio.sleep(0.001)
    for _ in range(5):
        await asyncio.sleep(0)
