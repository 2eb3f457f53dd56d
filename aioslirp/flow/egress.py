"""The egress decision of a new flow: rules, DNS name bindings, the Python hook, the verdict cache.

Theory of operation
-------------------
:class:`Egress` answers "may the guest open this flow?" for :meth:`Guard.admit
<aioslirp.flow.guard.Guard.admit>` with a :class:`Decision` ``(allowed, rule, name, reason)``:

1. the most specific CIDR rule for the host-side address, port and protocol
   (:meth:`EgressPolicy.match_addr <aioslirp.config.policy.EgressPolicy.match_addr>`); a built-in
   default deny (cloud metadata) decides at once: no name opens it;
2. the names the address is bound to (:class:`NameBindings`: the virtual DNS bound each A/AAAA
   address of an allowed answer to the name the guest asked, for the record's TTL clamped to
   ``[dns_binding_ttl_min, dns_binding_ttl_max]`` seconds). Each bound name's most specific name
   rule competes with the CIDR rule (see :mod:`aioslirp.config.policy` for the order); the flow is
   allowed when the winner for any bound name allows it, and then carries that name. Under
   ``egress_default deny``, a rule without ports does not open DNS (ports 53 and 853) to another
   resolver: only a rule naming the port (or a CIDR rule) does;
3. what no rule decides goes to the Python hook (``NetworkConfig.policy``) if any, else to
   ``egress_default``.

Names are decided the same way before the virtual DNS forwards a query (:meth:`Egress.dns_verdict`):
the most specific name rule without ports or protocol, then the hook (a :class:`PolicyRequest` of
``proto`` ``"dns"``; its verdict cached per name like a flow's, an async one awaited through
:meth:`Egress.dns_ask` with the same timeout), then ``egress_default``. So a hook never turns
name denial off: it decides the names no rule decides, as it decides the flows.

Cost: decisions are cached per host address, then per ``(port, protocol)``, until the earliest
expiry of the bindings used (and the hook's ``policy_cache_ttl``); a rule change or a new
binding for the address empties the address's entry. A repeated check is two dict look-ups.

Bounds (a guest chooses the addresses, ports and names): :data:`VERDICT_CACHE` verdicts in all
and :data:`VERDICT_CACHE_PER_ADDRESS` per address, :data:`HOOK_CACHE` hook verdicts,
``max_dns_bindings`` name bindings (:class:`NameBindings`); hook calls in progress at most one per
flow :class:`~aioslirp.flow.guard.Guard` holds (``max_pending_connects``) plus one per DNS query
in flight (``dns_max_inflight``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import ipaddress
import logging
import socket
import time
from typing import Any

from ..config.policy import EgressPolicy

__all__ = ["DNS_PENDING", "Decision", "Egress", "NameBindings", "PolicyRequest"]

log = logging.getLogger("aioslirp.limits")

_INF = float("inf")
_DNS_PORTS = (53, 853)
#: Flow verdicts cached at most, in all (host addresses x ``(port, protocol)``): one more starts
#: the cache over (``egress.verdict_cache_resets``). A verdict decided again costs a few
#: microseconds; an entry about 300 bytes (5 MB in all).
VERDICT_CACHE = 16384
#: Verdicts cached per host address at most (one more starts that address's over): a guest
#: walking the ports of one address does not push the others out.
VERDICT_CACHE_PER_ADDRESS = 4096
#: Hook verdicts (flows and DNS names) cached at most (one more starts the cache over).
HOOK_CACHE = 4096
PROTO_NAMES = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmp"}
#: RFC 8914 INFO-CODEs of :meth:`Egress.dns_verdict` (the values of
#: :data:`aioslirp.services.dns_policy.EDE_BLOCKED` / ``EDE_PROHIBITED``).
EDE_BLOCKED, EDE_PROHIBITED = 15, 18
#: :meth:`Egress.dns_verdict`'s code when an async hook must be asked (:meth:`Egress.dns_ask`).
DNS_PENDING = -1


class Decision:
    """The egress verdict of one flow.

    Attributes:
        allowed: the verdict.
        rule: the text of the deciding rule (``"pypi.org:443"``, ``"169.254.0.0/16 (default)"``,
            ``"egress-default deny"``, ``"policy hook"``), or ``""`` when nothing decided (allowed).
        name: the DNS name the destination is bound to and that decided, or ``None``.
        reason: ``"rule"``, ``"default"`` (``egress_default``), ``"hook"``, ``"hook_timeout"``,
            ``"hook_error"`` or ``"pending"`` (an async hook is being asked: :attr:`allowed` is False).
    """

    __slots__ = ("allowed", "rule", "name", "reason")

    allowed: bool
    rule: str
    name: str | None
    reason: str

    def __init__(self, allowed: bool, rule: str = "", name: str | None = None, reason: str = "rule") -> None:
        self.allowed, self.rule, self.name, self.reason = allowed, rule, name, reason

    def __repr__(self) -> str:
        return f"Decision({self.allowed}, {self.rule!r}, {self.name!r}, {self.reason!r})"


class PolicyRequest:
    """What the Python hook is asked about, for a new flow or a DNS name that no rule decided.

    * a flow: ``proto`` ``"tcp"``, ``"udp"`` or ``"icmp"``; ``dst`` the host-side address text;
      ``port`` (0 for ICMP); ``name`` the DNS name the address is bound to, or ``None``;
    * a DNS name the guest asks the virtual DNS to resolve: ``proto`` ``"dns"``; ``name`` the
      name (lower case, no trailing dot; its labels of printable ASCII without ``.`` or ``\\``:
      a name with other bytes is refused before any rule or hook sees it); ``dst`` the
      virtual DNS server's address the guest asked (``"10.0.2.3"``, ``"fd00::3"``); ``port`` 53.
      Allowed: the query goes upstream and the answer's addresses are bound to the name (flows to
      them are then decided as usual, asking the hook again for what no rule decides); denied:
      NXDOMAIN with an RFC 8914 Extended DNS Error 15 (Blocked) whose EXTRA-TEXT is the verdict's
      rule (``"policy hook: REASON"``), the upstream never asked. One verdict per name, whatever
      the query type or server, cached ``policy_cache_ttl`` seconds;

    and ``guest``: the guest's ``"ip:port"`` text, or ``None`` when unknown. The hook returns a
    bool or ``(bool, reason)``; an exception denies; an async hook slower than ``policy_timeout``
    gets ``policy_timeout_verdict``.
    """

    __slots__ = ("proto", "dst", "port", "name", "guest")

    proto: str
    dst: str
    port: int
    name: str | None
    guest: str | None

    def __init__(self, proto: str, dst: str, port: int, name: str | None = None, guest: str | None = None) -> None:
        self.proto, self.dst, self.port, self.name, self.guest = proto, dst, port, name, guest

    def __repr__(self) -> str:
        return f"PolicyRequest({self.proto}, {self.dst}, {self.port}, {self.name!r}, {self.guest!r})"


_ALLOW_ALL = Decision(True, "", None, "default")
#: :meth:`Egress._call`'s value when the sync hook returned an awaitable.
_PENDING = object()


class NameBindings:
    """Address -> names learned from the virtual DNS's answers, each until its expiry (loop time, s).

    At most ``limit`` (address, name) pairs: binding one more evicts the oldest
    (``counters["egress.dns_bindings_evicted"]``). ``on_change(addr)`` is called when an address
    gains or loses a name other than by expiry (the verdict cache forgets it; an expiry ends the
    cached verdicts that used the binding by itself).
    """

    __slots__ = ("limit", "counters", "_pairs", "_by_addr", "on_change")

    limit: int
    counters: dict
    _pairs: dict
    _by_addr: dict
    on_change: Any

    def __init__(self, limit: int, counters: dict, on_change=None) -> None:
        self.limit = int(limit)  # (NetworkConfig.max_dns_bindings: at least 1)
        self.counters = counters
        self._pairs: dict = {}  # (addr, name) -> trusted (the owner's dns_records), oldest first
        self._by_addr: dict = {}  # addr -> {name: expiry}
        self.on_change = on_change

    def __len__(self) -> int:
        return len(self._pairs)

    def bind(self, addr: str, name: str, expiry: float, trusted: bool = False) -> None:
        """Bind ``addr`` (canonical address text) to ``name`` (lower case) until loop time ``expiry``;
        ``trusted``: from the owner's ``dns_records`` (kept by :meth:`drop_where`)."""
        key = (addr, name)
        pairs = self._pairs
        fresh = pairs.pop(key, None) is None
        while len(pairs) >= self.limit:
            (oaddr, oname), _ = next(iter(pairs.items()))
            del pairs[(oaddr, oname)]
            names = self._by_addr.get(oaddr)
            if names is not None:
                names.pop(oname, None)
                if not names:
                    del self._by_addr[oaddr]
            self.counters["egress.dns_bindings_evicted"] = self.counters.get("egress.dns_bindings_evicted", 0) + 1
            if self.on_change is not None:
                self.on_change(oaddr)
        pairs[key] = trusted
        self._by_addr.setdefault(addr, {})[name] = expiry
        if fresh and self.on_change is not None:
            self.on_change(addr)

    def names(self, addr: str, now: float) -> dict:
        """``{name: expiry}`` of the live bindings of ``addr`` at loop time ``now`` (expired ones dropped)."""
        names = self._by_addr.get(addr)
        if not names:
            return {}
        dead = [n for n, e in names.items() if e <= now]
        for n in dead:
            del names[n]
            self._pairs.pop((addr, n), None)
        if not names:
            del self._by_addr[addr]
        return names

    def drop_where(self, doomed) -> int:
        """Forget the bindings but the trusted ones of each address for which ``doomed(addr)`` is
        true (calling ``on_change(addr)``); returns how many were forgotten."""
        pairs, by_addr = self._pairs, self._by_addr
        gone = [(a, n) for a in by_addr if doomed(a) for n in by_addr[a] if not pairs.get((a, n))]
        for a, n in gone:
            del pairs[(a, n)]
            names = by_addr[a]
            del names[n]
            if not names:
                del by_addr[a]
        if self.on_change is not None:
            for a in {a for a, _ in gone}:
                self.on_change(a)
        return len(gone)

    def clear(self) -> None:
        self._pairs.clear()
        self._by_addr.clear()


class Egress:
    """The egress decisions of one stack (see the module documentation).

    Args:
        config: the validated ``NetworkConfig`` (``egress_*``, ``dns_binding_ttl_*``,
            ``max_dns_bindings*``, ``policy*``).
        counters: the stack's counters (``egress.*``).
        hook: the Python policy hook (default ``config.policy``).

    Attributes:
        rules: the :class:`~aioslirp.config.policy.EgressPolicy`.
        bindings: the :class:`NameBindings`.
        default_allow: ``egress_default == "allow"``.
    """

    __slots__ = ("config", "counters", "rules", "bindings", "default_allow", "hook", "hook_async", "timeout",
                 "timeout_allow", "hook_ttl", "ttl_min", "ttl_max", "per_answer", "_cache", "_hook_cache",
                 "_pending", "_default", "ctx", "names_wanted", "_cached", "_gen")

    config: Any
    counters: dict
    rules: EgressPolicy
    bindings: NameBindings
    default_allow: bool
    hook: Any
    hook_async: bool
    timeout: float
    timeout_allow: bool
    hook_ttl: float
    ttl_min: float
    ttl_max: float
    per_answer: int
    _cache: dict
    #: Verdicts in :attr:`_cache`, all addresses together.
    _cached: int
    _hook_cache: dict
    _pending: dict
    #: Counts :meth:`clear_cache` calls: a hook verdict asked for before the last one is not cached.
    _gen: int
    _default: Decision
    _version: int
    #: The stack's FlowContext (for ``ctx.running`` / ``ctx.audit``), or ``None``.
    ctx: Any
    #: Something besides the rules needs the name bindings (a flow handler's route by name).
    names_wanted: bool

    def __init__(self, config, counters=None, hook=None) -> None:
        self.config = config
        self.counters = counters if counters is not None else {}
        self.rules = EgressPolicy.from_config(config)
        self.default_allow = config.egress_default != "deny"
        self._default = _ALLOW_ALL if self.default_allow else Decision(False, "egress-default deny", None, "default")
        self.bindings = NameBindings(config.max_dns_bindings, self.counters, self._forget)
        self.ttl_min = float(config.dns_binding_ttl_min)
        self.ttl_max = float(config.dns_binding_ttl_max)
        self.per_answer = int(config.max_dns_bindings_per_answer)
        self._gen = 0
        self.set_hook(hook if hook is not None else config.policy)
        self.timeout = float(config.policy_timeout)
        self.timeout_allow = config.policy_timeout_verdict == "allow"
        self.hook_ttl = float(config.policy_cache_ttl)
        self._cache: dict = {}  # addr -> {(port, proto): (Decision, until)}
        self._cached = 0
        self._hook_cache: dict = {}  # (name, addr, port, proto) / (name, 53, "dns") -> (Decision, until)
        self._pending: dict = {}  # hook key -> Future of the Decision
        self.ctx = None
        self.names_wanted = False

    def set_hook(self, hook) -> None:
        """Install (or with ``None`` remove) the Python policy hook; forgets cached verdicts."""
        self.hook = hook
        self.hook_async = hook is not None and (inspect.iscoroutinefunction(hook) or
                                                inspect.iscoroutinefunction(getattr(hook, "__call__", None)))
        self.clear_cache()

    # ------------------------------------------------------------------ EgressPolicy's interface
    @property
    def empty(self) -> bool:
        """Nothing to decide: no rule, no hook, default allow (every flow is allowed)."""
        return self.rules.empty and self.hook is None and self.default_allow

    @property
    def names_on(self) -> bool:
        """DNS answers matter: name rules exist, the default is deny, a hook may want names, or a flow
        handler is routed by name (:attr:`names_wanted`)."""
        return self.rules.has_names or not self.default_allow or self.hook is not None or self.names_wanted

    def allows(self, addr: str, *, user_only: bool = False, port: int = 0, proto: int = 0) -> bool:
        """:meth:`EgressPolicy.allows <aioslirp.config.policy.EgressPolicy.allows>` (DNS upstreams)."""
        return self.rules.allows(addr, user_only=user_only, port=port, proto=proto)

    def match(self, addr: str, *, user_only: bool = False):
        return self.rules.match(addr, user_only=user_only)

    def describe(self) -> list[str]:
        return self.rules.describe()

    # ------------------------------------------------------------------ run-time changes
    def add(self, text: str, allow: bool = True, close: bool = False) -> str:
        """Add a user rule (``"pypi.org:443"``...); returns its canonical text; raises ``ConfigError``.
        ``close``: then end (:meth:`close_denied`) the open guest flows the rules no longer allow
        (a new deny rule's)."""
        out = self.rules.add(text, allow)
        self.clear_cache()
        self._uncovered()  # the new rule may replace a covering allow rule of the same text
        if close:
            self.close_denied()
        return out

    def remove(self, text: str, close: bool = False):
        """Remove a user rule; returns the removed :class:`~aioslirp.config.policy.Rule` or ``None``.
        ``close``: then end (:meth:`close_denied`) the open guest flows the rules no longer allow,
        i.e. those a removed allow alone allowed. Raises ``ConfigError`` for a malformed text."""
        r = self.rules.remove(text)
        if r is not None:
            self.clear_cache()
            self._uncovered()
            if close:
                self.close_denied()
        return r

    def close_denied(self, now: float | None = None) -> int:
        """End every open guest-initiated flow of the stack (``ctx.table``) that the policy now
        denies (``flow.shutdown()``: a TCP flow is reset both ways); counted as
        ``egress.flows_closed``. Returns how many. ``now``: loop time (default the loop's)."""
        ctx = self.ctx
        table = getattr(ctx, "table", None)
        if table is None:
            return 0
        if now is None:
            now = ctx.running.time() if ctx.is_started else time.monotonic()  # no flow before the stack runs
        cfg = self.config
        gws = {}
        for attr, loop_text in (("gateway", "127.0.0.1"), ("gateway6", "::1")):
            gw = getattr(cfg, attr, None)
            if gw is not None:
                gws[ipaddress.ip_address(str(gw)).packed] = loop_text
        doomed = []
        for flow in list(table.flows.values()):
            if flow.direction != "outbound" or getattr(flow, "forward_id", None) is not None:
                continue
            dst = flow.dst_ip
            if flow.proto == 6 and flow.remote is None:
                continue  # DNS over TCP: a local service
            remote = gws.get(dst) or socket.inet_ntop(socket.AF_INET if len(dst) == 4 else socket.AF_INET6, dst)
            d = self.decide(flow.proto, remote, flow.dst_port or 0, now)
            if not d.allowed and d.reason != "pending":
                doomed.append(flow)
        for flow in doomed:
            flow.shutdown()
        if doomed:
            self.counters["egress.flows_closed"] = self.counters.get("egress.flows_closed", 0) + len(doomed)
        return len(doomed)

    def list_rules(self) -> list[dict]:
        """The user's rules: ``[{"rule": text, "verdict": "allow"|"deny"}, ...]``."""
        return self.rules.rules()

    def builtin_rules(self) -> list[str]:
        """The built-in deny rules (:meth:`EgressPolicy.builtin <aioslirp.config.policy.EgressPolicy.builtin>`)."""
        return self.rules.builtin()

    def rules_list(self) -> list[dict]:
        """:meth:`list_rules` (a method, not ``rules_list = list_rules``: mypyc compiles no method alias)."""
        return self.list_rules()

    def clear_cache(self) -> None:
        """Forget every cached decision (rules or hook changed). Hook calls in progress are left to
        their waiters but no longer shared with new requests, and their verdicts are not cached
        (they answered for the old rules or hook)."""
        self._cache = {}
        self._cached = 0
        self._hook_cache = {}
        self._pending = {}
        self._gen += 1

    @property
    def cached(self) -> int:
        """Flow verdicts cached now, all addresses together (at most :data:`VERDICT_CACHE`)."""
        return self._cached

    @property
    def hook_cached(self) -> int:
        """Hook verdicts cached now (at most :data:`HOOK_CACHE`)."""
        return len(self._hook_cache)

    @property
    def hook_pending(self) -> int:
        """Async hook calls in progress."""
        return len(self._pending)

    def _uncovered(self) -> None:
        """Drop the bindings an upstream answer could make only under a CIDR allow rule that is
        gone now (see :meth:`bind_answer`), counted ``egress.dns_bindings_uncovered``; those of the
        owner's ``dns_records`` stay."""
        n = self.bindings.drop_where(lambda a: not self.may_bind(a))
        if n:
            self.counters["egress.dns_bindings_uncovered"] = self.counters.get("egress.dns_bindings_uncovered", 0) + n

    def _forget(self, addr: str) -> None:
        per = self._cache.pop(addr, None)
        if per is not None:
            self._cached -= len(per)

    # ------------------------------------------------------------------ decisions
    def decide(self, proto: int, addr: str, port: int, now: float, guest: tuple | str | None = None) -> Decision:
        """The :class:`Decision` for a new flow of ``proto`` (6, 17, 1, 58) to host address ``addr``
        (text) and ``port`` (0 for ICMP) at loop time ``now`` (seconds). With an async hook that
        must be asked, the decision's reason is ``"pending"`` (see :meth:`ask`)."""
        per = self._cache.get(addr)
        if per is not None:
            hit = per.get((port, proto))
            if hit is not None and hit[1] > now:
                return hit[0]
        d, until = self._decide(proto, addr, port, now, guest)
        if d.reason == "pending":
            return d
        key = (port, proto)
        per = self._cache.get(addr)  # (again: a sync hook may have changed the rules meanwhile)
        if per is None or key not in per:
            if self._cached >= VERDICT_CACHE:  # a guest walking addresses and ports: start over
                self._cache = {}
                self._cached = 0
                per = None
                self.counters["egress.verdict_cache_resets"] = self.counters.get("egress.verdict_cache_resets", 0) + 1
            if per is None:
                per = self._cache[addr] = {}
            elif len(per) >= VERDICT_CACHE_PER_ADDRESS:  # a guest walking the ports of one address
                self._cached -= len(per)
                per.clear()
            self._cached += 1
        per[key] = (d, until)
        return d

    def _decide(self, proto: int, addr: str, port: int, now: float, guest) -> tuple[Decision, float]:
        rules = self.rules
        best = rules.match_addr(addr, port, proto)
        if best is not None and best.default:
            return Decision(False, best.text + " (default)", None, "rule"), _INF
        until = _INF
        name = None
        names = self.bindings.names(addr, now) if rules.has_names or self.hook is not None else {}
        if names:
            strict_dns = not self.default_allow and port in _DNS_PORTS
            allow_hit = deny_hit = None  # (rule, name) of the best allow / deny among the names
            for n, expiry in names.items():
                r = rules.match_name(n, port, proto, skip_portless=strict_dns)
                if best is not None and (r is None or best.key > r.key):
                    r = best
                if r is None:
                    continue
                until = min(until, expiry)
                if r.allow:
                    if allow_hit is None or r.key > allow_hit[0].key:
                        allow_hit = (r, n if r is not best else None)
                elif deny_hit is None or r.key > deny_hit[0].key:
                    deny_hit = (r, n if r is not best else None)
            hit = allow_hit or deny_hit
            if hit is not None:
                return Decision(hit[0].allow, hit[0].text, hit[1], "rule"), until
            name = min(names)  # no rule: the hook may decide on a name
            until = min(names.values())
        if best is not None:
            return Decision(best.allow, best.text, None, "rule"), until
        if self.hook is not None:
            return self._ask_hook(PROTO_NAMES[proto], proto, addr, port, name, guest, now, until)
        return self._default, until

    # ------------------------------------------------------------------ the Python hook
    def _ask_hook(self, pname, proto, addr, port, name, guest, now, until) -> tuple[Decision, float]:
        key = (name, addr, port, proto)
        hit = self._hook_cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0], min(until, hit[1])
        if not self.hook_async:
            value = self._call(key, PolicyRequest(pname, addr, port, name, guest_text(guest)), name)
            if value is not _PENDING:
                return self._remember(key, self._verdict(value, name), now), min(until, now + self.hook_ttl)
        return Decision(False, "policy hook", name, "pending"), now

    def _call(self, key, req: PolicyRequest, name):
        """Call the sync hook on ``req``: its value, ``None`` when it raised (a broken hook denies,
        loudly), or :data:`_PENDING` when it returned an awaitable (a coroutine from a ``lambda``
        around an async function...): that is then awaited as an async hook's call of ``key``
        would be, and the hook is treated as async from now on (never ``bool(coroutine)``)."""
        try:
            value = self.hook(req)
        except Exception:
            log.exception("egress policy hook failed on %r: denied", req)
            return None
        if inspect.isawaitable(value):
            log.warning("egress policy hook %r returned an awaitable: treated as an async hook", self.hook)
            self.hook_async = True
            fut = self._pending[key] = asyncio.ensure_future(self._run_hook(key, req, name, self._gen, value))
            fut.add_done_callback(functools.partial(self._done, key))
            return _PENDING
        return value

    def _verdict(self, value, name) -> Decision:
        if value is None:
            return Decision(False, "policy hook", name, "hook_error")
        reason = ""
        if isinstance(value, tuple):
            value, reason = (value + ("",))[:2]
        text = "policy hook" + (f": {reason}" if reason else "")
        return Decision(bool(value), text, name, "hook")

    def _remember(self, key, d: Decision, now: float) -> Decision:
        if len(self._hook_cache) >= HOOK_CACHE:
            self._hook_cache = {}
        self._hook_cache[key] = (d, now + self.hook_ttl)
        return d

    async def ask(self, proto: int, addr: str, port: int, now: float, guest: tuple | str | None = None) -> Decision:
        """Await the async hook's verdict for a flow whose :meth:`decide` was ``"pending"`` (one call
        per ``(name, address, port, protocol)`` at a time; ``policy_timeout`` seconds, then
        ``policy_timeout_verdict``). The verdict is cached: :meth:`decide` returns it afterwards."""
        names = self.bindings.names(addr, now)
        name = min(names) if names else None
        key = (name, addr, port, proto)
        return await self._pending_call(key, PolicyRequest(PROTO_NAMES[proto], addr, port, name, guest_text(guest)),
                                        name)

    async def _pending_call(self, key, req: PolicyRequest, name) -> Decision:
        """The async hook's :class:`Decision` on ``req``, one call per ``key`` at a time."""
        fut = self._pending.get(key)
        if fut is None:
            fut = self._pending[key] = asyncio.ensure_future(self._run_hook(key, req, name, self._gen))
            fut.add_done_callback(functools.partial(self._done, key))
        return await asyncio.shield(fut)

    def _done(self, key, fut) -> None:
        if self._pending.get(key) is fut:  # (not a newer call of the same key, after clear_cache)
            del self._pending[key]

    async def _run_hook(self, key, req, name, gen: int, value=None) -> Decision:
        """The hook's :class:`Decision` on ``req`` (``value``: what a call already returned),
        cached unless :meth:`clear_cache` ran since generation ``gen``."""
        try:
            if value is None:
                value = self.hook(req)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout)
            d = self._verdict(value, name)
        except asyncio.TimeoutError:
            self.counters["egress.hook_timeouts"] = self.counters.get("egress.hook_timeouts", 0) + 1
            d = Decision(self.timeout_allow, f"policy hook timeout ({self.timeout:g} s)", name, "hook_timeout")
        except Exception:
            log.exception("egress policy hook failed on %r: denied", req)
            d = Decision(False, "policy hook", name, "hook_error")
        if gen == self._gen:
            self._remember(key, d, asyncio.get_running_loop().time())
        return d

    # ------------------------------------------------------------------ DNS
    def dns_verdict(self, name: str, now: float = 0.0, guest=None, dst: str = "") -> tuple[int, str]:
        """May the guest resolve ``name`` (lower case, no trailing dot) at loop time ``now``?
        ``(code, rule_text)``: code 0 for yes (the rule: the most specific allow rule matching the
        name, the hook's verdict ``"policy hook[: REASON]"`` or ``"egress-default allow"``), else
        the RFC 8914 INFO-CODE of the NXDOMAIN to answer: 15 (Blocked: a deny rule without ports or
        protocol is the most specific match, or the hook denied the name, or failed, or timed out
        under ``policy_timeout_verdict`` deny) or 18 (Prohibited: ``egress_default deny``, no allow
        rule matches the name, no hook). Rules with ports or a protocol do not block a name: they
        decide its flows.

        What no rule decides goes to the hook (a :class:`PolicyRequest` of ``proto`` ``"dns"``,
        ``dst`` the virtual DNS address ``dst``, ``guest`` the guest's endpoint), its verdict cached
        per name for ``policy_cache_ttl`` seconds. An async hook not yet asked gives
        :data:`DNS_PENDING`: await :meth:`dns_ask` for the verdict."""
        for r in self.rules.name_rules(name):
            if r.allow:
                return 0, r.text
            if r.unrestricted:
                return EDE_BLOCKED, r.text
        if self.hook is not None:
            key = (name, 53, "dns")
            hit = self._hook_cache.get(key)
            if hit is not None and hit[1] > now:
                return _dns_code(hit[0])
            if not self.hook_async:
                value = self._call(key, PolicyRequest("dns", dst, 53, name, guest_text(guest)), name)
                if value is not _PENDING:
                    return _dns_code(self._remember(key, self._verdict(value, name), now))
            return DNS_PENDING, "policy hook"
        if self.default_allow:
            return 0, "egress-default allow"
        return EDE_PROHIBITED, "egress-default deny"

    async def dns_ask(self, name: str, guest=None, dst: str = "") -> tuple[int, str]:
        """Await the async hook's verdict on resolving ``name`` (after :meth:`dns_verdict` gave
        :data:`DNS_PENDING`): one call per name at a time, ``policy_timeout`` seconds, then
        ``policy_timeout_verdict``; cached as :meth:`dns_verdict` says. Returns ``(code, rule)``
        as :meth:`dns_verdict`."""
        key = (name, 53, "dns")
        d = await self._pending_call(key, PolicyRequest("dns", dst, 53, name, guest_text(guest)), name)
        # the rules may have changed meanwhile: they decide first, then the verdict now cached
        code, rule = self.dns_verdict(name, asyncio.get_running_loop().time(), guest, dst)
        return _dns_code(d) if code == DNS_PENDING else (code, rule)

    def may_bind(self, addr: str) -> bool:
        """May an upstream DNS answer bind ``addr`` (text)? See :meth:`bind_answer`."""
        cls = address_class(addr)
        return cls == GLOBAL or (cls == SPECIAL and self.rules.covers(addr) is not None)

    def bind_answer(self, name: str, addrs, now: float, trusted: bool = False) -> int:
        """Bind the ``(address text, ttl seconds)`` pairs of an allowed answer for ``name`` at loop
        time ``now`` (each TTL clamped to ``[dns_binding_ttl_min, dns_binding_ttl_max]``); at most
        ``max_dns_bindings_per_answer`` of them (the rest: ``egress.dns_bindings_capped``). Returns
        how many were bound.

        An upstream answer (``trusted`` False) binds no address that is not globally reachable
        (DNS rebinding: whoever controls an allowed name's DNS could otherwise open the host's
        loopback services through the gateway, or its LAN, container bridges, VPN): never a
        loopback, unspecified, link-local, multicast or broadcast address (:data:`NEVER_BOUND`),
        and a special-purpose one (:data:`SPECIAL_BOUND`: private, shared 100.64/10, unique local
        fc00::/7, documentation, ...; IPv4-mapped and other embedding forms alike,
        :func:`address_class`) only when a user's CIDR allow rule, with any ports, covers it.
        Each refused address is counted ``egress.dns_bindings_refused``. The owner's
        ``dns_records`` (``trusted``) bind any address."""
        n = 0
        for addr, ttl in addrs:
            if not trusted and not self.may_bind(addr):
                self.counters["egress.dns_bindings_refused"] = self.counters.get("egress.dns_bindings_refused", 0) + 1
                continue
            if n >= self.per_answer:
                self.counters["egress.dns_bindings_capped"] = self.counters.get("egress.dns_bindings_capped", 0) + 1
                break
            ttl = min(max(float(ttl), self.ttl_min), self.ttl_max)
            self.bindings.bind(addr, name, now + ttl, trusted)
            n += 1
        return n


def _dns_code(d: Decision) -> tuple[int, str]:
    """``(code, rule)`` of :meth:`Egress.dns_verdict` for a hook's :class:`Decision`."""
    return (0, d.rule) if d.allowed else (EDE_BLOCKED, d.rule)


def _nets(text: str) -> tuple:
    return tuple(ipaddress.ip_network(n) for n in text.split())


#: Never bound from an upstream answer, whatever the rules: loopback, "this network" (0/8;
#: ``connect()`` to 0.0.0.0 reaches the host itself), link-local, multicast, broadcast, the
#: unspecified address.
NEVER_BOUND = _nets("0.0.0.0/8 127.0.0.0/8 169.254.0.0/16 224.0.0.0/4 255.255.255.255/32 "
                    "::/128 ::1/128 fe80::/10 ff00::/8")
#: Bound from an upstream answer only when a CIDR allow rule covers the address: the
#: special-purpose ranges not globally reachable (RFC 6890 and the IANA special-purpose address
#: registries: private use, shared address space 100.64/10 (RFC 6598), IETF protocol
#: assignments, documentation, benchmarking, reserved; unique local fc00::/7, site-local,
#: discard-only, local-use NAT64 (RFC 8215), SRv6 SIDs (RFC 9602)); every IPv6 address outside
#: global unicast 2000::/3 but the NAT64 prefix 64:ff9b::/96 is treated alike.
SPECIAL_BOUND = _nets("10.0.0.0/8 100.64.0.0/10 172.16.0.0/12 192.0.0.0/24 192.0.2.0/24 192.168.0.0/16 "
                      "198.18.0.0/15 198.51.100.0/24 203.0.113.0/24 240.0.0.0/4 "
                      "100::/64 2001::/23 2001:db8::/32 3fff::/20 5f00::/16 fc00::/7 fec0::/10 64:ff9b:1::/48")
_GLOBAL6 = ipaddress.ip_network("2000::/3")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_6TO4 = ipaddress.ip_network("2002::/16")
#: :func:`address_class` values.
GLOBAL, SPECIAL, NEVER = 0, 1, 2


def address_class(addr: str) -> int:
    """How an upstream DNS answer may bind ``addr`` (address text, a ``%scope`` ignored):
    :data:`GLOBAL` (bound), :data:`SPECIAL` (a range of :data:`SPECIAL_BOUND`: bound only under a
    covering CIDR allow rule) or :data:`NEVER` (:data:`NEVER_BOUND`, or not an address). An IPv6
    address that embeds an IPv4 one (IPv4-mapped ``::ffff:0:0/96``, IPv4-compatible ``::/96``,
    NAT64 ``64:ff9b::/96`` (RFC 6052), 6to4 ``2002::/16`` (RFC 3056)) is at least as restricted
    as the IPv4 address it embeds."""
    try:
        ip = ipaddress.ip_address(addr)  # (an IPv6 %scope is kept by ipaddress and changes nothing here)
    except ValueError:
        return NEVER
    worst = GLOBAL
    if ip.version == 6:
        v = int(ip)
        if ip.ipv4_mapped is not None or 1 < v < 1 << 32 or ip in _NAT64:  # the IPv4 address decides
            return address_class(str(ipaddress.IPv4Address(v & 0xFFFFFFFF)))
        if ip in _6TO4:
            worst = address_class(str(ip.sixtofour))
    for net in NEVER_BOUND:
        if ip.version == net.version and ip in net:
            return NEVER
    for net in SPECIAL_BOUND:
        if ip.version == net.version and ip in net:
            return max(worst, SPECIAL)
    if ip.version == 6 and ip not in _GLOBAL6:
        return max(worst, SPECIAL)
    return worst


def guest_text(guest) -> str | None:
    """``"ip:port"`` (``"[v6]:port"``) of a guest endpoint given as ``(address bytes, port)`` or text."""
    if guest is None or isinstance(guest, str):
        return guest
    ip, port = guest
    if len(ip) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, ip)}:{port}"
    return f"[{socket.inet_ntop(socket.AF_INET6, ip)}]:{port}"


def guest_fields(guest) -> tuple[str | None, int | None]:
    """``(address text, port)`` of a guest endpoint given as ``(address bytes, port)``, as
    ``"ip:port"`` / ``"[v6]:port"`` text, or ``None`` -- the ``guest`` and ``guest_port`` of an
    audit record, as in the flow records."""
    if guest is None:
        return None, None
    if isinstance(guest, str):
        host, _, digits = guest.rpartition(":")
        return host.strip("[]"), int(digits) if digits.isdigit() else None
    ip, port = guest
    return socket.inet_ntop(socket.AF_INET if len(ip) == 4 else socket.AF_INET6, ip), port


def wall() -> float:
    """Seconds since the epoch (audit records)."""
    return time.time()
