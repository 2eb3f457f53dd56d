"""Span sinks: where a :class:`~aioslirp.observe.tracing.Tracer` puts the spans it records.

Theory of operation
-------------------
The tracer decides *what* is recorded (names, parents, attributes, events, times: the
trace points of docs/observability.md); a span sink decides *how* a span is made and
where it goes. Two implementations:

* :class:`SdkSink` -- the OpenTelemetry SDK: a ``TracerProvider`` given as
  ``Stack(tracer_provider=...)`` (an OTLP exporter, the JSON-lines
  :class:`~aioslirp.observe.spanfile.JsonLinesSpanExporter`, anything the SDK exports to) is
  wrapped in one. Each span is an SDK span object (ids from the provider's generator,
  attributes checked and copied, handed to its span processors): about 15-20 µs of the event
  loop's CPU per span on the reference machine, about 15 spans per connection at trace level
  ``frames``.
* :class:`JsonLinesSink` -- direct to the trace file (``aioslirp run --trace FILE`` without
  ``--otlp-endpoint``; a library user passes one as ``tracer_provider=``): a span is formatted
  to its JSON line (the format of :mod:`aioslirp.observe.spanfile`, which ``aioslirp
  trace-report`` reads) when it ends, from precomputed pieces (each flow's ids, the resource),
  with no SDK object; the lines are written by a writer thread of the sink in batches. A
  flow span is a small record (:class:`FlowSpan`) until it ends; every other span is one line
  at once (:meth:`JsonLinesSink.emit`).

The seam (what a tracer calls; both sinks have it):

* ``start_flow(name, attributes, start_ns) -> span``: a root span (a new trace) left open;
  the span has ``set_attribute(key, value)``, ``add_event(name, attributes=None,
  timestamp=None)`` and ``end(end_time=None)`` (times ``time.time_ns()`` values);
* ``context(span)``: what children of ``span`` are given as their ``parent`` (computed once
  per flow);
* ``emit(name, parent, attributes, start_ns, end_ns, links=None)``: a span that has already
  ended (``parent``: a ``context()`` value or ``None``; ``links``: flow spans);
* ``current_span(name, attributes)``: a context manager recording a span around a block;
* ``flush()``: write what is pending (the stack calls it when it closes); ``shutdown()``.

Any other object given as ``tracer_provider=`` (one without ``start_flow``) is an
OpenTelemetry provider and gets an :class:`SdkSink` (:func:`as_sink`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
import json
import json.encoder
from json.encoder import encode_basestring_ascii
from typing import IO

log = logging.getLogger("aioslirp.observe")

__all__ = ["SdkSink", "JsonLinesSink", "FlowSpan", "as_sink", "encode_json", "WRITE_INTERVAL", "WRITE_SLICE",
           "MAX_PENDING"]

#: Seconds between two batches of the :class:`JsonLinesSink` writer thread.
WRITE_INTERVAL = 0.2
#: Entries a :class:`JsonLinesSink` writer formats and writes at a time (about 100 KB).
WRITE_SLICE = 128
#: Lines a :class:`JsonLinesSink` holds for its writer at most; beyond, spans are dropped and
#: counted (``dropped``): a file that cannot keep up never grows the process without bound.
MAX_PENDING = 1 << 20

#: The json module's C encoder factory (CPython; None elsewhere), not in its typing stubs.
c_make_encoder = getattr(json.encoder, "c_make_encoder", None)

_now = time.time_ns
_bits = random.getrandbits


def _json_default(value):
    return str(value)


#: The json module's C encoder, made once (CPython): json.dumps' set-up is not paid per call.
_enc = (c_make_encoder(None, _json_default, encode_basestring_ascii, None, ":", ",", False, False, True)
        if c_make_encoder is not None else None)


def _encode(obj) -> str:
    if _enc is not None:
        return "".join(_enc(obj, 0))
    return json.dumps(obj, separators=(",", ":"), default=_json_default)  # an interpreter without it


def encode_json(obj) -> str:
    """``obj`` as compact ASCII JSON text, as the trace file's lines have it (``json.dumps`` with
    ``separators=(",", ":")``; an unknown type as its ``str``)."""
    return _encode(obj)


def _native_lines():
    """``span_lines`` of the native extension (a writer's batch formatted in C into one bytes
    object: the same bytes as :func:`_lines`), or ``None`` without it."""
    from .. import native

    ext = native.extension()
    return getattr(ext, "span_lines", None) if ext is not None else None


#: The writer's batch formatter in C, when the extension is there (else :func:`_lines`).
_C_LINES = _native_lines()


def as_sink(tracer_provider):
    """The sink for ``tracer_provider``: itself when it is one (it has ``start_flow``), else an
    :class:`SdkSink` around it (``None``: the global OpenTelemetry provider)."""
    if hasattr(tracer_provider, "start_flow"):
        return tracer_provider
    return SdkSink(tracer_provider)


class SdkSink:
    """Spans through an OpenTelemetry ``TracerProvider`` (see the module documentation).

    Args:
        tracer_provider: the provider (``None``: the global one; with the OpenTelemetry API alone
            the spans are non-recording).
    """

    __slots__ = ("otel", "_link", "_in_context")

    def __init__(self, tracer_provider=None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Link

        self.otel = trace.get_tracer("aioslirp", tracer_provider=tracer_provider)
        self._link = Link
        self._in_context = trace.set_span_in_context

    def start_flow(self, name: str, attributes: dict, start_ns: int | None = None):
        """A root SDK span, open (``start_ns``: ``time.time_ns()``; ``None``: now)."""
        return self.otel.start_span(name, attributes=attributes, start_time=start_ns)

    def context(self, span):
        """The OpenTelemetry context holding ``span`` (the parent of its children)."""
        return self._in_context(span)

    def emit(self, name: str, parent, attributes: dict, start_ns: int, end_ns: int, links=None) -> None:
        """An SDK span from ``start_ns`` to ``end_ns`` (ns), child of ``parent`` (a :meth:`context`
        value or ``None``), linked to the flow spans ``links``."""
        link = self._link
        sp = self.otel.start_span(name, context=parent, attributes=attributes, start_time=start_ns,
                                  links=[link(s.get_span_context()) for s in links] if links else None)
        sp.end(end_time=end_ns)

    def current_span(self, name: str, attributes: dict | None = None):
        """``start_as_current_span``: spans started inside the block are its children."""
        return self.otel.start_as_current_span(name, attributes=attributes)

    def flush(self) -> None:
        """Nothing: the provider's span processors export on their own schedule."""

    def shutdown(self) -> None:
        """Nothing: the provider belongs to the caller (``TracerProvider.shutdown()``)."""


class FlowSpan:
    """An open root span of a :class:`JsonLinesSink` (a flow's): its ids, start, attributes and
    events until :meth:`end` writes its line. Duck-types the SDK span's ``set_attribute``,
    ``set_attributes``, ``add_event``, ``end``."""

    __slots__ = ("sink", "name", "trace_id", "span_id", "start", "attributes", "events", "ended")

    def __init__(self, sink: "JsonLinesSink", name: str, attributes: dict, start_ns: int) -> None:
        self.sink = sink
        self.name = name
        self.trace_id = sink.new_trace_id()  # "<32 hex>"
        self.span_id = sink.new_span_id()  # "<16 hex>"
        self.start = start_ns
        self.attributes = attributes
        self.events: list = []  # (name, time ns, attributes or None)
        self.ended = False

    def set_attribute(self, key: str, value) -> None:
        """Set attribute ``key`` (a str, int, float or bool value, as the SDK takes)."""
        self.attributes[key] = value

    def set_attributes(self, attributes: dict) -> None:
        """Set every attribute of ``attributes`` (as the SDK span's ``set_attributes``)."""
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes: dict | None = None, timestamp: int | None = None) -> None:
        """Add event ``name`` at ``timestamp`` (``time.time_ns()``; ``None``: now)."""
        self.events.append((name, _now() if timestamp is None else timestamp, attributes))

    def end(self, end_time: int | None = None) -> None:
        """Write the span's line (once; ``end_time`` ns, ``None``: now)."""
        if self.ended:
            return
        self.ended = True
        self.sink.put(self.name, self.trace_id, self.span_id, "null", self.start,
                      _now() if end_time is None else end_time, self.attributes, self.events, "[]")


def _events(events: list) -> str:
    # an entry is (name, time ns, attributes or None), or its JSON text already (the native ring's)
    return "[" + ",".join(e if type(e) is str else '{"name":%s,"time_ns":%d,"attributes":%s}'
                          % (encode_basestring_ascii(e[0]), e[1], _encode(e[2]) if e[2] else "{}")
                          for e in events) + "]"


def _line(entry: tuple, resource: str) -> str:
    """The JSON line of a span queued by :meth:`JsonLinesSink.put` (formatted on the writer's thread)."""
    name, trace_id, span_id, parent, start_ns, end_ns, attributes, events, links = entry
    return _LINE % (encode_basestring_ascii(name), trace_id, span_id, parent, start_ns,
                    end_ns, _encode(attributes) if attributes else "{}", _events(events) if events else "[]", links,
                    resource)


def _lines(entries: list, resource: str) -> tuple[bytes, int]:
    """A writer's batch as ``(bytes, lines)``: each entry a span of :meth:`JsonLinesSink.put`
    (:func:`_line`) or a ``(bytes, lines)`` pair of :meth:`JsonLinesSink.put_text`."""
    out, n = [], 0
    for e in entries:
        if len(e) == 2:
            out.append(e[0])
            n += e[1]
        else:
            out.append(_line(e, resource).encode())
            n += 1
    return b"".join(out), n


_LINE = ('{"name":%s,"trace_id":"%s","span_id":"%s","parent_span_id":%s,"kind":"INTERNAL","start_ns":%d,'
         '"end_ns":%d,"attributes":%s,"events":%s,"links":%s,"status":"UNSET","resource":%s}\n')


class JsonLinesSink:
    """Spans straight to a JSON-lines trace file, no SDK object per span (module documentation).

    Args:
        path: the trace file, opened (truncated) at once: a bad path fails here with ``OSError``.
        resource: the attributes of every line's ``resource`` (default ``{"service.name":
            "aioslirp"}``; the CLI gives the SDK's resource, ``OTEL_RESOURCE_ATTRIBUTES`` and all).
        label: names the file in the warning of a failed write (default ``trace file <path>``).
        interval: seconds between the writer thread's batches (:data:`WRITE_INTERVAL`).

    Attributes:
        written: spans written to the file; dropped: spans lost (a failed write, or more than
            :data:`MAX_PENDING` lines waiting); error: the errno text of a failed write, or ``None``.

    Thread use: spans are made on the stacks' event loop thread(s); the writer thread (started
    with the first span, ended by :meth:`shutdown`) only takes finished lines and writes them.
    A write that fails never raises: one warning line, the file closed, later spans dropped.
    """

    def __init__(self, path: str, resource: dict | None = None, label: str | None = None,
                 interval: float = WRITE_INTERVAL) -> None:
        self.path = path
        self.label = label or f"trace file {path}"
        self.interval = interval
        self._file: IO[bytes] | None = open(path, "wb", buffering=0)  # (a batch: one bytes object, one write)
        #: The ``resource`` of every line, as JSON text.
        self.resource_json = _encode(dict(resource) if resource is not None else {"service.name": "aioslirp"})
        self._lines: collections.deque = collections.deque()
        self._lock = threading.Lock()  # the file and the order of batches
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None
        self._shut = False
        self.written = 0
        self.dropped = 0
        self.error: str | None = None

    # ------------------------------------------------------------------ the seam
    @staticmethod
    def new_trace_id() -> str:
        """A random non-zero trace id, 32 hex digits."""
        return "%032x" % (_bits(128) or 1)

    @staticmethod
    def new_span_id() -> str:
        """A random non-zero span id, 16 hex digits."""
        return "%016x" % (_bits(64) or 1)

    def start_flow(self, name: str, attributes: dict, start_ns: int | None = None) -> FlowSpan:
        """An open root span (a new trace) from ``start_ns`` (``None``: now); ``attributes`` is kept, not copied."""
        return FlowSpan(self, name, attributes, _now() if start_ns is None else start_ns)

    @staticmethod
    def context(span: FlowSpan) -> FlowSpan:
        """The parent of ``span``'s children: the span itself."""
        return span

    def emit(self, name: str, parent: FlowSpan | None, attributes: dict, start_ns: int, end_ns: int,
             links=None) -> None:
        """One line: span ``name`` from ``start_ns`` to ``end_ns`` (ns), child of the flow span
        ``parent`` (``None``: a root span, a new trace), linked to the flow spans ``links``."""
        if parent is None:
            trace_id, parent_id = self.new_trace_id(), "null"
        else:
            trace_id, parent_id = parent.trace_id, '"' + parent.span_id + '"'
        self.put(name, trace_id, "%016x" % (_bits(64) or 1), parent_id, start_ns, end_ns, attributes, None,
                 "[" + ",".join('{"trace_id":"%s","span_id":"%s"}' % (s.trace_id, s.span_id) for s in links) + "]"
                 if links else "[]")

    def put(self, name: str, trace_id: str, span_id: str, parent: str, start_ns: int, end_ns: int,
            attributes: dict, events: list | None, links: str) -> None:
        """Queue one span for the writer, which formats its line: ``trace_id`` and ``span_id`` hex
        digits, ``parent`` and ``links`` JSON text, ``events`` a :class:`FlowSpan`'s (``None``: none);
        ``attributes`` and ``events`` are not to be changed any more. Nothing is formatted here,
        on the event loop: the writer's thread does it (about 2 µs a line there)."""
        lines = self._lines
        if len(lines) >= MAX_PENDING or self._shut:
            self.dropped += 1
            return
        lines.append((name, trace_id, span_id, parent, start_ns, end_ns, attributes, events, links))
        if self._writer is None:
            self._start_writer()

    def put_text(self, text: bytes, count: int) -> None:
        """Queue ``count`` lines already formatted (``text``: whole lines, ASCII, each ending in a
        newline; the native plane's records, formatted in C by ``TcpEngine.trace_json``)."""
        lines = self._lines
        if len(lines) >= MAX_PENDING or self._shut:
            self.dropped += count
            return
        lines.append((text, count))
        if self._writer is None:
            self._start_writer()

    @contextlib.contextmanager
    def current_span(self, name: str, attributes: dict | None = None):
        """A root span around the block (this sink has no current-span context: spans started
        inside are not its children)."""
        t0 = _now()
        try:
            yield None
        finally:
            self.emit(name, None, dict(attributes or {}), t0, _now())

    # ------------------------------------------------------------------ the writer
    def _start_writer(self) -> None:
        self._writer = threading.Thread(target=self._run, name="aioslirp-trace-writer", daemon=True)
        self._writer.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()
        self._write()

    def _write(self) -> None:
        """Write every line queued so far, in order (either thread)."""
        with self._lock:
            lines = self._lines
            n = len(lines)
            if not n:
                return
            pop = lines.popleft
            fmt = _C_LINES
            res = self.resource_json
            while n > 0:
                # A slice at a time: one bytes object of some 100 KB each, not one of the whole
                # batch (megabytes: fresh pages, faulted in, for every batch).
                k = min(n, WRITE_SLICE)
                n -= k
                batch = [pop() for _ in range(k)]
                try:
                    data, k = fmt(batch, res, _encode) if fmt is not None else _lines(batch, res)
                except Exception:  # pragma: no cover - defensive: _encode takes any value
                    self.dropped += k
                    log.exception("%s: cannot format spans", self.label)
                    continue
                f = self._file
                if f is None:
                    self.dropped += k
                    continue
                try:
                    view = memoryview(data)
                    done, total = 0, len(view)
                    while done < total:  # (an unbuffered file: a short write is possible)
                        done += f.write(view[done:])
                except OSError as exc:
                    self.dropped += k
                    self._failed(exc)
                    continue
                self.written += k

    def _failed(self, exc: OSError) -> None:
        """A write failed (lock held): one warning line, close the file quietly, drop from now on."""
        self.error = exc.strerror or str(exc)
        log.warning("%s: cannot write spans (%s); spans from now on are not recorded", self.label, self.error)
        f, self._file = self._file, None
        if f is None:
            return
        try:
            f.close()
        except OSError:
            pass

    def flush(self) -> None:
        """Write every span ended so far, now, on the calling thread."""
        self._write()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """:meth:`flush` (the SDK's name)."""
        self._write()
        return True

    def shutdown(self) -> None:
        """Write what is left, end the writer thread, close the file (idempotent; spans ended later are dropped)."""
        if self._shut:
            return
        self._shut = True  # later spans are dropped (counted)
        self._stop.set()
        thread = self._writer
        if thread is not None:
            thread.join()
        self._write()
        with self._lock:
            f, self._file = self._file, None
            if f is not None:
                try:
                    f.close()
                except OSError as exc:
                    self.error = exc.strerror or str(exc)
                    log.warning("%s: cannot write spans (%s)", self.label, self.error)
