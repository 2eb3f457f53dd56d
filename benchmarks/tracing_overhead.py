"""What the trace points cost: CRR p50 with tracing off, with the OpenTelemetry API only, and
with the SDK and a no-op exporter (plus, for reference, the SDK writing a --trace file).

Each run is ``aioslirp run`` (started through a small wrapper that sets the tracing mode up
in the aioslirp process, then calls ``aioslirp.cli.main``) whose command is one Python
process doing N connect / 1-byte request / 1-byte response / close iterations against an
echo server on the host's 127.0.0.1 (through the gateway 10.0.2.2). The client times each
iteration with ``perf_counter_ns``; the first ``--warmup`` iterations are dropped. Modes
are interleaved over ``--rounds`` rounds so drift hits them all alike.

Tracing off is a ``None`` tracer: each trace point costs one attribute load and an ``is not
None`` branch, below the noise of a CRR run; compare ``benchmarks/micro_crr.py`` of two trees
for that. (An older ``count`` mode counted the module-level switch of the process-global
tracer, which no longer exists.)

Usage (root or rootless with user namespaces, from the repository root)::

    python benchmarks/tracing_overhead.py [--iterations 2000] [--rounds 5] [--pin CPU]
        [--json benchmarks/results/tracing_overhead.json]

Prints a markdown table. Figures measured on the project machine are in
``docs/crr-latency.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Runs in the aioslirp process: set the tracing mode up, then behave as ``aioslirp``.
WRAPPER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from aioslirp.observe import tracing
    mode = sys.argv[2]
    if mode == "api":
        tracing.enable()  # no SDK installed as global provider: non-recording spans
    elif mode in ("sdk", "file"):
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from aioslirp.cli.observe import JsonLinesSpanExporter, NoopSpanExporter
        tp = TracerProvider()
        exp = NoopSpanExporter() if mode == "sdk" else JsonLinesSpanExporter(sys.argv[3])
        tp.add_span_processor(BatchSpanProcessor(exp, max_queue_size=1 << 16, max_export_batch_size=2048))
        tracing.enable(tp)
    from aioslirp.cli import main
    rc = main(sys.argv[4:])
    if mode in ("sdk", "file"):
        tracing.end_all(); tp.shutdown()
    sys.exit(rc)
""")

#: Runs in the guest: N CRR iterations, one JSON line of latencies (us).
CLIENT = textwrap.dedent("""
    import json, socket, sys, time
    port, n, warmup = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    lat = []
    ns = time.perf_counter_ns
    for i in range(n + warmup):
        t = ns()
        s = socket.create_connection(("10.0.2.2", port))
        s.sendall(b"x")
        if s.recv(1) != b"x":
            raise SystemExit("bad echo")
        s.close()
        if i >= warmup:
            lat.append(ns() - t)
    lat.sort()
    pct = lambda p: lat[min(len(lat) - 1, int(p / 100 * len(lat)))] / 1000
    print(json.dumps({"n": len(lat), "p50": pct(50), "p90": pct(90), "p99": pct(99),
                      "mean": sum(lat) / len(lat) / 1000}))
""")


class EchoServer:
    """1-byte echo on 127.0.0.1: reads one byte, echoes it, waits for EOF, closes. One thread."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                try:
                    d = c.recv(1)
                    if d:
                        c.sendall(d)
                    while c.recv(64):
                        pass
                except OSError:
                    pass


def run_mode(mode: str, port: int, n: int, warmup: int, pin: str | None, trace_file: str = "") -> dict:
    argv = [sys.executable, "-c", WRAPPER, REPO, mode, trace_file or "-",
            "run", "--trace-level", "frames", "--", sys.executable, "-c", CLIENT, str(port), str(n), str(warmup)]
    if pin is not None:
        argv = ["taskset", "-c", pin] + argv
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{mode}: rc={p.returncode}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2000, help="CRR iterations per run (default 2000)")
    ap.add_argument("--warmup", type=int, default=200, help="iterations dropped at the start of each run")
    ap.add_argument("--rounds", type=int, default=5, help="runs per mode, interleaved (default 5)")
    ap.add_argument("--pin", metavar="CPU", help="taskset -c CPU for aioslirp and the client (the path cost)")
    ap.add_argument("--no-file", action="store_true", help="skip the --trace file mode")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    if args.pin is not None:
        os.sched_setaffinity(0, {int(c) for c in args.pin.split(",")})  # the echo server thread too
    server = EchoServer()
    modes = ["off", "api", "sdk"] + ([] if args.no_file else ["file"])
    results: dict = {m: [] for m in modes}
    trace_path = os.path.join("/tmp", f"aioslirp-overhead-{os.getpid()}.jsonl")
    try:
        for r in range(args.rounds):
            for m in modes:
                res = run_mode(m, server.port, args.iterations, args.warmup, args.pin, trace_path)
                results[m].append(res)
                print(f"round {r + 1} {m:>4}: p50 {res['p50']:.1f} us p90 {res['p90']:.1f} us", file=sys.stderr)
    finally:
        if os.path.exists(trace_path):
            os.unlink(trace_path)
    summary = {}
    for m in modes:
        p50s = [x["p50"] for x in results[m]]
        summary[m] = {"p50_median": statistics.median(p50s), "p50_min": min(p50s), "p50_max": max(p50s),
                      "p90_median": statistics.median(x["p90"] for x in results[m]), "runs": results[m]}
    base = summary["off"]["p50_median"]
    report = {
        "iterations": args.iterations, "warmup": args.warmup, "rounds": args.rounds, "pin": args.pin,
        "cpus": os.cpu_count(), "python": sys.version.split()[0], "modes": summary,
    }
    print(f"\nCRR through `aioslirp run`, {args.iterations} iterations x {args.rounds} rounds per mode"
          f"{', pinned to CPU ' + args.pin if args.pin else ', unpinned'} (us)\n")
    print("| mode | p50 (median of runs) | p50 min-max | p90 | vs off |")
    print("| --- | ---: | ---: | ---: | ---: |")
    labels = {"off": "tracing off", "api": "API only (no SDK)", "sdk": "SDK + no-op exporter", "file": "SDK + --trace file"}
    for m in modes:
        s = summary[m]
        print(f"| {labels[m]} | {s['p50_median']:.1f} | {s['p50_min']:.1f}-{s['p50_max']:.1f} | {s['p90_median']:.1f} | "
              f"{100.0 * (s['p50_median'] - base) / base:+.1f}% |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
