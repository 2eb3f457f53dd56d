"""Trace points as OpenTelemetry spans, gated by one module-level boolean.

With tracing off (the default) every call site costs one attribute look-up of
:data:`enabled`. :func:`enable` turns the trace points on; spans then go to the
OpenTelemetry tracer provider configured by the application (API only here).
"""

from __future__ import annotations

import contextlib

#: True when trace points record spans. Read at each call site: ``if tracing.enabled:``.
enabled = False
_tracer = None


def enable(tracer_provider=None) -> None:
    """Record spans for the stack's trace points (through ``tracer_provider`` or the global one)."""
    global enabled, _tracer
    from opentelemetry import trace

    _tracer = trace.get_tracer("aioslirp", tracer_provider=tracer_provider)
    enabled = True


def disable() -> None:
    """Stop recording spans."""
    global enabled
    enabled = False


def span(name: str, attributes: dict | None = None):
    """A context manager recording span ``name`` (a no-op context when tracing is off)."""
    if not enabled or _tracer is None:
        return contextlib.nullcontext()
    return _tracer.start_as_current_span(name, attributes=attributes)
