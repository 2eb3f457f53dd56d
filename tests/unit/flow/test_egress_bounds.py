"""Every per-guest store of the egress path has a total bound (issue 24, 2), in process.

A guest chooses the destinations, ports and names it tries; each store the egress decision keeps
for them is counted after a flood and must stay within its documented bound (docs/security.md,
"Resource bounds"): the flow verdict cache (:data:`~aioslirp.flow.egress.VERDICT_CACHE` in all,
:data:`~aioslirp.flow.egress.VERDICT_CACHE_PER_ADDRESS` per address), the hook's verdicts
(:data:`~aioslirp.flow.egress.HOOK_CACHE`), the hook calls in progress (flows held:
``max_pending_connects``; DNS queries: ``dns_max_inflight``), the name bindings
(``max_dns_bindings``).
"""

from __future__ import annotations

import asyncio
import socket
import tracemalloc

import dpkt

from aioslirp.config import NetworkConfig
from aioslirp.flow import egress as egress_mod
from aioslirp.flow.egress import HOOK_CACHE, VERDICT_CACHE, VERDICT_CACHE_PER_ADDRESS, Egress
from aioslirp.flow.guard import DENIED, HELD, Guard
from aioslirp.services.dns import DnsForwarder

TCP, UDP = 6, 17


class Ctx:
    def __init__(self):
        self.counters: dict = {}
        self.audit = None

    def drop(self, reason):
        self.counters["drop." + reason] = self.counters.get("drop." + reason, 0) + 1


def entries(e: Egress) -> int:
    """The verdicts really held, counted one by one (not the egress's own count)."""
    return sum(len(per) for per in e._cache.values())


def test_a_syn_flood_over_addresses_and_ports_keeps_the_verdict_cache_bounded():
    """20 denied addresses x 4,000 ports (80,000 SYNs through Guard.admit, as the issue measured):
    at most VERDICT_CACHE verdicts are held at any time, the egress's own count agrees, and the
    cache memory stays within a few MB. Before the fix: 80,000 entries (~15 MB)."""
    ctx = Ctx()
    g = Guard(NetworkConfig(egress_default="deny").validate(), ctx.drop, ctx=ctx)
    e = g.policy
    most = 0
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for a in range(20):
            addr = f"198.18.{a}.1"
            for port in range(1, 4001):
                assert g.admit(TCP, addr, port, 1.0) == DENIED
            most = max(most, entries(e))
            assert e.cached == entries(e)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert most <= VERDICT_CACHE and entries(e) <= VERDICT_CACHE
    assert ctx.counters["drop.egress_denied"] == 80000
    assert e.counters["egress.verdict_cache_resets"] >= 80000 // VERDICT_CACHE - 1
    assert grown < 8 << 20, grown
    # a cached verdict is still a look-up: the last one is answered from the cache
    assert e.decide(TCP, "198.18.19.1", 4000, 1.0) is e._cache["198.18.19.1"][(4000, TCP)][0]


def test_one_address_walked_port_by_port_keeps_the_others():
    e = Egress(NetworkConfig(egress_default="deny").validate(), {})
    e.decide(TCP, "198.51.100.1", 443, 0.0)
    for port in range(1, VERDICT_CACHE_PER_ADDRESS + 10):
        e.decide(UDP, "198.51.100.2", port, 0.0)
    assert len(e._cache["198.51.100.2"]) <= VERDICT_CACHE_PER_ADDRESS
    assert (443, TCP) in e._cache["198.51.100.1"] and e.cached == entries(e)


def test_refreshing_an_expired_verdict_does_not_count_twice():
    e = Egress(NetworkConfig(egress_allow=["a.test"], egress_default="deny").validate(), {})
    e.bind_answer("a.test", [("93.184.216.34", 30)], 0.0)
    for t in range(0, 300, 31):  # the binding expires, the verdict is decided again in its slot
        e.bind_answer("a.test", [("93.184.216.34", 30)], float(t))
        e.decide(TCP, "93.184.216.34", 80, t + 29.0)
        e.decide(TCP, "93.184.216.34", 80, t + 30.5)
    assert e.cached == entries(e) == 1


async def test_guest_syn_frames_to_many_destinations_keep_the_cache_bounded(monkeypatch):
    """The same through the whole stack: 600 guest SYN frames to 600 denied destinations, with
    the bound lowered to 256: each is answered ICMP administratively prohibited (counted), and
    the stack's verdict cache never holds more than 256."""
    from support.frames import F4, tcp_frame
    from support.stacks import served_stack

    monkeypatch.setattr(egress_mod, "VERDICT_CACHE", 256)
    cfg = NetworkConfig(egress_default="deny", ipv6=False, dns_upstreams=[("127.0.0.1", 9)])
    async with served_stack(cfg, settle=0.1) as (stack, guest, _):
        most = 0
        for i in range(600):
            dst = socket.inet_aton(f"198.18.{i >> 8}.{i & 255 or 1}")
            guest.send(tcp_frame(F4, 40000 + i, 80 + (i % 7), 0x02, dst=dst))
            if i % 50 == 49:
                for _ in range(100):
                    await asyncio.sleep(0.01)
                    if stack.counters["drop.egress_denied"] >= i + 1:
                        break
                most = max(most, entries(stack.policy))
        assert stack.counters["drop.egress_denied"] == 600
        assert 0 < most <= 256 and stack.policy.cached == entries(stack.policy) <= 256


def test_hook_verdicts_are_bounded():
    """A sync hook asked about 10,000 addresses and 10,000 names keeps at most HOOK_CACHE verdicts."""
    e = Egress(NetworkConfig(policy=lambda req: False).validate(), {})
    for i in range(10000):
        e.decide(TCP, f"198.18.{i >> 8}.{i & 255}", 80, 0.0)
        e.dns_verdict(f"n{i}.exfil.test", 0.0)
        assert e.hook_cached <= HOOK_CACHE
    assert e.cached <= VERDICT_CACHE


def test_async_hook_calls_in_progress_are_bounded_for_flows_and_dns():
    """An async hook that never answers in time: flows held beyond max_pending_connects are
    refused (limit_pending_connects) and DNS queries beyond the forwarder's in-flight cap get no
    answer (overload); the hook calls in progress never exceed the two bounds together."""
    async def never(req):
        await asyncio.sleep(60)
        return True

    async def main():
        cfg = NetworkConfig(policy=never, policy_timeout=0.2, max_pending_connects=8,
                            dns_upstreams=["127.0.0.1:9"]).validate()
        ctx = Ctx()
        g = Guard(cfg, ctx.drop, ctx=ctx)
        f = DnsForwarder(cfg, max_inflight=5)
        f.policy = g.policy
        now = asyncio.get_running_loop().time()
        held = []
        for i in range(50):
            addr = f"198.18.0.{i + 1}"
            v = g.admit(TCP, addr, 80, now)
            if v == HELD:
                held.append(asyncio.ensure_future(g.ask(TCP, addr, 80, now)))
        queries = [asyncio.ensure_future(f.resolve(
            bytes(dpkt.dns.DNS(id=i, rd=1, qd=[dpkt.dns.DNS.Q(name=f"n{i}.test", type=1, cls=1)])), now=now))
            for i in range(50)]
        await asyncio.sleep(0.05)
        pending = g.policy.hook_pending
        assert len(held) == 8 and ctx.counters["drop.limit_pending_connects"] == 42
        assert f.stats["overload"] == 45 and pending == 8 + 5
        assert await asyncio.gather(*held) == [False] * 8  # the timeout verdict (deny)
        replies = await asyncio.gather(*queries)
        assert sum(r is None for r in replies) == 45
        assert all(dpkt.dns.DNS(r).rcode == 3 for r in replies if r is not None)  # timeout: denied
        assert g.policy.hook_pending == 0 and g.held == 0
        await f.close()

    asyncio.run(main())
