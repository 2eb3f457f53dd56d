"""TCP NAT flow: the asyncio glue between a sans-IO :class:`TcpConnection` and a host socket.

One :class:`TcpFlow` per guest connection, owned by the stack's flow table. Its task
connects the host socket first and only then lets the connection answer the guest's SYN
(SYN-ACK after the host connect; RST when refused; ICMP unreachable when the host or
network is unreachable or the connect times out). Data then moves through the callbacks of
a :class:`~aioslirp.nat.hostsock.HostSocket` (read through the stack's own epoll, a
:class:`~aioslirp.nat.hostsock.HostPoller`; ``add_writer`` after a short send), named like
asyncio protocol callbacks:

* guest -> host: segments are fed to the connection; at the end of each batch of guest
  frames :meth:`TcpFlow.flush` writes the in-order bytes to the host socket. What the
  kernel does not take stays in the connection (``pause_writing``), so its receive window
  closes instead of data being dropped; ``resume_writing`` (the socket is writable again)
  takes them again and a window update goes out.
* host -> guest: ``data_received`` appends to the connection's send buffer; when that
  buffer is full (``send_space <= 0``) reading from the host socket pauses until the
  guest's ACKs make room.
* a FIN from either side becomes ``shutdown(SHUT_WR)`` / a FIN towards the other side;
  the reverse direction stays open. A RST either way tears the flow down.
* fair shares (``share_up`` / ``share_down``, the guest's :class:`~aioslirp.fair.Share` of the
  loop each way): the bytes moved are charged to them; over the guest's share, the flow stops
  reading or writing until the loop's scheduler gives the guest its turn (:mod:`aioslirp.fair`).
* rate caps (``rate_up`` / ``rate_down``, the guest's shared
  :class:`~aioslirp.ratelimit.ByteBucket` each way): towards the host, guest bytes are written
  only while the bucket holds them; the rest waits in the connection (its window closes) and
  a loop timer writes it when the bucket has refilled. Towards the guest, each host read is
  spent from the bucket and reading pauses while it is in debt, resumed by the same timer.
  Nothing is dropped; a capped flow stays on its :class:`HostSocket` (no move to a transport).

Once both directions are closed the host socket is closed at once; TIME-WAIT towards the
guest keeps only the flow-table entry. Guest bytes already ACKed that the host has not taken
yet keep the host socket open until they are written, whatever the guest does next: a guest
that reuses the 4-tuple at once (a new SYN in TIME-WAIT or CLOSED) gets a new flow, while the
old one drains under a key of its own (:meth:`TcpFlow.retire`).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from typing import cast

from ..fair import Share
from ..flow.base import Flow, FlowFamily, admission
from ..flow.context import FlowContext
from ..ratelimit import ByteBucket
from ..tcp.connection import (CLOSE_WAIT, CLOSED, CLOSING, ESTABLISHED, LAST_ACK, SYN_RECEIVED, TIME_WAIT,
                              TcpConnection)
from ..tcp.tcb import ResetEvent
from ..wire.icmp import KIND_HOST, KIND_NET
from ..wire.ip import PROTO_TCP
from ..wire.offload import MAX_TSO_PAYLOAD4, MAX_TSO_PAYLOAD6
from ..wire.tcp import ACK, SYN, Segment, TcpFrameBuilder, syn_options
from .hostsock import HostSocket, TransportHost, close_socket, connect_start, wait_connected
from .mover import HostMover
from .pacing import FlowPacing

__all__ = ["HostFactory", "TcpFlow"]

log = logging.getLogger("aioslirp.tcp")

#: States in which both directions are closed towards the guest (or about to be).
_CLOSED_BOTH = frozenset((TIME_WAIT, CLOSED, LAST_ACK, CLOSING))
#: States in which the connection is over: a new SYN on its 4-tuple opens a new one.
_OVER = frozenset((TIME_WAIT, CLOSED))
#: States in which a host socket that closed without error becomes our FIN towards the guest.
_OPEN_TOWARDS_GUEST = frozenset((ESTABLISHED, CLOSE_WAIT, SYN_RECEIVED))
_RETIRED = itertools.count(1)  # serials that make the flow-table keys of retired flows unique

#: ``host(flow)``: the in-process host side of a TCP flow instead of a host socket, a
#: :class:`~aioslirp.nat.mover.HostMover` (the DNS service's ``DnsTcpHost``, a Python handler's
#: ``TcpHandlerHost``), made when the flow's task starts.
HostFactory = Callable[["TcpFlow"], HostMover]


class TcpFlow(FlowPacing, asyncio.Protocol):
    """One NAT'ed guest TCP connection. ``remote`` is the host address (``None``: the DNS service).

    ``host``: ``host(flow)`` returning the flow's in-process host side instead of a host socket
    (:data:`HostFactory`: the DNS service for ``remote`` ``None``, a Python handler,
    :mod:`aioslirp.handlers`): then the SYN is answered at once, with no connect.

    The bytes move through :attr:`transport`, a :class:`~aioslirp.nat.mover.HostMover` (a
    :class:`HostSocket`, then for bulk traffic a :class:`TransportHost`; the DNS service or a
    handler): the one seam where the native data path of issue 26 plugs in.

    ``ctx``: the stack's :class:`~aioslirp.flow.context.FlowContext` (started: the flow takes its
    loop from ``ctx.running``); ``fam``: the flow's family (Family4/6).
    ``key`` addresses are 4 bytes (IPv4) or 16 bytes (IPv6); ``orig_header`` is the guest's
    SYN packet (IPv4: header + 8 bytes; IPv6: up to 1232 bytes) quoted in ICMP errors.
    """

    proto = PROTO_TCP
    proto_name = "tcp"
    #: See :class:`~aioslirp.flow.base.Flow`.
    direction: str = "outbound"
    forward_id: int | None = None

    __slots__ = (
        "ctx", "fam", "key", "guest_ip", "guest_port", "dst_ip", "dst_port", "remote", "orig_header", "loop",
        "last_active", "eth", "v6", "offload", "_builder", "conn", "transport", "host_paused", "reading_paused",
        "eof_sent", "host_closed", "_timer", "_timer_at", "_finished", "done", "_wake", "_upgrade_sock",
        "_upgrading", "_close_abort", "_pending_sock", "_connect_waiting", "_t0", "retired", "no_socket", "task",
        "_mark_dirty", "started", "_outcome", "rate_up", "rate_down", "rate_paused", "_rate_timer", "_rate_at",
        "name", "rule",
        "_host_factory", "share_up", "share_down", "share_paused", "share_held",
    )

    #: The stack's :class:`~aioslirp.flow.context.FlowContext` (flow table, counters, inject queue, config).
    ctx: FlowContext
    #: The flow's family (``Family4``/``Family6``): Ethernet header, ICMP errors.
    fam: FlowFamily
    #: ``(6, guest addr, guest port, remote addr, remote port)``; a retired flow's has a serial appended.
    key: tuple
    guest_ip: bytes
    guest_port: int
    dst_ip: bytes
    dst_port: int
    #: The host address connected to, ``None`` for the DNS-over-TCP service.
    remote: str | None
    #: The guest's SYN packet, quoted in ICMP errors.
    orig_header: bytes
    loop: asyncio.AbstractEventLoop
    #: Loop time of the last guest segment (the idle sweep reads it).
    last_active: float
    #: The Ethernet header of frames towards the guest.
    eth: bytes
    v6: bool
    #: Frames with partial checksums and GSO (a TAP with offload).
    offload: bool
    #: This flow's frame builder (made on first use, again if ``eth`` changes).
    _builder: TcpFrameBuilder | None
    conn: TcpConnection
    #: The mover (:class:`~aioslirp.nat.mover.HostMover`): HostSocket, TransportHost, DnsTcpHost,
    #: TcpHandlerHost, or None (connecting, or moving to a transport).
    transport: HostMover | None
    #: The host socket's send buffer is full: guest bytes wait in the connection.
    host_paused: bool
    #: Reading the host socket is paused: the connection's send buffer is full.
    reading_paused: bool
    #: The guest's FIN was passed on (``write_eof``).
    eof_sent: bool
    host_closed: bool
    _timer: asyncio.TimerHandle | None
    _timer_at: float | None
    _finished: bool
    #: Resolved when the flow is over.
    done: asyncio.Future
    _wake: asyncio.Future
    _upgrade_sock: socket.socket | None
    _upgrading: bool
    _close_abort: bool
    _pending_sock: socket.socket | None
    _connect_waiting: bool
    _t0: float
    #: The guest reused this flow's 4-tuple (see :meth:`retire`): nothing goes to the guest any more.
    retired: bool
    #: No host socket could be opened (see :meth:`_open_socket`): the SYN was refused, the flow
    #: never entered the table.
    no_socket: bool
    task: asyncio.Task
    #: :attr:`FlowTable.mark_dirty <aioslirp.flow.table.FlowTable.mark_dirty>` (its dirty set's
    #: ``add``, bound): :meth:`flush` runs after the batch of guest frames.
    _mark_dirty: Callable[[Flow], None]
    #: Loop time of creation (the guest's SYN).
    started: float
    #: How it ended when known before it leaves (refused, unreachable, timeout, evicted); see :attr:`outcome`.
    _outcome: str | None
    #: The guest's byte-rate caps each way (``ctx.rate_up`` / ``rate_down``), ``None``: none.
    rate_up: ByteBucket | None
    rate_down: ByteBucket | None
    #: Reading the host socket is paused: the ``rate_down`` bucket is in debt.
    rate_paused: bool
    #: Loop timer (and its time) that resumes a flow held by a rate cap.
    _rate_timer: asyncio.TimerHandle | None
    _rate_at: float
    #: The egress decision's DNS name and rule (see :class:`~aioslirp.flow.base.Flow`).
    name: str | None
    rule: str | None
    #: ``host(flow)`` -> the in-process host side (DNS over TCP, a Python handler), or ``None``: a host socket.
    _host_factory: HostFactory | None
    #: The guest's :class:`~aioslirp.fair.Share` of the loop each way (``ctx.running.share_up`` /
    #: ``share_down``), ``None``: not scheduled (the DNS service, ``fair_weight`` None).
    share_up: Share | None
    share_down: Share | None
    #: Reading the host side is paused: the guest is over its share down (waits for its turn).
    share_paused: bool
    #: Writing to the host side is held: the guest is over its share up (waits for its turn).
    share_held: bool

    def __init__(self, ctx: FlowContext, fam: FlowFamily, key: tuple, remote: str | None, syn: Segment | None,
                 orig_header: bytes, now: float, host: HostFactory | None = None) -> None:
        self.ctx, self.fam = ctx, fam
        self.key = key
        _, self.guest_ip, self.guest_port, self.dst_ip, self.dst_port = key
        self.remote = remote
        self.orig_header = orig_header
        self.loop = loop = ctx.running.loop
        cfg = ctx.config
        self.last_active = self.started = now
        self._outcome = None
        self.name, self.rule = admission(ctx, self, remote)  # the egress decision's name and rule (Flow)
        if remote is not None:
            self.rate_up, self.rate_down = ctx.rate_up, ctx.rate_down
            running = ctx.running
            self.share_up, self.share_down = running.share_up, running.share_down
        else:  # the DNS-over-TCP service is not capped nor scheduled
            self.rate_up = self.rate_down = None
            self.share_up = self.share_down = None
        self.share_paused = self.share_held = False
        self.rate_paused = False
        self._rate_timer = None
        self._rate_at = 0.0
        self.eth = fam.eth_to(self.guest_ip)
        # IPv4 or IPv6 is chosen once per flow: frame builder, MSS (MTU - 40 / - 60), socket family.
        self.v6 = v6 = len(self.guest_ip) == 16
        # Checksum/segmentation offload (decided once per flow, from the transport): segments up
        # to ~64 KB with partial checksums, which the kernel cuts to the guest's MSS and completes.
        self.offload = offload = ctx.offload
        self._builder = None
        self.conn = TcpConnection(iss=random.getrandbits(32), mss=cfg.mtu - (60 if v6 else 40),
                                  rcv_buf=cfg.tcp_buffer,
                                  snd_buf=cfg.tcp_buffer, now=now, linger=cfg.tcp_linger,
                                  ack_delay=float(cfg.tcp_ack_delay),
                                  max_segment=(MAX_TSO_PAYLOAD6 if v6 else MAX_TSO_PAYLOAD4) if offload else None)
        if syn is not None:  # None: active open towards the guest (ForwardedTcpFlow)
            self.conn.on_syn(syn, now)
        self.transport = None
        self.host_paused = False
        self.reading_paused = False
        self.eof_sent = False
        self.host_closed = False
        self._timer = None
        self._timer_at = None
        self._finished = False
        self.done = self._wake = loop.create_future()
        self._upgrade_sock = None  # the host socket while it moves to a transport
        self._upgrading = False
        self._close_abort = False
        self._pending_sock = None  # a connect in progress, for the task
        self._connect_waiting = False  # the task waits for that connect
        self._t0 = 0.0
        self.retired = False
        self.no_socket = False
        # host: the DNS service's or a Python handler's host side: the SYN is answered at once, no connect
        self._host_factory = host
        sock = None
        if syn is not None and remote is not None and host is None:
            sock = self._open_socket(now)
            if sock is None:  # refused with a RST: the flow never enters the table
                return
        self._mark_dirty = ctx.table.mark_dirty  # on_segment: the table flushes the flow after the batch
        ctx.table.add(self)
        self.task = ctx.start_task(self._run(), f"aioslirp-tcp-{self.guest_port}")
        if sock is not None:
            self._start_connect(sock)

    @property
    def state(self) -> str:
        """RFC 9293 state of the guest-facing connection."""
        return self.conn.state

    # ----------------------------------------------------------------- task
    #: What the flow is called in the log line of a failure.
    _what = "TCP flow"

    async def _run(self) -> None:
        """The flow's task: open the host side (:meth:`_open`), then live until the end. A failure of
        its own is logged and counted (``flow_errors``), the guest gets a RST; siblings go on."""
        try:
            await self._open()
            await self._wait_end()
        except asyncio.CancelledError:
            pass
        except Exception:
            ident = self.ctx.identity
            log.exception("%s%s %s failed", ident.log_prefix, self._what, self.key, extra=ident.log_extra)
            self.ctx.counters["flow_errors"] += 1
            self.conn.abort()
            self._emit(self.loop.time())
        finally:
            self._teardown()

    async def _open(self) -> None:
        """The host side: a mover from the host factory (a Python handler's), or the wait for the
        non-blocking connect started at the SYN."""
        if self._host_factory is not None:
            self.transport = self._host_factory(self)
            if self.remote is not None:
                self.ctx.guard.connected(self)
            self._accept(0.0, True)
        elif self._pending_sock is not None:
            await self._connect_wait()

    async def _wait_end(self) -> None:
        """The task's life after the connect: wait for the flow's end, moving the host socket to an
        asyncio transport when :meth:`request_upgrade` asks for it on the way."""
        while not self._finished:
            await self._wake
            sock = self._upgrade_sock
            if sock is not None:
                self._upgrade_sock = None
                if self._finished:
                    close_socket(sock, abort=True)
                    return
                await self.loop.create_connection(lambda: self, sock=sock)  # -> connection_made
            if not self._finished:
                self._wake = self.loop.create_future()

    def request_upgrade(self) -> None:
        """Bulk traffic (a read filled :data:`~aioslirp.nat.hostsock.READ_SIZE`, or the kernel took
        only part of a write): hand the socket to an asyncio (uvloop) transport, whose reads loop
        and whose writes buffer in C (measured: host->guest +16%, guest->host +18% and -24% CPU
        per GB against :class:`HostSocket`); connection set-up and request/response traffic keep
        the lighter :class:`HostSocket` (CRR -6%). Guest bytes that arrive meanwhile wait in the
        connection (nothing ACKed is lost); see ``tests/unit/nat/test_hostsock.py``."""
        hs = self.transport
        if (self._upgrading or self.host_closed or self._finished or not isinstance(hs, HostSocket)
                or self.rate_up is not None or self.rate_down is not None):  # a capped flow's reads stay bounded
            return
        self._upgrading = True
        self.ctx.counters["tcp_bulk_transport"] += 1
        self._upgrade_sock = hs.detach()
        self.transport = None
        if not self._wake.done():
            self._wake.set_result(None)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """asyncio.Protocol: the transport of an upgraded flow (see :meth:`request_upgrade`)."""
        # a stream transport (create_connection); uvloop's follow asyncio.Transport without subclassing it
        stream = cast(asyncio.Transport, transport)
        self._upgrading = False
        th = self.transport = TransportHost(stream)
        if self.host_closed:  # _close_host ran while the transport was being made
            th.abort() if self._close_abort else th.close()
            return
        stream.set_write_buffer_limits(high=512 * 1024)
        self.host_paused = False  # HostSocket's wait for writability ended with it
        if self.reading_paused or self.rate_paused or self.share_paused:
            # Enough for asyncio's transport (it starts reading after this callback and honours
            # the pause); uvloop starts reading regardless: data_received pauses it again.
            stream.pause_reading()
        self.flush(self.loop.time())

    def _open_socket(self, now: float) -> socket.socket | None:
        """The host socket for the connect (non-blocking from ``socket()`` on: no separate ioctl
        per connection), or ``None`` when the kernel gives none (``EMFILE``, ``ENFILE``,
        ``ENOBUFS``, ``ENOMEM``...): then the guest's SYN is answered with a RST, as a refused
        connect would be (RFC 9293 3.10.7.1), and counted as ``drop.tcp_socket_error``."""
        try:
            return socket.socket(socket.AF_INET6 if self.v6 else socket.AF_INET,
                                 socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        except OSError as exc:
            self.ctx.drop("tcp_socket_error")
            log.debug("TCP flow %s: no host socket: %s", self.key, exc)
            self.no_socket = True
            self._finished = True
            self.conn.refuse()
            self._emit(now)
            return None

    def _start_connect(self, sock: socket.socket) -> None:
        """Start the host connect on ``sock`` while the guest's SYN is being dispatched.

        Towards host loopback the kernel usually completes the handshake inside ``connect()``
        (asking again says so, or gives the refusal), so the SYN-ACK leaves in the same batch
        as the SYN arrived, with no event-loop round trip; otherwise (``EINPROGRESS``) the
        flow's task waits for the socket to become writable (:meth:`_connect_wait`).
        """
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._t0 = time.perf_counter()  # for the tcp.syn_ack trace point (loop.time() ticks in ms)
            err = connect_start(sock, (self.remote, self.dst_port))
        except BaseException:
            sock.close()
            raise
        if err == 0:
            self._connected(sock)
        elif err == errno.EINPROGRESS:
            self._pending_sock = sock
        else:
            self._connect_failed(sock, OSError(err, os.strerror(err)))

    async def _connect_wait(self) -> None:
        """The task's part of a connect that did not complete at once (timeout ``tcp_connect_timeout``)."""
        sock = self._pending_sock
        assert sock is not None, "_start_connect left it"
        self._pending_sock = None
        if self._finished:
            sock.close()
            return
        self._connect_waiting = True
        try:
            await wait_connected(self.loop, sock, float(self.ctx.config.tcp_connect_timeout))
        except (asyncio.TimeoutError, OSError) as exc:
            self._connect_failed(sock, exc)
            return
        except BaseException:
            sock.close()
            raise
        finally:
            self._connect_waiting = False
        self._connected(sock)

    def _connected(self, sock: socket.socket) -> None:
        if self.conn.state is CLOSED or self._finished:
            sock.close()
            self._finish()
            return
        self.transport = HostSocket(self.ctx.running.host_poller, sock, self, self.ctx.queue.held(), self.rate_down)
        self.ctx.guard.connected(self)
        self._accept(time.perf_counter() - self._t0, False)

    def _connect_failed(self, sock: socket.socket, exc: BaseException) -> None:
        """Refused: RST to the guest. Unreachable or timed out: ICMP destination unreachable."""
        sock.close()
        counters = self.ctx.counters
        if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
            self._outcome = "refused"
            counters["tcp_connect_refused"] += 1
            self.conn.refuse()
            tr = self.ctx.tracer
            if tr is not None:
                tr.record_connect_failed(self, "refused")
            self._emit(self.loop.time())
            self._finish()
            return
        counters["tcp_connect_unreachable"] += 1
        self._outcome = "timeout" if isinstance(exc, TimeoutError) else "unreachable"
        tr = self.ctx.tracer
        if tr is not None:
            tr.record_connect_failed(self, "unreachable")
        log.debug("connect %s:%d failed: %r", self.remote, self.dst_port, exc)
        kind = KIND_NET if getattr(exc, "errno", None) == errno.ENETUNREACH else KIND_HOST
        self.fam.icmp_error(kind, self.orig_header)
        self._finish()

    def _accept(self, connect_time: float, immediate: bool) -> None:
        now = self.loop.time()
        self.conn.accept(now)
        tr = self.ctx.tracer
        if tr is not None:
            tr.record_syn_ack(self, connect_time, immediate)
        self.flush(now)

    # ----------------------------------------------------------------- host socket callbacks (HostSocket)
    def data_received(self, data: bytes) -> None:
        """Bytes from the host (:class:`~aioslirp.nat.mover.MoverFlow`): into the connection's send
        buffer, then :meth:`flush` at loop time."""
        conn = self.conn
        conn.send(data)
        tr = self.ctx.tracer
        if tr is not None:
            tr.record_host_data(self, len(data))
        if conn.send_space <= 0:  # tcp_buffer towards the guest is full
            if not self.reading_paused:
                self.reading_paused = True
                self.ctx.counters["tcp_host_read_paused"] += 1
            # Pause even when the flag says so already: bytes arriving at all mean that reading
            # runs. uvloop ignores a pause_reading() made in connection_made (it starts reading
            # after that callback), so a flow that moved to a transport while paused would
            # otherwise read on without bound. At most one read lands past tcp_buffer.
            mover = self.transport
            if mover is not None:  # (the mover calling back is there)
                mover.pause_reading()
        now = self.loop.time()
        rate = self.rate_down
        if rate is not None:  # --rate-limit down: spend the read, hold off reading while in debt
            rate.spend(len(data), now)
            wait = rate.wait(now)
            if wait > 0:
                if not self.rate_paused:
                    self.rate_paused = True
                    self.ctx.counters["tcp_rate_paused_down"] += 1
                mover = self.transport
                if mover is not None:
                    mover.pause_reading()
                self._rate_wake(now + wait)
        share = self.share_down
        if share is not None and share.charge(len(data)):  # over the guest's fair share: wait for its turn
            mover = self.transport
            if mover is not None:
                mover.pause_reading()
            if not self.share_paused:
                self.share_paused = True
                self.ctx.counters["tcp_fair_wait_down"] += 1
                share.wait(self._share_down_turn)
        self.flush(now)

    def eof_received(self) -> bool:
        """The host peer shut down its write side: our FIN towards the guest after its bytes."""
        self.conn.shutdown_write()
        tr = self.ctx.tracer
        if tr is not None:
            tr.record_flow_event(self, "fin.host")
        self.flush(self.loop.time())
        return True

    def connection_lost(self, exc) -> None:
        """The host socket is closed: ``exc`` None after our own close or the peer's end of stream,
        else the error (the host peer reset, a broken pipe...): normal network events, counted
        (``tcp_host_lost``) and logged at DEBUG with the flow, the guest told with a RST."""
        self.host_closed = True
        if exc is not None:
            self.ctx.counters["tcp_host_lost"] += 1
            log.debug("TCP flow %s: host connection lost: %s", self.key, exc)
        if not self._finished:
            if exc is not None:
                self.conn.abort()
            elif self.conn.state in _OPEN_TOWARDS_GUEST:
                self.conn.shutdown_write()
            self.flush(self.loop.time())

    def pause_writing(self) -> None:
        """The mover takes no more guest bytes for now: they wait in the connection."""
        self.host_paused = True
        self.ctx.counters["tcp_host_write_paused"] += 1  # guest data now waits in tcp_buffer

    def resume_writing(self) -> None:
        """The mover has room again."""
        self.host_paused = False
        self.flush(self.loop.time())

    # ----------------------------------------------------------------- guest side
    def on_segment(self, seg: Segment, now: float) -> bool:
        """Feed one guest segment at loop time ``now``. False: the flow is over and ``seg`` opens a new one."""
        conn = self.conn
        if seg.flags & SYN and not seg.flags & ACK and conn.state in _OVER:
            return False
        self.last_active = now
        conn.receive_segment(seg, now)
        tr = self.ctx.tracer
        if tr is not None:
            tr.record_segment(self, seg)
        self._mark_dirty(self)
        return True

    def flush(self, now: float) -> None:
        """Move bytes between the connection and the mover (:attr:`transport`), send the segments
        due at loop time ``now`` (seconds: the batch's, or the callback's), re-arm the timer."""
        share = self.share_down
        if share is not None:  # a backlogged guest's frames come after the light guests' input (aioslirp.fair)
            share.safe_point()
        conn = self.conn
        tr = self.transport
        if tr is not None and not self.host_closed:
            pending = conn.recv_pending  # in-order guest bytes not yet written to the host
            rate = self.rate_up
            share = self.share_up
            while pending and not self.host_paused and not self.share_held:
                data = conn.peek_chunk()
                if rate is not None:  # --rate-limit up: write what the bucket holds, the rest waits
                    data = self._rate_cut(rate, data)
                    if data is None:
                        break
                n = tr.send(data)  # what the kernel took; the rest stays queued (window closes)
                if n:
                    if rate is not None:
                        rate.spend(n, now)
                    pending = conn.consume(n)
                    if share is not None and share.charge(n):  # over the guest's fair share: the rest waits its turn
                        self.share_held = True
                        self.ctx.counters["tcp_fair_wait_up"] += 1
                        share.wait(self._share_up_turn)
                        break
                if n < len(data):
                    break
            tr = self.transport  # None when a partial send started the move to a transport
        if tr is not None and not self.host_closed:
            if conn.fin_received and not self.eof_sent and not conn.recv_pending:
                self.eof_sent = True
                if tr.can_write_eof():
                    tr.write_eof()
            if self.reading_paused and conn.send_space > 0:
                self.reading_paused = False
                if not self.rate_paused and not self.share_paused:
                    tr.resume_reading()
        self._emit(now)
        ev = conn.next_event()
        while ev is not None:
            if ev.__class__ is ResetEvent:
                self.ctx.counters["tcp_resets"] += 1
                self._close_host(abort=True)
            tracer = self.ctx.tracer
            if tracer is not None:
                tracer.record_conn_event(self, ev.name)
            ev = conn.next_event()
        state = conn.state
        if state is CLOSED:
            if not self._undrained():
                self._finish()
            return
        if (state is TIME_WAIT or (self.eof_sent and state in _CLOSED_BOTH)) and not self._undrained():
            self._close_host(abort=False)
        self._arm_timer()

    def _undrained(self) -> bool:
        """Guest bytes we ACKed but the host socket has not taken yet (write side paused): they keep
        the host socket open until resume_writing() drains them, so nothing ACKed is dropped."""
        conn = self.conn
        return bool(not self.host_closed and not conn.reset and (self.transport is not None or self._upgrading)
                    and conn.recv_pending)

    def _emit(self, now: float) -> None:
        """Frames for the segments due at loop time ``now``, into the inject queue (``ctx.inject``)."""
        segs = self.conn.segments_to_send(now)
        if not segs or self.retired:  # retired: the 4-tuple is the guest's new connection's now
            return
        b = self._builder
        if b is None or b.eth != self.eth:
            b = self._builder = TcpFrameBuilder(self.eth, self.dst_ip, self.guest_ip, self.dst_port, self.guest_port,
                                                self.offload)
        inject = self.ctx.inject
        build = b.build
        gso = self.conn.effective_mss  # offload: a longer payload is one GSO frame (ignored otherwise)
        for s in segs:
            inject(build(s.seq, s.ack, s.flags, s.wnd, syn_options(s) if s.flags & SYN else b"", s.payload, gso))

    def _arm_timer(self) -> None:
        """Make sure a loop timer fires by the connection's next deadline.

        Lazy: a timer already armed for an earlier (or the same) time is left alone, and one
        no longer needed is not cancelled (firing early is harmless: ``handle_timer`` fires
        only what is due, and :meth:`_on_timer` re-arms for what is left). A connection's
        deadlines move several times per round trip (delayed ACK, RTO, linger); cancelling
        and creating a loop timer for each move cost more than the rare idle wake-up.
        """
        at = self.conn.get_timer()
        if at is None:
            return
        cur = self._timer_at
        if cur is not None and cur <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        try:
            now = self.loop.time()
            self.conn.handle_timer(now)
            self.flush(now)
        except Exception:
            log.exception("TCP flow %s timer failed", self.key)
            self.failed_internally()

    # ----------------------------------------------------------------- teardown
    def _close_host(self, abort: bool) -> None:
        tr = self.transport
        if tr is None and self._upgrading and not self.host_closed:
            # Between HostSocket and transport: close the socket now, or when the transport arrives.
            self.host_closed = True
            self._close_abort = abort
            sock, self._upgrade_sock = self._upgrade_sock, None
            if sock is not None:
                close_socket(sock, abort)
            return
        if tr is None or self.host_closed:
            return
        self.host_closed = True
        if abort:
            tr.abort()  # HostSocket: SO_LINGER 0, so the host peer sees a RST (a guest RST stays a RST)
        else:
            tr.close()

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if not self.done.done():
                self.done.set_result(None)
            if not self._wake.done():
                self._wake.set_result(None)
            if self._connect_waiting and asyncio.current_task(self.loop) is not self.task:
                # Over (the guest reset its SYN) while the host connect is still pending: stop
                # waiting for it, so the flow and its socket go now, not at the connect timeout.
                self.task.cancel()

    def _teardown(self) -> None:
        self._finished = True
        if self._pending_sock is not None:  # the task ended before it waited for the connect
            self._pending_sock.close()
            self._pending_sock = None
        if self._upgrade_sock is not None:  # ended while moving to a transport
            close_socket(self._upgrade_sock, True)
            self._upgrade_sock = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
        self._close_host(abort=self.conn.reset)
        self.ctx.table.remove(self)

    def retire(self) -> None:
        """Make way for a new guest connection on this flow's 4-tuple: the guest sent a SYN while
        the flow is in TIME-WAIT or CLOSED (:meth:`on_segment` returned False; RFC 9293 3.10.7.4
        and RFC 6191: a SYN in TIME-WAIT may open a new incarnation of the connection).

        Nothing ACKed to the guest is thrown away, and the host never sees a RST for a
        connection that ended gracefully:

        * nothing left in the connection for the host: the host socket, if still open, is
          closed with a FIN (what its kernel or transport still holds reaches the host peer),
          then the flow ends (:meth:`shutdown`);
        * guest bytes still waiting for the host socket (its peer reads slowly): the flow leaves
          its 4-tuple but stays in the flow table under a key of its own (the 5-tuple plus a
          serial, which no guest segment looks up), so it still counts in the flow limits and
          is reaped (``tcp_idle_timeout``), reset and shut down with the stack like any flow.
          It sends nothing more to the guest, writes the rest to the host, closes the host
          socket with a FIN and ends on its own. Counted as ``tcp_retired_draining``.
        """
        conn = self.conn
        draining = (conn.recv_pending and not self.host_closed and not conn.reset
                    and (self.transport is not None or self._upgrading))
        table = self.ctx.table
        if not draining or table.get(self.key) is not self:
            if not conn.reset:
                self._close_host(abort=False)
            self.shutdown()
            return
        self.retired = True
        self.ctx.counters["tcp_retired_draining"] += 1
        table.rekey(self, self.key + (next(_RETIRED),))

    def fail(self) -> None:
        """End this flow after an internal error: RST to the guest, abort the host socket."""
        self.shutdown()

    def failed_internally(self) -> None:
        """An internal error in one of this flow's callbacks (host data, timer): counted as
        ``flow_errors``, then :meth:`fail`; its sibling flows and the stack carry on."""
        self.ctx.counters["flow_errors"] += 1
        self.fail()

    def shutdown(self) -> None:
        """Tear down now (stack exit, eviction): RST towards the guest, host socket closed."""
        if self.conn.state not in _OVER:
            self.conn.abort()
            try:
                self._emit(self.loop.time())
            except Exception:  # pragma: no cover
                pass
        self._close_host(abort=True)
        self._finish()
        if not self.task.done():
            self.task.cancel()  # a task cancelled before its first step never runs its finally:
        self._teardown()  # so tear down here (idempotent)

    def expire(self, now: float) -> bool:
        """Idle sweep: reset both ways after ``tcp_idle_timeout`` s (0: never) without a guest segment."""
        if not 0 < float(self.ctx.config.tcp_idle_timeout) < now - self.last_active:
            return False
        self.ctx.counters["tcp_idle_closed"] += 1
        self._outcome = "timeout"
        self.shutdown()
        return True

