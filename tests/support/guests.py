"""Helpers for the end-to-end tests: `aioslirp run` around a real guest process, and one small
description per address family (the guest's view: addresses as text, tool flags).

pytest runs in a loopback-only namespace (conftest.py): host servers listen on 127.0.0.1 or
``::1``, and the documentation addresses put on ``lo`` are the only other destinations.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import dpkt
import pytest

GUEST_PY = sys.executable


def run_guest(servers, script: str, *opts: str, timeout: float = 120, cmd: list | None = None):
    """Run ``script`` (python) — or ``cmd`` — inside `aioslirp run`; returns CompletedProcess.

    ``servers["dns"]`` is the DNS upstream (``.port`` on 127.0.0.1); ``opts`` go to `aioslirp run`.
    """
    argv = [sys.executable, "-m", "aioslirp", "run", "--dns", f"127.0.0.1:{servers['dns'].port}", *opts, "--"]
    argv += cmd if cmd is not None else [GUEST_PY, "-c", textwrap.dedent(script)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def guest_json(servers, script: str, *opts: str, timeout: float = 120) -> dict:
    """Run ``script`` as :func:`run_guest` does; it must exit 0 and print one JSON line last."""
    p = run_guest(servers, script, *opts, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout={p.stdout}\nstderr={p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def need_tool(tool: str, package: str) -> None:
    """Fail (not skip) when a guest tool is missing."""
    if not shutil.which(tool):
        pytest.fail(f"{tool} is required (apt-get install {package}; bash .ci/prereqs installs every tool the suite drives)")


#: Guest-side snippet: ``link_mtu(sock)``, the MTU of tap0 (SIOCGIFMTU; /sys is the host's here).
LINK_MTU = """
import fcntl, struct
def link_mtu(sock):
    return struct.unpack_from("16si", fcntl.ioctl(sock.fileno(), 0x8921, struct.pack("16si", b"tap0", 0)))[1]
"""


def handshake_mss(pcap: Path, port: int) -> tuple[int | None, int | None]:
    """MSS options (RFC 9293 section 3.7.1) in a ``--pcap`` capture: ``(guest's SYN to port,
    our SYN-ACK from port)``, ``None`` for a missing one (the first handshake on ``port``)."""
    syn = synack = None
    with open(pcap, "rb") as f:
        for _ts, buf in dpkt.pcap.Reader(f):
            ip = dpkt.ethernet.Ethernet(buf).data
            tcp = getattr(ip, "data", None)
            if not isinstance(tcp, dpkt.tcp.TCP) or not tcp.flags & dpkt.tcp.TH_SYN:
                continue
            mss = next((struct.unpack("!H", v)[0] for o, v in dpkt.tcp.parse_opts(tcp.opts) if o == dpkt.tcp.TCP_OPT_MSS), None)
            if tcp.dport == port and not tcp.flags & dpkt.tcp.TH_ACK and syn is None:
                syn = mss
            elif tcp.sport == port and tcp.flags & dpkt.tcp.TH_ACK and synack is None:
                synack = mss
    return syn, synack


class GuestFamily(NamedTuple):
    """One address family as the guest sees it on the default network."""

    name: str            # "ipv4" / "ipv6": test ids, property names
    version: int         # 4 / 6: `ping -4`, `ip -4`, `dig -4`
    af: str              # the guest script's socket family: "AF_INET" / "AF_INET6"
    loopback: str        # where host servers listen
    gw: str              # the gateway: host loopback behind it
    dns: str             # the stack's DNS address
    url_host: str        # the gateway in a URL
    remote: str          # a non-gateway address, put on lo by a fixture
    remote_len: int      # its prefix length on lo
    unroutable: str      # no route to it in pytest's namespace
    mss_overhead: int    # IP + TCP header bytes: MSS <= MTU - this
    admin_errno: str     # what a connected UDP socket gets from "administratively prohibited"
    cidr_flag: str       # `aioslirp run` option choosing the network
    custom_net: str      # a network for that option (gateway ::2 / .2, DNS ::3 / .3)
    dns_qtype: str       # the family's address record
    bulk_mb: int         # size of the bulk transfer each way

    @property
    def flag(self) -> str:
        return f"-{self.version}"


IPV4 = GuestFamily("ipv4", 4, "AF_INET", "127.0.0.1", "10.0.2.2", "10.0.2.3", "10.0.2.2", "192.0.2.55", 32,
                   "192.0.2.1", 40, "EHOSTUNREACH", "--cidr", "10.9.8.0/24", "A", 50)
IPV6 = GuestFamily("ipv6", 6, "AF_INET6", "::1", "fd00::2", "fd00::3", "[fd00::2]", "2001:db8::55", 128,
                   "2001:db8:1::1", 60, "EACCES", "--cidr6", "fd42:1:2:3::/64", "AAAA", 20)
GUEST_FAMILIES = {f.name: f for f in (IPV4, IPV6)}


#: A guest program for the rate-cap tests (``.format(port=, n=, mode="down"|"up")``): one connection to
#: the host DataServer at 10.0.2.2:port moving ``n`` bytes, and a JSON line with the bytes, their
#: SHA-256 and the seconds from connect to the end (the guest's own count).
PACED_GUEST = """
import hashlib, json, socket, time
port, n, mode = {port}, {n}, {mode!r}
s = socket.create_connection(("10.0.2.2", port))
t0 = time.monotonic()
if mode == "down":
    s.sendall(b"DOWN %d 7\\n" % n)
    h, got = hashlib.sha256(), 0
    while True:
        b = s.recv(1 << 16)
        if not b:
            break
        h.update(b); got += len(b)
    out = {{"bytes": got, "sha": h.hexdigest()}}
else:
    body = bytes(range(256)) * (n // 256)
    s.sendall(b"UP\\n" + body)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while not reply.endswith(b"\\n"):
        reply += s.recv(100)
    got, sha = reply.split()
    out = {{"bytes": int(got), "sha": sha.decode(), "sent_sha": hashlib.sha256(body).hexdigest()}}
out["seconds"] = time.monotonic() - t0
print(json.dumps(out))
"""
