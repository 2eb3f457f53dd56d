"""Native UDP flows (issue 26): a UDP NAT flow that Python admitted, its datagrams moved in C.

Theory of operation
-------------------
Python's first-datagram path is unchanged: :class:`~aioslirp.dispatch.l4.L4` admits the flow
(policy, limits) and :class:`~aioslirp.nat.udp.UdpFlow` connects its host socket and enters the
flow table. Then :meth:`NativeUdp.adopt` hands the flow to the native data plane of the TAP being
served (``aioslirp.native._dataplane.Plane``): from then on the TAP reader sends the flow's guest
datagrams to its host socket from C (the frame must match the 5-tuple, come from the guest's MAC
and pass the UDP checksum rule; anything else goes to Python as before), and the host socket's
readiness calls the plane's C reader (``Plane.udp_readable(slot)``, the loop's reader of the
socket: no Python frame runs), which reads its datagrams and writes their frames to the TAP (built
as the Python path builds them, fragmented to the MTU). No Python object is made per datagram.

What moved is reported back so that everything Python keeps stays current: the plane bumps the
stack's counters itself (the host reader ``udp_datagrams_down``, ``frames_out`` and ``bytes_out``;
the TAP reader ``frames_in``, ``bytes_in`` and ``handled.udp`` after each read), so a datagram
either way runs no Python frame. Before the idle sweep looks at a flow, before ``Stack.flows()``,
when a flow ends, and after a TAP read in which a guest datagram's send failed or was refused
(``TapTransport.native_taken``), :meth:`NativeUdp.take` brings in, per flow touched either way,
its ``bytes_up``, ``bytes_down``, ``last_active`` and ``drop.udp_send_blocked``. A host socket error goes to the flow
at once (:meth:`UdpFlow.host_error <aioslirp.nat.udp.UdpFlow.host_error>`: the ICMP error to the
guest, quoting the last datagram the plane saw). The idle sweep, eviction, the audit record and
``Stack.flows()`` therefore see the flow as on the Python path.

Made by ``Stack.serve`` for a native TAP transport (``AIOSLIRP_NATIVE`` unset, the default, ``1`` or holding ``udp``) when nothing
observes frames one by one or shapes them: no pcap wrapper, no rate cap. Tracing keeps the flows
native (the flow table gives each its span); their datagrams have no per-frame trace point yet
(the TCP engine's ring, :mod:`aioslirp.nat.native_tcp`, has them for TCP flows).
Adopted: IPv4 flows whose guest MAC is known, on a link MTU of at least 576; not to the DHCP
server ports. Frames the plane writes do not pass the inject queue: they leave when the host
datagram arrives, not at the end of the loop turn. When the transport goes, :meth:`detach` hands
every flow back to its Python reader.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from ..wire.ipv4 import DEFAULT_TTL
from .udp import UdpFlow

__all__ = ["NativeUdp"]

log = logging.getLogger("aioslirp.native")

#: Flows one plane moves at once (a new flow beyond it stays on the Python path).
CAPACITY = 4096
#: DHCP server ports: such datagrams may be the DHCP service's, decided per datagram in Python.
_NOT_ADOPTED_PORTS = (67, 547)
#: The smallest link MTU the plane fragments for (at most 119 fragments of a 65,507-byte datagram).
_MIN_MTU = 576


class NativeUdp:
    """The native UDP flows of one served TAP transport (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        transport: the :class:`~aioslirp.transport.tap.TapTransport` being served, with a native
            plane (``transport.plane``).
        capacity: flows the plane moves at once.
    """

    __slots__ = ("ctx", "counters", "transport", "plane", "loop", "flows")

    ctx: Any
    counters: dict[str, int]
    transport: Any
    plane: Any
    loop: Any
    #: slot -> the adopted flow.
    flows: dict[int, UdpFlow]

    @classmethod
    def start(cls, ctx: Any, transport: Any, served: Any) -> "NativeUdp | None":
        """The native UDP flows of ``transport`` (the raw transport a stack serves; ``served``: what
        it serves after its wrappers), or ``None`` when the native plane does not run UDP flows
        there: ``AIOSLIRP_NATIVE`` without ``udp``, a transport not read natively, a wrapped one
        (pcap; ``served`` is taken before the trace points' wrapper) or rate caps on the stack
        (module documentation)."""
        from .. import native

        if served is not transport and getattr(transport, "plane", None) is not None and native.wanted():
            ident = ctx.identity
            log.info("%snative data plane: a transport wrapper (pcap) sees every frame: TCP and UDP flows "
                     "stay on the Python path", ident.log_prefix, extra=ident.log_extra)
        if (served is not transport or getattr(transport, "plane", None) is None or not native.udp_wanted()
                or ctx.rate_up is not None or ctx.rate_down is not None):
            return None
        return cls(ctx, transport)

    def __init__(self, ctx: Any, transport: Any, capacity: int = CAPACITY) -> None:
        self.ctx = ctx
        self.counters = ctx.counters
        self.transport = transport
        self.plane = transport.plane
        self.loop = ctx.running.loop
        self.flows = {}
        self.plane.udp_enable(capacity)
        self.plane.udp_sink(transport.fd, transport.vnet_hdr, self.counters, self._host_error_at)
        transport.native_taken = self.take

    def adopt(self, flow: Any) -> None:
        """Move ``flow`` (a :class:`~aioslirp.nat.udp.UdpFlow` just admitted, its host socket
        connected) to the native plane, when it qualifies and the table has room."""
        if type(flow) is not UdpFlow or flow.sock is None or flow.native is not None:
            return
        fam = flow.fam
        if fam.v6 or flow.dst_port in _NOT_ADOPTED_PORTS or fam.mtu < _MIN_MTU:
            return
        if fam.neighbors.get(flow.guest_ip) is None:  # frames would go to broadcast: Python's way
            return
        slot = self.plane.udp_adopt(flow.sock.fileno(), flow.guest_ip, flow.guest_port, flow.dst_ip, flow.dst_port,
                                    fam.eth_to(flow.guest_ip), DEFAULT_TTL, fam.mtu, flow.last_active)
        if slot < 0:
            return
        self.flows[slot] = flow
        flow.go_native(self, slot, self.plane.udp_readable)
        self.counters["native.udp_flows_adopted"] += 1

    def release(self, flow: UdpFlow) -> None:
        """``flow`` ends (its shutdown): take what moved last, and forget its slot."""
        self.take()
        self.plane.udp_release(flow.native_slot)
        self.flows.pop(flow.native_slot, None)

    def detach(self) -> None:
        """The transport goes: every adopted flow back to the Python path."""
        self.take()
        for slot, flow in list(self.flows.items()):
            self.plane.udp_release(slot)
            flow.leave_native()
        self.flows.clear()
        self.transport.native_taken = None

    def take(self) -> None:
        """What the TAP reader moved in C since the last call, into the counters and the flows."""
        frames, nbytes, touched = self.plane.udp_touched()
        if frames:
            counters = self.counters
            counters["frames_in"] += frames
            counters["bytes_in"] += nbytes
            counters["handled.udp"] += frames
        for slot, _datagrams, up_bytes, blocked, err, last_active, down_bytes in touched:
            flow = self.flows.get(slot)
            if flow is None:
                continue
            flow.bytes_up += up_bytes
            flow.bytes_down += down_bytes
            if last_active > flow.last_active:
                flow.last_active = last_active
            if blocked:
                self.counters["drop.udp_send_blocked"] += blocked
            if err:
                self._host_error(flow, err)

    def _host_error_at(self, slot: int, err: int) -> None:
        """The plane's reader of the host socket of ``slot`` saw the error ``err`` (errno)."""
        flow = self.flows.get(slot)
        if flow is not None:
            self._host_error(flow, err)

    def _host_error(self, flow: UdpFlow, err: int) -> None:
        last = self.plane.udp_last_header(flow.native_slot)
        if last:
            flow.last_header = last
        flow.host_error(OSError(err, os.strerror(err) if err != errno.EAGAIN else "EAGAIN"))
