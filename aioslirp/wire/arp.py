"""ARP for IPv4 over Ethernet (RFC 826): parse requests, build replies and requests."""

from __future__ import annotations

import struct

from .ethernet import ETH, ETHERTYPE_ARP, ETHERTYPE_IPV4, BROADCAST

ARP_REQUEST = 1
ARP_REPLY = 2
#: ``(htype, ptype, hlen, plen, oper, sha, spa, tha, tpa)`` — 28 bytes.
ARP = struct.Struct("!HHBBH6s4s6s4s")


def parse_arp(buf, off: int = 14):
    """Parse an Ethernet/IPv4 ARP packet at ``off``.

    Returns ``(oper, sha, spa, tha, tpa)`` (MACs 6 bytes, addresses 4 bytes) or ``None``
    when truncated or not Ethernet/IPv4 ARP.
    """
    if len(buf) < off + ARP.size:
        return None
    htype, ptype, hlen, plen, oper, sha, spa, tha, tpa = ARP.unpack_from(buf, off)
    if htype != 1 or ptype != ETHERTYPE_IPV4 or hlen != 6 or plen != 4:
        return None
    return oper, sha, spa, tha, tpa


def build_arp(oper: int, sha: bytes, spa: bytes, tha: bytes, tpa: bytes, eth_dst: bytes | None = None) -> bytes:
    """A whole ARP frame (42 bytes, unpadded). ``eth_dst`` defaults to ``tha`` for replies, broadcast for requests."""
    if eth_dst is None:
        eth_dst = tha if oper == ARP_REPLY else BROADCAST
    return ETH.pack(eth_dst, sha, ETHERTYPE_ARP) + ARP.pack(1, ETHERTYPE_IPV4, 6, 4, oper, sha, spa, tha, tpa)
