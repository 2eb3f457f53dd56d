"""Reproduce the CRR investigation of docs/crr-latency.md: one CRR loop two ways, both traced.

* ``per-process``: a driver in the guest starts a **new Python client process per
  iteration**; each client does one connect / 1-byte request / 1-byte response / close.
  The driver times each iteration from spawn to exit; the client prints the time of its
  own CRR (connect to close).
* ``one-process``: one client process runs all N iterations in a loop.

Both are first run without tracing (the client-side gap), then under ``aioslirp run --trace FILE`` against a 1-byte echo server on the host's
127.0.0.1, and each trace file is summarised with ``aioslirp trace-report``. Usage, from
the repository root (root, or rootless with user namespaces)::

    python benchmarks/crr_investigation.py [--per-process 200] [--one-process 2000] [--pin CPU]
        [--keep DIR] [--png]

Prints the client-side figures, both reports and a two-line comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tracing_overhead import EchoServer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE_CRR = textwrap.dedent("""
    import socket, sys, time
    t = time.perf_counter_ns()
    s = socket.create_connection(("10.0.2.2", int(sys.argv[1])))
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    s.close()
    print((time.perf_counter_ns() - t) / 1000)
""")

PER_PROCESS_DRIVER = textwrap.dedent("""
    import json, subprocess, sys, time
    port, n, client = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    wall, inner = [], []
    for _ in range(n):
        t = time.perf_counter_ns()
        out = subprocess.run([sys.executable, "-c", client, port], capture_output=True, text=True, check=True).stdout
        wall.append((time.perf_counter_ns() - t) / 1000)
        inner.append(float(out))
    wall.sort(); inner.sort()
    print(json.dumps({"n": n, "iteration_p50_us": wall[n // 2], "iteration_p90_us": wall[int(n * 0.9)],
                      "crr_in_client_p50_us": inner[n // 2]}))
""")

ONE_PROCESS = textwrap.dedent("""
    import json, socket, sys, time
    port, n = int(sys.argv[1]), int(sys.argv[2])
    lat = []
    for _ in range(n):
        t = time.perf_counter_ns()
        s = socket.create_connection(("10.0.2.2", port))
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        s.close()
        lat.append((time.perf_counter_ns() - t) / 1000)
    lat.sort()
    print(json.dumps({"n": n, "iteration_p50_us": lat[n // 2], "iteration_p90_us": lat[int(n * 0.9)],
                      "crr_in_client_p50_us": lat[n // 2]}))
""")


def traced_run(trace: str | None, guest_argv: list, pin: str | None) -> dict:
    """Run ``guest_argv`` under ``aioslirp run`` (``--trace trace`` unless None); its JSON line."""
    argv = [sys.executable, "-m", "aioslirp", "run", *(["--trace", trace, "--trace-level", "frames"] if trace else []), "--", *guest_argv]
    if pin is not None:
        argv = ["taskset", "-c", pin] + argv
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO))
    if p.returncode != 0:
        raise SystemExit(f"aioslirp run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def report(trace: str, png: bool) -> str:
    argv = [sys.executable, "-m", "aioslirp", "trace-report", trace, "--connections", "1"]
    if png:
        argv += ["--png", trace.rsplit(".", 1)[0] + ".png"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    if p.returncode != 0:
        raise SystemExit(p.stderr)
    return p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-process", type=int, default=200, metavar="N", help="iterations, one process each (200)")
    ap.add_argument("--one-process", type=int, default=2000, metavar="N", help="iterations in one process (2000)")
    ap.add_argument("--pin", metavar="CPU", help="taskset -c CPU for aioslirp and the guest")
    ap.add_argument("--keep", metavar="DIR", help="keep the trace files (and PNGs) in DIR")
    ap.add_argument("--png", action="store_true", help="also draw each report (needs matplotlib)")
    args = ap.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {int(c) for c in args.pin.split(",")})  # the echo server thread too
    server = EchoServer()
    workdir = args.keep or tempfile.mkdtemp(prefix="aioslirp-crr-")
    os.makedirs(workdir, exist_ok=True)
    a_trace = os.path.join(workdir, "per-process.jsonl")
    b_trace = os.path.join(workdir, "one-process.jsonl")
    a_argv = [sys.executable, "-c", PER_PROCESS_DRIVER, str(server.port), str(args.per_process), ONE_CRR]
    b_argv = [sys.executable, "-c", ONE_PROCESS, str(server.port), str(args.one_process)]
    a0 = traced_run(None, a_argv, args.pin)
    b0 = traced_run(None, b_argv, args.pin)
    print(f"== without tracing: iteration p50 {a0['iteration_p50_us']:.0f} us with a new client process per "
          f"iteration, {b0['iteration_p50_us']:.0f} us in one process: "
          f"{a0['iteration_p50_us'] / b0['iteration_p50_us']:.0f}x\n")
    a = traced_run(a_trace, a_argv, args.pin)
    b = traced_run(b_trace, b_argv, args.pin)
    print(f"== per-process: {a['n']} iterations, a new client process each "
          f"({'pinned to CPU ' + args.pin if args.pin else 'unpinned'})")
    print(f"client view: iteration (spawn to exit) p50 {a['iteration_p50_us']:.0f} us, p90 {a['iteration_p90_us']:.0f} us; "
          f"CRR inside the client p50 {a['crr_in_client_p50_us']:.0f} us\n")
    print(report(a_trace, args.png))
    print(f"== one-process: {b['n']} iterations in one client process")
    print(f"client view: iteration p50 {b['iteration_p50_us']:.0f} us, p90 {b['iteration_p90_us']:.0f} us\n")
    print(report(b_trace, args.png))
    print(f"== traced, per-process / one-process iteration p50: {a['iteration_p50_us'] / b['iteration_p50_us']:.0f}x")
    if not args.keep:
        for f in os.listdir(workdir):
            os.unlink(os.path.join(workdir, f))
        os.rmdir(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
