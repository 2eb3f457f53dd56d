"""Observability set-up for the command line: ``--trace FILE``, ``--otlp-endpoint URL``, ``--pcap FILE``.

:class:`Observability` turns those options into the stacks' ``tracer_provider``: with ``--trace
FILE`` alone a :class:`~aioslirp.observe.sink.JsonLinesSink` (spans formatted straight to the
file's lines, no SDK span object each, written by its thread); with ``--otlp-endpoint`` an
OpenTelemetry SDK tracer provider (a :class:`JsonLinesSpanExporter` for the file when both are
given, an OTLP/HTTP exporter for the endpoint, both behind a ``BatchSpanProcessor`` so spans are
serialized and written on the SDK's worker thread, off the event loop), a meter provider
exporting :mod:`aioslirp.observe.metrics` over OTLP,
and a stack factory that wraps the transport in a
:class:`~aioslirp.transport.pcap.PcapTransport`. :meth:`Observability.shutdown` ends open
flow spans and flushes every exporter, the OTLP endpoint within :data:`OTLP_SHUTDOWN_TIMEOUT`
seconds (one that does not answer is given up on, one warning line); the CLI calls it on
exit, SIGTERM included.

Trace file format (written by :class:`~aioslirp.observe.sink.JsonLinesSink` or
:class:`~aioslirp.observe.spanfile.JsonLinesSpanExporter`, which lives in
:mod:`aioslirp.observe.spanfile` and is re-exported here): one JSON object per line, one
line per finished span::

    {"name": "tcp.flow", "trace_id": "<32 hex>", "span_id": "<16 hex>",
     "parent_span_id": "<16 hex>" | null, "kind": "INTERNAL",
     "start_ns": <unix ns>, "end_ns": <unix ns>, "attributes": {...},
     "events": [{"name": ..., "time_ns": ..., "attributes": {...}}],
     "links": [{"trace_id": ..., "span_id": ...}], "status": "UNSET",
     "resource": {"service.name": "aioslirp", ...}}

``resource`` is the attributes of the provider's resource (``service.name``...), on every line,
so that lines of several processes in one file stay apart; the spans of each stack carry its
guest's ``aioslirp.guest.name`` and ``aioslirp.guest.label.<key>`` in ``attributes`` (one
provider serves every stack of a process).

``aioslirp trace-report FILE`` reads it (:mod:`aioslirp.cli.trace_report`).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import urllib.parse

from ..errors import ConfigError
from ..observe.sink import JsonLinesSink
from ..observe.spanfile import JsonLinesSpanExporter, NoopSpanExporter, span_to_dict

log = logging.getLogger("aioslirp.observe")

__all__ = ["Observability", "JsonLinesSpanExporter", "NoopSpanExporter", "span_to_dict", "otlp_urls", "SERVICE_NAME",
           "OTLP_SHUTDOWN_TIMEOUT", "probe_writable"]

#: ``service.name`` of the exported resource unless ``OTEL_SERVICE_NAME`` /
#: ``OTEL_RESOURCE_ATTRIBUTES`` set one.
SERVICE_NAME = "aioslirp"

#: Seconds :meth:`Observability.shutdown` gives the OTLP exporters to deliver the last spans
#: and metrics; an endpoint that does not answer by then is given up on (one warning line).
OTLP_SHUTDOWN_TIMEOUT = 2.0

_OTLP_HINT = "pip install 'aioslirp[otlp]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"


def otlp_urls(endpoint: str) -> tuple[str, str]:
    """``(traces_url, metrics_url)`` for ``--otlp-endpoint``.

    A base URL (``http://localhost:4318`` or ``.../``) gets the OTLP/HTTP paths
    ``/v1/traces`` and ``/v1/metrics`` appended; a URL ending in ``/v1/traces`` is used as
    is for traces (and its ``/v1/metrics`` sibling for metrics). Raises
    :class:`ConfigError` (``--otlp-endpoint``) for anything but an ``http``/``https`` URL
    with a host.
    """
    u = urllib.parse.urlsplit(endpoint)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError("--otlp-endpoint", f"{endpoint!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:4318)")
    try:
        u.port
    except ValueError:
        raise ConfigError("--otlp-endpoint", f"{endpoint!r} has an invalid port") from None
    path = u.path.rstrip("/")
    if path.endswith("/v1/traces"):
        base = path[: -len("/v1/traces")]
    else:
        base = path
    traces = urllib.parse.urlunsplit((u.scheme, u.netloc, base + "/v1/traces", u.query, ""))
    metrics = urllib.parse.urlunsplit((u.scheme, u.netloc, base + "/v1/metrics", u.query, ""))
    return traces, metrics


def _resource():
    from opentelemetry.sdk.resources import Resource

    res = Resource.create({})
    name = res.attributes.get("service.name")
    if not name or str(name).startswith("unknown_service"):
        res = res.merge(Resource({"service.name": SERVICE_NAME}))
    return res


def _bsp(exporter):
    """A BatchSpanProcessor sized for bursts of short flows, unless ``OTEL_BSP_*`` says otherwise."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    kw = {}
    if "OTEL_BSP_MAX_QUEUE_SIZE" not in os.environ:
        kw["max_queue_size"] = 1 << 16
    if "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" not in os.environ:
        kw["max_export_batch_size"] = 2048
    if "OTEL_BSP_SCHEDULE_DELAY" not in os.environ:
        kw["schedule_delay_millis"] = 500
    return BatchSpanProcessor(exporter, **kw)


def probe_writable(path: str) -> None:
    """Open ``path`` for writing (created when missing, never truncated) and write zero bytes.

    Catches at startup what only a write reveals: ``/dev/full`` (``ENOSPC``), a procfs or
    sysfs file root may open but not write (``EIO``, ``EACCES``), a read-only file system
    (``EROFS``). A FIFO is left alone (opening it would wait for a reader). Raises ``OSError``.
    """
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            return
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    try:
        os.write(fd, b"")
    finally:
        os.close(fd)


_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\"()\[\]]+)")
_HTTP_CODE = re.compile(r"code: (\d+), reason: ([^,]+)")


def _failure_reason(message: str) -> str | None:
    """A short reason out of an OpenTelemetry exporter log message (``Connection refused``,
    ``HTTP 404 Not Found``), or None."""
    m = _ERRNO_TEXT.search(message)
    if m:
        return m.group(1).strip()
    m = _HTTP_CODE.search(message)
    if m:
        return f"HTTP {m.group(1)} {m.group(2).strip()}"
    if "timed out" in message:
        return "timed out"
    return None


class _OtlpReport(logging.Handler):
    """Export failures towards ``--otlp-endpoint`` as one warning line naming the endpoint.

    The OTLP exporters log each retry and each failure (with exception text) through the
    ``opentelemetry.exporter`` loggers. :meth:`install` takes those records off the user's
    stderr (they are re-logged at DEBUG by ``aioslirp.observe``) and keeps the last reason;
    the first export that fails (:meth:`failed`) becomes one WARNING line, later failures are
    only counted in ``dropped`` (spans, metric batches).
    """

    LOGGER = "opentelemetry.exporter"

    def __init__(self, endpoint: str) -> None:
        super().__init__(logging.DEBUG)
        self.endpoint = endpoint
        self.reason: str | None = None
        self.reported = False
        self.dropped = {"spans": 0, "metrics": 0}
        self.shut: set[int] = set()  # id() of exporters already shut down
        self.lock_ = threading.Lock()
        self._saved: tuple | None = None

    def install(self) -> None:
        lg = logging.getLogger(self.LOGGER)
        self._saved = (lg.propagate, lg.level)
        lg.addHandler(self)
        lg.propagate = False
        lg.setLevel(logging.DEBUG if log.isEnabledFor(logging.DEBUG) else logging.INFO)

    def uninstall(self) -> None:
        if self._saved is None:
            return
        lg = logging.getLogger(self.LOGGER)
        lg.removeHandler(self)
        lg.propagate, level = self._saved
        lg.setLevel(level)
        self._saved = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # pragma: no cover - a malformed record
            return
        reason = _failure_reason(msg)
        if reason:
            self.reason = reason
        log.debug("OTLP exporter: %s", " ".join(msg.split()))

    def failed(self, kind: str, n: int) -> None:
        with self.lock_:
            self.dropped[kind] += n
        why = self._first_report()
        if why is not None:
            log.warning("--otlp-endpoint %s: cannot export %s%s; telemetry is dropped while it fails "
                        "(not logged again)", self.endpoint, kind, why)

    def gave_up(self, seconds: float) -> None:
        why = self._first_report()
        if why is not None:
            log.warning("--otlp-endpoint %s: no answer within %g s at exit%s; the last spans and metrics are "
                        "dropped", self.endpoint, seconds, why)

    def _first_report(self) -> str | None:
        """The ``" (reason)"`` (or ``""``) to put in the one warning line, the first time a failure
        is to be reported (from any thread); ``None`` after: it was reported."""
        with self.lock_:
            if self.reported:
                return None
            self.reported = True
        return f" ({self.reason})" if self.reason else ""

    def first_shutdown(self, exporter) -> bool:
        """True the first time ``exporter`` is shut down (the SDK may call it again, from another thread)."""
        with self.lock_:
            if id(exporter) in self.shut:
                return False
            self.shut.add(id(exporter))
            return True


def _otlp_exporters(traces_url: str, metrics_url: str, report: _OtlpReport):
    """``(span_exporter, metric_exporter)``: the SDK's OTLP/HTTP exporters, with failures
    going to ``report`` and a ``shutdown`` that may be called more than once (to abort retries)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    class SpanExporter(OTLPSpanExporter):
        def export(self, spans):
            result = super().export(spans)
            if result.name != "SUCCESS":
                report.failed("spans", len(spans))
            return result

        def shutdown(self):
            if report.first_shutdown(self):
                super().shutdown()

    class MetricExporter(OTLPMetricExporter):
        def export(self, metrics_data, timeout_millis: float | None = 10000, **kwargs):
            result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            if result.name != "SUCCESS":
                report.failed("metrics", 1)
            return result

        def shutdown(self, timeout_millis: float = 30_000, **kwargs):
            if report.first_shutdown(self):
                super().shutdown(timeout_millis=timeout_millis, **kwargs)

    return SpanExporter(endpoint=traces_url), MetricExporter(endpoint=metrics_url)


class Observability:
    """The observability options of one ``aioslirp`` run.

    ``trace_file``: path of the JSON-lines span file; ``otlp_endpoint``: OTLP/HTTP base URL
    (spans and metrics); ``pcap``: capture file; ``pcap_max_bytes``: bound of the capture
    file in bytes (``None``: unbounded). :meth:`check` validates them (raises
    :class:`ConfigError` naming the option); :meth:`start` sets the exporters up (and
    tries a zero-byte write to the ``--trace``/``--pcap`` files: :class:`ConfigError` when
    that fails); :meth:`stack_factory` makes stacks with the capture and metrics attached;
    :meth:`shutdown` flushes everything (idempotent; the OTLP endpoint gets at most
    :data:`OTLP_SHUTDOWN_TIMEOUT` seconds). Export failures while running are one warning
    line each (the trace file; the OTLP endpoint), never an exception.
    """

    def __init__(self, *, trace_file: str | None = None, otlp_endpoint: str | None = None,
                 pcap: str | None = None, pcap_max_bytes: int | None = None) -> None:
        self.trace_file = trace_file
        self.otlp_endpoint = otlp_endpoint
        self.pcap = pcap
        self.pcap_max_bytes = pcap_max_bytes
        self.tracer_provider = None
        self.meter_provider = None
        self.file_exporter = None
        self.otlp_report: _OtlpReport | None = None
        self.stacks: list = []
        self.pcap_writer = None
        self._file_bsp = None
        self._otlp_exporters: tuple = ()
        self._started = False
        self._shut = False

    @classmethod
    def from_args(cls, args) -> "Observability":
        """From the parsed CLI options (``trace``, ``otlp_endpoint``, ``pcap``, ``pcap_max_bytes``)."""
        return cls(trace_file=getattr(args, "trace", None), otlp_endpoint=getattr(args, "otlp_endpoint", None),
                   pcap=getattr(args, "pcap", None), pcap_max_bytes=getattr(args, "pcap_max_bytes", None))

    @property
    def active(self) -> bool:
        return bool(self.trace_file or self.otlp_endpoint or self.pcap)

    def check(self) -> None:
        """Validate the options without side effects beyond probing imports. Raises :class:`ConfigError`."""
        if self.pcap_max_bytes is not None and self.pcap_max_bytes < 24 + 16:
            raise ConfigError("--pcap-max-bytes", f"{self.pcap_max_bytes} is too small (at least 40 bytes)")
        if self.pcap_max_bytes is not None and not self.pcap:
            raise ConfigError("--pcap-max-bytes", "needs --pcap FILE")
        for option, path in (("--trace", self.trace_file), ("--pcap", self.pcap)):
            if path is None:
                continue
            parent = os.path.dirname(os.path.abspath(path)) or "."
            if os.path.isdir(path):
                raise ConfigError(option, f"{path!r} is a directory")
            if not os.path.isdir(parent):
                raise ConfigError(option, f"directory {parent!r} does not exist")
            if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
                raise ConfigError(option, f"cannot write {path!r}: permission denied")
        if self.trace_file or self.otlp_endpoint:
            option = "--otlp-endpoint" if self.otlp_endpoint else "--trace"
            try:
                import opentelemetry.sdk.trace  # noqa: F401
            except ImportError:
                raise ConfigError(option, f"needs the OpenTelemetry SDK: {_OTLP_HINT}") from None
        if self.otlp_endpoint:
            otlp_urls(self.otlp_endpoint)
            try:
                import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
            except ImportError:
                raise ConfigError("--otlp-endpoint", f"needs the otlp extra: {_OTLP_HINT}") from None

    def start(self) -> None:
        """Create the providers and exporters (the stacks of :meth:`stack_factory` are traced). Raises :class:`ConfigError`."""
        if self._started:
            return
        self.check()
        self._started = True
        if self.pcap:
            from ..transport.pcap import PcapWriter

            try:
                probe_writable(self.pcap)
                self.pcap_writer = PcapWriter(self.pcap, max_bytes=self.pcap_max_bytes)
            except OSError as exc:
                raise ConfigError("--pcap", f"cannot write {self.pcap!r}: {exc.strerror}") from None
        if not (self.trace_file or self.otlp_endpoint):
            return
        from opentelemetry.sdk.trace import TracerProvider

        resource = _resource()
        if not self.otlp_endpoint:  # the file alone: the direct sink, no SDK span per span
            try:
                probe_writable(self.trace_file)
                self.tracer_provider = JsonLinesSink(self.trace_file, resource=dict(resource.attributes),
                                                     label=f"--trace {self.trace_file}")
            except OSError as exc:
                raise ConfigError("--trace", f"cannot write {self.trace_file!r}: {exc.strerror or exc}") from None
            return
        # No atexit hooks: shutdown() flushes, with a bound on the OTLP endpoint's time.
        tp = TracerProvider(resource=resource, shutdown_on_exit=False)
        if self.trace_file:
            try:
                probe_writable(self.trace_file)
                self.file_exporter = JsonLinesSpanExporter(self.trace_file, label=f"--trace {self.trace_file}")
            except OSError as exc:
                raise ConfigError("--trace", f"cannot write {self.trace_file!r}: {exc.strerror or exc}") from None
            self._file_bsp = _bsp(self.file_exporter)
            tp.add_span_processor(self._file_bsp)
        if self.otlp_endpoint:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            traces_url, metrics_url = otlp_urls(self.otlp_endpoint)
            self.otlp_report = _OtlpReport(self.otlp_endpoint)
            self.otlp_report.install()
            span_exporter, metric_exporter = _otlp_exporters(traces_url, metrics_url, self.otlp_report)
            self._otlp_exporters = (span_exporter, metric_exporter)
            tp.add_span_processor(_bsp(span_exporter))
            reader = PeriodicExportingMetricReader(metric_exporter)
            self.meter_provider = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)
        self.tracer_provider = tp  # each stack of stack_factory() traces through it

    def stack_factory(self, base=None):
        """A ``stack_factory(config)`` for :func:`aioslirp.frontends.netns.run_in_namespace` / ``attach``:
        builds the stack with ``base`` (default :class:`~aioslirp.stack.Stack`), traced through
        :attr:`tracer_provider` when there is one, then adds the pcap wrapper and registers the
        metrics."""

        def factory(config):
            if base is None:
                from ..stack import Stack

                make = Stack
            else:
                make = base
            tp = self.tracer_provider
            stack = make(config) if tp is None else make(config, tracer_provider=tp)
            self.stacks.append(stack)
            if self.pcap_writer is not None:
                from ..transport.pcap import PcapTransport

                writer = self.pcap_writer
                stack.transport_wrappers.append(lambda transport: PcapTransport(transport, writer=writer))
            if self.meter_provider is not None:
                from ..observe.metrics import register

                register(stack, self.meter_provider)
            return stack

        return factory

    def shutdown(self) -> None:
        """End open flow spans, flush and close the exporters and captures. Idempotent; never raises."""
        if self._shut:
            return
        self._shut = True
        if self.pcap_writer is not None:
            try:
                self.pcap_writer.close()
            except Exception:  # pragma: no cover - defensive
                log.exception("closing the pcap capture failed")
        if self.tracer_provider is not None:
            try:
                for stack in self.stacks:  # end the spans of flows still open
                    if stack.tracer is not None:
                        stack.tracer.end_all()
                if self.otlp_report is None:
                    self.tracer_provider.shutdown()
                elif self._file_bsp is not None:
                    self._file_bsp.shutdown()  # the local file first, completely
            except Exception:  # pragma: no cover - defensive
                log.exception("flushing spans failed")
        if self.otlp_report is not None:
            self._shutdown_otlp()
        elif self.meter_provider is not None:  # pragma: no cover - metrics come with OTLP only
            try:
                self.meter_provider.shutdown()
            except Exception:
                log.exception("flushing metrics failed")

    def _shutdown_otlp(self) -> None:
        """Flush spans and metrics to the OTLP endpoint for at most :data:`OTLP_SHUTDOWN_TIMEOUT` s.

        The SDK retries a failing export with backoff for up to ``OTEL_EXPORTER_OTLP_TIMEOUT``
        (10 s) per batch and signal; here the flush runs on a daemon thread, and when the
        bound passes the exporters are shut down (which ends their retry waits) and what is
        left is dropped, with one warning line naming the endpoint.
        """
        report = self.otlp_report
        providers = [p for p in (self.tracer_provider, self.meter_provider) if p is not None]

        def flush() -> None:
            for provider in providers:
                try:
                    provider.shutdown()
                except Exception as exc:  # pragma: no cover - defensive
                    log.debug("OTLP flush: %s", exc)

        thread = threading.Thread(target=flush, name="aioslirp-otlp-flush", daemon=True)
        thread.start()
        thread.join(OTLP_SHUTDOWN_TIMEOUT)
        if thread.is_alive():
            for exporter in self._otlp_exporters:
                try:
                    exporter.shutdown()
                except Exception as exc:  # pragma: no cover - defensive
                    log.debug("OTLP exporter shutdown: %s", exc)
            thread.join(0.5)
            report.gave_up(OTLP_SHUTDOWN_TIMEOUT)
        if not thread.is_alive():
            report.uninstall()
