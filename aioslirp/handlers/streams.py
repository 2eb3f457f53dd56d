"""A guest TCP connection as asyncio streams: the host side of a flow taken over by a Python handler.

:class:`TcpHandlerHost` stands where a host socket would for a
:class:`~aioslirp.nat.tcp.TcpFlow` (the model is :class:`~aioslirp.services.dns_tcp.DnsTcpHost`):
the flow answers the guest's SYN at once (no host connect first) and hands the handler
``(flow, reader, writer)``:

* guest -> handler: the guest's in-order bytes go into ``reader`` (an ``asyncio.StreamReader``)
  as far as it holds less than ``tcp_buffer`` bytes; the rest stays in the connection, whose
  receive window closes, until the handler reads (RFC 9293 3.8.6). The guest's FIN is the
  reader's EOF; a guest RST makes the reader raise ``ConnectionResetError``.
* handler -> guest: ``writer.write(data)`` moves bytes into the connection's send buffer as far as
  it has room (``tcp_buffer``); the rest waits in the writer and ``await writer.drain()`` blocks
  until the guest's ACKs have taken it all. ``writer.write_eof()`` and ``writer.close()`` are a
  FIN after the bytes written; ``writer.transport.abort()`` is a RST.

The handler's task is the flow's: it is cancelled when the flow ends: at once on a RST either
way, eviction, idle timeout or the stack's exit; :data:`GRACE` seconds after both directions
closed gracefully (the handler may still read the guest's last bytes and EOF). A handler that raises ends its flow
with a RST, is counted (``handler_errors``) and logged; the stack carries on. A handler that
returns without closing its writer closes it (FIN); guest bytes arriving after it returned or
closed its writer are taken and dropped (the guest's window stays open, so it can finish).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from ..nat.hostsock import connect_numeric

__all__ = ["GuestFlow", "GuestReader", "GuestWriter", "GuestTransport", "TcpHandlerHost", "run_handler"]

log = logging.getLogger("aioslirp.handlers")

#: Seconds a handler may run on after its flow ended gracefully (both directions closed), to read
#: and act on the guest's last bytes; then its task is cancelled. A RST, an eviction or the
#: stack's exit cancel it at once.
GRACE = 5.0


def _text(addr: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET6 if len(addr) == 16 else socket.AF_INET, addr)


class GuestFlow:
    """What a handler is told about the flow it handles (TCP or UDP), and its way out.

    Attributes:
        proto: ``"tcp"`` or ``"udp"``.
        family: 4 or 6.
        guest: ``(address text, port)`` of the guest's end.
        destination: ``(address text, port)`` the guest sent to, as the guest sees it.
        remote: the host-side address text the NAT would connect to (for the gateway, the
            host's loopback), which :meth:`open_upstream` uses.
        name: the DNS name the virtual DNS bound to the destination address (the one the egress
            policy decided on, else the first bound name), or ``None``.
        started: wall-clock time (``time.time()``, seconds) of the guest's first packet.
        connect_timeout: seconds :meth:`open_upstream` waits (``tcp_connect_timeout``).
    """

    __slots__ = ("proto", "family", "guest", "destination", "remote", "name", "started", "connect_timeout",
                 "_upstreams", "_send", "_closed")

    proto: str
    family: int
    guest: tuple
    destination: tuple
    remote: str
    name: str | None
    started: float
    connect_timeout: float
    _upstreams: list
    #: UDP: ``send(payload)`` towards the guest; ``None`` for TCP.
    _send: object
    _closed: bool

    def __init__(self, proto: str, flow, name: str | None, connect_timeout: float, send=None) -> None:
        self.proto = proto
        self.family = 6 if len(flow.guest_ip) == 16 else 4
        self.guest = (_text(flow.guest_ip), flow.guest_port)
        self.destination = (_text(flow.dst_ip), flow.dst_port)
        self.remote = flow.remote
        self.name = name
        self.started = time.time()
        self.connect_timeout = connect_timeout
        self._upstreams: list = []
        self._send = send
        self._closed = False

    def __repr__(self) -> str:
        g, d = self.guest, self.destination
        return f"GuestFlow({self.proto} {g[0]}:{g[1]} -> {d[0]}:{d[1]}{' ' + self.name if self.name else ''})"

    async def open_upstream(self, *, limit: int = 1 << 16):
        """Open the host connection the NAT would have made: TCP to ``(remote, destination port)``.

        Returns ``(reader, writer)``, asyncio streams (``limit``: the reader's buffer limit,
        bytes). Raises ``OSError`` (``ConnectionRefusedError``...) or ``TimeoutError`` after
        :attr:`connect_timeout` seconds; ``TypeError`` for a UDP flow. The connection is owned by
        the flow: aborted when the flow ends, whatever the handler does.
        """
        if self.proto != "tcp":
            raise TypeError("open_upstream() is for TCP flows")
        if self._closed:
            raise ConnectionResetError("the guest's flow has ended")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in self.remote else socket.AF_INET,
                             socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await connect_numeric(loop, sock, (self.remote, self.destination[1]), self.connect_timeout)
            reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        except BaseException:
            sock.close()
            raise
        if self._closed:
            writer.transport.abort()
            raise ConnectionResetError("the guest's flow has ended")
        self.own(writer)
        return reader, writer

    def own(self, writer) -> None:
        """Tie a connection the handler opened (``writer``: an ``asyncio.StreamWriter``) to the flow:
        its transport is aborted when the flow ends. :meth:`open_upstream` does this itself."""
        self._upstreams.append(writer)

    def send(self, payload) -> None:
        """UDP: send ``payload`` (bytes, at most 65,507) to the guest from :attr:`destination`.
        Raises ``TypeError`` for a TCP flow (use the writer)."""
        if self._send is None:
            raise TypeError("send() is for UDP flows")
        self._send(payload)

    def close(self) -> None:
        """The flow ended: abort the connections it owns (idempotent)."""
        self._closed = True
        ups, self._upstreams = self._upstreams, []
        for w in ups:
            try:
                w.transport.abort()
            except Exception:  # pragma: no cover - a transport already gone
                pass


class GuestReader(asyncio.StreamReader):
    """The guest's bytes (an ``asyncio.StreamReader``): every read that frees room lets the guest send more."""

    #: The flow's in-process host side, told when a read made room.
    host: TcpHandlerHost

    def __init__(self, host: TcpHandlerHost, limit: int) -> None:
        super().__init__(limit=limit)
        self.host = host

    def _maybe_resume_transport(self) -> None:
        # Called by every StreamReader read method after it consumed from the buffer (CPython
        # 3.11-3.13); the hook through which reading re-opens the guest's window.
        super()._maybe_resume_transport()
        self.host.room()

    @property
    def buffered(self) -> int:
        """Guest bytes held, not yet read (at most ``tcp_buffer``)."""
        return len(self._buffer)


class GuestTransport:
    """The writer's transport (``asyncio.WriteTransport``-like): ``write``, ``write_eof``,
    ``close`` (FIN), ``abort`` (RST), ``is_closing``, ``get_extra_info``, ``get_write_buffer_size``."""

    __slots__ = ("_host",)

    _host: TcpHandlerHost

    def __init__(self, host) -> None:
        self._host = host

    def write(self, data) -> None:
        self._host.h_write(data)

    def writelines(self, lines) -> None:
        for d in lines:
            self._host.h_write(d)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """FIN towards the guest after the bytes written (half-close: reading goes on)."""
        self._host.h_eof()

    def close(self) -> None:
        """FIN after the bytes written; guest bytes that still come are dropped."""
        self._host.h_close()

    def abort(self) -> None:
        """Reset the guest's connection (RST) now; what was not sent is dropped."""
        self._host.h_abort()

    def is_closing(self) -> bool:
        return self._host.closing

    def get_write_buffer_size(self) -> int:
        """Bytes written but not yet in the connection's send buffer."""
        return len(self._host.out)

    def get_extra_info(self, name, default=None):
        """``"peername"``: the guest's ``(address, port)``; ``"sockname"``: the destination's."""
        return self._host.extra(name, default)


class GuestWriter(GuestTransport):
    """``asyncio.StreamWriter``-like writer towards the guest (see the module documentation): the
    transport's ``write``/``writelines``/``write_eof``/``close``/``is_closing``/``get_extra_info``
    (a StreamWriter forwards them to its transport), plus :meth:`drain` and :meth:`wait_closed`.

    ``drain()`` raises ``ConnectionResetError`` once the guest reset the connection or the flow
    ended; ``write()`` after ``close()`` is ignored.
    """

    __slots__ = ("transport",)

    #: The :class:`GuestTransport` (``abort()``: RST).
    transport: GuestTransport

    def __init__(self, host) -> None:
        super().__init__(host)
        self.transport = GuestTransport(host)

    async def wait_closed(self) -> None:
        """Wait until the flow has closed its host side (the guest ACKed our FIN and closed, or a RST)."""
        await asyncio.shield(self._host.done)

    async def drain(self) -> None:
        """Wait until every byte written is in the connection's send buffer (at most ``tcp_buffer``
        bytes towards the guest are held there). Raises ``ConnectionResetError`` when the flow ended."""
        await self._host.h_drain()

    def __repr__(self) -> str:
        return f"<GuestWriter {self._host.gflow!r}>"


class TcpHandlerHost:
    """The HostSocket-like host side of a TCP flow taken over by ``handler`` (see the module documentation).

    Args:
        flow: the :class:`~aioslirp.nat.tcp.TcpFlow`.
        handler: ``async def handler(flow: GuestFlow, reader, writer)``.
        name: the destination's DNS name or ``None``.
        errors: ``errors(handler, flow, exc)``: count and log a handler's failure.
    """

    __slots__ = ("flow", "handler", "gflow", "reader", "writer", "out", "cap", "writing", "reading", "closed",
                 "closing", "eof_pending", "eof_done", "discard", "done", "_waiters", "_errors", "task", "_grace")

    flow: object
    handler: object
    gflow: GuestFlow
    reader: GuestReader
    writer: GuestWriter
    #: Bytes written by the handler, not yet in the connection's send buffer.
    out: bytearray
    #: At most this many guest bytes are held in the reader (``tcp_buffer``).
    cap: int
    #: The flow is paused (``pause_writing``) until the handler reads.
    writing: bool
    #: False while the flow's send buffer towards the guest is full (``pause_reading``).
    reading: bool
    #: The flow closed (or aborted) its host side: nothing more either way.
    closed: bool
    #: The handler closed its writer (or the flow ended).
    closing: bool
    eof_pending: bool
    eof_done: bool
    #: Guest bytes are taken and dropped (the handler returned or closed its writer).
    discard: bool
    #: Resolved when the flow closed its host side.
    done: asyncio.Future
    _waiters: list
    _errors: object
    task: asyncio.Task
    #: Cancels the task :data:`GRACE` seconds after a graceful end of the flow, if still running.
    _grace: asyncio.TimerHandle | None

    def __init__(self, flow, handler, name: str | None, errors) -> None:
        self.flow = flow
        self.handler = handler
        ctx = flow.ctx
        self.gflow = GuestFlow("tcp", flow, name, float(ctx.config.tcp_connect_timeout))
        self.cap = max(1, int(ctx.config.tcp_buffer))
        self.reader = GuestReader(self, self.cap)
        self.writer = GuestWriter(self)
        self.out = bytearray()
        self.writing = False
        self.reading = True
        self.closed = self.closing = self.eof_pending = self.eof_done = self.discard = False
        self.done = flow.loop.create_future()
        self._waiters: list = []
        self._errors = errors
        self._grace = None
        self.task = ctx.start_task(self._main(), f"aioslirp-handler-{flow.guest_port}")

    async def _main(self) -> None:
        try:
            await self.handler(self.gflow, self.reader, self.writer)
        except asyncio.CancelledError:
            if not self.closed:
                self.h_abort()
            return
        except Exception as exc:
            if not self.closed:
                self._errors(self.handler, self.gflow, exc)
                self.h_abort()
            else:
                log.debug("handler %r on %r ended after its flow: %r", self.handler, self.gflow, exc)
            return
        finally:
            self.gflow.close()
            if self._grace is not None:
                self._grace.cancel()
                self._grace = None
        if not self.closing:
            self.h_close()
        self.discard = True

    # ------------------------------------------------------------------ handler -> guest
    def h_write(self, data) -> None:
        if self.closing or self.eof_pending or not data:
            return
        self.out += data
        if self.reading:
            self._deliver()

    def h_eof(self) -> None:
        if self.closed or self.eof_pending:
            return
        self.eof_pending = True
        self._deliver()

    def h_close(self) -> None:
        self.h_eof()
        self.closing = self.discard = True
        self._room_all()

    def h_abort(self) -> None:
        """RST towards the guest (the host side failed): the flow ends."""
        if self.closed:
            return
        self._end(ConnectionResetError("connection reset by the handler"))
        self.flow.connection_lost(ConnectionResetError())

    async def h_drain(self) -> None:
        while self.out and not self.closed:
            fut = self.flow.loop.create_future()
            self._waiters.append(fut)
            await fut
        if self.closed and self.out:
            raise ConnectionResetError("the guest's connection has ended")

    def _deliver(self) -> None:
        """Move written bytes into the connection's send buffer as far as it has room; then the FIN."""
        flow = self.flow
        out = self.out
        while out and self.reading and not self.closed:
            space = flow.conn.send_space
            if space <= 0:
                break
            n = min(space, len(out))
            chunk = bytes(out[:n])
            del out[:n]
            flow.data_received(chunk)  # pauses us (pause_reading) when the send buffer is full
        if not out:
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)
            if self.eof_pending and not self.eof_done and not self.closed:
                self.eof_done = True
                flow.eof_received()

    # ------------------------------------------------------------------ guest -> handler
    def room(self) -> None:
        """The handler read: let a paused flow offer its bytes again."""
        if self.writing and not self.closed and self.reader.buffered < self.cap:
            self.writing = False
            self.flow.resume_writing()

    def _room_all(self) -> None:
        if self.writing and not self.closed:
            self.writing = False
            self.flow.resume_writing()

    def extra(self, name, default=None):
        if name == "peername":
            return self.gflow.guest
        if name == "sockname":
            return self.gflow.destination
        return default

    # ------------------------------------------------------------------ the HostSocket subset used by TcpFlow
    def send(self, data) -> int:
        """Take what fits of the guest's bytes ``data`` into the reader; returns how many."""
        if self.closed:
            return 0
        if self.discard:
            return len(data)
        reader = self.reader
        take = min(len(data), self.cap - reader.buffered)
        if take > 0:
            reader.feed_data(data[:take] if take < len(data) else data)
        else:
            take = 0
        if take < len(data) and not self.writing:
            self.writing = True
            self.flow.pause_writing()
        return take

    def get_extra_info(self, name, default=None):
        return default

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """The guest's FIN: the reader's EOF."""
        if not self.reader.at_eof():
            self.reader.feed_eof()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        if not self.reading:
            self.reading = True
            if not self.closed:
                self._deliver()

    def close(self) -> None:
        """The flow closed its host side (both directions done, or its end): the handler's task stops."""
        self._end(None)

    def abort(self) -> None:
        """The guest reset the connection (or the flow was shut down)."""
        self._end(ConnectionResetError("connection reset by the guest"))

    def _end(self, exc) -> None:
        if self.closed:
            return
        self.closed = self.closing = True
        reader = self.reader
        if exc is not None:
            reader.set_exception(exc)
        elif not reader.at_eof():
            reader.feed_eof()
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)
        if not self.done.done():
            self.done.set_result(None)
        if self.task is asyncio.current_task() or self.task.done():
            return
        if exc is None:  # a graceful end: the handler may still read what the guest sent last
            self._grace = self.flow.loop.call_later(GRACE, self.task.cancel)
        else:
            self.gflow.close()
            self.task.cancel()


def run_handler(handler, name, errors, flow):
    """The ``host(flow)`` factory of a handled :class:`~aioslirp.nat.tcp.TcpFlow` (bind the first three
    with ``functools.partial``): the flow's :class:`TcpHandlerHost`."""
    return TcpHandlerHost(flow, handler, name, errors)
