"""The host side of a TCP flow: a connected non-blocking socket read through the stack's own
epoll (:class:`HostPoller`), written with ``add_writer`` after a short send.

:class:`HostSocket` stands where an asyncio transport stood (``loop.create_connection(sock=...)``)
and offers the subset :class:`~aioslirp.nat.tcp.TcpFlow` uses. It keeps no write buffer of its
own: :meth:`HostSocket.send` returns how many bytes the kernel took, and the flow leaves the rest
in the connection's receive queue, so the window advertised to the guest closes when the host
peer reads slowly (RFC 9293 3.8.6: the receive window is the buffer space left), instead of the
bytes piling up in a second buffer.

Why not an asyncio transport: per guest connection a transport costs an extra event-loop
iteration before ``connection_made`` (the SYN-ACK waited for it), enum conversions and
``getsockname``/``getpeername``/``ioctl`` system calls at creation, and a ``connection_lost``
callback at the end. Measured on the CRR benchmark (benchmarks/run.py): see docs/performance.md.

Callbacks into the flow, with the asyncio protocol names: ``data_received(bytes)``,
``eof_received()`` (the host peer shut down its write side; reading stops),
``connection_lost(exc)`` (only after an error: the socket is already closed),
``pause_writing()`` (the kernel's send buffer is full) and ``resume_writing()`` (it has room).

A bulk flow moves its socket to an asyncio transport, served through :class:`TransportHost`
(the same interface: both follow :class:`~aioslirp.nat.mover.HostMover`, and call the flow
back as a :class:`~aioslirp.nat.mover.MoverFlow`). The connect before all this is :func:`connect_start` /
:func:`wait_connected` (:func:`connect_numeric` both); :func:`close_socket` is the one way a
host socket is closed, with ``abort`` so that the host peer sees an RST.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import socket
import struct
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

from ..flow.context import ReadPoller
from ..ratelimit import ByteBucket
from .mover import Bytes, MoverFlow

__all__ = ["HostPoller", "HostSocket", "TransportHost", "READ_SIZE", "connect_start", "connect_numeric", "wait_connected",
           "close_socket", "linger_zero"]

log = logging.getLogger("aioslirp.tcp")

#: Largest single ``recv`` from the host socket, bytes (further capped by the guest's window room).
READ_SIZE = 256 * 1024
#: Smallest ``recv`` size, bytes (used when the flow's send buffer is nearly full).
MIN_READ = 4096
#: Most readiness events (one per socket) taken from the :class:`HostPoller` epoll per loop
#: callback; more ready sockets keep its fd readable, and the rest come on the next iteration.
POLL_MAX_EVENTS = 256
#: Reads up to this size (bytes) have their frames written to the guest before the callback
#: returns (no writer task wake-up: request/response latency); larger ones leave it to the writer.
SYNC_WRITE_MAX = 16384
_LINGER0 = struct.pack("ii", 1, 0)
# One receive buffer for all host sockets (one thread): each read is copied out at its exact size.
# recv(READ_SIZE) instead would malloc 256 KiB and shrink it for every read; for small reads that
# fragments the heap (measured: +17.8 MiB RSS over 10,000 short connections, vs +2-4 MiB this way).
_RBUF = bytearray(READ_SIZE)
_RVIEW = memoryview(_RBUF)


class _ClosedFlow:
    """Stands for the flow once the socket is closed (late callbacks find nothing to do)."""

    __slots__ = ()

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass


# Typed as the flow it stands for: once closed, only a late writer callback (pause_writing,
# resume_writing) can reach it; the read callback is unregistered with the socket.
_CLOSED_FLOW = cast(MoverFlow, _ClosedFlow())


def linger_zero(sock: socket.socket) -> None:
    """Make closing ``sock`` send an RST to its peer (``SO_LINGER`` on, 0 seconds); errors ignored."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
    except OSError:
        pass


def close_socket(sock: socket.socket | None, abort: bool) -> None:
    """Close ``sock`` (``None``: nothing to do); with ``abort`` so that the peer sees an RST."""
    if sock is None:
        return
    if abort:
        linger_zero(sock)
    sock.close()


def connect_start(sock: socket.socket, addr: tuple) -> int:
    """Start connecting non-blocking ``sock`` to numeric ``addr``: 0 (connected), ``EINPROGRESS``
    (still going: wait for writability) or the errno of the failure (``ECONNREFUSED``...).

    To a local address (the gateway maps to the host's loopback) the kernel usually finishes
    the handshake inside ``connect()`` itself: asking again at once says so (``EISCONN``), or
    gives the refusal, without a trip through the event loop (``EALREADY``: still going).
    """
    err = sock.connect_ex(addr)
    if err == errno.EINPROGRESS:
        err = sock.connect_ex(addr)
        if err == errno.EISCONN:
            err = 0
        elif err == errno.EALREADY:
            err = errno.EINPROGRESS
    return err


async def connect_numeric(loop: asyncio.AbstractEventLoop, sock: socket.socket, addr: tuple,
                          timeout: float | None = None) -> None:
    """Connect non-blocking ``sock`` to ``addr``, a *numeric* (host, port) pair, without a resolver.

    ``loop.sock_connect`` in uvloop runs ``getaddrinfo`` on libuv's thread pool for every call,
    even for a numeric address: a thread hand-off per guest connection (measured: CRR backend
    CPU -20%, p50 -17% without it). Raises ``OSError`` (``ConnectionRefusedError`` etc., by
    errno) like ``sock_connect``, and ``TimeoutError`` (errno ``ETIMEDOUT``) when ``timeout``
    seconds pass first; cancellation leaves no reader/writer or timer registered.

    The timeout is a ``loop.call_later`` handle, not ``asyncio.wait_for``, which in Python 3.11
    wraps the coroutine in a task of its own: one task less per guest connection.
    """
    err = connect_start(sock, addr)
    if err == 0:
        return
    if err != errno.EINPROGRESS:
        raise OSError(err, os.strerror(err))
    await wait_connected(loop, sock, timeout)


async def wait_connected(loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float | None = None) -> None:
    """Wait until the connect in progress on non-blocking ``sock`` ends (writable), then raise its
    error (``SO_ERROR``) as ``OSError``, or ``TimeoutError`` after ``timeout`` seconds."""
    fut = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    def expired() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError(errno.ETIMEDOUT, "connect timed out"))

    loop.add_writer(fd, ready)
    timer = loop.call_later(timeout, expired) if timeout is not None else None
    try:
        await fut
    finally:
        loop.remove_writer(fd)
        if timer is not None:
            timer.cancel()
    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))


class HostPoller:
    """Read readiness of the host sockets through one ``epoll`` of our own, watched by ``loop``.

    The epoll's fd is registered once with the loop (``loop.add_reader``); when it is readable
    :meth:`dispatch` takes up to :data:`POLL_MAX_EVENTS` ready fds (``epoll_wait`` with no wait)
    and calls each one's callback. A socket then costs one ``EPOLL_CTL_ADD`` to start and one
    ``EPOLL_CTL_DEL`` to stop, where the loop's ``add_reader``/``remove_reader`` (uvloop's
    ``uv_poll``) cost about 7 system calls per socket (``epoll_ctl`` ADD and DEL probes, an
    ``ioctl(FIONBIO)``, ``DEL`` calls answered ``ENOENT`` on stop and close).

    Level-triggered, ``EPOLLIN`` only. Stopping is a ``DEL``, not a ``MOD`` to an empty event
    mask: epoll reports ``EPOLLHUP``/``EPOLLERR`` whatever the mask, so a paused socket whose
    peer hung up would keep the epoll readable and the loop spinning.

    Callbacks are looked up when the batch is dispatched (a dict fd -> callback), so one that
    stops or closes another socket of the same batch also stops its delivery. An exception
    from a callback is logged and the rest of the batch is still delivered (a failing flow
    ends itself, never its siblings). One per :class:`~aioslirp.stack.Stack`
    (``ctx.running.host_poller``, :class:`~aioslirp.flow.context.Running`), made when it starts and
    closed by its ``aclose``.
    Not thread-safe: all methods on ``loop``'s thread.
    """

    __slots__ = ("loop", "_ep", "_callbacks", "_fd")

    loop: asyncio.AbstractEventLoop
    _ep: select.epoll
    #: fd -> its read callback (no arguments): the fds registered in the epoll.
    _callbacks: dict[int, Callable[[], None]]
    #: The epoll's own fd (registered with ``loop``), or -1 once closed.
    _fd: int

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._ep = select.epoll()
        self._callbacks = {}
        self._fd = self._ep.fileno()
        loop.add_reader(self._fd, self.dispatch)

    @property
    def fd(self) -> int:
        """The epoll's own fd (the one ``loop`` watches), -1 once closed."""
        return self._fd

    @property
    def registered(self) -> int:
        """How many fds are registered (being read) now."""
        return len(self._callbacks)

    @property
    def closed(self) -> bool:
        """:meth:`close` ran: the epoll is closed and no longer watched by the loop."""
        return self._fd < 0

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (no arguments) whenever ``fd`` is readable, until
        :meth:`remove_reader`. ``fd`` not yet registered. Raises ``OSError`` from ``epoll_ctl``
        (``EBADF`` for a closed fd, ``EPERM`` for a file that epoll cannot watch) and
        ``ValueError`` once closed."""
        try:
            self._ep.register(fd, select.EPOLLIN)
        except FileExistsError:  # this very socket is in the set already: take it as a re-arm
            self._ep.modify(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def remove_reader(self, fd: int) -> bool:
        """Stop watching ``fd``; True when it was registered. No callback for ``fd`` follows, not
        even from the batch being dispatched. Call it *before* closing the socket: epoll keeps
        watching a closed fd's open file while another process holds it (a child forked
        meanwhile), and its events would then come under a number a new socket may have."""
        if self._callbacks.pop(fd, None) is None:
            return False
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):  # fd already closed, or the epoll is
            pass
        return True

    def dispatch(self) -> None:
        """Deliver the ready fds' callbacks (the loop calls this when the epoll is readable)."""
        try:
            events = self._ep.poll(0, POLL_MAX_EVENTS)
        except (InterruptedError, ValueError):  # a signal; closed meanwhile
            return
        callbacks = self._callbacks
        for fd, _ in events:
            cb = callbacks.get(fd)
            if cb is None:  # stopped or closed by an earlier callback of this batch
                continue
            try:
                cb()
            except Exception:  # one socket's failure does not cost the others their turn
                log.exception("host socket read callback failed (fd %d)", fd)

    def close(self) -> int:
        """Stop watching the epoll, close it and forget the registered fds (those still open are
        not closed). Returns how many fds were still registered (their owners should have
        removed them: logged as a warning). Idempotent (0 the next times)."""
        if self._fd < 0:
            return 0
        left = len(self._callbacks)
        if left:
            log.warning("host poller closed with %d sockets still registered", left)
        self._callbacks.clear()
        self.loop.remove_reader(self._fd)
        self._fd = -1
        self._ep.close()
        return left


class HostSocket:
    """A connected, non-blocking host socket (``sock``) serving ``flow``; readable at once.

    ``poller``: the stack's :class:`HostPoller`, which watches the socket for reading (its
    ``loop`` runs everything else: the writer for a short send, ``call_soon``, the clock).

    ``batch``: a context manager (the stack's ``InjectQueue.held()``) entered around each small
    read (at most :data:`SYNC_WRITE_MAX` bytes), so that the frames it produces are written to
    the guest before the callback returns.

    Not thread-safe; all methods run on ``loop``'s thread. Raises nothing for I/O errors: they
    close the socket and reach the flow as ``connection_lost(exc)``.
    """

    __slots__ = ("loop", "poller", "sock", "fd", "flow", "batch", "reading", "writing", "closed", "cap")

    loop: asyncio.AbstractEventLoop
    #: The :class:`HostPoller` the socket is registered with while :attr:`reading` (typed by the
    #: :class:`~aioslirp.flow.context.ReadPoller` it follows, as ``ctx.running`` holds it).
    poller: ReadPoller
    sock: socket.socket
    #: ``sock.fileno()``.
    fd: int
    #: The :class:`~aioslirp.nat.tcp.TcpFlow` served (a no-op stand-in once closed).
    flow: MoverFlow
    #: The guest-side batch context (``InjectQueue.held()``): frames the flow queues while it
    #: is held leave together when it ends, in the same loop iteration.
    batch: AbstractContextManager
    #: Registered with :attr:`poller` for reading.
    reading: bool
    #: A writer is registered (the last send was short): the flow is paused.
    writing: bool
    closed: bool
    #: The guest's host -> guest :class:`~aioslirp.ratelimit.ByteBucket`, or ``None``: a read
    #: takes at most what it holds (at least :data:`MIN_READ`), so bursts stay bounded.
    cap: ByteBucket | None

    def __init__(self, poller: ReadPoller, sock: socket.socket, flow: MoverFlow, batch: AbstractContextManager,
                 cap: ByteBucket | None = None) -> None:
        self.poller = poller
        self.loop = poller.loop
        self.batch = batch
        self.sock = sock
        self.fd = sock.fileno()
        self.flow = flow
        self.closed = False
        self.writing = False
        self.reading = True
        self.cap = cap
        poller.add_reader(self.fd, self._on_readable)

    # ------------------------------------------------------------------ reading
    def _on_readable(self) -> None:
        flow = self.flow
        room = flow.conn.send_space
        cap = self.cap
        if cap is not None:  # --rate-limit down: read no more than the bucket holds
            tokens = int(cap.available(self.loop.time()))
            if tokens < room:
                room = tokens if tokens > MIN_READ else MIN_READ
        try:
            n = self.sock.recv_into(_RVIEW, READ_SIZE if room >= READ_SIZE else (room if room > MIN_READ else MIN_READ))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        try:  # (no cost in CPython >= 3.11 while nothing raises)
            if n > SYNC_WRITE_MAX:
                # Bulk: the writer task sends these frames (writing them here, before the next read,
                # measured 10-25% less host -> guest throughput).
                flow.data_received(bytes(_RVIEW[:n]))
                if n == READ_SIZE and not self.closed:
                    flow.request_upgrade()  # a bulk sender: the flow moves to an asyncio transport
                return
            with self.batch:  # a small read (request/response): its frames are written at the end, at once
                if n:
                    flow.data_received(bytes(_RVIEW[:n]))
                else:
                    self.pause_reading()
                    flow.eof_received()
        except Exception:  # a failing flow ends itself alone (RST both ways); the loop carries on
            log.exception("TCP flow %s failed on host data", getattr(flow, "key", None))
            flow.failed_internally()

    def pause_reading(self) -> None:
        """Stop reading the host socket (the flow's send buffer is full)."""
        if self.reading and not self.closed:
            self.reading = False
            self.poller.remove_reader(self.fd)

    def resume_reading(self) -> None:
        """Read the host socket again."""
        if not self.reading and not self.closed:
            self.reading = True
            self.poller.add_reader(self.fd, self._on_readable)

    # ------------------------------------------------------------------ writing
    def send(self, data: Bytes) -> int:
        """Write what the kernel takes of ``data`` now; returns that many bytes (0..len(data)).

        Short of ``len(data)``, the flow is paused (``pause_writing``) until the socket is
        writable again (``resume_writing``), or, after an error, told ``connection_lost``
        on the next loop iteration.
        """
        if self.closed:
            return 0
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            self.loop.call_soon(self._fail, exc)
            return 0
        if n < len(data) and not self.writing:
            self.writing = True
            self.loop.add_writer(self.fd, self._on_writable)
            self.flow.pause_writing()
            if n:  # the kernel's send buffer is full in mid-write: a bulk receiver on the host
                self.flow.request_upgrade()
        return n

    def _on_writable(self) -> None:
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)
        self.flow.resume_writing()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """Shut down the write side (our FIN towards the host peer)."""
        if not self.closed:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                self.loop.call_soon(self._fail, exc)

    # ------------------------------------------------------------------ closing
    def _unregister(self) -> None:
        # No reference back to the flow once closed: flow <-> HostSocket would otherwise be a
        # cycle that only the full (generation 2) collection frees, so the memory of finished
        # connections would pile up between collections (measured: +18 MiB RSS over 10,000).
        self.flow = _CLOSED_FLOW
        self.closed = True
        if self.reading:
            self.reading = False
            self.poller.remove_reader(self.fd)
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)

    def detach(self) -> socket.socket:
        """Stop serving the socket (no callbacks any more) and hand it over, open."""
        self._unregister()
        return self.sock

    def close(self) -> None:
        """Close the socket (a FIN to the host peer if not sent yet)."""
        if not self.closed:
            self._unregister()
            self.sock.close()

    def abort(self) -> None:
        """Close the socket with a RST to the host peer (``SO_LINGER`` 0 seconds)."""
        if not self.closed:
            self._unregister()
            close_socket(self.sock, abort=True)

    def _fail(self, exc: BaseException) -> None:
        if self.closed:
            return
        flow = self.flow
        self._unregister()
        self.sock.close()
        flow.connection_lost(exc)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``"socket"``: the host socket; ``"peername"``/``"sockname"``: its addresses."""
        if name == "socket":
            return self.sock
        if name in ("peername", "sockname") and not self.closed:
            try:
                return self.sock.getpeername() if name == "peername" else self.sock.getsockname()
            except OSError:
                return default
        return default


class TransportHost:
    """The :class:`~aioslirp.nat.hostsock.HostSocket` interface over an asyncio transport (a flow
    moved to one by :meth:`TcpFlow.request_upgrade`); flow control through its write buffer:
    ``pause_writing``/``resume_writing`` reach the flow as asyncio protocol callbacks."""

    __slots__ = ("tr",)
    writing = False

    tr: asyncio.Transport

    def __init__(self, tr: asyncio.Transport) -> None:
        self.tr = tr

    def send(self, data: Bytes) -> int:
        """Hand ``data`` to the transport; returns ``len(data)``, or 0 once the transport is closing:
        a write failed (the host peer reset, a broken pipe) and asyncio calls ``connection_lost``
        on the next loop iteration. Writing on would do nothing but make asyncio's selector transport
        log ``socket.send() raised exception.`` from the 6th such write on, naming no flow (uvloop
        drops them silently)."""
        tr = self.tr
        if tr.is_closing():
            return 0
        tr.write(data)  # bytes, or a view of immutable bytes: no copy needed
        return len(data)

    def can_write_eof(self) -> bool:
        return self.tr.can_write_eof()

    def write_eof(self) -> None:
        self.tr.write_eof()

    def pause_reading(self) -> None:
        """Stop reading. Bytes may arrive although the transport says it is paused already: asyncio
        (3.11) starts reading after ``connection_made`` whatever that callback did (uvloop too), so
        its ``pause_reading`` would then do nothing; resuming first makes the pause take effect."""
        tr = self.tr
        if not tr.is_reading():
            tr.resume_reading()
        tr.pause_reading()

    def resume_reading(self) -> None:
        self.tr.resume_reading()

    def close(self) -> None:
        self.tr.close()

    def abort(self) -> None:
        sock = self.tr.get_extra_info("socket")
        if sock is not None:
            linger_zero(sock)
        self.tr.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.tr.get_extra_info(name, default)
