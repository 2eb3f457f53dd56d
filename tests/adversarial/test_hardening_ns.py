"""Hardening against a hostile guest, end to end: `aioslirp run` with a real Linux namespace behind the TAP.

The guest programs are in ``support/guest_programs/hostile.py``; they read the stack's counters through the API
socket (``--api-socket``). Host-side measurements (fds, RSS) are taken from /proc of the
`aioslirp run` process. pytest runs in a loopback-only namespace (conftest.py): the host peers
are on 127.0.0.1 / ::1 and every crafted destination stays inside 10.0.2.0/24, the host's
loopback through 10.0.2.2, or 169.254.169.254, which the stack refuses by policy.

Figures (fds, RSS) are printed (``pytest -s``) and asserted only against the documented bounds
of docs/security.md, never as timings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from aioslirp.native import status as native_status
from support.namespaces import netns_holders
from support.paths import GUEST_PROGRAMS
from support.prereqs import need
from support.servers import DataServer, UdpEcho, host_servers, pattern

pytestmark = pytest.mark.netns

GUEST = str(GUEST_PROGRAMS / "hostile.py")


@pytest.fixture(scope="module")
def servers():
    with host_servers() as s:
        yield s


def aioslirp_run(servers, mode: str, args: dict, *opts: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "aioslirp", "run", "--dns", f"127.0.0.1:{servers['dns'].port}", *opts, "--",
            sys.executable, GUEST, mode, json.dumps(args)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_json(p: subprocess.Popen, timeout: float = 60) -> dict:
    """The next JSON line of the guest's stdout (fails after ``timeout`` s)."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box or not box[0]:
        p.kill()
        out, err = p.communicate(timeout=10)
        pytest.fail(f"no output from the guest (rc={p.returncode})\nstderr={err[-4000:]}")
    return json.loads(box[0])


def finish(p: subprocess.Popen, timeout: float = 60) -> tuple[dict, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"guest did not finish\nstderr={err[-4000:]}")
    assert p.returncode == 0, f"rc={p.returncode}\nstdout={out[-2000:]}\nstderr={err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])["result"], err


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_hostile_frames_then_20mb_download(servers, tmp_path):
    api = str(tmp_path / "api.sock")
    n = 20 * 1024 * 1024
    p = aioslirp_run(servers, "hostile", {"api": api, "port": servers["data"].port, "n": n, "seed": 11,
                                          "random": 400}, "--api-socket", api)
    r, err = finish(p, 120)
    crafted, rnd = r["crafted"], r["random_delta"]
    expected = Counter(r["expected"])
    # every crafted frame is accounted for by exactly the counter it was built to hit
    for name, count in expected.items():
        assert crafted.get(name, 0) == count, (name, sorted(crafted.items()))
    crafted_drops = {k: v for k, v in crafted.items() if k.startswith("drop.")}
    assert sum(crafted_drops.values()) == sum(v for k, v in expected.items() if k.startswith("drop.")), crafted_drops
    assert crafted["frames_in"] >= r["crafted_frames"]
    # every seeded random frame is one counted drop
    random_drops = {k: v for k, v in rnd.items() if k.startswith("drop.")}
    assert sum(random_drops.values()) == r["random"], rnd
    assert "drop.internal_error" not in crafted and "drop.internal_error" not in rnd
    # the DNS compression loop is answered FORMERR, with the guest's ID
    assert (r["dns_rcode"], r["dns_id"]) == (1, 0xBEEF)
    # and the stack still moves 20 MB byte-exact afterwards
    assert r["got"] == n and r["sha"] == hashlib.sha256(pattern(n, 11)).hexdigest()
    assert not os.path.exists(api), "API socket left behind"
    print("crafted:", dict(sorted(crafted_drops.items())), "\nrandom:", dict(sorted(random_drops.items())))


class Sampler:
    """Samples fds and RSS of ``pid`` every 20 ms in a thread; ``peak()`` gives the maxima."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((proc_fds(self.pid), proc_rss_kb(self.pid)))
            except OSError:
                return
            time.sleep(0.02)

    def peak(self) -> tuple[int, int]:
        return max(s[0] for s in self.samples), max(s[1] for s in self.samples)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def test_syn_flood_to_black_hole_stays_bounded(servers, tmp_path):
    """20,000 SYNs to a host listener that never accepts (reached through 10.0.2.2): the pending
    host connects stay under the per-destination bound, fds and memory stay bounded, and a
    download to another port works meanwhile."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1)  # never accepted: two connections queue, every later connect stays pending
    api = str(tmp_path / "api.sock")
    n = 5 * 1024 * 1024
    count = 20000
    p = aioslirp_run(servers, "synflood", {"api": api, "hole_port": hole.getsockname()[1], "count": count,
                                           "port": servers["data"].port, "n": n, "seed": 5}, "--api-socket", api)
    try:
        assert read_json(p)["phase"] == "ready"
        pid = p.pid
        time.sleep(0.2)
        fds0, rss0 = proc_fds(pid), proc_rss_kb(pid)
        sampler = Sampler(pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        flooded = read_json(p)
        time.sleep(0.3)
        p.stdin.write("go\n")
        p.stdin.flush()
        r, _ = finish(p, 90)
        sampler.stop()
    finally:
        hole.close()
        if p.poll() is None:
            p.kill()
    fds_peak, rss_peak = sampler.peak()
    c = r["counters"]
    per_dest = 1024 // 4  # max_pending_connects (default 1024) / 4 towards one destination
    pending = r["flows"].get("tcp", {}).get("SYN-RECEIVED", 0)
    refused = c.get("drop.limit_pending_connects", 0)
    print(f"\nSYN flood: {count} SYNs in {flooded['sent_s']:.2f} s; stack saw {c['frames_in']} frames; "
          f"pending at the end {pending}; refused (pending bound) {refused}, rate-limited "
          f"{c.get('drop.limit_new_flow_rate', 0)}, inject_full {c.get('drop.inject_full', 0)}; "
          f"fds {fds0} -> peak {fds_peak} (+{fds_peak - fds0}); RSS {rss0} kB -> peak {rss_peak} kB "
          f"(+{(rss_peak - rss0) / 1024:.1f} MiB)")
    assert r["got"] == n and r["sha"] == hashlib.sha256(pattern(n, 5)).hexdigest()
    assert pending <= per_dest
    assert refused >= count // 2  # most SYNs met the bound (the rest: the 256 admitted, kernel-queue losses)
    assert c.get("drop.internal_error", 0) == 0
    # documented bounds (docs/security.md): one fd per pending connect, ~64 KiB of memory per flow
    assert fds_peak - fds0 <= per_dest + 16
    assert rss_peak - rss0 <= (per_dest * 64 + 16 * 1024)


def api_call(path: str, execute: str) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(json.dumps({"execute": execute}).encode())
    s.shutdown(socket.SHUT_WR)
    buf = b""
    while chunk := s.recv(65536):
        buf += chunk
    s.close()
    return json.loads(buf)["return"]


def wait_no_flows(api: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = api_call(api, "get_stats")
        if not st["flows"] or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


#: Bounds of the RSS comparison over 10,000 connections (docs/security.md). The allocators (pymalloc,
#: glibc, libuv) keep some freed arenas the first time round (measured +0.1 to +8.2 MiB after the
#: first 10,000, depending on the machine's load), so the first round only has a loose bound; the
#: leak check is the second round of 10,000 against the first: flat, where a leak of 1 KiB per
#: connection would show as ~10 MiB.
FIRST_ROUND_KB = 16 * 1024
SECOND_ROUND_KB = 3 * 1024


def test_10000_short_connections_return_to_baseline(servers, tmp_path):
    api = str(tmp_path / "api.sock")
    count = 10000
    p = aioslirp_run(servers, "crr", {"port": servers["data"].port, "warm": 2000, "count": count, "rounds": 2},
                     "--api-socket", api)
    rss: list[int] = []
    fds: list[int] = []
    try:
        assert read_json(p)["phase"] == "warm"
        assert not wait_no_flows(api)["flows"]
        pid = p.pid
        fds.append(proc_fds(pid))
        rss.append(proc_rss_kb(pid))
        for _ in range(2):
            p.stdin.write("go\n")
            p.stdin.flush()
            done = read_json(p, 120)
            st = wait_no_flows(api)
            fds.append(proc_fds(pid))
            rss.append(proc_rss_kb(pid))
        p.stdin.write("end\n")
        p.stdin.flush()
        r, _ = finish(p, 30)
    finally:
        if p.poll() is None:
            p.kill()
    c = st["counters"]
    print(f"\n2 x {count} connections ({count / done['took']:.0f}/s); fds {fds}; RSS kB {rss} "
          f"({(rss[1] - rss[0]) / 1024:+.1f} MiB, then {(rss[2] - rss[1]) / 1024:+.1f} MiB)")
    assert r["count"] == count
    assert not st["flows"]
    assert c["flows.tcp.opened"] >= 2 * count + 2000 and c["flows.tcp.opened"] == c["flows.tcp.closed"]
    assert c.get("drop.internal_error", 0) == 0 and c.get("flow_errors", 0) == 0
    assert fds[0] == fds[1] == fds[2]
    assert rss[1] - rss[0] <= FIRST_ROUND_KB
    assert rss[2] - rss[1] <= SECOND_ROUND_KB


@pytest.mark.parametrize("ignore_term", [False, True], ids=["command-exits", "command-ignores-sigterm"])
def test_sigterm_during_transfer(servers, tmp_path, ignore_term):
    """SIGTERM to `aioslirp run` while the guest downloads. A command that exits on SIGTERM ends
    the run with 143; one that ignores it keeps its network for --stop-timeout seconds, then
    sees its connection reset (and exits by itself). Either way no process, namespace or API
    socket is left."""
    api = str(tmp_path / "api.sock")
    p = aioslirp_run(servers, "sigterm", {"port": servers["data"].port, "n": 64 << 20, "ignore_term": ignore_term},
                     "--api-socket", api, "--stop-timeout", "1")
    try:
        started = read_json(p)
        assert started["phase"] == "started"
        assert netns_holders(started["netns"]), "the guest's namespace should exist while it runs"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    if ignore_term:
        assert p.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])["result"]
        assert r["sigterm_seen"] and r["ended"] == "reset", r
        # the network stayed up for --stop-timeout (1 s); the RST came before the SIGKILL (rc 0, not 137)
        assert r["after_term_s"] >= 0.9
        assert "stopping its network" in err
    else:
        assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    print(f"\nexit {p.returncode} {took:.2f} s after SIGTERM")
    assert netns_holders(started["netns"]) == []
    assert not os.path.exists(api)


def test_egress_policy_in_namespace(servers, tmp_path):
    """--deny ::1/128 refuses TCP and UDP to the IPv6 gateway (the host's ::1) at once, the
    default policy refuses 169.254.169.254 (TCP, UDP and ping, nothing sent), IPv4 to the gateway works."""
    data6, udp6 = DataServer(host="::1"), UdpEcho("::1")
    api = str(tmp_path / "api.sock")
    try:
        p = aioslirp_run(servers, "policy", {"api": api, "port4": servers["data"].port, "port6": data6.port,
                                             "udp4": servers["udp"].port, "udp6": udp6.port},
                         "--api-socket", api, "--deny", "::1/128")
        r, _ = finish(p, 60)
    finally:
        data6.close()
        udp6.close()
    print("\n", json.dumps(r, indent=1))
    # EHOSTUNREACH/EACCES on connect can only come from our ICMP error (a lost SYN ends in the client's
    # 5 s "timed out"), so the errno is the proof the denial was answered, not left to time out. Linux
    # keeps an ICMP error that arrives while connect() still holds the socket lock as a soft error and
    # sends the SYN again after its 1 s RTO (tcp_v4_err/tcp_v6_err): each such SYN is denied and counted
    # too, so the count follows the guest's own retransmissions (its RetransSegs), not a clock.
    assert r["tcp_metadata"]["errno"] == "EHOSTUNREACH"
    assert r["udp_metadata"]["errno"] == "EHOSTUNREACH"
    assert r["ping_metadata"] == {"answer": "unreachable", "code": 13}
    assert r["tcp_gw6_denied"]["errno"] == "EACCES"
    assert r["udp_gw6_denied"]["errno"] == "EACCES"
    assert r["tcp_gw4_allowed"]["ok"] == 1000
    assert r["udp_gw4_allowed"]["ok"] == "ping"
    syn_retries = r["tcp_metadata"]["syn_retries"] + r["tcp_gw6_denied"]["syn_retries"]
    assert r["counters"]["drop.egress_denied"] == 5 + syn_retries
    assert data6.commands == [] and udp6.count == 0  # nothing reached the denied host side


# ---------------------------------------------------------------------- `aioslirp attach` + SIGTERM
#: The client inside the attached namespace: a slow download from the host's DataServer; one JSON
#: line once 1 MiB arrived, one when the connection ended (how, and when, by CLOCK_MONOTONIC).
ATTACH_CLIENT = r"""
import errno, json, socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
s.settimeout(20)
s.connect(("10.0.2.2", int(sys.argv[1])))
s.sendall(b"DOWN %d 1\n" % int(sys.argv[2]))
got, ended, announced = 0, "eof", False
try:
    while True:
        d = s.recv(65536)
        if not d:
            break
        got += len(d)
        if not announced and got >= 1 << 20:
            announced = True
            print(json.dumps({"phase": "started", "got": got}), flush=True)
        if announced:
            time.sleep(0.01)  # a slow reader: the transfer is still running when SIGTERM comes
except ConnectionResetError:
    ended = "reset"
except socket.timeout:
    ended = "timeout"
except OSError as exc:
    ended = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps({"phase": "ended", "got": got, "ended": ended, "at": time.monotonic()}), flush=True)
"""

PR_SET_CHILD_SUBREAPER = 36


def _set_child_subreaper(on: bool) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphans of our descendants become our children."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def children_of(pid: int) -> set[int]:
    """PIDs whose parent is ``pid`` (from /proc/PID/stat)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(d))
    return out


def ns_ip(holder: int, *args: str):
    out = subprocess.run(["nsenter", "-t", str(holder), "-n", "ip", "-j", *args],
                         capture_output=True, text=True, timeout=10, check=True)
    return json.loads(out.stdout)


def ns_links(holder: int) -> list[str]:
    return [link["ifname"] for link in ns_ip(holder, "link", "show")]


def ns_configured(holder: int) -> bool:
    """tap0 has 10.0.2.15 and the default route goes through it."""
    addrs = [a["local"] for link in ns_ip(holder, "addr", "show") if link["ifname"] == "tap0"
             for a in link["addr_info"] if a["family"] == "inet"]
    routes = [r.get("dev") for r in ns_ip(holder, "route", "show", "default")]
    return addrs == ["10.0.2.15"] and routes == ["tap0"]


def fd_table() -> dict:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


@pytest.mark.parametrize("how", ["netns-path", "pid"])
def test_attach_sigterm_during_transfer(servers, tmp_path, how):
    """SIGTERM to `aioslirp attach` while a client in the attached namespace downloads 64 MiB
    from a host server on 127.0.0.1 (through 10.0.2.2). Documented (docs/security.md, Shutdown):
    the guest's connection is reset while its link is still up, attach exits 0, the API socket
    is removed. Also checked: the client's recv ends with ECONNRESET within seconds (no hang),
    attach leaves no process behind (this test is the child subreaper, so an orphan of attach
    would become its child), the TAP is gone from the namespace, this process's fds are as
    before, and the namespace is gone once the test ends its holder."""
    need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")
    n = 64 << 20
    api = str(tmp_path / "api.sock")
    client_py = tmp_path / "client.py"
    client_py.write_text(ATTACH_CLIENT)
    time.sleep(0.1)
    fds0 = fd_table()
    holder = subprocess.Popen(["unshare", "-n", "sleep", "120"])  # holds the namespace until we kill it
    attach = client = None
    own_children0 = children_of(os.getpid())
    _set_child_subreaper(True)
    try:
        own = os.stat("/proc/self/ns/net").st_ino
        for _ in range(200):
            with contextlib.suppress(FileNotFoundError):
                if os.stat(f"/proc/{holder.pid}/ns/net").st_ino != own:
                    break
            time.sleep(0.01)
        ns_ino = os.stat(f"/proc/{holder.pid}/ns/net").st_ino
        assert ns_ino != own
        target = ["--netns", f"/proc/{holder.pid}/ns/net"] if how == "netns-path" else [str(holder.pid)]
        attach = subprocess.Popen([sys.executable, "-m", "aioslirp", "attach", "--api-socket", api, *target],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not (ns_configured(holder.pid) and os.path.exists(api)):
            assert attach.poll() is None, attach.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "attach did not configure tap0"
            time.sleep(0.05)
        client = subprocess.Popen(["nsenter", "-t", str(holder.pid), "-n", sys.executable, str(client_py),
                                   str(servers["data"].port), str(n)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = read_json(client, 30)
        assert started["phase"] == "started"
        stats = api_call(api, "get_stats")
        assert stats["flows"].get("tcp") == {"ESTABLISHED": 1}, stats["flows"]
        attach_children = children_of(attach.pid)  # the namespace helper is done by now: expect none
        t0 = time.monotonic()
        attach.send_signal(signal.SIGTERM)
        ended = read_json(client, 15)  # the client's recv ends, it does not hang until its 20 s timeout
        client.communicate(timeout=10)
        _, err = attach.communicate(timeout=15)
        took = time.monotonic() - t0
        client_rc, rc = client.returncode, attach.returncode
        print(f"\nattach ({how}): client saw {ended['ended']} {ended['at'] - t0:.3f} s after SIGTERM "
              f"(got {ended['got'] >> 20} of {n >> 20} MiB); attach exited {rc} after {took:.2f} s")
        assert ended["ended"] == "reset", ended
        assert ended["at"] - t0 < 5
        assert ended["got"] < n
        assert client_rc == 0
        assert rc == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert not os.path.exists(api), "API socket left behind"
        assert attach_children == set(), attach_children
        orphans = children_of(os.getpid()) - own_children0 - {holder.pid}
        assert orphans == set(), f"processes left by attach: {orphans}"
        assert ns_links(holder.pid) == ["lo"], "the TAP should go with attach"
        # this process: the DataServer's connection closes once it has seen the RST
        deadline = time.monotonic() + 10
        while fd_table() != fds0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fd_table() == fds0
    finally:
        _set_child_subreaper(False)
        for p in (client, attach):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for pid in children_of(os.getpid()) - own_children0 - {holder.pid}:  # orphans we became parent of
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        holder.kill()
        holder.wait()
    assert netns_holders(ns_ino) == [], "the namespace should be gone with its holder"


def test_connections_of_processes_left_behind_by_the_command_are_reset(tmp_path):
    """`aioslirp run -- sh -c 'client &'`: sh exits at once; the client's connection is reset."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(srv.accept()[0]), daemon=True)
    t.start()
    marker = tmp_path / "client.out"
    client = (f"import socket, time\n"
              f"s = socket.create_connection(('10.0.2.2', {port}))\n"
              f"open({str(marker)!r}, 'w').write('connected\\n')\n"
              f"time.sleep(0.5)\n"
              f"try:\n"
              f"    r = s.recv(10)\n"
              f"    out = 'eof' if not r else 'data'\n"
              f"except ConnectionResetError:\n"
              f"    out = 'reset'\n"
              f"open({str(marker)!r}, 'a').write(out + '\\n')\n")
    script = tmp_path / "client.py"
    script.write_text(client)
    cmd = f"{sys.executable} {script} & for i in $(seq 100); do [ -s {marker} ] && exit 0; sleep 0.05; done; exit 1"
    try:
        p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--", "sh", "-c", cmd],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        deadline = time.monotonic() + 10
        while "\n" not in marker.read_text()[len("connected\n"):] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.read_text().split() == ["connected", "reset"]
        t.join(5)
        assert accepted
    finally:
        for c in accepted:
            c.close()
        srv.close()


def test_a_tcp_segment_in_ipv4_fragments_reaches_the_host_once_on_either_plane(servers, tmp_path):
    """A guest's TCP segment carried by two IPv4 fragments (out of order) on an open flow: the stack
    reassembles it and hands it to the flow where it runs (on the native plane, the default: to the
    engine as the plain segment, ``native_tcp.via_python``); the host server counts and hashes
    every byte once, and the guest's FIN is acknowledged."""
    need(shutil.which("iptables") is not None, "iptables is missing (apt-get install iptables)")
    api = str(tmp_path / "api.sock")
    p = aioslirp_run(servers, "fragtcp", {"api": api, "port": servers["data"].port, "n": 6000},
                     "--api-socket", api)
    result, err = finish(p)
    assert result["first_acked"]  # the reassembled segment, acknowledged
    assert result["answer"] == result["want"], err[-2000:]
    assert result["acked_fin"]
    c = result["counters"]
    assert c.get("ip_reassembled", 0) >= 1
    if native_status() == "on":
        assert c.get("native_tcp.via_python", 0) >= 1, {k: v for k, v in c.items() if "native" in k}
