"""Summaries, markdown tables (ratios to the faster pasta per figure), the PNG plot and the docs update.

``summarize(records)`` takes the medians over rounds of each metric per placement and
backend; ``markdown(doc)`` renders them; ``plot(doc, path)`` draws them with matplotlib
(optional: ``pip install -e '.[bench]'``); ``update_docs`` replaces the results section of
docs/performance.md. Also usable on its own: ``python benchmarks/report.py RUN.json``
prints the markdown of a saved run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REFERENCE = "pasta"  # Debian's pasta; pasta-RELEASE backends (--pasta PATH) are references too

#: metric -> (label, unit, lower_is_better)
METRICS = {
    "crr_p50": ("CRR p50", "us", True),
    "crr_p90": ("CRR p90", "us", True),
    "crr_p99": ("CRR p99", "us", True),
    "crr_rate": ("CRR rate", "conn/s", False),
    "crr_cpu_ms_per_1k": ("CRR backend CPU", "ms/1000 conn", True),
    "crr_cpu_user_ms_per_1k": ("CRR backend CPU, user", "ms/1000 conn", True),
    "crr_cpu_sys_ms_per_1k": ("CRR backend CPU, system", "ms/1000 conn", True),
    "rr_p50": ("RR p50", "us", True),
    "rr_p90": ("RR p90", "us", True),
    "rr_p99": ("RR p99", "us", True),
    "udprr_p50": ("UDP RR p50", "us", True),
    "udprr_p90": ("UDP RR p90", "us", True),
    "udprr_p99": ("UDP RR p99", "us", True),
    "up_gbps": ("TCP ns->host", "Gbit/s", False),
    "up_cpu_s_per_gb": ("CPU ns->host", "s/GB", True),
    "up_retrans": ("retransmits ns->host", "", True),
    "down_gbps": ("TCP host->ns", "Gbit/s", False),
    "down_cpu_s_per_gb": ("CPU host->ns", "s/GB", True),
    "down_retrans": ("retransmits host->ns", "", True),
}
for _n in (1, 8, 64):
    METRICS[f"ccrr{_n}_rate"] = (f"CRR x{_n} rate", "conn/s", False)
    METRICS[f"ccrr{_n}_p50"] = (f"CRR x{_n} p50", "us", True)
    METRICS[f"ccrr{_n}_p99"] = (f"CRR x{_n} p99", "us", True)
    METRICS[f"ccrr{_n}_cpu_ms_per_1k"] = (f"CRR x{_n} backend CPU", "ms/1000 conn", True)
METRICS.update({
    "idle_open": ("idle flows open", "", False),
    "idle_rss_mb": ("RSS with idle flows", "MB", True),
    "idle_base_rss_mb": ("RSS before", "MB", True),
    "idle_fds": ("fds with idle flows", "", True),
    "idle_setup_s": ("time to open idle flows", "s", True),
})


def is_pasta(backend: str) -> bool:
    """Debian's ``pasta`` and every ``pasta-...`` backend (other builds, other MTUs)."""
    return backend == REFERENCE or backend.startswith(REFERENCE + "-")


def references(summary: dict) -> dict:
    """``{placement: {metric: backend}}``: for each figure, the pasta that did best (lowest latency,
    CPU and retransmits; highest throughput and rate). Ratios and targets are to that one."""
    out: dict = {}
    for pl, per_b in summary.items():
        names: dict = {}
        for key in {k for s in per_b.values() for k in s if k in METRICS}:
            lower = METRICS[key][2]
            best = None
            for b, s in per_b.items():
                v = s.get(key)
                if not is_pasta(b) or v is None:
                    continue
                if best is None or (v < best[0] if lower else v > best[0]):
                    best = (v, b)
            if best is not None:
                names[key] = best[1]
        out[pl] = names
    return out


def reference_values(summary_pl: dict) -> dict:
    """``{metric: value}`` of the faster pasta per figure in one placement's summary."""
    names = references({"_": summary_pl})["_"]
    return {key: summary_pl[b][key] for key, b in names.items()}


#: Markers of an optimised CPython build in its ``sysconfig`` variables.
PGO_MARKERS = ("--enable-optimizations", "-fprofile-use", "-fprofile-instr-use")
LTO_MARKERS = ("--with-lto", "-flto")
FLAG_VARS = ("CONFIG_ARGS", "PY_CFLAGS", "PY_CFLAGS_NODIST", "PY_LDFLAGS_NODIST", "OPT", "CFLAGS", "LDFLAGS")


def interpreter_record(version: str, implementation: str, executable: str, config_vars: dict,
                       extension: bool) -> dict:
    """What the results say about the interpreter that ran aioslirp.

    ``pgo``/``lto`` are True when a marker shows in the build's ``sysconfig`` variables
    (``CONFIG_ARGS``, ``PY_CFLAGS``, ...), False when it does not, and None ("not shown") for a
    distribution's build (``--prefix=/usr``): Debian and Ubuntu build ``python3`` with PGO and LTO
    from their packaging rules, which ``sysconfig`` does not record.
    """
    flags = " ".join(str(config_vars.get(k) or "") for k in FLAG_VARS)
    distro = "'--prefix=/usr'" in str(config_vars.get("CONFIG_ARGS") or "")

    def seen(markers: tuple) -> bool | None:
        if any(m in flags for m in markers):
            return True
        return None if distro else False

    return {"version": version, "implementation": implementation, "executable": os.path.basename(executable),
            "pgo": seen(PGO_MARKERS), "lto": seen(LTO_MARKERS), "distribution_build": distro,
            "extension": bool(extension)}


def current_interpreter() -> dict:
    """``interpreter_record`` of this process; ``extension``: every module of the compiled per-frame
    path loaded native (``aioslirp.compiled.status()``; False without it or where the package
    predates it)."""
    import sysconfig

    try:
        from aioslirp import compiled

        extension = all(compiled.status().values())
    except ImportError:
        extension = False
    return interpreter_record(platform.python_version(), platform.python_implementation(), sys.executable,
                              sysconfig.get_config_vars(), extension)


def interpreter_text(rec: dict | None) -> str:
    """``Python 3.11.2 (CPython, python3, PGO+LTO, no compiled extension)`` for the header line."""
    if not rec:
        return "Python ?"
    if rec.get("error"):
        return f"Python ? ({rec.get('executable')}: {rec['error']})"
    opt = [name for name in ("PGO", "LTO") if rec.get(name.lower())]
    unknown = [name for name in ("PGO", "LTO") if rec.get(name.lower()) is None]
    build = "+".join(opt) if opt else ("no PGO/LTO" if not unknown else "")
    if unknown:
        build = (build + ", " if build else "") + "/".join(unknown) + " not shown by sysconfig (distribution build)"
    ext = "compiled extension loaded" if rec.get("extension") else "no compiled extension"
    return (f"Python {rec.get('version')} ({rec.get('implementation')}, {rec.get('executable')}, {build}, {ext})")


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def host_meta(backends, repo: Path) -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    commit = _run(["git", "rev-parse", "--short", "HEAD"], repo)
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], repo))
    return {
        "kernel": platform.release(),
        "cpu_model": cpu,
        "ncpu": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit + ("+dirty" if dirty else ""),
        "iperf3": _run(["dpkg-query", "-W", "-f=${Version}", "iperf3"]),
        "backends": {b.name: {"description": b.description, "version": b.version()} for b in backends},
    }


def one_line(rec: dict) -> str:
    """Short progress text for one record."""
    if not rec.get("ok"):
        return "FAILED: " + rec.get("error", "?")
    r = rec.get("result", {})
    test = rec["test"]
    cpu = rec.get("backend_cpu_s")
    cpu_txt = f" cpu {cpu:.2f}s" if cpu is not None else ""
    if test in ("crr", "rr", "udprr") or test.startswith("ccrr"):
        extra = f" err {r.get('errors', r.get('lost', 0))}"
        return f"n={r.get('n')} p50 {r.get('p50')} p90 {r.get('p90')} p99 {r.get('p99')} us, {r.get('rate')}/s{cpu_txt}{extra}"
    if test.startswith("tcp"):
        return f"{r.get('gbps', 0):.2f} Gbit/s retr {r.get('retransmits')}{cpu_txt}" + (
            f" ({rec['cpu_s_per_gb']:.2f} s/GB)" if rec.get("cpu_s_per_gb") is not None else "")
    if test == "idle":
        ld = rec.get("backend_loaded") or {}
        c = rec.get("backend_counters") or {}
        refused = {k: v for k, v in c.items()
                   if "refus" in k or "connect_failed" in k or k.startswith(("drop.", "limit_"))}
        refused.update(rec.get("host_listen") or {})  # the host listener's overflows, drops, cookies
        return (f"open {r.get('client', {}).get('open')} rss {ld.get('VmRSS_mb')} MB fds {ld.get('fds')}"
                + (" " + " ".join(f"{k} {v}" for k, v in refused.items()) if refused else ""))
    return ""


def metrics_of(rec: dict) -> dict:
    """Flat metric values of one record (see METRICS)."""
    if not rec.get("ok"):
        return {}
    test, r, out = rec["test"], rec.get("result", {}), {}
    if test in ("crr", "rr", "udprr") or test.startswith("ccrr"):
        for k in ("p50", "p90", "p99", "rate"):
            if r.get(k) is not None:
                out[f"{test}_{k}"] = r[k]
        if rec.get("cpu_ms_per_1k_conn") is not None:
            out[f"{test}_cpu_ms_per_1k"] = rec["cpu_ms_per_1k_conn"]
        if test == "crr" and rec.get("cpu_user_ms_per_1k_conn") is not None:
            out["crr_cpu_user_ms_per_1k"] = rec["cpu_user_ms_per_1k_conn"]
            out["crr_cpu_sys_ms_per_1k"] = rec["cpu_sys_ms_per_1k_conn"]
    elif test in ("tcp_up", "tcp_down"):
        d = "up" if test == "tcp_up" else "down"
        out[f"{d}_gbps"] = r.get("gbps")
        if r.get("retransmits") is not None:
            out[f"{d}_retrans"] = r["retransmits"]
        if rec.get("cpu_s_per_gb") is not None:
            out[f"{d}_cpu_s_per_gb"] = rec["cpu_s_per_gb"]
    elif test == "idle":
        cl = r.get("client", {})
        out["idle_open"] = cl.get("open")
        out["idle_setup_s"] = cl.get("setup_s")
        ld, bf = rec.get("backend_loaded") or {}, rec.get("backend_before") or {}
        if ld.get("VmRSS_mb") is not None:
            out["idle_rss_mb"] = ld["VmRSS_mb"]
            out["idle_fds"] = ld.get("fds")
        if bf.get("VmRSS_mb") is not None:
            out["idle_base_rss_mb"] = bf["VmRSS_mb"]
    return {k: v for k, v in out.items() if v is not None}


def summarize(records: list[dict]) -> dict:
    """``{placement: {backend: {metric: median over rounds, metric + "_n": samples}}}``."""
    acc: dict = {}
    for rec in records:
        for k, v in metrics_of(rec).items():
            acc.setdefault(rec["placement"], {}).setdefault(rec["backend"], {}).setdefault(k, []).append(v)
    out: dict = {}
    for pl, per_b in acc.items():
        for b, per_m in per_b.items():
            dst = out.setdefault(pl, {}).setdefault(b, {})
            for k, vals in per_m.items():
                dst[k] = statistics.median(vals)
                dst[k + "_n"] = len(vals)
    return out


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    return str(v)


def _count(v) -> str:
    return "–" if v is None else str(int(round(v)))


def _ratio(val, ref) -> str:
    if val is None or ref in (None, 0):
        return ""
    return f" ({val / ref:.2f}x)"


def _cell(s: dict, ref: dict, key: str, ratio: bool = True) -> str:
    v = s.get(key)
    return _fmt(v) + (_ratio(v, ref.get(key)) if ratio else "")


def _target_rows(summary_pl: dict, check) -> list[tuple]:
    """``check(s, add)`` for each aioslirp variant's figures ``s``; ``add(name, value, limit, ok_fn,
    limit_text)`` records one verdict row (``met`` ``None`` without a value or a limit)."""
    rows: list[tuple] = []
    for b, s in summary_pl.items():
        if not b.startswith("aioslirp"):
            continue

        def add(name, val, limit, ok_fn, fmt_limit, b=b):
            met = None if val is None or limit is None else ok_fn(val, limit)
            rows.append((b, name, val, fmt_limit, met))

        check(s, add)
    return rows


def targets(summary_pl: dict) -> list[tuple]:
    """Issue 7 targets for each aioslirp variant: (backend, target, value, limit, met)."""
    ref = reference_values(summary_pl)
    s4n = summary_pl.get("slirp4netns-65520", {})

    def check(s, add):
        for key, label in (("crr_p50", "CRR p50 <= 2.0x pasta"), ("rr_p50", "RR p50 <= 2.0x pasta")):
            lim = ref.get(key) * 2 if ref.get(key) else None
            add(label, s.get(key), lim, lambda v, l: v <= l, f"{_fmt(lim)} us")
        for key, label in (("up_gbps", "TCP ns->host >= slirp4netns-65520"),
                           ("down_gbps", "TCP host->ns >= slirp4netns-65520")):
            lim = s4n.get(key)
            add(label, s.get(key), lim, lambda v, l: v >= l, f"{_fmt(lim)} Gbit/s")
        for key, label in (("up_cpu_s_per_gb", "CPU/GB ns->host <= 3x pasta"),
                           ("down_cpu_s_per_gb", "CPU/GB host->ns <= 3x pasta")):
            lim = ref.get(key) * 3 if ref.get(key) else None
            add(label, s.get(key), lim, lambda v, l: v <= l, f"{_fmt(lim)} s/GB")

    return _target_rows(summary_pl, check)


def targets16(summary_pl: dict, idle_flows: int | None = None) -> list[tuple]:
    """Issue 16 targets for each aioslirp variant: (backend, target, value, limit, met).

    Ratios are to the faster pasta per figure (:func:`reference_values`); the throughput floor is
    0.8x Debian's ``pasta`` and slirp4netns-65520, whichever is higher. ``met`` is ``None`` where
    the run lacks the figure or its reference. The idle target counts only a run of 10,000 flows.
    """
    ref = reference_values(summary_pl)
    bookworm = summary_pl.get(REFERENCE, {})
    s4n = summary_pl.get("slirp4netns-65520", {})

    def check(s, add):
        for key, factor, label, unit in (("crr_p50", 1.5, "CRR p50 <= 1.5x pasta", "us"),
                                         ("rr_p50", 1.5, "RR p50 <= 1.5x pasta", "us"),
                                         ("udprr_p50", 1.5, "UDP RR p50 <= 1.5x pasta", "us"),
                                         ("crr_cpu_ms_per_1k", 2.0, "CPU per connection <= 2.0x pasta", "ms/1000"),
                                         ("up_cpu_s_per_gb", 2.0, "CPU/GB ns->host <= 2.0x pasta", "s/GB"),
                                         ("down_cpu_s_per_gb", 2.0, "CPU/GB host->ns <= 2.0x pasta", "s/GB")):
            lim = ref[key] * factor if ref.get(key) else None
            add(label, s.get(key), lim, lambda v, l: v <= l, f"{_fmt(lim)} {unit}")
        lim = ref["ccrr64_rate"] * 0.7 if ref.get("ccrr64_rate") else None
        add("64 concurrent connections >= 0.7x pasta's rate", s.get("ccrr64_rate"), lim,
            lambda v, l: v >= l, f"{_fmt(lim)} conn/s")
        for key, label in (("up_gbps", "TCP ns->host >= 0.8x pasta (bookworm) and >= slirp4netns-65520"),
                           ("down_gbps", "TCP host->ns >= 0.8x pasta (bookworm) and >= slirp4netns-65520")):
            floors = [v for v in (bookworm.get(key) and bookworm[key] * 0.8, s4n.get(key)) if v]
            lim = max(floors) if len(floors) == 2 else None
            add(label, s.get(key), lim, lambda v, l: v >= l, f"{_fmt(lim)} Gbit/s")
        if idle_flows == 10000 and s.get("idle_rss_mb") is not None:
            add("10,000 idle flows < 100 MB RSS", s["idle_rss_mb"], 100.0,
                lambda v, l: v < l and s.get("idle_open") == idle_flows, "100 MB")

    return _target_rows(summary_pl, check)


def reference_note(summary_pl: dict, keys: tuple) -> list[str]:
    """With more than one pasta: a line naming the faster pasta of each of ``keys`` (else nothing)."""
    if sum(1 for b in summary_pl if is_pasta(b)) < 2:
        return []
    names = references({"_": summary_pl})["_"]
    parts = [f"{METRICS[k][0]} {names[k]}" for k in keys if k in names]
    return ["", "Ratios to the faster pasta per figure: " + "; ".join(parts) + "."] if parts else []


def markdown(doc: dict) -> str:
    meta, summary = doc["meta"], doc["summary"]
    order = list(meta.get("backends", {}).keys())
    la0, la1 = meta.get("loadavg_start"), meta.get("loadavg_end")
    interp = interpreter_text(meta["interpreter"]) if meta.get("interpreter") else f"Python {meta.get('python')}"
    lines = [
        f"Run {meta.get('started', '?')} on {meta.get('cpu_model', '?')} ({meta.get('ncpu')} CPUs), "
        f"kernel {meta.get('kernel')}, {interp}, aioslirp commit {meta.get('commit')}; "
        f"{meta['profile']['rounds']} interleaved round(s)"
        f"{' (unpinned: ' + str(meta['profile'].get('unpinned_rounds')) + ')' if 'unpinned' in meta['profile'].get('placements', []) else ''}"
        f", medians; load average "
        f"{', '.join(f'{x:.2f}' for x in la0) if la0 else '?'} at the start and "
        f"{', '.join(f'{x:.2f}' for x in la1) if la1 else '?'} at the end"
        f"{' (**high: other work was running, figures are noisy**)' if la0 and max(la0[0], (la1 or la0)[0]) > 0.5 * (meta.get('ncpu') or 1) else ''}.",
        "",
        "Versions: " + "; ".join(sorted({f"{b.split('-')[0]} {v['version']}" for b, v in meta.get("backends", {}).items()
                                         if b != "veth"}))
        + f"; iperf3 {meta.get('iperf3')}; client and servers: {meta.get('client_impl', 'python')} "
        "(benchmarks/bench.c, or client.py/hostserver.py).",
        "",
        "Ratios in parentheses are to the faster pasta per figure in the same run and placement (for latency "
        "and CPU, lower is better; for throughput and rates, higher is better); with more than one pasta, "
        "each table names which one that was.",
    ]
    for pl in ("pinned", "unpinned"):
        if pl not in summary:
            continue
        S = summary[pl]
        ref = reference_values(S)
        bs = [b for b in order if b in S] + [b for b in S if b not in order]
        where = (f"client, servers and backend pinned to CPU {meta.get('pinned_cpu')}" if pl == "pinned"
                 else f"no pinning (CPUs {meta.get('allowed_cpus')})")
        lines += ["", f"### {pl.capitalize()}: {where}", "",
                  "Latency in microseconds (p50 / p90 / p99), ratio of p50 to the faster pasta; backend CPU per "
                  "1,000 CRR connections.",
                  "",
                  "| backend | CRR | RR | UDP RR | CRR backend CPU ms/1000 | of which user / system |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for b in bs:
            s = S[b]
            cols = []
            for t in ("crr", "rr", "udprr"):
                if s.get(f"{t}_p50") is None:
                    cols.append("–")
                else:
                    cols.append(f"{_fmt(s.get(t + '_p50'))} / {_fmt(s.get(t + '_p90'))} / {_fmt(s.get(t + '_p99'))}"
                                f"{_ratio(s.get(t + '_p50'), ref.get(t + '_p50'))}")
            cols.append(_cell(s, ref, "crr_cpu_ms_per_1k"))
            cols.append("–" if s.get("crr_cpu_user_ms_per_1k") is None else
                        f"{_fmt(s['crr_cpu_user_ms_per_1k'])} / {_fmt(s['crr_cpu_sys_ms_per_1k'])}")
            lines.append(f"| {b} | " + " | ".join(cols) + " |")
        lines += reference_note(S, ("crr_p50", "rr_p50", "udprr_p50", "crr_cpu_ms_per_1k"))
        lines += ["", "TCP bulk (iperf3, one stream): throughput, backend CPU seconds per GB moved, sender retransmits.",
                  "",
                  "| backend | ns->host Gbit/s | CPU s/GB | retr | host->ns Gbit/s | CPU s/GB | retr |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for b in bs:
            s = S[b]
            lines.append(f"| {b} | {_cell(s, ref, 'up_gbps')} | {_cell(s, ref, 'up_cpu_s_per_gb')} | "
                         f"{_count(s.get('up_retrans'))} | {_cell(s, ref, 'down_gbps')} | "
                         f"{_cell(s, ref, 'down_cpu_s_per_gb')} | {_count(s.get('down_retrans'))} |")
        lines += reference_note(S, ("up_gbps", "up_cpu_s_per_gb", "down_gbps", "down_cpu_s_per_gb"))
        lines += ["", "Concurrent CRR: connections per second (p50 latency us) with 1, 8 and 64 connections in flight "
                  "from one client process; backend CPU per 1,000 connections at 64.", "",
                  "| backend | x1 conn/s (p50) | x8 conn/s (p50) | x64 conn/s (p50) | x64 CPU ms/1000 |",
                  "| --- | --- | --- | --- | --- |"]
        for b in bs:
            s = S[b]
            cols = []
            for n in (1, 8, 64):
                rate = s.get(f"ccrr{n}_rate")
                cols.append("–" if rate is None else
                            f"{_fmt(rate)}{_ratio(rate, ref.get(f'ccrr{n}_rate'))} ({_fmt(s.get(f'ccrr{n}_p50'))})")
            cols.append(_cell(s, ref, "ccrr64_cpu_ms_per_1k"))
            lines.append(f"| {b} | " + " | ".join(cols) + " |")
        lines += reference_note(S, ("ccrr1_rate", "ccrr8_rate", "ccrr64_rate", "ccrr64_cpu_ms_per_1k"))
    idle_rows = []
    for pl, S in summary.items():
        for b in [b for b in order if b in S] + [b for b in S if b not in order]:
            s = S[b]
            if s.get("idle_open") is not None:
                idle_rows.append(f"| {b} | {_count(s.get('idle_open'))} | {_fmt(s.get('idle_base_rss_mb'))} | "
                                 f"{_fmt(s.get('idle_rss_mb'))} | {_count(s.get('idle_fds'))} | "
                                 f"{_fmt(s.get('idle_setup_s'))} |")
    if idle_rows:
        n = meta["profile"].get("idle_flows")
        lines += ["", f"### {n} idle TCP flows", "",
                  "Open, confirmed end to end with a 1-byte echo each, then held; backend RSS and open fds "
                  "(kernel reference: no backend process). Opening stops after "
                  f"{meta['profile'].get('idle_budget_s', '?')} s; every process's RLIMIT_NOFILE is "
                  f"{(meta.get('rlimit_nofile') or ['?'])[0]} (pasta needs two fds per flow).", "",
                  "| backend | flows open | RSS before MB | RSS with flows MB | fds | seconds to open |",
                  "| --- | --- | --- | --- | --- | --- |", *idle_rows]
    for issue, rows_of in (("7", lambda S: targets(S)),
                           ("16", lambda S: targets16(S, meta["profile"].get("idle_flows")))):
        for pl in ("pinned", "unpinned"):
            if pl not in summary:
                continue
            rows = rows_of(summary[pl])
            if not rows:
                continue
            lines += ["", f"### Issue {issue} targets ({pl}; pasta = the faster pasta per figure)", "",
                      "| backend | target | value | limit | met |",
                      "| --- | --- | --- | --- | --- |"]
            for b, name, val, lim, met in rows:
                lines.append(f"| {b} | {name} | {_fmt(val)} | {lim} | "
                             f"{'–' if met is None else ('yes' if met else '**no**')} |")
            if issue != "7":
                continue
            for b, s in summary[pl].items():
                if b.startswith("aioslirp") and s.get("idle_rss_mb") is not None:
                    met = s["idle_rss_mb"] < 300 and s.get("idle_open") == meta["profile"].get("idle_flows")
                    lines.append(f"| {b} | {meta['profile'].get('idle_flows')} idle flows < 300 MB RSS | "
                                 f"{_fmt(s['idle_rss_mb'])} MB ({_fmt(s.get('idle_open'))} open) | 300 MB | "
                                 f"{'yes' if met else '**no**'} |")
    failures = [r for r in doc.get("records", []) if not r.get("ok")]
    if failures:
        lines += ["", "Failures:", ""]
        for r in failures:
            lines.append(f"- round {r['round'] + 1} {r['placement']} {r['backend']} {r['test']}: {r.get('error')}")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> Path | None:
    """Bar charts of the main metrics (pinned and unpinned side by side). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return None
    summary = doc["summary"]
    order = list(doc["meta"].get("backends", {}).keys())
    panels = [("crr_p50", "CRR p50 (us)"), ("rr_p50", "RR p50 (us)"), ("udprr_p50", "UDP RR p50 (us)"),
              ("ccrr64_rate", "CRR x64 (conn/s)"), ("up_gbps", "TCP ns->host (Gbit/s)"),
              ("down_gbps", "TCP host->ns (Gbit/s)"), ("up_cpu_s_per_gb", "CPU ns->host (s/GB)"),
              ("down_cpu_s_per_gb", "CPU host->ns (s/GB)")]
    pls = [p for p in ("pinned", "unpinned") if p in summary]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    width = 0.8 / max(1, len(pls))
    for ax, (key, title) in zip(axes.flat, panels):
        bs = [b for b in order if any(b in summary[p] for p in pls)]
        for i, pl in enumerate(pls):
            vals = [summary[pl].get(b, {}).get(key) or 0 for b in bs]
            xs = [x + i * width for x in range(len(bs))]
            ax.bar(xs, vals, width, label=pl)
        ax.set_title(title, fontsize=10)
        ax.set_xticks([x + width * (len(pls) - 1) / 2 for x in range(len(bs))])
        ax.set_xticklabels(bs, rotation=35, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    meta = doc["meta"]
    fig.suptitle(f"aioslirp vs pasta, slirp4netns, veth — {meta.get('started', '')}, commit {meta.get('commit')}, "
                 f"load {meta.get('loadavg_start', [0])[0]:.2f}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)


START, END = "<!-- results:start -->", "<!-- results:end -->"


def update_docs(page: Path, md: str, with_plot: bool) -> None:
    """Replace the text between the results markers of ``page`` with ``md`` (and the plot)."""
    text = page.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{page} has no {START} ... {END} section")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    body = md.replace("### ", "#### ")
    if with_plot:
        body += "\n![Benchmark results](performance.png)\n"
    page.write_text(f"{head}{START}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter"]:  # run.py asks the --python interpreter this way
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's aioslirp, as run.py runs it
        print(json.dumps(current_interpreter()))
        sys.exit(0)
    d = json.loads(Path(sys.argv[1]).read_text())
    if "records" not in d:
        d["records"] = []
    print(markdown(d))
