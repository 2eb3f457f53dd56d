"""Port forwards host -> guest (``-p/--publish``, ``add_hostfwd``).

Theory of operation
-------------------
A :class:`~aioslirp.config.forward.PortForward` names a host address and port to listen on, a
protocol and a guest address and port. :class:`Forwarder` (one per :class:`~aioslirp.Stack`, reached
through ``Stack.add_forward()``/``remove_forward()``/``forwards()``) opens the host
listener and turns what arrives there into flows in the stack's ordinary flow table:

* **TCP**: a reader callback on the listening socket accepts host connections. Each accepted socket becomes a
  :class:`~aioslirp.nat.forwarded.ForwardedTcpFlow`: the stack makes sure it knows the guest's
  MAC (an ARP request from the gateway when it does not, RFC 826), then *sends the SYN
  itself* (active open, :meth:`TcpConnection.connect`) from the gateway address
  (``10.0.2.2``) and a source port of its own, so the guest sees a connection from the
  gateway. The guest's SYN-ACK comes back through the normal dispatch (the flow key
  ``(tcp, guest addr, guest port, gateway, source port)`` matches) and from then on the
  flow relays both ways exactly like a guest-initiated flow: MSS and window scaling,
  flow control, half-close both ways, RST both ways.
  A guest that answers with RST (nothing listening) or does not answer within
  ``tcp_connect_timeout`` makes the host client see a reset at once (``SO_LINGER`` 0).
* **UDP**: one host socket per forward. Each host client ``(address, port)`` becomes a
  :class:`UdpForwardFlow` with its own source port towards the guest; the guest's
  replies to that port go back to that client through the listening socket. The flow is
  tracked in the flow table (idle timeout ``udp_idle_timeout``, evictable), so replies
  are routed even with ``disable_host_loopback``.

Source ports towards the guest are taken round-robin from 49152-65535 (RFC 6335's
dynamic range), skipping any that would give a flow key already in use, so a 4-tuple is
not reused while the guest may still hold it in TIME-WAIT.

Removing a forward closes its listener at once (new connections are refused); TCP
connections already forwarded carry on until they close, UDP flows of that forward end
with it (they answer through its socket). Stack exit closes everything.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
from dataclasses import replace

from ..config.forward import PROTOS, PortForward
from ..errors import ConfigError
from ..flow.base import flow_key
from ..wire.arp import ARP_REQUEST, build_arp
from ..wire.ip import PROTO_TCP, PROTO_UDP
from .datagram import DatagramFlow

__all__ = ["ForwardError", "UnknownForwardError", "Forwarder", "UdpForwardFlow", "listen"]

log = logging.getLogger("aioslirp.forward")

#: Source ports the stack uses towards the guest for forwarded flows (RFC 6335 dynamic range).
SOURCE_PORTS = (49152, 65535)
#: Seconds to wait for the guest's ARP reply before giving up on a forwarded connection.
ARP_TIMEOUT = 1.0
#: Seconds between ARP requests while waiting.
ARP_RETRY = 0.2
#: Listen backlog of forwarded TCP ports.
BACKLOG = 1024
#: Datagrams held per UDP flow while the guest's MAC is being resolved.
UDP_PENDING_MAX = 32


class ForwardError(OSError):
    """A forward could not be set up (host port in use, no permission, bad address...).

    ``str(err)`` is one line naming the forward; ``err.errno`` is the OS error number
    when there is one.
    """

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(errno_ or 0, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UnknownForwardError(ForwardError, KeyError):
    """:meth:`Stack.remove_forward` of a forward the stack does not have. ``str(err)`` names the id
    asked and the active ids; ``err.forward_id`` is the id (or what was given). ``errno`` is
    ``ENOENT``.

    It is a :class:`ForwardError`, and also a ``KeyError`` (what ``remove_forward`` raised up to
    0.1.0), so code written for either catches it.
    """

    def __init__(self, forward_id, active: list[int]) -> None:
        ids = ", ".join(map(str, active)) or "none"
        super().__init__(f"remove_forward: no forward with id {forward_id!r} (active ids: {ids})", errno.ENOENT)
        self.forward_id = forward_id


def _reset_close(sock) -> None:
    """Close ``sock`` with an RST (``SO_LINGER`` on, 0 s) so the peer sees a reset at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    sock.close()


class _Listener:
    """One active forward: its host socket and what serves it."""

    __slots__ = ("fwd", "sock", "guest_ip", "fam", "clients", "closed")

    fwd: PortForward
    sock: socket.socket
    #: The guest's address, 4 bytes (IPv4) or 16 (IPv6).
    guest_ip: bytes
    #: The guest address's family (``Family4`` / ``Family6``): gateway, output, neighbours.
    fam: object
    clients: dict
    closed: bool

    def __init__(self, fwd: PortForward, sock: socket.socket, guest_ip: bytes, fam) -> None:
        self.fwd = fwd
        self.sock = sock
        self.guest_ip = guest_ip
        self.fam = fam
        #: UDP: host client (addr, port) -> UdpForwardFlow.
        self.clients: dict = {}
        self.closed = False


def listen(fwd: PortForward) -> socket.socket:
    """The host socket of ``fwd`` (its ``host_addr``, ``host_port``, ``proto``), bound, listening
    (TCP) and non-blocking. Raises :class:`ForwardError` (one line naming the address, port and
    protocol) when it cannot be bound: in use, no permission."""
    family = socket.AF_INET6 if ":" in fwd.host_addr else socket.AF_INET
    stype = socket.SOCK_STREAM if fwd.proto == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(family, stype)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if stype == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((fwd.host_addr, fwd.host_port))
        if stype == socket.SOCK_STREAM:
            sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        what = f"{fwd.host_addr}:{fwd.host_port}/{fwd.proto}"
        if ":" in fwd.host_addr:
            what = f"[{fwd.host_addr}]:{fwd.host_port}/{fwd.proto}"
        hint = ""
        if exc.errno == errno.EACCES and fwd.host_port < 1024:
            hint = " (ports below 1024 need CAP_NET_BIND_SERVICE or net.ipv4.ip_unprivileged_port_start)"
        raise ForwardError(f"cannot listen on {what}: {os.strerror(exc.errno or 0)}{hint}", exc.errno) from None
    return sock


class Forwarder:
    """The port forwards of one stack. Use it through :class:`~aioslirp.Stack`.

    ``ctx``: the stack's :class:`~aioslirp.flow.context.FlowContext`; ``fam``: its
    :class:`~aioslirp.dispatch.family.Family4` (the gateway address, the ARP cache, IPv4 output);
    ``fam6``: its :class:`~aioslirp.dispatch.family.Family6`, or ``None`` without IPv6 (then a
    forward to an IPv6 guest address is refused). A forward to an IPv6 guest address comes from
    the IPv6 gateway (``fd00::2``), the guest's link-layer address found by Neighbor Discovery
    (RFC 4861 7.2) instead of ARP.
    """

    __slots__ = ("ctx", "fam", "fam6", "_listeners", "_next_id", "_next_port", "_resolving")

    ctx: object
    fam: object
    fam6: object
    #: Forward id -> its listener.
    _listeners: dict[int, _Listener]
    _next_id: int
    #: The next source port to try for a forwarded connection (in ``SOURCE_PORTS``).
    _next_port: int
    #: Guest address -> the ARP resolution in progress.
    _resolving: dict[bytes, asyncio.Future]

    def __init__(self, ctx, fam, fam6=None) -> None:
        self.ctx = ctx
        self.fam = fam
        self.fam6 = fam6
        self._listeners: dict[int, _Listener] = {}
        self._next_id = 1
        self._next_port = SOURCE_PORTS[0]
        self._resolving: dict[bytes, asyncio.Future] = {}

    # ------------------------------------------------------------------ management
    def _check(self, fwd: PortForward) -> tuple[PortForward, bytes, object]:
        cfg = self.ctx.config
        if fwd.proto not in PROTOS:
            raise ConfigError("proto", f"{fwd.proto!r} is not tcp or udp")
        try:
            host = str(ipaddress.ip_address(fwd.host_addr))
        except ValueError:
            raise ConfigError("host_addr", f"{fwd.host_addr!r} is not an IP address") from None
        if not isinstance(fwd.host_port, int) or not 0 <= fwd.host_port <= 65535:
            raise ConfigError("host_port", f"{fwd.host_port!r} is not a port number")
        if not isinstance(fwd.guest_port, int) or not 1 <= fwd.guest_port <= 65535:
            raise ConfigError("guest_port", f"{fwd.guest_port!r} is not a port number in 1-65535")
        guest = cfg.guest if fwd.guest_addr in (None, "") else fwd.guest_addr
        try:
            gaddr = ipaddress.ip_address(str(guest).strip().strip("[]"))
        except ValueError:
            raise ConfigError("guest_addr", f"{guest!r} is not an IPv4 or IPv6 address") from None
        if gaddr.version == 6:
            if self.fam6 is None or not getattr(cfg, "ipv6", False):
                raise ConfigError("guest_addr", f"{gaddr} is an IPv6 address and the stack does not serve IPv6")
            net = ipaddress.IPv6Network(str(cfg.cidr6))
            if gaddr not in net or gaddr == net.network_address or gaddr in (
                    ipaddress.ip_address(str(cfg.gateway6)), ipaddress.ip_address(str(cfg.dns6))):
                raise ConfigError("guest_addr", f"{gaddr} is not a guest address in {net}")
            return replace(fwd, host_addr=host, guest_addr=str(gaddr)), gaddr.packed, self.fam6
        net = cfg.cidr
        if (gaddr not in net or gaddr in (net.network_address, net.broadcast_address)
                or gaddr in (cfg.gateway, cfg.dns)):
            raise ConfigError("guest_addr", f"{gaddr} is not a guest address in {net}")
        return replace(fwd, host_addr=host, guest_addr=str(gaddr)), gaddr.packed, self.fam

    async def add(self, fwd: PortForward) -> PortForward:
        """Start listening for ``fwd``. Returns it with ``id`` (and a kernel-chosen
        ``host_port`` when 0). Raises ``ConfigError`` for bad fields and
        :class:`ForwardError` when the host socket cannot listen."""
        fwd, guest_ip, fam = self._check(fwd)
        sock = listen(fwd)
        fwd = replace(fwd, host_port=sock.getsockname()[1], id=self._next_id)
        self._next_id += 1
        lst = _Listener(fwd, sock, guest_ip, fam)
        self._listeners[fwd.id] = lst
        ctx = self.ctx
        if fwd.proto == "tcp":
            ctx.running.loop.add_reader(sock.fileno(), self._tcp_acceptable, lst)
        else:
            ctx.running.loop.add_reader(sock.fileno(), self._udp_readable, lst)
        ctx.counters[f"forwards.{fwd.proto}.added"] += 1
        ident = ctx.identity
        log.info("%sforwarding %s", ident.log_prefix, fwd.spec(), extra=ident.log_extra)
        return fwd

    def remove(self, fwd_id: int) -> PortForward:
        """Stop forward ``fwd_id``: close its listener. Raises :class:`UnknownForwardError` (a
        ``ForwardError`` and a ``KeyError``) when unknown."""
        lst = self._listeners.pop(fwd_id, None)
        if lst is None:
            raise UnknownForwardError(fwd_id, list(self._listeners))
        self._close_listener(lst)
        self.ctx.counters[f"forwards.{lst.fwd.proto}.removed"] += 1
        ident = self.ctx.identity
        log.info("%sremoved forward %s", ident.log_prefix, lst.fwd.spec(), extra=ident.log_extra)
        return lst.fwd

    def list(self) -> list[PortForward]:
        """Active forwards in the order they were added."""
        return [lst.fwd for lst in self._listeners.values()]

    def close(self) -> None:
        """Close every listener (stack exit)."""
        for lst in list(self._listeners.values()):
            self._close_listener(lst)
        self._listeners.clear()
        for fut in self._resolving.values():
            if not fut.done():
                fut.cancel()
        self._resolving.clear()

    def _close_listener(self, lst: _Listener) -> None:
        if lst.closed:
            return
        lst.closed = True
        if lst.sock.fileno() >= 0:
            try:
                self.ctx.running.loop.remove_reader(lst.sock.fileno())
            except Exception:  # pragma: no cover - loop closed
                pass
        for flow in list(lst.clients.values()):
            flow.shutdown()
        lst.clients.clear()
        lst.sock.close()

    # ------------------------------------------------------------------ helpers
    def source_port(self, proto: int, guest_ip: bytes, guest_port: int) -> int | None:
        """A gateway-side source port giving a flow key not in use, round-robin; None if none is
        free. The gateway is the one of ``guest_ip``'s family (4 or 16 bytes)."""
        lo, hi = SOURCE_PORTS
        flows = self.ctx.table.flows
        gw = (self.fam6 if len(guest_ip) == 16 else self.fam).gw
        port = self._next_port
        for _ in range(hi - lo + 1):
            candidate = port
            port = lo if port >= hi else port + 1
            if flow_key(proto, guest_ip, guest_port, gw, candidate) not in flows:
                self._next_port = port
                return candidate
        return None

    async def resolve_guest(self, ip4: bytes, timeout: float = ARP_TIMEOUT) -> bool:
        """Make sure the guest's MAC for ``ip4`` is known: ARP requests from the gateway
        every ``ARP_RETRY`` s until it answers or ``timeout`` s pass (for a 16-byte IPv6
        address: Neighbor Solicitations, RFC 4861 7.2.2, at most one a second). Concurrent
        callers share one resolution. Returns True when the MAC is known."""
        ctx = self.ctx
        fam = self.fam6 if len(ip4) == 16 else self.fam
        if ip4 in fam.neighbors:
            return True
        fut = self._resolving.get(ip4)
        if fut is None:
            fut = ctx.running.loop.create_future()
            self._resolving[ip4] = fut
            ctx.spawn(self._arp(ip4, timeout, fut), name="aioslirp-fwd-arp")
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled():
                return False
            raise

    async def _arp(self, ip4: bytes, timeout: float, fut: asyncio.Future) -> None:
        ctx = self.ctx
        v6 = len(ip4) == 16
        fam = self.fam6 if v6 else self.fam
        loop = ctx.running.loop
        deadline = loop.time() + timeout
        next_request = 0.0
        try:
            while ip4 not in fam.neighbors:
                now = loop.time()
                if now >= deadline:
                    ctx.counters["forward_ndp_failed" if v6 else "forward_arp_failed"] += 1
                    break
                if v6:
                    fam.eth_to(ip4)  # a Neighbor Solicitation (rate-limited by the family)
                elif now >= next_request:
                    ctx.counters["arp_requests"] += 1
                    ctx.inject(build_arp(ARP_REQUEST, fam.gw_mac, fam.gw, b"\x00" * 6, ip4))
                    next_request = now + ARP_RETRY
                await asyncio.sleep(0.005)
        finally:
            if self._resolving.get(ip4) is fut:
                del self._resolving[ip4]
            if not fut.done():
                fut.set_result(ip4 in fam.neighbors)

    # ------------------------------------------------------------------ TCP
    def _tcp_acceptable(self, lst: _Listener) -> None:
        """The listening socket is readable: accept what is queued (up to 64 at a time)."""
        for _ in range(64):
            if lst.closed:
                return
            try:
                csock, peer = lst.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE/ENFILE/ENOBUFS...: stop accepting for a moment instead of spinning.
                self.ctx.counters["forward_accept_errors"] += 1
                ident = self.ctx.identity
                log.warning("%sforward %s: accept failed: %s", ident.log_prefix, lst.fwd.spec(), exc.strerror,
                            extra=ident.log_extra)
                loop = self.ctx.running.loop
                loop.remove_reader(lst.sock.fileno())
                loop.call_later(0.1, self._resume_accept, lst)
                return
            try:
                self._tcp_accepted(lst, csock, peer)
            except Exception:
                ident = self.ctx.identity
                log.exception("%sforward %s: cannot start a flow", ident.log_prefix, lst.fwd.spec(),
                              extra=ident.log_extra)
                self.ctx.counters["flow_errors"] += 1
                _reset_close(csock)

    def _resume_accept(self, lst: _Listener) -> None:
        if not lst.closed:
            self.ctx.running.loop.add_reader(lst.sock.fileno(), self._tcp_acceptable, lst)

    def _tcp_accepted(self, lst: _Listener, csock: socket.socket, peer) -> None:
        from .forwarded import ForwardedTcpFlow

        ctx = self.ctx
        counters = ctx.counters
        counters["forward_tcp_accepted"] += 1
        if ctx.closed or not ctx.table.make_room():
            counters["drop.forward_flow_table_full"] += 1
            _reset_close(csock)
            return
        gport = lst.fwd.guest_port
        sport = self.source_port(PROTO_TCP, lst.guest_ip, gport)
        if sport is None:
            counters["drop.forward_no_source_port"] += 1
            _reset_close(csock)
            return
        key = flow_key(PROTO_TCP, lst.guest_ip, gport, lst.fam.gw, sport)
        ForwardedTcpFlow(ctx, lst.fam, key, csock, peer, self.resolve_guest, lst.fwd.id)

    # ------------------------------------------------------------------ UDP
    def _udp_readable(self, lst: _Listener) -> None:
        ctx = self.ctx
        for _ in range(64):
            try:
                data, peer = lst.sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("forward %s: recvfrom: %s", lst.fwd.spec(), exc)
                return
            if lst.closed:
                return
            flow = lst.clients.get(peer)
            if flow is None or flow.closed:
                if not ctx.table.make_room():
                    ctx.counters["drop.forward_flow_table_full"] += 1
                    continue
                sport = self.source_port(PROTO_UDP, lst.guest_ip, lst.fwd.guest_port)
                if sport is None:
                    ctx.counters["drop.forward_no_source_port"] += 1
                    continue
                flow = UdpForwardFlow(self, lst, peer, sport)
            flow.to_guest(data)


class UdpForwardFlow(DatagramFlow):
    """One host client of a UDP forward, as a flow in the stack's table.

    Key ``(udp, guest addr, guest port, gateway, source port)``. Host datagrams go to
    the guest from ``gateway:source port``; the guest's datagrams to that port go back to
    the client through the forward's socket. Closed by the flow table's idle sweep after
    ``udp_idle_timeout`` seconds without traffic either way (:meth:`expire`), when evicted, or
    when its forward is removed.
    """

    proto = PROTO_UDP
    proto_name = "udp"
    idle_counter = "udp_idle_closed"
    direction = "inbound"
    name = rule = None  # not admitted by the egress policy (see aioslirp.flow.base.Flow)

    __slots__ = ("forwarder", "listener", "peer", "forward_id", "guest_port", "dst_port", "remote", "bytes_up",
                 "bytes_down", "closed", "_pending")

    forwarder: Forwarder
    listener: _Listener
    #: The host client's address.
    peer: tuple
    forward_id: int
    guest_port: int
    dst_port: int
    #: ``host:port`` of the client.
    remote: str
    bytes_up: int
    bytes_down: int
    closed: bool
    #: Datagrams waiting for the guest's address to resolve (ARP).
    _pending: list

    def __init__(self, forwarder: Forwarder, lst: _Listener, peer, sport: int) -> None:
        ctx = forwarder.ctx
        fam = lst.fam
        key = flow_key(PROTO_UDP, lst.guest_ip, lst.fwd.guest_port, fam.gw, sport)
        super().__init__(ctx, fam, key, ctx.running.loop.time(), ctx.config.udp_idle_timeout)
        self.forwarder = forwarder
        self.listener = lst
        self.peer = peer
        self.forward_id = lst.fwd.id
        _, self.guest_ip, self.guest_port, self.dst_ip, self.dst_port = key
        self.remote = f"{peer[0]}:{peer[1]}"
        self.bytes_up = self.bytes_down = 0
        self.closed = False
        self._pending: list = []
        lst.clients[peer] = self
        ctx.table.add(self)

    def to_guest(self, data: bytes) -> None:
        """A datagram from the host client: send it to the guest (after ARP if needed)."""
        ctx = self.ctx
        self.last_active = now = self.loop.time()
        rate = ctx.rate_down
        if rate is not None and not rate.take(len(data), now):
            ctx.counters["drop.rate_limit_down"] += 1
            return
        self.bytes_down += len(data)
        ctx.counters["udp_datagrams_down"] += 1
        if self.guest_ip in self.fam.neighbors and not self._pending:
            self._inject(data)
            return
        if len(self._pending) >= UDP_PENDING_MAX:
            ctx.counters["drop.forward_udp_unresolved"] += 1
            return
        self._pending.append(data)
        if len(self._pending) == 1:
            ctx.spawn(self._resolve(), name="aioslirp-fwd-udp-arp")

    async def _resolve(self) -> None:
        ok = await self.forwarder.resolve_guest(self.guest_ip)
        pending, self._pending = self._pending, []
        if self.closed:
            return
        if not ok:
            self.ctx.counters["drop.forward_udp_unresolved"] += len(pending)
            return
        for data in pending:
            self._inject(data)

    def _inject(self, data: bytes) -> None:
        self.fam.inject_ip(self.fam.build_udp(self.dst_ip, self.guest_ip, self.dst_port, self.guest_port, data),
                           self.guest_ip)

    def send(self, payload, header, now: float) -> None:
        """A guest datagram to our source port (``now``: loop time): pass it to the host client."""
        self.last_active = now
        sock = self.listener.sock
        if self.closed or sock.fileno() < 0:
            return
        rate = self.ctx.rate_up
        if rate is not None and not rate.take(len(payload), now):
            self.ctx.counters["drop.rate_limit_up"] += 1
            return
        try:
            sock.sendto(payload, self.peer)
            self.bytes_up += len(payload)
            self.ctx.counters["udp_datagrams_up"] += 1
        except BlockingIOError:
            self.ctx.counters["drop.udp_send_blocked"] += 1
        except OSError as exc:
            log.debug("UDP forward flow %s: %s", self.key, exc)

    def shutdown(self) -> None:
        """Leave the flow table now (the forward's socket stays with the forward)."""
        if self.closed:
            return
        self.closed = True
        self._pending = []
        if self.listener.clients.get(self.peer) is self:
            del self.listener.clients[self.peer]
        self.ctx.table.remove(self)
