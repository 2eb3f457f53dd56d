"""TCP segments on the wire (RFC 9293 section 3.1), for both address families.

Theory of operation
-------------------
:func:`parse_segment` reads the 20-byte header with one precompiled struct and, when the data
offset says so, walks the options (MSS, window scale and SACK-permitted are kept; the others
are skipped). The result is a :class:`Segment`: header fields, the SYN options and the
payload as a ``memoryview`` slice of the caller's buffer (no copy). Ports and the checksum
are not in it: the caller keyed the flow on the ports and checked (or trusted) the checksum
before. A header that cannot be parsed is ``None``; the caller counts it (``bad_tcp_header``).

:class:`TcpFrameBuilder` writes one flow's frames towards the guest: Ethernet + IPv4 or IPv6
(chosen by the address length, once) + TCP + payload in one ``bytearray``. The parts of the
IPv4 header checksum and of the pseudo-header sum (RFC 9293 3.1, RFC 8200 8.1) that depend
only on the addresses are summed once per flow, so a frame costs one ``partial`` over the
segment. With ``offload`` the frame is an :class:`~aioslirp.wire.offload.OffloadFrame` whose
checksum field holds only the pseudo-header sum, for the kernel to complete (a payload longer
than ``gso_size`` is one GSO frame the kernel cuts up): no payload byte is summed in Python.
:func:`build_tcp` is the same builder for a single frame (a RST to a segment no flow owns).
"""

from __future__ import annotations

import struct

from .checksum import finish, partial
from .ip import PROTO_TCP
from .ipv4 import DEFAULT_TTL, IP_DF, IPV4, next_ident
from .ipv6 import DEFAULT_HLIM, IPV6, VTF6
from .offload import F_NEEDS_CSUM, GSO_NONE, GSO_TCPV4, GSO_TCPV6, VNET, OffloadFrame

__all__ = [
    "FIN", "SYN", "RST", "PSH", "ACK", "URG", "TCP", "TCP_HLEN", "Segment", "parse_segment", "reset_for",
    "syn_options", "TcpFrameBuilder", "TcpOffloadBuilder", "build_tcp",
]

#: Flag bits of the TCP header (RFC 9293 3.1); ECE/CWR (RFC 3168) are not used.
FIN, SYN, RST, PSH, ACK, URG = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_FLAG_NAMES = ((SYN, "SYN"), (FIN, "FIN"), (RST, "RST"), (PSH, "PSH"), (ACK, "ACK"), (URG, "URG"))

#: ``(sport, dport, seq, ack, off_flags, wnd, csum, urg)`` — 20 bytes.
TCP = struct.Struct("!HHIIHHHH")
TCP_HLEN = 20
#: Option kinds (RFC 9293 3.2, RFC 7323, RFC 2018).
OPT_END, OPT_NOP, OPT_MSS, OPT_WSCALE, OPT_SACK_PERM = 0, 1, 2, 3, 4

_H = struct.Struct("!H")
_MASK = 0xFFFFFFFF


class Segment:
    """One TCP segment as the connection sees it: header fields, SYN options and payload.

    ``seq``/``ack`` are 32-bit sequence numbers; ``flags`` the TCP flag bits (:data:`SYN`,
    :data:`ACK`, ...). ``wnd`` is the 16-bit window *field* as on the wire: already
    right-shifted by the window-scale that applies to this segment (never scaled on a
    SYN). ``payload`` is ``bytes`` or a ``memoryview`` (``b""`` when empty). ``mss``
    (bytes), ``wscale`` (shift count) and ``sack_perm`` are the options; they only mean
    something on SYN segments (``None``/``False`` when absent).
    """

    __slots__ = ("seq", "ack", "flags", "wnd", "payload", "mss", "wscale", "sack_perm")

    seq: int
    ack: int
    flags: int
    wnd: int
    payload: bytes | memoryview
    mss: int | None
    wscale: int | None
    sack_perm: bool

    def __init__(
        self,
        seq: int,
        ack: int,
        flags: int,
        wnd: int,
        payload: bytes | memoryview = b"",
        mss: int | None = None,
        wscale: int | None = None,
        sack_perm: bool = False,
    ) -> None:
        self.seq = seq
        self.ack = ack
        self.flags = flags
        self.wnd = wnd
        self.payload = payload
        self.mss = mss
        self.wscale = wscale
        self.sack_perm = sack_perm

    def __repr__(self) -> str:
        names = [n for bit, n in _FLAG_NAMES if self.flags & bit]
        extra = self.flags & ~0x3F
        if extra:
            names.append(hex(extra))
        parts = [f"seq={self.seq}", f"ack={self.ack}", f"flags={'|'.join(names) or '0'}", f"wnd={self.wnd}"]
        if len(self.payload):
            data = bytes(self.payload)
            parts.append(f"payload={data[:16]!r}{'...' if len(data) > 16 else ''}(len={len(data)})")
        if self.mss is not None:
            parts.append(f"mss={self.mss}")
        if self.wscale is not None:
            parts.append(f"wscale={self.wscale}")
        if self.sack_perm:
            parts.append("sack_perm")
        return f"Segment({', '.join(parts)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        return (
            self.seq == other.seq
            and self.ack == other.ack
            and self.flags == other.flags
            and self.wnd == other.wnd
            and self.mss == other.mss
            and self.wscale == other.wscale
            and self.sack_perm == other.sack_perm
            and bytes(self.payload) == bytes(other.payload)
        )

    __hash__ = None  # type: ignore[assignment]


def parse_segment(l4) -> Segment | None:
    """Parse a TCP header + payload (``memoryview``, at least 20 bytes) into a :class:`Segment`.

    Options MSS (kind 2), window scale (3) and SACK-permitted (4) are read; others are
    skipped. Returns ``None`` for a bad data offset or a malformed option list
    (e.g. a zero option length).
    """
    _sport, _dport, seq, ack, off_flags, wnd, _csum, _urg = TCP.unpack_from(l4, 0)
    doff = (off_flags >> 12) << 2
    if doff == 20:  # no options: most segments after the handshake
        return Segment(seq, ack, off_flags & 0x3F, wnd, l4[20:], None, None, False)
    if doff < 20 or doff > len(l4):
        return None
    mss = wscale = None
    sack = False
    i = 20
    while i < doff:
        kind = l4[i]
        if kind == OPT_END:
            break
        if kind == OPT_NOP:
            i += 1
            continue
        if i + 1 >= doff:
            return None
        olen = l4[i + 1]
        if olen < 2 or i + olen > doff:
            return None
        if kind == OPT_MSS and olen == 4:
            mss = (l4[i + 2] << 8) | l4[i + 3]
        elif kind == OPT_WSCALE and olen == 3:
            wscale = l4[i + 2]
        elif kind == OPT_SACK_PERM and olen == 2:
            sack = True
        i += olen
    return Segment(seq, ack, off_flags & 0x3F, wnd, l4[doff:], mss, wscale, sack)


def reset_for(seg: Segment) -> tuple[int, int, int]:
    """``(seq, ack, flags)`` of the RST answering ``seg``, a segment no flow owns (RFC 9293 3.10.7.1).

    With ACK set the RST takes its sequence number from ``seg.ack``; otherwise it is
    sent with sequence 0 and acknowledges everything ``seg`` occupied (payload, SYN, FIN).
    """
    if seg.flags & ACK:
        return seg.ack, 0, RST
    seglen = len(seg.payload) + (1 if seg.flags & SYN else 0) + (1 if seg.flags & FIN else 0)
    return 0, (seg.seq + seglen) & _MASK, RST | ACK


def syn_options(seg: Segment) -> bytes:
    """The options of our SYN or SYN-ACK ``seg``: MSS, then NOP + window scale when set (RFC 7323 2.2)."""
    opts = b""
    if seg.mss is not None:
        opts += b"\x02\x04" + _H.pack(seg.mss)
    if seg.wscale is not None:
        opts += b"\x01\x03\x03" + bytes((seg.wscale,))
    return opts


class TcpFrameBuilder:
    """Builds one flow's TCP frames towards the guest, for IPv4 or IPv6 (see the module docstring).

    ``eth``: the 14-byte Ethernet header; ``src``/``dst``: 4-byte (IPv4) or 16-byte (IPv6)
    addresses (``src`` is the remote side, ``dst`` the guest); ``sport``/``dport`` the ports.
    ``offload``: frames for a TAP with checksum/segmentation offload (partial checksum and a
    virtio-net header in ``.vnet``, :mod:`aioslirp.wire.offload`), else complete checksums.
    IPv4 frames have DF set, TTL 64 and the next identification; IPv6 frames hop limit 64.
    """

    __slots__ = ("eth", "src", "dst", "sport", "dport", "v6", "offload", "_pseudo", "_iphsum", "_l4",
                 "_gso_type")

    eth: bytes
    src: bytes
    dst: bytes
    sport: int
    dport: int
    v6: bool
    offload: bool
    _pseudo: int
    _iphsum: int
    _l4: int
    _gso_type: int

    def __init__(self, eth: bytes, src: bytes, dst: bytes, sport: int, dport: int, offload: bool = False) -> None:
        self.eth = bytes(eth)
        self.src = src
        self.dst = dst
        self.sport = sport
        self.dport = dport
        self.v6 = v6 = len(src) == 16
        self.offload = offload
        addr_sum = partial(src + dst)
        # pseudo-header (RFC 9293 3.1 / RFC 8200 8.1) without the length: addresses + protocol
        self._pseudo = addr_sum + PROTO_TCP
        # IPv4 header sum without total length and ident: 0x4500, DF, TTL 64 / TCP, addresses
        self._iphsum = 0x4500 + IP_DF + ((DEFAULT_TTL << 8) | PROTO_TCP) + addr_sum
        self._l4 = 54 if v6 else 34
        self._gso_type = GSO_TCPV6 if v6 else GSO_TCPV4

    def build(self, seq: int, ack: int, flags: int, wnd: int, options: bytes = b"", payload=b"",
              gso_size: int = 0) -> bytearray:
        """A whole frame. ``options`` padded to 4 bytes; ``payload`` bytes-like (copied).

        With ``offload`` an :class:`~aioslirp.wire.offload.OffloadFrame` (a ``bytearray``) whose
        payload longer than ``gso_size`` (bytes, the guest's MSS; 0: never) makes it a GSO frame;
        ``gso_size`` is ignored otherwise.
        """
        optlen = len(options)
        if optlen & 3:
            options = bytes(options) + b"\x00" * (4 - (optlen & 3))
            optlen = len(options)
        thl = 20 + optlen
        plen = len(payload)
        tcp_len = thl + plen
        l4 = self._l4
        offload = self.offload
        # Headers first, then the payload appended: no zero-filling of a 64 KB buffer that is
        # overwritten at once (measured 1.4 vs 3.5 us per 64 KB frame).
        buf: bytearray = OffloadFrame(l4 + thl) if offload else bytearray(l4 + thl)
        buf[0:14] = self.eth
        if self.v6:
            IPV6.pack_into(buf, 14, VTF6, tcp_len, PROTO_TCP, DEFAULT_HLIM, self.src, self.dst)
        else:
            total = 20 + tcp_len
            ident = next_ident()
            IPV4.pack_into(buf, 14, 0x45, 0, total, ident, IP_DF, DEFAULT_TTL, PROTO_TCP,
                           finish(self._iphsum + total + ident), self.src, self.dst)
        # The checksum field holds the folded pseudo-header sum, not complemented (CHECKSUM_PARTIAL).
        TCP.pack_into(buf, l4, self.sport, self.dport, seq & _MASK, ack & _MASK, ((thl >> 2) << 12) | flags, wnd,
                      (self._pseudo + tcp_len) % 0xFFFF, 0)
        if optlen:
            buf[l4 + 20:l4 + thl] = options
        if plen:
            buf += payload
        if offload:
            if gso_size and plen > gso_size:
                vnet = VNET.pack(F_NEEDS_CSUM, self._gso_type, l4 + thl, gso_size, l4, 16, 0)
            else:
                vnet = VNET.pack(F_NEEDS_CSUM, GSO_NONE, l4 + thl, 0, l4, 16, 0)
            buf.vnet = vnet  # type: ignore[attr-defined]  # an OffloadFrame
        else:
            # The field holds the pseudo-header sum: the sum over the segment with it is the full sum.
            _H.pack_into(buf, l4 + 16, finish(partial(memoryview(buf)[l4:])))
        return buf


class TcpOffloadBuilder(TcpFrameBuilder):
    """A :class:`TcpFrameBuilder` with ``offload`` on (:meth:`build` returns
    :class:`~aioslirp.wire.offload.OffloadFrame` objects)."""

    __slots__ = ()

    def __init__(self, eth: bytes, src: bytes, dst: bytes, sport: int, dport: int) -> None:
        super().__init__(eth, src, dst, sport, dport, True)


def build_tcp(eth: bytes, src: bytes, dst: bytes, sport: int, dport: int, seq: int, ack: int,
              flags: int, wnd: int, options: bytes = b"", payload=b"") -> bytearray:
    """One whole Ethernet/IPv4 or Ethernet/IPv6 TCP frame (by the address length), complete checksum.

    ``eth``: 14-byte Ethernet header; ``options`` padded to 4 bytes. For a flow's frames keep a
    :class:`TcpFrameBuilder`: it sums the addresses once.
    """
    return TcpFrameBuilder(eth, src, dst, sport, dport).build(seq, ack, flags, wnd, options, payload)

