"""The TCP flow of a port forward: a host -> guest connection, opened towards the guest.

:class:`ForwardedTcpFlow` is a :class:`~aioslirp.nat.tcp.TcpFlow` whose host socket was
accepted by a forward's listener (:class:`~aioslirp.nat.forward.Forwarder`): it makes sure the
guest's MAC is known, sends our SYN (an active open, RFC 9293 3.5) and from then on relays like
any flow.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from ..flow.base import FlowFamily
from ..flow.context import FlowContext
from ..tcp.connection import LISTEN, SYN_SENT
from .hostsock import HostSocket
from .tcp import TcpFlow

__all__ = ["ForwardedTcpFlow"]

log = logging.getLogger("aioslirp.tcp")


class ForwardedTcpFlow(TcpFlow):
    """A host -> guest connection of a TCP port forward (active open towards the guest).

    ``sock`` is the accepted host socket, ``peer`` its remote address; ``key`` is
    ``(tcp, guest addr, guest port, gateway addr, source port)``. The task attaches the
    host socket, makes sure the guest's MAC is known (``resolve(guest_ip) -> bool``, an
    awaitable), sends our SYN (:meth:`TcpConnection.connect`: MSS ``mtu - 40`` and window
    scaling offered as for outbound flows) and from then on relays like any flow. The
    guest's SYN-ACK arrives through the stack's normal dispatch. Host bytes that arrive
    before the handshake completes are queued and sent after it; a host EOF then becomes
    our FIN behind them. A guest RST, no guest MAC, or no SYN-ACK within
    ``tcp_connect_timeout`` seconds closes the host socket with a RST at once.
    """

    direction = "inbound"

    __slots__ = ("host_sock", "peer", "forward_id", "_resolve", "_connect_timer")

    #: The accepted host socket.
    host_sock: socket.socket
    #: Its remote address, ``(host, port, ...)``.
    peer: tuple
    #: The id of the port forward it came through, if known.
    forward_id: int | None
    #: ``resolve(guest_ip)``: awaits the guest's MAC (ARP/NDP); True when it answered.
    _resolve: Callable[[bytes], Awaitable[bool]]
    #: Bounds the wait for the guest's SYN-ACK (``tcp_connect_timeout``).
    _connect_timer: asyncio.TimerHandle | None

    def __init__(self, ctx: FlowContext, fam: FlowFamily, key: tuple, sock: socket.socket, peer: tuple,
                 resolve: Callable[[bytes], Awaitable[bool]], forward_id: int | None = None) -> None:
        self.host_sock = sock
        self.peer = peer
        self.forward_id = forward_id
        self._resolve = resolve
        self._connect_timer = None
        run = ctx.running
        super().__init__(ctx, fam, key, f"{peer[0]}:{peer[1]}", None, b"", run.time())
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        # host bytes wait for the handshake
        self.transport = HostSocket(run.host_poller, sock, self, self.ctx.queue.held(), self.rate_down)

    _what = "forwarded TCP flow"

    def _teardown(self) -> None:
        if self._connect_timer is not None:
            self._connect_timer.cancel()
            self._connect_timer = None
        super()._teardown()

    async def _open(self) -> None:
        ctx, loop = self.ctx, self.loop
        if self.host_closed or self._finished:  # closed before the task ran
            self._close_host(abort=True)
            self._finish()
            return
        if not await self._resolve(self.guest_ip):
            ctx.counters["forward_guest_unresolved"] += 1
            log.info("forward to %s:%d: the guest does not answer ARP/NDP",
                     socket.inet_ntop(socket.AF_INET6 if self.v6 else socket.AF_INET, self.guest_ip),
                     self.guest_port)
            self.conn.abort()
            self._close_host(abort=True)
            self._finish()
            return
        if self._finished or self.conn.state is not LISTEN:
            self._finish()
            return
        self.eth = self.fam.eth_to(self.guest_ip)
        self._connect_timer = loop.call_later(float(ctx.config.tcp_connect_timeout), self._connect_timeout)
        now = loop.time()
        self.conn.connect(now)
        self.flush(now)

    def _connect_timeout(self) -> None:
        self._connect_timer = None
        if self.conn.state is SYN_SENT:
            self._outcome = "timeout"
            self.ctx.counters["forward_connect_timeout"] += 1
            self.conn.abort()
            self._emit(self.loop.time())
            self._close_host(abort=True)
            self._finish()
