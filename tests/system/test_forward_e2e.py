"""Port forwards end to end: ``aioslirp run -p ... --api-socket ...`` with real servers inside the
namespace (``support/guest_programs/forward_servers.py`` as the command: the Linux kernel's TCP/IP answers our SYNs) and
real host clients in this process on 127.0.0.1. Bytes are checked by SHA-256 both ways.

pytest runs in a loopback-only namespace (conftest.py): nothing here leaves the machine.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from support.paths import GUEST_PROGRAMS
from support.prereqs import have_ipv6_loopback, need
from support.servers import free_port

pytestmark = pytest.mark.netns

GUEST_SERVER = str(GUEST_PROGRAMS / "forward_servers.py")
GUEST_TCP, GUEST_UDP, GUEST_CLOSED = 8080, 8081, 9999


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


class ForwardGuest:
    """One ``aioslirp run ... -- python forward_servers.py`` process."""

    def __init__(self, *opts: str) -> None:
        argv = [sys.executable, "-m", "aioslirp", "run", *opts, "--",
                sys.executable, GUEST_SERVER, str(GUEST_TCP), str(GUEST_UDP)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"READY":
            self.stop()
            raise AssertionError(f"guest did not start: {line!r} {self.proc.stderr.read()[-2000:]!r}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self) -> int:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
        finally:
            for f in (self.proc.stdout, self.proc.stderr):
                if f:
                    f.close()


def api(path: str, request, *, half_close: bool = True) -> dict:
    """One API request: write it, shut down the write side, read the reply to EOF."""
    raw = request if isinstance(request, bytes) else json.dumps(request).encode() + b"\n"
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(10)
        c.connect(path)
        c.sendall(raw)
        if half_close:
            c.shutdown(socket.SHUT_WR)
        reply = b""
        while True:
            d = c.recv(65536)
            if not d:
                break
            reply += d
    return json.loads(reply)


def exchange(port: int, up: bytes, n_down: int, seed: int, host: str = "127.0.0.1", family=socket.AF_INET):
    """Send ``N SEED\\n`` + ``up`` and half-close while reading the reply to EOF.

    Returns ``(header, body_sha256, body_len, seconds)``.
    """
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect((host, port))
    t0 = time.monotonic()

    def sender() -> None:
        s.sendall(b"%d %d\n" % (n_down, seed))
        s.sendall(up)
        s.shutdown(socket.SHUT_WR)

    th = threading.Thread(target=sender)
    th.start()
    buf = b""
    while b"\n" not in buf:
        d = s.recv(65536)
        assert d, f"EOF before the reply header: {buf!r}"
        buf += d
    header, body = buf.split(b"\n", 1)
    h = hashlib.sha256(body)
    n = len(body)
    while True:
        d = s.recv(1 << 20)
        if not d:
            break
        h.update(d)
        n += len(d)
    elapsed = time.monotonic() - t0
    th.join()
    s.close()
    return header.decode(), h.hexdigest(), n, elapsed


def check_exchange(port: int, n_up: int, n_down: int, seed: int, **kw) -> float:
    up = pattern(n_up, seed + 1000)
    header, sha, n, elapsed = exchange(port, up, n_down, seed, **kw)
    assert header == f"{n_up} {hashlib.sha256(up).hexdigest()}"
    assert n == n_down and sha == hashlib.sha256(pattern(n_down, seed)).hexdigest()
    return elapsed


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    ports = {"tcp": free_port(), "udp": free_port(socket.SOCK_DGRAM), "closed": free_port()}
    api_path = str(tmp_path_factory.mktemp("fwd") / "api.sock")
    g = ForwardGuest("-p", f"127.0.0.1:{ports['tcp']}:{GUEST_TCP}", "-p", f"{ports['udp']}:{GUEST_UDP}/udp",
              "--publish", f"127.0.0.1:{ports['closed']}:{GUEST_CLOSED}/tcp", "--api-socket", api_path)
    g.ports = ports
    g.api_path = api_path
    yield g
    assert g.stop() == 0
    assert not os.path.exists(api_path), "the API socket file is removed on exit"


def inbound_tcp_flows(g) -> list:
    return [f for f in api(g.api_path, {"execute": "list_flows"})["return"]["flows"]
            if f["proto"] == "tcp" and f["direction"] == "inbound"]


def wait_until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_tcp_forward_20mb_each_way_with_half_close(guest):
    n = 20 * 1024 * 1024
    elapsed = check_exchange(guest.ports["tcp"], n, n, 7)
    print(f"forwarded 20 MB each way in {elapsed:.2f} s ({2 * n / elapsed / 1e6:.1f} MB/s total)")


def test_five_connections_leave_no_fd_or_flow(guest):
    assert wait_until(lambda: not inbound_tcp_flows(guest))
    before = guest.fds()
    for i in range(5):
        check_exchange(guest.ports["tcp"], 100_000, 200_000, i)
    # TIME-WAIT towards the guest keeps only the flow entry (about 1 s), never a host fd
    assert wait_until(lambda: guest.fds() == before), (before, guest.fds())
    assert wait_until(lambda: not inbound_tcp_flows(guest))
    assert guest.fds() == before


def test_100_concurrent_forwarded_connections(guest):
    def one(i: int):
        up = pattern(5000 + i, i)
        return i, exchange(guest.ports["tcp"], up, 20000 + i, i)

    with concurrent.futures.ThreadPoolExecutor(100) as pool:
        results = list(pool.map(one, range(100)))
    assert len(results) == 100
    for i, (header, sha, n, _) in results:
        up = pattern(5000 + i, i)
        assert header == f"{len(up)} {hashlib.sha256(up).hexdigest()}"
        assert n == 20000 + i and sha == hashlib.sha256(pattern(20000 + i, i)).hexdigest()
    assert wait_until(lambda: not inbound_tcp_flows(guest), 10)


def test_guest_closes_first_host_client_sees_eof(guest):
    s = socket.create_connection(("127.0.0.1", guest.ports["tcp"]), timeout=10)
    s.sendall(b"HOLD\n")
    assert s.recv(100) == b""  # the guest's FIN reaches the host client (a hang ends in socket.timeout)
    s.close()


def test_guest_not_listening_host_client_fails_fast(guest):
    s = socket.socket()
    s.settimeout(10)
    try:
        s.connect(("127.0.0.1", guest.ports["closed"]))  # on loopback the RST may even beat connect()
        data = s.recv(100)
        outcome = "eof" if data == b"" else data
    except ConnectionResetError:
        outcome = "reset"
    s.close()
    assert outcome == "reset"  # the guest's RST is passed on (no wait for the 10 s socket timeout)


@pytest.mark.parametrize("size", [1, 8000])
def test_udp_forward_echo(guest, size):
    data = pattern(size, size)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(5)
    u.connect(("127.0.0.1", guest.ports["udp"]))
    u.send(data)
    assert u.recv(65535) == data
    u.close()


def test_api_add_list_use_remove(guest):
    port = free_port()
    r = api(guest.api_path, {"execute": "add_hostfwd", "arguments": {
        "proto": "tcp", "host_addr": "127.0.0.1", "host_port": port, "guest_addr": "", "guest_port": GUEST_TCP}})
    fid = r["return"]["id"]
    assert r == {"return": {"id": fid}} and fid >= 4  # 1-3 are the --publish forwards
    entries = api(guest.api_path, {"execute": "list_hostfwd"})["entries"]
    assert {"id": fid, "proto": "tcp", "host_addr": "127.0.0.1", "host_port": port, "guest_addr": "10.0.2.15",
            "guest_port": GUEST_TCP} in entries
    assert [e["id"] for e in entries][:3] == [1, 2, 3]
    check_exchange(port, 300_000, 300_000, 11)
    assert api(guest.api_path, {"execute": "remove_hostfwd", "arguments": {"id": fid}}) == {"return": {}}
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert fid not in [e["id"] for e in api(guest.api_path, {"execute": "list_hostfwd"})["return"]["entries"]]
    assert api(guest.api_path, {"execute": "remove_hostfwd", "arguments": {"id": fid}}) == {
        "error": {"desc": "bad request: remove_hostfwd: bad arguments.id"}}


def test_api_udp_forward_default_guest_addr(guest):
    port = free_port(socket.SOCK_DGRAM)
    r = api(guest.api_path, {"execute": "add_hostfwd", "arguments": {
        "proto": "udp", "host_addr": "127.0.0.1", "host_port": port, "guest_addr": "", "guest_port": GUEST_UDP}})
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(5)
    u.connect(("127.0.0.1", port))
    u.send(b"via api")
    assert u.recv(100) == b"via api"
    u.close()
    assert api(guest.api_path, {"execute": "remove_hostfwd", "arguments": {"id": r["return"]["id"]}}) == {"return": {}}


def test_api_errors_never_crash(guest):
    path = guest.api_path
    before = api(path, {"execute": "get_stats"})["return"]
    assert api(path, b"{this is not json") == {"error": {"desc": "bad request: cannot parse JSON"}}
    assert api(path, {"execute": "no_such_command"}) == {"error": {"desc": "bad request: unknown execute"}}
    assert api(path, b"[]") == {"error": {"desc": "bad request: json_object() failed"}}
    assert api(path, {"arguments": {}}) == {"error": {"desc": "bad request: no execute found"}}
    assert api(path, b"") == {"error": {"desc": "bad request: cannot parse JSON"}}
    # the host port of a --publish forward is in use: an error reply, the process carries on
    r = api(path, {"execute": "add_hostfwd", "arguments": {
        "proto": "tcp", "host_addr": "127.0.0.1", "host_port": guest.ports["tcp"], "guest_port": 1}})
    assert r["error"]["desc"] == (f"bad request: add_hostfwd: cannot listen on 127.0.0.1:{guest.ports['tcp']}/tcp: "
                                  "Address already in use")
    # a client that does not half-close still gets its reply (the request parses)
    r = api(path, b'{"execute": "list_hostfwd"}', half_close=False)
    assert [e["id"] for e in r["return"]["entries"]][:3] == [1, 2, 3]
    # a client that goes away mid-request
    c = socket.socket(socket.AF_UNIX)
    c.connect(path)
    c.sendall(b'{"execute": ')
    c.close()
    assert guest.proc.poll() is None
    # ... and still forwards: one connection of this test's own, seen in the counters
    check_exchange(guest.ports["tcp"], 20_000, 30_000, 21)
    stats = api(path, {"execute": "get_stats"})["return"]
    assert stats["forwards"] == 3
    opened_before = before["flows_total"].get("tcp", {}).get("opened", 0)  # no entry before the first flow
    assert stats["flows_total"]["tcp"]["opened"] == opened_before + 1
    assert stats["frames"]["in"] > before["frames"]["in"] and stats["bytes"]["out"] > before["bytes"]["out"]


def test_start_errors_exit_with_one_line(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    argv = [sys.executable, "-m", "aioslirp", "run"]
    try:
        p = subprocess.run(argv + ["-p", f"{port}:80", "--", "true"], capture_output=True, text=True, timeout=30)
    finally:
        busy.close()
    assert p.returncode == 1
    assert p.stderr.strip() == f"aioslirp: error: --publish: cannot listen on 127.0.0.1:{port}/tcp: Address already in use"
    p = subprocess.run(argv + ["-p", "80:80/sctp", "--", "true"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--publish" in p.stderr
    p = subprocess.run(argv + ["-p", "localhost:80:80", "--", "true"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--publish" in p.stderr
    bad_dir = str(tmp_path / "missing" / "api.sock")
    p = subprocess.run(argv + ["--api-socket", bad_dir, "--", "true"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--api-socket" in p.stderr  # bad input, like --pcap


def test_forwards_with_disable_host_loopback_and_ipv6_host(tmp_path):
    tcp, udp = free_port(), free_port(socket.SOCK_DGRAM)
    opts = ["--disable-host-loopback", "-p", f"{tcp}:{GUEST_TCP}", "-p", f"{udp}:{GUEST_UDP}/udp"]
    v6 = free_port(host="::1") if have_ipv6_loopback() else None
    if v6 is not None:
        opts += ["-p", f"[::1]:{v6}:{GUEST_TCP}"]
    g = ForwardGuest(*opts)
    try:
        check_exchange(tcp, 50_000, 50_000, 3)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.settimeout(5)
        u.connect(("127.0.0.1", udp))
        u.send(b"no loopback, still routed")
        assert u.recv(100) == b"no loopback, still routed"
        u.close()
        need(v6 is not None, "no IPv6 loopback in this namespace: the IPv6 forward is not checked")
        check_exchange(v6, 10_000, 10_000, 4, host="::1", family=socket.AF_INET6)
    finally:
        assert g.stop() == 0
