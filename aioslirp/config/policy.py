"""Egress policy: which host-side destinations guest flows may reach (``--allow`` / ``--deny``).

Theory of operation
-------------------
The policy is a list of CIDR rules, each ``allow`` or ``deny``, matched against the address the
*host* socket would talk to: for a guest flow that is the remote the stack connects to (for the
gateway, ``127.0.0.1`` / ``::1``); for the DNS forwarder, the upstream resolver's address.

Precedence: the rule with the **longest matching prefix wins**. On a tie (the same prefix
length), a rule the user gave beats a built-in default, and among the user's rules ``deny``
beats ``allow``. An address no rule matches is allowed. So ``--deny 0.0.0.0/0 --allow
192.0.2.0/24`` is an allow-list, and ``--allow 169.254.169.254/32`` opens one address of the
link-local range the defaults deny.

Built-in defaults (``NetworkConfig.egress_default_deny``): ``169.254.0.0/16`` and
``fe80::/10``, the link-local ranges where cloud metadata services live (``169.254.169.254``
on AWS, Google Cloud, Azure, OpenStack...), plus ``fd00:ec2::254/128``, the IPv6 address of
the AWS instance metadata service (a unique-local address, outside our ``fd00::/64``). IPv6
link-local destinations are never routed anyway (they are scoped to the guest's link).

DNS upstreams: the user's ``--deny`` / ``--allow`` rules apply to them too, the built-in
defaults do not. An upstream from the host's resolv.conf is the operator's choice (Google
Cloud's resolver is ``169.254.169.254``), and the forwarder only ever sends it DNS questions
it has parsed, never guest bytes as they came.

The check runs once per new flow (a TCP SYN, a UDP flow's first datagram, an ICMP echo flow's
first request), never per packet: a few integer comparisons per rule.
"""

from __future__ import annotations

import ipaddress
import socket

from ..errors import ConfigError

__all__ = ["DEFAULT_DENY", "EgressPolicy", "parse_rules"]

#: Denied unless allowed: link-local ranges (cloud metadata at 169.254.169.254) and AWS's IPv6 metadata address.
DEFAULT_DENY = ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")

# Tie-break rank at one prefix length: higher wins.
_RANK_DEFAULT, _RANK_ALLOW, _RANK_DENY = 0, 1, 2


def parse_rules(values, field_name: str) -> list[str]:
    """Normalise a list of CIDR strings (``"10.1.0.0/16"``, ``"2001:db8::/32"``, a bare address for
    one host). Returns the canonical network texts; raises :class:`ConfigError` naming ``field_name``
    (``"egress_deny"``...) for anything that is not an IP network."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    out = []
    for v in values:
        try:
            net = ipaddress.ip_network(str(v).strip(), strict=False)
        except ValueError:
            raise ConfigError(field_name, f"{v!r} is not a CIDR network (e.g. 192.0.2.0/24, 2001:db8::/32)") from None
        out.append(net.compressed)
    return out


#: Host addresses whose verdict :meth:`EgressPolicy.allows` remembers.
_VERDICT_CACHE = 4096


class EgressPolicy:
    """Compiled allow/deny rules (see the module documentation for the precedence).

    ``allow`` / ``deny``: the user's CIDR texts; ``defaults``: built-in deny CIDRs. Raises
    :class:`ConfigError` for a malformed CIDR.
    """

    __slots__ = ("_v4", "_v6", "empty", "_verdicts")

    #: Rules per family, first match wins: ``(family, prefixlen, rank, net_int, mask_int, allowed, text, default)``.
    _v4: list[tuple]
    _v6: list[tuple]
    empty: bool
    _verdicts: dict[str, bool]

    def __init__(self, allow=(), deny=(), defaults=DEFAULT_DENY) -> None:
        rules = []  # (family, prefixlen, rank, net_int, mask_int, allowed, text)
        for texts, rank, allowed, name in ((defaults, _RANK_DEFAULT, False, "egress_default_deny"),
                                           (allow, _RANK_ALLOW, True, "egress_allow"),
                                           (deny, _RANK_DENY, False, "egress_deny")):
            for text in parse_rules(list(texts), name):
                net = ipaddress.ip_network(text)
                bits = 32 if net.version == 4 else 128
                mask = ((1 << net.prefixlen) - 1) << (bits - net.prefixlen) if net.prefixlen else 0
                rules.append((net.version, net.prefixlen, rank, int(net.network_address), mask, allowed, text,
                              rank == _RANK_DEFAULT))
        # First match wins once sorted: longest prefix first, then by rank (deny > allow > default).
        rules.sort(key=lambda r: (-r[1], -r[2]))
        self._v4 = [r for r in rules if r[0] == 4]
        self._v6 = [r for r in rules if r[0] == 6]
        #: True when no rule exists at all (every check is then one attribute test).
        self.empty = not rules
        # addr -> allows(addr): a guest reaches few distinct host addresses (the gateway is one),
        # and the rules never change, so each is matched once (bounded: cleared when full).
        self._verdicts: dict[str, bool] = {}

    @classmethod
    def from_config(cls, cfg) -> "EgressPolicy":
        """The policy of a :class:`~aioslirp.config.NetworkConfig` (``egress_allow``, ``egress_deny``,
        ``egress_default_deny``)."""
        return cls(getattr(cfg, "egress_allow", ()) or (), getattr(cfg, "egress_deny", ()) or (),
                   getattr(cfg, "egress_default_deny", DEFAULT_DENY) or ())

    def match(self, addr: str, *, user_only: bool = False):
        """The deciding rule for ``addr`` (an IPv4/IPv6 address text, a ``%scope`` suffix ignored):
        ``(allowed, cidr_text, is_default)``, or ``None`` when no rule matches. ``user_only`` skips
        the built-in defaults (used for DNS upstreams). A text that is not an address matches nothing."""
        addr = addr.split("%", 1)[0]
        try:
            if ":" in addr:
                value, rules = int.from_bytes(socket.inet_pton(socket.AF_INET6, addr), "big"), self._v6
            else:
                value, rules = int.from_bytes(socket.inet_aton(addr), "big"), self._v4
        except OSError:
            return None
        for _fam, _plen, _rank, net, mask, allowed, text, default in rules:
            if value & mask == net and not (user_only and default):
                return allowed, text, default
        return None

    def allows(self, addr: str, *, user_only: bool = False) -> bool:
        """True when guest traffic may reach host-side address ``addr`` (text)."""
        if self.empty:
            return True
        if not user_only:
            v = self._verdicts.get(addr)
            if v is not None:
                return v
        m = self.match(addr, user_only=user_only)
        v = m is None or m[0]
        if not user_only:
            if len(self._verdicts) >= _VERDICT_CACHE:
                self._verdicts.clear()
            self._verdicts[addr] = v
        return v

    def describe(self) -> list[str]:
        """The rules in the order they are tried, e.g. ``["deny 169.254.0.0/16 (default)", ...]``."""
        return [f"{'allow' if r[5] else 'deny'} {r[6]}{' (default)' if r[7] else ''}" for r in self._v4 + self._v6]
