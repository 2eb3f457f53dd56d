"""Sans-IO layer 2 of the shared switch: the MAC table and where each guest frame goes.

:class:`L2` is given batches of Ethernet frames from one guest port and returns, per batch,
the frames for that guest's own stack and the frames for each other guest port. It does no I/O
and reads no clock (``now``, seconds of any monotonic origin, is passed in). The rules:

* the **source MAC** is learned on the sending port (:class:`MacTable`); a frame is dropped,
  and counted on its port, when its source is multicast or all zeroes (``drop.bad_src_mac``),
  the gateway's MAC (``drop.gateway_mac``), a MAC another port holds (``drop.mac_in_use``: a
  guest spoofing another guest's MAC steals nothing), or a new MAC on a port that holds
  ``max_macs`` already (``drop.mac_limit``: a guest flooding MACs cannot grow the table);
* a frame claiming **another guest's IPv4 address** (an ARP packet whose sender address, or an
  IPv4 packet whose source address, is an address the switch gave another port) is dropped
  (``drop.arp_spoofed``, ``drop.ip_spoofed``): no guest answers or sends for another's address;
* with ``prefix6`` (the network's /64), the switch **learns each guest's IPv6 addresses** in
  that prefix: the source address of its IPv6 packets, and the target of its duplicate address
  detection probes (Neighbor Solicitations from ``::``, RFC 4862 5.4.2), which a guest sends
  before it uses a SLAAC address, EUI-64 or stable-privacy (RFC 7217) alike. An address is
  learned by the first guest that sends from it or probes it, at most ``max_ipv6`` per guest
  (the first ones; later ones work, unlearned: each such frame counts in ``ipv6_not_learned``),
  never the prefix's own reserved ones (``reserved6``: the gateway's, the DNS server's, the
  subnet-router anycast), never a modified EUI-64 address made from another guest's MAC, and it is forgotten
  when the guest leaves (detached or removed). Then an IPv6 packet from an address another
  guest holds is dropped (``drop.ip6_spoofed``), as is a Neighbor Advertisement for one
  (``drop.nd_spoofed``): no guest answers or sends for another's address. A probe for another
  guest's address still goes through (so the kernels' DAD sees the collision), unlearned;
* a frame **to the gateway MAC** goes to the sender's own stack only (``to_stack``);
* a **broadcast or multicast** frame (ARP requests, DHCP, IPv6 neighbour discovery) goes to the
  sender's own stack and to every other port the sender may reach (``flooded``);
* a **unicast** frame to a MAC learned on another port goes to that port (``switched``) when the
  two may reach each other, else it is dropped (``drop.isolated``); to a MAC learned on the
  sending port itself it is dropped (``drop.to_self``); to a MAC nobody holds it is flooded to
  every port the sender may reach, not to the stack (``flooded_unknown``).

Two ports may reach each other when neither is *isolated*: an isolated guest reaches its own
stack (the gateway, DNS, DHCP, the NAT) and nothing else, and no other guest reaches it.

Bounds: a port holds at most ``max_macs`` MACs, so the table holds at most ``max_macs`` times
the number of ports; and at most ``max_ipv6`` IPv6 addresses. A learned MAC unheard for ``mac_age`` seconds may be taken by another port
or replaced on its own; a port's *pinned* MAC (the one it was given, else the first it sent
from) stays with it until the port is removed.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["L2", "MacTable", "PortState", "DEFAULT_MAX_MACS", "DEFAULT_MAC_AGE", "DEFAULT_MAX_IPV6"]

#: MACs one port may hold (its pinned MAC included).
DEFAULT_MAX_MACS = 8
#: Seconds a learned (not pinned) MAC lives without a frame from it (Linux bridges' default ageing).
DEFAULT_MAC_AGE = 300.0

#: IPv6 addresses learned per port (a SLAAC address, and a temporary or second one).
DEFAULT_MAX_IPV6 = 2

_ZERO16 = bytes(16)
_ICMP6, _ND_NS, _ND_NA = 58, 135, 136

_SEEN = 2  # index of the last-heard time in a table entry [port, pinned, seen]


class MacTable:
    """MAC -> port, learned from source addresses; bounded per port (see the module documentation).

    Args:
        max_macs: MACs one port may hold (>= 1).
        mac_age: seconds a learned MAC lives without a frame from it (> 0).
    """

    __slots__ = ("max_macs", "mac_age", "_entries", "_by_port")

    def __init__(self, max_macs: int = DEFAULT_MAX_MACS, mac_age: float = DEFAULT_MAC_AGE) -> None:
        self.max_macs = int(max_macs)
        self.mac_age = float(mac_age)
        self._entries: dict[bytes, list] = {}  # mac -> [port, pinned, seen]
        self._by_port: dict[int, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def owner(self, mac: bytes, now: float) -> int | None:
        """The port holding ``mac`` (6 bytes) at ``now``, or ``None``."""
        e = self._entries.get(mac)
        if e is None or (not e[1] and now - e[_SEEN] >= self.mac_age):
            return None
        return e[0]

    def macs(self, port: int) -> set[bytes]:
        """The MACs ``port`` holds (a copy)."""
        return set(self._by_port.get(port, ()))

    def pin(self, port: int, mac: bytes, now: float) -> bool:
        """Give ``mac`` to ``port`` for good (until :meth:`forget`); False when another port
        holds it (pinned, or heard within ``mac_age``) or ``port`` is full."""
        e = self._entries.get(mac)
        if e is not None and e[0] != port:
            if self.owner(mac, now) is not None:
                return False
            self._remove(mac)
        if e is None or e[0] != port:
            if self.learn(port, mac, now) is not None:
                return False
        self._entries[mac][1] = True
        return True

    def learn(self, port: int, mac: bytes, now: float) -> str | None:
        """``mac`` sent a frame on ``port`` at ``now``: learn or refresh it. Returns ``None``, or
        the drop reason: ``"mac_in_use"`` (another port holds it), ``"mac_limit"`` (``port``
        holds ``max_macs`` MACs heard within ``mac_age``)."""
        e = self._entries.get(mac)
        if e is not None:
            if e[0] == port:
                e[_SEEN] = now
                return None
            if e[1] or now - e[_SEEN] < self.mac_age:
                return "mac_in_use"
            self._remove(mac)  # a stale learned MAC of another port: it moves
        held = self._by_port.setdefault(port, set())
        if len(held) >= self.max_macs:
            age = self.mac_age
            for old in [m for m in held if not self._entries[m][1] and now - self._entries[m][_SEEN] >= age]:
                self._remove(old)
            if len(held) >= self.max_macs:
                return "mac_limit"
        self._entries[mac] = [port, False, now]
        held.add(mac)
        return None

    def forget(self, port: int) -> None:
        """Drop every MAC ``port`` holds (the port left)."""
        for mac in self._by_port.pop(port, ()):
            del self._entries[mac]

    def _remove(self, mac: bytes) -> None:
        port = self._entries.pop(mac)[0]
        held = self._by_port.get(port)
        if held is not None:
            held.discard(mac)


class PortState:
    """What :class:`L2` knows of one port: whether it is ``isolated``, its pinned ``mac`` (``None``
    until given or first heard), its IPv4 address (``ipv4``, 4 bytes, or ``None``), the IPv6
    addresses learned from it (``ipv6``, 16 bytes each, first learned first), whether a guest is
    ``attached`` (frames are flooded only to attached ports) and its ``counters`` (``frames_in``,
    ``to_stack``, ``switched``, ``flooded``, ``flooded_unknown``, ``frames_from_guests``,
    ``ipv6_learned``, ``ipv6_not_learned``, ``drop.<reason>``, ``frames_dropped``)."""

    __slots__ = ("isolated", "mac", "ipv4", "ipv6", "attached", "counters")

    def __init__(self, isolated: bool = False, mac: bytes | None = None, ipv4: bytes | None = None) -> None:
        self.isolated = bool(isolated)
        self.mac = mac
        self.ipv4 = ipv4
        self.ipv6: list[bytes] = []
        self.attached = False
        self.counters: Counter = Counter()


class L2:
    """The switching rules over ports numbered by the caller (see the module documentation).

    Args:
        gateway_mac: the stacks' MAC (6 bytes): frames to it go to the sender's own stack.
        max_macs: MACs one port may hold; ``mac_age``: seconds a learned MAC lives unheard.
        prefix6: the network's IPv6 /64 prefix (its first 8 bytes) whose addresses are learned,
            or ``None``: no IPv6 learning. ``reserved6``: addresses of it never learned (16
            bytes each). ``max_ipv6``: addresses learned per port.

    Attributes:
        ipv6_version: grows by one whenever a port's learned IPv6 addresses change.
    """

    __slots__ = ("gateway_mac", "table", "ports", "prefix6", "reserved6", "max_ipv6", "ipv6_version", "_reach",
                 "_addresses", "_addresses6")

    def __init__(self, gateway_mac: bytes, max_macs: int = DEFAULT_MAX_MACS,
                 mac_age: float = DEFAULT_MAC_AGE, *, prefix6: bytes | None = None, reserved6=(),
                 max_ipv6: int = DEFAULT_MAX_IPV6) -> None:
        self.gateway_mac = bytes(gateway_mac)
        self.table = MacTable(max_macs, mac_age)
        self.ports: dict[int, PortState] = {}
        self.prefix6 = None if prefix6 is None else bytes(prefix6[:8])
        self.reserved6 = frozenset(bytes(a) for a in reserved6)
        self.max_ipv6 = int(max_ipv6)
        self.ipv6_version = 0
        self._reach: dict[int, tuple[int, ...]] = {}  # port -> the attached ports it floods to
        self._addresses: dict[bytes, int] = {}  # a port's IPv4 address (4 bytes) -> the port
        self._addresses6: dict[bytes, int] = {}  # a learned IPv6 address (16 bytes) -> the port

    def add_port(self, port: int, *, isolated: bool = False, mac: bytes | None = None, ipv4: bytes | None = None,
                 now: float = 0.0) -> PortState:
        """Add ``port`` (not attached yet). ``mac``: its pinned MAC; ``ipv4``: its address (4 bytes),
        which no other port may claim. Raises ``ValueError`` when ``port`` exists or another port
        holds ``mac`` or ``ipv4``."""
        if port in self.ports:
            raise ValueError(f"port {port} exists")
        if mac is not None and self.table.owner(mac, now) is not None:
            raise ValueError("the MAC is another port's")
        if ipv4 is not None and ipv4 in self._addresses:
            raise ValueError("the address is another port's")
        state = self.ports[port] = PortState(isolated, mac, ipv4)
        if ipv4 is not None:
            self._addresses[ipv4] = port
        if mac is not None:
            self.table.pin(port, mac, now)
        self._recompute()
        return state

    def remove_port(self, port: int) -> None:
        """Remove ``port``, its address and every MAC it holds."""
        state = self.ports.pop(port, None)
        if state is not None and state.ipv4 is not None:
            self._addresses.pop(state.ipv4, None)
        if state is not None:
            self._forget6(state)
        self.table.forget(port)
        self._recompute()

    def attach(self, port: int, attached: bool = True) -> None:
        """A guest is on ``port`` now (or, ``attached=False``, left it: the MACs it learned go;
        its pinned MAC stays)."""
        state = self.ports[port]
        state.attached = attached
        if not attached:
            self._forget6(state)
            pinned = state.mac
            self.table.forget(port)
            if pinned is not None:
                self.table.pin(port, pinned, 0.0)
        self._recompute()

    def _forget6(self, state: PortState) -> None:
        if state.ipv6:
            for a in state.ipv6:
                self._addresses6.pop(a, None)
            state.ipv6 = []
            self.ipv6_version += 1

    def _ipv6(self, port: int, state: PortState, f, now: float) -> str | None:
        """The IPv6 frame ``f`` (54 bytes or more) from ``port``: learn its addresses; the drop
        reason when it claims another port's address, else ``None``."""
        prefix = self.prefix6
        held = self._addresses6
        src = bytes(f[22:38])
        mine = src[:8] == prefix
        if mine:
            holder = held.get(src)
            if holder is not None and holder != port:
                return "ip6_spoofed"
            mine = holder is None  # learn it below, once the frame passes
        probe = None
        if f[20] == _ICMP6 and len(f) >= 78 and f[54] in (_ND_NS, _ND_NA):
            target = bytes(f[62:78])
            if target[:8] == prefix:
                holder = held.get(target)
                if f[54] == _ND_NA:
                    if holder is not None and holder != port:
                        return "nd_spoofed"
                elif src == _ZERO16 and holder is None:  # a DAD probe (RFC 4862 5.4.2)
                    probe = target
        if mine:
            self._learn6(port, state, src, now)
        if probe is not None:
            self._learn6(port, state, probe, now)
        return None

    def _learn6(self, port: int, state: PortState, addr: bytes, now: float) -> None:
        if addr in self.reserved6 or addr[8:] == b"\0" * 8:
            return
        if addr[11:13] == b"\xff\xfe":  # a modified EUI-64 interface id (RFC 4291 2.5.1): whose MAC?
            mac = bytes((addr[8] ^ 2, addr[9], addr[10], addr[13], addr[14], addr[15]))
            owner = self.table.owner(mac, now)
            if owner is not None and owner != port:
                return
        if len(state.ipv6) >= self.max_ipv6:
            state.counters["ipv6_not_learned"] += 1
            return
        state.ipv6.append(addr)
        self._addresses6[addr] = port
        state.counters["ipv6_learned"] += 1
        self.ipv6_version += 1

    def _recompute(self) -> None:
        ports = self.ports
        open_ = [p for p, s in ports.items() if s.attached and not s.isolated]
        self._reach = {p: (() if s.isolated else tuple(q for q in open_ if q != p)) for p, s in ports.items()}

    def forward(self, port: int, frames, now: float) -> tuple[list, dict[int, list]]:
        """Where the batch ``frames`` (bytes-like Ethernet frames) from ``port`` goes, at ``now``:
        ``(frames for port's own stack, {other port: [frames]})``, in arrival order each. Every
        frame is counted on ``port`` once: ``to_stack``, ``switched``, ``flooded``,
        ``flooded_unknown`` (a flooded frame also goes to the stack when it is broadcast or
        multicast) or ``drop.<reason>``."""
        state = self.ports[port]
        c = state.counters
        c["frames_in"] += len(frames)
        gw = self.gateway_mac
        table = self.table
        learn = table.learn
        reach = self._reach[port]
        mine = state.mac
        ports = self.ports
        addresses = self._addresses
        v6 = self.prefix6 is not None
        stack: list = []
        out: dict[int, list] = {}
        for f in frames:
            if len(f) < 14:
                self._drop(c, "truncated")
                continue
            src = bytes(f[6:12])
            if src != mine:
                if src[0] & 1 or src == b"\0\0\0\0\0\0":
                    self._drop(c, "bad_src_mac")
                    continue
                if src == gw:
                    self._drop(c, "gateway_mac")
                    continue
                why = learn(port, src, now)
                if why is not None:
                    self._drop(c, why)
                    continue
                if mine is None:  # the first MAC heard on a port given none is its own for good
                    state.mac = mine = src
                    table.pin(port, src, now)
            else:
                learn(port, src, now)
            kind = f[12:14]
            if addresses and len(f) >= 32 and (kind == b"\x08\x06" or kind == b"\x08\x00"):
                claimed = bytes(f[28:32] if kind == b"\x08\x06" else f[26:30])  # ARP sender / IPv4 source
                holder = addresses.get(claimed)
                if holder is not None and holder != port:
                    self._drop(c, "arp_spoofed" if kind == b"\x08\x06" else "ip_spoofed")
                    continue
            elif v6 and kind == b"\x86\xdd" and len(f) >= 54:
                why = self._ipv6(port, state, f, now)
                if why is not None:
                    self._drop(c, why)
                    continue
            dst = bytes(f[0:6])
            if dst == gw:
                stack.append(f)
                c["to_stack"] += 1
            elif dst[0] & 1:
                stack.append(f)
                c["flooded"] += 1
                for q in reach:
                    out.setdefault(q, []).append(f)
            else:
                owner = table.owner(dst, now)
                if owner is None:
                    c["flooded_unknown"] += 1
                    for q in reach:
                        out.setdefault(q, []).append(f)
                elif owner == port:
                    self._drop(c, "to_self")
                elif owner not in reach:
                    other = ports.get(owner)
                    self._drop(c, "isolated" if state.isolated or other is None or other.isolated else "not_attached")
                else:
                    c["switched"] += 1
                    out.setdefault(owner, []).append(f)
        for q, fs in out.items():
            ports[q].counters["frames_from_guests"] += len(fs)
        return stack, out

    @staticmethod
    def _drop(c: Counter, reason: str) -> None:
        c["drop." + reason] += 1
        c["frames_dropped"] += 1
