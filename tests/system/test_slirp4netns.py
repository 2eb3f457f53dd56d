"""``aioslirp-slirp4netns``: slirp4netns's command line, fd protocol and API, tested by value.

* Parser: the exact argv RootlessKit 1.1.0 and Podman 4.3.1 pass (see
  ``../shared/containers/README.md``), the forms getopt accepts, and one-line errors
  (exit status 2) naming the option.
* fd protocol in-process: :func:`aioslirp.cli.slirp4netns.serve` with a socket pair standing in
  for the TAP and the real :class:`~aioslirp.Stack`: the ready byte is written once, after
  the transport reads, after the API socket listens; an exit-fd hang-up ends it (status 0).
* The binary in real namespaces (as root, inside pytest's loopback-only namespace): TAP
  created and configured with ``-c`` by the time the ready byte arrives, or a TAP the caller
  made attached as is; data both ways (a host server reached via 10.0.2.2, a namespace
  server reached through ``add_hostfwd``); exit on exit-fd hang-up / SIGTERM / target exit;
  failures before the ready byte; ``--enable-sandbox --enable-seccomp`` as root and as an
  unprivileged user.
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
import time
from pathlib import Path

import dpkt
import pytest

from aioslirp.cli import slirp4netns as s4
from aioslirp.cli.slirp4netns import HELP, UsageError, build_config, parse_args

from support.prereqs import need
from support.servers import DataServer, DnsUpstream, free_port, pattern

SETPRIV = shutil.which("setpriv")
#: Seconds an exit (hang-up, SIGTERM, target gone) may take before the test calls it a hang.
#: Only a guard against hanging: no latency bound (a loaded machine is slow, not wrong).
EXIT_GUARD = 30
UNSHARE = shutil.which("unshare")
NSENTER = shutil.which("nsenter")
NOBODY = 65534
GUEST_MAC = bytes.fromhex("020000000064")


# ----------------------------------------------------------------------------------------
# argv parser


def test_rootlesskit_argv():
    o = parse_args(["--mtu", "65520", "-r", "3", "--disable-host-loopback", "16111", "tap0"])
    assert (o.netns_type, o.pid, o.target, o.tapname) == ("pid", 16111, "16111", "tap0")
    assert (o.mtu, o.ready_fd, o.exit_fd, o.api_socket) == (65520, 3, None, None)
    assert o.disable_host_loopback and not o.configure and not o.enable_ipv6
    o = parse_args(["--mtu", "1500", "-r", "3", "--cidr", "10.0.3.0/24", "16295", "tap0"])
    assert (o.mtu, o.cidr, o.disable_host_loopback) == (1500, "10.0.3.0/24", False)
    o = parse_args(["--mtu", "65520", "-r", "3", "--disable-host-loopback", "--api-socket", "/st/.s4nn.sock", "1", "tap0"])
    assert o.api_socket == "/st/.s4nn.sock"
    o = parse_args(["--mtu", "9000", "-r", "3", "--disable-host-loopback", "--enable-ipv6", "26229", "tap0"])
    assert o.enable_ipv6 and o.mtu == 9000
    o = parse_args(["--mtu", "65520", "-r", "3", "--disable-host-loopback", "--enable-sandbox", "--enable-seccomp", "30964", "tap0"])
    assert o.enable_sandbox and o.enable_seccomp


def test_podman_argv():
    o = parse_args("--mtu=65520 --enable-sandbox --enable-seccomp --enable-ipv6 -c -e 3 -r 4 "
                   "--netns-type=path /run/netns/netns-UUID tap0".split())
    assert (o.netns_type, o.target, o.pid, o.tapname) == ("path", "/run/netns/netns-UUID", None, "tap0")
    assert (o.configure, o.exit_fd, o.ready_fd, o.mtu) == (True, 3, 4, 65520)
    assert o.enable_sandbox and o.enable_seccomp and o.enable_ipv6 and not o.disable_host_loopback
    o = parse_args(["--disable-host-loopback", "--mtu=65520", "--enable-sandbox", "--enable-seccomp", "--enable-ipv6",
                    "-c", "-e", "3", "-r", "4", "--api-socket", "/tmp/t/" + "a" * 64 + ".net",
                    "--netns-type=path", "/run/netns/x", "tap0"])
    assert o.api_socket.endswith(".net") and o.disable_host_loopback
    # P5: the rootless netns, no exit fd
    o = parse_args("--mtu=65520 --enable-sandbox --enable-seccomp --enable-ipv6 -c -r 3 --netns-type=path /x/rootless-netns-h tap0".split())
    assert (o.exit_fd, o.ready_fd) == (None, 3)


def test_getopt_forms():
    o = parse_args(["-r3", "-e4", "-m1400", "-6", "-a", "/s", "-c", "--userns-path=/proc/1/ns/user", "--netns-type", "pid", "7", "eth9"])
    assert (o.ready_fd, o.exit_fd, o.mtu, o.enable_ipv6, o.api_socket, o.configure) == (3, 4, 1400, True, "/s", True)
    assert (o.userns_path, o.pid, o.tapname) == ("/proc/1/ns/user", 7, "eth9")
    o = parse_args(["--ready-fd=5", "--exit-fd", "6", "--api-socket=/a", "--macaddress", "02:AB:00:00:00:01", "-c", "9", "tap0"])
    assert (o.ready_fd, o.exit_fd, o.api_socket, o.macaddress) == (5, 6, "/a", "02:ab:00:00:00:01")
    o = parse_args(["--no-host-loopback", "--create-sandbox", "--disable-dns", "--target-type=netns", "9", "tap0"])
    assert o.disable_host_loopback and o.enable_sandbox and o.disable_dns
    # options after the positionals, and extra positionals (slirp4netns only warns)
    o = parse_args(["9", "tap0", "--mtu=1500", "extra"])
    assert (o.mtu, o.extra_args) == (1500, ["extra"])
    o = parse_args(["--netns-type=tapfd", "5"])
    assert (o.tap_fd, o.tapname) == (5, None)


@pytest.mark.parametrize("argv, option", [
    (["--mtu=abc", "1", "tap0"], "--mtu"),
    (["--mtu=70000", "1", "tap0"], "--mtu"),
    (["--mtu=100", "1", "tap0"], "--mtu"),
    (["--cidr=10.0.2.100/24", "1", "tap0"], "--cidr"),
    (["--cidr=10.0.0.0/26", "1", "tap0"], "--cidr"),
    (["--cidr=banana", "1", "tap0"], "--cidr"),
    (["--cidr=10.0.2.0", "1", "tap0"], "--cidr"),
    (["abc", "tap0"], "PID"),
    (["0", "tap0"], "PID"),
    (["1"], "TAPNAME"),
    ([], "PID"),
    (["1", "tap0/x"], "TAPNAME"),
    (["1", "a-very-long-interface-name"], "TAPNAME"),
    (["--netns-type=ns", "1", "tap0"], "--netns-type"),
    (["--macaddress=02:00:00:00:00:01", "1", "tap0"], "--macaddress"),
    (["-c", "--macaddress=zz:00:00:00:00:01", "1", "tap0"], "--macaddress"),
    (["-c", "--macaddress=01:00:00:00:00:01", "1", "tap0"], "--macaddress"),
    (["--target-type=bess", "/sock"], "--target-type"),
    (["-r", "-1", "1", "tap0"], "--ready-fd"),
    (["--exit-fd=x", "1", "tap0"], "--exit-fd"),
    (["-r", "3", "-e", "3", "1", "tap0"], "--ready-fd"),
    (["--outbound-addr=127.0.0.1", "1", "tap0"], "--outbound-addr"),
    (["--outbound-addr6=::1", "1", "tap0"], "--outbound-addr6"),
    (["--api-socket=/" + "x" * 120, "1", "tap0"], "--api-socket"),
    (["--log-level=loud", "1", "tap0"], "--log-level"),
    (["-c", "--netns-type=tapfd", "3"], "--configure"),
])
def test_bad_options_one_line_exit_2(argv, option, capsys):
    with pytest.raises(UsageError) as err:
        parse_args(argv)
    assert str(err.value).startswith(option + ":"), str(err.value)
    assert s4.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{s4.PROG}: error: {option}:"), out.err


def test_unknown_option_exit_2(capsys):
    assert s4.main(["--frobnicate", "1", "tap0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--frobnicate" in err


def test_help_is_an_api(capsys):
    """RootlessKit and Podman grep --help for these option names; --help exits 0 on stdout."""
    assert s4.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out == HELP
    for flag in ("--netns-type", "--userns-path", "--cidr", "--disable-host-loopback", "--api-socket",
                 "--enable-sandbox", "--enable-seccomp", "--mtu", "--enable-ipv6", "--outbound-addr",
                 "--configure", "--exit-fd", "--ready-fd", "--disable-dns", "--macaddress"):
        assert flag in out, flag
    assert s4.main(["-h"]) == 0 and capsys.readouterr().out == HELP
    # anywhere on the line, like getopt (clients only ever pass it alone)
    assert s4.main(["1", "tap0", "--help"]) == 0 and capsys.readouterr().out == HELP
    assert s4.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"{s4.PROG} version ")


def test_help_is_fast_and_light():
    """Clients run --help before every start: it must not import the stack."""
    code = "import sys; from aioslirp.cli.slirp4netns import main; main(['--help']); print(sorted(m for m in sys.modules if m.startswith(('aioslirp.stack', 'pyroute2', 'uvloop', 'dpkt'))))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


def test_cli_subcommand_and_console_script():
    p = subprocess.run([sys.executable, "-m", "aioslirp", "slirp4netns", "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout == HELP
    p = subprocess.run([sys.executable, "-m", "aioslirp", "slirp4netns", "--mtu=1", "1", "tap0"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.startswith("aioslirp-slirp4netns: error: --mtu:")
    script = Path(sys.executable).parent / "aioslirp-slirp4netns"
    if script.exists():
        p = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and "--netns-type" in p.stdout


def test_defaults_slirp4netns_users_rely_on():
    c = build_config(parse_args(["1", "tap0"]))
    assert (str(c.cidr), str(c.gateway), str(c.dns), str(c.guest), c.mtu) == ("10.0.2.0/24", "10.0.2.2", "10.0.2.3", "10.0.2.100", 1500)
    assert c.disable_host_loopback is False
    c = build_config(parse_args(["--cidr=10.0.3.0/24", "--mtu=65520", "--disable-host-loopback", "1", "tap0"]))
    assert (str(c.gateway), str(c.dns), str(c.guest), c.mtu, c.disable_host_loopback) == ("10.0.3.2", "10.0.3.3", "10.0.3.100", 65520, True)
    c = build_config(parse_args(["--cidr=172.16.0.0/16", "1", "tap0"]))
    assert (str(c.gateway), str(c.guest)) == ("172.16.0.2", "172.16.0.100")


def test_check_environment_names_the_option():
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(UsageError, match="^--ready-fd: "):
        s4.check_environment(parse_args(["-r", str(w), "1", "tap0"]))
    with pytest.raises(UsageError, match="^--exit-fd: "):
        s4.check_environment(parse_args(["-e", str(r), "1", "tap0"]))
    with pytest.raises(UsageError, match="^PATH: "):
        s4.check_environment(parse_args(["--netns-type=path", "/nonexistent/netns", "tap0"]))
    with pytest.raises(UsageError, match="^--userns-path: "):
        s4.check_environment(parse_args(["--userns-path=/nonexistent/user", "1", "tap0"]))


# ----------------------------------------------------------------------------------------
# fd protocol in-process: a socket pair is the TAP, the Stack is real


def _arp_request(target: str) -> bytes:
    arp = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REQUEST, sha=GUEST_MAC, spa=socket.inet_aton("10.0.2.100"),
                       tha=b"\x00" * 6, tpa=socket.inet_aton(target))
    return bytes(dpkt.ethernet.Ethernet(dst=b"\xff" * 6, src=GUEST_MAC, type=dpkt.ethernet.ETH_TYPE_ARP, data=arp))


def _dns_query_frame(qid: int, name: str) -> bytes:
    q = dpkt.dns.DNS(id=qid, rd=1, qd=[dpkt.dns.DNS.Q(name=name, type=dpkt.dns.DNS_A, cls=dpkt.dns.DNS_IN)])
    udp = dpkt.udp.UDP(sport=40000, dport=53, data=bytes(q))
    udp.ulen = len(udp)
    ip = dpkt.ip.IP(src=socket.inet_aton("10.0.2.100"), dst=socket.inet_aton("10.0.2.3"), p=dpkt.ip.IP_PROTO_UDP, ttl=64, data=udp)
    return bytes(dpkt.ethernet.Ethernet(dst=bytes.fromhex("525500000202"), src=GUEST_MAC, type=dpkt.ethernet.ETH_TYPE_IP, data=ip))


async def _recv_frame(sock: socket.socket, want, timeout: float = 3.0):
    """Next frame from the stack for which ``want(eth)`` is true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = deadline - loop.time()
        assert left > 0, "no matching frame from the stack"
        data = await asyncio.wait_for(loop.sock_recv(sock, 70000), left)
        eth = dpkt.ethernet.Ethernet(data)
        if want(eth):
            return eth


class _Harness:
    """``serve()`` on a SOCK_SEQPACKET pair with a ready pipe, an exit pipe and an API socket."""

    def __init__(self, tmp_path: Path, extra: list[str] | None = None, api: bool = True, upstream=None) -> None:
        self.ready_r, self.ready_w = os.pipe()
        self.exit_r, self.exit_w = os.pipe()
        self.api_path = str(tmp_path / "api.sock") if api else None
        argv = ["-c", "-r", str(self.ready_w), "-e", str(self.exit_r), "--netns-type=path", "/dev/null", "tap0", *(extra or [])]
        if api:
            argv[:0] = ["--api-socket", self.api_path]
        self.opts = parse_args(argv)
        self.config = build_config(self.opts)
        if upstream is not None:
            self.config.dns_upstreams = [("127.0.0.1", upstream)]
        self.guest, tap = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.guest.setblocking(False)
        self.stacks: list = []
        from aioslirp.stack import Stack

        def factory(config):
            self.stacks.append(Stack(config))
            return self.stacks[-1]

        self.task = asyncio.create_task(s4.serve(self.opts, self.config, tap.detach(), "tap0", stack_factory=factory))

    async def ready(self, timeout: float = 5.0) -> bytes:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.add_reader(self.ready_r, lambda: fut.done() or fut.set_result(None))
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            loop.remove_reader(self.ready_r)
        return os.read(self.ready_r, 100)

    def close(self) -> None:
        for fd in (self.ready_r, self.exit_r, self.exit_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.close(self.ready_w)  # closed by serve() after the ready byte; here when it failed first
        self.guest.close()


async def _api(path: str, request: dict) -> tuple[bytes, bytes]:
    """One request the way Podman does it: write, shut down writing, a single read of 2,048 bytes."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.setblocking(False)
        await loop.sock_connect(c, path)
        await loop.sock_sendall(c, json.dumps(request).encode() + b"\n")
        c.shutdown(socket.SHUT_WR)
        first = await asyncio.wait_for(loop.sock_recv(c, 2048), 5)
        rest = await asyncio.wait_for(loop.sock_recv(c, 2048), 5)
    return first, rest


async def test_ready_once_after_attach_and_api_then_exit_on_hangup(tmp_path):
    h = _Harness(tmp_path)
    try:
        data = await h.ready()
        assert data == b"1"
        assert os.read(h.ready_r, 100) == b""  # written once, then the fd was closed
        # ready means: the transport reads (an ARP request for the gateway is answered) ...
        h.guest.send(_arp_request("10.0.2.2"))
        eth = await _recv_frame(h.guest, lambda e: e.type == dpkt.ethernet.ETH_TYPE_ARP)
        assert eth.data.op == dpkt.arp.ARP_OP_REPLY and eth.data.spa == socket.inet_aton("10.0.2.2")
        # ... and the API socket listens; replies come in one read, "" means CIDR+100
        first, rest = await _api(h.api_path, {"execute": "add_hostfwd", "arguments": {
            "proto": "tcp", "host_addr": "127.0.0.1", "host_port": free_port(), "guest_addr": "", "guest_port": 80}})
        assert json.loads(first) == {"return": {"id": 1}} and rest == b""
        first, _ = await _api(h.api_path, {"execute": "list_hostfwd"})
        entries = json.loads(first)["return"]["entries"]
        assert [(e["id"], e["guest_addr"], e["guest_port"]) for e in entries] == [(1, "10.0.2.100", 80)]
        first, _ = await _api(h.api_path, {"execute": "remove_hostfwd", "arguments": {"id": 1}})
        assert json.loads(first) == {"return": {}}
        first, _ = await _api(h.api_path, {"execute": "nope"})
        assert "error" in json.loads(first)
        # the exit fd hangs up: serve() returns 0 (the guard only catches a hang), the API socket file is gone
        os.close(h.exit_w)
        assert await asyncio.wait_for(h.task, EXIT_GUARD) == 0
        assert not os.path.exists(h.api_path)
    finally:
        if not h.task.done():
            h.task.cancel()
            await asyncio.gather(h.task, return_exceptions=True)
        h.close()


async def test_no_ready_byte_when_the_api_socket_fails(tmp_path):
    h = _Harness(tmp_path / "missing-dir")
    try:
        with pytest.raises(s4.SetupError, match="--api-socket"):
            await asyncio.wait_for(h.task, 5)
        assert not _closed(h.ready_w)  # left for the process exit to close
        os.close(h.ready_w)
        assert os.read(h.ready_r, 100) == b""  # nothing was written
    finally:
        h.close()


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
        return False
    except OSError:
        return True


async def test_sigterm_ends_serve_cleanly(tmp_path):
    h = _Harness(tmp_path)
    try:
        assert await h.ready() == b"1"
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(h.task, EXIT_GUARD) == 0
        assert not os.path.exists(h.api_path)
    finally:
        h.close()


@pytest.mark.parametrize("disable", [False, True])
async def test_disable_dns(tmp_path, disable):
    up = DnsUpstream()
    h = _Harness(tmp_path, ["--disable-dns"] if disable else [], api=False, upstream=up.port)
    try:
        assert await h.ready() == b"1"
        h.guest.send(_dns_query_frame(0x1234, "example.test"))
        eth = await _recv_frame(h.guest, lambda e: e.type == dpkt.ethernet.ETH_TYPE_IP and isinstance(e.data.data, dpkt.udp.UDP))
        reply = dpkt.dns.DNS(eth.data.data.data)
        assert reply.id == 0x1234
        if disable:
            assert reply.rcode == dpkt.dns.DNS_RCODE_SERVFAIL and up.udp_queries == 0
        else:
            assert reply.rcode == 0 and [socket.inet_ntoa(a.ip) for a in reply.an] == ["10.0.2.99"]
        os.close(h.exit_w)
        assert await asyncio.wait_for(h.task, 1.0) == 0
    finally:
        up.close()
        h.close()


# ----------------------------------------------------------------------------------------
# the binary, in real namespaces (root, inside pytest's loopback-only namespace)


@pytest.fixture
def ns_prerequisites():
    need(os.geteuid() == 0 and os.path.exists("/dev/net/tun") and UNSHARE and NSENTER,
         "needs root, /dev/net/tun, unshare and nsenter")


needs_ns = pytest.mark.usefixtures("ns_prerequisites")

_NS_SERVER = r"""
import hashlib, random, socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 80))
srv.listen(8)
print("listening", flush=True)
while True:
    c, _ = srv.accept()
    with c:
        n = int(c.recv(100).split()[0])
        c.sendall(random.Random(7).randbytes(n))
"""


@contextlib.contextmanager
def target_namespace(*argv: str, rootless: bool = False, env=None):
    """A process in a new network namespace (``unshare -n``, or ``-rn`` as an unprivileged user)."""
    cmd = [UNSHARE, "-rn" if rootless else "-n", *(argv or ("sleep", "120"))]
    if rootless:
        cmd = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        own = os.stat("/proc/self/ns/net").st_ino
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{p.pid}/ns/net").st_ino == own:
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else "timeout"
            time.sleep(0.01)
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()


def in_ns(pid: int, *argv: str, rootless: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
    cmd = [NSENTER, "-t", str(pid), "-n", *argv]
    if rootless:
        cmd = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
               NSENTER, "--preserve-credentials", "-U", "-t", str(pid), "-n", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class Binary:
    """The slirp4netns binary under test, started with a ready pipe and an exit pipe."""

    def __init__(self, args: list[str], *, exe: list[str] | None = None, exit_fd: bool = True, prefix=(), env=None) -> None:
        self.ready_r, ready_w = os.pipe()
        self.exit_r = self.exit_w = None
        fds = [ready_w]
        opts = ["-r", str(ready_w)]
        if exit_fd:
            exit_r, self.exit_w = os.pipe()
            fds.append(exit_r)
            opts += ["-e", str(exit_r)]
        argv = [*prefix, *(exe or [sys.executable, "-m", "aioslirp", "slirp4netns"]), *opts, *args]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, pass_fds=fds, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for fd in fds:
            os.close(fd)

    def wait_ready(self, timeout: float = 20) -> bytes:
        import select

        r, _, _ = select.select([self.ready_r], [], [], timeout)
        assert r, f"no ready byte within {timeout} s"
        data = os.read(self.ready_r, 100)
        self.ready_after = time.monotonic() - self.t0
        return data

    def hang_up(self) -> int:
        """Close the exit fd's write end; returns the binary's exit status (waits at most EXIT_GUARD s)."""
        os.close(self.exit_w)
        self.exit_w = None
        return self.proc.wait(EXIT_GUARD)

    def close(self) -> tuple[str, str]:
        if self.proc.poll() is None:
            self.proc.kill()
        out, err = self.proc.communicate(timeout=10)
        for fd in (self.ready_r, self.exit_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return out, err


def _link(pid: int, ifname: str = "tap0", rootless: bool = False) -> dict:
    p = in_ns(pid, "ip", "-j", "addr", "show", "dev", ifname, rootless=rootless)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)[0]


FETCH = r"""
import hashlib, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=20)
s.sendall(f"GET /{n} HTTP/1.0\r\n\r\n".encode() if port != 80 else f"{n}\n".encode())
buf = b""
while True:
    d = s.recv(1 << 16)
    if not d:
        break
    buf += d
if port != 80:
    buf = buf.split(b"\r\n\r\n", 1)[1]
print(len(buf), hashlib.sha256(buf).hexdigest())
"""


@needs_ns
def test_binary_configures_serves_forwards_and_exits_on_hangup(tmp_path):
    """Podman's call (-c, -e, -r, --api-socket, --netns-type=path, --enable-ipv6) against a real namespace."""
    srv = DataServer()
    srv6 = DataServer(host="::1")
    api = str(tmp_path / "s4.net")
    try:
        with target_namespace(sys.executable, "-c", _NS_SERVER) as target:
            assert target.stdout.readline().strip() == "listening"
            b = Binary(["--mtu=65520", "--enable-ipv6", "-c", "--api-socket", api, "--netns-type=path",
                        f"/proc/{target.pid}/ns/net", "tap0"])
            try:
                assert b.wait_ready() == b"1"
                assert os.read(b.ready_r, 10) == b""  # once, then closed
                # at the ready byte: TAP attached (carrier) and configured
                link = _link(target.pid)
                assert "UP" in link["flags"] and "LOWER_UP" in link["flags"] and "NO-CARRIER" not in link["flags"]
                assert link["mtu"] == 65520
                assert [(a["local"], a["prefixlen"]) for a in link["addr_info"] if a["family"] == "inet"] == [("10.0.2.100", 24)]
                # the TAP carries a virtio-net header: checksum/segmentation offload (docs/slirp4netns.md)
                info = json.loads(in_ns(target.pid, "ip", "-d", "-j", "link", "show", "tap0").stdout)[0]["linkinfo"]
                assert info["info_data"]["vnet_hdr"] is True
                route = json.loads(in_ns(target.pid, "ip", "-j", "route", "show", "default").stdout)
                assert [(r["gateway"], r["dev"]) for r in route] == [("10.0.2.2", "tap0")]
                assert "UP" in _link(target.pid, "lo")["flags"]
                # namespace -> host through 10.0.2.2
                p = in_ns(target.pid, sys.executable, "-c", FETCH, "10.0.2.2", str(srv.port), "300000")
                assert p.returncode == 0, p.stderr
                assert p.stdout.split() == ["300000", hashlib.sha256(pattern(300000, 1)).hexdigest()]
                # --enable-ipv6: SLAAC in fd00::/64 from our RA, then namespace -> host's ::1 through fd00::2
                deadline = time.monotonic() + 10
                while not [a for a in _link(target.pid)["addr_info"] if a["family"] == "inet6" and a["scope"] == "global"]:
                    assert time.monotonic() < deadline, _link(target.pid)
                    time.sleep(0.05)
                (g6,) = [a for a in _link(target.pid)["addr_info"] if a["family"] == "inet6" and a["scope"] == "global"]
                assert g6["local"].startswith("fd00::") and g6["prefixlen"] == 64
                p = in_ns(target.pid, sys.executable, "-c", FETCH, "fd00::2", str(srv6.port), "200000")
                assert p.returncode == 0, p.stderr
                assert p.stdout.split() == ["200000", hashlib.sha256(pattern(200000, 1)).hexdigest()]
                # host -> namespace through add_hostfwd with guest_addr "" (= 10.0.2.100), one read
                hp = free_port()
                with socket.socket(socket.AF_UNIX) as c:
                    c.connect(api)
                    c.sendall(json.dumps({"execute": "add_hostfwd", "arguments": {"proto": "tcp", "host_addr": "127.0.0.1",
                                          "host_port": hp, "guest_addr": "", "guest_port": 80}}).encode() + b"\n")
                    c.shutdown(socket.SHUT_WR)
                    assert json.loads(c.recv(2048)) == {"return": {"id": 1}}
                with socket.create_connection(("127.0.0.1", hp), timeout=10) as c:
                    c.sendall(b"1000000\n")
                    got = b""
                    while (d := c.recv(1 << 16)):
                        got += d
                import random
                assert hashlib.sha256(got).hexdigest() == hashlib.sha256(random.Random(7).randbytes(1000000)).hexdigest()
                # exit fd hang-up: a clean exit, API socket removed
                assert b.hang_up() == 0
                assert not os.path.exists(api)
            finally:
                out, err = b.close()
            assert "Recommended IP:  10.0.2.100" in out
            assert "* IPv6 gateway:    fd00::2" in out
    finally:
        srv.close()
        srv6.close()


@needs_ns
def test_binary_attaches_to_callers_tap_and_stops_on_sigterm(tmp_path):
    """RootlessKit's call: PID TAPNAME without -c, the TAP made (and set up) by the caller."""
    with target_namespace() as target:
        for cmd in (["ip", "tuntap", "add", "name", "tap0", "mode", "tap"], ["ip", "link", "set", "tap0", "up"],
                    ["ip", "addr", "add", "10.0.3.100/24", "dev", "tap0"]):
            assert in_ns(target.pid, *cmd).returncode == 0
        assert "NO-CARRIER" in _link(target.pid)["flags"]
        b = Binary(["--mtu", "1500", "--cidr", "10.0.3.0/24", "--disable-host-loopback", str(target.pid), "tap0"], exit_fd=False)
        try:
            assert b.wait_ready() == b"1"
            link = _link(target.pid)
            assert "LOWER_UP" in link["flags"] and "NO-CARRIER" not in link["flags"]
            # not reconfigured: the caller's address only, no route added
            assert [a["local"] for a in link["addr_info"] if a["family"] == "inet"] == ["10.0.3.100"]
            assert json.loads(in_ns(target.pid, "ip", "-j", "route", "show", "default").stdout) == []
            # the gateway is CIDR+2 and answers ARP; host loopback through it is refused at once
            assert in_ns(target.pid, "ip", "route", "add", "default", "via", "10.0.3.2").returncode == 0
            p = in_ns(target.pid, sys.executable, "-c",
                      "import socket,time; t=time.monotonic()\ntry:\n socket.create_connection(('10.0.3.2', 9), timeout=5)\n"
                      "except ConnectionRefusedError: print('refused', time.monotonic()-t)")
            assert p.stdout.split()[0] == "refused", p.stdout + p.stderr  # an RST (a hang ends in a timeout error)
            b.proc.send_signal(signal.SIGTERM)
            assert b.proc.wait(EXIT_GUARD) == 0
        finally:
            b.close()


@needs_ns
def test_binary_exits_when_the_target_process_exits():
    with target_namespace() as target:
        b = Binary(["-c", str(target.pid), "tap0"], exit_fd=False)
        try:
            assert b.wait_ready() == b"1"
            target.kill()
            target.wait()
            assert b.proc.wait(EXIT_GUARD) == 0
        finally:
            b.close()


@needs_ns
def test_binary_setup_failure_before_ready():
    # a PID that is gone by the time the child looks
    p = subprocess.Popen(["true"])
    p.wait()
    b = Binary(["-c", str(p.pid), "tap0"])
    try:
        assert b.proc.wait(10) == 1
        assert os.read(b.ready_r, 10) == b""  # the ready fd closed without a byte
    finally:
        out, err = b.close()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"aioslirp-slirp4netns: error: process {p.pid} does not exist", err
    # a file that is not a network namespace
    b = Binary(["-c", "--netns-type=path", "/proc/self/ns/user", "tap0"])
    try:
        assert b.proc.wait(10) == 1
    finally:
        out, err = b.close()
    assert "is not a network namespace" in err and len(err.strip().splitlines()) == 1, err


def _status(pid: int) -> dict:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


@needs_ns
def test_binary_sandbox_and_seccomp_as_root(tmp_path):
    srv = DataServer()
    try:
        with target_namespace() as target:
            api = str(tmp_path / "api.sock")
            b = Binary(["--enable-sandbox", "--enable-seccomp", "-c", "--api-socket", api, "--netns-type=path",
                        f"/proc/{target.pid}/ns/net", "tap0"])
            try:
                assert b.wait_ready() == b"1"
                st = _status(b.proc.pid)
                assert int(st["CapEff"], 16) == 1 << 10 and int(st["CapBnd"], 16) == 1 << 10  # CAP_NET_BIND_SERVICE only
                assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
                visible = sorted(os.listdir(f"/proc/{b.proc.pid}/root"))
                assert "etc" in visible and "run" in visible and "usr" in visible
                for hidden in ("proc", "sys", "dev", "home", "var", "srv"):
                    assert hidden not in visible, visible
                # the data path still works: flows, lazily imported modules, host sockets
                p = in_ns(target.pid, sys.executable, "-c", FETCH, "10.0.2.2", str(srv.port), "200000")
                assert p.stdout.split() == ["200000", hashlib.sha256(pattern(200000, 1)).hexdigest()], p.stderr
                # the API still answers (its socket was bound before the sandbox)
                with socket.socket(socket.AF_UNIX) as c:
                    c.connect(api)
                    c.sendall(b'{"execute":"list_hostfwd"}')
                    c.shutdown(socket.SHUT_WR)
                    assert json.loads(c.recv(2048))["return"] == {"entries": []}
                assert b.hang_up() == 0
                assert not os.path.exists(api)  # removed from inside the sandbox, through a held folder fd
            finally:
                out, err = b.close()
            assert "Traceback" not in err, err
    finally:
        srv.close()


# ----------------------------------------------------------------------------------------
# unprivileged: RootlessKit's situation (the binary runs as a plain user), with the sandbox


@pytest.fixture(scope="module")
def world_venv():
    from support.worldvenv import Unavailable, build_world_venv

    need(os.geteuid() == 0 and SETPRIV, "needs root and setpriv to run as an unprivileged user")
    work = Path(tempfile.mkdtemp(prefix="aioslirp-s4nn-"))
    try:
        try:
            vpy, vbin = build_world_venv(work)
        except Unavailable as exc:
            need(False, str(exc))
        yield vpy, vbin
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


@needs_ns
@pytest.mark.timeout(180)
def test_binary_rootless_pid_type_with_sandbox(world_venv, tmp_path):
    vpy, vbin = world_venv
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/", "LANG": "C.UTF-8"}
    srv = DataServer()
    try:
        with tun_mode(0o666), target_namespace(rootless=True, env=env) as target:
            b = Binary(["--mtu=65520", "--enable-sandbox", "--enable-seccomp", "-c", str(target.pid), "tap0"],
                       exe=[str(vbin / "aioslirp-slirp4netns")],
                       prefix=[SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"], env=env)
            try:
                assert b.wait_ready() == b"1", b.close()
                st = _status(b.proc.pid)
                assert st["Uid"].split()[0] == str(NOBODY) and st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
                # still in the host's network namespace (pytest's), never the target's
                assert os.stat(f"/proc/{b.proc.pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
                link = _link(target.pid, rootless=True)
                assert [(a["local"], a["prefixlen"]) for a in link["addr_info"] if a["family"] == "inet"] == [("10.0.2.100", 24)]
                p = in_ns(target.pid, str(vpy), "-c", FETCH, "10.0.2.2", str(srv.port), "200000", rootless=True)
                assert p.stdout.split() == ["200000", hashlib.sha256(pattern(200000, 1)).hexdigest()], p.stderr
                b.proc.send_signal(signal.SIGTERM)
                assert b.proc.wait(EXIT_GUARD) == 0
            finally:
                out, err = b.close()
            assert "Traceback" not in err, err
    finally:
        srv.close()
