"""Benchmark client: runs INSIDE the guest namespace, one process per test.

``python client.py MODE HOST PORT [options]`` loops in-process (no fork/exec per
iteration), times every iteration with ``time.perf_counter_ns`` and prints one JSON line:

* ``crr``: connect, send 1 byte, receive 1 byte, close; repeated for ``--duration`` s.
* ``rr``: one connection; send 1 byte, receive 1 byte; repeated.
* ``udprr``: one connected UDP socket; send 1 byte, receive 1 byte; a reply missing after
  ``--timeout`` s counts as lost and the request is sent again.
* ``ccrr``: ``--parallel N`` connections in flight at once (non-blocking, epoll), each doing
  the CRR sequence and starting over; per-connection latency from socket() to close().
* ``probe``: retry a TCP (and UDP) echo until it works or ``--timeout`` passes.
* ``idle``: open ``--count N`` connections (at most 256 connecting at a time), exchange one
  byte on each so the backend has the host side established (giving up on the rest after
  ``--timeout`` seconds, and on one connection after 10 s), then print
  ``{"ready": ...}`` and hold them all until a line arrives on stdin; then close them and
  print ``{"closed": N}``.

Latencies are reported in microseconds (``p50``/``p90``/``p99``/``mean``/``max``) over the
iterations after the first ``--warmup`` seconds. Blocking sockets use kernel timeouts
(``SO_RCVTIMEO``/``SO_SNDTIMEO``) so an iteration costs exactly its syscalls.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import select
import socket
import struct
import sys
import time
from array import array

ns = time.perf_counter_ns


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def _kernel_timeouts(s: socket.socket, seconds: float) -> None:
    tv = _timeval(seconds)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def summary(samples: array, elapsed_s: float, extra: dict | None = None) -> dict:
    """Percentiles (us) of ``samples`` (ns). ``rate`` is iterations per second."""
    vals = sorted(samples)
    n = len(vals)
    out = {"n": n, "elapsed_s": round(elapsed_s, 4), "rate": round(n / elapsed_s, 1) if elapsed_s > 0 else 0.0}
    if n:
        def pct(p: float) -> float:
            return round(vals[min(n - 1, int(p / 100.0 * n))] / 1000.0, 2)

        out.update(p50=pct(50), p90=pct(90), p99=pct(99), mean=round(sum(vals) / n / 1000.0, 2),
                   max=round(vals[-1] / 1000.0, 2))
    if extra:
        out.update(extra)
    return out


def _tune_netns() -> None:
    """Per-namespace sysctls so CRR loops do not run out of ports (we are root in the guest ns)."""
    for path, value in (("/proc/sys/net/ipv4/tcp_tw_reuse", "1"),
                        ("/proc/sys/net/ipv4/ip_local_port_range", "1024 65535")):
        try:
            with open(path, "w") as f:
                f.write(value)
        except OSError:
            pass


def run_crr(host: str, port: int, duration: float, warmup: float, timeout: float) -> dict:
    samples = array("q")
    dst = (host, port)
    errors = 0
    AF, ST = socket.AF_INET, socket.SOCK_STREAM
    tv = _timeval(timeout)
    SOL, RCV, SND = socket.SOL_SOCKET, socket.SO_RCVTIMEO, socket.SO_SNDTIMEO
    NODELAY = socket.TCP_NODELAY
    start = ns()
    measure_from = start + int(warmup * 1e9)
    end = measure_from + int(duration * 1e9)
    t_measure = None
    total = 0
    while True:
        t0 = ns()
        if t0 >= end:
            break
        s = socket.socket(AF, ST)
        try:
            s.setsockopt(SOL, RCV, tv)
            s.setsockopt(SOL, SND, tv)
            s.setsockopt(socket.IPPROTO_TCP, NODELAY, 1)
            s.connect(dst)
            s.send(b"x")
            if s.recv(1) != b"x":
                raise OSError("short reply")
        except OSError:
            errors += 1
            s.close()
            continue
        s.close()
        t1 = ns()
        total += 1
        if t0 >= measure_from:
            if t_measure is None:
                t_measure = t0
            samples.append(t1 - t0)
    elapsed = (ns() - (t_measure or end)) / 1e9
    return summary(samples, elapsed, {"errors": errors, "total": total})


def run_rr(host: str, port: int, duration: float, warmup: float, timeout: float) -> dict:
    samples = array("q")
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(None)
    _kernel_timeouts(s, timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send, recv = s.send, s.recv
    total = 0
    start = ns()
    measure_from = start + int(warmup * 1e9)
    end = measure_from + int(duration * 1e9)
    t_measure = None
    while True:
        t0 = ns()
        if t0 >= end:
            break
        send(b"x")
        if recv(1) != b"x":
            raise SystemExit("rr: connection closed")
        t1 = ns()
        total += 1
        if t0 >= measure_from:
            if t_measure is None:
                t_measure = t0
            samples.append(t1 - t0)
    elapsed = (ns() - (t_measure or end)) / 1e9
    s.close()
    return summary(samples, elapsed, {"errors": 0, "total": total})


def run_udprr(host: str, port: int, duration: float, warmup: float, timeout: float) -> dict:
    samples = array("q")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _kernel_timeouts(s, timeout)
    s.connect((host, port))
    send, recv = s.send, s.recv
    lost = 0
    total = 0
    start = ns()
    measure_from = start + int(warmup * 1e9)
    end = measure_from + int(duration * 1e9)
    t_measure = None
    while True:
        t0 = ns()
        if t0 >= end:
            break
        send(b"x")
        try:
            recv(16)
        except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO expired: EAGAIN
            lost += 1
            continue
        except ConnectionRefusedError:
            lost += 1
            time.sleep(timeout)
            continue
        t1 = ns()
        total += 1
        if t0 >= measure_from:
            if t_measure is None:
                t_measure = t0
            samples.append(t1 - t0)
    elapsed = (ns() - (t_measure or end)) / 1e9
    return summary(samples, elapsed, {"lost": lost, "total": total})


def run_ccrr(host: str, port: int, duration: float, warmup: float, parallel: int, timeout: float) -> dict:
    """``parallel`` CRR state machines multiplexed with epoll in this one process."""
    ep = select.epoll()
    dst = (host, port)
    samples = array("q")
    errors = 0
    # fd -> [sock, t_start, state]; state 0 = connecting, 1 = awaiting reply
    slots: dict[int, list] = {}
    EPOLLIN, EPOLLOUT = select.EPOLLIN, select.EPOLLOUT
    start = ns()
    measure_from = start + int(warmup * 1e9)
    end = measure_from + int(duration * 1e9)
    t_measure = None
    deadline_ns = int(timeout * 1e9)
    total = 0

    def launch() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        t0 = ns()
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = s.connect_ex(dst)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            raise OSError(err, os.strerror(err))
        fd = s.fileno()
        slots[fd] = [s, t0, 0]
        ep.register(fd, EPOLLOUT)

    for _ in range(parallel):
        launch()
    while slots:
        now = ns()
        stop = now >= end
        events = ep.poll(0.1)
        if not events:
            # reap stuck connections (a backend that dropped something)
            for fd, slot in list(slots.items()):
                if ns() - slot[1] > deadline_ns:
                    ep.unregister(fd)
                    slot[0].close()
                    del slots[fd]
                    errors += 1
                    if not stop:
                        launch()
            continue
        for fd, ev in events:
            slot = slots.get(fd)
            if slot is None:
                continue
            s = slot[0]
            ok = True
            try:
                if slot[2] == 0:
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    s.send(b"x")
                    slot[2] = 1
                    ep.modify(fd, EPOLLIN)
                    continue
                data = s.recv(1)
                if data != b"x":
                    raise OSError("short reply")
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                ok = False
            ep.unregister(fd)
            s.close()
            del slots[fd]
            t1 = ns()
            if ok:
                if slot[1] >= measure_from and t1 <= end:
                    if t_measure is None:
                        t_measure = slot[1]
                    samples.append(t1 - slot[1])
            else:
                errors += 1
            total += 1
            if t1 < end:
                launch()
    elapsed = (end - (t_measure or end)) / 1e9
    return summary(samples, elapsed, {"errors": errors, "parallel": parallel, "total": total})


def run_probe(host: str, port: int, udp_port: int, timeout: float) -> dict:
    """Wait until a TCP echo and (when ``udp_port``) a UDP echo through the backend work."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    last = ""
    tcp_ok = udp_ok = False
    while time.monotonic() < deadline and not (tcp_ok and (udp_ok or not udp_port)):
        try:
            if not tcp_ok:
                with socket.create_connection((host, port), timeout=1.0) as s:
                    s.sendall(b"x")
                    tcp_ok = s.recv(1) == b"x"
            if udp_port and not udp_ok:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                    u.settimeout(0.5)
                    u.connect((host, udp_port))
                    u.send(b"x")
                    udp_ok = u.recv(16) == b"x"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.02)
    return {"ok": tcp_ok and (udp_ok or not udp_port), "tcp": tcp_ok, "udp": udp_ok,
            "wait_s": round(time.monotonic() - t0, 3), "last_error": last}


def run_idle(host: str, port: int, count: int, timeout: float) -> dict:
    """Open ``count`` connections, confirm each end to end with a 1-byte echo, hold them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(count + 1024, soft)), hard))
    ep = select.epoll()
    dst = (host, port)
    done: list[socket.socket] = []
    pending: dict[int, list] = {}
    failed = 0
    launched = 0
    t_start = time.monotonic()
    deadline = t_start + timeout
    while (launched < count or pending) and time.monotonic() < deadline:
        while launched < count and len(pending) < 256:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex(dst)
            launched += 1
            if err not in (0, errno.EINPROGRESS):
                s.close()
                failed += 1
                continue
            pending[s.fileno()] = [s, 0, time.monotonic()]
            ep.register(s.fileno(), select.EPOLLOUT)
        for fd, _ev in ep.poll(0.2):
            slot = pending.get(fd)
            if slot is None:
                continue
            s = slot[0]
            try:
                if slot[1] == 0:
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    s.send(b"x")
                    slot[1] = 1
                    ep.modify(fd, select.EPOLLIN)
                    continue
                if s.recv(1) != b"x":
                    raise OSError("short reply")
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                failed += 1
                ep.unregister(fd)
                s.close()
                del pending[fd]
                continue
            ep.unregister(fd)
            del pending[fd]
            done.append(s)
        now = time.monotonic()
        for fd, slot in list(pending.items()):
            if now - slot[2] > 10:
                ep.unregister(fd)
                slot[0].close()
                del pending[fd]
                failed += 1
    setup_s = time.monotonic() - t_start
    for fd, slot in pending.items():
        slot[0].close()
        failed += 1
    print(json.dumps({"ready": True, "open": len(done), "failed": failed, "setup_s": round(setup_s, 3)}), flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    for s in done:
        s.close()
    return {"open": len(done), "failed": failed, "setup_s": round(setup_s, 3),
            "close_s": round(time.monotonic() - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("crr", "rr", "udprr", "ccrr", "idle", "probe"))
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--duration", type=float, default=1.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=0.2, help="seconds run before measuring")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--count", type=int, default=10000)
    p.add_argument("--timeout", type=float, default=2.0, help="per-operation timeout, seconds")
    p.add_argument("--udp-port", type=int, default=0, help="probe: also check this UDP echo port")
    a = p.parse_args(argv)
    _tune_netns()
    if a.mode == "crr":
        out = run_crr(a.host, a.port, a.duration, a.warmup, a.timeout)
    elif a.mode == "rr":
        out = run_rr(a.host, a.port, a.duration, a.warmup, a.timeout)
    elif a.mode == "udprr":
        out = run_udprr(a.host, a.port, a.duration, a.warmup, min(a.timeout, 0.2))
    elif a.mode == "probe":
        out = run_probe(a.host, a.port, a.udp_port, a.timeout)
    elif a.mode == "ccrr":
        out = run_ccrr(a.host, a.port, a.duration, a.warmup, a.parallel, a.timeout)
    else:
        out = run_idle(a.host, a.port, a.count, a.timeout)
    out["mode"] = a.mode
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
