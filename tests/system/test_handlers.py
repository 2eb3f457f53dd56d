"""Guest flows handed to Python handlers (issue 17), with real guests: a Linux network namespace behind
an in-process :class:`~aioslirp.Stack` (``run_in_namespace`` on pytest's loop), so that the handlers
are coroutines of this test.

The handlers answer on documentation addresses nobody serves (192.0.2.80...): a handled flow is never
connected to its destination unless the handler opens it (``open_upstream``). Upstream proxies (an
asyncio HTTP CONNECT proxy and a SOCKS5 server written here, tinyproxy when installed) and the target
servers listen on the test namespace's loopback: nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import http.client
import io
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from aioslirp import NetworkConfig, Stack, splice
from aioslirp.frontends.netns import run_in_namespace

from support.guests import need_tool
from support.prereqs import need
from support.servers import DataServer, NameServer, free_port, pattern
from support.stacks import fd_count

pytestmark = pytest.mark.netns


async def run_guest(cfg, script: str, *args, timeout: float = 120, setup=None, **stack_kw):
    """Run ``script`` (Python) in a namespace behind a Stack(cfg, **stack_kw); ``setup(stack)`` runs before
    the guest starts. Returns ``(json printed by the guest, stack)``; checks that nothing is left:
    no flow, no task, no extra fd."""
    stacks = []

    def factory(c):
        s = Stack(c, **stack_kw)
        if setup is not None:
            setup(s)
        stacks.append(s)
        return s

    fds = fd_count()
    tasks = asyncio.all_tasks()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        rc = await asyncio.wait_for(
            run_in_namespace(cfg, ["sh", "-c", f'"{sys.executable}" -c "$0" "$@" > {out}', script, *map(str, args)],
                             stack_factory=factory), timeout)
        text = open(out).read()
    stack = stacks[0]
    assert rc == 0, (text, {k: v for k, v in stack.counters.items() if "drop" in k or "error" in k or "tcp" in k})
    assert not stack.parts.flows
    assert all(t.done() for t in stack.parts.tasks)
    for _ in range(40):  # the test's own servers (proxies) may take a moment to see their last connection end
        await asyncio.sleep(0.05)
        if not asyncio.all_tasks() - tasks and fd_count() == fds:
            break
    assert asyncio.all_tasks() - tasks == set()
    assert fd_count() == fds
    return json.loads(text), stack


def cfg(**kw) -> NetworkConfig:
    kw.setdefault("dns_upstreams", [("127.0.0.1", 9)])
    return NetworkConfig(**kw)


# ============================================================================ the API


def transform(data: bytes) -> bytes:
    return bytes(b ^ 0x5A for b in data)


async def http_transform(flow, reader, writer):
    """A plain-HTTP service: answers a POST with the body XORed with 0x5A (any other request: 404)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    n = 0
    for h in lines[1:]:
        k, _, v = h.partition(":")
        if k.strip().lower() == "content-length":
            n = int(v)
    body = await reader.readexactly(n)
    out = transform(body)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Name: %s\r\nConnection: close\r\n\r\n"
                 % (len(out), (flow.name or "-").encode()) + out)
    await writer.drain()
    writer.close()


GUEST_API = r'''
import errno, hashlib, json, os, socket, subprocess, sys, time
out = {}
body = os.urandom(300000)
with open("/tmp/body", "wb") as f:
    f.write(body)
def curl(*a):
    p = subprocess.run(["curl", "-s", "--max-time", "20", *a], capture_output=True, timeout=30)
    return p.returncode, hashlib.sha256(p.stdout).hexdigest(), p.stdout[:200].decode(errors="replace")
out["body"] = hashlib.sha256(bytes(b ^ 0x5A for b in body)).hexdigest()
out["curl"] = curl("--data-binary", "@/tmp/body", "http://192.0.2.80/")
out["curl_name"] = curl("-D", "/tmp/h", "--data-binary", "@/tmp/body", "http://svc.test/")
out["name_hdr"] = [l for l in open("/tmp/h").read().splitlines() if l.lower().startswith("x-name")]

def err(fn):
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))

# half-close, guest first: send, SHUT_WR, read the answer to EOF
s = socket.create_connection(("192.0.2.81", 7), timeout=10)
s.sendall(b"a" * 100000)
s.shutdown(socket.SHUT_WR)
buf = b""
while True:
    d = s.recv(65536)
    if not d:
        break
    buf += d
s.close()
out["half_guest"] = buf.decode()
# half-close, handler first: read its EOF, then send and SHUT_WR
s = socket.create_connection(("192.0.2.81", 8), timeout=10)
buf = b""
while True:
    d = s.recv(65536)
    if not d:
        break
    buf += d
out["half_handler_first"] = buf.decode()
s.sendall(b"b" * 70000)
s.shutdown(socket.SHUT_WR)
time.sleep(0.3)
s.close()
# a handler that raises: RST; the next connection is served
s = socket.create_connection(("192.0.2.81", 9), timeout=10)
s.sendall(b"BOOM\n")
out["raise"] = err(lambda: s.recv(100) or "eof")
s.close()
s = socket.create_connection(("192.0.2.81", 9), timeout=10)
s.sendall(b"hello\n")
out["after_raise"] = s.recv(100).decode()
s.close()
# transport.abort(): RST
# (a RST that closely follows the SYN-ACK may fail the guest's connect() itself, with the same errno)
out["abort"] = err(lambda: socket.create_connection(("192.0.2.81", 10), timeout=10).recv(100) or "eof")
# UDP round trip
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(5)
got = []
for i in range(3):
    u.sendto(b"ping %d" % i, ("192.0.2.53", 5353))
    got.append(u.recv(100).decode())
out["udp"] = got
# the egress policy first: a denied destination never reaches the handler
s = socket.socket()
s.settimeout(5)
out["denied"] = err(lambda: s.connect(("192.0.2.99", 80)) or "connected")
s.close()
print(json.dumps(out))
'''


async def test_handler_api_with_a_real_guest():
    """curl through a transforming HTTP handler (SHA-256 of the body), by address and by DNS name
    (``flow.name``); half-close both ways; a handler that raises is a RST and the next connection is
    served; ``transport.abort()`` is a RST; a UDP handler round trip; a flow the egress policy
    denies never reaches a handler; nothing left afterwards."""
    need_tool("curl", "curl")
    seen = []
    half = {}

    async def half_guest_first(flow, reader, writer):
        data = await reader.read()  # to the guest's FIN
        writer.write(b"got %d" % len(data))
        writer.write_eof()

    async def half_handler_first(flow, reader, writer):
        writer.write(b"first")
        writer.write_eof()
        data = await reader.read()
        half["after_eof"] = len(data)
        writer.close()

    async def raising(flow, reader, writer):
        line = await reader.readline()
        if line.startswith(b"BOOM"):
            raise RuntimeError("boom (expected by the test)")
        writer.write(line)
        await writer.drain()
        writer.close()

    async def aborting(flow, reader, writer):
        writer.transport.abort()

    async def catch_all(flow, reader, writer):
        seen.append(flow.destination)
        writer.transport.abort()

    async def udp_upper(flow, datagrams):
        seen.append((flow.proto, flow.destination))
        async for d in datagrams:
            flow.send(d.upper())

    def setup(stack):
        stack.route("192.0.2.80:80", http_transform)
        stack.route("svc.test:80", http_transform)
        stack.route("192.0.2.81:7", half_guest_first)
        stack.route("192.0.2.81:8", half_handler_first)
        stack.route("192.0.2.81:9", raising)
        stack.route("192.0.2.81:10", aborting)
        stack.route("192.0.2.53:5353/udp", udp_upper)

    names = NameServer({"svc.test": "192.0.2.82"})
    try:
        # egress_allow covers svc.test's documentation address, which an upstream answer binds (for
        # the route by name) only under a covering CIDR allow rule (docs/security.md)
        out, stack = await run_guest(cfg(dns_upstreams=[("127.0.0.1", names.port)], egress_deny=["192.0.2.99"],
                                         egress_allow=["192.0.2.0/24"]),
                                     GUEST_API, setup=setup, tcp_handler=catch_all)
    finally:
        names.close()
    assert out["curl"][0] == 0 and out["curl"][1] == out["body"], out["curl"]
    assert out["curl_name"][0] == 0 and out["curl_name"][1] == out["body"], out["curl_name"]
    assert out["name_hdr"] == ["X-Name: svc.test"] or out["name_hdr"] == ["x-name: svc.test"], out["name_hdr"]
    assert out["half_guest"] == "got 100000"
    assert out["half_handler_first"] == "first" and half["after_eof"] == 70000
    assert out["raise"] == "ECONNRESET" and out["after_raise"] == "hello\n"
    assert out["abort"] == "ECONNRESET"
    assert out["udp"] == ["PING 0", "PING 1", "PING 2"]
    assert out["denied"] != "connected"
    assert ("udp", ("192.0.2.53", 5353)) in seen
    assert not [d for d in seen if d[0] == "192.0.2.99"]  # the denied flow never reached the catch-all
    c = stack.counters
    assert c["handler_errors"] == 1 and c["drop.egress_denied"] >= 1
    assert c["handler_flows.udp"] == 1 and c["handler_flows.tcp"] >= 7


GUEST_BULK = r'''
import hashlib, json, socket, sys, threading, time
N = int(sys.argv[1])
chunk = bytes(range(256)) * 256
s = socket.create_connection(("192.0.2.90", 9000), timeout=60)
h_up = hashlib.sha256()
def send():
    left = N
    while left:
        c = chunk[:min(left, len(chunk))]
        s.sendall(c)
        h_up.update(c)
        left -= len(c)
    s.shutdown(socket.SHUT_WR)
t = threading.Thread(target=send)
t0 = time.monotonic()
t.start()
h = hashlib.sha256()
n = 0
while True:
    d = s.recv(1 << 20)
    if not d:
        break
    h.update(d)
    n += len(d)
t.join()
s.close()
print(json.dumps({"n": n, "down": h.hexdigest(), "up": h_up.hexdigest(), "s": time.monotonic() - t0}))
'''


async def test_slow_handler_20mb_each_way_is_bounded():
    """20 MB each way through a handler that reads slowly and echoes the bytes transformed: the guest
    blocks instead of anything being lost (SHA-256 both ways) and the handler never holds more than
    ``tcp_buffer`` guest bytes; the bytes written wait for ``drain()``."""
    n = 20 * 1000 * 1000
    tcp_buffer = 256 * 1024
    held = []
    up = hashlib.sha256()

    async def slow_echo(flow, reader, writer):
        i = 0
        while True:
            held.append(reader.buffered)
            data = await reader.read(65536)
            if not data:
                break
            up.update(data)
            i += 1
            if i % 16 == 0:
                await asyncio.sleep(0.005)  # slow: the guest's window closes meanwhile
            writer.write(transform(data))
            held.append(writer.transport.get_write_buffer_size())
            await writer.drain()
        writer.close()

    out, stack = await run_guest(cfg(tcp_buffer=tcp_buffer), GUEST_BULK, n, tcp_handler=slow_echo)
    expect_up = hashlib.sha256()
    chunk = bytes(range(256)) * 256
    left = n
    while left:
        c = chunk[:min(left, len(chunk))]
        expect_up.update(c)
        left -= len(c)
    down = hashlib.sha256()
    left = n
    while left:
        c = chunk[:min(left, len(chunk))]
        down.update(transform(c))
        left -= len(c)
    assert out["n"] == n and out["up"] == expect_up.hexdigest() == up.hexdigest()
    assert out["down"] == down.hexdigest()
    assert max(held) <= tcp_buffer, max(held)
    assert stack.counters["tcp_host_write_paused"] > 0  # the handler's slowness closed the guest's window


# ============================================================================ upstream proxies


class ConnectProxy:
    """An HTTP CONNECT proxy (asyncio, on pytest's loop); ``auth``: the ``user:password`` it demands."""

    def __init__(self, auth: str | None = None) -> None:
        self.auth = auth
        self.seen: list = []

    async def start(self) -> "ConnectProxy":
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def handle(self, r, w) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, target, _ = lines[0].split()
            hdrs = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            self.seen.append((method, target, hdrs.get("proxy-authorization")))
            if self.auth and hdrs.get("proxy-authorization") != "Basic " + base64.b64encode(self.auth.encode()).decode():
                w.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
                return
            host, port = target.rsplit(":", 1)
            try:
                ur, uw = await asyncio.open_connection(host.strip("[]"), int(port))
            except OSError:
                w.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                return
            w.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await splice(r, w, ur, uw)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


class Socks5Proxy(ConnectProxy):
    """A SOCKS5 server (RFC 1928 CONNECT; RFC 1929 user/password when ``auth`` is set)."""

    async def handle(self, r, w) -> None:
        try:
            ver, n = await r.readexactly(2)
            methods = await r.readexactly(n)
            want = 2 if self.auth else 0
            if want not in methods:
                w.write(b"\x05\xff")
                return
            w.write(bytes([5, want]))
            user = None
            if want == 2:
                await r.readexactly(1)
                user = (await r.readexactly((await r.readexactly(1))[0])).decode()
                pw = (await r.readexactly((await r.readexactly(1))[0])).decode()
                ok = f"{user}:{pw}" == self.auth
                w.write(b"\x01" + (b"\x00" if ok else b"\x01"))
                if not ok:
                    return
            _v, cmd, _r, atyp = await r.readexactly(4)
            if atyp == 3:
                host = (await r.readexactly((await r.readexactly(1))[0])).decode()
            else:
                host = socket.inet_ntop(socket.AF_INET if atyp == 1 else socket.AF_INET6,
                                        await r.readexactly(4 if atyp == 1 else 16))
            port = struct.unpack("!H", await r.readexactly(2))[0]
            self.seen.append(("SOCKS5", f"{host}:{port}", user))
            try:
                ur, uw = await asyncio.open_connection(host, port)
            except OSError:
                w.write(b"\x05\x05\x00\x01" + bytes(6))  # connection refused
                return
            w.write(b"\x05\x00\x00\x01" + bytes(6))
            await splice(r, w, ur, uw)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()


@contextlib.contextmanager
def tinyproxy():
    exe = shutil.which("tinyproxy") or ("/usr/bin/tinyproxy" if os.path.exists("/usr/bin/tinyproxy") else None)
    need(exe, "tinyproxy (apt-get install tinyproxy)")
    with tempfile.TemporaryDirectory() as d:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        conf = os.path.join(d, "tinyproxy.conf")
        with open(conf, "w") as f:  # no ConnectPort line: CONNECT to any port
            f.write(f"Port {port}\nListen 127.0.0.1\nTimeout 30\nMaxClients 20\nUser nobody\nGroup nogroup\n"
                    f"LogLevel Connect\n")
        p = subprocess.Popen([exe, "-d", "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                with socket.socket() as c:
                    if c.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.05)
            yield port
        finally:
            p.terminate()
            p.wait(10)


GUEST_PROXY = r"""
import errno, hashlib, json, random, socket, subprocess, sys
port, closed, direct = map(int, sys.argv[1:4])
out = {}
def err(fn):
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))
p = subprocess.run(["curl", "-s", "--max-time", "20", "http://10.0.2.2:%d/200000" % port], capture_output=True, timeout=30)
out["curl"] = [p.returncode, hashlib.sha256(p.stdout).hexdigest()]
def down(port, n, seed):
    s = socket.create_connection(("10.0.2.2", port), timeout=20)
    s.sendall(b"DOWN %d %d\n" % (n, seed))
    h, got = hashlib.sha256(), 0
    while True:
        d = s.recv(65536)
        if not d:
            break
        h.update(d)
        got += len(d)
    s.close()
    return [got, h.hexdigest()]
out["down"] = down(port, 3000000, 7)
s = socket.create_connection(("10.0.2.2", port), timeout=20)
data = random.Random(1).randbytes(2000000)
s.sendall(b"UP\n" + data)
s.shutdown(socket.SHUT_WR)  # half-close through the tunnel
out["up"] = s.makefile().readline().split()
out["up_want"] = [str(len(data)), hashlib.sha256(data).hexdigest()]
s.close()
out["direct"] = down(direct, 1000, 1)
def refused():
    s = socket.create_connection(("10.0.2.2", closed), timeout=20)
    s.sendall(b"x")
    return s.recv(10) or "eof"
out["refused"] = err(refused)
p = subprocess.run(["curl", "-s", "--max-time", "20", "http://10.0.2.2:%d/" % closed], capture_output=True, timeout=30)
out["curl_refused"] = p.returncode
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["http", "socks5", "tinyproxy"])
async def test_upstream_proxy_chaining(kind, tmp_path):
    """The guest's TCP flows through an upstream proxy (``--upstream-proxy``'s handler): plain HTTP (curl)
    and raw tunnelled flows both ways with half-close arrive whole; credentials come from the
    environment, never the guest; a NO_PROXY destination goes direct; a refused upstream is a RST
    for the guest (curl fails at once). For the asyncio HTTP proxy the flows are also recorded
    (:class:`~aioslirp.handlers.record.Recorder` composed with the proxy's ``connect``)."""
    from aioslirp.handlers.proxy import UpstreamProxy
    from aioslirp.handlers.record import Recorder

    need_tool("curl", "curl")
    data, direct = DataServer(), DataServer()
    env = {"AIOSLIRP_PROXY_USER": "alice", "AIOSLIRP_PROXY_PASSWORD": "s3cret"}
    proxy = None
    with contextlib.ExitStack() as es:
        if kind == "tinyproxy":
            url, env = f"http://127.0.0.1:{es.enter_context(tinyproxy())}", {}
        else:
            proxy = await (ConnectProxy if kind == "http" else Socks5Proxy)(auth="alice:s3cret").start()
            url = f"{kind}://127.0.0.1:{proxy.port}"
        handler = UpstreamProxy(url, no_proxy=f"127.0.0.1:{direct.port}", env=env)
        if kind == "http":
            handler = Recorder(tmp_path, connect=handler.connect)
        try:
            out, stack = await run_guest(cfg(), GUEST_PROXY, data.port, free_port(), direct.port, tcp_handler=handler)
        finally:
            if proxy is not None:
                await proxy.close()
            data.close()
            direct.close()
    assert out["curl"] == [0, hashlib.sha256(pattern(200000, 1)).hexdigest()]
    assert out["down"] == [3000000, hashlib.sha256(pattern(3000000, 7)).hexdigest()]
    if kind != "tinyproxy":  # tinyproxy ends the whole tunnel on the client's FIN (no half-close)
        assert out["up"] == out["up_want"]
    assert out["direct"] == [1000, hashlib.sha256(pattern(1000, 1)).hexdigest()]
    assert out["refused"] == "ECONNRESET" and out["curl_refused"] in (7, 52, 56), out  # at or just after connect()
    if proxy is not None:
        targets = {t for _m, t, _a in proxy.seen}
        assert f"127.0.0.1:{data.port}" in targets and f"127.0.0.1:{direct.port}" not in targets
        assert all(a in ("Basic " + base64.b64encode(b"alice:s3cret").decode(), "alice") for _m, _t, a in proxy.seen)
    assert stack.counters["handler_errors"] == 0
    if kind == "http":
        metas = {p: json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))}
        downs = [p for p, m in metas.items() if m["down"] == 3000000]
        assert len(downs) == 1 and metas[downs[0]]["destination"] == ["10.0.2.2", data.port]
        assert downs[0].with_suffix(".down").read_bytes() == pattern(3000000, 7)
        ups = [p for p in tmp_path.glob("*.up") if p.stat().st_size == 2000003]
        assert ups and ups[0].read_bytes()[3:] == random.Random(1).randbytes(2000000)


# ============================================================================ in process (frames), units


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
async def test_stack_exit_cancels_handlers_and_closes_their_upstreams(v6):
    """A TCP handler holding an upstream connection (``open_upstream``: the gateway is the host's
    loopback) and a UDP handler, both waiting for ever, each family: leaving the Stack cancels both
    tasks, aborts the upstream (the server sees it end); no task, socket or fd is left."""
    from support.prereqs import have_ipv6_loopback
    from support.frames import F4, F6, of_proto, tcp_frame, udp_frame
    from support.stacks import recv_frames, served_stack

    if v6:
        need(have_ipv6_loopback(), "IPv6 on the test namespace's loopback")
    F = F6 if v6 else F4
    fds, tasks = fd_count(), asyncio.all_tasks()
    lsn = socket.socket(F.af)
    lsn.bind((F.loopback, 0))
    lsn.listen(4)
    port = lsn.getsockname()[1]
    started, cancelled = asyncio.Event(), []

    async def hold(flow, reader, writer):
        await flow.open_upstream()
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("tcp")
            raise

    async def hold_udp(flow, datagrams):
        try:
            async for _d in datagrams:
                flow.send(b"seen")
        finally:
            cancelled.append("udp")

    async with served_stack(cfg(), settle=0.1) as (stack, guest, _first):
        stack.route("*", hold)
        stack.route("*/udp", hold_udp)
        guest.send(tcp_frame(F, 41000, port, 0x02, opts=b"\x02\x04\x05\xb4"))
        guest.send(udp_frame(F, 41001, 9999, b"x"))
        await asyncio.wait_for(started.wait(), 5)
        frames = await recv_frames(guest, 0.3)
        assert [ip.data.flags & 0x12 for _e, ip in of_proto(F, frames, 6)][:1] == [0x12]  # SYN-ACK at once
        assert [bytes(ip.data.data) for _e, ip in of_proto(F, frames, 17)] == [b"seen"]
        conn, _ = lsn.accept()
        assert len(stack.parts.flows) == 2 and stack.counters["handler_flows.tcp"] == 1
    guest.close()
    assert sorted(cancelled) == ["tcp", "udp"]
    conn.settimeout(5)
    try:
        assert conn.recv(10) == b""
    except ConnectionResetError:
        pass
    conn.close()
    lsn.close()
    await asyncio.sleep(0.05)
    assert asyncio.all_tasks() - tasks == set()
    assert fd_count() == fds


def test_routes_first_match_and_unroute():
    """Route matches in egress-rule syntax; the first match wins, then the defaults; names from the
    bindings; unroute by route, handler or match."""
    from aioslirp.errors import ConfigError
    from aioslirp.flow.egress import Decision, Egress
    from aioslirp.handlers.routes import Router

    def a(): pass
    def b(): pass
    def c(): pass
    eg = Egress(NetworkConfig())
    r = Router({}, eg, tcp_handler=c)
    r.add("192.0.2.0/24:80", a)
    r.add("*.svc.test", b)
    r.add("*/udp", b)
    assert eg.names_on  # a route by name makes the virtual DNS bind names
    assert r.pick(6, "192.0.2.7", 80, 0.0) == (a, None)
    assert r.pick(6, "192.0.2.7", 81, 0.0) == (c, None)
    eg.bindings.bind("192.0.2.7", "api.svc.test", 100.0)
    assert r.pick(6, "192.0.2.7", 81, 1.0) == (b, "api.svc.test")
    assert r.pick(6, "192.0.2.7", 81, 1.0, Decision(True, "x", "other.test")) == (c, "other.test")
    assert r.pick(17, "2001:db8::1", 53, 0.0) == (b, None)
    assert r.remove(b) == 2 and r.remove("192.0.2.0/24:80") == 1 and not r.routes
    r.tcp_handler = None
    r.remove(None)
    assert r.pick(17, "192.0.2.7", 53, 0.0) is None
    with pytest.raises(ConfigError):
        r.add("not a rule!", a)
    with pytest.raises(TypeError):
        r.add("*", 42)


def test_proxy_url_and_no_proxy():
    from aioslirp.errors import ConfigError
    from aioslirp.config.upstream import NoProxy, parse_proxy_url

    p = parse_proxy_url("http://u%40x:p%3Aw@proxy.test:8080")
    assert (p.kind, p.host, p.port, p.user, p.password) == ("http", "proxy.test", 8080, "u@x", "p:w")
    assert "p:w" not in repr(p)
    p = parse_proxy_url("socks5h://[::1]:1081", env={"AIOSLIRP_PROXY_USER": "al", "AIOSLIRP_PROXY_PASSWORD": "pw"})
    assert (p.kind, p.host, p.port, p.user, p.password) == ("socks5", "::1", 1081, "al", "pw")
    assert parse_proxy_url("http://proxy.test", env={}).port == 3128 and parse_proxy_url("http://x", env={}).user is None
    for bad in ("ftp://x:1", "http://:80", "http://x:1/path", "http://x:99999"):
        with pytest.raises(ConfigError):
            parse_proxy_url(bad, env={})
    n = NoProxy(".corp.test, example.org:8443 10.0.0.0/8 [2001:db8::1]:443", env={})
    assert n.excluded("a.corp.test", "192.0.2.1", 80) and n.excluded("corp.test", "192.0.2.1", 80)
    assert not n.excluded("xcorp.test", "192.0.2.1", 80)
    assert n.excluded("example.org", "192.0.2.1", 8443) and not n.excluded("example.org", "192.0.2.1", 443)
    assert n.excluded(None, "10.1.2.3", 1) and not n.excluded(None, "11.1.2.3", 1)
    assert n.excluded(None, "2001:db8::1", 443) and not n.excluded(None, "2001:db8::1", 80)
    assert NoProxy(None, env={"NO_PROXY": "*"}).excluded(None, "192.0.2.1", 1)
    assert not NoProxy(None, env={})


async def test_upstream_proxy_names_the_destination():
    """The proxy is given the destination's DNS name when the flow has one (HTTP and SOCKS5 ATYP 3),
    with the credentials of the environment; a proxy that refuses ends the flow (counted in ``failures``)."""
    from aioslirp.handlers.proxy import ProxyError, UpstreamProxy

    class FakeFlow:
        destination, remote, name = ("192.0.2.80", 443), "192.0.2.80", "svc.test"
        owned: list = []

        def own(self, w):
            self.owned.append(w)

    env = {"AIOSLIRP_PROXY_USER": "alice", "AIOSLIRP_PROXY_PASSWORD": "s3cret"}
    for cls, kind in ((ConnectProxy, "http"), (Socks5Proxy, "socks5")):
        proxy = await cls(auth="alice:s3cret").start()
        try:
            up = UpstreamProxy(f"{kind}://127.0.0.1:{proxy.port}", env=env, no_proxy="")
            with pytest.raises(ProxyError):  # the test proxy cannot resolve svc.test: it refuses
                await up.connect(FakeFlow())
            assert proxy.seen[0][1] == "svc.test:443"
        finally:
            for w in FakeFlow.owned:
                w.close()
            FakeFlow.owned.clear()
            await proxy.close()


# ============================================================================ --verify-sni


GUEST_SNI = r"""
import errno, json, socket, ssl, subprocess, sys
port = int(sys.argv[1])
out = {}
def hello(name):
    i, o = ssl.MemoryBIO(), ssl.MemoryBIO()
    t = ssl.create_default_context().wrap_bio(i, o, server_hostname=name)
    try:
        t.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return o.read()
def ask(name, data):
    try:
        s = socket.create_connection(("allowed.test", port), timeout=10)
        s.sendall(data)
        got = s.recv(100)
        s.close()
        return got.decode() or "eof"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))
out["same"] = ask("allowed.test", hello("allowed.test"))
out["shared"] = ask("cdn.test", hello("cdn.test"))  # shares the address, no rule allows it
out["no_sni"] = ask("-", b"\x16\x03\x01\x00\x04\x01\x00\x00\x00")
out["garbage"] = ask("-", b"\x00" * 100)
out["http"] = ask("-", b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
out["http_other"] = ask("-", b"GET / HTTP/1.1\r\nHost: cdn.test\r\n\r\n")
# issue 24 item 3: lines end at LF for the server (http.server, nginx): it reads Host: cdn.test
out["smuggled"] = ask("-", b"GET / HTTP/1.1\r\nX-Pad: 1\nHost: cdn.test\n\r\nHost: allowed.test\r\n\r\n")
# item 6: a CONNECT asks for its target, not for its Host
out["connect_other"] = ask("-", b"CONNECT cdn.test:%d HTTP/1.1\r\nHost: allowed.test\r\n\r\n" % port)
out["connect_same"] = ask("-", b"CONNECT allowed.test:%d HTTP/1.1\r\nHost: allowed.test:%d\r\n\r\n" % (port, port))
print(json.dumps(out))
"""


@pytest.fixture
def sni_world():
    """192.0.2.10 on the test namespace's loopback (set up outside the event loop: pyroute2) and a
    server there answering ``OK`` to the first bytes of each connection, ``OK HOST`` to an HTTP/1
    head, HOST being the Host that Python's HTTP server code reads in it (``http.client.parse_headers``,
    as ``http.server`` does)."""
    from support.namespaces import namespace_address

    with namespace_address("192.0.2.10"):
        srv = socket.socket()
        srv.bind(("192.0.2.10", 0))
        srv.listen(8)

        def serve():
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                data = c.recv(65536)
                reply = b"OK"
                if data[:1].isupper():
                    _, _, rest = data.partition(b"\n")
                    reply += b" " + str(http.client.parse_headers(io.BytesIO(rest)).get("Host")).encode()
                c.sendall(reply)
                c.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            yield srv.getsockname()[1]
        finally:
            srv.shutdown(socket.SHUT_RDWR)
            srv.close()
            t.join(5)


async def test_verify_sni_with_a_real_guest(sni_world):
    """``verify_sni`` and ``--egress-default deny --allow allowed.test:PORT``: a ClientHello (or HTTP Host)
    naming allowed.test passes to the server; one naming cdn.test, which shares the address, one
    without a name and bytes that are neither are reset, counted and audited. So are a head the server
    reads as ``Host: cdn.test`` (bare LFs, issue 24 item 3) and ``CONNECT cdn.test`` with ``Host:
    allowed.test`` (item 6)."""
    port = sni_world
    names = NameServer({"allowed.test": "192.0.2.10", "cdn.test": "192.0.2.10"})
    try:
        log = io.StringIO()
        out, stack = await run_guest(cfg(dns_upstreams=[("127.0.0.1", names.port)], egress_default="deny",
                                         # 192.0.2.0/24:9/udp covers the names' documentation address:
                                         # their answers may bind it (docs/security.md); opens nothing used
                                         egress_allow=[f"allowed.test:{port}", "192.0.2.0/24:9/udp"],
                                         verify_sni=True, audit_log=log),
                                     GUEST_SNI, port)
        events = [json.loads(line) for line in log.getvalue().splitlines()]
    finally:
        names.close()
    assert out == {"same": "OK", "shared": "ECONNRESET", "no_sni": "ECONNRESET", "garbage": "ECONNRESET",
                   "http": "OK allowed.test", "http_other": "ECONNRESET", "smuggled": "ECONNRESET",
                   "connect_other": "ECONNRESET", "connect_same": f"OK allowed.test:{port}"}, out
    c = stack.counters
    assert c["egress.sni_verified"] == 3 and c["egress.sni_denied"] == 6
    assert [e["name"] for e in events if e.get("rule") == "verify-sni"] == ["cdn.test", None, None, "cdn.test",
                                                                            None, None]


GUEST_SNI_REQUESTS = r"""
import errno, http.client, json, socket, subprocess, sys
port = int(sys.argv[1])
out = {}
def response(s):
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = s.recv(4096)
        if not d:
            return "eof"
        buf += d
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    n = sum(int(v) for k, _, v in (line.partition(b":") for line in lines[1:]) if k.lower() == b"content-length")
    while len(body) < n:
        body += s.recv(4096)
    return (lines[0].split(b" ")[1] + b" " + body).decode()
def raw(*sends):
    got = []
    s = socket.create_connection(("allowed.test", port), timeout=10)
    try:
        for data in sends:
            s.sendall(data)
            got.append(response(s))
    except OSError as exc:
        got.append(errno.errorcode.get(exc.errno, str(exc)))
    finally:
        s.close()
    return got
def get(path, host="allowed.test:%d" % port, extra=b""):
    return b"GET %s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (path.encode(), host.encode(), extra)
c = http.client.HTTPConnection("allowed.test", port, timeout=10)
c.request("GET", "/keep-1")
first = c.getresponse().read().decode()
sock = c.sock
c.request("GET", "/keep-2")
out["keepalive"] = [first, c.getresponse().read().decode(), c.sock is sock]
c.close()
curl = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-o", "/dev/null", "-w", "%{http_code} %{num_connects}\n",
                       "http://allowed.test:%d/curl-1" % port, "http://allowed.test:%d/curl-2" % port],
                      capture_output=True, text=True, timeout=60)
out["curl"] = curl.stdout.splitlines() + curl.stderr.splitlines()
out["second_other"] = raw(get("/second-1"), get("/second-2", "cdn.test:%d" % port))
out["pipelined_other"] = raw(get("/pipe-1") + get("/pipe-2", "cdn.test:%d" % port))
fake = get("/fake", "cdn.test:%d" % port)
out["body"] = raw(b"POST /body-1 HTTP/1.1\r\nHost: allowed.test:%d\r\nContent-Length: %d\r\n\r\n%s"
                  % (port, len(fake), fake), get("/body-2"))
out["chunked"] = raw(b"POST /chunk-1 HTTP/1.1\r\nHost: allowed.test:%d\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n0\r\n\r\n" % (port, len(fake), fake), get("/chunk-2"))
out["h2c"] = raw(get("/h2c", extra=b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                   b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"))
ws = get("/ws", extra=b"Upgrade: websocket\r\nConnection: Upgrade\r\n")
s = socket.create_connection(("allowed.test", port), timeout=10)
s.sendall(ws)
out["ws"] = [response(s)]
s.sendall(fake)  # after the 101: WebSocket bytes, whatever they look like
got = b""
while len(got) < len(fake):
    got += s.recv(4096)
out["ws"].append(got == fake)
s.close()
out["ws_refused"] = raw(get("/ws-no", extra=b"Upgrade: websocket\r\nConnection: Upgrade\r\n"), fake)
print(json.dumps(out))
"""


@pytest.fixture
def sni_http_world():
    """192.0.2.10 on the test namespace's loopback and Python's HTTP/1.1 server there (keep-alive;
    it reads Content-Length and chunked content), recording ``(path, Host)`` of each request it
    reads; ``/ws`` answers ``Upgrade: websocket`` with 101 and echoes what follows, ``/ws-no`` with
    426. Yields ``(port, records)``."""
    import http.server

    from support.namespaces import namespace_address

    records: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def reply(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            host = self.headers.get("Host")
            records.append((self.path, host))
            if self.path == "/ws" and self.headers.get("Upgrade") == "websocket":
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.end_headers()
                self.wfile.flush()
                data = self.connection.recv(65536)
                self.wfile.write(data)
                self.close_connection = True
            elif self.path == "/ws-no":
                self.reply(426, b"no")
            else:
                self.reply(200, host.encode())

        def do_POST(self) -> None:
            if self.headers.get("Transfer-Encoding") == "chunked":
                while True:
                    size = int(self.rfile.readline(), 16)
                    self.rfile.read(size + 2)
                    if not size:
                        break
            else:
                self.rfile.read(int(self.headers["Content-Length"]))
            self.do_GET()

    with namespace_address("192.0.2.10"):
        server = http.server.ThreadingHTTPServer(("192.0.2.10", 0), Handler)
        server.daemon_threads = True
        t = threading.Thread(target=server.serve_forever, daemon=True)
        t.start()
        try:
            yield server.server_address[1], records
        finally:
            server.shutdown()
            server.server_close()
            t.join(5)


async def test_verify_sni_judges_every_request_of_a_connection(sni_http_world):
    """``verify_sni`` over plain HTTP/1.1 with a real guest and Python's keep-alive server: two
    requests on one connection (http.client; curl with two URLs) both reach it; a second request
    naming cdn.test (which shares the address, and no rule allows), kept alive or pipelined, never
    reaches it and the connection is reset; a head inside Content-Length or chunked content is
    content; h2c is refused; a WebSocket is a tunnel after the server's 101, not after its 426."""
    need_tool("curl", "curl")
    port, records = sni_http_world
    names = NameServer({"allowed.test": "192.0.2.10", "cdn.test": "192.0.2.10"})
    try:
        log = io.StringIO()
        out, stack = await run_guest(cfg(dns_upstreams=[("127.0.0.1", names.port)], egress_default="deny",
                                         # 192.0.2.0/24:9/udp covers the names' documentation address:
                                         # an upstream answer binds no special-purpose address without one
                                         egress_allow=[f"allowed.test:{port}", "192.0.2.0/24:9/udp"],
                                         verify_sni=True, audit_log=log),
                                     GUEST_SNI_REQUESTS, port)
        events = [json.loads(line) for line in log.getvalue().splitlines()]
    finally:
        names.close()
    host = f"allowed.test:{port}"
    assert out == {"keepalive": [host, host, True], "curl": ["200 1", "200 0"],
                   "second_other": [f"200 {host}", "ECONNRESET"], "pipelined_other": ["ECONNRESET"],
                   "body": [f"200 {host}", f"200 {host}"], "chunked": [f"200 {host}", f"200 {host}"],
                   "h2c": ["ECONNRESET"], "ws": ["101 ", True], "ws_refused": ["426 no", "ECONNRESET"]}, out
    assert records == [(path, host) for path in ("/keep-1", "/keep-2", "/curl-1", "/curl-2", "/second-1", "/body-1",
                                                 "/body-2", "/chunk-1", "/chunk-2", "/ws", "/ws-no")]
    c = stack.counters
    assert (c["egress.sni_verified"], c["egress.sni_denied"], c["egress.sni_requests_verified"]) == (7, 4, 4)
    assert [e["name"] for e in events if e.get("rule") == "verify-sni"] == ["cdn.test", "cdn.test", None, "cdn.test"]


async def test_udp_queue_is_bounded():
    """At most QUEUE guest datagrams wait for a UDP handler; past it ``put`` refuses (the flow counts
    ``handler_udp_dropped``); the iteration ends with the flow."""
    from aioslirp.handlers.udp import QUEUE, Datagrams

    d = Datagrams()
    assert all(d.put(b"%d" % i) for i in range(QUEUE)) and not d.put(b"more") and len(d) == QUEUE
    d.end()
    got = [x async for x in d]
    assert len(got) == QUEUE and got[0] == b"0" and not d.put(b"late")


def test_a_route_to_the_guest_side_gateway_address_is_warned_about(caplog):
    """Routes match the host side: "10.0.2.2:8000" (the gateway as the guest sees it) would match
    nothing, silently; it is accepted with one warning naming the address, "127.0.0.1:8000" without."""
    import logging

    async def h(flow, reader, writer):
        writer.close()

    stack = Stack(NetworkConfig())
    with caplog.at_level(logging.WARNING, logger="aioslirp.stack"):
        stack.route("10.0.2.2:8000", h)
        stack.route("[fd00::2]:8000", h)
        stack.route("127.0.0.1:8000", h)
        stack.route("*", h)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "10.0.2.2 is an address of the virtual network" in msgs[0] and "fd00::2" in msgs[1]


async def test_a_handled_udp_flow_is_listed_with_the_rule_that_let_it_through():
    """A UDP flow a Python handler took follows the Flow protocol like any flow (mypy checks it,
    tests/package/test_types.py): ``stack.flows()`` lists it with the egress rule that allowed it (it had
    no ``name`` / ``rule``: listing it raised ``AttributeError``)."""
    from support.frames import F4, udp_frame
    from support.stacks import served_stack

    async def echo(flow, datagrams):
        async for d in datagrams:
            flow.send(d)

    async with served_stack(cfg(egress_default="deny", egress_allow=["127.0.0.1:9999/udp"]), settle=0.1) as (
            stack, guest, _first):
        stack.route("*/udp", echo)
        guest.send(udp_frame(F4, 41001, 9999, b"x"))
        for _ in range(100):
            if stack.parts.flows:
                break
            await asyncio.sleep(0.01)
        (info,) = stack.flows()
        assert (info.protocol, info.destination, info.rule, info.name) == ("udp", ("10.0.2.2", 9999),
                                                                            "127.0.0.1/32:9999/udp", None)
