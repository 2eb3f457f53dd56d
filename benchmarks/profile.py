#!/usr/bin/env python3
"""Profile aioslirp on one benchmark path (CRR, RR, TCP up/down) with py-spy or cProfile.

Run as root, like run.py (same isolation: a loopback-only namespace of its own)::

    sudo .venv/bin/python benchmarks/profile.py crr --tool py-spy --seconds 8
    sudo .venv/bin/python benchmarks/profile.py tcp_up --tool cprofile --mtu 65520

The stack is started with ``aioslirp attach`` on a fresh namespace; the workload runs from
inside it (the C client of bench.c, or iperf3) for ``--seconds``; meanwhile

* ``py-spy``: ``py-spy record --format raw`` samples the aioslirp process (``pip install
  py-spy``); the report lists the functions with the most samples on top of the stack
  (self) and anywhere in it (inclusive);
* ``cprofile``: aioslirp runs under ``python -m cProfile -o FILE`` and the report lists
  the top functions by own time and by cumulative time.

Output goes to ``benchmarks/results/profiles/`` (raw file + a ``.txt`` report), and the
report is printed. ``--pinned`` puts client, servers and stack on one CPU.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import pstats
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import backends as B  # noqa: E402
import run as R  # noqa: E402


def workload(sess: "R.Session", mode: str, seconds: float) -> dict:
    if mode in ("tcp_up", "tcp_down"):
        return sess.test_iperf(mode == "tcp_down", seconds)
    parallel = 0
    if mode.startswith("ccrr"):
        parallel, mode = int(mode[4:]), "ccrr"
    return sess.test_client(mode, seconds, 0.2, parallel)


def report_raw(path: Path, top: int) -> str:
    """Self and inclusive sample counts per function from py-spy's raw (collapsed) output."""
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            self_c[_short(frames[-1])] += n
            for fr in set(_short(x) for x in frames):
                incl[fr] += n
    out = io.StringIO()
    print(f"{total} samples", file=out)
    print(f"\nTop {top} by self samples (function on top of the stack):", file=out)
    for fr, n in self_c.most_common(top):
        print(f"  {100.0 * n / total:5.1f}%  {fr}", file=out)
    print(f"\nTop {top} by inclusive samples:", file=out)
    for fr, n in incl.most_common(top):
        print(f"  {100.0 * n / total:5.1f}%  {fr}", file=out)
    return out.getvalue()


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)" so that lines of one function add up
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    fname = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(fname.split('/')[-2:])})"


def proc_counts(pid: int) -> dict:
    """The backend's counters that need no tracer: context switches (``/proc/PID/status``: a
    voluntary one is the process going to sleep, i.e. one wait of its event loop), read and write
    system calls (``/proc/PID/io`` syscr/syscw: read, recv*, readv / write, send*, writev...) and
    user and system CPU (:func:`run.proc_cpu`), summed over its threads."""
    out = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in out:
                    out[k] += int(v)
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("syscr", "syscw"):
                out[k] = int(v)
    cpu = R.proc_cpu(pid)
    out["user_s"], out["sys_s"] = cpu["user"], cpu["sys"]
    return out


def report_counts(path: Path, iterations: int) -> str:
    """Per iteration (connection or round trip): the counters of :func:`proc_counts`."""
    d = json.loads(path.read_text())
    if not iterations:
        return json.dumps(d) + "\n"
    lines = [f"{iterations} iterations; per iteration:"]
    for k, v in d.items():
        lines.append(f"  {k:28s} {v * 1e6 / iterations:8.1f} us" if k.endswith("_s") else
                     f"  {k:28s} {v / iterations:8.2f}")
    return "\n".join(lines) + "\n"


def report_perf(path: Path, top: int) -> str:
    """On-CPU share by shared object (interpreter, uvloop, kernel...) and by symbol, from ``perf report``."""
    out = io.StringIO()
    for sort in ("dso", "dso,sym"):
        rep = subprocess.run(["perf", "report", "-i", str(path), "--no-children", "--sort", sort, "--stdio",
                              "-g", "none", "--percent-limit", "0.5"], capture_output=True, text=True)
        lines = [ln for ln in rep.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
        print(f"By {sort}:", file=out)
        print("\n".join(lines[:top]), file=out)
        print(file=out)
    return out.getvalue()


def report_strace(path: Path, top: int, iterations: int) -> str:
    """``strace -c`` summary with calls per workload iteration (connection for CRR, round trip for RR)."""
    out = io.StringIO()
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and not line.lstrip().startswith("100.00"):
            name = parts[-1]
            calls = int(parts[3])
            rows.append((calls, name, line))
    rows.sort(reverse=True)
    total = sum(c for c, _, _ in rows)
    print(f"{iterations} iterations; {total} system calls"
          f" ({total / iterations:.1f} per iteration)" if iterations else "", file=out)
    print("calls/iter  syscall", file=out)
    for calls, name, _ in rows[:top]:
        print(f"{calls / max(iterations, 1):10.2f}  {name}", file=out)
    print("\nstrace -c:\n" + path.read_text(), file=out)
    return out.getvalue()


def report_pstats(path: Path, top: int) -> str:
    out = io.StringIO()
    st = pstats.Stats(str(path), stream=out)
    st.strip_dirs()
    print("By own time (tottime):", file=out)
    st.sort_stats("tottime").print_stats(top)
    print("By cumulative time:", file=out)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("crr", "rr", "udprr", "ccrr8", "ccrr64", "tcp_up", "tcp_down"))
    ap.add_argument("--tool", choices=("py-spy", "cprofile", "strace", "perf", "counts"), default="py-spy",
                    help="strace: system calls per connection/iteration (strace -c), any --backend; "
                    "perf: on-CPU samples (perf record -e cpu-clock) by shared object and symbol, any --backend")
    ap.add_argument("--backend", choices=("aioslirp", "pasta"), default="aioslirp",
                    help="backend to attach to (py-spy and cprofile: aioslirp only)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--mtu", type=int, help="aioslirp --mtu (default: its default)")
    ap.add_argument("--pinned", action="store_true", help="client, servers and aioslirp on one CPU")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--native", action="store_true", help="py-spy --native: show C frames (uvloop, syscalls)")
    ap.add_argument("--call-graph", choices=("fp", "dwarf"), default="fp",
                    help="perf: stacks by frame pointers (default) or by DWARF unwinding (through libpython and "
                         "the compiled modules, which keep no frame pointers: `perf report --children` then gives "
                         "each Python-level function's inclusive share)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--extra", default="", help="more aioslirp options, one string (e.g. '--trace F --trace-level frames')")
    ap.add_argument("--tree", help="directory holding another aioslirp package to profile (A/B)")
    ap.add_argument("--out", default=str(HERE / "results" / "profiles"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("profile.py: error: run as root", file=sys.stderr)
        return 2
    if args.backend != "aioslirp" and args.tool not in ("strace", "perf", "counts"):
        print("profile.py: error: --backend pasta needs --tool strace, perf or counts", file=sys.stderr)
        return 2
    pyspy = shutil.which("py-spy") or str(Path(args.python).parent / "py-spy")
    if args.tool == "py-spy" and not os.path.exists(pyspy):
        print("profile.py: error: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tag = f"{args.mode}-{'' if args.backend == 'aioslirp' else args.backend + '-'}{args.tool}{'-native' if args.native else ''}-mtu{args.mtu or 'default'}{'-pinned' if args.pinned else ''}-{stamp}"
    prof_file = out / f"{tag}.{ {'py-spy': 'raw', 'cprofile': 'prof', 'strace': 'strace', 'perf': 'perf', 'counts': 'json'}[args.tool]}"
    cbench = R.build_c_tools(HERE / "results" / ".bin")

    R.enter_sandbox(need_default_route=args.backend == "pasta")
    workdir = tempfile.mkdtemp(prefix="aioslirp-prof-")
    os.chmod(workdir, 0o755)
    allowed = sorted(os.sched_getaffinity(0))
    cpus = {allowed[-1]} if args.pinned else set(allowed)
    py_args = ["-m", "cProfile", "-o", str(prof_file)] if args.tool == "cprofile" else []
    backend = (B.Aioslirp(args.mtu, args.python, extra=shlex.split(args.extra), python_args=py_args,
                          tree=args.tree) if args.backend == "aioslirp"
               else B.Pasta(args.mtu or 65520))
    result = None
    try:
        with R.Session(backend, "pinned" if args.pinned else "unpinned", cpus, workdir, workdir, args.python, 1,
                       cbench) as sess:
            spy = None
            if args.tool == "py-spy":
                spy = subprocess.Popen([pyspy, "record", "-p", str(backend.pid), "-f", "raw", "-r", str(args.rate),
                                        "-o", str(prof_file), "-d", str(int(args.seconds + 2)),
                                        *([] if args.native else ["--nonblocking"]),
                                        *(["--native"] if args.native else [])],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(0.5)
            elif args.tool == "perf":
                graph = ["-g"] if args.call_graph == "fp" else ["--call-graph", "dwarf,8192"]
                spy = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", str(args.rate * 4), *graph,
                                        "-o", str(prof_file), "-p", str(backend.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(0.5)
            elif args.tool == "strace":
                spy = subprocess.Popen(["strace", "-c", "-f", "-o", str(prof_file), "-p", str(backend.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(0.5)
            before = proc_counts(backend.pid) if args.tool == "counts" else None
            result = workload(sess, args.mode, args.seconds)
            if before is not None:
                after = proc_counts(backend.pid)
                prof_file.write_text(json.dumps({k: after[k] - before[k] for k in before}))
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                try:
                    spy.wait(20)
                except subprocess.TimeoutExpired:
                    spy.kill()
                if not prof_file.exists():
                    print("py-spy failed: " + spy.stderr.read().decode(errors="replace")[-800:], file=sys.stderr)
                    return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.tool == "strace":
        text = report_strace(prof_file, args.top, ((result or {}).get("result") or {}).get("total") or 0)
    elif args.tool == "perf":
        text = report_perf(prof_file, args.top)
    elif args.tool == "counts":
        text = report_counts(prof_file, ((result or {}).get("result") or {}).get("total") or 0)
    else:
        text = (report_raw(prof_file, args.top) if args.tool == "py-spy" else report_pstats(prof_file, args.top))
    head = f"aioslirp profile: {args.mode}, {args.tool}, MTU {args.mtu or 'default'}, " \
           f"{'pinned' if args.pinned else 'unpinned'}, load {os.getloadavg()[0]:.2f}\nworkload: " \
           f"{R.report.one_line(dict(result or {}, ok=True, test=args.mode))}\n\n"
    (out / f"{tag}.txt").write_text(head + text)
    print(head + text)
    print(f"profile: {prof_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
