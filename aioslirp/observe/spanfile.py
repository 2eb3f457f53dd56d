"""The trace file: an OpenTelemetry SDK span exporter writing one JSON object per span.

:class:`JsonLinesSpanExporter` is what ``aioslirp run --trace FILE --otlp-endpoint URL`` uses for
the file (``--trace FILE`` alone writes through :class:`~aioslirp.observe.sink.JsonLinesSink`, the
same lines without an SDK span object each) and what a program that embeds stacks can hand its own
``TracerProvider``::

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from aioslirp.observe.spanfile import JsonLinesSpanExporter

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter("spans.jsonl")))

The line format is in :mod:`aioslirp.cli.observe` (``name``, ids, ``start_ns``/``end_ns`` in
Unix nanoseconds, ``attributes``, ``events``, ``links``, ``status`` and the provider's
``resource``); ``aioslirp trace-report FILE`` reads it. The SDK is optional (the ``otlp`` extra):
without it this module imports, and the classes cannot be instantiated usefully.
"""

from __future__ import annotations

import json
import logging
import threading

log = logging.getLogger("aioslirp.observe")

__all__ = ["JsonLinesSpanExporter", "NoopSpanExporter", "span_to_dict"]

try:  # the SDK is optional (the ``otlp`` extra); without it only the classes below are unusable
    from opentelemetry.sdk.trace.export import SpanExporter as _SpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult as _Result
except ImportError:  # pragma: no cover - exercised only without the SDK
    _SpanExporter = object
    _Result = None


def span_to_dict(span) -> dict:
    """One finished SDK span (``ReadableSpan``) as the trace file's JSON object."""
    ctx = span.context
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": _plain(span.attributes),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": _plain(e.attributes)} for e in span.events],
        "links": [{"trace_id": format(l.context.trace_id, "032x"), "span_id": format(l.context.span_id, "016x")}
                  for l in span.links],
        "status": span.status.status_code.name,
        "resource": _plain(span.resource.attributes) if span.resource is not None else {},
    }


def _plain(attrs) -> dict:
    if not attrs:
        return {}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.items()}


class JsonLinesSpanExporter(_SpanExporter):
    """SDK span exporter writing one JSON line per span (see the module docstring) to ``path``.

    The file is opened (truncated) at once, so a bad path fails early with ``OSError``.
    ``export`` runs on the batch processor's worker thread; each batch is flushed to the
    file before it returns. Use with ``BatchSpanProcessor`` to stay off the event loop.

    A write that fails later (disk full, ``EFBIG``, an I/O error) never raises: it is
    logged as one warning line naming ``label`` (default: the path) and the errno text,
    the file is closed and every later span is dropped and counted in ``dropped``.
    """

    def __init__(self, path: str, label: str | None = None) -> None:
        self.path = path
        self.label = label or f"trace file {path}"
        self._file = open(path, "w", encoding="utf-8")
        self._lock = threading.Lock()
        self.exported = 0
        self.dropped = 0
        self.error: str | None = None

    def export(self, spans):
        lines = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._file is None:
                self.dropped += len(spans)
                return _Result.FAILURE
            try:
                self._file.write(lines)
                self._file.flush()
            except OSError as exc:
                self.dropped += len(spans)
                self._failed(exc)
                return _Result.FAILURE
            self.exported += len(spans)
        return _Result.SUCCESS

    def _failed(self, exc: OSError) -> None:
        """A write failed (lock held): one warning line, close the file quietly, drop from now on."""
        self.error = exc.strerror or str(exc)
        log.warning("%s: cannot write spans (%s); spans from now on are not recorded", self.label, self.error)
        f, self._file = self._file, None
        try:
            f.close()  # flushes what is buffered again, which fails again; the fd is closed anyway
        except OSError:
            pass

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                f, self._file = self._file, None
                try:
                    f.close()
                except OSError as exc:
                    self.error = exc.strerror or str(exc)
                    log.warning("%s: cannot write spans (%s)", self.label, self.error)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class NoopSpanExporter(_SpanExporter):
    """Span exporter that drops everything (benchmarks: the SDK's cost without any I/O)."""

    def export(self, spans):
        return _Result.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
