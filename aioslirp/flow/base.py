"""What every flow is: the :class:`Flow` protocol and its key, :func:`flow_key`.

A flow is one NAT conversation of the guest (or of a host client of a port forward) that
holds host resources: a TCP connection (:class:`~aioslirp.tcp.flow.TcpFlow`), a UDP flow
(:class:`~aioslirp.udp.UdpFlow`, :class:`~aioslirp.forward.UdpForwardFlow`) or an ICMP echo
flow (:class:`~aioslirp.icmp.IcmpFlow`), IPv4 or IPv6. The stack's
:class:`~aioslirp.flow.table.FlowTable` finds it by its key, flushes it at the end of a batch
of guest frames, sweeps it when idle and evicts it when room is needed; the API socket and the
trace points read it through the attributes below. Nothing else about a flow is assumed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Flow", "flow_key"]


def flow_key(proto: int, guest_ip: bytes, guest_port: int, remote_ip: bytes, remote_port: int) -> tuple:
    """The flow-table key ``(proto, guest addr, guest port, remote addr, remote port)``.

    ``proto``: 6, 17, 1 or 58 (IP protocol / IPv6 next header); addresses 4 bytes (IPv4) or
    16 bytes (IPv6), as on the wire; ports 0-65535. The remote side is what the guest sees:
    the address and port it sent to (for a port forward, the gateway and the source port the
    stack chose). An echo flow has the echo identifier as guest port and 0 as remote port.
    The per-segment look-ups of :mod:`aioslirp.dispatch.l4` build the same tuple inline.
    """
    return (proto, guest_ip, guest_port, remote_ip, remote_port)


@runtime_checkable
class Flow(Protocol):
    """The interface of a flow in the :class:`~aioslirp.flow.table.FlowTable`.

    Attributes:
        key: its :func:`flow_key` (a retired TCP flow appends a serial, see ``TcpFlow.retire``).
        proto: 6, 17, 1 or 58.
        proto_name: ``"tcp"``, ``"udp"`` or ``"icmp"`` (both families); counters
            ``flows.<proto_name>.opened`` / ``.closed``.
        direction: ``"outbound"`` (the guest opened it) or ``"inbound"`` (a port forward).
        state: the RFC 9293 state name of a TCP flow, ``"OPEN"`` for the others.
        guest_ip, dst_ip: the guest's address and the remote address it sees (bytes, 4 or 16).
        guest_port, dst_port: the ports (``None`` for echo flows, which have none).
        remote: the host side as text (the address connected to, or ``host:port`` of a port
            forward's client), ``None`` when not kept (UDP flows) or a local service (DNS over TCP).
        forward_id: the id of the port forward it belongs to, or ``None``.
        last_active: loop time (seconds, ``loop.time()``) of its last activity.
        bytes_up, bytes_down: payload bytes guest -> host and host -> guest, ``None`` when not
            counted here (TCP flows: see their connection; echo flows).
        trace: the tracing record of the flow (:mod:`aioslirp.tracing`), ``None`` when untraced.
    """

    key: tuple
    proto: int
    proto_name: str
    direction: str
    state: str
    guest_ip: bytes
    guest_port: int | None
    dst_ip: bytes
    dst_port: int | None
    remote: str | None
    forward_id: int | None
    last_active: float
    bytes_up: int | None
    bytes_down: int | None
    trace: object

    def flush(self) -> None:
        """Send what is due (called once per batch of guest frames for a flow marked dirty)."""

    def fail(self) -> None:
        """End the flow after an internal error of its own (a failed :meth:`flush`)."""

    def shutdown(self) -> None:
        """End now (stack exit, reset, eviction, idle): host resources released, table left."""

    def expire(self, now: float) -> bool:
        """Idle sweep at loop time ``now``: shut down (and count) when idle past the flow kind's
        timeout; True when it did."""
