"""The audit log and the counters agree (issue 15, "Done when"), with a real guest.

A guest under ``aioslirp run --egress-default deny --allow allowed.test:PORT --audit-log F
--api-socket S`` does allowed and denied TCP, UDP and DNS traffic, waits until no flow is left,
reads ``get_stats`` and exits. Then: deny records by reason == ``egress.denied_*`` counters
(their sum ``drop.egress_denied``), DNS deny records == ``egress.dns_blocked``, flow-end records
by protocol == ``flows.<proto>.closed`` (== opened), and each allowed flow's record carries the
name and the rule that allowed it, and the bytes the local servers saw.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import socket
import subprocess
import sys
import threading

import pytest

from support.egress_world import Dns
from support.guests import need_tool
from support.namespaces import namespace_address
from support.prereqs import have_ipv6_loopback, need

pytestmark = pytest.mark.netns

BODY = hashlib.sha256(b"audit").digest() * 1000  # 32000 bytes


class Servers:
    """TCP (an HTTP/1.0 answer of :data:`BODY`) and UDP echo on ``[::]:PORT`` (both families; the
    same port number), each noting the bytes of every conversation: ``tcp`` ``[(received, sent)]``,
    ``udp`` ``[(peer, n)]``."""

    def __init__(self) -> None:
        self.tcp_sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.tcp_sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.tcp_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp_sock.bind(("::", 0))
        self.tcp_sock.listen(16)
        self.port = self.tcp_sock.getsockname()[1]
        self.udp_sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        self.udp_sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.udp_sock.bind(("::", self.port))
        self.tcp: list = []
        self.udp: list = []
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._echo, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.tcp_sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        got = sent = 0
        buf = b""
        with c:
            try:
                while b"\r\n\r\n" not in buf:
                    d = c.recv(4096)
                    if not d:
                        break
                    buf += d
                got = len(buf)
                reply = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
                c.sendall(reply)
                sent = len(reply)
                c.shutdown(socket.SHUT_WR)
                while True:
                    d = c.recv(4096)
                    if not d:
                        break
                    got += len(d)
            except OSError:
                pass
        self.tcp.append((got, sent))

    def _echo(self) -> None:
        while True:
            try:
                data, peer = self.udp_sock.recvfrom(65535)
                if peer is None:  # shut down
                    return
                self.udp.append((peer, len(data)))
                self.udp_sock.sendto(data, peer)
            except OSError:
                return

    def close(self) -> None:
        for s in (self.tcp_sock, self.udp_sock):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.fixture(scope="module")
def world():
    need(have_ipv6_loopback(), "IPv6 on the test namespace's loopback")
    need_tool("curl", "curl")
    need_tool("dig", "bind9-dnsutils")
    with contextlib.ExitStack() as es:
        for a in ("192.0.2.10", "192.0.2.20", "192.0.2.30", "2001:db8::10"):
            es.enter_context(namespace_address(a))
        up = Dns("127.0.0.1")
        es.callback(up.close)
        srv = Servers()
        es.callback(srv.close)
        yield {"up": up, "srv": srv}


GUEST = r'''
import json, socket, subprocess, sys, time
a = json.loads(sys.argv[1])
port, api_path = a["port"], a["api"]
out = {}

def run(*argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return p.returncode

def api(execute, **arguments):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(api_path)
    s.sendall(json.dumps({"execute": execute, "arguments": arguments}).encode())
    s.shutdown(socket.SHUT_WR)
    buf = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        buf += d
    s.close()
    return json.loads(buf)

def connect(family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(addr)
        return "ok"
    except OSError as exc:
        return exc.errno
    finally:
        s.close()

def udp(family, addr, payload):
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.settimeout(2)
    try:
        s.sendto(payload, addr)
        return len(s.recv(65535))
    except OSError as exc:
        return str(exc)
    finally:
        s.close()

out["curl4"] = run("curl", "-s", "-o", "/dev/null", "--max-time", "10", "-4", f"http://allowed.test:{port}/")
out["curl6"] = run("curl", "-s", "-o", "/dev/null", "--max-time", "10", "-6", f"http://allowed.test:{port}/")
a4 = socket.getaddrinfo("allowed.test", port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
a6 = socket.getaddrinfo("allowed.test", port, socket.AF_INET6, socket.SOCK_DGRAM)[0][4]
# an open flow shows its name and rule in list_flows
held = socket.create_connection(a4[:2], timeout=5)
out["listed"] = [f for f in api("list_flows")["return"]["flows"] if f.get("name")]
held.sendall(b"GET / HTTP/1.0\r\n\r\n")
while held.recv(65536):
    pass
held.close()
out["udp4"] = udp(socket.AF_INET, a4, b"x" * 1000)
out["udp6"] = udp(socket.AF_INET6, a6, b"y" * 700)
# denied: the allowed name's address on another port (default), a deny rule's address, a literal
out["tcp_other_port"] = connect(socket.AF_INET, ("192.0.2.10", port + 1))
out["tcp_denied_rule"] = connect(socket.AF_INET, ("192.0.2.20", port))
out["tcp_literal6"] = connect(socket.AF_INET6, ("2001:db8::99", port))
out["udp_other_port"] = udp(socket.AF_INET, ("192.0.2.10", port + 1), b"z")
out["udp_literal"] = udp(socket.AF_INET, ("192.0.2.30", port), b"z")
out["dig_denied"] = run("dig", "+tries=1", "+time=3", "denied.test")
out["dig_other"] = run("dig", "+tries=1", "+time=3", "+tcp", "other.test")
out["dig_other_resolver"] = run("dig", "@192.0.2.30", "+tries=1", "+time=2", "allowed.test")
deadline = time.monotonic() + 20
while True:
    st = api("get_stats")["return"]
    if not any(st["flows"].get(p) for p in st["flows"]) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
out["stats"] = st
print(json.dumps(out))
'''


def test_audit_records_agree_with_counters_and_servers(world, tmp_path):
    srv = world["srv"]
    port = srv.port
    log, api = tmp_path / "audit.jsonl", str(tmp_path / "api.sock")
    argv = [sys.executable, "-m", "aioslirp", "run", "--dns", "127.0.0.1:53", "--egress-default", "deny",
            "--allow", f"allowed.test:{port}", "--deny", "192.0.2.20", "--deny", "denied.test",
            # the names resolve to documentation addresses, which an upstream answer binds only under
            # a covering CIDR allow rule (docs/security.md); these open only port 9/udp, unused here
            "--allow", "192.0.2.0/24:9/udp", "--allow", "[2001:db8::/32]:9/udp",
            "--limit", "udp_idle_timeout=1", "--audit-log", str(log), "--api-socket", api, "--",
            sys.executable, "-c", GUEST, json.dumps({"port": port, "api": api})]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout={p.stdout[-3000:]}\nstderr={p.stderr[-4000:]}"
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["curl4"] == 0 and r["curl6"] == 0
    assert r["udp4"] == 1000 and r["udp6"] == 700, r
    assert all(r[k] != "ok" for k in ("tcp_other_port", "tcp_denied_rule", "tcp_literal6")), r
    st = r["stats"]
    assert not any(st["flows"].get(k) for k in st["flows"]), st["flows"]
    c = st["counters"]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    by_event = collections.defaultdict(list)
    for rec in recs:
        by_event[rec["event"]].append(rec)

    # denials: one record per denial, by reason, and the total
    denies = by_event["deny"]
    reasons = collections.Counter(rec["reason"] for rec in denies)
    assert reasons == {k: c.get("egress.denied_" + k, 0) for k in ("rule", "default", "hook")
                       if c.get("egress.denied_" + k, 0)}, (reasons, c)
    assert len(denies) == c["drop.egress_denied"] >= 6
    assert all(rec["verdict"] == "deny" and rec["rule"] for rec in denies)
    assert reasons["rule"] >= 1 and reasons["default"] >= 5
    assert any(rec["dst"] == "192.0.2.20" and rec["rule"] == "192.0.2.20/32" for rec in denies), denies
    assert any(rec["dst"] == "192.0.2.30" and rec["port"] == 53 for rec in denies), denies  # another resolver
    # DNS decisions: a deny record per blocked query
    dns_denied = [rec for rec in by_event["dns"] if rec["verdict"] == "deny"]
    assert len(dns_denied) == c["egress.dns_blocked"] >= 2
    assert {rec["name"] for rec in dns_denied} >= {"denied.test", "other.test"}
    assert {rec["rule"] for rec in dns_denied if rec["name"] == "denied.test"} == {"denied.test"}
    # flow ends: one record per flow closed, by protocol
    flows = by_event["flow"]
    per_proto = collections.Counter(rec["proto"] for rec in flows)
    for proto in ("tcp", "udp", "icmp"):
        assert per_proto.get(proto, 0) == c.get(f"flows.{proto}.closed", 0) == c.get(f"flows.{proto}.opened", 0), \
            (proto, per_proto, c)
    # allowed flows carry the name and the rule; bytes are the servers'
    rule = f"allowed.test:{port}"
    named = [rec for rec in flows if rec["name"] == "allowed.test"]
    tcp = sorted((rec["bytes_up"], rec["bytes_down"]) for rec in named if rec["proto"] == "tcp")
    assert tcp == sorted(srv.tcp) and len(tcp) == 3, (tcp, srv.tcp)
    listed = r["listed"]
    open_ = [f for f in listed if f["state"] == "ESTABLISHED"]  # (curl's flows linger in TIME-WAIT)
    assert [(f["proto"], f["remote_addr"], f["remote_port"], f["name"], f["rule"]) for f in open_] == [
        ("tcp", "192.0.2.10", port, "allowed.test", rule)], listed
    assert all(f["name"] == "allowed.test" and f["rule"] == rule for f in listed)
    assert {rec["dst"] for rec in named if rec["proto"] == "tcp"} == {"192.0.2.10", "2001:db8::10"}
    udp = sorted((rec["bytes_up"], rec["bytes_down"]) for rec in named if rec["proto"] == "udp")
    assert udp == [(700, 700), (1000, 1000)], udp
    assert sorted(n for _peer, n in srv.udp) == [700, 1000]
    assert all(rec["rule"] == rule and rec["verdict"] == "allow" for rec in named)
    # the flows no name decided: the DNS service over TCP (dig +tcp), no rule
    assert all(rec["rule"] is None for rec in flows if rec["name"] is None), flows
