#!/usr/bin/env python3
"""aioslirp benchmark harness: aioslirp against pasta, slirp4netns and a kernel veth pair.

Run as root from the repository (needs ``pasta``, ``slirp4netns``, ``iperf3``, ``nsenter``,
``unshare``, ``ip``; Debian: ``apt-get install passt slirp4netns iperf3 iproute2 util-linux``)::

    sudo .venv/bin/python benchmarks/run.py            # full run, under 10 minutes
    sudo .venv/bin/python benchmarks/run.py --quick    # 1-2 minutes, fewer/shorter repetitions
    sudo .venv/bin/python benchmarks/run.py --pasta "$(../shared/peers/build.sh)"   # and today's upstream pasta

What it does (see docs/performance.md for the method):

1. Moves itself into a fresh network namespace with only loopback (``aioslirp.host.isolate``) and
   a private mount namespace, so nothing it starts can reach anything outside this machine.
   pasta refuses to start without a default route, so a veth pair with both ends inside
   this private namespace serves as a black-hole default route (TEST-NET 192.0.2.0/24).
2. For each round, CPU placement (``pinned``: client, servers and backend on one CPU;
   ``unpinned``) and backend (order rotated every round): creates a fresh guest network
   namespace, attaches the backend, starts the host servers (``hostserver.py`` and
   ``iperf3 -s``) on 127.0.0.1 (the veth peer address for the kernel reference) and runs
   each test as ONE client process inside the namespace (``client.py`` or ``iperf3 -c``).
   Backend CPU time comes from ``/proc/PID/task/*/sched`` (``se.sum_exec_runtime``).
3. Writes ``benchmarks/results/run-STAMP.json`` (every record), and for full runs
   ``latest.json``/``latest.md``/``latest.png`` plus the results section of
   docs/performance.md (medians over rounds, ratios to the faster pasta per figure; the JSON's
   ``references`` names it, ``meta.interpreter`` records the Python that ran aioslirp).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as _dt
import json
import os
import platform
import resource
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import backends as B  # noqa: E402
import report  # noqa: E402

TCP_PORT = 7001
UDP_PORT = 7002
IPERF_PORT = 5201
CLIENT = str(HERE / "client.py")
#: Builds upstream pasta from the source shipped beside the repository; prints the pasta path.
PEERS_BUILD = REPO.parent / "shared" / "peers" / "build.sh"
SERVER = str(HERE / "hostserver.py")
NOFILE = 65536

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1


def build_c_tools(out_dir: Path) -> str | None:
    """Compile bench.c (client + server without interpreter overhead). None if no compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "bench"
    src = HERE / "bench.c"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        p = subprocess.run([cc, "-O2", "-Wall", "-o", str(exe), str(src)], capture_output=True, text=True)
        if p.returncode != 0:
            log(f"cannot compile bench.c, using the Python client and server: {p.stderr.strip()[:300]}")
            return None
    return str(exe)


def build_peers(script: str) -> str | None:
    """Run the peers build script (from the repository, so its output lands in .cache/peers); the pasta path."""
    if not os.path.exists(script):
        print(f"run.py: error: --build-peers: {script} not found", file=sys.stderr)
        return None
    log(f"building upstream pasta with {script} (about a minute the first time)")
    p = subprocess.run(["sh", script], cwd=REPO, capture_output=True, text=True)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        print(f"run.py: error: --build-peers: {script} failed: {(p.stderr or p.stdout).strip()[-400:]}",
              file=sys.stderr)
        return None
    return lines[-1]


def interpreter_of(python: str) -> dict:
    """``report.interpreter_record`` as seen by the interpreter that runs aioslirp (``--python``)."""
    try:
        p = subprocess.run([python, str(HERE / "report.py"), "--interpreter"], capture_output=True, text=True,
                           timeout=60, cwd="/")
        return json.loads(p.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {"executable": os.path.basename(python), "error": f"{type(exc).__name__}: {exc}"[:200]}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------
# sandbox


def enter_sandbox(need_default_route: bool) -> None:
    """Loopback-only network namespace + private mount namespace for the whole harness."""
    from aioslirp.host.isolate import isolate_network

    isolate_network()
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    for path, value in (("/proc/sys/net/ipv4/tcp_tw_reuse", "1"),
                        ("/proc/sys/net/ipv4/ip_local_port_range", "1024 65535")):
        with open(path, "w") as f:
            f.write(value)
    if need_default_route:
        # A black hole: both ends of this veth live in our private namespace; frames sent
        # to 192.0.2.254 find no neighbour and go nowhere. pasta only needs the route to exist.
        for cmd in (["ip", "link", "add", "bsink0", "type", "veth", "peer", "name", "bsink1"],
                    ["ip", "link", "set", "bsink1", "up"],
                    ["ip", "addr", "add", "192.0.2.1/24", "dev", "bsink0"],
                    ["ip", "link", "set", "bsink0", "up"],
                    ["ip", "route", "add", "default", "via", "192.0.2.254", "dev", "bsink0"]):
            subprocess.run(cmd, check=True, capture_output=True)


#: The guest namespace's sysctls, as the harness's own (enter_sandbox): a client that closes first keeps
#: each port in TIME-WAIT for 60 s, so at 10,000+ connections/s the default 28,232 ephemeral ports ran
#: out after 2-3 s of CRR (connect: EADDRNOTAVAIL, counted as errors) for the fast backends alone.
GUEST_SYSCTLS = (("net.ipv4.tcp_tw_reuse", "1"), ("net.ipv4.ip_local_port_range", "1024 65535"))


def make_netns(path: str) -> None:
    Path(path).touch()
    sysctls = " && ".join(f"sysctl -qw {k}='{v}'" for k, v in GUEST_SYSCTLS)
    subprocess.run(["unshare", f"--net={path}", "sh", "-c", f"ip link set lo up && {sysctls}"], check=True,
                   capture_output=True)


def remove_netns(path: str) -> None:
    _libc.umount2(path.encode(), MNT_DETACH)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _raise_nofile() -> tuple[int, int]:
    """Soft (and, with CAP_SYS_RESOURCE, hard) RLIMIT_NOFILE up to NOFILE; returns the result."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in ((max(hard, NOFILE), max(hard, NOFILE)), (hard, hard)):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, want)
            break
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def make_preexec(cpus: set[int]):
    def preexec() -> None:
        os.sched_setaffinity(0, cpus)
        _raise_nofile()
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.setpgrp()

    return preexec


# ------------------------------------------------------------------------------------------
# /proc readings


def proc_cpu(pid: int | None) -> dict | None:
    """Backend CPU seconds: ``sched`` (sum of se.sum_exec_runtime over live threads, ns
    resolution), ``stat`` (utime+stime, clock ticks, includes exited threads) and its two parts
    ``user`` (utime) and ``sys`` (stime: the kernel's work for the backend's system calls)."""
    if pid is None:
        return None
    sched = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{tid}/sched") as f:
                    for line in f:
                        if line.startswith("se.sum_exec_runtime"):
                            sched += float(line.split(":")[1]) / 1000.0
                            break
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        user, system = int(fields[11]) / tck, int(fields[12]) / tck
    except OSError:
        return None
    return {"sched": sched, "stat": user + system, "user": user, "sys": system}


def cpu_delta(before: dict | None, after: dict | None) -> float | None:
    if not before or not after:
        return None
    d_sched = after["sched"] - before["sched"]
    d_stat = after["stat"] - before["stat"]
    # A thread that exited during the test is missing from the sched sum but not from stat.
    return d_stat if d_stat > d_sched + 0.05 else d_sched


#: TcpExt counters of the harness's namespace (where the host servers listen) that say why a
#: host connect waited: the listener's queues overflowing, its SYN queue full, SYN cookies.
LISTEN_COUNTERS = ("ListenOverflows", "ListenDrops", "TCPReqQFullDrop", "TCPReqQFullDoCookies", "SyncookiesSent",
                   "TCPBacklogDrop", "TCPTimeouts")


def tcp_ext(names: tuple[str, ...] = LISTEN_COUNTERS) -> dict:
    """The named TcpExt counters of this process's network namespace (``/proc/net/netstat``)."""
    out: dict = {}
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for head, vals in zip(lines[::2], lines[1::2]):
        if head.startswith("TcpExt:"):
            for k, v in zip(head.split()[1:], vals.split()[1:]):
                if k in names:
                    out[k] = int(v)
    return out


def proc_mem(pid: int | None) -> dict | None:
    if pid is None:
        return None
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "Cpus_allowed_list", "Threads"):
                    out[key] = rest.strip()
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    for key in ("VmRSS", "VmHWM"):
        if key in out:
            out[key + "_mb"] = round(int(out.pop(key).split()[0]) / 1024.0, 1)
    return out


def cpus_of(pid: int | None) -> str | None:
    mem = proc_mem(pid)
    return mem.get("Cpus_allowed_list") if mem else None


def tcp_listening(port: int) -> bool:
    want = f":{port:04X}"
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if parts[1].endswith(want) and parts[3] == "0A":
                return True
    return False


# ------------------------------------------------------------------------------------------
# one session: one backend attached to one fresh namespace


class Session:
    def __init__(self, backend: B.Backend, placement: str, cpus: set[int], workdir: str, logdir: str,
                 python: str, index: int, cbench: str | None = None) -> None:
        self.backend = backend
        self.placement = placement
        self.cpus = cpus
        self.preexec = make_preexec(cpus)
        self.ns = os.path.join(workdir, f"ns{index}")
        self.log_path = os.path.join(logdir, f"{backend.name}-{index}.log")
        self.python = python
        self.server: subprocess.Popen | None = None
        self.iperf: subprocess.Popen | None = None
        self.index = index
        self.cbench = cbench

    def __enter__(self) -> "Session":
        try:
            make_netns(self.ns)
            self.backend.start(self.ns, self.preexec, self.log_path)
            self._start_servers()
            probe = self.client(["probe", self.backend.gateway, str(TCP_PORT), "--udp-port", str(UDP_PORT),
                                 "--timeout", "20"], timeout=40)
            if not probe.get("ok"):
                proc = self.backend.proc
                if proc is not None and proc.poll() is not None:
                    tail = Path(self.log_path).read_text(errors="replace").strip().splitlines()[-1:]
                    raise B.BackendError(f"{self.backend.name} exited with status {proc.returncode}: "
                                         f"{' '.join(tail)} (log {self.log_path})")
                raise B.BackendError(f"{self.backend.name}: no connectivity through the backend: {probe}")
            self.setup_wait_s = probe.get("wait_s")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in (self.server, self.iperf):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(3)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(3)
        self.server = self.iperf = None
        with contextlib.suppress(Exception):
            self.backend.stop()
        remove_netns(self.ns)

    def _start_servers(self) -> None:
        addr = self.backend.server_addr
        impl = [self.cbench, "server"] if self.cbench else [self.python, SERVER]
        self.server = subprocess.Popen([*impl, addr, str(TCP_PORT), str(UDP_PORT)],
                                       stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=self.preexec)
        ready, _, _ = select.select([self.server.stdout], [], [], 10)
        if not ready or b"ready" not in self.server.stdout.readline():
            raise B.BackendError("host server did not start")
        self.iperf = subprocess.Popen(["iperf3", "-s", "-B", addr, "-p", str(IPERF_PORT)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      stdin=subprocess.DEVNULL, preexec_fn=self.preexec)
        deadline = time.monotonic() + 10
        while not tcp_listening(IPERF_PORT):
            if time.monotonic() > deadline or self.iperf.poll() is not None:
                raise B.BackendError("iperf3 -s did not start")
            time.sleep(0.02)

    def client(self, args: list[str], timeout: float, cmd: list[str] | None = None) -> dict:
        argv = B.in_ns(self.ns, cmd if cmd is not None else [self.python, CLIENT, *args])
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, preexec_fn=self.preexec)
        lines = [ln for ln in p.stdout.strip().splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"client {' '.join(args or cmd or [])} failed (rc={p.returncode}): "
                               f"{(p.stderr or p.stdout).strip()[-400:]}")
        if cmd is not None and cmd[0] == "iperf3":
            return json.loads(p.stdout)
        return json.loads(lines[-1])

    def measured(self, fn) -> tuple[dict, float | None, float, tuple[float, float] | None]:
        """``fn()``'s result, the backend's CPU seconds meanwhile (:func:`cpu_delta`), the wall
        seconds, and the CPU's ``(user, sys)`` parts in clock ticks' resolution (``None``: unread)."""
        pid = self.backend.pid
        before = proc_cpu(pid)
        t0 = time.monotonic()
        result = fn()
        wall = time.monotonic() - t0
        after = proc_cpu(pid)
        split = (after["user"] - before["user"], after["sys"] - before["sys"]) if before and after else None
        return result, cpu_delta(before, after), wall, split

    # --- tests ------------------------------------------------------------------------

    def test_client(self, mode: str, duration: float, warmup: float, parallel: int = 0) -> dict:
        port = str(UDP_PORT if mode == "udprr" else TCP_PORT)
        if self.cbench:
            cmd = [self.cbench, mode, self.backend.gateway, port, str(duration), str(warmup)]
            cmd += [str(parallel)] if parallel else []
            call = lambda: self.client([], timeout=duration + warmup + 60, cmd=cmd)  # noqa: E731
        else:
            args = [mode, self.backend.gateway, port, "--duration", str(duration), "--warmup", str(warmup)]
            args += ["--parallel", str(parallel)] if parallel else []
            call = lambda: self.client(args, timeout=duration + warmup + 60)  # noqa: E731
        res, cpu, wall, split = self.measured(call)
        rec = {"result": res, "backend_cpu_s": cpu, "wall_s": round(wall, 3)}
        total = res.get("total")
        if cpu is not None and total:
            rec["cpu_ms_per_1k_conn"] = cpu * 1000.0 / (total / 1000.0)
            if split is not None:
                rec["cpu_user_ms_per_1k_conn"] = split[0] * 1000.0 / (total / 1000.0)
                rec["cpu_sys_ms_per_1k_conn"] = split[1] * 1000.0 / (total / 1000.0)
        return rec

    def test_iperf(self, reverse: bool, seconds: float) -> dict:
        cmd = ["iperf3", "-c", self.backend.gateway, "-p", str(IPERF_PORT), "-t", str(seconds), "-J",
               *(["-R"] if reverse else [])]
        res, cpu, wall, _ = self.measured(lambda: self.client([], timeout=seconds + 60, cmd=cmd))
        end = res.get("end", {})
        recv = end.get("sum_received", {})
        sent = end.get("sum_sent", {})
        out = {
            "gbps": recv.get("bits_per_second", 0.0) / 1e9,
            "bytes": recv.get("bytes", 0),
            "sent_bytes": sent.get("bytes", 0),
            "retransmits": sent.get("retransmits"),
            "seconds": recv.get("seconds"),
            "client_cpu": end.get("cpu_utilization_percent"),
        }
        rec = {"result": out, "backend_cpu_s": cpu, "wall_s": round(wall, 3)}
        moved = max(out["bytes"], out["sent_bytes"])
        if cpu is not None and moved:
            rec["cpu_s_per_gb"] = cpu / (moved / 1e9)
        return rec

    def test_idle(self, count: int, budget: float) -> dict:
        """Open ``count`` idle flows (giving up after ``budget`` s), read backend RSS/fds while held."""
        pid = self.backend.pid
        base = proc_mem(pid)
        listen0 = tcp_ext()
        argv = B.in_ns(self.ns, [self.python, CLIENT, "idle", self.backend.gateway, str(TCP_PORT),
                                 "--count", str(count), "--timeout", str(budget)])
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             preexec_fn=self.preexec)
        try:
            ready, _, _ = select.select([p.stdout], [], [], budget + 30)
            if not ready:
                raise RuntimeError(f"idle client did not get ready in {budget + 30:g} s")
            info = json.loads(p.stdout.readline())
            time.sleep(0.5)  # let the backend settle
            loaded = proc_mem(pid)
            stats = self.backend.stats()  # its counters while the flows are held (aioslirp: the control API)
            listen1 = tcp_ext()
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(120)
            closed = json.loads(p.stdout.readline() or "{}")
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        time.sleep(0.5)
        after = proc_mem(pid)
        rec = {"result": {"client": info, "closed": closed, "count": count},
               "backend_before": base, "backend_loaded": loaded, "backend_after": after}
        if stats is not None:
            rec["backend_counters"] = stats
        # the host listener's side of the open, whatever the backend (the servers' namespace)
        rec["host_listen"] = {k: v - listen0.get(k, 0) for k, v in listen1.items() if v != listen0.get(k, 0)}
        return rec


# ------------------------------------------------------------------------------------------
# orchestration

TEST_NAMES = ("crr", "rr", "udprr", "ccrr1", "ccrr8", "ccrr64", "tcp_up", "tcp_down", "idle")


def profile(quick: bool) -> dict:
    if quick:
        return {"rounds": 1, "placements": ["pinned"], "lat_s": 0.5, "warmup_s": 0.1, "ccrr_s": 0.4,
                "tput_s": 1.0, "idle_flows": 2000, "idle_budget_s": 10.0, "unpinned_rounds": 1}
    return {"rounds": 3, "placements": ["pinned", "unpinned"], "lat_s": 1.0, "warmup_s": 0.2, "ccrr_s": 0.8,
            "tput_s": 2.0, "idle_flows": 10000, "idle_budget_s": 20.0, "unpinned_rounds": 3}


def vm_section(python: str, vm_argv: list[str]) -> str:
    """The VM section (issue 27): ``benchmarks/vhost_user.py`` with ``vm_argv`` (its output shown as
    it comes; it isolates itself in a namespace of its own), as markdown for the run's results:
    its table of medians and verdicts, or the failure's last lines."""
    cmd = [python, str(HERE / "vhost_user.py"), *vm_argv]
    log("VM section: " + " ".join(portable_argv(cmd[1:])))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert p.stdout is not None
    for line in p.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    rc = p.wait()
    head = ["", "### VM section: one QEMU guest over each back end (benchmarks/vhost_user.py "
            + " ".join(vm_argv) + ")", ""]
    start = next((i for i, line in enumerate(lines) if line.startswith("QEMU guest (")), None)
    if rc != 0 or start is None:
        return "\n".join(head + [f"vhost_user.py exited with status {rc}:", "", "```text", *lines[-15:], "```", ""])
    return "\n".join(head + lines[start:] + [""])


def session_groups(tests: list[str], with_idle: bool) -> list[list[str]]:
    """The tests of one backend in one round, as the sessions (a new namespace and backend each)
    that run them: all but ``idle`` in one, then ``idle`` (when ``with_idle``) in one of its own.

    The other tests leave ~25,000 of the guest's sockets in TIME-WAIT (its client closes first, and
    without TCP timestamps the guest reuses none of them); once its connect() wraps around the
    ephemeral ports it scans past them one by one. In a bare namespace 10,000 connects cost 0.3 s of
    CPU, and 19.7 s behind 25,000 TIME-WAIT sockets: run after them, the idle client opened 9,162-9,734
    of its 10,000 flows in its 20 s, whatever the backend (pasta and slirp4netns as well)."""
    groups = [[t for t in tests if t != "idle"]]
    if with_idle and "idle" in tests:
        groups.append(["idle"])
    return [g for g in groups if g]


def run_session(sess: Session, tests: list[str], prof: dict, records: list, base: dict) -> None:
    for test in tests:
        rec = dict(base, test=test)
        t0 = time.monotonic()
        try:
            if test in ("crr", "rr", "udprr"):
                rec.update(sess.test_client(test, prof["lat_s"], prof["warmup_s"]))
            elif test.startswith("ccrr"):
                n = int(test[4:])
                rec.update(sess.test_client("ccrr", prof["ccrr_s"], prof["warmup_s"], n))
            elif test in ("tcp_up", "tcp_down"):
                rec.update(sess.test_iperf(test == "tcp_down", prof["tput_s"]))
            elif test == "idle":
                rec.update(sess.test_idle(prof["idle_flows"], prof["idle_budget_s"]))
            rec["ok"] = True
        except Exception as exc:  # one failing test must not end the run
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:600])
        rec["loadavg"] = os.getloadavg()
        rec["test_wall_s"] = round(time.monotonic() - t0, 2)
        records.append(rec)
        log(f"  {base['backend']:<18} {test:<8} {report.one_line(rec)}")


def portable_argv(argv: list[str]) -> list[str]:
    """``argv`` as recorded in the results: paths inside this checkout relative to it, paths beside
    it (``../shared``) relative too, so that a committed result names no directory of the machine."""
    root = str(REPO) + os.sep
    parent = str(REPO.parent) + os.sep
    return [a.replace(root, "").replace(parent, ".." + os.sep) for a in argv]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round, pinned only, short tests (1-2 minutes)")
    ap.add_argument("--rounds", type=int, help="interleaved repetitions (default 3, both placements in each; "
                    "quick 1)")
    ap.add_argument("--placements", help="comma list of pinned,unpinned")
    ap.add_argument("--backends", help="comma list (default: all): " + ",".join(b.name for b in B.all_backends()))
    ap.add_argument("--tests", help="comma list (default: all): " + ",".join(TEST_NAMES))
    ap.add_argument("--cpu", type=int, help="CPU for the pinned placement (default: the last allowed CPU)")
    ap.add_argument("--idle-flows", type=int, help="idle TCP flows for the idle test (default 10000; quick 2000)")
    ap.add_argument("--python", default=sys.executable, help="Python with aioslirp importable (default: this one)")
    ap.add_argument("--out", default=str(HERE / "results"), help="results directory")
    ap.add_argument("--impl", choices=("c", "python"), default="c",
                    help="client/server implementation: c (bench.c, compiled with cc; default, falls back to "
                         "python without a compiler) or python (client.py/hostserver.py)")
    ap.add_argument("--no-latest", action="store_true",
                    help="do not update latest.* and docs/performance.md (only a full default run does: not "
                         "--quick, nor one narrowed by --backends/--tests/--rounds/--placements/--idle-flows)")
    ap.add_argument("--pasta", action="append", default=[], metavar="[NAME=]PATH",
                    help="add a pasta backend running the binary PATH, named NAME or pasta-RELEASE from its "
                         "--version (e.g. pasta-2026_07_16); repeatable. Debian's pasta (in PATH) stays 'pasta'. "
                         "Ratios are to the faster pasta per figure")
    ap.add_argument("--build-peers", nargs="?", const=str(PEERS_BUILD), metavar="SCRIPT",
                    help="build today's upstream pasta with SCRIPT (default ../shared/peers/build.sh beside the "
                         "repository; output in .cache/peers) and add it as with --pasta")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME[:TREE][=ARGS]",
                    help="add an aioslirp backend named aioslirp-NAME for A/B runs: TREE is a directory holding "
                         "another aioslirp package to run (e.g. a copy of the code before a change), ARGS extra "
                         "'aioslirp attach' options (e.g. 'x=--mtu 65520'); repeatable")
    ap.add_argument("--python-plane", action="store_true",
                    help="add aioslirp-python: aioslirp with AIOSLIRP_NATIVE=0 (the Python data path; 'aioslirp' "
                         "runs the native data plane, the default: the TAP read in C, guest TCP and UDP NAT flows in "
                         "aioslirp/native)")
    ap.add_argument("--vm", metavar="ARGS",
                    help="also run the VM section after the namespace one: the same QEMU guest over aioslirp "
                         "vhost-user, aioslirp stream, passt --vhost-user and passt's stream socket "
                         "(benchmarks/vhost_user.py with ARGS, one string, e.g. '--smp 1,2'; '' for its defaults), "
                         "its table appended to the run's markdown")
    args = ap.parse_args(argv)
    vm_argv = None
    if args.vm is not None:
        import vhost_user  # (checked before the namespace section starts: it takes minutes)

        vm_argv = shlex.split(args.vm)
        _vm_args, error = vhost_user.parse(vm_argv)
        if error:
            print(f"run.py: error: --vm: {error}", file=sys.stderr)
            return 2

    prof = profile(args.quick)
    if args.rounds:
        prof["rounds"] = args.rounds
        prof["unpinned_rounds"] = min(prof["unpinned_rounds"], args.rounds)
    if args.placements:
        prof["placements"] = [p.strip() for p in args.placements.split(",") if p.strip()]
        if any(p not in ("pinned", "unpinned") for p in prof["placements"]):
            print("run.py: error: --placements takes pinned and/or unpinned", file=sys.stderr)
            return 2
    if args.idle_flows is not None:
        prof["idle_flows"] = args.idle_flows
    lineup = B.all_backends(args.python)
    pasta_specs = list(args.pasta)
    if args.build_peers:
        built = build_peers(args.build_peers)
        if built is None:
            return 2
        pasta_specs.append(built)
    at = next((i + 1 for i, b in enumerate(lineup) if isinstance(b, B.Pasta)), len(lineup))
    for spec in pasta_specs:
        extra_pasta = B.pasta_from_spec(spec, [b.name for b in lineup])
        lineup.insert(at, extra_pasta)
        at += 1
    for spec in args.variant:
        head, _, extra = spec.partition("=")
        vname, _, tree = head.partition(":")
        lineup.insert(0, B.Aioslirp(None, args.python, shlex.split(extra), name=f"aioslirp-{vname}",
                                    tree=os.path.abspath(tree) if tree else None))
    if args.python_plane:
        lineup.insert(1, B.Aioslirp(None, args.python, name="aioslirp-python", env={"AIOSLIRP_NATIVE": "0"}))
    if args.backends:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = set(wanted) - {b.name for b in lineup}
        if unknown:
            print(f"run.py: error: --backends: unknown {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        lineup = [b for b in lineup if b.name in wanted]
    missing = {"pasta": "passt", "slirp4netns": "slirp4netns"}
    for b in list(lineup):
        if isinstance(b, B.Pasta) and b.binary:
            if not b.available():
                print(f"run.py: error: --pasta: {b.binary} is not an executable", file=sys.stderr)
                return 2
            continue
        tool = b.name.split("-")[0]
        if tool in missing and not shutil.which(tool):
            log(f"skipping {b.name}: {tool} not installed (apt-get install {missing[tool]})")
            lineup.remove(b)
    tests = list(TEST_NAMES)
    if args.tests:
        tests = [t.strip() for t in args.tests.split(",") if t.strip()]
        bad = set(tests) - set(TEST_NAMES)
        if bad:
            print(f"run.py: error: --tests: unknown {', '.join(sorted(bad))}", file=sys.stderr)
            return 2
    allowed = sorted(os.sched_getaffinity(0))
    pin_cpu = args.cpu if args.cpu is not None else allowed[-1]
    if pin_cpu not in allowed:
        print(f"run.py: error: --cpu: CPU {pin_cpu} is not available (allowed {allowed})", file=sys.stderr)
        return 2
    placements = {"pinned": {pin_cpu}, "unpinned": set(allowed)}
    if os.geteuid() != 0:
        print("run.py: error: run as root (it creates namespaces, TAP devices and veth pairs)", file=sys.stderr)
        return 2
    for tool in ("nsenter", "unshare", "ip", "iperf3"):
        if not shutil.which(tool):
            print(f"run.py: error: {tool} not found (apt-get install iproute2 util-linux iperf3)", file=sys.stderr)
            return 2

    cbench = build_c_tools(Path(args.out) / ".bin") if args.impl == "c" else None
    meta = report.host_meta(lineup, REPO)
    meta["client_impl"] = "c" if cbench else "python"
    meta["interpreter"] = interpreter_of(args.python)
    meta.update(profile=prof, tests=tests, pinned_cpu=pin_cpu, allowed_cpus=allowed, quick=args.quick,
                loadavg_start=os.getloadavg(), started=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                rlimit_nofile=_raise_nofile(), argv=portable_argv(sys.argv[1:]))
    log(f"load average {meta['loadavg_start']}; {len(lineup)} backends x {len(prof['placements'])} placements "
        f"x {prof['rounds']} rounds")

    enter_sandbox(need_default_route=any(isinstance(b, B.Pasta) for b in lineup))
    workdir = tempfile.mkdtemp(prefix="aioslirp-bench-")
    os.chmod(workdir, 0o755)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logdir = Path(args.out) / f"logs-{stamp}"
    logdir.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    t_start = time.monotonic()
    index = 0
    try:
        for rnd in range(prof["rounds"]):
            for pl_i, placement in enumerate(prof["placements"]):
                if placement == "unpinned" and "pinned" in prof["placements"] and rnd >= prof["unpinned_rounds"]:
                    continue  # the unpinned figures are the secondary view: fewer rounds keep the run short
                shift = rnd % len(lineup) if lineup else 0
                order = lineup[shift:] + lineup[:shift]
                for backend in order:
                    groups = session_groups(tests, with_idle=rnd == 0 and pl_i == 0)
                    for group in groups:
                        index += 1
                        base = {"round": rnd, "placement": placement, "backend": backend.name}
                        try:
                            with Session(backend, placement, placements[placement], workdir, str(logdir),
                                         args.python, index, cbench) as sess:
                                base["cpus"] = {"backend": cpus_of(backend.pid), "server": cpus_of(sess.server.pid),
                                                "client": ",".join(map(str, sorted(placements[placement])))}
                                base["setup_wait_s"] = sess.setup_wait_s
                                log(f"round {rnd + 1}/{prof['rounds']} {placement} {backend.name} "
                                    f"(cpus {base['cpus']}, load {os.getloadavg()[0]:.2f})")
                                run_session(sess, group, prof, records, base)
                        except Exception as exc:
                            log(f"  {backend.name}: session failed: {exc}")
                            records.append(dict(base, test="session", ok=False, error=str(exc)[:600]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    meta["loadavg_end"] = os.getloadavg()
    meta["duration_s"] = round(time.monotonic() - t_start, 1)
    summary = report.summarize(records)
    out = Path(args.out)
    doc = {"meta": meta, "summary": summary, "references": report.references(summary), "records": records}
    run_path = out / f"run-{stamp}{'-quick' if args.quick else ''}.json"
    run_path.write_text(json.dumps(doc, indent=1))
    md = report.markdown(doc)
    if vm_argv is not None:
        md += vm_section(args.python, vm_argv)
    (out / f"run-{stamp}{'-quick' if args.quick else ''}.md").write_text(md)
    log(f"wrote {run_path} ({meta['duration_s']} s, load average at the end {meta['loadavg_end']})")
    complete = not (args.quick or args.backends or args.tests or args.rounds or args.placements or args.idle_flows)
    if complete and not args.no_latest:
        (out / "latest.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                     "references": doc["references"]}, indent=1))
        (out / "latest.md").write_text(md)
        png = report.plot(doc, out / "latest.png")
        docs_png = None
        if png:
            docs_png = REPO / "docs" / "performance.png"
            shutil.copyfile(png, docs_png)
        report.update_docs(REPO / "docs" / "performance.md", md, with_plot=docs_png is not None)
        log(f"updated {out / 'latest.md'} and docs/performance.md")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
