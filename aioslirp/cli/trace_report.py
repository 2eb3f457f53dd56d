"""``aioslirp trace-report FILE``: where the time of each connection goes.

Reads the JSON-lines span file written by ``--trace FILE`` (format in
:mod:`aioslirp.cli.observe`) and builds, for every ``tcp.flow`` span (one per guest TCP
connection):

* its **timeline**: ``syn`` at the span's start, the span's events in time order
  (``host.connect``, ``syn_ack.queued``, ``syn_ack.sent``, ``established``, ``guest.data``,
  ``host.data``, ``data.sent``, ``fin.guest``, ``fin.host``, ``fin.sent``, ``closed``...,
  see :mod:`aioslirp.observe.tracing`), and ``flow.end`` at the span's end, with the gap from
  each event to the one before;
* its **stages**: each pair of consecutive events ``a → b`` is a stage whose length is the
  gap. Between two connections of the same guest address that follow each other (the
  next SYN comes after the previous connection's ``fin.guest``, or its end when the guest
  never sent a FIN), the stage ``guest idle (fin.guest → next syn)`` is the time the guest
  spent before opening the next connection: in a CRR loop, the client's own work.

Per stage the report gives n, p50, p90 and p99 over all connections (nearest-rank
percentiles, microseconds); it also summarises the four trace points' own measurements
(``process_guest_frame`` processing time, ``tcp.syn_ack`` host connect time,
``drain_to_guest`` write time, ``writer_wake`` queue wait, and on the native data plane the
time its poll wake-up ran socket events and timers), the CRR cycle (SYN to the next
SYN) and the time inside the stack (SYN to ``closed``), and ends with a verdict line
naming the largest stage by p50 among the stages seen in at least half the connections.
Stages that start once both FINs are in (``fin.guest`` and ``fin.host``: the exchange is over
for both peers) are the flow's **tail** -- TIME-WAIT, the linger, the end record -- and lie on
no request's path (the guest's next connection runs meanwhile): the table marks them
``(after the close)`` and the verdict leaves them out, naming the largest of them apart.

What a file holds depends on the ``--trace-level`` it was recorded at (docs/observability.md,
"Trace levels"); the report names the level it sees (:attr:`Report.level`) and says what is
missing instead of guessing: at ``flows`` the flow spans carry no events, so there is no stage
breakdown (each connection is ``syn → flow.end``); below ``frames`` there are no per-frame
trace points (``process_guest_frame``, ``drain_to_guest``, ``writer_wake``) nor ``*.sent``
events.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field

__all__ = ["load_spans", "guest_spans", "build_report", "format_report", "plot_report", "cli_main", "Report",
           "Connection", "IDLE_STAGE", "FRAME_SPANS", "percentile"]

#: Name of the stage between one connection's guest FIN and the same guest's next SYN.
IDLE_STAGE = "guest idle (fin.guest → next syn)"


#: The spans recorded only at ``--trace-level frames``.
FRAME_SPANS = frozenset({"process_guest_frame", "drain_to_guest", "writer_wake"})

_NEEDS_TIMELINE = ("the flow spans carry no events (recorded at --trace-level flows): the stage breakdown "
                   "needs --trace-level timeline or frames")
_NEEDS_FRAMES = "(none: the per-frame trace points need --trace-level frames)"


class ReportError(Exception):
    """The span file cannot be read or holds no spans. ``str(err)`` is one line."""


def percentile(sorted_vals: list, p: float) -> float:
    """Nearest-rank percentile ``p`` (0-100) of an ascending list (``nan`` when empty)."""
    n = len(sorted_vals)
    if not n:
        return math.nan
    k = max(1, math.ceil(p / 100.0 * n))
    return sorted_vals[min(n, k) - 1]


@dataclass
class Connection:
    """One guest TCP connection: its ``tcp.flow`` span, events as ``(name, time_ns)`` in time order."""

    trace_id: str
    client: str
    server: str
    peer: str | None
    start_ns: int
    end_ns: int
    outcome: str | None
    bytes_up: int | None
    bytes_down: int | None
    events: list = field(default_factory=list)

    def gaps(self) -> list:
        """``[(event, offset_us, gap_us)]``: offset from the SYN and gap from the previous event."""
        out = []
        prev = None
        for name, t in self.events:
            out.append((name, (t - self.start_ns) / 1000.0, None if prev is None else (t - prev) / 1000.0))
            prev = t
        return out

    def stages(self) -> list:
        """``[(stage name, gap_us)]`` for each pair of consecutive events."""
        ev = self.events
        return [(f"{a} → {b}", (tb - ta) / 1000.0) for (a, ta), (b, tb) in zip(ev, ev[1:])]

    def time_of(self, name: str):
        for n, t in self.events:
            if n == name:
                return t
        return None


@dataclass
class Report:
    """What :func:`build_report` found. Times in microseconds."""

    spans: int
    connections: list
    other_flows: dict
    stages: dict  # stage name -> sorted list of gaps (us)
    stage_order: list
    trace_points: dict  # label -> sorted list of values (us)
    cycles: list  # sorted SYN -> next SYN (us)
    in_stack: list  # sorted SYN -> closed (us)
    verdict: str = ""
    largest: str | None = None
    #: Stages that start after both FINs in at least half the connections they occur in (the
    #: flow's tail: not on any request's path; left out of the verdict).
    tail: frozenset = frozenset()
    #: The ``--trace-level`` the spans show: ``"frames"`` (per-frame spans seen), ``"timeline"``
    #: (flow events or ``tcp.syn_ack`` spans seen), else ``"flows"``.
    level: str = "flows"


def load_spans(path: str) -> list:
    """The span objects of a ``--trace`` file (lines that are not JSON objects with a ``name``
    and ``start_ns`` are skipped). Raises :class:`ReportError` (unreadable file, no spans)."""
    spans = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict) and "name" in obj and isinstance(obj.get("start_ns"), int):
                    spans.append(obj)
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not a --trace span file (not UTF-8 text)") from None
    if not spans:
        raise ReportError(f"{path} holds no spans (write one with 'aioslirp run --trace {path} -- CMD')")
    return spans


def guest_spans(spans: list, name: str) -> list:
    """The spans of ``spans`` whose ``aioslirp.guest.name`` attribute is ``name`` (one guest's, in
    a file that one tracer provider wrote for many stacks)."""
    return [s for s in spans if (s.get("attributes") or {}).get("aioslirp.guest.name") == name]


def _hostport(attrs: dict, addr: str, port: str) -> str:
    a = attrs.get(addr, "?")
    p = attrs.get(port)
    return f"{a}:{p}" if p is not None else str(a)


def build_report(spans: list) -> Report:
    """Connections, stages, trace-point figures and the verdict from a list of span objects."""
    conns: list[Connection] = []
    other: dict = {}
    points: dict = {"process_guest_frame: processing": [], "tcp.syn_ack: host connect": [],
                    "drain_to_guest: write": [], "writer_wake: queue wait (max of batch)": [],
                    "writer_wake: native poll wake-up": []}
    names = set()
    has_events = False
    for s in spans:
        name = s["name"]
        names.add(name)
        attrs = s.get("attributes") or {}
        if name.endswith(".flow") and s.get("events"):
            has_events = True
        if name == "tcp.flow":
            events = [("syn", s["start_ns"])]
            evs = sorted(((e["name"], e["time_ns"]) for e in s.get("events") or ()), key=lambda e: e[1])
            events += evs
            events.append(("flow.end", s.get("end_ns") or (evs[-1][1] if evs else s["start_ns"])))
            conns.append(Connection(
                trace_id=s.get("trace_id", ""), client=_hostport(attrs, "client.address", "client.port"),
                server=_hostport(attrs, "server.address", "server.port"), peer=attrs.get("network.peer.address"),
                start_ns=s["start_ns"], end_ns=events[-1][1], outcome=attrs.get("aioslirp.tcp.outcome"),
                bytes_up=attrs.get("aioslirp.bytes.from_guest"), bytes_down=attrs.get("aioslirp.bytes.to_guest"),
                events=events))
        elif name.endswith(".flow"):
            other[name] = other.get(name, 0) + 1
        elif name == "process_guest_frame" and "aioslirp.processing_us" in attrs:
            points["process_guest_frame: processing"].append(float(attrs["aioslirp.processing_us"]))
        elif name == "tcp.syn_ack" and not attrs.get("aioslirp.connect.immediate"):
            points["tcp.syn_ack: host connect"].append(float(attrs.get("aioslirp.connect_us", 0)))
        elif name == "drain_to_guest" and "aioslirp.drain_us" in attrs:
            points["drain_to_guest: write"].append(float(attrs["aioslirp.drain_us"]))
        elif name == "writer_wake" and "aioslirp.wait_us.max" in attrs:
            points["writer_wake: queue wait (max of batch)"].append(float(attrs["aioslirp.wait_us.max"]))
        elif name == "writer_wake" and "aioslirp.wake_us" in attrs:  # the native plane's (its events run)
            points["writer_wake: native poll wake-up"].append(float(attrs["aioslirp.wake_us"]))
    conns.sort(key=lambda c: c.start_ns)

    stages: dict = {}
    position: dict = {}  # stage -> offsets of its end from the SYN, to order the table
    after_close: dict = {}  # stage -> how many of its occurrences start once both FINs are in
    for c in conns:
        fin_guest, fin_host = c.time_of("fin.guest"), c.time_of("fin.host")
        done = max(fin_guest, fin_host) if fin_guest is not None and fin_host is not None else None
        for (a, ta), (b, tb) in zip(c.events, c.events[1:]):
            st = f"{a} → {b}"
            stages.setdefault(st, []).append((tb - ta) / 1000.0)
            position.setdefault(st, []).append((tb - c.start_ns) / 1000.0)
            if done is not None and ta >= done:
                after_close[st] = after_close.get(st, 0) + 1
    cycles = []
    idle = []
    last_by_client: dict = {}
    for c in conns:
        guest = c.client.rsplit(":", 1)[0]
        prev = last_by_client.get(guest)
        if prev is not None:
            cycles.append((c.start_ns - prev.start_ns) / 1000.0)
            t_fin = prev.time_of("fin.guest") or prev.end_ns
            if c.start_ns >= t_fin:
                idle.append((c.start_ns - t_fin) / 1000.0)
        last_by_client[guest] = c
    if idle:
        stages[IDLE_STAGE] = idle
        position[IDLE_STAGE] = [math.inf]
    for v in stages.values():
        v.sort()
    order = sorted(stages, key=lambda st: percentile(sorted(position[st]), 50))
    in_stack = sorted((c.time_of("closed") - c.start_ns) / 1000.0 for c in conns if c.time_of("closed") is not None)
    tail = frozenset(st for st, k in after_close.items() if 2 * k >= len(stages[st]))
    rep = Report(spans=len(spans), connections=conns, other_flows=other, stages=stages, stage_order=order,
                 trace_points={k: sorted(v) for k, v in points.items()}, cycles=sorted(cycles), in_stack=in_stack,
                 tail=tail)
    if names & FRAME_SPANS:
        rep.level = "frames"
    elif has_events or "tcp.syn_ack" in names:
        rep.level = "timeline"
    _verdict(rep)
    return rep


def _verdict(rep: Report) -> None:
    n = len(rep.connections)
    if not n:
        rep.verdict = "verdict: no TCP connections in this trace"
        return
    if rep.level == "flows":
        rep.verdict = f"verdict: no stage breakdown: {_NEEDS_TIMELINE}"
        return
    need = max(1, n // 2)
    path = {st: v for st, v in rep.stages.items() if st not in rep.tail} or rep.stages
    cands = [(percentile(v, 50), st) for st, v in path.items() if len(v) >= need]
    if not cands:
        cands = [(percentile(v, 50), st) for st, v in path.items()]
    p50, st = max(cands)
    rep.largest = st
    text = f"verdict: the largest stage is '{st}' with p50 {_fmt(p50)} us"
    if rep.cycles:
        cyc = percentile(rep.cycles, 50)
        text += f", {100.0 * p50 / cyc:.0f}% of the median CRR cycle ({_fmt(cyc)} us SYN to next SYN)"
    if rep.in_stack:
        text += f"; SYN to closed inside the stack: p50 {_fmt(percentile(rep.in_stack, 50))} us"
    if st == IDLE_STAGE:
        text += " -- the time goes to the guest between connections, not to the stack"
    tail = [(percentile(rep.stages[t], 50), t) for t in rep.tail if t != st]
    if tail:
        t_p50, t_st = max(tail)
        text += (f" (left out: the flow's tail after both FINs, largest '{t_st}' p50 {_fmt(t_p50)} us, "
                 "on no request's path)")
    rep.verdict = text


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v >= 10000:
        return f"{v:.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}"


def format_report(rep: Report, limit: int = 10, path: str = "") -> str:
    """The text report. ``limit``: connections whose timeline is printed (0: all)."""
    out = []
    n = len(rep.connections)
    others = ", ".join(f"{v} {k.split('.')[0].upper()}" for k, v in sorted(rep.other_flows.items()))
    out.append(f"trace-report {path}: {rep.spans} spans, {n} TCP connections" + (f" (and {others} flows)" if others else "")
               + f", trace level {rep.level}")
    shown = rep.connections if limit <= 0 else rep.connections[:limit]
    for i, c in enumerate(shown, 1):
        total = (c.end_ns - c.start_ns) / 1000.0
        peer = f" via {c.peer}" if c.peer else ""
        sizes = "" if c.bytes_up is None else f", {c.bytes_up} B from the guest, {c.bytes_down} B to it"
        out.append("")
        out.append(f"connection {i}: {c.client} -> {c.server}{peer}, outcome {c.outcome or '?'}{sizes}, "
                   f"{_fmt(total)} us")
        out.append(f"  {'t (us)':>12} {'gap (us)':>12}  event")
        for name, off, gap in c.gaps():
            out.append(f"  {_fmt(off):>12} {_fmt(gap):>12}  {name}")
    if len(shown) < n:
        out.append("")
        out.append(f"({n - len(shown)} more connections; --connections 0 prints all)")
    out.append("")
    out.append(f"stages over {n} connections (gap between consecutive events, us)")
    if rep.level == "flows" and n:
        out.append(f"  ({_NEEDS_TIMELINE})")
    width = max([len(s) for s in rep.stage_order] + [5])
    out.append(f"  {'stage':<{width}} {'n':>7} {'p50':>10} {'p90':>10} {'p99':>10}")
    for st in rep.stage_order:
        v = rep.stages[st]
        mark = "  (after the close)" if st in rep.tail else ""
        out.append(f"  {st:<{width}} {len(v):>7} {_fmt(percentile(v, 50)):>10} {_fmt(percentile(v, 90)):>10} "
                   f"{_fmt(percentile(v, 99)):>10}{mark}")
    out.append("")
    out.append("trace points (us)")
    width = max(len(k) for k in rep.trace_points)
    out.append(f"  {'measure':<{width}} {'n':>7} {'p50':>10} {'p90':>10} {'p99':>10}")
    for k, v in rep.trace_points.items():
        out.append(f"  {k:<{width}} {len(v):>7} {_fmt(percentile(v, 50)):>10} {_fmt(percentile(v, 90)):>10} "
                   f"{_fmt(percentile(v, 99)):>10}")
    if rep.level != "frames":
        out.append(f"  {_NEEDS_FRAMES}")
    if rep.cycles or rep.in_stack:
        out.append("")
    if rep.cycles:
        out.append(f"CRR cycle (SYN to next SYN): n {len(rep.cycles)}, p50 {_fmt(percentile(rep.cycles, 50))} us, "
                   f"p90 {_fmt(percentile(rep.cycles, 90))} us, p99 {_fmt(percentile(rep.cycles, 99))} us")
    if rep.in_stack:
        out.append(f"inside the stack (SYN to closed): n {len(rep.in_stack)}, p50 {_fmt(percentile(rep.in_stack, 50))} us, "
                   f"p90 {_fmt(percentile(rep.in_stack, 90))} us, p99 {_fmt(percentile(rep.in_stack, 99))} us")
    out.append("")
    out.append(rep.verdict)
    return "\n".join(out) + "\n"


def plot_report(rep: Report, out_path: str, max_connections: int = 40) -> None:
    """Draw ``rep`` as a PNG: per-stage p50/p90/p99 bars (log scale) and the stacked stage
    timelines of the first ``max_connections`` connections. Needs matplotlib (``plot`` extra);
    raises ``ImportError`` without it and ``OSError`` when ``out_path`` cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = rep.stage_order
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, max(4.0, 0.35 * len(order) + 2)))
    ys = range(len(order))
    for p, alpha in ((99, 0.25), (90, 0.5), (50, 1.0)):
        ax1.barh(list(ys), [max(percentile(rep.stages[s], p), 0.01) for s in order], alpha=alpha,
                 color="tab:blue", label=f"p{p}")
    ax1.set_yticks(list(ys))
    ax1.set_yticklabels(order, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xscale("log")
    ax1.set_xlabel("gap (µs, log scale)")
    ax1.set_title(f"stages over {len(rep.connections)} connections")
    ax1.legend(loc="lower right")
    conns = rep.connections[:max_connections]
    cmap = plt.get_cmap("tab20")
    colors = {st: cmap(i % 20) for i, st in enumerate(order)}
    seen = set()
    for i, c in enumerate(conns):
        left = 0.0
        for st, gap in c.stages():
            label = st if st not in seen else None
            seen.add(st)
            ax2.barh(i, gap, left=left, color=colors.get(st, "grey"), label=label)
            left += gap
    ax2.invert_yaxis()
    ax2.set_xlabel("time since SYN (µs)")
    ax2.set_ylabel("connection")
    ax2.set_title(f"timelines of the first {len(conns)} connections")
    if seen:
        ax2.legend(fontsize=6, loc="lower right")
    fig.suptitle(rep.verdict, fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def cli_main(args) -> int:
    """``aioslirp trace-report``: print the report; exit 0, or 2 with one line for bad input."""
    try:
        spans = load_spans(args.file)
    except ReportError as exc:
        print(f"aioslirp: error: FILE: {exc}", file=sys.stderr)
        return 2
    guest = getattr(args, "guest", None)
    if guest is not None:
        spans = guest_spans(spans, guest)
        if not spans:
            print(f"aioslirp: error: --guest: no span of guest {guest!r} in {args.file}", file=sys.stderr)
            return 2
    rep = build_report(spans)
    if args.connections < 0:
        print("aioslirp: error: --connections: must be 0 or more", file=sys.stderr)
        return 2
    sys.stdout.write(format_report(rep, args.connections, args.file))
    if args.png:
        try:
            plot_report(rep, args.png)
        except ImportError:
            print("aioslirp: error: --png needs matplotlib: pip install 'aioslirp[plot]'", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"aioslirp: error: --png: cannot write {args.png}: {exc.strerror}", file=sys.stderr)
            return 2
        print(f"plot written to {args.png}")
    return 0
