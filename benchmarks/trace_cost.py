"""What the native TCP engine's trace points cost while tracing is off, in instructions (issue 26:
"the trace points cost < 1% of CRR when off, A/B against a build without them").

Timing cannot resolve a few untaken branches per frame on a shared 2-CPU machine (the spread of
CRR runs is up to 25%: docs/performance.md), so this counts instructions with callgrind, which are
the same from run to run whatever else the machine does. Two builds of the native extension from
this checkout: as shipped, and with ``-DTN_NO_TRACE`` (the points compiled out), each in a copy of
the package in a temporary directory. Each drives the same CRR-shaped workload through the
engine's fake sockets (``TcpEngine(..., fake=True)``: adopt, SYN-ACK, the guest's ACK and request,
the host's reply and FIN, the guest's ACK and FIN, the end record): only the engine's C runs per
frame, no kernel. The instructions inside aioslirp/native/*.c are summed per connection.

Usage: ``python benchmarks/trace_cost.py [--connections N]``; needs valgrind and a C compiler.
Prints the two counts per connection and their difference, and the difference as a share of a
CRR connection's whole backend CPU (given by ``--cpu-us``, measured by benchmarks/run.py; the
instructions are converted at a deliberately slow 1 ns each, so the share printed is an upper
bound).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GUEST_MAC = bytes.fromhex("525400123456")
GW_MAC = bytes.fromhex("52550a000202")
GUEST = socket.inet_aton("10.0.2.15")
GW = socket.inet_aton("10.0.2.2")
HOST = socket.inet_aton("127.0.0.1")
IRS, ISS, DPORT = 1000, 5000, 8080


def child(n: int) -> None:
    """The workload (run under callgrind): n CRR-shaped connections through a fake engine."""
    import dpkt

    from aioslirp import native

    ext = native.extension()
    if ext is None:
        raise SystemExit(f"trace_cost.py: the native extension is not usable: {native.why_not()}")

    def frame(gport: int, flags: int, seq: int, ack: int, data: bytes = b"") -> bytes:
        t = dpkt.tcp.TCP(sport=gport, dport=DPORT, seq=seq, ack=ack, flags=flags, win=512, data=data)
        ip = dpkt.ip.IP(src=GUEST, dst=GW, p=6, ttl=64, data=t)
        ip.len = 20 + len(bytes(t))
        return bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=GW_MAC, type=0x0800, data=ip))

    A, F, P = dpkt.tcp.TH_ACK, dpkt.tcp.TH_FIN, dpkt.tcp.TH_PUSH
    req, reply = b"GET / HTTP/1.0\r\n\r\n", b"x" * 100
    plans = []
    for i in range(n):  # every frame built before the engine runs
        g = 10000 + i
        plans.append((g, frame(g, A, IRS + 1, ISS + 1), frame(g, A | P, IRS + 1, ISS + 1, req),
                      frame(g, A, IRS + 1 + len(req), ISS + 1 + len(reply) + 1),
                      frame(g, A | F, IRS + 1 + len(req), ISS + 1 + len(reply) + 1)))
    e = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 64, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    e.fake_connect_mode(0)
    now = 0.0
    for g, ack, request, ack_reply, fin in plans:
        now += 0.001
        _status, slot, gen = e.adopt(False, GUEST_MAC, GUEST, g, GW, DPORT, HOST, DPORT, IRS, ISS, 1460, 7, 65535,
                                     now)
        fd = e.fake_fds()[-1]
        e.input(ack, False, now)
        e.input(request, False, now)
        e.fake_host_send(fd, reply, now)
        e.fake_host_eof(fd, now)
        e.input(ack_reply, False, now)
        e.input(fin, False, now)
        e.fake_frames()
        e.poll(now + 2.0)  # TIME-WAIT over: the end record
        now += 2.0


def build(tree: Path, no_trace: bool) -> None:
    env = dict(os.environ, AIOSLIRP_NO_MYPYC="1")
    if no_trace:
        env["CFLAGS"] = (env.get("CFLAGS", "") + " -DTN_NO_TRACE").strip()
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def count(tree: Path, n: int, out: Path) -> int:
    """Instructions inside aioslirp/native/*.c for n connections (callgrind, self cost)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                    "--child", str(n)], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
                          capture_output=True, text=True, check=True).stdout
    total = 0
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S+):", line)
        if m and "/native/" in m.group(2) and m.group(2).endswith(".c"):
            total += int(m.group(1).replace(",", ""))
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--cpu-us", type=float, default=50.0,
                    help="a CRR connection's backend CPU, µs (benchmarks/run.py; default 50)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return 0
    for tool in ("valgrind", "callgrind_annotate"):
        if not shutil.which(tool):
            print(f"trace_cost.py: {tool} is missing (apt-get install valgrind)", file=sys.stderr)
            return 1
    results = {}
    with tempfile.TemporaryDirectory(prefix="aioslirp-trace-cost-") as tmp:
        for name, no_trace in (("points compiled in, off", False), ("compiled out (-DTN_NO_TRACE)", True)):
            tree = Path(tmp) / ("without" if no_trace else "with")
            shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "build", "docs",
                                                                      "tests", "benchmarks", "*.so", "__pycache__"))
            build(tree, no_trace)
            results[name] = count(tree, args.connections, Path(tmp) / f"{tree.name}.out") / args.connections
    (a_name, a), (b_name, b) = results.items()
    print(f"native engine instructions per connection ({args.connections} connections, callgrind):")
    print(f"  {a_name}: {a:,.0f}")
    print(f"  {b_name}: {b:,.0f}")
    delta = a - b
    print(f"  difference: {delta:,.0f} instructions ({100 * delta / b:+.2f}% of the engine's own)")
    print(f"  at 1 ns per instruction, {delta / 1000:.3f} µs: {100 * delta / 1000 / args.cpu_us:.3f}% of a "
          f"{args.cpu_us:g} µs CRR connection (an upper bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
