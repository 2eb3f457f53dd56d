"""Transport over a connected byte-stream socket: QEMU's ``-netdev stream`` (and old ``-netdev socket``).

Each Ethernet frame travels as a 4-byte big-endian length followed by the frame (see
:mod:`aioslirp.transport.framing`). The socket is usually an ``AF_UNIX`` ``SOCK_STREAM``
connection accepted from a listening path (``aioslirp qemu --socket PATH``) or one end of a
``socketpair()`` whose other end QEMU inherited (``addr.type=fd``).

Reading: ``loop.add_reader``; each wake-up reads up to ``reads_per_wakeup`` chunks of
``read_size`` bytes (stopping at ``EAGAIN``), decodes them and hands every completed frame
to the stack in one batch. EOF, a socket error or a length prefix over
:data:`~aioslirp.transport.base.MAX_FRAME` closes the transport (the last with an error
logged before anything is allocated for the frame).

Writing: a batch of frames from the stack's writer becomes one ``sendmsg()`` of
``[prefix, frame, prefix, frame, ...]``. When the socket is full (the guest is not
reading), the unsent remainder waits in an output buffer drained by ``loop.add_writer``;
the loop never blocks. The buffer is bounded by ``max_buffer`` bytes: a frame that would
go over it is dropped whole (the stream stays in sync) and counted in ``send_drops``; TCP
towards the guest then retransmits.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Sequence

from .base import MAX_FRAME, SocketTransport
from .framing import FrameTooLarge, StreamDecoder, encode_frames

__all__ = ["StreamTransport"]

log = logging.getLogger("aioslirp.transport.stream")

#: Most buffers handed to one sendmsg (Linux IOV_MAX is 1024).
_IOV_MAX = 1024
_FATAL_SEND = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF, errno.ECONNREFUSED)


class StreamTransport(SocketTransport):
    """Length-prefixed frames over a connected ``SOCK_STREAM`` socket (takes ownership of ``sock``).

    Args:
        sock: a connected stream socket (``AF_UNIX`` usually; ``AF_INET`` works too).
        read_size: bytes per ``recv`` (default 256 KiB).
        reads_per_wakeup: most ``recv`` calls per readable event, to bound latency.
        max_buffer: most bytes (prefixes included) kept queued for the guest when the socket
            is full; beyond that whole frames are dropped and counted.
        max_frame: largest frame accepted from the guest, in bytes.
        name: label for log lines (default: the peer address or fd).

    Counters (besides ``frames_in``, ``frames_out``, ``send_errors``): ``send_drops`` (dict
    reason -> frames: ``full``, ``closed``), ``bytes_buffered`` (now queued), and
    ``close_reason`` (``"eof"``, ``"frame_too_large"``, ``"error"`` or ``"closed"``).

    Raises:
        ValueError: ``sock`` is not a ``SOCK_STREAM`` socket.
    """

    __slots__ = ("read_size", "reads_per_wakeup", "decoder")

    gone_hint = ("QEMU (-netdev stream) is still running and connected to this socket (QEMU's own output says "
                 "why it left), or that the other end of the socket is still open")

    read_size: int
    reads_per_wakeup: int
    decoder: StreamDecoder

    def __init__(self, sock: socket.socket, *, read_size: int = 256 * 1024, reads_per_wakeup: int = 4,
                 max_buffer: int = 8 * 1024 * 1024, max_frame: int = MAX_FRAME, name: str | None = None) -> None:
        if sock.type != socket.SOCK_STREAM:
            raise ValueError("StreamTransport needs a SOCK_STREAM socket")
        super().__init__(sock, max_buffer, name)
        self.read_size = read_size
        self.reads_per_wakeup = reads_per_wakeup
        self.decoder = StreamDecoder(max_frame)
        # A bigger socket buffer absorbs a guest that reads in bursts (TCG vCPU).
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        except OSError:  # pragma: no cover - not fatal
            pass

    # -------------------------------------------------------------- reading
    def _readable(self) -> None:
        if self._fd < 0:
            return
        recv = self.sock.recv
        feed = self.decoder.feed
        frames: list[bytes] = []
        end: str | None = None
        exc: BaseException | None = None
        for _ in range(self.reads_per_wakeup):
            try:
                data = recv(self.read_size)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                end, exc = "error", e
                break
            if not data:
                end = "eof"
                break
            try:
                frames += feed(data)
            except FrameTooLarge as e:
                log.error("%s: guest sent a frame length of %d bytes (maximum %d): closing the connection",
                          self.name, e.length, e.max_frame)
                end, exc = "frame_too_large", e
                break
            if len(data) < self.read_size:
                break
        if frames:
            self.frames_in += len(frames)
            sink = self._on_frames
            if sink is not None:
                sink(frames)
        if end is not None:
            if end == "eof":
                if self.decoder.pending:
                    log.info("%s: guest closed the connection inside a frame (%d bytes lost)",
                             self.name, self.decoder.pending)
                else:
                    log.info("%s: guest closed the connection", self.name)
            elif end == "error":
                log.info("%s: read failed (%s); closing", self.name, exc)
            self.close_reason = end
            self.close(exc)

    # -------------------------------------------------------------- writing
    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Queue ``frames`` for the guest and write as much as the socket takes now.

        One ``sendmsg`` per call when the socket keeps up. Never blocks, never raises for
        I/O: frames over ``max_buffer`` are dropped and counted (``send_drops["full"]``);
        a broken connection closes the transport.
        """
        if self._fd < 0:
            self._drop("closed", len(frames))
            return
        if self._out:  # already backed up: append what fits, the writer callback sends it
            self._enqueue(frames, 0)
            return
        bufs = encode_frames(frames)
        total = 0
        for f in frames:
            total += len(f) + 4
        sent = self._sendmsg(bufs)
        if sent is None:
            return
        self.frames_out += len(frames)
        if sent == total:
            return
        # Partial write: keep the unsent tail (never split a frame when dropping later).
        self._queue_tail(bufs, sent)

    def _sendmsg(self, bufs: list) -> int | None:
        """Send ``bufs`` (at most _IOV_MAX at a time); returns bytes sent, None if the transport closed."""
        sent = 0
        sock = self.sock
        i = 0
        while i < len(bufs):
            chunk = bufs[i:i + _IOV_MAX]
            try:
                n = sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                return sent
            except OSError as exc:
                return self._send_failed(exc)
            sent += n
            want = 0
            for b in chunk:
                want += len(b)
            if n < want:
                return sent
            i += _IOV_MAX
        return sent

    def _send_failed(self, exc: OSError) -> None:
        """A write error on a stream cannot skip a frame without breaking the framing: close."""
        if exc.errno in _FATAL_SEND:  # the guest went away
            log.info("%s: write failed (%s); closing", self.name, exc)
        else:
            log.warning("%s: write failed (%s); closing", self.name, exc)
        self.send_errors += 1
        self.close_reason = "error"
        self.close(exc)
        return None

    def _queue_tail(self, bufs: list, sent: int) -> None:
        out = self._out
        for b in bufs:
            ln = len(b)
            if sent >= ln:
                sent -= ln
                continue
            if sent:
                b = memoryview(b)[sent:]
                ln -= sent
                sent = 0
            out.append(b)
            self.bytes_buffered += ln
        self._start_writer()

    def _enqueue(self, frames: Sequence[bytes], start: int) -> None:
        out = self._out
        limit = self.max_buffer
        dropped = 0
        for f in frames[start:]:
            size = len(f) + 4
            if self.bytes_buffered + size > limit:
                dropped += 1
                continue
            out.append(_prefix(len(f)))
            out.append(f)
            self.bytes_buffered += size
            self.frames_out += 1
        if dropped:
            self._drop("full", dropped)

    def _writable(self) -> None:
        out = self._out
        while out:
            bufs = []
            for b in out:
                bufs.append(b)
                if len(bufs) >= _IOV_MAX:
                    break
            try:
                n = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._send_failed(exc)
                return
            self.bytes_buffered -= n
            while n:
                b = out[0]
                ln = len(b)
                if n >= ln:
                    out.popleft()
                    n -= ln
                else:
                    out[0] = memoryview(b)[n:]
                    n = 0
                    return  # socket full again
        self._stop_writer()

    # -------------------------------------------------------------- closing
    def _close_io(self) -> None:
        if self.close_reason is None:
            self.close_reason = "closed"
        self._stop_writer()
        fd, self._fd = self._fd, -1
        if fd >= 0 and self._loop is not None:
            self._loop.remove_reader(fd)
        self._out.clear()
        self.bytes_buffered = 0
        self.sock.close()


def _prefix(n: int) -> bytes:
    return n.to_bytes(4, "big")
