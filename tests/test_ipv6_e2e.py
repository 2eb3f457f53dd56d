"""IPv6 end to end: `aioslirp run` puts a real Linux namespace behind our TAP; it configures
itself by SLAAC from our Router Advertisements and reaches host servers on ``::1`` through
the gateway ``fd00::2``. Real tools inside (python, ping, dig, ip); results asserted by value.

pytest runs in a loopback-only namespace (conftest.py): ``::1`` and the documentation
addresses put on ``lo`` here are the only IPv6 destinations; nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from hostservers import DataServer, DnsUpstream, UdpEcho, pattern
from test_e2e import LINK_MTU, guest_json, handshake_mss, run_guest  # `aioslirp run` around a guest script

pytestmark = pytest.mark.netns

AAAA = "2001:db8::99"
ROUTER_LL = "fe80::5055:aff:fe00:202"  # modified EUI-64 of the gateway MAC 52:55:0a:00:02:02


@pytest.fixture(scope="module")
def servers():
    data = DataServer(host="::1")
    udp = UdpEcho(host="::1")
    dns = DnsUpstream(aaaa=AAAA)
    yield {"data": data, "udp": udp, "dns": dns}
    data.close()
    udp.close()
    dns.close()


def need(tool: str, package: str) -> None:
    if not shutil.which(tool):
        pytest.fail(f"{tool} is required (apt-get install {package})")


def test_slaac_address_route_and_resolv_conf(servers):
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


def test_download_and_upload_20mb_over_ipv6(servers, request):
    port = servers["data"].port
    n = 20 * 1024 * 1024
    script = f"""
    import socket, hashlib, json, time, random
    s = socket.create_connection(("fd00::2", {port}), timeout=60)
    assert s.family == socket.AF_INET6
    s.sendall(b"DOWN {n} 17\\n")
    h = hashlib.sha256(); got = 0; t0 = time.monotonic()
    while True:
        d = s.recv(1 << 20)
        if not d: break
        h.update(d); got += len(d)
    down_s = time.monotonic() - t0
    s.close()
    data = random.Random(19).randbytes({n})
    s = socket.create_connection(("fd00::2", {port}), timeout=60)
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
    assert r["sha"] == hashlib.sha256(pattern(n, 17)).hexdigest()
    count, sha = r["reply"].split()
    assert int(count) == n and sha == hashlib.sha256(pattern(n, 19)).hexdigest()
    down = n * 8 / r["down_s"] / 1e6
    up = n * 8 / r["up_s"] / 1e6
    request.node.user_properties += [("ipv6_download_Mbit_s", round(down)), ("ipv6_upload_Mbit_s", round(up))]
    print(f"IPv6 download {down:.0f} Mbit/s, upload {up:.0f} Mbit/s")


def test_mss_follows_the_configured_mtu_over_ipv6(servers, tmp_path):
    """``--mtu 4000``: the guest's link has that MTU and both SYNs of a connection to ``::1``
    (via fd00::2) carry MSS 3940 (MTU - 60: IPv6 and TCP headers, RFC 9293 3.7.1); 1 MB arrives."""
    port = servers["data"].port
    n = 1 << 20
    script = LINK_MTU + textwrap.dedent(f"""
    import socket, hashlib, json
    s = socket.create_connection(("fd00::2", {port}), timeout=30)
    s.sendall(b"DOWN {n} 23\\n")
    h = hashlib.sha256()
    while (d := s.recv(1 << 16)):
        h.update(d)
    print(json.dumps({{"sha": h.hexdigest(), "mtu": link_mtu(s), "mss": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)}}))
    """)
    pcap = tmp_path / "mss6.pcap"
    r = guest_json(servers, script, "--mtu", "4000", "--pcap", str(pcap))
    assert r["sha"] == hashlib.sha256(pattern(n, 23)).hexdigest()
    assert r["mtu"] == 4000
    assert handshake_mss(pcap, port) == (3940, 3940)
    assert 3940 - 40 <= r["mss"] <= 3940  # the guest's send MSS: ours, less any TCP options


def test_udp_echo_small_and_fragmented_over_ipv6(servers):
    port = servers["udp"].port
    script = f"""
    import socket, json, random
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.connect(("fd00::2", {port}))
    out = {{}}
    for n in (1, 1400, 60000):
        data = random.Random(n).randbytes(n)
        s.send(data)
        got = s.recv(65535)
        out[str(n)] = got == data
    print(json.dumps(out))
    """
    assert guest_json(servers, script) == {"1": True, "1400": True, "60000": True}


def test_ping6_gateway_and_dns(servers):
    need("ping", "iputils-ping")
    p = run_guest(servers, "", cmd=["sh", "-c", "ping -6 -c 2 -W 2 fd00::2 && ping -6 -c 1 -W 2 -s 1400 fd00::3"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 packets transmitted, 2 received" in p.stdout
    assert "1 packets transmitted, 1 received" in p.stdout


def test_dns_aaaa_over_ipv6_transport(servers):
    need("dig", "dnsutils")
    before_udp, before_tcp = servers["dns"].udp_queries, servers["dns"].tcp_queries
    cmd = ("dig +short +time=3 +tries=1 -6 @fd00::3 www.example.test AAAA && "
           "dig +short +tcp +time=3 +tries=1 -6 @fd00::3 other.example.test AAAA && "
           "dig +short +time=3 +tries=1 -6 @fd00::3 www.example.test A")
    p = run_guest(servers, "", cmd=["sh", "-c", cmd])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.split() == [AAAA, AAAA, "10.0.2.99"]
    # all three reached the upstream on 127.0.0.1 (the TCP query is forwarded over UDP)
    assert servers["dns"].udp_queries >= before_udp + 3
    assert servers["dns"].tcp_queries == before_tcp


def test_no_ipv6_leaves_no_ipv6(servers):
    cmd = "ip -j -6 addr show dev tap0; echo; cat /etc/resolv.conf; cat /proc/sys/net/ipv6/conf/tap0/disable_ipv6"
    p = run_guest(servers, "", "--no-ipv6", cmd=["sh", "-c", cmd])
    assert p.returncode == 0, p.stderr
    addr_json, rest = p.stdout.split("\n\n", 1)
    links = json.loads(addr_json) if addr_json.strip() else []
    assert all(not link.get("addr_info") for link in links), links
    assert "fd00::3" not in rest
    assert rest.split()[-1] == "1"


def test_disable_host_loopback_blocks_ipv6_gateway(servers):
    port = servers["data"].port
    uport = servers["udp"].port
    script = f"""
    import socket, json
    out = {{}}
    try:
        socket.create_connection(("fd00::2", {port}), timeout=5)
        out["tcp"] = "connected"
    except ConnectionRefusedError:
        out["tcp"] = "refused"
    except Exception as e:
        out["tcp"] = repr(e)
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.connect(("fd00::2", {uport}))
    s.send(b"x")
    try:
        s.recv(100)
        out["udp"] = "data"
    except PermissionError:
        out["udp"] = "prohibited"   # ICMPv6 administratively prohibited -> EACCES
    except Exception as e:
        out["udp"] = repr(e)
    print(json.dumps(out))
    """
    before = len(servers["data"].commands), servers["udp"].count
    r = guest_json(servers, script, "--disable-host-loopback")
    assert r == {"tcp": "refused", "udp": "prohibited"}
    assert (len(servers["data"].commands), servers["udp"].count) == before


def test_udp_closed_port_and_unreachable_network_over_ipv6(servers):
    import socket as _s

    probe = _s.socket(_s.AF_INET6, _s.SOCK_DGRAM)
    probe.bind(("::1", 0))
    closed = probe.getsockname()[1]
    probe.close()
    script = f"""
    import socket, json, time, errno
    out = {{}}
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.connect(("fd00::2", {closed}))
    s.send(b"hello")
    try:
        s.recv(100)
        out["udp"] = "data"
    except ConnectionRefusedError:
        out["udp"] = "refused"
    except socket.timeout:
        out["udp"] = "timeout"
    t0 = time.monotonic()
    try:
        socket.create_connection(("2001:db8:1::1", 80), timeout=10)
        out["tcp"] = "connected"
    except OSError as e:
        out["tcp"] = errno.errorcode.get(e.errno, repr(e))
    out["t"] = time.monotonic() - t0
    print(json.dumps(out))
    """
    r = guest_json(servers, script)
    assert r["udp"] == "refused"
    assert r["tcp"] in ("ENETUNREACH", "EHOSTUNREACH")  # an ICMPv6 error: no answer would be a timeout


# A "remote" IPv6 host that is not the gateway: a documentation address (RFC 3849) on lo in
# pytest's loopback-only namespace. Packets to it never leave this namespace.
REMOTE6 = "2001:db8::55"


@pytest.fixture(scope="module")
def remote6():
    subprocess.run(["ip", "-6", "addr", "add", f"{REMOTE6}/128", "dev", "lo", "nodad"], check=True)
    yield REMOTE6
    subprocess.run(["ip", "-6", "addr", "del", f"{REMOTE6}/128", "dev", "lo"], check=False)


def test_nat_to_non_gateway_ipv6_address_tcp_and_ping(servers, remote6):
    need("ping", "iputils-ping")
    srv = DataServer(host=remote6)
    try:
        script = f"""
        import socket, hashlib, json, subprocess
        s = socket.create_connection(("{remote6}", {srv.port}), timeout=20)
        s.sendall(b"DOWN 2000000 23\\n")
        h = hashlib.sha256(); got = 0
        while True:
            d = s.recv(65536)
            if not d: break
            h.update(d); got += len(d)
        p = subprocess.run(["ping", "-6", "-c", "2", "-W", "2", "{remote6}"], capture_output=True, text=True)
        print(json.dumps({{"got": got, "sha": h.hexdigest(), "ping_rc": p.returncode, "ping": p.stdout}}))
        """
        r = guest_json(servers, script)
    finally:
        srv.close()
    assert r["got"] == 2000000 and r["sha"] == hashlib.sha256(pattern(2000000, 23)).hexdigest()
    assert r["ping_rc"] == 0 and "2 received" in r["ping"], r["ping"]


def test_mtu_below_1280_needs_no_ipv6():
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


def test_custom_prefix(servers):
    port = servers["data"].port
    script = f"""
    import socket, json, subprocess
    s = socket.create_connection(("fd42:1:2:3::2", {port}), timeout=10)
    s.sendall(b"DOWN 1000 5\\n")
    got = b""
    while True:
        d = s.recv(4096)
        if not d: break
        got += d
    a = subprocess.run(["ip", "-6", "-o", "addr", "show", "dev", "tap0", "scope", "global"],
                       capture_output=True, text=True).stdout.split()[3]
    print(json.dumps({{"n": len(got), "addr": a, "resolv": open("/etc/resolv.conf").read()}}))
    """
    r = guest_json(servers, script, "--cidr6", "fd42:1:2:3::/64")
    assert r["n"] == 1000
    assert ipaddress.IPv6Interface(r["addr"]).network == ipaddress.IPv6Network("fd42:1:2:3::/64")
    assert "nameserver fd42:1:2:3::3" in r["resolv"]
