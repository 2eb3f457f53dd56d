#!/usr/bin/env python3
"""The same QEMU guest over five back ends in one run: aioslirp vhost-user (guest TCP flows in
Python, and ``-native``: ``AIOSLIRP_NATIVE=1``, the native TCP engine on the rings), aioslirp
stream, passt ``--vhost-user`` and passt over its stream socket (issue 27's targets).

Run as root from the repository (QEMU >= 8: ``../shared/guestvm/qemu-backports.sh``; iperf3;
passt 2026 built by ``../shared/peers/build.sh`` into ``.cache/peers``, or ``--passt PATH``)::

    sudo .venv/bin/python benchmarks/vhost_user.py                  # 1 round, MTU 65520 and 1500
    sudo .venv/bin/python benchmarks/vhost_user.py --rounds 3 --smp 1,2

What it does (the set-up of benchmarks/qemu_vs_passt.py): moves itself into a fresh network
namespace with only loopback and a veth black hole for passt's default route; for each round,
MTU and back end (order alternated every round) starts the back end on a fresh UNIX socket,
boots the guestvm guest (TCG unless KVM is usable; ``-netdev vhost-user`` with its RAM in a
shared memfd, or ``-netdev stream``), and in the guest runs ``iperf3 -c 10.0.2.2 -t T`` (guest
to host) and ``iperf3 -R`` (host to guest) against ``iperf3 -s`` on the host's 127.0.0.1. Per
run: iperf3 throughput each way (the host iperf3's JSON) and the back end's CPU seconds, also
per GB moved. Medians go to a markdown table with the ratios the issue targets; every record to
``benchmarks/results/vhost_user-STAMP.json``.

Under TCG the emulated guest CPU bounds every back end: compare back ends within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from qemu_vs_passt import blackhole_default_route, cpu_seconds, free_port  # noqa: E402
from support import qemu  # noqa: E402  (tests/support/qemu.py)

from aioslirp.host.isolate import isolate_network  # noqa: E402

BACKENDS = ("aioslirp-vhost-user", "aioslirp-vhost-user-native", "aioslirp-stream", "passt-vhost-user",
            "passt-stream")
PEERS = REPO / ".cache" / "peers"


def find_passt(given: str | None) -> str | None:
    if given:
        return given
    built = sorted(PEERS.glob("passt-*/passt"))
    if built:
        return str(built[-1])
    script = REPO.parent / "shared" / "peers" / "build.sh"
    if script.exists():
        p = subprocess.run(["sh", str(script), str(PEERS)], capture_output=True, text=True)
        if p.returncode == 0:
            return str(Path(p.stdout.strip()).with_name("passt"))
    return None


def start_backend(name: str, sock: Path, mtu: int, passt: str, log) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if name.endswith("-native"):  # the native data plane: guest TCP flows in the C engine on the rings
        env["AIOSLIRP_NATIVE"] = "1"
    if name.startswith("aioslirp"):
        cmd = "vhost-user" if "vhost-user" in name else "qemu"
        argv = [sys.executable, "-m", "aioslirp", cmd, "--socket", str(sock), "--mtu", str(mtu)]
    else:
        argv = [passt, "-f", "-q", "--runas", "0:0", "-s", str(sock), "-m", str(mtu), "-a", "10.0.2.15",
                "-n", "24", "-g", "10.0.2.2", "-D", "10.0.2.3", "-1", "-l", str(sock) + ".log"]
        if name.endswith("vhost-user"):
            argv.insert(1, "--vhost-user")
    return subprocess.Popen(argv, stdout=log, stderr=log, env=env)


async def one_run(backend: str, mtu: int, smp: int, args, workdir: Path) -> dict:
    sock = workdir / f"{backend}-{mtu}-{smp}.sock"
    p_up, p_down = free_port(), free_port()
    iperfs = [subprocess.Popen(["iperf3", "-s", "-1", "-J", "-B", "127.0.0.1", "-p", str(p)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for p in (p_up, p_down)]
    t = args.seconds
    cmd = f"""
iperf3 -c 10.0.2.2 -p {p_up} -t {t} >/dev/null 2>&1; echo UP_RC=$?
iperf3 -c 10.0.2.2 -p {p_down} -t {t} -R >/dev/null 2>&1; echo DOWN_RC=$?
"""
    with open(workdir / f"{backend}-{mtu}-{smp}.log", "w") as log:
        proc = start_backend(backend, sock, mtu, args.passt, log)
        try:
            for _ in range(1000):
                if sock.exists():
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"{backend} exited with {proc.returncode}")
                await asyncio.sleep(0.01)
            time.sleep(0.2)
            cpu0 = cpu_seconds(proc.pid)
            if "vhost-user" in backend:
                argv = qemu.vhost_user_argv(sock, cmd, workdir=workdir, smp=smp)
            else:
                argv = qemu.qemu_argv(f"stream,server=off,addr.type=unix,addr.path={sock}", cmd, workdir=workdir)
                if smp != 1:
                    argv[argv.index("-smp") + 1] = str(smp)
            res = await qemu.run_vm(argv, 60 + 4 * t)
            cpu = cpu_seconds(proc.pid) - cpu0
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    outs = []
    for p in iperfs:
        try:
            out, _ = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            out = ""
        outs.append(json.loads(out) if out.strip() else {})
    v = res.values
    rec = {"backend": backend, "mtu": mtu, "smp": smp, "guest_rc": res.rc, "timed_out": res.timed_out,
           "ok": res.rc == 0 and v.get("UP_RC") == "0" and v.get("DOWN_RC") == "0"}
    moved = 0
    try:
        rec["iperf_up_mbit"] = round(outs[0]["end"]["sum_received"]["bits_per_second"] / 1e6, 1)
        rec["iperf_down_mbit"] = round(outs[1]["end"]["sum_sent"]["bits_per_second"] / 1e6, 1)
        moved = outs[0]["end"]["sum_received"]["bytes"] + outs[1]["end"]["sum_sent"]["bytes"]
    except (KeyError, IndexError):
        rec["ok"] = False
    rec["backend_cpu_s"] = round(cpu, 2)
    if moved:
        rec["backend_cpu_s_per_gb"] = round(cpu / (moved / 1e9), 3)
    rec["wall_s"] = round(res.wall, 2)
    if not rec["ok"]:
        rec["console_tail"] = res.tail(30)
        rec["backend_log_tail"] = (workdir / f"{backend}-{mtu}-{smp}.log").read_text(errors="replace")[-3000:]
    return rec


def median(recs, key):
    vals = [r[key] for r in recs if r.get("ok") and key in r]
    return statistics.median(vals) if vals else float("nan")


def table(records: list[dict]) -> str:
    return "\n\n".join(f"guest -smp {smp}:\n\n" + _table([r for r in records if r["smp"] == smp])
                       for smp in sorted({r["smp"] for r in records}))


def _table(records: list[dict]) -> str:
    rows = ["| back end | MTU | runs ok | iperf3 guest→host (Mbit/s) | iperf3 host→guest (Mbit/s) "
            "| back end CPU per GB (s) |", "|---|---|---|---|---|---|"]
    for mtu in sorted({r["mtu"] for r in records}):
        for backend in BACKENDS:
            recs = [r for r in records if r["backend"] == backend and r["mtu"] == mtu]
            if not recs:
                continue
            okn = sum(1 for r in recs if r["ok"])
            rows.append(f"| {backend} | {mtu} | {okn}/{len(recs)} | {median(recs, 'iperf_up_mbit'):.0f} "
                        f"| {median(recs, 'iperf_down_mbit'):.0f} | {median(recs, 'backend_cpu_s_per_gb'):.2f} |")
    rows.append("")
    for mtu in sorted({r["mtu"] for r in records}):
        def m(b, k):
            return median([r for r in records if r["backend"] == b and r["mtu"] == mtu], k)
        for ours in ("aioslirp-vhost-user", "aioslirp-vhost-user-native"):
            for other, target in (("passt-vhost-user", 1.1), ("aioslirp-stream", 1.5)):
                up = m(ours, "iperf_up_mbit") / m(other, "iperf_up_mbit")
                down = m(ours, "iperf_down_mbit") / m(other, "iperf_down_mbit")
                if up != up or down != down:  # one of them not run (nan)
                    continue
                verdict = "met" if up >= target and down >= target else "not met"
                rows.append(f"MTU {mtu}: {ours} / {other}: {up:.2f}x up, {down:.2f}x down "
                            f"(target >= {target}x both ways: {verdict})")
    return "\n".join(rows)


async def main_async(args) -> int:
    qemu.ensure_built()
    records = []
    workdir = Path(tempfile.mkdtemp(prefix="vhost-user-bench-"))
    os.chmod(workdir, 0o755)
    try:
        for rnd in range(args.rounds):
            for smp, mtu in [(smp, mtu) for smp in args.smp for mtu in args.mtus]:
                order = list(args.backends)
                if rnd % 2:
                    order.reverse()
                for backend in order:
                    rec = await one_run(backend, mtu, smp, args, workdir)
                    rec["round"] = rnd
                    records.append(rec)
                    print(json.dumps({k: v for k, v in rec.items() if k not in ("console_tail", "backend_log_tail")}), flush=True)
                    if not rec["ok"]:
                        print(rec.get("console_tail", ""), rec.get("backend_log_tail", ""), file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {"accel": qemu.accel(), "cpus": os.cpu_count(), "rounds": args.rounds, "smp": args.smp,
            "seconds": args.seconds, "passt": args.passt,
            "qemu": subprocess.run([qemu.QEMU, "--version"], capture_output=True, text=True).stdout.split("\n")[0]}
    (out_dir / f"vhost_user-{stamp}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    print()
    print(f"QEMU guest ({meta['accel']}, {meta['cpus']} host CPUs), iperf3 -t {args.seconds}, "
          f"medians over {args.rounds} round(s):")
    print()
    print(table(records))
    return 0 if all(r["ok"] for r in records) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="rounds (default 1)")
    parser.add_argument("--mtus", type=lambda s: [int(x) for x in s.split(",")], default=[65520, 1500],
                        help="comma-separated MTUs (default 65520,1500)")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS),
                        help=f"comma-separated, of {','.join(BACKENDS)} (default all)")
    parser.add_argument("--seconds", type=int, default=4, help="iperf3 -t (default 4)")
    parser.add_argument("--smp", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                        help="comma-separated guest CPU counts (default 1)")
    parser.add_argument("--passt", metavar="PATH", help="the passt binary (default: the 2026 build in .cache/peers)")
    args = parser.parse_args()
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        parser.error(f"--backends: unknown {bad[0]!r} (choose from {', '.join(BACKENDS)})")
    if os.geteuid() != 0:
        print("vhost_user: error: run as root (network namespace with a veth black hole for passt)", file=sys.stderr)
        return 2
    if any(b.startswith("passt") for b in args.backends):
        args.passt = find_passt(args.passt)
        if args.passt is None:
            print("vhost_user: error: no passt 2026 build (../shared/peers/build.sh, or --passt PATH)", file=sys.stderr)
            return 2
    for tool in ("iperf3", qemu.QEMU):
        if shutil.which(tool) is None:
            print(f"vhost_user: error: {tool} not found (apt-get install iperf3 qemu-system-x86)", file=sys.stderr)
            return 2
    isolate_network()
    blackhole_default_route()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
