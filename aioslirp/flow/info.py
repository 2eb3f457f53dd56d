"""Typed snapshots of the flow table: :class:`FlowInfo`, and :class:`FlowRecords`, what
``stack.flows`` is: called, it returns them (``stack.flows()``).

``stack.flows()`` is a list of :class:`FlowInfo` records made from the live flow table at that
moment, for embedders and for the API socket's ``list_flows``. The table itself (``dict`` key ->
flow, see :class:`~aioslirp.flow.base.Flow`) is ``stack.parts.flows``; up to 0.1 it was
``stack.flows`` too, and its read operations still work there for one release, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass

from .context import FlowContext

__all__ = ["FlowInfo", "FlowRecords", "flow_info"]


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
        destination: ``(address, port)`` of the other end as the guest sees it (the address it
            sent to; for a port forward, the gateway and the source port the stack chose), as
            :attr:`GuestFlow.destination <aioslirp.handlers.streams.GuestFlow>`. Named
            ``remote`` up to 0.1 (that name still reads it, with a ``DeprecationWarning``):
            ``remote`` is the host side in :class:`~aioslirp.flow.base.Flow` and ``GuestFlow``.
        name: the DNS name the guest resolved for ``destination`` when an egress name rule admitted the
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
        guest_name: the name of the stack's guest (``Stack(name=...)``), ``None`` when it has none.
    """

    protocol: str
    guest: tuple
    destination: tuple
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
    guest_name: str | None = None

    @property
    def remote(self) -> tuple:
        """Deprecated name of :attr:`destination` (``DeprecationWarning``; goes in the next release)."""
        warnings.warn("FlowInfo.remote is deprecated: it is now FlowInfo.destination (the guest-visible end; "
                      "FlowInfo.host is the host side); the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return self.destination


def flow_info(flow, now: float, guest_name: str | None = None) -> FlowInfo:
    """The :class:`FlowInfo` of ``flow`` (a :class:`~aioslirp.flow.base.Flow`) at loop time ``now``
    (seconds), of the guest named ``guest_name``."""
    up, down = flow.bytes_up, flow.bytes_down
    last = flow.last_active
    created = flow.started
    return FlowInfo(
        protocol=flow.proto_name,
        guest=(_addr(flow.guest_ip), flow.guest_port),
        destination=(_addr(flow.dst_ip), flow.dst_port),
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
        guest_name=guest_name,
    )


class FlowRecords:
    """What ``stack.flows`` is. Called, a ``list`` of :class:`FlowInfo`, one per flow, in table
    order, at loop time (flows exist only once the stack runs: ``ctx.running.time()``).

    Reading it as the live table (``len()``, ``in``, ``[key]``, iteration, ``keys()``,
    ``values()``, ``items()``, ``get()``, truth), as up to 0.1, still works until the next
    release, each time with a ``DeprecationWarning``: the table is ``stack.parts.flows``.

    Args:
        table: the flow table's ``dict`` (key -> :class:`~aioslirp.flow.base.Flow`).
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext` (its clock once started).
        guest_name: the guest's name each record carries (``None``: none).
    """

    __slots__ = ("_table", "_ctx", "_guest_name")

    _table: dict
    _ctx: FlowContext
    _guest_name: str | None

    def __init__(self, table: dict, ctx: FlowContext, guest_name: str | None = None) -> None:
        self._table = table
        self._ctx = ctx
        self._guest_name = guest_name

    def __call__(self) -> list[FlowInfo]:
        table = self._table
        if not table:
            return []
        native = self._ctx.native_udp
        if native is not None:  # what the native plane moved since its last report
            native.take()
        now = self._ctx.running.time()
        name = self._guest_name
        return [flow_info(f, now, name) for f in list(table.values())]

    def __repr__(self) -> str:
        return f"<stack.flows: call it for the FlowInfo records ({len(self._table)} flows)>"

    def _dict(self) -> dict:
        warnings.warn("reading stack.flows as the flow table (a dict) is deprecated: stack.flows() gives "
                      "FlowInfo records, the live table is stack.parts.flows (goes in the next release)",
                      DeprecationWarning, stacklevel=3)
        return self._table

    def __len__(self) -> int:
        return len(self._dict())

    def __bool__(self) -> bool:
        return bool(self._dict())

    def __iter__(self):
        return iter(self._dict())

    def __contains__(self, key) -> bool:
        return key in self._dict()

    def __getitem__(self, key):
        return self._dict()[key]

    def keys(self):
        return self._dict().keys()

    def values(self):
        return self._dict().values()

    def items(self):
        return self._dict().items()

    def get(self, key, default=None):
        return self._dict().get(key, default)
