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
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import dpkt
import pytest

from aioslirp import NetworkConfig, Stack, splice
from aioslirp.netns import run_in_namespace
from conftest import need
from guest_helpers import need_tool
from hostservers import DataServer, pattern
from stack_helpers import fd_count

pytestmark = pytest.mark.netns


class Names:
    """A DNS upstream on 127.0.0.1 answering A queries from ``table`` (name -> address), else NXDOMAIN."""

    def __init__(self, table: dict) -> None:
        self.table = table
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            q = dpkt.dns.DNS(data)
            r = dpkt.dns.DNS(id=q.id, qr=dpkt.dns.DNS_R, rd=q.rd, ra=1, qd=q.qd)
            qd = q.qd[0]
            addr = self.table.get(qd.name.lower())
            if addr is None:
                r.rcode = dpkt.dns.DNS_RCODE_NXDOMAIN
            elif qd.type == dpkt.dns.DNS_A:
                r.an = [dpkt.dns.DNS.RR(name=qd.name, type=dpkt.dns.DNS_A, cls=dpkt.dns.DNS_IN, ttl=60,
                                        ip=socket.inet_aton(addr))]
            self.sock.sendto(bytes(r), peer)

    def close(self) -> None:
        self.sock.close()


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
    assert not stack.flows
    assert all(t.done() for t in stack.tasks)
    await asyncio.sleep(0.05)
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
s = socket.create_connection(("192.0.2.81", 10), timeout=10)
out["abort"] = err(lambda: s.recv(100) or "eof")
s.close()
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

    names = Names({"svc.test": "192.0.2.82"})
    try:
        out, stack = await run_guest(cfg(dns_upstreams=[("127.0.0.1", names.port)], egress_deny=["192.0.2.99"]),
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
