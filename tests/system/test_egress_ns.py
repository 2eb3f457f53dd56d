"""The egress policy end to end: a real guest behind ``aioslirp run --egress-default deny --allow
allowed.test:PORT``, with a local DNS upstream and HTTP servers on documentation addresses put on
the test namespace's ``lo`` (see conftest.py: nothing leaves the machine).

The upstream answers ``allowed.test`` (192.0.2.10, 2001:db8::10), ``denied.test`` (192.0.2.20)
and ``cdn-b.test`` (192.0.2.10: it shares allowed.test's address) and listens on 127.0.0.1:53,
the upstream of the stack, and on 192.0.2.30:53, "another resolver" the guest must not reach.
Sans-I/O coverage of the same rules: tests/unit/flow/test_egress_names.py.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys

import pytest

from support.egress_world import BODY, world  # noqa: F401 - world: the module's fixture
from support.prereqs import have_ipv6_loopback, need

pytestmark = pytest.mark.netns

GUEST = r'''
import errno, hashlib, json, socket, subprocess, sys, time
a = json.loads(sys.argv[1])
port, port2, api_path = a["port"], a["port2"], a["api"]
out = {}

def run(*argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout

def api(execute, **arguments):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(api_path)
    s.sendall(json.dumps({"execute": execute, "arguments": arguments}).encode())
    s.shutdown(socket.SHUT_WR)
    buf = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        buf += d
    s.close()
    return json.loads(buf)

def connect(name, family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    t0 = time.monotonic()
    try:
        s.connect(addr)
        out[name] = {"ok": True, "s": time.monotonic() - t0}
    except OSError as exc:
        out[name] = {"errno": errno.errorcode.get(exc.errno, str(exc.errno)), "s": time.monotonic() - t0}
    finally:
        s.close()

def curl(name, *opts, url=None):
    p = subprocess.run(["curl", "-s", "--max-time", "10", *opts, url or f"http://allowed.test:{port}/"],
                       capture_output=True, timeout=30)
    out[name] = {"rc": p.returncode, "sha": hashlib.sha256(p.stdout).hexdigest()}

curl("curl")
curl("curl4", "-4")
curl("curl6", "-6")
out["getent_allowed"] = run("getent", "hosts", "allowed.test")
out["getent_denied"] = run("getent", "hosts", "denied.test")
out["dig_denied"] = run("dig", "+tries=1", "+time=3", "denied.test")
out["dig_denied6"] = run("dig", "@fd00::3", "+tries=1", "+time=3", "AAAA", "denied.test")
out["dig_denied_tcp"] = run("dig", "+tcp", "+tries=1", "+time=3", "denied.test")
out["dig_other"] = run("dig", "+tries=1", "+time=3", "other.test")
out["dig_evil"] = run("dig", "+tries=1", "+time=3", "evilallowed.test")
out["dig_cdn_b"] = run("dig", "+tries=1", "+time=3", "cdn-b.test")
connect("other_port4", socket.AF_INET, ("192.0.2.10", port2))
connect("other_port6", socket.AF_INET6, ("2001:db8::10", port2))
connect("literal4", socket.AF_INET, ("192.0.2.30", port))
connect("denied_addr", socket.AF_INET, ("192.0.2.20", port))
out["dig_other_resolver"] = run("dig", "@192.0.2.30", "+tries=1", "+time=2", "allowed.test")
out["dig_other_resolver_tcp"] = run("dig", "@192.0.2.30", "+tcp", "+tries=1", "+time=2", "allowed.test")
# rules at run time over the API socket
out["add"] = api("add_rule", rule="192.0.2.30:%d/tcp" % port)
connect("literal4_added", socket.AF_INET, ("192.0.2.30", port))
out["list"] = api("list_rules")

def get(s):
    n = 0
    try:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        while True:
            d = s.recv(65536)
            if not d:
                return n
            n += len(d)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

kept = socket.create_connection(("192.0.2.30", port), timeout=5)
out["remove_keep"] = api("remove_rule", rule="192.0.2.30:%d/tcp" % port)
out["kept_after_remove"] = get(kept)
kept.close()
api("add_rule", rule="192.0.2.30:%d/tcp" % port)
ended = socket.create_connection(("192.0.2.30", port), timeout=5)
time.sleep(0.2)
out["remove"] = api("remove_rule", rule="192.0.2.30/32:%d/tcp" % port, close=True)
out["ended_after_remove"] = get(ended)
ended.close()
connect("literal4_removed", socket.AF_INET, ("192.0.2.30", port))
out["counters"] = {k: v for k, v in api("get_stats")["return"]["counters"].items()
                   if k.startswith("egress.") or k == "drop.egress_denied"}
print(json.dumps(out))
'''


def test_sandbox_with_name_allow_list(world, tmp_path):
    api = str(tmp_path / "api.sock")
    port = world["port"]
    argv = [sys.executable, "-m", "aioslirp", "run", "--dns", "127.0.0.1:53", "--egress-default", "deny",
            "--allow", f"allowed.test:{port}", "--deny", "denied.test", "--api-socket", api,
            # the names resolve to documentation addresses, which an upstream answer binds only under
            # a covering CIDR allow rule (docs/security.md); these open only port 9/udp, unused here
            "--allow", "192.0.2.0/24:9/udp", "--allow", "[2001:db8::/32]:9/udp", "--",
            sys.executable, "-c", GUEST, json.dumps({"port": port, "port2": world["port2"], "api": api})]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout={p.stdout[-3000:]}\nstderr={p.stderr[-4000:]}"
    r = json.loads(p.stdout.strip().splitlines()[-1])
    sha = hashlib.sha256(BODY).hexdigest()
    for k in ("curl", "curl4", "curl6"):
        assert r[k] == {"rc": 0, "sha": sha}, (k, r[k])
    assert r["getent_allowed"][0] == 0 and "allowed.test" in r["getent_allowed"][1]
    assert r["getent_denied"][0] != 0
    rc, text = r["dig_denied"]
    assert "status: NXDOMAIN" in text and "EDE: 15 (Blocked): (denied.test)" in text, text
    assert "EDE: 15 (Blocked): (denied.test)" in r["dig_denied_tcp"][1] and "(TCP)" in r["dig_denied_tcp"][1]
    rc, text = r["dig_denied6"]
    assert "status: NXDOMAIN" in text and "EDE: 15 (Blocked)" in text and "SERVER: fd00::3" in text, text
    for k in ("dig_other", "dig_evil", "dig_cdn_b"):
        assert "status: NXDOMAIN" in r[k][1] and "EDE: 18 (Prohibited): (egress-default deny)" in r[k][1], r[k][1]
    # the upstream never saw the denied names
    blocked = {"denied.test", "other.test", "evilallowed.test", "cdn-b.test"}
    assert not blocked & set(world["up"].asked), world["up"].asked
    # refused at once: ICMP administratively prohibited
    assert r["other_port4"]["errno"] == "EHOSTUNREACH" and r["other_port4"]["s"] < 1, r["other_port4"]
    assert r["other_port6"]["errno"] == "EACCES" and r["other_port6"]["s"] < 1, r["other_port6"]
    assert r["literal4"]["errno"] == "EHOSTUNREACH" and r["literal4"]["s"] < 1
    assert r["denied_addr"]["errno"] == "EHOSTUNREACH"
    assert r["dig_other_resolver"][0] != 0 and r["dig_other_resolver_tcp"][0] != 0
    assert world["other"].asked == []
    assert r["add"] == {"return": {"rule": f"192.0.2.30/32:{port}/tcp"}}
    assert r["literal4_added"]["ok"]
    assert {"rule": f"192.0.2.30/32:{port}/tcp", "verdict": "allow"} in r["list"]["return"]["rules"]
    assert r["remove_keep"] == {"return": {"closed": 0}}
    assert r["kept_after_remove"] > len(BODY)  # without close, an open flow stays
    assert r["remove"]["return"]["closed"] >= 1
    assert r["ended_after_remove"] in ("ECONNRESET", 0), r["ended_after_remove"]
    assert r["literal4_removed"]["errno"] == "EHOSTUNREACH"
    c = r["counters"]
    assert c["egress.dns_blocked"] >= 5 and c["drop.egress_denied"] >= 6
    assert c["drop.egress_denied"] == c.get("egress.denied_default", 0) + c.get("egress.denied_rule", 0)
    assert c.get("egress.denied_hook", 0) == 0


# ============================================================================ the Python hook, in process


def _listeners(fam) -> dict:
    """``{port % 4: listening socket}`` for 0, 1 and 2, on explicit ports (bind(0) prefers one parity)."""
    want: dict = {}
    for port in range(23000, 23200):
        if port % 4 == 3 or port % 4 in want:
            continue
        s = socket.socket(fam.af)
        try:
            s.bind((fam.loopback, port))
            s.listen(8)
        except OSError:
            s.close()
            continue
        want[port % 4] = s
        if len(want) == 3:
            return want
    for s in want.values():
        s.close()
    pytest.fail("no free listening ports")


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("fam_name", ["ipv4", "ipv6"])
async def test_python_hook_decides_guest_syns(kind, fam_name):
    """A hook allowing even ports: the SYN to an even port is answered SYN-ACK (an async hook: after
    its verdict, the held SYN replayed), to an odd port ICMP administratively prohibited; an async
    hook slower than policy_timeout gets the timeout verdict (deny)."""
    from aioslirp.config import NetworkConfig
    from support.frames import F4, F6, icmp_of, of_proto, tcp_frame
    from support.stacks import recv_frames, served_stack

    fam = F4 if fam_name == "ipv4" else F6
    if fam is F6:
        need(have_ipv6_loopback(), "IPv6 on the test namespace's loopback")
    asked = []

    def sync_hook(req):
        asked.append((req.proto, req.dst, req.port, req.guest))
        return req.port % 2 == 0, "even ports"

    async def async_hook(req):
        asked.append((req.proto, req.dst, req.port, req.guest))
        if req.port % 4 == 0:
            await asyncio.sleep(5)
        return req.port % 2 == 0, "even ports"

    import asyncio

    want = _listeners(fam)  # port % 4 -> listener: 2 allowed, 1 denied, 0 slow (async hook)
    lsn = list(want.values())
    even, odd, slow = (want[k].getsockname()[1] for k in (2, 1, 0))
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], policy=sync_hook if kind == "sync" else async_hook,
                        policy_timeout=0.2)
    try:
        async with served_stack(cfg, settle=0.3) as (stack, guest, _first):
            guest.send(tcp_frame(fam, 41000, even, 0x02, opts=b"\x02\x04\x05\xb4"))
            frames = await recv_frames(guest, 1.0)
            synack = [ip.data for _e, ip in of_proto(fam, frames, 6) if ip.data.flags & 0x12 == 0x12]
            assert synack and synack[0].sport == even
            guest.send(tcp_frame(fam, 41001, odd, 0x02))
            errs = icmp_of(fam, await recv_frames(guest, 1.0), 3 if fam is F4 else 1)
            assert errs and errs[0][2][1] == (13 if fam is F4 else 1)  # administratively prohibited
            assert stack.counters["egress.denied_hook"] == 1 and stack.counters["drop.egress_denied"] == 1
            assert asked[0][:3] == ("tcp", fam.loopback, even) and asked[0][3].endswith(":41000")
            if kind == "async":
                assert stack.counters["drop.egress_held"] == 2
                if True:
                    guest.send(tcp_frame(fam, 41002, slow, 0x02))
                    errs = icmp_of(fam, await recv_frames(guest, 1.0), 3 if fam is F4 else 1)
                    assert errs and stack.counters["egress.hook_timeouts"] == 1
            n = len(asked)
            guest.send(tcp_frame(fam, 41003, even, 0x02))  # the cached verdict: not asked again
            await recv_frames(guest, 0.3)
            assert len(asked) == n
            assert stack.parts.guard.held == 0
    finally:
        for s in lsn:
            s.close()
