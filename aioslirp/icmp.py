"""ICMP and ICMPv6 echo proxying (RFC 792, RFC 4443 4.1-4.2).

Echo requests to the gateway and DNS addresses are answered by the stack itself. Other
destinations are proxied, by the first mechanism that works on this host (chosen once for
IPv4 and once for IPv6):

1. ping sockets (``SOCK_DGRAM`` with ``IPPROTO_ICMP`` / ``IPPROTO_ICMPV6``), allowed by
   ``net.ipv4.ping_group_range`` (it governs both families); the kernel picks the
   identifier, which is rewritten back to the guest's;
2. one raw ICMP (ICMPv6) socket (needs CAP_NET_RAW), replies matched by (remote,
   identifier); the ICMPv6 one filters everything but Echo Reply (``ICMP6_FILTER``,
   RFC 3542 3.2) and the kernel fills its checksums;
3. neither: the request is dropped and counted, and the log says so once.

Each (guest, remote, identifier) is a flow that the flow table's idle sweep ends after
``icmp_idle_timeout`` seconds without an echo either way (:meth:`IcmpFlow.expire`); IPv6 flows
have protocol 58 in their key and 16-byte addresses.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct

from .wire.checksum import checksum
from .wire.ipv4 import ICMP, PROTO_ICMP, build_icmp_packet
from .wire.ipv6 import build_icmp6_packet

log = logging.getLogger("aioslirp.icmp")

#: socket() errors that say nothing about the mechanism, only that the kernel or the process is
#: out of fds or memory now: the probe is not concluded (asked again on the next echo).
_NO_SOCKET_NOW = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))

ICMP_ECHO_REPLY, ICMP_ECHO = 0, 8
ICMP6_ECHO_REQUEST, ICMP6_ECHO_REPLY = 128, 129
PROTO_ICMPV6 = 58
ICMP6_FILTER = 1  # <netinet/icmp6.h>, level IPPROTO_ICMPV6
_ECHO = struct.Struct("!BBHHH")


class IcmpFlow:
    """One proxied echo conversation; owned by :class:`IcmpEcho`."""

    proto = PROTO_ICMP
    proto_name = "icmp"
    state = "OPEN"
    direction = "outbound"
    guest_port = dst_port = None  # echo flows have no ports (the identifier is in the key)
    forward_id = None
    bytes_up = bytes_down = None
    trace = None

    def __init__(self, echo: "IcmpEcho", key, guest_ip: bytes, dst_ip: bytes, remote: str, ident: int, sock):
        self.echo = echo
        self.key = key
        self.guest_ip, self.dst_ip, self.remote, self.ident = guest_ip, dst_ip, remote, ident
        self.sock = sock  # per-flow ping socket, or None with the shared raw socket
        self.v6 = len(guest_ip) == 16
        if self.v6:
            self.proto = PROTO_ICMPV6
        stack = echo.stack
        self.loop = loop = stack.loop
        self.last_active = loop.time()
        self._timeout = float(stack.config.icmp_idle_timeout)
        stack.table.add(self)
        if sock is not None:
            loop.add_reader(sock.fileno(), self._readable)

    def expire(self, now: float) -> bool:
        """The idle sweep: end the flow when no echo went either way for ``icmp_idle_timeout``
        seconds before loop time ``now``. True when it did."""
        if now - self.last_active < self._timeout:
            return False
        self.shutdown()
        return True

    def send(self, seq: int, payload: bytes) -> None:
        self.last_active = self.loop.time()
        if self.v6:  # the kernel fills ICMPv6 checksums (ping and raw sockets, RFC 3542 3.1)
            msg = _ECHO.pack(ICMP6_ECHO_REQUEST, 0, 0, self.ident, seq) + payload
        else:
            msg = bytearray(_ECHO.pack(ICMP_ECHO, 0, 0, self.ident, seq) + payload)
            struct.pack_into("!H", msg, 2, checksum(msg))
        try:
            if self.sock is not None:
                self.sock.sendto(msg, (self.remote, 0))
            else:
                (self.echo.raw6 if self.v6 else self.echo.raw).sendto(msg, (self.remote, 0))
        except OSError as exc:
            self.echo.stack.counters["drop.icmp_send_error"] += 1
            log.debug("ICMP echo to %s: %s", self.remote, exc)

    def _readable(self) -> None:
        for _ in range(16):
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(data) < 8 or data[0] != (ICMP6_ECHO_REPLY if self.v6 else ICMP_ECHO_REPLY):
                continue
            self.deliver(data[6:8], data[8:])

    def deliver(self, seq_bytes: bytes, payload) -> None:
        """Send an echo reply from the remote to the guest."""
        self.last_active = self.loop.time()
        seq = int.from_bytes(seq_bytes, "big")
        stack = self.echo.stack
        stack.counters["icmp_echo_replies"] += 1
        if self.v6:
            stack.inject_ip6(build_icmp6_packet(self.dst_ip, self.guest_ip, ICMP6_ECHO_REPLY, 0,
                                                struct.pack("!HH", self.ident, seq) + bytes(payload)), self.guest_ip)
            return
        stack.inject_ip(build_icmp_packet(self.dst_ip, self.guest_ip, ICMP_ECHO_REPLY, 0,
                                          (self.ident << 16) | seq, payload), self.guest_ip)

    def flush(self) -> None:
        pass

    def fail(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Close the ping socket and leave the flow table now. Idempotent."""
        if self.sock is not None:
            try:
                self.loop.remove_reader(self.sock.fileno())
            except Exception:
                pass
            self.sock.close()
            self.sock = None
        self.echo.stack.table.remove(self)
        self.echo.by_remote.pop((self.dst_ip, self.ident), None)


class IcmpEcho:
    """Chooses the echo mechanism once and creates :class:`IcmpFlow` objects."""

    def __init__(self, stack) -> None:
        self.stack = stack
        #: IPv4 mechanism: ``None`` (not probed yet), ``"ping"``, ``"raw"`` or ``"none"``.
        self.mode: str | None = None
        #: IPv6 mechanism, probed on the first IPv6 echo to proxy; same values.
        self.mode6: str | None = None
        self.raw: socket.socket | None = None
        self.raw6: socket.socket | None = None
        self.by_remote: dict = {}
        self._warned = False

    def _probe(self) -> None:
        """Choose :attr:`mode`; left ``None`` when the kernel gives no socket now (EMFILE...)."""
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
            s.close()
            self.mode = "ping"
            return
        except OSError as exc:
            if exc.errno in _NO_SOCKET_NOW:
                return
        try:
            self.raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
            self.raw.setblocking(False)
            self.stack.loop.add_reader(self.raw.fileno(), self._raw_readable)
            self.mode = "raw"
        except OSError as exc:
            if exc.errno in _NO_SOCKET_NOW:
                return
            self.mode = "none"
            log.warning("ICMP echo: no ping sockets (net.ipv4.ping_group_range) and no raw sockets "
                        "(CAP_NET_RAW); only the gateway and DNS answer pings")
        log.info("ICMP echo proxy mode: %s", self.mode)

    def echo(self, guest_ip: bytes, dst_ip: bytes, remote: str, ident: int, seq: int, payload: bytes, header) -> None:
        """Proxy one echo request from ``guest_ip`` to ``dst_ip`` (``remote`` on the host)."""
        if self.mode is None:
            self._probe()
            if self.mode is None:
                self.stack.drop("icmp_socket_error")
                return
        if self.mode == "none":
            self.stack.drop("icmp_unsupported")
            return
        key = (PROTO_ICMP, guest_ip, ident, dst_ip, 0)
        flow = self.stack.flows.get(key)
        if flow is None:
            if not self.stack.table.make_room():
                return self.stack.drop("flow_table_full")
            sock = None
            if self.mode == "ping":
                try:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
                    sock.setblocking(False)
                except OSError as exc:
                    self.stack.drop("icmp_socket_error")
                    log.debug("ping socket: %s", exc)
                    return
            flow = IcmpFlow(self, key, guest_ip, dst_ip, remote, ident, sock)
            if sock is None:
                self.by_remote[(dst_ip, ident)] = flow
        self.stack.handled("icmp_echo")
        flow.send(seq, payload)

    def _probe6(self) -> None:
        """Choose :attr:`mode6`; left ``None`` when the kernel gives no socket now (EMFILE...)."""
        try:
            s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6)
            s.close()
            self.mode6 = "ping"
        except OSError as exc:
            if exc.errno in _NO_SOCKET_NOW:
                return
            try:
                raw = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
            except OSError as exc2:
                if exc2.errno in _NO_SOCKET_NOW:
                    return
                self.mode6 = "none"
                log.warning("ICMPv6 echo: no ping sockets (net.ipv4.ping_group_range) and no raw sockets "
                            "(CAP_NET_RAW); only the gateway and DNS answer pings")
            else:
                # block every type but Echo Reply (a set bit blocks, RFC 3542 3.2)
                words = [0xFFFFFFFF] * 8
                words[ICMP6_ECHO_REPLY >> 5] &= ~(1 << (ICMP6_ECHO_REPLY & 31)) & 0xFFFFFFFF
                try:
                    raw.setsockopt(socket.IPPROTO_ICMPV6, ICMP6_FILTER, struct.pack("8I", *words))
                except OSError:
                    pass
                raw.setblocking(False)
                self.raw6 = raw
                self.stack.loop.add_reader(raw.fileno(), self._raw6_readable)
                self.mode6 = "raw"
        log.info("ICMPv6 echo proxy mode: %s", self.mode6)

    def echo6(self, guest_ip: bytes, dst_ip: bytes, remote: str, ident: int, seq: int, payload: bytes) -> None:
        """Proxy one ICMPv6 echo request from ``guest_ip`` to ``dst_ip`` (``remote`` on the host)."""
        if self.mode6 is None:
            self._probe6()
            if self.mode6 is None:
                self.stack.drop("icmp_socket_error")
                return
        if self.mode6 == "none":
            self.stack.drop("icmp6_unsupported")
            return
        key = (PROTO_ICMPV6, guest_ip, ident, dst_ip, 0)
        flow = self.stack.flows.get(key)
        if flow is None:
            if not self.stack.table.make_room():
                return self.stack.drop("flow_table_full")
            sock = None
            if self.mode6 == "ping":
                try:
                    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6)
                    sock.setblocking(False)
                except OSError as exc:
                    self.stack.drop("icmp_socket_error")
                    log.debug("ICMPv6 ping socket: %s", exc)
                    return
            flow = IcmpFlow(self, key, guest_ip, dst_ip, remote, ident, sock)
            if sock is None:
                self.by_remote[(dst_ip, ident)] = flow
        self.stack.handled("icmp_echo")
        flow.send(seq, payload)

    def _raw6_readable(self) -> None:
        for _ in range(64):
            try:
                data, addr = self.raw6.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
                    log.debug("raw ICMPv6: %s", exc)
                return
            if len(data) < 8 or data[0] != ICMP6_ECHO_REPLY:
                continue
            try:
                src = socket.inet_pton(socket.AF_INET6, addr[0].split("%", 1)[0])
            except (OSError, IndexError):
                continue
            flow = self.by_remote.get((src, int.from_bytes(data[4:6], "big")))
            if flow is not None:
                flow.deliver(data[6:8], data[8:])

    def _raw_readable(self) -> None:
        for _ in range(64):
            try:
                data = self.raw.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
                    log.debug("raw ICMP: %s", exc)
                return
            ihl = (data[0] & 0x0F) * 4
            if len(data) < ihl + 8 or data[ihl] != ICMP_ECHO_REPLY:
                continue
            src = data[12:16]
            ident = int.from_bytes(data[ihl + 4:ihl + 6], "big")
            flow = self.by_remote.get((src, ident))
            if flow is not None:
                flow.deliver(data[ihl + 6:ihl + 8], data[ihl + 8:])

    def close(self) -> None:
        for name in ("raw", "raw6"):
            sock = getattr(self, name)
            if sock is not None:
                try:
                    self.stack.loop.remove_reader(sock.fileno())
                except Exception:
                    pass
                sock.close()
                setattr(self, name, None)
