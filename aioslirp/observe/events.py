"""A stack's lifecycle events, and their bounded record.

The front ends ask a stack to stop with :func:`request_stop`, which also stops a stack of one's
own written for 0.1 (``close()``).

:class:`EventLog` is a stack's bounded record of its lifecycle events (:class:`Event`:
``ready``, ``guest_link_up``, ``guest_link_down``, ``error``), followed with
:meth:`Stack.events() <aioslirp.stack.Stack.events>` or :meth:`Stack.on_event()
<aioslirp.stack.Stack.on_event>` and written as JSON lines by ``--events FILE``.

Ending a guest's session cleanly is the stack's own work (:meth:`Stack.farewell
<aioslirp.stack.Stack.farewell>`); why a transport ended before the guest's first frame, its own
(:meth:`Transport.gone_before_first_frame <aioslirp.transport.base.Transport.gone_before_first_frame>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["EVENT_HISTORY", "EVENT_NAMES", "Event", "EventFile", "EventLog"]

log = logging.getLogger("aioslirp.stack")  # the stack's logger, as before the move

#: Event names, and gvisor-tap-vsock's (gvproxy's) notification for the same moment.
EVENT_NAMES = {
    "ready": "Ready",  # serve() started: the transport is open, frames are read
    "guest_link_up": "ConnectionEstablished",  # the first guest frame on that transport
    "guest_link_down": "ConnectionClosed",  # the transport closed (the guest went away, or a stop)
    "error": "HypervisorError",  # serving failed, or the transport closed with an error
}

#: Events kept for :meth:`EventLog.events` (the oldest is dropped, and counted, beyond it).
EVENT_HISTORY = 256


@dataclass(frozen=True, slots=True)
class Event:
    """One lifecycle event of a stack.

    Attributes:
        name: ``"ready"``, ``"guest_link_up"``, ``"guest_link_down"`` or ``"error"`` (:data:`EVENT_NAMES`).
        seq: 1, 2, ... per stack, in the order they happened.
        time: wall-clock time, seconds since the epoch (``time.time()``).
        data: details, JSON-ready: ``transport`` (its class name) for all; ``ifname`` when known;
            ``reason`` for ``guest_link_down`` (``"closed"``: the transport closed, the guest went
            away; ``"stopped"``: :meth:`Stack.stop <aioslirp.stack.Stack.stop>`); ``message``
            (one line) for ``error``; ``guest_name`` and ``labels`` (a ``dict``) for all, when the
            stack was given them (``Stack(name=..., labels=...)``).
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
    synchronously when an event is emitted (an exception is logged, never raised). ``fields``
    (e.g. the stack's ``guest_name`` and ``labels``) are added to every event's ``data``.
    """

    def __init__(self, maxlen: int = EVENT_HISTORY, *, fields: dict | None = None) -> None:
        #: What every event's ``data`` gets (the stack's ``identity.audit_fields``: ``guest_name``, ``labels``).
        self.fields = fields or {}
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
        if self.fields:
            data.update(self.fields)
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


class EventFile:
    """``--events FILE``: events appended to ``path`` as JSON lines (:meth:`Event.to_json`), one
    line each, flushed at once. Opening raises ``OSError``; a failed write (a full disk) is
    ignored: the guests' sessions go on. One file may take the events of many stacks
    (``stack.on_event(events_file.write)``): each line carries its guest's ``guest_name`` and ``labels``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._out = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, ev: Event) -> None:
        """Append ``ev`` as one line."""
        try:
            self._out.write(json.dumps(ev.to_json()) + "\n")
        except (OSError, ValueError):  # a full disk, a closed file
            pass

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._out.close()
