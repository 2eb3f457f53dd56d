"""The audit log: one JSON record per flow at its end, per denial and per DNS decision.

An :class:`AuditLog` takes records (``dict``, JSON-ready) through :meth:`AuditLog.record` and

* writes each as one JSON line to its sink, a path (``"-"``: stderr) or a text file object,
  buffered: lines leave in one ``write`` when :data:`FLUSH_LINES` are pending or
  :data:`FLUSH_INTERVAL` seconds after the first one (a loop timer), and at :meth:`close`;
* offers each to the async iterators of :meth:`AuditLog.events` (``Stack.audit_records()``),
  each with a bounded queue: a reader that falls behind loses the *oldest* records, counted in
  :attr:`AuditLog.records_dropped` and the stack counter ``audit.records_dropped``.

The stack hands it to the flows as ``ctx.audit`` and to the flow table, whose one exit
(``FlowTable.remove``) calls :meth:`AuditLog.flow_ended`: a dict and a list append per flow,
nothing per frame. Addresses are kept as bytes until a record is written or read (then
text). Log rotation: :meth:`AuditLog.reopen` (the CLI calls it on SIGHUP), and a path whose
file was renamed or removed is reopened at the next write (``logrotate`` without
``copytruncate`` works either way).

The record format (every field and unit) is in docs/audit.md.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import sys
import time

from ..ratelimit import TokenBucket

__all__ = ["AuditLog", "FLUSH_INTERVAL", "FLUSH_LINES", "EVENTS_QUEUE"]

log = logging.getLogger("aioslirp.audit")

#: Seconds a written record may wait in the buffer before it is written out.
FLUSH_INTERVAL = 0.2
#: Records pending that make a write at once.
FLUSH_LINES = 256
#: Default bound of each :meth:`AuditLog.events` reader's queue, records.
EVENTS_QUEUE = 4096
#: Denial and DNS records (``deny``, ``dns``) per second a guest can cause, and the burst
#: saved: beyond them such records are not written but counted (``audit.records_suppressed``),
#: so a guest flooding denied destinations or DNS queries cannot grow the log without bound
#: (each denial is still counted by the policy: ``drop.egress_denied``, ``egress.*``). Flow
#: records are never suppressed (their rate is the new-flow rate's).
DECISION_RATE = 100.0
DECISION_BURST = 200.0

_ADDR_FIELDS = ("guest", "dst")


def _cook(rec: dict) -> dict:
    """Addresses kept as bytes (4 or 16) -> text, in place; returns ``rec``."""
    for k in _ADDR_FIELDS:
        v = rec.get(k)
        if v.__class__ is bytes:
            rec[k] = socket.inet_ntop(socket.AF_INET6 if len(v) == 16 else socket.AF_INET, v)
    return rec


class _Reader:
    """One reader of :meth:`AuditLog.events`: an async iterator over its own bounded queue.

    Subscribed from creation (records taken after ``events()`` returned are kept for it, even
    before the first ``async for`` step); :meth:`aclose` unsubscribes, and the iteration ends
    after the queued records once the log is closed.
    """

    __slots__ = ("log", "queue", "waiter", "closed")

    log: AuditLog
    queue: collections.deque
    waiter: asyncio.Future | None
    closed: bool

    def __init__(self, audit: AuditLog, maxlen: int) -> None:
        self.log = audit
        self.queue = collections.deque(maxlen=maxlen)
        self.waiter = None
        self.closed = False

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> "_Reader":
        return self

    async def __anext__(self) -> dict:
        q = self.queue
        while not q:
            if self.closed:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return _cook(q.popleft())

    async def aclose(self) -> None:
        """Stop reading: unsubscribe (what is queued is forgotten)."""
        self.closed = True
        self.queue.clear()
        self.log.unsubscribe(self)
        self.wake()


class AuditLog:
    """Where audit records go: a JSON-lines sink and/or :meth:`events` readers.

    Args:
        target: a path (``str`` or path-like; ``"-"``: stderr), a text file object (its
            ``write(str)`` and, if it has one, ``flush()`` are called; it is not closed), or
            ``None`` (no file: :meth:`events` readers only).
        flush_interval: seconds a record may wait before it is written (default 0.2).
        flush_lines: pending records that make a write at once (default 256).

    Raises:
        OSError: from the constructor when the path cannot be opened for appending.

    Attributes:
        records: records taken (``int``).
        records_dropped: records lost by slow :meth:`events` readers (each a reader's oldest).
        counters: the stack's ``Counter`` once :meth:`bind` ran (``audit.records``,
            ``audit.records_dropped``, ``audit.write_errors``), else a private one.
    """

    __slots__ = ("path", "_file", "_own", "_ino", "_pending", "_timer", "_loop", "_readers", "flush_interval",
                 "flush_lines", "records", "records_dropped", "counters", "closed", "_decisions")

    path: str | None
    _file: object
    _own: bool
    _ino: tuple | None
    _pending: list
    _timer: asyncio.TimerHandle | None
    _loop: asyncio.AbstractEventLoop | None
    _readers: list
    flush_interval: float
    flush_lines: int
    records: int
    records_dropped: int
    counters: dict
    closed: bool
    #: The bucket of ``deny`` / ``dns`` records (:data:`DECISION_RATE`).
    _decisions: TokenBucket

    def __init__(self, target=None, *, flush_interval: float = FLUSH_INTERVAL, flush_lines: int = FLUSH_LINES) -> None:
        self.path = None
        self._file = None
        self._own = False
        self._ino = None
        if target is not None and not hasattr(target, "write"):
            path = os.fspath(target)
            if path == "-":
                self._file = sys.stderr
            else:
                self.path = path
                self._open()
        else:
            self._file = target
        self._pending: list = []
        self._timer = None
        self._loop = None
        self._readers: list = []
        self.flush_interval = float(flush_interval)
        self.flush_lines = max(1, int(flush_lines))
        self.records = 0
        self.records_dropped = 0
        self.counters = collections.Counter()
        self.closed = False
        self._decisions = TokenBucket(DECISION_RATE, DECISION_BURST)

    # ------------------------------------------------------------------ set-up
    def bind(self, loop: asyncio.AbstractEventLoop | None, counters=None) -> None:
        """Run on ``loop`` (its timer flushes; ``None``: each record is written at once) and count
        in ``counters`` (the stack's). ``Stack.start`` calls it."""
        self._loop = loop
        if counters is not None:
            counters.update(self.counters)
            self.counters = counters

    def _open(self) -> None:
        f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held until close()
        self._file, self._own = f, True
        st = os.fstat(f.fileno())
        self._ino = (st.st_dev, st.st_ino)

    def reopen(self) -> None:
        """Close and reopen the path (log rotation; the CLI's SIGHUP). Pending records are written
        first, to the old file. Nothing for a file object or stderr."""
        if self.path is None or self.closed:
            return
        self.flush()
        old = self._file
        try:
            self._open()
        except OSError as exc:
            log.error("audit log: cannot reopen %s: %s", self.path, exc)
            self.counters["audit.write_errors"] += 1
            return
        if old is not None:
            try:
                old.close()
            except OSError:
                pass

    def _rotated(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._ino

    # ------------------------------------------------------------------ records
    def record(self, rec: dict) -> None:
        """Take one record (a ``dict`` of JSON-ready values; ``"guest"`` / ``"dst"`` may be
        addresses as 4 or 16 bytes). Never raises for the sink: write errors are logged and
        counted ``audit.write_errors``."""
        if self.closed:
            return
        if rec.get("event") != "flow" and not self._decisions.take(time.monotonic()):
            self.counters["audit.records_suppressed"] += 1  # over DECISION_RATE: counted, not written
            return
        self.records += 1
        if self._file is not None:
            pending = self._pending
            pending.append(rec)
            if len(pending) >= self.flush_lines or self._loop is None:
                self.flush()
            elif self._timer is None:
                self._timer = self._loop.call_later(self.flush_interval, self.flush)
        for r in self._readers:
            q = r.queue
            if len(q) == q.maxlen:
                self.records_dropped += 1
                self.counters["audit.records_dropped"] += 1
            q.append(rec)
            r.wake()

    def flow_ended(self, flow) -> None:
        """The record of ``flow`` (a :class:`~aioslirp.flow.base.Flow`) leaving the flow table:
        called once per flow by ``FlowTable.remove``. See docs/audit.md for the fields."""
        loop = self._loop
        self.record({
            "event": "flow", "time": time.time(), "proto": flow.proto_name, "direction": flow.direction,
            "guest": flow.guest_ip, "guest_port": flow.guest_port, "dst": flow.dst_ip, "port": flow.dst_port,
            "name": flow.name, "verdict": "allow", "rule": flow.rule,
            "bytes_up": flow.bytes_up, "bytes_down": flow.bytes_down,
            "duration": (loop.time() - flow.started) if loop is not None else None, "end": flow.outcome,
        })

    def flush(self) -> None:
        """Write the pending records now (one ``write``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = self._pending
        if not pending or self._file is None:
            return
        self._pending = []
        try:
            text = "".join([json.dumps(_cook(r), separators=(",", ":"), default=str) + "\n" for r in pending])
            if self.path is not None and self._rotated():
                self.reopen()
            f = self._file
            f.write(text)
            fl = getattr(f, "flush", None)
            if fl is not None:
                fl()
        except (OSError, ValueError, TypeError) as exc:
            self.counters["audit.write_errors"] += 1
            log.error("audit log: write failed: %s", exc)

    def close(self) -> None:
        """Write what is pending, close the file if this log opened it, end the readers (after
        what they hold). Idempotent."""
        if self.closed:
            return
        self.flush()
        self.closed = True
        if self._own and self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self._file = None
        for r in self._readers:
            r.closed = True
            r.wake()
        self._readers = []

    # ------------------------------------------------------------------ readers
    def events(self, maxlen: int = EVENTS_QUEUE) -> _Reader:
        """An async iterator of the records taken from now on (the same dicts as written,
        addresses as text), until :meth:`close`. Its queue holds ``maxlen`` records; past that
        the oldest is lost (:attr:`records_dropped`). ``await it.aclose()`` unsubscribes."""
        r = _Reader(self, max(1, int(maxlen)))
        if self.closed:
            r.closed = True
        else:
            self._readers.append(r)
        return r

    def unsubscribe(self, reader: _Reader) -> None:
        """Take ``reader`` (one of :meth:`events`) off this log; it gets no more records. Idempotent."""
        if reader in self._readers:
            self._readers.remove(reader)
