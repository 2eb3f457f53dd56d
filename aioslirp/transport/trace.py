"""Frame-level trace points around a transport: :class:`TraceTransport`.

It wraps the transport a traced stack serves (``Stack.serve`` adds it, outermost, when the
stack has a tracer), as :class:`~aioslirp.transport.pcap.PcapTransport` wraps one for a
capture (smoltcp's ``Tracer`` over a ``Device``). Each ``send_frames`` is timed and told to
the stack's :class:`~aioslirp.observe.tracing.Tracer` afterwards (``record_drain``: the
``drain_to_guest`` and ``writer_wake`` spans). Frames from the guest pass through untouched:
their ``process_guest_frame`` spans are recorded by the link after each frame's dispatch,
since they need the flow the dispatch found and a time per frame, not per batch.
"""

from __future__ import annotations

import time
from typing import Sequence

from .base import Transport, TransportWrapper

__all__ = ["TraceTransport"]

_now = time.time_ns


class TraceTransport(TransportWrapper):
    """Wrap ``inner``; after each :meth:`send_frames`, call ``tracer.record_drain(frames, t0)``
    (``t0``: ``time.time_ns()`` before the write). Delegates everything else to ``inner``
    (:class:`~aioslirp.transport.base.TransportWrapper`); :attr:`closed` is the inner transport's."""

    __slots__ = ("tracer",)

    #: The stack's :class:`~aioslirp.observe.tracing.Tracer`.
    tracer: object

    def __init__(self, inner: Transport, tracer) -> None:
        super().__init__(inner)
        self.tracer = tracer

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Hand ``frames`` to the inner transport, then tell the tracer."""
        t0 = _now()
        self.inner.send_frames(frames)
        self.tracer.record_drain(frames, t0)
