"""Trace points as OpenTelemetry spans, gated by one module-level boolean.

Theory of operation
-------------------
Every call site in the data path reads :data:`enabled` first (``if tracing.enabled:``) and
only then calls into this module, so with tracing off (the default) a call site costs one
module attribute look-up and a branch. :func:`enable` turns the trace points on; spans go
to the tracer provider given there (or the global one: with the OpenTelemetry API alone
they are non-recording and cheap, with the SDK they are recorded and exported).

Spans (names and attributes; ``network.*``, ``client.*``, ``server.*`` follow the
OpenTelemetry semantic conventions, the rest is ``aioslirp.*``):

* ``tcp.flow`` / ``udp.flow`` / ``icmp.flow`` -- one per NAT flow, from its creation (the
  guest's SYN or first datagram) until it leaves the flow table and its last frame has
  been written to the guest. A root span: each connection is one trace. Attributes
  ``network.transport``, ``network.type``, ``client.address``/``client.port`` (the guest),
  ``server.address``/``server.port`` (the destination the guest asked for),
  ``network.peer.address`` (the host address actually connected); at the end
  ``aioslirp.bytes.from_guest``, ``aioslirp.bytes.to_guest`` and for TCP
  ``aioslirp.tcp.state`` and ``aioslirp.tcp.outcome`` (``closed``, ``reset``, ``refused``,
  ``unreachable``). Events, in time order (the CRR timeline):
  ``host.connect`` (the flow's task starts the host connect), ``syn_ack.queued`` (with
  ``aioslirp.connect_us``), ``connect.refused`` / ``connect.unreachable``,
  ``established``, ``guest.data`` / ``host.data`` (payload from each side, with
  ``aioslirp.bytes``; the first :data:`MAX_DATA_EVENTS` of each), ``fin.guest``,
  ``fin.host``, ``reset`` (the guest reset us or we gave up), ``closed``, and, stamped by
  the writer when the frame reached the transport, ``syn_ack.sent``, ``data.sent``,
  ``fin.sent``, ``rst.sent`` (with ``aioslirp.wait_us``: time in the inject queue).
* ``process_guest_frame`` -- trace point 1: one guest frame processed. Child of its flow's
  span when the frame belongs to a flow (including the SYN that creates it). Attributes
  ``aioslirp.ethertype``, ``network.type``, ``network.transport``, ``aioslirp.frame.bytes``,
  ``aioslirp.tcp.flags``, ``aioslirp.frames_queued`` (frames put in the inject queue while
  processing it), ``aioslirp.processing_us``.
* ``tcp.syn_ack`` -- trace point 2: the SYN-ACK is queued for a new guest connection.
  Child of the flow span. ``client.port`` (guest port), ``server.port`` (remote port),
  ``aioslirp.connect.immediate`` (no host connect was needed: the DNS service),
  ``aioslirp.connect_us`` (host connect time).
* ``drain_to_guest`` -- trace point 3: the writer handed one batch to the transport.
  ``aioslirp.frames``, ``aioslirp.queue_depth`` (depth before the drain),
  ``aioslirp.drain_us``.
* ``writer_wake`` -- trace point 4: from the oldest frame of the batch entering the inject
  queue to the batch's write (the asyncio analogue of the reference's poll-thread wait).
  ``aioslirp.frames`` (frames stamped at enqueue), ``aioslirp.wait_us.max``,
  ``aioslirp.wait_us.min``.

The batch spans are children of the flow span when the whole batch belongs to one flow,
and carry links to every flow whose frames they wrote.

Timestamps are ``time.time_ns()`` (the SDK's clock), so spans made after the fact (a
guest frame's span is created once the frame is dispatched and its flow is known) line
up with events stamped by the SDK.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import time

from .flow.base import flow_key
from .wire.tcp import ACK, FIN, PSH, RST, SYN

log = logging.getLogger("aioslirp.tracing")

__all__ = ["enabled", "enable", "disable", "span", "end_all", "MAX_DATA_EVENTS"]

#: True when trace points record spans. Read at each call site: ``if tracing.enabled:``.
enabled = False
_tracer = None

#: Per flow, at most this many ``guest.data``, ``host.data`` and ``data.sent`` events each.
MAX_DATA_EVENTS = 8

#: Stamps of frames waiting in inject queues: id(frame) -> (frame, enqueue time ns, record, kind).
_stamps: dict = {}
_MAX_STAMPS = 1 << 16
#: Flow records whose span has not ended yet.
_open: set = set()
#: Internal errors of the tracing code (each is logged once per hook; the data path goes on).
errors = 0
_logged: set = set()

_now = time.time_ns
_PROTO_NAMES = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmp"}
_TCP_FIN, _TCP_SYN, _TCP_RST, _TCP_ACK = FIN, SYN, RST, ACK
_FLAG_LETTERS = ((FIN, "F"), (SYN, "S"), (RST, "R"), (PSH, "P"), (ACK, "A"))
#: Connection events recorded from ``TcpConnection.next_event`` (the others are recorded
#: when the guest segment that caused them is fed, see :func:`guest_segment`).
_CONN_EVENTS = {"reset": "reset", "closed": "closed"}


def enable(tracer_provider=None) -> None:
    """Record spans for the stack's trace points through ``tracer_provider`` (default: the global one).

    Needs only ``opentelemetry-api``; without an SDK provider the spans are non-recording.
    """
    global enabled, _tracer
    from opentelemetry import trace

    _tracer = trace.get_tracer("aioslirp", tracer_provider=tracer_provider)
    enabled = True


def disable() -> None:
    """Stop recording spans (flow spans already open still end normally)."""
    global enabled
    enabled = False


def span(name: str, attributes: dict | None = None):
    """A context manager recording span ``name`` as the current span (a no-op context when tracing is off)."""
    if not enabled or _tracer is None:
        return contextlib.nullcontext()
    return _tracer.start_as_current_span(name, attributes=attributes)


def _safe(fn):
    """A tracing hook never breaks the data path: an exception is counted and logged once."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global errors
        try:
            return fn(*args, **kwargs)
        except Exception:
            errors += 1
            if fn.__name__ not in _logged:
                _logged.add(fn.__name__)
                log.exception("tracing hook %s failed (further failures are only counted)", fn.__name__)
            return None

    return wrapper


# --------------------------------------------------------------------------- flows
class _FlowTrace:
    """Tracing state of one flow: its span, a context for children, counters."""

    __slots__ = ("span", "ctx", "stack", "pending", "closing", "to_guest", "n_guest", "n_host", "n_sent", "outcome")

    def __init__(self, span, ctx, stack) -> None:
        self.span = span
        self.ctx = ctx
        self.stack = stack
        self.pending = 0  # frames of this flow stamped in the inject queue
        self.closing = False  # the flow left the table; end the span once pending == 0
        self.to_guest = 0
        self.n_guest = self.n_host = self.n_sent = 0
        self.outcome = None  # a TCP flow's failed connect: "refused" or "unreachable"


def _addr(raw) -> str:
    try:
        return str(ipaddress.ip_address(bytes(raw)))
    except ValueError:
        return repr(raw)


@_safe
def flow_opened(stack, flow) -> None:
    """A flow entered the flow table: start its span (called by ``FlowTable.add``)."""
    from opentelemetry import trace

    if _tracer is None:
        return
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
    sp = _tracer.start_span(name + ".flow", attributes=attrs)
    rec = _FlowTrace(sp, trace.set_span_in_context(sp), stack)
    flow.trace = rec
    _open.add(rec)


@_safe
def flow_closed(flow) -> None:
    """A flow left the flow table (``FlowTable.remove``): set the end attributes; the span
    ends once the flow's last queued frame has been written."""
    rec = flow.trace
    if rec is None:
        return
    flow.trace = None
    sp = rec.span
    if flow.proto_name == "tcp":
        conn = flow.conn
        irs = conn.irs
        from_guest = 0 if irs is None else (conn.rcv_nxt - irs - 1 - (1 if conn.fin_received else 0)) & 0xFFFFFFFF
        if from_guest > 0x7FFFFFFF:
            from_guest = 0
        sp.set_attribute("aioslirp.bytes.from_guest", from_guest)
        sp.set_attribute("aioslirp.bytes.to_guest", rec.to_guest)
        sp.set_attribute("aioslirp.tcp.state", conn.state)
        outcome = rec.outcome or ("reset" if conn.reset else "closed")
        sp.set_attribute("aioslirp.tcp.outcome", outcome)
    else:
        up = flow.bytes_up
        if up is not None:
            sp.set_attribute("aioslirp.bytes.from_guest", up)
            sp.set_attribute("aioslirp.bytes.to_guest", flow.bytes_down)
    rec.closing = True
    if rec.pending <= 0:
        _end(rec)


def _end(rec: _FlowTrace, end_time: int | None = None) -> None:
    if rec in _open:
        _open.discard(rec)
        rec.span.end(end_time=end_time)


@_safe
def flow_event(flow, name: str, attributes: dict | None = None) -> None:
    """Add event ``name`` to ``flow``'s span (no-op when the flow has no span)."""
    rec = flow.trace
    if rec is not None:
        rec.span.add_event(name, attributes)


@_safe
def connect_failed(flow, outcome: str) -> None:
    """The host connect of a TCP flow failed: ``outcome`` is ``refused`` or ``unreachable``."""
    rec = flow.trace
    if rec is not None:
        rec.outcome = outcome
    flow_event(flow, "connect." + outcome)


@_safe
def tcp_event(flow, name: str) -> None:
    """An event from the sans-IO connection (``established``, ``fin``, ``reset``, ``closed``)."""
    rec = flow.trace
    if rec is not None and name in _CONN_EVENTS:
        rec.span.add_event(_CONN_EVENTS[name])


def guest_segment(flow, seg, now: float) -> None:
    """Feed guest segment ``seg`` to ``flow.conn`` and record what it changed: ``established``,
    ``guest.data`` (with its payload length), ``fin.guest``."""
    conn = flow.conn
    est0, fin0 = conn.established_at, conn.fin_received
    try:
        conn.receive_segment(seg, now)
    finally:
        _segment_events(flow, len(seg.payload), est0, fin0)


@_safe
def _segment_events(flow, nbytes: int, est0, fin0: bool) -> None:
    rec = flow.trace
    if rec is None:
        return
    conn = flow.conn
    sp = rec.span
    if est0 is None and conn.established_at is not None:
        sp.add_event("established")
    if nbytes and rec.n_guest < MAX_DATA_EVENTS:
        rec.n_guest += 1
        sp.add_event("guest.data", {"aioslirp.bytes": nbytes})
    if conn.fin_received and not fin0:
        sp.add_event("fin.guest")


@_safe
def host_data(flow, nbytes: int) -> None:
    """The host socket delivered ``nbytes`` for the guest."""
    rec = flow.trace
    if rec is not None:
        rec.to_guest += nbytes
        if rec.n_host < MAX_DATA_EVENTS:
            rec.n_host += 1
            rec.span.add_event("host.data", {"aioslirp.bytes": nbytes})


def syn_ack(flow, connect_time: float, immediate: bool) -> None:
    """Trace point 2: queue the SYN-ACK (``flow.conn.accept``) inside a ``tcp.syn_ack`` span.

    ``connect_time``: seconds the host connect took; ``immediate``: no host connect was needed.
    """
    t0 = _now()
    try:
        flow.conn.accept(flow.loop.time())
    finally:
        _syn_ack_span(flow, connect_time, immediate, t0, _now())


@_safe
def _syn_ack_span(flow, connect_time: float, immediate: bool, t0: int, t1: int) -> None:
    rec = flow.trace
    connect_us = int(connect_time * 1e6)
    if rec is not None and not immediate:
        rec.span.add_event("host.connect", timestamp=t0 - int(connect_time * 1e9))
    attrs = {"client.port": flow.guest_port, "server.port": flow.dst_port,
             "aioslirp.connect.immediate": immediate, "aioslirp.connect_us": connect_us}
    sp = _tracer.start_span("tcp.syn_ack", context=rec.ctx if rec is not None else None, attributes=attrs,
                            start_time=t0)
    sp.end(end_time=t1)
    if rec is not None:
        rec.span.add_event("syn_ack.queued", {"aioslirp.connect_us": connect_us}, timestamp=t1)


# --------------------------------------------------------------------------- frames
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


def _flags_text(flags: int) -> str:
    return "".join(c for bit, c in _FLAG_LETTERS if flags & bit)


def guest_frame(stack, frame, dispatch, *args) -> None:
    """Trace point 1: dispatch one guest frame (``dispatch(frame, *args)``) and record its span."""
    depth0 = len(stack.inject_queue)
    t0 = _now()
    try:
        dispatch(frame, *args)
    finally:
        _frame_span(stack, frame, t0, _now(), depth0)


@_safe
def _frame_span(stack, frame, t0: int, t1: int, depth0: int) -> None:
    queued = len(stack.inject_queue) - depth0
    key, transport, flags, _plen = _frame_key(frame, False)
    flow = stack.flows.get(key) if key is not None else None
    rec = flow.trace if flow is not None else None
    attrs = {"aioslirp.frame.bytes": len(frame), "aioslirp.frames_queued": max(queued, 0),
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
    if flags:
        attrs["aioslirp.tcp.flags"] = _flags_text(flags)
    sp = _tracer.start_span("process_guest_frame", context=rec.ctx if rec is not None else None,
                            attributes=attrs, start_time=t0)
    sp.end(end_time=t1)


@_safe
def frame_queued(stack, frame) -> None:
    """A frame entered the inject queue: stamp its enqueue time and its flow (``Stack.inject``)."""
    key, _transport, flags, plen = _frame_key(frame, True)
    rec = None
    kind = None
    if key is not None:
        flow = stack.flows.get(key)
        if flow is not None:
            rec = flow.trace
    if rec is not None:
        if flags & _TCP_RST:
            kind = "rst.sent"
        elif flags & _TCP_SYN:
            kind = "syn_ack.sent" if flags & _TCP_ACK else "syn.sent"
        elif flags & _TCP_FIN:
            kind = "fin.sent"
        elif plen > 0:
            kind = "data.sent"
        rec.pending += 1
    if len(_stamps) >= _MAX_STAMPS:
        _discard_stamps()
    old = _stamps.get(id(frame))
    if old is not None and old[2] is not None:
        _unpend(old[2])
    _stamps[id(frame)] = (frame, _now(), rec, kind)


def _unpend(rec: _FlowTrace) -> None:
    rec.pending -= 1
    if rec.closing and rec.pending <= 0:
        _end(rec)


def _discard_stamps() -> None:
    """Forget every stamp (frames dropped without a write leave stale ones behind)."""
    for _frame, _t, rec, _kind in list(_stamps.values()):
        if rec is not None:
            _unpend(rec)
    _stamps.clear()


def drain(stack, transport, batch, depth: int) -> None:
    """Trace points 3 and 4: write ``batch`` with ``transport.send_frames`` and record
    ``drain_to_guest`` and ``writer_wake``; stamp ``*.sent`` events on the flows' spans."""
    t0 = _now()
    try:
        transport.send_frames(batch)
    finally:
        _drained(batch, depth, t0, _now())


@_safe
def _drained(batch, depth: int, t0: int, t1: int) -> None:
    first = None
    n_stamped = 0
    wmax = wmin = 0
    recs: list = []  # distinct flows of this batch, in order
    done: list = []  # one entry per stamped frame of a flow
    pop = _stamps.pop
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
            if kind is not None and (kind != "data.sent" or rec.n_sent < MAX_DATA_EVENTS):
                if kind == "data.sent":
                    rec.n_sent += 1
                rec.span.add_event(kind, {"aioslirp.wait_us": wait / 1000.0}, timestamp=t1)
    _batch_spans(batch, depth, t0, t1, first, n_stamped, wmax, wmin, recs)
    for rec in done:
        _unpend(rec)


@_safe
def discard(batch) -> None:
    """Frames of ``batch`` were dropped without a write: forget their stamps."""
    for f in batch:
        st = _stamps.pop(id(f), None)
        if st is not None and st[2] is not None:
            _unpend(st[2])


def _batch_spans(batch, depth, t0, t1, first, n_stamped, wmax, wmin, recs) -> None:
    from opentelemetry.trace import Link

    ctx = recs[0].ctx if len(recs) == 1 else None
    links = [Link(r.span.get_span_context()) for r in recs] if recs else None
    sp = _tracer.start_span("drain_to_guest", context=ctx, links=links, start_time=t0,
                            attributes={"aioslirp.frames": len(batch), "aioslirp.queue_depth": depth,
                                        "aioslirp.drain_us": (t1 - t0) / 1000.0})
    sp.end(end_time=t1)
    if first is not None:
        sp = _tracer.start_span("writer_wake", context=ctx, links=links, start_time=first,
                                attributes={"aioslirp.frames": n_stamped, "aioslirp.wait_us.max": wmax / 1000.0,
                                            "aioslirp.wait_us.min": wmin / 1000.0})
        sp.end(end_time=t1)


@_safe
def stack_closed(stack) -> None:
    """The stack closed: end the spans of its flows (some may still wait for queued frames
    that will never be written) and forget the stamps of its frames."""
    for k, st in list(_stamps.items()):
        if st[2] is None or st[2].stack is stack:
            del _stamps[k]
    for rec in [r for r in _open if r.stack is stack]:
        _end(rec)


def end_all() -> None:
    """End every flow span still open (call before shutting the tracer provider down)."""
    _stamps.clear()
    for rec in list(_open):
        _end(rec)
