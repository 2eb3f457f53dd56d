"""Native UDP flows (aioslirp/nat/native_udp.py, the plane's UDP table) against the Python path.

The same guest frames and host datagrams go through a Stack served over a TAP-like transport
(a ``SOCK_SEQPACKET`` pair read by the native TAP reader) twice: with the UDP flows on the Python
path, and with ``AIOSLIRP_NATIVE=udp`` (admitted flows moved to the native plane). What reaches
the guest (every frame, byte for byte but the IPv4 identification and header checksum), what
reaches the host, the stack's counters and the flows' records must be the same; and in the
native run the flows' datagrams after the first must not have touched the Python path.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.nat.udp import UdpFlow
from aioslirp.transport.tap import TapTransport

from support.frames import F4, udp_frame
from support.native import need_extension

#: Counters that must agree between the two runs.
COUNTERS = ("frames_in", "bytes_in", "handled.udp", "frames_dropped", "drop.bad_udp_checksum", "udp_datagrams_down",
            "frames_out", "bytes_out", "flows.udp.opened", "flows.udp.closed", "icmp_errors_sent",
            "drop.udp_send_blocked")


class EchoServer:
    """A host UDP server on loopback: answers ``b"echo:" + datagram``, and ``b"big" * 1000`` to ``b"big"``."""

    def __init__(self, loop, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.got: list[bytes] = []
        self.loop = loop
        loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(65536)
            except BlockingIOError:
                return
            self.got.append(data)
            self.sock.sendto(b"big" * 1000 if data == b"big" else b"echo:" + data, addr)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


def _norm(frame: bytes) -> bytes:
    """A frame to the guest without what the two paths number differently: the IPv4
    identification and so the header checksum."""
    if len(frame) >= 34 and frame[12:14] == b"\x08\x00":
        return frame[:18] + b"\0\0" + frame[20:24] + b"\0\0" + frame[26:]
    return frame


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _scenario(mode: str, monkeypatch, port: int, closed_port: int) -> dict:
    """Run the script once; ``mode``: ``"python"`` or ``"native"`` (AIOSLIRP_NATIVE=udp); the echo
    server at ``port``, nothing at ``closed_port`` (the same in both runs)."""
    loop = asyncio.get_running_loop()
    if mode == "native":
        monkeypatch.setenv("AIOSLIRP_NATIVE", "udp")
    else:
        monkeypatch.setenv("AIOSLIRP_NATIVE", "0")  # the Python path
    sends = {"n": 0}
    original = UdpFlow.send

    def counting_send(self, payload, header, now):
        sends["n"] += 1
        return original(self, payload, header, now)

    monkeypatch.setattr(UdpFlow, "send", counting_send)
    server = EchoServer(loop, port)
    guest, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    guest.setblocking(False)
    received: list[bytes] = []
    stack = Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], mtu=1500, ipv6=False))
    async with stack:
        transport = TapTransport(ours.detach(), native=True)
        serve = asyncio.ensure_future(stack.serve(transport))

        async def exchange(frame: bytes, replies: int) -> None:
            guest.send(frame)
            want = len(received) + replies
            end = loop.time() + 5
            while len(received) < want:
                assert loop.time() < end, f"{mode}: {len(received)} of {want} frames"
                try:
                    received.append(guest.recv(70000))
                except BlockingIOError:
                    await asyncio.sleep(0.005)

        async def quiet() -> None:
            await asyncio.sleep(0.1)
            while True:
                try:
                    received.append(guest.recv(70000))
                except BlockingIOError:
                    return

        for i in range(6):  # a flow: its first datagram opens it, the rest move natively
            await exchange(udp_frame(F4, 40000, port, b"ping %d" % i), 1)
        await exchange(udp_frame(F4, 40001, port, b"other flow"), 1)
        await exchange(udp_frame(F4, 40001, port, b"big"), 3)  # 3000 bytes: three fragments at MTU 1500
        bad = bytearray(udp_frame(F4, 40000, port, b"bad checksum"))
        bad[40] ^= 0xFF  # the UDP checksum: the Python path drops it, counted
        guest.send(bytes(bad))
        await exchange(udp_frame(F4, 40000, port, b"after"), 1)
        await exchange(udp_frame(F4, 40002, closed_port, b"nobody 1"), 0)
        await asyncio.sleep(0.05)
        guest.send(udp_frame(F4, 40002, closed_port, b"nobody 2"))  # the ICMP port unreachable comes back
        await quiet()
        records = sorted((f.guest, f.destination, f.bytes_from_guest, f.bytes_to_guest) for f in stack.flows()
                         if f.protocol == "udp")
        counters = {k: stack.counters.get(k, 0) for k in COUNTERS}
        adopted = stack.counters.get("native.udp_flows_adopted", 0)
        stack.stop()
        await serve
    server.close()
    guest.close()
    return {"frames": [_norm(f) for f in received], "host": server.got, "counters": counters, "records": records,
            "python_sends": sends["n"], "adopted": adopted}


async def test_native_udp_flows_give_the_python_paths_bytes_and_counts(monkeypatch):
    need_extension()
    ports = _free_port(), _free_port()
    py = await _scenario("python", monkeypatch, *ports)
    nat = await _scenario("native", monkeypatch, *ports)
    assert nat["host"] == py["host"] == [b"ping %d" % i for i in range(6)] + [b"other flow", b"big", b"after"]
    assert nat["frames"] == py["frames"]
    assert len(py["frames"]) == 6 + 1 + 3 + 1 + 2  # the echoes, three fragments, an ICMP error per "nobody"
    assert [f[23] for f in py["frames"][-2:]] == [1, 1] and [f[34] for f in py["frames"][-2:]] == [3, 3]
    assert nat["counters"] == py["counters"]
    assert py["counters"]["drop.bad_udp_checksum"] == 1 and py["counters"]["icmp_errors_sent"] >= 1
    assert nat["records"] == py["records"]
    assert py["adopted"] == 0 and nat["adopted"] == 3
    # natively, only each flow's first datagram (and the one with a bad checksum) took the Python path
    assert py["python_sends"] == 11 and nat["python_sends"] == 3


@pytest.mark.parametrize("env", ["0", "tcp"])
async def test_without_the_udp_switch_no_flow_is_adopted(monkeypatch, env):
    need_extension()
    monkeypatch.setenv("AIOSLIRP_NATIVE", env)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a:
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
            serve = asyncio.ensure_future(stack.serve(TapTransport(b.detach(), native=True)))
            await asyncio.sleep(0.01)
            assert stack.parts.ctx.native_udp is None
            stack.stop()
            await serve


async def test_a_pcap_wrapper_keeps_the_flows_on_the_python_path_and_says_so(monkeypatch, caplog, tmp_path):
    """A transport wrapped for pcap (every frame seen by Python): neither native TCP nor native UDP
    flows, and one log line naming the cause (what docs/architecture.md promises)."""
    from aioslirp.transport.pcap import PcapTransport

    need_extension()
    monkeypatch.delenv("AIOSLIRP_NATIVE", raising=False)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, caplog.at_level("INFO", logger="aioslirp.native"):
        stack = Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)]))
        stack.transport_wrappers.append(lambda t: PcapTransport(t, str(tmp_path / "x.pcap")))
        async with stack:
            serve = asyncio.ensure_future(stack.serve(TapTransport(b.detach(), native=True)))
            await asyncio.sleep(0.01)
            assert stack.parts.ctx.native_udp is None and stack.parts.ctx.native_tcp is None
            stack.stop()
            await serve
    assert any("a transport wrapper (pcap) sees every frame" in r.getMessage() for r in caplog.records)
