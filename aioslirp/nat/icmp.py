"""ICMP and ICMPv6 echo proxying (RFC 792, RFC 4443 4.1-4.2), written once over a family.

Echo requests to the gateway and DNS addresses are answered by the stack itself (the L3 of
each family). Other destinations are proxied, by the first mechanism that works on this host
(chosen once for IPv4 and once for IPv6, on the first echo of each):

1. ping sockets (``SOCK_DGRAM`` with ``IPPROTO_ICMP`` / ``IPPROTO_ICMPV6``), allowed by
   ``net.ipv4.ping_group_range`` (it governs both families); the kernel picks the
   identifier, which is rewritten back to the guest's;
2. one raw ICMP (ICMPv6) socket (needs CAP_NET_RAW), replies matched by (remote,
   identifier); the ICMPv6 one filters everything but Echo Reply (``ICMP6_FILTER``,
   RFC 3542 3.2) and the kernel fills its checksums;
3. neither: the request is dropped and counted, and the log says so once.

Each (guest, remote, identifier) is a flow that the flow table's idle sweep ends after
``icmp_idle_timeout`` seconds without an echo either way (:meth:`IcmpFlow.expire`); IPv6 flows
have protocol 58 in their key and 16-byte addresses. What differs by family (socket family and
protocol, message and reply builders, the reply type) comes from the flow's
:class:`~aioslirp.dispatch.family.Family4` / ``Family6``.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct

from ..flow.base import admission, flow_key
from ..wire.icmp import ICMP6_ECHO_REPLY, ICMP_ECHO_REPLY
from ..wire.ip import PROTO_ICMP
from .datagram import SocketFlow

log = logging.getLogger("aioslirp.icmp")

#: socket() errors that say nothing about the mechanism, only that the kernel or the process is
#: out of fds or memory now: the probe is not concluded (asked again on the next echo).
_NO_SOCKET_NOW = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))

ICMP6_FILTER = 1  # <netinet/icmp6.h>, level IPPROTO_ICMPV6


class IcmpFlow(SocketFlow):
    """One proxied echo conversation; owned by :class:`IcmpEcho`. Its ``sock`` is its ping socket,
    or ``None`` with the shared raw socket."""

    proto_name = "icmp"
    direction = "outbound"
    guest_port = dst_port = None  # echo flows have no ports (the identifier is in the key)
    forward_id = None
    bytes_up = bytes_down = None

    __slots__ = ("echo", "proto", "v6", "remote", "ident", "name", "rule")

    echo: IcmpEcho
    #: ``PROTO_ICMP`` (1) or ``PROTO_ICMPV6`` (58): the family's.
    proto: int
    v6: bool
    remote: str
    #: The echo identifier of the guest.
    ident: int
    #: The egress decision's DNS name and rule (see :class:`~aioslirp.flow.base.Flow`).
    name: str | None
    rule: str | None

    def __init__(self, echo: "IcmpEcho", fam, key, guest_ip: bytes, dst_ip: bytes, remote: str, ident: int, sock,
                 now: float) -> None:
        ctx = echo.ctx
        super().__init__(ctx, fam, key, now, ctx.config.icmp_idle_timeout)
        self.echo = echo
        self.proto = fam.icmp_proto
        self.v6 = fam.v6
        self.guest_ip, self.dst_ip, self.remote, self.ident = guest_ip, dst_ip, remote, ident
        self.sock = sock  # per-flow ping socket, or None with the shared raw socket
        self.name, self.rule = admission(ctx, self, remote)
        ctx.table.add(self)
        if sock is not None:
            self.loop.add_reader(sock.fileno(), self._readable)

    def send(self, seq: int, payload: bytes, now: float) -> None:
        """Send one echo request of the guest (``now``: loop time)."""
        self.last_active = now
        msg = self.fam.echo_request(self.ident, seq, payload)
        try:
            sock = self.sock if self.sock is not None else self.echo.raw_socket(self.fam)
            sock.sendto(msg, (self.remote, 0))
        except OSError as exc:
            self.ctx.counters["drop.icmp_send_error"] += 1
            log.debug("ICMP echo to %s: %s", self.remote, exc)

    def _readable(self) -> None:
        reply_type = self.fam.echo_reply_type
        for _ in range(16):
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(data) < 8 or data[0] != reply_type:
                continue
            self.deliver(data[6:8], data[8:])

    def deliver(self, seq_bytes: bytes, payload) -> None:
        """Send an echo reply from the remote to the guest."""
        self.last_active = self.loop.time()
        seq = int.from_bytes(seq_bytes, "big")
        self.ctx.counters["icmp_echo_replies"] += 1
        fam = self.fam
        fam.inject_ip(fam.echo_reply(self.dst_ip, self.guest_ip, self.ident, seq, payload), self.guest_ip)

    def shutdown(self) -> None:
        """Close the ping socket, leave the flow table and the raw socket's replies now. Idempotent."""
        super().shutdown()
        self.echo.by_remote.pop((self.dst_ip, self.ident), None)


def _raw_reply4(data: bytes, _addr):
    """``(source, identifier, offset of the ICMP message)`` of an Echo Reply read from a raw
    ICMP socket (the IPv4 header comes first), or ``None``."""
    ihl = (data[0] & 0x0F) * 4
    if len(data) < ihl + 8 or data[ihl] != ICMP_ECHO_REPLY:
        return None
    return data[12:16], int.from_bytes(data[ihl + 4:ihl + 6], "big"), ihl


def _raw_reply6(data: bytes, addr):
    """The same for a raw ICMPv6 socket (no IPv6 header; the source is ``addr``)."""
    if len(data) < 8 or data[0] != ICMP6_ECHO_REPLY:
        return None
    try:
        src = socket.inet_pton(socket.AF_INET6, addr[0].split("%", 1)[0])
    except (OSError, IndexError):
        return None
    return src, int.from_bytes(data[4:6], "big"), 0


class IcmpEcho:
    """Chooses the echo mechanism once per family and creates :class:`IcmpFlow` objects.

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
    """

    __slots__ = ("ctx", "_mode", "_raw", "by_remote")

    ctx: object
    #: The echo mechanism by ``fam.v6``: ``None`` (not probed yet), ``"ping"``, ``"raw"`` or ``"none"``.
    _mode: dict[bool, str | None]
    #: The shared raw socket by ``fam.v6`` (mode ``"raw"``).
    _raw: dict[bool, socket.socket | None]
    by_remote: dict

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self._mode: dict[bool, str | None] = {False: None, True: None}  # by fam.v6
        self._raw: dict[bool, socket.socket | None] = {False: None, True: None}
        #: (remote address, identifier) -> flow, for the replies read from a raw socket.
        self.by_remote: dict = {}

    @property
    def mode(self) -> str | None:
        """IPv4 mechanism: ``None`` (not probed yet), ``"ping"``, ``"raw"`` or ``"none"``."""
        return self._mode[False]

    @property
    def mode6(self) -> str | None:
        """IPv6 mechanism, probed on the first IPv6 echo to proxy; same values."""
        return self._mode[True]

    @property
    def raw(self) -> socket.socket | None:
        """The shared raw ICMP socket (mode ``"raw"``)."""
        return self._raw[False]

    @property
    def raw6(self) -> socket.socket | None:
        """The shared raw ICMPv6 socket (mode ``"raw"``)."""
        return self._raw[True]

    def raw_socket(self, fam) -> socket.socket | None:
        """The raw socket of ``fam``'s family."""
        return self._raw[fam.v6]

    def _probe(self, fam) -> None:
        """Choose the mechanism of ``fam``; left ``None`` when the kernel gives no socket now (EMFILE...)."""
        v6 = fam.v6
        try:
            socket.socket(fam.af, socket.SOCK_DGRAM, fam.ipproto_icmp).close()
            self._mode[v6] = "ping"
        except OSError as exc:
            if exc.errno in _NO_SOCKET_NOW:
                return
            try:
                raw = socket.socket(fam.af, socket.SOCK_RAW, fam.ipproto_icmp)
            except OSError as exc2:
                if exc2.errno in _NO_SOCKET_NOW:
                    return
                self._mode[v6] = "none"
                log.warning("%s echo: no ping sockets (net.ipv4.ping_group_range) and no raw sockets "
                            "(CAP_NET_RAW); only the gateway and DNS answer pings", "ICMPv6" if v6 else "ICMP")
            else:
                if v6:  # block every type but Echo Reply (a set bit blocks, RFC 3542 3.2)
                    words = [0xFFFFFFFF] * 8
                    words[ICMP6_ECHO_REPLY >> 5] &= ~(1 << (ICMP6_ECHO_REPLY & 31)) & 0xFFFFFFFF
                    try:
                        raw.setsockopt(socket.IPPROTO_ICMPV6, ICMP6_FILTER, struct.pack("8I", *words))
                    except OSError:
                        pass
                raw.setblocking(False)
                self._raw[v6] = raw
                self.ctx.running.loop.add_reader(raw.fileno(), self._raw_readable, v6)
                self._mode[v6] = "raw"
        log.info("%s echo proxy mode: %s", "ICMPv6" if v6 else "ICMP", self._mode[v6])

    def echo(self, fam, guest_ip: bytes, dst_ip: bytes, remote: str, ident: int, seq: int, payload: bytes,
             now: float) -> None:
        """Proxy one echo request from ``guest_ip`` to ``dst_ip`` (``remote`` on the host) of
        family ``fam``; ``now``: loop time. Counted ``handled.icmp_echo`` or dropped."""
        ctx = self.ctx
        v6 = fam.v6
        if self._mode[v6] is None:
            self._probe(fam)
            if self._mode[v6] is None:
                return ctx.drop("icmp_socket_error")
        if self._mode[v6] == "none":
            return ctx.drop(fam.reason["icmp_unsupported"])
        key = flow_key(fam.icmp_proto, guest_ip, ident, dst_ip, 0)
        flow = ctx.table.get(key)
        if flow is None:
            if not ctx.table.make_room():
                return ctx.drop("flow_table_full")
            sock = None
            if self._mode[v6] == "ping":
                try:
                    sock = socket.socket(fam.af, socket.SOCK_DGRAM, fam.ipproto_icmp)
                    sock.setblocking(False)
                except OSError as exc:
                    ctx.drop("icmp_socket_error")
                    log.debug("ping socket: %s", exc)
                    return
            flow = IcmpFlow(self, fam, key, guest_ip, dst_ip, remote, ident, sock, now)
            if sock is None:
                self.by_remote[(dst_ip, ident)] = flow
        ctx.handled("icmp_echo")
        flow.send(seq, payload, now)

    def _raw_readable(self, v6: bool) -> None:
        raw = self._raw[v6]
        parse = _raw_reply6 if v6 else _raw_reply4
        for _ in range(64):
            try:
                data, addr = raw.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
                    log.debug("raw %s: %s", "ICMPv6" if v6 else "ICMP", exc)
                return
            reply = parse(data, addr)
            if reply is None:
                continue
            src, ident, off = reply
            flow = self.by_remote.get((src, ident))
            if flow is not None:
                flow.deliver(data[off + 6:off + 8], data[off + 8:])

    def close(self) -> None:
        for v6, sock in self._raw.items():
            if sock is not None:
                try:
                    self.ctx.running.loop.remove_reader(sock.fileno())
                except Exception:
                    pass
                sock.close()
                self._raw[v6] = None
