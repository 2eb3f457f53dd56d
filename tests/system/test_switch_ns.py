"""aioslirp.Switch with real kernel guests: two network namespaces, each with a TAP served as a
guest of one switch (its own stack), ping each other, move 10 MB byte-exact (sha256) between
them, both reach a host server through their own stacks, resolve each other's names with dig,
and get distinct SLAAC addresses from the shared prefix; an isolated third guest reaches the
host but no guest.

pytest runs as root in a loopback-only namespace (conftest.py); the guests' namespaces are its
children (``unshare -n``), and each TAP is made here, then moved into its guest's namespace
(the fd keeps working)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import os
import re
import subprocess
import sys
import threading
import time

import pytest

import aioslirp
from aioslirp import NetworkConfig, TapTransport
from aioslirp.transport.tapdev import create_tap

from support.namespaces import start_target_namespace
from support.guests import need_tool

GUESTS = (("alpha", "52:54:00:00:01:0a", "10.0.2.15"), ("beta", "52:54:00:00:01:0b", "10.0.2.16"),
          ("gamma", "52:54:00:00:01:0c", "10.0.2.17"))
SIZE = 10 * 1024 * 1024

pytestmark = pytest.mark.netns


async def sh(pid: int, *argv: str, timeout: float = 60, check: bool = True, stdin=None) -> str:
    """Run ``argv`` in the network namespace of ``pid``; its stdout (text)."""
    proc = await asyncio.create_subprocess_exec("nsenter", "-t", str(pid), "-n", *argv, stdin=stdin,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} in {pid}: rc={proc.returncode}\n{out.decode()}\n{err.decode()}")
    return out.decode()


@contextlib.contextmanager
def kernel_guests(n: int, dad: bool = False):
    """``n`` namespaces, each with a TAP made here and moved in, addressed statically (the address
    its switch lease gives: the kit has no DHCP client), lo up, default route via the gateway.
    ``dad``: IPv6 duplicate address detection on, and stable-privacy SLAAC addresses (RFC 7217),
    as many distributions configure; else DAD off and EUI-64 addresses. Yields ``[(pid, tap fd, ifname)]``."""
    made = []
    try:
        for i in range(n):
            ns = start_target_namespace()
            fd, name = create_tap(f"swg{i}%d", 1500)
            made.append((ns, fd, name))
            _, mac, addr = GUESTS[i]
            pid = str(ns.pid)
            for cmd in (["ip", "link", "set", name, "netns", pid],
                        ["nsenter", "-t", pid, "-n", "ip", "link", "set", "lo", "up"],
                        ["nsenter", "-t", pid, "-n", "ip", "link", "set", name, "address", mac],
                        ["nsenter", "-t", pid, "-n", "sysctl", "-qw", f"net.ipv6.conf.{name}.accept_dad={int(dad)}"],
                        *([["nsenter", "-t", pid, "-n", "sysctl", "-qw",
                            f"net.ipv6.conf.{name}.stable_secret=fd12:3456:789a:{i + 1}::1"],
                           ["nsenter", "-t", pid, "-n", "sysctl", "-qw", f"net.ipv6.conf.{name}.addr_gen_mode=2"]]
                          if dad else []),
                        ["nsenter", "-t", pid, "-n", "ip", "addr", "add", f"{addr}/24", "dev", name],
                        ["nsenter", "-t", pid, "-n", "ip", "link", "set", name, "up"],
                        ["nsenter", "-t", pid, "-n", "ip", "route", "add", "default", "via", "10.0.2.2"]):
                subprocess.run(cmd, check=True, capture_output=True)
        yield [(ns.pid, fd, name) for ns, fd, name in made]
    finally:
        for ns, _fd, _name in made:
            ns.kill()
            ns.wait()


@contextlib.contextmanager
def host_http(body: bytes):
    """An HTTP server on 127.0.0.1 (the host behind the gateway) serving ``body`` at /; yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


RECEIVER = r"""
import hashlib, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9100)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); h = hashlib.sha256(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b: break
    h.update(b); n += len(b)
print(n, h.hexdigest(), flush=True)
"""

SENDER = r"""
import socket, sys
data = open(sys.argv[1], "rb").read()
c = socket.create_connection((sys.argv[2], 9100), timeout=60); c.sendall(data); c.close()
"""


async def test_two_kernel_guests_on_one_switch(tmp_path):
    need_tool("dig", "bind9-dnsutils")
    payload = os.urandom(SIZE)
    blob = tmp_path / "blob"
    blob.write_bytes(payload)
    want = hashlib.sha256(payload).hexdigest()
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], dns_timeout=0.3)
    with kernel_guests(3) as guests, host_http(b"host says hi\n") as http_port:
        async with aioslirp.Switch(cfg) as sw:
            stacks = []
            for (name, mac, addr), (_pid, fd, ifname) in zip(GUESTS, guests):
                s = await sw.add_guest(mac, name=name, address=addr, isolated=name == "gamma",
                                       labels={"role": name})
                stacks.append(s)
            serves = [asyncio.ensure_future(sw.serve(s, TapTransport(fd, ifname=ifname)))
                      for s, (_pid, fd, ifname) in zip(stacks, guests)]
            (pa, _, ia), (pb, _, ib), (pc, _, ic) = guests
            # guest to guest, both ways
            out = await sh(pa, "ping", "-c", "3", "-i", "0.2", "-W", "2", "10.0.2.16")
            assert " 0% packet loss" in out, out
            await sh(pb, "ping", "-c", "2", "-i", "0.2", "-W", "2", "10.0.2.15")
            # 10 MB alpha -> beta, byte-exact
            recv = await asyncio.create_subprocess_exec("nsenter", "-t", str(pb), "-n", sys.executable, "-c",
                                                        RECEIVER, stdout=subprocess.PIPE)
            assert (await asyncio.wait_for(recv.stdout.readline(), 30)).startswith(b"listening")
            t0 = time.monotonic()
            await sh(pa, sys.executable, "-c", SENDER, str(blob), "10.0.2.16", timeout=240)
            line = (await asyncio.wait_for(recv.stdout.readline(), 60)).decode().split()
            secs = time.monotonic() - t0
            await recv.wait()
            assert line == [str(SIZE), want]
            print(f"guest to guest: 10 MB in {secs:.2f} s ({SIZE * 8 / secs / 1e6:.0f} Mbit/s, with the "
                  "sender's interpreter start)")
            # every guest reaches the host through its own stack (gamma too: isolation spares the gateway)
            for pid in (pa, pb, pc):
                out = await sh(pid, "curl", "-s", "--max-time", "20", f"http://10.0.2.2:{http_port}/")
                assert out == "host says hi\n"
            assert [s.counters["flows.tcp.opened"] for s in stacks] == [1, 1, 1]
            # the beta <-> alpha traffic went through no stack: beta's stack saw only its own flow
            assert sw.port_of(stacks[0]).counters["switched"] > SIZE // 1500
            # names, answered by each guest's own stack
            assert (await sh(pa, "dig", "+short", "+time=2", "+tries=1", "@10.0.2.3", "beta.aioslirp.internal")
                    ).split() == ["10.0.2.16"]
            assert (await sh(pb, "dig", "+short", "+time=2", "+tries=1", "@10.0.2.3", "alpha.aioslirp.internal")
                    ).split() == ["10.0.2.15"]
            assert (await sh(pa, "dig", "+short", "+time=2", "+tries=1", "@10.0.2.3", "gamma.aioslirp.internal")
                    ).split() == []  # isolated: not named to the others
            # the isolated guest reaches no guest, and none reaches it
            out = await sh(pc, "ping", "-c", "2", "-i", "0.2", "-W", "1", "10.0.2.15", check=False)
            assert " 100% packet loss" in out, out
            out = await sh(pa, "ping", "-c", "2", "-i", "0.2", "-W", "1", "10.0.2.17", check=False)
            assert " 100% packet loss" in out, out
            # IPv6: distinct SLAAC addresses from the shared prefix (the guests' own MACs), reachable
            addrs = []
            for pid, ifname in ((pa, ia), (pb, ib)):
                for _ in range(50):
                    out = await sh(pid, "ip", "-6", "-o", "addr", "show", "dev", ifname, "scope", "global")
                    found = re.findall(r"inet6 (fd00::[0-9a-f:]+)/64", out)
                    if found:
                        break
                    await asyncio.sleep(0.2)
                addrs.append(found[0])
            assert addrs[0] != addrs[1]
            await sh(pa, "ping", "-6", "-c", "2", "-i", "0.2", "-W", "2", addrs[1])
            stats = sw.stats()
            assert stats["macs"] <= stats["macs_max"]
        # the switch is closed: every serve() returned, the TAP fds are closed
        await asyncio.wait_for(asyncio.gather(*serves), 10)
        for _pid, fd, _ in guests:
            with pytest.raises(OSError):
                os.fstat(fd)


async def test_guests_names_have_aaaa_records_of_their_own_slaac_addresses():
    """Two kernel guests with DAD and stable-privacy addresses (not computable from the MAC): the
    switch learns each one's address from its DAD probe, so 'dig AAAA beta' from alpha answers
    beta's address (and no other), and alpha reaches beta there by ping6."""
    need_tool("dig", "bind9-dnsutils")
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], dns_timeout=0.3)
    with kernel_guests(2, dad=True) as guests:
        async with aioslirp.Switch(cfg) as sw:
            stacks = [await sw.add_guest(mac, name=name, address=addr) for name, mac, addr in GUESTS[:2]]
            serves = [asyncio.ensure_future(sw.serve(s, TapTransport(fd, ifname=ifname)))
                      for s, (_pid, fd, ifname) in zip(stacks, guests)]
            (pa, _, ia), (pb, _, ib) = guests
            addrs = []
            for pid, ifname in ((pa, ia), (pb, ib)):
                for _ in range(100):  # SLAAC, then DAD (about a second)
                    out = await sh(pid, "ip", "-6", "-o", "addr", "show", "dev", ifname, "scope", "global")
                    found = re.findall(r"inet6 (fd00::[0-9a-f:]+)/64", out)
                    if found and "tentative" not in out:
                        break
                    await asyncio.sleep(0.1)
                addrs.append(found[0] if found else None)
            assert None not in addrs and addrs[0] != addrs[1]
            assert "ff:fe" not in addrs[1] and "fffe" not in addrs[1].replace(":", "")  # not EUI-64
            beta = (await sh(pa, "dig", "+short", "+time=2", "+tries=1", "@10.0.2.3", "AAAA",
                             "beta.aioslirp.internal")).split()
            assert beta == [addrs[1]]
            alpha = (await sh(pb, "dig", "+short", "+time=2", "+tries=1", "@fd00::3", "AAAA",
                              "alpha.aioslirp.internal")).split()
            assert alpha == [addrs[0]]
            out = await sh(pa, "ping", "-6", "-c", "2", "-i", "0.2", "-W", "2", beta[0])
            assert " 0% packet loss" in out, out
            assert [str(a) for a in sw.port_of(stacks[1]).ipv6] == [addrs[1]]
        await asyncio.wait_for(asyncio.gather(*serves), 10)
