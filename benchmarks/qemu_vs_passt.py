#!/usr/bin/env python3
"""QEMU guest over ``-netdev stream``: aioslirp (``aioslirp qemu``) against passt, same guest, same run.

Run as root from the repository (Debian: ``apt-get install qemu-system-x86 passt iperf3 cpio``;
the guest kernel + initramfs come from ../shared/guestvm, built into ``$GUESTVM_CACHE`` or
``.cache/guestvm`` on first use)::

    sudo .venv/bin/python benchmarks/qemu_vs_passt.py              # 3 rounds, MTU 1500 and 65520
    sudo .venv/bin/python benchmarks/qemu_vs_passt.py --rounds 1 --mtus 1500

What it does:

1. Moves itself into a fresh network namespace with only loopback (``aioslirp.host.isolate``),
   so neither backend can reach anything but this machine's loopback. passt refuses to start
   without an external interface, so a veth pair with both ends inside this namespace and a
   default route into it (TEST-NET-1, nothing answers) stands in for one.
2. Starts host servers on 127.0.0.1: an HTTP server (``tests/support/servers.py``) and one-off
   ``iperf3 -s`` per measurement.
3. For each round, MTU and backend (order alternated every round): starts the backend on a
   fresh UNIX socket (``aioslirp qemu --socket P --mtu M`` or ``passt -f -s P -m M -a 10.0.2.15
   -n 24 -g 10.0.2.2 -D 10.0.2.3 -1``; both map the gateway 10.0.2.2 to the host's
   127.0.0.1), boots the guest (TCG unless KVM is usable) with
   ``-netdev stream,server=off,addr.type=unix,addr.path=P`` and DHCP, and in the guest:
   downloads 20 MB with busybox wget (SHA-256 checked), then runs ``iperf3 -c 10.0.2.2 -t 3``
   (guest to host) and ``iperf3 -R`` (host to guest).
4. Reports per run: wall time from QEMU start to the end of the download ("boot to
   download"), the guest's uptime then, the download time, iperf3 throughput each way (from
   the host iperf3's JSON), and the backend's CPU seconds (``/proc/PID/stat``). Medians over
   rounds go to a markdown table on stdout; every record to
   ``benchmarks/results/qemu_vs_passt-STAMP.json``.

Numbers are for comparing the two backends on the same machine in the same run, not
absolute: under TCG the guest's own CPU dominates.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import hashlib
import json
import os
import shutil
import socket
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

from support import qemu  # noqa: E402  (tests/support/qemu.py)
from support.servers import DataServer, pattern  # noqa: E402

from aioslirp.host.isolate import isolate_network  # noqa: E402

SIZE = 20 * 1024 * 1024
TICK = os.sysconf("SC_CLK_TCK")


def blackhole_default_route() -> None:
    """A default route into a veth pair that lives entirely in this namespace (passt needs one)."""
    for cmd in (["ip", "link", "add", "qbh0", "type", "veth", "peer", "name", "qbh1"],
                ["ip", "link", "set", "qbh1", "up"],
                ["ip", "addr", "add", "192.0.2.1/24", "dev", "qbh0"],
                ["ip", "link", "set", "qbh0", "up"],
                ["ip", "route", "add", "default", "via", "192.0.2.254", "dev", "qbh0"]):
        subprocess.run(cmd, check=True, capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def start_backend(name: str, sock: Path, mtu: int, log) -> subprocess.Popen:
    if name == "aioslirp":
        argv = [sys.executable, "-m", "aioslirp", "qemu", "--socket", str(sock), "--mtu", str(mtu)]
    else:
        argv = ["passt", "-f", "-q", "--runas", "0:0", "-s", str(sock), "-m", str(mtu), "-a", "10.0.2.15",
                "-n", "24", "-g", "10.0.2.2", "-D", "10.0.2.3", "-1", "-l", str(sock) + ".log"]
    return subprocess.Popen(argv, stdout=log, stderr=log)


async def one_run(backend: str, mtu: int, data: DataServer, workdir: Path) -> dict:
    sock = workdir / f"{backend}-{mtu}.sock"
    p_up, p_down = free_port(), free_port()
    iperfs = [subprocess.Popen(["iperf3", "-s", "-1", "-J", "-B", "127.0.0.1", "-p", str(p)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for p in (p_up, p_down)]
    with open(workdir / f"{backend}-{mtu}.log", "w") as log:
        proc = start_backend(backend, sock, mtu, log)
        try:
            for _ in range(500):
                if sock.exists():
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"{backend} exited with {proc.returncode}")
                await asyncio.sleep(0.01)
            time.sleep(0.1)
            cpu0 = cpu_seconds(proc.pid)
            cmd = f"""
read U _ < /proc/uptime; echo DL_START=$U
wget -q -O - http://10.0.2.2:{data.port}/{SIZE} | sha256sum | {{ read h _; echo DOWN_SHA=$h; }}
read U _ < /proc/uptime; echo DL_END=$U
iperf3 -c 10.0.2.2 -p {p_up} -t 3 >/dev/null 2>&1; echo UP_RC=$?
iperf3 -c 10.0.2.2 -p {p_down} -t 3 -R >/dev/null 2>&1; echo DOWN_RC=$?
"""
            argv = qemu.qemu_argv(f"stream,server=off,addr.type=unix,addr.path={sock}", cmd, workdir=workdir)
            res = await qemu.run_vm(argv, 180)
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
    ok = (res.rc == 0 and v.get("DOWN_SHA") == hashlib.sha256(pattern(SIZE, 1)).hexdigest()
          and v.get("UP_RC") == "0" and v.get("DOWN_RC") == "0")
    rec = {"backend": backend, "mtu": mtu, "ok": ok, "guest_rc": res.rc, "timed_out": res.timed_out}
    if v.get("DL_END") and v.get("DL_START"):
        rec["boot_to_download_s"] = round(res.at["DL_END"], 2)
        rec["guest_uptime_at_download_s"] = float(v["DL_END"])
        rec["download_s"] = round(float(v["DL_END"]) - float(v["DL_START"]), 2)
        rec["dhcp_ready_s"] = round(res.at.get("DL_START", float("nan")), 2)
    try:
        rec["iperf_up_mbit"] = round(outs[0]["end"]["sum_received"]["bits_per_second"] / 1e6, 1)
        rec["iperf_down_mbit"] = round(outs[1]["end"]["sum_sent"]["bits_per_second"] / 1e6, 1)
    except (KeyError, IndexError):
        pass
    rec["backend_cpu_s"] = round(cpu, 2)
    rec["wall_s"] = round(res.wall, 2)
    if not ok:
        rec["console_tail"] = res.tail(30)
    return rec


def median(recs, key):
    vals = [r[key] for r in recs if r.get("ok") and key in r]
    return statistics.median(vals) if vals else float("nan")


def table(records: list[dict]) -> str:
    rows = ["| backend | MTU | runs ok | boot to 20 MB downloaded (s) | guest uptime then (s) | download (s) "
            "| iperf3 guest→host (Mbit/s) | iperf3 host→guest (Mbit/s) | backend CPU (s) |",
            "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["mtu"], r["backend"]) for r in records})
    for mtu, backend in keys:
        recs = [r for r in records if r["backend"] == backend and r["mtu"] == mtu]
        okn = sum(1 for r in recs if r["ok"])
        rows.append(f"| {backend} | {mtu} | {okn}/{len(recs)} | {median(recs, 'boot_to_download_s'):.2f} "
                    f"| {median(recs, 'guest_uptime_at_download_s'):.2f} | {median(recs, 'download_s'):.2f} "
                    f"| {median(recs, 'iperf_up_mbit'):.0f} | {median(recs, 'iperf_down_mbit'):.0f} "
                    f"| {median(recs, 'backend_cpu_s'):.2f} |")
    return "\n".join(rows)


async def main_async(args) -> int:
    qemu.ensure_built()
    data = DataServer()
    records = []
    workdir = Path(tempfile.mkdtemp(prefix="qemu-vs-passt-"))
    os.chmod(workdir, 0o755)
    try:
        for rnd in range(args.rounds):
            for mtu in args.mtus:
                order = list(args.backends)
                if rnd % 2:
                    order.reverse()
                for backend in order:
                    rec = await one_run(backend, mtu, data, workdir)
                    rec["round"] = rnd
                    records.append(rec)
                    print(json.dumps({k: v for k, v in rec.items() if k != "console_tail"}), flush=True)
                    if not rec["ok"]:
                        print(rec.get("console_tail", ""), file=sys.stderr)
    finally:
        data.close()
        shutil.rmtree(workdir, ignore_errors=True)
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {"accel": qemu.accel(), "cpus": os.cpu_count(), "rounds": args.rounds,
            "qemu": subprocess.run([qemu.QEMU, "--version"], capture_output=True, text=True).stdout.split("\n")[0]}
    (out_dir / f"qemu_vs_passt-{stamp}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    print()
    print(f"QEMU guest (-netdev stream, {meta['accel']}, {meta['cpus']} CPUs), medians over {args.rounds} round(s):")
    print()
    print(table(records))
    return 0 if all(r["ok"] for r in records) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--mtus", type=lambda s: [int(x) for x in s.split(",")], default=[1500, 65520],
                        help="comma-separated MTUs (default 1500,65520)")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["aioslirp", "passt"],
                        help="comma-separated: aioslirp,passt (default both)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("qemu_vs_passt: error: run as root (network namespace with a veth black hole for passt)", file=sys.stderr)
        return 2
    for tool in ("passt", "iperf3", qemu.QEMU):
        if "passt" not in args.backends and tool == "passt":
            continue
        if shutil.which(tool) is None:
            print(f"qemu_vs_passt: error: {tool} not found (apt-get install passt iperf3 qemu-system-x86)",
                  file=sys.stderr)
            return 2
    isolate_network()
    blackhole_default_route()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
