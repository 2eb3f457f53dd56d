"""Guest TCP flows on the native data plane (issue 26): the Python side of the C engine.

Theory of operation
-------------------
When a stack serves a :class:`~aioslirp.transport.tap.TapTransport` whose reader is native, or a
:class:`~aioslirp.transport.vhost_user.VhostUserTransport` (whose rings are walked in C), with
the native plane on (the default; ``AIOSLIRP_NATIVE`` unset, ``1`` or holding ``tcp``), :meth:`NativeTcp.start` makes the C engine
(``aioslirp.native._dataplane.TcpEngine``, ``aioslirp/native/tcpnat.c``) for it and hands it to the
TAP reader (``TapTransport.attach_tcp``) or the ring walker (``VhostUserTransport.attach_tcp``: the
engine writes its frames into the RX ring through ``tcp_sink()``, no Python object per frame; the
two extensions meet in ``aioslirp/native/tcpsink.h``). Python stays the control plane:

* **One upcall per new flow.** :class:`~aioslirp.dispatch.l4.L4` admits a guest SYN as always
  (egress policy and hook, the guard's bounds, flow table room, handler routing); a plain NAT
  flow (no Python handler, not the DNS-over-TCP service) is then adopted by the engine
  (:meth:`NativeTcp.adopt`) instead of becoming a :class:`~aioslirp.nat.tcp.TcpFlow`: a
  :class:`NativeTcpFlow` stands for it in the flow table (limits, ``stack.flows()``, counters,
  the audit log), the engine opens the host socket, answers the SYN and from then on takes
  every guest frame of the 5-tuple in C, before Python sees it.
* **One record per ended flow.** The engine's epoll (host sockets and one timerfd) is one reader
  of the event loop; its callback (:meth:`NativeTcp.poll`) runs the socket events and timers in
  C and returns what ended: the placeholder leaves the table with the engine's outcome and byte
  counts, counted as the Python path counts them (``tcp_connect_refused``,
  ``tcp_connect_unreachable`` with its ICMP error to the guest, ``tcp_resets``,
  ``tcp_host_lost``, ``tcp_idle_closed``).

* **Trace points stay on the native plane.** Tracing keeps flows native: at ``trace_level``
  ``flows`` the flow table gives native flows their span as it does Python's; from ``timeline``
  the engine's trace points are switched on (``TcpEngine.trace``: fixed-size records in a ring
  of :data:`TRACE_RING` records in C, a full ring counted as ``native_tcp.trace_overflow``, never
  grown) and :meth:`NativeTcp.poll` drains the ring, on the same wake-up that takes the records,
  into the Python path's spans (``Tracer.record_native_ring``: with the direct JSON-lines sink
  formatted in C, ``TcpEngine.trace_json``): ``tcp.syn_ack`` (with ``host.connect`` and ``syn_ack.queued``
  on the flow span) from ``timeline``; ``process_guest_frame``, ``drain_to_guest`` and
  ``writer_wake`` (``aioslirp.plane`` ``native``) at ``frames``. From ``timeline`` the engine
  also writes the moments of each flow's TCP timeline (``TN_TR_EVENT``: the guest's ACK of the
  SYN-ACK, guest and host data, each FIN, a reset, the end; the data ones for the first
  :data:`~aioslirp.observe.tracing.MAX_DATA_EVENTS` of each direction only, counted in C), drained
  into the flow span's events of the Python path's names (``established``, ``guest.data``,
  ``host.data``, ``fin.guest``, ``fin.host``, ``reset``, ``closed``, ``connect.refused``,
  ``connect.unreachable``) with the engine's timestamps, before the flow's end closes its span.
  At ``frames`` also the ``*.sent`` events of the frames it wrote (``aioslirp.wait_us`` 0: the
  engine writes each frame at once, no inject queue), and a wake-up that wrote one flow's frames
  only is a child of its span, as a drain is.

* **Rate caps hold in C.** A stack with ``rate_up`` / ``rate_down`` (``--rate-limit``) keeps its
  TCP flows native: the engine has one byte bucket per direction (the rule of
  :class:`~aioslirp.ratelimit.ByteBucket`: the rate, a burst of max(64 KiB, 10 ms of it), full at
  the start; integer nanobytes and nanoseconds in C), shared by the flows it runs. Paced without
  loss: towards the guest the host socket is read only while the bucket is above zero (at most
  what it holds, one segment over at most); towards the host our window is at most what the
  bucket holds, so the guest's bytes wait in the guest. A held flow is woken by the engine's
  timer heap once 16 KiB have refilled. The holds are counted in the Python path's counters,
  ``tcp_rate_held_up`` and ``tcp_rate_paused_down`` (:meth:`NativeTcp.poll`). The engine's
  buckets are its own: UDP and ICMP (Python path) and the TCP flows the Python path runs
  (handlers, forwards) spend the stack's buckets, so each of the two planes holds the cap.
  Rates are whole bytes/s (rounded); one below 1 or above :data:`RATE_MAX` keeps TCP on the
  Python path.

* **Fair shares hold in C too.** A stack enrolled in the loop's fair scheduler (:mod:`aioslirp.fair`,
  ``NetworkConfig.fair_weight``) has its guest's shares ``ctx.running.share_up`` / ``share_down``;
  the bytes its engine moves each way (``TcpEngine.moved()``, the engine's totals) are charged to
  them after each turn: each :meth:`NativeTcp.poll` and each batch of guest frames the TAP
  reader or the vhost-user ring walker handed to the engine (the engine is *metered*: its
  ``pending()`` says so after a batch that moved bytes, and :meth:`NativeTcp.take` charges). A
  charge over the guest's share while another guest is busy holds that direction of the whole
  engine (``TcpEngine.allow(down=0)``: no host socket is read; ``up=0``: our window to the guest
  opens no further, what it may still send under the edge already advertised is taken and
  charged) and waits for the guest's turn (``tcp_fair_wait_down`` / ``tcp_fair_wait_up``, as the
  Python path counts them). On its turn the engine gets the guest's credit as an allowance (it
  holds itself once that is spent, so that a turn is about one quantum, not every flow's window)
  and is polled at once: the held flows resume without waiting for an event. The allowance is
  lifted once :data:`ALONE_TURNS` charges in a row found no other guest busy. Up, while an
  allowance is set, the engine charges our window when it opens rather than the bytes when they
  come (``TcpEngine.moved()``'s first total), so that the guest's flows together get no more than
  it. The engine's epoll fd (and the TAP fd of the
  native reader) is watched by the stack's seat in the express lane, so a light guest's native
  flows are served early as its Python flows are. Without contention all this is one
  subtraction per turn.

Not on the native plane in this version (the Python path takes them, unchanged): a transport
wrapped for pcap, flows to Python handlers and to the DNS service, port forwards (host ->
guest), and every transport other than the TAP and vhost-user. The engine's own counters are in
``Stack.stats()`` under ``native_tcp``.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from typing import ClassVar

from .. import native
from ..fair import Share
from ..flow.context import FlowContext
from ..wire.icmp import KIND_HOST, KIND_NET
from ..wire.ip import PROTO_TCP
from ..wire.tcp import ACK, SYN, Segment, build_tcp

__all__ = ["NativeTcp", "NativeTcpFlow"]

log = logging.getLogger("aioslirp.tcp")

_REC_CONNECTED, _REC_ENDED = 1, 2
#: ``enum tn_outcome`` of tcpnat.h -> the flow's outcome (``None``: shutdown by Python, kept as set).
_OUTCOMES = (None, "closed", "reset", "refused", "unreachable", "timeout", None)
#: ``enum tn_why`` of tcpnat.h -> the counter of the Python path.
_WHY_COUNTERS = (None, "tcp_resets", "tcp_host_lost", "tcp_idle_closed", None, None, None)
#: Trace records the engine's ring holds between two drains (40 bytes each, allocated once when
#: tracing is on); beyond it new records are dropped and counted (``native_tcp.trace_overflow``).
TRACE_RING = 8192

#: The largest rate cap the engine takes, bytes/s (``TN_RATE_MAX`` of tcpnat.h, about 550 Gbit/s).
RATE_MAX = 1 << 36
#: The engine's counters of rate-cap holds -> the Python path's counter names.
_RATE_COUNTERS = (("rate_held_up", "tcp_rate_held_up"), ("rate_paused_down", "tcp_rate_paused_down"))

#: The least allowance the engine gets on a guest's turn or while a turn goes on (bytes): the
#: guest's credit when larger; a smaller one would open windows too small to be used (the guest's
#: silly-window avoidance) or read less than a segment. What a turn moves beyond its credit is the
#: guest's debt (:mod:`aioslirp.fair`).
TURN_MIN = 16 * 1024

#: Charges in a row that find no other guest busy (``FairLink.alone``) before a guest that waited
#: for its turns moves without a bound again. Until then it moves :data:`TURN_MIN` at a time, and
#: once its credit is spent it waits one pass of the scheduler (which credits it: no other guest
#: waits), so that a neighbour idle for a moment (its socket empty between two reads, its guest
#: not scheduled by the kernel) is served first when it comes back, instead of finding the
#: flooding guest in an unbounded turn (every flow's window at once, up to MiBs) that the
#: scheduler forgave as uncontended. A guest left alone is unbounded again after these charges.
ALONE_TURNS = 16

#: Seconds in TIME-WAIT after the guest's last segment: ``TcpConnection``'s ``time_wait``, which
#: the Python path leaves at its default.
TIME_WAIT = 1.0


def _engine_rate(bucket) -> int | None:
    """The engine's rate for the stack's bucket (``ctx.rate_up`` / ``rate_down``): whole bytes/s,
    0 for no cap (``None``), ``None`` when the engine cannot take it (below 1 or above :data:`RATE_MAX`)."""
    if bucket is None:
        return 0
    rate = round(bucket.rate)
    return rate if 1 <= rate <= RATE_MAX else None


class _Ended:
    """``flow.done`` of a :class:`NativeTcpFlow`: ``done()`` says whether the engine ended it (what
    the guard asks of a pending connect, as of a ``TcpFlow``'s future)."""

    __slots__ = ("flow",)

    def __init__(self, flow: "NativeTcpFlow") -> None:
        self.flow = flow

    def done(self) -> bool:
        return self.flow.ended


class _ConnView:
    """What the flow spans read of a TCP flow's connection at its end (the tracer's
    ``record_flow_closed`` at trace level ``flows``): the bytes taken from the guest as
    ``rcv_nxt - irs - 1``, the state, whether it was reset."""

    __slots__ = ("irs", "rcv_nxt", "fin_received", "state", "reset")

    def __init__(self, flow: "NativeTcpFlow") -> None:
        self.irs = 0
        self.rcv_nxt = (flow.bytes_up + 1) & 0xFFFFFFFF
        self.fin_received = False
        self.state = flow.state
        self.reset = flow.outcome == "reset"


class NativeTcpFlow:
    """The flow table's entry of a TCP flow the native engine runs (a
    :class:`~aioslirp.flow.base.Flow`): its addresses and admission as Python knew them; its
    state, activity and byte counts read from the engine while it lives, its end from the
    engine's record."""

    proto = PROTO_TCP
    proto_name = "tcp"
    direction = "outbound"
    forward_id = None

    __slots__ = ("key", "guest_ip", "guest_port", "dst_ip", "dst_port", "remote", "started", "name", "rule",
                 "_outcome", "_plane", "slot", "gen", "_final", "orig_header", "fam", "transport", "opened_ns")

    def __init__(self, plane: "NativeTcp", fam, key: tuple, remote: str, orig_header: bytes, now: float,
                 slot: int, gen: int, transport: "NativeTcp | None", opened_ns: int | None = None) -> None:
        self.key = key
        _, self.guest_ip, self.guest_port, self.dst_ip, self.dst_port = key
        self.remote = remote
        self.started = now
        self._outcome: str | None = None
        self._plane = plane
        self.slot = slot
        self.gen = gen
        self._final: tuple[int, int] | None = None  # (bytes_up, bytes_down) once ended
        self.orig_header = orig_header
        self.fam = fam
        #: ``None`` while the host connect is pending (the guard counts pending connects by it),
        #: then the :class:`NativeTcp` that moves its bytes.
        self.transport = transport
        #: ``time.time_ns()`` when the engine began adopting it (before it entered the table): its
        #: span starts then, before the engine's first trace record of it (``None``: untraced).
        self.opened_ns = opened_ns
        self.name, self.rule = plane.ctx.guard.admitted(self, remote)  # (the policy's word on it)

    @property
    def done(self) -> _Ended:
        """``done.done()``: the flow ended (:class:`_Ended`; made when asked, as the guard asks
        only of a pending connect)."""
        return _Ended(self)

    def _info(self):
        if self._final is not None or self.slot < 0:
            return None
        return self._plane.engine.info(self.slot, self.gen)

    @property
    def state(self) -> str:
        info = self._info()
        return "CLOSED" if info is None else info[0]

    @property
    def last_active(self) -> float:
        info = self._info()
        return self.started if info is None else info[1]

    @property
    def bytes_up(self) -> int:
        if self._final is not None:
            return self._final[0]
        info = self._info()
        return 0 if info is None else info[2]

    @property
    def bytes_down(self) -> int:
        if self._final is not None:
            return self._final[1]
        info = self._info()
        return 0 if info is None else info[3]

    @property
    def outcome(self) -> str:
        return self._outcome or "closed"

    @outcome.setter
    def outcome(self, value: str) -> None:
        self._outcome = value

    @property
    def ended(self) -> bool:
        """True once the engine ended the flow (:meth:`finish`)."""
        return self._final is not None

    def finish(self, bytes_up: int, bytes_down: int, outcome: str | None) -> None:
        """The engine ended the flow: its final byte counts (guest -> host, host -> guest) and
        its outcome (``None``, or one already set by Python, keeps the one it has)."""
        self._final = (bytes_up, bytes_down)
        if outcome is not None and self._outcome is None:
            self._outcome = outcome

    @property
    def conn(self) -> _ConnView:
        """A view of the connection for the flow spans (:class:`_ConnView`)."""
        return _ConnView(self)

    def flush(self, now: float) -> None:
        """Nothing: the engine sends its own frames."""

    def on_segment(self, seg, now: float) -> bool:
        """A guest segment of this flow that reached Python: a retransmitted SYN read in the same
        batch as the first, before the adoption (dropped: True, counted ``native_tcp.syn_repeated``), or one the native classifier
        leaves to Python (an IPv4 TCP segment sent in fragments, reassembled here; an IPv6 one
        behind extension headers): handed to the engine as the plain segment it is (the same
        addresses, ports, sequence numbers, flags, window and payload, no options: the engine keeps
        none past the SYN; its checksum checked already) and counted ``native_tcp.via_python``.
        Once the flow ended in the engine (its record is on the way) it belongs to no flow (False)."""
        if self.state == "CLOSED":
            return False
        if seg.flags & SYN and not seg.flags & ACK:
            self._plane.ctx.counters["native_tcp.syn_repeated"] += 1
            return True
        e = self.fam.eth_to(self.guest_ip)  # towards the guest: swapped, the guest's frame to us
        frame = build_tcp(e[6:12] + e[:6] + e[12:14], self.guest_ip, self.dst_ip, self.guest_port, self.dst_port,
                          seg.seq, seg.ack, seg.flags, seg.wnd, b"", seg.payload)
        plane = self._plane
        counters = plane.ctx.counters
        if plane.engine.input(bytes(frame), True, now):
            counters["native_tcp.via_python"] += 1
        else:  # not the engine's after all (it ended meanwhile): dropped, counted
            counters["drop.tcp_native_not_taken"] += 1
        return True

    def retire(self) -> None:
        """The 5-tuple is wanted by a new guest connection: take the engine's records (this
        flow's end among them), then leave the table if still in it."""
        self._plane.poll()
        self._plane.ctx.table.remove(self)

    def fail(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """End now (stack exit, reset, eviction): RST to the guest, the host socket aborted."""
        self._plane.close_flow(self)

    def expire(self, now: float) -> bool:
        """The engine runs the idle timeout itself (``tcp_idle_timeout``)."""
        return False


class _Turns:
    """One direction of a :class:`NativeTcp` in the loop's fair scheduler: the guest's
    :class:`~aioslirp.fair.Share` that way, charged with the bytes the engine moved; over it (with
    another guest waiting) the engine is held that way until the guest's turn (the module
    documentation, "Fair shares hold in C too")."""

    __slots__ = ("plane", "share", "up", "counter", "seen", "waiting", "bounded", "alone")

    def __init__(self, plane: "NativeTcp", share: Share, up: bool) -> None:
        self.plane = plane
        self.share = share
        self.up = up
        #: The stack's counter of the waits (the Python path's name).
        self.counter = "tcp_fair_wait_up" if up else "tcp_fair_wait_down"
        #: The engine's total that way when last charged (bytes).
        self.seen = 0
        #: Held, waiting for the guest's turn (one callback registered at a time).
        self.waiting = False
        #: The engine has an allowance that way (the credit of a turn), not "no bound".
        self.bounded = False
        #: Charges in a row that found no other guest busy while bounded (:data:`ALONE_TURNS`).
        self.alone = 0

    def _allow(self, n: int | None) -> int:
        """The engine's allowance that way (bytes, ``None`` no bound); 1: held flows resume at its next poll."""
        engine = self.plane.engine
        return engine.allow(up=n) if self.up else engine.allow(down=n)

    def charge(self, total: int) -> None:
        """The engine's total that way is now ``total`` bytes: charge what moved since the last call."""
        n = total - self.seen
        self.seen = total
        share = self.share
        if not self.bounded or self.waiting:  # no bound (the usual case: one subtraction), or held already
            if share.charge(n) and not self.waiting:  # over its share, another guest busy
                self.alone = 0
                self._wait()
            return
        left = share.available() - n  # a turn goes on: its credit after this charge
        if share.charge(n):
            self.alone = 0
            self._wait()
            return
        if share.link.alone():  # no other guest busy (a neighbour idle for a moment, or gone)
            self.alone += 1
            if self.alone >= ALONE_TURNS:  # gone: no bound
                self.bounded = False
                due = self._allow(None)
                self.plane.meter()
            elif left <= 0:  # its credit is spent (the scheduler credited it): a pass first
                self._wait()
                return
            else:
                due = self._allow(TURN_MIN)
        else:
            self.alone = 0
            due = self._allow(max(TURN_MIN, int(share.available())))
            # A turn goes on beside other busy guests: a safe point, so that a sparse guest's input
            # waits for one batch or poll of this guest, not for the rest of its quantum.
            share.safe_point()
        if due:  # held flows resume: on the next loop iteration (this runs inside a poll or a batch)
            self.plane.poll_soon()

    def _wait(self) -> None:
        """Hold the engine that way and wait for the guest's turn (counted as the Python path counts it)."""
        self.waiting = True
        self.plane.ctx.counters[self.counter] += 1
        self._allow(0)
        self.plane.meter()
        self.share.wait(self.turn)

    def turn(self) -> None:
        """The guest's turn that way (the scheduler's pass): the engine may move the guest's
        credit, and is polled now (its held flows resume)."""
        self.waiting = False
        try:
            self._allow(max(TURN_MIN, int(self.share.available())))
        except ValueError:  # the engine is closed (the stack's serve ended)
            return
        self.bounded = True
        self.plane.meter()
        self.plane.poll()


class NativeTcp:
    """The native TCP engine of one served TAP and the flows it runs (see the module documentation).

    ``ctx``: the stack's :class:`~aioslirp.flow.context.FlowContext`; ``engine``: the
    ``TcpEngine``; its epoll is read by :meth:`poll` from the loop."""

    __slots__ = ("ctx", "engine", "flows", "loop", "_fd", "tracer", "frames_traced", "rated", "_rate_seen", "_up",
                 "_down", "_poll_due")

    #: More keyword arguments of the engine (tests: ``{"peek_off": False}`` takes the fallback for
    #: kernels without ``SO_PEEK_OFF``, a discard buffer).
    engine_options: ClassVar[dict] = {}

    def __init__(self, ctx: FlowContext, engine, frames_traced: bool = False) -> None:
        self.ctx = ctx
        self.engine = engine
        self.flows: dict[tuple[int, int], NativeTcpFlow] = {}
        self.loop = ctx.running.loop
        #: The stack's tracer from trace level ``timeline`` (``ctx.tracer``), else ``None``: the
        #: engine's trace points are on while it is set; ``frames_traced``: level ``frames``.
        self.tracer = ctx.tracer
        self.frames_traced = frames_traced and self.tracer is not None
        #: The stack has rate caps: the engine's holds are added to ``ctx.counters`` on each poll.
        self.rated = ctx.rate_up is not None or ctx.rate_down is not None
        self._rate_seen = {name: 0 for name, _ in _RATE_COUNTERS}
        if self.tracer is not None:
            engine.trace(TRACE_RING)
        #: The guest's shares of the loop's fair scheduler each way (:class:`_Turns`), ``None``: not scheduled.
        running = ctx.running
        self._up = None if running.share_up is None else _Turns(self, running.share_up, True)
        self._down = None if running.share_down is None else _Turns(self, running.share_down, False)
        if self._up is not None or self._down is not None:
            self.meter()  # the TAP reader's batches that moved bytes call take(): charged there
        self._poll_due = False
        self._fd = engine.fileno()
        if self._fd >= 0:
            self.loop.add_reader(self._fd, self.poll)

    @classmethod
    def start(cls, ctx: FlowContext, transport, frames_traced: bool = False, syn=None) -> "NativeTcp | None":
        """The engine for ``transport`` (what the stack serves, after its wrappers other than the
        trace points'), or ``None`` when the native plane does not run TCP flows there: not a TAP
        read natively nor a vhost-user device, a transport wrapped for pcap, or a rate cap the engine
        does not take (below 1 or above :data:`RATE_MAX` bytes/s; module documentation).
        ``frames_traced``: the stack traces at level ``frames`` (the per-frame
        trace points too). ``syn``: the stack's ``Link.syn``, the SYN lane of a transport that has
        one (``syn_lane``: the TAP's native reader), where a plain new connection's SYN goes
        without the dispatch's parse (its frame span too, at level ``frames``)."""
        attach = getattr(transport, "attach_tcp", None)
        if attach is None or not getattr(transport, "native", False) or not native.tcp_wanted():
            return None
        rate_up, rate_down = _engine_rate(ctx.rate_up), _engine_rate(ctx.rate_down)
        if rate_up is None or rate_down is None:
            log.info("%snative data plane: a rate cap outside 1..%d bytes/s: TCP flows stay on the Python path",
                     ctx.identity.log_prefix, RATE_MAX, extra=ctx.identity.log_extra)
            return None
        ext = native.extension()
        if ext is None or not hasattr(ext, "TcpEngine"):
            return None
        cfg = ctx.config
        sink = getattr(transport, "tcp_sink", None)  # a vhost-user device: frames into its RX ring
        options = dict(cls.engine_options)
        if sink is not None:
            options["sink"] = sink()
        engine = ext.TcpEngine(transport.fd, transport.vnet_hdr, transport.offload, cfg.gateway_mac_bytes,
                               int(cfg.mtu), int(cfg.max_flows), int(cfg.tcp_buffer), float(cfg.tcp_idle_timeout),
                               float(cfg.tcp_connect_timeout), float(cfg.tcp_linger), time_wait=TIME_WAIT,
                               rate_up=rate_up, rate_down=rate_down, ack_delay=float(cfg.tcp_ack_delay), **options)
        plane = cls(ctx, engine, frames_traced)
        attach(engine, plane.take)
        lane = getattr(transport, "syn_lane", None)
        if lane is not None and syn is not None:
            lane(syn)
        ident = ctx.identity
        log.info("%snative data plane: guest TCP flows run in C (peek offset: %s)", ident.log_prefix,
                 "SO_PEEK_OFF" if engine.counters().get("peek_off") else "a discard buffer", extra=ident.log_extra)
        return plane

    # -------------------------------------------------------------- flows
    def adopt(self, fam, key: tuple, remote: str, seg: Segment, orig_header: bytes, now: float) -> bool:
        """Run the admitted guest SYN ``seg`` of ``key`` (to host address ``remote``) natively.
        True: the flow is the engine's (or already over: refused, unreachable, no socket; counted);
        False: the engine has no room, the Python path takes it."""
        _, src, sport, dst, dport = key
        v6 = len(src) == 16
        try:
            host = socket.inet_pton(socket.AF_INET6 if v6 else socket.AF_INET, remote)
        except OSError:
            return False  # not a numeric address of the family: the Python path
        mss, wscale = seg.mss, seg.wscale
        opened_ns = time.time_ns() if self.tracer is not None else None
        status, slot, gen = self.engine.adopt(
            v6, fam.mac_of(src), src, sport, dst, dport, host, dport, seg.seq, random.getrandbits(32),
            -1 if mss is None else mss, -1 if wscale is None else wscale, seg.wnd, now)
        if status == -errno.ENOSPC or status == -errno.EEXIST:
            return False
        # connected at once (status 0, the usual case towards loopback): the table entry is never
        # a pending connect for the guard (as if it had been counted and forgotten at once)
        flow = NativeTcpFlow(self, fam, key, remote, orig_header, now, slot, gen, self if status == 0 else None,
                             opened_ns)
        self.flows[(slot, gen)] = flow
        self.ctx.table.add(flow)
        if status < 0:  # its end is queued: counted, the ICMP error, out of the table, after this batch
            self.loop.call_soon(self.take)  # (its SYN's frame span still finds the flow: trace point 1)
        return True

    def close_flow(self, flow: NativeTcpFlow) -> None:
        """End ``flow`` now (:meth:`NativeTcpFlow.shutdown`)."""
        if self.engine.close_flow(flow.slot, flow.gen, self.loop.time()):
            self.poll()
        else:
            self.flows.pop((flow.slot, flow.gen), None)
            self.ctx.table.remove(flow)

    def poll(self) -> None:
        """Run the engine's socket events and timers; take its records (the loop's reader)."""
        try:
            records = self.engine.poll()
        except ValueError:  # closed
            return
        if records is None:  # called from a yield point inside this engine's own turn: later
            return
        if self.rated:
            self._rate_counters()
        self._records(records)
        self._charge()

    def poll_soon(self) -> None:
        """:meth:`poll` on the next loop iteration (once, however often asked before it runs)."""
        if not self._poll_due:
            self._poll_due = True
            self.loop.call_soon(self._poll_now)

    def _poll_now(self) -> None:
        self._poll_due = False
        self.poll()

    def reader(self) -> tuple[int, Callable[[], None]] | None:
        """The engine's epoll fd and its reader (:meth:`poll`), for the fair scheduler's express
        lane (``Seat.watch``); ``None`` without one (a fake engine) or once closed."""
        return None if self._fd < 0 else (self._fd, self.poll)

    def meter(self) -> None:
        """Say to the engine when its batches are to be charged (``pending()``, the TAP reader's hook):
        while a direction is bounded or held, after any bytes moved; otherwise once :data:`TURN_MIN`
        bytes moved (a guest's request and answer of a few bytes make no upcall; a share lags at
        most that behind, a fraction of a quantum)."""
        bounded = any(t is not None and (t.bounded or t.waiting) for t in (self._up, self._down))
        self.engine.meter(True, 0 if bounded else TURN_MIN)

    def _charge(self) -> None:
        """Charge the bytes the engine moved since the last call to the guest's shares (when it
        has them and :meth:`meter` says it is time: ``engine.pending()``, its records taken); over a
        share, that direction is held until the guest's turn (:class:`_Turns`)."""
        up, down = self._up, self._down
        if (up is None and down is None) or not self.engine.pending():
            return
        moved_up, moved_down = self.engine.moved()
        if down is not None and moved_down != down.seen:
            down.charge(moved_down)
        if up is not None and moved_up != up.seen:
            up.charge(moved_up)

    def _rate_counters(self) -> None:
        """Add the engine's rate-cap holds since the last call to the stack's counters
        (``tcp_rate_held_up``, ``tcp_rate_paused_down``, as the Python path counts them)."""
        c = self.counters()
        seen = self._rate_seen
        counters = self.ctx.counters
        for name, counter in _RATE_COUNTERS:
            value = c.get(name, 0)
            if value > seen[name]:
                counters[counter] += value - seen[name]
                seen[name] = value

    def take(self) -> None:
        """Take the engine's records and charge the bytes it moved, nothing else (the TAP reader's hook
        after a batch that ended flows or moved bytes: the socket events are this object's reader's,
        not a second ``epoll_wait``)."""
        try:
            records = self.engine.records()
        except ValueError:  # closed
            return
        if records is None:  # from a yield point inside this engine's own turn: later
            return
        self._records(records)
        self._charge()

    def _records(self, records: list) -> None:
        if self.tracer is not None:  # before the ends below: their flows are still known
            self._drain_trace()
        for slot, gen, kind, outcome, why, err, up, down in records:
            flow = self.flows.get((slot, gen))
            if flow is None:
                continue
            if kind == _REC_CONNECTED:
                flow.transport = self
                self.ctx.guard.connected(flow)
                continue
            del self.flows[(slot, gen)]
            self._ended(flow, outcome, why, err, up, down)

    def _drain_trace(self) -> None:
        """The engine's trace records (``struct tn_trace_rec`` of tcpnat.h) as the tracer's spans
        (``Tracer.record_native_ring``: formatted in C for the direct JSON-lines sink, else
        through the hooks of each record's kind)."""
        tr = self.tracer
        if tr is not None and self.engine.trace_pending():
            tr.record_native_ring(self.engine, self.flows, self.frames_traced)

    def _ended(self, flow: NativeTcpFlow, outcome: int, why: int, err: int, up: int, down: int) -> None:
        name = _OUTCOMES[outcome] if 0 <= outcome < len(_OUTCOMES) else None
        flow.finish(up, down, name)
        ctx = self.ctx
        counters = ctx.counters
        if name == "refused":
            counters["tcp_connect_refused"] += 1
        elif name in ("unreachable", "timeout") and why == 5:  # the connect failed
            counters["tcp_connect_unreachable"] += 1
            log.debug("connect %s:%d failed: %s", flow.remote, flow.dst_port, os.strerror(err))
            flow.fam.icmp_error(KIND_NET if err == errno.ENETUNREACH else KIND_HOST, flow.orig_header)
        counter = _WHY_COUNTERS[why] if 0 <= why < len(_WHY_COUNTERS) else None
        if counter is not None:
            counters[counter] += 1
        ctx.table.remove(flow)

    def counters(self) -> dict:
        """The engine's counters (``Stack.stats()['native_tcp']``)."""
        try:
            return self.engine.counters()
        except ValueError:
            return {}

    def close(self) -> None:
        """End every native flow (RST to the guest where it can still be written) and the engine;
        its counters are added to the stack's as ``native_tcp.<name>``."""
        if self._fd >= 0:
            self.loop.remove_reader(self._fd)
            self._fd = -1
        now = self.loop.time()
        for flow in list(self.flows.values()):
            self.engine.close_flow(flow.slot, flow.gen, now)
        self.poll()
        if self.rated:
            self._rate_counters()
        counters = self.ctx.counters
        for name, value in self.counters().items():
            if name not in ("live", "peek_off") and value:
                counters["native_tcp." + name] += value
        self.engine.close()
