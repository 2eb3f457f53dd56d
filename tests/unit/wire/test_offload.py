"""Checksum/segmentation offload on the TAP (IFF_VNET_HDR) and the delayed ACK, against real peers.

* wire: :class:`TcpOffloadBuilder` frames, once their partial checksum is completed, equal the
  frames :func:`build_tcp` computes in full; the virtio-net header fields.
* stack: a frame the guest's kernel flagged (``csum_ok``) is not checksum-verified, an
  unflagged one still is.
* end to end (``aioslirp run``, the guest's Linux TCP behind our TAP): bulk both ways over IPv4
  and IPv6, SHA-256 checked, with offload (the capture shows frames above the MTU both ways:
  the guest's GSO segments and ours) and with ``--no-offload`` (no frame above the MTU); a
  guest with Nagle on (no TCP_NODELAY) doing two small writes per request is answered after our
  delayed ACK, never after a retransmission timeout (the guest's kernel retransmits nothing).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import subprocess
import sys
import textwrap
import threading

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.stack import Stack
from aioslirp.transport.base import Transport
from aioslirp.wire.checksum import partial
from aioslirp.wire.offload import (F_NEEDS_CSUM, GSO_NONE, GSO_TCPV4, GSO_TCPV6, VNET, OffloadFrame,
                                   complete_checksum)
from aioslirp.wire.tcp import TcpOffloadBuilder, build_tcp

from support.servers import DataServer, host_servers, pattern

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

ETH4 = b"\x52\x54\x00\x12\x34\x56" + b"\x52\x55\x0a\x00\x02\x02" + b"\x08\x00"
ETH6 = ETH4[:12] + b"\x86\xdd"
G4, R4 = bytes([10, 0, 2, 15]), bytes([10, 0, 2, 2])
G6, R6 = socket.inet_pton(socket.AF_INET6, "fd00::15"), socket.inet_pton(socket.AF_INET6, "fd00::2")


# ------------------------------------------------------------------------------------ wire


@pytest.mark.parametrize("plen", [0, 1, 1459, 1460, 1461, 65495])
def test_ipv4_offload_frame_completes_to_the_full_checksum_frame(plen):
    payload = pattern(plen, plen)
    b = TcpOffloadBuilder(ETH4, R4, G4, 8080, 40000)
    f = b.build(0xFFFFFF00, 7, 0x18, 1000, b"", payload, 1460)
    assert isinstance(f, OffloadFrame)
    full = build_tcp(ETH4, R4, G4, 8080, 40000, 0xFFFFFF00, 7, 0x18, 1000, b"", payload)
    done = complete_checksum(f)
    # the IPv4 identification differs (a counter); everything else, checksums included, is equal
    assert done[:18] == full[:18] and done[20:24] == full[20:24] and done[34:] == full[34:]
    assert partial(done[14:34]) == 0  # a valid IPv4 header checksum
    flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, _nb = VNET.unpack(f.vnet)
    assert (flags, csum_start, csum_offset, hdr_len) == (F_NEEDS_CSUM, 34, 16, 54)
    if plen > 1460:
        assert (gso_type, gso_size) == (GSO_TCPV4, 1460)
    else:
        assert (gso_type, gso_size) == (GSO_NONE, 0)


@pytest.mark.parametrize("plen", [0, 100, 5000])
def test_ipv6_offload_frame_completes_to_the_full_checksum_frame(plen):
    payload = pattern(plen, 3)
    opts = b"\x02\x04\x05\x8c\x01\x03\x03\x07"  # MSS 1420, window scale 7 (as on a SYN-ACK)
    f = TcpOffloadBuilder(ETH6, R6, G6, 443, 50000).build(1, 2, 0x12, 65535, opts, payload, 1420)
    full = build_tcp(ETH6, R6, G6, 443, 50000, 1, 2, 0x12, 65535, opts, payload)
    assert complete_checksum(f) == full
    flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, _nb = VNET.unpack(f.vnet)
    assert (flags, csum_start, csum_offset, hdr_len) == (F_NEEDS_CSUM, 54, 16, 54 + 28)
    assert (gso_type, gso_size) == ((GSO_TCPV6, 1420) if plen > 1420 else (GSO_NONE, 0))


# ------------------------------------------------------------------------------------ stack


class _NullTransport(Transport):
    async def _start_reading(self) -> None:
        pass

    def send_frames(self, frames) -> None:
        self.frames_out += len(frames)

    def _close_io(self) -> None:
        pass


def _guest_tcp_ack(bad_csum: bool) -> bytes:
    frame = bytearray(build_tcp(ETH4[6:12] + ETH4[:6] + ETH4[12:], G4, R4, 40000, 8080, 5, 6, 0x10, 100))
    if bad_csum:
        frame[50] ^= 0x55
    return bytes(frame)


def test_stack_trusts_only_flagged_frames():
    async def main():
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
            tr = _NullTransport()
            task = asyncio.ensure_future(stack.serve(tr))
            await asyncio.sleep(0)
            stack.parts.link.on_frames([_guest_tcp_ack(True)], [False])
            assert stack.counters["drop.bad_tcp_checksum"] == 1
            # flagged by the guest's kernel (NEEDS_CSUM): not verified, so it reaches TCP (no flow: RST)
            stack.parts.link.on_frames([memoryview(_guest_tcp_ack(True))], [True])
            assert stack.counters["drop.bad_tcp_checksum"] == 1
            assert stack.counters["drop.tcp_no_flow"] == 1 and stack.counters["tcp_rst_sent"] == 1
            stack.parts.link.on_frames([_guest_tcp_ack(True)])  # a transport without flags: verified
            assert stack.counters["drop.bad_tcp_checksum"] == 2
            stack.stop()
            await task

    asyncio.run(main())


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def servers():
    with host_servers() as s:
        data6 = DataServer(host="::1")
        yield {**s, "data6": data6}
        data6.close()


def _run(servers, script: str, *opts: str, timeout: float = 120) -> dict:
    argv = [sys.executable, "-m", "aioslirp", "run", "--dns", f"127.0.0.1:{servers['dns'].port}", *opts, "--",
            sys.executable, "-c", textwrap.dedent(script)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout={p.stdout}\nstderr={p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


BULK = """
import socket, hashlib, json, random
addr = ({host!r}, {port})
s = socket.create_connection(addr, timeout=60)
s.sendall(b"DOWN {n} 5\\n")
h = hashlib.sha256(); got = 0
while True:
    d = s.recv(1 << 20)
    if not d: break
    h.update(d); got += len(d)
s.close()
data = random.Random(6).randbytes({n})
s = socket.create_connection(addr, timeout=60)
s.sendall(b"UP\\n" + data)
s.shutdown(socket.SHUT_WR)
reply = b""
while True:
    d = s.recv(4096)
    if not d: break
    reply += d
print(json.dumps({{"down": h.hexdigest(), "down_n": got, "up": reply.decode().strip()}}))
"""


def _frame_sizes(path) -> tuple[int, int]:
    """Largest guest->host and host->guest frame in a capture, bytes."""
    up = down = 0
    with open(path, "rb") as f:
        for _ts, buf in dpkt.pcap.Reader(f):
            if buf[12:14] == b"\x08\x00":
                src = buf[26:30]
                guest = src == G4
            elif buf[12:14] == b"\x86\xdd":
                guest = buf[22:38] != R6  # frames from the gateway fd00::2 are ours
            else:
                continue
            if guest:
                up = max(up, len(buf))
            else:
                down = max(down, len(buf))
    return up, down


@pytest.mark.netns
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "no-offload"])
def test_bulk_both_ways(servers, tmp_path, family, offload):
    n = 8 * 1024 * 1024
    host, port = ("10.0.2.2", servers["data"].port) if family == "ipv4" else ("fd00::2", servers["data6"].port)
    pcap = tmp_path / "bulk.pcap"
    opts = ["--pcap", str(pcap)] + ([] if offload else ["--no-offload"])
    res = _run(servers, BULK.format(host=host, port=port, n=n), *opts)
    assert res["down_n"] == n
    assert res["down"] == hashlib.sha256(pattern(n, 5)).hexdigest()
    assert res["up"] == f"{n} {hashlib.sha256(pattern(n, 6)).hexdigest()}"  # UP answers "<bytes> <sha256>"
    up, down = _frame_sizes(pcap)
    if offload:
        # the guest's kernel sent GSO super-segments, and ours were cut by the kernel
        assert up > 1514 and down > 1514, (up, down)
    else:
        assert up <= 1514 and down <= 1514, (up, down)


NAGLE = """
import socket, json, struct, time
s = socket.create_connection(("10.0.2.2", {port}), timeout=10)
assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # Nagle on
times = []
for i in range({rounds}):
    t = time.monotonic()
    s.send(b"a")
    s.send(b"b")  # held by Nagle until our ACK of "a" arrives
    assert s.recv(1) == b"!"
    times.append(time.monotonic() - t)
# struct tcp_info (linux/tcp.h): 8 one-byte fields, then 32-bit ones; tcpi_total_retrans is the 24th
total_retrans = struct.unpack_from("8B24I", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104))[-1]
s.close()
print(json.dumps({{"times": times, "total_retrans": total_retrans}}))
"""


class _PairServer:
    """Reads two bytes, answers one, until EOF (the request needs both of the guest's writes)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            buf = b""
            while True:
                d = conn.recv(16)
                if not d:
                    return
                buf += d
                while len(buf) >= 2:
                    assert buf[:2] == b"ab"
                    buf = buf[2:]
                    self.requests += 1
                    conn.sendall(b"!")

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.mark.netns
def test_nagle_guest_is_not_held_beyond_the_ack_delay(servers):
    srv = _PairServer()
    rounds = 30
    try:
        res = _run(servers, NAGLE.format(port=srv.port, rounds=rounds))
    finally:
        srv.close()
    assert srv.requests == rounds and len(res["times"]) == rounds
    # Each request waits for our delayed ACK of its first byte (1 ms by default). An ACK that
    # never comes, or comes after the guest's retransmission timeout (at least 200 ms), makes the
    # guest's kernel retransmit "a": counted in its tcpi_total_retrans (causality, not a clock).
    assert res["total_retrans"] == 0, res
    print(f"request times (s), sorted: {sorted(res['times'])}")
