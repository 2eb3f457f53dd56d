"""IPv6 (RFC 8200) on the wire: parsing, extension headers, fragmenting, addresses.

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
(RFC 7112). Reassembly keeps state, so it is not here: :class:`aioslirp.dispatch.reassembly.Ipv6Reassembler`
returns the reassembled datagram as a complete unfragmented IPv6 packet, which the caller
parses again with :func:`parse_ipv6`.

Building: :func:`ip6_header` and :func:`fragment6`; checksums use the RFC 8200 section 8.1
pseudo-header (:func:`pseudo_sum6`). The transport layers build on this module:
:mod:`aioslirp.wire.tcp`, :mod:`aioslirp.wire.udp` and :mod:`aioslirp.wire.icmp` (ICMPv6 types
and codes, echo replies and errors). Addresses are 16-byte ``bytes`` throughout.
"""

from __future__ import annotations

import itertools
import struct

from .checksum import partial
from .ethernet import ETH, ETH_HLEN, ETHERTYPE_IPV6
from .ip import PROTO_ICMPV6, PROTO_TCP, PROTO_UDP

__all__ = [
    "IPV6", "Ipv6", "parse_ipv6", "walk_ext", "pseudo_sum6", "l4_checksum_ok", "ip6_header", "fragment6", "eth6",
    "multicast_mac", "solicited_node", "link_local_from_mac", "is_multicast", "is_link_local",
    "UNSPECIFIED", "ALL_NODES", "ALL_ROUTERS", "MIN_MTU",
]

# Next Header values (IANA "Assigned Internet Protocol Numbers"); the upper-layer ones are
# aioslirp.wire.ip's, shared with IPv4.
NH_HOPOPTS = 0
NH_TCP = PROTO_TCP
NH_UDP = PROTO_UDP
NH_ROUTING = 43
NH_FRAGMENT = 44
NH_ESP = 50
NH_AH = 51
NH_ICMPV6 = PROTO_ICMPV6
NH_NONE = 59
NH_DSTOPTS = 60

#: ``(ver_tc_flow: int, payload_len, next_header, hop_limit, src: bytes[16], dst: bytes[16])`` — 40 bytes.
IPV6 = struct.Struct("!IHBB16s16s")
#: Fragment header ``(next_header, offset_flags, ident)`` — 8 bytes (RFC 8200 4.5).
FRAG = struct.Struct("!BxHI")
_PSEUDO6 = struct.Struct("!16s16sI3xB")

IPV6_HLEN = 40
MIN_MTU = 1280  # RFC 8200 section 5
MAX_EXT_HEADERS = 8
DEFAULT_HLIM = 64
#: The first 32-bit word of the IPv6 headers we build: version 6, traffic class 0, flow label 0.
VTF6 = 6 << 28
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

    src: bytes
    dst: bytes
    hlim: int
    tc_flow: int
    proto: int
    off: int
    l4: int
    end: int
    frag: tuple[int, bool, int] | None
    ext: int

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
    IPV6.pack_into(buf, off, VTF6, plen, nh, hlim, src, dst)


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

