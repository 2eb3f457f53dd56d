"""The guest link: batches of Ethernet frames in, Ethernet demux, ARP and the IPv4 neighbours.

:meth:`Link.on_frames` is the sink a transport delivers guest frames to. It reads the clock
once per batch (``now = loop.time()``, handed down to L3, L4, the services and the flows),
counts ``frames_in`` / ``bytes_in``, dispatches every frame (:meth:`Link.dispatch`: by
EtherType to :class:`~aioslirp.dispatch.ipv4.Ipv4Input`, :meth:`Link.arp`, or
:class:`~aioslirp.dispatch.ipv6.Ipv6Path`), then flushes the flows the batch touched (one ACK
and one socket write per flow) and writes what the batch queued for the guest, all in the same
event-loop iteration. A frame that makes the code raise is counted (``drop.internal_error``)
and logged; the next frame goes on.

ARP (RFC 826): requests for the gateway and DNS addresses are answered (``arp_replies``); the
sender of any ARP packet from our subnet is learned in the ARP cache, as is the source of any
valid IPv4 packet (:mod:`aioslirp.dispatch.ipv4`).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from ..wire.arp import ARP_REPLY, ARP_REQUEST, build_arp, parse_arp
from ..wire.ethernet import ETH, ETHERTYPE_ARP, ETHERTYPE_IPV4, ETHERTYPE_IPV6

__all__ = ["Link"]

log = logging.getLogger("aioslirp.stack")

_UNTRUSTED = itertools.repeat(False)  # csum_ok of a transport without checksum flags


class Link:
    """The guest link of one stack (see the module documentation).

    Args:
        ctx: the stack's :class:`~aioslirp.flow.base.FlowContext`.
        fam4: the :class:`~aioslirp.dispatch.family.Family4` (addresses, the ARP cache).
        ipv4: ``ipv4(frame, src_mac, trusted, now)``, the IPv4 input.
        ipv6: ``ipv6(frame, src_mac, trusted, now)``, the IPv6 input, or ``None`` (IPv6 off:
            such frames are dropped, ``drop.ipv6_disabled``).

    Attributes:
        tracer: the stack's :class:`~aioslirp.observe.tracing.Tracer` (``ctx.tracer``), or ``None``:
            told of each guest frame after its dispatch (``process_guest_frame``).
    """

    __slots__ = ("ctx", "counters", "drop", "queue", "flush", "fam4", "neighbors", "ipv4", "ipv6", "tracer")

    ctx: Any
    counters: dict[str, int]
    #: ``ctx.drop``.
    drop: Any
    #: The :class:`~aioslirp.inject.InjectQueue`.
    queue: Any
    #: ``FlowTable.flush``: run once per batch of guest frames.
    flush: Any
    fam4: Any
    #: The ARP cache (``fam4.neighbors``).
    neighbors: Any
    ipv4: Any
    ipv6: Any
    #: The stack's tracer (``None``: not traced).
    tracer: Any

    def __init__(self, ctx, fam4, ipv4, ipv6=None) -> None:
        self.ctx = ctx
        self.counters = ctx.counters
        self.drop = ctx.drop
        self.queue = ctx.queue
        self.flush = ctx.table.flush
        self.fam4 = fam4
        self.neighbors = fam4.neighbors
        self.ipv4 = ipv4
        self.ipv6 = ipv6
        self.tracer = ctx.tracer

    def on_frames(self, frames, csum_ok=None) -> None:
        """A batch of guest frames from the transport. ``csum_ok`` (offload TAP only): per frame,
        True when the guest's kernel flagged its L4 checksum partial or valid (``NEEDS_CSUM`` /
        ``DATA_VALID``): such frames are trusted, as passt does, instead of verified."""
        now = self.ctx.loop.time()
        q = self.queue
        q.hold = True  # the frames the batch queues leave below, at once (see aioslirp.inject)
        try:
            counters = self.counters
            counters["frames_in"] += len(frames)
            counters["bytes_in"] += sum(map(len, frames))
            dispatch = self.dispatch
            tr = self.tracer
            if tr is not None:
                tr.record_batch_start()
            for f, ok in zip(frames, _UNTRUSTED if csum_ok is None else csum_ok):
                try:
                    dispatch(f, ok, now)
                except Exception:
                    self.drop("internal_error")
                    log.exception("internal error processing a guest frame")
                if tr is not None:
                    tr.record_guest_frame(f)
            self.flush()
        finally:
            q.hold = False
        q.write_now()

    def process(self, frame, trusted: bool = False, now: float | None = None) -> None:
        """Count and dispatch one guest Ethernet frame (bytes-like). Never raises: bad input is
        dropped and counted. ``now``: loop time (default: read now)."""
        counters = self.counters
        counters["frames_in"] += 1
        counters["bytes_in"] += len(frame)
        if now is None:
            loop = self.ctx.loop
            now = loop.time() if loop is not None else time.monotonic()
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

    def dispatch(self, frame, trusted: bool, now: float) -> None:
        """Demultiplex one guest frame by EtherType (no counting of ``frames_in``)."""
        if len(frame) < 14:
            return self.drop("truncated_eth")
        _dst_mac, src_mac, ethertype = ETH.unpack_from(frame, 0)
        if src_mac[0] & 1:
            return self.drop("bad_src_mac")
        if ethertype == ETHERTYPE_IPV4:
            self.ipv4(frame, src_mac, trusted, now)
        elif ethertype == ETHERTYPE_ARP:
            self.arp(frame, src_mac)
        elif ethertype == ETHERTYPE_IPV6:
            if self.ipv6 is not None:
                self.ipv6(frame, src_mac, trusted, now)
            else:
                self.drop("ipv6_disabled")
        else:
            self.drop("unknown_ethertype")

    def arp(self, frame, src_mac: bytes) -> None:
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
