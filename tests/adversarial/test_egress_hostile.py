"""Hostile input to the egress policy through the real DNS path (issue 15): a DNS answer with
thousands of addresses and a guest resolving many names leave bounded name bindings, counted;
malformed rules are one-line errors naming the field. The upstream is a real UDP server on
127.0.0.1 (the DnsForwarder's own sockets), nothing leaves the machine."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.errors import ConfigError
from aioslirp.flow.egress import Egress
from aioslirp.services.dns import DnsForwarder

from support.frames import dns_query
from support.servers import NameServer


def answers(name: str) -> list[bytes]:
    """``big.test`` -> 3000 A records (10.x.y.1), any other name ``nI.many.test`` -> 198.18.(I>>8).(I&255)."""
    if name == "big.test":
        return [bytes([10, i >> 8, i & 255, 1]) for i in range(3000)]
    i = int(name.split(".")[0][1:])
    return [bytes([198, 18, i >> 8, i & 255])]


@pytest.fixture
def upstream():
    u = NameServer(answers, ttl=300)
    yield u
    u.close()


def _forwarder(upstream, **cfg):
    config = NetworkConfig(dns_upstreams=[f"127.0.0.1:{upstream.port}"], **cfg).validate()
    counters: dict = {}
    f = DnsForwarder(config)
    f.policy = e = Egress(config, counters)
    return f, e, counters


def test_answer_with_thousands_of_addresses_binds_a_bounded_number(upstream):
    # 10.0.0.0/8:9/udp covers the answer's private addresses: an upstream answer may bind them (docs/security.md)
    f, e, counters = _forwarder(upstream, egress_allow=["big.test:443", "10.0.0.0/8:9/udp"], egress_default="deny",
                                max_dns_bindings_per_answer=64)

    async def main():
        try:
            return await f.resolve(dns_query("big.test", 7), tcp=True, now=0.0)
        finally:
            await f.close()

    reply = dpkt.dns.DNS(asyncio.run(main()))
    assert len(reply.an) == 3000  # the guest gets the answer as is
    assert len(e.bindings) == 64 and counters["egress.dns_bindings_capped"] == 1
    assert e.decide(6, "10.0.0.1", 443, 1.0).name == "big.test"  # the first ones are bound
    assert not e.decide(6, "10.11.183.1", 443, 1.0).allowed  # the 3000th is not


def test_guest_resolving_many_names_keeps_a_bounded_table(upstream):
    # 198.18.0.0/15:9/udp covers the answers' benchmarking addresses: they may bind (docs/security.md)
    f, e, counters = _forwarder(upstream, egress_allow=["*.many.test:443", "198.18.0.0/15:9/udp"],
                                egress_default="deny",
                                max_dns_bindings=100)

    async def main():
        try:
            for i in range(500):
                r = dpkt.dns.DNS(await f.resolve(dns_query(f"n{i}.many.test", 7), now=float(i)))
                assert r.rcode == 0 and len(r.an) == 1
        finally:
            await f.close()

    asyncio.run(main())
    assert len(e.bindings) == 100 and counters["egress.dns_bindings_evicted"] == 400
    assert e.decide(6, "198.18.1.243", 443, 500.0).name == "n499.many.test"  # the newest stay
    assert not e.decide(6, "198.18.0.0", 443, 500.0).allowed  # the oldest went


@pytest.mark.parametrize("option, value, field, why", [
    ("--allow", "pypi.org:0", "--allow", "pypi.org:0"),
    ("--allow", "pypi.org:443/sctp", "--allow", "sctp"),
    ("--deny", "*.", "--deny", "'*.'"),
    ("--deny", "10.0.0.0/33", "--deny", "10.0.0.0/33"),
    ("--allow", "[fd00::/8:53/udp", "--allow", "fd00::/8"),
    ("--dns-record", "a.test=10.0.0.256", "--dns-record", "a.test: '10.0.0.256' is not an IPv4 or IPv6 address"),
    ("--dns-record", "*.test=10.0.0.1", "--dns-record", "'*.test' is not a DNS name"),
])
def test_malformed_values_one_line_naming_the_option(option, value, field, why):
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", option, value, "--", "true"],
                       capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"aioslirp: error: {field}: ") and why in lines[0], lines[0]


def test_malformed_rules_from_python_name_the_field():
    for field in ("egress_allow", "egress_deny"):
        with pytest.raises(ConfigError) as ei:
            NetworkConfig(**{field: ["pypi.org:99999"]}).validate()
        assert str(ei.value).startswith(f"{field}: ") and "\n" not in str(ei.value)
