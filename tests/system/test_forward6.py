"""Port forwards to the guest's IPv6 address (issue 15 item 9): ``-p`` with a bracketed guest
address and ``add_hostfwd`` with an IPv6 ``guest_addr``, to a real guest whose servers listen on
IPv6 only (``IPV6_V6ONLY``), so nothing reaches them over IPv4. Parsing and refusals too.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.config.forward import PortForward, parse_publish
from aioslirp.errors import ConfigError

GUEST6 = "fd00::100"

GUEST = r'''
import socket, subprocess, sys, threading
subprocess.run(["ip", "-6", "addr", "add", "fd00::100/64", "dev", "tap0", "nodad"], check=True)
tcp = socket.socket(socket.AF_INET6)
tcp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("::", 8080))
tcp.listen(16)
udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
udp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
udp.bind(("::", 8081))

def serve(c, peer):
    with c:
        data = b""
        while not data.endswith(b"\n"):
            d = c.recv(65536)
            if not d:
                break
            data += d
        c.sendall(("%s %s " % (peer[0], c.getsockname()[0])).encode() + data)

def tcp_loop():
    while True:
        c, peer = tcp.accept()
        threading.Thread(target=serve, args=(c, peer), daemon=True).start()

def udp_loop():
    while True:
        data, peer = udp.recvfrom(65535)
        udp.sendto(peer[0].encode() + b" " + data, peer)

threading.Thread(target=tcp_loop, daemon=True).start()
threading.Thread(target=udp_loop, daemon=True).start()
print("READY", flush=True)
sys.stdin.read()
'''


def _free(family=socket.AF_INET, kind=socket.SOCK_STREAM, host="127.0.0.1") -> int:
    with socket.socket(family, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _api(path: str, execute: str, **arguments) -> dict:
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(10)
        c.connect(path)
        c.sendall(json.dumps({"execute": execute, "arguments": arguments}).encode())
        c.shutdown(socket.SHUT_WR)
        buf = b""
        while True:
            d = c.recv(65536)
            if not d:
                break
            buf += d
    return json.loads(buf)


def _tcp(host: str, port: int, payload: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(payload)
        buf = b""
        while True:
            d = s.recv(65536)
            if not d:
                return buf
            buf += d


def test_parse_publish_guest_addresses():
    assert parse_publish("[::1]:8080:[fd00::100]:80") == PortForward("tcp", "::1", 8080, "fd00::100", 80)
    assert parse_publish("8080:[FD00::100]:80/udp") == PortForward("udp", "127.0.0.1", 8080, "fd00::100", 80)
    assert parse_publish("0.0.0.0:8080:10.0.2.100:80") == PortForward("tcp", "0.0.0.0", 8080, "10.0.2.100", 80)
    assert parse_publish("8080:10.0.2.100:80").guest_addr == "10.0.2.100"
    assert parse_publish("[::1]:8080:[fd00::100]:80").spec() == "[::1]:8080:[fd00::100]:80/tcp"
    for bad, why in (("8080:fd00::100:80", "expected"), ("[::1]:8080:fd00::1:80", "expected"),
                     ("1:[nope]:2", "'nope' is not an IP address (guest)"),
                     ("[::1]:[80]:80", "'80' is not an IP address (guest)"), ("[::1]:80:[81]", "not bracketed"),
                     ("[::1:8080:80", "unterminated"), ("::1:8080:80", "expected")):
        with pytest.raises(ConfigError) as ei:
            parse_publish(bad)
        assert ei.value.field == "--publish" and why in str(ei.value) and "\n" not in str(ei.value), (bad, ei.value)


async def test_ipv6_guest_addr_checked():
    async with Stack(NetworkConfig()) as st:
        for addr, why in (("fd00::2", "is not a guest address"), ("fd01::5", "is not a guest address"),
                          ("fd00::", "is not a guest address"), ("nope", "is not an IPv4 or IPv6 address")):
            with pytest.raises(ConfigError) as ei:
                await st.add_forward(PortForward("tcp", "127.0.0.1", 0, addr, 80))
            assert ei.value.field == "guest_addr" and why in str(ei.value)
        f = await st.add_forward(PortForward("tcp", "127.0.0.1", 0, "[fd00::100]", 80))
        assert f.guest_addr == "fd00::100"
    async with Stack(NetworkConfig(ipv6=False)) as st:
        with pytest.raises(ConfigError) as ei:
            await st.add_forward(PortForward("tcp", "127.0.0.1", 0, "fd00::100", 80))
        assert "does not serve IPv6" in str(ei.value)


@pytest.mark.netns
def test_forwards_to_the_guest_ipv6_address(tmp_path):
    from support.prereqs import have_ipv6_loopback, need
    from support.guests import need_tool

    need_tool("ip", "iproute2")
    tcp4, udp4 = _free(), _free(kind=socket.SOCK_DGRAM)
    v6 = have_ipv6_loopback()
    tcp6 = _free(socket.AF_INET6, host="::1") if v6 else None
    api_path = str(tmp_path / "api.sock")
    opts = ["-p", f"127.0.0.1:{tcp4}:[{GUEST6}]:8080", "-p", f"{udp4}:[{GUEST6}]:8081/udp", "--api-socket", api_path]
    if v6:
        opts += ["-p", f"[::1]:{tcp6}:[{GUEST6}]:8080"]
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "run", *opts, "--", sys.executable, "-c", GUEST],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else b""
        assert line.strip() == b"READY", (line, proc.stderr.read1(4000) if proc.poll() is not None else b"")
        # -p 127.0.0.1:P:[fd00::100]:8080: the guest sees the IPv6 gateway, on its IPv6 address
        body = os.urandom(100_000).hex().encode() + b"\n"
        assert _tcp("127.0.0.1", tcp4, body) == f"fd00::2 {GUEST6} ".encode() + body
        if v6:
            assert _tcp("::1", tcp6, b"six\n") == f"fd00::2 {GUEST6} six\n".encode()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.settimeout(5)
            u.connect(("127.0.0.1", udp4))
            u.send(b"dgram")
            assert u.recv(100) == b"fd00::2 dgram"
        # over the API socket: add, list, use, remove
        hp = _free()
        r = _api(api_path, "add_hostfwd", proto="tcp", host_addr="127.0.0.1", host_port=hp,
                 guest_addr=GUEST6, guest_port=8080)
        fid = r["return"]["id"]
        entries = _api(api_path, "list_hostfwd")["return"]["entries"]
        assert {"id": fid, "proto": "tcp", "host_addr": "127.0.0.1", "host_port": hp, "guest_addr": GUEST6,
                "guest_port": 8080} in entries
        assert _tcp("127.0.0.1", hp, b"api\n") == f"fd00::2 {GUEST6} api\n".encode()
        flows = _api(api_path, "list_flows")["return"]["flows"]
        assert all(f["guest_addr"] in (GUEST6, "10.0.2.100") for f in flows)
        bad = _api(api_path, "add_hostfwd", proto="tcp", host_addr="127.0.0.1", host_port=_free(),
                   guest_addr="fd00::2", guest_port=80)
        assert "bad arguments.guest_addr" in bad["error"]["desc"], bad
        assert _api(api_path, "remove_hostfwd", id=fid) == {"return": {}}
        with pytest.raises(OSError):
            _tcp("127.0.0.1", hp, b"gone\n")
        # IPv4 to the guest's port 8080 finds nothing: the servers are IPv6-only
        r4 = _api(api_path, "add_hostfwd", proto="tcp", host_addr="127.0.0.1", host_port=_free(),
                  guest_addr="", guest_port=8080)
        assert "id" in r4["return"]
        need(v6, "no IPv6 loopback in this namespace: the [::1] host side is not checked")
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0
        proc.stdout.close()
        proc.stderr.close()
