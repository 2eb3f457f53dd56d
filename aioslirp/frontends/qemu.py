"""Serving QEMU guests: ``-netdev stream`` / ``-netdev dgram`` on a UNIX socket, or an inherited fd.

:class:`QemuServer` puts a :class:`~aioslirp.stack.Stack` behind a listening path or a
connected socket and serves **one guest at a time**, then the next, with the same stack:

* ``stream`` on a path: the server listens; QEMU connects (``-netdev
  stream,server=off,addr.type=unix,addr.path=PATH``). While a guest is connected, a second
  connection is accepted and closed at once, with a warning in the log (QEMU 7.2 then
  sees EOF and its NIC carries no traffic; it does not reconnect). When the guest
  disconnects, every flow it had is torn down (:meth:`Stack.reset_flows`) and the
  server waits for the next connection.
* ``dgram`` on a path: the server binds PATH; QEMU binds its own path and sends there
  (``-netdev dgram,local.type=unix,local.path=QEMU_PATH,remote.type=unix,remote.path=PATH``).
  The first sender is the guest; datagrams from other senders are dropped (counted,
  logged once) while it is alive. A send to the guest failing (QEMU gone), or a new
  sender arriving after the old one's socket disappeared, tears the old guest's flows
  down and serves the new one (see :class:`~aioslirp.transport.dgram.DgramTransport`).
* a connected socket (``fd``): one guest, QEMU started with ``addr.type=fd`` (stream) or
  ``local.type=fd`` (dgram) on the other end of a ``socketpair()``; serving ends when the
  guest disconnects.

The socket path is removed when the server stops (only if it is still ours); a stale
socket left by a crashed server is replaced, a live one is refused (:class:`SocketInUse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat

from ..host.signals import request_stop
from ..transport.dgram import DgramTransport
from ..transport.stream import StreamTransport
from ..transport.unixpath import SocketInUse, bind_path

__all__ = ["QemuServer", "SocketInUse", "check_socket_path", "serve_qemu", "transport_for_fd"]

log = logging.getLogger("aioslirp.qemu")

#: Longest usable ``sun_path`` (bytes), without the terminating NUL.
MAX_SOCKET_PATH = 107


def check_socket_path(path: str) -> str | None:
    """Why ``path`` cannot be a socket path (one line), or ``None`` when it can.

    Checks the length limit of ``AF_UNIX`` paths, that the directory exists, and that an
    existing file there is a socket (a stale one is replaced when binding).
    """
    raw = os.fsencode(path)
    if not raw:
        return "the socket path is empty"
    if len(raw) > MAX_SOCKET_PATH:
        return f"{path!r} is {len(raw)} bytes long; UNIX socket paths are limited to {MAX_SOCKET_PATH}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} exists and is not a socket"
    return None


def transport_for_fd(fd: int, *, dgram: bool | None = None):
    """A transport over the connected socket ``fd`` (ownership taken): stream or dgram by its type.

    ``dgram`` (when not ``None``) states the type the caller expects. Raises ``OSError``
    when ``fd`` is not a socket, ``ValueError`` when it is not connected, of the wrong type,
    or neither ``SOCK_STREAM`` nor ``SOCK_DGRAM``.
    """
    sock = socket.socket(fileno=fd)
    try:
        kind = sock.type
        if kind not in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
            raise ValueError(f"fd {fd} is neither a stream nor a datagram socket")
        if dgram is not None and dgram != (kind == socket.SOCK_DGRAM):
            raise ValueError(f"fd {fd} is a {'datagram' if kind == socket.SOCK_DGRAM else 'stream'} socket")
        try:
            sock.getpeername()
        except OSError:
            raise ValueError(f"fd {fd} is not a connected socket") from None
    except BaseException:
        sock.detach()
        raise
    if kind == socket.SOCK_STREAM:
        return StreamTransport(sock, name=f"fd {fd}")
    return DgramTransport(sock, name=f"fd {fd}")


class QemuServer:
    """Serve QEMU guests one at a time with ``stack``.

    Give exactly one of ``path`` (listen / bind there; ``dgram`` picks ``-netdev dgram``
    over ``-netdev stream``) or ``transport`` (an already connected transport, e.g. from
    :func:`transport_for_fd`). Then ``await server.serve()`` until :meth:`close` (or, with
    ``transport``, until that guest leaves). ``start()`` binds the path early so a caller
    can launch QEMU right after it returns.

    Attributes:
        guests: guests served so far. ``refused``: connections refused while busy.
        transport: the current guest's transport, or ``None``.

    Raises (from :meth:`start`): :class:`SocketInUse`, ``OSError`` when binding fails.
    """

    def __init__(self, stack, *, path: str | None = None, dgram: bool = False, transport=None) -> None:
        if (path is None) == (transport is None):
            raise ValueError("give exactly one of path or transport")
        self.stack = stack
        self.path = path
        self.dgram = dgram
        self.transport = transport
        self.guests = 0
        self.refused = 0
        self._listener: socket.socket | None = None
        self._ino: int | None = None
        self._pending: asyncio.Queue | None = None
        self._stopping: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy = False
        self._started = False

    async def start(self) -> None:
        """Bind/listen on the path (no-op for a transport). Idempotent."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._stopping = self._loop.create_future()
        if self.path is None:
            return
        if self.dgram:
            sock = bind_path(self.path, socket.SOCK_DGRAM)
            self._ino = os.stat(self.path).st_ino
            self.transport = DgramTransport(sock, name=self.path, on_guest_change=self._guest_changed)
            log.info("waiting for a QEMU guest on %s (-netdev dgram)", self.path)
            return
        sock = bind_path(self.path, socket.SOCK_STREAM)
        self._ino = os.stat(self.path).st_ino
        sock.listen(8)
        sock.setblocking(False)
        self._listener = sock
        self._pending = asyncio.Queue()
        self._loop.add_reader(sock.fileno(), self._accept)
        log.info("waiting for a QEMU guest on %s (-netdev stream)", self.path)

    async def serve(self) -> None:
        """Serve guests until :meth:`close` (path) or until the one guest leaves (transport).

        Always releases the socket and the path before returning.
        """
        await self.start()
        try:
            if self.path is None or self.dgram:
                await self._serve_one(self.transport, reset_after=self.path is None)
                return
            while not self._stopping.done() and not self._stack_stopped():
                getter = asyncio.ensure_future(self._pending.get())
                await asyncio.wait([getter, self._stopping], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await getter
                    break
                conn, label = getter.result()
                await self._serve_one(StreamTransport(conn, name=label), reset_after=True)
        finally:
            self._release()

    async def _serve_one(self, transport, *, reset_after: bool) -> None:
        self.transport = transport
        self._busy = True
        if not isinstance(transport, DgramTransport) or transport.connected:
            self.guests += 1
            log.info("guest connected on %s", transport.name)
        stack = self.stack
        serve = asyncio.ensure_future(stack.serve(transport))
        try:
            await asyncio.wait([serve, self._stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not serve.done():
                if self._stopping.done():  # stopping (SIGINT/SIGTERM): the guest is told first
                    request_stop(stack)  # serve() resets the guest's flows, then closes the transport
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(asyncio.shield(serve), 2.0)
                transport.close()
                await asyncio.gather(serve, return_exceptions=True)
            self._busy = False
            self.transport = None
        if serve.exception() is not None:
            raise serve.exception()
        reason = getattr(transport, "close_reason", None)
        log.info("guest on %s left (%s): %s", transport.name, reason or "closed", _transport_stats(transport))
        if reset_after:
            self._reset(transport.name)

    def _stack_stopped(self) -> bool:
        stopped = getattr(self.stack, "_stopped", None)  # set by Stack.stop()
        return stopped is not None and stopped.done()

    def _reset(self, label: str) -> None:
        n = self.stack.reset_flows()
        log.info("guest on %s: %d flow(s) torn down", label, n)

    def _guest_changed(self, old, new) -> None:
        if new is not None:
            self.guests += 1
        if old is not None:
            if self.transport is not None:
                log.info("guest on %s: %s", self.path, _transport_stats(self.transport))
            self._reset(self.path or "?")

    def _accept(self) -> None:
        listener = self._listener
        if listener is None:
            return
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept on %s failed: %s", self.path, exc)
                return
            label = f"{self.path}#{self.guests + self._pending.qsize() + 1}"
            if self._busy or not self._pending.empty():
                self.refused += 1
                log.warning("refusing a second guest on %s: one guest at a time (closed at once)", self.path)
                conn.close()
                continue
            self._pending.put_nowait((conn, label))

    def close(self) -> None:
        """Stop serving: the current guest's transport closes, :meth:`serve` returns."""
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)
        elif self._stopping is None:
            self._release()

    def _release(self) -> None:
        if self._listener is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        if self._pending is not None:
            while not self._pending.empty():
                self._pending.get_nowait()[0].close()
        if self.transport is not None:
            self.transport.close()
        if self.path is not None and self._ino is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
            self._ino = None


async def serve_qemu(config, *, path: str | None = None, fd: int | None = None, dgram: bool = False,
                     handle_signals: bool = False, stack_factory=None) -> int:
    """``aioslirp qemu``: serve QEMU guests on ``path`` (or the connected socket ``fd``) until stopped.

    With ``handle_signals``, SIGINT and SIGTERM stop serving cleanly. Returns 0 on a clean
    stop (signal, or the ``fd`` guest leaving). Raises :class:`SocketInUse`, ``OSError``
    (binding), ``ValueError`` (a bad ``fd``).
    """
    import signal

    from ..stack import Stack

    factory = stack_factory or Stack
    loop = asyncio.get_running_loop()
    async with factory(config) as stack:
        if fd is not None:
            server = QemuServer(stack, transport=transport_for_fd(fd, dgram=dgram if dgram else None))
        else:
            server = QemuServer(stack, path=path, dgram=dgram)
        installed = []
        try:
            await server.start()
            if handle_signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, _stop, server, sig)
                    installed.append(sig)
                reopen = getattr(stack, "reopen_audit_log", None)
                if reopen is not None:  # SIGHUP: reopen the --audit-log file (log rotation)
                    loop.add_signal_handler(signal.SIGHUP, reopen)
                    installed.append(signal.SIGHUP)
            await server.serve()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            server.close()
        log.info("stopped after %d guest(s)", server.guests)
        log.debug("counters: %s", dict(stack.counters))
    return 0


def _transport_stats(tr) -> str:
    drops = getattr(tr, "send_drops", None) or {}
    text = f"{tr.frames_in} frames in, {tr.frames_out} out"
    if drops:
        text += ", dropped towards the guest: " + ", ".join(f"{k}={v}" for k, v in sorted(drops.items()))
    foreign = getattr(tr, "drop_foreign", 0)
    if foreign:
        text += f", {foreign} from other senders ignored"
    return text


def _stop(server: QemuServer, sig) -> None:
    log.info("%s received; stopping", signal_name(sig))
    server.close()


def signal_name(sig) -> str:
    import signal

    try:
        return signal.Signals(sig).name
    except ValueError:  # pragma: no cover
        return str(sig)
