"""The stack's own epoll for host-socket reads (aioslirp.nat.hostsock.HostPoller).

Checked with real sockets and the kernel's view of the epoll (``/proc/self/fdinfo``: one
``tfd:`` line per registered fd): a stack's connections register one fd each while they read
and none once they ended; when the stack exits the epoll is closed and nothing is left
registered; a flow paused because its buffer towards the guest is full gets no read callback
(the host bytes stay in the kernel) until the guest's ACKs resume it, through the loop; one
socket's failing callback does not stop the others of the same batch, and a socket removed by
an earlier callback of the batch gets none.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import socket
import struct
import termios

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.nat.hostsock import HostPoller, HostSocket
from aioslirp.wire.tcp import build_tcp

from support.frames import ACK, FIN, GUEST4, GUEST_MAC, GW4, GW_MAC, PSH, SYN
from support.stacks import CollectTransport as Collect, fd_count

ETH = GW_MAC + GUEST_MAC + b"\x08\x00"
SEQ_ACK = struct.Struct("!II")


def epoll_targets(epfd: int) -> int:
    """How many fds the kernel has registered in epoll ``epfd`` (``tfd:`` lines of its fdinfo)."""
    with open(f"/proc/self/fdinfo/{epfd}") as f:
        return sum(1 for line in f if line.startswith("tfd:"))


def epoll_fds() -> set[str]:
    """This process's open epoll fds."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventpoll]":
                out.add(name)
        except OSError:
            pass
    return out


def unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue (``FIONREAD``)."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return buf[0]


def _loops():
    out = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        pass
    else:
        out.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return out


def payload(frames) -> bytes:
    """The TCP payload of IPv4 frames to the guest, in order."""
    out = bytearray()
    for f in frames:
        if f[12:14] != b"\x08\x00" or f[23] != 6:
            continue
        doff = (f[46] >> 4) * 4
        total = struct.unpack_from("!H", f, 16)[0]
        out += f[34 + doff:14 + total]
    return bytes(out)


@pytest.mark.parametrize("new_loop", _loops())
def test_connections_register_once_and_the_epoll_is_closed_with_the_stack(new_loop):
    async def main():
        fds0 = fd_count()
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        eps0 = epoll_fds()
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
            tr = Collect()
            serving = asyncio.ensure_future(stack.serve(tr))
            await asyncio.sleep(0)
            poller = stack.parts.ctx.running.host_poller
            assert isinstance(poller, HostPoller) and not poller.closed
            new = epoll_fds() - eps0  # the loop's epoll existed before the stack
            # the stack's, and the one of the loop's express lane (aioslirp.fair), which watches
            # the stack's poller while a scheduled stack runs on the loop
            assert str(poller.fd) in new and len(new) == 2
            epfd = poller.fd
            assert epoll_targets(epfd) == 0

            on_frames = stack.parts.link.on_frames

            def guest(sport, seq, ack, flags, data=b""):
                on_frames([build_tcp(ETH, GUEST4, GW4, sport, port, seq, ack, flags, 65535, b"", data)], [True])

            n = 12
            for i in range(n):
                sport = 41000 + i
                tr.out.clear()
                guest(sport, 1000, 0, SYN)
                iss = SEQ_ACK.unpack_from(tr.out[-1], 38)[0]
                host, _ = srv.accept()
                guest(sport, 1001, iss + 1, ACK)
                guest(sport, 1001, iss + 1, ACK | PSH, b"q")
                flow = stack.parts.flows[(6, GUEST4, sport, GW4, port)]
                assert isinstance(flow.transport, HostSocket)
                assert poller.registered == 1 and epoll_targets(epfd) == 1  # one ADD, nothing more
                assert host.recv(1) == b"q"
                host.send(b"a")
                for _ in range(50):  # the loop's epoll -> ours -> the read callback
                    await asyncio.sleep(0.001)
                    if payload(tr.out) == b"a":
                        break
                assert payload(tr.out) == b"a"
                guest(sport, 1002, iss + 2, ACK | FIN)
                assert host.recv(1) == b""
                host.close()
                for _ in range(50):  # the EOF arrives through the epoll too: our FIN
                    await asyncio.sleep(0.001)
                    if any(f[47] & FIN for f in tr.out):
                        break
                fin = [f for f in tr.out if f[47] & FIN]
                assert fin
                guest(sport, 1003, SEQ_ACK.unpack_from(fin[-1], 38)[0] + 1, ACK)
                await asyncio.sleep(0)
                assert poller.registered == 0 and epoll_targets(epfd) == 0
            stack.stop()
            await serving
        assert poller.closed and poller.registered == 0
        assert poller.close() == 0  # idempotent
        assert str(epfd) not in epoll_fds() - eps0 and epoll_fds() == eps0
        srv.close()
        assert fd_count() == fds0

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())


@pytest.mark.parametrize("new_loop", _loops())
def test_a_paused_flow_gets_no_read_callback_until_resumed(new_loop):
    async def main():
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], tcp_buffer=16384)) as stack:
            tr = Collect()
            serving = asyncio.ensure_future(stack.serve(tr))
            await asyncio.sleep(0)
            poller = stack.parts.ctx.running.host_poller

            on_frames = stack.parts.link.on_frames

            def guest(seq, ack, flags, data=b""):
                on_frames([build_tcp(ETH, GUEST4, GW4, 41500, port, seq, ack, flags, 65535, b"", data)], [True])

            guest(1000, 0, SYN)
            iss = SEQ_ACK.unpack_from(tr.out[-1], 38)[0]
            host, _ = srv.accept()
            guest(1001, iss + 1, ACK)
            flow = stack.parts.flows[(6, GUEST4, 41500, GW4, port)]
            hs = flow.transport
            assert isinstance(hs, HostSocket)
            tr.out.clear()
            host.sendall(b"x" * 16384)  # fills the flow's buffer towards the guest: reading pauses
            for _ in range(100):
                await asyncio.sleep(0.001)
                if flow.reading_paused:
                    break
            assert flow.reading_paused and not hs.reading
            assert poller.registered == 0
            got = len(payload(tr.out))
            assert got >= 16384
            host.sendall(b"y" * 5000)
            for _ in range(100):  # until the kernel holds them all on our side
                if unread(hs.sock) == 5000:
                    break
                await asyncio.sleep(0.001)
            assert unread(hs.sock) == 5000
            for _ in range(20):  # many loop iterations: no read while paused
                await asyncio.sleep(0.001)
            assert len(payload(tr.out)) == got and unread(hs.sock) == 5000
            guest(1001, iss + 1 + got, ACK)  # the guest ACKs everything: room again, reading resumes
            assert hs.reading and poller.registered == 1
            for _ in range(100):
                await asyncio.sleep(0.001)
                if len(payload(tr.out)) == got + 5000:
                    break
            data = payload(tr.out)
            assert len(data) == got + 5000 and data.endswith(b"y" * 5000)
            assert unread(hs.sock) == 0
            host.close()
            stack.stop()
            await serving
        assert poller.closed and poller.registered == 0
        srv.close()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())


def test_a_failing_callback_does_not_stop_the_rest_of_the_batch(caplog):
    async def main():
        loop = asyncio.get_running_loop()
        poller = HostPoller(loop)
        pairs = [socket.socketpair() for _ in range(4)]
        calls = []
        try:
            def make(i):
                def cb():
                    calls.append(i)
                    pairs[i][0].recv(16)
                    if i % 2 == 0:
                        raise RuntimeError(f"flow {i} broke")
                return cb

            for i, (a, b) in enumerate(pairs):
                poller.add_reader(a.fileno(), make(i))
                b.send(b"!")
            assert poller.registered == 4
            with caplog.at_level(logging.ERROR, logger="aioslirp.tcp"):
                poller.dispatch()  # one batch: all four ready
            assert sorted(calls) == [0, 1, 2, 3]
            assert sum("read callback failed" in r.getMessage() for r in caplog.records) == 2
            assert poller.registered == 4  # a failure does not unregister anyone

            # A socket removed by an earlier callback of the batch gets no callback from it.
            calls.clear()
            a0, a1 = pairs[0][0], pairs[1][0]
            poller.remove_reader(pairs[2][0].fileno())
            poller.remove_reader(pairs[3][0].fileno())

            def first(me, other):
                def cb():
                    calls.append(me)
                    poller.remove_reader(other.fileno())
                    other.close()  # closed in the same batch, after its event was taken
                return cb

            poller.remove_reader(a0.fileno())
            poller.remove_reader(a1.fileno())
            poller.add_reader(a0.fileno(), first(0, a1))
            poller.add_reader(a1.fileno(), first(1, a0))
            pairs[0][1].send(b"!")
            pairs[1][1].send(b"!")
            poller.dispatch()
            assert len(calls) == 1 and poller.registered == 1
            assert poller.remove_reader(pairs[calls[0]][0].fileno()) is True
            assert poller.remove_reader(pairs[calls[0]][0].fileno()) is False
            assert poller.registered == 0
        finally:
            assert poller.close() == 0
            for a, b in pairs:
                a.close()
                b.close()
        assert poller.closed

    asyncio.run(main())
