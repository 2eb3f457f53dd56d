"""Helpers for the in-process Stack tests: a Stack served over a socketpair, the frames it sends
back, and one small description per address family so that a test is written once and run
for IPv4 and IPv6 (as smoltcp runs its interface tests for each medium with ``#[case]``).

Frames are built with dpkt; every frame the stack sends is decoded with dpkt and its
checksums are verified with an independent RFC 1071 sum (``support.frames.ref_checksum6``).
Tests see what the stack shows: frames in and out, ``stack.counters``, the flow table (``stack.parts.flows``).
The few internals some tests read go through the functions at the end of this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time

import dpkt
import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.transport.base import Transport

from support.frames import (ACK, DNS6, GUEST, GUEST6, GUEST_LL, GUEST_MAC, GW, GW6, GW_LL, GW_MAC, SYN, a6,
                            checksum_valid, icmp6_frame, raw6, udp6_frame)

GUEST4 = socket.inet_aton("10.0.2.15")
GW4 = socket.inet_aton("10.0.2.2")
DNS4 = socket.inet_aton("10.0.2.3")
DNS_A, DNS_AAAA = "10.0.2.99", "2001:db8::99"  # what tests' DnsUpstream(aaaa=DNS_AAAA) answers


class CollectTransport(Transport):
    """A transport with offload that only collects the frames written to the guest (``out``),
    for tests that drive ``Stack.on_frames`` themselves (the guest side of micro_crr)."""

    offload = True

    def __init__(self) -> None:
        super().__init__()
        self.out: list = []

    async def _start_reading(self) -> None:
        pass

    def send_frames(self, frames) -> None:
        self.out.extend(frames)

    def _close_io(self) -> None:
        pass


def fd_count() -> int:
    """Open file descriptors of this process, after a garbage collection (so that sockets an
    earlier test left to the collector do not close in the middle of the count being compared)."""
    import gc

    gc.collect()
    return len(os.listdir("/proc/self/fd"))


async def recv_frames(sock, timeout=1.0):
    """Frames the stack sent to the guest end within ``timeout`` s (stops 50 ms after the last)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    out = []
    wait = timeout
    while True:
        try:
            out.append(await asyncio.wait_for(loop.sock_recv(sock, 70000), wait))
        except asyncio.TimeoutError:
            return out
        wait = 0.05


@contextlib.asynccontextmanager
async def served_stack(cfg, settle: float = 0.5):
    """Serve a Stack(``cfg``) over a socketpair; yields ``(stack, guest socket, first frames)``,
    the first frames being what the stack sent within ``settle`` s of serving (with IPv6 on:
    the Router Advertisement sent when serving starts)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        async with Stack(cfg) as stack:
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            first = await recv_frames(a, settle)
            yield stack, a, first
            stack.stop()
            await task
    finally:
        a.close()


def _l4_sum_ok(src: bytes, dst: bytes, proto: int, msg: bytes) -> bool:
    if proto == 1:  # ICMPv4: no pseudo-header (RFC 792)
        return _plain_sum(msg) == 0xFFFF
    return checksum_valid(src, dst, proto, msg)  # the IPv4 and IPv6 pseudo-headers sum to the same words


def _plain_sum(msg: bytes) -> int:
    """RFC 1071 sum of ``msg`` (folded); a header or message with a valid checksum gives 0xFFFF."""
    data = msg + (b"\x00" if len(msg) % 2 else b"")
    s = 0
    for i in range(0, len(data), 2):
        s += (data[i] << 8) | data[i + 1]
        s = (s & 0xFFFF) + (s >> 16)
    return s


class Family4:
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
        """An IPv4 packet (dpkt fills header and upper-layer checksums)."""
        ip = dpkt.ip.IP(src=src or self.guest, dst=dst or self.gw, p=proto, ttl=64, data=l4, **kw)
        ip.len = 20 + len(bytes(l4))
        ip.sum = 0
        return bytes(ip)

    def frame(self, packet: bytes, dst_mac: bytes = GW_MAC) -> bytes:
        return dst_mac + GUEST_MAC + struct.pack("!H", self.ethertype) + packet

    def echo(self, ident: int, seq: int, payload: bytes, src=None, dst=None) -> bytes:
        msg = dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=ident, seq=seq, data=payload))
        return self.frame(self.packet(msg, 1, src, dst))

    def addr_text(self, addr: bytes) -> str:
        return socket.inet_ntop(self.af, addr)

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
        assert _plain_sum(f[14:14 + ihl]) == 0xFFFF
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


class Family6:
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

    def frame(self, packet: bytes, dst_mac: bytes = GW_MAC) -> bytes:
        return dst_mac + GUEST_MAC + struct.pack("!H", self.ethertype) + packet

    def echo(self, ident: int, seq: int, payload: bytes, src=None, dst=None) -> bytes:
        return icmp6_frame(src or self.guest, dst or self.gw, 128, 0, struct.pack("!HH", ident, seq) + payload, hlim=64)

    def addr_text(self, addr: bytes) -> str:
        return socket.inet_ntop(self.af, addr)

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


F4, F6 = Family4(), Family6()
FAMILIES = [F4, F6]


def tcp_frame(fam, sport: int, dport: int, flags: int, seq: int = 1000, ack: int = 0, opts: bytes = b"",
              data: bytes = b"", src: bytes | None = None, dst: bytes | None = None) -> bytes:
    """A guest TCP segment of family ``fam`` (window 65535)."""
    t = dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, ack=ack, flags=flags, win=65535, off=5 + len(opts) // 4,
                     opts=opts, data=data)
    return fam.frame(fam.packet(t, 6, src, dst))


def udp_frame(fam, sport: int, dport: int, payload: bytes, src: bytes | None = None, dst: bytes | None = None) -> bytes:
    """A guest UDP datagram of family ``fam``."""
    if fam is F6:
        return udp6_frame(src or fam.guest, dst or fam.gw, sport, dport, payload)
    u = dpkt.udp.UDP(sport=sport, dport=dport, ulen=8 + len(payload), data=payload)
    return fam.frame(fam.packet(u, 17, src, dst))


def of_proto(fam, frames, proto: int) -> list:
    """Decoded (Ethernet, IP) of the ``fam`` frames carrying ``proto``."""
    return [fam.decode(f) for f in frames if fam.is_ip(f, proto)]


def icmp_of(fam, frames, icmp_type: int) -> list:
    """``(Ethernet, IP, message bytes)`` of the ICMP / ICMPv6 messages of type ``icmp_type``."""
    return [(*fam.decode(f), fam.l4(f)) for f in frames
            if fam.is_ip(f, fam.icmp_proto) and not fam.is_fragment(f) and fam.l4(f)[:1] == bytes((icmp_type,))]


# ---------------------------------------------------------------------------------------------
# The internals some tests read, in one place: update these when the core moves.


def stack_tasks(stack) -> set:
    """The tasks the stack spawned and has not yet seen end (flows, services)."""
    return stack.parts.tasks


def ipv6_path(stack):
    """The stack's IPv6 path (``None`` with ``ipv6=False``)."""
    return stack.parts.v6


def ndp_neighbours(stack) -> dict:
    """The IPv6 neighbour cache: address (16 bytes) -> MAC."""
    return stack.parts.v6.ndp.neighbors


def ipv6_guest_mac(stack):
    """The MAC of the guest's last IPv6 frame (``None`` before the first)."""
    return stack.parts.v6.guest_mac


def eth_to(stack, ip: bytes) -> bytes:
    """The 14-byte Ethernet header the stack puts on a frame to the guest's ``ip``."""
    parts = stack.parts
    return (parts.family6 if len(ip) == 16 else parts.family4).eth_to(ip)


def icmp_echo_mode(stack, fam) -> str | None:
    """The echo proxy mechanism chosen for ``fam``: ``"ping"``, ``"raw"``, ``"none"`` or None."""
    return stack.parts.icmp.mode if fam is F4 else stack.parts.icmp.mode6


def icmp_raw_socket(stack, fam):
    """The shared raw ICMP socket of ``fam`` (``None`` when not open)."""
    return stack.parts.icmp.raw if fam is F4 else stack.parts.icmp.raw6


# ------------------------------------------------------------------------- the guest end of a socketpair
class Guest:
    """The guest end of the socketpair: send frames, collect what the stack sends back."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)

    def send(self, *frames: bytes) -> None:
        for f in frames:
            self.sock.send(f)

    async def recv(self, timeout: float = 0.5, settle: float = 0.05) -> list[dpkt.ethernet.Ethernet]:
        """Frames from the stack within ``timeout`` s (returns ``settle`` s after the last one)."""
        loop = asyncio.get_running_loop()
        out = []
        wait = timeout
        while True:
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 70000), wait)
            except asyncio.TimeoutError:
                return out
            if not data:  # the stack closed its end
                return out
            out.append(dpkt.ethernet.Ethernet(data))
            wait = settle

    @staticmethod
    def tcp4(frames):
        return [e.data.data for e in frames if e.type == 0x0800 and e.data.p == 6]

    @staticmethod
    def icmp4(frames):
        return [e.data.data for e in frames if e.type == 0x0800 and e.data.p == 1]


@contextlib.asynccontextmanager
async def serving(**cfg):
    cfg.setdefault("ipv6", False)
    cfg.setdefault("dns_upstreams", [("127.0.0.1", 9)])
    cfg.setdefault("dns_timeout", 0.3)
    cfg.setdefault("tcp_connect_timeout", 3.0)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        async with Stack(NetworkConfig(**cfg)) as stack:
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            guest = Guest(a)
            if cfg["ipv6"]:
                await guest.recv(0.3)  # the first RA
            try:
                yield stack, guest
            finally:
                stack.stop()
                await task
    finally:
        a.close()


def listener(backlog: int = 16) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(backlog)
    return s


async def until(cond, timeout: float = 2.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# ------------------------------------------------------------------------- a guest for port forwards
class FakeGuest:
    """The guest end of the socket pair: receive/parse and build/send frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.loop = asyncio.get_running_loop()

    async def recv(self, timeout: float = 3.0) -> dpkt.ethernet.Ethernet:
        data = await asyncio.wait_for(self.loop.sock_recv(self.sock, 70000), timeout)
        return dpkt.ethernet.Ethernet(data)

    async def expect(self, pred, timeout: float = 3.0):
        """The next frame for which ``pred(eth)`` is true (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("expected frame did not arrive")
            eth = await self.recv(left)
            if pred(eth):
                return eth

    async def expect_tcp(self, timeout: float = 3.0) -> dpkt.tcp.TCP:
        eth = await self.expect(lambda e: isinstance(e.data, dpkt.ip.IP) and e.data.p == 6, timeout)
        return eth.data.data

    def send_ip(self, l4, proto: int, src: bytes = GUEST, dst: bytes = GW) -> None:
        ip = dpkt.ip.IP(src=src, dst=dst, p=proto, ttl=64, data=l4)
        ip.len = 20 + len(bytes(l4))
        eth = dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=GW_MAC, type=0x0800, data=ip)
        self.sock.send(bytes(eth))

    def send_tcp(self, sport, dport, seq, ack, flags, data=b"", win=65535, opts=b"") -> None:
        self.send_ip(dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, ack=ack, flags=flags, win=win,
                                  opts=opts, off=(20 + len(opts)) // 4, data=data), 6)

    def answer_arp(self, arp_eth) -> None:
        req = arp_eth.data
        rep = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REPLY, sha=GUEST_MAC, spa=req.tpa, tha=req.sha, tpa=req.spa)
        self.sock.send(bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=req.sha, type=0x0806, data=rep)))


def is_arp_request(e) -> bool:
    return e.type == 0x0806 and e.data.op == dpkt.arp.ARP_OP_REQUEST


@pytest.fixture
async def stack_guest(request):
    cfg_kw = getattr(request, "param", {})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], tcp_connect_timeout=2.0, **cfg_kw)
    async with Stack(cfg) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        yield stack, FakeGuest(a)
        stack.stop()
        await task
    a.close()


async def host_connect(port: int, family=socket.AF_INET, host="127.0.0.1"):
    return await asyncio.wait_for(asyncio.open_connection(host, port, family=family), 3)


async def guest_accept(guest: FakeGuest, guest_port: int, *, mac_known: bool = False, wscale: int = 7):
    """Play the guest's side of the handshake; returns (sport, our_seq, their_next_seq, syn)."""
    if not mac_known:
        arp = await guest.expect(is_arp_request)
        assert arp.src == GW_MAC and arp.data.spa == GW and arp.data.tpa == GUEST
        assert arp.dst == b"\xff" * 6
        guest.answer_arp(arp)
    syn = await guest.expect_tcp()
    assert syn.flags == SYN and syn.dport == guest_port
    iss = 1000
    opts = b"\x02\x04\x05\xb4" + b"\x01\x03\x03" + bytes([wscale])
    guest.send_tcp(guest_port, syn.sport, iss, syn.seq + 1, SYN | ACK, opts=opts, win=64240)
    ack = await guest.expect_tcp()
    assert ack.flags & ACK and not ack.flags & SYN and ack.ack == iss + 1 and ack.seq == syn.seq + 1
    return syn.sport, iss + 1, syn.seq + 1, syn
