"""``--dns-record NAME=ADDR`` / ``NetworkConfig(dns_records=...)``: names the virtual DNS answers itself.

Unit tests through :meth:`DnsForwarder.resolve` (no sockets), config and CLI errors, and a real
guest in a namespace: A and AAAA over UDP and TCP to both DNS addresses, never upstream, not
denied under ``--egress-default deny``, and ``host.aioslirp.internal`` reaching the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.config.records import HOST_NAME, parse_dns_record
from aioslirp.errors import ConfigError
from aioslirp.flow.egress import Egress
from aioslirp.services.dns import DnsForwarder
from aioslirp.services.dns_local import LOCAL_TTL

from support.egress_world import Dns


def query(name: str, qtype=dpkt.dns.DNS_A, edns: bool = False) -> bytes:
    q = dpkt.dns.DNS(id=0x1234, rd=1, qd=[dpkt.dns.DNS.Q(name=name, type=qtype, cls=1)])
    if edns:
        q.ar = [dpkt.dns.DNS.RR(name="", type=41, cls=1232, ttl=0, rdata=b"")]
    return bytes(q)


def forwarder(**cfg):
    config = NetworkConfig(dns_upstreams=["127.0.0.1:53"], **cfg).validate()
    asked = []

    class Fake(DnsForwarder):
        __slots__ = ()

        async def _forward(self, q, question, tcp):
            asked.append(q)
            return None

    f = Fake(config)
    return f, config, asked


def test_records_answered_locally_both_types_never_upstream():
    f, config, asked = forwarder(dns_records={"svc.test": ["192.0.2.5", "2001:db8::5"], "v4only.test": "192.0.2.6"})

    async def main():
        return [await f.resolve(query(n, t, edns=e)) for n, t, e in (
            ("SVC.test", dpkt.dns.DNS_A, False), ("svc.test", dpkt.dns.DNS_AAAA, True),
            ("v4only.test", dpkt.dns.DNS_AAAA, False), ("svc.test", dpkt.dns.DNS_MX, False),
            ("svc.test", 255, False), (HOST_NAME, dpkt.dns.DNS_A, False), (HOST_NAME, dpkt.dns.DNS_AAAA, False))]

    a, aaaa, nodata, mx, any_, host4, host6 = (dpkt.dns.DNS(r) for r in asyncio.run(main()))
    assert asked == []
    assert a.id == 0x1234 and a.rcode == 0 and a.aa and a.qr == dpkt.dns.DNS_R
    assert [(rr.type, rr.ip, rr.ttl) for rr in a.an] == [(1, socket.inet_aton("192.0.2.5"), LOCAL_TTL)]
    assert [rr.ip6 for rr in aaaa.an] == [socket.inet_pton(socket.AF_INET6, "2001:db8::5")]
    assert any(rr.type == 41 for rr in aaaa.ar)  # EDNS in, OPT out
    assert nodata.rcode == 0 and nodata.an == [] and mx.an == []
    assert sorted(rr.type for rr in any_.an) == [1, 28]
    assert host4.an[0].ip == socket.inet_aton("10.0.2.2")
    assert host6.an[0].ip6 == socket.inet_pton(socket.AF_INET6, "fd00::2")
    assert f.stats["local"] == 7


def test_records_are_not_denied_and_bind_their_name_under_default_deny():
    counters: dict = {}
    f, config, asked = forwarder(dns_records=[f"{HOST_NAME}=10.0.2.2", "svc.test=192.0.2.5"], egress_default="deny",
                                 egress_deny=["svc.test"], egress_allow=[f"{HOST_NAME}:8080"])
    e = f.policy = Egress(config, counters)

    async def main():
        return await f.resolve(query("svc.test"), now=10.0), await f.resolve(query(HOST_NAME), now=10.0)

    svc, host = (dpkt.dns.DNS(r) for r in asyncio.run(main()))
    assert svc.rcode == 0 and svc.an[0].ip == socket.inet_aton("192.0.2.5")
    assert host.an[0].ip == socket.inet_aton("10.0.2.2") and len(host.an) == 1  # the user's record replaces both
    assert asked == [] and counters.get("egress.dns_blocked", 0) == 0
    # the gateway is bound as the host side sees it (127.0.0.1), so the name rule opens it
    d = e.decide(6, "127.0.0.1", 8080, 11.0)
    assert d.allowed and d.name == HOST_NAME and d.rule == f"{HOST_NAME}:8080"
    assert not e.decide(6, "127.0.0.1", 8081, 11.0).allowed
    assert not e.decide(6, "192.0.2.5", 8080, 11.0).allowed  # a deny rule still decides the flows


def test_no_ipv6_default_host_record_is_ipv4_only():
    c = NetworkConfig(ipv6=False).validate()
    assert [str(a) for a in c.dns_records[HOST_NAME]] == ["10.0.2.2"]


@pytest.mark.parametrize("records, why", [
    ({"x..y": "192.0.2.1"}, "'x..y' is not a DNS name"),
    ({"ok.test": "nope"}, "ok.test: 'nope' is not an IPv4 or IPv6 address"),
    ({"192.0.2.1": "192.0.2.1"}, "is an address, not a DNS name"),
    ({"ok.test": "224.0.0.1"}, "is not a unicast address"),
    ({"ok.test": "0.0.0.0"}, "is not a unicast address"),
    ("a=b", "a dict {name: address} is needed"),
    ({"ok.test": 5}, "5 is not an address or a list of them"),
])
def test_bad_records_one_line_naming_the_field(records, why):
    with pytest.raises(ConfigError) as ei:
        NetworkConfig(dns_records=records).validate()
    text = str(ei.value)
    assert text.startswith("dns_records: ") and why in text and "\n" not in text, text


@pytest.mark.parametrize("arg, why", [
    ("foo", "'foo' is not NAME=ADDR"),
    ("foo=1.2.3", "foo: '1.2.3' is not an IPv4 or IPv6 address"),
    ("=192.0.2.1", "'' is not a DNS name"),
    ("a b=192.0.2.1", "is not a DNS name"),
])
def test_cli_dns_record_errors(arg, why):
    with pytest.raises(ConfigError) as ei:
        parse_dns_record(arg)
    assert str(ei.value).startswith("--dns-record: ") and why in str(ei.value)
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--dns-record", arg, "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == f"aioslirp: error: {ei.value}", p.stderr


# ============================================================================ a real guest

GUEST = r'''
import json, socket, subprocess, sys, time
port = int(sys.argv[1])
out = {}
def run(*argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout
for key, args in {"a": ["svc.test"], "aaaa6": ["@fd00::3", "AAAA", "svc.test"], "a_tcp": ["+tcp", "svc.test"],
                  "aaaa_tcp6": ["@fd00::3", "+tcp", "AAAA", "svc.test"], "host": [HOST], "host6": ["AAAA", HOST],
                  "other": ["other.test"]}.items():
    out[key] = run("dig", "+tries=1", "+time=3", "+short", *args)[1].split()
out["getent"] = run("getent", "ahostsv4", HOST)[0]
p = subprocess.run(["curl", "-s", "--max-time", "10", f"http://{HOST}:{port}/"], capture_output=True, timeout=30)
out["curl"] = [p.returncode, p.stdout.decode(errors="replace")]
print(json.dumps(out))
'''.replace("HOST", repr(HOST_NAME))


@pytest.mark.netns
def test_guest_resolves_records_over_udp_and_tcp_both_families(tmp_path):
    from support.prereqs import have_ipv6_loopback, need
    from support.guests import need_tool

    need(have_ipv6_loopback(), "IPv6 on the test namespace's loopback")
    need_tool("dig", "bind9-dnsutils")
    need_tool("curl", "curl")
    with contextlib.ExitStack() as es:
        up = Dns("127.0.0.1")
        es.callback(up.close)
        web = socket.socket()
        es.callback(web.close)
        web.bind(("127.0.0.1", 0))
        web.listen(4)
        port = web.getsockname()[1]

        def serve():
            with contextlib.suppress(OSError):
                c, _ = web.accept()
                with c:
                    c.recv(4096)
                    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello")

        import threading
        threading.Thread(target=serve, daemon=True).start()
        argv = [sys.executable, "-m", "aioslirp", "run", "--dns", "127.0.0.1:53", "--egress-default", "deny",
                "--deny", "svc.test", "--allow", f"{HOST_NAME}:{port}",
                "--dns-record", "svc.test=192.0.2.5", "--dns-record", "svc.test=2001:db8::5", "--",
                sys.executable, "-c", GUEST, str(port)]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout={p.stdout[-3000:]}\nstderr={p.stderr[-4000:]}"
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["a"] == r["a_tcp"] == ["192.0.2.5"], r
    assert r["aaaa6"] == r["aaaa_tcp6"] == ["2001:db8::5"], r
    assert r["host"] == ["10.0.2.2"] and r["host6"] == ["fd00::2"], r
    assert r["other"] == []  # not local, not allowed: NXDOMAIN
    assert r["getent"] == 0
    assert r["curl"] == [0, "hello"], r["curl"]
    assert not {"svc.test", HOST_NAME} & set(up.asked), up.asked
