"""End to end, for IPv4 and for IPv6: `aioslirp run` puts a real process (Linux kernel TCP/IP)
in a new namespace behind our TAP; real servers listen on host loopback (127.0.0.1 or ``::1``,
reached through the gateway 10.0.2.2 or fd00::2); results are asserted by value.

Each test takes ``fam`` (tests/support/guests.py: the family's addresses as text, its tool
flags, what the kernel reports for our ICMP errors). Tests for one family only say why.
pytest itself runs in a loopback-only namespace (conftest.py), so nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.frontends.netns import run_in_namespace

from support.frames import DNS_A, DNS_AAAA
from support.guests import GUEST_FAMILIES, LINK_MTU, guest_json, handshake_mss, need_tool, run_guest
from support.native import need_extension
from support.servers import DataServer, DnsUpstream, UdpEcho, free_port, host_servers, pattern
from support.stacks import fd_count, stack_tasks

pytestmark = pytest.mark.netns

ROUTER_LL = "fe80::5055:aff:fe00:202"  # modified EUI-64 of the gateway MAC 52:55:0a:00:02:02
ANSWER = {"A": DNS_A, "AAAA": DNS_AAAA}  # what DnsUpstream(aaaa=DNS_AAAA) answers
IPV6_ONLY = pytest.mark.parametrize("fam", ["ipv6"], indirect=True)


@pytest.fixture(scope="module", autouse=True, params=["python", "native"])
def plane(request):
    """Every test runs on the Python data path and again on the native data plane
    (``AIOSLIRP_NATIVE=1``: the TAP read in C, guest TCP NAT flows in aioslirp/native/tcpnat.c;
    tests/system/test_native_tcp.py checks that they do run there)."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "native":
            need_extension()
            mp.setenv("AIOSLIRP_NATIVE", "1")
        else:
            mp.setenv("AIOSLIRP_NATIVE", "0")  # the Python path
        yield request.param


@pytest.fixture(scope="module", params=list(GUEST_FAMILIES))
def fam(request, plane):
    return GUEST_FAMILIES[request.param]


@pytest.fixture(scope="module")
def servers(fam):
    with host_servers(fam.loopback, aaaa=DNS_AAAA) as s:
        yield s


def test_http_get_with_curl(servers, fam):
    need_tool("curl", "curl")
    port = servers["data"].port
    p = run_guest(servers, "", cmd=["sh", "-c",
                                    f"curl -sS -g --max-time 20 http://{fam.url_host}:{port}/100000 | sha256sum"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[0] == hashlib.sha256(pattern(100000, 1)).hexdigest()


def test_bulk_download_and_upload(servers, fam, request):
    """``fam.bulk_mb`` MiB each way (50 over IPv4, 20 over IPv6), bytes checked by SHA-256."""
    port = servers["data"].port
    n = fam.bulk_mb * 1024 * 1024
    script = f"""
    import socket, hashlib, json, time, random
    s = socket.create_connection(("{fam.gw}", {port}), timeout=60)
    assert s.family == socket.{fam.af}
    s.sendall(b"DOWN {n} 7\\n")
    h = hashlib.sha256(); got = 0; t0 = time.monotonic()
    while True:
        d = s.recv(1 << 20)
        if not d: break
        h.update(d); got += len(d)
    down_s = time.monotonic() - t0
    s.close()
    data = random.Random(9).randbytes({n})
    s = socket.create_connection(("{fam.gw}", {port}), timeout=60)
    t0 = time.monotonic()
    s.sendall(b"UP\\n" + data)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = s.recv(4096)
        if not d: break
        reply += d
    up_s = time.monotonic() - t0
    print(json.dumps({{"got": got, "sha": h.hexdigest(), "reply": reply.decode(), "down_s": down_s,
                       "up_s": up_s}}))
    """
    r = guest_json(servers, script)
    assert r["got"] == n
    assert r["sha"] == hashlib.sha256(pattern(n, 7)).hexdigest()
    count, sha = r["reply"].split()
    assert int(count) == n
    assert sha == hashlib.sha256(pattern(n, 9)).hexdigest()
    down = n * 8 / r["down_s"] / 1e6
    up = n * 8 / r["up_s"] / 1e6
    request.node.user_properties += [(f"{fam.name}_download_Mbit_s", round(down)),
                                     (f"{fam.name}_upload_Mbit_s", round(up))]
    print(f"{fam.name} download {down:.0f} Mbit/s, upload {up:.0f} Mbit/s")


def test_upload_to_slow_reader_loses_nothing(servers, fam):
    port = servers["data"].port
    n = 4 * 1024 * 1024
    script = f"""
    import socket, json, random
    data = random.Random(3).randbytes({n})
    s = socket.create_connection(("{fam.gw}", {port}), timeout=60)
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


def test_half_close_guest_then_read_and_host_closes_first(servers, fam):
    port = servers["data"].port
    script = f"""
    import socket, json, hashlib
    # guest half-closes, then reads the full response
    s = socket.create_connection(("{fam.gw}", {port}), timeout=30)
    s.sendall(b"UP\\nhello")
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        d = s.recv(4096)
        if not d: break
        reply += d
    s.close()
    # host sends 3 MB and closes at once, before the guest has read anything
    s = socket.create_connection(("{fam.gw}", {port}), timeout=30)
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


def test_sequential_and_concurrent_connections(servers, fam):
    port = servers["data"].port
    script = f"""
    import socket, json, threading, hashlib
    ok = 0
    for i in range(200):
        s = socket.create_connection(("{fam.gw}", {port}), timeout=30)
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
        s = socket.create_connection(("{fam.gw}", {port}), timeout=30)
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


def test_closed_port_refused_fast(servers, fam):
    script = f"""
    import socket, json
    try:
        socket.create_connection(("{fam.gw}", {free_port(socket.SOCK_STREAM, fam.loopback)}), timeout=10)
        err = "connected"
    except ConnectionRefusedError:
        err = "ECONNREFUSED"
    except Exception as e:
        err = repr(e)
    print(json.dumps({{"err": err}}))
    """
    r = guest_json(servers, script)
    assert r["err"] == "ECONNREFUSED"  # an RST: a lost SYN would end in a timeout error instead


def test_dns_udp_and_tcp_via_dig(servers, fam):
    """dig over the family's transport: its own record type over UDP and TCP, the other
    family's over UDP; the TCP query is forwarded over UDP (no truncation)."""
    need_tool("dig", "bind9-dnsutils")
    other = "A" if fam.dns_qtype == "AAAA" else "AAAA"
    dig = f"dig +short +time=3 +tries=1 {fam.flag} @{fam.dns}"
    before_udp, before_tcp = servers["dns"].udp_queries, servers["dns"].tcp_queries
    p = run_guest(servers, "", cmd=["sh", "-c", f"{dig} www.example.test {fam.dns_qtype} && "
                                                f"{dig} +tcp other.example.test {fam.dns_qtype} && "
                                                f"{dig} www.example.test {other} && cat /etc/resolv.conf"])
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.split("\n")
    assert lines[:3] == [ANSWER[fam.dns_qtype], ANSWER[fam.dns_qtype], ANSWER[other]]
    assert f"nameserver {fam.dns}" in p.stdout
    # all three reached the upstream on 127.0.0.1 over UDP
    assert servers["dns"].udp_queries >= before_udp + 3
    assert servers["dns"].tcp_queries == before_tcp


def test_udp_echo_small_and_fragmented(servers, fam):
    port = servers["udp"].port
    script = f"""
    import socket, json, random
    s = socket.socket(socket.{fam.af}, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.connect(("{fam.gw}", {port}))
    out = {{}}
    for n in (1, 1400, 60000):
        data = random.Random(n).randbytes(n)
        s.send(data)
        got = s.recv(65535)
        out[str(n)] = got == data
    print(json.dumps(out))
    """
    assert guest_json(servers, script) == {"1": True, "1400": True, "60000": True}


def test_ping_gateway_and_dns(servers, fam):
    need_tool("ping", "iputils-ping")
    p = run_guest(servers, "", cmd=["sh", "-c", f"ping {fam.flag} -c 2 -W 2 {fam.gw} && "
                                                f"ping {fam.flag} -c 1 -W 2 -s 1400 {fam.dns}"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 packets transmitted, 2 received" in p.stdout
    assert "1 packets transmitted, 1 received" in p.stdout


def test_disable_host_loopback_blocks_gateway(servers, fam):
    """TCP to the gateway is refused; UDP gets "administratively prohibited", which the guest's
    kernel reports as ``fam.admin_errno`` (EHOSTUNREACH for ICMP, EACCES for ICMPv6)."""
    script = f"""
    import socket, json, errno
    out = {{}}
    try:
        socket.create_connection(("{fam.gw}", {servers["data"].port}), timeout=5)
        out["tcp"] = "connected"
    except ConnectionRefusedError:
        out["tcp"] = "refused"
    except Exception as e:
        out["tcp"] = repr(e)
    s = socket.socket(socket.{fam.af}, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.connect(("{fam.gw}", {servers["udp"].port}))
    s.send(b"x")
    try:
        s.recv(100)
        out["udp"] = "data"
    except OSError as e:
        out["udp"] = errno.errorcode.get(e.errno, repr(e))
    print(json.dumps(out))
    """
    before = len(servers["data"].commands), servers["udp"].count
    r = guest_json(servers, script, "--disable-host-loopback")
    assert r == {"tcp": "refused", "udp": fam.admin_errno}
    assert (len(servers["data"].commands), servers["udp"].count) == before


def test_rst_both_ways(servers, fam):
    port = servers["data"].port
    before = len(servers["data"].events)
    script = f"""
    import socket, json, struct, time
    out = {{}}
    s = socket.create_connection(("{fam.gw}", {port}), timeout=10)
    s.sendall(b"RSTME\\n")
    try:
        d = s.recv(100)
        out["host_rst"] = "eof" if d == b"" else "data"
    except ConnectionResetError:
        out["host_rst"] = "reset"
    s = socket.create_connection(("{fam.gw}", {port}), timeout=10)
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


def test_udp_to_closed_port_gets_port_unreachable(servers, fam):
    script = f"""
    import socket, json
    s = socket.socket(socket.{fam.af}, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.connect(("{fam.gw}", {free_port(socket.SOCK_DGRAM, fam.loopback)}))
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


def test_unreachable_network_fails_fast(servers, fam):
    # pytest's namespace has only loopback: the host connect() fails at once with
    # ENETUNREACH and nothing is sent anywhere. The guest must get ICMP unreachable.
    routes = subprocess.run(["ip", fam.flag, "route", "show", "default"], capture_output=True, text=True).stdout
    assert routes.strip() == "", "test must run in the loopback-only namespace"
    script = f"""
    import socket, json, errno
    try:
        socket.create_connection(("{fam.unroutable}", 80), timeout=10)
        r = "connected"
    except OSError as e:
        r = errno.errorcode.get(e.errno, repr(e))
    print(json.dumps({{"r": r}}))
    """
    r = guest_json(servers, script)
    assert r["r"] in ("ENETUNREACH", "EHOSTUNREACH")  # an ICMP error: no answer would be a timeout


def test_mtu_65520_transfer(servers, fam, tmp_path):
    """With ``--mtu 65520`` the guest's link has that MTU and both SYNs carry MSS 65520 minus
    the IP and TCP headers (65480 / 65460, RFC 9293 3.7.1); 20 MB arrive intact."""
    port = servers["data"].port
    n = 20 * 1024 * 1024
    want = 65520 - fam.mss_overhead
    script = LINK_MTU + textwrap.dedent(f"""
    import socket, hashlib, json
    s = socket.create_connection(("{fam.gw}", {port}), timeout=30)
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
    assert handshake_mss(pcap, port) == (want, want)
    assert want - 40 <= r["mss"] <= want  # the guest's send MSS: ours, less any TCP options


def test_mss_follows_the_configured_mtu(servers, fam, tmp_path):
    """``--mtu 4000``: the guest's link has that MTU and both SYNs of a connection to host
    loopback (via the gateway) carry MSS 4000 minus the IP and TCP headers (3960 / 3940,
    RFC 9293 3.7.1); 1 MB arrives."""
    port = servers["data"].port
    n = 1 << 20
    want = 4000 - fam.mss_overhead
    script = LINK_MTU + textwrap.dedent(f"""
    import socket, hashlib, json
    s = socket.create_connection(("{fam.gw}", {port}), timeout=30)
    s.sendall(b"DOWN {n} 23\\n")
    h = hashlib.sha256()
    while (d := s.recv(1 << 16)):
        h.update(d)
    print(json.dumps({{"sha": h.hexdigest(), "mtu": link_mtu(s), "mss": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)}}))
    """)
    pcap = tmp_path / "mss.pcap"
    r = guest_json(servers, script, "--mtu", "4000", "--pcap", str(pcap))
    assert r["sha"] == hashlib.sha256(pattern(n, 23)).hexdigest()
    assert r["mtu"] == 4000
    assert handshake_mss(pcap, port) == (want, want)
    assert want - 40 <= r["mss"] <= want  # the guest's send MSS: ours, less any TCP options


@pytest.fixture(scope="module")
def remote_addr(fam):
    """``fam.remote`` on lo of pytest's loopback-only namespace: a host that is not the gateway
    (TEST-NET-1, RFC 5737; documentation prefix, RFC 3849). Packets to it never leave."""
    extra = ["nodad"] if fam.version == 6 else []
    subprocess.run(["ip", fam.flag, "addr", "add", f"{fam.remote}/{fam.remote_len}", "dev", "lo", *extra], check=True)
    yield fam.remote
    subprocess.run(["ip", fam.flag, "addr", "del", f"{fam.remote}/{fam.remote_len}", "dev", "lo"], check=False)


def test_nat_to_non_gateway_address_tcp_and_ping(servers, fam, remote_addr):
    need_tool("ping", "iputils-ping")
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
        p = subprocess.run(["ping", "{fam.flag}", "-c", "2", "-W", "2", "{remote_addr}"],
                           capture_output=True, text=True)
        print(json.dumps({{"got": got, "sha": h.hexdigest(), "ping_rc": p.returncode, "ping": p.stdout}}))
        """
        r = guest_json(servers, script)
    finally:
        srv.close()
    assert r["got"] == 2000000 and r["sha"] == hashlib.sha256(pattern(2000000, 21)).hexdigest()
    assert r["ping_rc"] == 0 and "2 received" in r["ping"], r["ping"]


def test_custom_network(servers, fam):
    """``--cidr`` / ``--cidr6``: the guest's address, its gateway (.2 / ::2) and DNS (.3 / ::3)."""
    net = ipaddress.ip_network(fam.custom_net)
    script = f"""
    import socket, json, subprocess
    s = socket.create_connection(("{net[2]}", {servers["data"].port}), timeout=10)
    s.sendall(b"DOWN 1000 5\\n")
    got = b""
    while True:
        d = s.recv(4096)
        if not d: break
        got += d
    a = subprocess.run(["ip", "{fam.flag}", "-o", "addr", "show", "dev", "tap0", "scope", "global"],
                       capture_output=True, text=True).stdout.split()[3]
    print(json.dumps({{"n": len(got), "addr": a, "resolv": open("/etc/resolv.conf").read()}}))
    """
    r = guest_json(servers, script, fam.cidr_flag, fam.custom_net)
    assert r["n"] == 1000
    assert ipaddress.ip_interface(r["addr"]).network == net
    assert f"nameserver {net[3]}" in r["resolv"]


@IPV6_ONLY
def test_slaac_address_route_and_resolv_conf(servers, fam):
    """IPv6 only: the guest configures itself by SLAAC from our RAs; IPv4 is set statically."""
    cmd = "ip -j -6 addr show dev tap0; echo; ip -j -6 route show; echo; cat /etc/resolv.conf"
    p = run_guest(servers, "", cmd=["sh", "-c", cmd])
    assert p.returncode == 0, p.stderr
    addr_json, route_json, resolv = p.stdout.split("\n\n", 2)
    (link,) = json.loads(addr_json)
    infos = link["addr_info"]
    glob = [a for a in infos if a["scope"] == "global"]
    assert len(glob) == 1, infos
    a = ipaddress.IPv6Address(glob[0]["local"])
    assert a in ipaddress.IPv6Network("fd00::/64") and glob[0]["prefixlen"] == 64
    assert not glob[0].get("tentative")
    assert glob[0]["valid_life_time"] == 86400 and glob[0]["preferred_life_time"] == 14400  # our RA's PIO
    assert any(x["scope"] == "link" for x in infos)
    routes = json.loads(route_json)
    default = [r for r in routes if r["dst"] == "default"]
    assert [(r["gateway"], r["dev"], r["protocol"]) for r in default] == [(ROUTER_LL, "tap0", "ra")]
    assert [ln for ln in resolv.splitlines() if ln.startswith("nameserver")] == ["nameserver 10.0.2.3",
                                                                                "nameserver fd00::3"]
    assert "warning" not in p.stderr


@IPV6_ONLY
def test_no_ipv6_leaves_no_ipv6(servers, fam):
    """IPv6 only: ``--no-ipv6``; there is no switch for IPv4."""
    cmd = "ip -j -6 addr show dev tap0; echo; cat /etc/resolv.conf; cat /proc/sys/net/ipv6/conf/tap0/disable_ipv6"
    p = run_guest(servers, "", "--no-ipv6", cmd=["sh", "-c", cmd])
    assert p.returncode == 0, p.stderr
    addr_json, rest = p.stdout.split("\n\n", 1)
    links = json.loads(addr_json) if addr_json.strip() else []
    assert all(not link.get("addr_info") for link in links), links
    assert "fd00::3" not in rest
    assert rest.split()[-1] == "1"


def test_mtu_below_1280_needs_no_ipv6():
    """IPv6 only: IPv6 needs an MTU of at least 1280 (RFC 8200 5) and a /64 (SLAAC)."""
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--mtu", "1000", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.startswith("aioslirp: error: --mtu:") and "IPv6" in p.stderr and len(p.stderr.splitlines()) == 1
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--cidr6", "fd00::/48", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("aioslirp: error: --cidr6:"), p.stderr
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--mtu", "1000", "--no-ipv6", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


async def test_namespace_workload_leaves_no_fd_task_or_flow(fam):
    """A real guest runs TCP, UDP and DNS through a Stack in this process (``run_in_namespace``
    on pytest's own loop); afterwards the flow table is empty, every flow task is done and
    this process has no extra fd."""
    data, udp, dns = DataServer(host=fam.loopback), UdpEcho(host=fam.loopback), DnsUpstream(aaaa=DNS_AAAA)
    try:
        script = textwrap.dedent(f"""
            import socket, hashlib, subprocess, sys
            for i in range(20):
                s = socket.create_connection(("{fam.gw}", {data.port}), timeout=20)
                s.sendall(b"DOWN 100000 %d\\n" % i)
                buf = b""
                while True:
                    d = s.recv(65536)
                    if not d: break
                    buf += d
                s.close()
                assert hashlib.sha256(buf).hexdigest() == sys.argv[1 + i], i
            u = socket.socket(socket.{fam.af}, socket.SOCK_DGRAM); u.settimeout(5)
            u.sendto(b"x" * 100, ("{fam.gw}", {udp.port})); assert u.recv(200) == b"x" * 100
            assert socket.getaddrinfo("leak.test", None, socket.{fam.af})[0][4][0] == "{ANSWER[fam.dns_qtype]}"
            # a connection the guest resets
            s = socket.create_connection(("{fam.gw}", {data.port}), timeout=20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00")
            s.close()
        """)
        hashes = [hashlib.sha256(pattern(100000, i)).hexdigest() for i in range(20)]
        cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", dns.port)], udp_idle_timeout=0.5)
        stacks = []

        def factory(c):
            stacks.append(Stack(c))
            return stacks[-1]

        fds_before = fd_count()
        tasks_before = asyncio.all_tasks()
        rc = await run_in_namespace(cfg, [sys.executable, "-c", script, *hashes], stack_factory=factory)
        assert rc == 0
        stack = stacks[0]
        assert stack.counters["flows.tcp.opened"] >= 21
        assert stack.counters["flows.udp.opened"] >= 1
        assert stack.counters["drop.internal_error"] == 0
        assert not stack.parts.flows
        assert all(t.done() for t in stack_tasks(stack))
        await asyncio.sleep(0.05)
        assert asyncio.all_tasks() - tasks_before == set()
        assert fd_count() == fds_before
    finally:
        data.close()
        udp.close()
        dns.close()
