"""Ending a guest's session cleanly.

:func:`farewell` runs while the guest's link is still up, when the stack is asked to stop
(SIGINT/SIGTERM of ``aioslirp attach`` / ``aioslirp qemu``, :meth:`Stack.close
<aioslirp.stack.Stack.close>`, the grace period of ``aioslirp run`` running out): every TCP
flow is reset towards the guest (an RST the guest's applications see as ECONNRESET instead
of a connection that hangs until its own timeout) and its host socket is closed with a RST
to the host peer; UDP and ICMP flows close their sockets; with IPv6 the final Router
Advertisement withdraws the default route (RFC 4861 6.2.5). Then those frames are written to
the transport at once (:meth:`InjectQueue.drain <aioslirp.inject.InjectQueue.drain>`), which the
caller closes afterwards.

When the guest itself went away (the TAP's process exited, QEMU disconnected) there is no
one to tell: the flows are torn down without it (:meth:`Stack.aclose`, :meth:`Stack.reset_flows`).

:class:`EventLog` is a stack's bounded record of its lifecycle events (:class:`Event`:
``ready``, ``guest_link_up``, ``guest_link_down``, ``error``), followed with
:meth:`Stack.events() <aioslirp.stack.Stack.events>` or :meth:`Stack.on_event()
<aioslirp.stack.Stack.on_event>`.

``aioslirp run``'s SIGTERM handling (:class:`~aioslirp.host.signals.GracefulStop`) is host
plumbing, in :mod:`aioslirp.host.signals`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["EVENT_NAMES", "Event", "EventLog", "farewell", "gone_before_first_frame"]

log = logging.getLogger("aioslirp.stack")


async def farewell(stack) -> int:
    """Reset every flow towards the guest, withdraw the IPv6 router, let the writer flush.

    Returns the number of flows torn down. Never raises for a flow that fails to shut down
    (logged by :meth:`Stack.reset_flows`). The transport must still be open for the guest to
    see anything; closing it is the caller's job. The frames are written to the transport without
    waiting.
    """
    n = stack.reset_flows()
    stack.counters["flows_reset_at_stop"] += n
    if stack.v6 is not None:
        stack.v6.final_ra()
    await stack.inject_queue.drain()  # written to the transport now, then one loop iteration
    return n


# --------------------------------------------------------------------------------------------
# lifecycle events (Stack.events(), Stack.on_event(), ``--events FILE``)

#: Event names, and gvisor-tap-vsock's (gvproxy's) notification for the same moment.
EVENT_NAMES = {
    "ready": "Ready",  # serve() started: the transport is open, frames are read
    "guest_link_up": "ConnectionEstablished",  # the first guest frame on that transport
    "guest_link_down": "ConnectionClosed",  # the transport closed (the guest went away, or a stop)
    "error": "HypervisorError",  # serving failed, or the transport closed with an error
}

#: Events kept for :meth:`EventLog.events` (the oldest is dropped, and counted, beyond it).
EVENT_HISTORY = 256

#: What to check, by transport class, when its other end is gone before the guest sent a frame.
_GONE_HINTS = {
    "SocketPairTransport": "the other socket of the pair stays open in the guest (hand it over, e.g. with "
                           "subprocess pass_fds=, before this process closes its copy)",
    "StreamTransport": "QEMU (-netdev stream) is still running and connected to this socket (QEMU's own "
                       "output says why it left), or that the other end of the socket is still open",
    "DgramTransport": "QEMU (-netdev dgram) is running and its remote= address is this socket's",
    "TapTransport": "the TAP device still exists (ip link show {ifname}) and the namespace holding it "
                    "was not removed",
}


def gone_before_first_frame(transport, exc: BaseException | None = None) -> str | None:
    """One line naming why ``transport`` ended before the guest sent a frame and what to check, or
    ``None`` when the other end did not end it (:attr:`~aioslirp.transport.base.Transport.close_reason`
    ``"closed"``: closed from this side; ``"guest_exited"``: the guest process ended)."""
    why = getattr(transport, "close_reason", None)
    if why not in ("eof", "error", "frame_too_large"):
        return None
    kind = type(transport).__name__
    label = getattr(transport, "ifname", None) or getattr(transport, "name", None)
    if why == "eof":
        cause = "the other end closed (EOF)"
    elif why == "frame_too_large":
        cause = f"the guest sent a frame too large ({exc})"
    else:
        cause = f"{type(exc).__name__}: {exc}" if exc is not None else "a read or write failed"
    hint = _GONE_HINTS.get(kind, "the guest holds the other end open").format(ifname=label or "IFNAME")
    text = f"{kind}{f' {label}' if label else ''} closed before the guest sent a frame: {cause}; check that {hint}"
    return " ".join(text.split())


@dataclass(frozen=True, slots=True)
class Event:
    """One lifecycle event of a stack.

    Attributes:
        name: ``"ready"``, ``"guest_link_up"``, ``"guest_link_down"`` or ``"error"`` (:data:`EVENT_NAMES`).
        seq: 1, 2, ... per stack, in the order they happened.
        time: wall-clock time, seconds since the epoch (``time.time()``).
        data: details, JSON-ready: ``transport`` (its class name) for all; ``ifname`` when known;
            ``reason`` for ``guest_link_down`` (``"closed"``: the transport closed, the guest went
            away; ``"stopped"``: :meth:`Stack.close <aioslirp.stack.Stack.close>`); ``message``
            (one line) for ``error``.
    """

    name: str
    seq: int
    time: float
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """``{"event": name, "gvproxy": gvproxy's name, "seq": int, "time": float, **data}``."""
        return {"event": self.name, "gvproxy": EVENT_NAMES.get(self.name), "seq": self.seq, "time": self.time,
                **self.data}


class EventLog:
    """The bounded record of a stack's lifecycle events and the ways to follow it.

    At most ``maxlen`` events are kept (the oldest is dropped beyond it, counted in
    :attr:`dropped`), so that no reader, or one that never reads, can make it grow. Callbacks run
    synchronously when an event is emitted (an exception is logged, never raised).
    """

    def __init__(self, maxlen: int = EVENT_HISTORY) -> None:
        self._ring: deque = deque(maxlen=max(1, int(maxlen)))
        self._seq = 0
        #: Events dropped from the history because it was full.
        self.dropped = 0
        self._callbacks: list = []
        self._waiters: set = set()
        self._closed = False

    def emit(self, name: str, **data) -> Event:
        """Record event ``name`` with ``data`` (JSON-ready values); wake readers; run callbacks."""
        self._seq += 1
        ev = Event(name, self._seq, time.time(), data)
        if len(self._ring) == self._ring.maxlen:
            self.dropped += 1
        self._ring.append(ev)
        self._wake()
        for cb in list(self._callbacks):
            try:
                cb(ev)
            except Exception:
                log.exception("event callback %r failed", cb)
        return ev

    def on_event(self, callback) -> "Callable[[], None]":
        """Call ``callback(event)`` for every event from now on; returns a function that removes it."""
        self._callbacks.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return remove

    def close(self) -> None:
        """No more events: iterators end once they have yielded what is kept."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def history(self) -> list:
        """The events kept, oldest first."""
        return list(self._ring)

    async def events(self, history: bool = True):
        """Async iterator of events: those kept first (with ``history``), then each new one as it
        happens; ends when the stack closes. A reader slower than :data:`EVENT_HISTORY` events
        misses the oldest (see :attr:`dropped`), it never holds memory."""
        cursor = 0 if history else self._seq
        while True:
            new = [ev for ev in self._ring if ev.seq > cursor]
            if new:
                for ev in new:
                    cursor = ev.seq
                    yield ev
                continue
            if self._closed:
                return
            fut = asyncio.get_running_loop().create_future()
            self._waiters.add(fut)
            try:
                await fut
            finally:
                self._waiters.discard(fut)
