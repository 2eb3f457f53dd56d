"""Transport interface: moves whole Ethernet frames between the guest and the stack.

A transport does I/O only, no protocol work. The stack calls :meth:`Transport.open`
with a callback that receives *batches* of frames (each a ``bytes`` object holding one
Ethernet frame, no preamble/FCS), and calls :meth:`Transport.send_frames` from its
single writer task with batches of frames for the guest.

When the transport ends (peer closed, fd error, :meth:`close`), :attr:`closed`
completes; ``Stack.serve()`` returns then.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from typing import Callable, ClassVar, Iterable, Protocol, Sequence

from ..inject import Frame

log = logging.getLogger("aioslirp.transport")

#: Largest frame any transport accepts or sends: 65,535-byte IP packet + Ethernet header + slack.
MAX_FRAME = 65535 + 14 + 64


class FrameSink(Protocol):
    """Where a transport delivers the guest's frames, a batch at a time: in a stack, the link's
    :meth:`Link.on_frames <aioslirp.dispatch.link.Link.on_frames>` (the first hop of the per-frame
    path). ``csum_ok`` (an offload TAP only): per frame, the guest's kernel vouched for its L4 checksum."""

    def __call__(self, frames: list[bytes], csum_ok: Iterable[bool] | None = None, /) -> None: ...


class Transport:
    """Base class. Subclasses implement :meth:`_start_reading`, :meth:`send_frames`, :meth:`_close_io`."""

    __slots__ = ("_on_frames", "_loop", "closed", "close_reason", "frames_in", "frames_out", "send_errors")

    _on_frames: FrameSink | None
    _loop: asyncio.AbstractEventLoop | None
    #: Resolved (with the exception or ``None``) when the transport closed; ``None`` before :meth:`open`.
    closed: asyncio.Future | None
    #: Why it closed: ``None`` while open; ``"closed"`` (:meth:`close` from outside: the stack, its
    #: owner); set by the transport before it closes itself: ``"eof"`` (the other end closed),
    #: ``"error"`` (a read or write failed), ``"frame_too_large"``, ``"guest_exited"`` (a watched
    #: process ended).
    close_reason: str | None
    frames_in: int
    frames_out: int
    send_errors: int
    #: What to check when the other end is gone before the guest sent a frame, the end of the line
    #: :meth:`gone_before_first_frame` gives (``{ifname}``: the transport's name); each transport
    #: names its own peer.
    gone_hint: ClassVar[str] = "the guest holds the other end open"

    def __init__(self) -> None:
        self._on_frames: FrameSink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed: asyncio.Future | None = None
        self.close_reason: str | None = None
        #: Frames and bytes moved, for counters.
        self.frames_in = 0
        self.frames_out = 0
        self.send_errors = 0

    async def open(self, on_frames: FrameSink) -> None:
        """Start delivering guest frames to ``on_frames(list_of_bytes)``. Called once by the stack."""
        self._loop = asyncio.get_running_loop()
        self.closed = self._loop.create_future()
        self._on_frames = on_frames
        await self._start_reading()

    def swap_sink(self, old: FrameSink, new: FrameSink) -> bool:
        """Deliver guest frames to ``new`` from now on if they go to ``old`` now; returns whether
        it swapped (a wrapper's inner transport delivers to the wrapper, not to ``old``)."""
        if self._on_frames is old:
            self._on_frames = new
            return True
        return False

    async def _start_reading(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def guest_reader(self) -> tuple[int, Callable[[], None]] | None:
        """The fd the loop watches for the guest's frames and the callback it runs when that fd
        is readable (a spurious call reads nothing and returns), while reading; ``None`` when the
        transport reads otherwise. The fair scheduler's express lane (:mod:`aioslirp.fair`)
        watches the same fd to serve a light guest ahead of a flooding one."""
        return None

    def send_frames(self, frames: Sequence[Frame]) -> None:  # pragma: no cover - abstract
        """Write ``frames`` to the guest, in order. Never raises for I/O errors: counts and logs them."""
        raise NotImplementedError

    def _close_io(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self, exc: BaseException | None = None) -> None:
        """Stop I/O and release the fd/socket. Idempotent."""
        if self.closed is not None and self.closed.done():
            return
        if getattr(self, "close_reason", None) is None:  # a subclass may not call __init__
            self.close_reason = "closed"
        try:
            self._close_io()
        finally:
            if self.closed is not None and not self.closed.done():
                self.closed.set_result(exc)

    def gone_before_first_frame(self, exc: BaseException | None = None) -> str | None:
        """One line naming why this transport ended before the guest sent a frame and what to
        check (:attr:`gone_hint`), or ``None`` when the other end did not end it (:attr:`close_reason`
        ``"closed"``: closed from this side; ``"guest_exited"``: the guest process ended). ``exc``:
        what :attr:`closed` completed with. ``Stack.serve`` logs it and emits it as an ``error`` event."""
        why = getattr(self, "close_reason", None)
        if why not in ("eof", "error", "frame_too_large"):
            return None
        kind = type(self).__name__
        label = getattr(self, "ifname", None) or getattr(self, "name", None)
        if why == "eof":
            cause = "the other end closed (EOF)"
        elif why == "frame_too_large":
            cause = f"the guest sent a frame too large ({exc})"
        else:
            cause = f"{type(exc).__name__}: {exc}" if exc is not None else "a read or write failed"
        hint = self.gone_hint.format(ifname=label or "IFNAME")
        text = f"{kind}{f' {label}' if label else ''} closed before the guest sent a frame: {cause}; check that {hint}"
        return " ".join(text.split())


class TransportWrapper(Transport):
    """A transport in front of another one (middleware, as smoltcp's ``Tracer`` and
    ``PcapWriter`` wrap a ``Device``): everything is delegated to ``inner`` (its :attr:`closed`,
    counters and offload are this one's); a subclass overrides what it observes:
    :meth:`_guest_sink` for frames from the guest, :meth:`send_frames` for frames to it."""

    __slots__ = ("inner",)

    inner: Transport

    def __init__(self, inner: Transport) -> None:
        super().__init__()
        self.inner = inner

    async def open(self, on_frames: FrameSink) -> None:
        self._on_frames = on_frames
        await self.inner.open(self._guest_sink(on_frames))
        self._loop = asyncio.get_running_loop()  # the loop the inner transport opened on
        self.closed = self.inner.closed

    def _guest_sink(self, on_frames: FrameSink) -> FrameSink:
        """The callback the inner transport delivers guest frames to (default: ``on_frames`` itself)."""
        return on_frames

    def send_frames(self, frames: Sequence[Frame]) -> None:
        """Hand ``frames`` to the inner transport."""
        self.inner.send_frames(frames)

    @property
    def offload(self) -> bool:
        """The inner transport's checksum/segmentation offload (see :class:`~aioslirp.transport.tap.TapTransport`)."""
        return bool(getattr(self.inner, "offload", False))

    # The counters are the inner transport's (Transport.__init__ sets them: ignored here).
    frames_in = property(lambda self: self.inner.frames_in, lambda self, value: None)  # type: ignore[assignment]
    frames_out = property(lambda self: self.inner.frames_out, lambda self, value: None)  # type: ignore[assignment]
    send_errors = property(lambda self: self.inner.send_errors, lambda self, value: None)  # type: ignore[assignment]

    def close(self, exc: BaseException | None = None) -> None:
        """Close the inner transport. Idempotent."""
        self.inner.close(exc)

    def _close_io(self) -> None:  # pragma: no cover - close() is overridden
        self.inner.close()


class SocketTransport(Transport):
    """Common part of the socket transports (:class:`~aioslirp.transport.stream.StreamTransport`,
    :class:`~aioslirp.transport.dgram.DgramTransport`) over ``sock`` (non-blocking from here on; the
    transport owns it): reading starts with ``add_reader`` on ``self._fd`` (``-1``: already closed,
    :attr:`closed` completes at once) calling ``self._readable``; what the socket does not take now
    waits in ``_out`` (``bytes_buffered`` bytes, at most ``max_buffer``), drained by ``self._writable``
    between :meth:`_start_writer` and :meth:`_stop_writer`; frames that cannot be sent are counted by
    reason in ``send_drops`` and ``send_errors``, and the first drop because more than ``max_buffer``
    bytes wait is logged. ``name``: label for log lines (default: ``fd N``)."""

    __slots__ = ("sock", "_fd", "name", "max_buffer", "send_drops", "_out", "bytes_buffered", "_writing")

    sock: socket.socket
    _fd: int
    name: str
    max_buffer: int
    send_drops: dict
    #: Buffers (frames, or prefixes and frames) not yet sent.
    _out: collections.deque
    #: Bytes now waiting in ``_out``.
    bytes_buffered: int
    #: ``_writable`` is registered with the loop.
    _writing: bool

    def __init__(self, sock: socket.socket, max_buffer: int, name: str | None) -> None:
        super().__init__()
        self.sock = sock
        self.max_buffer = max_buffer
        self.name = name or f"fd {sock.fileno()}"
        self.send_drops: dict[str, int] = {}
        self._out: collections.deque = collections.deque()
        self.bytes_buffered = 0
        self._writing = False
        self._fd = sock.fileno()
        sock.setblocking(False)

    async def _start_reading(self) -> None:
        if self._fd < 0:
            if self.closed is not None and not self.closed.done():
                self.closed.set_result(None)
            return
        self._loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def guest_reader(self) -> tuple[int, Callable[[], None]] | None:
        """See :meth:`Transport.guest_reader`: the socket and its read callback."""
        if self._fd < 0 or self.closed is None or self.closed.done():
            return None
        return self._fd, self._readable

    def _writable(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _start_writer(self) -> None:
        """Drain ``_out`` when the socket has room (``loop.add_writer``), unless it does already or is closed."""
        if not self._writing and self._fd >= 0:
            self._writing = True
            self._loop.add_writer(self._fd, self._writable)

    def _stop_writer(self) -> None:
        """Stop waiting for room (``_out`` is drained, or given up)."""
        if self._writing:
            self._writing = False
            if self._fd >= 0:
                self._loop.remove_writer(self._fd)

    def _drop(self, reason: str, n: int) -> None:
        self.send_errors += n
        first = reason not in self.send_drops
        self.send_drops[reason] = self.send_drops.get(reason, 0) + n
        if first and reason == "full":
            log.warning("%s: the guest is not reading; dropping frames beyond %d buffered bytes (counted in send_drops)",
                        self.name, self.max_buffer)

