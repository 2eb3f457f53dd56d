"""IPv6 (RFC 8200) and ICMPv6 (RFC 4443) on the wire: parsing, extension headers, reassembly, building.

Theory of operation
-------------------
:func:`parse_ipv6` reads the fixed 40-byte header with one precompiled struct and, when the
Next Header field names an extension header, walks the chain (:func:`walk_ext`) until it
reaches an upper-layer protocol. It returns an :class:`Ipv6` (slotted, offsets into the
caller's buffer, no copy) or a **drop reason** string such as ``"ipv6_bad_length"``; the
stack counts it as ``drop.<reason>``. Nothing here raises on guest input.

Extension headers (RFC 8200 section 4) are bounded: at most :data:`MAX_EXT_HEADERS` headers,
each one inside the payload. Hop-by-Hop must come first (4.3); options in Hop-by-Hop and
Destination Options are walked TLV by TLV and an unknown option whose action bits say
"discard" drops the packet (4.2; we never send Parameter Problem for it). A Routing header
with Segments Left > 0 is dropped (4.4, we do not source-route; RFC 5095 deprecated type 0);
with Segments Left == 0 it is skipped. A second Fragment header is a drop.

Fragments (RFC 8200 4.5): the Fragment header stops the walk. :attr:`Ipv6.frag` holds
``(offset_in_bytes, more, ident)`` and :attr:`Ipv6.l4` points at the fragmentable part.
For the first fragment (offset 0) the rest of the chain is checked to lie in that fragment
(RFC 7112). :class:`Ipv6Reassembler` (built on :class:`~aioslirp.wire.reassembly.Reassembler`,
so overlapping fragments discard the whole datagram, RFC 5722) returns the reassembled
datagram as a complete unfragmented IPv6 packet, which the caller parses again with
:func:`parse_ipv6`; atomic fragments (offset 0, M=0, RFC 6946) come back at once.

Building mirrors :mod:`aioslirp.wire.ipv4`: :func:`build_tcp6` returns a whole Ethernet frame,
:func:`build_udp6_packet` / :func:`build_icmp6_packet` an IPv6 packet without Ethernet
header; checksums use the RFC 8200 section 8.1 pseudo-header. :func:`build_icmp6_error`
builds Destination Unreachable / Packet Too Big / Time Exceeded / Parameter Problem with as
much of the offending packet as fits in 1280 bytes, and refuses (returns ``None``) where
RFC 4443 section 2.4 (e) forbids an error. Addresses are 16-byte ``bytes`` throughout.
"""

from __future__ import annotations

import itertools
import struct
import time

from .checksum import finish, partial
from .ethernet import ETH, ETH_HLEN, ETHERTYPE_IPV6
from ..ratelimit import ICMP_ERROR_BURST, ICMP_ERROR_RATE, TokenBucket  # noqa: F401 - their old import path
from .reassembly import DEFAULT_MAX_BYTES, Reassembler

__all__ = [
    "IPV6", "Ipv6", "Ipv6Reassembler", "TokenBucket", "parse_ipv6", "walk_ext", "pseudo_sum6",
    "l4_checksum_ok", "ip6_header", "build_tcp6", "build_udp6_packet", "build_icmp6_packet",
    "build_icmp6_error", "icmp6_error_allowed", "echo_reply6", "fragment6", "eth6",
    "multicast_mac", "solicited_node", "link_local_from_mac", "is_multicast", "is_link_local",
    "UNSPECIFIED", "ALL_NODES", "ALL_ROUTERS", "MIN_MTU",
]

# Next Header values (IANA "Assigned Internet Protocol Numbers").
NH_HOPOPTS = 0
NH_TCP = 6
NH_UDP = 17
NH_ROUTING = 43
NH_FRAGMENT = 44
NH_ESP = 50
NH_AH = 51
NH_ICMPV6 = 58
NH_NONE = 59
NH_DSTOPTS = 60
PROTO_TCP, PROTO_UDP, PROTO_ICMPV6 = NH_TCP, NH_UDP, NH_ICMPV6

# ICMPv6 types (RFC 4443, RFC 4861).
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
UNREACH_NOROUTE, UNREACH_ADMIN, UNREACH_BEYONDSCOPE, UNREACH_ADDR, UNREACH_PORT = 0, 1, 2, 3, 4
UNREACH_POLICY, UNREACH_REJECT = 5, 6

#: ``(ver_tc_flow: int, payload_len, next_header, hop_limit, src: bytes[16], dst: bytes[16])`` — 40 bytes.
IPV6 = struct.Struct("!IHBB16s16s")
#: Fragment header ``(next_header, offset_flags, ident)`` — 8 bytes (RFC 8200 4.5).
FRAG = struct.Struct("!BxHI")
#: ``(type, code, csum)`` — first 4 bytes of every ICMPv6 message.
ICMP6 = struct.Struct("!BBH")
TCP = struct.Struct("!HHIIHHHH")
UDP = struct.Struct("!HHHH")
_PSEUDO6 = struct.Struct("!16s16sI3xB")
_H = struct.Struct("!H")
_I = struct.Struct("!I")

IPV6_HLEN = 40
MIN_MTU = 1280  # RFC 8200 section 5
MAX_EXT_HEADERS = 8
DEFAULT_HLIM = 64
_VER6 = 6 << 28
UNSPECIFIED = bytes(16)
ALL_NODES = bytes.fromhex("ff020000000000000000000000000001")
ALL_ROUTERS = bytes.fromhex("ff020000000000000000000000000002")
_SOLICITED_PREFIX = bytes.fromhex("ff0200000000000000000001ff")

# Options known in Hop-by-Hop / Destination Options headers: Pad1, PadN, Router Alert (RFC 2711,
# carried by MLD), Tunnel Encapsulation Limit (RFC 2473). Jumbo Payload (0xC2) is refused: the
# payload length field is never 0 here.
_KNOWN_OPTS = frozenset((0x00, 0x01, 0x05, 0x04))

_ident6 = itertools.count(1)


def next_ident6() -> int:
    """Fragment identification for the next datagram we fragment (32 bits, wraps)."""
    return next(_ident6) & 0xFFFFFFFF


# ------------------------------------------------------------------ addresses
def is_multicast(addr: bytes) -> bool:
    """``ff00::/8`` (RFC 4291 2.7)."""
    return addr[0] == 0xFF


def is_link_local(addr: bytes) -> bool:
    """``fe80::/10`` (RFC 4291 2.5.6)."""
    return addr[0] == 0xFE and (addr[1] & 0xC0) == 0x80


def solicited_node(addr: bytes) -> bytes:
    """Solicited-node multicast address ``ff02::1:ffXX:XXXX`` of ``addr`` (RFC 4291 2.7.1)."""
    return _SOLICITED_PREFIX + bytes(addr[13:16])


def multicast_mac(addr: bytes) -> bytes:
    """Ethernet destination for IPv6 multicast ``addr``: ``33:33`` + its last 32 bits (RFC 2464 7)."""
    return b"\x33\x33" + bytes(addr[12:16])


def link_local_from_mac(mac: bytes) -> bytes:
    """``fe80::/64`` address with the modified EUI-64 interface identifier of ``mac`` (RFC 4291 App. A).

    ``52:55:0a:00:02:02`` -> ``fe80::5055:aff:fe00:202`` (universal/local bit inverted, ``ff:fe`` inserted).
    """
    return b"\xfe\x80" + bytes(6) + bytes((mac[0] ^ 0x02, mac[1], mac[2], 0xFF, 0xFE, mac[3], mac[4], mac[5]))


def eth6(dst_mac: bytes, src_mac: bytes) -> bytes:
    """14-byte Ethernet header with EtherType IPv6."""
    return ETH.pack(dst_mac, src_mac, ETHERTYPE_IPV6)


# ------------------------------------------------------------------ parsing
class Ipv6:
    """One parsed IPv6 packet. Offsets are absolute indexes into the buffer given to :func:`parse_ipv6`.

    Attributes:
        src, dst: 16-byte addresses.
        hlim: hop limit. ``tc_flow``: the first 32 bits (version, traffic class, flow label).
        proto: upper-layer protocol (6 TCP, 17 UDP, 58 ICMPv6, 59 No Next Header, others as
            found); for a fragment, the Fragment header's Next Header.
        off: offset of the IPv6 header. ``l4``: offset of the upper-layer header (for a
            fragment: of the fragmentable part). ``end``: end of the packet (``off + 40 +
            payload length``; Ethernet padding after it is ignored).
        frag: ``None``, or ``(offset_bytes, more, ident)`` from the Fragment header.
        ext: number of extension headers walked.
    """

    __slots__ = ("src", "dst", "hlim", "tc_flow", "proto", "off", "l4", "end", "frag", "ext")

    def __init__(self, src, dst, hlim, tc_flow, proto, off, l4, end, frag, ext) -> None:
        self.src = src
        self.dst = dst
        self.hlim = hlim
        self.tc_flow = tc_flow
        self.proto = proto
        self.off = off
        self.l4 = l4
        self.end = end
        self.frag = frag
        self.ext = ext

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Ipv6(src={self.src.hex()}, dst={self.dst.hex()}, proto={self.proto}, l4={self.l4}, "
                f"end={self.end}, frag={self.frag}, ext={self.ext})")


def _check_options(buf, start: int, stop: int) -> str | None:
    """Walk the TLV options of a Hop-by-Hop / Destination Options header (RFC 8200 4.2)."""
    i = start
    while i < stop:
        t = buf[i]
        if t == 0:  # Pad1
            i += 1
            continue
        if i + 1 >= stop:
            return "ipv6_bad_option"
        j = i + 2 + buf[i + 1]
        if j > stop:
            return "ipv6_bad_option"
        if t not in _KNOWN_OPTS:
            if t == 0xC2:
                return "ipv6_jumbogram"
            if t >> 6:  # action 01/10/11: discard (we never send Parameter Problem for it)
                return "ipv6_unknown_option"
        i = j
    return None


def walk_ext(buf, pos: int, end: int, nh: int, count: int = 0, seen_frag: bool = False):
    """Walk an extension-header chain starting at ``pos`` with Next Header ``nh``.

    Stops at the first upper-layer protocol, at a Fragment header, or at No Next Header.
    Returns ``(nh, pos, count, frag_pos)``: ``nh`` the protocol found (44 when stopped at a
    Fragment header, whose offset is ``frag_pos``, else ``-1``), ``pos`` where it starts,
    ``count`` the headers walked so far. Returns a drop-reason string for a chain that is too
    long (> 8 headers), runs past ``end``, has Hop-by-Hop anywhere but first, a bad option,
    a Routing header with Segments Left > 0, or a second Fragment header.
    """
    while True:
        if nh == NH_HOPOPTS or nh == NH_DSTOPTS or nh == NH_ROUTING:
            if nh == NH_HOPOPTS and count:
                return "ipv6_hbh_not_first"
            count += 1
            if count > MAX_EXT_HEADERS:
                return "ipv6_ext_too_many"
            if pos + 8 > end:
                return "ipv6_ext_truncated"
            hlen = (buf[pos + 1] + 1) << 3
            if pos + hlen > end:
                return "ipv6_ext_truncated"
            if nh == NH_ROUTING:
                if buf[pos + 3]:  # Segments Left
                    return "ipv6_routing_header"
            else:
                reason = _check_options(buf, pos + 2, pos + hlen)
                if reason is not None:
                    return reason
            nh = buf[pos]
            pos += hlen
            continue
        if nh == NH_FRAGMENT:
            if seen_frag:
                return "ipv6_multiple_fragment"
            count += 1
            if count > MAX_EXT_HEADERS:
                return "ipv6_ext_too_many"
            if pos + 8 > end:
                return "ipv6_ext_truncated"
            return NH_FRAGMENT, pos, count, pos
        return nh, pos, count, -1


def parse_ipv6(buf, off: int = ETH_HLEN):
    """Parse the IPv6 packet at ``off`` in ``buf`` (bytes-like; a whole Ethernet frame by default).

    Returns an :class:`Ipv6` or a drop-reason string: ``ipv6_truncated``, ``ipv6_bad_version``,
    ``ipv6_jumbogram`` (payload length 0, RFC 2675, unsupported), ``ipv6_bad_length`` (payload
    length beyond the buffer), ``ipv6_bad_src`` (multicast source, RFC 4291 2.7), the
    :func:`walk_ext` reasons, ``ipv6_bad_fragment`` (a non-last fragment whose length is not a
    multiple of 8, RFC 8200 4.5) and ``ipv6_frag_incomplete_chain`` (a first fragment without
    the whole header chain, RFC 7112). Source/destination policy (prefix, our own addresses)
    is the caller's.
    """
    n = len(buf)
    if n < off + IPV6_HLEN:
        return "ipv6_truncated"
    vtf, plen, nh, hlim, src, dst = IPV6.unpack_from(buf, off)
    if vtf >> 28 != 6:
        return "ipv6_bad_version"
    if plen == 0:
        # A zero payload length means a Jumbo Payload option (RFC 2675) — or an empty packet
        # with No Next Header, which is legal but useless.
        if nh != NH_NONE:
            return "ipv6_jumbogram"
    l4 = off + IPV6_HLEN
    end = l4 + plen
    if end > n:
        return "ipv6_bad_length"
    if src[0] == 0xFF:
        return "ipv6_bad_src"
    if nh == NH_TCP or nh == NH_UDP or nh == NH_ICMPV6:  # fast path: no extension headers
        return Ipv6(src, dst, hlim, vtf, nh, off, l4, end, None, 0)
    r = walk_ext(buf, l4, end, nh)
    if type(r) is str:
        return r
    nh, pos, count, fpos = r
    if fpos < 0:
        return Ipv6(src, dst, hlim, vtf, nh, off, pos, end, None, count)
    fnh, offflags, ident = FRAG.unpack_from(buf, fpos)
    foff = offflags & 0xFFF8
    more = bool(offflags & 1)
    start = fpos + 8
    if more and (end - start) & 7:
        return "ipv6_bad_fragment"
    if foff == 0:
        # RFC 7112 / RFC 8200 4.5: the first fragment carries the whole header chain.
        r2 = walk_ext(buf, start, end, fnh, count, True)
        if type(r2) is str:
            return "ipv6_frag_incomplete_chain" if r2 == "ipv6_ext_truncated" else r2
    return Ipv6(src, dst, hlim, vtf, fnh, off, start, end, (foff, more, ident), count)


# ------------------------------------------------------------------ checksums
def pseudo_sum6(src: bytes, dst: bytes, nh: int, length: int) -> int:
    """Partial checksum of the IPv6 pseudo-header (RFC 8200 section 8.1): src, dst, 32-bit length, next header."""
    return partial(_PSEUDO6.pack(src, dst, length, nh))


def l4_checksum_ok(src: bytes, dst: bytes, proto: int, l4) -> bool:
    """True when the TCP/UDP/ICMPv6 message ``l4`` (header + payload, checksum in place) verifies.

    A zero UDP checksum is invalid over IPv6 (RFC 8200 8.1) and fails here.
    """
    if proto == NH_UDP and len(l4) >= 8 and l4[6] == 0 and l4[7] == 0:
        return False
    return (partial(l4) + pseudo_sum6(src, dst, proto, len(l4))) % 0xFFFF == 0


# ------------------------------------------------------------------ building
def ip6_header(buf: bytearray, off: int, src: bytes, dst: bytes, nh: int, plen: int,
               hlim: int = DEFAULT_HLIM) -> None:
    """Write a 40-byte IPv6 header (traffic class and flow label 0) into ``buf`` at ``off``."""
    IPV6.pack_into(buf, off, _VER6, plen, nh, hlim, src, dst)


def build_tcp6(eth: bytes, src: bytes, dst: bytes, sport: int, dport: int, seq: int, ack: int,
               flags: int, wnd: int, options: bytes = b"", payload=b"") -> bytearray:
    """A whole Ethernet/IPv6/TCP frame (hop limit 64). ``eth``: 14-byte header (EtherType 0x86DD);
    ``options`` padded to 4 bytes. Same shape as :func:`aioslirp.wire.ipv4.build_tcp`."""
    optlen = len(options)
    if optlen & 3:
        options = bytes(options) + b"\x00" * (4 - (optlen & 3))
        optlen = len(options)
    thl = 20 + optlen
    plen = len(payload)
    tcp_len = thl + plen
    buf = bytearray(ETH_HLEN + IPV6_HLEN + tcp_len)
    buf[0:14] = eth
    IPV6.pack_into(buf, 14, _VER6, tcp_len, NH_TCP, DEFAULT_HLIM, src, dst)
    TCP.pack_into(buf, 54, sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, ((thl >> 2) << 12) | flags, wnd, 0, 0)
    if optlen:
        buf[74:74 + optlen] = options
    if plen:
        buf[54 + thl:] = payload
    _H.pack_into(buf, 70, finish(pseudo_sum6(src, dst, NH_TCP, tcp_len) + partial(memoryview(buf)[54:])))
    return buf


def build_udp6_packet(src: bytes, dst: bytes, sport: int, dport: int, payload, hlim: int = DEFAULT_HLIM) -> bytearray:
    """IPv6 packet *without* Ethernet header: IPv6 + UDP + payload; a computed 0 checksum is sent as 0xFFFF.

    ``payload`` up to 65,527 bytes; use :func:`fragment6` for the link MTU.
    """
    ulen = 8 + len(payload)
    buf = bytearray(IPV6_HLEN + ulen)
    IPV6.pack_into(buf, 0, _VER6, ulen, NH_UDP, hlim, src, dst)
    UDP.pack_into(buf, 40, sport, dport, ulen, 0)
    buf[48:] = payload
    csum = finish(pseudo_sum6(src, dst, NH_UDP, ulen) + partial(memoryview(buf)[40:]))
    _H.pack_into(buf, 46, csum or 0xFFFF)
    return buf


def build_icmp6_packet(src: bytes, dst: bytes, icmp_type: int, code: int, body, hlim: int = DEFAULT_HLIM) -> bytearray:
    """IPv6 packet *without* Ethernet header carrying one ICMPv6 message.

    ``body``: everything after the 4-byte type/code/checksum (e.g. identifier, sequence and
    data for an echo; the reserved/flags word and fields for NDP). The checksum covers the
    pseudo-header (RFC 4443 2.3). NDP messages need ``hlim=255`` (RFC 4861).
    """
    ilen = 4 + len(body)
    buf = bytearray(IPV6_HLEN + ilen)
    IPV6.pack_into(buf, 0, _VER6, ilen, NH_ICMPV6, hlim, src, dst)
    ICMP6.pack_into(buf, 40, icmp_type, code, 0)
    buf[44:] = body
    _H.pack_into(buf, 42, finish(pseudo_sum6(src, dst, NH_ICMPV6, ilen) + partial(memoryview(buf)[40:])))
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
    if not l4_checksum_ok(ip.src, ip.dst, NH_ICMPV6, msg):
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
    if type(ip) is not str and ip.proto == NH_ICMPV6 and ip.l4 < len(orig) and (ip.frag is None or ip.frag[0] == 0):
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
    caller's (see :class:`TokenBucket`).
    """
    if not icmp6_error_allowed(orig, icmp_type, code, link_multicast):
        return None
    quoted = bytes(orig[:MIN_MTU - IPV6_HLEN - 8])
    if src is None:
        src = bytes(orig[24:40])
    return build_icmp6_packet(src, bytes(orig[8:24]), icmp_type, code, _I.pack(param & 0xFFFFFFFF) + quoted)


def fragment6(packet, mtu: int) -> list:
    """Split an IPv6 packet (40-byte header, no extension headers) to fit ``mtu`` (RFC 8200 4.5).

    Returns ``[packet]`` when it fits. Otherwise each fragment is the IPv6 header (payload
    length fixed, Next Header 44) + an 8-byte Fragment header (same new identification,
    offset in 8-byte units, M flag) + a piece of the original payload, a multiple of 8 bytes
    except the last.
    """
    total = len(packet)
    if total <= mtu:
        return [packet]
    vtf, _plen, nh, hlim, src, dst = IPV6.unpack_from(packet, 0)
    data = memoryview(packet)[IPV6_HLEN:]
    step = (mtu - IPV6_HLEN - 8) & ~7
    ident = next_ident6()
    out = []
    for off in range(0, len(data), step):
        chunk = data[off:off + step]
        more = 1 if off + step < len(data) else 0
        frag = bytearray(IPV6_HLEN + 8 + len(chunk))
        IPV6.pack_into(frag, 0, vtf, 8 + len(chunk), NH_FRAGMENT, hlim, src, dst)
        FRAG.pack_into(frag, IPV6_HLEN, nh, off | more, ident)
        frag[48:] = chunk
        out.append(frag)
    return out


# ------------------------------------------------------------------ reassembly
class Ipv6Reassembler:
    """Bounded IPv6 reassembly (RFC 8200 4.5, RFC 5722) on top of :class:`Reassembler`.

    Keyed by ``(src, dst, ident)``. The bounds are those of :class:`Reassembler` (datagrams
    in progress, fragments each, bytes held, ``timeout`` seconds), with the same drop reasons;
    the first fragment's headers (IPv6 header and unfragmentable extension headers), kept
    with its datagram until it completes, count against ``max_bytes`` too. Overlapping
    fragments discard the whole datagram, exact duplicates are ignored. The reassembled
    fragmentable part is limited to 65,515 bytes by the shared reassembler (RFC 8200 allows
    65,535 minus the unfragmentable part; UDP payloads up to 65,507 bytes reassemble). NDP
    messages (ICMPv6 133-137) that arrive fragmented are dropped (RFC 6980).

    :meth:`add` returns the whole datagram as an unfragmented IPv6 packet (``bytes``: the
    first fragment's header and unfragmentable extension headers, Next Header patched, payload
    length recomputed, the fragmentable part appended) for the caller to parse again, or
    ``None``. Drop reasons accumulate in :attr:`drops` (merge and clear them, as with
    :class:`Reassembler`).
    """

    def __init__(self, *, max_datagrams: int = 64, max_fragments: int = 64, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout: float = 15.0) -> None:
        self._r = Reassembler(max_datagrams=max_datagrams, max_fragments=max_fragments, max_bytes=max_bytes,
                              timeout=timeout)
        self.drops = self._r.drops
        self.timeout = timeout

    @classmethod
    def from_config(cls, config) -> "Ipv6Reassembler":
        """One built with the ``reassembly_*`` bounds of a :class:`~aioslirp.config.NetworkConfig`."""
        return cls(max_datagrams=int(config.reassembly_max_datagrams),
                   max_fragments=int(config.reassembly_max_fragments),
                   max_bytes=int(config.reassembly_max_bytes), timeout=float(config.reassembly_timeout))

    def __len__(self) -> int:
        return len(self._r)

    @property
    def held(self) -> int:
        """Bytes held now (fragment payloads and first-fragment headers), at most ``max_bytes``."""
        return self._r.held

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def add(self, buf, ip: Ipv6, now: float | None = None) -> bytes | None:
        """Add the fragment ``ip`` (parsed from ``buf`` by :func:`parse_ipv6`). ``now`` in seconds."""
        if now is None:
            now = time.monotonic()
        foff, more, ident = ip.frag
        mv = memoryview(buf)
        if foff == 0 and not more:  # atomic fragment (RFC 6946): process in isolation
            return self._rebuild(bytes(mv[ip.off:ip.l4 - 8]), self._nh_pos(buf, ip), ip.proto, mv[ip.l4:ip.end])
        if foff == 0:
            head = bytes(mv[ip.off:ip.l4 - 8])
            done = self._r.add_fragment((ip.src, ip.dst, ident), 0, more, mv[ip.l4:ip.end], now,
                                        (head, self._nh_pos(buf, ip), ip.proto), len(head))
        else:
            done = self._r.add_fragment((ip.src, ip.dst, ident), foff, more, mv[ip.l4:ip.end], now)
        if done is None:
            return None
        data, info = done
        if info is None:  # cannot happen: completion needs the offset-0 fragment
            self._drop("frag_no_first")
            return None
        return self._rebuild(info[0], info[1], info[2], data)

    @staticmethod
    def _nh_pos(buf, ip: Ipv6) -> int:
        """Offset (relative to the IPv6 header) of the Next Header byte that says 44."""
        pos, nh = ip.off + IPV6_HLEN, buf[ip.off + 6]
        at = 6
        while nh != NH_FRAGMENT:
            at = pos - ip.off
            nh = buf[pos]
            pos += (buf[pos + 1] + 1) << 3
        return at

    def _rebuild(self, head: bytes, nh_at: int, nh: int, data) -> bytes | None:
        pkt = bytearray(head)
        pkt += data
        pkt[nh_at] = nh
        plen = len(pkt) - IPV6_HLEN
        if plen > 0xFFFF:
            self._drop("frag_bad_length")
            return None
        _H.pack_into(pkt, 4, plen)
        ip = parse_ipv6(pkt, 0)
        if type(ip) is str:
            self._drop(ip)
            return None
        if ip.proto == NH_ICMPV6 and ip.l4 < ip.end and ND_ROUTER_SOLICIT <= pkt[ip.l4] <= ND_REDIRECT:
            self._drop("ndp_fragmented")
            return None
        return bytes(pkt)
