"""UDP datagrams on the wire (RFC 768; over IPv6, RFC 8200 section 8.1), for both address families.

:func:`build_udp` returns an IP packet *without* Ethernet header (the caller fragments it to the
link MTU and adds the header): IPv4 or IPv6 by the address length. The checksum covers the
family's pseudo-header; a computed 0 is sent as 0xFFFF (RFC 768; over IPv6 a zero checksum is
invalid). Parsing a UDP header is one ``UDP.unpack_from``: the dispatch does it in line.
"""

from __future__ import annotations

import struct

from .checksum import finish, partial
from .ip import PROTO_UDP
from .ipv4 import DEFAULT_TTL, ip_header, next_ident
from .ipv6 import IPV6, IPV6_HLEN, VTF6

__all__ = ["UDP", "UDP_HLEN", "build_udp"]

#: ``(sport, dport, length, csum)`` — 8 bytes.
UDP = struct.Struct("!HHHH")
UDP_HLEN = 8

_H = struct.Struct("!H")


def build_udp(src: bytes, dst: bytes, sport: int, dport: int, payload, hlim: int = DEFAULT_TTL) -> bytearray:
    """IP packet *without* Ethernet header: IPv4 (4-byte addresses) or IPv6 (16-byte) + UDP + ``payload``.

    ``hlim``: the IPv4 TTL or IPv6 hop limit (64). IPv4: the next identification, DF clear (the
    caller may fragment it). ``payload`` up to 65,507 (IPv4) / 65,527 (IPv6) bytes.
    """
    ulen = 8 + len(payload)
    # Pseudo-header sum (RFC 768 / RFC 8200 8.1): addresses, protocol and the UDP length.
    psum = partial(src + dst) + PROTO_UDP + ulen
    if len(src) == 16:
        buf = bytearray(IPV6_HLEN + ulen)
        IPV6.pack_into(buf, 0, VTF6, ulen, PROTO_UDP, hlim, src, dst)
        off = IPV6_HLEN
    else:
        buf = bytearray(20 + ulen)
        off = 20
    UDP.pack_into(buf, off, sport, dport, ulen, 0)
    buf[off + 8:] = payload
    csum = finish(psum + partial(memoryview(buf)[off:]))
    _H.pack_into(buf, off + 6, csum or 0xFFFF)
    if off == 20:
        ip_header(buf, 0, src, dst, PROTO_UDP, 20 + ulen, next_ident(), 0, hlim)
    return buf

