"""``--pcap``: every frame both ways, readable by dpkt and tshark, bounded by --pcap-max-bytes."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import socket
import subprocess
import sys
import textwrap
import threading

import dpkt
import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.transport.pcap import PCAP_HEADER_LEN, PcapTransport

from support.frames import GUEST4, GW4
from support.paths import REPO
from support.servers import DataServer, pattern


def read_pcap(path) -> list:
    with open(path, "rb") as f:
        return [(ts, bytes(buf)) for ts, buf in dpkt.pcap.Reader(f)]


def tcp_segments(records, port: int) -> list:
    """``[(ts, ip, tcp)]`` of IPv4/TCP frames to or from host-side ``port`` via the gateway."""
    out = []
    for ts, buf in records:
        eth = dpkt.ethernet.Ethernet(buf)
        ip = eth.data
        if not isinstance(ip, dpkt.ip.IP) or not isinstance(ip.data, dpkt.tcp.TCP):
            continue
        if port in (ip.data.sport, ip.data.dport):
            out.append((ts, ip, ip.data))
    return out


def stream(segs, src: bytes, isn: int) -> bytes:
    """In-order payload sent by ``src``, reassembled by sequence number from ``isn`` (the SYN's seq)."""
    data = {}
    for _ts, ip, tcp in segs:
        if ip.src == src and tcp.data:
            data[(tcp.seq - isn - 1) & 0xFFFFFFFF] = bytes(tcp.data)
    out = bytearray()
    for off in sorted(data):
        chunk = data[off]
        if off <= len(out):
            out += chunk[len(out) - off:]
    return bytes(out)


@pytest.mark.netns
def test_pcap_of_a_namespace_run_has_handshake_and_payload(tmp_path):
    server = DataServer()
    cap = tmp_path / "run.pcap"
    n = 300_000
    script = textwrap.dedent(f"""
        import socket
        s = socket.create_connection(("10.0.2.2", {server.port}), timeout=20)
        s.sendall(b"DOWN {n} 5\\n")
        got = 0
        while True:
            d = s.recv(65536)
            if not d: break
            got += len(d)
        s.close()
        assert got == {n}, got
    """)
    try:
        p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--pcap", str(cap), "--",
                            sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        server.close()
    assert p.returncode == 0, p.stderr
    records = read_pcap(cap)
    segs = tcp_segments(records, server.port)
    syns = [(ip, t) for _ts, ip, t in segs if t.flags & dpkt.tcp.TH_SYN and not t.flags & dpkt.tcp.TH_ACK]
    (syn_ip, syn), = syns
    assert syn_ip.src == GUEST4 and syn_ip.dst == GW4 and syn.dport == server.port
    synacks = [(ip, t) for _ts, ip, t in segs if t.flags & dpkt.tcp.TH_SYN and t.flags & dpkt.tcp.TH_ACK]
    (sa_ip, synack), = synacks
    assert sa_ip.src == GW4 and sa_ip.dst == GUEST4 and synack.sport == server.port
    assert synack.ack == (syn.seq + 1) & 0xFFFFFFFF
    assert stream(segs, GUEST4, syn.seq) == f"DOWN {n} 5\n".encode()
    down = stream(segs, GW4, synack.seq)
    assert hashlib.sha256(down).hexdigest() == hashlib.sha256(pattern(n, 5)).hexdigest()
    fins = [ip.src for _ts, ip, t in segs if t.flags & dpkt.tcp.TH_FIN]
    assert GUEST4 in fins and GW4 in fins
    stamps = [ts for ts, _buf in records]
    assert stamps == sorted(stamps)
    # the link is Ethernet and frames are whole (guest frames included: ARP, DHCP or IPv6 too)
    assert all(len(buf) >= 42 for _ts, buf in records)

    tshark = shutil.which("tshark")
    if tshark is None:
        pytest.fail("tshark is required (apt-get install tshark; .ci/prereqs installs it)")
    t = subprocess.run([tshark, "-r", str(cap), "-T", "fields", "-e", "frame.number", "-e", "tcp.flags.syn",
                        "-e", "tcp.flags.ack", "-e", "tcp.srcport", "-e", "tcp.len"],
                       capture_output=True, text=True, timeout=120)
    assert t.returncode == 0, t.stderr
    rows = [line.split("\t") for line in t.stdout.splitlines()]
    assert len(rows) == len(records)
    tcp_rows = [r for r in rows if r[3] in (str(server.port), str(syn.sport))]
    assert len(tcp_rows) == len(segs)
    syn_rows = [r for r in tcp_rows if r[1] in ("1", "True")]
    assert len(syn_rows) == 2
    down_bytes = sum(int(r[4] or 0) for r in tcp_rows if r[3] == str(server.port))
    assert down_bytes >= n


@pytest.mark.netns
def test_pcap_max_bytes_bounds_the_file(tmp_path):
    server = DataServer()
    cap = tmp_path / "small.pcap"
    script = textwrap.dedent(f"""
        import socket
        s = socket.create_connection(("10.0.2.2", {server.port}), timeout=20)
        s.sendall(b"DOWN 200000 1\\n")
        got = 0
        while True:
            d = s.recv(65536)
            if not d: break
            got += len(d)
        assert got == 200000
    """)
    try:
        p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--pcap", str(cap), "--pcap-max-bytes", "20000",
                            "--", sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        server.close()
    assert p.returncode == 0, p.stderr
    size = cap.stat().st_size
    assert PCAP_HEADER_LEN < size <= 20000
    records = read_pcap(cap)
    assert records and PCAP_HEADER_LEN + sum(16 + len(b) for _t, b in records) == size
    assert "--pcap-max-bytes" in p.stderr  # said once in the log


async def test_pcap_wrapper_records_both_directions_and_flushes_on_close(tmp_path):
    cap = tmp_path / "pair.pcap"
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    guest_mac = bytes.fromhex("525400123456")
    arp = (b"\xff" * 6 + guest_mac + b"\x08\x06" + bytes.fromhex("0001080006040001") + guest_mac
           + GUEST4 + b"\x00" * 6 + GW4)
    threads_before = {t.name for t in threading.enumerate()}
    try:
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
            wrapped = []
            stack.transport_wrappers.append(lambda t: wrapped.append(PcapTransport(t, str(cap))) or wrapped[-1])
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            a.setblocking(False)
            loop = asyncio.get_running_loop()
            received = []  # every frame the stack sent: ARP replies, and e.g. IPv6 router advertisements
            for _ in range(3):
                a.send(arp)
                while True:
                    received.append(await asyncio.wait_for(loop.sock_recv(a, 70000), 5))
                    if received[-1][12:14] == b"\x08\x06":
                        break
            reply = received[-1]
            stack.stop()
            await task
            while True:  # what the stack sent while stopping: the final RA (RFC 4861 6.2.5)
                try:
                    last = a.recv(70000)
                except BlockingIOError:
                    break
                if not last:
                    break
                received.append(last)
    finally:
        a.close()
    (w,) = wrapped
    assert w.writer.captured == 3 + len(received) and w.writer.not_captured == 0
    frames = [buf for _ts, buf in read_pcap(cap)]
    assert sorted(frames) == sorted([arp] * 3 + received)
    arps = [f for f in frames if f[12:14] == b"\x08\x06"]
    assert arps == [arp, reply] * 3  # each request, then its reply, in order
    assert "aioslirp-pcap" not in {t.name for t in threading.enumerate()} - threads_before
    with open(cap, "rb") as f:
        magic, major, minor, _z, _s, snap, link = __import__("struct").unpack("<IHHiIII", f.read(24))
    assert (magic, major, minor, link) == (0xA1B2C3D4, 2, 4, 1) and snap >= 65535 + 14
