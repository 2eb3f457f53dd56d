"""Transport over a connected message socket: one Ethernet frame per message.

For embedding: a VM manager or test creates ``socket.socketpair(AF_UNIX, SOCK_SEQPACKET)``
(or ``SOCK_DGRAM``), hands one end to the guest side and the other to
:class:`SocketPairTransport`. EOF or a socket error ends the transport.
"""

from __future__ import annotations

import errno
import logging
import socket

from .base import MAX_FRAME, Transport

log = logging.getLogger("aioslirp.transport")


class SocketPairTransport(Transport):
    """Frames over a connected ``SOCK_SEQPACKET`` or ``SOCK_DGRAM`` socket (takes ownership)."""

    __slots__ = ("sock", "batch")

    gone_hint = ("the other socket of the pair stays open in the guest (hand it over, e.g. with subprocess "
                 "pass_fds=, before this process closes its copy)")

    sock: socket.socket
    batch: int

    def __init__(self, sock: socket.socket, *, batch: int = 64) -> None:
        super().__init__()
        if sock.type not in (socket.SOCK_SEQPACKET, socket.SOCK_DGRAM):
            raise ValueError("SocketPairTransport needs a SOCK_SEQPACKET or SOCK_DGRAM socket")
        self.sock = sock
        self.batch = batch
        sock.setblocking(False)

    async def _start_reading(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        frames = []
        recv = self.sock.recv
        for _ in range(self.batch):
            try:
                data = recv(MAX_FRAME)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close_reason = "error"
                self.close(exc)
                return
            if not data and self.sock.type == socket.SOCK_SEQPACKET:
                if frames:
                    self._deliver(frames)
                self.close_reason = "eof"
                self.close()
                return
            frames.append(data)
        if frames:
            self._deliver(frames)

    def _deliver(self, frames) -> None:
        self.frames_in += len(frames)
        self._on_frames(frames)

    def send_frames(self, frames) -> None:
        send = self.sock.send
        for f in frames:
            try:
                send(f)
                self.frames_out += 1
            except (BlockingIOError, InterruptedError):
                self.send_errors += 1
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF, errno.ECONNREFUSED):
                    self.close_reason = "error"
                    self.close(exc)
                    return
                self.send_errors += 1

    def _close_io(self) -> None:
        if self.sock.fileno() >= 0:
            try:
                self._loop.remove_reader(self.sock.fileno())
            except Exception:
                pass
            self.sock.close()
