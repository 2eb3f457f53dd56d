"""Egress rules by name, sans I/O: parsing, matching, the most-specific order, DNS name bindings
(fake clock), blocked DNS answers (RFC 8914), the Python hook and run-time rule changes.

End to end with real guests: tests/system/test_egress_ns.py.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.config.policy import EgressPolicy, parse_rule, parse_rules
from aioslirp.errors import ConfigError
from aioslirp.flow.egress import Decision, Egress, NameBindings
from aioslirp.flow.guard import DENIED, HELD, Guard
from aioslirp.services.dns import DnsForwarder, _question, read_name
from aioslirp.services.dns_policy import EDE_BLOCKED, EDE_PROHIBITED, answer_addresses, blocked_response, has_edns

TCP, UDP, ICMP = 6, 17, 1


def egress(**cfg) -> Egress:
    return Egress(NetworkConfig(**cfg).validate(), {})


# ============================================================================ parsing


@pytest.mark.parametrize(("text", "canonical"), [
    ("pypi.org", "pypi.org"),
    ("PyPI.org.", "pypi.org"),
    ("pypi.org:443", "pypi.org:443"),
    ("*.githubusercontent.com", "*.githubusercontent.com"),
    ("*.example.org:80-81/tcp", "*.example.org:80-81/tcp"),
    ("10.0.0.0/8:8000-8999/tcp", "10.0.0.0/8:8000-8999/tcp"),
    ("[fd00::/8]:53/udp", "[fd00::/8]:53/udp"),
    ("[2001:db8::1]/udp", "[2001:db8::1/128]/udp"),
    ("192.0.2.7", "192.0.2.7/32"),
    ("10.1.2.3/16", "10.1.0.0/16"),
    ("2001:0db8::/32", "2001:db8::/32"),
    ("x.org:53/UDP", "x.org:53/udp"),
])
def test_rule_canonical_text(text, canonical):
    assert parse_rule(text, "egress_allow").text == canonical
    assert parse_rules([text], "f") == [canonical]


@pytest.mark.parametrize(("text", "why"), [
    ("bogus", "expected a CIDR network"),
    ("pypi.org:0", "port 0 is out of range 1-65535"),
    ("pypi.org:99999", "port 99999 is out of range"),
    ("pypi.org:9-1", "is empty"),
    ("pypi.org:x", "are not PORT or LOW-HIGH"),
    ("pypi.org:", "expected ports after ':'"),
    ("pypi.org/icmp", "protocol 'icmp' is not tcp or udp"),
    ("evil*.org", "a wildcard is '*.' in front of a name only"),
    ("*.*.org", "a wildcard is '*.'"),
    ("a..b", "is not a domain name"),
    ("-x.org/tcp/udp", "is not a CIDR network"),
    ("10.0.0.0/99", "is not a CIDR network"),
    ("1.2.3.999", "is not an IP address"),
    ("[fd00::/8:53", "unterminated '['"),
    ("[fd00::/8]53", "expected ':PORTS' after ']'"),
    ("a" * 64 + ".org", "is not a domain name"),
    ("x.123", "is not a domain name"),
])
def test_malformed_rule_names_field_and_rule_in_one_line(text, why):
    with pytest.raises(ConfigError) as err:
        NetworkConfig(egress_deny=["pypi.org", text]).validate()
    msg = str(err.value)
    assert msg.startswith(f"egress_deny: {text!r}: "), msg
    assert why in msg and "\n" not in msg
    assert err.value.field == "egress_deny"


def test_config_fields_validated():
    c = NetworkConfig(egress_default="DENY", policy_timeout_verdict="Allow").validate()
    assert (c.egress_default, c.policy_timeout_verdict) == ("deny", "allow")
    for kw, field in (({"egress_default": "maybe"}, "egress_default"),
                      ({"dns_binding_ttl_min": -1}, "dns_binding_ttl_min"),
                      ({"dns_binding_ttl_min": 10, "dns_binding_ttl_max": 5}, "dns_binding_ttl_min"),
                      ({"max_dns_bindings": 0}, "max_dns_bindings"), ({"policy": 3}, "policy")):
        with pytest.raises(ConfigError) as err:
            NetworkConfig(**kw).validate()
        assert err.value.field == field


# ============================================================================ matching and order


def test_name_match_is_case_insensitive_and_on_label_boundaries():
    p = EgressPolicy(allow=["pypi.org", "*.x.org"], defaults=())
    assert p.match_name("PyPI.Org.").text == "pypi.org"
    assert p.match_name("evilpypi.org") is None
    assert p.match_name("pypi.org.evil") is None
    assert p.match_name("files.pypi.org") is None  # an exact name is not a wildcard
    assert p.match_name("a.x.org").text == "*.x.org"
    assert p.match_name("a.b.c.x.org").text == "*.x.org"  # one or more labels
    assert p.match_name("x.org") is None  # the wildcard never matches its suffix
    assert p.match_name("ax.org") is None


def test_ports_and_protocols():
    p = EgressPolicy(allow=["pypi.org:443", "dns.test:53/udp", "r.test:8000-8999/tcp"], defaults=())
    assert p.match_name("pypi.org", 443, TCP) and p.match_name("pypi.org", 443, UDP)
    assert p.match_name("pypi.org", 80, TCP) is None
    assert p.match_name("pypi.org", 0, ICMP) is None  # echo flows have no port
    assert p.match_name("dns.test", 53, UDP) and p.match_name("dns.test", 53, TCP) is None
    assert p.match_name("r.test", 8000, TCP) and p.match_name("r.test", 8999, TCP)
    assert p.match_name("r.test", 7999, TCP) is None and p.match_name("r.test", 9000, TCP) is None
    c = EgressPolicy(deny=["10.0.0.0/8:8000-8999/tcp", "[fd00::/8]:53/udp"], defaults=())
    assert c.match_addr("10.1.1.1", 8080, TCP).text == "10.0.0.0/8:8000-8999/tcp"
    assert c.match_addr("10.1.1.1", 8080, UDP) is None
    assert c.match_addr("fd00::9", 53, UDP).text == "[fd00::/8]:53/udp"
    assert c.match_addr("fd00::9", 53, TCP) is None


def test_most_specific_rule_wins():
    e = egress(egress_allow=["*.example.org", "10.0.0.0/8", "10.0.0.0/8:443", "ok.bad.example.org"],
               egress_deny=["bad.example.org", "*.bad.example.org", "10.0.0.0/8:443/tcp", "10.9.0.0/16"],
               egress_default="deny")
    rules = e.rules
    # exact name > wildcard (longer suffix first) > CIDR (longer prefix first)
    assert rules.match_name("ok.bad.example.org").text == "ok.bad.example.org"
    assert rules.match_name("x.bad.example.org").text == "*.bad.example.org"
    assert rules.match_name("bad.example.org").text == "bad.example.org"
    assert rules.match_name("y.example.org").text == "*.example.org"
    # ports beat no ports, a protocol beats none, a longer prefix beats ports
    assert rules.match_addr("10.1.1.1", 80, TCP).text == "10.0.0.0/8"
    assert rules.match_addr("10.1.1.1", 443, UDP).text == "10.0.0.0/8:443"
    assert rules.match_addr("10.1.1.1", 443, TCP).text == "10.0.0.0/8:443/tcp"
    assert rules.match_addr("10.9.1.1", 443, UDP).text == "10.9.0.0/16"
    # a name rule beats a CIDR rule for an address bound to the name
    e.bind_answer("y.example.org", [("10.9.1.1", 60)], 0.0)
    d = e.decide(TCP, "10.9.1.1", 80, 1.0)
    assert (d.allowed, d.rule, d.name) == (True, "*.example.org", "y.example.org")
    # same target both ways: deny
    assert EgressPolicy(allow=["a.org:1"], deny=["a.org:1"]).match_name("a.org", 1, TCP).allow is False


def test_name_rules_never_open_the_builtin_metadata_denies():
    e = egress(egress_allow=["meta.test"], egress_default="deny")
    e.bind_answer("meta.test", [("169.254.169.254", 60)], 0.0)
    d = e.decide(TCP, "169.254.169.254", 80, 1.0)
    assert (d.allowed, d.rule) == (False, "169.254.0.0/16 (default)")
    e2 = egress(egress_allow=["169.254.169.254/32:80"])
    assert e2.decide(TCP, "169.254.169.254", 80, 0.0).allowed
    assert not e2.decide(TCP, "169.254.169.254", 81, 0.0).allowed


def test_default_deny_and_other_resolvers():
    e = egress(egress_allow=["allowed.test:8080", "web.test", "192.0.2.53/32:53"], egress_default="deny")
    e.bind_answer("allowed.test", [("198.51.100.1", 60)], 0.0)
    e.bind_answer("web.test", [("198.51.100.2", 60)], 0.0)
    d = e.decide(TCP, "198.51.100.1", 8080, 1.0)
    assert (d.allowed, d.rule, d.name, d.reason) == (True, "allowed.test:8080", "allowed.test", "rule")
    d = e.decide(TCP, "198.51.100.1", 8081, 1.0)
    assert (d.allowed, d.rule, d.reason) == (False, "egress-default deny", "default")
    assert not e.decide(TCP, "203.0.113.1", 80, 1.0).allowed  # a literal address no name resolved to
    assert e.decide(TCP, "198.51.100.2", 443, 1.0).allowed
    # DNS to another resolver: a rule without ports does not open it, a rule naming the port does
    assert not e.decide(UDP, "198.51.100.2", 53, 1.0).allowed
    assert not e.decide(TCP, "198.51.100.2", 853, 1.0).allowed
    assert e.decide(UDP, "192.0.2.53", 53, 1.0).allowed
    # default allow: everything no rule denies
    assert egress().decide(UDP, "198.51.100.2", 53, 1.0).allowed


def test_dns_verdicts():
    e = egress(egress_allow=["allowed.test:8080", "*.ok.test"], egress_deny=["denied.test", "x.ok.test:22"],
               egress_default="deny")
    assert e.dns_verdict("allowed.test") == (0, "allowed.test:8080")
    assert e.dns_verdict("denied.test") == (EDE_BLOCKED, "denied.test")
    assert e.dns_verdict("other.test") == (EDE_PROHIBITED, "egress-default deny")
    assert e.dns_verdict("evilallowed.test") == (EDE_PROHIBITED, "egress-default deny")
    assert e.dns_verdict("x.ok.test") == (0, "*.ok.test")  # a deny with ports decides flows, not the name
    assert e.dns_verdict("ok.test")[0] == EDE_PROHIBITED
    a = egress(egress_deny=["denied.test"])
    assert a.dns_verdict("denied.test") == (EDE_BLOCKED, "denied.test")
    assert a.dns_verdict("sub.denied.test") == (0, "egress-default allow")
    assert a.names_on and not egress().names_on


# ============================================================================ bindings (fake clock)


def test_binding_ttl_is_clamped_and_expires():
    e = egress(egress_allow=["a.test"], egress_default="deny", dns_binding_ttl_min=30, dns_binding_ttl_max=100)
    e.bind_answer("a.test", [("198.51.100.1", 5), ("198.51.100.2", 50), ("198.51.100.3", 10**6)], 1000.0)
    assert e.decide(TCP, "198.51.100.1", 1, 1029.9).allowed  # floor: 30 s
    assert not e.decide(TCP, "198.51.100.1", 1, 1030.0).allowed  # expired (the cache too)
    assert e.decide(TCP, "198.51.100.2", 1, 1049.9).allowed and not e.decide(TCP, "198.51.100.2", 1, 1050.0).allowed
    assert e.decide(TCP, "198.51.100.3", 1, 1099.9).allowed and not e.decide(TCP, "198.51.100.3", 1, 1100.0).allowed
    # a refresh extends it
    e.bind_answer("a.test", [("198.51.100.1", 60)], 2000.0)
    assert e.decide(TCP, "198.51.100.1", 1, 2059.0).allowed


def test_binding_table_is_bounded_and_counts_evictions():
    counters: dict = {}
    b = NameBindings(3, counters)
    for i in range(5):
        b.bind(f"198.51.100.{i}", "n.test", 100.0)
    assert len(b) == 3 and counters["egress.dns_bindings_evicted"] == 2
    assert b.names("198.51.100.0", 0.0) == {} and b.names("198.51.100.4", 0.0) == {"n.test": 100.0}
    e = Egress(NetworkConfig(egress_allow=["a.test"], egress_default="deny", max_dns_bindings=10).validate(), {})
    for i in range(50):
        e.bind_answer(f"n{i}.a.test", [(f"198.51.100.{i}", 60)], 0.0)
    assert len(e.bindings) == 10 and e.counters["egress.dns_bindings_evicted"] == 40


def test_one_answer_with_thousands_of_addresses_binds_a_bounded_number():
    e = egress(egress_allow=["big.test"], egress_default="deny", max_dns_bindings_per_answer=16)
    addrs = [(f"10.{i >> 8}.{i & 255}.1", 60) for i in range(3000)]
    assert e.bind_answer("big.test", addrs, 0.0) == 16
    assert len(e.bindings) == 16 and e.counters["egress.dns_bindings_capped"] == 1


def test_shared_address_allowed_if_any_bound_name_allows():
    e = egress(egress_allow=["allowed.test:80"], egress_default="deny")
    e.bind_answer("cdn-b.test", [("198.51.100.9", 60)], 0.0)
    assert not e.decide(TCP, "198.51.100.9", 80, 1.0).allowed
    e.bind_answer("allowed.test", [("198.51.100.9", 60)], 1.0)  # a new binding empties the cache entry
    d = e.decide(TCP, "198.51.100.9", 80, 2.0)
    assert (d.allowed, d.name) == (True, "allowed.test")


# ============================================================================ DNS messages


def query(name: str, qtype=dpkt.dns.DNS_A, edns: bool = True) -> bytes:
    q = dpkt.dns.DNS(id=0x4242, rd=1, qd=[dpkt.dns.DNS.Q(name=name, type=qtype, cls=dpkt.dns.DNS_IN)])
    if edns:
        q.ar = [dpkt.dns.DNS.RR(name="", type=41, cls=1232, ttl=0, rdata=b"")]
    return bytes(q)


def answer(q: bytes, records) -> bytes:
    d = dpkt.dns.DNS(q)
    r = dpkt.dns.DNS(id=d.id, qr=dpkt.dns.DNS_R, rd=1, ra=1, qd=d.qd)
    an = []
    for owner, kind, value, ttl in records:
        if kind == "A":
            an.append(dpkt.dns.DNS.RR(name=owner, type=1, cls=1, ttl=ttl, ip=socket.inet_aton(value)))
        elif kind == "AAAA":
            an.append(dpkt.dns.DNS.RR(name=owner, type=28, cls=1, ttl=ttl,
                                      ip6=socket.inet_pton(socket.AF_INET6, value)))
        else:
            an.append(dpkt.dns.DNS.RR(name=owner, type=5, cls=1, ttl=ttl, cname=value))
    r.an = an
    return bytes(r)


def ede(reply: bytes) -> tuple[int, int, str] | None:
    """(rcode, info-code, extra text) of a reply, the EDE None when absent."""
    d = dpkt.dns.DNS(reply)
    for rr in d.ar:
        if rr.type == 41:
            code, ln, info = struct.unpack_from("!HHH", rr.rdata, 0)
            assert code == 15
            return d.rcode, info, rr.rdata[6:4 + ln].decode()
    return None


def test_blocked_response_carries_ede_only_with_edns():
    for edns in (True, False):
        q = query("denied.test", edns=edns)
        _, qend = _question(q)
        assert has_edns(q, qend, read_name) is edns
        r = blocked_response(q, qend, EDE_BLOCKED, "denied.test", edns)
        d = dpkt.dns.DNS(r)
        assert (d.id, d.qr, d.rcode, d.rd, d.qd[0].name, len(d.an)) == (0x4242, 1, 3, 1, "denied.test", 0)
        assert ede(r) == ((3, EDE_BLOCKED, "denied.test") if edns else None)


def test_answer_addresses_follow_cname_chain_to_the_name_asked():
    q = query("www.a.test")
    r = answer(q, [("www.a.test", "CNAME", "edge.cdn.test", 300), ("edge.cdn.test", "CNAME", "e1.cdn.test", 40),
                   ("e1.cdn.test", "A", "198.51.100.7", 600), ("e1.cdn.test", "AAAA", "2001:db8::7", 20),
                   ("unrelated.test", "A", "198.51.100.66", 600)])
    qname = _question(q)[0][0]
    assert answer_addresses(r, qname, read_name) == [("198.51.100.7", 40), ("2001:db8::7", 20)]
    assert answer_addresses(r[:40], qname, read_name) == []  # malformed: nothing


def forwarder(stack_counters, reply_for, **cfg):
    """A DnsForwarder under an Egress whose upstream answers with ``reply_for(query)`` (no sockets)."""
    config = NetworkConfig(dns_upstreams=["127.0.0.1:53"], **cfg).validate()
    e = Egress(config, stack_counters)
    asked = []

    class Fake(DnsForwarder):
        __slots__ = ()

        async def _forward(self, q, question, tcp):
            asked.append(q)
            return reply_for(q)

    f = Fake(config)
    f.policy = e
    return f, e, asked


def test_forwarder_blocks_denied_names_and_binds_allowed_answers():
    counters: dict = {}
    f, e, asked = forwarder(counters, lambda q: answer(q, [(dpkt.dns.DNS(q).qd[0].name, "A", "198.51.100.1", 5)]),
                            egress_allow=["allowed.test:8080"], egress_deny=["denied.test"], egress_default="deny")

    async def main():
        r1 = await f.resolve(query("denied.test"), now=100.0)
        r2 = await f.resolve(query("other.test", edns=False), now=100.0)
        r3 = await f.resolve(query("ALLOWED.test"), now=100.0)
        return r1, r2, r3

    r1, r2, r3 = asyncio.run(main())
    assert ede(r1) == (3, EDE_BLOCKED, "denied.test")
    assert dpkt.dns.DNS(r2).rcode == 3 and ede(r2) is None
    assert len(asked) == 1  # the upstream never saw the denied names
    assert dpkt.dns.DNS(r3).an[0].ip == socket.inet_aton("198.51.100.1")
    assert counters["egress.dns_blocked"] == 2 and f.stats["blocked"] == 2
    assert e.decide(TCP, "198.51.100.1", 8080, 129.0).name == "allowed.test"  # TTL 5 -> floor 30
    assert not e.decide(TCP, "198.51.100.1", 8080, 130.0).allowed


# ============================================================================ Guard, audit, counters


class Audit:
    def __init__(self):
        self.records = []

    def record(self, rec: dict) -> None:
        self.records.append(rec)


class Ctx:
    def __init__(self):
        self.counters: dict = {}
        self.audit = Audit()

    def drop(self, reason):
        self.counters["drop." + reason] = self.counters.get("drop." + reason, 0) + 1


def guard(hook=None, **cfg) -> tuple[Guard, Ctx]:
    ctx = Ctx()
    return Guard(NetworkConfig(**cfg).validate(), ctx.drop, ctx=ctx, hook=hook), ctx


def test_denials_are_counted_by_reason_and_audited():
    g, ctx = guard(egress_allow=["a.test:80"], egress_deny=["192.0.2.0/24"], egress_default="deny")
    g.policy.bind_answer("a.test", [("198.51.100.1", 60)], 0.0)
    assert g.admit(TCP, "198.51.100.1", 80, 1.0, (socket.inet_aton("10.0.2.15"), 4000)) is None
    assert g.decision.name == "a.test"
    assert g.admit(TCP, "198.51.100.1", 81, 1.0, (socket.inet_aton("10.0.2.15"), 4001)) == DENIED
    assert g.admit(UDP, "192.0.2.1", 9, 1.0, (socket.inet_pton(socket.AF_INET6, "fd00::15"), 5)) == DENIED
    assert g.admit(TCP, "169.254.169.254", 80, 1.0) == DENIED
    c = ctx.counters
    assert (c["drop.egress_denied"], c["egress.denied_default"], c["egress.denied_rule"]) == (3, 1, 2)
    recs = ctx.audit.records
    # the same guest fields as a flow record: address and port apart
    assert [(r["event"], r["proto"], r["guest"], r["guest_port"], r["dst"], r["port"], r["name"], r["verdict"],
             r["rule"]) for r in recs] == [
        # the port a.test's rule does not allow: the record still names the name the address is bound to
        ("deny", "tcp", "10.0.2.15", 4001, "198.51.100.1", 81, "a.test", "deny", "egress-default deny"),
        ("deny", "udp", "fd00::15", 5, "192.0.2.1", 9, None, "deny", "192.0.2.0/24"),
        ("deny", "tcp", None, None, "169.254.169.254", 80, None, "deny", "169.254.0.0/16 (default)")]
    # the destination as the guest sent to it (the gateway), the host address the policy decided on apart
    assert g.admit(TCP, "127.0.0.1", 8080, 1.0, (socket.inet_aton("10.0.2.15"), 4002), socket.inet_aton("10.0.2.2")) \
        == DENIED
    assert (recs[-1]["dst"], recs[-1]["host"], recs[-1]["port"]) == (socket.inet_aton("10.0.2.2"), "127.0.0.1", 8080)
    assert all(isinstance(r["time"], float) for r in recs)


def test_verdict_cache_is_a_lookup_and_rule_changes_clear_it():
    g, _ = guard(egress_default="deny")
    e = g.policy
    assert g.admit(TCP, "198.51.100.1", 80, 0.0) == DENIED
    assert e._cache["198.51.100.1"][(80, TCP)][0].allowed is False
    assert e.add("198.51.100.0/24:80/tcp") == "198.51.100.0/24:80/tcp"
    assert e._cache == {}
    assert g.admit(TCP, "198.51.100.1", 80, 0.0) is None
    assert e.list_rules() == [{"rule": "198.51.100.0/24:80/tcp", "verdict": "allow"}]
    assert e.remove("198.51.100.0/24:80/TCP").text == "198.51.100.0/24:80/tcp"
    assert e.remove("198.51.100.0/24:80/tcp") is None
    assert g.admit(TCP, "198.51.100.1", 80, 0.0) == DENIED
    with pytest.raises(ConfigError):
        e.add("nope")


# ============================================================================ the Python hook


def test_sync_hook_decides_what_no_rule_did_and_is_cached():
    asked = []

    def hook(req):
        asked.append((req.proto, req.dst, req.port, req.name, req.guest))
        return (req.port == 443, "only https")

    g, ctx = guard(hook, egress_deny=["192.0.2.0/24"], policy_cache_ttl=10)
    g.policy.bind_answer("h.test", [("198.51.100.5", 60)], 0.0)
    assert g.admit(TCP, "192.0.2.1", 443, 0.0) == DENIED  # a rule decides first: not asked
    assert g.admit(TCP, "198.51.100.5", 443, 0.0, (socket.inet_aton("10.0.2.15"), 7)) is None
    assert g.decision.rule == "policy hook: only https" and g.decision.reason == "hook"
    assert g.admit(TCP, "198.51.100.5", 80, 0.0) == DENIED
    assert ctx.counters["egress.denied_hook"] == 1
    assert g.admit(TCP, "198.51.100.5", 443, 5.0) is None
    assert asked == [("tcp", "198.51.100.5", 443, "h.test", "10.0.2.15:7"), ("tcp", "198.51.100.5", 80, "h.test", None)]
    assert g.admit(TCP, "198.51.100.5", 443, 10.5) is None  # the cached verdict expired: asked again
    assert len(asked) == 3
    g2, _ = guard(lambda req: 1 / 0)
    assert g2.admit(UDP, "198.51.100.5", 1, 0.0) == DENIED  # a failing hook denies


def test_async_hook_holds_then_decides_with_timeout():
    async def hook(req):
        if req.port == 1:
            await asyncio.sleep(5)
        return req.port != 2

    async def main():
        g, ctx = guard(hook, policy_timeout=0.05)
        now = asyncio.get_running_loop().time()
        assert g.admit(TCP, "198.51.100.5", 3, now) == HELD
        assert await g.ask(TCP, "198.51.100.5", 3, now) is True
        assert g.admit(TCP, "198.51.100.5", 3, now) is None  # cached now
        assert g.admit(TCP, "198.51.100.5", 2, now) == HELD
        assert await g.ask(TCP, "198.51.100.5", 2, now) is False
        assert g.admit(TCP, "198.51.100.5", 1, now) == HELD
        assert await g.ask(TCP, "198.51.100.5", 1, now) is False  # timeout -> deny
        assert ctx.counters["egress.hook_timeouts"] == 1
        assert g.admit(TCP, "198.51.100.5", 1, now) == DENIED  # the timeout verdict is cached
        assert g.held == 0
        g3, _ = guard(hook, policy_timeout=0.05, policy_timeout_verdict="allow")
        assert await g3.ask(TCP, "198.51.100.5", 1, now) is True

    asyncio.run(main())


def test_decision_is_slotted():
    d = Decision(True, "r", "n", "rule")
    with pytest.raises(AttributeError):
        d.other = 1


# ============================================================================ run-time changes over the API socket


def test_api_add_list_remove_rules(tmp_path):
    import json

    from aioslirp.frontends.api import ApiServer
    from aioslirp.stack import Stack

    stack = Stack(NetworkConfig(egress_default="deny"))
    api = ApiServer(stack, str(tmp_path / "api.sock"))

    def call(execute, **arguments):
        return json.loads(asyncio.run(api.handle(json.dumps({"execute": execute, "arguments": arguments}).encode())))

    assert call("add_rule", rule="Allowed.test:8080") == {"return": {"rule": "allowed.test:8080"}}
    assert call("add_rule", rule="192.0.2.0/24", verdict="deny") == {"return": {"rule": "192.0.2.0/24"}}
    assert call("list_rules") == {"return": {"rules": [{"rule": "allowed.test:8080", "verdict": "allow"},
                                                       {"rule": "192.0.2.0/24", "verdict": "deny"}],
                                             "default": "deny"}}
    assert stack.policy.dns_verdict("allowed.test")[0] == 0
    err = call("add_rule", rule="x.org:99999")["error"]["desc"]
    assert err == "bad request: add_rule: bad arguments.rule: 'x.org:99999': port 99999 is out of range 1-65535"
    assert call("add_rule", rule="x.org", verdict="maybe")["error"]["desc"] == \
        "bad request: add_rule: bad arguments.verdict"
    assert call("add_rule")["error"]["desc"] == "bad request: add_rule: bad arguments.rule"
    assert call("remove_rule", rule="nothere.test")["error"]["desc"] == "bad request: remove_rule: no such rule"
    assert call("remove_rule", rule="allowed.test:8080", close="yes")["error"]["desc"] == \
        "bad request: remove_rule: bad arguments.close"
    assert call("remove_rule", rule="allowed.test:8080") == {"return": {"closed": 0}}
    assert stack.policy.dns_verdict("allowed.test")[0] == EDE_PROHIBITED


class FakeFlow:
    direction, forward_id, remote = "outbound", None, "x"

    def __init__(self, proto, dst, port):
        self.proto, self.dst_ip, self.dst_port = proto, socket.inet_aton(dst), port
        self.down = False

    def shutdown(self):
        self.down = True


def test_removed_allow_closes_only_the_flows_it_alone_allowed_and_only_when_asked():
    from aioslirp.stack import Stack

    stack = Stack(NetworkConfig(egress_default="deny", egress_allow=["198.51.100.0/24:80", "198.51.100.7/32"]))
    flows = {1: FakeFlow(TCP, "198.51.100.1", 80), 2: FakeFlow(UDP, "198.51.100.7", 80),
             3: FakeFlow(TCP, "10.0.2.2", 80)}
    stack.parts.table.flows.update(flows)
    try:
        stack.policy.add("127.0.0.1/32")
        assert stack.policy.remove("198.51.100.0/24:80").text == "198.51.100.0/24:80"
        assert not any(f.down for f in flows.values())  # without close: open flows stay
        stack.policy.add("198.51.100.0/24:80")
        stack.policy.remove("198.51.100.0/24:80", close=True)
        assert [f.down for f in flows.values()] == [True, False, False]  # .7 has its own rule; the gateway too
        assert stack.counters["egress.flows_closed"] == 1
    finally:
        stack.parts.table.flows.clear()


def test_dns_upstream_check_uses_its_port_and_ignores_defaults_and_egress_default():
    e = egress(egress_deny=["127.0.0.0/8:22", "192.0.2.0/24:53/udp"], egress_default="deny")
    assert e.allows("127.0.0.53", user_only=True, port=53, proto=UDP)  # a deny of port 22 is not a deny of 53
    assert not e.allows("192.0.2.1", user_only=True, port=53, proto=UDP)
    assert e.allows("169.254.169.254", user_only=True, port=53, proto=UDP)  # the built-in defaults do not apply
    assert e.allows("127.0.0.1")  # proto 0: rules with ports do not count


def test_an_upstream_answer_never_binds_the_hosts_loopback_or_link_local():
    """DNS rebinding: whoever controls an allowed name's DNS answers 127.0.0.1 (or ::1, a
    link-local, unspecified or multicast address); bound, the name rule would open the host's own
    loopback services through the gateway. Refused and counted; the owner's --dns-record (trusted)
    still binds the gateway's host address."""
    g, ctx = guard(egress_allow=["a.test:80", "gw.test:80"], egress_default="deny")
    answer_addrs = [("127.0.0.1", 60), ("127.1.2.3", 60), ("::1", 60), ("::ffff:127.0.0.1", 60), ("0.0.0.0", 60),
                    ("169.254.169.254", 60), ("fe80::1", 60), ("224.0.0.1", 60), ("198.51.100.1", 60)]
    assert g.policy.bind_answer("a.test", answer_addrs, 0.0) == 1
    assert g.policy.counters["egress.dns_bindings_refused"] == 8
    guest = (socket.inet_aton("10.0.2.15"), 4000)
    assert g.admit(TCP, "127.0.0.1", 80, 1.0, guest) == DENIED  # the gateway's host side stays shut
    assert g.admit(TCP, "::1", 80, 1.0, guest) == DENIED
    assert g.admit(TCP, "198.51.100.1", 80, 1.0, guest) is None and g.decision.name == "a.test"
    assert g.policy.bind_answer("gw.test", [("127.0.0.1", 60)], 1.0, trusted=True) == 1
    assert g.admit(TCP, "127.0.0.1", 80, 2.0, guest) is None and g.decision.name == "gw.test"


def test_policy_cache_ttl_must_be_positive():
    """A held flow is replayed with the verdict its hook just gave: with no cache it would be
    held and asked again for ever (one SYN: ~19,000 hook calls a second)."""
    with pytest.raises(ConfigError, match="policy_cache_ttl"):
        NetworkConfig(policy_cache_ttl=0).validate()
    assert NetworkConfig(policy_cache_ttl=0.5).validate().policy_cache_ttl == 0.5
