"""UDP NAT flows: one connected host socket per (guest addr, guest port, remote addr, remote port).

A flow keeps no task of its own: the flow table's idle sweep closes it once it carried no
datagram either way for ``NetworkConfig.udp_idle_timeout`` seconds (``udp_idle_closed``,
:meth:`UdpFlow.expire`; ``last_active`` is loop time). Datagrams from the remote are sent to
the guest as IPv4/UDP or IPv6/UDP by the flow's family (chosen once, at creation), fragmented
to the link MTU (up to 65,507 bytes of payload). ``ECONNREFUSED`` from the host becomes ICMP
(ICMPv6) port unreachable towards the guest (RFC 792 / RFC 1122 3.2.2.1, RFC 4443 3.1),
quoting the guest's last datagram; ``EHOSTUNREACH`` / ``ENETUNREACH`` host / network
unreachable.

A flow may be adopted by the native data plane (:class:`~aioslirp.nat.native_udp.NativeUdp`,
issue 26): its datagrams then move in C both ways, and the plane reports what moved in batches
(:meth:`UdpFlow.go_native`); the flow stays in the table as it was, with its counters and its
last activity kept current.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Any

from ..flow.base import admission
from ..wire.icmp import KIND_HOST, KIND_NET, KIND_PORT
from ..wire.ip import PROTO_UDP
from .datagram import SocketFlow

log = logging.getLogger("aioslirp.udp")

#: Host socket errors -> the destination unreachable kind told to the guest (see aioslirp.dispatch.family).
_ERR_KINDS: dict[Any, str] = {errno.ECONNREFUSED: KIND_PORT, errno.EHOSTUNREACH: KIND_HOST, errno.ENETUNREACH: KIND_NET}


class UdpFlow(SocketFlow):
    """One guest UDP flow. Created by the L4 dispatch on the guest's first datagram.

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        fam: the flow's :class:`~aioslirp.dispatch.family.Family4` / ``Family6``.
        key: its :func:`~aioslirp.flow.base.flow_key`.
        remote: the host address to connect to (text).
        now: loop time of the first datagram.

    Under a rate cap (``ctx.rate_up`` / ``rate_down``) a datagram the bucket does not hold is
    dropped, counted ``drop.rate_limit_up`` / ``drop.rate_limit_down`` (not a frame outcome: the
    guest's datagram was handled).

    After construction ``sock`` is ``None`` when no flow could be made (counted as
    ``drop.udp_socket_error``, or ``drop.udp_connect_error`` with :attr:`connect_error` the
    unreachable kind to tell the guest); the flow is then not in the table.
    """

    proto = PROTO_UDP
    proto_name = "udp"
    idle_counter = "udp_idle_closed"
    direction = "outbound"
    remote = None  # the host address is not kept (see aioslirp.flow.base.Flow)
    forward_id = None

    __slots__ = ("guest_port", "dst_port", "last_header", "bytes_up", "bytes_down", "connect_error", "_build",
                 "_inject", "name", "rule", "native", "native_slot")

    guest_port: int
    dst_port: int
    #: The guest's last IP header + 8 bytes, quoted in ICMP errors.
    last_header: bytes
    bytes_up: int
    bytes_down: int
    connect_error: str | None
    #: ``fam.build_udp`` and ``fam.inject_ip``.
    _build: Any
    _inject: Any
    #: The egress decision's DNS name and rule (see :class:`~aioslirp.flow.base.Flow`).
    name: str | None
    rule: str | None
    #: The :class:`~aioslirp.nat.native_udp.NativeUdp` moving this flow's datagrams, or ``None``.
    native: Any
    #: Its slot in the native plane's UDP table (meaningful while :attr:`native` is set).
    native_slot: int

    def __init__(self, ctx, fam, key: tuple, remote: str, now: float | None = None) -> None:
        loop = ctx.running.loop
        super().__init__(ctx, fam, key, loop.time() if now is None else now, ctx.config.udp_idle_timeout)
        _, self.guest_ip, self.guest_port, self.dst_ip, self.dst_port = key
        self.name, self.rule = admission(ctx, self, remote)
        self.native = None
        self.native_slot = -1
        self.last_header = b""
        self.bytes_up = self.bytes_down = 0
        self.sock = None
        #: The unreachable kind (``"port"``, ``"host"``, ``"net"``) when the connect failed.
        self.connect_error: str | None = None
        self._build = fam.build_udp
        self._inject = fam.inject_ip
        try:
            sock = socket.socket(fam.af, socket.SOCK_DGRAM)
        except OSError as exc:  # EMFILE, ENFILE, ENOBUFS...: the datagram is dropped, no flow is left
            ctx.drop("udp_socket_error")
            log.debug("UDP socket: %s", exc)  # counted; a log line per hostile datagram would flood
            return
        try:
            sock.setblocking(False)
            sock.connect((remote, self.dst_port))
        except OSError as exc:
            sock.close()
            self.connect_error = _ERR_KINDS.get(exc.errno, KIND_HOST)
            ctx.drop("udp_connect_error")
            return
        self.sock = sock
        loop.add_reader(sock.fileno(), self._readable)
        ctx.table.add(self)

    def send(self, payload, header, now: float) -> None:
        """Send a guest datagram to the remote. ``header``: the guest's IP header + 8 bytes, for
        ICMP errors; ``now``: loop time."""
        self.last_active = now
        self.last_header = bytes(header)
        rate = self.ctx.rate_up
        if rate is not None and not rate.take(len(payload), now):
            self.ctx.counters["drop.rate_limit_up"] += 1  # (the frame's outcome stays handled.udp)
            return
        try:
            self.sock.send(payload)
            self.bytes_up += len(payload)
        except BlockingIOError:
            self.ctx.counters["drop.udp_send_blocked"] += 1
        except OSError as exc:
            self._error(exc)

    def _readable(self) -> None:
        counters = self.ctx.counters
        rate = self.ctx.rate_down
        for _ in range(64):
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as exc:
                self._error(exc)
                return
            self.last_active = now = self.loop.time()
            if rate is not None and not rate.take(len(data), now):
                counters["drop.rate_limit_down"] += 1
                continue
            self.bytes_down += len(data)
            counters["udp_datagrams_down"] += 1
            self._inject(self._build(self.dst_ip, self.guest_ip, self.dst_port, self.guest_port, data),
                         self.guest_ip)

    def go_native(self, native: Any, slot: int, host_readable: Any) -> None:
        """Hand this flow to the native data plane (:meth:`NativeUdp.adopt
        <aioslirp.nat.native_udp.NativeUdp.adopt>`): the host socket is read by ``host_readable(slot)``
        (the plane's C reader) from now on instead of :meth:`_readable`."""
        self.native = native
        self.native_slot = slot
        fd = self.sock.fileno()
        self.loop.remove_reader(fd)
        self.loop.add_reader(fd, host_readable, slot)

    def expire(self, now: float) -> bool:
        """As :meth:`SocketFlow.expire <aioslirp.nat.datagram.SocketFlow.expire>`, with the native
        plane's last activity of this flow taken first."""
        native = self.native
        if native is not None:
            native.take()
        return super().expire(now)

    def leave_native(self) -> None:
        """Back to the Python path (the native plane went away with its transport): this flow reads
        its host socket itself again."""
        self.native = None
        self.native_slot = -1
        if self.sock is not None:
            fd = self.sock.fileno()
            self.loop.remove_reader(fd)
            self.loop.add_reader(fd, self._readable)

    def shutdown(self) -> None:
        """Leave the native plane (if it moved this flow), then as :meth:`SocketFlow.shutdown
        <aioslirp.nat.datagram.SocketFlow.shutdown>`."""
        native = self.native
        if native is not None:
            self.native = None
            native.release(self)
        super().shutdown()

    def host_error(self, exc: OSError) -> None:
        """The host socket failed (``exc``), seen by the native plane: as on the Python path, an
        ICMP error to the guest quoting its last datagram, or a debug line."""
        self._error(exc)

    def _error(self, exc: OSError) -> None:
        kind = _ERR_KINDS.get(exc.errno)
        if kind is not None and self.last_header:
            self.fam.icmp_error(kind, self.last_header)
        else:
            log.debug("UDP flow %s: %s", self.key, exc)
