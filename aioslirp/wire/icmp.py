"""ICMP (RFC 792) and ICMPv6 (RFC 4443, RFC 4861 message types) on the wire: types, codes, builders.

Every ICMP and ICMPv6 type and code the stack uses is defined here, once. A flow that cannot
reach its destination names *why* with a kind (:data:`KIND_NET`, :data:`KIND_HOST`,
:data:`KIND_PORT`, :data:`KIND_ADMIN`, and :data:`KIND_TOO_BIG` for IPv6), and the family maps
it to its own ``(type, code)``: :data:`UNREACH4` for ICMP, :data:`UNREACH6` for ICMPv6 (RFC 4443
3.1 gives the IPv6 equivalents of the ICMP codes). :data:`UNREACH4_KIND` turns an ICMP code back
into its kind, for callers that still speak ICMP codes.

Builders return an IP packet *without* Ethernet header: :func:`build_icmp_packet` /
:func:`build_icmp6_packet` one message, :func:`echo_reply4` / :func:`echo_reply6` the Echo Reply
to a request, :func:`build_icmp_error` / :func:`build_icmp6_error` an error quoting the
offending packet (RFC 792: its header + 8 bytes; RFC 4443 2.4 (c): as much as fits in 1280
bytes, and not at all where 2.4 (e) forbids it). Rate limits are the caller's.
"""

from __future__ import annotations

import struct

from .checksum import checksum, finish, partial
from .ip import PROTO_ICMP, PROTO_ICMPV6
from .ipv4 import ip_header, next_ident
from .ipv6 import (DEFAULT_HLIM, IPV6, IPV6_HLEN, MIN_MTU, UNSPECIFIED, VTF6, Ipv6, l4_checksum_ok, parse_ipv6,
                   pseudo_sum6)

__all__ = [
    "ICMP", "ICMP6", "ICMP_ECHO_REPLY", "ICMP_UNREACH", "ICMP_ECHO", "ICMP_TIME_EXCEEDED",
    "UNREACH_NET", "UNREACH_HOST", "UNREACH_PROTO", "UNREACH_PORT", "UNREACH_NEEDFRAG", "UNREACH_ADMIN",
    "ICMP6_DST_UNREACH", "ICMP6_PACKET_TOO_BIG", "ICMP6_TIME_EXCEEDED", "ICMP6_PARAM_PROB",
    "ICMP6_ECHO_REQUEST", "ICMP6_ECHO_REPLY", "ND_ROUTER_SOLICIT", "ND_ROUTER_ADVERT",
    "ND_NEIGHBOR_SOLICIT", "ND_NEIGHBOR_ADVERT", "ND_REDIRECT",
    "UNREACH6_NOROUTE", "UNREACH6_ADMIN", "UNREACH6_BEYONDSCOPE", "UNREACH6_ADDR", "UNREACH6_PORT",
    "UNREACH6_POLICY", "UNREACH6_REJECT",
    "KIND_NET", "KIND_HOST", "KIND_PORT", "KIND_ADMIN", "KIND_TOO_BIG", "UNREACH4", "UNREACH6", "UNREACH4_KIND",
    "build_icmp_packet", "echo_reply4", "build_icmp_error", "build_icmp6_packet", "echo_reply6",
    "icmp6_error_allowed", "build_icmp6_error",
]

# ------------------------------------------------------------------ ICMP (IPv4)
#: ``(type, code, csum, rest)`` — 8 bytes (``rest``: identifier << 16 | sequence for echo).
ICMP = struct.Struct("!BBHI")
# Types (RFC 792).
ICMP_ECHO_REPLY = 0
ICMP_UNREACH = 3
ICMP_ECHO = 8
ICMP_TIME_EXCEEDED = 11
# Destination Unreachable codes (RFC 792, RFC 1812 5.2.7.1: 13 communication administratively prohibited).
UNREACH_NET = 0
UNREACH_HOST = 1
UNREACH_PROTO = 2
UNREACH_PORT = 3
UNREACH_NEEDFRAG = 4
UNREACH_ADMIN = 13

# ------------------------------------------------------------------ ICMPv6
#: ``(type, code, csum)`` — first 4 bytes of every ICMPv6 message.
ICMP6 = struct.Struct("!BBH")
# Types (RFC 4443; Neighbor Discovery, RFC 4861).
ICMP6_DST_UNREACH = 1
ICMP6_PACKET_TOO_BIG = 2
ICMP6_TIME_EXCEEDED = 3
ICMP6_PARAM_PROB = 4
ICMP6_ECHO_REQUEST = 128
ICMP6_ECHO_REPLY = 129
ND_ROUTER_SOLICIT = 133
ND_ROUTER_ADVERT = 134
ND_NEIGHBOR_SOLICIT = 135
ND_NEIGHBOR_ADVERT = 136
ND_REDIRECT = 137
# Destination Unreachable codes (RFC 4443 3.1).
UNREACH6_NOROUTE = 0
UNREACH6_ADMIN = 1
UNREACH6_BEYONDSCOPE = 2
UNREACH6_ADDR = 3
UNREACH6_PORT = 4
UNREACH6_POLICY = 5
UNREACH6_REJECT = 6

# ------------------------------------------------------------------ unreachable kinds
#: No route to the destination network (connect: ``ENETUNREACH``).
KIND_NET = "net"
#: The destination host does not answer (``EHOSTUNREACH``, a connect timeout, no route for it).
KIND_HOST = "host"
#: Nothing listens on the destination port (UDP: ``ECONNREFUSED``).
KIND_PORT = "port"
#: The egress policy refuses the destination.
KIND_ADMIN = "admin"
#: The packet exceeds the link MTU (IPv6 Packet Too Big; its ``param`` is the MTU).
KIND_TOO_BIG = "too_big"

#: kind -> ICMP ``(type, code)``.
UNREACH4 = {
    KIND_NET: (ICMP_UNREACH, UNREACH_NET),
    KIND_HOST: (ICMP_UNREACH, UNREACH_HOST),
    KIND_PORT: (ICMP_UNREACH, UNREACH_PORT),
    KIND_ADMIN: (ICMP_UNREACH, UNREACH_ADMIN),
}
#: kind -> ICMPv6 ``(type, code)`` (RFC 4443 3.1: host unreachable is "address unreachable").
UNREACH6 = {
    KIND_NET: (ICMP6_DST_UNREACH, UNREACH6_NOROUTE),
    KIND_HOST: (ICMP6_DST_UNREACH, UNREACH6_ADDR),
    KIND_PORT: (ICMP6_DST_UNREACH, UNREACH6_PORT),
    KIND_ADMIN: (ICMP6_DST_UNREACH, UNREACH6_ADMIN),
    KIND_TOO_BIG: (ICMP6_PACKET_TOO_BIG, 0),
}
#: ICMP Destination Unreachable code -> kind (the codes the flows send).
UNREACH4_KIND = {code: kind for kind, (_type, code) in UNREACH4.items()}

_I = struct.Struct("!I")
_H = struct.Struct("!H")


# ------------------------------------------------------------------ ICMP builders
def build_icmp_packet(src: bytes, dst: bytes, icmp_type: int, code: int, rest: int, payload) -> bytearray:
    """IPv4 packet *without* Ethernet header carrying one ICMP message (TTL 64, DF clear).

    ``rest``: the 32-bit word after the checksum (identifier and sequence for an echo, 0 for an
    error); ``payload``: what follows it.
    """
    ilen = 8 + len(payload)
    buf = bytearray(20 + ilen)
    ICMP.pack_into(buf, 20, icmp_type, code, 0, rest)
    buf[28:] = payload
    _H.pack_into(buf, 22, checksum(memoryview(buf)[20:]))  # no pseudo-header: may be all zero
    ip_header(buf, 0, src, dst, PROTO_ICMP, 20 + ilen, next_ident(), 0)
    return buf


def echo_reply4(src: bytes, dst: bytes, rest: int, data) -> bytearray:
    """Echo Reply (RFC 792) from ``src`` to ``dst`` with the request's identifier/sequence word
    ``rest`` and its ``data``."""
    return build_icmp_packet(src, dst, ICMP_ECHO_REPLY, 0, rest, data)


def build_icmp_error(icmp_type: int, code: int, orig) -> bytearray | None:
    """An ICMP error about ``orig`` (the offending IPv4 packet from its header on), to its source,
    from its destination, quoting its header and the first 8 bytes of its data (RFC 792).

    ``None`` when ``orig`` is shorter than 28 bytes.
    """
    orig = bytes(orig)
    if len(orig) < 28:
        return None
    ihl = (orig[0] & 0x0F) * 4
    return build_icmp_packet(orig[16:20], orig[12:16], icmp_type, code, 0, orig[: ihl + 8])


# ------------------------------------------------------------------ ICMPv6 builders
def build_icmp6_packet(src: bytes, dst: bytes, icmp_type: int, code: int, body, hlim: int = DEFAULT_HLIM) -> bytearray:
    """IPv6 packet *without* Ethernet header carrying one ICMPv6 message.

    ``body``: everything after the 4-byte type/code/checksum (e.g. identifier, sequence and
    data for an echo; the reserved/flags word and fields for NDP). The checksum covers the
    pseudo-header (RFC 4443 2.3). NDP messages need ``hlim=255`` (RFC 4861).
    """
    ilen = 4 + len(body)
    buf = bytearray(IPV6_HLEN + ilen)
    IPV6.pack_into(buf, 0, VTF6, ilen, PROTO_ICMPV6, hlim, src, dst)
    ICMP6.pack_into(buf, 40, icmp_type, code, 0)
    buf[44:] = body
    _H.pack_into(buf, 42, finish(pseudo_sum6(src, dst, PROTO_ICMPV6, ilen) + partial(memoryview(buf)[40:])))
    return buf


def echo_reply6(buf, ip: Ipv6, local: bytes | None = None):
    """Echo Reply (RFC 4443 4.2) to the Echo Request described by ``ip`` in ``buf``.

    Returns the reply as an IPv6 packet (no Ethernet header) from ``local`` (default: the
    request's destination) to the request's source, same identifier, sequence and data; or a
    drop reason: ``icmp6_not_echo``, ``icmp6_truncated``, ``icmp6_bad_checksum``,
    ``icmp6_echo_fragmented`` (the caller reassembles first), ``icmp6_echo_bad_src``
    (unspecified source), ``icmp6_echo_multicast`` (multicast request and no unicast ``local``).
    """
    if ip.frag is not None:
        return "icmp6_echo_fragmented"
    msg = memoryview(buf)[ip.l4:ip.end]
    if len(msg) < 8:
        return "icmp6_truncated"
    if msg[0] != ICMP6_ECHO_REQUEST or msg[1] != 0:
        return "icmp6_not_echo"
    if not l4_checksum_ok(ip.src, ip.dst, PROTO_ICMPV6, msg):
        return "icmp6_bad_checksum"
    if ip.src == UNSPECIFIED:
        return "icmp6_echo_bad_src"
    src = ip.dst if local is None else local
    if src[0] == 0xFF:  # RFC 4443 4.2: a reply to a multicast request comes from a unicast address
        return "icmp6_echo_multicast"
    return build_icmp6_packet(src, ip.src, ICMP6_ECHO_REPLY, 0, msg[4:])


def icmp6_error_allowed(orig, icmp_type: int, code: int = 0, link_multicast: bool = False) -> bool:
    """Whether RFC 4443 section 2.4 (e) allows an ICMPv6 error about ``orig`` (an IPv6 packet).

    Refused: about an ICMPv6 error or a Redirect; about a packet to a multicast address or
    sent as link-layer multicast/broadcast (``link_multicast``), except Packet Too Big and
    Parameter Problem code 2; about a packet whose source is unspecified or multicast.
    """
    if len(orig) < IPV6_HLEN:
        return False
    src = bytes(orig[8:24])
    dst = bytes(orig[24:40])
    if src == UNSPECIFIED or src[0] == 0xFF:
        return False
    if (dst[0] == 0xFF or link_multicast) and not (
            icmp_type == ICMP6_PACKET_TOO_BIG or (icmp_type == ICMP6_PARAM_PROB and code == 2)):
        return False
    ip = parse_ipv6(orig, 0)
    if type(ip) is not str and ip.proto == PROTO_ICMPV6 and ip.l4 < len(orig) and (ip.frag is None or ip.frag[0] == 0):
        t = orig[ip.l4]
        if t < 128 or t == ND_REDIRECT:
            return False
    return True


def build_icmp6_error(icmp_type: int, code: int, orig, src: bytes | None = None, param: int = 0,
                      link_multicast: bool = False) -> bytearray | None:
    """An ICMPv6 error about ``orig`` (the offending IPv6 packet, no Ethernet header), to its source.

    ``icmp_type``: 1 Destination Unreachable (``code`` 0-6, RFC 4443 3.1), 2 Packet Too Big
    (``param`` = the MTU, 3.2), 3 Time Exceeded, 4 Parameter Problem (``param`` = pointer).
    ``src``: our address sending it (default: the original destination, as the host there
    would). The message quotes as much of ``orig`` as fits in a 1280-byte packet (2.4 (c)).
    Returns ``None`` when :func:`icmp6_error_allowed` says no. Rate limiting (2.4 (f)) is the
    caller's (see :class:`~aioslirp.ratelimit.TokenBucket`).
    """
    if not icmp6_error_allowed(orig, icmp_type, code, link_multicast):
        return None
    quoted = bytes(orig[:MIN_MTU - IPV6_HLEN - 8])
    if src is None:
        src = bytes(orig[24:40])
    return build_icmp6_packet(src, bytes(orig[8:24]), icmp_type, code, _I.pack(param & 0xFFFFFFFF) + quoted)
