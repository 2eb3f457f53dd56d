"""End to end: `aioslirp run` puts a real process (Linux kernel TCP/IP) in a new namespace
behind our TAP; real servers listen on host loopback; results are asserted by value.

pytest itself runs in a loopback-only namespace (conftest.py), so nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dpkt
import pytest

from hostservers import DataServer, DnsUpstream, UdpEcho, pattern

pytestmark = pytest.mark.netns

GUEST_PY = sys.executable


@pytest.fixture(scope="module")
def servers():
    data = DataServer()
    udp = UdpEcho()
    dns = DnsUpstream()
    yield {"data": data, "udp": udp, "dns": dns}
    data.close()
    udp.close()
    dns.close()


def run_guest(servers, script: str, *opts: str, timeout: float = 120, cmd: list | None = None):
    """Run ``script`` (python) — or ``cmd`` — inside `aioslirp run`; returns CompletedProcess."""
    argv = [sys.executable, "-m", "aioslirp", "run", "--dns", f"127.0.0.1:{servers['dns'].port}", *opts, "--"]
    argv += cmd if cmd is not None else [GUEST_PY, "-c", textwrap.dedent(script)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def guest_json(servers, script: str, *opts: str, timeout: float = 120) -> dict:
    p = run_guest(servers, script, *opts, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout={p.stdout}\nstderr={p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_http_get_with_curl(servers):
    if not shutil.which("curl"):
        pytest.fail("curl is required (apt-get install curl)")
    port = servers["data"].port
    p = run_guest(servers, "", cmd=["sh", "-c", f"curl -sS --max-time 20 http://10.0.2.2:{port}/100000 | sha256sum"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[0] == hashlib.sha256(pattern(100000, 1)).hexdigest()


def test_download_and_upload_50mb(servers):
    port = servers["data"].port
    n = 50 * 1024 * 1024
    script = f"""
    import socket, hashlib, json, time
    s = socket.create_connection(("10.0.2.2", {port}), timeout=60)
    s.sendall(b"DOWN {n} 7\\n")
    h = hashlib.sha256(); got = 0; t0 = time.monotonic()
    while True:
        d = s.recv(1 << 20)
        if not d: break
        h.update(d); got += len(d)
    down_s = time.monotonic() - t0
    s.close()
    import random
    data = random.Random(9).randbytes({n})
    s = socket.create_connection(("10.0.2.2", {port}), timeout=60)
    t0 = time.monotonic()
    s.sendall(b"UP\\n" + data)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = s.recv(4096)
        if not d: break
        reply += d
    up_s = time.monotonic() - t0
    print(json.dumps({{"got": got, "sha": h.hexdigest(), "reply": reply.decode(), "down_s": down_s, "up_s": up_s}}))
    """
    r = guest_json(servers, script)
    assert r["got"] == n
    assert r["sha"] == hashlib.sha256(pattern(n, 7)).hexdigest()
    count, sha = r["reply"].split()
    assert int(count) == n
    assert sha == hashlib.sha256(pattern(n, 9)).hexdigest()
    print(f"download {n / r['down_s'] / 1e6:.1f} MB/s, upload {n / r['up_s'] / 1e6:.1f} MB/s")


def test_upload_to_slow_reader_loses_nothing(servers):
    port = servers["data"].port
    n = 4 * 1024 * 1024
    script = f"""
    import socket, json, random
    data = random.Random(3).randbytes({n})
    s = socket.create_connection(("10.0.2.2", {port}), timeout=60)
    s.sendall(b"SLOWUP\\n" + data)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = s.recv(4096)
        if not d: break
        reply += d
    print(json.dumps({{"reply": reply.decode()}}))
    """
    r = guest_json(servers, script)
    count, sha = r["reply"].split()
    assert int(count) == n and sha == hashlib.sha256(pattern(n, 3)).hexdigest()


def test_half_close_guest_then_read_and_host_closes_first(servers):
    port = servers["data"].port
    script = f"""
    import socket, json, hashlib
    # guest half-closes, then reads the full response
    s = socket.create_connection(("10.0.2.2", {port}), timeout=30)
    s.sendall(b"UP\\nhello")
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = s.recv(4096)
        if not d: break
        reply += d
    s.close()
    # host sends 3 MB and closes at once, before the guest has read anything
    s = socket.create_connection(("10.0.2.2", {port}), timeout=30)
    s.sendall(b"DOWN 3000000 5\\n")
    import time; time.sleep(0.5)
    h = hashlib.sha256(); got = 0
    while True:
        d = s.recv(65536)
        if not d: break
        h.update(d); got += len(d)
    print(json.dumps({{"reply": reply.decode(), "got": got, "sha": h.hexdigest()}}))
    """
    r = guest_json(servers, script)
    assert r["reply"] == f"5 {hashlib.sha256(b'hello').hexdigest()}\n"
    assert r["got"] == 3000000 and r["sha"] == hashlib.sha256(pattern(3000000, 5)).hexdigest()


def test_sequential_and_concurrent_connections(servers):
    port = servers["data"].port
    script = f"""
    import socket, json, threading, hashlib
    ok = 0
    for i in range(200):
        s = socket.create_connection(("10.0.2.2", {port}), timeout=30)
        s.sendall(b"DOWN 1000 %d\\n" % i)
        buf = b""
        while True:
            d = s.recv(4096)
            if not d: break
            buf += d
        s.close()
        ok += len(buf) == 1000
    results = []
    def worker(i):
        s = socket.create_connection(("10.0.2.2", {port}), timeout=30)
        s.sendall(b"DOWN 200000 %d\\n" % i)
        h = hashlib.sha256()
        while True:
            d = s.recv(65536)
            if not d: break
            h.update(d)
        s.close()
        results.append((i, h.hexdigest()))
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(50)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print(json.dumps({{"seq_ok": ok, "conc": results}}))
    """
    r = guest_json(servers, script)
    assert r["seq_ok"] == 200
    assert len(r["conc"]) == 50
    for i, sha in r["conc"]:
        assert sha == hashlib.sha256(pattern(200000, i)).hexdigest()


def test_closed_port_refused_fast(servers):
    import socket as _s
    probe = _s.socket()
    probe.bind(("127.0.0.1", 0))
    closed_port = probe.getsockname()[1]
    probe.close()
    script = f"""
    import socket, json, time
    t0 = time.monotonic()
    try:
        socket.create_connection(("10.0.2.2", {closed_port}), timeout=10)
        err = "connected"
    except ConnectionRefusedError:
        err = "ECONNREFUSED"
    except Exception as e:
        err = repr(e)
    print(json.dumps({{"err": err, "t": time.monotonic() - t0}}))
    """
    r = guest_json(servers, script)
    assert r["err"] == "ECONNREFUSED"  # an RST: a lost SYN would end in a timeout error instead


def test_dns_udp_and_tcp_via_dig(servers):
    if not shutil.which("dig"):
        pytest.fail("dig is required (apt-get install dnsutils)")
    before_udp = servers["dns"].udp_queries
    p = run_guest(servers, "", cmd=["sh", "-c",
                                    "dig +short +time=3 +tries=1 @10.0.2.3 example.test A && "
                                    "dig +short +tcp +time=3 +tries=1 @10.0.2.3 other.test A && "
                                    "cat /etc/resolv.conf"])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.split("\n")
    assert lines[0] == "10.0.2.99" and lines[1] == "10.0.2.99"
    assert "nameserver 10.0.2.3" in p.stdout
    # the TCP query reached 10.0.2.3:53 over TCP and was forwarded (over UDP, no truncation)
    assert servers["dns"].udp_queries >= before_udp + 2


def test_udp_echo_small_and_fragmented(servers):
    port = servers["udp"].port
    script = f"""
    import socket, json, random
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.connect(("10.0.2.2", {port}))
    out = {{}}
    for n in (1, 60000):
        data = random.Random(n).randbytes(n)
        s.send(data)
        got = s.recv(65535)
        out[str(n)] = got == data
    print(json.dumps(out))
    """
    r = guest_json(servers, script)
    assert r == {"1": True, "60000": True}


def test_ping_gateway(servers):
    if not shutil.which("ping"):
        pytest.fail("ping is required (apt-get install iputils-ping)")
    p = run_guest(servers, "", cmd=["ping", "-c", "2", "-W", "2", "10.0.2.2"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 received" in p.stdout


def test_disable_host_loopback_blocks_gateway(servers):
    port = servers["data"].port
    script = f"""
    import socket, json
    try:
        socket.create_connection(("10.0.2.2", {port}), timeout=5)
        r = "connected"
    except ConnectionRefusedError:
        r = "refused"
    except Exception as e:
        r = repr(e)
    print(json.dumps({{"r": r}}))
    """
    before = len(servers["data"].commands)
    r = guest_json(servers, script, "--disable-host-loopback")
    assert r["r"] == "refused"
    assert len(servers["data"].commands) == before


def test_rst_both_ways(servers):
    port = servers["data"].port
    before = len(servers["data"].events)
    script = f"""
    import socket, json, struct, time
    out = {{}}
    s = socket.create_connection(("10.0.2.2", {port}), timeout=10)
    s.sendall(b"RSTME\\n")
    try:
        d = s.recv(100)
        out["host_rst"] = "eof" if d == b"" else "data"
    except ConnectionResetError:
        out["host_rst"] = "reset"
    s = socket.create_connection(("10.0.2.2", {port}), timeout=10)
    s.sendall(b"WAIT\\n")
    time.sleep(0.2)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    time.sleep(0.3)
    print(json.dumps(out))
    """
    r = guest_json(servers, script)
    assert r["host_rst"] == "reset"
    deadline = time.monotonic() + 5
    while len(servers["data"].events) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers["data"].events[before:] == ["reset"]


def test_udp_to_closed_port_gets_port_unreachable(servers):
    import socket as _s
    probe = _s.socket(_s.AF_INET, _s.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    closed = probe.getsockname()[1]
    probe.close()
    script = f"""
    import socket, json
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.connect(("10.0.2.2", {closed}))
    s.send(b"hello")
    try:
        s.recv(100)
        r = "data"
    except ConnectionRefusedError:
        r = "refused"
    except socket.timeout:
        r = "timeout"
    print(json.dumps({{"r": r}}))
    """
    assert guest_json(servers, script)["r"] == "refused"


def test_unreachable_network_fails_fast(servers):
    # pytest's namespace has only loopback: the host connect() fails at once with
    # ENETUNREACH and nothing is sent anywhere. The guest must get ICMP unreachable.
    routes = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True).stdout
    assert routes.strip() == "", "test must run in the loopback-only namespace"
    script = """
    import socket, json, time, errno
    t0 = time.monotonic()
    try:
        socket.create_connection(("192.0.2.1", 80), timeout=10)
        r = "connected"
    except OSError as e:
        r = errno.errorcode.get(e.errno, repr(e))
    print(json.dumps({"r": r, "t": time.monotonic() - t0}))
    """
    r = guest_json(servers, script)
    assert r["r"] in ("ENETUNREACH", "EHOSTUNREACH")  # an ICMP error: no answer would be a timeout


#: Guest-side snippet: ``link_mtu(sock)``, the MTU of tap0 (SIOCGIFMTU; /sys is the host's here).
LINK_MTU = """
import fcntl, struct
def link_mtu(sock):
    return struct.unpack_from("16si", fcntl.ioctl(sock.fileno(), 0x8921, struct.pack("16si", b"tap0", 0)))[1]
"""


def handshake_mss(pcap: Path, port: int) -> tuple[int | None, int | None]:
    """MSS options (RFC 9293 section 3.7.1) in a ``--pcap`` capture: ``(guest's SYN to port,
    our SYN-ACK from port)``, ``None`` for a missing one (the first handshake on ``port``)."""
    syn = synack = None
    with open(pcap, "rb") as f:
        for _ts, buf in dpkt.pcap.Reader(f):
            ip = dpkt.ethernet.Ethernet(buf).data
            tcp = getattr(ip, "data", None)
            if not isinstance(tcp, dpkt.tcp.TCP) or not tcp.flags & dpkt.tcp.TH_SYN:
                continue
            mss = next((struct.unpack("!H", v)[0] for o, v in dpkt.tcp.parse_opts(tcp.opts) if o == dpkt.tcp.TCP_OPT_MSS), None)
            if tcp.dport == port and not tcp.flags & dpkt.tcp.TH_ACK and syn is None:
                syn = mss
            elif tcp.sport == port and tcp.flags & dpkt.tcp.TH_ACK and synack is None:
                synack = mss
    return syn, synack


def test_mtu_65520_transfer(servers, tmp_path):
    """With ``--mtu 65520`` the guest's link has that MTU and both SYNs carry MSS 65480
    (MTU - 40, RFC 9293 3.7.1); 20 MB arrive intact."""
    port = servers["data"].port
    n = 20 * 1024 * 1024
    script = LINK_MTU + textwrap.dedent(f"""
    import socket, hashlib, json
    s = socket.create_connection(("10.0.2.2", {port}), timeout=30)
    s.sendall(b"DOWN {n} 11\\n")
    h = hashlib.sha256(); got = 0
    while True:
        d = s.recv(1 << 20)
        if not d: break
        h.update(d); got += len(d)
    print(json.dumps({{"got": got, "sha": h.hexdigest(), "mtu": link_mtu(s),
                       "mss": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)}}))
    """)
    pcap = tmp_path / "mtu.pcap"
    r = guest_json(servers, script, "--mtu", "65520", "--pcap", str(pcap), "--pcap-max-bytes", "1M")
    assert r["got"] == n and r["sha"] == hashlib.sha256(pattern(n, 11)).hexdigest()
    assert r["mtu"] == 65520
    assert handshake_mss(pcap, port) == (65480, 65480)
    assert 65480 - 40 <= r["mss"] <= 65480  # the guest's send MSS: ours, less any TCP options


# A "remote" host that is not the gateway: an address assigned to lo in pytest's
# loopback-only namespace (TEST-NET-1, RFC 5737). Packets to it never leave this namespace.
REMOTE = "192.0.2.55"


@pytest.fixture(scope="module")
def remote_addr():
    subprocess.run(["ip", "addr", "add", f"{REMOTE}/32", "dev", "lo"], check=True)
    yield REMOTE
    subprocess.run(["ip", "addr", "del", f"{REMOTE}/32", "dev", "lo"], check=False)


def test_nat_to_non_gateway_address_tcp_and_ping(servers, remote_addr):
    if not shutil.which("ping"):
        pytest.fail("ping is required (apt-get install iputils-ping)")
    srv = DataServer(host=remote_addr)
    try:
        script = f"""
        import socket, hashlib, json, subprocess
        s = socket.create_connection(("{remote_addr}", {srv.port}), timeout=20)
        s.sendall(b"DOWN 2000000 21\\n")
        h = hashlib.sha256(); got = 0
        while True:
            d = s.recv(65536)
            if not d: break
            h.update(d); got += len(d)
        p = subprocess.run(["ping", "-c", "2", "-W", "2", "{remote_addr}"], capture_output=True, text=True)
        print(json.dumps({{"got": got, "sha": h.hexdigest(), "ping_rc": p.returncode, "ping": p.stdout}}))
        """
        r = guest_json(servers, script)
    finally:
        srv.close()
    assert r["got"] == 2000000 and r["sha"] == hashlib.sha256(pattern(2000000, 21)).hexdigest()
    assert r["ping_rc"] == 0 and "2 received" in r["ping"], r["ping"]
