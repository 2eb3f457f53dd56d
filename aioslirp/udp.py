"""UDP NAT flows: one connected host socket per (guest addr, guest port, remote addr, remote port).

A flow keeps no task of its own: the flow table's idle sweep closes it once it carried no
datagram either way for ``NetworkConfig.udp_idle_timeout`` seconds (``udp_idle_closed``,
:meth:`UdpFlow.expire`; ``last_active`` is loop time). Datagrams from the
remote are sent to the guest as IPv4/UDP or IPv6/UDP (chosen once per flow by the length
of the key's addresses), fragmented to the link MTU (up to 65,507 bytes of payload).
``ECONNREFUSED`` from the host becomes ICMP (ICMPv6) port unreachable towards the guest
(RFC 792 / RFC 1122 3.2.2.1, RFC 4443 3.1), quoting the guest's last datagram.
"""

from __future__ import annotations

import errno
import logging
import socket

from .wire.ipv4 import PROTO_UDP, build_udp_packet
from .wire.ipv6 import build_udp6_packet

log = logging.getLogger("aioslirp.udp")

ICMP_UNREACH, UNREACH_NET, UNREACH_HOST, UNREACH_PORT = 3, 0, 1, 3
_ERR_CODES = {errno.ECONNREFUSED: UNREACH_PORT, errno.EHOSTUNREACH: UNREACH_HOST, errno.ENETUNREACH: UNREACH_NET}


class UdpFlow:
    """One guest UDP flow. Created by the stack on the guest's first datagram."""

    proto = PROTO_UDP
    proto_name = "udp"
    state = "OPEN"
    direction = "outbound"
    remote = None  # the host address is not kept (see aioslirp.flow.base.Flow)
    forward_id = None
    trace = None

    def __init__(self, stack, key: tuple, remote: str) -> None:
        self.stack = stack
        self.key = key
        _, self.guest_ip, self.guest_port, self.dst_ip, self.dst_port = key
        self.loop = loop = stack.loop
        self.last_active = loop.time()
        self._timeout = float(stack.config.udp_idle_timeout)
        self.last_header = b""
        self.bytes_up = self.bytes_down = 0
        self.sock = None
        self.connect_error: int | None = None
        v6 = len(self.guest_ip) == 16
        self._build = build_udp6_packet if v6 else build_udp_packet
        self._inject = stack.inject_ip6 if v6 else stack.inject_ip
        try:
            sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
        except OSError as exc:  # EMFILE, ENFILE, ENOBUFS...: the datagram is dropped, no flow is left
            stack.drop("udp_socket_error")
            log.debug("UDP socket: %s", exc)  # counted; a log line per hostile datagram would flood
            return
        try:
            sock.setblocking(False)
            sock.connect((remote, self.dst_port))
        except OSError as exc:
            sock.close()
            code = _ERR_CODES.get(exc.errno, UNREACH_HOST)
            self.connect_error = code
            stack.drop("udp_connect_error")
            self.sock = None
            return
        self.sock = sock
        loop.add_reader(sock.fileno(), self._readable)
        stack.table.add(self)

    def expire(self, now: float) -> bool:
        """The idle sweep: close the flow when it carried no datagram for ``udp_idle_timeout``
        seconds before loop time ``now`` (counted ``udp_idle_closed``). True when it did."""
        if now - self.last_active < self._timeout:
            return False
        self.stack.counters["udp_idle_closed"] += 1
        self.shutdown()
        return True

    def send(self, payload, header) -> None:
        """Send a guest datagram to the remote. ``header``: the guest's IP header + 8 bytes, for ICMP errors."""
        self.last_active = self.loop.time()
        self.last_header = bytes(header)
        try:
            self.sock.send(payload)
            self.bytes_up += len(payload)
        except BlockingIOError:
            self.stack.counters["drop.udp_send_blocked"] += 1
        except OSError as exc:
            self._error(exc)

    def _readable(self) -> None:
        stack = self.stack
        for _ in range(64):
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as exc:
                self._error(exc)
                return
            self.last_active = self.loop.time()
            self.bytes_down += len(data)
            stack.counters["udp_datagrams_down"] += 1
            self._inject(self._build(self.dst_ip, self.guest_ip, self.dst_port, self.guest_port, data),
                         self.guest_ip)

    def _error(self, exc: OSError) -> None:
        code = _ERR_CODES.get(exc.errno)
        if code is not None and self.last_header:
            self.stack.send_icmp_error(ICMP_UNREACH, code, self.last_header)
        else:
            log.debug("UDP flow %s: %s", self.key, exc)

    def flush(self) -> None:
        pass

    def fail(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Close the host socket and leave the flow table now. Idempotent."""
        if self.sock is not None:
            try:
                self.loop.remove_reader(self.sock.fileno())
            except Exception:
                pass
            self.sock.close()
            self.sock = None
        self.stack.table.remove(self)
