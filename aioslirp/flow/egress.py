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

Cost: decisions are cached per host address, then per ``(port, protocol)``, until the earliest
expiry of the bindings used (and the hook's ``policy_cache_ttl``); a rule change or a new
binding for the address empties the address's entry. A repeated check is two dict look-ups.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import socket
import time

from ..config.policy import EgressPolicy

__all__ = ["Decision", "Egress", "NameBindings", "PolicyRequest"]

log = logging.getLogger("aioslirp.limits")

_INF = float("inf")
_DNS_PORTS = (53, 853)
#: Host addresses whose decisions are cached at most, and ``(port, protocol)`` pairs per address
#: (then that cache starts over).
VERDICT_CACHE = 4096
#: Hook verdicts cached at most.
HOOK_CACHE = 4096
PROTO_NAMES = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmp"}


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
    """What the Python hook is asked about: ``proto`` (``"tcp"``, ``"udp"``, ``"icmp"``), ``dst``
    (host-side address text), ``port`` (0 for ICMP), ``name`` (the bound DNS name, or ``None``),
    ``guest`` (``"ip:port"`` text, or ``None`` when unknown)."""

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


class NameBindings:
    """Address -> names learned from the virtual DNS's answers, each until its expiry (loop time, s).

    At most ``limit`` (address, name) pairs: binding one more evicts the oldest
    (``counters["egress.dns_bindings_evicted"]``). ``on_change(addr)`` is called when an address
    gains a name (the verdict cache forgets it).
    """

    __slots__ = ("limit", "counters", "_pairs", "_by_addr", "on_change")

    limit: int
    counters: dict
    _pairs: dict
    _by_addr: dict
    on_change: object

    def __init__(self, limit: int = 4096, counters=None, on_change=None) -> None:
        self.limit = max(1, int(limit))
        self.counters = counters if counters is not None else {}
        self._pairs: dict = {}  # (addr, name) -> expiry, oldest first
        self._by_addr: dict = {}  # addr -> {name: expiry}
        self.on_change = on_change

    def __len__(self) -> int:
        return len(self._pairs)

    def bind(self, addr: str, name: str, expiry: float) -> None:
        """Bind ``addr`` (canonical address text) to ``name`` (lower case) until loop time ``expiry``."""
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
        pairs[key] = expiry
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
                 "_pending", "_default", "_version", "ctx", "names_wanted")

    config: object
    counters: dict
    rules: EgressPolicy
    bindings: NameBindings
    default_allow: bool
    hook: object
    hook_async: bool
    timeout: float
    timeout_allow: bool
    hook_ttl: float
    ttl_min: float
    ttl_max: float
    per_answer: int
    _cache: dict
    _hook_cache: dict
    _pending: dict
    _default: Decision
    _version: int
    #: The stack's FlowContext (for ``ctx.running`` / ``ctx.audit``), or ``None``.
    ctx: object
    #: Something besides the rules needs the name bindings (a flow handler's route by name).
    names_wanted: bool

    def __init__(self, config, counters=None, hook=None) -> None:
        self.config = config
        self.counters = counters if counters is not None else {}
        self.rules = EgressPolicy.from_config(config)
        self.default_allow = getattr(config, "egress_default", "allow") != "deny"
        self._default = _ALLOW_ALL if self.default_allow else Decision(False, "egress-default deny", None, "default")
        self.bindings = NameBindings(getattr(config, "max_dns_bindings", 4096), self.counters, self._forget)
        self.ttl_min = float(getattr(config, "dns_binding_ttl_min", 30.0))
        self.ttl_max = float(getattr(config, "dns_binding_ttl_max", 3600.0))
        self.per_answer = int(getattr(config, "max_dns_bindings_per_answer", 64))
        self.set_hook(hook if hook is not None else getattr(config, "policy", None))
        self.timeout = float(getattr(config, "policy_timeout", 1.0))
        self.timeout_allow = getattr(config, "policy_timeout_verdict", "deny") == "allow"
        self.hook_ttl = float(getattr(config, "policy_cache_ttl", 10.0))
        self._cache: dict = {}  # addr -> {(port, proto): (Decision, until)}
        self._hook_cache: dict = {}  # (name or addr, port, proto) -> (Decision, until)
        self._pending: dict = {}  # hook key -> Future of the Decision
        self._version = self.rules.version
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
    def add(self, text: str, allow: bool = True) -> str:
        """Add a user rule (``"pypi.org:443"``...); returns its canonical text; raises ``ConfigError``."""
        out = self.rules.add(text, allow)
        self.clear_cache()
        return out

    def remove(self, text: str, close: bool = False):
        """Remove a user rule; returns the removed :class:`~aioslirp.config.policy.Rule` or ``None``.
        ``close``: then end (:meth:`close_denied`) the open guest flows the rules no longer allow,
        i.e. those a removed allow alone allowed. Raises ``ConfigError`` for a malformed text."""
        r = self.rules.remove(text)
        if r is not None:
            self.clear_cache()
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

    rules_list = list_rules

    def clear_cache(self) -> None:
        """Forget every cached decision (rules or hook changed)."""
        self._cache = {}
        self._hook_cache = {}

    def _forget(self, addr: str) -> None:
        self._cache.pop(addr, None)

    # ------------------------------------------------------------------ decisions
    def decide(self, proto: int, addr: str, port: int, now: float, guest: str | None = None) -> Decision:
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
        if per is None:
            if len(self._cache) >= VERDICT_CACHE:
                self._cache = {}
            per = self._cache[addr] = {}
        elif len(per) >= VERDICT_CACHE:  # a guest walking the ports of one address
            per.clear()
        per[(port, proto)] = (d, until)
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
            return self._ask_hook(PROTO_NAMES.get(proto, "tcp"), proto, addr, port, name, guest, now, until)
        return self._default, until

    # ------------------------------------------------------------------ the Python hook
    def _ask_hook(self, pname, proto, addr, port, name, guest, now, until) -> tuple[Decision, float]:
        key = (name or addr, port, proto)
        hit = self._hook_cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0], min(until, hit[1])
        req = PolicyRequest(pname, addr, port, name, guest_text(guest))
        if not self.hook_async:
            d = self._verdict(self._call(req), name)
            return self._remember(key, d, now), min(until, now + self.hook_ttl)
        return Decision(False, "policy hook", name, "pending"), now

    def _call(self, req):
        try:
            return self.hook(req)
        except Exception:  # a broken hook denies, loudly
            log.exception("egress policy hook failed on %r: denied", req)
            return None

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

    async def ask(self, proto: int, addr: str, port: int, now: float, guest: str | None = None) -> Decision:
        """Await the async hook's verdict for a flow whose :meth:`decide` was ``"pending"`` (one call
        per ``(name or address, port, protocol)`` at a time; ``policy_timeout`` seconds, then
        ``policy_timeout_verdict``). The verdict is cached: :meth:`decide` returns it afterwards."""
        names = self.bindings.names(addr, now) if self.hook is not None else {}
        name = min(names) if names else None
        key = (name or addr, port, proto)
        fut = self._pending.get(key)
        if fut is None:
            fut = self._pending[key] = asyncio.ensure_future(self._run_hook(key, PolicyRequest(
                PROTO_NAMES.get(proto, "tcp"), addr, port, name, guest_text(guest)), name))
            fut.add_done_callback(lambda _f, k=key: self._pending.pop(k, None))
        return await asyncio.shield(fut)

    async def _run_hook(self, key, req, name) -> Decision:
        try:
            value = await asyncio.wait_for(self.hook(req), self.timeout)
            d = self._verdict(value, name)
        except asyncio.TimeoutError:
            self.counters["egress.hook_timeouts"] = self.counters.get("egress.hook_timeouts", 0) + 1
            d = Decision(self.timeout_allow, f"policy hook timeout ({self.timeout:g} s)", name, "hook_timeout")
        except Exception:
            log.exception("egress policy hook failed on %r: denied", req)
            d = Decision(False, "policy hook", name, "hook_error")
        loop = asyncio.get_running_loop()
        self._remember(key, d, loop.time())
        return d

    # ------------------------------------------------------------------ DNS
    def dns_verdict(self, name: str) -> tuple[int, str]:
        """May the guest resolve ``name`` (lower case, no trailing dot)? ``(code, rule_text)``: code
        0 for yes (the rule: the most specific allow rule matching the name, ``"egress-default
        allow"`` or ``"policy hook"``), else the RFC 8914 INFO-CODE of the NXDOMAIN to answer: 15
        (Blocked: a deny rule without ports or protocol is the most specific match) or 18
        (Prohibited: ``egress_default deny``, no allow rule matches the name, no hook to ask).
        Rules with ports or a protocol do not block a name: they decide its flows."""
        for r in self.rules.name_rules(name):
            if r.allow:
                return 0, r.text
            if r.unrestricted:
                return 15, r.text
        if self.hook is not None:
            return 0, "policy hook"
        if self.default_allow:
            return 0, "egress-default allow"
        return 18, "egress-default deny"

    def bind_answer(self, name: str, addrs, now: float, trusted: bool = False) -> int:
        """Bind the ``(address text, ttl seconds)`` pairs of an allowed answer for ``name`` at loop
        time ``now`` (each TTL clamped to ``[dns_binding_ttl_min, dns_binding_ttl_max]``); at most
        ``max_dns_bindings_per_answer`` of them (the rest: ``egress.dns_bindings_capped``). Returns
        how many were bound.

        An upstream answer (``trusted`` False) never binds a loopback, unspecified, link-local or
        multicast address (counted ``egress.dns_bindings_refused``): otherwise whoever controls an
        allowed name's DNS could open the host's own loopback services through the gateway (DNS
        rebinding). Only the owner's ``dns_records`` (``trusted``) and CIDR rules open those."""
        n = 0
        for addr, ttl in addrs:
            if not trusted and _rebinding_target(addr):
                self.counters["egress.dns_bindings_refused"] = self.counters.get("egress.dns_bindings_refused", 0) + 1
                continue
            if n >= self.per_answer:
                self.counters["egress.dns_bindings_capped"] = self.counters.get("egress.dns_bindings_capped", 0) + 1
                break
            ttl = min(max(float(ttl), self.ttl_min), self.ttl_max)
            self.bindings.bind(addr, name, now + ttl)
            n += 1
        return n


def _rebinding_target(addr: str) -> bool:
    """True for an address an upstream DNS answer must not bind (see :meth:`Egress.bind_answer`)."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return True
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast


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
        host, _, port = guest.rpartition(":")
        return host.strip("[]"), int(port) if port.isdigit() else None
    ip, port = guest
    return socket.inet_ntop(socket.AF_INET if len(ip) == 4 else socket.AF_INET6, ip), port


def wall() -> float:
    """Seconds since the epoch (audit records)."""
    return time.time()
