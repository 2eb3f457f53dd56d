"""Bulk TCP throughput and backend CPU per GB through an identity handler vs the plain NAT path (issue 17).

1. Moves itself into a fresh network namespace with only loopback (``aioslirp.host.isolate``;
   ``--no-isolate`` to stay), so nothing leaves the machine, and starts a small host data
   server in a **separate process** (``python3 -c``) on 127.0.0.1, so its CPU is not counted.
2. For each round and each mode (interleaved), in this process: an embedded ``aioslirp.Stack``,
   either plain (``nat``: the NAT path) or with ``stack.route("*", identity)`` where
   ``identity`` is::

       async def identity(flow, reader, writer):
           r2, w2 = await flow.open_upstream()
           await aioslirp.splice(reader, writer, r2, w2)

   and ``aioslirp.spawn([python3 -c CLIENT], stack=stack)``: a guest Python client (its own
   process, not counted) that, once told to go, connects to the gateway 10.0.2.2 (the host's
   127.0.0.1) and downloads ``--size`` MB from the server (``download``) or uploads as much
   (``upload``).
3. Per transfer: wall time and Gbit/s as the guest measures them (connect to last byte /
   server's reply), and this process's CPU seconds (``time.process_time()``, i.e. the stack
   and the handler) per GB (1e9 bytes) over the same window. Every transfer's byte count and
   SHA-256 are checked against the pattern (no lost byte) or the run fails.
4. Prints ``| mode | direction | Gbit/s (median) | CPU s/GB (median) |``; ``--json PATH``
   writes every transfer and the medians.

Run as root (or with user namespaces), like ``aioslirp run``:
``.venv/bin/python benchmarks/handler_bulk.py [--size 500] [--rounds 3] [--json out.json]``.
Figures are reported, never asserted; small sizes only check that it works (noise).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import aioslirp  # noqa: E402

MB = 1_000_000
BLOCK_SEED = 17
MODES = ("nat", "identity")
DIRECTIONS = ("download", "upload")

# The data pattern: one 1 MiB random block repeated, the last one cut (server, guest and the check agree).
PATTERN = """
import random
BLOCK = random.Random(%d).randbytes(1 << 20)
def chunks(n):
    mv = memoryview(BLOCK)
    while n > 0:
        k = min(n, len(BLOCK))
        yield mv[:k]
        n -= k
""" % BLOCK_SEED

# Host server: one connection at a time. "DOWN n\n": sends n bytes of the pattern, closes.
# "UP n\n" + bytes to EOF: replies "count sha256\n", closes. Prints its port first.
SERVER = PATTERN + r"""
import hashlib, socket, sys
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
buf = bytearray(1 << 20)
while True:
    c, _ = srv.accept()
    with c:
        line = b""
        while not line.endswith(b"\n"):
            d = c.recv(1)
            if not d:
                break
            line += d
        cmd = line.split()
        if cmd[:1] == [b"DOWN"]:
            for ch in chunks(int(cmd[1])):
                c.sendall(ch)
        elif cmd[:1] == [b"UP"]:
            h = hashlib.sha256(); got = 0
            while True:
                k = c.recv_into(buf)
                if not k:
                    break
                h.update(memoryview(buf)[:k]); got += k
            c.sendall(b"%d %s\n" % (got, h.hexdigest().encode()))
"""

# Guest client: says it is ready, waits for a line on stdin, does one transfer, prints JSON.
CLIENT = PATTERN + r"""
import hashlib, json, socket, sys, time
host, port, direction, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
s = socket.create_connection((host, port), timeout=120)
h = hashlib.sha256(); got = 0
if direction == "download":
    s.sendall(b"DOWN %d\n" % n)
    buf = bytearray(1 << 20)
    while True:
        k = s.recv_into(buf)
        if not k:
            break
        h.update(memoryview(buf)[:k]); got += k
    res = {"got": got, "sha": h.hexdigest()}
else:
    s.sendall(b"UP %d\n" % n)
    for ch in chunks(n):
        s.sendall(ch)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = s.recv(4096)
        if not d:
            break
        reply += d
    got, sha = reply.split()
    res = {"got": int(got), "sha": sha.decode()}
res["wall_s"] = time.monotonic() - t0
s.close()
print(json.dumps(res), flush=True)
"""


async def identity(flow, reader, writer):
    """The identity handler: the natural host connection, spliced both ways."""
    r2, w2 = await flow.open_upstream()
    await aioslirp.splice(reader, writer, r2, w2)


def expected_sha(n: int) -> str:
    ns: dict = {}
    exec(PATTERN, ns)
    h = hashlib.sha256()
    for ch in ns["chunks"](n):
        h.update(ch)
    return h.hexdigest()


async def transfer(mode: str, direction: str, port: int, n: int, want_sha: str) -> dict:
    """One transfer through a fresh stack; returns its record (raises if a byte is lost)."""
    argv = [sys.executable, "-c", textwrap.dedent(CLIENT), "10.0.2.2", str(port), direction, str(n)]
    async with aioslirp.Stack(aioslirp.NetworkConfig()) as stack:
        if mode == "identity":
            stack.route("*", identity)
        async with aioslirp.spawn(argv, stack=stack, stdin=asyncio.subprocess.PIPE,
                                  stdout=asyncio.subprocess.PIPE) as guest:
            line = await asyncio.wait_for(guest.stdout.readline(), 60)
            if line.strip() != b"ready":
                raise RuntimeError(f"{mode}/{direction}: guest said {line!r}")
            cpu0, t0 = time.process_time(), time.monotonic()
            guest.stdin.write(b"go\n")
            await guest.stdin.drain()
            line = await guest.stdout.readline()
            cpu1, t1 = time.process_time(), time.monotonic()
            rc = await asyncio.wait_for(guest.wait(), 30)
        handled = stack.stats()["counters"].get("handler_flows.tcp", 0)
    if rc != 0 or not line:
        raise RuntimeError(f"{mode}/{direction}: guest exited {rc} without a result")
    if handled != (1 if mode == "identity" else 0):
        raise RuntimeError(f"{mode}/{direction}: {handled} flows went through a handler")
    res = json.loads(line)
    if res["got"] != n or res["sha"] != want_sha:
        raise RuntimeError(f"{mode}/{direction}: {res['got']} of {n} bytes, sha {res['sha']} (want {want_sha})")
    wall = res["wall_s"]
    return {"mode": mode, "direction": direction, "bytes": n, "wall_s": wall, "outer_wall_s": t1 - t0,
            "gbps": n * 8 / wall / 1e9, "cpu_s": cpu1 - cpu0, "cpu_s_per_gb": (cpu1 - cpu0) / (n / 1e9),
            "handler_flows": handled}


def start_server() -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER)], stdout=subprocess.PIPE, text=True)
    port = p.stdout.readline().strip()
    if not port.isdigit():
        p.kill()
        raise SystemExit(f"host server did not start (rc={p.wait()})")
    return p, int(port)


async def run(args) -> dict:
    n = args.size * MB
    want = expected_sha(n)
    srv, port = start_server()
    records = []
    try:
        for rnd in range(args.rounds):
            for direction in DIRECTIONS:
                order = MODES if rnd % 2 == 0 else MODES[::-1]  # interleaved, alternating which goes first
                for mode in order:
                    rec = await transfer(mode, direction, port, n, want)
                    rec["round"] = rnd
                    records.append(rec)
                    print(f"round {rnd} {mode:8} {direction:8} {rec['gbps']:.3f} Gbit/s "
                          f"{rec['cpu_s_per_gb']:.2f} CPU s/GB", file=sys.stderr, flush=True)
    finally:
        srv.kill()
        srv.wait()
    medians = []
    for mode in MODES:
        for direction in DIRECTIONS:
            rs = [r for r in records if r["mode"] == mode and r["direction"] == direction]
            medians.append({"mode": mode, "direction": direction, "n": len(rs),
                            "wall_s": statistics.median(r["wall_s"] for r in rs),
                            "gbps": statistics.median(r["gbps"] for r in rs),
                            "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in rs)})
    return {"size_mb": args.size, "rounds": args.rounds, "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(), "python": sys.version.split()[0], "medians": medians, "records": records}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", type=int, default=500, metavar="MB", help="MB (1e6 bytes) per transfer (default 500)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, modes interleaved (default 3)")
    ap.add_argument("--json", metavar="PATH", help="write the transfers and medians as JSON")
    ap.add_argument("--no-isolate", action="store_true", help="stay in this network namespace")
    args = ap.parse_args()
    if args.size < 1 or args.rounds < 1:
        ap.error("--size and --rounds must be >= 1")
    if not args.no_isolate:
        from aioslirp.host.isolate import isolate_network

        isolate_network()
    result = asyncio.run(run(args))
    print("| mode | direction | Gbit/s (median) | CPU s/GB (median) |\n| --- | --- | --- | --- |")
    for m in result["medians"]:
        print(f"| {m['mode']} | {m['direction']} | {m['gbps']:.3f} | {m['cpu_s_per_gb']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
