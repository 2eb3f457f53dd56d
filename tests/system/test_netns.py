"""Namespace and TAP plumbing: aioslirp.frontends.netns, aioslirp.transport.tap, the CLI.

pytest runs as root inside a loopback-only network namespace (conftest.py); every
namespace made here is a child of that one and only talks to our own handlers, so no
frame can leave the machine. Most tests use ``FakeStack`` (a few lines of frame
handling written with dpkt) so they check the plumbing, not the real stack; the
``cli`` tests run the real :class:`aioslirp.Stack`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.frontends.netns import attach, run_in_namespace
from aioslirp.host.nsbase import NamespaceError, resolv_conf_text
from aioslirp.transport.tap import TapTransport
from aioslirp.transport.tapdev import TapError, create_tap, open_tap

from support.namespaces import start_target_namespace
from support.paths import REPO
from support.prereqs import need

pytestmark = pytest.mark.netns

GW_MAC = bytes.fromhex("525500000202")
SETPRIV = shutil.which("setpriv")
NOBODY = 65534

need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")


# ----------------------------------------------------------------------------------------
# a stand-in stack: records guest frames, optionally answers them


class FakeStack:
    """Implements the part of the Stack API netns uses: async context manager, serve(), stop()."""

    def __init__(self, config: NetworkConfig, handler=None) -> None:
        self.config = config
        self.handler = handler
        self.frames: list[bytes] = []
        self.transport = None
        self.started = asyncio.Event()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        if self.transport is not None:
            self.transport.close()

    async def serve(self, transport) -> None:
        self.transport = transport
        await transport.open(self._on_frames)
        self.started.set()
        await transport.closed

    def _on_frames(self, frames) -> None:
        for frame in frames:
            self.frames.append(frame)
            if self.handler is not None:
                self.handler(self, frame)

    def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def send(self, frame: bytes) -> None:
        self.transport.send_frames([frame])


def ip4(text: str) -> bytes:
    return socket.inet_aton(text)


def arp_reply(req: dpkt.ethernet.Ethernet) -> bytes:
    arp = req.data
    rep = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REPLY, sha=GW_MAC, spa=arp.tpa, tha=arp.sha, tpa=arp.spa)
    return bytes(dpkt.ethernet.Ethernet(dst=req.src, src=GW_MAC, type=dpkt.ethernet.ETH_TYPE_ARP, data=rep))


def udp_frame(dst_mac: bytes, src: str, sport: int, dst: str, dport: int, payload: bytes) -> bytes:
    udp = dpkt.udp.UDP(sport=sport, dport=dport, data=payload)
    udp.ulen = len(udp)
    ip = dpkt.ip.IP(src=ip4(src), dst=ip4(dst), p=dpkt.ip.IP_PROTO_UDP, ttl=64, data=udp)
    return bytes(dpkt.ethernet.Ethernet(dst=dst_mac, src=GW_MAC, type=dpkt.ethernet.ETH_TYPE_IP, data=ip))


def answer_arp_and_echo_udp(stack: FakeStack, frame: bytes) -> None:
    """ARP for anything but the guest -> our MAC; UDP to 10.0.2.2 -> echoed back upper-cased."""
    eth = dpkt.ethernet.Ethernet(frame)
    if eth.type == dpkt.ethernet.ETH_TYPE_ARP and eth.data.op == dpkt.arp.ARP_OP_REQUEST:
        if eth.data.tpa != ip4("10.0.2.15"):
            stack.send(arp_reply(eth))
    elif eth.type == dpkt.ethernet.ETH_TYPE_IP and isinstance(eth.data.data, dpkt.udp.UDP):
        ip, udp = eth.data, eth.data.data
        if ip.dst == ip4("10.0.2.2"):
            stack.send(udp_frame(eth.src, "10.0.2.2", udp.dport, socket.inet_ntoa(ip.src), udp.sport, udp.data.upper()))


async def run_fake(argv, handler=None, timeout: float = 30.0, **cfg) -> tuple[int, FakeStack]:
    made: list[FakeStack] = []

    def factory(config):
        made.append(FakeStack(config, handler))
        return made[-1]

    rc = await asyncio.wait_for(run_in_namespace(NetworkConfig(**cfg), argv, stack_factory=factory), timeout)
    return rc, made[0]


def parse(frames: list[bytes]) -> list[dpkt.ethernet.Ethernet]:
    return [dpkt.ethernet.Ethernet(f) for f in frames]


# ----------------------------------------------------------------------------------------
# run_in_namespace with the fake stack (as root)


async def test_guest_frame_reaches_transport():
    """A UDP send to 10.0.2.2 from inside makes the kernel ARP for the gateway through our TAP."""
    script = "import socket,time; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('10.0.2.2', 9)); time.sleep(0.5)"
    rc, stack = await run_fake([sys.executable, "-c", script])
    assert rc == 0
    arps = [e for e in parse(stack.frames) if e.type == dpkt.ethernet.ETH_TYPE_ARP]
    assert arps, f"no ARP among {len(stack.frames)} frames"
    req = arps[0].data
    assert req.op == dpkt.arp.ARP_OP_REQUEST
    assert (req.spa, req.tpa) == (ip4("10.0.2.15"), ip4("10.0.2.2"))
    assert arps[0].dst == b"\xff" * 6
    assert stack.transport.frames_in >= len(stack.frames) > 0


async def test_send_frames_reach_guest_socket(tmp_path):
    """Frames written with send_frames (ARP reply, then a UDP datagram) reach the guest's kernel and socket."""
    out = tmp_path / "result.json"
    script = textwrap.dedent(
        f"""
        import json, socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(('10.0.2.15', 7777))
        s.settimeout(1.0)
        for _ in range(10):
            s.sendto(b'hello from the guest', ('10.0.2.2', 9999))
            try:
                data, addr = s.recvfrom(2048)
                break
            except socket.timeout:
                pass
        else:
            raise SystemExit(3)
        open({str(out)!r}, 'w').write(json.dumps({{'data': data.decode(), 'addr': list(addr)}}))
        """
    )
    rc, stack = await run_fake([sys.executable, "-c", script], handler=answer_arp_and_echo_udp)
    assert rc == 0
    result = json.loads(out.read_text())
    assert result == {"data": "HELLO FROM THE GUEST", "addr": ["10.0.2.2", 9999]}
    udp = [e for e in parse(stack.frames) if e.type == dpkt.ethernet.ETH_TYPE_IP and isinstance(e.data.data, dpkt.udp.UDP)]
    assert any(e.data.dst == ip4("10.0.2.2") and e.data.data.dport == 9999 for e in udp)
    assert stack.transport.frames_out >= 2 and stack.transport.send_errors == 0


@pytest.mark.parametrize(
    "cfg, expect",
    [
        ({}, {"addr": "10.0.2.15", "prefix": 24, "gw": "10.0.2.2", "dns": "10.0.2.3", "mtu": 1500}),
        (
            {"cidr": "10.0.7.0/24", "mtu": 1400, "dns_search": ["example.test", "corp.test"]},
            {"addr": "10.0.7.15", "prefix": 24, "gw": "10.0.7.2", "dns": "10.0.7.3", "mtu": 1400},
        ),
    ],
)
async def test_interface_and_resolv_conf_inside(tmp_path, cfg, expect):
    host_resolv = Path("/etc/resolv.conf").read_bytes() if os.path.exists("/etc/resolv.conf") else None
    cmd = (
        f"ip -j addr show dev tap0 > {tmp_path}/addr; ip -j route show > {tmp_path}/route; "
        f"ip -j link show dev lo > {tmp_path}/lo; cat /etc/resolv.conf > {tmp_path}/resolv"
    )
    rc, _ = await run_fake(["sh", "-c", cmd], **cfg)
    assert rc == 0
    (link,) = json.loads((tmp_path / "addr").read_text())
    assert link["ifname"] == "tap0" and link["mtu"] == expect["mtu"]
    assert "UP" in link["flags"]
    v4 = [a for a in link["addr_info"] if a["family"] == "inet"]
    assert [(a["local"], a["prefixlen"]) for a in v4] == [(expect["addr"], expect["prefix"])]
    routes = json.loads((tmp_path / "route").read_text())
    default = [r for r in routes if r["dst"] == "default"]
    assert [(r["gateway"], r["dev"]) for r in default] == [(expect["gw"], "tap0")]
    (lo,) = json.loads((tmp_path / "lo").read_text())
    assert "UP" in lo["flags"]
    resolv = (tmp_path / "resolv").read_text()
    assert f"nameserver {expect['dns']}" in resolv.splitlines()
    assert [line for line in resolv.splitlines() if line.startswith("nameserver")] == [f"nameserver {expect['dns']}",
                                                                                    "nameserver fd00::3"]
    if cfg.get("dns_search"):
        assert "search example.test corp.test" in resolv.splitlines()
    if host_resolv is not None:
        assert Path("/etc/resolv.conf").read_bytes() == host_resolv  # the host's file is untouched


def test_resolv_conf_text():
    cfg = NetworkConfig(dns_search=["a.test"]).validate()
    assert resolv_conf_text(cfg).splitlines()[1:] == ["nameserver 10.0.2.3", "nameserver fd00::3", "search a.test"]
    cfg = NetworkConfig(ipv6=False).validate()
    assert resolv_conf_text(cfg).splitlines()[1:] == ["nameserver 10.0.2.3"]


@pytest.mark.parametrize(
    "argv, status",
    [
        (["sh", "-c", "exit 7"], 7),
        (["sh", "-c", "exit 0"], 0),
        (["sh", "-c", "kill -TERM $$"], 128 + signal.SIGTERM),
        (["aioslirp-no-such-command"], 127),
    ],
)
async def test_exit_status_propagates(argv, status):
    rc, _ = await run_fake(argv)
    assert rc == status


async def test_custom_ifname_and_sigpipe_default(tmp_path):
    """--ifname is honoured, and the command does not inherit Python's SIG_IGN for SIGPIPE."""
    cmd = f"ip -j link show dev veth-x > {tmp_path}/link; grep SigIgn /proc/self/status > {tmp_path}/sig"
    made = []

    def factory(config):
        made.append(FakeStack(config))
        return made[-1]

    rc = await run_in_namespace(NetworkConfig(), ["sh", "-c", cmd], ifname="veth-x", stack_factory=factory)
    assert rc == 0
    assert json.loads((tmp_path / "link").read_text())[0]["ifname"] == "veth-x"
    ignored = int((tmp_path / "sig").read_text().split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))


async def test_setup_error_is_one_line():
    with pytest.raises(NamespaceError) as info:
        await run_in_namespace(NetworkConfig(), ["true"], ifname="x" * 20, stack_factory=FakeStack)
    assert "\n" not in str(info.value) and "interface name" in str(info.value)


async def test_forward_signals_passes_sigterm_to_command(tmp_path):
    """With forward_signals, SIGTERM to us reaches the command; SIGINT is left to it (no effect on us)."""
    marker = tmp_path / "started"
    cmd = f"trap 'exit 42' TERM; touch {marker}; while :; do sleep 0.05; done"
    made = []

    def factory(config):
        made.append(FakeStack(config))
        return made[-1]

    task = asyncio.create_task(
        run_in_namespace(NetworkConfig(), ["sh", "-c", cmd], stack_factory=factory, forward_signals=True)
    )
    for _ in range(200):
        if marker.exists():
            break
        await asyncio.sleep(0.05)
    assert marker.exists()
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 10) == 42
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_command_dies_with_aioslirp():
    """PR_SET_PDEATHSIG: if aioslirp is killed, the command gets SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "run", "--", "sleep", "60"], cwd=REPO)
    try:
        child = None
        for _ in range(200):
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            if kids and Path(f"/proc/{kids[0]}/cmdline").read_bytes().startswith(b"sleep"):
                child = int(kids[0])
                break
            time.sleep(0.05)
        assert child is not None, "the command did not start"
        proc.kill()
        proc.wait()
        for _ in range(100):
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                break
            if state in ("Z", "X"):
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the command outlived aioslirp")
    finally:
        proc.kill()
        proc.wait()


_RESOLV_SCRIPT = """
import json, os, sys
from aioslirp.host import nschild
from aioslirp.host.isolate import CLONE_NEWNS, unshare
link, target = sys.argv[1], sys.argv[2]
nschild.RESOLV_CONF = link
unshare(CLONE_NEWNS)
warnings = []
nschild._install_resolv_conf("nameserver 10.0.2.3\\n", warnings)
print(json.dumps({"seen": open(link).read() if os.path.exists(link) else None, "warnings": warnings}))
"""


@pytest.mark.parametrize("dangling", [False, True])
def test_resolv_conf_symlink_handling(tmp_path, dangling):
    """/etc/resolv.conf as a symlink: the generated file goes over its target; a dangling one warns."""
    target = tmp_path / "real-resolv.conf"
    if not dangling:
        target.write_text("nameserver 192.0.2.1\n")
    link = tmp_path / "resolv.conf"
    link.symlink_to(target)
    p = subprocess.run([sys.executable, "-c", _RESOLV_SCRIPT, str(link), str(target)], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    if dangling:
        assert len(out["warnings"]) == 1 and "missing" in out["warnings"][0]
    else:
        assert out == {"seen": "nameserver 10.0.2.3\n", "warnings": []}
        assert target.read_text() == "nameserver 192.0.2.1\n"  # only that private mount namespace saw it


# ----------------------------------------------------------------------------------------
# TapTransport units (TAP devices made in pytest's own isolated namespace)


@contextlib.contextmanager
def local_tap():
    fd, name = create_tap("aiot%d", 1500)
    yield fd, name


async def test_watch_pid_closes_transport():
    with local_tap() as (fd, name):
        t = TapTransport(fd, ifname=name)
        await t.open(lambda frames: None)
        proc = subprocess.Popen(["sleep", "0.3"])
        t.watch_pid(proc.pid)
        start = time.monotonic()
        assert await asyncio.wait_for(t.closed, 10) is None
        assert time.monotonic() - start < 5
        assert t.fd == -1
        proc.wait()


async def test_watch_pid_of_dead_process_closes_at_once():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with local_tap() as (fd, name):
        t = TapTransport(fd, ifname=name)
        t.watch_pid(proc.pid)  # before open(): the stack may not serve yet
        await t.open(lambda frames: None)
        await asyncio.wait_for(t.closed, 5)
        assert t.fd == -1


async def test_write_to_down_interface_is_counted_not_fatal():
    with local_tap() as (fd, name):
        t = TapTransport(fd, ifname=name)
        await t.open(lambda frames: None)
        frame = udp_frame(b"\xff" * 6, "10.0.2.2", 1, "10.0.2.15", 2, b"x")
        t.send_frames([frame, frame])  # link is down: EIO
        assert t.send_drops == {"eio": 2} and t.send_errors == 2
        assert not t.closed.done()
        t.close()
        t.close()  # idempotent
        t.send_frames([frame])
        assert t.send_drops["closed"] == 1


async def test_deleted_interface_ends_transport():
    with local_tap() as (fd, name):
        t = TapTransport(fd, ifname=name)
        await t.open(lambda frames: None)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        subprocess.run(["ip", "link", "del", name], check=True)
        t.send_frames([udp_frame(b"\xff" * 6, "10.0.2.2", 1, "10.0.2.15", 2, b"x")])
        exc = await asyncio.wait_for(t.closed, 5)
        assert isinstance(exc, OSError)
        assert t.fd == -1


def test_open_by_name_attaches_to_existing_tap():
    subprocess.run(["ip", "tuntap", "add", "dev", "aiopersist0", "mode", "tap"], check=True)
    try:
        t = TapTransport.open_by_name("aiopersist0")
        assert t.ifname == "aiopersist0" and t.fd >= 0
        with pytest.raises(TapError) as info:
            open_tap("aiopersist0")  # a second attach to a single-queue TAP: busy
        assert "in use" in str(info.value)
        t.close()
    finally:
        subprocess.run(["ip", "tuntap", "del", "dev", "aiopersist0", "mode", "tap"], check=True)


def test_bad_interface_name():
    with pytest.raises(TapError) as info:
        open_tap("bad/name")
    assert "interface name" in str(info.value)


# ----------------------------------------------------------------------------------------
# attach (as root)


def _ns_ip(pid: int, *args: str):
    out = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-j", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


async def test_attach_by_pid_configures_and_ends_with_target():
    target = start_target_namespace()
    made: list[FakeStack] = []

    def factory(config):
        made.append(FakeStack(config))
        return made[-1]

    try:
        task = asyncio.create_task(attach(NetworkConfig(mtu=1400), pid=target.pid, ifname="slirp0", stack_factory=factory))
        for _ in range(200):
            if made and made[0].started.is_set() or task.done():
                break
            await asyncio.sleep(0.05)
        assert not task.done(), task.result()
        (link,) = _ns_ip(target.pid, "addr", "show", "dev", "slirp0")
        assert link["mtu"] == 1400 and "UP" in link["flags"]
        assert [(a["local"], a["prefixlen"]) for a in link["addr_info"] if a["family"] == "inet"] == [("10.0.2.15", 24)]
        routes = _ns_ip(target.pid, "route", "show", "default")
        assert [(r["gateway"], r["dev"]) for r in routes] == [("10.0.2.2", "slirp0")]
        target.kill()
        assert await asyncio.wait_for(task, 10) == 0  # watched pid exited -> clean end
    finally:
        target.kill()
        target.wait()


async def test_attach_by_netns_path_until_closed():
    target = start_target_namespace()
    made: list[FakeStack] = []

    def factory(config):
        made.append(FakeStack(config))
        return made[-1]

    try:
        task = asyncio.create_task(attach(NetworkConfig(), netns_path=f"/proc/{target.pid}/ns/net", stack_factory=factory))
        for _ in range(200):
            if made and made[0].started.is_set() or task.done():
                break
            await asyncio.sleep(0.05)
        assert not task.done(), task.result()
        (link,) = _ns_ip(target.pid, "addr", "show", "dev", "tap0")
        assert link["ifname"] == "tap0"
        made[0].stop()
        assert await asyncio.wait_for(task, 10) == 0
    finally:
        target.kill()
        target.wait()


async def test_attach_errors_are_one_line():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(NamespaceError) as info:
        await attach(NetworkConfig(), pid=proc.pid, stack_factory=FakeStack)
    assert "no such process" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(NamespaceError) as info:
        await attach(NetworkConfig(), netns_path="/etc/hostname", stack_factory=FakeStack)
    assert "not a network namespace" in str(info.value)
    with pytest.raises(ValueError):
        await attach(NetworkConfig(), stack_factory=FakeStack)


# ----------------------------------------------------------------------------------------
# CLI


def cli(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aioslirp", *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize(
    "args, option",
    [
        (["run", "--mtu", "abc", "--", "true"], "--mtu"),
        (["run", "--mtu", "100", "--", "true"], "--mtu"),
        (["run", "--cidr", "10.0.2.0/30", "true"], "--cidr"),
        (["run", "--cidr", "banana", "true"], "--cidr"),
        (["run", "--dns", "not-an-ip", "true"], "--dns"),
        (["run", "--dns", "1.1.1.1:99999", "true"], "--dns"),
        (["run", "--dns-search", "a b", "true"], "--dns-search"),
        (["run", "--log-level", "loud", "true"], "--log-level"),
        (["run", "--ifname", "much-too-long-name", "true"], "--ifname"),
        (["attach"], "PID"),
        (["attach", "notapid"], "PID"),
        (["attach", "--bogus", "1"], "--bogus"),
    ],
)
def test_cli_argument_errors(args, option):
    p = cli(*args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert option in lines[0] and "Traceback" not in p.stderr


def test_cli_help_has_examples():
    p = cli("run", "--help")
    assert p.returncode == 0 and "examples:" in p.stdout and "aioslirp run --" in p.stdout
    p = cli("attach", "--help")
    assert p.returncode == 0 and "--netns PATH" in p.stdout


def test_cli_run_real_stack_exit_status_and_resolv_conf():
    p = cli("run", "--", "sh", "-c", "cat /etc/resolv.conf; ip -j addr show dev tap0; exit 7")
    assert p.returncode == 7, p.stderr
    assert "nameserver 10.0.2.3" in p.stdout.splitlines()
    assert '"local":"10.0.2.15"' in p.stdout
    assert "Traceback" not in p.stderr


def test_cli_run_real_stack_answers_arp_for_gateway():
    """The real Stack answers the guest's ARP for the gateway through the TAP."""
    script = (
        "import socket,subprocess,time\n"
        "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('10.0.2.2', 9))\n"
        "for _ in range(40):\n"
        "    out = subprocess.run(['ip', '-j', 'neigh', 'show', '10.0.2.2'], capture_output=True, text=True).stdout\n"
        "    if 'lladdr' in out: print(out); break\n"
        "    time.sleep(0.05)\n"
        "else: raise SystemExit(5)\n"
    )
    p = cli("run", "--", sys.executable, "-c", script)
    assert p.returncode == 0, p.stderr
    (neigh,) = json.loads(p.stdout.strip().splitlines()[-1])
    assert neigh["lladdr"] == "52:55:0a:00:02:02"


@pytest.mark.parametrize("how", ["sigterm", "sigint", "target-exits"])
def test_cli_attach_by_pid(how):
    target = start_target_namespace()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioslirp", "attach", "--mtu", "1400", str(target.pid), "eth7"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        link = None
        for _ in range(200):
            r = subprocess.run(["nsenter", "-t", str(target.pid), "-n", "ip", "-j", "addr", "show", "dev", "eth7"], capture_output=True, text=True)
            if r.returncode == 0 and '"10.0.2.15"' in r.stdout:
                (link,) = json.loads(r.stdout)
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        assert link is not None and link["mtu"] == 1400
        # No wait: the signal may come while attach still finishes its set-up (the handlers are
        # installed before the namespace is touched), and must still be a clean stop.
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how == "sigint":
            proc.send_signal(signal.SIGINT)
        else:
            target.kill()
        assert proc.wait(15) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        target.kill()
        target.wait()


def test_example_tap_bridge_serves_and_stops_on_sigterm():
    subprocess.run(["ip", "tuntap", "add", "dev", "aiobridge0", "mode", "tap"], check=True)
    try:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "tap_bridge.py"), "--ifname", "aiobridge0", "-v"],
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))),
        )
        deadline = time.monotonic() + 20
        # the TAP shows as carrier-on (LOWER_UP) once a process has it open
        while time.monotonic() < deadline:
            out = subprocess.run(["ip", "-j", "link", "show", "aiobridge0"], capture_output=True, text=True).stdout
            if "NO-CARRIER" not in out and proc.poll() is None:
                subprocess.run(["ip", "link", "set", "aiobridge0", "up"], check=True)
                out = subprocess.run(["ip", "-j", "link", "show", "aiobridge0"], capture_output=True, text=True).stdout
                if "LOWER_UP" in out:
                    break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "serving" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "tuntap", "del", "dev", "aiobridge0", "mode", "tap"], check=False)


# ----------------------------------------------------------------------------------------
# rootless: as an unprivileged user, with a world-readable virtualenv


@pytest.fixture(scope="module")
def rootless_env():
    """(python, bin_dir, workdir) of a venv from /usr/bin/python3 readable by everyone, aioslirp installed."""
    from support.worldvenv import Unavailable, build_world_venv

    need(SETPRIV, "setpriv (util-linux) is missing")
    work = Path(tempfile.mkdtemp(prefix="aioslirp-rootless-"))
    try:
        try:
            vpy, vbin = build_world_venv(work)
        except Unavailable as exc:
            need(False, str(exc))
        (work / "out").mkdir(mode=0o777)
        (work / "out").chmod(0o777)
        yield vpy, vbin, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def tun_mode(mode: int):
    old = stat.S_IMODE(os.stat("/dev/net/tun").st_mode)
    os.chmod("/dev/net/tun", mode)
    try:
        yield
    finally:
        os.chmod("/dev/net/tun", old)


def as_nobody(argv, work: Path, timeout: float = 40) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(work), "LANG": "C.UTF-8"}
    return subprocess.run(
        [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=work,
    )


_ROOTLESS_DRIVER = r'''
import asyncio, json, os, subprocess, sys, time
from aioslirp.config import NetworkConfig
from aioslirp.frontends.netns import attach, run_in_namespace

OUT = sys.argv[1]

class FakeStack:
    def __init__(self, config):
        self.transport = None
        self.started = asyncio.Event()
        self.frames = 0
    async def __aenter__(self): return self
    async def __aexit__(self, *exc):
        if self.transport: self.transport.close()
    async def serve(self, transport):
        self.transport = transport
        await transport.open(self.on_frames)
        self.started.set()
        await transport.closed
    def on_frames(self, frames): self.frames += len(frames)
    def stop(self):
        if self.transport: self.transport.close()

async def main():
    result = {"uid": os.getuid()}
    cmd = (f"id -u > {OUT}/uid; ip -j addr show dev tap0 > {OUT}/addr; ip -j route show default > {OUT}/route; "
           f"cat /etc/resolv.conf > {OUT}/resolv")
    result["run_rc"] = await asyncio.wait_for(run_in_namespace(
        NetworkConfig(mtu=1400, dns_search=["rootless.test"]), ["sh", "-c", cmd], stack_factory=FakeStack), 30)

    # attach by PID to a namespace this unprivileged user made (enters its user namespace)
    target = subprocess.Popen(["unshare", "-rn", "sleep", "30"])
    own = os.stat("/proc/self/ns/net").st_ino
    while os.stat(f"/proc/{target.pid}/ns/net").st_ino == own:
        time.sleep(0.01)
    stacks = []
    def factory(config):
        stacks.append(FakeStack(config)); return stacks[-1]
    task = asyncio.create_task(attach(NetworkConfig(), pid=target.pid, stack_factory=factory))
    while not (stacks and stacks[0].started.is_set()) and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        task.result()
    out = subprocess.run(["nsenter", "--preserve-credentials", "-U", "-n", "-t", str(target.pid),
                          "ip", "-j", "addr", "show", "dev", "tap0"], capture_output=True, text=True)
    result["attach_addr"] = out.stdout
    result["attach_err"] = out.stderr
    target.kill()
    result["attach_rc"] = await asyncio.wait_for(task, 10)
    target.wait()
    print(json.dumps(result))

asyncio.run(main())
'''


@pytest.mark.timeout(120)
def test_rootless_run_and_attach(rootless_env):
    vpy, vbin, work = rootless_env
    out = work / "out"
    driver = work / "driver.py"
    driver.write_text(_ROOTLESS_DRIVER)
    driver.chmod(0o644)

    # /dev/net/tun at 0600: one clear line, exit 1
    with tun_mode(0o600):
        p = as_nobody([str(vbin / "aioslirp"), "run", "--", "true"], work)
    assert p.returncode == 1, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "0666" in p.stderr, p.stderr

    with tun_mode(0o666):
        p = as_nobody([str(vpy), str(driver), str(out)], work, timeout=60)
        assert p.returncode == 0, p.stderr
        result = json.loads(p.stdout.strip().splitlines()[-1])
        # the console script and the real Stack, rootless: exit status and resolv.conf
        q = as_nobody([str(vbin / "aioslirp"), "run", "--", "sh", "-c",
                       "cat /etc/resolv.conf; ip -6 -o addr show dev tap0 scope global; exit 7"], work)
        # rootless data path: a real HTTP GET from a host server on loopback through the stack (IPv4, IPv6)
        from support.servers import DataServer, pattern
        srv = DataServer()
        srv6 = DataServer(host="::1")
        try:
            g = as_nobody([str(vbin / "aioslirp"), "run", "--", "sh", "-c",
                           f"curl -sS --max-time 20 http://10.0.2.2:{srv.port}/300000 | sha256sum; "
                           f"curl -sS -g --max-time 20 'http://[fd00::2]:{srv6.port}/300000' | sha256sum"],
                          work, timeout=60)
        finally:
            srv.close()
            srv6.close()
    assert g.returncode == 0, g.stderr
    assert g.stdout.split()[0::2] == [hashlib.sha256(pattern(300000, 1)).hexdigest()] * 2, g.stdout + g.stderr
    assert q.returncode == 7, q.stderr
    assert "nameserver 10.0.2.3" in q.stdout.splitlines() and "nameserver fd00::3" in q.stdout.splitlines()
    assert " inet6 fd00::" in q.stdout and "warning" not in q.stderr, q.stdout + q.stderr  # SLAAC, rootless

    assert result["uid"] == NOBODY and result["run_rc"] == 0
    assert (out / "uid").read_text().strip() == "0"  # mapped to root inside its user namespace
    (link,) = json.loads((out / "addr").read_text())
    assert link["mtu"] == 1400 and "UP" in link["flags"]
    assert [(a["local"], a["prefixlen"]) for a in link["addr_info"] if a["family"] == "inet"] == [("10.0.2.15", 24)]
    assert [(r["gateway"], r["dev"]) for r in json.loads((out / "route").read_text())] == [("10.0.2.2", "tap0")]
    resolv = (out / "resolv").read_text().splitlines()
    assert "nameserver 10.0.2.3" in resolv and "search rootless.test" in resolv

    assert result["attach_rc"] == 0
    assert result["attach_addr"], result["attach_err"]
    (alink,) = json.loads(result["attach_addr"])
    assert [(a["local"], a["prefixlen"]) for a in alink["addr_info"] if a["family"] == "inet"] == [("10.0.2.15", 24)]


# ------------------------------------------------------------------ the helper's reply, read once
def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_tap_reply_gives_the_one_fd_of_an_ok_and_closes_what_it_does_not_give():
    """The namespace child's answer as every parent reads it (``run``/``attach``, ``spawn``, the
    slirp4netns drop-in): ``ok`` with one fd is returned; a failure, an ``ok`` with a wrong number
    of fds, a malformed or empty reply leave no fd open."""
    from aioslirp.host.nsbase import NamespaceError
    from aioslirp.host.nschild import SetupError, tap_reply

    r, w = os.pipe()
    try:
        msg, fd = tap_reply(b'{"ok": true, "ifname": "tap0"}', [r])
        assert (msg["ifname"], fd) == ("tap0", r) and _fd_open(r)
    finally:
        os.close(r)
        os.close(w)
    r, w = os.pipe()
    with pytest.raises(NamespaceError, match=r"^no /dev/net/tun$"):
        tap_reply(b'{"ok": false, "error": "no /dev/net/tun"}', [r, w], NamespaceError, "namespace helper")
    assert not _fd_open(r) and not _fd_open(w)
    r, w = os.pipe()
    with pytest.raises(SetupError, match=r"^the namespace child did not pass the TAP fd$"):
        tap_reply(b'{"ok": true}', [r, w])
    assert not _fd_open(r) and not _fd_open(w)
    for data in (b"", b"{not json", b"[1]"):
        r, w = os.pipe()
        os.close(w)
        assert tap_reply(data, [r]) == (None, -1)
        assert not _fd_open(r)
