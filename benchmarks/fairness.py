#!/usr/bin/env python3
"""Per-guest fairness of one process: guests in network namespaces served by stacks on one event loop.

Every guest is an ``aioslirp.spawn`` guest (a Python program in its own network namespace
behind its own :class:`~aioslirp.Stack`), all in this process, on one loop (uvloop when
installed, as ``aioslirp`` runs). A host server in a separate process (so that it takes no
turn of this process's loop) sends endless data to every connection on one port and echoes
64-byte requests on another. The guests:

* ``flood``: ``--flood-flows`` parallel downloads (default 4; ``--direction up``: uploads, to a
  host sink, for the guest -> host direction);
* ``n1`` .. ``nK``: one download each (``--neighbours K``, default 1);
* ``lat1`` .. ``latM``: small request/response (64 bytes each way, one connection, a request
  every millisecond; ``--latency-guests M``, default 1).

Timeline: the latency guests measure their round trips alone first (*unloaded*: the
downloaders are connected but idle; ``--unloaded`` seconds, default ``--duration``; no such
window without latency guests), then the downloads start, and after ``--warmup`` seconds
everything is measured for ``--duration`` seconds (*loaded*). Prints one row per guest: its
download rate (Gbit/s) and its ratio to its fair share (the downloaders' total divided in
proportion to their weights: 1.0 is exactly fair), and per latency guest the p50 round trip
unloaded, loaded and their ratio; then one JSON line with the same figures (and per guest
``fair_waits``: how often its flows waited for its turn, the stack's ``tcp_fair_wait_down`` +
``tcp_fair_wait_up``; ``express``: how often the scheduler's express lane ran its input early,
the stack's ``fair_express``; ``native_tcp``: its TCP flows ran on the native data plane (the
default where it is built; ``AIOSLIRP_NATIVE=0`` in the environment: the Python path); and ``loop_cpu``: the CPU time of this process, the stacks' loop,
per second of the loaded window: 1.0 is one core busy).

The issue-28 target: every guest >= 0.9 of its fair share and a latency ratio <= 1.5.
``--isolate`` serves the latency guests from a service process of their own (its own loop and
stacks, as one process per guest would), so that the flood shares only the machine with them:
the latency ratio of one process per guest on this machine.
``--latency-pasta PASTA`` serves them by pasta instead (one pasta process per latency guest): the
same flood's cost to a guest aioslirp does not serve at all, the machine's share under the peers' model.
``--no-fair`` takes the guests out of the scheduler (``NetworkConfig(fair_weight=None)``):
the behaviour before it, for comparison. Options::

    python benchmarks/fairness.py                  # 4-flow flood, one neighbour, one latency guest, 5 s
    python benchmarks/fairness.py --no-fair        # the same without the fair scheduler
    python benchmarks/fairness.py --neighbours 3 --flood-flows 8 --weights flood=2
    python benchmarks/fairness.py --quick          # 1 s windows (a smoke run: figures are noisy)

Needs root (or user namespaces) and ``/dev/net/tun``; traffic stays on 127.0.0.1 and in the
guests' namespaces. On a shared or small machine the guests, the host server and the kernel
compete with the loop for CPU: compare runs on the same machine, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import textwrap
import threading
import time

PIPE = asyncio.subprocess.PIPE

# ------------------------------------------------------------------ the host server (own process)
CHUNK = 256 * 1024
REQUEST = 64


class _Source(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        buf = b"\x5a" * CHUNK
        try:
            while True:
                self.request.sendall(buf)
        except OSError:
            pass


class _Sink(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        buf = bytearray(CHUNK)
        try:
            while self.request.recv_into(buf):
                pass
        except OSError:
            pass


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                data = sock.recv(4096)
                if not data:
                    return
                sock.sendall(data)
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def host_server(kind: str) -> None:
    """Serve the source or the echo on 127.0.0.1 (a port chosen by the kernel), print the port as
    one JSON line, and run until stdin closes. One process each: the source's sending threads
    would otherwise hold the interpreter lock while an echo waits (milliseconds of latency that
    are not the stack's)."""
    srv = _Server(("127.0.0.1", 0), {"source": _Source, "sink": _Sink, "echo": _Echo}[kind])
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(json.dumps({kind: srv.server_address[1]}), flush=True)
    sys.stdin.read()


# ------------------------------------------------------------------ the guests' programs
# Each reads the start time (time.time(), the same clock in every namespace) on stdin, keeps to
# the timeline given in its arguments (seconds after the start) and prints one JSON line.
DOWNLOAD = textwrap.dedent("""
    import json, selectors, socket, sys, time
    host, port, nflows, start, m0, m1 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(float, sys.argv[4:7])
    t0 = float(sys.stdin.readline())
    time.sleep(max(0.0, t0 + start - time.time()))
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(nflows):
        s = socket.create_connection((host, port))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        socks.append(s)
    up = len(sys.argv) > 7 and sys.argv[7] == "up"
    if up:
        for s in socks:
            sel.modify(s, selectors.EVENT_WRITE)
    buf = bytearray(1 << 20)
    data = memoryview(bytes(256 * 1024))
    got = 0
    t_m0, t_m1 = t0 + m0, t0 + m1
    while True:
        now = time.time()
        if now >= t_m1:
            break
        for key, _ in sel.select(0.05):
            try:
                n = key.fileobj.send(data) if up else key.fileobj.recv_into(buf)
            except BlockingIOError:
                continue
            if now >= t_m0:
                got += n
    for s in socks:
        s.close()
    print(json.dumps({"bytes": got, "seconds": m1 - m0}))
""")

LATENCY = textwrap.dedent("""
    import json, socket, statistics, sys, time
    host, port, u0, u1, l0, l1 = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:7])
    t0 = float(sys.stdin.readline())
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = b"r" * 64

    def window(a, b):
        out = []
        time.sleep(max(0.0, t0 + a - time.time()))
        while time.time() < t0 + b:
            t = time.perf_counter()
            s.sendall(req)
            n = 0
            while n < 64:
                n += len(s.recv(64 - n))
            out.append(time.perf_counter() - t)
            time.sleep(0.001)
        return out

    unloaded, loaded = window(u0, u1), window(l0, l1)
    print(json.dumps({"unloaded_p50_us": statistics.median(unloaded) * 1e6,
                      "loaded_p50_us": statistics.median(loaded) * 1e6,
                      "samples": [len(unloaded), len(loaded)]}))
""")


def serve_one(spec: str) -> int:
    """``--serve-one``: one guest behind its own stack, in this process on its own loop (uvloop
    when installed): ``spec`` is a JSON object ``{"argv": [...], "name": ...}``. Prints a line
    ``{"ready": true}`` once the guest runs, relays one line of stdin to the guest, then prints
    the guest's output and one JSON line of this stack's figures."""
    import aioslirp

    spec_d = json.loads(spec)

    async def run() -> None:
        cfg = aioslirp.NetworkConfig(ipv6=False)
        async with aioslirp.spawn(spec_d["argv"], config=cfg, name=spec_d["name"], stdin=PIPE, stdout=PIPE) as g:
            print(json.dumps({"ready": True}), flush=True)  # (the caller's timeline starts after it)
            line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            g.stdin.write(line.encode())
            await g.stdin.drain()
            out = await g.stdout.read()
            await g.wait()
            native = g.stack.stats().get("native_tcp", {}).get("adopted", 0) > 0
        sys.stdout.write(out.decode())
        print(json.dumps({"native_tcp": native}), flush=True)

    try:
        import uvloop
        new_loop = uvloop.new_event_loop
    except ImportError:
        new_loop = asyncio.new_event_loop
    loop = new_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    return 0


class _Isolated:
    """A guest served by ``--serve-one`` (or by pasta: ``--latency-pasta``) in a process of its
    own, with the ``stdin`` / ``stdout`` / ``wait`` of a spawned guest (its output: the guest's
    lines, then the service's when ``service_line``)."""

    def __init__(self, proc, service_line: bool = True) -> None:
        self.proc = proc
        self.stdin, self.stdout = proc.stdin, proc.stdout
        self.service_line = service_line

    async def wait(self) -> int:
        return await self.proc.wait()


def _yield_counters() -> tuple[int, int] | None:
    """``(polls, served)`` of the native plane's yield point in this process, or None without it."""
    from aioslirp import native

    set_yield = native.yield_point()
    ext = native.extension()
    return None if set_yield is None or ext is None else tuple(ext.yield_counters())


def _default_route() -> bool:
    """This network namespace has an IPv4 default route (``/proc/net/route``): pasta refuses to start without one."""
    try:
        with open("/proc/net/route") as f:
            return any(line.split()[1:2] == ["00000000"] for line in list(f)[1:])
    except OSError:
        return False


def pasta_argv(binary: str) -> list[str]:
    """pasta serving one guest command (appended after ``--``) in a network namespace of its own, as
    ``benchmarks/backends.py`` runs it: 10.0.2.15/24, gateway 10.0.2.2 mapped to the host's loopback,
    MTU 65520, no port forwards."""
    return [binary, "-f", "-q", "--runas", "0:0", "-4", "--config-net", "-a", "10.0.2.15", "-n", "24",
            "-g", "10.0.2.2", "-m", "65520", "-t", "none", "-u", "none", "-T", "none", "-U", "none"]


def _weights(text: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value) if sep else float("nan")
        except ValueError:
            out[name.strip()] = float("nan")
        if not out[name.strip()] > 0:
            raise SystemExit(f"fairness.py: --weights: {item.strip()!r}: expected NAME=POSITIVE_NUMBER")
    return out


async def measure(args) -> dict:
    """Run one measurement (see the module documentation); returns the figures."""
    import aioslirp

    servers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--host-server", kind],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for kind in ("source" if args.direction == "down" else "sink", "echo")]
    try:
        ports: dict = {}
        for server in servers:
            ports.update(json.loads(server.stdout.readline()))
        weights = _weights(args.weights)
        dur, warm = args.duration, args.warmup
        # the timeline, seconds after the start
        # the unloaded window (--unloaded seconds, default --duration) only with latency guests
        u0, u1 = 0.3, 0.3 + (args.unloaded if args.unloaded is not None else dur)
        d0 = u1 + 0.2 if args.latency_guests else 0.3
        l0, l1 = d0 + warm, d0 + warm + dur
        guests = [("flood", "download", args.flood_flows)] if args.flood_flows else []
        guests += [(f"n{i + 1}", "download", 1) for i in range(args.neighbours)]
        guests += [(f"lat{i + 1}", "latency", 0) for i in range(args.latency_guests)]
        unknown = set(weights) - {g[0] for g in guests}
        if unknown:
            raise SystemExit(f"fairness.py: --weights: no guest named {sorted(unknown)[0]!r}")
        yield_before = _yield_counters()
        async with contextlib.AsyncExitStack() as stack:
            procs = []
            for name, kind, flows in guests:
                weight = None if args.no_fair else weights.get(name, 1.0)
                # (the default weight is left to the config: the script also runs on a version without it)
                cfg = aioslirp.NetworkConfig(ipv6=False, **({} if weight == 1.0 else {"fair_weight": weight}))
                if kind == "download":
                    port = ports["source"] if args.direction == "down" else ports["sink"]
                    argv = [sys.executable, "-c", DOWNLOAD, "10.0.2.2", str(port), str(flows),
                            str(d0), str(l0), str(l1), args.direction]
                else:
                    argv = [sys.executable, "-c", LATENCY, "10.0.2.2", str(ports["echo"]), str(u0), str(u1),
                            str(l0), str(l1)]
                if kind == "latency" and args.latency_pasta:  # the peers' model: pasta, one process per guest
                    proc = await asyncio.create_subprocess_exec(
                        *pasta_argv(args.latency_pasta), "--", *argv, stdin=PIPE, stdout=PIPE,
                        stderr=subprocess.DEVNULL)
                    stack.push_async_callback(_reap, proc)
                    procs.append((name, kind, flows, None, _Isolated(proc, service_line=False)))
                    continue
                if kind == "latency" and args.isolate:
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable, os.path.abspath(__file__), "--serve-one",
                        json.dumps({"argv": argv, "name": name}), stdin=PIPE, stdout=PIPE)
                    stack.push_async_callback(_reap, proc)
                    assert proc.stdout is not None
                    if not json.loads(await proc.stdout.readline() or b"{}").get("ready"):
                        raise SystemExit(f"fairness.py: the service process of {name} did not start")
                    procs.append((name, kind, flows, None, _Isolated(proc)))
                    continue
                g = await stack.enter_async_context(aioslirp.spawn(argv, config=cfg, name=name, stdin=PIPE,
                                                                   stdout=PIPE))
                procs.append((name, kind, flows, weight, g))
            t0 = time.time() + 0.2
            for *_, g in procs:
                g.stdin.write(f"{t0}\n".encode())
                await g.stdin.drain()
            if args.loop_nice:  # this thread only (Linux: a thread's own nice), after every child started
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.loop_nice)
            cpu: list[float] = []  # this process's CPU time (the loop's) at the loaded window's ends
            loop = asyncio.get_running_loop()
            for at in (l0, l1):
                loop.call_later(max(0.0, t0 + at - time.time()), lambda: cpu.append(time.process_time()))
            outs = await asyncio.wait_for(asyncio.gather(*(g.stdout.read() for *_, g in procs)), l1 + 60)
            for *_, g in procs:
                await g.wait()
            # how often each guest's flows waited for its turn (0 without the scheduler)
            waits = [{k: g.stack.counters.get(k, 0) for k in ("tcp_fair_wait_down", "tcp_fair_wait_up", "fair_express")}
                     if not isinstance(g, _Isolated) else {} for *_, g in procs]
            # the guest's TCP flows ran on the native data plane (its stack still serves: stats() has them)
            native = [g.stack.stats().get("native_tcp", {}).get("adopted", 0) > 0
                      if not isinstance(g, _Isolated) else None for *_, g in procs]
        rows = []
        for (name, kind, flows, weight, g), out, w, nat in zip(procs, outs, waits, native):
            lines = out.decode().strip().splitlines()
            if isinstance(g, _Isolated) and g.service_line and lines:  # its service's line last
                nat = json.loads(lines.pop())["native_tcp"]
            if not lines:
                raise SystemExit(f"fairness.py: guest {name} printed nothing")
            served_by = ("pasta" if not g.service_line else "own process") if isinstance(g, _Isolated) else "shared loop"
            rows.append({"isolated": isinstance(g, _Isolated), "served_by": served_by, "guest": name, "kind": kind, "flows": flows, "weight": weight, **json.loads(lines[-1]),
                         "fair_waits": w.get("tcp_fair_wait_down", 0) + w.get("tcp_fair_wait_up", 0),
                         "express": w.get("fair_express", 0), "native_tcp": nat})
        downloads = [r for r in rows if r["kind"] == "download"]
        total = sum(r["bytes"] for r in downloads)
        wsum = sum((r["weight"] or 1.0) for r in downloads)
        for r in downloads:
            r["gbps"] = r["bytes"] * 8 / r["seconds"] / 1e9
            fair = total * (r["weight"] or 1.0) / wsum
            r["fair_share_ratio"] = r["bytes"] / fair if fair else 0.0
        for r in rows:
            if r["kind"] == "latency":
                r["latency_ratio"] = r["loaded_p50_us"] / r["unloaded_p50_us"]
        loop_cpu = (cpu[1] - cpu[0]) / dur if len(cpu) == 2 else None
        yield_after = _yield_counters()
        # the native plane's yield point (aioslirp.fair, "The yield point"): its polls of the express
        # lane inside busy guests' turns, and how often it served the lane there (None: no native plane)
        yields = None if yield_before is None or yield_after is None else {
            "polls": yield_after[0] - yield_before[0], "served": yield_after[1] - yield_before[1]}
        return {"fair": not args.no_fair, "isolate": args.isolate, "latency_pasta": args.latency_pasta, "direction": args.direction, "duration": dur, "loop_cpu": loop_cpu, "yield_point": yields,
                "warmup": warm, "total_gbps": total * 8 / dur / 1e9,
                "guests": rows}
    finally:
        for server in servers:
            server.stdin.close()
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()




async def _reap(proc) -> None:
    """End an isolated guest's service process if it still runs (the measurement failed)."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


def print_report(res: dict) -> None:
    what = "downloads" if res["direction"] == "down" else "uploads"
    print(f"fair scheduler: {'on' if res['fair'] else 'off'}; window {res['duration']:g} s after "
          f"{res['warmup']:g} s warm-up; {what} in all {res['total_gbps']:.2f} Gbit/s; "
          f"the loop's process used {res['loop_cpu']:.2f} CPU"
          + ("; latency guests in a process of their own" if res.get("isolate") else "")
          + (f"; latency guests served by {res['latency_pasta']}" if res.get("latency_pasta") else ""))
    print("| guest | flows | weight | Gbit/s | fair-share ratio | p50 unloaded us | p50 loaded us | latency ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res["guests"]:
        w = "-" if r["weight"] is None else f"{r['weight']:g}"
        if r["kind"] == "download":
            print(f"| {r['guest']} | {r['flows']} | {w} | {r['gbps']:.2f} | {r['fair_share_ratio']:.2f} | - | - | - |")
        else:
            print(f"| {r['guest']} | - | {w} | - | - | {r['unloaded_p50_us']:.0f} | {r['loaded_p50_us']:.0f} | "
                  f"{r['latency_ratio']:.2f} |")
    print(json.dumps(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-server", choices=("source", "sink", "echo"), help=argparse.SUPPRESS)
    ap.add_argument("--direction", choices=("down", "up"), default="down",
                    help="down: the guests download from the host (default); up: they upload to it")
    ap.add_argument("--flood-flows", type=int, default=4,
                    help="parallel downloads of the flooding guest (default 4; 0: no flooding guest)")
    ap.add_argument("--neighbours", type=int, default=1, help="guests with one download each (default 1)")
    ap.add_argument("--latency-guests", type=int, default=1, help="request/response guests (default 1)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of each measured window (default 5)")
    ap.add_argument("--unloaded", type=float, metavar="SECONDS",
                    help="seconds of the latency guests' unloaded window (default: --duration)")
    ap.add_argument("--warmup", type=float, default=1.0,
                    help="seconds of transfer before the loaded window (default 1)")
    ap.add_argument("--weights", help="fair_weight per guest, e.g. flood=2,n1=0.5 (default 1 each)")
    ap.add_argument("--no-fair", action="store_true",
                    help="take the guests out of the fair scheduler (fair_weight=None)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="event loop (default uvloop, asyncio when uvloop is missing)")
    ap.add_argument("--quick", action="store_true", help="1 s windows, 0.5 s warm-up: a smoke run")
    ap.add_argument("--isolate", action="store_true",
                    help="serve the latency guests from a process of their own (the machine's share of the latency)")
    ap.add_argument("--latency-pasta", metavar="PASTA",
                    help="serve the latency guests by the pasta binary PASTA instead (one process per guest, the "
                         "peers' model): what the same flood costs a guest that aioslirp does not serve")
    ap.add_argument("--loop-nice", type=int, default=0, metavar="N",
                    help="the loop's thread runs at nice N (1-19) once the guests and servers started: the "
                         "guests' readers and the host servers get the CPU first, so the loop is the bottleneck "
                         "and its service is what the scheduler divides (default 0: unchanged)")
    ap.add_argument("--serve-one", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.host_server:
        host_server(args.host_server)
        return 0
    if args.serve_one:
        return serve_one(args.serve_one)
    for name in ("flood_flows", "neighbours", "latency_guests"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')}: must be at least 0")
    if args.quick:
        args.duration, args.warmup = 1.0, 0.5
    if not (args.duration > 0 and args.warmup >= 0):
        ap.error("--duration must be > 0 and --warmup >= 0")
    if not 0 <= args.loop_nice <= 19:
        ap.error("--loop-nice: must be 0-19")
    if args.unloaded is not None and not args.unloaded > 0:
        ap.error("--unloaded must be > 0")
    if args.latency_pasta is not None:
        found = shutil.which(args.latency_pasta)
        if found is None:
            ap.error(f"--latency-pasta: {args.latency_pasta!r} is not an executable")
        if args.isolate:
            ap.error("--latency-pasta: not with --isolate (the latency guests are served by one or the other)")
        if not _default_route():
            ap.error("--latency-pasta: pasta needs an IPv4 default route in this namespace (a black hole will do, "
                     "as benchmarks/run.py makes)")
        args.latency_pasta = os.path.abspath(found)
    new_loop = asyncio.new_event_loop
    if args.loop == "uvloop":
        try:
            import uvloop
            new_loop = uvloop.new_event_loop
        except ImportError:
            pass
    loop = new_loop()
    try:
        res = loop.run_until_complete(measure(args))
    finally:
        loop.close()
    print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
