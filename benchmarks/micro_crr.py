#!/usr/bin/env python3
"""In-process CRR cycle: the stack's own CPU per guest connection, without the TAP and the loop.

A :class:`~aioslirp.Stack` serves a transport that only collects frames (with offload, like
the TAP of ``aioslirp attach``); the script plays the guest (frames built with
:func:`aioslirp.wire.ipv4.build_tcp`, checksums flagged as trusted) and the host server (a
listening socket on 127.0.0.1 in this process) and runs the connect / 1-byte request /
1-byte response / close cycle of the CRR benchmark, calling the stack's entry points
directly: ``on_frames`` for guest frames (one batch per frame, as they mostly arrive),
the host socket's read callback for the answer and the EOF, one loop pass for the flow task.
Only the time spent inside those calls is counted (the guest's and the server's work is
not), so the figure is the stack's Python + system-call cost per connection, with far less
noise than the end-to-end benchmark: use it to compare two versions of the code
(``--tree DIR``, or run it from each checkout)::

    python benchmarks/micro_crr.py --connections 20000
    python benchmarks/micro_crr.py --tree /tmp/old-aioslirp     # DIR holds an aioslirp package

``--policy-rules N`` measures with an egress policy of ``N`` generated rules (half CIDR deny
rules ``198.18.X.Y/32:PORT/tcp``, half name allow rules ``svcI.example.test:443``; none matches
the benchmark's flows and ``egress_default`` stays ``allow``, so each new flow is decided by the
policy and allowed by default); with ``--audit-log FILE`` too, it is the configuration of issue
15's cost target (a 100-rule policy with the audit log on, compared with neither)::

    python benchmarks/micro_crr.py --connections 20000
    python benchmarks/micro_crr.py --connections 20000 --policy-rules 100 --audit-log /dev/null

``--handler identity`` measures the same cycle through a Python flow handler that opens the
natural upstream and splices (``flow.open_upstream()`` + ``aioslirp.splice``, docs/handlers.md);
``--handler none`` the NAT path measured the same way. Both run the whole cycle on the loop (the
handler's connect and streams need it) against an asyncio server in this process, and count the
process's CPU time per connection (``time.process_time``: the server's and the guest driver's work
included, idle waits excluded): compare the two with each other, not with the default mode's figure.

``--mode rr`` runs request/response round trips on one connection instead (1-byte request,
1-byte answer, the guest's ACK). Prints microseconds per connection or round trip (median and
best of ``--repeat`` runs) and the frames per cycle both ways. Needs no privileges; traffic
stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tree", help="directory holding the aioslirp package to measure")
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--mode", choices=("crr", "rr"), default="crr",
                    help="rr: request/response round trips on one connection (--connections of them)")
    ap.add_argument("--audit-log", metavar="FILE",
                    help="measure with the audit log on, written to FILE (e.g. /dev/null)")
    ap.add_argument("--policy-rules", type=int, default=0, metavar="N",
                    help="measure with an egress policy of N generated CIDR and name rules (default deny off)")
    ap.add_argument("--handler", choices=("none", "identity"),
                    help="crr through an identity flow handler (or 'none': the NAT path), CPU time per "
                    "connection with an in-process asyncio server (see the module documentation)")
    args = ap.parse_args()
    if args.policy_rules < 0:
        ap.error("--policy-rules: must be >= 0")
    if args.tree:
        sys.path.insert(0, args.tree)
    from aioslirp import NetworkConfig, Stack
    from aioslirp.transport.base import Transport
    from aioslirp.wire.tcp import build_tcp

    class Collect(Transport):
        offload = True

        def __init__(self) -> None:
            super().__init__()
            self.out: list = []

        async def _start_reading(self) -> None:
            pass

        def send_frames(self, frames) -> None:
            self.out.extend(frames)

        def _close_io(self) -> None:
            pass

    guest_mac, gw_mac = bytes.fromhex("525400123456"), bytes.fromhex("52550a000202")
    eth = gw_mac + guest_mac + b"\x08\x00"
    guest, gw = socket.inet_aton("10.0.2.15"), socket.inet_aton("10.0.2.2")
    seq_ack = struct.Struct("!II")
    SYN, FIN, PSH, ACK = 0x02, 0x01, 0x08, 0x10

    async def run(n: int) -> tuple[float, float, float]:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(256)
        port = srv.getsockname()[1]
        inside = 0.0
        perf = time.perf_counter
        extra = {"audit_log": args.audit_log} if args.audit_log else {}
        if args.policy_rules:
            extra["egress_deny"] = [f"198.18.{i // 256 % 256}.{i % 256}/32:{1000 + i % 60000}/tcp"
                                    for i in range(0, args.policy_rules, 2)]
            extra["egress_allow"] = [f"svc{i}.example.test:443" for i in range(1, args.policy_rules, 2)]
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], **extra)) as stack:
            tr = Collect()
            serving = asyncio.ensure_future(stack.serve(tr))
            await asyncio.sleep(0)
            out = tr.out
            ok = [True]
            on_frames = stack.parts.link.on_frames

            def frame(sport, seq, ack, flags, payload=b""):
                return [build_tcp(eth, guest, gw, sport, port, seq, ack, flags, 65535, b"", payload)]

            def last_seq():
                return seq_ack.unpack_from(out[-1], 38)[0]

            frames_in = frames_out = 0
            if args.mode == "rr":
                sport = 19999
                on_frames(frame(sport, 1000, 0, SYN), ok)
                iss = last_seq()
                c, _ = srv.accept()
                on_frames(frame(sport, 1001, iss + 1, ACK), ok)
                flow = stack.parts.flows[(6, guest, sport, gw, port)]
                s, a = 1001, iss + 1
                for i in range(n):
                    out.clear()
                    t = perf()
                    on_frames(frame(sport, s, a, ACK | PSH, b"q"), ok)
                    inside += perf() - t
                    c.recv(1)
                    c.send(b"a")
                    s += 1
                    t = perf()
                    flow.transport._on_readable()
                    a += 1
                    on_frames(frame(sport, s, a, ACK), ok)
                    await asyncio.sleep(0)  # due timers, if any
                    inside += perf() - t
                    frames_in += 2
                    frames_out += len(out)
                c.close()
                flow.shutdown()
                await asyncio.sleep(0)
                n_done = n
            else:
                n_done = 0
            for i in range(n - n_done):
                sport = 20000 + i % 40000
                out.clear()
                s = 1000
                t = perf()
                on_frames(frame(sport, s, 0, SYN), ok)
                inside += perf() - t
                iss = last_seq()
                c, _ = srv.accept()
                t = perf()
                on_frames(frame(sport, s + 1, iss + 1, ACK), ok)
                on_frames(frame(sport, s + 1, iss + 1, ACK | PSH, b"q"), ok)
                inside += perf() - t
                c.recv(1)
                c.send(b"a")
                flow = stack.parts.flows[(6, guest, sport, gw, port)]
                t = perf()
                flow.transport._on_readable()
                on_frames(frame(sport, s + 2, iss + 2, ACK), ok)
                on_frames(frame(sport, s + 2, iss + 2, ACK | FIN), ok)
                inside += perf() - t
                c.recv(1)
                c.close()
                t = perf()
                flow.transport._on_readable()  # EOF: our FIN
                on_frames(frame(sport, s + 3, iss + 3, ACK), ok)
                await asyncio.sleep(0)  # the flow's task ends
                inside += perf() - t
                frames_in += 6
                frames_out += len(out)
            if stack.parts.flows:
                raise SystemExit(f"flows left: {len(stack.parts.flows)}")
            stack.stop()
            await serving
        srv.close()
        return inside * 1e6 / n, frames_in / n, frames_out / n

    async def run_handler(n: int) -> tuple[float, float, float]:
        from aioslirp import splice

        async def identity(flow, reader, writer):
            up_r, up_w = await flow.open_upstream()
            await splice(reader, writer, up_r, up_w)

        async def serve(r, w):
            await r.read(1)
            w.write(b"a")
            await r.read()  # the guest's FIN
            w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        kw = {"tcp_handler": identity} if args.handler == "identity" else {}
        frames_in = frames_out = 0
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)]), **kw) as stack:
            tr = Collect()
            serving = asyncio.ensure_future(stack.serve(tr))
            await asyncio.sleep(0)
            out = tr.out
            ok = [True]
            on_frames = stack.parts.link.on_frames

            def frame(sport, seq, ack, flags, payload=b""):
                return [build_tcp(eth, guest, gw, sport, port, seq, ack, flags, 65535, b"", payload)]

            def tcp(f):  # an IPv4 TCP frame to the guest (not an RA...)
                return f[12:14] == b"\x08\x00" and f[23] == 6

            async def until(pred):
                for k in range(100000):
                    if pred():
                        return
                    await asyncio.sleep(0 if k < 8 else 1e-4)  # then idle in the loop (no CPU) for timers
                raise SystemExit("stalled")

            t0 = time.process_time()
            for i in range(n):
                sport = 20000 + i % 40000
                out.clear()
                s = 1000
                on_frames(frame(sport, s, 0, SYN), ok)
                await until(lambda: any(tcp(f) and f[47] & SYN for f in out))
                iss = seq_ack.unpack_from([f for f in out if tcp(f) and f[47] & SYN][0], 38)[0]
                on_frames(frame(sport, s + 1, iss + 1, ACK), ok)
                on_frames(frame(sport, s + 1, iss + 1, ACK | PSH, b"q"), ok)
                await until(lambda: any(tcp(f) and len(f) > 54 and f[-1:] == b"a" for f in out))
                on_frames(frame(sport, s + 2, iss + 2, ACK | FIN), ok)
                await until(lambda: any(tcp(f) and f[47] & FIN for f in out))
                on_frames(frame(sport, s + 3, iss + 3, ACK), ok)
                key = (6, guest, sport, gw, port)
                await until(lambda: key not in stack.parts.flows)
                frames_in += 5
                frames_out += len(out)
            wall = time.process_time() - t0  # CPU of this process: waits (timers, the loop idle) excluded
            stack.stop()
            await serving
        server.close()
        await server.wait_closed()
        return wall * 1e6 / n, frames_in / n, frames_out / n

    if args.handler is not None:
        run = run_handler  # noqa: F811
    if not args.no_uvloop:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    results = [asyncio.run(run(args.connections)) for _ in range(args.repeat)]
    us = [r[0] for r in results]
    if args.policy_rules or args.audit_log:
        print(f"policy rules: {args.policy_rules}, audit log: {args.audit_log or 'off'}")
    print(f"{statistics.median(us):.1f} us per {'round trip' if args.mode == 'rr' else 'connection'}, best {min(us):.1f} (runs: {', '.join(f'{u:.1f}' for u in us)}); "
          f"frames per {'round trip' if args.mode == 'rr' else 'connection'}: {results[0][1]:.0f} in, "
          f"{results[0][2]:.1f} out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
