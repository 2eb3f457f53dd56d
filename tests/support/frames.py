"""Guest frames for the tests: one vocabulary, built with dpkt, checked against an independent sum.

Every test that plays the guest builds its frames here:

* **Addresses** of the default network: ``GUEST_MAC``, ``GW_MAC``; IPv4 ``GUEST4``, ``GW4``,
  ``DNS4``; IPv6 ``GUEST6``, ``GW6``, ``DNS6``, ``GUEST_LL``, ``GW_LL``, ``UNSPEC``; :func:`a6`.
* **A case per address family**, :data:`F4` (:class:`V4`) and :data:`F6` (:class:`V6`): addresses,
  ICMP types, counter names, how to build and decode a packet, so that a test is written once and
  run for IPv4 and IPv6 (as smoltcp runs its interface tests for each medium with ``#[case]``).
  (The product's own per-family classes are ``aioslirp.dispatch.family.Family4``/``Family6``.)
* **Frames**, each for a family: :func:`ip_frame`, :func:`tcp_frame`, :func:`udp_frame`,
  :func:`echo_frame`; for IPv6 corner cases :func:`icmp6_frame`, :func:`udp6_frame`,
  :func:`raw6` (no Ethernet) and :func:`eth6_frame`.
* **Payloads**: :func:`dns_query`.
* **What came back**: :func:`of_proto`, :func:`icmp_of`, ``fam.decode`` (checksums verified with
  :func:`ref_checksum6` / :func:`plain_sum`, word-by-word RFC 1071 sums independent of
  aioslirp.wire.checksum).

Fuzzers (tests/adversarial/test_fuzz_*.py) and guest programs keep builders of their own: they
mutate raw bytes, or run where the tests' modules are not importable.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

import dpkt

GUEST_MAC = bytes.fromhex("525400123456")
GW_MAC = bytes.fromhex("52550a000202")
GUEST4 = socket.inet_aton("10.0.2.15")
GW4 = socket.inet_aton("10.0.2.2")
DNS4 = socket.inet_aton("10.0.2.3")
GW_LL = ipaddress.IPv6Address("fe80::5055:aff:fe00:202").packed  # modified EUI-64 of 52:55:0a:00:02:02
GW6 = ipaddress.IPv6Address("fd00::2").packed
DNS6 = ipaddress.IPv6Address("fd00::3").packed
GUEST6 = ipaddress.IPv6Address("fd00::5054:ff:fe12:3456").packed
GUEST_LL = ipaddress.IPv6Address("fe80::5054:ff:fe12:3456").packed
UNSPEC = bytes(16)
DNS_A, DNS_AAAA = "10.0.2.99", "2001:db8::99"  # what tests' DnsUpstream(aaaa=DNS_AAAA) answers
SYN, ACK, FIN, RST, PSH = dpkt.tcp.TH_SYN, dpkt.tcp.TH_ACK, dpkt.tcp.TH_FIN, dpkt.tcp.TH_RST, dpkt.tcp.TH_PUSH


def a6(text: str) -> bytes:
    """The 16 bytes of IPv6 address ``text``."""
    return ipaddress.IPv6Address(text).packed


# ------------------------------------------------------------------------------------ checksums
def plain_sum(msg: bytes) -> int:
    """RFC 1071 sum of ``msg`` (folded); a header or message with a valid checksum gives 0xFFFF."""
    data = msg + (b"\x00" if len(msg) % 2 else b"")
    s = 0
    for i in range(0, len(data), 2):
        s += (data[i] << 8) | data[i + 1]
        s = (s & 0xFFFF) + (s >> 16)
    return s


def ref_checksum6(src: bytes, dst: bytes, nh: int, msg: bytes) -> int:
    """RFC 1071 sum over the RFC 8200 8.1 pseudo-header and ``msg``, written out word by word.

    Independent of aioslirp.wire.checksum (which reduces a big integer modulo 0xFFFF).
    Returns the folded 16-bit one's-complement sum; a message with a valid checksum gives 0xFFFF.
    The IPv4 pseudo-header (RFC 9293 3.1) sums to the same words, so 4-byte addresses work too.
    """
    pseudo = src + dst + struct.pack("!I", len(msg)) + b"\x00\x00\x00" + bytes((nh,))
    return plain_sum(pseudo + msg)


def checksum_valid(src: bytes, dst: bytes, nh: int, msg: bytes) -> bool:
    return ref_checksum6(src, dst, nh, msg) == 0xFFFF


def _l4_sum_ok(src: bytes, dst: bytes, proto: int, msg: bytes) -> bool:
    if proto == 1:  # ICMPv4: no pseudo-header (RFC 792)
        return plain_sum(msg) == 0xFFFF
    return checksum_valid(src, dst, proto, msg)


# ------------------------------------------------------------------------------- family cases
class FamilyCase:
    """What a test needs to know of one address family (see :class:`V4`, :class:`V6`)."""

    name: str
    af: int
    loopback: str
    ethertype: int
    guest: bytes
    gw: bytes
    dns: bytes

    def packet(self, l4, proto: int, src: bytes | None = None, dst: bytes | None = None, **kw) -> bytes:
        """An IP packet from the guest (default) to the gateway (default) carrying ``l4``."""
        raise NotImplementedError

    def frame(self, packet: bytes, dst_mac: bytes = GW_MAC) -> bytes:
        """``packet`` in an Ethernet frame from the guest's MAC."""
        return dst_mac + GUEST_MAC + struct.pack("!H", self.ethertype) + packet

    def addr_text(self, addr: bytes) -> str:
        return socket.inet_ntop(self.af, addr)


class V4(FamilyCase):
    """IPv4 on the default network 10.0.2.0/24."""

    name = "ipv4"
    af = socket.AF_INET
    loopback = "127.0.0.1"
    ethertype = 0x0800
    guest, gw, dns = GUEST4, GW4, DNS4
    #: (source, destination) of echo requests the stack answers itself
    local_echo = ((GUEST4, GW4), (GUEST4, DNS4))
    icmp_proto, echo_request, echo_reply = 1, 8, 0
    port_unreachable = (3, 3)  # (type, code), RFC 792
    mss_overhead = 40  # IPv4 + TCP headers: SYN-ACK MSS = MTU - 40
    dns_qtype, dns_answer = 1, socket.inet_aton(DNS_A)
    remote = "192.0.2.56"  # TEST-NET-1 (RFC 5737), put on lo of pytest's loopback-only namespace
    counter = {"echo_local": "icmp_echo_local", "errors_sent": "icmp_errors_sent",
               "fragments": "ip_fragments", "reassembled": "ip_reassembled"}

    def packet(self, l4, proto: int, src: bytes | None = None, dst: bytes | None = None, **kw) -> bytes:
        """An IPv4 packet, TTL 64 (dpkt fills header and upper-layer checksums); ``kw``: more
        dpkt.ip.IP fields (``id``, ``mf``, ``offset``...)."""
        ip = dpkt.ip.IP(src=src or self.guest, dst=dst or self.gw, p=proto, ttl=64, data=l4, **kw)
        ip.len = 20 + len(bytes(l4))
        ip.sum = 0
        return bytes(ip)

    def add_remote_cmd(self) -> list:
        return ["ip", "addr", "add", f"{self.remote}/32", "dev", "lo"]

    def del_remote_cmd(self) -> list:
        return ["ip", "addr", "del", f"{self.remote}/32", "dev", "lo"]

    def is_ip(self, f: bytes, proto: int) -> bool:
        return f[12:14] == b"\x08\x00" and f[23] == proto

    def l4(self, f: bytes) -> bytes:
        """The upper-layer bytes of an IPv4 frame (options and padding skipped)."""
        ihl = (f[14] & 0x0F) * 4
        return f[14 + ihl:14 + struct.unpack_from("!H", f, 16)[0]]

    def is_fragment(self, f: bytes) -> bool:
        return bool(struct.unpack_from("!H", f, 20)[0] & 0x3FFF)

    def decode(self, f: bytes):
        """(Ethernet, IP) of a frame from the stack; IP and upper-layer checksums verified."""
        e = dpkt.ethernet.Ethernet(f)
        assert e.type == self.ethertype
        ihl = (f[14] & 0x0F) * 4
        assert plain_sum(f[14:14 + ihl]) == 0xFFFF
        if not self.is_fragment(f) and f[23] in (1, 6, 17):
            assert _l4_sum_ok(f[26:30], f[30:34], f[23], self.l4(f))
        return e, e.data

    def udp_fragments(self, sport: int, dport: int, payload: bytes, ident: int, chunk: int = 1480) -> list:
        """Frames carrying one UDP datagram in fragments of ``chunk`` bytes (a multiple of 8)."""
        body = self.packet(dpkt.udp.UDP(sport=sport, dport=dport, ulen=8 + len(payload), sum=0, data=payload), 17)[20:]
        out = []
        for off in range(0, len(body), chunk):
            part = body[off:off + chunk]
            more = 1 if off + chunk < len(body) else 0
            out.append(self.frame(self.packet(part, 17, id=ident, mf=more, offset=off >> 3)))
        return out

    def fragment_parts(self, frames) -> list:
        """Sorted (byte offset, data) of IPv4 fragments."""
        return sorted(((struct.unpack_from("!H", f, 20)[0] & 0x1FFF) << 3, self.l4(f)) for f in frames)

    def quoted(self, err: bytes):
        """(source, destination, source port) of the datagram an ICMP error quotes."""
        q = err[8:]
        return q[12:16], q[16:20], q[20:22]


class V6(FamilyCase):
    """IPv6 on the default prefix fd00::/64."""

    name = "ipv6"
    af = socket.AF_INET6
    loopback = "::1"
    ethertype = 0x86DD
    guest, gw, dns = GUEST6, GW6, DNS6
    local_echo = ((GUEST6, GW6), (GUEST6, DNS6), (GUEST_LL, GW_LL))
    icmp_proto, echo_request, echo_reply = 58, 128, 129
    port_unreachable = (1, 4)  # (type, code), RFC 4443 3.1
    mss_overhead = 60  # IPv6 + TCP headers: SYN-ACK MSS = MTU - 60
    dns_qtype, dns_answer = 28, a6(DNS_AAAA)
    remote = "2001:db8::56"  # documentation address (RFC 3849) on lo of pytest's loopback-only namespace
    counter = {"echo_local": "icmp6_echo_local", "errors_sent": "icmp6_errors_sent",
               "fragments": "ipv6_fragments", "reassembled": "ipv6_reassembled"}

    def packet(self, l4, proto: int, src: bytes | None = None, dst: bytes | None = None, hlim: int = 64) -> bytes:
        """An IPv6 packet (dpkt fills the upper-layer checksum)."""
        ip = dpkt.ip6.IP6(src=src or self.guest, dst=dst or self.gw, nxt=proto, hlim=hlim, plen=len(bytes(l4)))
        ip.data = l4
        return bytes(ip)

    def add_remote_cmd(self) -> list:
        return ["ip", "-6", "addr", "add", f"{self.remote}/128", "dev", "lo", "nodad"]

    def del_remote_cmd(self) -> list:
        return ["ip", "-6", "addr", "del", f"{self.remote}/128", "dev", "lo"]

    def is_ip(self, f: bytes, proto: int) -> bool:
        return f[12:14] == b"\x86\xdd" and f[20] == proto

    def l4(self, f: bytes) -> bytes:
        """The bytes after the fixed IPv6 header (the stack sends no extension header but Fragment)."""
        return f[54:54 + struct.unpack_from("!H", f, 18)[0]]

    def is_fragment(self, f: bytes) -> bool:
        return f[20] == 44

    def decode(self, f: bytes):
        """(Ethernet, IP6) of a frame from the stack, its upper-layer checksum verified."""
        e = dpkt.ethernet.Ethernet(f)
        assert e.type == self.ethertype
        ip = e.data
        if ip.nxt in (6, 17, 58):
            assert checksum_valid(ip.src, ip.dst, ip.nxt, f[54:54 + ip.plen])
        return e, ip

    def udp_fragments(self, sport: int, dport: int, payload: bytes, ident: int, chunk: int = 1448) -> list:
        body = self.packet(dpkt.udp.UDP(sport=sport, dport=dport, ulen=8 + len(payload), sum=0, data=payload), 17)[40:]
        out = []
        for off in range(0, len(body), chunk):
            more = 1 if off + chunk < len(body) else 0
            frag = struct.pack("!BBHI", 17, 0, off | more, ident)  # Fragment header (RFC 8200 4.5)
            out.append(self.frame(raw6(self.guest, self.gw, 44, frag + body[off:off + chunk])))
        return out

    def fragment_parts(self, frames) -> list:
        return sorted((struct.unpack_from("!H", f, 56)[0] & 0xFFF8, f[62:]) for f in frames)

    def quoted(self, err: bytes):
        q = err[8:]
        return q[8:24], q[24:40], q[40:42]


F4, F6 = V4(), V6()
FAMILIES = [F4, F6]


# ------------------------------------------------------------------------------------- frames
def ip_frame(fam: FamilyCase, l4, proto: int, src: bytes | None = None, dst: bytes | None = None, **kw) -> bytes:
    """A guest frame of family ``fam`` carrying ``l4`` (a dpkt object or bytes) as protocol
    ``proto``, from the guest (default) to the gateway (default); ``kw``: more IP header fields."""
    return fam.frame(fam.packet(l4, proto, src, dst, **kw))


def tcp_frame(fam: FamilyCase, sport: int, dport: int, flags: int, seq: int = 1000, ack: int = 0, opts: bytes = b"",
              data: bytes = b"", src: bytes | None = None, dst: bytes | None = None, *, win: int = 65535,
              mss: int | None = None) -> bytes:
    """A guest TCP segment of family ``fam``; ``mss``: an MSS option (RFC 9293 3.7.1) before ``opts``."""
    if mss is not None:
        opts = struct.pack("!BBH", 2, 4, mss) + opts
    t = dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, ack=ack, flags=flags, win=win, off=5 + len(opts) // 4,
                     opts=opts, data=data)
    return ip_frame(fam, t, 6, src, dst)


def udp_frame(fam: FamilyCase, sport: int, dport: int, payload: bytes, src: bytes | None = None,
              dst: bytes | None = None) -> bytes:
    """A guest UDP datagram of family ``fam``."""
    if fam is F6:
        return udp6_frame(src or fam.guest, dst or fam.gw, sport, dport, payload)
    u = dpkt.udp.UDP(sport=sport, dport=dport, ulen=8 + len(payload), data=payload)
    return ip_frame(fam, u, 17, src, dst)


def echo_frame(fam: FamilyCase, ident: int, seq: int = 1, payload: bytes = b"hi", src: bytes | None = None,
               dst: bytes | None = None) -> bytes:
    """A guest echo request of family ``fam`` (ICMP type 8, RFC 792; ICMPv6 type 128, RFC 4443 4.1)."""
    if fam is F6:
        return icmp6_frame(src or fam.guest, dst or fam.gw, 128, 0, struct.pack("!HH", ident, seq) + payload, hlim=64)
    msg = dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=ident, seq=seq, data=payload))
    return ip_frame(fam, msg, 1, src, dst)


def icmp6_frame(src: bytes, dst: bytes, icmp_type: int, code: int, body: bytes, hlim: int = 255,
                src_mac: bytes = GUEST_MAC, dst_mac: bytes | None = None) -> bytes:
    """A whole Ethernet/IPv6/ICMPv6 frame built by dpkt (checksum computed by dpkt); to a
    multicast ``dst`` it goes to its 33:33 MAC (RFC 2464 7)."""
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
    """A whole Ethernet/IPv6/UDP frame (checksum computed by dpkt)."""
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


def eth6_frame(packet: bytes, src_mac: bytes = GUEST_MAC, dst_mac: bytes = GW_MAC) -> bytes:
    """IPv6 ``packet`` (e.g. from :func:`raw6`) in an Ethernet frame."""
    return dst_mac + src_mac + b"\x86\xdd" + packet


# ----------------------------------------------------------------------------------- payloads
def dns_query(name: str = "policy.test", qid: int = 0x1234, qtype: int = dpkt.dns.DNS_A) -> bytes:
    """A DNS query (RFC 1035 4.1) for ``name``, type ``qtype`` (1 A, 28 AAAA), class IN, recursion desired."""
    return bytes(dpkt.dns.DNS(id=qid, rd=1, qd=[dpkt.dns.DNS.Q(name=name, type=qtype, cls=dpkt.dns.DNS_IN)]))


# ---------------------------------------------------------------------------------- decoding
def of_proto(fam: FamilyCase, frames, proto: int) -> list:
    """Decoded (Ethernet, IP) of the ``fam`` frames carrying ``proto``."""
    return [fam.decode(f) for f in frames if fam.is_ip(f, proto)]


def icmp_of(fam: FamilyCase, frames, icmp_type: int) -> list:
    """``(Ethernet, IP, message bytes)`` of the ICMP / ICMPv6 messages of type ``icmp_type``."""
    return [(*fam.decode(f), fam.l4(f)) for f in frames
            if fam.is_ip(f, fam.icmp_proto) and not fam.is_fragment(f) and fam.l4(f)[:1] == bytes((icmp_type,))]
