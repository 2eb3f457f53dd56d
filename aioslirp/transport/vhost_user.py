"""vhost-user-net: the device side of a virtio-net NIC whose guest memory the front end shares.

Theory of operation
-------------------
A vhost-user front end (QEMU ``-netdev vhost-user``, cloud-hypervisor ``--net vhost_user=true``,
libvirt ``<interface type='vhostuser'>``) runs the guest's virtio-net device model but hands its
data path to a back end over a UNIX socket (QEMU docs/interop/vhost-user.rst): control messages
(a 12-byte header ``request, flags, size`` and a payload, file descriptors in ``SCM_RIGHTS``)
give it the guest's memory (``SET_MEM_TABLE``: one fd per region, mapped here) and the two split
virtqueues of the NIC (queue 0 RX: buffers the guest posts for our frames; queue 1 TX: the
guest's frames), each with a kick eventfd (the guest says "look") and a call eventfd (we
interrupt the guest). Frames then move with no socket in between: one copy out of guest memory
per guest frame, one copy into it per frame for the guest, one call per batch.

The control messages are handled here in Python; the rings are walked and filled in C
(:mod:`aioslirp.native.vhost`, ``vring.c``), where every descriptor is checked against the memory
table: the guest owns the ring contents, which are hostile input (what is dropped and counted:
``vring.h``; :meth:`VhostUserTransport.counters`). A queue whose avail index jumps past the queue
size or names a head past it is marked broken (logged once, its error eventfd signalled) and
walked no more until the front end sets it up again.

With the native plane on (the default) the stack's guest TCP NAT flows run in the native TCP engine here as on
a TAP (:mod:`aioslirp.nat.native_tcp`): the ring walker hands it each guest frame before making a
Python object of it (:meth:`VhostUserTransport.attach_tcp`), and the engine writes its frames into the
RX ring itself (:meth:`VhostUserTransport.tcp_sink`; what finds no buffer waits in C, in order,
at most ``max_buffer`` bytes), one call to the guest per turn of the engine. Its data crosses user
space with no copy at all: the engine reserves RX buffers, has the kernel peek the host socket
straight into them (``recvmsg(MSG_PEEK)`` with iovecs into guest memory, as passt does), then
writes the headers in place and commits; the buffers the peek did not reach go back to the ring
unseen. When that cannot be (the ring short of buffers, frames already waiting, a bad chain, a
driver without ``GUEST_CSUM``/``GUEST_TSO``) the frame takes the copying path above. Counters:
``tcp_frames_in``, ``tcp_frames_out`` (of which ``tcp_frames_direct`` in place; ``tcp_direct_short``:
reservations refused), ``tcp_frames_waited``, ``tcp_rx_full``, ``tcp_rx_dropped``, ``tcp_gso_refused``.

Features offered (virtio 1.1 section 5.1.3): ``VERSION_1``, ``CSUM`` and ``HOST_TSO4/6`` (the
guest sends partial checksums and 64 KB TCP segments: the stack trusts their checksums and
takes them whole, as from an offload TAP, :mod:`aioslirp.wire.offload`), ``GUEST_CSUM`` and
``GUEST_TSO4/6`` (our TCP goes to the guest as 64 KB segments with partial checksums:
:attr:`VhostUserTransport.offload`), ``MRG_RXBUF`` (a frame spans several guest buffers),
``EVENT_IDX`` (kicks and calls only when the other side asks), ``VHOST_USER_F_PROTOCOL_FEATURES``
with the protocol feature ``REPLY_ACK``. Not offered: multiqueue, indirect descriptors, live
migration (dirty logging), ``CTRL_VQ``. A front end without ``GUEST_CSUM`` gets complete
checksums (computed here); one without ``GUEST_TSO4``/``6`` no 64 KB segment (``gso_refused``).

Connections: server mode (the default) listens on ``path`` (QEMU ``-chardev socket,path=PATH``);
client mode connects, again every ``reconnect`` seconds when the front end goes. One front end at
a time; when it disconnects its memory is unmapped, its eventfds closed, and the next one is served
by the same transport (``on_front_end`` is called with ``False``, then ``True``). A front end that
outlives its back end (DPDK virtio_user, ``server=1``) sends ``SET_VRING_BASE`` 0 for rings further
on: each queue resumes from its used ring's index (``rings_resumed``).
"""

from __future__ import annotations

import array
import asyncio
import collections
import logging
import os
import socket
from typing import Callable, Sequence

from ..native import vhost as native_vhost
from ..wire.offload import GSO_NONE, GSO_TCPV4, GSO_TCPV6, OffloadFrame, complete_checksum
from .base import MAX_FRAME, Transport
from .unixpath import bind_path
from .vhost_proto import (
    F_GUEST_CSUM, F_GUEST_TSO4, F_GUEST_TSO6, F_MRG_RXBUF, F_EVENT_IDX, F_PROTOCOL_FEATURES, F_VERSION_1,
    OFFERED_FEATURES, P_REPLY_ACK, OFFERED_PROTOCOL_FEATURES, GET_FEATURES, SET_FEATURES, SET_OWNER, RESET_OWNER,
    SET_MEM_TABLE, SET_LOG_BASE, SET_LOG_FD, SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE,
    SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR, GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES, GET_QUEUE_NUM,
    SET_VRING_ENABLE, SEND_RARP, NET_SET_MTU, NAMES, HEADER, VERSION, FLAG_REPLY, FLAG_NEED_REPLY, MAX_PAYLOAD,
    MAX_FDS, TX_COALESCE, TX_DEFER, U64, VRING_STATE, VRING_ADDR, MEM_HEADER, MEM_REGION, VRING_NOFD, VRING_INDEX, RX, TX,
)

__all__ = ["VhostUserError", "VhostUserTransport"]

log = logging.getLogger("aioslirp.transport.vhost_user")



class VhostUserError(Exception):
    """A front end broke the protocol (the connection is dropped; the message names the field)."""


class _Ring:
    """One queue's file descriptors and state as the messages set them."""

    __slots__ = ("kick", "call", "err", "enabled", "started")

    def __init__(self) -> None:
        self.kick = -1
        self.call = -1
        self.err = -1
        self.enabled = False
        self.started = False


class VhostUserTransport(Transport):
    """The device side of vhost-user-net over the UNIX socket ``path``.

    Args:
        path: the socket path; with ``server=True`` (the default) it is created (a stale socket
            replaced, a live one refused: :class:`~aioslirp.transport.unixpath.SocketInUse`)
            and removed on :meth:`close`; with ``server=False`` the front end listens there.
        server: listen (the front end connects), or connect (the front end listens).
        reconnect: client mode: seconds between connection attempts (the front end not there
            yet, or gone); ``None``: close the transport when the first front end goes.
        batch: most guest frames handed to the stack per sink call.
        max_buffer: most bytes of frames kept for the guest while it has no free RX buffer;
            frames beyond are dropped (``send_drops["full"]``), TCP retransmits.
        max_frame: the largest frame (without the 12-byte virtio-net header) either way.
        on_front_end: called with ``True`` when a front end's rings start, ``False`` when it
            disconnects (the guest it ran is gone).
        tx_coalesce: TX kick moderation, in bytes (0: off). A walk of the TX ring that took at
            least this many bytes (a bulk upload) and found the ring empty asks the driver for no
            kick; the ring is walked again ``tx_interval`` seconds later, and that walk asks for
            a kick unless it is bulk too. Small frames are kicked for at once. Fewer wake-ups.
        tx_interval: seconds between the walks of a bulk upload (> 0; loop timers are in ms).
        tx_defer: TX completion deferral, in seconds (0: off; at most 1). After a walk that took
            under 4 KiB the call giving the guest its buffers back waits up to this long, and is
            dropped if the driver took them back by itself meanwhile (EVENT_IDX ``used_event``;
            a Linux guest does when it next receives or sends): one interrupt per request and
            response instead of two. Still wanted at the deadline, it goes (``tx_calls_late``).

    Raises ``RuntimeError`` (from the constructor) when the native extension is not usable
    (there is no Python ring walker). :meth:`counters` has the drops by reason.
    """

    __slots__ = ("path", "server", "reconnect", "name", "_batch", "max_buffer", "_max_frame", "on_front_end",
                 "_listener", "_conn", "_dev", "_rings", "_rbuf", "_rfds", "features", "protocol_features",
                 "_guest_csum", "_guest_tso4", "_guest_tso6", "_pending", "bytes_buffered", "send_drops",
                 "protocol", "front_ends", "_ino", "_connector", "_tx_scheduled", "_broken_seen", "_hdr_len",
                 "offload", "_announced", "_tcp", "_tcp_ended", "tx_interval", "tx_defer")

    gone_hint = "the front end (QEMU -netdev vhost-user) is running and connected to {ifname}"
    #: The rings are walked natively: unless ``AIOSLIRP_NATIVE`` leaves ``tcp`` out the stack runs guest
    #: TCP flows on the native engine here too (:meth:`attach_tcp`, :meth:`tcp_sink`).
    native = True
    #: No TAP fd: the native TCP engine writes its frames through :meth:`tcp_sink`.
    fd = -1
    #: Frames carry a virtio-net header (the engine's frames start with one).
    vnet_hdr = True

    def __init__(self, path: str, *, server: bool = True, reconnect: float | None = 1.0, batch: int = 64,
                 max_buffer: int = 8 * 1024 * 1024, max_frame: int = MAX_FRAME,
                 on_front_end: Callable[[bool], None] | None = None, tx_coalesce: int = TX_COALESCE,
                 tx_interval: float = 0.001, tx_defer: float = TX_DEFER) -> None:
        super().__init__()
        ext = native_vhost.extension()
        if ext is None:
            raise RuntimeError(f"vhost-user needs the native extension: {native_vhost.why_not()}")
        if batch < 1:
            raise ValueError("batch must be >= 1")
        if tx_coalesce < 0:
            raise ValueError(f"tx_coalesce: {tx_coalesce} is negative (bytes; 0 turns it off)")
        if not tx_interval > 0:
            raise ValueError(f"tx_interval: {tx_interval!r} is not > 0 (seconds)")
        if not 0 <= tx_defer <= 1:
            raise ValueError(f"tx_defer: {tx_defer!r} is not within 0..1 (seconds; 0 turns it off)")
        self.path = path
        self.server = server
        self.reconnect = reconnect
        self.name = path
        self._batch = batch
        self.max_buffer = max_buffer
        self._max_frame = max_frame
        self.on_front_end = on_front_end
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._dev = ext.Device(max_frame, batch)
        self._dev.set_tx_coalesce(tx_coalesce)
        #: Seconds between the TX walks of a bulk upload (``tx_coalesce``).
        self.tx_interval = tx_interval
        self._dev.set_tx_defer(tx_defer)
        #: Seconds a small TX walk's completion call may wait (0: off).
        self.tx_defer = tx_defer
        self._rings = [_Ring(), _Ring()]
        self._rbuf = bytearray()
        self._rfds: list[int] = []
        #: The virtio features the front end accepted (SET_FEATURES), and the protocol features.
        self.features = 0
        self.protocol_features = 0
        self._guest_csum = self._guest_tso4 = self._guest_tso6 = True
        self._hdr_len = 12
        self._pending: collections.deque = collections.deque()
        self.bytes_buffered = 0
        self.send_drops: dict[str, int] = {}
        #: Control-plane counters: ``messages``, ``refused`` (a second front end), ``protocol_errors``,
        #: ``unknown`` (requests not handled), ``mem_tables``, ``rings_resumed`` (a queue whose used
        #: ring's index was not the base: the front end ran with another back end, which
        #: consumed the chains below it; taken from there).
        self.protocol: dict[str, int] = collections.defaultdict(int)
        #: Front ends served so far.
        self.front_ends = 0
        self._ino: int | None = None
        self._connector: asyncio.Task | None = None
        self._tx_scheduled = False
        self._broken_seen: set[int] = set()
        self._announced = False
        #: The NIC offloads checksums and TCP segmentation both ways (offered; see the module notes).
        self.offload = True
        self._tcp = None
        self._tcp_ended: Callable[[], None] | None = None

    # -- Transport interface ----------------------------------------------------------------------

    async def _start_reading(self) -> None:
        loop = self._loop
        assert loop is not None
        if self.server:
            sock = bind_path(self.path, socket.SOCK_STREAM)
            self._ino = os.stat(self.path).st_ino
            sock.listen(4)
            sock.setblocking(False)
            self._listener = sock
            loop.add_reader(sock.fileno(), self._accept)
            log.info("vhost-user: waiting for a front end on %s", self.path)
        else:
            self._connector = loop.create_task(self._connect_loop())

    def send_frames(self, frames: Sequence) -> None:
        """Write ``frames`` into the guest's RX buffers (one call for the batch); what does not fit
        now waits (at most ``max_buffer`` bytes) for the guest's next buffers. Never raises."""
        if self._conn is None or not self._rings[RX].started:
            self._drop("not_ready", len(frames))
            return
        if not (self._guest_csum and self._guest_tso4 and self._guest_tso6):
            frames = self._fit_offload(frames)
        pending = self._pending
        if pending:
            self._queue(frames)
            return
        try:
            done, state, delivered = self._dev.rx(frames, 0)
        except (TypeError, MemoryError) as exc:  # never raise (a frame that is not bytes-like is counted in C)
            self._drop("error", len(frames))
            log.warning("vhost-user %s: frames for the guest refused (%s)", self.path, exc)
            return
        self.frames_out += delivered
        if done < len(frames):
            if state == 1:  # no RX buffers now: keep the rest, wait for the guest's kick
                self._queue(frames[done:] if done else frames)
                if self._dev.rx_kick_me(-1):  # buffers came meanwhile
                    self._loop.call_soon(self._flush_pending)
            else:
                self._note_broken(RX)

    def tcp_sink(self) -> object:
        """The frame sink for ``TcpEngine(sink=...)`` (:mod:`aioslirp.nat.native_tcp`): the native
        TCP engine writes its frames for the guest into the RX ring, no Python object per frame;
        what finds no RX buffer waits (at most ``max_buffer`` bytes, beyond: dropped, counted as
        ``tcp_rx_full``, the engine retransmits)."""
        return self._dev.tcp_sink()

    def attach_tcp(self, engine, ended: Callable[[], None] | None = None) -> None:
        """Hand the guest frames of native TCP flows to ``engine`` (a ``TcpEngine`` made with
        :meth:`tcp_sink`, or ``None`` to stop) in the native ring walker, before the sink sees them.
        ``ended()`` is called after a TX batch in which the engine ended flows (``engine.pending()``)."""
        self._tcp = engine
        self._tcp_ended = ended
        if engine is None:
            self._dev.attach_tcp(None)
            return
        engine.hook_records(ended is not None)
        self._dev.attach_tcp(engine, self.max_buffer)

    def _close_io(self) -> None:
        loop = self._loop
        if self._tcp is not None:
            self.attach_tcp(None)
        if self._connector is not None:
            self._connector.cancel()
            self._connector = None
        self._disconnect("closed", announce=False)
        if self._listener is not None:
            if loop is not None:
                loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            if self._ino is not None:
                try:
                    if os.stat(self.path).st_ino == self._ino:
                        os.unlink(self.path)
                except OSError:
                    pass
                self._ino = None

    @property
    def connected(self) -> bool:
        """A front end is connected (its rings may not run yet)."""
        return self._conn is not None

    @property
    def running(self) -> bool:
        """Both queues of the connected front end are running (its guest's driver is up)."""
        return self._conn is not None and self._rings[RX].started and self._rings[TX].started

    # -- counters ---------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """The ring counters (``tx_frames``, ``rx_frames``, ``calls``, ``kicks``, and the drops by
        reason of ``vring.h``: ``desc_out_of_region``, ``chain_loop``, ``avail_jump``, ...), the
        control plane's (``messages``, ``protocol_errors``, ...) and ``send_drops``."""
        out = dict(self._dev.counters())
        out.update(self.protocol)
        for k, v in self.send_drops.items():
            out[f"send_{k}"] = v
        return out

    def ring_state(self) -> dict[str, dict]:
        """Each queue as it is now, a debug aid for a stalled ring (who waits for whom): our indexes
        (``last_avail``, ``seen_avail``, ``used_idx``, ``signalled_used``), the ring's words
        (``avail_idx``, ``used_ring_idx``, the driver's ``used_event``, our ``avail_event``, the
        flags), whether a kick is pending on its kick eventfd (not read), whether it is started;
        ``rx`` also has the frames waiting for buffers (``pending``: the Python side's;
        ``tcp_frames_waiting``: the native TCP engine's). SIGUSR1 logs it (``aioslirp vhost-user``)."""
        import select

        out = {}
        for q, name in ((RX, "rx"), (TX, "tx")):
            ring = self._rings[q]
            state = dict(self._dev.queue_state(q))
            state["started"] = ring.started
            if ring.kick >= 0:
                try:
                    state["kick_pending"] = bool(select.select([ring.kick], [], [], 0)[0])
                except (OSError, ValueError):
                    state["kick_pending"] = None
            out[name] = state
        out["rx"]["pending"] = len(self._pending)
        out["counters"] = self.counters()
        return out

    def broken(self) -> dict[int, str]:
        """The queues now marked broken: ``{0 (RX) | 1 (TX): reason}``."""
        out = {}
        for q in (RX, TX):
            why = self._dev.broken(q)
            if why:
                out[q] = why
        return out

    # -- connections ------------------------------------------------------------------------------

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
                log.warning("vhost-user %s: accept failed: %s", self.path, exc)
                return
            if self._conn is not None:
                self.protocol["refused"] += 1
                log.warning("vhost-user %s: refusing a second front end (one at a time)", self.path)
                conn.close()
                continue
            self._attach(conn)

    async def _connect_loop(self) -> None:
        warned = False
        while True:
            if self._conn is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await self._loop.sock_connect(sock, self.path)
                except OSError as exc:
                    sock.close()
                    if self.reconnect is None:
                        self.close_reason = "error"
                        self.close(exc)
                        return
                    if not warned:
                        log.info("vhost-user: no front end listening on %s yet (%s); retrying every %.1f s",
                                 self.path, exc.strerror or exc, self.reconnect)
                        warned = True
                else:
                    warned = False
                    self._attach(sock)
            await asyncio.sleep(self.reconnect if self.reconnect is not None else 0.2)

    def _attach(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self._conn = conn
        self.front_ends += 1
        self._rbuf.clear()
        self._loop.add_reader(conn.fileno(), self._readable)
        log.info("vhost-user %s: front end #%d connected", self.path, self.front_ends)

    def _disconnect(self, why: str, *, announce: bool = True) -> None:
        """Forget the front end: its memory, eventfds and pending frames; the transport stays open
        (server mode; client mode connects again), unless ``reconnect`` is ``None`` in client mode."""
        conn = self._conn
        if conn is None:
            return
        was_running = self._announced
        self._conn = None
        loop = self._loop
        if loop is not None:
            loop.remove_reader(conn.fileno())
        conn.close()
        for q in (RX, TX):
            self._stop_ring(q)
            ring = self._rings[q]
            self._dev.set_call(q, -1)
            for fd in (ring.kick, ring.call, ring.err):
                if fd >= 0:
                    os.close(fd)
            self._rings[q] = _Ring()
        self._dev.reset()
        for fd in self._rfds:
            os.close(fd)
        self._rfds.clear()
        if self._pending:
            self._drop("front_end_gone", len(self._pending))
            self._pending.clear()
            self.bytes_buffered = 0
        self._broken_seen.clear()
        self._announced = False
        self.features = self.protocol_features = 0
        log.info("vhost-user %s: front end gone (%s): %s", self.path, why, self._summary())
        if announce and was_running and self.on_front_end is not None:
            self.on_front_end(False)
        if announce and not self.server and self.reconnect is None:
            self.close_reason = "eof" if why == "eof" else "error"
            self.close()

    def _summary(self) -> str:
        c = self._dev.counters()
        return ", ".join(f"{k}={v}" for k, v in sorted(c.items()) if v)

    # -- control messages -------------------------------------------------------------------------

    def _readable(self) -> None:
        """Read messages one at a time (exactly the bytes of the current one: the fds that come
        with a read belong to the message being read, never to the next)."""
        while self._conn is not None:
            buf = self._rbuf
            want = HEADER.size
            if len(buf) >= HEADER.size:
                request, flags, size = HEADER.unpack_from(buf, 0)
                if size > MAX_PAYLOAD:
                    self.protocol["protocol_errors"] += 1
                    log.warning("vhost-user %s: message %s with a payload of %d bytes (at most %d): disconnecting",
                                self.path, NAMES.get(request, request), size, MAX_PAYLOAD)
                    self._disconnect("error: payload too large")
                    return
                want += size
            if len(buf) < want:
                try:
                    data, anc, mflags, _ = self._conn.recvmsg(want - len(buf), socket.CMSG_SPACE(MAX_FDS * 4))
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    self._disconnect(f"error: {exc.strerror or exc}")
                    return
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds = array.array("i")
                        fds.frombytes(payload[:len(payload) - len(payload) % 4])
                        self._rfds.extend(fds)
                if mflags & socket.MSG_CTRUNC:
                    self.protocol["protocol_errors"] += 1
                    self._disconnect("error: more file descriptors than a message may carry")
                    return
                if not data:
                    self._disconnect("eof")
                    return
                buf += data
                continue
            if want == HEADER.size and HEADER.unpack_from(buf, 0)[2]:
                continue  # the header is in: now its payload
            request, flags, size = HEADER.unpack_from(buf, 0)
            payload = bytes(buf[HEADER.size:want])
            buf.clear()
            fds, self._rfds = self._rfds, []
            self.protocol["messages"] += 1
            try:
                self._handle(request, flags, payload, fds)
            except VhostUserError as exc:
                self.protocol["protocol_errors"] += 1
                log.warning("vhost-user %s: %s: %s; disconnecting", self.path, NAMES.get(request, request), exc)
                self._disconnect(f"error: {exc}")
                return
            finally:
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)

    def _reply(self, request: int, payload: bytes) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.sendall(HEADER.pack(request, VERSION | FLAG_REPLY, len(payload)) + payload)
        except OSError as exc:
            raise VhostUserError(f"reply failed: {exc.strerror or exc}") from None

    def _handle(self, request: int, flags: int, p: bytes, fds: list[int]) -> None:
        """One message; ``fds`` are closed by the caller (an fd kept is replaced by -1 in it)."""
        dev = self._dev
        replied = False
        ok = True
        if request == GET_FEATURES:
            self._reply(request, U64.pack(OFFERED_FEATURES))
            replied = True
        elif request == SET_FEATURES:
            self._set_features(_u64(p, "features"))
        elif request == GET_PROTOCOL_FEATURES:
            self._reply(request, U64.pack(OFFERED_PROTOCOL_FEATURES))
            replied = True
        elif request == SET_PROTOCOL_FEATURES:
            self.protocol_features = _u64(p, "protocol features") & OFFERED_PROTOCOL_FEATURES
        elif request == GET_QUEUE_NUM:
            self._reply(request, U64.pack(2))
            replied = True
        elif request in (SET_OWNER, SEND_RARP, NET_SET_MTU):
            pass
        elif request == RESET_OWNER:
            for q in (RX, TX):
                self._stop_ring(q)
        elif request == SET_MEM_TABLE:
            ok = self._set_mem_table(p, fds)
        elif request == SET_VRING_NUM:
            q, num = self._state(p)
            self._stop_ring(q)
            try:
                dev.set_num(q, num)
            except ValueError as exc:
                raise VhostUserError(str(exc)) from None
        elif request == SET_VRING_ADDR:
            if len(p) < VRING_ADDR.size:
                raise VhostUserError(f"vring address: {len(p)} bytes (expected {VRING_ADDR.size})")
            index, _flags, desc, used, avail, _log = VRING_ADDR.unpack_from(p)
            q = self._queue_index(index)
            try:
                resumed = dev.set_addr(q, desc, used, avail)
            except ValueError as exc:
                log.warning("vhost-user %s: %s", self.path, exc)
                ok = False
            else:
                if resumed:  # the front end ran with a back end before us (the chains below were consumed)
                    self.protocol["rings_resumed"] += 1
                    log.debug("vhost-user %s: queue %d resumes at the used ring's index %d (not the base)",
                             self.path, q, dev.get_base(q))
        elif request == SET_VRING_BASE:
            q, base = self._state(p)
            dev.set_base(q, base)
        elif request == GET_VRING_BASE:
            q, _ = self._state(p)
            self._stop_ring(q)
            self._reply(request, VRING_STATE.pack(q, dev.get_base(q)))
            replied = True
        elif request in (SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR):
            ok = self._set_vring_fd(request, _u64(p, "vring fd index"), fds)
        elif request == SET_VRING_ENABLE:
            q, on = self._state(p)
            self._rings[q].enabled = bool(on)
            if on:
                self._maybe_start(q)
            else:  # disabled: not walked until enabled again
                self._stop_ring(q)
        elif request in (SET_LOG_BASE, SET_LOG_FD):
            ok = False  # no dirty logging (LOG_ALL / LOG_SHMFD not offered)
        else:
            self.protocol["unknown"] += 1
            log.debug("vhost-user %s: request %d not handled", self.path, request)
            ok = False
        if not replied and flags & FLAG_NEED_REPLY and self.protocol_features & P_REPLY_ACK:
            self._reply(request, U64.pack(0 if ok else 1))

    def _queue_index(self, index: int) -> int:
        if index not in (RX, TX):
            raise VhostUserError(f"vring index {index} (this device has queues 0 and 1)")
        return index

    def _state(self, p: bytes) -> tuple[int, int]:
        if len(p) < VRING_STATE.size:
            raise VhostUserError(f"vring state: {len(p)} bytes (expected {VRING_STATE.size})")
        index, num = VRING_STATE.unpack_from(p)
        return self._queue_index(index), num

    def _set_features(self, features: int) -> None:
        self.features = features
        self._hdr_len = 12 if features & (F_VERSION_1 | F_MRG_RXBUF) else 10
        self._guest_csum = bool(features & F_GUEST_CSUM)
        self._guest_tso4 = bool(features & F_GUEST_TSO4)
        self._guest_tso6 = bool(features & F_GUEST_TSO6)
        self._dev.set_features(self._hdr_len, bool(features & F_MRG_RXBUF), bool(features & F_EVENT_IDX),
                               self._guest_csum, self._guest_tso4, self._guest_tso6)

    def _set_mem_table(self, p: bytes, fds: list[int]) -> bool:
        if len(p) < MEM_HEADER.size:
            raise VhostUserError(f"memory table: {len(p)} bytes")
        n, _ = MEM_HEADER.unpack_from(p)
        if n > MAX_FDS or len(p) < MEM_HEADER.size + n * MEM_REGION.size:
            raise VhostUserError(f"nregions: {n} regions in {len(p)} bytes")
        if len(fds) != n:
            raise VhostUserError(f"nregions: {n} regions but {len(fds)} file descriptors")
        regions = []
        for i in range(n):
            gpa, size, uva, offset = MEM_REGION.unpack_from(p, MEM_HEADER.size + i * MEM_REGION.size)
            regions.append((gpa, size, uva, offset, fds[i]))
        try:
            self._dev.set_mem_table(regions)
        except (OSError, ValueError) as exc:
            log.warning("vhost-user %s: memory table refused: %s", self.path, exc)
            return False
        self.protocol["mem_tables"] += 1
        for q in (RX, TX):
            if self._rings[q].started and not self._dev.ready(q):
                self._stop_ring(q)
        return True

    def _set_vring_fd(self, request: int, value: int, fds: list[int]) -> bool:
        q = self._queue_index(value & VRING_INDEX)
        fd = -1
        if not value & VRING_NOFD:
            if len(fds) != 1:
                raise VhostUserError(f"{NAMES[request]}: {len(fds)} file descriptors (expected 1)")
            fd, fds[0] = fds[0], -1  # kept: not closed by the caller
            os.set_blocking(fd, False)
        ring = self._rings[q]
        if request == SET_VRING_KICK:
            self._stop_ring(q)
            if ring.kick >= 0:
                os.close(ring.kick)
            ring.kick = fd
            if fd < 0:
                log.warning("vhost-user %s: queue %d without a kick fd (polling) is not supported", self.path, q)
            self._maybe_start(q)
        elif request == SET_VRING_CALL:
            self._dev.set_call(q, fd)
            if ring.call >= 0:
                os.close(ring.call)
            ring.call = fd
        else:
            if ring.err >= 0:
                os.close(ring.err)
            ring.err = fd
        return True

    # -- rings ------------------------------------------------------------------------------------

    def _maybe_start(self, q: int) -> None:
        """Start queue ``q`` once it has a kick fd, rings and (with protocol features) is enabled."""
        ring = self._rings[q]
        enabled = ring.enabled or not self.features & F_PROTOCOL_FEATURES
        if ring.started or ring.kick < 0 or not enabled or not self._dev.ready(q):
            return
        ring.started = True
        self._broken_seen.discard(q)
        loop = self._loop
        if q == TX:
            loop.add_reader(ring.kick, self._on_tx_kick)
            self._schedule_tx()  # frames made before we listened
        else:
            loop.add_reader(ring.kick, self._on_rx_kick)
        if self._rings[RX].started and self._rings[TX].started and not self._announced:
            self._announced = True
            log.info("vhost-user %s: rings running (features %#x)", self.path, self.features)
            if self.on_front_end is not None:
                self.on_front_end(True)

    def _stop_ring(self, q: int) -> None:
        ring = self._rings[q]
        if ring.started:
            ring.started = False
            if self._loop is not None and ring.kick >= 0:
                self._loop.remove_reader(ring.kick)

    def _on_tx_kick(self) -> None:
        self._tx(self._rings[TX].kick)

    def _schedule_tx(self, delay: float = 0.0) -> None:
        """Walk the TX ring again on the next loop iteration, or ``delay`` seconds later (once,
        however often asked before it runs)."""
        if not self._tx_scheduled:
            self._tx_scheduled = True
            if delay:
                self._loop.call_later(delay, self._tx_again)
            else:
                self._loop.call_soon(self._tx_again)

    def _tx_again(self) -> None:
        self._tx_scheduled = False
        if self._rings[TX].started:
            self._tx(-1)

    def _tx(self, kick: int) -> None:
        """The guest's frames: one call into C walks the TX queue (up to ``batch`` chains), then one
        sink call; more waiting: again on the next loop iteration (other work goes between)."""
        frames, csum_ok, more = self._dev.tx(kick)
        if frames:
            self.frames_in += len(frames)
            sink = self._on_frames
            if sink is not None:
                sink(frames, csum_ok)
        ended = self._tcp_ended
        if ended is not None and self._tcp.pending():
            ended()
        if more == 1:
            self._schedule_tx()
        elif more == 2:  # bulk: no kick asked for; walked again after the interval
            self._schedule_tx(self.tx_interval)
        elif more == 3:  # a completion call waits: walked again to settle or send it
            self._schedule_tx(self.tx_defer)
        elif TX not in self._broken_seen and self._dev.broken(TX):
            self._note_broken(TX)

    def _on_rx_kick(self) -> None:
        if self._dev.rx_kick_me(self._rings[RX].kick) and self._pending:
            self._flush_pending()

    def _queue(self, frames: Sequence) -> None:
        pending = self._pending
        for frame in frames:
            n = len(frame)
            if self.bytes_buffered + n > self.max_buffer:
                self._drop("full")
                continue
            pending.append(frame)
            self.bytes_buffered += n

    def _flush_pending(self) -> None:
        pending = self._pending
        if not pending or self._conn is None:
            return
        frames = list(pending)
        try:
            done, state, delivered = self._dev.rx(frames, 0)
        except (TypeError, MemoryError) as exc:
            self._drop("error", len(pending))
            log.warning("vhost-user %s: frames for the guest refused (%s)", self.path, exc)
            pending.clear()
            self.bytes_buffered = 0
            return
        self.frames_out += delivered
        for _ in range(done):
            self.bytes_buffered -= len(pending.popleft())
        if state == 2:
            self._note_broken(RX)
        elif pending and self._dev.rx_kick_me(-1):
            self._loop.call_soon(self._flush_pending)

    def _note_broken(self, q: int) -> None:
        why = self._dev.broken(q)
        if not why or q in self._broken_seen:
            return
        self._broken_seen.add(q)
        log.warning("vhost-user %s: the guest broke queue %d (%s); it is not walked until set up again",
                    self.path, q, why)
        err = self._rings[q].err
        if err >= 0:
            try:
                os.write(err, U64.pack(1))
            except OSError:
                pass
        if q == RX and self._pending:
            self._drop("broken", len(self._pending))
            self._pending.clear()
            self.bytes_buffered = 0

    def _fit_offload(self, frames: Sequence) -> list:
        """Frames for a guest that did not accept GUEST_CSUM / GUEST_TSO4 / GUEST_TSO6: partial
        checksums completed here, segments it cannot take dropped (``gso_refused``)."""
        out = []
        for frame in frames:
            if frame.__class__ is OffloadFrame:
                gso = frame.vnet[1] & 0x7F
                if (gso == GSO_TCPV4 and not self._guest_tso4) or (gso == GSO_TCPV6 and not self._guest_tso6):
                    self._drop("gso_refused")
                    continue
                if gso == GSO_NONE and not self._guest_csum and frame.vnet[0] & 1:
                    try:
                        frame = complete_checksum(frame)
                    except ValueError:  # not TCP: no partial checksum is built for it
                        pass
            out.append(frame)
        return out

    def _drop(self, reason: str, n: int = 1) -> None:
        self.send_errors += n
        first = reason not in self.send_drops
        self.send_drops[reason] = self.send_drops.get(reason, 0) + n
        if first and reason not in ("not_ready", "front_end_gone"):
            log.warning("vhost-user %s: dropping frames for the guest (%s); counted in send_drops", self.path, reason)


def _u64(p: bytes, what: str) -> int:
    if len(p) < 8:
        raise VhostUserError(f"{what}: {len(p)} bytes (expected 8)")
    return U64.unpack_from(p)[0]

