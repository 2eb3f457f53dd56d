"""Configurable bounds: fragment reassembly (IPv4 and IPv6) and the per-flow TCP buffer counters.

* Sans-IO: each reassembly bound (datagrams in progress, fragments per datagram, bytes held,
  timeout) with a fake clock, for :class:`Reassembler` (IPv4) and :class:`Ipv6Reassembler`, each
  hit counted under its own drop reason; a hypothesis run checks that the bytes held always
  equal the fragments kept and never exceed the cap.
* Config: the ``reassembly_*`` fields are validated (ConfigError naming the field) and settable
  with ``--limit`` (a bad value: one line naming the option, exit 2).
* A whole Stack in this process: a guest flooding incomplete fragments hits the byte cap, the
  counter rises in ``Stack.stats()``, unfragmented traffic keeps working, and once the flood's
  datagrams time out a fragmented UDP datagram (both families) and a fragmented ping get
  through byte-exact to a real UDP echo server on host loopback.
* The inject queue: a burst beyond ``inject_queue_size`` is dropped and counted, then it recovers.
* A real Linux guest in a namespace with a small ``tcp_buffer``: reading the host socket pauses
  (``tcp_host_read_paused``) and writing to it pauses (``tcp_host_write_paused``), and the bytes
  arrive intact both ways (SHA-256).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import dpkt
import pytest
from hypothesis import given, settings, strategies as st

from aioslirp import ConfigError, NetworkConfig, SocketPairTransport, Stack
from aioslirp.cli import build_parser, config_from_args
from aioslirp.config.limits import LIMIT_FIELDS, parse_limits
from aioslirp.dispatch.reassembly import Ipv6Reassembler, Reassembler
from aioslirp.frontends.netns import run_in_namespace
from aioslirp.nat.hostsock import READ_SIZE
from aioslirp.nat.tcp import TcpFlow
from aioslirp.wire.ipv6 import parse_ipv6

from support.frames import GUEST4, GUEST6, GUEST_MAC, GW4, GW6, GW_MAC, raw6, ref_checksum6
from support.servers import DataServer, UdpEcho, pattern
from support.stacks import GuestEnd

REMOTE6 = bytes.fromhex("20010db8000000000000000000000001")


# ---------------------------------------------------------------------------------- sans-IO, IPv4
def test_v4_datagram_count_bound_evicts_the_oldest():
    r = Reassembler(max_datagrams=3)
    for ident in range(5):
        assert r.add(("k", ident), 0, True, bytes(8), 0.0) is None
    assert len(r) == 3 and r.drops == {"frag_evicted": 2}
    assert r.held == 3 * 8
    # the evicted datagram 0 cannot complete any more; datagram 4 can
    assert r.add(("k", 0), 8, False, b"end", 0.0) is None
    assert r.add(("k", 4), 8, False, b"end", 0.0) == bytes(8) + b"end"


def test_v4_fragments_per_datagram_bound_discards_the_datagram():
    r = Reassembler(max_fragments=4)
    for i in range(4):
        assert r.add(("k",), 8 * i, True, b"abcdefgh", 0.0) is None
    assert r.held == 32 and not r.drops
    assert r.add(("k",), 32, True, b"abcdefgh", 0.0) is None
    assert r.drops == {"frag_too_many": 1}
    assert len(r) == 0 and r.held == 0


def test_v4_byte_cap_drops_new_fragments_but_lets_a_datagram_complete():
    r = Reassembler(max_bytes=100)
    assert r.add(("a",), 0, True, b"a" * 48, 0.0) is None
    assert r.add(("b",), 0, True, b"b" * 48, 0.0) is None
    assert r.held == 96
    # 96 + 8 > 100: the fragment of a new datagram is dropped, nothing is left of it
    assert r.add(("c",), 0, True, b"c" * 8, 0.0) is None
    assert r.drops == {"frag_memory_full": 1} and len(r) == 2 and ("c",) not in r and r.held == 96
    # a fragment of a datagram in progress is dropped too, and the datagram stays
    assert r.add(("b",), 48, True, b"x" * 8, 0.0) is None
    assert r.drops == {"frag_memory_full": 2} and ("b",) in r and r.held == 96
    # ...unless it completes its datagram: that frees the bytes at once
    assert r.add(("a",), 48, False, b"A" * 16, 0.0) == b"a" * 48 + b"A" * 16
    assert r.held == 48 and len(r) == 1
    assert r.add(("c",), 0, True, b"c" * 8, 0.0) is None
    assert r.held == 56 and r.drops == {"frag_memory_full": 2}


def test_v4_timeout_expires_datagrams_and_frees_their_bytes():
    r = Reassembler(timeout=2.0)
    r.add(("a",), 0, True, bytes(16), 0.0)
    r.add(("b",), 0, True, bytes(24), 1.0)
    assert r.held == 40
    r.add(("c",), 0, True, bytes(8), 2.5)  # a: 2.5 s old, expired; b: 1.5 s, kept
    assert r.drops == {"frag_timeout": 1} and ("a",) not in r and ("b",) in r and r.held == 32
    # b's last fragment after its deadline starts a new, incomplete datagram
    assert r.add(("b",), 24, False, bytes(8), 3.0) is None
    assert r.drops == {"frag_timeout": 2}
    r.expire(100.0)
    assert len(r) == 0 and r.held == 0 and r.drops == {"frag_timeout": 4}


def test_v4_bounds_reject_each_counted_separately():
    r = Reassembler(max_datagrams=2, max_fragments=2, max_bytes=64, timeout=1.0)
    r.add((1,), 0, True, bytes(8), 0.0)
    r.add((1,), 8, True, bytes(8), 0.0)
    r.add((1,), 16, True, bytes(8), 0.0)  # too many
    r.add((2,), 0, True, bytes(56), 0.0)
    r.add((3,), 0, True, bytes(16), 0.0)  # 56 + 16 > 64
    r.add((4,), 0, True, bytes(8), 0.0)
    r.add((5,), 0, True, bytes(8), 0.0)  # evicts 2
    r.add((6,), 0, True, bytes(8), 5.0)  # 4 and 5 time out
    assert r.drops == {"frag_too_many": 1, "frag_memory_full": 1, "frag_evicted": 1, "frag_timeout": 2}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.booleans(), st.integers(0, 48),
                          st.floats(0, 3)), max_size=80),
       st.integers(8, 400))
def test_v4_bytes_held_always_match_the_fragments_kept(ops, cap):
    r = Reassembler(max_datagrams=4, max_fragments=6, max_bytes=cap, timeout=2.0)
    now = 0.0
    for ident, off8, more, n, dt in ops:
        now += dt
        n = n if not more else (n & ~7)
        r.add((ident,), off8 * 8, more, bytes(n), now)
        kept = sum(len(d) for p in r._pending.values() for _, d in p.frags)
        assert r.held == kept <= cap
        assert len(r) <= 4


# ---------------------------------------------------------------------------------- sans-IO, IPv6
def frag6(ident: int, offset: int, more: bool, chunk: bytes, nh: int = 17) -> tuple[bytes, object]:
    pkt = raw6(REMOTE6, GUEST6, 44, struct.pack("!BxHI", nh, offset | int(more), ident) + chunk)
    ip = parse_ipv6(pkt, 0)
    assert not isinstance(ip, str), ip
    return pkt, ip


HEAD6 = 40  # the IPv6 header kept with each datagram until it completes


def test_v6_datagram_count_bound_evicts_the_oldest():
    r = Ipv6Reassembler(max_datagrams=3)
    for ident in range(5):
        assert r.add(*frag6(ident, 0, True, bytes(8)), now=1.0) is None
    assert len(r) == 3 and r.drops == {"frag_evicted": 2}
    assert r.held == 3 * (8 + HEAD6)
    # the evicted datagram 0 cannot complete: its tail starts a new datagram (evicting 2)
    assert r.add(*frag6(0, 8, False, bytes(8)), now=1.0) is None
    assert r.drops == {"frag_evicted": 3}
    whole = r.add(*frag6(4, 8, False, bytes(8)), now=1.0)
    assert whole == raw6(REMOTE6, GUEST6, 17, bytes(16))
    assert len(r) == 2 and r.held == (8 + HEAD6) + 8  # datagram 3 and the orphan tail of 0


def test_v6_fragments_per_datagram_bound():
    r = Ipv6Reassembler(max_fragments=3)
    for i in range(3):
        assert r.add(*frag6(9, 8 * i, True, bytes(8)), now=1.0) is None
    assert r.add(*frag6(9, 24, True, bytes(8)), now=1.0) is None
    assert r.drops == {"frag_too_many": 1} and len(r) == 0 and r.held == 0


def test_v6_byte_cap_counts_the_first_fragment_header():
    r = Ipv6Reassembler(max_bytes=2 * (64 + HEAD6))
    assert r.add(*frag6(1, 0, True, bytes(64)), now=1.0) is None
    assert r.add(*frag6(2, 0, True, bytes(64)), now=1.0) is None
    assert r.held == 2 * (64 + HEAD6)
    # a non-first fragment of a third datagram does not fit either
    assert r.add(*frag6(3, 8, True, bytes(8)), now=1.0) is None
    assert r.add(*frag6(3, 0, True, bytes(8)), now=1.0) is None
    assert r.drops == {"frag_memory_full": 2} and len(r) == 2
    # completing datagram 1 is allowed over the cap and frees its bytes and header
    whole = r.add(*frag6(1, 64, False, b"tail"), now=1.0)
    assert whole == raw6(REMOTE6, GUEST6, 17, bytes(64) + b"tail")
    assert r.held == 64 + HEAD6
    assert r.add(*frag6(3, 0, True, bytes(8)), now=1.0) is None
    assert r.held == 64 + HEAD6 + 8 + HEAD6


def test_v6_timeout_expires_datagrams_and_frees_their_bytes():
    r = Ipv6Reassembler(timeout=2.0)
    r.add(*frag6(1, 0, True, bytes(16)), now=10.0)
    r.add(*frag6(2, 0, True, bytes(16)), now=11.0)
    assert r.held == 2 * (16 + HEAD6)
    assert r.add(*frag6(1, 16, False, bytes(8)), now=12.5) is None  # 1 expired first: no completion
    assert r.drops == {"frag_timeout": 1} and r.held == 16 + HEAD6 + 8
    r.add(*frag6(3, 0, True, bytes(8)), now=30.0)
    assert r.drops == {"frag_timeout": 3} and len(r) == 1 and r.held == 8 + HEAD6


# ---------------------------------------------------------------------------------- configuration
def test_reassembly_defaults_and_from_config():
    cfg = NetworkConfig().validate()
    assert (cfg.reassembly_max_datagrams, cfg.reassembly_max_fragments, cfg.reassembly_max_bytes,
            cfg.reassembly_timeout) == (64, 64, 4 << 20, 15.0)
    cfg = NetworkConfig(reassembly_max_datagrams=8, reassembly_max_fragments=5, reassembly_max_bytes=9000,
                        reassembly_timeout=2.5).validate()
    for r in (Reassembler.from_config(cfg), Ipv6Reassembler.from_config(cfg)._r):
        assert (r.max_datagrams, r.max_fragments, r.max_bytes, r.timeout) == (8, 5, 9000, 2.5)


@pytest.mark.parametrize("field, value", [
    ("reassembly_max_datagrams", 0), ("reassembly_max_datagrams", "many"),
    ("reassembly_max_fragments", -1), ("reassembly_max_bytes", 0), ("reassembly_max_bytes", None),
    ("reassembly_timeout", 0), ("reassembly_timeout", "soon"),
])
def test_bad_reassembly_values_name_their_field(field, value):
    with pytest.raises(ConfigError) as err:
        NetworkConfig(**{field: value}).validate()
    assert err.value.field == field and "\n" not in str(err.value)


def test_limit_option_sets_the_reassembly_bounds():
    for name in ("reassembly_max_datagrams", "reassembly_max_fragments", "reassembly_max_bytes",
                 "reassembly_timeout"):
        assert name in LIMIT_FIELDS
    assert parse_limits(["reassembly_max_bytes=65536", "reassembly-timeout=3"]) == {
        "reassembly_max_bytes": 65536, "reassembly_timeout": 3.0}
    args = build_parser().parse_args(["run", "--limit", "reassembly_max_bytes=131072",
                                      "--limit", "reassembly_max_datagrams=16", "--", "true"])
    cfg = config_from_args(args)
    assert cfg.reassembly_max_bytes == 131072 and cfg.reassembly_max_datagrams == 16
    assert Stack(cfg).parts.reassembler.max_bytes == 131072


@pytest.mark.parametrize("value, words", [("0", "must be positive"), ("lots", "not a whole number")])
def test_bad_limit_value_is_one_line_naming_the_option_exit_2(value, words):
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--limit", f"reassembly_max_bytes={value}",
                        "--", "true"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--limit" in lines[0] and "reassembly_max_bytes" in lines[0], p.stderr
    assert words in lines[0]


# ---------------------------------------------------------------------------------- a whole Stack
def frags4(l4: bytes, proto: int, ident: int, dst: bytes = GW4, size: int = 1480) -> list[bytes]:
    """IPv4 fragments (Ethernet frames) of the upper-layer bytes ``l4``, ``size`` bytes each."""
    out = []
    for off in range(0, len(l4), size):
        chunk = l4[off:off + size]
        more = off + size < len(l4)
        ip = dpkt.ip.IP(src=GUEST4, dst=dst, p=proto, ttl=64, id=ident, mf=int(more), offset=off >> 3, data=chunk)
        ip.len = 20 + len(chunk)
        ip.sum = 0
        out.append(bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=GW_MAC, type=0x0800, data=ip)))
    return out


def udp4_l4(sport: int, dport: int, payload: bytes, dst: bytes = GW4) -> bytes:
    """UDP header and payload with the checksum dpkt computes over the IPv4 pseudo-header."""
    u = dpkt.udp.UDP(sport=sport, dport=dport, data=payload)
    u.ulen = 8 + len(payload)
    ip = dpkt.ip.IP(src=GUEST4, dst=dst, p=17, ttl=64, data=u)
    ip.len = 20 + len(bytes(u))
    return bytes(ip)[20:]


def echo4_l4(ident: int, payload: bytes) -> bytes:
    return bytes(dpkt.icmp.ICMP(type=8, data=dpkt.icmp.ICMP.Echo(id=ident, seq=1, data=payload)))


def reassemble4(frames, proto: int) -> list[bytes]:
    """The upper-layer bytes of every complete IPv4 datagram of ``proto`` among ``frames``."""
    parts: dict = {}
    for e in frames:
        if e.type == 0x0800 and e.data.p == proto:
            ip = e.data
            parts.setdefault(ip.id, []).append((ip.offset << 3, bool(ip.mf), bytes(ip.data)))
    out = []
    for pieces in parts.values():
        pieces.sort()
        data = b"".join(p[2] for p in pieces)
        if not pieces[-1][1] and sum(len(p[2]) for p in pieces) == len(data):
            out.append(data)
    return out


def udp6_l4(sport: int, dport: int, payload: bytes, src: bytes, dst: bytes) -> bytes:
    l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    s = ref_checksum6(src, dst, 17, l4)
    return l4[:6] + struct.pack("!H", (~s & 0xFFFF) or 0xFFFF) + l4[8:]


def frags6(l4: bytes, ident: int, dst: bytes = GW6, size: int = 1232, nh: int = 17) -> list[bytes]:
    out = []
    for off in range(0, len(l4), size):
        more = off + size < len(l4)
        pkt = raw6(GUEST6, dst, 44, struct.pack("!BxHI", nh, off | int(more), ident) + l4[off:off + size])
        out.append(GW_MAC + GUEST_MAC + b"\x86\xdd" + pkt)
    return out


def reassemble6(frames, nh: int) -> list[bytes]:
    """Upper-layer bytes of every IPv6 datagram of ``nh`` among ``frames`` (whole or fragmented)."""
    parts: dict = {}
    out = []
    for e in frames:
        if e.type != 0x86DD:
            continue
        raw = bytes(e.data)
        if raw[6] == nh:
            out.append(raw[40:40 + struct.unpack_from("!H", raw, 4)[0]])
        elif raw[6] == 44 and raw[40] == nh:
            offm, ident = struct.unpack_from("!HI", raw, 42)
            plen = struct.unpack_from("!H", raw, 4)[0]
            parts.setdefault(ident, []).append((offm & 0xFFF8, bool(offm & 1), raw[48:40 + plen]))
    for pieces in parts.values():
        pieces.sort()
        if not pieces[-1][1]:
            out.append(b"".join(p[2] for p in pieces))
    return out


async def serve(**cfg):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stack = Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], **cfg))
    await stack.__aenter__()
    task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
    await asyncio.sleep(0)
    return stack, GuestEnd(a), task


async def stop(stack, guest, task) -> None:
    stack.stop()
    await task
    await stack.__aexit__(None, None, None)
    guest.sock.close()


CAP = 65536
TIMEOUT = 1.0


async def test_fragment_flood_hits_the_byte_cap_then_traffic_gets_through_ipv4():
    echo = UdpEcho()
    stack, guest, task = await serve(ipv6=False, reassembly_max_bytes=CAP, reassembly_timeout=TIMEOUT)
    try:
        # The flood: 60 first fragments of 1,480 bytes each (fed straight to the stack so that the
        # whole burst lands within one timeout). 44 fit under 64 KiB (65,120 bytes), 16 do not.
        junk = os.urandom(1480)
        for ident in range(60):
            stack.process_guest_frame(frags4(junk + bytes(8), 17, 1000 + ident)[0])
        counters = stack.stats()["counters"]
        assert counters["drop.frag_memory_full"] == 16
        assert counters["ip_fragments"] == 60 and counters.get("drop.frag_evicted", 0) == 0
        assert stack.parts.reassembler.held == 44 * 1480 <= CAP

        # Unfragmented traffic is unaffected: a ping to the gateway is answered at once.
        guest.send(frags4(echo4_l4(7, b"small"), 1, 1)[0])
        icmp = [e.data.data for e in await guest.recv(1.0) if e.type == 0x0800 and e.data.p == 1]
        assert [(i.type, i.data.id, i.data.data) for i in icmp] == [(0, 7, b"small")]

        # A fragmented UDP datagram now: its two 1,480-byte fragments do not fit (dropped), the
        # 48-byte tail does (held), so nothing reaches the echo server.
        payload = os.urandom(3000)
        guest.send(*frags4(udp4_l4(40000, echo.port, payload), 17, 2))
        assert reassemble4(await guest.recv(0.5), 17) == []
        assert stack.counters["drop.frag_memory_full"] == 18 and echo.count == 0

        # After the reassembly timeout the flood's datagrams expire and the same traffic passes.
        await asyncio.sleep(TIMEOUT + 0.1)
        guest.send(*frags4(udp4_l4(40000, echo.port, payload), 17, 3))
        got = reassemble4(await guest.recv(2.0), 17)
        assert [hashlib.sha256(d[8:]).hexdigest() for d in got] == [hashlib.sha256(payload).hexdigest()]
        assert stack.counters["drop.frag_timeout"] == 45
        big = os.urandom(4000)
        guest.send(*frags4(echo4_l4(8, big), 1, 4))
        replies = reassemble4(await guest.recv(2.0), 1)
        assert len(replies) == 1 and replies[0][0] == 0 and replies[0][8:] == big
        counters = stack.stats()["counters"]
        assert counters["drop.frag_memory_full"] == 18 and counters["ip_reassembled"] == 2
        assert stack.parts.reassembler.held == 0 and counters.get("drop.internal_error", 0) == 0
    finally:
        await stop(stack, guest, task)
        echo.close()


async def test_fragment_flood_hits_the_byte_cap_then_traffic_gets_through_ipv6():
    echo = UdpEcho("::1")
    stack, guest, task = await serve(ipv6=True, reassembly_max_bytes=CAP, reassembly_timeout=TIMEOUT)
    try:
        await guest.recv(0.3)  # the first RA
        # Each first fragment holds 1,232 bytes plus its 40-byte IPv6 header: 51 x 1,272 = 64,872
        # fit under 64 KiB, the other 9 do not.
        junk = os.urandom(1232)
        for ident in range(60):
            stack.process_guest_frame(frags6(junk + bytes(8), 5000 + ident)[0])
        counters = stack.stats()["counters"]
        assert counters["drop.frag_memory_full"] == 9 and counters["ipv6_fragments"] == 60
        assert stack.parts.v6.reassembler.held == 51 * 1272 <= CAP
        # IPv4 has its own reassembler, untouched
        assert stack.parts.reassembler.held == 0

        # A fragmented UDP datagram during the flood: 1,272 and 1,232 do not fit, the 544-byte
        # tail does.
        payload = os.urandom(3000)
        l4 = udp6_l4(40000, echo.port, payload, GUEST6, GW6)
        guest.send(*frags6(l4, 77))
        assert reassemble6(await guest.recv(0.5), 17) == []
        assert stack.counters["drop.frag_memory_full"] == 11 and echo.count == 0

        await asyncio.sleep(TIMEOUT + 0.1)
        guest.send(*frags6(l4, 78))
        got = reassemble6(await guest.recv(2.0), 17)
        assert [hashlib.sha256(d[8:]).hexdigest() for d in got] == [hashlib.sha256(payload).hexdigest()]
        counters = stack.stats()["counters"]
        assert counters["drop.frag_timeout"] == 52 and counters["ipv6_reassembled"] == 1
        assert counters["drop.frag_memory_full"] == 11 and counters.get("drop.internal_error", 0) == 0
        assert stack.parts.v6.reassembler.held == 0
    finally:
        await stop(stack, guest, task)
        echo.close()


async def test_inject_queue_full_drops_and_counts_then_recovers():
    """``inject_queue_size`` frames at most wait for the guest; beyond, a frame is dropped and
    counted (``drop.inject_full``), and the queue serves again once the writer drained it."""
    stack, guest, task = await serve(ipv6=False, inject_queue_size=4)
    try:
        for seq in range(10):  # ten pings in one go: the writer gets no turn in between
            stack.process_guest_frame(frags4(echo4_l4(seq, b"q"), 1, 100 + seq)[0])
        assert stack.stats()["counters"]["drop.inject_full"] == 6
        assert stack.stats()["inject_queue"] == {"depth": 4, "size": 4}
        replies = [e.data.data for e in await guest.recv(1.0) if e.type == 0x0800 and e.data.p == 1]
        assert [r.data.id for r in replies] == [0, 1, 2, 3]
        guest.send(frags4(echo4_l4(99, b"later"), 1, 200)[0])
        replies = [e.data.data for e in await guest.recv(1.0) if e.type == 0x0800 and e.data.p == 1]
        assert [(r.data.id, r.data.data) for r in replies] == [(99, b"later")]
        assert stack.counters["drop.inject_full"] == 6
    finally:
        await stop(stack, guest, task)


# ---------------------------------------------------------------------------------- tcp_buffer
class LazyReader:
    """Accepts one connection, reads nothing for ``delay`` s, then reads to EOF and answers
    ``<bytes> <sha256>``. A small receive buffer, so the sender's buffers fill up quickly."""

    def __init__(self, delay: float) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.sock.settimeout(30)
        self.port = self.sock.getsockname()[1]
        self.delay = delay
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import time

        try:
            c, _ = self.sock.accept()
        except OSError:
            return
        with c:
            time.sleep(self.delay)
            h, n = hashlib.sha256(), 0
            while True:
                d = c.recv(1 << 20)
                if not d:
                    break
                h.update(d)
                n += len(d)
            c.sendall(f"{n} {h.hexdigest()}\n".encode())

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


async def sample_tcp_buffers(stacks: list, peaks: dict, period: float = 0.002) -> None:
    """Until cancelled: the largest ``send_buffered`` / ``recv_buffered`` (bytes) seen in any
    TCP flow of ``stacks[0]``, into ``peaks["send"]`` / ``peaks["recv"]``; ``peaks["samples"]``
    counts the samples that saw a TCP flow."""
    while True:
        await asyncio.sleep(period)
        if not stacks:
            continue
        conns = [f.conn for f in list(stacks[0].parts.flows.values()) if isinstance(f, TcpFlow)]
        if conns:
            peaks["samples"] += 1
        for c in conns:
            peaks["send"] = max(peaks["send"], c.send_buffered)
            peaks["recv"] = max(peaks["recv"], c.recv_buffered)


async def test_tcp_buffer_full_counts_host_read_and_write_pauses(monkeypatch):
    """A real guest with a small tcp_buffer: the guest reads late (host reads pause) and the host
    reads late (host writes pause); every byte arrives, checked by SHA-256 both ways. Sampled
    during the transfer, no flow holds more than tcp_buffer towards the host, nor more than
    tcp_buffer plus one host read (READ_SIZE) towards the guest (docs/security.md). The Python
    path's buffers (``AIOSLIRP_NATIVE=0``; the native engine holds no guest or host bytes: its bound
    is tests/system/test_native_tcp.py's)."""
    monkeypatch.setenv("AIOSLIRP_NATIVE", "0")
    data, lazy = DataServer(), LazyReader(delay=1.5)
    down, up = 4_000_000, 12_000_000
    try:
        script = textwrap.dedent(f"""
            import hashlib, random, socket, sys, time
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            s.settimeout(30)
            s.connect(("10.0.2.2", {data.port}))
            s.sendall(b"DOWN {down} 5\\n")
            time.sleep(1.0)  # read nothing for a while
            h, n = hashlib.sha256(), 0
            while True:
                d = s.recv(1 << 20)
                if not d: break
                h.update(d); n += len(d)
            s.close()
            assert n == {down} and h.hexdigest() == sys.argv[1], (n, h.hexdigest())
            blob = random.Random(6).randbytes({up})
            c = socket.create_connection(("10.0.2.2", {lazy.port}), timeout=30)
            c.sendall(blob)
            c.shutdown(socket.SHUT_WR)
            answer = b""
            while not answer.endswith(b"\\n"):
                d = c.recv(200)
                if not d: break
                answer += d
            assert answer.decode().split() == [str({up}), hashlib.sha256(blob).hexdigest()], answer
        """)
        cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], tcp_buffer=65536, ipv6=False)
        stacks = []

        def factory(c):
            stacks.append(Stack(c))
            return stacks[-1]

        want = hashlib.sha256(pattern(down, 5)).hexdigest()
        peaks = {"send": 0, "recv": 0, "samples": 0}
        sampler = asyncio.create_task(sample_tcp_buffers(stacks, peaks))
        try:
            rc = await asyncio.wait_for(
                run_in_namespace(cfg, [sys.executable, "-c", script, want], stack_factory=factory), 90)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        assert rc == 0
        counters = stacks[0].stats()["counters"]
        assert counters["tcp_host_read_paused"] >= 1
        assert counters["tcp_host_write_paused"] >= 1
        assert counters.get("drop.internal_error", 0) == 0
        # the guest and the lazy host each read nothing for >= 1 s: the buffers were full then
        assert peaks["samples"] >= 100, peaks
        assert cfg.tcp_buffer // 2 <= peaks["send"] <= cfg.tcp_buffer + READ_SIZE, peaks
        assert cfg.tcp_buffer // 2 <= peaks["recv"] <= cfg.tcp_buffer, peaks
        print(f"\ntcp_buffer=64KiB: host_read_paused={counters['tcp_host_read_paused']} "
              f"host_write_paused={counters['tcp_host_write_paused']} peak buffered {peaks}")
    finally:
        data.close()
        lazy.close()
