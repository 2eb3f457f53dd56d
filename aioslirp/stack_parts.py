"""The parts of one :class:`~aioslirp.stack.Stack`, read-only: ``stack.parts``.

The stack builds its parts (the flow context, the flow table, the guard, the inject queue, the
link and the L3/L4 dispatch, the services) and wires them to one another at construction; it
keeps them here, in one object that tests, debugging and tools read. The data path never goes
through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations only: this module imports none of the parts
    from .dispatch.family import Family4
    from .dispatch.ipv4 import Ipv4Input
    from .dispatch.l4 import L4
    from .dispatch.link import Link
    from .flow.context import FlowContext, Resolver
    from .flow.guard import Guard
    from .flow.table import FlowTable, IdleOrder
    from .handlers.routes import Router
    from .nat.icmp import IcmpEcho
    from .inject import InjectQueue
    from .wire.neighbors import NeighborCache

__all__ = ["StackParts"]


class StackParts:
    """The parts of one :class:`Stack`, read-only (``stack.parts``): for tests, debugging and tools.

    Not the embedder's interface: these names follow the code and may change in any release
    (the interface is :class:`Stack`'s own names). Each attribute is the object itself, so
    ``stack.parts.guard.policy`` or ``stack.parts.table.flush()`` act on the live stack; only
    rebinding an attribute is refused (``AttributeError``). The data path never goes through
    this object: the parts hold direct references to one another.

    Attributes:
        ctx: the :class:`~aioslirp.flow.context.FlowContext` the parts were built with (``drop()``,
            ``handled()``, the loop once started, ...).
        table: the :class:`~aioslirp.flow.table.FlowTable` (``flush()``: let the flows touched
            since the last flush send).
        flows: the live flow table, ``dict`` key -> flow (:class:`~aioslirp.flow.base.Flow`);
            ``stack.flows()`` gives records of it.
        idle_order: the :class:`~aioslirp.flow.table.IdleOrder` of the UDP/ICMP flows (the
            eviction candidates).
        guard: the :class:`~aioslirp.flow.guard.Guard` (egress policy and bounds).
        inject_queue: the :class:`~aioslirp.inject.InjectQueue` of frames for the guest
            (``put(frame)``, ``write_now()``, ``room``).
        tasks: the ``set`` of the flows' own tasks.
        icmp: the ICMP echo proxy (:class:`~aioslirp.nat.icmp.IcmpEcho`).
        router: the routes to Python flow handlers (:class:`~aioslirp.handlers.routes.Router`).
        link: the guest link (:class:`~aioslirp.dispatch.link.Link`; ``on_frames(frames)`` is the
            transport's sink, ``process(frame)`` one frame).
        l4: the one :class:`~aioslirp.dispatch.l4.L4`.
        ipv4: the IPv4 input (:class:`~aioslirp.dispatch.ipv4.Ipv4Input`).
        family4: the :class:`~aioslirp.dispatch.family.Family4` (addresses, ``eth_to()``,
            ``inject_ip()``, ``err_bucket``: the rate limiter of the ICMP errors we send).
        v6: the IPv6 half (:class:`~aioslirp.dispatch.ipv6.Ipv6Path`: NDP/RA, DHCPv6, IPv6
            input), ``None`` when ``config.ipv6`` is off; ``family6`` its family.
        neighbors: the ARP cache, IPv4 (4 bytes) -> guest MAC (a
            :class:`~aioslirp.wire.neighbors.NeighborCache` of at most ``MAX_NEIGHBORS`` = 1024;
            one more forgets the entry learned longest ago, ``arp.neighbors_evicted``).
    """

    __slots__ = ("ctx", "table", "flows", "idle_order", "guard", "inject_queue", "tasks", "icmp", "router",
                 "link", "l4", "ipv4", "family4", "v6", "family6", "neighbors")

    ctx: FlowContext
    table: FlowTable
    flows: dict
    idle_order: IdleOrder
    guard: Guard
    inject_queue: InjectQueue
    tasks: set
    icmp: IcmpEcho
    router: Router
    link: Link
    l4: L4
    ipv4: Ipv4Input
    family4: Family4
    #: :class:`~aioslirp.dispatch.ipv6.Ipv6Path` or ``None`` (imported only with IPv6).
    v6: object
    #: :class:`~aioslirp.dispatch.family.Family6` or ``None``.
    family6: object
    neighbors: NeighborCache

    def __init__(self, **parts) -> None:
        for name in self.__slots__:
            object.__setattr__(self, name, parts.pop(name))
        if parts:
            raise TypeError(f"StackParts: unknown parts {sorted(parts)}")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"stack.parts is read-only: {name!r} cannot be rebound (change the part itself)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"stack.parts is read-only: {name!r} cannot be deleted")

    def __repr__(self) -> str:
        return f"<StackParts of a Stack: {', '.join(self.__slots__)}>"

    # the parts made or changed as the stack runs, read where they live
    @property
    def dns(self) -> Resolver | None:
        """The :class:`~aioslirp.services.dns.DnsForwarder` (``ctx.running.dns``; ``None`` until the
        stack started)."""
        return self.ctx.running.dns if self.ctx.is_started else None

    @property
    def dhcp(self):
        """The :class:`~aioslirp.services.dhcp.DhcpServer` (a new one per :meth:`Stack.reset_flows`)."""
        return self.family4.dhcp_server

    @property
    def reassembler(self):
        """The IPv4 fragment :class:`~aioslirp.wire.reassembly.Reassembler`."""
        return self.ipv4.reassembler

    @property
    def audit(self):
        """The :class:`~aioslirp.observe.audit.AuditLog`, or ``None`` (off; :meth:`Stack.audit_records`
        starts one without a file)."""
        return self.ctx.audit

    @property
    def loop(self):
        """The event loop the stack runs on (``ctx.running.loop``; ``None`` before :meth:`Stack.start`)."""
        return self.ctx.running.loop if self.ctx.is_started else None

    @property
    def closed(self) -> bool:
        """True once :meth:`Stack.aclose` began."""
        return bool(self.ctx.closed)

    @property
    def offload(self) -> bool:
        """The transport being served offers checksum/TCP segmentation offload (a TAP with
        ``IFF_VNET_HDR``): TCP flows opened while it is served send ~64 KB segments with partial
        checksums (:mod:`aioslirp.wire.offload`). Set by :meth:`Stack.serve`."""
        return bool(self.ctx.offload)
