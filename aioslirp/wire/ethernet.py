"""Ethernet II headers (IEEE 802.3), 14 bytes: destination MAC, source MAC, EtherType."""

from __future__ import annotations

import struct

ETH_HLEN = 14
ETHERTYPE_IPV4 = 0x0800
ETHERTYPE_ARP = 0x0806
ETHERTYPE_IPV6 = 0x86DD
BROADCAST = b"\xff" * 6

#: ``(dst: bytes[6], src: bytes[6], ethertype: int)``
ETH = struct.Struct("!6s6sH")


def mac_str(mac: bytes) -> str:
    """``b'\\x52\\x55...'`` -> ``'52:55:...'``."""
    return ":".join(f"{b:02x}" for b in mac)


def eth_header(dst: bytes, src: bytes, ethertype: int) -> bytes:
    """14-byte Ethernet header."""
    return ETH.pack(dst, src, ethertype)
