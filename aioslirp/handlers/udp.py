"""A guest UDP flow taken over by a Python handler: ``async def handler(flow, datagrams)``.

:class:`HandledUdpFlow` stands in the flow table where a :class:`~aioslirp.nat.udp.UdpFlow` would, with
no host socket. The guest's datagrams go into a bounded queue (:data:`QUEUE` payloads; one more
is dropped and counted ``handler_udp_dropped``) that the handler iterates (``async for payload in
datagrams``); ``flow.send(payload)`` sends a datagram to the guest from the destination. The
flow ends like a NAT one (``udp_idle_timeout`` without a datagram either way, eviction, the
stack's exit), and when the handler returns or raises (``handler_errors``, logged); the handler's
iteration then ends and its task is cancelled. A next datagram of the guest starts a new flow.
"""

from __future__ import annotations

import asyncio
from collections import deque

from ..flow.base import admission
from ..nat.datagram import DatagramFlow
from ..wire.ip import PROTO_UDP
from .streams import GuestFlow

__all__ = ["Datagrams", "HandledUdpFlow", "QUEUE"]

#: Guest datagrams a handled UDP flow holds for its handler at most.
QUEUE = 256


class Datagrams:
    """The guest's datagrams of one flow, an async iterator of ``bytes`` payloads (ends with the flow)."""

    __slots__ = ("_q", "_wake", "_ended")

    _q: deque
    _wake: asyncio.Future | None
    _ended: bool

    def __init__(self) -> None:
        self._q: deque = deque()
        self._wake = None
        self._ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        while not self._q:
            if self._ended:
                raise StopAsyncIteration
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        return self._q.popleft()

    def __len__(self) -> int:
        return len(self._q)

    def put(self, payload: bytes) -> bool:
        """Queue one payload; False (not queued) when :data:`QUEUE` are waiting or it ended."""
        if self._ended or len(self._q) >= QUEUE:
            return False
        self._q.append(payload)
        self._kick()
        return True

    def end(self) -> None:
        self._ended = True
        self._kick()

    def _kick(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)


class HandledUdpFlow(DatagramFlow):
    """One guest UDP flow handed to ``handler`` (see the module documentation).

    Args: ``ctx`` (the :class:`~aioslirp.flow.context.FlowContext`), ``fam`` (Family4/6), ``key`` (the
    :func:`~aioslirp.flow.base.flow_key`), ``remote`` (host-side address text), ``now`` (loop time),
    ``handler``, ``name`` (the destination's DNS name or ``None``), ``errors`` (the router's
    ``failed(handler, flow, exc)``).
    """

    proto = PROTO_UDP
    proto_name = "udp"
    idle_counter = "udp_idle_closed"
    direction = "outbound"
    forward_id = None

    __slots__ = ("guest_port", "dst_port", "remote", "bytes_up", "bytes_down", "datagrams", "gflow", "handler", "task",
                 "_errors", "_ended", "name", "rule")

    guest_port: int
    dst_port: int
    remote: str
    bytes_up: int
    bytes_down: int
    datagrams: Datagrams
    gflow: GuestFlow
    handler: object
    task: asyncio.Task
    _errors: object
    _ended: bool
    #: The egress decision's DNS name and rule (see :class:`~aioslirp.flow.base.Flow`).
    name: str | None
    rule: str | None

    def __init__(self, ctx, fam, key: tuple, remote: str, now: float, handler, name: str | None, errors) -> None:
        super().__init__(ctx, fam, key, now, ctx.config.udp_idle_timeout)
        _, self.guest_ip, self.guest_port, self.dst_ip, self.dst_port = key
        self.remote = remote
        self.name, self.rule = admission(ctx, self, remote)  # the egress decision's name and rule (Flow)
        self.bytes_up = self.bytes_down = 0
        self.datagrams = Datagrams()
        self.handler = handler
        self._errors = errors
        self._ended = False
        self.gflow = GuestFlow("udp", self, name, float(ctx.config.tcp_connect_timeout), self.to_guest)
        ctx.table.add(self)
        self.task = ctx.start_task(self._main(), f"aioslirp-udp-handler-{self.guest_port}")

    async def _main(self) -> None:
        try:
            await self.handler(self.gflow, self.datagrams)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            if not self._ended:
                self._errors(self.handler, self.gflow, exc)
        finally:
            self.gflow.close()
            if not self._ended:
                self.shutdown()

    # ------------------------------------------------------------------ both ways
    def send(self, payload, header, now: float) -> None:
        """A guest datagram (the L4 dispatch): queued for the handler, or dropped (counted) when full."""
        self.last_active = now
        if self.datagrams.put(bytes(payload)):
            self.bytes_up += len(payload)
        else:
            self.ctx.counters["handler_udp_dropped"] += 1

    def to_guest(self, payload) -> None:
        """The handler's ``flow.send(payload)``: one datagram to the guest (dropped once the flow ended,
        or under a ``rate_down`` cap without room, counted ``drop.rate_limit_down``)."""
        if self._ended:
            return
        now = self.loop.time()
        rate = self.ctx.rate_down
        if rate is not None and not rate.take(len(payload), now):
            self.ctx.counters["drop.rate_limit_down"] += 1
            return
        self.last_active = now
        self.bytes_down += len(payload)
        fam = self.fam
        fam.inject_ip(fam.build_udp(self.dst_ip, self.guest_ip, self.dst_port, self.guest_port, bytes(payload)),
                      self.guest_ip)

    # ------------------------------------------------------------------ the Flow interface (and DatagramFlow's)
    def shutdown(self) -> None:
        """End now: the handler's iteration ends, its task is cancelled, the flow leaves the table."""
        if not self._ended:
            self._ended = True
            self.datagrams.end()
            self.gflow.close()
            if self.task is not asyncio.current_task() and not self.task.done():
                self.task.cancel()
        self.ctx.table.remove(self)
