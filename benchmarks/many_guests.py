#!/usr/bin/env python3
"""Many guests, one process: N stacks on one event loop, each guest with a live TCP flow (issue 28 item 6).

Two processes, so that the service's memory and CPU are its own:

* **the service** (this script re-run with ``--service``): only the stacks. N
  :class:`aioslirp.Stack` (``NetworkConfig()`` defaults, ``name="guest-I"``, no tracer) on one
  asyncio loop (uvloop, as the CLI runs, unless ``--no-uvloop``), each serving one end of its
  own ``socketpair(AF_UNIX, SOCK_SEQPACKET)`` through
  :class:`~aioslirp.transport.socketpair.SocketPairTransport`;
* **the driver** (the process you start): the other end of every socket pair, a small guest per
  pair built from :mod:`aioslirp.wire` frames (static address 10.0.2.15, or with ``--dhcp`` the
  address of a DHCP lease; the gateway's MAC known, ARP requests answered; a minimal TCP
  client: handshake, one request in flight, retransmit after 1 s, ACK of every answer) and the
  host server, an echo server on 127.0.0.1 that every guest
  reaches at 10.0.2.2 through its own stack's NAT.

Phases: the service makes and starts the N stacks (start-up time), reports its memory with no
flow; the service's CPU is read over an idle window; every guest opens its flow (at most 200
handshakes in flight) and the memory with all flows open is read; then each guest sends a
``--size``-byte request ``--rate`` times a second (random phase; one in flight, the next
``1 / rate`` seconds after the answer) for ``--warmup``
+ ``--duration`` seconds; over the ``--duration`` window the service's CPU (user + system, from
``/proc``) and every answer's latency (request sent by the guest -> whole answer back, the
driver's own scheduling delay included) are recorded, and the memory at its end.

Memory is VmRSS and the proportional set size (PSS: shared pages divided among the processes
mapping them, from ``/proc/PID/smaps_rollup``) of the service process; ``baseline`` is the
interpreter with aioslirp imported, before any stack. ``--profile-memory`` makes the service
also print ``tracemalloc``'s largest allocation sites (with no flow and with all flows open) to
stderr, and the gc-tracked objects by type. ``--trace FILE`` traces every stack through one
``TracerProvider`` (one export thread, spans as JSON lines in ``FILE``, each with the guest's
``aioslirp.guest.name``) at ``--trace-level`` (default ``flows``: a span per flow, ended when the
service stops), so that the figures include tracing.

Prints a short table, or the JSON record with ``--json`` (``-`` for stdout)::

    python benchmarks/many_guests.py                      # 1000 guests, 1 request/s each, 10 s
    python benchmarks/many_guests.py --guests 200 --rate 10 --json out.json
    python benchmarks/many_guests.py --quick              # 20 guests, a few seconds: the test's run

Exit status 1 when a guest's flow was never answered or a flow was lost. Needs no privileges;
the soft open-file limit is raised to 2 N + 256 (the hard limit, ``ulimit -Hn``, must allow it:
else a one-line error). Traffic stays on 127.0.0.1 and the socket pairs. Benchmarks are run on
a quiet machine; the figures in docs/performance.md name the machine they came from.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import time

from aioslirp.wire.arp import ARP_REPLY, build_arp, parse_arp
from aioslirp.wire.tcp import build_tcp
from aioslirp.wire.udp import build_udp

GUEST_MAC = bytes.fromhex("525400123456")
GW_MAC = bytes.fromhex("52550a000202")
GUEST4 = socket.inet_aton("10.0.2.15")
GW4 = socket.inet_aton("10.0.2.2")
SYN, FIN, RST, PSH, ACK = 0x02, 0x01, 0x04, 0x08, 0x10
MSS_OPT = b"\x02\x04\x05\xb4"  # MSS 1460
SEQ_MASK = 0xFFFFFFFF
BOOTP = struct.Struct("!BBBBIHH4s4s4s4s16s64s128s")  # RFC 2131 section 2, 236 bytes
DHCP_COOKIE = b"\x63\x82\x53\x63"
DISCOVER, OFFER, REQUEST, DHCPACK = 1, 2, 3, 5


# ----------------------------------------------------------------------------------- /proc figures
def proc_memory(pid: int | str = "self") -> dict:
    """VmRSS and (when the kernel has smaps_rollup) PSS of a process, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0] + "_mb"] = int(line.split()[1]) / 1024
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    out["Pss_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def proc_cpu(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list, q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ----------------------------------------------------------------------------------- the service
def service_main(args) -> int:
    """The service process: fds on stdin (one JSON line), then commands, one per stdin line."""
    if args.profile_memory:
        import tracemalloc
        tracemalloc.start(8)
    import aioslirp
    from aioslirp import NetworkConfig, Stack
    from aioslirp.transport.socketpair import SocketPairTransport
    from aioslirp import compiled

    fds = json.loads(sys.stdin.readline())["fds"]
    base_mem = proc_memory()

    def reply(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    provider = exporter = None
    if args.trace:  # one provider (one export thread) for every stack
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from aioslirp.cli.observe import JsonLinesSpanExporter

        provider = TracerProvider()
        exporter = JsonLinesSpanExporter(args.trace)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    cfg = {"trace_level": args.trace_level} if args.trace else {}

    async def run() -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        stacks, serving = [], []
        for i, fd in enumerate(fds):
            stack = Stack(NetworkConfig(**cfg), name=f"guest-{i}", labels={"bench": "many_guests"},
                          tracer_provider=provider)
            await stack.start()
            tr = SocketPairTransport(socket.socket(fileno=fd))
            serving.append(loop.create_task(stack.serve(tr)))
            stacks.append(stack)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        startup = time.perf_counter() - t0
        snap = _mem_snapshot() if args.profile_memory else None
        cmds: asyncio.Queue = asyncio.Queue()
        buf = bytearray()

        def on_stdin() -> None:
            data = os.read(0, 65536)
            if not data:
                cmds.put_nowait("stop")
                return
            buf.extend(data)
            while b"\n" in buf:
                line, _, rest = bytes(buf).partition(b"\n")
                buf[:] = rest
                cmds.put_nowait(line.decode().strip())

        loop.add_reader(0, on_stdin)
        reply({"ready": True, "stacks": len(stacks), "startup_s": startup, "baseline": base_mem,
               "uvloop": type(loop).__module__.startswith("uvloop"), "aioslirp": aioslirp.__version__,
               "compiled": all(compiled.status().values()), "python": sys.version.split()[0]})
        while True:
            cmd = await cmds.get()
            if cmd == "stats":
                flows = sum(len(s.parts.flows) for s in stacks)
                drops = sum(n for s in stacks for k, n in s.counters.items() if k.startswith("drop."))
                reply({"mem": proc_memory(), "cpu_s": proc_cpu(), "flows": flows, "drops": drops,
                       "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
                       "serving": sum(not t.done() for t in serving)})
            elif cmd == "profile":
                if snap is not None:
                    _mem_report(snap, len(stacks))
                reply({"ok": True})
            elif cmd == "stop":
                break
        loop.remove_reader(0)
        for s in stacks:
            s.stop()
        await asyncio.gather(*serving, return_exceptions=True)
        for s in stacks:
            await s.aclose()
        if provider is not None:
            provider.shutdown()  # flush
        reply({"stopped": True, "spans": exporter.exported if exporter is not None else None})

    if not args.no_uvloop:
        try:
            import uvloop
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:  # pragma: no cover - uvloop is a dependency
            pass
    asyncio.run(run())
    return 0


def _mem_snapshot():
    import tracemalloc
    return tracemalloc.take_snapshot()


def _mem_report(first, n: int) -> None:
    """tracemalloc's largest sites now and their growth since ``first`` (stacks made), to stderr."""
    import gc
    import tracemalloc
    snap = tracemalloc.take_snapshot()
    err = sys.stderr
    total = sum(s.size for s in first.statistics("filename"))
    print(f"--- tracemalloc with the stacks started: {total / 2**20:.1f} MiB traced, "
          f"{total / n:.0f} B per stack; largest sites:", file=err)
    for st in first.statistics("lineno")[:25]:
        print(f"{st.size / 2**20:8.2f} MiB {st.count:8d} blocks  {st.traceback[0]}", file=err)
    print("--- growth with all flows open, largest sites:", file=err)
    for st in snap.compare_to(first, "lineno")[:25]:
        print(f"{st.size_diff / 2**20:+8.2f} MiB {st.count_diff:+8d} blocks  {st.traceback[0]}", file=err)
    counts: dict = {}
    for o in gc.get_objects():
        t = type(o).__qualname__
        counts[t] = counts.get(t, 0) + 1
    print("--- gc-tracked objects by type (per stack):", file=err)
    for t, c in sorted(counts.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{c:9d} {c / n:8.1f}  {t}", file=err)
    err.flush()


# ----------------------------------------------------------------------------------- the driver
class Guest:
    """One guest: the driver's end of a socket pair, a static address, one TCP flow to the host."""

    __slots__ = ("i", "sock", "sport", "snd_nxt", "rcv_nxt", "state", "pending", "sent_at", "got",
                 "answers", "latencies", "retransmits", "timer", "eth", "dport", "bench", "addr", "xid")

    def __init__(self, i: int, sock: socket.socket, bench: "Driver") -> None:
        self.i, self.sock, self.bench = i, sock, bench
        self.sport = 40000 + i % 20000
        self.snd_nxt = random.getrandbits(32)
        self.rcv_nxt = 0
        self.state = "closed"
        self.pending = 0  # bytes of the answer still due (0: no request in flight)
        self.sent_at = 0.0
        self.got = 0
        self.answers = 0
        self.latencies: list = []
        self.retransmits = 0
        self.timer = None
        self.eth = GW_MAC + GUEST_MAC + b"\x08\x00"
        self.dport = bench.port
        self.addr = GUEST4  # static; with --dhcp, the address the lease gives
        self.xid = random.getrandbits(32)

    def tcp(self, seq: int, flags: int, payload: bytes = b"", options: bytes = b"") -> None:
        frame = build_tcp(self.eth, self.addr, GW4, self.sport, self.dport, seq, self.rcv_nxt,
                          flags, 65535, options, payload)
        try:
            self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            self.bench.send_full += 1  # lost: the retransmit timer sends it again

    def dhcp(self, mtype: int = DISCOVER, offered: bytes = b"", server: bytes = b"") -> None:
        """A DHCPDISCOVER (again after 1 s without an offer), or the DHCPREQUEST of an offer (RFC 2131 3.1)."""
        self.state = "dhcp"
        opts = bytes((53, 1, mtype))
        if mtype == REQUEST:
            opts += bytes((50, 4)) + offered + bytes((54, 4)) + server
        msg = BOOTP.pack(1, 1, 6, 0, self.xid, 0, 0, bytes(4), bytes(4), bytes(4), bytes(4), GUEST_MAC + bytes(10),
                         b"", b"") + DHCP_COOKIE + opts + bytes((55, 2, 1, 3, 255))
        frame = b"\xff" * 6 + GUEST_MAC + b"\x08\x00" + build_udp(bytes(4), b"\xff" * 4, 68, 67, msg)
        try:
            self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            self.bench.send_full += 1
        self.arm(1.0, self.dhcp)

    def dhcp_reply(self, f: bytes, u: int) -> None:
        """A DHCP message to port 68 at offset ``u`` (the UDP header): an offer is requested, an ack binds."""
        b = u + 8
        if len(f) < b + 240 or f[b] != 2 or struct.unpack_from("!I", f, b + 4)[0] != self.xid:
            return
        yiaddr = f[b + 16:b + 20]
        opts, i, end = {}, b + 240, len(f)
        while i < end and f[i] != 255:
            if f[i] == 0:
                i += 1
                continue
            if i + 2 > end:
                break
            opts[f[i]] = f[i + 2:i + 2 + f[i + 1]]
            i += 2 + f[i + 1]
        mtype = opts.get(53, b"\0")[0]
        if mtype == OFFER:
            self.dhcp(REQUEST, yiaddr, opts.get(54, GW4))
        elif mtype == DHCPACK:
            self.addr = yiaddr
            self.bench.leases += 1
            self.connect()

    def connect(self) -> None:
        self.state = "syn-sent"
        self.tcp(self.snd_nxt, SYN, options=MSS_OPT)
        self.arm(1.0, self.connect)

    def arm(self, delay: float, cb) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.bench.loop.call_later(delay, cb)

    def request(self) -> None:
        """Send one request (or resend the one in flight)."""
        if self.state != "established":
            return
        b = self.bench
        if self.pending:
            self.retransmits += 1
            self.tcp(self.snd_nxt, PSH | ACK, b.payload)
        else:
            self.sent_at = time.perf_counter()
            self.pending = len(b.payload)
            self.got = 0
            self.tcp(self.snd_nxt, PSH | ACK, b.payload)
        self.arm(1.0, self.request)

    def readable(self) -> None:
        while True:
            try:
                f = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            if not f:
                self.state = "gone"
                self.bench.loop.remove_reader(self.sock.fileno())
                return
            self.frame(f)

    def frame(self, f: bytes) -> None:
        et = f[12:14]
        if et == b"\x08\x06":  # ARP: answer a request for our address
            a = parse_arp(f)
            if a is not None and a[0] == 1 and a[4] == self.addr:
                self.sock.send(build_arp(ARP_REPLY, GUEST_MAC, self.addr, a[1], a[2]))
            return
        if et != b"\x08\x00":
            return  # IPv6 RAs and the rest: not ours to answer
        ihl = (f[14] & 0x0F) * 4
        t = 14 + ihl
        if f[23] == 17:
            if self.state == "dhcp" and f[t + 2:t + 4] == b"\x00\x44":  # to port 68
                self.dhcp_reply(f, t)
            return
        if f[23] != 6:
            return
        sport, dport, seq, ack, off, flags = struct.unpack_from("!HHIIBB", f, t)
        if dport != self.sport:
            return
        payload = f[t + (off >> 4) * 4:14 + struct.unpack_from("!H", f, 16)[0]]
        if flags & RST:
            self.state = "reset"
            self.bench.resets += 1
            return
        if self.state == "syn-sent":
            if flags & SYN and flags & ACK and ack == (self.snd_nxt + 1) & SEQ_MASK:
                self.snd_nxt = ack
                self.rcv_nxt = (seq + 1) & SEQ_MASK
                self.state = "established"
                self.timer.cancel()
                self.timer = None
                self.tcp(self.snd_nxt, ACK)
                self.bench.on_established(self)
            return
        if self.state != "established":
            return
        if self.pending and ((ack - self.snd_nxt) & SEQ_MASK) == len(self.bench.payload) and not payload:
            return  # the bare ACK of our request
        if payload and seq == self.rcv_nxt:
            self.rcv_nxt = (seq + len(payload)) & SEQ_MASK
            if self.pending:
                self.got += len(payload)
                if self.got >= self.pending:
                    self.snd_nxt = (self.snd_nxt + self.pending) & SEQ_MASK
                    self.pending = 0
                    self.answers += 1
                    if self.bench.measuring:
                        self.latencies.append(time.perf_counter() - self.sent_at)
                    self.tcp(self.snd_nxt, ACK)
                    self.schedule()
                    return
            self.tcp(self.snd_nxt, ACK)
        elif payload:  # out of order or a duplicate: say where we are
            self.tcp(self.snd_nxt, ACK)

    def schedule(self, first: bool = False) -> None:
        b = self.bench
        if not b.loading:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            return
        period = 1.0 / b.rate
        self.arm(random.uniform(0, period) if first else period, self.request)


class Driver:
    def __init__(self, args) -> None:
        self.args = args
        self.rate = args.rate
        self.payload = b"q" * args.size
        self.measuring = False
        self.loading = False
        self.send_full = 0
        self.resets = 0
        self.established = 0
        self.leases = 0
        self._all_up: asyncio.Future | None = None
        self._slots: asyncio.Semaphore | None = None

    def on_established(self, g: Guest) -> None:
        self.established += 1
        self._slots.release()
        if self.established == len(self.guests) and not self._all_up.done():
            self._all_up.set_result(None)

    async def run(self) -> dict:
        args = self.args
        loop = self.loop = asyncio.get_running_loop()
        n = args.guests
        self.loadavg_start = os.getloadavg()

        class Echo(asyncio.Protocol):
            def connection_made(self, transport):
                self.t = transport

            def data_received(self, data):
                self.t.write(data)

        server = await loop.create_server(Echo, "127.0.0.1", 0, backlog=4096)
        self.port = server.sockets[0].getsockname()[1]
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(n)]
        svc_fds = [b.fileno() for _a, b in pairs]
        cmd = [sys.executable, os.path.abspath(__file__), "--service"]
        if args.no_uvloop:
            cmd.append("--no-uvloop")
        if args.profile_memory:
            cmd.append("--profile-memory")
        if args.trace:
            cmd += ["--trace", os.path.abspath(args.trace), "--trace-level", args.trace_level]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=svc_fds,
                                text=True, bufsize=1)
        for _a, b in pairs:
            b.close()

        async def ask(line: str | None) -> dict:
            if line is not None:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            text = await loop.run_in_executor(None, proc.stdout.readline)
            if not text:
                raise SystemExit(f"the service exited ({proc.wait()})")
            return json.loads(text)

        try:
            proc.stdin.write(json.dumps({"fds": svc_fds}) + "\n")
            proc.stdin.flush()
            ready = await ask(None)
            self.guests = [Guest(i, a, self) for i, (a, _b) in enumerate(pairs)]
            for g in self.guests:
                g.sock.setblocking(False)
                loop.add_reader(g.sock.fileno(), g.readable)
            idle0 = await ask("stats")
            await asyncio.sleep(args.idle)
            idle1 = await ask("stats")

            # every guest opens its flow, at most 200 handshakes in flight
            self._all_up = loop.create_future()
            self._slots = asyncio.Semaphore(200)
            t0 = time.perf_counter()
            for g in self.guests:
                await self._slots.acquire()
                if args.dhcp:
                    g.dhcp()
                else:
                    g.connect()
            try:
                await asyncio.wait_for(asyncio.shield(self._all_up), 30 + n / 50)
            except asyncio.TimeoutError:
                pass
            connect_s = time.perf_counter() - t0
            await asyncio.sleep(0.5)  # the last ACKs land
            opened = await ask("stats")

            self.loading = True
            for g in self.guests:
                g.schedule(first=True)
            await asyncio.sleep(args.warmup)
            self.measuring = True
            answers0 = sum(g.answers for g in self.guests)
            load0 = await ask("stats")
            t_load = time.perf_counter()
            await asyncio.sleep(args.duration)
            load1 = await ask("stats")
            window = time.perf_counter() - t_load
            answers1 = sum(g.answers for g in self.guests)
            self.measuring = False
            self.loading = False
            deadline = time.perf_counter() + 3
            while any(g.pending for g in self.guests) and time.perf_counter() < deadline:
                await asyncio.sleep(0.05)
            final = await ask("stats")
            resets = self.resets  # before the stop, whose farewell resets every flow
            if args.profile_memory:
                await ask("profile")
            stopped = await ask("stop")
        finally:
            if proc.poll() is None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
                try:
                    await loop.run_in_executor(None, proc.wait, 30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            server.close()
            for g in getattr(self, "guests", []):
                g.sock.close()

        lat = [x for g in self.guests for x in g.latencies]
        per_guest_p50 = sorted(percentile(g.latencies, 0.5) for g in self.guests if g.latencies)
        cpu_load = load1["cpu_s"] - load0["cpu_s"]
        cpu_idle = idle1["cpu_s"] - idle0["cpu_s"]
        idle_window = args.idle
        answered = answers1 - answers0
        us = lambda x: None if x is None else round(x * 1e6, 1)  # noqa: E731
        mb = lambda m: {k: round(v, 2) for k, v in m.items()}  # noqa: E731
        return {
            "guests": n, "rate_per_guest": self.rate, "size": args.size, "duration_s": round(window, 3),
            "python": ready["python"], "uvloop": ready["uvloop"], "compiled": ready["compiled"],
            "aioslirp": ready["aioslirp"], "loadavg_start": self.loadavg_start, "loadavg": os.getloadavg(),
            "ncpu": os.cpu_count(),
            "startup_s": round(ready["startup_s"], 3),
            "startup_ms_per_stack": round(ready["startup_s"] * 1e3 / n, 3),
            "memory_mb": {"baseline": mb(ready["baseline"]), "idle": mb(idle0["mem"]), "flows_open": mb(opened["mem"]),
                          "load": mb(load1["mem"])},
            "rss_kib_per_guest": round((load1["mem"]["VmRSS_mb"] - ready["baseline"]["VmRSS_mb"]) * 1024 / n, 1),
            "idle_cpu_pct": round(100 * cpu_idle / idle_window, 2),
            "cpu": {"service_s": round(cpu_load, 3), "service_pct": round(100 * cpu_load / window, 1),
                    "per_guest_us_per_s": round(cpu_load * 1e6 / n / window, 1),
                    "per_request_us": round(cpu_load * 1e6 / answered, 1) if answered else None},
            "requests": {"answered_in_window": answered, "per_s": round(answered / window, 1),
                         "retransmits": sum(g.retransmits for g in self.guests),
                         "driver_send_full": self.send_full},
            "latency_us": {"p50": us(percentile(lat, 0.5)), "p90": us(percentile(lat, 0.9)),
                           "p99": us(percentile(lat, 0.99)), "max": us(max(lat) if lat else None),
                           "worst_guest_p50": us(per_guest_p50[-1] if per_guest_p50 else None)},
            "connect_s": round(connect_s, 3), "dhcp_leases": self.leases if args.dhcp else None,
            "flows": {"established": self.established, "open_in_service": opened["flows"],
                      "open_at_end": final["flows"], "resets": resets},
            "guests_answered": sum(1 for g in self.guests if g.answers),
            "trace": {"level": args.trace_level, "spans": stopped["spans"]} if args.trace else None,
            "service_drops": final["drops"], "serving": final["serving"],
            "service_fds": {"idle": idle0["fds"], "flows_open": opened["fds"]}, "service_threads": opened["threads"],
        }


def render(r: dict) -> str:
    m = r["memory_mb"]
    lat = r["latency_us"]
    lines = [
        f"{r['guests']} guests in one process (Python {r['python']}, {'uvloop' if r['uvloop'] else 'asyncio'}, "
        f"{'compiled' if r['compiled'] else 'pure Python'}), {r['rate_per_guest']} req/s each of {r['size']} B, "
        f"{r['duration_s']} s",
        f"  start-up: {r['startup_s']} s ({r['startup_ms_per_stack']} ms per stack); flows up in {r['connect_s']} s"
        + (f" (DHCP first: {r['dhcp_leases']} leases)" if r.get("dhcp_leases") is not None else ""),
        "  service memory (MiB)  VmRSS  PSS",
    ]
    for k in ("baseline", "idle", "flows_open", "load"):
        lines.append(f"    {k:<18} {m[k].get('VmRSS_mb', 0):7.1f} {m[k].get('Pss_mb', float('nan')):6.1f}")
    c = r["cpu"]
    lines += [
        f"  RSS per guest under load: {r['rss_kib_per_guest']} KiB; idle CPU {r['idle_cpu_pct']} %",
        f"  CPU under load: {c['service_pct']} % of a core, {c['per_guest_us_per_s']} us per guest per second, "
        f"{c['per_request_us']} us per request",
        f"  service fds: {r['service_fds']['idle']} idle, {r['service_fds']['flows_open']} with the flows open; "
        f"{r['service_threads']} thread(s)",
        f"  requests: {r['requests']['per_s']}/s answered, {r['requests']['retransmits']} retransmits",
        f"  latency (us): p50 {lat['p50']}  p90 {lat['p90']}  p99 {lat['p99']}  max {lat['max']}  "
        f"(worst guest's p50 {lat['worst_guest_p50']})",
        *([f"  traced at {r['trace']['level']}: {r['trace']['spans']} spans"] if r.get("trace") else []),
        f"  guests answered: {r['guests_answered']}/{r['guests']}; flows open {r['flows']['open_in_service']}, "
        f"at end {r['flows']['open_at_end']}, resets {r['flows']['resets']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guests", type=int, default=1000, metavar="N", help="stacks and guests (default 1000)")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second per guest (default 1)")
    ap.add_argument("--size", type=int, default=64, help="request and answer bytes (default 64)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds under load (default 10)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring (default 2)")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of the idle CPU window (default 3)")
    ap.add_argument("--dhcp", action="store_true",
                    help="each guest takes its address by DHCP before it connects (default: static 10.0.2.15)")
    ap.add_argument("--quick", action="store_true", help="20 guests, 2 s: a smoke run (the test's)")
    ap.add_argument("--json", metavar="PATH", help="write the JSON record to PATH ('-': stdout, no table)")
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--profile-memory", action="store_true",
                    help="the service prints tracemalloc's largest sites and object counts to stderr")
    ap.add_argument("--trace", metavar="FILE", help="trace every stack through one tracer provider, spans as "
                    "JSON lines to FILE (the service's CPU and memory then include tracing)")
    ap.add_argument("--trace-level", choices=("flows", "timeline", "frames"), default="flows",
                    help="with --trace (default flows)")
    ap.add_argument("--service", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.service:
        return service_main(args)
    if args.quick:
        args.guests, args.duration, args.warmup, args.idle = min(args.guests, 20), 2.0, 0.5, 0.5
        args.rate = max(args.rate, 5.0)
    for name in ("guests", "rate", "size", "duration", "idle"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name}: must be > 0")
    if args.warmup < 0:
        ap.error("--warmup: must be >= 0")
    need = 2 * args.guests + 256  # both ends of every pair while the service starts, then a host socket per flow
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            ap.error(f"--guests: {args.guests} guests need {need} open files, the hard limit is {hard} (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))  # the service inherits it
    if args.size > 1400:
        ap.error("--size: at most 1400 (one segment each way)")
    if not args.no_uvloop:
        try:
            import uvloop
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:  # pragma: no cover
            pass
    result = asyncio.run(Driver(args).run())
    if args.json == "-":
        print(json.dumps(result))
    else:
        print(render(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    ok = (result["guests_answered"] == result["guests"] and result["flows"]["open_at_end"] == result["guests"]
          and result["flows"]["resets"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
