"""Which guest flows go to which Python handler: :class:`Router`, asked once per admitted new flow.

A route is ``(match, handler)``; the first route whose match covers a new flow wins, then (with
``verify_sni``) the SNI verifier for a TCP flow an egress name rule allowed, then the
stack's default handler for the protocol (``Stack(tcp_handler=..., udp_handler=...)``), else
the flow is NATed as usual. The egress policy decides first: a flow it denies (or holds for an
async hook) never reaches a handler.

A match is written like an egress rule (:mod:`aioslirp.config.policy`): ``TARGET[:PORTS][/PROTO]``
with ``TARGET`` a CIDR network or address (matched against the host-side address, as the rules
are: the gateway is the host's loopback), a DNS name or a wildcard ``*.SUFFIX`` (matched against
the names the virtual DNS bound to the destination address, see
:class:`~aioslirp.flow.egress.NameBindings`), or ``*`` (every destination). Without ``/PROTO``
a match covers TCP flows only (a handler is either a TCP or a UDP one): a UDP handler's match
ends with ``/udp``. A list of texts matches when any of them does; ``None`` is ``*``.
Examples: ``"*:80/tcp"``, ``"example.com:443"``, ``"*.internal.test"``, ``"10.0.0.0/8"``,
``"[2001:db8::/32]:53/udp"``.
"""

from __future__ import annotations

import logging

from ..config.policy import KIND_CIDR, addr_int, name_matches, parse_rule

__all__ = ["Route", "Router"]

log = logging.getLogger("aioslirp.handlers")

_TCP, _UDP = 6, 17
_LOG_MAX = 256  # handlers whose first failure is logged with a traceback (then at debug level)


def _rules(match) -> list:
    if match is None:
        match = "*"
    texts = [match] if isinstance(match, str) else list(match)
    rules = []
    for text in texts:
        t = str(text).strip()
        if t == "*" or t.startswith(("*:", "*/")):
            tail = t[1:]
            rules.append(parse_rule("0.0.0.0/0" + tail, "route"))
            rules.append(parse_rule("[::/0]" + tail if tail.startswith(":") else "::/0" + tail, "route"))
        else:
            rules.append(parse_rule(t, "route"))
    for r in rules:
        if r.proto is None:
            r.proto = _TCP
    return rules


class Route:
    """One route: ``match`` (its text or texts, as given), its compiled rules, ``handler``."""

    __slots__ = ("match", "rules", "handler", "names")

    match: object
    rules: list
    handler: object
    #: Some rule is a name or wildcard (the destination's names are looked up).
    names: bool

    def __init__(self, match, handler) -> None:
        self.match = match
        self.rules = _rules(match)
        self.handler = handler
        self.names = any(r.kind != KIND_CIDR for r in self.rules)

    def covers(self, proto: int, addr, port: int, names) -> tuple[bool, str | None]:
        """``(matches, name)`` for a flow of ``proto`` to host-side ``addr`` (``(family, int)`` from
        ``addr_int``) and ``port``, whose destination is bound to ``names`` (an iterable of names)."""
        for r in self.rules:
            if not r.applies(port, proto):
                continue
            if r.kind == KIND_CIDR:
                if addr is not None and addr[0] == r.family and addr[1] & r.mask == r.net:
                    return True, None
            else:
                for n in names:
                    if name_matches(r, n):
                        return True, n
        return False, None

    def __repr__(self) -> str:
        return f"Route({self.match!r}, {self.handler!r})"


class Router:
    """The stack's routes to Python handlers (see the module documentation).

    Args:
        counters: the stack's counters (``handler_errors``, ``handled_flows.tcp`` / ``.udp``).
        egress: the stack's :class:`~aioslirp.flow.egress.Egress` (name bindings; told when a route
            needs names, so that the virtual DNS records them).
        tcp_handler, udp_handler: the defaults after the routes (``None``: NAT).
    """

    __slots__ = ("routes", "tcp_handler", "udp_handler", "counters", "egress", "active", "_logged", "verifier")

    routes: list
    tcp_handler: object
    udp_handler: object
    counters: dict
    egress: object
    #: Any route or default handler: new flows are looked up here.
    active: bool
    _logged: set
    #: ``--verify-sni``'s :class:`~aioslirp.handlers.sni.SniVerifier`: takes the TCP flows a name rule
    #: allowed that no route takes (``None``: off).
    verifier: object

    def __init__(self, counters, egress, tcp_handler=None, udp_handler=None) -> None:
        self.routes: list = []
        self.counters = counters
        self.egress = egress
        self.tcp_handler = tcp_handler
        self.udp_handler = udp_handler
        self._logged: set = set()
        self.verifier = None
        self._update()

    def set_verifier(self, verifier) -> None:
        """Install (``None``: remove) the ``--verify-sni`` handler."""
        self.verifier = verifier
        self._update()

    def _update(self) -> None:
        self.active = (bool(self.routes) or self.tcp_handler is not None or self.udp_handler is not None
                       or self.verifier is not None)
        if self.egress is not None and any(r.names for r in self.routes):
            self.egress.names_wanted = True

    def add(self, match, handler) -> Route:
        """Append a route (last in order; see the module documentation for ``match``). Returns it.
        Raises :class:`~aioslirp.errors.ConfigError` for a match that does not parse,
        ``TypeError`` when ``handler`` is not callable."""
        if not callable(handler):
            raise TypeError(f"handler {handler!r} is not callable")
        route = Route(match, handler)
        self.routes.append(route)
        self._update()
        return route

    def remove(self, what) -> int:
        """Remove the routes that are ``what`` (a :class:`Route`), have it as handler, or were added
        with an equal match. Returns how many. Flows already handled go on."""
        keep = [r for r in self.routes if not (r is what or r.handler is what or r.match == what)]
        n = len(self.routes) - len(keep)
        self.routes = keep
        self._update()
        return n

    def pick(self, proto: int, remote: str, port: int, now: float, decision=None):
        """The handler of a new admitted flow of ``proto`` (6 or 17) to host-side ``remote`` and
        ``port`` at loop time ``now`` (``decision``: the egress :class:`~aioslirp.flow.egress.Decision`,
        or ``None``): ``(handler, name)``, or ``None`` (NAT it)."""
        name = decision.name if decision is not None else None
        names = None
        addr = addr_int(remote)
        for route in self.routes:
            if route.names and names is None:
                names = (name,) if name is not None else tuple(sorted(self._names(remote, now)))
            ok, n = route.covers(proto, addr, port, names or ())
            if ok:
                return route.handler, n or name or self._first_name(remote, now)
        if (self.verifier is not None and proto == _TCP and decision is not None and decision.allowed
                and name is not None and decision.reason == "rule"):  # a name rule allowed it: --verify-sni
            return self.verifier, name
        default = self.tcp_handler if proto == _TCP else self.udp_handler if proto == _UDP else None
        if default is None:
            return None
        return default, name or self._first_name(remote, now)

    def _names(self, remote: str, now: float):
        eg = self.egress
        return eg.bindings.names(remote, now) if eg is not None else {}

    def _first_name(self, remote: str, now: float) -> str | None:
        names = self._names(remote, now)
        return min(names) if names else None

    def failed(self, handler, flow, exc: BaseException) -> None:
        """A handler raised on ``flow``: counted ``handler_errors``; the first failure of each handler
        is logged with its traceback, later ones at debug level."""
        self.counters["handler_errors"] += 1
        key = id(handler)
        if key not in self._logged and len(self._logged) < _LOG_MAX:
            self._logged.add(key)
            log.error("flow handler %r failed on %r (reset; counted as handler_errors; further failures of this "
                      "handler are logged at debug level)", handler, flow, exc_info=exc)
        else:
            log.debug("flow handler %r failed on %r: %r", handler, flow, exc)
