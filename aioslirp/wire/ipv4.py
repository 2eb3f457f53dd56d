"""IPv4 (RFC 791), TCP (RFC 9293 section 3.1), UDP (RFC 768) and ICMP (RFC 792) headers.

Parsing is eager ``struct.Struct.unpack_from`` over the received buffer; payloads stay
``memoryview`` slices. Building writes the whole frame (Ethernet + IPv4 + L4 + payload)
into one ``bytearray`` with checksums filled in. Addresses are 4-byte ``bytes``.
"""

from __future__ import annotations

import itertools
import struct

from .checksum import checksum, finish, partial
from .ethernet import ETH_HLEN

PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17

#: ``(ver_ihl, tos, total_len, ident, flags_frag, ttl, proto, csum, src, dst)`` — 20 bytes.
IPV4 = struct.Struct("!BBHHHBBH4s4s")
#: ``(sport, dport, seq, ack, off_flags, wnd, csum, urg)`` — 20 bytes.
TCP = struct.Struct("!HHIIHHHH")
#: ``(sport, dport, length, csum)`` — 8 bytes.
UDP = struct.Struct("!HHHH")
#: ``(type, code, csum, rest)`` — 8 bytes (``rest``: id/seq for echo).
ICMP = struct.Struct("!BBHI")
_PSEUDO = struct.Struct("!4s4sxBH")
_H = struct.Struct("!H")

IP_DF = 0x4000
IP_MF = 0x2000
IP_OFFMASK = 0x1FFF
DEFAULT_TTL = 64

_ident = itertools.count(1)


def next_ident() -> int:
    """IPv4 identification for the next datagram we originate (16 bits, wraps)."""
    return next(_ident) & 0xFFFF


def pseudo_sum(src: bytes, dst: bytes, proto: int, length: int) -> int:
    """Partial checksum of the IPv4 pseudo-header (RFC 9293 section 3.1, RFC 768)."""
    return partial(_PSEUDO.pack(src, dst, proto, length))


def ip_header(buf: bytearray, off: int, src: bytes, dst: bytes, proto: int, total_len: int,
              ident: int = 0, flags_frag: int = IP_DF, ttl: int = DEFAULT_TTL) -> None:
    """Write a 20-byte IPv4 header with its checksum into ``buf`` at ``off``."""
    IPV4.pack_into(buf, off, 0x45, 0, total_len, ident, flags_frag, ttl, proto, 0, src, dst)
    _H.pack_into(buf, off + 10, finish(partial(memoryview(buf)[off:off + 20])))


def build_tcp(eth: bytes, src: bytes, dst: bytes, sport: int, dport: int, seq: int, ack: int,
              flags: int, wnd: int, options: bytes = b"", payload=b"") -> bytearray:
    """A whole Ethernet/IPv4/TCP frame. ``eth``: 14-byte Ethernet header; ``options`` padded to 4 bytes."""
    optlen = len(options)
    if optlen & 3:
        options = bytes(options) + b"\x00" * (4 - (optlen & 3))
        optlen = len(options)
    thl = 20 + optlen
    plen = len(payload)
    tcp_len = thl + plen
    buf = bytearray(ETH_HLEN + 20 + tcp_len)
    buf[0:14] = eth
    ip_header(buf, 14, src, dst, PROTO_TCP, 20 + tcp_len, next_ident())
    TCP.pack_into(buf, 34, sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, ((thl >> 2) << 12) | flags, wnd, 0, 0)
    if optlen:
        buf[54:54 + optlen] = options
    if plen:
        buf[34 + thl:] = payload
    csum = finish(pseudo_sum(src, dst, PROTO_TCP, tcp_len) + partial(memoryview(buf)[34:]))
    _H.pack_into(buf, 50, csum)
    return buf


def build_udp_packet(src: bytes, dst: bytes, sport: int, dport: int, payload) -> bytearray:
    """IPv4 packet *without* Ethernet header: IPv4 header (no ident, DF clear) + UDP + payload."""
    ulen = 8 + len(payload)
    buf = bytearray(20 + ulen)
    UDP.pack_into(buf, 20, sport, dport, ulen, 0)
    buf[28:] = payload
    csum = finish(pseudo_sum(src, dst, PROTO_UDP, ulen) + partial(memoryview(buf)[20:]))
    _H.pack_into(buf, 26, csum or 0xFFFF)
    ip_header(buf, 0, src, dst, PROTO_UDP, 20 + ulen, next_ident(), 0)
    return buf


def build_icmp_packet(src: bytes, dst: bytes, icmp_type: int, code: int, rest: int, payload) -> bytearray:
    """IPv4 packet *without* Ethernet header carrying one ICMP message."""
    ilen = 8 + len(payload)
    buf = bytearray(20 + ilen)
    ICMP.pack_into(buf, 20, icmp_type, code, 0, rest)
    buf[28:] = payload
    _H.pack_into(buf, 22, checksum(memoryview(buf)[20:]))  # no pseudo-header: may be all zero
    ip_header(buf, 0, src, dst, PROTO_ICMP, 20 + ilen, next_ident(), 0)
    return buf


def fragment(packet, mtu: int) -> list:
    """Split an IPv4 packet (20-byte header, no options) into fragments that fit ``mtu`` (RFC 791 3.2).

    Returns ``[packet]`` when it already fits. Each fragment carries a copy of the header
    with MF and the offset (in 8-byte units) set and its checksum recomputed.
    """
    total = len(packet)
    if total <= mtu:
        return [packet]
    hdr = bytes(packet[:20])
    data = memoryview(packet)[20:]
    step = (mtu - 20) & ~7
    ver_ihl, tos, _, ident, flags_frag, ttl, proto, _, src, dst = IPV4.unpack(hdr)
    out = []
    for off in range(0, len(data), step):
        chunk = data[off:off + step]
        more = IP_MF if off + step < len(data) else 0
        frag = bytearray(20 + len(chunk))
        ip_header(frag, 0, src, dst, proto, len(frag), ident, more | (off >> 3), ttl)
        frag[20:] = chunk
        out.append(frag)
    return out
