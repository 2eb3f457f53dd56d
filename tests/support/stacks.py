"""A Stack served in this process over a socketpair, and the guest's end of it.

Two ways to serve one, both with real host sockets behind (pytest runs in a loopback-only
namespace): :func:`served_stack` (any ``NetworkConfig``; yields the raw guest socket and the
first frames, for the family-parametrized tests that decode with :mod:`support.frames`) and
:func:`serving` (IPv4 by default, a dead DNS upstream; yields a :class:`GuestEnd`, which decodes
with dpkt). :func:`stack_guest` is a fixture for port forwards, whose guest answers the stack's
ARP and SYNs (:func:`guest_accept`).

Tests see what the stack shows: frames in and out, ``stack.counters``, the flow table
(``stack.parts.flows``). The few internals some tests read go through the functions under
"internals" below: update these when the core moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import dpkt
import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.transport.base import Transport

from support.frames import ACK, F4, GUEST4, GUEST_MAC, GW4, GW_MAC, SYN, tcp_frame


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


class GuestEnd:
    """The guest end of the socketpair: send frames, read what the stack sends back (dpkt-decoded).

    :meth:`recv` collects every frame within a time; :meth:`expect` waits for one frame that
    matches; :meth:`answer_arp` answers the stack's ARP request for the guest.
    """

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

    async def next_frame(self, timeout: float = 3.0) -> dpkt.ethernet.Ethernet:
        """The next frame from the stack (``TimeoutError`` after ``timeout`` s)."""
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, 70000), timeout)
        return dpkt.ethernet.Ethernet(data)

    async def expect(self, pred, timeout: float = 3.0) -> dpkt.ethernet.Ethernet:
        """The next frame for which ``pred(eth)`` is true (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("expected frame did not arrive")
            eth = await self.next_frame(left)
            if pred(eth):
                return eth

    async def expect_tcp(self, timeout: float = 3.0) -> dpkt.tcp.TCP:
        """The next IPv4 TCP segment from the stack."""
        eth = await self.expect(lambda e: isinstance(e.data, dpkt.ip.IP) and e.data.p == 6, timeout)
        return eth.data.data

    def answer_arp(self, arp_eth) -> None:
        """Answer the stack's ARP request ``arp_eth`` (RFC 826) with the guest's MAC."""
        req = arp_eth.data
        rep = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REPLY, sha=GUEST_MAC, spa=req.tpa, tha=req.sha, tpa=req.spa)
        self.sock.send(bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=req.sha, type=0x0806, data=rep)))

    @staticmethod
    def tcp4(frames):
        """The IPv4 TCP segments (dpkt) among ``frames``."""
        return [e.data.data for e in frames if e.type == 0x0800 and e.data.p == 6]

    @staticmethod
    def icmp4(frames):
        """The ICMPv4 messages (dpkt) among ``frames``."""
        return [e.data.data for e in frames if e.type == 0x0800 and e.data.p == 1]


@contextlib.asynccontextmanager
async def serving(**cfg):
    """Serve a Stack(NetworkConfig(**cfg)) over a socketpair; yields ``(stack, GuestEnd)``. Defaults:
    IPv4 only, a DNS upstream nobody answers (127.0.0.1:9, 0.3 s), a 3 s TCP connect timeout."""
    cfg.setdefault("ipv6", False)
    cfg.setdefault("dns_upstreams", [("127.0.0.1", 9)])
    cfg.setdefault("dns_timeout", 0.3)
    cfg.setdefault("tcp_connect_timeout", 3.0)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        async with Stack(NetworkConfig(**cfg)) as stack:
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            guest = GuestEnd(a)
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
    """A TCP listener on 127.0.0.1:<ephemeral>."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(backlog)
    return s


async def until(cond, timeout: float = 2.0) -> bool:
    """Wait until ``cond()`` (polled every 10 ms); False after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# ------------------------------------------------------------------------------ port forwards
def is_arp_request(e) -> bool:
    """True for an ARP request (what the stack asks before its first frame to the guest)."""
    return e.type == 0x0806 and e.data.op == dpkt.arp.ARP_OP_REQUEST


@pytest.fixture
async def stack_guest(request):
    """``(stack, GuestEnd)``: a Stack (IPv4 and IPv6, a dead DNS upstream, a 2 s TCP connect timeout;
    ``request.param``: more NetworkConfig fields) served over a socketpair, for port forwards."""
    cfg_kw = getattr(request, "param", {})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], tcp_connect_timeout=2.0, **cfg_kw)
    async with Stack(cfg) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        yield stack, GuestEnd(a)
        stack.stop()
        await task
    a.close()


async def host_connect(port: int, family=socket.AF_INET, host="127.0.0.1"):
    """A host client of a port forward: ``(reader, writer)`` within 3 s."""
    return await asyncio.wait_for(asyncio.open_connection(host, port, family=family), 3)


async def guest_accept(guest: GuestEnd, guest_port: int, *, mac_known: bool = False, wscale: int = 7):
    """Play the guest's side of the handshake; returns (sport, our_seq, their_next_seq, syn)."""
    if not mac_known:
        arp = await guest.expect(is_arp_request)
        assert arp.src == GW_MAC and arp.data.spa == GW4 and arp.data.tpa == GUEST4
        assert arp.dst == b"\xff" * 6
        guest.answer_arp(arp)
    syn = await guest.expect_tcp()
    assert syn.flags == SYN and syn.dport == guest_port
    iss = 1000
    opts = b"\x02\x04\x05\xb4" + b"\x01\x03\x03" + bytes([wscale])
    guest.send(tcp_frame(F4, guest_port, syn.sport, SYN | ACK, iss, syn.seq + 1, opts=opts, win=64240))
    ack = await guest.expect_tcp()
    assert ack.flags & ACK and not ack.flags & SYN and ack.ack == iss + 1 and ack.seq == syn.seq + 1
    return syn.sport, iss + 1, syn.seq + 1, syn


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
