"""Admission control for guest-initiated flows.

Theory of operation
-------------------
The guest is untrusted: whatever it sends, the stack must stay bounded in host fds, memory
and CPU, and must never open more of the host than configured. Per-packet work is already
bounded (fixed-size parsing, the bounded inject queue, per-flow TCP buffers, the fragment
reassemblers); what a hostile guest can multiply is *flows*, each holding a host socket and
a task. So every guest-initiated flow passes :meth:`Guard.admit` once, at creation (a TCP SYN,
a UDP flow's first datagram, an ICMP echo flow's first request), and never afterwards: the
cost on the packet path of an existing flow is zero.

:meth:`Guard.admit` checks, in this order, and the first that fails refuses the new flow:

1. the egress policy (:mod:`aioslirp.flow.egress`: rules by address, name, port and protocol,
   the DNS name bindings, the Python hook): a denied destination is answered with ICMP
   destination unreachable, *communication administratively prohibited* (ICMP type 3 code
   13; ICMPv6 type 1 code 1), counted as ``drop.egress_denied`` and by reason as
   ``egress.denied_rule`` (a deny rule, the built-in defaults included), ``egress.denied_default``
   (``egress_default deny``) or ``egress.denied_hook`` (the Python hook, its timeout or error).
   While an async hook is asked, the flow is held (:data:`HELD`: a TCP SYN gets no answer yet,
   a UDP datagram waits; at most ``max_pending_connects`` held at once, beyond: refused as
   ``limit_pending_connects``). The decision of the last admitted flow is :attr:`Guard.decision`;
2. the per-protocol flow caps ``max_tcp_flows`` / ``max_udp_flows`` / ``max_icmp_flows``
   (``drop.limit_tcp_flows``...), and the open-file limit: each flow may hold one host socket,
   and so may each DNS query in flight, so the process's soft ``RLIMIT_NOFILE`` is raised
   towards ``max_flows`` + ``dns_max_inflight`` + :data:`FD_RESERVE` (up to the hard limit);
   what it allows beyond the reserve is split by :func:`fd_budgets` between flows (more are
   refused, ``drop.limit_fds``) and DNS queries (the forwarder's in-flight cap is lowered to
   its share: more get no answer, ``DnsForwarder.stats["overload"]``);
3. for TCP towards the host: the pending host connects, i.e. SYNs whose host ``connect()`` has
   not completed yet, at most ``max_pending_connects`` in all and a quarter of that towards
   any one ``(address, port)`` (``drop.limit_pending_connects``), so that a SYN flood against
   a black hole cannot block connections to other destinations;
4. the new-flow rate, a token bucket of ``new_flow_burst`` tokens refilled at
   ``new_flow_rate`` per second (``drop.limit_new_flow_rate``).

A refused TCP SYN gets a RST (the guest's connect fails at once with ECONNREFUSED), a refused
UDP datagram or ICMP echo is dropped; flows that exist keep working. Should the kernel still
give no socket to an admitted flow (``EMFILE`` because something else holds fds, ``ENFILE``,
``ENOBUFS``...), the flow is refused the same way (``drop.tcp_socket_error``,
``drop.udp_socket_error``, ``drop.icmp_socket_error``) and never enters the flow table. The
total flow-table bound (``max_flows``, with eviction of the longest-idle UDP/ICMP flow) stays in
:meth:`FlowTable.make_room <aioslirp.flow.table.FlowTable.make_room>`, which also covers port
forwards.

The guard learns about flows from :meth:`FlowTable.add <aioslirp.flow.table.FlowTable.add>` /
:meth:`~aioslirp.flow.table.FlowTable.remove` (:meth:`Guard.opened` / :meth:`Guard.closed`), so
its per-protocol counts are exact; the table's idle sweep re-counts them (:meth:`Guard.recount`).
A pending connect leaves the pending set when its host socket is connected or the flow ends;
the set is swept lazily (at most every :data:`PRUNE_INTERVAL` seconds), only when a bound is
reached.

Idle flows are the flow table's business (:mod:`aioslirp.flow.table`, one sweep for every flow
kind): a TCP flow that carried no guest segment for ``tcp_idle_timeout`` seconds is reset (RST
to the guest and to the host peer, ``tcp_idle_closed``). aioslirp sends no keepalives towards
the guest; the guest's own keepalives count as activity.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, SupportsInt

from ..config.identity import NO_IDENTITY, GuestIdentity
from .egress import Decision, Egress, guest_fields, wall

__all__ = ["DENIED", "FD_RESERVE", "HELD", "PRUNE_INTERVAL", "Guard", "fd_budgets", "raise_fd_limit"]

log = logging.getLogger("aioslirp.limits")

#: Verdict of :meth:`Guard.admit` for a destination the egress policy denies.
DENIED = "egress_denied"
#: Verdict of :meth:`Guard.admit` while an async policy hook decides (hold the packet, see :meth:`Guard.ask`).
HELD = "egress_held"
#: Seconds between two sweeps of the pending-connect set while a bound is reached.
PRUNE_INTERVAL = 0.005
_NAMES = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmp"}
_LOGGED_MAX = 64
_FIELD_OF = {"limit_fds": "open-file limit (ulimit -n)", "limit_tcp_flows": "max_tcp_flows", "limit_udp_flows": "max_udp_flows",
             "limit_icmp_flows": "max_icmp_flows", "limit_pending_connects": "max_pending_connects",
             "limit_new_flow_rate": "new_flow_rate"}


#: File descriptors kept out of the flow and DNS budgets (see :func:`fd_budgets`): listeners,
#: the API socket, captures, the transport, the event loop's own.
FD_RESERVE = 256


def fd_budgets(soft_limit: SupportsInt, max_flows: SupportsInt, dns_max_inflight: SupportsInt) -> tuple[int, int]:
    """``(flows, dns_queries)`` that a soft ``RLIMIT_NOFILE`` of ``soft_limit`` fds allows, each
    holding one host socket, with :data:`FD_RESERVE` fds kept for everything else.

    When the limit allows ``max_flows + dns_max_inflight`` beyond the reserve, DNS gets
    ``dns_max_inflight`` and flows the rest; below that both are cut in proportion (at least
    one DNS query when any fd is left). Never negative; their sum never exceeds
    ``soft_limit - FD_RESERVE``.
    """
    avail = max(0, int(soft_limit) - FD_RESERVE)
    flows, dns = max(0, int(max_flows)), max(0, int(dns_max_inflight))
    if avail >= flows + dns:
        return avail - dns, dns
    share = avail * dns // (flows + dns)
    if dns and avail and not share:
        share = 1
    return avail - share, share


def raise_fd_limit(want: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` towards ``want`` (never above the hard limit,
    never lowering it), as the Go runtime and systemd services do. Returns the soft limit now
    in force (a very large number for "unlimited")."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    if soft == inf:
        return 1 << 30
    target = want if hard == inf else min(want, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # pragma: no cover - a sandbox that forbids it
            pass
    return soft


class Guard:
    """Admission control of one :class:`~aioslirp.stack.Stack` (see the module documentation).

    Args:
        config: the stack's validated ``NetworkConfig``.
        drop: ``drop(reason)``, the stack's count of a dropped guest frame (``drop.<reason>``).
        new_bucket: ``new_bucket(now)`` makes the new-flow rate limiter when the stack starts,
            an object with ``take(now) -> bool`` (a ``TokenBucket`` of ``new_flow_burst``
            tokens at ``new_flow_rate`` per second, full at loop time ``now``), or ``None`` for
            no rate limit.

        ctx: the stack's :class:`~aioslirp.flow.context.FlowContext` (counters, ``ctx.audit``), or ``None``.
        hook: the Python policy hook (``Stack(policy=...)``), default ``config.policy``.
        fd_limit: ``fd_limit(want) -> soft limit``, raises the open-file limit towards ``want``
            (default :func:`raise_fd_limit`; a test gives the limit it wants to see).

    Attributes:
        policy: the :class:`~aioslirp.flow.egress.Egress` built from the config (rules by CIDR,
            name, port and protocol; ``add`` / ``remove`` / ``list_rules`` at run time).
        decision: the :class:`~aioslirp.flow.egress.Decision` of the last flow :meth:`admit` let
            through (``None`` before any, or with no policy).
        active: open flows by protocol name (``"tcp"``, ``"udp"``, ``"icmp"``), both families.
        caps: the per-protocol caps from the config.
    """

    __slots__ = ("config", "_drop", "policy", "caps", "active", "max_pending", "max_pending_dest", "_pending",
                 "_pending_dest", "_pruned_at", "_new_bucket", "bucket", "fd_budget", "dns_fd_budget", "dns_inflight",
                 "_logged", "ctx", "counters", "decision", "held")

    config: Any
    _drop: Callable[[str], object]
    policy: Egress
    ctx: Any
    counters: dict
    decision: Decision | None
    #: Flows held while an async hook decides.
    held: int
    caps: dict[str, int]
    active: dict[str, int]
    max_pending: int
    max_pending_dest: int
    _pending: dict
    _pending_dest: dict
    _pruned_at: float
    _new_bucket: Any
    bucket: Any
    fd_budget: int
    dns_fd_budget: int
    dns_inflight: int
    _logged: set

    def __init__(self, config, drop, new_bucket=None, ctx=None, hook=None,
                 fd_limit: Callable[[int], int] | None = None) -> None:
        cfg = self.config = config
        self._drop = drop
        self.ctx = ctx
        self.counters = ctx.counters if ctx is not None else {}
        self.policy = Egress(cfg, self.counters, hook)
        self.policy.ctx = ctx
        self.decision = None
        self.held = 0
        self.caps = {"tcp": int(cfg.max_tcp_flows), "udp": int(cfg.max_udp_flows), "icmp": int(cfg.max_icmp_flows)}
        self.active = {"tcp": 0, "udp": 0, "icmp": 0}
        self.max_pending = int(cfg.max_pending_connects)
        #: At most this many pending connects towards one (address, port).
        self.max_pending_dest = max(1, self.max_pending // 4)
        self._pending: dict = {}  # flow -> (remote, port)
        self._pending_dest: dict = {}  # (remote, port) -> count
        self._pruned_at = float("-inf")
        self._new_bucket = new_bucket
        #: The new-flow rate limiter (made by :meth:`start`), or ``None``.
        self.bucket = None
        max_flows, dns_max = int(cfg.max_flows), int(cfg.dns_max_inflight)
        soft = (fd_limit or raise_fd_limit)(max_flows + dns_max + FD_RESERVE)
        #: Flows allowed by the process's open-file limit (each may hold one host socket), and
        #: DNS queries allowed in flight (each may hold one upstream socket); see :func:`fd_budgets`.
        self.fd_budget, self.dns_fd_budget = fd_budgets(soft, max_flows, dns_max)
        if self.fd_budget < max_flows:
            log.warning("the open-file limit (ulimit -n) allows about %d flows, below max_flows=%d: "
                        "more are refused (drop.limit_fds)", self.fd_budget, max_flows)
        if self.dns_fd_budget < dns_max:
            log.warning("the open-file limit (ulimit -n) allows %d DNS queries in flight, below "
                        "dns_max_inflight=%d: more get no answer (DNS overload)", self.dns_fd_budget, dns_max)
        #: DNS-over-UDP queries being answered (the stack drops more than ``dns_max_inflight``;
        #: all queries, UDP and TCP, are bounded by the forwarder itself, ``DnsForwarder.max_inflight``,
        #: which :meth:`start` lowers to :attr:`dns_fd_budget`).
        self.dns_inflight = 0
        self._logged: set = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self, dns=None, *, now: float) -> None:
        """Make the new-flow rate limiter, full at ``now`` (seconds: the stack's loop time), hook
        the DNS forwarder ``dns``'s upstream check to the policy and cap its queries in flight to
        :attr:`dns_fd_budget` (``Stack.start``)."""
        if self._new_bucket is not None:
            self.bucket = self._new_bucket(now)
        if dns is not None:
            dns.policy = self.policy
            dns.max_inflight = min(dns.max_inflight, self.dns_fd_budget)

    def dns_admit(self) -> bool:
        """May one more DNS-over-UDP query be answered? At most ``dns_max_inflight`` queries, and
        no more than the DNS share of the open-file limit (:attr:`dns_fd_budget`), are in flight;
        the caller drops the rest (``drop.dns_too_many_queries``)."""
        return self.dns_inflight < min(self.config.dns_max_inflight, self.dns_fd_budget)

    def dns_track(self, task: asyncio.Task) -> None:
        """Count a DNS-over-UDP query task in :attr:`dns_inflight` until it ends."""
        self.dns_inflight += 1
        task.add_done_callback(self._dns_done)

    def _dns_done(self, _task) -> None:
        self.dns_inflight -= 1

    @property
    def pending(self) -> int:
        """TCP flows whose host connect may still be in progress (swept lazily)."""
        return len(self._pending)

    # ------------------------------------------------------------------ admission
    def admit(self, proto: int, remote: str | None, port: int, now: float,
              guest: tuple | str | None = None, seen: bytes | None = None) -> str | None:
        """May the guest open a new flow of ``proto`` (6, 17, 1 or 58) to host address ``remote``
        (text; ``None`` for a local service such as DNS over TCP) and ``port``?

        Returns ``None`` to admit (:attr:`decision` then says which rule and name allowed it),
        :data:`DENIED` when the egress policy denies the flow (answer ICMP administratively
        prohibited), :data:`HELD` while an async policy hook decides (answer nothing; see
        :meth:`ask`), or the name of the bound that was hit (answer a TCP SYN with a RST, drop
        anything else). Each refusal is counted as ``drop.<verdict>``. ``port``: 0 for an echo
        flow. ``now``: seconds on the clock :meth:`start` was given (the loop's). ``guest``: the
        guest's endpoint, ``(address bytes, port)`` or ``"ip:port"``, for the hook and the audit log;
        ``seen``: the destination address as the guest sent to it (bytes), for the audit log.
        """
        self.decision = None
        if remote is not None:
            policy = self.policy
            if not policy.empty:
                d = self.decision = policy.decide(proto, remote, port, now, guest)
                if not d.allowed:
                    if d.reason == "pending":
                        if self.held >= self.max_pending:
                            return self._refuse("limit_pending_connects")
                        self.held += 1  # until ask() returns
                        return HELD
                    self.deny(d, proto, remote, port, guest, seen, now)
                    return DENIED
        name = _NAMES.get(proto, "tcp")
        active = self.active
        if active[name] >= self.caps[name]:
            return self._refuse("limit_" + name + "_flows")
        if active["tcp"] + active["udp"] + active["icmp"] >= self.fd_budget:
            return self._refuse("limit_fds")
        if name == "tcp" and remote is not None:
            dest = (remote, port)
            if len(self._pending) >= self.max_pending or self._pending_dest.get(dest, 0) >= self.max_pending_dest:
                self._prune(now)
                if len(self._pending) >= self.max_pending or self._pending_dest.get(dest, 0) >= self.max_pending_dest:
                    return self._refuse("limit_pending_connects")
        bucket = self.bucket
        if bucket is not None and not bucket.take(now):
            return self._refuse("limit_new_flow_rate")
        return None

    def admitted(self, flow, remote: str | None) -> tuple[str | None, str | None]:
        """``(name, rule)`` a new guest-initiated ``flow`` (being created right after :meth:`admit`
        let it through) carries: the DNS name its address is bound to and that decided (``None``
        when none did), and the text of the rule (or ``"policy hook..."``) that allowed it
        (``None`` when no rule decided, e.g. ``egress_default allow``). ``(None, None)`` for an
        inbound flow (a port forward) or a local service (``remote`` ``None``). The decision is
        taken: a second call returns ``(None, None)``."""
        d = self.decision
        if d is None or remote is None or flow.direction != "outbound":
            return None, None
        self.decision = None
        return d.name, (d.rule or None)

    def deny(self, d: Decision, proto: int, remote: str, port: int, guest, seen: bytes | None = None,
             now: float | None = None) -> None:
        """Count (``drop.egress_denied``, ``egress.denied_<reason>``), log once per address and
        audit (``ctx.audit``: a ``deny`` record whose ``reason`` is that counter's suffix, ``rule``,
        ``default`` or ``hook``) a denial by the egress policy. The record's ``name`` is the
        deciding name, else a name the address is bound to at ``now`` (the first in order): a
        port the name's rule does not allow still says which name the guest meant."""
        self._drop(DENIED)
        reason = "hook" if d.reason.startswith("hook") else d.reason
        key = "egress.denied_" + reason
        c = self.counters
        c[key] = c.get(key, 0) + 1
        if remote not in self._logged and len(self._logged) < _LOGGED_MAX:
            self._logged.add(remote)
            ident = self._identity()
            log.info("%segress policy: guest traffic to %s denied (%s)", ident.log_prefix, remote, d.rule,
                     extra=ident.log_extra)
        ctx = self.ctx
        a = ctx.audit if ctx is not None else None
        if a is not None:
            g, gport = guest_fields(guest)
            name = d.name
            if name is None and now is not None:
                bound = self.policy.bindings.names(remote, now)
                name = min(bound) if bound else None
            a.record({"event": "deny", "time": wall(), "proto": _NAMES.get(proto, "tcp"), "guest": g,
                      "guest_port": gport, "dst": seen if seen is not None else remote, "port": port, "host": remote,
                      "name": name, "verdict": "deny", "rule": d.rule, "reason": reason})

    async def ask(self, proto: int, remote: str, port: int, now: float, guest=None, seen: bytes | None = None) -> bool:
        """A flow :meth:`admit` held (:data:`HELD`): await the async hook's verdict (bounded by
        ``policy_timeout``); a denial is counted and audited here (the caller answers ICMP
        administratively prohibited), an allowed flow goes through :meth:`admit` again (its
        verdict is cached now). Returns the verdict."""
        try:
            d = await self.policy.ask(proto, remote, port, now, guest)
        finally:
            self.held = max(0, self.held - 1)
        if not d.allowed:
            self.deny(d, proto, remote, port, guest, seen, now)
        return d.allowed

    def _identity(self) -> GuestIdentity:
        """The stack's guest identity (for its log lines), or the empty one without a context (or
        a context of one's own without it)."""
        return getattr(self.ctx, "identity", NO_IDENTITY)

    def _refuse(self, reason: str) -> str:
        self._drop(reason)
        if reason not in self._logged:
            self._logged.add(reason)
            ident = self._identity()
            log.warning("%srefusing new guest flows: the %s bound is reached (counted as drop.%s; logged once; "
                        "see --limit)", ident.log_prefix, _FIELD_OF.get(reason, reason), reason, extra=ident.log_extra)
        return reason

    def _prune(self, now: float) -> None:
        """Forget pending connects that completed or ended (at most every PRUNE_INTERVAL seconds)."""
        if now - self._pruned_at < PRUNE_INTERVAL:
            return
        self._pruned_at = now
        done = [f for f in self._pending if f.transport is not None or f.done.done()]
        for f in done:
            self._forget(f)

    def _forget(self, flow) -> None:
        dest = self._pending.pop(flow, None)
        if dest is not None:
            n = self._pending_dest[dest] - 1
            if n:
                self._pending_dest[dest] = n
            else:
                del self._pending_dest[dest]

    # ------------------------------------------------------------------ flow table hooks
    def opened(self, flow) -> None:
        """:meth:`FlowTable.add <aioslirp.flow.table.FlowTable.add>` calls this for every flow
        entering the table."""
        name = flow.proto_name
        if name in self.active:
            self.active[name] += 1
        if name == "tcp" and flow.remote is not None and flow.direction != "inbound" and flow.transport is None:
            dest = (flow.remote, flow.dst_port)
            self._pending[flow] = dest
            self._pending_dest[dest] = self._pending_dest.get(dest, 0) + 1

    def connected(self, flow) -> None:
        """A TCP flow's host connect completed: it no longer counts as a pending connect."""
        if self._pending:
            self._forget(flow)

    def closed(self, flow) -> None:
        """:meth:`FlowTable.remove <aioslirp.flow.table.FlowTable.remove>` calls this once for every
        flow leaving the table."""
        name = flow.proto_name
        if name in self.active and self.active[name] > 0:
            self.active[name] -= 1
        if self._pending:
            self._forget(flow)

    def recount(self, flows) -> None:
        """Re-count :attr:`active` from ``flows`` (the table's flows; the idle sweep calls this):
        a flow that left the table without :meth:`closed` must not hold a slot for ever."""
        counts = dict.fromkeys(self.active, 0)
        for f in flows:
            if f.proto_name in counts:
                counts[f.proto_name] += 1
        self.active = counts
