"""What every flow is: the :class:`Flow` protocol and its key, :func:`flow_key`.

A flow is one NAT conversation of the guest (or of a host client of a port forward) that
holds host resources: a TCP connection (:class:`~aioslirp.nat.tcp.TcpFlow`), a UDP flow
(:class:`~aioslirp.nat.udp.UdpFlow`, :class:`~aioslirp.nat.forward.UdpForwardFlow`) or an ICMP echo
flow (:class:`~aioslirp.nat.icmp.IcmpFlow`), IPv4 or IPv6. The stack's
:class:`~aioslirp.flow.table.FlowTable` finds it by its key, flushes it at the end of a batch
of guest frames, sweeps it when idle and evicts it when room is needed; the API socket and the
trace points read it through the attributes below. Nothing else about a flow is assumed.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from ..wire.tcp import Segment

__all__ = ["AuditSink", "Flow", "FlowFamily", "FlowWatch", "TracePoints", "admission", "flow_key"]

log = logging.getLogger("aioslirp.stack")


def flow_key(proto: int, guest_ip: bytes, guest_port: int, remote_ip: bytes, remote_port: int) -> tuple:
    """The flow-table key ``(proto, guest addr, guest port, remote addr, remote port)``.

    ``proto``: 6, 17, 1 or 58 (IP protocol / IPv6 next header); addresses 4 bytes (IPv4) or
    16 bytes (IPv6), as on the wire; ports 0-65535. The remote side is what the guest sees:
    the address and port it sent to (for a port forward, the gateway and the source port the
    stack chose). An echo flow has the echo identifier as guest port and 0 as remote port.
    The per-segment look-ups of :mod:`aioslirp.dispatch.l4` build the same tuple inline.
    """
    return (proto, guest_ip, guest_port, remote_ip, remote_port)


def admission(ctx, flow, remote: str | None) -> tuple[str | None, str | None]:
    """``(name, rule)`` for a flow being created (its :attr:`Flow.name` and :attr:`Flow.rule`):
    what the egress policy said when :meth:`Guard.admit <aioslirp.flow.guard.Guard.admit>` let
    it through (:meth:`Guard.admitted <aioslirp.flow.guard.Guard.admitted>`); ``(None, None)``
    with no guard, for an inbound flow or a local service (``remote`` ``None``)."""
    guard = getattr(ctx, "guard", None)
    if guard is None or remote is None:
        return None, None
    return guard.admitted(flow, remote)


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
        bytes_up, bytes_down: payload bytes guest -> host and host -> guest (TCP: in-order
            payload accepted from the guest / sent to it, retransmissions excluded), ``None``
            when not counted (echo flows).
        started: loop time (seconds) the flow was created.
        outcome: how it ended, read when it leaves the table (the audit log's ``end``): TCP
            ``"closed"``, ``"reset"``, ``"refused"``, ``"unreachable"``, ``"timeout"`` (connect
            or idle timeout), ``"evicted"``; UDP and echo flows ``"idle"``, ``"evicted"``,
            ``"closed"``. Settable (the flow table sets ``"evicted"``).
        name: the DNS name (lower case, no trailing dot) whose binding to the destination address
            let the flow through the egress policy (the virtual DNS answered it to the guest), or
            ``None`` (no name decided, an inbound flow, a local service). Set at creation.
        rule: the text of the egress rule that allowed the flow (``"pypi.org:443"``,
            ``"10.0.0.0/8"``, ``"policy hook: ..."``), or ``None`` when no rule decided (``egress_default
            allow``, inbound flows, local services). Set at creation (:func:`admission`).
    """

    # Settable: the table rekeys a retired TCP flow and marks an evicted flow's outcome. The
    # others are read-only here (a flow may compute them), so each flow class follows the
    # protocol as mypy checks it (tests/package/test_types.py).
    key: tuple
    outcome: str

    @property
    def proto(self) -> int: ...
    @property
    def proto_name(self) -> str: ...
    @property
    def direction(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def guest_ip(self) -> bytes: ...
    @property
    def guest_port(self) -> int | None: ...
    @property
    def dst_ip(self) -> bytes: ...
    @property
    def dst_port(self) -> int | None: ...
    @property
    def remote(self) -> str | None: ...
    @property
    def forward_id(self) -> int | None: ...
    @property
    def last_active(self) -> float: ...
    @property
    def bytes_up(self) -> int | None: ...
    @property
    def bytes_down(self) -> int | None: ...
    @property
    def started(self) -> float: ...
    @property
    def name(self) -> str | None: ...
    @property
    def rule(self) -> str | None: ...

    def flush(self, now: float) -> None:
        """Send what is due at loop time ``now`` (seconds, the batch's ``loop.time()``); called once
        per batch of guest frames for a flow marked dirty (:meth:`FlowTable.flush
        <aioslirp.flow.table.FlowTable.flush>`)."""

    def fail(self) -> None:
        """End the flow after an internal error of its own (a failed :meth:`flush`)."""

    def shutdown(self) -> None:
        """End now (stack exit, reset, eviction, idle): host resources released, table left."""

    def expire(self, now: float) -> bool:
        """Idle sweep at loop time ``now``: shut down (and count) when idle past the flow kind's
        timeout; True when it did."""


class FlowFamily(Protocol):
    """What a flow asks of its address family, the guest side of IPv4 or IPv6 (the dispatch's
    :class:`~aioslirp.dispatch.family.Family4` / ``Family6`` follow it; this floor does not import
    them)."""

    @property
    def v6(self) -> bool:
        """IPv6 (addresses of 16 bytes) or IPv4 (4 bytes)."""
        ...

    def eth_to(self, ip: bytes, /) -> bytes:
        """The 14-byte Ethernet header from the gateway to the guest's address ``ip``."""
        ...

    def inject_ip(self, packet: bytes | bytearray, dst: bytes, /) -> None:
        """Queue an IP packet (no Ethernet header) for the guest's ``dst``, fragmented to the MTU."""
        ...

    def icmp_error(self, kind: str, orig: bytes, now: float | None = None) -> None:
        """Destination unreachable of ``kind`` (``"net"``, ``"host"``, ``"port"``, ``"admin"``) to
        the guest about ``orig``, its packet (``now``: loop time; default the running clock)."""
        ...


class FlowWatch(Protocol):
    """What the :class:`~aioslirp.flow.table.FlowTable` tells of the flows entering and leaving it
    (the stack's :class:`~aioslirp.flow.guard.Guard`): a protocol, so that the table, compiled,
    takes any object that has these methods."""

    def opened(self, flow: Flow) -> None:
        """``flow`` entered the table."""

    def closed(self, flow: Flow) -> None:
        """``flow`` left the table (once)."""

    def recount(self, flows) -> None:
        """The idle sweep: ``flows`` are all the flows in the table now."""


class TracePoints(Protocol):
    """The trace points the data path records (:class:`aioslirp.observe.tracing.Tracer`, the stack's
    ``tracer``), each called after the work it describes: ``if tr is not None: tr.record_...(...)``.
    Named apart from the data path's own methods (``record_segment``, not ``on_segment``), so that a
    name search finds one thing."""

    def record_flow_opened(self, flow: Flow) -> None:
        """``flow`` entered the flow table."""

    def record_flow_closed(self, flow: Flow) -> None:
        """``flow`` left the flow table."""

    def record_flow_event(self, flow: Flow, name: str, attributes: dict | None = None) -> None:
        """An event of ``flow`` (``"fin.host"``...)."""

    def record_connect_failed(self, flow: Flow, outcome: str) -> None:
        """The host connect of a TCP flow failed (``"refused"``, ``"unreachable"``)."""

    def record_conn_event(self, flow: Flow, name: str) -> None:
        """An event of a TCP flow's connection (``TcpConnection.next_event``)."""

    def record_segment(self, flow: Flow, seg: Segment) -> None:
        """A guest segment fed to a TCP flow."""

    def record_host_data(self, flow: Flow, nbytes: int) -> None:
        """A host read of ``nbytes`` handed to a TCP flow."""

    def record_syn_ack(self, flow: Flow, connect_time: float, immediate: bool) -> None:
        """A TCP flow answered the guest's SYN (``connect_time``: seconds its host connect took)."""

    def record_batch_start(self) -> None:
        """A batch of guest frames begins (:class:`~aioslirp.dispatch.link.Link`)."""

    def record_guest_frame(self, frame: bytes | memoryview) -> None:
        """A guest frame was dispatched."""


class AuditSink(Protocol):
    """What the flow table and the guard tell the audit log (:class:`aioslirp.observe.audit.AuditLog`)."""

    def record(self, rec: dict) -> None:
        """One record (a denial, a DNS decision): fields in docs/audit.md."""

    def flow_ended(self, flow: Flow) -> None:
        """``flow`` left the flow table: its record."""
