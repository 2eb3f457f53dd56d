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
checksums (as passt does) instead of verifying them. The other way,
:class:`~aioslirp.wire.tcp.TcpFrameBuilder` with ``offload`` on (``TcpOffloadBuilder``) writes
frames whose TCP checksum field holds the (uncomplemented, folded) pseudo-header sum, flagged
``NEEDS_CSUM`` with ``csum_start``/``csum_offset``, so that the kernel completes the checksum
(or, for a local socket, never needs it); a payload longer than the MSS goes out as one GSO
frame that the kernel cuts into MSS-sized segments. No payload byte is summed in
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
from .ip import PROTO_TCP

__all__ = [
    "VNET", "VNET_HDR_LEN", "VNET_NONE", "F_NEEDS_CSUM", "F_DATA_VALID", "GSO_NONE", "GSO_TCPV4",
    "GSO_UDP", "GSO_TCPV6", "GSO_ECN", "OffloadFrame", "MAX_TSO_PAYLOAD4",
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


class OffloadFrame(bytearray):
    """An Ethernet frame (the ``bytearray`` itself) plus its virtio-net header in :attr:`vnet` (12 bytes)."""

    __slots__ = ("vnet",)

    #: The 12-byte ``virtio_net_hdr_v1`` (:data:`VNET`) to write before the frame.
    vnet: bytes


def complete_checksum(frame) -> bytearray:
    """A copy of ``frame`` (an Ethernet frame with a ``NEEDS_CSUM`` partial TCP checksum, as built by
    :class:`~aioslirp.wire.tcp.TcpFrameBuilder` with ``offload``) with the checksum completed: for tests and tools that want
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

