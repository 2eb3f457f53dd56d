#!/usr/bin/env python3
"""Port-forward throughput, host -> guest: aioslirp ``-p`` against pasta ``-t``, in one run.

Usage (root, or a user with unprivileged user namespaces; needs ``pasta`` from Debian's
``passt`` package, ``ip`` and ``unshare``)::

    python benchmarks/forward_vs_pasta.py [--size-mb 20] [--rounds 5] [--pin CPU] [--json FILE]

What it does:

1. Moves itself into a private network namespace with only loopback (the same sandbox as
   ``benchmarks/run.py``; pasta needs a default route to exist, so a black-hole veth pair
   with both ends inside that namespace provides one). Nothing leaves the machine.
2. For each backend, starts it with one TCP forward ``127.0.0.1:PORT -> guest :8080`` and,
   as the command inside the new namespace, the guest server
   ``tests/support/guest_programs/forward_servers.py``:
   ``aioslirp run -p 127.0.0.1:PORT:8080`` (MTU 1500 and 65520) and
   ``pasta --config-net -t 127.0.0.1/PORT:8080``.
3. Runs ``--rounds`` exchanges: the host client sends ``SIZE`` bytes and half-closes while
   reading; the guest server reads to EOF, answers their SHA-256 and then ``SIZE`` bytes of
   its own and closes. Both directions are verified by SHA-256. *Up* is host -> guest (from
   the connect to the first reply byte), *down* guest -> host (first reply byte to EOF).
4. Prints a markdown table (medians over the rounds; MB = 10^6 bytes) with the backend
   process's CPU seconds per GB moved, and optionally writes all samples as JSON.

Note that pasta serves connections from the host's loopback by *splicing* them to the
namespace's loopback (two sockets and ``splice(2)``, no TAP and no TCP/IP in user space),
while aioslirp carries every forwarded byte through its user-space TCP and the TAP
device. The comparison is the one a user sees; it is not the same amount of work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import select
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GUEST_SERVER = os.path.join(ROOT, "tests", "support", "guest_programs", "forward_servers.py")
GUEST_PORT = 8080
#: Seconds without progress after which a round counts as stalled.
STALL_S = 20.0


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backends(python: str, port: int) -> dict[str, list[str]]:
    guest = [python, GUEST_SERVER, str(GUEST_PORT), str(GUEST_PORT + 1)]
    aioslirp = [python, "-m", "aioslirp", "run", "-p", f"127.0.0.1:{port}:{GUEST_PORT}"]
    return {
        "aioslirp -p (MTU 1500)": aioslirp + ["--"] + guest,
        "aioslirp -p (MTU 65520)": aioslirp + ["--mtu", "65520", "--"] + guest,
        "pasta -t": ["pasta", "-f", "-q", "--runas", "0:0", "-4", "--config-net", "-a", "10.0.2.15", "-n", "24",
                     "-g", "10.0.2.2", "-I", "tap0", "-t", f"127.0.0.1/{port}:{GUEST_PORT}", "-u", "none",
                     "-T", "none", "-U", "none", "--"] + guest,
    }


def exchange(port: int, up: bytes, up_sha: str, n_down: int, seed: int, down_sha: str) -> tuple[float, float]:
    """One round; returns (up_seconds, down_seconds). Raises AssertionError on a mismatch."""
    s = socket.create_connection(("127.0.0.1", port), timeout=STALL_S)
    t0 = time.perf_counter()

    def sender() -> None:
        s.sendall(b"%d %d\n" % (n_down, seed))
        s.sendall(up)
        s.shutdown(socket.SHUT_WR)

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    try:
        buf = b""
        while b"\n" not in buf:
            d = s.recv(1 << 20)
            if not d:
                raise RoundFailed("truncated", f"EOF before the reply ({len(buf)} bytes)")
            buf += d
        t1 = time.perf_counter()
        header, body = buf.split(b"\n", 1)
        h = hashlib.sha256(body)
        n = len(body)
        while True:
            d = s.recv(1 << 20)
            if not d:
                break
            h.update(d)
            n += len(d)
        t2 = time.perf_counter()
    except (socket.timeout, TimeoutError):
        raise RoundFailed("stalled", f"no progress for {STALL_S:g} s") from None
    except ConnectionResetError:
        raise RoundFailed("reset", "connection reset") from None
    finally:
        s.close()
        th.join(STALL_S)
    if header.decode() != f"{len(up)} {up_sha}":
        raise RoundFailed("corrupt-up", f"guest received something else: {header!r}")
    if n != n_down:
        raise RoundFailed("truncated", f"host received {n} of {n_down} bytes")
    if h.hexdigest() != down_sha:
        raise RoundFailed("corrupt-down", "host received other bytes (SHA-256 differs)")
    return t1 - t0, t2 - t1


class RoundFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def measure(name: str, argv: list[str], port: int, size: int, rounds: int) -> dict:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"READY":
            raise RuntimeError(f"{name}: guest did not start: {proc.stderr.read1(4000)!r}")
        # the forward may come up a moment after the guest (pasta binds after the child starts)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        up = random.Random(1).randbytes(size)
        up_sha = hashlib.sha256(up).hexdigest()
        down_sha = hashlib.sha256(random.Random(2).randbytes(size)).hexdigest()
        failures: list[str] = []
        samples: list[tuple[float, float]] = []
        cpu = 0.0
        attempts = 0
        for attempt in range(3 * rounds + 1):
            if len(samples) >= rounds:
                break
            attempts += 1
            cpu0 = cpu_seconds(proc.pid)
            try:
                sample = exchange(port, up, up_sha, size, 2, down_sha)
            except RoundFailed as exc:
                failures.append(str(exc))
                print(f"# {name}: round failed: {exc}", file=sys.stderr)
                continue
            if attempt == 0 and not failures:
                continue  # the first good round is a warm-up
            cpu += cpu_seconds(proc.pid) - cpu0
            samples.append(sample)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if not samples:
        return {"backend": name, "argv": argv, "size_bytes": size, "rounds": 0, "attempts": attempts,
                "failed_rounds": len(failures),
                "failures": failures, "up_MBps": None, "down_MBps": None, "both_MBps": None, "cpu_s_per_GB": None,
                "samples_s": []}
    ups = [size / u / 1e6 for u, _ in samples]
    downs = [size / d / 1e6 for _, d in samples]
    both = [2 * size / (u + d) / 1e6 for u, d in samples]
    return {
        "backend": name,
        "argv": argv,
        "size_bytes": size,
        "rounds": len(samples),
        "attempts": attempts,
        "failed_rounds": len(failures),
        "failures": failures,
        "up_MBps": round(statistics.median(ups), 1),
        "down_MBps": round(statistics.median(downs), 1),
        "both_MBps": round(statistics.median(both), 1),
        "cpu_s_per_GB": round(cpu / (2 * size * len(samples) / 1e9), 2),
        "samples_s": [[round(u, 4), round(d, 4)] for u, d in samples],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=20.0, help="MiB each way per round (default 20)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per backend (default 5)")
    ap.add_argument("--pin", type=int, metavar="CPU", help="pin the client, the backend and the guest to one CPU")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--only", action="append", metavar="SUBSTRING", help="run only backends whose name contains this")
    args = ap.parse_args()
    if not shutil.which("pasta"):
        print("forward_vs_pasta.py: pasta not found (apt-get install passt)", file=sys.stderr)
        return 2
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    from run import enter_sandbox  # benchmarks/run.py: loopback-only netns + black-hole default route

    enter_sandbox(need_default_route=True)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    size = int(args.size_mb * 1024 * 1024)
    results = []
    for name, argv in backends(sys.executable, 0).items():
        if args.only and not any(s in name for s in args.only):
            continue
        port = free_port()
        argv = backends(sys.executable, port)[name]
        r = measure(name, argv, port, size, args.rounds)
        results.append(r)
        print(f"# {name}: up {r['up_MBps']} MB/s, down {r['down_MBps']} MB/s", file=sys.stderr)
    pinned = f"pinned to CPU {args.pin}" if args.pin is not None else "unpinned"
    print(f"\nHost -> guest port forward, {args.size_mb:g} MiB each way per round, median of {args.rounds} "
          f"rounds, {pinned}\n")
    print("| backend | up (host->guest) MB/s | down (guest->host) MB/s | both ways MB/s | backend CPU s/GB "
          "| failed rounds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['backend']} | {r['up_MBps']} | {r['down_MBps']} | {r['both_MBps']} | {r['cpu_s_per_GB']} "
              f"| {r['failed_rounds']} of {r['attempts']} |")
    print("\n(a failed round: the transfer was truncated, stalled, reset or corrupted; each round is checked "
          "by SHA-256 both ways; the first good round is a warm-up and not timed)")
    ref = next((r for r in results if r["backend"].startswith("pasta") and r["both_MBps"]), None)
    if ref:
        print()
        for r in results:
            if r is not ref and r["both_MBps"]:
                print(f"{r['backend']}: {r['both_MBps'] / ref['both_MBps']:.2f} x pasta's throughput (both ways)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pinned": args.pin, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
