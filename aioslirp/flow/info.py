"""Typed snapshots of the flow table: :class:`FlowInfo`, and :class:`FlowMap`, the table's
``dict`` that, called, returns them (``stack.flows()``).

``stack.flows`` stays what it always was, the live flow table (``dict`` key -> flow, see
:class:`~aioslirp.flow.base.Flow`); ``stack.flows()`` is a list of :class:`FlowInfo` records
made from it at that moment, for embedders and for the API socket's ``list_flows``.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

__all__ = ["FlowInfo", "FlowMap", "flow_info"]


def _addr(raw) -> str:
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 4:
        return socket.inet_ntoa(bytes(raw))
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        return socket.inet_ntop(socket.AF_INET6, bytes(raw))
    return str(raw)


@dataclass(frozen=True, slots=True)
class FlowInfo:
    """One flow of the stack at the moment :meth:`Stack.flows() <aioslirp.Stack>` was called.

    Attributes:
        protocol: ``"tcp"``, ``"udp"`` or ``"icmp"`` (IPv4 and IPv6 alike).
        guest: ``(address, port)`` of the guest's end, the address as text (``"10.0.2.15"``,
            ``"fd00::..."``); ``port`` is ``None`` for ICMP echo flows.
        remote: ``(address, port)`` of the other end as the guest sees it (the address it sent
            to; for a port forward, the gateway and the source port the stack chose).
        name: the DNS name the guest resolved for ``remote`` when an egress name rule admitted the
            flow by it (the virtual DNS's name binding), else ``None``.
        state: the RFC 9293 state name of a TCP flow (``"ESTABLISHED"``...), ``"OPEN"`` for the others.
        bytes_from_guest, bytes_to_guest: payload bytes (TCP: in-order stream bytes; UDP:
            datagram payloads) guest -> host and host -> guest so far; ``None`` when not counted
            (ICMP echo flows).
        age: seconds since the flow was opened.
        idle: seconds since its last activity (what ``list_flows`` reports as ``idle_s``).
        direction: ``"outbound"`` (the guest opened it) or ``"inbound"`` (a port forward).
        host: the host side as text (the address connected to, or ``host:port`` of a port
            forward's client); ``None`` when not kept (UDP flows) or a local service (DNS over TCP).
        forward_id: the id of the port forward it belongs to, or ``None``.
        rule: the egress rule that admitted the flow (its text), ``None`` when no rule decided.
    """

    protocol: str
    guest: tuple
    remote: tuple
    name: str | None
    state: str
    bytes_from_guest: int | None
    bytes_to_guest: int | None
    age: float
    idle: float
    direction: str = "outbound"
    host: str | None = None
    forward_id: int | None = None
    rule: str | None = None


def flow_info(flow, now: float) -> FlowInfo:
    """The :class:`FlowInfo` of ``flow`` (a :class:`~aioslirp.flow.base.Flow`) at loop time ``now`` (seconds)."""
    up, down = flow.bytes_up, flow.bytes_down
    last = flow.last_active
    created = flow.started
    return FlowInfo(
        protocol=flow.proto_name,
        guest=(_addr(flow.guest_ip), flow.guest_port),
        remote=(_addr(flow.dst_ip), flow.dst_port),
        name=flow.name,
        rule=flow.rule,
        state=str(flow.state),
        bytes_from_guest=up,
        bytes_to_guest=down,
        age=max(0.0, now - created),
        idle=max(0.0, now - last),
        direction=flow.direction,
        host=flow.remote,
        forward_id=flow.forward_id,
    )


class FlowMap(dict):
    """The flow table's ``dict`` (key -> flow); calling it returns a ``list`` of :class:`FlowInfo`,
    one per flow, in table order. ``clock`` is the loop's ``time`` once the stack started."""

    __slots__ = ("clock",)

    def __init__(self) -> None:
        super().__init__()
        self.clock = None

    def __call__(self) -> list[FlowInfo]:
        if not self:
            return []
        now = self.clock() if self.clock is not None else time.monotonic()
        return [flow_info(f, now) for f in list(self.values())]
