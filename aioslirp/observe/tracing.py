"""Trace points as OpenTelemetry spans, recorded by a :class:`Tracer` that belongs to one stack.

Theory of operation
-------------------
A :class:`~aioslirp.stack.Stack` made with ``tracer_provider=`` (or after :func:`enable`,
which sets that default for stacks made afterwards) owns one :class:`Tracer`; every other
stack has ``None``. The stack hands it to the objects that need it when it builds them:
``FlowContext.tracer`` (the flows), ``FlowTable.tracer``, ``InjectQueue.tracer``,
``Link.tracer``. A trace point reads that attribute and, when a tracer is there, tells it
what just happened, *after* doing the work::

    conn.receive_segment(seg, now)
    tr = self.ctx.tracer
    if tr is not None:
        tr.record_segment(self, seg)

So the data path is written once; with tracing off a trace point costs one attribute load and
an ``is not None`` test, and a hook never performs the data path's work. A hook that raises is
counted in :attr:`Tracer.errors` and logged once per hook; the data path goes on.

Everything the tracer remembers is its own: the record of each traced flow (a map keyed by
the flow object, nothing is set on flows), the enqueue stamps of frames waiting in the
inject queue, the flow records whose span has not ended. Two stacks in one process trace
into their own providers, or into one: every span a tracer starts carries its stack's
identity (``aioslirp.guest.name``, ``aioslirp.guest.label.<key>``, computed once when the
tracer is made), so spans of many stacks in one provider (one export thread) are split by it.

Where each trace point is recorded:

* flow spans and their events: the flow table (``record_flow_opened`` / ``record_flow_closed``) and
  the TCP flow (``record_segment``, ``record_host_data``, ``record_syn_ack``, ``record_conn_event``,
  ``record_connect_failed``, ``record_flow_event``), each after the call it describes;
* ``process_guest_frame``: :class:`~aioslirp.dispatch.link.Link`, after each frame's dispatch
  (the span's parent is the flow the dispatch found or created, and its timing and queued
  frames are per frame inside a batch: a transport wrapper sees whole batches only);
* ``drain_to_guest`` and ``writer_wake``: :class:`~aioslirp.transport.trace.TraceTransport`,
  a wrapper around the served transport (like ``PcapTransport``), which times each
  ``send_frames``; the inject queue stamps each frame it queues (``record_frame_queued``) and
  forgets those it drops unwritten (``record_discard``).

Trace levels (``NetworkConfig.trace_level``, ``--trace-level``; docs/observability.md): the
stack hands its tracer out once, when it is made, by level, so a trace point of a level not
recorded is a ``None`` attribute (its one branch) and never a call:

* ``"flows"`` (the default): the flow table only: one span per flow (``tcp.flow``,
  ``udp.flow``, ``icmp.flow``) with its start and end attributes, no events, no child span;
  nothing per frame, so a frame of no flow (ARP, ND, RA, DHCP) makes no span at all;
* ``"timeline"``: also the flows' own hooks (``FlowContext.tracer``): the flow spans' events
  (``host.connect``, ``syn_ack.queued``, ``established``, ``guest.data``, ``host.data``,
  ``fin.*``, ``reset``, ``closed``, ``connect.*``) and the ``tcp.syn_ack`` span;
* ``"frames"``: also the per-frame trace points: the link (``process_guest_frame``), the inject
  queue's stamps and the ``TraceTransport`` (``drain_to_guest``, ``writer_wake`` and the
  ``*.sent`` events); a flow span then ends when its last queued frame has been written.

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
  processing it), ``aioslirp.processing_us`` (from the end of the previous frame of the
  batch, or the batch's start, to the end of this one's dispatch).
* ``tcp.syn_ack`` -- trace point 2: the SYN-ACK is queued for a new guest connection. From
  the start of the host connect to the SYN-ACK queued. Child of the flow span.
  ``client.port`` (guest port), ``server.port`` (remote port),
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

Compatibility: :func:`enable` / :func:`disable` set and clear the provider that stacks made
afterwards trace through (a stack made with ``tracer_provider=`` ignores it);
:func:`end_all` ends the open flow spans of the tracers made that way. Nothing in the data
path reads this module's state.
"""

from __future__ import annotations

import contextlib
import weakref

from .sink import as_sink
from .tracer import MAX_DATA_EVENTS, Tracer

__all__ = ["Tracer", "enable", "disable", "default_tracer", "span", "end_all", "MAX_DATA_EVENTS"]


# --------------------------------------------------------------------------- the default
# For code written against the process-wide API (tracing.enable(tp) ... tracing.end_all()):
# a stack made without tracer_provider= asks default_tracer() for its tracer.
_default: list = []  # [provider] while enable() is in force
_made: "weakref.WeakSet[_Made]" = weakref.WeakSet()  # tracers made from it, for end_all()


class _Made:
    """A tracer made through :func:`enable`, in ``_made`` as long as the tracer lives (the tracer
    holds it: a compiled :class:`Tracer` takes no weak reference itself)."""

    __slots__ = ("tracer", "__weakref__")

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer


def enable(tracer_provider=None) -> None:
    """Stacks made from now on without ``tracer_provider=`` trace through ``tracer_provider``
    (default: the global one). Needs only ``opentelemetry-api``; without an SDK provider the
    spans are non-recording."""
    _default[:] = [tracer_provider]


def disable() -> None:
    """Stacks made from now on are not traced by default (stacks already made keep their tracer)."""
    _default.clear()


def default_tracer(flows, queue, identity=None) -> Tracer | None:
    """A :class:`Tracer` (of the stack's ``identity``) through the provider given to :func:`enable`,
    or ``None`` after :func:`disable` (the default)."""
    if not _default:
        return None
    tracer = Tracer(_default[0], flows, queue, identity=identity)
    made = tracer.keep = _Made(tracer)
    _made.add(made)
    return tracer


def end_all() -> None:
    """End every flow span still open in the tracers made through :func:`enable` (call before
    shutting the tracer provider down)."""
    for made in list(_made):
        made.tracer.end_all()


def span(name: str, attributes: dict | None = None):
    """A context manager recording span ``name`` through the provider given to :func:`enable`
    (a no-op context when there is none)."""
    if not _default:
        return contextlib.nullcontext()
    return as_sink(_default[0]).current_span(name, attributes)


def __getattr__(name: str):
    # Read-only views kept for code written against the process-wide API.
    if name == "enabled":  # stacks made now are traced
        return bool(_default)
    if name == "errors":  # hook failures in the tracers made through enable()
        return sum(m.tracer.errors for m in list(_made))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
