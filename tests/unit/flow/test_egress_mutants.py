"""Tests written from the survivors of the mutation run over ``aioslirp/flow/egress.py`` and
``aioslirp/services/dns_policy.py`` (docs/testing.md, "Mutation testing"). Sans I/O, each names
what it pins: a value a survivor changed without any other test noticing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.flow import egress as egress_mod
from aioslirp.flow.egress import DNS_PENDING, EDE_BLOCKED, NEVER, SPECIAL, Egress, NameBindings, address_class
from aioslirp.flow.guard import DENIED, HELD, Guard
from aioslirp.services.dns import _question, read_name
from aioslirp.services.dns_policy import answer_addresses, blocked_response, has_edns, plain_name, qname_text

TCP, UDP = 6, 17
PUB, PUB2 = "93.184.216.34", "93.184.216.35"  # global addresses (no traffic is sent anywhere)


def egress(**cfg) -> Egress:
    return Egress(NetworkConfig(**cfg).validate(), {})


class Ctx:
    def __init__(self):
        self.counters: dict = {}
        self.audit = None

    def drop(self, reason):
        self.counters["drop." + reason] = self.counters.get("drop." + reason, 0) + 1


def guard(hook=None, **cfg) -> tuple[Guard, Ctx]:
    ctx = Ctx()
    return Guard(NetworkConfig(**cfg).validate(), ctx.drop, ctx=ctx, hook=hook), ctx


# ============================================================================ Egress: construction, counters


def test_an_egress_without_counters_counts_in_its_own():
    e = Egress(NetworkConfig(egress_allow=["a.test"], max_dns_bindings_per_answer=1).validate())
    e.bind_answer("a.test", [(PUB, 60), (PUB2, 60)], 0.0)
    e.bind_answer("a.test", [(PUB, 60), (PUB2, 60)], 0.0)
    assert e.counters == {"egress.dns_bindings_capped": 2}


def test_policy_cache_ttl_is_how_long_a_hook_verdict_and_the_flow_verdict_built_on_it_last():
    asked = []
    e = egress(policy=lambda req: asked.append(req.port) or True, policy_cache_ttl=2.0)
    assert e.decide(TCP, PUB, 80, 0.0).allowed and asked == [80]
    assert e.decide(TCP, PUB, 80, 1.99).allowed and asked == [80]
    assert e.decide(TCP, PUB, 80, 2.0).allowed and asked == [80, 80]  # expired at exactly 2 s
    assert e.dns_verdict("n.test", 10.0) == (0, "policy hook") and e.dns_verdict("n.test", 11.99)[0] == 0
    assert len(asked) == 3
    e.dns_verdict("n.test", 12.0)
    assert len(asked) == 4


def test_the_hook_cache_is_apart_from_the_flow_cache():
    """A new name for the address empties the address's flow verdicts, not the hook's verdict for
    the (name, address, port, protocol) it already answered."""
    asked = []
    e = egress(egress_default="deny", policy=lambda req: asked.append(req.name) or True)
    e.bind_answer("h.test", [(PUB, 60)], 0.0)
    d = e.decide(TCP, PUB, 443, 1.0)
    assert (d.allowed, d.name, d.reason) == (True, "h.test", "hook")
    e.bind_answer("z.test", [(PUB, 60)], 1.0)  # min(names) is still h.test
    assert e.cached == 0
    assert e.decide(TCP, PUB, 443, 2.0).name == "h.test" and asked == ["h.test"]


@pytest.mark.parametrize(("hook", "is_async"), [
    (None, False), (lambda req: True, False), (type("C", (), {"__call__": lambda self, req: True})(), False)])
def test_a_sync_hook_is_not_taken_for_an_async_one(hook, is_async):
    assert egress(policy=hook).hook_async is is_async


async def _async_fn(req):
    return True


class _AsyncCall:
    async def __call__(self, req):
        return True


@pytest.mark.parametrize("hook", [_async_fn, _AsyncCall()])
def test_an_async_hook_is_known_at_once(hook):
    assert egress(policy=hook).hook_async is True


def test_the_egress_facade_of_the_rules():
    e = egress(egress_deny=["192.0.2.0/24"])
    assert e.match("192.0.2.1") == (False, "192.0.2.0/24", False) and e.match("198.51.100.1") is None
    assert e.match("169.254.1.1") == (False, "169.254.0.0/16", True)
    assert e.match("169.254.1.1", user_only=True) is None
    assert not e.allows("169.254.169.254")  # the built-in defaults count unless user_only
    assert e.allows("169.254.169.254", user_only=True) and not e.allows("192.0.2.9")
    assert e.describe()[:2] == ["deny 192.0.2.0/24", "deny 169.254.0.0/16 (default)"]


# ============================================================================ the verdict cache


def test_a_cached_verdict_is_the_same_object():
    e = egress(egress_deny=["192.0.2.0/24"])
    assert e.decide(TCP, "192.0.2.1", 80, 0.0) is e.decide(TCP, "192.0.2.1", 80, 0.0)
    assert e.cached == 1


def test_the_verdict_cache_bounds_are_exact_and_resets_counted(monkeypatch):
    monkeypatch.setattr(egress_mod, "VERDICT_CACHE", 4)
    monkeypatch.setattr(egress_mod, "VERDICT_CACHE_PER_ADDRESS", 3)
    e = egress(egress_default="deny")
    for i in range(5):
        e.decide(TCP, f"93.184.217.{i}", 1, 0.0)
    assert e.counters["egress.verdict_cache_resets"] == 1
    e.clear_cache()
    e.counters["egress.verdict_cache_resets"] = 5
    for port in (1, 2, 3):
        e.decide(TCP, PUB, port, 0.0)
    assert e.cached == 3
    e.decide(TCP, PUB, 4, 0.0)  # a 4th port of one address: that address starts over
    assert e.cached == 1 and e.counters["egress.verdict_cache_resets"] == 5
    for port in (1, 2, 3):
        e.decide(TCP, PUB2, port, 0.0)
    assert e.cached == 4
    e.decide(TCP, "93.184.216.36", 1, 0.0)  # the 5th verdict in all: the cache starts over
    assert e.cached == 1 and e.counters["egress.verdict_cache_resets"] == 6
    e.clear_cache()
    assert e.cached == 0


def test_a_pending_verdict_is_not_cached():
    async def hook(req):
        return True

    e = egress(policy=hook)
    assert e.decide(TCP, PUB, 80, 0.0).reason == "pending"
    assert e.cached == 0


# ============================================================================ _decide: names and rules


def test_of_two_names_the_most_specific_rule_then_the_first_bound_wins():
    e = egress(egress_allow=["*.x.test", "a.x.test"], egress_default="deny")
    e.bind_answer("b.x.test", [(PUB, 60)], 0.0)
    e.bind_answer("c.x.test", [(PUB, 60)], 0.0)
    assert e.decide(TCP, PUB, 80, 1.0).name == "b.x.test"  # the same rule: the first name
    e.bind_answer("a.x.test", [(PUB, 60)], 0.0)
    d = e.decide(TCP, PUB, 80, 1.0)
    assert (d.name, d.rule) == ("a.x.test", "a.x.test")  # the exact name beats the wildcard


def test_a_cidr_rule_deciding_for_a_bound_address_carries_no_name():
    e = egress(egress_allow=["93.184.216.0/24", "other.test"], egress_default="deny")  # (names matter)
    e.bind_answer("a.test", [(PUB, 60)], 0.0)
    d = e.decide(TCP, PUB, 80, 1.0)
    assert (d.allowed, d.rule, d.name, d.reason) == (True, "93.184.216.0/24", None, "rule")


def test_a_hook_decision_carries_the_bound_name():
    e = egress(egress_default="deny", policy=lambda req: False)
    e.bind_answer("h.test", [(PUB, 60)], 0.0)
    d = e.decide(TCP, PUB, 80, 1.0)
    assert (d.allowed, d.name, d.rule, d.reason) == (False, "h.test", "policy hook", "hook")
    e2 = egress(policy=lambda req: 1 / 0)
    e2.bind_answer("h.test", [(PUB, 60)], 0.0)
    d = e2.decide(TCP, PUB, 80, 1.0)
    assert (d.allowed, d.name, d.reason) == (False, "h.test", "hook_error")


def test_a_hook_answering_a_one_tuple_gives_no_reason():
    assert egress(policy=lambda req: (True,)).decide(TCP, PUB, 80, 0.0).rule == "policy hook"


def test_a_failing_or_slow_hook_is_counted_as_the_hooks_denial(caplog):
    g, ctx = guard(lambda req: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="aioslirp.limits"):
        assert g.admit(UDP, PUB, 9, 0.0) == DENIED
    assert ctx.counters["egress.denied_hook"] == 1
    assert "egress policy hook failed on PolicyRequest(udp, 93.184.216.34, 9, None, None): denied" in caplog.text

    async def slow(req):
        await asyncio.sleep(5)

    async def main():
        g, ctx = guard(slow, policy_timeout=0.02)
        now = asyncio.get_running_loop().time()
        g.policy.bind_answer("s.test", [(PUB, 60)], now)
        ctx.counters["egress.hook_timeouts"] = 3
        assert g.admit(TCP, PUB, 80, now) == HELD
        assert await g.ask(TCP, PUB, 80, now) is False
        assert ctx.counters["egress.denied_hook"] == 1 and ctx.counters["egress.hook_timeouts"] == 4
        d = g.policy.decide(TCP, PUB, 80, now)
        assert (d.name, d.reason) == ("s.test", "hook_timeout")

    asyncio.run(main())


def test_an_async_hook_gets_the_flow_as_it_is():
    seen = []

    async def hook(req):
        seen.append((req.proto, req.dst, req.port, req.name, req.guest))
        return True

    async def main():
        e = egress(policy=hook)
        e.bind_answer("u.test", [(PUB, 60)], 0.0)
        assert (await e.ask(UDP, PUB, 5353, 1.0, (socket.inet_aton("10.0.2.15"), 7))).allowed
        assert (await e.dns_ask("n.test", (socket.inet_pton(socket.AF_INET6, "fd00::15"), 9), "fd00::3")) == \
            (0, "policy hook")

    asyncio.run(main())
    assert seen == [("udp", PUB, 5353, "u.test", "10.0.2.15:7"), ("dns", "fd00::3", 53, "n.test", "[fd00::15]:9")]


def test_a_coroutine_from_a_sync_hook_is_awaited_once_for_its_key():
    calls, made = [], []

    async def check(req):
        calls.append((req.proto, req.name))
        return req.port != 22

    async def main():
        e = egress(policy=lambda req: made.append(req.proto) or check(req))
        e.bind_answer("c.test", [(PUB, 60)], 0.0)
        d = e.decide(TCP, PUB, 22, 1.0)
        assert d.reason == "pending" and e.hook_pending == 1
        d = await e.ask(TCP, PUB, 22, 1.0)
        assert (d.allowed, d.name) == (False, "c.test")
        await asyncio.sleep(0)
        assert calls == [("tcp", "c.test")] and made == ["tcp"] and e.hook_pending == 0
        e2 = egress(policy=lambda req: check(req))
        assert e2.dns_verdict("d.test", 1.0)[0] == DNS_PENDING
        assert await e2.dns_ask("d.test") == (0, "policy hook")
        assert calls[-1] == ("dns", "d.test") and len(calls) == 2

    asyncio.run(main())


def test_a_dns_verdict_awaited_across_a_hook_change_is_the_awaited_one():
    async def slow_yes(req):
        await asyncio.sleep(0.05)
        return True

    async def no(req):
        return False

    async def main():
        e = egress(egress_default="deny", policy=slow_yes)
        t = asyncio.ensure_future(e.dns_ask("a.test"))
        await asyncio.sleep(0.01)
        e.set_hook(no)  # not cached: the re-check is pending again, the answer is the awaited one
        assert await t == (0, "policy hook")

    asyncio.run(main())


# ============================================================================ close_denied


class FakeFlow:
    direction, forward_id = "outbound", None

    def __init__(self, proto, dst, port, remote="x", direction="outbound", forward_id=None):
        fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
        self.proto, self.dst_ip, self.dst_port, self.remote = proto, socket.inet_pton(fam, dst), port, remote
        self.direction, self.forward_id = direction, forward_id
        self.down = False

    def shutdown(self):
        self.down = True


class Table:
    def __init__(self, flows):
        self.flows = dict(enumerate(flows))


class FakeCtx:
    """A FlowContext's shape as far as close_denied reads it: the table, and once the stack runs
    ``running`` (its ``time()``, loop time)."""

    def __init__(self, flows, running=None):
        self.table = Table(flows)
        if running is not None:
            self.running = running

    @property
    def is_started(self) -> bool:
        return hasattr(self, "running")


def test_close_denied_ends_exactly_the_flows_the_policy_now_denies():
    e = egress(egress_allow=["127.0.0.1/32", "::1/128", f"{PUB}/32:1", "[2606:4700::/32]:80"], egress_default="deny")
    flows = [FakeFlow(TCP, "10.0.2.2", 80), FakeFlow(TCP, "fd00::2", 80), FakeFlow(TCP, PUB, 80),
             FakeFlow(TCP, "10.0.2.3", 53, remote=None),  # DNS over TCP: a local service
             FakeFlow(TCP, PUB, 81, direction="inbound"), FakeFlow(TCP, PUB, 82, forward_id=3),
             FakeFlow(1, PUB, None),  # an echo flow: port 0, which the rule for port 1 does not cover
             FakeFlow(TCP, "2606:4700::1", 80), FakeFlow(TCP, "2606:4700::1", 81)]
    e.ctx = FakeCtx(flows)
    e.counters["egress.flows_closed"] = 1
    assert e.close_denied(now=0.0) == 3
    assert [f.down for f in flows] == [False, False, True, False, False, False, True, False, True]
    assert e.counters["egress.flows_closed"] == 4


def test_close_denied_decides_at_the_time_given_or_the_loops():
    e = egress(egress_allow=["a.test:80"], egress_default="deny")
    e.bind_answer("a.test", [(PUB, 30)], 0.0)
    flow = FakeFlow(TCP, PUB, 80)

    class Loop:
        t = 10.0

        def time(self):
            return self.t

    e.ctx = FakeCtx([flow], Loop())
    assert e.close_denied() == 0 and not flow.down  # loop time 10: the binding holds
    assert e.close_denied(now=31.0) == 1 and flow.down
    e.ctx = None
    assert e.close_denied() == 0


def test_close_denied_leaves_a_flow_the_async_hook_must_decide():
    async def hook(req):
        return False

    e = egress(policy=hook)
    flow = FakeFlow(TCP, PUB, 80)
    e.ctx = FakeCtx([flow])
    assert e.close_denied(now=0.0) == 0 and not flow.down


# ============================================================================ bindings


def test_refreshing_a_binding_makes_it_the_newest():
    counters: dict = {}
    b = NameBindings(2, counters)
    b.bind("a", "n.test", 100.0)
    b.bind("b", "n.test", 100.0)
    b.bind("a", "n.test", 100.0)  # a refresh evicts nothing
    assert counters == {}
    b.bind("c", "n.test", 100.0)
    assert b.names("a", 0.0) and not b.names("b", 0.0)


def test_evicting_one_name_of_an_address_keeps_its_others_and_tells():
    changed = []
    b = NameBindings(2, {}, changed.append)
    b.bind("a", "one.test", 100.0)
    b.bind("a", "two.test", 100.0)
    b.bind("z", "z.test", 100.0)
    assert b.names("a", 0.0) == {"two.test": 100.0}
    assert changed == ["a", "a", "a", "z"]  # two names bound, one evicted, then z bound


def test_an_evicted_binding_stops_opening_its_address():
    e = egress(egress_allow=["*.e.test:80"], egress_default="deny", max_dns_bindings=1)
    e.bind_answer("a.e.test", [(PUB, 60)], 0.0)
    assert e.decide(TCP, PUB, 80, 1.0).allowed
    e.bind_answer("b.e.test", [(PUB2, 60)], 1.0)
    assert not e.decide(TCP, PUB, 80, 2.0).allowed


def test_drop_where_keeps_trusted_names_and_tells():
    changed = []
    b = NameBindings(10, {}, changed.append)
    b.bind("a", "up.test", 100.0)  # untrusted by default
    b.bind("a", "mine.test", 100.0, True)
    b.bind("b", "up.test", 100.0)
    assert b.drop_where(lambda addr: addr == "a") == 1
    assert b.names("a", 0.0) == {"mine.test": 100.0} and b.names("b", 0.0)
    assert changed[-1] == "a" and len(b) == 2


# ============================================================================ address classes


@pytest.mark.parametrize(("addr", "cls"), [
    ("::2", NEVER),  # IPv4-compatible 0.0.0.2
    ("::1:0:0", SPECIAL), ("::1:0:1", SPECIAL),  # past the IPv4-compatible range, outside 2000::/3
    ("fc00::1%eth0", SPECIAL), ("2606:4700::1%1", 0),
])
def test_address_class_edges(addr, cls):
    assert address_class(addr) == cls


# ============================================================================ dns_policy


def test_names_without_their_terminating_zero():
    assert plain_name(b"\x01a") is False
    assert qname_text(b"\x01a") == "a"


def _msg(qid=0x4242, flags=0x0100, an=(), ns=(), ar=(), name=b"\x04test\x00", qtype=1):
    """A DNS message of one question and the given raw records (each ``(type, rdata)``)."""
    def rr(t, rdata, ttl=60):
        return b"\x00" + struct.pack("!HHIH", t, 1 if t != 41 else 1232, ttl, len(rdata)) + rdata
    body = b"".join(rr(*r) for r in (*an, *ns, *ar))
    return struct.pack("!HHHHHH", qid, flags, 1, len(an), len(ns), len(ar)) + name + struct.pack("!HH", qtype, 1) + body


def test_has_edns_looks_for_the_opt_record_in_the_additional_section_only():
    def edns(m):
        return has_edns(m, _question(m)[1], read_name)

    assert edns(_msg(ar=[(41, b"")]))
    assert edns(_msg(an=[(1, b"\x01\x02\x03\x04")], ar=[(41, b"")]))
    assert edns(_msg(ns=[(1, b"\x01\x02\x03\x04")], ar=[(41, b"")]))
    assert not edns(_msg(ns=[(41, b"")], ar=[(1, b"\x01\x02\x03\x04")]))  # OPT in the authority section
    assert not edns(_msg(ar=[(1, b"\x01\x02\x03\x04")]))
    truncated = _msg(ar=[(41, b"")])[:-2] + b"\x00\x0a"  # RDLENGTH 10, no data
    assert not edns(truncated)


def test_blocked_response_fields():
    q = _msg(qid=0xBEEF, flags=0x0000)  # RD clear
    qend = _question(q)[1]
    r = blocked_response(q, qend, 18, "x" * 300, True)
    qid, flags = struct.unpack_from("!HH", r, 0)
    assert (qid, flags) == (0xBEEF, 0x8000 | 0x0080 | 3)
    opt = r[qend + 1:]
    rtype, payload, ttl, rdlen = struct.unpack_from("!HHIH", opt, 0)
    code, length, info = struct.unpack_from("!HHH", opt, 10)
    assert (rtype, payload, ttl, code, info) == (41, 1232, 0, 15, 18)
    assert length == 2 + 255 == rdlen - 4 and opt[16:] == b"x" * 255
    r = blocked_response(q, qend, 15, "bad \udc80 text", True)  # a lone surrogate: replaced, not raised
    assert r.endswith(b"bad ? text")
    q = _msg(flags=0x2900)  # opcode 5 (UPDATE), RD
    assert struct.unpack_from("!H", blocked_response(q, _question(q)[1], 15, "r", False), 2)[0] == 0xA983


def _answer(records, rcode=0, name=b"\x04test\x00"):
    """A reply to ``test`` A with ``records``: ``(owner wire, type, ttl, rdata)``."""
    body = b"".join(o + struct.pack("!HHIH", t, 1, ttl, len(rd)) + rd for o, t, ttl, rd in records)
    return struct.pack("!HHHHHH", 1, 0x8180 | rcode, 1, len(records), 0, 0) + name + b"\x00\x01\x00\x01" + body


def test_answer_addresses_edges():
    name = b"\x04test\x00"
    a = socket.inet_aton(PUB)
    assert answer_addresses(_answer([(name, 1, 300, a)]), name, read_name) == [(PUB, 300)]
    assert answer_addresses(_answer([(name, 1, 300, a)], rcode=3), name, read_name) == []  # NXDOMAIN
    assert answer_addresses(_answer([(name, 1, 300, a)], rcode=2), name, read_name) == []
    assert answer_addresses(_answer([(name, 16, 300, b"\x03abc")]), name, read_name) == []  # TXT, 4 bytes
    assert answer_addresses(_answer([(name, 99, 300, bytes(16))]), name, read_name) == []  # 16 bytes, not AAAA
    # a TTL with its top bit set counts as at most 2**31 (RFC 2181 8), through a CNAME too
    assert answer_addresses(_answer([(name, 1, 0xFFFFFFFF, a)]), name, read_name) == [(PUB, 1 << 31)]
    cname = b"\x01c\x04test\x00"
    r = _answer([(name, 5, 0xFFFFFFFF, cname), (cname, 1, 0xFFFFFFFF, a)])
    assert answer_addresses(r, name, read_name) == [(PUB, 1 << 31)]


def test_answer_addresses_of_a_message_with_signed_looking_counts():
    d = dpkt.dns.DNS(id=0x9000, qr=1, rd=1, ra=1, qd=[dpkt.dns.DNS.Q(name="test", type=1, cls=1)],
                     an=[dpkt.dns.DNS.RR(name="test", type=1, cls=1, ttl=5, ip=socket.inet_aton(PUB))])
    assert answer_addresses(bytes(d), b"\x04test\x00", read_name) == [(PUB, 5)]
    assert EDE_BLOCKED == 15


def test_a_name_without_a_rule_takes_the_addresss_cidr_rule():
    """An address bound to two names: one with no rule of its own (its winner: the CIDR allow for
    the address), one denied by name. The flow is allowed if the winner for any name allows it."""
    e = egress(egress_allow=["93.184.216.0/24"], egress_deny=["evil.test"], egress_default="deny")
    e.bind_answer("plain.test", [(PUB, 60)], 0.0)
    e.bind_answer("evil.test", [(PUB, 60)], 0.0)
    d = e.decide(TCP, PUB, 80, 1.0)
    assert (d.allowed, d.rule, d.name) == (True, "93.184.216.0/24", None)
