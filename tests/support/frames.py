"""Test helpers for the IPv6 tests: packet building with dpkt and an independent checksum reference."""

from __future__ import annotations

import ipaddress
import socket
import struct

import dpkt

GUEST_MAC = bytes.fromhex("525400123456")
GW_MAC = bytes.fromhex("52550a000202")
GW_LL = ipaddress.IPv6Address("fe80::5055:aff:fe00:202").packed  # modified EUI-64 of 52:55:0a:00:02:02
GW6 = ipaddress.IPv6Address("fd00::2").packed
DNS6 = ipaddress.IPv6Address("fd00::3").packed
GUEST6 = ipaddress.IPv6Address("fd00::5054:ff:fe12:3456").packed
GUEST_LL = ipaddress.IPv6Address("fe80::5054:ff:fe12:3456").packed
UNSPEC = bytes(16)
GUEST = socket.inet_aton("10.0.2.15")
GW = socket.inet_aton("10.0.2.2")
DNS = socket.inet_aton("10.0.2.3")
METADATA = socket.inet_aton("169.254.169.254")
SYN, ACK, FIN, RST, PSH = dpkt.tcp.TH_SYN, dpkt.tcp.TH_ACK, dpkt.tcp.TH_FIN, dpkt.tcp.TH_RST, dpkt.tcp.TH_PUSH


def a6(text: str) -> bytes:
    return ipaddress.IPv6Address(text).packed


def ref_checksum6(src: bytes, dst: bytes, nh: int, msg: bytes) -> int:
    """RFC 1071 sum over the RFC 8200 8.1 pseudo-header and ``msg``, written out word by word.

    Independent of aioslirp.wire.checksum (which reduces a big integer modulo 0xFFFF).
    Returns the folded 16-bit one's-complement sum; a message with a valid checksum gives 0xFFFF.
    """
    pseudo = src + dst + struct.pack("!I", len(msg)) + b"\x00\x00\x00" + bytes((nh,))
    data = pseudo + msg + (b"\x00" if len(msg) % 2 else b"")
    s = 0
    for i in range(0, len(data), 2):
        s += (data[i] << 8) | data[i + 1]
        s = (s & 0xFFFF) + (s >> 16)
    return s


def checksum_valid(src: bytes, dst: bytes, nh: int, msg: bytes) -> bool:
    return ref_checksum6(src, dst, nh, msg) == 0xFFFF


def icmp6_frame(src: bytes, dst: bytes, icmp_type: int, code: int, body: bytes, hlim: int = 255,
                src_mac: bytes = GUEST_MAC, dst_mac: bytes | None = None) -> bytes:
    """A whole Ethernet/IPv6/ICMPv6 frame built by dpkt (checksum computed by dpkt)."""
    icmp = dpkt.icmp6.ICMP6(type=icmp_type, code=code, sum=0)
    icmp.data = body
    ip = dpkt.ip6.IP6(src=src, dst=dst, nxt=58, hlim=hlim, plen=4 + len(body))
    ip.data = icmp
    if dst_mac is None:
        dst_mac = b"\x33\x33" + dst[12:16] if dst[0] == 0xFF else GW_MAC
    eth = dpkt.ethernet.Ethernet(src=src_mac, dst=dst_mac, type=0x86DD)
    eth.data = ip
    return bytes(eth)


def udp6_frame(src: bytes, dst: bytes, sport: int, dport: int, payload: bytes, src_mac: bytes = GUEST_MAC,
               dst_mac: bytes = GW_MAC, hlim: int = 64) -> bytes:
    u = dpkt.udp.UDP(sport=sport, dport=dport, ulen=8 + len(payload), sum=0)
    u.data = payload
    ip = dpkt.ip6.IP6(src=src, dst=dst, nxt=17, hlim=hlim, plen=8 + len(payload))
    ip.data = u
    eth = dpkt.ethernet.Ethernet(src=src_mac, dst=dst_mac, type=0x86DD)
    eth.data = ip
    return bytes(eth)


def raw6(src: bytes, dst: bytes, nh: int, payload: bytes, hlim: int = 64, plen: int | None = None) -> bytes:
    """An IPv6 packet (no Ethernet) from raw pieces, for extension-header and hostile-length cases."""
    return struct.pack("!IHBB16s16s", 6 << 28, len(payload) if plen is None else plen, nh, hlim, src, dst) + payload


def eth(packet: bytes, src_mac: bytes = GUEST_MAC, dst_mac: bytes = GW_MAC) -> bytes:
    return dst_mac + src_mac + b"\x86\xdd" + packet


# ------------------------------------------------------------------------- IPv4 shorthands
def ip_frame(l4, proto: int, dst: bytes = GW, src: bytes = GUEST) -> bytes:
    ip = dpkt.ip.IP(src=src, dst=dst, p=proto, ttl=64, id=7, data=l4)
    ip.len = 20 + len(bytes(l4))
    ip.sum = 0
    return bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=GW_MAC, type=0x0800, data=ip))


def tcp(sport: int, dport: int, flags: int, seq: int = 1000, ack: int = 0, dst: bytes = GW, data: bytes = b"") -> bytes:
    t = dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, ack=ack, flags=flags, win=65535,
                     opts=b"\x02\x04\x05\xb4" if flags & SYN else b"", data=data)
    t.off = 5 + len(t.opts) // 4
    return ip_frame(t, 6, dst)


def udp(sport: int, dport: int, payload: bytes, dst: bytes = GW) -> bytes:
    u = dpkt.udp.UDP(sport=sport, dport=dport, data=payload)
    u.ulen = len(bytes(u))
    return ip_frame(u, 17, dst)


def echo(ident: int, dst: bytes) -> bytes:
    return ip_frame(dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=ident, seq=1, data=b"hi")), 1, dst)


def tcp6(sport: int, dport: int, flags: int, dst: bytes, seq: int = 1000) -> bytes:
    t = dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, flags=flags, win=65535)
    ip = dpkt.ip6.IP6(src=GUEST6, dst=dst, nxt=6, hlim=64, plen=len(bytes(t)))
    ip.data = t
    return bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=GW_MAC, type=0x86DD, data=ip))


def dns_query(name: bytes = b"policy.test", qid: int = 0x1234) -> bytes:
    q = dpkt.dns.DNS(id=qid, qd=[dpkt.dns.DNS.Q(name=name.decode(), type=dpkt.dns.DNS_A)])
    return bytes(q)
