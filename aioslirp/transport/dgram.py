"""Transport over a datagram socket: one Ethernet frame per datagram, no header.

This is QEMU's ``-netdev dgram`` (and vfkit's ``unixgram`` network device): QEMU binds its
own ``AF_UNIX`` ``SOCK_DGRAM`` path (``local.path``) and sends every frame as one datagram
to ours (``remote.path``). Two ways to use it:

* **bound** (``DgramTransport.bind(path)`` / ``aioslirp qemu --dgram --socket PATH``): the
  first sender becomes *the guest* and our socket is ``connect()``-ed to it. From then on
  the kernel refuses datagrams from any other sender (their ``sendto`` fails with
  ``EPERM``): one guest at a time. Frames queued from another sender before that are
  dropped, counted in ``drop_foreign`` and logged once per sender. The guest is known to
  be gone when a send to it fails with ``ECONNREFUSED``, or when the once-a-second check
  (``probe_interval``) finds nothing bound at its path any more, or a different socket
  there (QEMU restarted on the same path). Then ``on_guest_change(old, None)`` is called
  so that the owner can tear the old guest's flows down, our socket is disconnected, and
  the next sender becomes the guest (``on_guest_change(None, new)``). The transport
  itself stays open.
* **connected** (a ``socketpair(AF_UNIX, SOCK_DGRAM)`` end, QEMU ``local.type=fd``): every
  datagram is the guest's; a send failing with ``ECONNREFUSED`` (peer closed) closes the
  transport. A datagram socket gives no EOF, so a VM manager should also watch QEMU's
  process.

Reads are batched (up to ``batch`` datagrams per wake-up, until ``EAGAIN``). Writes are one
``send`` per frame (a datagram is a frame). Why connect: the kernel lets a receiver queue
only ``net.unix.max_dgram_qlen`` (default 10) datagrams from a sender it is not connected
to, and an unconnected sender gets ``EAGAIN`` with no way to wait; a connected sender can
wait for ``POLLOUT``, which the kernel raises when the receiver drains its queue. So when
``send`` says ``EAGAIN`` the rest of the batch waits in an output queue drained by
``loop.add_writer`` (bounded by ``max_buffer`` bytes; frames beyond are dropped and
counted in ``send_drops["full"]``). The loop never blocks.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
from typing import Callable, Sequence

from .base import MAX_FRAME, SocketTransport

__all__ = ["DgramTransport"]

log = logging.getLogger("aioslirp.transport.dgram")

_GONE = (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTCONN, errno.EPIPE, errno.ECONNRESET)
_libc = ctypes.CDLL(None, use_errno=True)


class DgramTransport(SocketTransport):
    """Frames as datagrams on ``sock`` (``SOCK_DGRAM``; takes ownership).

    Args:
        sock: a ``SOCK_DGRAM`` socket, either connected (socketpair / fd) or bound and
            unconnected (then the guest is learned from the first datagram).
        batch: most datagrams read per wake-up.
        max_buffer: most bytes of frames kept waiting for a full receiver.
        probe_interval: seconds between checks that a bound-mode guest still exists.
        name: label for log lines.
        on_guest_change: ``callback(old_addr, new_addr)`` in bound mode, called when the
            guest is found gone (``new_addr`` ``None``) or a new sender becomes the guest
            (``old_addr`` ``None``).
        unlink_path: a filesystem path to remove when the transport closes (set by
            :meth:`bind`).

    Counters: ``frames_in``, ``frames_out``, ``send_errors``, ``send_drops`` (reason ->
    frames: ``full``, ``no_guest``, ``gone``, ``too_big``, ``closed``), ``drop_foreign``
    (datagrams from a second sender), ``guests`` (guests seen), ``bytes_buffered``.

    Raises:
        ValueError: ``sock`` is not ``SOCK_DGRAM``.
    """

    __slots__ = ("batch", "probe_interval", "on_guest_change", "unlink_path", "drop_foreign", "guests", "peer",
                 "_peer_ino", "_probe", "_foreign_logged", "connected")

    gone_hint = "QEMU (-netdev dgram) is running and its remote= address is this socket's"

    batch: int
    probe_interval: float
    on_guest_change: Callable[[object, object], None] | None
    unlink_path: str | None
    drop_foreign: int
    guests: int
    #: The guest's address (bound mode), ``None`` when none is known.
    peer: object
    _peer_ino: int | None
    #: The probe timer (bound mode).
    _probe: object
    _foreign_logged: set
    #: The socket is connected (a socketpair / fd) rather than bound.
    connected: bool

    def __init__(self, sock: socket.socket, *, batch: int = 64, max_buffer: int = 8 * 1024 * 1024,
                 probe_interval: float = 1.0, name: str | None = None,
                 on_guest_change: Callable[[object, object], None] | None = None,
                 unlink_path: str | None = None) -> None:
        if sock.type != socket.SOCK_DGRAM:
            raise ValueError("DgramTransport needs a SOCK_DGRAM socket")
        super().__init__(sock, max_buffer, name)
        self.batch = batch
        self.probe_interval = probe_interval
        self.on_guest_change = on_guest_change
        self.unlink_path = unlink_path
        self.drop_foreign = 0
        self.guests = 0
        try:
            sock.getpeername()
            #: True for a socket connected from the start (fd / socketpair): one guest, ever.
            self.connected = True
        except OSError:
            self.connected = False
        #: Address of the guest (bound mode), ``None`` while there is none.
        self.peer = None
        self._peer_ino: int | None = None
        self._probe: object = None
        self._foreign_logged: set = set()
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 1 << 20)
            except OSError:  # pragma: no cover
                pass

    @classmethod
    def bind(cls, path: str, **kwargs) -> "DgramTransport":
        """Bind a new ``AF_UNIX`` datagram socket at ``path`` (removed again on close).

        Raises ``OSError`` (e.g. ``EADDRINUSE`` when ``path`` exists).
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        kwargs.setdefault("name", path)
        return cls(sock, unlink_path=path, **kwargs)

    # -------------------------------------------------------------- reading
    def _readable(self) -> None:
        if self._fd < 0:
            return
        frames: list[bytes] = []
        exc: OSError | None = None
        if self.connected:
            recv = self.sock.recv
            for _ in range(self.batch):
                try:
                    frames.append(recv(MAX_FRAME))
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    exc = e
                    break
        else:
            recvfrom = self.sock.recvfrom
            for _ in range(self.batch):
                try:
                    data, addr = recvfrom(MAX_FRAME)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    exc = e
                    break
                if addr != self.peer and not self._accept_sender(addr, frames):
                    continue
                frames.append(data)
        if frames:
            self._deliver(frames)
        if exc is not None:
            if not self.connected and exc.errno in _GONE:
                return  # an earlier send's error reported on read; handled by the send path
            log.info("%s: read failed (%s); closing", self.name, exc)
            self.close_reason = "error"
            self.close(exc)

    def _deliver(self, frames: list) -> None:
        self.frames_in += len(frames)
        sink = self._on_frames
        if sink is not None:
            sink(frames)

    def _accept_sender(self, addr, frames: list) -> bool:
        """A datagram from ``addr``, not the guest. True: it is the guest now, serve it."""
        if not addr:
            self.drop_foreign += 1  # an unnamed sender cannot be answered
            return False
        if self.peer is not None:
            if self._peer_alive():
                self.drop_foreign += 1
                if addr not in self._foreign_logged and len(self._foreign_logged) < 64:
                    self._foreign_logged.add(addr)
                    log.warning("%s: ignoring frames from %s: already serving the guest at %s (one guest at a time)",
                                self.name, _label(addr), _label(self.peer))
                return False
            if frames:  # what the old guest sent first goes first
                self._deliver(frames[:])
                frames.clear()
            self._peer_lost("its socket is gone")
        try:
            self.sock.connect(addr)
        except OSError as exc:  # it vanished already
            self.drop_foreign += 1
            log.info("%s: new guest %s is gone already (%s)", self.name, _label(addr), exc.strerror)
            return False
        self.peer = addr
        self._peer_ino = _inode(addr)
        self.guests += 1
        self._foreign_logged.discard(addr)
        log.info("%s: serving guest %s", self.name, _label(addr))
        if self.on_guest_change is not None:
            self.on_guest_change(None, addr)
        self._arm_probe()
        return True

    def _peer_alive(self) -> bool:
        peer = self.peer
        if not isinstance(peer, (str, bytes)) or (isinstance(peer, bytes) and peer.startswith(b"\0")):
            return _bound(peer)  # abstract address: no inode to compare
        ino = _inode(peer)
        return ino is not None and ino == self._peer_ino and _bound(peer)

    def _arm_probe(self) -> None:
        if self._probe is None and self._loop is not None and self.probe_interval > 0 and self._fd >= 0:
            self._probe = self._loop.call_later(self.probe_interval, self._check_peer)

    def _check_peer(self) -> None:
        self._probe = None
        if self._fd < 0 or self.peer is None:
            return
        if not self._peer_alive():
            self._peer_lost("its socket is gone")
        else:
            self._arm_probe()

    def _peer_lost(self, why: str) -> None:
        old, self.peer = self.peer, None
        self._peer_ino = None
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        _disconnect(self._fd)
        dropped = len(self._out)
        if dropped:
            self._drop("gone", dropped)
        self._out.clear()
        self.bytes_buffered = 0
        self._stop_writer()
        log.info("%s: guest %s left (%s)", self.name, _label(old), why)
        if self.on_guest_change is not None:
            self.on_guest_change(old, None)

    # -------------------------------------------------------------- writing
    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Send each frame as one datagram; waits (bounded, counted drops) when the receiver is full."""
        if self._fd < 0:
            self._drop("closed", len(frames))
            return
        if not self.connected and self.peer is None:
            self._drop("no_guest", len(frames))
            return
        if self._out:
            self._enqueue(frames, 0)
            return
        send = self.sock.send
        for i, f in enumerate(frames):
            try:
                send(f)
            except (BlockingIOError, InterruptedError):
                self._enqueue(frames, i)
                self._start_writer()
                return
            except OSError as exc:
                self._send_error(exc, len(frames) - i)
                return
            self.frames_out += 1

    def _send_error(self, exc: OSError, n: int) -> None:
        e = exc.errno or 0
        if e in (errno.EMSGSIZE,):
            self._drop("too_big", 1)
            return
        if e == errno.ENOBUFS:
            self._drop("full", 1)
            return
        self._drop("gone", n)
        if not self.connected and e in _GONE:
            self._peer_lost(os.strerror(e))
        else:
            log.info("%s: write failed (%s); closing", self.name, exc)
            self.close_reason = "error"
            self.close(exc)

    def _enqueue(self, frames: Sequence[bytes], start: int) -> None:
        out = self._out
        dropped = 0
        for f in frames[start:]:
            if self.bytes_buffered + len(f) > self.max_buffer:
                dropped += 1
                continue
            out.append(f)
            self.bytes_buffered += len(f)
        if dropped:
            self._drop("full", dropped)

    def _writable(self) -> None:
        out = self._out
        send = self.sock.send
        while out:
            f = out[0]
            try:
                send(f)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                out.popleft()
                self.bytes_buffered -= len(f)
                self._send_error(exc, 1)
                if self._fd < 0 or (not self.connected and self.peer is None):
                    return
                continue
            out.popleft()
            self.bytes_buffered -= len(f)
            self.frames_out += 1
        self._stop_writer()

    # -------------------------------------------------------------- closing
    def _close_io(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        self._stop_writer()
        self._out.clear()
        self.bytes_buffered = 0
        fd, self._fd = self._fd, -1
        if fd >= 0:
            if self._loop is not None:
                self._loop.remove_reader(fd)
            self.sock.close()
            if self.unlink_path:
                _unlink_socket(self.unlink_path)


def _inode(addr) -> int | None:
    try:
        return os.stat(addr).st_ino
    except (OSError, TypeError, ValueError):
        return None


def _bound(addr) -> bool:
    """Whether a datagram socket is bound at ``addr`` (a connect() probe; sends nothing)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(addr)
        return True
    except (OSError, TypeError, ValueError):
        return False
    finally:
        probe.close()


def _disconnect(fd: int) -> None:
    """Dissolve a datagram socket's association (``connect`` to ``AF_UNSPEC``, POSIX 1003.1g)."""
    if fd < 0:
        return
    sa = ctypes.create_string_buffer(16)  # sa_family = AF_UNSPEC (0)
    _libc.connect(fd, sa, 16)


def _label(addr) -> str:
    if isinstance(addr, bytes) and addr.startswith(b"\0"):
        return "@" + addr[1:].decode(errors="replace")
    return repr(addr) if addr in (None, "", b"") else str(addr)


def _unlink_socket(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
