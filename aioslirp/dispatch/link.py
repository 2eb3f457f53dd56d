"""The guest link: batches of Ethernet frames in, Ethernet demux, ARP and the IPv4 neighbours.

:meth:`Link.on_frames` is the sink a transport delivers guest frames to. It reads the clock
once per batch (``now = ctx.running.time()``, the loop's, handed down to L3, L4, the services and
the flows), counts ``frames_in`` / ``bytes_in``, dispatches every frame (:meth:`Link.dispatch`: by
EtherType to :meth:`Ipv4Input.input <aioslirp.dispatch.ipv4.Ipv4Input.input>`, :meth:`Link.arp`,
or :meth:`Ipv6Path.dispatch <aioslirp.dispatch.ipv6.Ipv6Path.dispatch>`), then flushes the flows
the batch touched with that ``now`` (:meth:`FlowTable.flush <aioslirp.flow.table.FlowTable.flush>`:
one ACK and one socket write per flow) and writes what the batch queued for the guest, all in the
same event-loop iteration. Each collaborator is an attribute of its own class, so that an editor or
a static walk follows the frame from here to the host socket's ``send``. A frame that makes the code raise is counted (``drop.internal_error``)
and logged; the next frame goes on.

ARP (RFC 826): requests for the gateway and DNS addresses are answered (``arp_replies``); the
sender of any ARP packet from our subnet is learned in the ARP cache, as is the source of any
valid IPv4 packet (:mod:`aioslirp.dispatch.ipv4`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..flow.base import TracePoints
from ..flow.context import FlowContext
from ..flow.table import FlowTable
from ..inject import InjectQueue
from ..wire.arp import ARP_REPLY, ARP_REQUEST, build_arp, parse_arp
from ..wire.ethernet import ETH, ETHERTYPE_ARP, ETHERTYPE_IPV4, ETHERTYPE_IPV6
from ..wire.neighbors import NeighborCache
from ..wire.tcp import SYN, Segment
from .family import Family4
from .ipv4 import Ipv4Input

if TYPE_CHECKING:  # imported only with IPv6 on (Stack): NDP, DHCPv6
    from .ipv6 import Ipv6Path

__all__ = ["Link"]

log = logging.getLogger("aioslirp.stack")

_UNTRUSTED = itertools.repeat(False)  # csum_ok of a transport without checksum flags

#: Guest frames of one batch between two safe points of the guest's upload share
#: (:meth:`~aioslirp.fair.Share.safe_point`: while the link is contended and this guest is
#: backlogged, the sparse guests' input runs there first; nothing else).
SAFE_POINT_FRAMES = 8


class Link:
    """The guest link of one stack (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext`.
        fam4: the :class:`~aioslirp.dispatch.family.Family4` (addresses, the ARP cache).
        ipv4: the IPv4 input (:meth:`Ipv4Input.input <aioslirp.dispatch.ipv4.Ipv4Input.input>`).
        ipv6: the IPv6 input (:meth:`Ipv6Path.dispatch <aioslirp.dispatch.ipv6.Ipv6Path.dispatch>`),
            or ``None`` (IPv6 off: such frames are dropped, ``drop.ipv6_disabled``).

        tracer: the stack's :class:`~aioslirp.observe.tracing.Tracer` at trace level ``"frames"``
            (``None``, the default: no per-frame trace point), kept as :attr:`tracer`: told of each
            guest frame after its dispatch (``process_guest_frame``).
    """

    __slots__ = ("ctx", "counters", "drop", "queue", "table", "fam4", "neighbors", "ipv4", "ipv6", "tracer")

    ctx: FlowContext
    counters: dict[str, int]
    #: ``ctx.drop``.
    drop: Callable[[str], None]
    #: The :class:`~aioslirp.inject.InjectQueue` (held during a batch, written at its end).
    queue: InjectQueue
    #: The flow table: :meth:`FlowTable.flush <aioslirp.flow.table.FlowTable.flush>` runs once per batch.
    table: FlowTable
    fam4: Family4
    #: The ARP cache (``fam4.neighbors``).
    neighbors: NeighborCache
    ipv4: Ipv4Input
    ipv6: Ipv6Path | None
    #: The stack's tracer at trace level ``"frames"`` (``None``: no per-frame trace point).
    tracer: TracePoints | None

    def __init__(self, ctx: FlowContext, fam4: Family4, ipv4: Ipv4Input, ipv6: Ipv6Path | None = None, *,
                 tracer: TracePoints | None = None) -> None:
        self.ctx = ctx
        self.counters = ctx.counters
        self.drop = ctx.drop
        self.queue = ctx.queue
        self.table = ctx.table
        self.fam4 = fam4
        self.neighbors = fam4.neighbors
        self.ipv4 = ipv4
        self.ipv6 = ipv6
        self.tracer = tracer

    def on_frames(self, frames: Sequence[bytes | memoryview], csum_ok: Iterable[bool] | None = None) -> None:
        """A batch of guest frames from the transport (its sink, a :class:`~aioslirp.transport.base.FrameSink`).
        ``csum_ok`` (offload TAP only): per frame, True when the guest's kernel flagged its L4
        checksum partial or valid (``NEEDS_CSUM`` / ``DATA_VALID``): such frames are trusted, as
        passt does, instead of verified. Reads the clock once (``ctx.running.time()``: loop time)
        and hands that ``now`` to every frame's dispatch and to the flush of the flows the batch
        touched. Every :data:`SAFE_POINT_FRAMES` frames it offers the guest's upload share a safe
        point (``share_up.safe_point()``: other guests' light input first while this one is
        backlogged)."""
        running = self.ctx.running
        now = running.time()
        share = running.share_up
        q = self.queue
        q.hold = True  # the frames the batch queues leave below, at once (see aioslirp.inject)
        try:
            counters = self.counters
            counters["frames_in"] += len(frames)
            counters["bytes_in"] += sum(map(len, frames))
            dispatch = self.dispatch  # a local alias inside the batch loop, the one place it pays
            tr = self.tracer
            if tr is not None:
                tr.record_batch_start()
            n = 0
            for f, ok in zip(frames, _UNTRUSTED if csum_ok is None else csum_ok):
                try:
                    dispatch(f, ok, now)
                except Exception:
                    self.drop("internal_error")
                    log.exception("internal error processing a guest frame")
                if tr is not None:
                    tr.record_guest_frame(f)
                n += 1
                if share is not None and not n % SAFE_POINT_FRAMES:
                    # a backlogged guest's long batch (an upload: 64 segments of up to 64 KB):
                    # the light guests' input first, every few frames (aioslirp.fair)
                    share.safe_point()
            self.table.flush(now)
        finally:
            q.hold = False
        q.write_now()

    def syn(self, frame: bytes, v6: bool, l4_off: int, end: int, sport: int, dport: int, seq: int, wnd: int,
            mss: int, wscale: int, sack: bool, now: float) -> bool:
        """The SYN lane (the native TAP reader's ``Plane.syn_lane``): one guest SYN of no native flow
        that the C classifier found plain (``dp_syn_lane`` in aioslirp/native/dataplane.h: SYN
        alone, no payload, non-zero ports, its Ethernet, IP and TCP headers checked as
        :meth:`dispatch` and the L3/L4 below check them, its checksum too unless trusted), with
        what it read: ``v6`` (IPv6, else IPv4), the TCP header's offset ``l4_off`` and the IP
        packet's ``end`` in ``frame``, the ports, ``seq``, the window field ``wnd``, the options
        (``mss``, ``wscale``: -1 absent; ``sack``). It runs what :meth:`on_frames` runs for that
        frame but the parse: counted (``frames_in``, ``bytes_in``, ``native_tcp.syn_lane``), the guest's source checked,
        then the admission (:meth:`L4.tcp_syn <aioslirp.dispatch.l4.L4.tcp_syn>`), what it queued
        written at once, its ``process_guest_frame`` span recorded at trace level ``frames``. ``now``: the
        batch's loop time. True: done (admitted, refused or dropped,
        all counted); False: nothing done (a flow of the Python path holds the 5-tuple, or IPv6 is
        off): the frame goes to :meth:`on_frames` with its batch. Never raises."""
        inp = self.ipv6 if v6 else self.ipv4
        if inp is None:
            return False
        seg = Segment(seq, 0, SYN, wnd, b"", None if mss < 0 else mss, None if wscale < 0 else wscale, sack)
        q = self.queue
        q.hold = True
        tr = self.tracer
        if tr is not None:
            tr.record_batch_start()
        try:
            took = inp.syn(frame, sport, dport, l4_off, end, seg, now)
        except Exception:
            self.drop("internal_error")
            log.exception("internal error processing a guest frame")
            took = True
        finally:
            q.hold = False
        if took:
            if tr is not None:  # its process_guest_frame span, as on_frames records it
                tr.record_guest_frame(frame)
            counters = self.counters
            counters["frames_in"] += 1
            counters["bytes_in"] += len(frame)
            counters["native_tcp.syn_lane"] += 1
            self.table.flush(now)
            q.write_now()
        return took

    def process(self, frame: bytes | memoryview, trusted: bool = False, now: float | None = None) -> None:
        """Count and dispatch one guest Ethernet frame (bytes-like). Never raises: bad input is
        dropped and counted. ``now``: loop time (default: read now, ``ctx.running.time()``; the
        stack must have started)."""
        counters = self.counters
        counters["frames_in"] += 1
        counters["bytes_in"] += len(frame)
        if now is None:
            now = self.ctx.running.time()
        tr = self.tracer
        if tr is not None:
            tr.record_batch_start()
        try:
            self.dispatch(frame, trusted, now)
        except Exception:
            self.drop("internal_error")
            log.exception("internal error processing a guest frame")
        if tr is not None:
            tr.record_guest_frame(frame)

    def dispatch(self, frame: bytes | memoryview, trusted: bool, now: float) -> None:
        """Demultiplex one guest frame by EtherType (no counting of ``frames_in``)."""
        if len(frame) < 14:
            return self.drop("truncated_eth")
        _dst_mac, src_mac, ethertype = ETH.unpack_from(frame, 0)
        if src_mac[0] & 1:
            return self.drop("bad_src_mac")
        if ethertype == ETHERTYPE_IPV4:
            self.ipv4.input(frame, src_mac, trusted, now)
        elif ethertype == ETHERTYPE_ARP:
            self.arp(frame, src_mac)
        elif ethertype == ETHERTYPE_IPV6:
            v6 = self.ipv6
            if v6 is not None:
                v6.dispatch(frame, src_mac, trusted, now)
            else:
                self.drop("ipv6_disabled")
        else:
            self.drop("unknown_ethertype")

    def arp(self, frame: bytes | memoryview, src_mac: bytes) -> None:
        """One guest ARP packet: learn its sender, answer requests for our addresses."""
        arp = parse_arp(frame)
        if arp is None:
            return self.drop("bad_arp")
        oper, sha, spa, _tha, tpa = arp
        fam = self.fam4
        if fam.in_subnet(spa) and spa not in fam.ours and self.neighbors.get(spa) != sha:
            if self.neighbors.learn(spa, sha):
                self.counters["arp.neighbors_evicted"] += 1
        self.ctx.handled("arp")
        if oper != ARP_REQUEST:
            return
        if tpa == spa:  # gratuitous ARP / DAD probe announcements
            return
        if tpa in fam.ours:
            self.counters["arp_replies"] += 1
            self.ctx.inject(build_arp(ARP_REPLY, fam.gw_mac, tpa, sha, spa))
