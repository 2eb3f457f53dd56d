#!/usr/bin/env python3
"""The same QEMU guest over five back ends in one run: aioslirp vhost-user (guest TCP flows in the
native TCP engine on the rings, the default; and ``-python``: ``AIOSLIRP_NATIVE=0``, in Python), aioslirp
stream, passt ``--vhost-user`` and passt over its stream socket (issue 27's targets).

Run as root from the repository (QEMU >= 8: ``../shared/guestvm/qemu-backports.sh``; iperf3;
passt 2026 built by ``../shared/peers/build.sh`` into ``.cache/peers``, or ``--passt PATH``)::

    sudo .venv/bin/python benchmarks/vhost_user.py                  # 1 round, MTU 65520 and 1500
    sudo .venv/bin/python benchmarks/vhost_user.py --rounds 3 --smp 1,2
    sudo .venv/bin/python benchmarks/vhost_user.py --tests crr,rr --mtus 1500   # latency only

What it does (the set-up of benchmarks/qemu_vs_passt.py): moves itself into a fresh network
namespace with only loopback and a veth black hole for passt's default route; for each round,
MTU and back end (order alternated every round) starts the back end on a fresh UNIX socket,
boots the guestvm guest (TCG unless KVM is usable; ``-netdev vhost-user`` with its RAM in a
shared memfd, or ``-netdev stream``), and in the guest runs ``iperf3 -c 10.0.2.2 -t T`` (guest
to host) and ``iperf3 -R`` (host to guest) against ``iperf3 -s`` on the host's 127.0.0.1, then
``bench crr 10.0.2.2 PORT L W`` and ``bench rr ...`` (benchmarks/bench.c, built with
``cc -O2 -static`` and put into the guest as ``/bin/bench`` by a second gzip'd cpio archive
appended to a temporary copy of the kit's initramfs) against one host ``bench server`` on
127.0.0.1: CRR is connect, 1 byte each way, close; RR is 1 byte each way on one connection;
each prints one JSON line on the guest's console (p50/p90/p99 in microseconds over
the L seconds after a W-second warm-up: ``--latency-seconds``, ``--warmup``). Per run: iperf3
throughput each way (the host iperf3's JSON), CRR and RR p50 inside the guest, and the back
end's CPU seconds from boot to the end of iperf3, also per GB moved (iperf3's bytes).
``--tests`` picks among iperf3, crr and rr. Medians go to a markdown table with the ratios the
issue targets (throughput >= 1.1x passt vhost-user and >= 1.5x aioslirp stream,
CRR/RR p50 <= 1.0x passt vhost-user); every record, with its ratios to the same round's passt
vhost-user run, to ``benchmarks/results/vhost_user-STAMP.json``.

Under TCG the emulated guest CPU bounds every back end: compare back ends within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import shutil
import signal
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

BACKENDS = ("aioslirp-vhost-user", "aioslirp-vhost-user-python", "aioslirp-stream", "passt-vhost-user",
            "passt-stream")
TESTS = ("iperf3", "crr", "rr")
REFERENCE = "passt-vhost-user"  # the CRR/RR ratios' denominator
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
    env.pop("AIOSLIRP_NATIVE", None)  # the native data plane (the default): guest TCP flows in C on the rings
    if name.endswith("-python"):  # the Python data path
        env["AIOSLIRP_NATIVE"] = "0"
    if name.startswith("aioslirp"):
        cmd = "vhost-user" if "vhost-user" in name else "qemu"
        argv = [sys.executable, "-m", "aioslirp", cmd, "--socket", str(sock), "--mtu", str(mtu)]
    else:
        argv = [passt, "-f", "-q", "--runas", "0:0", "-s", str(sock), "-m", str(mtu), "-a", "10.0.2.15",
                "-n", "24", "-g", "10.0.2.2", "-D", "10.0.2.3", "-1", "-l", str(sock) + ".log"]
        if name.endswith("vhost-user"):
            argv.insert(1, "--vhost-user")
    return subprocess.Popen(argv, stdout=log, stderr=log, env=env)


def build_guest_bench(workdir: Path, cache: Path | None = None) -> Path:
    """Compile benchmarks/bench.c statically into ``workdir/bench`` (the guest has no libc of
    ours) and return ``workdir/initramfs-bench.cpio.gz``: the kit's initramfs (from ``cache``,
    default the built kit) plus ``/bin/bench`` (mode 0755). The same binary is the host's server.
    Raises RuntimeError without a C compiler, CalledProcessError when the build fails."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler for benchmarks/bench.c (apt-get install gcc)")
    exe = workdir / "bench"
    subprocess.run([cc, "-O2", "-static", "-o", str(exe), str(HERE / "bench.c")], check=True)
    return qemu.initrd_with({"bin/bench": (exe.read_bytes(), 0o755)}, workdir / "initramfs-bench.cpio.gz",
                             cache)


def start_bench_server(exe: Path) -> tuple[subprocess.Popen, int]:
    """``bench server 127.0.0.1 PORT PORT`` (TCP echo for crr/rr); returns it and its TCP port."""
    port = free_port()
    proc = subprocess.Popen([str(exe), "server", "127.0.0.1", str(port), str(port)], stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    if not line.strip() or not json.loads(line).get("ready"):
        proc.kill()
        raise RuntimeError(f"bench server did not start: {line!r}")
    return proc, port


def guest_script(tests, t: int, p_up: int, p_down: int, bench_port: int, lat_s: float, warm_s: float) -> str:
    """The guest's shell snippet: per test in ``tests`` a ``KEY_RC=status`` line, and for crr/rr
    ``CRR=``/``RR=`` followed by bench's JSON line (its stderr after it, on failure)."""
    lines = []
    if "iperf3" in tests:
        lines += [f"iperf3 -c 10.0.2.2 -p {p_up} -t {t} >/dev/null 2>&1; echo UP_RC=$?",
                  f"iperf3 -c 10.0.2.2 -p {p_down} -t {t} -R >/dev/null 2>&1; echo DOWN_RC=$?"]
    for mode in ("crr", "rr"):
        if mode in tests:
            key = mode.upper()
            lines += [f"R=$(bench {mode} 10.0.2.2 {bench_port} {lat_s:g} {warm_s:g} 2>/tmp/{mode}.err); "
                      f"echo {key}_RC=$?; echo \"{key}=$R\"; cat /tmp/{mode}.err"]
    return "\n" + "\n".join(lines) + "\n"


def parse_latency(values: dict, mode: str) -> dict | None:
    """bench's JSON line for ``mode`` from the guest's ``KEY=VALUE`` lines, or None when the
    run failed (status not 0, no line, or no measured iteration)."""
    key = mode.upper()
    if values.get(f"{key}_RC") != "0":
        return None
    try:
        res = json.loads(values.get(key, ""))
    except ValueError:
        return None
    return res if res.get("mode") == mode and res.get("n", 0) > 0 and "p50" in res else None


def add_ratios(records: list[dict]) -> None:
    """Set ``crr_p50_vs_passt_vhost_user`` / ``rr_p50_vs_passt_vhost_user`` on every record with
    a p50: its p50 over the p50 of the passt vhost-user run of the same round, MTU and -smp."""
    for rec in records:
        ref = next((r for r in records if r["backend"] == REFERENCE and
                    (r.get("round"), r["mtu"], r["smp"]) == (rec.get("round"), rec["mtu"], rec["smp"])), None)
        for mode in ("crr", "rr"):
            k = f"{mode}_p50_us"
            if ref is not None and k in rec and ref.get(k):
                rec[f"{mode}_p50_vs_passt_vhost_user"] = round(rec[k] / ref[k], 3)


async def one_run(backend: str, mtu: int, smp: int, args, workdir: Path) -> dict:
    sock = workdir / f"{backend}-{mtu}-{smp}.sock"
    p_up, p_down = free_port(), free_port()
    iperf = "iperf3" in args.tests
    iperfs = [subprocess.Popen(["iperf3", "-s", "-1", "-J", "-B", "127.0.0.1", "-p", str(p)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
              for p in ((p_up, p_down) if iperf else ())]
    t = args.seconds
    cmd = guest_script(args.tests, t, p_up, p_down, args.bench_port, args.latency_seconds, args.warmup)
    budget = 60 + (4 * t if iperf else 0) + sum(2 * (args.latency_seconds + args.warmup) + 10
                                                 for m in ("crr", "rr") if m in args.tests)
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
                argv = qemu.vhost_user_argv(sock, cmd, workdir=workdir, smp=smp, initrd=args.initrd)
            else:
                argv = qemu.qemu_argv(f"stream,server=off,addr.type=unix,addr.path={sock}", cmd, workdir=workdir,
                                      initrd=args.initrd)
                if smp != 1:
                    argv[argv.index("-smp") + 1] = str(smp)
            t0 = time.monotonic()
            vm = await qemu.Vm.start(argv)
            dump = backend.startswith("aioslirp-vhost-user")  # SIGUSR1: the back end logs its rings' state
            stalled = False
            if iperf:  # the CPU per GB counts boot and iperf3 only, not the crr/rr that follow
                stalled = not await vm.wait_for_key("DOWN_RC", budget)
                v = vm.result.values
                if dump and not stalled and (v.get("UP_RC") != "0" or v.get("DOWN_RC") != "0"):
                    proc.send_signal(signal.SIGUSR1)  # iperf3 failed: the guest is still up, its rings mapped
            cpu = cpu_seconds(proc.pid) - cpu0
            if not stalled:
                try:
                    await asyncio.wait_for(asyncio.shield(vm.proc.wait()), max(1.0, budget - (time.monotonic() - t0)))
                except asyncio.TimeoutError:
                    stalled = True
            if stalled and dump:  # the guest is still up: before QEMU is killed
                proc.send_signal(signal.SIGUSR1)
                await asyncio.sleep(1.0)
            res = await vm.wait(1.0 if stalled else max(1.0, budget - (time.monotonic() - t0)))
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
           "ok": res.rc == 0 and (not iperf or (v.get("UP_RC") == "0" and v.get("DOWN_RC") == "0"))}
    moved = 0
    if iperf:
        try:
            rec["iperf_up_mbit"] = round(outs[0]["end"]["sum_received"]["bits_per_second"] / 1e6, 1)
            rec["iperf_down_mbit"] = round(outs[1]["end"]["sum_sent"]["bits_per_second"] / 1e6, 1)
            moved = outs[0]["end"]["sum_received"]["bytes"] + outs[1]["end"]["sum_sent"]["bytes"]
        except (KeyError, IndexError):
            rec["ok"] = False
    for mode in ("crr", "rr"):
        if mode in args.tests:
            lat = parse_latency(v, mode)
            if lat is None:
                rec["ok"] = False
            else:
                rec[mode] = lat
                rec[f"{mode}_p50_us"] = lat["p50"]
    rec["backend_cpu_s"] = round(cpu, 2)  # boot + iperf3 (the whole run without iperf3)
    if moved:
        rec["backend_cpu_s_per_gb"] = round(cpu / (moved / 1e9), 3)
    rec["wall_s"] = round(res.wall, 2)
    if not rec["ok"]:
        rec["console_tail"] = res.tail(30)
        rec["backend_log_tail"] = (workdir / f"{backend}-{mtu}-{smp}.log").read_text(errors="replace")[-6000:]
    return rec


def median(recs, key):
    vals = [r[key] for r in recs if r.get("ok") and key in r]
    return statistics.median(vals) if vals else float("nan")


def table(records: list[dict]) -> str:
    return "\n\n".join(f"guest -smp {smp}:\n\n" + _table([r for r in records if r["smp"] == smp])
                       for smp in sorted({r["smp"] for r in records}))


def _fig(x: float, spec: str, suffix: str = "") -> str:
    """``x`` formatted, or ``-`` when there is no figure (NaN: the test was not run or failed)."""
    return "-" if math.isnan(x) else f"{x:{spec}}{suffix}"


def _table(records: list[dict]) -> str:
    rows = ["| back end | MTU | runs ok | iperf3 guest→host (Mbit/s) | iperf3 host→guest (Mbit/s) "
            "| back end CPU per GB (s) | CRR p50 (µs) | CRR / passt vhost-user | RR p50 (µs) "
            "| RR / passt vhost-user |", "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for mtu in sorted({r["mtu"] for r in records}):
        def m(b, k):
            return median([r for r in records if r["backend"] == b and r["mtu"] == mtu], k)
        for backend in BACKENDS:
            recs = [r for r in records if r["backend"] == backend and r["mtu"] == mtu]
            if not recs:
                continue
            okn = sum(1 for r in recs if r["ok"])
            crr, rr = m(backend, "crr_p50_us"), m(backend, "rr_p50_us")
            rows.append(f"| {backend} | {mtu} | {okn}/{len(recs)} | {_fig(m(backend, 'iperf_up_mbit'), '.0f')} "
                        f"| {_fig(m(backend, 'iperf_down_mbit'), '.0f')} "
                        f"| {_fig(m(backend, 'backend_cpu_s_per_gb'), '.2f')} "
                        f"| {_fig(crr, '.0f')} | {_fig(crr / m(REFERENCE, 'crr_p50_us'), '.2f', 'x')} "
                        f"| {_fig(rr, '.0f')} | {_fig(rr / m(REFERENCE, 'rr_p50_us'), '.2f', 'x')} |")
        for ours in ("aioslirp-vhost-user", "aioslirp-vhost-user-python"):
            label = ours.replace("aioslirp-", "aioslirp ", 1)
            for other, target in ((REFERENCE, 1.1), ("aioslirp-stream", 1.5)):
                up = m(ours, "iperf_up_mbit") / m(other, "iperf_up_mbit")
                down = m(ours, "iperf_down_mbit") / m(other, "iperf_down_mbit")
                if not (math.isnan(up) or math.isnan(down)):
                    verdict = "met" if up >= target and down >= target else "not met"
                    verdicts.append(f"MTU {mtu}: {label} / {other}: {up:.2f}x up, {down:.2f}x down "
                                    f"(target >= {target}x both ways: {verdict})")
            crr = m(ours, "crr_p50_us") / m(REFERENCE, "crr_p50_us")
            rr = m(ours, "rr_p50_us") / m(REFERENCE, "rr_p50_us")
            if not (math.isnan(crr) and math.isnan(rr)):
                verdict = "met" if crr <= 1.0 and rr <= 1.0 else "not met"
                verdicts.append(f"MTU {mtu}: {label} / {REFERENCE} p50 in the guest: "
                                f"{_fig(crr, '.2f', 'x')} CRR, {_fig(rr, '.2f', 'x')} RR (target <= 1.0x both: {verdict})")
    return "\n".join(rows + [""] + verdicts)


async def main_async(args) -> int:
    qemu.ensure_built()
    records = []
    workdir = Path(tempfile.mkdtemp(prefix="vhost-user-bench-"))
    os.chmod(workdir, 0o755)
    server = None
    args.initrd, args.bench_port = None, 0
    try:
        if "crr" in args.tests or "rr" in args.tests:
            args.initrd = build_guest_bench(workdir)
            server, args.bench_port = start_bench_server(workdir / "bench")
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
        if server is not None:
            server.terminate()
            server.communicate(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
    add_ratios(records)
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {"accel": qemu.accel(), "cpus": os.cpu_count(), "rounds": args.rounds, "smp": args.smp,
            "seconds": args.seconds, "tests": args.tests, "latency_seconds": args.latency_seconds,
            "warmup_seconds": args.warmup, "passt": args.passt,
            "qemu": subprocess.run([qemu.QEMU, "--version"], capture_output=True, text=True).stdout.split("\n")[0]}
    (out_dir / f"vhost_user-{stamp}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    print()
    print(f"QEMU guest ({meta['accel']}, {meta['cpus']} host CPUs), tests {','.join(args.tests)}, "
          f"iperf3 -t {args.seconds}, bench crr/rr {args.latency_seconds:g} s after {args.warmup:g} s warm-up, "
          f"medians over {args.rounds} round(s):")
    print()
    print(table(records))
    return 0 if all(r["ok"] for r in records) else 1


def option_error(args) -> str | None:
    """The first bad option as ``--name: what is wrong`` (one line), or None."""
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        return f"--backends: unknown {bad[0]!r} (choose from {', '.join(BACKENDS)})"
    bad = [t for t in args.tests if t not in TESTS]
    if bad:
        return f"--tests: unknown {bad[0]!r} (choose from {', '.join(TESTS)})"
    if args.latency_seconds <= 0:
        return f"--latency-seconds: {args.latency_seconds:g} is not > 0"
    if args.warmup < 0:
        return f"--warmup: {args.warmup:g} is negative"
    return None


def _ints(text: str) -> list[int]:
    """A comma list of integers (``--mtus``, ``--smp``)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace | None, str | None]:
    """``(args, None)`` for good options, ``(None, "--name: what is wrong")`` for a bad value
    (argparse itself exits with status 2 on an unknown option). ``run.py --vm`` checks its
    pass-through options with this before its own run starts."""
    parser = argparse.ArgumentParser(prog="vhost_user.py", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("--rounds", type=int, default=1, help="rounds (default 1)")
    parser.add_argument("--mtus", type=_ints, default=[65520, 1500],
                        help="comma-separated MTUs (default 65520,1500)")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS),
                        help=f"comma-separated, of {','.join(BACKENDS)} (default all)")
    parser.add_argument("--seconds", type=int, default=4, help="iperf3 -t (default 4)")
    parser.add_argument("--smp", type=_ints, default=[1],
                        help="comma-separated guest CPU counts (default 1)")
    parser.add_argument("--tests", type=lambda s: s.split(","), default=list(TESTS),
                        help=f"comma-separated, of {','.join(TESTS)} (default all)")
    parser.add_argument("--latency-seconds", type=float, default=4.0,
                        help="bench crr/rr measured duration in the guest (default 4)")
    parser.add_argument("--warmup", type=float, default=1.0, help="bench crr/rr warm-up seconds (default 1)")
    parser.add_argument("--passt", metavar="PATH", help="the passt binary (default: the 2026 build in .cache/peers)")
    try:
        args, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:  # a value of the wrong type: one line, as the checks below
        return None, str(exc)
    if extra:
        return None, f"unrecognized arguments: {' '.join(extra)}"
    error = option_error(args)
    return (None, error) if error else (args, None)


def main(argv: list[str] | None = None) -> int:
    args, error = parse(argv)
    if args is None:
        print(f"vhost_user.py: error: {error}", file=sys.stderr)
        return 2
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
