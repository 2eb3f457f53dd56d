"""DNS over TCP at the virtual DNS address (RFC 1035 4.2.2, RFC 7766).

:class:`DnsTcpHost` stands where a host socket would for a :class:`~aioslirp.nat.tcp.TcpFlow`
to DNS:53: it takes the guest's byte stream, splits it into 2-byte-length-prefixed
messages, forwards each through the :class:`~aioslirp.services.dns.DnsForwarder` and
answers in order, one message at a time. It offers the subset of the
:class:`~aioslirp.nat.hostsock.HostSocket` interface the flow uses, with the same flow
control both ways, so that a guest holds at most ``tcp_buffer`` plus a small fixed amount
per direction, whatever it pipelines and however slowly it reads:

* guest -> us: :meth:`DnsTcpHost.send` takes only what fits: at most :data:`MAX_QUEUED`
  messages waiting or being answered, and :data:`MAX_HELD` bytes of them and of a partial
  message. Short of all, it pauses the flow (``pause_writing``): the rest stays in the
  connection, whose receive window closes (RFC 9293 3.8.6, RFC 7766 6.2.3), until an
  answered message makes room (``resume_writing``).
* us -> guest: an answer goes into the flow's send buffer (``data_received``) only as far as
  that buffer (``tcp_buffer``) has room (``conn.send_space``); when it is full the flow calls
  :meth:`DnsTcpHost.pause_reading` and no further message is answered until
  :meth:`DnsTcpHost.resume_reading` (the guest ACKed some).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from .dns import DnsTcpSession

__all__ = ["DnsTcpHost", "MAX_HELD", "MAX_QUEUED"]

log = logging.getLogger("aioslirp.dns")

#: Guest messages a connection may have waiting or being answered (RFC 7766 6.2.1.1 pipelining).
MAX_QUEUED = 16
#: Bytes of guest messages held per connection (waiting, being answered, or partly received):
#: one largest frame, so that any message can complete once those before it are answered.
MAX_HELD = DnsTcpSession.MAX_MESSAGE + 2


class DnsTcpHost:
    """HostSocket-like DNS responder for one guest TCP connection (``flow``, a TcpFlow).

    The dispatch (:class:`~aioslirp.dispatch.l4.L4`) hands ``functools.partial(DnsTcpHost,
    forwarder=..., counters=..., tasks=...)`` to a flow to the DNS address's port 53 as its ``host``
    factory: ``forwarder`` answers the messages, ``counters`` gets ``dns_queries_tcp``, ``tasks``
    holds the answering task. It is the flow's mover: it follows
    :class:`~aioslirp.nat.mover.HostMover` (this floor does not import it).
    """

    __slots__ = ("flow", "forwarder", "_counters", "session", "_msgs", "_msg_bytes", "_out", "_eof", "_wake", "closed",
                 "writing", "reading", "task")

    #: The guest's :class:`~aioslirp.nat.tcp.TcpFlow`.
    flow: object
    #: The :class:`~aioslirp.services.dns.DnsForwarder`.
    forwarder: object
    _counters: dict[str, int]
    session: DnsTcpSession
    _msgs: deque[bytes]
    _msg_bytes: int
    _out: bytes | memoryview
    _eof: bool
    _wake: asyncio.Future | None
    closed: bool
    writing: bool
    reading: bool
    task: asyncio.Task

    def __init__(self, flow, forwarder, counters, tasks) -> None:
        self.flow = flow
        self.forwarder = forwarder
        self._counters = counters
        self.session = DnsTcpSession()
        self._msgs: deque[bytes] = deque()  # complete messages, the first one being answered
        self._msg_bytes = 0  # the stream bytes they took (length prefixes included)
        self._out = b""  # the part of the current answer not yet in the flow's send buffer
        self._eof = False  # the guest's FIN: answer what is held, then FIN back
        self._wake: asyncio.Future | None = None
        self.closed = False
        #: The flow is paused (``pause_writing``) until room frees here.
        self.writing = False
        #: False while the flow's send buffer towards the guest is full (``pause_reading``).
        self.reading = True
        self.task = asyncio.get_running_loop().create_task(self._answer(), name="aioslirp-dns-tcp")
        tasks.add(self.task)
        self.task.add_done_callback(tasks.discard)

    # ------------------------------------------------------------------ state
    @property
    def queued(self) -> int:
        """Guest messages waiting or being answered (at most :data:`MAX_QUEUED`)."""
        return len(self._msgs)

    @property
    def held(self) -> int:
        """Guest bytes held: queued messages and a partial one (at most :data:`MAX_HELD`)."""
        return self._msg_bytes + self.session.pending

    @property
    def unsent(self) -> int:
        """Bytes of the current answer not yet in the flow's send buffer (at most one frame)."""
        return len(self._out)

    # ------------------------------------------------------------------ answering
    def _kick(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    async def _answer(self) -> None:
        flow = self.flow
        while not self.closed:
            if self._out or self._msgs:
                if not self.reading:
                    pass  # the flow's send buffer is full: wait for resume_reading()
                elif self._out:
                    self._deliver()
                    continue
                else:
                    msg = self._msgs[0]
                    reply = await self.forwarder.resolve(msg, tcp=True, guest=(flow.guest_ip, flow.guest_port))
                    if self.closed:
                        return
                    self._msgs.popleft()
                    self._msg_bytes -= len(msg) + 2
                    if reply:
                        self._counters["dns_queries_tcp"] += 1
                        self._out = memoryview(DnsTcpSession.frame(reply))
                    self._room()
                    continue
            elif self._eof:
                flow.eof_received()
                return
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake

    def _deliver(self) -> None:
        """Hand the flow as much of the current answer as its send buffer has room for."""
        out = self._out
        space = self.flow.conn.send_space
        # space <= 0 while reading is not expected (the flow pauses us first): then give it all,
        # as a host socket's read would, and the flow pauses us.
        n = space if 0 < space < len(out) else len(out)
        self._out = out[n:]
        self.flow.data_received(out[:n])

    def _room(self) -> None:
        """A message was answered: let a paused flow offer us its bytes again."""
        if self.writing and not self.closed and len(self._msgs) < MAX_QUEUED and self.held < MAX_HELD:
            self.writing = False
            self.flow.resume_writing()

    # ------------------------------------------------------------------ the HostSocket subset used by TcpFlow
    def send(self, data) -> int:
        """Take what fits of the guest's bytes ``data``; returns how many (0..len(data)).

        Short of ``len(data)``, the flow is paused (``pause_writing``) until an answered
        message makes room (``resume_writing``).
        """
        if self.closed:
            return 0
        room = MAX_QUEUED - len(self._msgs)
        taken = 0
        if room > 0:
            msgs, taken = self.session.feed_some(data, room, MAX_HELD - self.held)
            if msgs:
                self._msgs.extend(msgs)
                self._msg_bytes += sum(map(len, msgs)) + 2 * len(msgs)  # stream bytes, prefixes too
                self._kick()
        if taken < len(data) and not self.writing:
            self.writing = True
            self.flow.pause_writing()
        return taken

    def get_extra_info(self, name, default=None):
        return default

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """The guest's FIN: answer the messages held, then FIN towards the guest."""
        self._eof = True
        self._kick()

    def pause_reading(self) -> None:
        """The flow's send buffer towards the guest is full: answer nothing more for now."""
        self.reading = False

    def resume_reading(self) -> None:
        """The guest ACKed: go on answering."""
        if not self.reading:
            self.reading = True
            self._kick()

    def close(self) -> None:
        """Stop: answers not yet handed to the flow are dropped, a query in progress abandoned."""
        self.abort()

    def abort(self) -> None:
        self.closed = True
        self._msgs.clear()
        self._msg_bytes = 0
        self._out = b""
        if self.task is not asyncio.current_task():
            self.task.cancel()
        else:
            self._kick()
