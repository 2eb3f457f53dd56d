"""The :class:`Tracer`: one stack's trace points as spans (see :mod:`aioslirp.observe.tracing`,
whose documentation describes the spans, the trace levels and the sinks). Its own module so that
the build can compile it with mypyc (``aioslirp.compiled.COMPILED``): the process-wide API and its
read-only compatibility views (a module ``__getattr__``) stay in :mod:`~aioslirp.observe.tracing`,
which mypyc cannot compile.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import random
import time

from ..flow.base import flow_key
from .sink import as_sink, encode_json
from ..wire.tcp import ACK, FIN, PSH, RST, SYN

log = logging.getLogger("aioslirp.tracing")

__all__ = ["Tracer", "MAX_DATA_EVENTS"]

#: Per flow, at most this many ``guest.data``, ``host.data`` and ``data.sent`` events each.
MAX_DATA_EVENTS = 8

_MAX_STAMPS = 1 << 16
_now = time.time_ns
_bits = random.getrandbits
#: ``enum tn_trace_type`` of the native engine's trace records (aioslirp/native/tcpnat.h).
_TR_FRAME, _TR_SYN_ACK, _TR_DRAIN, _TR_WAKE, _TR_EVENT = 1, 2, 3, 4, 5
#: ``enum tn_flow_event`` -> the flow span's event (the Python path's names); from :data:`_FE_SENT`
#: on, the ``*.sent`` events (trace level ``frames`` only, as the Python path's).
_FLOW_EVENTS = (None, "established", "guest.data", "host.data", "fin.guest", "fin.host", "reset", "closed",
                "connect.refused", "connect.unreachable", "syn_ack.sent", "data.sent", "fin.sent", "rst.sent")
_FE_SENT = 10
_PROTO_NAMES = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmp"}
_FLAG_LETTERS = ((FIN, "F"), (SYN, "S"), (RST, "R"), (PSH, "P"), (ACK, "A"))
#: Connection events recorded from ``TcpConnection.next_event`` (``established`` and ``fin``
#: are recorded from the guest segment that caused them, see :meth:`Tracer.record_segment`).
_CONN_EVENTS = {"reset": "reset", "closed": "closed"}
#: A TCP flow's ``outcome`` after a failed host connect -> ``aioslirp.tcp.outcome``.
_FAILED_CONNECT = {"refused": "refused", "unreachable": "unreachable", "timeout": "unreachable"}


def _safe(fn):
    """A tracing hook never breaks the data path: an exception is counted (``tracer.errors``)
    and logged once per hook and tracer."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except Exception:
            self._hook_failed(fn.__name__)
            return None

    return wrapper


class _FlowTrace:
    """Tracing state of one flow: its span, a context for children, counters."""

    __slots__ = ("span", "ctx", "pending", "closing", "n_guest", "n_host", "n_sent", "outcome",
                 "established", "fin_guest")

    def __init__(self, span, ctx) -> None:
        self.span = span
        self.ctx = ctx
        self.pending = 0  # frames of this flow stamped in the inject queue
        self.closing = False  # the flow left the table; end the span once pending == 0
        self.n_guest = self.n_host = self.n_sent = 0
        self.outcome: str | None = None  # a TCP flow's failed connect: "refused" or "unreachable"
        self.established = False  # the "established" event was recorded
        self.fin_guest = False  # the "fin.guest" event was recorded


@functools.lru_cache(maxsize=4096)
def _addr(raw) -> str:
    """An address's text (cached: a guest's flows share their few addresses)."""
    try:
        return str(ipaddress.ip_address(bytes(raw)))
    except ValueError:
        return repr(raw)


def _frame_key(frame, to_guest: bool):
    """(flow key, transport name, TCP flags, payload length) of an IPv4/IPv6 frame, or Nones."""
    n = len(frame)
    if n < 34:
        return None, None, 0, 0
    et = (frame[12] << 8) | frame[13]
    if et == 0x0800:
        ihl = (frame[14] & 0x0F) << 2
        if (frame[20] & 0x3F) | frame[21]:  # a fragment: not attributed
            return None, _PROTO_NAMES.get(frame[23]), 0, 0
        proto = frame[23]
        src, dst = bytes(frame[26:30]), bytes(frame[30:34])
        total = (frame[16] << 8) | frame[17]
        l4 = 14 + ihl
        end = 14 + total
    elif et == 0x86DD and n >= 54:
        proto = frame[20]
        src, dst = bytes(frame[22:38]), bytes(frame[38:54])
        l4 = 54
        end = 54 + ((frame[18] << 8) | frame[19])
    else:
        return None, None, 0, 0
    name = _PROTO_NAMES.get(proto)
    if proto in (6, 17) and n >= l4 + 8:
        sport = (frame[l4] << 8) | frame[l4 + 1]
        dport = (frame[l4 + 2] << 8) | frame[l4 + 3]
        flags = plen = 0
        if proto == 6 and n >= l4 + 14:
            flags = frame[l4 + 13]
            plen = end - l4 - ((frame[l4 + 12] >> 4) << 2)
        else:
            plen = end - l4 - 8
        key = flow_key(proto, dst, dport, src, sport) if to_guest else flow_key(proto, src, sport, dst, dport)
        return key, name, flags, plen
    if proto in (1, 58) and n >= l4 + 8:
        ident = (frame[l4 + 4] << 8) | frame[l4 + 5]
        key = flow_key(proto, dst, ident, src, 0) if to_guest else flow_key(proto, src, ident, dst, 0)
        return key, name, 0, end - l4 - 8
    return None, name, 0, 0


#: The text of each value of a TCP header's flags byte ("S", "SA", "FA", ...).
_FLAGS_TEXT = tuple("".join(c for bit, c in _FLAG_LETTERS if flags & bit) for flags in range(256))


def _flags_text(flags: int) -> str:
    return _FLAGS_TEXT[flags & 0xFF]


class Tracer:
    """The trace points of one stack, recorded as OpenTelemetry spans (see the module documentation).

    Args:
        tracer_provider: the OpenTelemetry ``TracerProvider`` (``None``: the global one; with
            the OpenTelemetry API alone the spans are non-recording).
        flows: the stack's flow table (``get(key) -> flow``), to find a frame's flow.
        queue: the stack's inject queue (``len()``: its depth).
        identity: the stack's :class:`~aioslirp.config.identity.GuestIdentity`: every span this
            tracer starts carries its :attr:`guest` attributes (``aioslirp.guest.name``,
            ``aioslirp.guest.label.<key>``), so one provider can serve many stacks.

    Attributes:
        guest: the attributes every span gets (computed once here; ``{}`` without a name or labels).
        errors: internal errors of the hooks (each hook's first is logged).

    One per stack: the records it keeps (flow spans, frame stamps) belong to that stack.
    Every ``record_*`` hook (named apart from the data path's own ``on_*`` methods) is called after the work it describes, on the event loop's thread.
    """

    def __init__(self, tracer_provider=None, flows=None, queue=None, *, identity=None) -> None:
        self.guest: dict = dict(identity.span_attributes) if identity is not None else {}
        #: Where the spans go (:mod:`aioslirp.observe.sink`): ``tracer_provider`` itself when it is
        #: a span sink (a :class:`~aioslirp.observe.sink.JsonLinesSink`), else an ``SdkSink`` around it.
        self.sink = as_sink(tracer_provider)
        #: With a sink that takes formatted lines (``put_text``: the direct JSON-lines one), the
        #: native flows' spans by ``(slot, gen)``, as ``TcpEngine.trace_json`` takes them:
        #: ``(trace_id, span_id, events, ports, v6)``; ``None``: the ring's records go through the
        #: ``record_native_*`` hooks (the SDK).
        self.native_spans: dict | None = {} if hasattr(self.sink, "put_text") else None
        self._guest_json = "," + encode_json(self.guest)[1:-1] if self.guest else ""
        self.flows = flows if flows is not None else {}
        self.queue = queue if queue is not None else ()
        self.errors = 0
        #: Whatever its maker keeps alive with it (:func:`aioslirp.observe.tracing.default_tracer`'s
        #: entry in its weak set: a compiled class takes no weak reference itself).
        self.keep: object = None
        self.logged: set = set()
        #: Flow -> its record, while its span is open and the flow is in the table.
        self.records: dict = {}
        #: Records whose span has not ended yet (flows that left the table wait for their frames).
        self.open: set = set()
        #: Frames waiting in the inject queue: id(frame) -> (frame, enqueue time ns, record, kind).
        self.stamps: dict = {}
        self._mark = 0  # end of the previous guest frame's processing (or the batch's start), ns
        self._depth = 0  # inject queue depth then

    def _hook_failed(self, name: str) -> None:
        """Hook ``name`` raised (inside its ``except``): counted (``errors``), logged once per hook
        (:func:`_safe`, and the hooks of every connection that guard themselves)."""
        self.errors += 1
        if name not in self.logged:
            self.logged.add(name)
            log.exception("tracing hook %s failed (further failures are only counted)", name)

    def span(self, name: str, attributes: dict | None = None):
        """A context manager recording span ``name`` as the current span (with the :attr:`guest` attributes)."""
        if self.guest:
            attributes = {**attributes, **self.guest} if attributes else self.guest
        return self.sink.current_span(name, attributes)

    # ------------------------------------------------------------------ flows
    def record_flow_opened(self, flow) -> None:
        """``flow`` entered the flow table: start its span (then, or at ``flow.opened_ns``, a
        ``time.time_ns()`` value, when the flow has one: a native TCP flow, adopted by the engine
        just before it entered the table, whose first events the engine stamped then)."""
        # (the guard of :func:`_safe` written out: a hook of every connection, called without
        # packing its arguments)
        try:
            self._record_flow_opened(flow)
        except Exception:
            self._hook_failed("record_flow_opened")

    def _record_flow_opened(self, flow) -> None:
        name = flow.proto_name
        key = flow.key
        guest, dst = key[1], key[3]
        attrs = {
            "network.transport": "icmp" if name == "icmp" else name,
            "network.type": "ipv6" if len(guest) == 16 else "ipv4",
            "client.address": _addr(guest),
            "server.address": _addr(dst),
        }
        if name == "icmp":
            attrs["aioslirp.icmp.ident"] = key[2]
        else:
            attrs["client.port"] = key[2]
            attrs["server.port"] = key[4]
        direction = flow.direction
        if direction:
            attrs["aioslirp.direction"] = direction
        remote = flow.remote
        if remote:
            attrs["network.peer.address"] = remote
        elif name == "tcp" and remote is None:
            attrs["aioslirp.service"] = "dns"
        dns_name = getattr(flow, "name", None)
        if dns_name is not None:
            attrs["aioslirp.egress.name"] = dns_name
        rule = getattr(flow, "rule", None)
        if rule is not None:
            attrs["aioslirp.egress.rule"] = rule
        attrs.update(self.guest)
        sink = self.sink
        sp = sink.start_flow(name + ".flow", attrs, getattr(flow, "opened_ns", None))
        rec = _FlowTrace(sp, sink.context(sp))
        self.records[flow] = rec
        self.open.add(rec)
        native = self.native_spans
        if native is not None and getattr(flow, "slot", None) is not None:  # a flow of the native engine
            native[(flow.slot, flow.gen)] = (sp.trace_id, sp.span_id, sp.events, '"client.port":%d,"server.port":%d'
                                             % (key[2], key[4]), len(guest) == 16)

    def record_flow_closed(self, flow) -> None:
        """``flow`` left the flow table: set the end attributes; the span ends once the flow's
        last queued frame has been written."""
        # (the guard of :func:`_safe` written out: a hook of every connection, called without
        # packing its arguments)
        try:
            self._record_flow_closed(flow)
        except Exception:
            self._hook_failed("record_flow_closed")

    def _record_flow_closed(self, flow) -> None:
        rec = self.records.pop(flow, None)
        if rec is None:
            return
        if self.native_spans:
            self.native_spans.pop((getattr(flow, "slot", None), getattr(flow, "gen", None)), None)
        sp = rec.span
        if flow.proto_name == "tcp":
            conn = flow.conn
            irs = conn.irs
            from_guest = 0 if irs is None else (conn.rcv_nxt - irs - 1 - (1 if conn.fin_received else 0)) & 0xFFFFFFFF
            if from_guest > 0x7FFFFFFF:
                from_guest = 0
            # (below trace level "timeline" no record_connect_failed came: the flow says it)
            outcome = rec.outcome or _FAILED_CONNECT.get(flow.outcome) or ("reset" if conn.reset else "closed")
            sp.set_attributes({"aioslirp.bytes.from_guest": from_guest,
                               "aioslirp.bytes.to_guest": flow.bytes_down,  # sent, at every trace level
                               "aioslirp.tcp.state": conn.state, "aioslirp.tcp.outcome": outcome})
        else:
            up = flow.bytes_up
            if up is not None:
                sp.set_attributes({"aioslirp.bytes.from_guest": up, "aioslirp.bytes.to_guest": flow.bytes_down})
        rec.closing = True
        if rec.pending <= 0:
            self._end(rec)

    def _end(self, rec: _FlowTrace, end_time: int | None = None) -> None:
        if rec in self.open:
            self.open.discard(rec)
            rec.span.end(end_time=end_time)

    @_safe
    def record_flow_event(self, flow, name: str, attributes: dict | None = None) -> None:
        """Add event ``name`` to ``flow``'s span (nothing when the flow has no span)."""
        rec = self.records.get(flow)
        if rec is not None:
            rec.span.add_event(name, attributes)

    @_safe
    def record_connect_failed(self, flow, outcome: str) -> None:
        """The host connect of a TCP flow failed: ``outcome`` is ``refused`` or ``unreachable``."""
        rec = self.records.get(flow)
        if rec is not None:
            self._timeline(rec, "connect." + outcome)

    @_safe
    def record_conn_event(self, flow, name: str) -> None:
        """An event the sans-IO connection reported (``established``, ``fin``, ``reset``, ``closed``)."""
        rec = self.records.get(flow)
        if rec is not None and name in _CONN_EVENTS:
            rec.span.add_event(_CONN_EVENTS[name])

    @_safe
    def record_segment(self, flow, seg) -> None:
        """``flow.conn`` took guest segment ``seg``: record what it changed, ``established``,
        ``guest.data`` (with its payload length), ``fin.guest``."""
        rec = self.records.get(flow)
        if rec is None:
            return
        conn = flow.conn
        if not rec.established and conn.established_at is not None:
            self._timeline(rec, "established", 0)
        nbytes = len(seg.payload)
        if nbytes:
            self._timeline(rec, "guest.data", nbytes)
        if not rec.fin_guest and conn.fin_received:
            self._timeline(rec, "fin.guest", 0)

    @_safe
    def record_host_data(self, flow, nbytes: int) -> None:
        """The host socket delivered ``nbytes`` for the guest."""
        rec = self.records.get(flow)
        if rec is not None:
            self._timeline(rec, "host.data", nbytes)

    @staticmethod
    def _timeline(rec: _FlowTrace, name: str, nbytes: int = 0, at: int | None = None, wait_us: float = 0.0) -> None:
        """Event ``name`` of a flow's timeline on its span (at ``at``, ns; ``None``: now), by the
        rules of both planes: the data events (``guest.data``, ``host.data``) with
        ``aioslirp.bytes`` = ``nbytes``, and ``data.sent``, the first :data:`MAX_DATA_EVENTS` of
        each only; the ``*.sent`` events with ``aioslirp.wait_us`` = ``wait_us`` (µs in the inject
        queue); ``established`` and ``fin.guest`` noted as recorded; ``connect.refused`` /
        ``connect.unreachable`` as the flow's outcome."""
        attrs: dict | None = None
        if name.endswith(".sent"):
            if name == "data.sent":
                if rec.n_sent >= MAX_DATA_EVENTS:
                    return
                rec.n_sent += 1
            attrs = {"aioslirp.wait_us": wait_us}
        elif name == "guest.data":
            if rec.n_guest >= MAX_DATA_EVENTS:
                return
            rec.n_guest += 1
            attrs = {"aioslirp.bytes": nbytes}
        elif name == "host.data":
            if rec.n_host >= MAX_DATA_EVENTS:
                return
            rec.n_host += 1
            attrs = {"aioslirp.bytes": nbytes}
        elif name == "established":
            rec.established = True
        elif name == "fin.guest":
            rec.fin_guest = True
        elif name.startswith("connect."):
            rec.outcome = name[8:]
        rec.span.add_event(name, attrs, timestamp=at)

    @_safe
    def record_syn_ack(self, flow, connect_time: float, immediate: bool, at: int | None = None) -> None:
        """Trace point 2: the SYN-ACK of a new guest connection was queued (``conn.accept``).

        ``connect_time``: seconds the host connect took; ``immediate``: no host connect was needed;
        ``at``: when the SYN-ACK was queued (``time.time_ns()``; ``None``: now).
        """
        t1 = _now() if at is None else at
        t0 = t1 if immediate else t1 - int(connect_time * 1e9)
        rec = self.records.get(flow)
        connect_us = int(connect_time * 1e6)
        if rec is not None and not immediate:
            rec.span.add_event("host.connect", timestamp=t0)
        attrs = {"client.port": flow.guest_port, "server.port": flow.dst_port,
                 "aioslirp.connect.immediate": immediate, "aioslirp.connect_us": connect_us, **self.guest}
        self.sink.emit("tcp.syn_ack", rec.ctx if rec is not None else None, attrs, t0, t1)
        if rec is not None:
            rec.span.add_event("syn_ack.queued", {"aioslirp.connect_us": connect_us}, timestamp=t1)

    # ------------------------------------------------------------------ guest frames
    def record_batch_start(self) -> None:
        """Guest frames are about to be processed: note the time and the inject queue's depth
        (the start of the first frame's ``process_guest_frame``)."""
        self._depth = len(self.queue)
        self._mark = _now()

    def record_guest_frame(self, frame) -> None:
        """Trace point 1: guest ``frame`` was dispatched; record its ``process_guest_frame`` span."""
        try:
            self._frame_span(frame, _now())
        finally:
            self._mark = _now()  # the next frame's processing starts after this hook

    def _frame_span(self, frame, t1: int) -> None:
        """Trace point 1's span for guest ``frame``, processed until ``t1`` (ns)."""
        # (the guard of :func:`_safe` written out: a hook of every connection, called without
        # packing its arguments)
        try:
            self._frame_span_hook(frame, t1)
        except Exception:
            self._hook_failed("_frame_span")

    def _frame_span_hook(self, frame, t1: int) -> None:
        t0 = self._mark
        depth = len(self.queue)
        queued = depth - self._depth
        self._depth = depth
        key, transport, flags, _plen = _frame_key(frame, False)
        flow = self.flows.get(key) if key is not None else None
        rec = self.records.get(flow) if flow is not None else None
        attrs: dict[str, object] = {"aioslirp.frame.bytes": len(frame), "aioslirp.frames_queued": max(queued, 0),
                 "aioslirp.processing_us": (t1 - t0) / 1000.0}
        if len(frame) >= 14:
            et = (frame[12] << 8) | frame[13]
            attrs["aioslirp.ethertype"] = et
            if et == 0x0800:
                attrs["network.type"] = "ipv4"
            elif et == 0x86DD:
                attrs["network.type"] = "ipv6"
        if transport is not None:
            attrs["network.transport"] = transport
        self._end_frame_span(rec, attrs, flags, t0, t1)

    def _end_frame_span(self, rec, attrs: dict, flags: int, t0: int, t1: int) -> None:
        """The ``process_guest_frame`` span of either plane: ``attrs`` plus the TCP flags and the
        guest's identity, from ``t0`` to ``t1`` (ns), a child of the flow record ``rec`` if any."""
        if flags:
            attrs["aioslirp.tcp.flags"] = _flags_text(flags)
        attrs.update(self.guest)
        self.sink.emit("process_guest_frame", rec.ctx if rec is not None else None, attrs, t0, t1)

    # ------------------------------------------------------------------ frames for the guest
    @_safe
    def record_frame_queued(self, frame) -> None:
        """``frame`` entered the inject queue: stamp its enqueue time and its flow."""
        key, _transport, flags, plen = _frame_key(frame, True)
        rec = None
        kind = None
        if key is not None:
            flow = self.flows.get(key)
            if flow is not None:
                rec = self.records.get(flow)
        if rec is not None:
            if flags & RST:
                kind = "rst.sent"
            elif flags & SYN:
                kind = "syn_ack.sent" if flags & ACK else "syn.sent"
            elif flags & FIN:
                kind = "fin.sent"
            elif plen > 0:
                kind = "data.sent"
            rec.pending += 1
        stamps = self.stamps
        if len(stamps) >= _MAX_STAMPS:
            self._discard_stamps()
        old = stamps.get(id(frame))
        if old is not None and old[2] is not None:
            self._unpend(old[2])
        stamps[id(frame)] = (frame, _now(), rec, kind)

    def _unpend(self, rec: _FlowTrace) -> None:
        rec.pending -= 1
        if rec.closing and rec.pending <= 0:
            self._end(rec)

    def _discard_stamps(self) -> None:
        """Forget every stamp (frames dropped without a write leave stale ones behind)."""
        for _frame, _t, rec, _kind in list(self.stamps.values()):
            if rec is not None:
                self._unpend(rec)
        self.stamps.clear()

    @_safe
    def record_discard(self, frames) -> None:
        """``frames`` were dropped without a write: forget their stamps."""
        pop = self.stamps.pop
        for f in frames:
            st = pop(id(f), None)
            if st is not None and st[2] is not None:
                self._unpend(st[2])

    @_safe
    def record_drain(self, batch, t0: int) -> None:
        """Trace points 3 and 4: ``batch`` was handed to the transport (the write started at
        ``t0``, ns); record ``drain_to_guest`` and ``writer_wake`` and stamp ``*.sent`` events
        on the flows' spans."""
        t1 = _now()
        depth = len(batch) + len(self.queue)  # the batch left the queue before the write
        first = None
        n_stamped = 0
        wmax = wmin = 0
        recs: list = []  # distinct flows of this batch, in order
        done: list = []  # one entry per stamped frame of a flow
        pop = self.stamps.pop
        for f in batch:
            st = pop(id(f), None)
            if st is None:
                continue
            _frame, tq, rec, kind = st
            wait = t1 - tq
            if first is None or tq < first:
                first = tq
            if n_stamped == 0 or wait > wmax:
                wmax = wait
            if n_stamped == 0 or wait < wmin:
                wmin = wait
            n_stamped += 1
            if rec is not None:
                done.append(rec)
                if rec not in recs:
                    recs.append(rec)
                if kind is not None:
                    self._timeline(rec, kind, 0, t1, wait / 1000.0)
        try:
            self._batch_spans(batch, depth, t0, t1, first, n_stamped, wmax, wmin, recs)
        finally:
            for rec in done:
                self._unpend(rec)

    def _batch_spans(self, batch, depth, t0, t1, first, n_stamped, wmax, wmin, recs) -> None:
        ctx = recs[0].ctx if len(recs) == 1 else None
        links = [r.span for r in recs] if recs else None
        sink = self.sink
        sink.emit("drain_to_guest", ctx, {"aioslirp.frames": len(batch), "aioslirp.queue_depth": depth,
                                          "aioslirp.drain_us": (t1 - t0) / 1000.0, **self.guest}, t0, t1, links)
        if first is not None:
            sink.emit("writer_wake", ctx, {"aioslirp.frames": n_stamped, "aioslirp.wait_us.max": wmax / 1000.0,
                                           "aioslirp.wait_us.min": wmin / 1000.0, **self.guest}, first, t1, links)

    # ------------------------------------------------------------------ the native plane
    # Trace points 1, 3 and 4 of the native data plane and its flows' timeline events
    # (aioslirp.nat.native_tcp drains the C engine's trace ring into these; point 2 is
    # record_syn_ack with ``at``). Times are
    # ``time.time_ns()`` values; ``flow`` is the flow table's entry, or None once it left.

    @_safe
    def record_native_frame(self, flow, t0: int, t1: int, nbytes: int, queued: int, flags: int) -> None:
        """Trace point 1 on the native plane: a guest frame of ``flow`` (``nbytes`` long, TCP
        ``flags``) processed from ``t0`` to ``t1`` in C, putting ``queued`` frames out to the guest."""
        rec = self.records.get(flow) if flow is not None else None
        attrs = {"aioslirp.frame.bytes": nbytes, "aioslirp.frames_queued": queued,
                 "aioslirp.processing_us": (t1 - t0) / 1000.0, "network.transport": "tcp",
                 "aioslirp.plane": "native"}
        if flow is not None:
            v6 = len(flow.key[1]) == 16
            attrs["aioslirp.ethertype"] = 0x86DD if v6 else 0x0800
            attrs["network.type"] = "ipv6" if v6 else "ipv4"
        self._end_frame_span(rec, attrs, flags, t0, t1)

    @_safe
    def record_native_event(self, flow, name: str, nbytes: int, at: int) -> None:
        """A moment of the TCP timeline of ``flow`` in C at ``at`` (ns): event ``name`` on its span,
        as the Python path's (``established``, ``guest.data`` / ``host.data`` with ``nbytes`` in
        ``aioslirp.bytes``, the first :data:`MAX_DATA_EVENTS` of each, ``fin.guest``,
        ``fin.host``, ``reset``, ``closed``, ``connect.refused`` / ``connect.unreachable``; the
        ``*.sent`` events of frames written at once: ``aioslirp.wait_us`` 0)."""
        rec = self.records.get(flow) if flow is not None else None
        if rec is not None:
            self._timeline(rec, name, nbytes, at)

    @_safe
    def record_native_drain(self, flows, t0: int, t1: int, frames: int) -> None:
        """Trace point 3 on the native plane: ``frames`` written to the guest by C from ``t0`` to
        ``t1``, of ``flows`` (the one flow whose frames they all were, else empty: many)."""
        recs = [r for r in (self.records.get(f) for f in flows) if r is not None]
        ctx = recs[0].ctx if len(recs) == 1 else None
        self.sink.emit("drain_to_guest", ctx, {"aioslirp.frames": frames, "aioslirp.queue_depth": 0,
                                               "aioslirp.drain_us": (t1 - t0) / 1000.0, "aioslirp.plane": "native",
                                               **self.guest}, t0, t1, [r.span for r in recs] if recs else None)

    @_safe
    def record_native_wake(self, flows, t0: int, t1: int, socket_events: int, timers: int, frames: int) -> None:
        """Trace point 4 on the native plane: the engine's epoll woke the loop; from ``t0`` to ``t1``
        C ran ``socket_events`` socket readinesses and ``timers`` timer expirations, writing
        ``frames`` frames to the guest, of ``flows`` (the one flow whose frames they all were, else
        empty: none or many)."""
        recs = [r for r in (self.records.get(f) for f in flows) if r is not None]
        ctx = recs[0].ctx if recs else None
        self.sink.emit("writer_wake", ctx, {"aioslirp.frames": frames, "aioslirp.events.socket": socket_events,
                                            "aioslirp.events.timer": timers, "aioslirp.wake_us": (t1 - t0) / 1000.0,
                                            "aioslirp.plane": "native", **self.guest},
                       t0, t1, [r.span for r in recs] if recs else None)

    def record_native_ring(self, engine, flows: dict, frames: bool) -> None:
        """Take the native engine's trace records (``struct tn_trace_rec`` of tcpnat.h, oldest first)
        into spans: ``engine`` is the ``TcpEngine``, ``flows`` its flows by ``(slot, gen)``,
        ``frames`` the trace level ``frames`` (the per-frame records and ``*.sent`` events too).

        With a sink that takes lines (:attr:`native_spans` set) the engine formats them in C
        (``trace_json``: no Python object per record, but the flow events' text); otherwise each
        record goes through the ``record_native_*`` hook of its kind (an SDK span each)."""
        off = time.time_ns() - time.monotonic_ns()  # CLOCK_MONOTONIC -> the spans' clock
        native = self.native_spans
        if native is not None:
            try:
                text, n = engine.trace_json(native, frames, off, _bits(64), self._guest_json, self.sink.resource_json)
            except Exception:
                self.errors += 1
                log.exception("formatting the native trace records failed")
                return
            if n:
                self.sink.put_text(text, n)
            return
        records, _overflow = engine.trace_take()  # the overflow is in the engine's counters()
        for kind, slot, gen, t_ns, dur, a, b, c, flags in records:
            t1 = t_ns + off
            if kind == _TR_EVENT:
                if 0 < a < len(_FLOW_EVENTS) and (frames or a < _FE_SENT):
                    self.record_native_event(flows.get((slot, gen)), _FLOW_EVENTS[a], b, t1)
            elif kind == _TR_SYN_ACK:
                flow = flows.get((slot, gen))
                if flow is not None:
                    self.record_syn_ack(flow, a / 1e6, False, at=t1)
            elif not frames:
                continue
            elif kind == _TR_FRAME:
                self.record_native_frame(flows.get((slot, gen)), t1 - dur, t1, a, b, flags)
            elif kind == _TR_DRAIN:
                flow = None if b else flows.get((slot, gen))
                self.record_native_drain(() if flow is None else (flow,), t1 - dur, t1, a)
            elif kind == _TR_WAKE:
                flow = flows.get((slot, gen)) if slot >= 0 else None
                self.record_native_wake(() if flow is None else (flow,), t1 - dur, t1, a, b, c)

    # ------------------------------------------------------------------ the end
    @_safe
    def record_stack_closed(self) -> None:
        """The stack closed: end its flows' spans (some may still wait for queued frames that
        will never be written), forget the stamps and have the sink write what it holds
        (``sink.flush()``: the direct JSON-lines sink writes now; the SDK's processors keep their schedule)."""
        self.end_all()
        self.sink.flush()

    def end_all(self) -> None:
        """End every flow span still open (call before shutting the tracer provider down)."""
        self.stamps.clear()
        self.records.clear()
        if self.native_spans:
            self.native_spans.clear()
        for rec in list(self.open):
            self._end(rec)
