"""The native TCP NAT engine (aioslirp/native/tcpnat.c, aioslirp.nat.native_tcp) against the Linux
kernel: a real guest in a network namespace behind a Stack in this process, whose TAP is read by the
native reader (``AIOSLIRP_NATIVE=1``), for IPv4 and IPv6.

One guest run per family does it all (each run is a few seconds of real traffic): curl of a small
and a 16 MB body (SHA-256), a 16 MB upload (byte-exact, SHA-256 at the host server), 2,000
sequential short connections, half-close both ways, a refused port, a host server that resets and
a guest that resets, an upload to a slow host reader (the host socket fills: our window closes)
and a download the guest reads late (the guest's window closes: probes). Meanwhile a task of the
test reads ``stack.flows()``; afterwards the counters, the engine's counters and the audit log
are read: native flows are seen as Python ones are (limits, flows(), counters, audit records).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import sys
import textwrap

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.frontends.netns import run_in_namespace

from support.guests import GUEST_FAMILIES, PACED_GUEST, need_tool
from support.native import need_extension
from support.servers import DataServer, free_port, pattern

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

BIG = 16 * 1024 * 1024
CRR = 2000


@pytest.fixture(params=list(GUEST_FAMILIES))
def fam(request):
    return GUEST_FAMILIES[request.param]


@pytest.fixture(params=["peek_off", "discard"])
def peek(request, monkeypatch):
    """How the engine reads past the bytes the guest has not acknowledged: ``SO_PEEK_OFF`` (this
    kernel has it) or the fallback for kernels without it, a discard buffer (``peek_off=False``)."""
    if request.param == "discard":
        from aioslirp.nat.native_tcp import NativeTcp

        monkeypatch.setattr(NativeTcp, "engine_options", {"peek_off": False})
    return request.param


def guest_script(fam, port: int, closed_port: int) -> str:
    gw = fam.gw
    return textwrap.dedent(f"""
        import socket, hashlib, json, random, struct, subprocess, time
        out = {{}}
        def conn():
            s = socket.create_connection(("{gw}", {port}), timeout=60)
            assert s.family == socket.{fam.af}
            return s
        def read_all(s, size=1 << 20):
            h = hashlib.sha256(); n = 0
            while True:
                d = s.recv(size)
                if not d: break
                h.update(d); n += len(d)
            return n, h.hexdigest()
        # a connection that stays open while the test reads stack.flows()
        w = conn(); w.sendall(b"WAIT\\n" + b"x" * 10)
        time.sleep(1.0)
        w.close()
        # curl, small and large
        for size in (100000, {BIG}):
            p = subprocess.run(["sh", "-c", "curl -sS -g --max-time 60 http://{fam.url_host}:{port}/%d | sha256sum" % size],
                               capture_output=True, text=True)
            out["curl_%d" % size] = p.stdout.split()[0] if p.returncode == 0 else p.stderr
        # upload, byte-exact
        data = random.Random(9).randbytes({BIG})
        s = conn(); s.sendall(b"UP\\n" + data); s.shutdown(socket.SHUT_WR)
        out["up"] = s.makefile().read().strip(); s.close()
        # sequential short connections (CRR)
        ok = 0; t0 = time.monotonic()
        for i in range({CRR}):
            s = conn(); s.sendall(b"DOWN 100 %d\\n" % (i % 50))
            ok += read_all(s, 4096)[0] == 100
            s.close()
        out["crr_ok"] = ok; out["crr_s"] = time.monotonic() - t0
        # half-close: the guest's first (then it reads the reply), the host's first (3 MB, read late)
        s = conn(); s.sendall(b"UP\\nhello"); s.shutdown(socket.SHUT_WR)
        out["half_guest"] = s.makefile().read(); s.close()
        s = conn(); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        s.sendall(b"DOWN 3000000 5\\n"); time.sleep(0.5)
        out["half_host"] = read_all(s); s.close()
        # a refused port
        try:
            socket.create_connection(("{gw}", {closed_port}), timeout=10); out["refused"] = "connected"
        except ConnectionRefusedError:
            out["refused"] = "ECONNREFUSED"
        # the host resets; the guest resets
        s = conn(); s.sendall(b"RSTME\\n")
        try:
            out["host_rst"] = "eof" if s.recv(100) == b"" else "data"
        except ConnectionResetError:
            out["host_rst"] = "reset"
        s.close()
        s = conn(); s.sendall(b"WAIT\\n"); time.sleep(0.2)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)); s.close()
        # an upload to a slow reader (the host socket's buffers fill)
        data = random.Random(3).randbytes(4 * 1024 * 1024)
        s = conn(); s.sendall(b"SLOWUP\\n" + data); s.shutdown(socket.SHUT_WR)
        out["slow_up"] = s.makefile().read().strip(); s.close()
        time.sleep(0.3)
        print(json.dumps(out))
    """)


async def _watch_flows(stack_box: list, port: int, seen: list) -> None:
    """Record the first native flow to ``port`` seen ESTABLISHED in ``stack.flows()``, and the
    engine's counters then."""
    while True:
        if stack_box:
            for f in stack_box[0].flows():
                if (f.protocol == "tcp" and f.destination[1] == port and f.state == "ESTABLISHED"
                        and f.bytes_from_guest):
                    seen.append(f)
                    seen.append(stack_box[0].stats().get("native_tcp"))
                    return
        await asyncio.sleep(0.02)


async def test_native_tcp_flows_against_the_kernel(fam, peek, monkeypatch, tmp_path):
    need_extension()
    need_tool("curl", "curl")
    monkeypatch.setenv("AIOSLIRP_NATIVE", "1")
    data = DataServer(host=fam.loopback)
    audit = io.StringIO()
    stacks: list = []
    try:
        closed = free_port(host=fam.loopback)
        script = guest_script(fam, data.port, closed)
        cfg = NetworkConfig(audit_log=audit)
        out_path = tmp_path / "out.json"
        seen: list = []
        watcher = asyncio.ensure_future(_watch_flows(stacks, data.port, seen))

        def factory(c):
            stacks.append(Stack(c))
            return stacks[-1]

        # (without the sanitizer's preload, when the ASan test runs this: curl hangs under it)
        argv = ["env", "-u", "LD_PRELOAD", "sh", "-c", f'exec "$0" -c "$1" > {out_path}', sys.executable, script]
        rc = await run_in_namespace(cfg, argv, stack_factory=factory)
        watcher.cancel()
        text = out_path.read_text()
        assert rc == 0, text
        r = json.loads(text.strip().splitlines()[-1])
    finally:
        data.close()
    stack = stacks[0]
    c = stack.counters
    # the bytes, both ways
    assert r["curl_100000"] == hashlib.sha256(pattern(100000, 1)).hexdigest()
    assert r["curl_%d" % BIG] == hashlib.sha256(pattern(BIG, 1)).hexdigest()
    assert r["up"] == f"{BIG + 0} {hashlib.sha256(pattern(BIG, 9)).hexdigest()}"
    assert r["crr_ok"] == CRR
    assert r["half_guest"] == f"5 {hashlib.sha256(b'hello').hexdigest()}\n"
    assert r["half_host"] == [3000000, hashlib.sha256(pattern(3000000, 5)).hexdigest()]
    assert r["refused"] == "ECONNREFUSED"
    assert r["host_rst"] == "reset"
    assert data.events[-1:] == ["reset"]  # the guest's RST reached the host peer as a RST
    assert r["slow_up"] == f"{4 * 1024 * 1024} {hashlib.sha256(pattern(4 * 1024 * 1024, 3)).hexdigest()}"
    # every TCP flow ran natively: the engine adopted each, Python saw no segment of one but a SYN sent
    # again before the first was read (a slow first connection under ASan; native_tcp.syn_repeated)
    opened = c["flows.tcp.opened"]
    assert opened >= CRR + 10
    assert c["native_tcp.adopted"] == opened == c["flows.tcp.closed"]
    assert c["handled.tcp"] == c["native_tcp.syn_repeated"] and c["handled.tcp_syn"] == opened
    # the kernel's SYNs took the SYN lane (the reader's C straight to the admission), but for one
    # read behind a frame for Python in its batch
    print("syn lane", c["native_tcp.syn_lane"], "of", opened)
    assert CRR <= c["native_tcp.syn_lane"] <= opened
    assert c["native_tcp.frames"] > CRR * 3
    assert c["native_tcp.window_updates"] > 0  # the slow reader shrank our window; its reads opened it
    assert c["tcp_connect_refused"] == 1 and c["tcp_resets"] >= 1 and c["tcp_host_lost"] >= 1
    assert not stack.parts.flows
    # stack.flows() showed a native flow as it shows a Python one
    assert seen, "no native flow seen ESTABLISHED in stack.flows()"
    f, engine_counters = seen
    assert engine_counters["peek_off"] == (peek == "peek_off")
    assert f.guest[1] > 0 and f.bytes_from_guest == len(b"WAIT\n") + 10 and f.bytes_to_guest == 0
    assert f.host == fam.loopback and f.idle < 5
    # one audit record per flow, with the engine's outcome and byte counts
    recs = [json.loads(line) for line in audit.getvalue().splitlines() if line.strip()]
    tcp = [x for x in recs if x.get("proto") == "tcp"]
    assert len(tcp) == opened
    outcomes = {x["end"] for x in tcp}
    assert {"closed", "refused", "reset"} <= outcomes, outcomes
    ups = [x for x in tcp if x.get("bytes_up") == BIG + 3]
    assert len(ups) == 1 and ups[0]["end"] == "closed"
    downs = [x for x in tcp if x.get("bytes_down") == 3000000]
    assert len(downs) == 1


async def test_flows_ended_by_a_batch_of_guest_frames_are_taken_after_it():
    """The TAP reader hands a native flow's frames to the engine; when a batch ends flows (here the
    guest's RST), the transport calls back at once (``attach_tcp(engine, ended)``) instead of the
    engine's timer waking the loop, and the end record is there to take."""
    import socket

    from aioslirp.native import extension
    from aioslirp.transport.tap import TapTransport
    from support.frames import F4, GUEST_MAC, GW_MAC, RST, SYN, tcp_frame

    need_extension()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    t = TapTransport(a.detach(), native=True)
    engine = extension().TcpEngine(t.fd, False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 60.0)
    ended_calls: list = []
    t.attach_tcp(engine, lambda: ended_calls.append(engine.poll()))
    got: list = []
    await t.open(lambda frames, csum_ok=None: got.extend(frames))
    try:
        loop = asyncio.get_running_loop()
        st, slot, gen = engine.adopt(False, GUEST_MAC, F4.guest, 40000, F4.gw, port, socket.inet_aton("127.0.0.1"),
                                     port, 1000, 5000, 1460, 7, 65535, loop.time())
        assert st == 0  # connected at once (loopback): the SYN-ACK is on the TAP
        assert len(b.recv(2048)) > 54
        b.send(tcp_frame(F4, 40000, port, RST, seq=1001))
        b.send(tcp_frame(F4, 40001, port, SYN, seq=7, mss=1460))  # another flow's: for Python
        for _ in range(100):
            if ended_calls:
                break
            await asyncio.sleep(0.01)
        assert len(ended_calls) == 1 and [r[:4] for r in ended_calls[0]] == [(slot, gen, 2, 2)]
        assert len(got) == 1  # only the frame of no native flow reached the sink
        assert engine.live() == 0
    finally:
        t.close()
        engine.close()
        listener.close()
        b.close()




@pytest.mark.parametrize("direction", ["down", "up"])
async def test_native_tcp_paced_at_the_cap_without_loss(direction, monkeypatch, tmp_path):
    """``rate_up`` / ``rate_down`` = 20mbit with ``AIOSLIRP_NATIVE=1,udp``: the flow stays native
    (the engine adopted it, Python saw none of its segments) and the guest measures the cap within
    +-10% on bytes it counts itself, every byte delivered (SHA-256), the holds counted in the
    Python path's counter names (tests/unit/nat/test_rate_limit.py has the Python path's version)."""
    need_extension()
    monkeypatch.setenv("AIOSLIRP_NATIVE", "1,udp")
    data = DataServer(host="127.0.0.1")
    n = 8 * 1000 * 1000
    cap = 20 * 125_000  # 20mbit = 2.5 MB/s: 3.2 s
    stacks: list = []
    try:
        cfg = NetworkConfig(ipv6=False, **{f"rate_{direction}": "20mbit"})
        out_path = tmp_path / "out.json"
        script = textwrap.dedent(PACED_GUEST.format(port=data.port, n=n, mode=direction))

        def factory(c):
            stacks.append(Stack(c))
            return stacks[-1]

        argv = ["env", "-u", "LD_PRELOAD", "sh", "-c", f'exec "$0" -c "$1" > {out_path}', sys.executable, script]
        rc = await run_in_namespace(cfg, argv, stack_factory=factory)
        text = out_path.read_text()
        assert rc == 0, text
        out = json.loads(text.strip().splitlines()[-1])
    finally:
        data.close()
    if direction == "down":
        assert out["bytes"] == n and out["sha"] == hashlib.sha256(pattern(n, 7)).hexdigest()
    else:
        assert out["bytes"] == n // 256 * 256 and out["sha"] == out["sent_sha"]
    rate = out["bytes"] / out["seconds"]
    assert cap * 0.9 <= rate <= cap * 1.1, (rate, out)
    c = stacks[0].counters
    assert c["native_tcp.adopted"] == c["flows.tcp.opened"] == 1 and c["handled.tcp"] == c["native_tcp.syn_repeated"]
    held = "tcp_rate_held_up" if direction == "up" else "tcp_rate_paused_down"
    assert c[held] > 10 and c[held] == c["native_tcp." + held.removeprefix("tcp_")], dict(c)
    print(f"native {direction}: {rate * 8 / 1e6:.2f} Mbit/s, {c[held]} holds")
