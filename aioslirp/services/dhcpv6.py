"""Sans-IO stateless DHCPv6 server (RFC 8415) for the virtual link.

Addresses come from SLAAC (our RAs carry the prefix with the A flag and M=0); DHCPv6 only hands
out configuration (RAs set O=1): DNS recursive name server ``dns6`` (option 23, RFC 3646) and the
domain search list (option 24). The server identifies itself with a DUID-LL built from the
gateway MAC (RFC 8415 11.4: type 3, hardware type 1).

What each client message gets (RFC 8415 sections 16 and 18.3):

=====================  ==========================================================================
Information-request    Reply: Server ID, the client's Client ID (when sent), DNS servers, domain
                       list (when search domains are configured), Information Refresh Time.
                       Discarded when it carries an IA option or another server's Server ID.
Solicit                Advertise with a top-level Status Code NoAddrsAvail, Server ID, Client ID
                       and SOL_MAX_RT 3600 s, so stateful clients back off (18.3.9; the client
                       ignores such an Advertise, 18.2.9). Rapid Commit is ignored: no Reply,
                       no binding. Discarded without Client ID, with a Server ID, or via unicast.
Request                Reply: every IA_NA / IA_TA with T1=T2=0 and Status NoAddrsAvail, every
                       IA_PD with NoPrefixAvail (18.3.2), plus DNS options. Via unicast: Reply
                       with Status UseMulticast (we never send Server Unicast).
Renew / Rebind         Reply: every IA with Status NoBinding (we hold no bindings), DNS options.
Confirm                Reply: Status Success when every address in the IAs is inside ``cidr6``,
                       else NotOnLink (18.3.3); no reply when there is no address.
Release / Decline      Reply: Status Success, every IA with NoBinding (18.3.7, 18.3.8).
Relay-forward, server  Dropped: no relay agents on the virtual link; servers' messages are not
messages, others       for us.
=====================  ==========================================================================

:meth:`Dhcpv6Server.handle` takes the UDP payload of a guest datagram to port 547 and returns
the reply payload (``bytes``) — to be sent from our link-local address, port 547, to the
client's source address and port (546), Ethernet destination the client's MAC — or a
drop-reason string. It never raises on guest input, does no I/O and reads no clock.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter

from .dhcp import dns_labels

__all__ = ["Dhcpv6Server", "encode_domain_list", "duid_ll"]

log = logging.getLogger(__name__)

SOLICIT, ADVERTISE, REQUEST, CONFIRM, RENEW, REBIND, REPLY = 1, 2, 3, 4, 5, 6, 7
RELEASE, DECLINE, RECONFIGURE, INFORMATION_REQUEST, RELAY_FORW, RELAY_REPL = 8, 9, 10, 11, 12, 13
MSG_NAMES = {SOLICIT: "solicit", REQUEST: "request", CONFIRM: "confirm", RENEW: "renew", REBIND: "rebind",
             RELEASE: "release", DECLINE: "decline", INFORMATION_REQUEST: "information_request"}

OPT_CLIENTID, OPT_SERVERID, OPT_IA_NA, OPT_IA_TA, OPT_IAADDR, OPT_ORO = 1, 2, 3, 4, 5, 6
OPT_ELAPSED_TIME, OPT_STATUS_CODE, OPT_RAPID_COMMIT = 8, 13, 14
OPT_DNS_SERVERS, OPT_DOMAIN_LIST, OPT_IA_PD, OPT_IAPREFIX = 23, 24, 25, 26
OPT_INFORMATION_REFRESH_TIME, OPT_SOL_MAX_RT = 32, 82

STATUS_SUCCESS, STATUS_UNSPEC_FAIL, STATUS_NO_ADDRS_AVAIL, STATUS_NO_BINDING = 0, 1, 2, 3
STATUS_NOT_ON_LINK, STATUS_USE_MULTICAST, STATUS_NO_PREFIX_AVAIL = 4, 5, 6

DUID_LL = 3
HWTYPE_ETHERNET = 1
SOL_MAX_RT = 3600
MAX_DUID = 130  # RFC 8415 11.1: a DUID is at most 128 octets after its 2-byte type

_OPT = struct.Struct("!HH")
_H = struct.Struct("!H")
_I = struct.Struct("!I")


class _Drop(Exception):
    """Internal: ``args[0]`` is the drop reason."""


def duid_ll(mac: bytes) -> bytes:
    """DUID-LL (RFC 8415 11.4) for an Ethernet MAC: ``00 03 00 01`` + the 6 MAC bytes."""
    return struct.pack("!HH", DUID_LL, HWTYPE_ETHERNET) + bytes(mac)


def encode_domain_list(domains: list[str]) -> bytes:
    """Domain names in uncompressed DNS wire format, concatenated (RFC 8415 10, RFC 8106 5.2).

    Invalid names (empty label, label > 63 bytes, name > 255 bytes, not IDNA-encodable) are
    skipped with a warning. ``["example.com"]`` -> ``b"\\x07example\\x03com\\x00"``.
    """
    out = bytearray()
    for name in domains:
        labels = dns_labels(name)
        if labels is None:
            log.warning("DHCPv6/RA: skipping invalid search domain %r", name)
            continue
        for lab in labels:
            out.append(len(lab))
            out += lab
        out.append(0)
    return bytes(out)


def _opt(code: int, data: bytes) -> bytes:
    return _OPT.pack(code, len(data)) + data


def _status(code: int, message: str) -> bytes:
    return _opt(OPT_STATUS_CODE, _H.pack(code) + message.encode())


def parse_options(buf, start: int = 0, end: int | None = None) -> list[tuple[int, bytes]]:
    """Walk DHCPv6 options ``code(2) len(2) data`` from ``start`` to ``end`` (RFC 8415 21.1).

    Returns ``[(code, data), ...]`` in order; raises ``_Drop("option_overrun")`` when an
    option runs past ``end``.
    """
    end = len(buf) if end is None else end
    out = []
    i = start
    while i < end:
        if i + 4 > end:
            raise _Drop("option_overrun")
        code, olen = _OPT.unpack_from(buf, i)
        j = i + 4 + olen
        if j > end:
            raise _Drop("option_overrun")
        out.append((code, bytes(buf[i + 4:j])))
        i = j
    return out


class Dhcpv6Server:
    """Stateless DHCPv6 server of one virtual link.

    Args:
        config6: a validated :class:`~aioslirp.config.ipv6.Ipv6Config` (``dns6``, ``dns_search``,
            ``cidr6``, ``info_refresh_time``).
        gateway_mac: 6-byte MAC for the DUID-LL.

    Attributes:
        duid: our DUID (10 bytes). ``sent``: replies by message name (``reply``, ``advertise``).
    """

    __slots__ = ("config6", "duid", "sent", "_prefix8", "_dns_opt", "_domain_opt", "_irt_opt")

    config6: object
    duid: bytes
    sent: Counter
    #: The first 8 bytes of the guest prefix.
    _prefix8: bytes
    #: Encoded options of every reply.
    _dns_opt: bytes
    _domain_opt: bytes
    _irt_opt: bytes

    def __init__(self, config6, gateway_mac: bytes) -> None:
        if not hasattr(config6.cidr6, "network_address"):
            config6.validate()
        self.config6 = config6
        self.duid = duid_ll(gateway_mac)
        self.sent: Counter = Counter()
        self._prefix8 = config6.prefix_bytes[:8]
        self._dns_opt = _opt(OPT_DNS_SERVERS, config6.dns6_bytes)
        names = encode_domain_list(config6.dns_search)
        self._domain_opt = _opt(OPT_DOMAIN_LIST, names) if names else b""
        self._irt_opt = _opt(OPT_INFORMATION_REFRESH_TIME, _I.pack(int(config6.info_refresh_time)))

    def handle(self, payload, unicast: bool = False):
        """Process one DHCPv6 message from a client (UDP payload to port 547).

        ``unicast``: the IPv6 destination was one of our unicast addresses rather than
        ``ff02::1:2`` (All_DHCP_Relay_Agents_and_Servers). Returns the reply payload
        (``bytes``) or a drop reason: ``truncated``, ``relayed``, ``not_client_msg``,
        ``unexpected_msg_type``, ``option_overrun``, ``duplicate_id``, ``bad_duid``,
        ``no_client_id``, ``no_server_id``, ``other_server``, ``unexpected_server_id``,
        ``unexpected_ia``, ``bad_ia``, ``unicast_not_allowed``, ``confirm_no_addresses``.
        """
        try:
            return self._handle(bytes(payload), unicast)
        except _Drop as d:
            return d.args[0]
        except Exception:  # never let guest input raise into the stack
            log.debug("DHCPv6: unexpected error on a guest message", exc_info=True)
            return "error"

    # ------------------------------------------------------------------ internal
    def _handle(self, msg: bytes, unicast: bool) -> bytes:
        if len(msg) < 4:
            raise _Drop("truncated")
        mtype = msg[0]
        xid = msg[1:4]
        if mtype == RELAY_FORW:
            raise _Drop("relayed")
        if mtype in (ADVERTISE, REPLY, RECONFIGURE, RELAY_REPL):
            raise _Drop("not_client_msg")
        if mtype not in MSG_NAMES:
            raise _Drop("unexpected_msg_type")
        opts = parse_options(msg, 4)
        client_id = server_id = None
        ias = []
        for code, data in opts:
            if code == OPT_CLIENTID or code == OPT_SERVERID:
                if not 3 <= len(data) <= MAX_DUID:
                    raise _Drop("bad_duid")
                if code == OPT_CLIENTID:
                    if client_id is not None:
                        raise _Drop("duplicate_id")
                    client_id = data
                else:
                    if server_id is not None:
                        raise _Drop("duplicate_id")
                    server_id = data
            elif code in (OPT_IA_NA, OPT_IA_TA, OPT_IA_PD):
                ias.append((code, data))
        if server_id is not None and server_id != self.duid:
            raise _Drop("other_server")
        head = bytes((0,)) + xid + _opt(OPT_SERVERID, self.duid)
        if client_id is not None:
            head += _opt(OPT_CLIENTID, client_id)

        if mtype == INFORMATION_REQUEST:  # RFC 8415 16.12
            if ias:
                raise _Drop("unexpected_ia")
            return self._reply(REPLY, head + self._config_opts() + self._irt_opt)

        if client_id is None:
            raise _Drop("no_client_id")
        if mtype in (SOLICIT, CONFIRM, REBIND):  # 16.2, 16.5, 16.7: no Server ID, multicast only
            if server_id is not None:
                raise _Drop("unexpected_server_id")
            if unicast:
                raise _Drop("unicast_not_allowed")
        elif server_id is None:  # Request, Renew, Release, Decline (16.4, 16.6, 16.9, 16.10)
            raise _Drop("no_server_id")
        elif unicast:
            return self._reply(REPLY, head + _status(STATUS_USE_MULTICAST, "use multicast"))

        if mtype == SOLICIT:
            body = head + _status(STATUS_NO_ADDRS_AVAIL, "addresses by SLAAC only") + \
                _opt(OPT_SOL_MAX_RT, _I.pack(SOL_MAX_RT))
            return self._reply(ADVERTISE, body)
        if mtype == CONFIRM:
            addrs = [a for code, data in ias for a in self._ia_addrs(code, data)]
            if not addrs:
                raise _Drop("confirm_no_addresses")
            if all(a[:8] == self._prefix8 for a in addrs):
                return self._reply(REPLY, head + _status(STATUS_SUCCESS, "on link"))
            return self._reply(REPLY, head + _status(STATUS_NOT_ON_LINK, "not on link"))
        if mtype == REQUEST:
            body = head + b"".join(self._ia_status(code, data, STATUS_NO_PREFIX_AVAIL if code == OPT_IA_PD
                                                   else STATUS_NO_ADDRS_AVAIL) for code, data in ias)
            return self._reply(REPLY, body + self._config_opts())
        if mtype in (RENEW, REBIND):
            body = head + b"".join(self._ia_status(code, data, STATUS_NO_BINDING) for code, data in ias)
            return self._reply(REPLY, body + self._config_opts())
        # RELEASE, DECLINE
        body = head + _status(STATUS_SUCCESS, "ok") + \
            b"".join(self._ia_status(code, data, STATUS_NO_BINDING) for code, data in ias)
        return self._reply(REPLY, body)

    def _reply(self, mtype: int, body: bytes) -> bytes:
        self.sent["advertise" if mtype == ADVERTISE else "reply"] += 1
        return bytes((mtype,)) + body[1:]

    def _config_opts(self) -> bytes:
        return self._dns_opt + self._domain_opt

    @staticmethod
    def _ia_fixed(code: int) -> int:
        return 4 if code == OPT_IA_TA else 12

    def _ia_status(self, code: int, data: bytes, status: int) -> bytes:
        """The IA echoed with no leases: IAID, T1=T2=0 (IA_NA / IA_PD), a Status Code sub-option."""
        fixed = self._ia_fixed(code)
        if len(data) < fixed:
            raise _Drop("bad_ia")
        parse_options(data, fixed)  # validate the sub-options
        names = {STATUS_NO_ADDRS_AVAIL: "no addresses: use SLAAC", STATUS_NO_PREFIX_AVAIL: "no prefixes",
                 STATUS_NO_BINDING: "no binding"}
        return _opt(code, data[:4] + bytes(fixed - 4) + _status(status, names[status]))

    def _ia_addrs(self, code: int, data: bytes) -> list[bytes]:
        """Addresses (16 bytes) in the IA Address sub-options of an IA_NA / IA_TA."""
        if code == OPT_IA_PD:
            return []
        fixed = self._ia_fixed(code)
        if len(data) < fixed:
            raise _Drop("bad_ia")
        out = []
        for sub, sdata in parse_options(data, fixed):
            if sub == OPT_IAADDR:
                if len(sdata) < 24:
                    raise _Drop("bad_ia")
                out.append(sdata[:16])
        return out
