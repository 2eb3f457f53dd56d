"""Frame-level trace points around a transport: :class:`TraceTransport`.

It wraps the transport a traced stack serves (``Stack.serve`` adds it, outermost, when the
stack has a tracer), as :class:`~aioslirp.transport.pcap.PcapTransport` wraps one for a
capture (smoltcp's ``Tracer`` over a ``Device``). Each ``send_frames`` is timed and told to
the stack's :class:`~aioslirp.tracing.Tracer` afterwards (``on_drain``: the
``drain_to_guest`` and ``writer_wake`` spans). Frames from the guest pass through untouched:
their ``process_guest_frame`` spans are recorded by the link after each frame's dispatch,
since they need the flow the dispatch found and a time per frame, not per batch.
"""

from __future__ import annotations

import time
from typing import Sequence

from .base import Transport

__all__ = ["TraceTransport"]

_now = time.time_ns


class TraceTransport(Transport):
    """Wrap ``inner``; after each :meth:`send_frames`, call ``tracer.on_drain(frames, t0)``
    (``t0``: ``time.time_ns()`` before the write). Delegates everything else to ``inner``;
    :attr:`closed` is the inner transport's."""

    __slots__ = ("inner", "tracer")

    inner: Transport
    #: The stack's :class:`~aioslirp.tracing.Tracer`.
    tracer: object

    def __init__(self, inner: Transport, tracer) -> None:
        super().__init__()
        self.inner = inner
        self.tracer = tracer

    async def open(self, on_frames) -> None:
        self._on_frames = on_frames
        await self.inner.open(on_frames)
        self.closed = self.inner.closed

    @property
    def offload(self) -> bool:
        """The inner transport's checksum/segmentation offload (see :class:`~aioslirp.transport.tap.TapTransport`)."""
        return bool(getattr(self.inner, "offload", False))

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Hand ``frames`` to the inner transport, then tell the tracer."""
        t0 = _now()
        self.inner.send_frames(frames)
        self.tracer.on_drain(frames, t0)

    @property
    def frames_in(self) -> int:  # type: ignore[override]
        return self.inner.frames_in

    @frames_in.setter
    def frames_in(self, value) -> None:
        pass

    @property
    def frames_out(self) -> int:  # type: ignore[override]
        return self.inner.frames_out

    @frames_out.setter
    def frames_out(self, value) -> None:
        pass

    @property
    def send_errors(self) -> int:  # type: ignore[override]
        return self.inner.send_errors

    @send_errors.setter
    def send_errors(self, value) -> None:
        pass

    def close(self, exc: BaseException | None = None) -> None:
        """Close the inner transport. Idempotent."""
        self.inner.close(exc)

    def _close_io(self) -> None:  # pragma: no cover - close() is overridden
        self.inner.close()
