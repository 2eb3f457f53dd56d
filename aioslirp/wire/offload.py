"""virtio-net headers (TAP ``IFF_VNET_HDR``) and TCP frames built for checksum/segmentation offload.

Theory of operation
-------------------
A TAP opened with ``IFF_VNET_HDR`` prefixes every frame, both ways, with a
``struct virtio_net_hdr_v1`` (12 bytes once ``TUNSETVNETHDRSZ`` is 12; native byte order, which
is little-endian on the hosts this runs on; virtio 1.1 section 5.1.6):

====== ============== =============================================================
offset field          meaning
====== ============== =============================================================
0      ``flags``      ``NEEDS_CSUM`` (1): the L4 checksum is partial; ``DATA_VALID`` (2)
1      ``gso_type``   ``NONE`` (0), ``TCPV4`` (1), ``UDP`` (3), ``TCPV6`` (4); ``ECN`` bit 0x80
2      ``hdr_len``    bytes of Ethernet + IP + TCP headers (a hint)
4      ``gso_size``   payload bytes per segment when the frame is to be segmented
6      ``csum_start`` offset where checksumming starts (the L4 header)
8      ``csum_offset`` where, from ``csum_start``, the checksum is stored (TCP 16, UDP 6)
10     ``num_buffers`` unused on a TAP (0)
====== ============== =============================================================

With ``TUNSETOFFLOAD`` ``CSUM|TSO4|TSO6`` the guest kernel hands us its TCP (and UDP) with
``NEEDS_CSUM``: the checksum field holds only the pseudo-header sum, and TCP arrives as up
to ~64 KB "super-segments" (``gso_type`` TCPV4/TCPV6, ``gso_size`` the MSS). Such frames come
straight from the guest's kernel over a memory-only link, so the stack trusts their L4
checksums (as passt does) instead of verifying them. The other way, :class:`TcpOffloadBuilder`
writes frames whose TCP checksum field holds the (uncomplemented, folded) pseudo-header sum,
flagged ``NEEDS_CSUM`` with ``csum_start``/``csum_offset``, so that the kernel completes the
checksum (or, for a local socket, never needs it); a payload longer than the MSS goes out as
one GSO frame that the kernel cuts into MSS-sized segments. No payload byte is summed in
Python in either direction.

Frames that carry such metadata are :class:`OffloadFrame` objects: a ``bytearray`` holding
the plain Ethernet frame (what a pcap capture records: the TCP checksum shows as "incorrect",
as in captures on any offloading NIC, and a GSO frame as one frame larger than the MTU) plus
the 12-byte header in ``.vnet``; a transport with a vnet header writes ``frame.vnet`` before
the frame, and :data:`VNET_NONE` before any other frame.
"""

from __future__ import annotations

import struct

from .checksum import finish, partial
from .ipv4 import IP_DF, IPV4, PROTO_TCP, TCP, next_ident

__all__ = [
    "VNET", "VNET_HDR_LEN", "VNET_NONE", "F_NEEDS_CSUM", "F_DATA_VALID", "GSO_NONE", "GSO_TCPV4",
    "GSO_UDP", "GSO_TCPV6", "GSO_ECN", "OffloadFrame", "TcpOffloadBuilder", "MAX_TSO_PAYLOAD4",
    "MAX_TSO_PAYLOAD6",
]

#: ``(flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers)``, 12 bytes.
VNET = struct.Struct("=BBHHHHH")
VNET_HDR_LEN = VNET.size
F_NEEDS_CSUM = 1
F_DATA_VALID = 2
GSO_NONE = 0
GSO_TCPV4 = 1
GSO_UDP = 3
GSO_TCPV6 = 4
GSO_ECN = 0x80
#: The header written before frames without offload metadata (checksums complete).
VNET_NONE = bytes(VNET_HDR_LEN)

#: Largest TCP payload in one IPv4 GSO frame: 65,535-byte datagram - 20 (IP) - 20 (TCP).
MAX_TSO_PAYLOAD4 = 65535 - 20 - 20
#: Largest TCP payload in one IPv6 GSO frame: 65,535-byte payload length - 20 (TCP).
MAX_TSO_PAYLOAD6 = 65535 - 20

_H = struct.Struct("!H")
_IPV6_HEAD = struct.Struct("!IHBB16s16s")
_VER6 = 6 << 28


class OffloadFrame(bytearray):
    """An Ethernet frame (the ``bytearray`` itself) plus its virtio-net header in :attr:`vnet` (12 bytes)."""

    __slots__ = ("vnet",)


class TcpOffloadBuilder:
    """Builds one flow's TCP frames towards the guest for a TAP with offload.

    ``eth``: the 14-byte Ethernet header; ``src``/``dst``: 4-byte (IPv4) or 16-byte (IPv6)
    addresses (``src`` is the remote side, ``dst`` the guest); ``sport``/``dport`` the ports.
    :meth:`build` has the shape of :func:`aioslirp.wire.ipv4.build_tcp` plus ``gso_size``
    (bytes, the guest's MSS): a payload longer than that becomes a GSO frame. The address
    part of the pseudo-header sum and of the IPv4 header checksum is computed once here.
    """

    __slots__ = ("eth", "src", "dst", "sport", "dport", "v6", "_pseudo", "_iphsum", "_l4", "_gso_type")

    def __init__(self, eth: bytes, src: bytes, dst: bytes, sport: int, dport: int) -> None:
        self.eth = bytes(eth)
        self.src = src
        self.dst = dst
        self.sport = sport
        self.dport = dport
        self.v6 = v6 = len(src) == 16
        # pseudo-header (RFC 9293 3.1 / RFC 8200 8.1) without the length: addresses + protocol
        self._pseudo = partial(src + dst) + PROTO_TCP
        # IPv4 header sum without total length and ident: 0x4500, DF, TTL 64 / TCP, addresses
        self._iphsum = 0x4500 + IP_DF + ((64 << 8) | PROTO_TCP) + partial(src + dst)
        self._l4 = 54 if v6 else 34
        self._gso_type = GSO_TCPV6 if v6 else GSO_TCPV4

    def build(self, seq: int, ack: int, flags: int, wnd: int, options: bytes = b"", payload=b"",
              gso_size: int = 0) -> OffloadFrame:
        """A whole frame with a partial TCP checksum and its vnet header in ``.vnet``."""
        optlen = len(options)
        if optlen & 3:
            options = bytes(options) + b"\x00" * (4 - (optlen & 3))
            optlen = len(options)
        thl = 20 + optlen
        plen = len(payload)
        tcp_len = thl + plen
        l4 = self._l4
        # Headers first, then the payload appended: no zero-filling of a 64 KB buffer that is
        # overwritten at once (measured 1.4 vs 3.5 us per 64 KB frame).
        buf = OffloadFrame(l4 + thl)
        buf[0:14] = self.eth
        if self.v6:
            _IPV6_HEAD.pack_into(buf, 14, _VER6, tcp_len, PROTO_TCP, 64, self.src, self.dst)
        else:
            total = 20 + tcp_len
            ident = next_ident()
            IPV4.pack_into(buf, 14, 0x45, 0, total, ident, IP_DF, 64, PROTO_TCP,
                           finish(self._iphsum + total + ident), self.src, self.dst)
        # The checksum field holds the folded pseudo-header sum, not complemented (CHECKSUM_PARTIAL).
        psum = (self._pseudo + tcp_len) % 0xFFFF
        TCP.pack_into(buf, l4, self.sport, self.dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF,
                      ((thl >> 2) << 12) | flags, wnd, psum, 0)
        if optlen:
            buf[l4 + 20:l4 + thl] = options
        if plen:
            buf += payload
        if gso_size and plen > gso_size:
            buf.vnet = VNET.pack(F_NEEDS_CSUM, self._gso_type, l4 + thl, gso_size, l4, 16, 0)
        else:
            buf.vnet = VNET.pack(F_NEEDS_CSUM, GSO_NONE, l4 + thl, 0, l4, 16, 0)
        return buf


def complete_checksum(frame) -> bytearray:
    """A copy of ``frame`` (an Ethernet frame with a ``NEEDS_CSUM`` partial TCP checksum, as built by
    :class:`TcpOffloadBuilder`) with the checksum completed: for tests and tools that want
    verifiable frames. Raises ``ValueError`` for a frame that is not IPv4/IPv6 TCP."""
    buf = bytearray(frame)
    et = (buf[12] << 8) | buf[13]
    if et == 0x0800 and buf[23] == PROTO_TCP:
        l4 = 14 + ((buf[14] & 0x0F) << 2)
    elif et == 0x86DD and buf[20] == PROTO_TCP:
        l4 = 54
    else:
        raise ValueError("not a TCP frame")
    # The field holds the pseudo-header sum: the sum over the segment with it is the full sum.
    _H.pack_into(buf, l4 + 16, finish(partial(memoryview(buf)[l4:])))
    return buf
