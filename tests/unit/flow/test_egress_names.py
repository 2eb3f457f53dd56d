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


# The bindings below are mostly made ``trusted`` (as the owner's dns_records are): these tests are
# about what a binding does, and their documentation addresses (198.51.100.0/24...) are
# special-purpose ones that an upstream answer binds only under a covering CIDR allow rule
# (test_an_upstream_answer_binds_no_special_purpose_address_unless_a_cidr_rule_covers_it).


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
    e.bind_answer("allowed.test", [("198.51.100.1", 60)], 0.0, trusted=True)
    e.bind_answer("web.test", [("198.51.100.2", 60)], 0.0, trusted=True)
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
    e.bind_answer("a.test", [("198.51.100.1", 5), ("198.51.100.2", 50), ("198.51.100.3", 10**6)], 1000.0,
                  trusted=True)
    assert e.decide(TCP, "198.51.100.1", 1, 1029.9).allowed  # floor: 30 s
    assert not e.decide(TCP, "198.51.100.1", 1, 1030.0).allowed  # expired (the cache too)
    assert e.decide(TCP, "198.51.100.2", 1, 1049.9).allowed and not e.decide(TCP, "198.51.100.2", 1, 1050.0).allowed
    assert e.decide(TCP, "198.51.100.3", 1, 1099.9).allowed and not e.decide(TCP, "198.51.100.3", 1, 1100.0).allowed
    # a refresh extends it
    e.bind_answer("a.test", [("198.51.100.1", 60)], 2000.0, trusted=True)
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
        e.bind_answer(f"n{i}.a.test", [(f"198.51.100.{i}", 60)], 0.0, trusted=True)
    assert len(e.bindings) == 10 and e.counters["egress.dns_bindings_evicted"] == 40


def test_one_answer_with_thousands_of_addresses_binds_a_bounded_number():
    e = egress(egress_allow=["big.test"], egress_default="deny", max_dns_bindings_per_answer=16)
    addrs = [(f"10.{i >> 8}.{i & 255}.1", 60) for i in range(3000)]
    assert e.bind_answer("big.test", addrs, 0.0, trusted=True) == 16
    assert len(e.bindings) == 16 and e.counters["egress.dns_bindings_capped"] == 1


def test_shared_address_allowed_if_any_bound_name_allows():
    e = egress(egress_allow=["allowed.test:80"], egress_default="deny")
    e.bind_answer("cdn-b.test", [("198.51.100.9", 60)], 0.0, trusted=True)
    assert not e.decide(TCP, "198.51.100.9", 80, 1.0).allowed
    e.bind_answer("allowed.test", [("198.51.100.9", 60)], 1.0, trusted=True)  # a new binding: the cache entry goes
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
    # (the CIDR rule covers the answer's documentation range: an upstream answer may bind there)
    f, e, asked = forwarder(counters, lambda q: answer(q, [(dpkt.dns.DNS(q).qd[0].name, "A", "198.51.100.1", 5)]),
                            egress_allow=["allowed.test:8080", "198.51.100.0/24:9/udp"], egress_deny=["denied.test"],
                            egress_default="deny")

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
    g.policy.bind_answer("a.test", [("198.51.100.1", 60)], 0.0, trusted=True)
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
    g.policy.bind_answer("h.test", [("198.51.100.5", 60)], 0.0, trusted=True)
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
                                             "default": "deny",
                                             "builtin": ["169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128"]}}
    assert stack.policy.dns_verdict("allowed.test")[0] == 0
    err = call("add_rule", rule="x.org:99999")["error"]["desc"]
    assert err == "bad request: add_rule: bad arguments.rule: 'x.org:99999': port 99999 is out of range 1-65535"
    assert call("add_rule", rule="x.org", verdict="maybe")["error"]["desc"] == \
        "bad request: add_rule: bad arguments.verdict"
    assert call("add_rule")["error"]["desc"] == "bad request: add_rule: bad arguments.rule"
    # a key the command does not know is refused, not ignored: "action": "deny" without "verdict"
    # used to add an allow rule
    assert call("add_rule", rule="127.0.0.1/32:8000", action="deny")["error"]["desc"] == \
        "bad request: add_rule: bad arguments.action: not an argument (rule, verdict, close)"
    assert call("remove_rule", rule="allowed.test:8080", verdcit="deny")["error"]["desc"] == \
        "bad request: remove_rule: bad arguments.verdcit: not an argument (rule, close)"
    assert [r["rule"] for r in call("list_rules")["return"]["rules"]] == ["allowed.test:8080", "192.0.2.0/24"]
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
    loopback services through the gateway. Refused and counted, even under CIDR allow rules
    covering them; the owner's --dns-record (trusted) still binds the gateway's host address."""
    g, ctx = guard(egress_allow=["a.test:80", "gw.test:80", "127.0.0.0/8:9", "[::/0]:9", "0.0.0.0/0:9"],
                   egress_default="deny")
    answer_addrs = [("127.0.0.1", 60), ("127.1.2.3", 60), ("::1", 60), ("::ffff:127.0.0.1", 60), ("0.0.0.0", 60),
                    ("169.254.169.254", 60), ("fe80::1", 60), ("224.0.0.1", 60), ("0.1.2.3", 60),
                    ("255.255.255.255", 60), ("64:ff9b::7f00:1", 60), ("2002:7f00:1::1", 60), ("ff02::1", 60),
                    ("::", 60), ("nonsense", 60), ("93.184.216.34", 60)]
    assert g.policy.bind_answer("a.test", answer_addrs, 0.0) == 1
    assert g.policy.counters["egress.dns_bindings_refused"] == len(answer_addrs) - 1
    guest = (socket.inet_aton("10.0.2.15"), 4000)
    assert g.admit(TCP, "127.0.0.1", 80, 1.0, guest) == DENIED  # the gateway's host side stays shut
    assert g.admit(TCP, "::1", 80, 1.0, guest) == DENIED
    assert g.admit(TCP, "93.184.216.34", 80, 1.0, guest) is None and g.decision.name == "a.test"
    assert g.policy.bind_answer("gw.test", [("127.0.0.1", 60)], 1.0, trusted=True) == 1
    assert g.admit(TCP, "127.0.0.1", 80, 2.0, guest) is None and g.decision.name == "gw.test"


SPECIAL = ["10.1.2.3", "172.17.0.1", "192.168.1.1", "100.64.0.1", "192.0.2.7", "198.18.0.1", "240.0.0.1",
           "fc00::1", "fd12:3456::1", "2001:db8::1", "::ffff:10.1.2.3", "::ffff:192.168.1.1", "::a01:203",
           "64:ff9b::a01:203", "2002:a01:203::1", "64:ff9b:1::1", "100::1", "4000::1", "fec0::1"]


@pytest.mark.parametrize("addr", SPECIAL)
def test_an_upstream_answer_binds_no_special_purpose_address_unless_a_cidr_rule_covers_it(addr):
    """DNS rebinding to the host's network (issue 24, 4): an allowed name answered with a private
    (10/8, 172.16/12, 192.168/16), shared (100.64/10), unique local (fc00::/7), documentation or
    other special-purpose address, or the IPv4-mapped / NAT64 / 6to4 form of one, is not bound:
    a flow to it stays denied under default deny. A CIDR allow rule covering it (any ports) lets
    it bind; then the name rule opens it."""
    g, _ = guard(egress_allow=["a.test:80"], egress_default="deny")
    assert g.policy.bind_answer("a.test", [(addr, 60)], 0.0) == 0
    assert g.policy.counters["egress.dns_bindings_refused"] == 1
    assert g.admit(TCP, addr, 80, 1.0) == DENIED
    # a rule for another port and protocol covers it (of the address as answered: IPv6 for a mapped one)
    g2, _ = guard(egress_allow=["a.test:80", "[::/0]:9/udp" if ":" in addr else "0.0.0.0/0:9/udp"],
                  egress_default="deny")
    assert g2.policy.bind_answer("a.test", [(addr, 60)], 0.0) == 1
    d = g2.policy.decide(TCP, addr, 80, 1.0)
    assert (d.allowed, d.name, d.rule) == (True, "a.test", "a.test:80")


def test_a_covering_cidr_rule_is_an_allow_rule_of_the_users():
    g, _ = guard(egress_allow=["a.test:80"], egress_deny=["10.0.0.0/8"], egress_default="deny",
                 egress_deny_builtin=["10.0.0.0/8"])
    assert g.policy.bind_answer("a.test", [("10.1.2.3", 60)], 0.0) == 0  # a deny rule, a default: no cover
    g, _ = guard(egress_allow=["a.test:80", "10.1.0.0/16:22/tcp"], egress_default="deny")
    assert g.policy.bind_answer("a.test", [("10.1.2.3", 60), ("10.2.0.1", 60)], 0.0) == 1  # only inside the rule
    assert g.policy.rules.covers("10.1.9.9").text == "10.1.0.0/16:22/tcp" and g.policy.rules.covers("x") is None


def test_policy_cache_ttl_must_be_positive():
    """A held flow is replayed with the verdict its hook just gave: with no cache it would be
    held and asked again for ever (one SYN: ~19,000 hook calls a second)."""
    with pytest.raises(ConfigError, match="policy_cache_ttl"):
        NetworkConfig(policy_cache_ttl=0).validate()
    assert NetworkConfig(policy_cache_ttl=0.5).validate().policy_cache_ttl == 0.5


# ============================================================================ the hook decides names (issue 24)


def test_sync_hook_is_asked_about_names_no_rule_decides_and_cached():
    from aioslirp.flow.egress import DNS_PENDING

    asked = []

    def hook(req):
        asked.append((req.proto, req.name, req.dst, req.port, req.guest))
        if req.name == "broken.test":
            raise RuntimeError("hook bug")
        return req.name.endswith(".ok.test"), "names under ok.test"

    e = Egress(NetworkConfig(egress_default="deny", egress_allow=["pypi.org:443"], egress_deny=["denied.test"],
                             policy=hook, policy_cache_ttl=10).validate(), {})
    guest = (socket.inet_aton("10.0.2.15"), 5353)
    assert e.dns_verdict("pypi.org", 0.0, guest, "10.0.2.3") == (0, "pypi.org:443")  # a rule: not asked
    assert e.dns_verdict("denied.test", 0.0, guest, "10.0.2.3") == (EDE_BLOCKED, "denied.test")
    assert asked == []
    assert e.dns_verdict("c2vjcmv0.attacker.example", 0.0, guest, "10.0.2.3") == \
        (EDE_BLOCKED, "policy hook: names under ok.test")
    assert asked == [("dns", "c2vjcmv0.attacker.example", "10.0.2.3", 53, "10.0.2.15:5353")]
    assert e.dns_verdict("a.ok.test", 1.0) == (0, "policy hook: names under ok.test")
    assert e.dns_verdict("c2vjcmv0.attacker.example", 9.9)[0] == EDE_BLOCKED and len(asked) == 2  # cached
    assert e.dns_verdict("c2vjcmv0.attacker.example", 10.0)[0] == EDE_BLOCKED and len(asked) == 3  # expired
    assert e.dns_verdict("broken.test", 0.0) == (EDE_BLOCKED, "policy hook")  # an exception denies
    # a name's verdict and a flow's are apart: the hook is asked again for a flow to the name's address
    e.bind_answer("a.ok.test", [("198.51.100.1", 60)], 1.0, trusted=True)
    assert e.decide(TCP, "198.51.100.1", 443, 2.0).rule == "policy hook: names under ok.test"
    assert asked[-1][:2] == ("tcp", "a.ok.test")
    assert DNS_PENDING < 0


def test_async_hook_decides_names_with_timeout_and_cache():
    from aioslirp.flow.egress import DNS_PENDING

    calls = []

    async def hook(req):
        calls.append(req.name)
        if req.name == "slow.test":
            await asyncio.sleep(5)
        return req.name == "ok.test"

    async def main():
        e = Egress(NetworkConfig(egress_default="deny", policy=hook, policy_timeout=0.05).validate(), {})
        now = asyncio.get_running_loop().time()
        assert e.dns_verdict("ok.test", now) == (DNS_PENDING, "policy hook")
        # two queries for one name at once: one call
        r1, r2 = await asyncio.gather(e.dns_ask("ok.test"), e.dns_ask("ok.test"))
        assert r1 == r2 == (0, "policy hook") and calls == ["ok.test"]
        assert e.dns_verdict("ok.test", now) == (0, "policy hook")  # cached now
        assert await e.dns_ask("bad.test") == (EDE_BLOCKED, "policy hook")
        assert await e.dns_ask("slow.test") == (EDE_BLOCKED, "policy hook timeout (0.05 s)")
        assert e.counters["egress.hook_timeouts"] == 1
        assert e.dns_verdict("slow.test", now) == (EDE_BLOCKED, "policy hook timeout (0.05 s)")
        e2 = Egress(NetworkConfig(egress_default="deny", policy=hook, policy_timeout=0.05,
                                  policy_timeout_verdict="allow").validate(), {})
        assert await e2.dns_ask("slow.test") == (0, "policy hook timeout (0.05 s)")

    asyncio.run(main())


def test_forwarder_asks_an_async_hook_before_the_upstream():
    async def hook(req):
        return req.name == "ok.test", "hook"

    counters: dict = {}
    f, e, asked = forwarder(counters, lambda q: answer(q, [(dpkt.dns.DNS(q).qd[0].name, "A", "198.51.100.1", 60)]),
                            egress_default="deny", egress_allow=["pypi.org:443"], policy=hook)

    async def main():
        return (await f.resolve(query("exfil.test"), now=1.0, guest=(socket.inet_aton("10.0.2.15"), 9)),
                await f.resolve(query("ok.test"), now=1.0))

    r1, r2 = asyncio.run(main())
    assert ede(r1) == (3, EDE_BLOCKED, "policy hook: hook")
    assert dpkt.dns.DNS(r2).rcode == 0 and len(asked) == 1
    assert counters["egress.dns_blocked"] == 1


def test_removing_the_covering_rule_drops_the_bindings_it_let_in():
    """A run-time rule change must not leave open what the new rules would refuse: the bindings of
    special-purpose addresses an upstream answer made under a CIDR allow rule go with the rule
    (its removal, or its replacement by a deny of the same text); the owner's dns_records stay."""
    e = egress(egress_allow=["a.test:80", "10.0.0.0/8:9/udp"], egress_default="deny")
    assert e.bind_answer("a.test", [("10.1.2.3", 60), ("93.184.216.34", 60)], 0.0) == 2
    assert e.bind_answer("db.test", [("10.9.9.9", 60)], 0.0, trusted=True) == 1
    assert e.decide(TCP, "10.1.2.3", 80, 1.0).allowed  # cached now
    e.remove("10.0.0.0/8:9/udp")
    assert e.counters["egress.dns_bindings_uncovered"] == 1
    assert not e.decide(TCP, "10.1.2.3", 80, 1.0).allowed
    assert e.bindings.names("10.1.2.3", 1.0) == {} and e.bindings.names("93.184.216.34", 1.0)
    assert e.bindings.names("10.9.9.9", 1.0) == {"db.test": 60.0}
    e.add("10.0.0.0/8:9/udp")
    assert e.bind_answer("a.test", [("10.1.2.3", 60)], 2.0) == 1
    e.add("10.0.0.0/8:9/udp", allow=False)  # the same text as a deny: no longer covered
    assert e.bindings.names("10.1.2.3", 2.0) == {} and e.counters["egress.dns_bindings_uncovered"] == 2


# ============================================================================ the attacker's review (issue 24)


@pytest.mark.parametrize("wire_labels", [
    [b"x.pypi", b"org"],  # reads "x.pypi.org" (under *.pypi.org) but is resolved under org
    [b"pypi", b"org."],  # reads "pypi.org." -> "pypi.org" once the dot is stripped
    [b"data", b"attacker", b"com\x00", b"pypi", b"org"],  # a C-string resolver would stop at the NUL
    [b"a\\.b", b"pypi", b"org"], [b"a b", b"pypi", b"org"], [b"\xc3\xbc", b"pypi", b"org"],
    [b"\x7f", b"pypi", b"org"],
])
def test_a_name_whose_text_would_read_differently_is_refused_under_the_policy(wire_labels):
    """Two readings of one name: our text joins the labels with '.', the upstream walks the labels.
    A label holding '.', '\\', a space, a control or a non-ASCII byte could make the text match a
    rule (or satisfy a hook) that the real name does not: such a query gets NXDOMAIN + EDE 15
    (ODD_NAME), whatever the rules, and never reaches the upstream or the hook."""
    from aioslirp.services.dns_policy import ODD_NAME

    seen = []
    f, e, asked = forwarder({}, lambda q: answer(q, []), egress_allow=["*.pypi.org", "pypi.org"],
                            egress_default="deny", policy=lambda req: seen.append(req) or True)
    wire = b"".join(bytes([len(lb)]) + lb for lb in wire_labels) + b"\x00"
    q = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 1) + wire + struct.pack("!HH", 1, 1) + \
        b"\x00" + struct.pack("!HHIH", 41, 1232, 0, 0)
    r = asyncio.run(f.resolve(q, now=0.0))
    assert ede(r) == (3, EDE_BLOCKED, ODD_NAME)
    assert asked == [] and seen == []
    # plain names still pass, in any case
    assert dpkt.dns.DNS(asyncio.run(f.resolve(query("X.PyPI.org"), now=0.0))).rcode == 0 and len(asked) == 1


def test_a_sync_hook_that_returns_a_coroutine_does_not_allow_everything():
    """``policy=lambda req: check(req)`` with ``check`` async returns a coroutine, which is truthy:
    it was taken for "allow" (and never awaited). Now it is awaited as an async hook's verdict
    would be (the flow held meanwhile) and the hook is treated as async from then on."""
    async def check(req):
        return req.port == 443

    async def main():
        g, ctx = guard(lambda req: check(req), policy_timeout=1.0)
        now = asyncio.get_running_loop().time()
        assert g.admit(TCP, "93.184.216.34", 80, now) == HELD
        assert await g.ask(TCP, "93.184.216.34", 80, now) is False
        assert g.admit(TCP, "93.184.216.34", 80, now) == DENIED  # the verdict, cached
        assert g.policy.hook_async
        assert g.admit(TCP, "93.184.216.34", 443, now) == HELD
        assert await g.ask(TCP, "93.184.216.34", 443, now) is True
        assert g.admit(TCP, "93.184.216.34", 443, now) is None
        e = Egress(NetworkConfig(egress_default="deny", policy=lambda req: check(req)).validate(), {})
        from aioslirp.flow.egress import DNS_PENDING
        assert e.dns_verdict("a.test", now)[0] == DNS_PENDING
        assert await e.dns_ask("a.test") == (EDE_BLOCKED, "policy hook")

    asyncio.run(main())


def test_a_hook_verdict_asked_before_a_change_is_not_cached_after_it():
    """A rule or hook change while an async hook is asked: the answer still reaches its waiters,
    but it is not cached (it answered for the old rules or hook); the next request asks the new
    hook. A DNS verdict awaited across a new deny rule takes the rule's."""
    async def slow_yes(req):
        await asyncio.sleep(0.05)
        return True, "old"

    async def no(req):
        return False, "new"

    async def main():
        e = Egress(NetworkConfig(egress_default="deny", policy=slow_yes).validate(), {})
        now = asyncio.get_running_loop().time()
        assert e.decide(TCP, "93.184.216.34", 80, now).reason == "pending"
        t = asyncio.ensure_future(e.ask(TCP, "93.184.216.34", 80, now))
        await asyncio.sleep(0.01)
        e.set_hook(no)
        assert (await t).rule == "policy hook: old"
        assert e.decide(TCP, "93.184.216.34", 80, now).reason == "pending"  # not cached
        assert (await e.ask(TCP, "93.184.216.34", 80, now)).rule == "policy hook: new"
        assert e.hook_pending == 0
        e.set_hook(slow_yes)
        t = asyncio.ensure_future(e.dns_ask("late.test"))
        await asyncio.sleep(0.01)
        e.add("late.test", allow=False)
        assert await t == (EDE_BLOCKED, "late.test")

    asyncio.run(main())


def test_the_hook_sees_each_address_a_name_leads_to():
    """A hook's flow verdict was cached per name: once it allowed (name, address X), another
    address Y the name's DNS answered later got the verdict without the hook seeing Y. Now it is
    cached per (name, address, port, protocol)."""
    seen = []

    def hook(req):
        seen.append((req.name, req.dst))
        return req.dst == "93.184.216.34"

    e = Egress(NetworkConfig(egress_default="deny", policy=hook).validate(), {})
    e.bind_answer("cdn.test", [("93.184.216.34", 60), ("93.184.216.35", 60)], 0.0)
    assert e.decide(TCP, "93.184.216.34", 443, 1.0).allowed
    assert not e.decide(TCP, "93.184.216.35", 443, 1.0).allowed
    assert seen == [("cdn.test", "93.184.216.34"), ("cdn.test", "93.184.216.35")]


def test_a_new_deny_rule_can_end_the_flows_it_denies():
    """Adding a deny rule left the flows it now denies open, with no way to end them; now
    ``add(..., close=True)`` (API ``add_rule`` ``close``) ends them as ``remove`` does."""
    import json

    from aioslirp.frontends.api import ApiServer
    from aioslirp.stack import Stack

    stack = Stack(NetworkConfig())
    flows = {1: FakeFlow(TCP, "198.51.100.1", 80), 2: FakeFlow(TCP, "198.51.100.2", 80)}
    stack.parts.table.flows.update(flows)
    api = ApiServer(stack, "/nonexistent/api.sock")
    try:
        stack.policy.add("198.51.100.1/32", allow=False)
        assert not any(f.down for f in flows.values())
        stack.policy.add("198.51.100.1/32", allow=False, close=True)
        assert [f.down for f in flows.values()] == [True, False]
        del stack.parts.table.flows[1]  # (an ended flow leaves the table)
        reply = json.loads(asyncio.run(api.handle(json.dumps(
            {"execute": "add_rule", "arguments": {"rule": "198.51.100.2", "verdict": "deny", "close": True}}
        ).encode())))
        assert reply == {"return": {"rule": "198.51.100.2/32", "closed": 1}} and flows[2].down
        assert json.loads(asyncio.run(api.handle(json.dumps(
            {"execute": "add_rule", "arguments": {"rule": "x.test", "close": "yes"}}).encode())))["error"]["desc"] \
            == "bad request: add_rule: bad arguments.close"
    finally:
        stack.parts.table.flows.clear()


def test_an_internationalized_rule_asks_for_its_xn_form():
    with pytest.raises(ConfigError, match="xn-- form"):
        parse_rule("bücher.de", "egress_allow")
    assert parse_rule("XN--BCHER-KVA.de", "egress_allow").text == "xn--bcher-kva.de"


def test_a_binding_that_expires_while_the_hook_is_asked_does_not_lend_its_name():
    """A flow held while an async hook decides on (name, address); the name's binding expires
    before the flow is replayed: the verdict given for the name is not used for the address
    without it (the hook is asked again, now without a name), and the flow's cached verdict
    never outlives the binding it used."""
    asked = []

    async def by_name(req):
        asked.append(req.name)
        await asyncio.sleep(0.01)
        return req.name == "a.test"

    async def main():
        e = Egress(NetworkConfig(egress_default="deny", policy=by_name, dns_binding_ttl_min=0,
                                 policy_cache_ttl=100).validate(), {})
        e.bind_answer("a.test", [("93.184.216.34", 1)], 0.0)
        assert e.decide(TCP, "93.184.216.34", 443, 0.5).reason == "pending"
        assert (await e.ask(TCP, "93.184.216.34", 443, 0.5)).allowed
        d = e.decide(TCP, "93.184.216.34", 443, 0.9)  # the replay, the binding still alive
        assert (d.allowed, d.name) == (True, "a.test")
        d = e.decide(TCP, "93.184.216.34", 443, 1.0)  # expired at 1.0: the cached verdict too
        assert d.reason == "pending"
        assert not (await e.ask(TCP, "93.184.216.34", 443, 1.0)).allowed
        assert asked == ["a.test", None]

    asyncio.run(main())
