"""What every datagram flow is: the part of :class:`~aioslirp.flow.base.Flow` that a UDP or echo
flow fills in the same way, written once.

A datagram flow (:class:`~aioslirp.nat.udp.UdpFlow`, :class:`~aioslirp.nat.forward.UdpForwardFlow`,
:class:`~aioslirp.handlers.udp.HandledUdpFlow`, :class:`~aioslirp.nat.icmp.IcmpFlow`) holds
nothing back: each datagram goes on as it comes, so :meth:`DatagramFlow.flush` has nothing to
do, a failed flow is simply shut down, and it ends when it carried nothing either way for its
kind's idle timeout (:meth:`DatagramFlow.expire`, run by the flow table's idle sweep). What a
flow holds and how it lets go of it (its :meth:`~DatagramFlow.shutdown`) is its own;
:class:`SocketFlow` is the one with a connected host socket of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

__all__ = ["DatagramFlow", "SocketFlow"]


class DatagramFlow:
    """Base of the datagram flows (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        fam: the flow's :class:`~aioslirp.dispatch.family.Family4` / ``Family6``.
        key: its :func:`~aioslirp.flow.base.flow_key`.
        now: loop time of creation (seconds).
        timeout: its idle timeout in seconds (``udp_idle_timeout``, ``icmp_idle_timeout``).
    """

    state = "OPEN"
    #: The counter the idle sweep adds one to when it ends a flow of this kind (``None``: none).
    idle_counter: ClassVar[str | None] = None

    __slots__ = ("ctx", "fam", "key", "guest_ip", "dst_ip", "loop", "last_active", "_timeout", "started", "outcome")

    #: The stack's :class:`~aioslirp.flow.context.FlowContext`.
    ctx: Any
    #: The flow's family (``Family4``/``Family6``).
    fam: Any
    key: tuple
    guest_ip: bytes
    dst_ip: bytes
    loop: asyncio.AbstractEventLoop
    #: Loop time of the last datagram either way (the idle sweep reads it).
    last_active: float
    #: Seconds without a datagram after which :meth:`expire` ends the flow.
    _timeout: float
    #: Loop time of creation.
    started: float
    #: How it ended: ``"closed"``, ``"idle"``, ``"evicted"``.
    outcome: str

    def __init__(self, ctx, fam, key: tuple, now: float, timeout: float) -> None:
        self.ctx = ctx
        self.fam = fam
        self.key = key
        self.loop = ctx.running.loop
        self.last_active = self.started = now
        self.outcome = "closed"
        self._timeout = float(timeout)

    def flush(self, now: float) -> None:
        """Nothing to send at loop time ``now``: a datagram goes on as it comes."""

    def fail(self) -> None:
        """After an internal error of its own: :meth:`shutdown`."""
        self.shutdown()

    def expire(self, now: float) -> bool:
        """The idle sweep: end the flow (outcome ``"idle"``, counted :attr:`idle_counter`) when it
        carried no datagram either way for its idle timeout before loop time ``now``. True when it did."""
        if now - self.last_active < self._timeout:
            return False
        if self.idle_counter is not None:
            self.ctx.counters[self.idle_counter] += 1
        self.outcome = "idle"
        self.shutdown()
        return True

    def shutdown(self) -> None:  # pragma: no cover - abstract
        """End now: release what the flow holds and leave the flow table. Idempotent."""
        raise NotImplementedError


class SocketFlow(DatagramFlow):
    """A datagram flow with a host socket of its own (``sock``, read by ``loop.add_reader`` once set;
    ``None``: none, or closed), which :meth:`shutdown` closes."""

    __slots__ = ("sock",)

    #: The flow's own host socket (``None``: none, or closed).
    sock: Any  # socket.socket or None (typed Any for the compiled build)

    def shutdown(self) -> None:
        """Stop reading and close the host socket, and leave the flow table now. Idempotent."""
        sock = self.sock
        if sock is not None:
            try:
                self.loop.remove_reader(sock.fileno())
            except Exception:
                pass
            sock.close()
            self.sock = None
        self.ctx.table.remove(self)
