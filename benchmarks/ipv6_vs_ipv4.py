"""TCP throughput over IPv6 against IPv4 through ``aioslirp run`` (issue 5).

1. Moves itself into a fresh network namespace with only loopback (``aioslirp.host.isolate``),
   so nothing leaves the machine; starts one threaded TCP data server on 127.0.0.1 and one on
   ``::1`` (``tests/support/servers.py``: ``DOWN n seed`` / ``UP``).
2. For each family and each placement (unpinned; ``--pin CPU``: aioslirp and the guest on one
   CPU with ``taskset``, the path cost), runs ``aioslirp run`` with one guest Python process
   that downloads and uploads ``--mb`` MiB through the gateway (10.0.2.2 or [fd00::2]),
   ``--repeat`` times, checking SHA-256 both ways.
3. Prints a markdown table of the medians (Mbit/s) and writes the raw numbers as JSON to
   ``benchmarks/results/ipv6_vs_ipv4-<time>.json``.

Run as root (or with user namespaces): ``.venv/bin/python benchmarks/ipv6_vs_ipv4.py [--mb 50]
[--repeat 5] [--pin 0]``. Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

GUEST = r"""
import socket, hashlib, json, time, random, sys
host, port, n, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = random.Random(9).randbytes(n)
out = []
for i in range(repeat):
    s = socket.create_connection((host, port), timeout=60)
    s.sendall(b"DOWN %d 7\n" % n)
    h = hashlib.sha256(); got = 0; t0 = time.monotonic()
    while True:
        d = s.recv(1 << 20)
        if not d: break
        h.update(d); got += len(d)
    down = time.monotonic() - t0
    s.close()
    s = socket.create_connection((host, port), timeout=60)
    t0 = time.monotonic()
    s.sendall(b"UP\n" + data)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = s.recv(4096)
        if not d: break
        reply += d
    up = time.monotonic() - t0
    s.close()
    out.append({"down_s": down, "up_s": up, "got": got, "sha": h.hexdigest(), "reply": reply.decode()})
print(json.dumps(out))
"""


def run_family(family: str, port: int, mb: int, repeat: int, pin: str | None, run_opts=()) -> list[dict]:
    host = "10.0.2.2" if family == "ipv4" else "fd00::2"
    n = mb << 20
    argv = [sys.executable, "-m", "aioslirp", "run", *run_opts, "--", sys.executable, "-c", textwrap.dedent(GUEST),
            host, str(port), str(n), str(repeat)]
    if pin is not None:
        argv = ["taskset", "-c", pin, *argv]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{family}: rc={p.returncode}\n{p.stderr[-2000:]}")
    from support.servers import pattern

    want_down = hashlib.sha256(pattern(n, 7)).hexdigest()
    want_up = hashlib.sha256(pattern(n, 9)).hexdigest()
    runs = json.loads(p.stdout.strip().splitlines()[-1])
    for r in runs:
        assert r["got"] == n and r["sha"] == want_down, f"{family}: download corrupted"
        assert r["reply"].split() == [str(n), want_up], f"{family}: upload corrupted"
    return [{"down_mbit": n * 8 / r["down_s"] / 1e6, "up_mbit": n * 8 / r["up_s"] / 1e6} for r in runs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--mb", type=int, default=50, help="MiB per transfer (default 50)")
    ap.add_argument("--repeat", type=int, default=5, help="transfers each way per run (default 5)")
    ap.add_argument("--pin", metavar="CPU", help="also run pinned to this CPU (taskset -c)")
    ap.add_argument("--run-opt", action="append", default=[], metavar="OPT",
                    help="extra option for 'aioslirp run' (repeatable), e.g. --run-opt=--no-offload")
    args = ap.parse_args()

    from aioslirp.host.isolate import isolate_network
    from support.servers import DataServer

    isolate_network()
    srv4, srv6 = DataServer(), DataServer(host="::1")
    results: dict = {"mb": args.mb, "repeat": args.repeat, "cpus": os.cpu_count(), "run_opts": args.run_opt,
                     "runs": {}}
    try:
        for placement in ["unpinned"] + ([f"pin{args.pin}"] if args.pin is not None else []):
            pin = args.pin if placement != "unpinned" else None
            for family, srv in (("ipv4", srv4), ("ipv6", srv6)):
                results["runs"][f"{family}/{placement}"] = run_family(family, srv.port, args.mb, args.repeat, pin,
                                                                      args.run_opt)
    finally:
        srv4.close()
        srv6.close()
    print(f"| run | download Mbit/s (median) | upload Mbit/s (median) |\n| --- | --- | --- |")
    for name, runs in results["runs"].items():
        d = statistics.median(r["down_mbit"] for r in runs)
        u = statistics.median(r["up_mbit"] for r in runs)
        results.setdefault("medians", {})[name] = {"down_mbit": round(d), "up_mbit": round(u)}
        print(f"| {name} | {d:.0f} | {u:.0f} |")
    out = HERE / "results" / f"ipv6_vs_ipv4-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
