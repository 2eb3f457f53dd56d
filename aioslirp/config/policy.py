"""Egress policy rules: which host-side destinations guest flows may reach (``--allow`` / ``--deny``).

Theory of operation
-------------------
A rule is ``TARGET[:PORTS][/PROTO]``, ``allow`` or ``deny``:

* ``TARGET``: a CIDR network or one address (``10.0.0.0/8``, ``192.0.2.7``, ``2001:db8::/32``;
  bracketed when ports or a protocol follow an IPv6 network: ``[fd00::/8]:53/udp``), a domain name
  of at least two labels (``pypi.org``) or a wildcard ``*.SUFFIX`` (``*.githubusercontent.com``),
  which matches one or more labels in front of ``SUFFIX`` and never ``SUFFIX`` itself.
  Names match case-insensitively and on label boundaries only (``evilpypi.org`` is not
  ``pypi.org``); a trailing dot is ignored. An internationalized name is written in its
  ``xn--`` (punycode) form, as it travels in DNS: aioslirp does not convert (IDNA 2003 and 2008
  map some names differently, ``ß`` for one), so a rule reads exactly what the guest sends.
* ``PORTS``: ``443`` or a range ``8000-8999`` (1-65535); absent: every port.
* ``PROTO``: ``tcp`` or ``udp``; absent: every protocol (ICMP echo flows have port 0 and match
  only rules without ports).

A CIDR rule is matched against the address the *host* socket talks to (for the gateway,
``127.0.0.1`` / ``::1``); a name rule against the names the flow's destination address is bound
to: the names the virtual DNS resolved to that address for the guest (see
:mod:`aioslirp.flow.egress`).

Precedence: the **most specific matching rule wins**, compared in this order:

1. the target: an exact name beats a wildcard, a wildcard beats a CIDR; among wildcards the
   longer suffix (more labels) wins, among CIDRs the longer prefix;
2. then the ports: a rule with ports beats one without, a narrower range a wider one;
3. then the protocol: a rule naming one beats one that does not;
4. then the verdict: a user's ``deny`` beats a user's ``allow``, which beats a built-in default.

Exception: the built-in defaults (:data:`DEFAULT_DENY`, ``NetworkConfig.egress_deny_builtin``) are
lifted only by a more specific *CIDR* rule: no name rule opens the cloud-metadata range, whatever
a DNS answer says. A destination no rule decides goes to the Python hook (``NetworkConfig.policy``)
if any, else to ``egress_default`` (``allow``, today's behaviour, or ``deny``). So
``--egress-default deny --allow pypi.org:443`` is an allow-list of one name and port.

Built-in defaults: ``169.254.0.0/16`` and ``fe80::/10``, the link-local ranges where cloud
metadata services live (``169.254.169.254`` on AWS, Google Cloud, Azure, OpenStack...), plus
``fd00:ec2::254/128``, the IPv6 address of the AWS instance metadata service.

DNS upstreams: the user's CIDR rules apply to them too, the built-in defaults do not (an upstream
from the host's resolv.conf is the operator's choice; it only ever gets questions the forwarder
parsed).

The rules are matched once per new flow (a TCP SYN, a UDP flow's first datagram, an ICMP echo
flow's first request) and the verdict is cached per address (see :mod:`aioslirp.flow.egress`).
"""

from __future__ import annotations

import ipaddress
import socket

from ..errors import ConfigError

__all__ = ["DEFAULT_DENY", "EgressPolicy", "Rule", "name_matches", "parse_rule", "parse_rules"]

#: Denied unless allowed: link-local ranges (cloud metadata at 169.254.169.254) and AWS's IPv6 metadata address.
DEFAULT_DENY = ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")

# Target kinds, in increasing specificity.
KIND_CIDR, KIND_WILDCARD, KIND_NAME = 0, 1, 2
# Verdict rank at equal specificity: higher wins.
_RANK_DEFAULT, _RANK_ALLOW, _RANK_DENY = 0, 1, 2
_PROTOS = {"tcp": 6, "udp": 17}
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")
_SHAPE = ("expected a CIDR network (e.g. 192.0.2.0/24, 2001:db8::/32), a domain name (pypi.org) or a wildcard "
          "(*.example.org), optionally followed by :PORT or :LOW-HIGH and /tcp or /udp")


class Rule:
    """One compiled rule (see the module documentation for the syntax).

    Attributes:
        text: the canonical text (``"pypi.org:443/tcp"``, ``"10.0.0.0/8"``).
        allow: the verdict; ``default``: a built-in default (never a name rule).
        kind: ``KIND_CIDR`` (0), ``KIND_WILDCARD`` (1) or ``KIND_NAME`` (2).
        family, net, mask, plen: for a CIDR, 4 or 6, the network and mask as integers, the prefix length.
        name: for a name, the name; for a wildcard, the suffix (lower case, no trailing dot).
        lo, hi: the port range (``None``: every port); ``proto``: 6, 17 or ``None`` (every protocol).
        key: the sort key, larger = more specific (the module's precedence order).
    """

    __slots__ = ("text", "allow", "default", "kind", "family", "net", "mask", "plen", "name", "lo", "hi", "proto",
                 "key")

    text: str
    allow: bool
    default: bool
    kind: int
    family: int
    net: int
    mask: int
    plen: int
    name: str
    lo: int | None
    hi: int | None
    proto: int | None
    key: tuple

    def applies(self, port: int, proto: int) -> bool:
        """True when the rule's ports and protocol cover a flow of ``proto`` (6, 17, 1, 58) to ``port``."""
        if self.proto is not None and self.proto != proto:
            return False
        return self.lo is None or self.lo <= port <= self.hi

    @property
    def unrestricted(self) -> bool:
        """No ports and no protocol: the rule covers every flow to its target."""
        return self.lo is None and self.proto is None

    def __repr__(self) -> str:
        return f"Rule({'allow' if self.allow else 'deny'} {self.text}{' default' if self.default else ''})"


def _bad(field_name: str, text: str, why: str) -> ConfigError:
    return ConfigError(field_name, f"{text!r}: {why}")


def _ports(text: str, raw: str, field_name: str) -> tuple[int, int]:
    lo_s, sep, hi_s = text.partition("-")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise _bad(field_name, raw, f"ports {text!r} are not PORT or LOW-HIGH") from None
    for p in (lo, hi):
        if not 1 <= p <= 65535:
            raise _bad(field_name, raw, f"port {p} is out of range 1-65535")
    if lo > hi:
        raise _bad(field_name, raw, f"port range {text!r} is empty (LOW > HIGH)")
    return lo, hi


def _name(text: str, raw: str, field_name: str) -> tuple[int, str]:
    """``(kind, name)`` of a name or wildcard target; raises ConfigError."""
    kind = KIND_NAME
    if text.startswith("*."):
        kind, text = KIND_WILDCARD, text[2:]
    text = text[:-1] if text.endswith(".") else text
    labels = text.split(".")
    if "*" in text:
        raise _bad(field_name, raw, "a wildcard is '*.' in front of a name only (e.g. *.example.org)")
    if (not text or len(text) > 253 or any(not 0 < len(lb) <= 63 or not _NAME_CHARS.issuperset(lb) for lb in labels)
            or (kind == KIND_NAME and len(labels) < 2) or labels[-1].isdigit()):
        raise _bad(field_name, raw, _SHAPE) if kind == KIND_NAME and "." not in text else \
            _bad(field_name, raw, f"{text!r} is not a domain name (labels of a-z, 0-9, '-', '_'; at least two"
                 + ("; an internationalized name in its xn-- form" if not text.isascii() else "") + ")")
    return kind, text


def parse_rule(value, field_name: str, *, allow: bool = True, default: bool = False) -> Rule:
    """Compile one rule text (``"pypi.org:443"``, ``"*.example.org/tcp"``, ``"10.0.0.0/8:8000-8999/tcp"``,
    ``"[fd00::/8]:53/udp"``, ``"2001:db8::/32"``). Raises :class:`ConfigError` naming ``field_name``
    and the rule, one line."""
    raw = str(value)
    text = raw.strip().lower()
    r = Rule()
    r.allow, r.default, r.proto, r.lo, r.hi = bool(allow), bool(default), None, None, None
    head, sep, tail = text.rpartition("/")
    if sep and tail in _PROTOS:
        r.proto, text = _PROTOS[tail], head
    elif sep and tail.isalpha():
        raise _bad(field_name, raw, f"protocol {tail!r} is not tcp or udp")
    ports = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _bad(field_name, raw, "unterminated '['")
        target, rest = text[1:end], text[end + 1:]
        if rest:
            if not rest.startswith(":") or len(rest) == 1:
                raise _bad(field_name, raw, "expected ':PORTS' after ']'")
            ports = rest[1:]
    elif text.count(":") == 1:
        target, ports = text.split(":")
        if not ports:
            raise _bad(field_name, raw, "expected ports after ':'")
    else:
        target = text
    if ports is not None:
        r.lo, r.hi = _ports(ports, raw, field_name)
    if not target:
        raise _bad(field_name, raw, _SHAPE)
    try:
        net = ipaddress.ip_network(target, strict=False)
    except ValueError:
        net = None
    if net is not None:
        r.kind, r.family, r.plen, r.name = KIND_CIDR, net.version, net.prefixlen, ""
        bits = 32 if net.version == 4 else 128
        r.net = int(net.network_address)
        r.mask = ((1 << net.prefixlen) - 1) << (bits - net.prefixlen) if net.prefixlen else 0
        tgt = net.compressed
        length = net.prefixlen
    else:
        if ":" in target or "/" in target or target.replace(".", "").isdigit():
            raise _bad(field_name, raw, f"{target!r} is not a CIDR network (e.g. 192.0.2.0/24, 2001:db8::/32)"
                       if "/" in target or ":" in target else f"{target!r} is not an IP address")
        r.kind, r.name = _name(target, raw, field_name)
        r.family, r.net, r.mask, r.plen = 0, 0, 0, 0
        tgt = r.name if r.kind == KIND_NAME else "*." + r.name
        length = r.name.count(".") + 1
    if r.default and r.kind != KIND_CIDR:
        raise _bad(field_name, raw, "a built-in default must be a CIDR network")
    out = tgt
    if r.lo is not None:
        out = (f"[{tgt}]" if ":" in tgt else tgt) + (f":{r.lo}" if r.lo == r.hi else f":{r.lo}-{r.hi}")
    if r.proto is not None:
        if ":" in tgt and r.lo is None:
            out = f"[{tgt}]"
        out += "/tcp" if r.proto == 6 else "/udp"
    r.text = out
    rank = _RANK_DEFAULT if r.default else (_RANK_ALLOW if r.allow else _RANK_DENY)
    width = -65536 if r.lo is None else -(r.hi - r.lo)
    r.key = (r.kind, length, width, r.proto is not None, rank)
    return r


def parse_rules(values, field_name: str) -> list[str]:
    """Normalise a list of rule texts (see the module documentation; a bare address is one host,
    ``"192.0.2.7"`` -> ``"192.0.2.7/32"``). Returns the canonical texts; raises :class:`ConfigError`
    naming ``field_name`` (``"egress_deny"``...) and the rule."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [parse_rule(v, field_name).text for v in values]


def name_matches(rule: Rule, name: str) -> bool:
    """True when name rule ``rule`` matches ``name`` (lower case, no trailing dot): equal for a
    name, one or more labels in front of the suffix for a wildcard."""
    if rule.kind == KIND_NAME:
        return name == rule.name
    return name.endswith(rule.name) and len(name) > len(rule.name) + 1 and name[-len(rule.name) - 1] == "."


def addr_int(addr: str) -> tuple[int, int] | None:
    """``(family, integer)`` of an address text (a ``%scope`` suffix ignored), ``None`` if not one."""
    addr = addr.split("%", 1)[0]
    try:
        if ":" in addr:
            return 6, int.from_bytes(socket.inet_pton(socket.AF_INET6, addr), "big")
        return 4, int.from_bytes(socket.inet_aton(addr), "big")
    except OSError:
        return None


class EgressPolicy:
    """The compiled rules, most specific first (see the module documentation for the order).

    ``allow`` / ``deny``: the user's rule texts; ``defaults``: built-in deny CIDRs. Raises
    :class:`ConfigError` for a malformed rule. Rules change at run time through :meth:`add` /
    :meth:`remove`; :attr:`version` counts the changes (caches above compare it).
    """

    __slots__ = ("_v4", "_v6", "_names", "_user", "_defaults", "empty", "has_names", "version", "_verdicts")

    #: CIDR rules per family and name rules, each sorted most specific first.
    _v4: list[Rule]
    _v6: list[Rule]
    _names: list[Rule]
    #: The user's rules by canonical text (insertion order) and the built-in defaults.
    _user: dict[str, Rule]
    _defaults: list[Rule]
    #: No rule at all; ``has_names``: at least one name or wildcard rule.
    empty: bool
    has_names: bool
    version: int
    _verdicts: dict[str, bool]

    def __init__(self, allow=(), deny=(), defaults=DEFAULT_DENY) -> None:
        self._defaults = [parse_rule(t, "egress_deny_builtin", allow=False, default=True) for t in
                          ([defaults] if isinstance(defaults, str) else list(defaults or ()))]
        self._user = {}
        self.version = 0
        for texts, allowed, name in ((allow, True, "egress_allow"), (deny, False, "egress_deny")):
            for t in ([texts] if isinstance(texts, str) else list(texts or ())):
                r = parse_rule(t, name, allow=allowed)
                old = self._user.get(r.text)
                if old is None or old.allow:  # the same target given both ways: deny
                    self._user[r.text] = r
        self._compile()

    def _compile(self) -> None:
        rules = self._defaults + list(self._user.values())
        rules.sort(key=lambda r: r.key, reverse=True)
        self._v4 = [r for r in rules if r.kind == KIND_CIDR and r.family == 4]
        self._v6 = [r for r in rules if r.kind == KIND_CIDR and r.family == 6]
        self._names = [r for r in rules if r.kind != KIND_CIDR]
        self.empty = not rules
        self.has_names = bool(self._names)
        self._verdicts = {}
        self.version += 1

    @classmethod
    def from_config(cls, cfg) -> "EgressPolicy":
        """The policy of a :class:`~aioslirp.config.NetworkConfig` (``egress_allow``, ``egress_deny``,
        ``egress_deny_builtin``)."""
        return cls(getattr(cfg, "egress_allow", ()) or (), getattr(cfg, "egress_deny", ()) or (),
                   getattr(cfg, "egress_deny_builtin", DEFAULT_DENY) or ())

    # ------------------------------------------------------------------ changes
    def add(self, text: str, allow: bool = True) -> str:
        """Add (or replace: the same canonical text) a user rule; returns its canonical text.
        Raises :class:`ConfigError` (field ``rule``) for a malformed one."""
        r = parse_rule(text, "rule", allow=allow)
        self._user.pop(r.text, None)
        self._user[r.text] = r
        self._compile()
        return r.text

    def remove(self, text: str) -> Rule | None:
        """Remove the user rule of this text (canonicalised); returns it, or ``None`` if there was none."""
        r = self._user.pop(parse_rule(text, "rule").text, None)
        if r is not None:
            self._compile()
        return r

    def rules(self) -> list[dict]:
        """The user's rules in the order given: ``[{"rule": "pypi.org:443", "verdict": "allow"}, ...]``."""
        return [{"rule": r.text, "verdict": "allow" if r.allow else "deny"} for r in self._user.values()]

    def builtin(self) -> list[str]:
        """The built-in deny rules (``egress_deny_builtin``) in the order given, e.g.
        ``["169.254.0.0/16", ...]``: denied whatever the user's rules and default say, except
        where a more specific user allow rule covers them (docs/security.md)."""
        return [r.text for r in self._defaults]

    # ------------------------------------------------------------------ matching
    def match_addr(self, addr: str, port: int = 0, proto: int = 0, *, user_only: bool = False) -> Rule | None:
        """The most specific CIDR rule for a flow of ``proto`` to ``addr`` (text) and ``port``;
        with ``proto`` 0, only rules without ports and protocol count. ``None``: no rule."""
        v = addr_int(addr)
        if v is None:
            return None
        value = v[1]
        for r in (self._v4 if v[0] == 4 else self._v6):
            if value & r.mask == r.net and not (user_only and r.default) and (
                    r.applies(port, proto) if proto else r.lo is None and r.proto is None):
                return r
        return None

    def covers(self, addr: str) -> Rule | None:
        """The most specific user's CIDR *allow* rule whose network holds ``addr`` (text), with any
        ports and protocol, or ``None`` (the built-in defaults never cover)."""
        v = addr_int(addr)
        if v is None:
            return None
        value = v[1]
        for r in (self._v4 if v[0] == 4 else self._v6):
            if r.allow and not r.default and value & r.mask == r.net:
                return r
        return None

    def match_name(self, name: str, port: int = 0, proto: int = 0, *, skip_portless: bool = False) -> Rule | None:
        """The most specific name / wildcard rule for ``name`` (any case, a trailing dot ignored),
        ``port`` and ``proto`` (0: ports and protocols ignored, for tests). ``skip_portless``: rules without
        ports do not count. ``None``: no rule."""
        name = name.lower().rstrip(".")
        for r in self._names:
            if name_matches(r, name) and (not proto or r.applies(port, proto)) and not (skip_portless and r.lo is None):
                return r
        return None

    def name_rules(self, name: str) -> list[Rule]:
        """Every name / wildcard rule matching ``name``, most specific first."""
        name = name.lower().rstrip(".")
        return [r for r in self._names if name_matches(r, name)]

    def match(self, addr: str, *, user_only: bool = False):
        """The deciding CIDR rule for ``addr`` whatever the port: ``(allowed, text, is_default)``, or
        ``None``. ``user_only`` skips the built-in defaults (used for DNS upstreams)."""
        r = self.match_addr(addr, user_only=user_only)
        return None if r is None else (r.allow, r.text, r.default)

    def allows(self, addr: str, *, user_only: bool = False, port: int = 0, proto: int = 0) -> bool:
        """True when the most specific CIDR rule for host-side address ``addr`` (text), ``port`` and
        ``proto`` (0: only rules without ports and protocol count) does not deny it; cached per
        address (bounded) when ``proto`` is 0 and the defaults count."""
        if self.empty:
            return True
        if proto:
            r = self.match_addr(addr, port, proto, user_only=user_only)
            return r is None or r.allow
        if not user_only:
            v = self._verdicts.get(addr)
            if v is not None:
                return v
        r = self.match_addr(addr, user_only=user_only)
        v = r is None or r.allow
        if not user_only:
            if len(self._verdicts) >= 4096:
                self._verdicts.clear()
            self._verdicts[addr] = v
        return v

    def describe(self) -> list[str]:
        """The rules in the order they are tried, e.g. ``["deny 169.254.0.0/16 (default)", ...]``."""
        return [f"{'allow' if r.allow else 'deny'} {r.text}{' (default)' if r.default else ''}"
                for r in self._names + self._v4 + self._v6]
