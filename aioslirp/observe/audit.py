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

__all__ = ["AuditLog", "GuestAudit", "DECISION_BURST", "DECISION_RATE", "EVENTS_QUEUE", "FIRST_KEYS", "FIRST_WINDOW",
           "FLUSH_INTERVAL", "FLUSH_LINES", "SUMMARY_DELAY"]

log = logging.getLogger("aioslirp.audit")

#: Seconds a written record may wait in the buffer before it is written out.
FLUSH_INTERVAL = 0.2
#: Records pending that make a write at once.
FLUSH_LINES = 256
#: Default bound of each :meth:`AuditLog.events` reader's queue, records.
EVENTS_QUEUE = 4096
#: Denial and DNS records (``deny``, ``dns``) per second a guest can cause, and the burst
#: saved, *per kind* (a DNS flood does not spend the budget of denials): beyond them such
#: records are not written but counted (``audit.records_suppressed``), so a guest flooding
#: denied destinations or DNS queries cannot grow the log without bound (each denial is still
#: counted by the policy: ``drop.egress_denied``, ``egress.*``). Flow records are never
#: suppressed (their rate is the new-flow rate's).
DECISION_RATE = 100.0
DECISION_BURST = 200.0
#: The first record of a new key (``deny``: destination, port and rule; ``dns``: name, query
#: type and rule) is written whatever the budget, so a flood of other records cannot hide it:
#: keys remembered at most, per kind, and the seconds after which they are forgotten (so at
#: most FIRST_KEYS such records per kind per FIRST_WINDOW beyond the rate, and a key seen again
#: after the window is written again).
FIRST_KEYS = 4096
FIRST_WINDOW = 60.0
#: Seconds after a record was suppressed (the first since the last summary) when a ``suppressed``
#: record sums up what was held back: so at most one such record per kind a second.
SUMMARY_DELAY = 1.0
#: Kinds of decision record with a budget of their own; more kinds share one.
MAX_KINDS = 8

_ADDR_FIELDS = ("guest", "dst")


def _cook(rec: dict) -> dict:
    """Addresses kept as bytes (4 or 16) -> text, in place; returns ``rec``."""
    for k in _ADDR_FIELDS:
        v = rec.get(k)
        if v.__class__ is bytes:
            rec[k] = socket.inet_ntop(socket.AF_INET6 if len(v) == 16 else socket.AF_INET, v)
    return rec


class _Budget:
    """The write budget of one kind of decision record: a :class:`TokenBucket` for repeats, the
    keys already seen in this window, and what was suppressed since the last summary."""

    __slots__ = ("bucket", "keys", "window", "count", "first", "last")

    bucket: TokenBucket
    keys: set
    #: Clock time the key window started.
    window: float
    #: Records suppressed since the last ``suppressed`` record; wall times of the first and last.
    count: int
    first: float
    last: float

    def __init__(self, now: float) -> None:
        self.bucket = TokenBucket(DECISION_RATE, DECISION_BURST)
        self.keys = set()
        self.window = now
        self.count = 0
        self.first = self.last = 0.0

    def admit(self, key, now: float) -> bool:
        """May a record of ``key`` be written at clock time ``now``? A key new in this window is
        (while :data:`FIRST_KEYS` are not yet remembered); else the bucket decides."""
        if now - self.window >= FIRST_WINDOW:
            self.keys = set()
            self.window = now
        keys = self.keys
        if key not in keys and len(keys) < FIRST_KEYS:
            keys.add(key)
            return True
        return self.bucket.take(now)


def _key(rec: dict) -> tuple:
    """What makes a decision record new (:data:`FIRST_KEYS`): ``dns``: name, query type, rule;
    others: destination, port, rule."""
    if rec.get("event") == "dns":
        return rec.get("name"), rec.get("qtype"), rec.get("rule")
    return rec.get("dst"), rec.get("port"), rec.get("rule")


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
                 "flush_lines", "records", "records_dropped", "counters", "closed", "_budgets", "clock",
                 "_summary_timer")

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
    #: The write budget of each kind of decision record (``deny``, ``dns``).
    _budgets: dict
    #: Seconds on a monotonic clock (the budgets' time); ``time.monotonic`` unless given.
    clock: object
    _summary_timer: asyncio.TimerHandle | None

    def __init__(self, target=None, *, flush_interval: float = FLUSH_INTERVAL, flush_lines: int = FLUSH_LINES,
                 clock=None) -> None:
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
        self._budgets: dict = {}
        self.clock = clock if clock is not None else time.monotonic
        self._summary_timer = None

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
        counted ``audit.write_errors``.

        A decision record (any ``event`` but ``"flow"`` and ``"suppressed"``) is written when it
        is the first of its key in the window (:data:`FIRST_KEYS`) or within its kind's rate
        (:data:`DECISION_RATE`); else it is counted (``audit.records_suppressed``) and summed up
        in a ``suppressed`` record (docs/audit.md) :data:`SUMMARY_DELAY` seconds later (a loop
        timer), and at :meth:`close`; without a loop (:meth:`bind`), before the next record of
        its kind that is written."""
        if self.closed:
            return
        kind = rec.get("event")
        if kind != "flow" and kind != "suppressed":
            budgets = self._budgets
            b = budgets.get(kind)
            now = self.clock()
            if b is None:
                if len(budgets) >= MAX_KINDS:
                    kind = ""  # (kinds come from the code; this is a backstop)
                    b = budgets.get(kind)
                if b is None:
                    b = budgets[kind] = _Budget(now)
            if not b.admit(_key(rec), now):
                self.counters["audit.records_suppressed"] += 1
                t = rec.get("time")
                t = t if isinstance(t, float) else time.time()
                if not b.count:
                    b.first = t
                b.count += 1
                b.last = t
                if self._summary_timer is None and self._loop is not None:
                    self._summary_timer = self._loop.call_later(SUMMARY_DELAY, self._summaries)
                return
            if b.count and self._loop is None:  # no timer: say what was held back, before this record
                self._summary(kind, b)
        self._take(rec)

    def _summary(self, kind: str, b: _Budget) -> None:
        """Write the ``suppressed`` record of kind ``kind`` (docs/audit.md) and start counting again."""
        rec = {"event": "suppressed", "time": time.time(), "kind": kind or None, "count": b.count,
               "first": b.first, "last": b.last}
        b.count = 0
        self._take(rec)

    def _summaries(self) -> None:
        """The summary timer: a ``suppressed`` record for each kind with suppressed records."""
        self._summary_timer = None
        if self.closed:
            return
        for kind, b in self._budgets.items():
            if b.count:
                self._summary(kind, b)

    def _take(self, rec: dict) -> None:
        """Write ``rec`` (buffered) and hand it to the readers."""
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
        self.record(self.flow_record(flow))

    def for_guest(self, identity) -> AuditLog | GuestAudit:
        """What a stack of ``identity`` (:class:`~aioslirp.config.identity.GuestIdentity`) hands its
        flows: this log itself when the identity is empty, else a :class:`GuestAudit` adding
        ``guest_name`` / ``labels`` to each record of that stack (one log may serve many stacks)."""
        return GuestAudit(self, identity.audit_fields) if identity else self

    def flow_record(self, flow) -> dict:
        """The ``flow`` record of ``flow`` (docs/audit.md), not yet taken."""
        loop = self._loop
        return ({
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
        if self._summary_timer is not None:
            self._summary_timer.cancel()
        self._summaries()
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


class GuestAudit:
    """One stack's front of a shared :class:`AuditLog`: :meth:`record` and :meth:`flow_ended` add
    the stack's ``guest_name`` and ``labels`` (docs/audit.md) to each record, then hand it to the
    log; every other name (``events``, ``bind``, ``flush``, ``close``, ``reopen``, ``records``...)
    is the log's own. Made by :meth:`AuditLog.for_guest`; a dict update per record, nothing per frame.

    Args:
        log: the :class:`AuditLog`.
        fields: what each record gets (``GuestIdentity.audit_fields``).
    """

    __slots__ = ("log", "fields")

    log: AuditLog
    fields: dict

    def __init__(self, log: AuditLog, fields: dict) -> None:
        self.log = log
        self.fields = fields

    def record(self, rec: dict) -> None:
        """:meth:`AuditLog.record` of ``rec`` with the guest's fields."""
        rec.update(self.fields)
        self.log.record(rec)

    def flow_ended(self, flow) -> None:
        """:meth:`AuditLog.flow_ended` of ``flow`` with the guest's fields."""
        rec = self.log.flow_record(flow)
        rec.update(self.fields)
        self.log.record(rec)

    def __getattr__(self, name: str):
        return getattr(self.log, name)
