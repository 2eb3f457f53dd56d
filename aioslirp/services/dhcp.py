"""Sans-IO DHCPv4 server for the virtual LAN (RFC 2131, options per RFC 2132).

:class:`DhcpServer` takes the UDP payload of one guest datagram sent to port 67 and
returns the UDP payload of the reply (to be sent from ``config.gateway``:67 to the
client's port 68) plus whether it must be broadcast. It never performs I/O, never
reads a clock (``now`` is passed in, in seconds, any monotonic origin) and never
raises on guest input: anything it does not answer is counted in
:attr:`DhcpServer.dropped` by reason.

Addressing of the reply (RFC 2131 section 4.1, no relay agents on the virtual LAN):

* ``broadcast is True``: IP destination ``255.255.255.255``, Ethernet ``ff:ff:ff:ff:ff:ff``.
* ``broadcast is False``: IP destination :func:`reply_destination` (the reply's
  ``ciaddr`` when set, else its ``yiaddr``), Ethernet destination the client's MAC.

Leases: the pool runs from ``config.guest`` up to the last host address of
``config.cidr`` (or ``config.dhcp_pool_size`` addresses), skipping the gateway and DNS addresses. A MAC keeps its address
for the life of the server (also after RELEASE or expiry) unless the pool runs dry,
in which case the binding that has been inactive longest is reused.
"""

from __future__ import annotations

import ipaddress
import logging
import struct
from types import ModuleType

from ..config import NetworkConfig

__all__ = ["DhcpServer", "encode_search_list", "reply_destination"]

log = logging.getLogger(__name__)


def _dpkt() -> ModuleType:
    """dpkt, with its DHCP codec, imported on the first DHCP message: importing it costs about
    5 MB of RSS, which a process whose guests have static addresses never needs."""
    import dpkt.dhcp

    return dpkt

# Message types (RFC 2132 section 9.6).
DHCPDISCOVER, DHCPOFFER, DHCPREQUEST, DHCPDECLINE = 1, 2, 3, 4
DHCPACK, DHCPNAK, DHCPRELEASE, DHCPINFORM = 5, 6, 7, 8

# Option codes (RFC 2132 unless noted).
OPT_PAD = 0
OPT_SUBNET_MASK = 1
OPT_ROUTER = 3
OPT_DNS = 6
OPT_DOMAIN_NAME = 15
OPT_MTU = 26
OPT_REQUESTED_IP = 50
OPT_LEASE_TIME = 51
OPT_OVERLOAD = 52
OPT_MSG_TYPE = 53
OPT_SERVER_ID = 54
OPT_PARAM_LIST = 55
OPT_MESSAGE = 56
OPT_MAX_SIZE = 57
OPT_T1 = 58
OPT_T2 = 59
OPT_CLIENT_ID = 61
OPT_DOMAIN_SEARCH = 119  # RFC 3397
OPT_END = 255

BOOTREQUEST, BOOTREPLY = 1, 2
MAGIC = 0x63825363
FIXED_LEN = 236  # BOOTP fixed header, RFC 2131 figure 1
OPTIONS_OFFSET = FIXED_LEN + 4  # after the magic cookie
BROADCAST_FLAG = 0x8000
MIN_REPLY_LEN = 300  # BOOTP minimum (RFC 1542 section 2.1); some clients want it
DEFAULT_MAX_MESSAGE = 576  # RFC 2131 section 2: every client accepts 576-byte IP datagrams
IP_UDP_HEADERS = 28

#: Seconds an offered address stays reserved for the client it was offered to.
OFFER_HOLD = 60.0
#: Seconds an address reported in use by DHCPDECLINE is kept out of the pool.
DECLINE_HOLD = 600.0
#: Upper bound on tracked bindings (memory bound against MAC-spoofing floods).
MAX_BINDINGS = 4096

_SNAME = slice(44, 108)
_FILE = slice(108, 236)


class _Drop(Exception):
    """Internal: the message is ignored; ``args[0]`` is the reason counted in ``dropped``."""


class _Lease:
    __slots__ = ("mac", "addr", "expires", "reserved_until")

    mac: bytes | None
    addr: int
    expires: float
    reserved_until: float

    def __init__(self, mac: bytes | None, addr: int) -> None:
        self.mac = mac  # None: quarantined after DHCPDECLINE
        self.addr = addr
        self.expires = 0.0  # end of the bound lease (0: none)
        self.reserved_until = 0.0  # end of the offer hold / decline quarantine

    def active(self, now: float) -> bool:
        return self.expires > now or self.reserved_until > now

    def end(self) -> float:
        return max(self.expires, self.reserved_until)


def encode_search_list(domains: list[str]) -> bytes:
    """Encode domain names for option 119 (RFC 3397 section 2): DNS wire format with compression.

    Pointers are offsets from the start of the (concatenated) option data. Names that are
    not valid DNS names (empty label, label > 63 bytes, name > 255 bytes, non-ASCII that
    IDNA cannot encode) are skipped with a warning.
    """
    out = bytearray()
    suffixes: dict[tuple[bytes, ...], int] = {}
    for name in domains:
        labels = dns_labels(name)
        if labels is None:
            log.warning("DHCP: skipping invalid search domain %r", name)
            continue
        key = tuple(lab.lower() for lab in labels)
        for i in range(len(labels) + 1):
            suffix = key[i:]
            if not suffix:
                out.append(0)
                break
            ptr = suffixes.get(suffix)
            if ptr is not None:
                out += struct.pack("!H", 0xC000 | ptr)
                break
            if len(out) < 0x4000:
                suffixes[suffix] = len(out)
            out.append(len(labels[i]))
            out += labels[i]
    return bytes(out)


def dns_labels(name: str) -> list[bytes] | None:
    """The labels of domain ``name`` (text, IDNA-encoded when not ASCII), or None when it is not
    a valid DNS name (empty label, label over 63 bytes, name over 255 bytes; RFC 1035 2.3.4)."""
    name = name.strip().rstrip(".")
    if not name:
        return None
    try:
        raw = name.encode("ascii")
    except UnicodeEncodeError:
        try:
            raw = name.encode("idna")
        except UnicodeError:
            return None
    labels = raw.split(b".")
    if any(not 1 <= len(lab) <= 63 for lab in labels):
        return None
    if sum(len(lab) + 1 for lab in labels) + 1 > 255:
        return None
    return labels


def reply_destination(reply: bytes, broadcast: bool) -> str:
    """IPv4 destination of a reply returned by :meth:`DhcpServer.handle` (RFC 2131 section 4.1).

    ``"255.255.255.255"`` when ``broadcast``; else the reply's ``ciaddr`` if non-zero, else its ``yiaddr``.
    """
    if broadcast:
        return "255.255.255.255"
    ciaddr, yiaddr = struct.unpack_from("!II", reply, 12)
    return str(ipaddress.IPv4Address(ciaddr or yiaddr))


def _parse_options(buf: bytes, into: dict[int, bytes]) -> None:
    """Parse one options area strictly; concatenate repeated codes (RFC 3396).

    A missing END is tolerated; an option whose length runs past the area raises ``_Drop``.
    """
    i, n = 0, len(buf)
    while i < n:
        code = buf[i]
        if code == OPT_PAD:
            i += 1
            continue
        if code == OPT_END:
            return
        if i + 1 >= n:
            raise _Drop("option_overrun")
        length = buf[i + 1]
        end = i + 2 + length
        if end > n:
            raise _Drop("option_overrun")
        into[code] = into.get(code, b"") + buf[i + 2 : end]
        i = end


class DhcpServer:
    """DHCPv4 server state: the lease table of one virtual LAN.

    ``dropped`` maps a reason (``"truncated"``, ``"bad_magic"``, ``"option_overrun"``, ...)
    to the number of guest messages ignored for it. ``sent`` counts replies by type name.
    """

    __slots__ = ("config", "_net", "_server_id", "_excluded", "_pool_first", "_pool_last", "_cursor", "_by_mac",
                 "_by_addr", "dropped", "sent", "_lease_time", "_common", "_optional", "_lease_opts")

    config: NetworkConfig
    _net: ipaddress.IPv4Network
    _server_id: int
    #: Addresses never leased: network, broadcast, gateway, DNS.
    _excluded: set[int]
    _pool_first: int
    _pool_last: int
    #: The lowest address never handed out yet.
    _cursor: int
    _by_mac: dict[bytes, _Lease]
    _by_addr: dict[int, _Lease]
    dropped: dict[str, int]
    sent: dict[str, int]
    _lease_time: int
    #: Options of every reply, ``(code, value)``.
    _common: list[tuple[int, bytes]]
    #: Options dropped first when the reply is too big.
    _optional: list[tuple[int, bytes]]
    _lease_opts: list[tuple[int, bytes]]

    def __init__(self, config: NetworkConfig) -> None:
        if not isinstance(config.cidr, ipaddress.IPv4Network):
            config.validate()
        self.config = config
        net: ipaddress.IPv4Network = config.cidr  # type: ignore[assignment]
        self._net = net
        self._server_id = int(config.gateway)  # type: ignore[arg-type]
        self._excluded = {
            int(net.network_address),
            int(net.broadcast_address),
            int(config.gateway),  # type: ignore[arg-type]
            int(config.dns),  # type: ignore[arg-type]
        }
        self._pool_first = int(config.guest)  # type: ignore[arg-type]
        self._pool_last = int(net.broadcast_address) - 1
        size = getattr(config, "dhcp_pool_size", None)
        if size is not None:  # e.g. 1 on a Switch: this guest's address only
            self._pool_last = min(self._pool_last, self._pool_first + int(size) - 1)
        self._cursor = self._pool_first  # lowest address never handed out yet
        self._by_mac: dict[bytes, _Lease] = {}
        self._by_addr: dict[int, _Lease] = {}
        self.dropped: dict[str, int] = {}
        self.sent: dict[str, int] = {}

        lease = int(config.lease_time)
        self._lease_time = lease
        common = [
            (OPT_SUBNET_MASK, net.netmask.packed),
            (OPT_ROUTER, ipaddress.IPv4Address(config.gateway).packed),
            (OPT_DNS, ipaddress.IPv4Address(config.dns).packed),
            (OPT_MTU, struct.pack("!H", config.mtu)),
        ]
        self._common = common
        self._optional: list[tuple[int, bytes]] = []  # dropped first when the reply is too big
        search = [d for d in config.dns_search if dns_labels(d) is not None]
        if search:
            self._optional.append((OPT_DOMAIN_NAME, b".".join(dns_labels(search[0]) or [])))
            encoded = encode_search_list(search)
            if encoded:
                self._optional.append((OPT_DOMAIN_SEARCH, encoded))
        self._lease_opts = [
            (OPT_LEASE_TIME, struct.pack("!I", lease)),
            (OPT_T1, struct.pack("!I", lease // 2)),
            (OPT_T2, struct.pack("!I", lease * 7 // 8)),
        ]

    # ------------------------------------------------------------------ public

    def handle(self, payload: bytes, client_mac: bytes, now: float) -> tuple[bytes, bool] | None:
        """Process one guest message sent to UDP port 67.

        ``payload``: the UDP payload (BOOTP/DHCP message). ``client_mac``: the Ethernet
        source (6 bytes), used as the lease key when ``chaddr`` is not an Ethernet address.
        ``now``: current time in seconds (monotonic). Returns ``(reply_payload, broadcast)``
        or ``None`` when nothing is to be sent (RELEASE, DECLINE, ignored or malformed input).
        """
        try:
            return self._handle(bytes(payload), bytes(client_mac), float(now))
        except _Drop as drop:
            self._count(drop.args[0])
        except Exception:  # never let guest input raise into the stack
            log.debug("DHCP: unexpected error on guest message", exc_info=True)
            self._count("error")
        return None

    def lease_of(self, mac: bytes) -> ipaddress.IPv4Address | None:
        """Address bound to ``mac`` (offered, leased or released), or ``None``."""
        lease = self._by_mac.get(bytes(mac))
        return ipaddress.IPv4Address(lease.addr) if lease else None

    # ---------------------------------------------------------------- internal

    def _count(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _handle(self, payload: bytes, client_mac: bytes, now: float) -> tuple[bytes, bool] | None:
        if len(payload) < OPTIONS_OFFSET:
            raise _Drop("truncated")
        dpkt = _dpkt()
        try:
            msg = dpkt.dhcp.DHCP(payload)
        except (dpkt.Error, IndexError, struct.error, ValueError):
            # dpkt's own option walk is lax and may trip on overruns: use ours for the reason.
            _parse_options(payload[OPTIONS_OFFSET:], {})
            raise _Drop("malformed") from None
        if msg.magic != MAGIC:
            raise _Drop("bad_magic")  # plain BOOTP is not served
        if msg.op != BOOTREQUEST:
            raise _Drop("not_request")
        if msg.hln > 16:
            raise _Drop("bad_hlen")
        if msg.giaddr:
            raise _Drop("relayed")  # no relay agents on the virtual LAN

        opts: dict[int, bytes] = {}
        _parse_options(payload[OPTIONS_OFFSET:], opts)
        overload = opts.pop(OPT_OVERLOAD, None)
        if overload is not None:  # RFC 2132 section 9.3: options continue in file, then sname
            if len(overload) != 1 or overload[0] not in (1, 2, 3):
                raise _Drop("bad_overload")
            extra: dict[int, bytes] = {}
            if overload[0] & 1:
                _parse_options(payload[_FILE], extra)
            if overload[0] & 2:
                _parse_options(payload[_SNAME], extra)
            extra.pop(OPT_OVERLOAD, None)
            for code, value in extra.items():
                opts[code] = opts.get(code, b"") + value

        mtype = opts.get(OPT_MSG_TYPE)
        if mtype is None or len(mtype) != 1:
            raise _Drop("no_msg_type")
        mac = msg.chaddr[:6] if (msg.hrd == 1 and msg.hln == 6) else client_mac
        if len(mac) != 6:
            raise _Drop("bad_mac")

        kind = mtype[0]
        if kind == DHCPDISCOVER:
            return self._discover(payload, msg, opts, mac, now)
        if kind == DHCPREQUEST:
            return self._request(payload, msg, opts, mac, now)
        if kind == DHCPINFORM:
            return self._inform(payload, msg, opts)
        if kind == DHCPRELEASE:
            lease = self._by_mac.get(mac)
            if self._foreign_server(opts) or lease is None or lease.addr != msg.ciaddr:
                raise _Drop("release_unknown")
            lease.expires = 0.0
            lease.reserved_until = 0.0
            return None
        if kind == DHCPDECLINE:
            lease = self._by_mac.get(mac)
            req = self._addr_opt(opts, OPT_REQUESTED_IP)
            if self._foreign_server(opts) or lease is None or lease.addr != req:
                raise _Drop("decline_unknown")
            # Someone else uses the address: quarantine it and unbind the client.
            del self._by_mac[mac]
            lease.mac = None
            lease.expires = 0.0
            lease.reserved_until = now + DECLINE_HOLD
            log.info("DHCP: %s declined by %s, quarantined", ipaddress.IPv4Address(req), mac.hex(":"))
            return None
        raise _Drop("unexpected_msg_type")

    @staticmethod
    def _addr_opt(opts: dict[int, bytes], code: int) -> int | None:
        value = opts.get(code)
        if value is None:
            return None
        if len(value) != 4:
            raise _Drop("bad_option")
        return int.from_bytes(value, "big")

    def _foreign_server(self, opts: dict[int, bytes]) -> bool:
        sid = self._addr_opt(opts, OPT_SERVER_ID)
        return sid is not None and sid != self._server_id

    def _in_pool(self, addr: int) -> bool:
        return self._pool_first <= addr <= self._pool_last and addr not in self._excluded

    def _bind(self, mac: bytes, addr: int) -> _Lease:
        lease = _Lease(mac, addr)
        self._by_mac[mac] = lease
        self._by_addr[addr] = lease
        return lease

    def _allocate(self, mac: bytes, now: float, requested: int | None) -> _Lease | None:
        """The binding of ``mac``, else a new one (requested address, fresh address, reclaimed)."""
        lease = self._by_mac.get(mac)
        if lease is not None:
            return lease
        full = len(self._by_addr) >= MAX_BINDINGS
        if not full and requested is not None and self._in_pool(requested) and requested not in self._by_addr:
            return self._bind(mac, requested)
        while not full and self._cursor <= self._pool_last:
            addr = self._cursor
            self._cursor += 1
            if addr not in self._excluded and addr not in self._by_addr:
                return self._bind(mac, addr)
        # Pool (or table) exhausted: reuse the binding idle the longest.
        victim = None
        for cand in self._by_addr.values():
            if not cand.active(now) and (victim is None or cand.end() < victim.end()):
                victim = cand
        if victim is None:
            return None
        if victim.mac is not None:
            del self._by_mac[victim.mac]
        del self._by_addr[victim.addr]
        return self._bind(mac, victim.addr)

    def _discover(self, payload, msg, opts, mac, now):
        requested = self._addr_opt(opts, OPT_REQUESTED_IP)
        lease = self._allocate(mac, now, requested)
        if lease is None:
            log.warning("DHCP: address pool exhausted, ignoring DISCOVER from %s", mac.hex(":"))
            raise _Drop("pool_exhausted")
        lease.reserved_until = max(lease.reserved_until, now + OFFER_HOLD)
        return self._reply(payload, msg, opts, DHCPOFFER, yiaddr=lease.addr, ciaddr=0, lease=True)

    def _request(self, payload, msg, opts, mac, now):
        if self._foreign_server(opts):
            raise _Drop("other_server")  # the client chose another server's offer
        requested = self._addr_opt(opts, OPT_REQUESTED_IP)
        target = requested if requested is not None else msg.ciaddr
        if not target:
            raise _Drop("bad_request")
        lease = self._by_mac.get(mac)
        if lease is None and self._in_pool(target) and target not in self._by_addr:
            # Unknown client (e.g. the stack restarted): we are the only server, so grant.
            if len(self._by_addr) < MAX_BINDINGS:
                lease = self._bind(mac, target)
        if lease is None or lease.addr != target:
            return self._nak(payload, msg, opts, "requested address not available")
        lease.expires = now + self._lease_time
        lease.reserved_until = 0.0
        return self._reply(payload, msg, opts, DHCPACK, yiaddr=target, ciaddr=msg.ciaddr, lease=True)

    def _inform(self, payload, msg, opts):
        # RFC 2131 section 3.4 / 4.3.5: configuration only, no lease, no yiaddr.
        return self._reply(payload, msg, opts, DHCPACK, yiaddr=0, ciaddr=msg.ciaddr, lease=False)

    def _nak(self, payload, msg, opts, text: str):
        out = [(OPT_MSG_TYPE, bytes([DHCPNAK])), (OPT_SERVER_ID, struct.pack("!I", self._server_id))]
        if OPT_CLIENT_ID in opts:
            out.append((OPT_CLIENT_ID, opts[OPT_CLIENT_ID]))
        out.append((OPT_MESSAGE, text.encode()))
        self.sent["NAK"] = self.sent.get("NAK", 0) + 1
        # RFC 2131 section 4.1: without a relay a DHCPNAK is always broadcast.
        return self._build(payload, msg, 0, 0, out), True

    def _reply(self, payload, msg, opts, kind: int, *, yiaddr: int, ciaddr: int, lease: bool):
        head = [(OPT_MSG_TYPE, bytes([kind])), (OPT_SERVER_ID, struct.pack("!I", self._server_id))]
        if lease:
            head += self._lease_opts
        head += self._common
        tail = []
        if OPT_CLIENT_ID in opts:  # RFC 6842
            tail.append((OPT_CLIENT_ID, opts[OPT_CLIENT_ID]))
        limit = DEFAULT_MAX_MESSAGE
        max_size = opts.get(OPT_MAX_SIZE)
        if max_size is not None and len(max_size) == 2:
            limit = max(limit, int.from_bytes(max_size, "big"))
        optional = list(self._optional)
        while True:
            reply = self._build(payload, msg, yiaddr, ciaddr, head + optional + tail)
            if len(reply) + IP_UDP_HEADERS <= limit or not optional:
                break
            optional.pop()  # search list first, then the domain name
        name = "OFFER" if kind == DHCPOFFER else "ACK"
        self.sent[name] = self.sent.get(name, 0) + 1
        # RFC 2131 section 4.1 (giaddr is zero here): ciaddr set -> unicast to it;
        # else broadcast bit -> broadcast; else unicast to yiaddr and chaddr.
        if ciaddr:
            broadcast = False
        elif msg.flags & BROADCAST_FLAG or not yiaddr:
            broadcast = True
        else:
            broadcast = False
        return reply, broadcast

    def _build(self, payload: bytes, msg, yiaddr: int, ciaddr: int, options) -> bytes:
        hdr = _dpkt().dhcp.DHCP(
            op=BOOTREPLY,
            hrd=msg.hrd,
            hln=msg.hln,
            hops=0,
            xid=msg.xid,
            secs=0,
            flags=msg.flags & BROADCAST_FLAG,
            ciaddr=ciaddr,
            yiaddr=yiaddr,
            siaddr=0,
            giaddr=0,
            chaddr=payload[28:44],
            magic=MAGIC,
        ).pack_hdr()
        out = bytearray(hdr)
        for code, value in options:
            # RFC 3396: values longer than 255 bytes are split over several instances.
            chunks = [value[i : i + 255] for i in range(0, len(value), 255)] or [b""]
            for chunk in chunks:
                out.append(code)
                out.append(len(chunk))
                out += chunk
        out.append(OPT_END)
        if len(out) < MIN_REPLY_LEN:
            out += bytes(MIN_REPLY_LEN - len(out))
        return bytes(out)
