"""The shared switch: several guests on one virtual L2 network, each behind a stack of its own.

Theory of operation
-------------------
Every guest of a :class:`Switch` has a :class:`GuestPort`: its own :class:`~aioslirp.stack.Stack`
(own egress policy, rate caps, name and labels, counters, audit log, NAT flows) and, while it is
served, its own transport (a TAP, a QEMU socket...). Frames the guest sends go to the switch's
:class:`~aioslirp.switch.l2.L2` first, which hands the batch's frames for the gateway (and the
broadcast and multicast ones) to that guest's own stack, and the frames for other guests straight
to their transports (MAC learning, flooding, isolation, the MAC table's bounds: see
:mod:`aioslirp.switch.l2`). What a stack sends goes to its own guest's transport only. So a
guest's traffic to the outside is only ever processed by its own stack, exactly as without a
switch; guest-to-guest traffic never enters a stack (no NAT, no egress policy, no rate cap:
isolation is the control there).

One subnet: the switch's :class:`~aioslirp.config.NetworkConfig` (``cidr``, the gateway and DNS
addresses, the MTU, the IPv6 prefix and the gateway MAC) is every stack's. Each guest gets one
IPv4 address (the next free from ``config.guest`` up, or the one asked), and its stack's DHCP
server hands out that address only (``dhcp_pool_size=1``): the static lease of the guest's MAC.
IPv6 addresses are the guests' own (SLAAC from the shared prefix): the guests' MACs differ (the
switch refuses a MAC another port holds) and their duplicate address detection messages are
multicast, which the switch floods, so the kernel's DAD sees any collision.

Every stack answers ARP and NDP for the gateway and DNS addresses with the same MAC,
``config.gateway_mac``, and a guest only ever asks its own stack (frames to the gateway MAC and
the broadcast ones go to the sender's own stack; no stack sees another guest's frames): each
guest sees one gateway, at one MAC, whoever it asks.

DNS: a guest with a ``name`` is ``NAME.<domain>`` (``domain`` default ``aioslirp.internal``), an
A record of its address, and AAAA records of the IPv6 addresses the switch learned from it (its
own SLAAC addresses: :mod:`aioslirp.switch.l2`), in the DNS of every guest that may reach it
(isolated guests are named only to themselves), answered by that guest's own stack.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import logging

from ..config import NetworkConfig
from ..config.records import check_name
from ..errors import ConfigError
from ..stack import Stack
from ..transport.base import Transport
from .l2 import DEFAULT_MAC_AGE, DEFAULT_MAX_IPV6, DEFAULT_MAX_MACS, L2

__all__ = ["Switch", "GuestPort", "SHARED_FIELDS", "DEFAULT_DOMAIN"]

log = logging.getLogger("aioslirp.switch")

#: Fields of a guest's ``config`` that must equal the switch's: one network.
SHARED_FIELDS = ("cidr", "gateway", "dns", "mtu", "gateway_mac", "ipv6", "cidr6", "gateway6", "dns6")
#: Domain of the guests' names (``NAME.aioslirp.internal``), like ``host.aioslirp.internal``.
DEFAULT_DOMAIN = "aioslirp.internal"


def parse_mac(value, field_name: str = "mac") -> bytes:
    """``"52:54:00:12:34:56"`` (or ``-`` separated, or 6 bytes) -> 6 bytes. Raises
    :class:`ConfigError` naming ``field_name`` for anything else, a multicast or an all-zero MAC."""
    if isinstance(value, (bytes, bytearray)) and len(value) == 6:
        mac = bytes(value)
    else:
        parts = str(value).strip().replace("-", ":").split(":")
        try:
            if len(parts) != 6 or not all(len(p) == 2 for p in parts):
                raise ValueError
            mac = bytes.fromhex("".join(parts))
        except ValueError:
            raise ConfigError(field_name, f"{value!r} is not a MAC address (like 52:54:00:12:34:56)") from None
    if mac[0] & 1 or mac == bytes(6):
        raise ConfigError(field_name, f"{value!r} is not a unicast MAC address")
    return mac


def mac_text(mac: bytes | None) -> str | None:
    """6 bytes -> ``"52:54:00:12:34:56"``; ``None`` stays ``None``."""
    return None if mac is None else ":".join(f"{b:02x}" for b in mac)


class _StackSide(Transport):
    """The transport a guest's stack serves: frames from the switch in, frames out to the guest's
    own transport. Opening it opens the guest's transport; it closes when that one does."""

    __slots__ = ("_port",)

    def __init__(self, port: "GuestPort") -> None:
        super().__init__()
        self._port = port

    @property
    def name(self) -> str:
        return f"switch port {self._port.id}"

    def preflight(self) -> None:
        check = getattr(self._port.transport, "preflight", None)
        if check is not None:
            check()

    async def _start_reading(self) -> None:
        await self._port.open_guest_side()

    def deliver(self, frames: list) -> None:
        sink = self._on_frames
        if sink is not None and frames:
            sink(frames)

    def send_frames(self, frames) -> None:
        port = self._port
        tr = port.transport
        if tr is None:
            self.send_errors += len(frames)
            return
        self.frames_out += len(frames)
        tr.send_frames(frames)
        port.capture_frames(frames)

    def _close_io(self) -> None:
        tr = self._port.transport
        if tr is not None:
            reason = getattr(tr, "close_reason", None)
            if reason not in (None, "closed"):
                self.close_reason = reason
            tr.close()


class GuestPort:
    """One guest of a :class:`Switch` (``switch.port_of(stack)``, ``switch.ports()``); read-only.

    Attributes:
        id: the port's number (1, 2, ... per switch).
        stack: the guest's :class:`~aioslirp.stack.Stack`.
        name: the guest's name (``stack.identity.name``), or ``None``.
        mac: the guest's MAC as text (given to :meth:`Switch.add_guest`, else the first it sent
            from), or ``None`` before its first frame.
        address: the guest's IPv4 address (:class:`ipaddress.IPv4Address`, its stack's ``config.guest``).
        ipv6: the guest's IPv6 addresses the switch learned from its traffic (its own SLAAC
            addresses in the network's prefix; at most ``max_ipv6_per_guest``).
        isolated: the guest reaches only its own stack and no guest reaches it.
        transport: the guest's transport while it is served, else ``None``.
        serving: :meth:`Switch.serve` runs for this guest.
        counters: the port's ``collections.Counter``: ``frames_in`` (from the guest), ``to_stack``,
            ``switched`` (to one other guest), ``flooded`` (broadcast/multicast: to the stack and
            the other guests), ``flooded_unknown`` (unicast to no known MAC: to the other guests),
            ``frames_from_guests`` (frames other guests sent to it), ``drop.<reason>`` and
            ``frames_dropped`` (:mod:`aioslirp.switch.l2`).
    """

    __slots__ = ("id", "stack", "address", "transport", "serving", "_l2", "_peers", "_clock", "_state",
                 "_side", "_closed", "_capture", "_renamed")

    def __init__(self, port_id: int, stack: Stack, address, *, l2: L2, peers: dict, clock, state, capture=None,
                 renamed=None) -> None:
        self.id = port_id
        self.stack = stack
        self.address = address
        self.transport = None
        self.serving = False
        self._l2 = l2
        self._peers = peers  # the switch's {port id: GuestPort}
        self._clock = clock  # the loop's time()
        self._state = state
        self._side: _StackSide | None = None
        self._closed = False
        self._capture = capture  # record(frames): the switch's capture, or None
        self._renamed = renamed  # called when the switch learned a new address of a guest

    @property
    def name(self) -> str | None:
        return self.stack.identity.name

    @property
    def mac(self) -> str | None:
        return mac_text(self._state.mac)

    @property
    def ipv6(self) -> tuple:
        """The guest's IPv6 addresses the switch learned (:class:`ipaddress.IPv6Address`, first
        learned first; at most ``max_ipv6_per_guest``)."""
        return tuple(ipaddress.IPv6Address(a) for a in self._state.ipv6)

    @property
    def isolated(self) -> bool:
        return self._state.isolated

    @property
    def counters(self):
        return self._state.counters

    def info(self) -> dict:
        """A JSON-ready record: ``{"port", "name", "mac", "address", "ipv6", "isolated", "served", "counters"}``."""
        return {"port": self.id, "name": self.name, "mac": self.mac, "address": str(self.address),
                "ipv6": [str(a) for a in self.ipv6],
                "isolated": self.isolated, "served": self.transport is not None,
                "counters": {k: int(v) for k, v in sorted(self.counters.items())}}

    # ------------------------------------------------------------------ serving
    async def run(self, transport) -> None:
        """:meth:`Switch.serve` for this guest (see there)."""
        if self._closed:
            raise RuntimeError("the guest's port is closed")
        if self.serving:
            raise RuntimeError(f"guest {self.name or self.id} is being served already")
        if getattr(transport, "vnet_hdr", False):
            raise ConfigError("transport", "a TAP with a virtio-net header (offload) cannot be a switch port: "
                                           "open it without vnet_hdr")
        self.serving = True
        self.transport = transport
        side = self._side = _StackSide(self)
        try:
            await self.stack.serve(side)
        finally:
            if self.id in self._l2.ports:
                version = self._l2.ipv6_version
                self._l2.attach(self.id, False)
                if self._l2.ipv6_version != version and self._renamed is not None:
                    self._renamed()
            transport.close()
            self.transport = None
            self._side = None
            if not self._closed:
                self.stack.reset_flows()  # the guest left: its next transport starts clean
            self.serving = False

    async def open_guest_side(self) -> None:
        """Open the guest's transport (the stack opened its side): its frames go to the switch."""
        tr = self.transport
        await tr.open(self._from_guest)
        tr.closed.add_done_callback(self._guest_closed)
        self._l2.attach(self.id)

    def _guest_closed(self, _fut) -> None:
        side = self._side
        if side is not None:
            side.close_reason = getattr(self.transport, "close_reason", None) or "eof"
            side.close()

    def capture_frames(self, frames) -> None:
        """Record ``frames`` (sent by the guest, or by its stack to it) in the switch's capture."""
        cap = self._capture
        if cap is not None and frames:
            cap(frames)

    def _from_guest(self, frames, csum_ok=None) -> None:
        """The guest transport's sink: one batch through the switch."""
        if self._capture is not None:
            self.capture_frames(frames)
        l2 = self._l2
        version = l2.ipv6_version
        try:
            to_stack, out = l2.forward(self.id, frames, self._clock())
        except Exception:  # never into the transport's reader: the batch is dropped and counted
            c = self._state.counters
            c["drop.internal_error"] += len(frames)
            c["frames_dropped"] += len(frames)
            log.exception("internal error switching a batch of guest frames")
            return
        if l2.ipv6_version != version and self._renamed is not None:
            self._renamed()  # a guest's IPv6 address was learned: its name gets the AAAA record
        side = self._side
        if to_stack and side is not None:
            side.deliver(to_stack)
        if out:
            peers = self._peers
            for q, fs in out.items():
                other = peers.get(q)
                tr = other.transport if other is not None else None
                if tr is not None:
                    tr.send_frames(fs)

    async def close(self) -> None:
        """Stop serving (``stack.stop()``: the guest's flows are reset while it is there), then
        close the stack and the transport."""
        self.stack.stop()
        for _ in range(200):  # let serve() finish its goodbye first (at most 2 s)
            if not self.serving:
                break
            await asyncio.sleep(0.01)
        self._closed = True
        await self.stack.aclose()
        if self.transport is not None:
            self.transport.close()


class Switch:
    """Several guests on one virtual L2 network (one subnet), each behind a stack of its own.

    Usage::

        async with aioslirp.Switch(NetworkConfig()) as sw:
            a = await sw.add_guest(mac="52:54:00:00:00:0a", name="a")          # a started Stack
            b = await sw.add_guest(name="b", isolated=True, config=NetworkConfig(egress_default="deny"))
            await asyncio.gather(sw.serve(a, tap_a), sw.serve(b, tap_b))     # until both leave

    ``a`` is ``10.0.2.15``, ``b`` ``10.0.2.16`` (DHCP hands each its own); ``a.aioslirp.internal``
    resolves to ``10.0.2.15`` for the guests that may reach it. Leaving ``async with`` stops every
    :meth:`serve` and closes every stack (flows, host sockets, tasks, transports): nothing keeps
    running. See docs/switch.md.

    Args:
        config: the network of every guest (default ``NetworkConfig()``); a guest's own ``config``
            may differ in anything but :data:`SHARED_FIELDS`. Its ``guest`` is the first address
            handed out.
        domain: the guests' names are ``NAME.<domain>`` in the DNS (default ``aioslirp.internal``).
        max_macs_per_guest: MACs one guest may send from (default 8; its own included): the MAC
            table holds at most this many times the number of guests; beyond, frames from new
            MACs are dropped (``drop.mac_limit``).
        mac_age: seconds a learned MAC lives without a frame from it (default 300; a guest's own
            MAC never ages).
        max_ipv6_per_guest: IPv6 addresses the switch learns per guest (default 2), the first
            ones it sends from or probes (duplicate address detection) in ``config.cidr6``: the
            AAAA records of its name (:mod:`aioslirp.switch.l2`).
        capture: where the switch records the network's frames, each once: every frame a guest
            sends (before it is switched or dropped) and every frame a stack sends its guest;
            an object with ``record(frames, loop)``, a :class:`~aioslirp.transport.pcap.PcapWriter`
            (``aioslirp qemu --switch --pcap FILE``). ``None``: no capture.

    Raises:
        ConfigError: a bad ``config``, ``domain``, ``max_macs_per_guest``, ``mac_age`` or
            ``max_ipv6_per_guest`` (one line naming the field).
    """

    def __init__(self, config: NetworkConfig | None = None, *, domain: str = DEFAULT_DOMAIN,
                 max_macs_per_guest: int = DEFAULT_MAX_MACS, mac_age: float = DEFAULT_MAC_AGE,
                 max_ipv6_per_guest: int = DEFAULT_MAX_IPV6, capture=None) -> None:
        self.capture = capture
        self.config = (config if config is not None else NetworkConfig()).validate()
        self.domain = check_name(domain, "domain")
        if not isinstance(max_macs_per_guest, int) or max_macs_per_guest < 1:
            raise ConfigError("max_macs_per_guest", f"{max_macs_per_guest!r}: must be a positive whole number")
        try:
            age = float(mac_age)
        except (TypeError, ValueError):
            raise ConfigError("mac_age", f"{mac_age!r} is not a number of seconds") from None
        if not 0 < age < float("inf"):
            raise ConfigError("mac_age", f"{mac_age!r}: must be a positive number of seconds")
        if not isinstance(max_ipv6_per_guest, int) or max_ipv6_per_guest < 0:
            raise ConfigError("max_ipv6_per_guest", f"{max_ipv6_per_guest!r}: must be a whole number >= 0")
        cfg = self.config
        v6: dict = {}
        if cfg.ipv6:
            net6 = ipaddress.IPv6Network(str(cfg.cidr6))
            v6 = {"prefix6": net6.network_address.packed, "max_ipv6": max_ipv6_per_guest,
                  "reserved6": [ipaddress.IPv6Address(str(a)).packed for a in (cfg.gateway6, cfg.dns6)]}
        self._l2 = L2(cfg.gateway_mac_bytes, max_macs_per_guest, age, **v6)
        self._ports: dict[int, GuestPort] = {}
        self._by_stack: dict[int, GuestPort] = {}
        self._base_records: dict[int, dict] = {}  # port id -> its config's own dns_records
        self._next_id = 1
        self._reserved: set[ipaddress.IPv4Address] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Switch":
        self._loop = asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every :meth:`serve` and close every guest's stack (flows, sockets, tasks,
        transports). Idempotent."""
        if self._closed:
            return
        self._closed = True
        ports = list(self._ports.values())
        await asyncio.gather(*(p.close() for p in ports), return_exceptions=True)
        for port in ports:
            self._forget(port)

    def _forget(self, port: GuestPort) -> None:
        self._ports.pop(port.id, None)
        self._by_stack.pop(id(port.stack), None)
        self._base_records.pop(port.id, None)
        self._l2.remove_port(port.id)
        self._name_guests()

    # ------------------------------------------------------------------ guests
    async def add_guest(self, mac=None, *, name: str | None = None, labels=None, address=None,
                        isolated: bool = False, config: NetworkConfig | None = None, **stack_options) -> Stack:
        """Add a guest: its own :class:`~aioslirp.stack.Stack`, started, on a new port. Returns the stack.

        Args:
            mac: the guest's MAC (``"52:54:00:12:34:56"`` or 6 bytes), held by its port for good;
                ``None``: the first MAC the guest sends from.
            name: the guest's name: the stack's ``name`` (audit records, spans, events, log lines)
                and ``NAME.<domain>`` in the DNS; a DNS label (letters, digits, ``-``, ``_``; at
                most 63), unique on the switch. ``labels``: the stack's ``labels``.
            address: the guest's IPv4 address in ``config.cidr`` (default: the lowest free from
                ``config.guest`` up); its stack's DHCP hands out this address only.
            isolated: the guest reaches its own stack only (the gateway, DNS, the NAT), and no
                other guest reaches it.
            config: the guest's own :class:`~aioslirp.config.NetworkConfig` (egress rules, rate
                caps, timeouts...), equal to the switch's in :data:`SHARED_FIELDS`; default: the switch's.
            stack_options: the other keywords of :class:`~aioslirp.stack.Stack` (``audit``,
                ``policy``, ``tracer_provider``, ``tcp_handler``, ``udp_handler``).

        Raises:
            ConfigError: one line naming the field: ``mac`` (not a unicast MAC, or another
                guest's or the gateway's), ``name`` (not a DNS label, taken), ``address`` (outside
                the network, the gateway's, DNS's or another guest's; no free address left),
                ``config`` fields that differ from the switch's, and what ``Stack`` raises.
            RuntimeError: the switch is not entered (``async with``) or is closed.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("add_guest() needs an open Switch: use it inside 'async with Switch(...)'")
        now = self._loop.time()
        cfg = self.config
        mac_b = None
        if mac is not None:
            mac_b = parse_mac(mac)
            if mac_b == cfg.gateway_mac_bytes:
                raise ConfigError("mac", f"{mac_text(mac_b)} is the gateway's MAC")
            if self._l2.table.owner(mac_b, now) is not None:
                raise ConfigError("mac", f"{mac_text(mac_b)} is another guest's MAC")
        if name is not None:
            label = check_name(name, "name")
            if "." in label:
                raise ConfigError("name", f"{name!r} is not one DNS label (no dots)")
            if any(p.name is not None and p.name.lower() == label for p in self._ports.values()):
                raise ConfigError("name", f"{name!r} is another guest's name")
            if f"{label}.{self.domain}" in cfg.dns_records:
                raise ConfigError("name", f"{label}.{self.domain} is a name of the network's dns_records")
        addr = self._address(address)
        own = self._guest_config(config, addr)
        stack = Stack(own, name=name, labels=labels, **stack_options)
        port_id = self._next_id
        self._next_id += 1
        state = self._l2.add_port(port_id, isolated=isolated, mac=mac_b, ipv4=addr.packed, now=now)
        record = None if self.capture is None else functools.partial(self.capture.record, loop=self._loop)
        port = GuestPort(port_id, stack, addr, l2=self._l2, peers=self._ports, clock=self._loop.time, state=state,
                         capture=record, renamed=self._name_guests)
        self._ports[port_id] = port
        self._by_stack[id(stack)] = port
        self._base_records[port_id] = dict(own.dns_records)
        try:
            await stack.start()
        except BaseException:
            self._forget(port)
            raise
        self._name_guests()
        log.info("%sswitch port %d: guest %s%s", stack.identity.log_prefix, port_id, addr,
                 " (isolated)" if isolated else "", extra=stack.identity.log_extra)
        return stack

    def reserve(self, address) -> None:
        """Keep ``address`` (an IPv4 address in ``config.cidr``) for a guest that names it in
        :meth:`add_guest`: the default choice of an address skips it (a static lease whose guest
        has not joined yet). Raises :class:`ConfigError` naming ``address`` as :meth:`add_guest` does."""
        addr = self._address(address)
        self._reserved.add(addr)

    def _address(self, address) -> ipaddress.IPv4Address:
        cfg = self.config
        net = cfg.cidr
        taken = {p.address for p in self._ports.values()}
        reserved = {cfg.gateway, cfg.dns, net.network_address, net.broadcast_address}
        if address is not None:
            try:
                addr = ipaddress.IPv4Address(str(address).strip())
            except ValueError:
                raise ConfigError("address", f"{address!r} is not an IPv4 address") from None
            if addr not in net:
                raise ConfigError("address", f"{addr} is outside the network {net}")
            if addr in reserved:
                raise ConfigError("address", f"{addr} is the gateway's, the DNS server's or the network's own")
            if addr in taken:
                raise ConfigError("address", f"{addr} is another guest's address")
            return addr
        a = int(cfg.guest)
        while a < int(net.broadcast_address):
            addr = ipaddress.IPv4Address(a)
            if addr not in taken and addr not in reserved and addr not in self._reserved:
                return addr
            a += 1
        raise ConfigError("address", f"no free address left in {net} from {cfg.guest} up")

    def _guest_config(self, config: NetworkConfig | None, addr) -> NetworkConfig:
        base = self.config
        if config is None:
            config = base
        else:
            config = dataclasses.replace(config).validate()
            for f in SHARED_FIELDS:
                if getattr(config, f) != getattr(base, f):
                    raise ConfigError(f, f"{getattr(config, f)} differs from the switch's {getattr(base, f)}: "
                                         "the guests of a switch share one network")
        own = dataclasses.replace(config, guest=addr, dhcp_pool_size=1)
        return own.validate()

    def _name_guests(self) -> None:
        """Put every named guest in the DNS of each guest that may reach it (and its own)."""
        ports = list(self._ports.values())
        for port in ports:
            records = dict(self._base_records.get(port.id, {}))
            for other in ports:
                if other.name is None or (other is not port and (port.isolated or other.isolated)):
                    continue
                records[f"{other.name.lower()}.{self.domain}"] = (other.address, *other.ipv6)
            port.stack.config.dns_records = records

    def port_of(self, stack: Stack) -> GuestPort:
        """The :class:`GuestPort` of ``stack``; ``KeyError`` when it is not a guest of this switch."""
        port = self._by_stack.get(id(stack))
        if port is None or port.stack is not stack:
            raise KeyError("not a guest of this switch")
        return port

    def ports(self) -> list[GuestPort]:
        """Every guest's :class:`GuestPort`, in the order they were added."""
        return list(self._ports.values())

    def stats(self) -> dict:
        """A JSON-ready snapshot: ``{"guests": [GuestPort.info(), ...], "macs": int, "macs_max": int}``:
        the guests, the MACs the table holds now and its bound (``max_macs_per_guest`` x guests)."""
        ports = self.ports()
        return {"guests": [p.info() for p in ports], "macs": len(self._l2.table),
                "macs_max": self._l2.table.max_macs * len(ports)}

    async def remove_guest(self, stack: Stack) -> None:
        """Take ``stack``'s guest off the switch: its :meth:`serve` returns, its stack closes, its
        address, name and MACs are free again. ``KeyError`` when it is not a guest here."""
        port = self.port_of(stack)
        await port.close()
        self._forget(port)

    # ------------------------------------------------------------------ serving
    async def serve(self, stack: Stack, transport) -> None:
        """Serve ``stack``'s guest on ``transport`` (a :class:`~aioslirp.transport.base.Transport`
        carrying plain Ethernet frames: a TAP without a virtio-net header, a QEMU stream or dgram
        socket, a socket pair) until it closes, :meth:`remove_guest`, ``stack.stop()`` or the
        switch closes. The guest's flows are torn down when it leaves (``stack.reset_flows()``),
        so ``serve`` may be called again for the guest's next transport (a VM restarted).

        Raises:
            KeyError: ``stack`` is not a guest of this switch.
            RuntimeError: the guest is being served already, or the switch is closed.
            ConfigError: ``transport`` carries a virtio-net header (``vnet_hdr``): frames of one
                guest go to another as they are, so every port carries plain frames.
            What ``Stack.serve`` raises (a TAP that is down, a transport that cannot be opened).
        """
        port = self.port_of(stack)
        if self._closed:
            raise RuntimeError("the Switch is closed")
        await port.run(transport)
