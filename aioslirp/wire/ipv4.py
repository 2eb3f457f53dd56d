"""IPv4 (RFC 791) headers: the header struct, its checksum, the pseudo-header sum, fragmentation.

Parsing is eager ``struct.Struct.unpack_from`` over the received buffer (the dispatch does it
in line); payloads stay ``memoryview`` slices. The transport layers build on this:
:mod:`aioslirp.wire.tcp`, :mod:`aioslirp.wire.udp` and :mod:`aioslirp.wire.icmp` (their
structs and builders live there). Addresses are 4-byte ``bytes``.
"""

from __future__ import annotations

import itertools
import struct

from .checksum import finish, partial

#: ``(ver_ihl, tos, total_len, ident, flags_frag, ttl, proto, csum, src, dst)`` — 20 bytes.
IPV4 = struct.Struct("!BBHHHBBH4s4s")
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

