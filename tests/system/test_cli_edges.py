"""Rough edges a new user hit on the command line, each checked against the real command.

The rule: bad user input (an option, a config value) is one line naming the option, exit
status 2, no traceback, before anything is set up; a failure of an optional output while
running (a trace file, an OTLP endpoint) is one warning line and never changes the exit
status of ``aioslirp run`` (the command's). pytest runs in a loopback-only namespace
(conftest.py): the OTLP endpoints, forwards and namespaces here stay inside it.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from aioslirp.config import NetworkConfig
from aioslirp.errors import ConfigError
from aioslirp.transport.framing import StreamDecoder

from support.namespaces import start_target_namespace
from support.prereqs import importable, need
from support.servers import free_port

pytestmark = pytest.mark.netns

OTLP_HTTP = "opentelemetry.exporter.otlp.proto.http.trace_exporter"  # in the test extra

#: Words of Python's ipaddress module that must not reach the user.
IPADDRESS_WORDING = ("octets", "Expected", "parts expected", "does not appear to be", "Octet", "permitted",
                     "Invalid netmask", "Only hex digits")

need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")


def aioslirp(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aioslirp", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def one_line(p: subprocess.CompletedProcess) -> str:
    """The single stderr line of ``p`` (asserts there is exactly one and no traceback)."""
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def usage_error(p: subprocess.CompletedProcess, option: str) -> str:
    """Assert ``p`` failed as bad user input naming ``option``; returns the message."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    line = one_line(p)
    assert line.startswith(f"aioslirp: error: {option}: "), line
    return line


# ----------------------------------------------------------------------------------------
# 1. --trace FILE (and --pcap FILE) that cannot be written


@pytest.mark.parametrize("target", ["/dev/full", "/proc/version", "missing-dir", "a-directory"])
def test_unwritable_trace_file_is_one_line_exit_2(tmp_path, target):
    path = {"missing-dir": str(tmp_path / "no" / "t.jsonl"), "a-directory": str(tmp_path)}.get(target, target)
    p = aioslirp("run", "--trace", path, "--", "true")
    line = usage_error(p, "--trace")
    if target == "/dev/full":
        assert line == "aioslirp: error: --trace: cannot write '/dev/full': No space left on device"


def test_unwritable_pcap_file_is_one_line_exit_2():
    p = aioslirp("run", "--pcap", "/dev/full", "--", "true")
    assert usage_error(p, "--pcap") == "aioslirp: error: --pcap: cannot write '/dev/full': No space left on device"


def test_trace_write_failing_later_is_one_warning_and_keeps_the_exit_status(tmp_path):
    """A file size limit of 300 bytes: the startup probe (zero bytes) passes, the first batch of
    spans (one span line is longer) fails with EFBIG. One warning line, the command's status."""
    path = tmp_path / "spans.jsonl"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.RLIM_INFINITY))

    # at --trace-level frames the guest's own frames (router solicitation...) make spans, with no flow
    p = aioslirp("run", "--trace", str(path), "--trace-level", "frames", "--", "sh", "-c", "exit 5", preexec_fn=limit)
    assert p.returncode == 5, p.stderr
    line = one_line(p)
    assert line == (f"aioslirp: WARNING: --trace {path}: cannot write spans (File too large); "
                    "spans from now on are not recorded")
    assert path.stat().st_size <= 300


def test_json_exporter_write_error_is_logged_once_and_counted(tmp_path, caplog):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    from aioslirp.cli.observe import JsonLinesSpanExporter

    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("test")
    spans = []
    for i in range(3):
        sp = tracer.start_span(f"s{i}")
        sp.end()
        spans.append(sp)
    exporter = JsonLinesSpanExporter(str(tmp_path / "t.jsonl"), label="--trace t.jsonl")
    assert exporter.export(spans[:1]) == SpanExportResult.SUCCESS

    class Full:
        def write(self, _data):
            raise OSError(28, "No space left on device")

        flush = close = lambda self: None

    exporter._file = Full()
    with caplog.at_level(logging.WARNING, logger="aioslirp.observe"):
        assert exporter.export(spans[1:2]) == SpanExportResult.FAILURE
        assert exporter.export(spans[2:]) == SpanExportResult.FAILURE
        exporter.shutdown()
    assert [r.getMessage() for r in caplog.records] == [
        "--trace t.jsonl: cannot write spans (No space left on device); spans from now on are not recorded"]
    assert (exporter.exported, exporter.dropped) == (1, 2)
    assert json.loads((tmp_path / "t.jsonl").read_text())["name"] == "s0"


# ----------------------------------------------------------------------------------------
# 2. --otlp-endpoint that is dead: bounded exit, one warning line


@pytest.mark.parametrize("status", [0, 3])
def test_dead_otlp_endpoint_exits_in_bounded_time_with_one_warning(status):
    need(importable(OTLP_HTTP), f"{OTLP_HTTP} is missing (it is in the test extra)")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    t0 = time.monotonic()
    p = aioslirp("run", "--otlp-endpoint", endpoint, "--", "sh", "-c", f"exit {status}")
    elapsed = time.monotonic() - t0
    assert p.returncode == status, p.stderr
    assert elapsed < 8, f"exit took {elapsed:.1f} s (the SDK retries for ~15 s unbounded)"
    line = one_line(p)
    assert line.startswith(f"aioslirp: WARNING: --otlp-endpoint {endpoint}: "), line
    assert "(Connection refused)" in line


def test_silent_otlp_endpoint_exits_in_bounded_time_with_one_warning():
    """A server that accepts connections and never answers: requests would wait its whole
    10 s timeout per attempt; the shutdown bound gives up after ~2 s."""
    need(importable(OTLP_HTTP), f"{OTLP_HTTP} is missing (it is in the test extra)")
    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    endpoint = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        p = aioslirp("run", "--otlp-endpoint", endpoint, "--", "true")
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        th.join(2)
        srv.close()
        for c in held:
            c.close()
    assert p.returncode == 0, p.stderr
    assert elapsed < 8, f"exit took {elapsed:.1f} s"
    line = one_line(p)
    assert line.startswith(f"aioslirp: WARNING: --otlp-endpoint {endpoint}: "), line
    assert held, "aioslirp never tried the endpoint"


# ----------------------------------------------------------------------------------------
# 3. --api-socket PATH that cannot be created: exit 2 like --pcap


@pytest.mark.parametrize("case", ["missing-dir", "not-a-socket", "too-long"])
def test_api_socket_bad_path_is_exit_2(tmp_path, case):
    if case == "missing-dir":
        path = tmp_path / "no" / "api.sock"
        expect = f"directory {tmp_path / 'no'} does not exist"
    elif case == "not-a-socket":
        path = tmp_path / "file"
        path.write_text("x")
        expect = "exists and is not a socket"
    else:
        path = tmp_path / ("x" * 120)
        expect = "UNIX socket paths are limited to 107"
    p = aioslirp("run", "--api-socket", str(path), "--", "true")
    assert expect in usage_error(p, "--api-socket")
    p = aioslirp("run", "--pcap", str(tmp_path / "no" / "c.pcap"), "--", "true")
    usage_error(p, "--pcap")  # the same kind of mistake, the same status


# ----------------------------------------------------------------------------------------
# 4. -p/--publish giving one host port twice


@pytest.mark.parametrize(
    "specs, message",
    [
        (["8080:80", "8080:81"], "host port 8080/tcp on 127.0.0.1 given twice"),
        (["127.0.0.1:8080:80", "8080:81"], "host port 8080/tcp on 127.0.0.1 given twice"),
        (["5353:53/udp", "5353:54/UDP"], "host port 5353/udp on 127.0.0.1 given twice"),
        (["[::1]:8080:80", "[0:0::1]:8080:81"], "host port 8080/tcp on ::1 given twice"),
        (["0.0.0.0:8080:80", "127.0.0.1:8080:81"],
         "host port 8080/tcp given on 0.0.0.0 and on 127.0.0.1; 0.0.0.0 already means every address"),
        (["[::1]:8080:80", "[::]:8080:81"], "host port 8080/tcp given on ::1 and on ::; :: already means every address"),
    ],
)
def test_publish_same_host_port_twice_is_exit_2(specs, message):
    args = [a for s in specs for a in ("-p", s)]
    p = aioslirp("run", *args, "--", "true")
    assert usage_error(p, "-p/--publish") == f"aioslirp: error: -p/--publish: {message}"


def test_publish_same_port_different_protocol_or_family_is_fine():
    port = free_port()
    p = aioslirp("run", "-p", f"{port}:80", "-p", f"{port}:80/udp", "-p", f"[::1]:{port}:80", "--", "true")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""


# ----------------------------------------------------------------------------------------
# 5. address options: one line naming the option, no ipaddress wording


@pytest.mark.parametrize(
    "args, option, words",
    [
        (["--cidr", "fd00::/64"], "--cidr", ["'fd00::/64' is an IPv6 network", "--cidr6"]),
        (["--cidr6", "10.0.0.0/24"], "--cidr6", ["'10.0.0.0/24' is an IPv4 network", "--cidr "]),
        (["--cidr", "junk"], "--cidr", ["'junk' is not an IPv4 network (like 10.0.2.0/24)"]),
        (["--cidr", "10.0.2.0/33"], "--cidr", ["is not an IPv4 network"]),
        (["--cidr", "10.0.300.0/24"], "--cidr", ["is not an IPv4 network"]),
        (["--cidr6", "junk"], "--cidr6", ["'junk' is not an IPv6 network (like fd00::/64)"]),
        (["--cidr6", "fd00::/48"], "--cidr6", ["/64"]),
        (["--dns", "junk"], "--dns", ["'junk' is not an IP address"]),
        (["--dns", "fd00::zz"], "--dns", ["is not an IP address"]),
        (["--dns", "1.2.3.4:0"], "--dns", ["out of range"]),
        (["--allow", "junk"], "--allow", ["'junk'", "expected a CIDR network", "a domain name"]),
        (["--deny", "10.0.0.0/99"], "--deny", ["is not a CIDR network"]),
        (["-p", "1.2.3.400:80:80"], "--publish", ["is not an IP address"]),
    ],
)
def test_address_options_say_what_is_wrong(args, option, words):
    line = usage_error(aioslirp("run", *args, "--", "true"), option)
    for w in words:
        assert w in line, line
    assert not any(w in line for w in IPADDRESS_WORDING), line


@pytest.mark.parametrize("command", [["attach", "1"], ["qemu", "--socket", "SOCK"]])
def test_cidr_family_mistake_in_other_commands(tmp_path, command):
    command = [str(tmp_path / "q.sock") if a == "SOCK" else a for a in command]
    p = aioslirp(command[0], "--cidr", "fd00::/64", *command[1:])
    assert "--cidr6" in usage_error(p, "--cidr")


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        ({"cidr": "fd00::/64"}, "cidr", "'fd00::/64' is an IPv6 network; an IPv4 network is needed (like 10.0.2.0/24)"),
        ({"cidr": "10.0.2"}, "cidr", "'10.0.2' is not an IPv4 network (like 10.0.2.0/24)"),
        ({"gateway": "fd00::2"}, "gateway", "'fd00::2' is an IPv6 address; an IPv4 address is needed"),
        ({"dns": "10.0.2.300"}, "dns", "'10.0.2.300' is not an IPv4 address"),
        ({"cidr6": "10.0.0.0/8"}, "cidr6", "'10.0.0.0/8' is an IPv4 network; an IPv6 network is needed (like fd00::/64)"),
        ({"gateway6": "10.0.2.2"}, "gateway6", "'10.0.2.2' is an IPv4 address; an IPv6 address is needed"),
        ({"dns6": "fd00::zz"}, "dns6", "'fd00::zz' is not an IPv6 address"),
    ],
)
def test_network_config_address_errors_have_our_wording(kwargs, field, text):
    with pytest.raises(ConfigError) as info:
        NetworkConfig(**kwargs).validate()
    assert info.value.field == field
    assert str(info.value) == f"{field}: {text}"


# ----------------------------------------------------------------------------------------
# 6. aioslirp attach brings lo up in the target namespace


def _ns(pid: int, *argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(pid), "-n", *argv], capture_output=True, text=True, timeout=20, **kw)


_LOOPBACK_ECHO = r"""
import socket
srv = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(srv.getsockname(), timeout=5)
a, _ = srv.accept()
c.sendall(b"ping over lo")
print(a.recv(100).decode())
"""


def test_attach_brings_loopback_up():
    target = start_target_namespace()
    proc = None
    try:
        (lo,) = json.loads(_ns(target.pid, "ip", "-j", "link", "show", "lo").stdout)
        assert "UP" not in lo["flags"]  # a new namespace starts with lo down
        proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "attach", "--log-level", "info", str(target.pid)],
                                stderr=subprocess.PIPE, text=True)
        seen = []
        while not any("serving tap0" in line for line in seen):  # configured, signal handlers set
            line = proc.stderr.readline()
            assert line, f"attach ended: {''.join(seen)}"
            seen.append(line)
        r = _ns(target.pid, "ip", "-j", "addr", "show", "dev", "tap0")
        assert '"10.0.2.15"' in r.stdout, r
        (lo,) = json.loads(_ns(target.pid, "ip", "-j", "link", "show", "lo").stdout)
        assert "UP" in lo["flags"] and "LOWER_UP" in lo["flags"]
        r = _ns(target.pid, sys.executable, "-c", _LOOPBACK_ECHO)
        assert (r.returncode, r.stdout.strip()) == (0, "ping over lo"), r.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        rest = "".join(seen) + proc.stderr.read()
        assert "Traceback" not in rest and "WARNING" not in rest and "ERROR" not in rest, rest
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            proc.stderr.close()
        target.kill()
        target.wait()


def test_run_with_an_empty_command_name_is_one_line_and_127():
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--", ""], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 127, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "command not found" in lines[0] and "Traceback" not in p.stderr


# ----------------------------------------------------------------------------------------
# aioslirp qemu --switch: its options, and two stream guests on one network


@pytest.mark.parametrize("args, option", [
    (["--fd", "0", "--switch"], "--switch"),
    (["--socket", "S", "--switch", "--dgram"], "--switch"),
    (["--socket", "S", "--max-guests", "2"], "--max-guests"),
    (["--socket", "S", "--switch", "--max-guests", "0"], "--max-guests"),
    (["--socket", "S", "--switch", "--name", "a.b"], "--name"),
    (["--socket", "S", "--switch", "--publish", "8080:80"], "--publish"),
    (["--socket", "S", "--switch", "--publish", "127.0.0.1:8080:80"], "--publish"),
    (["--socket", "S", "--switch", "--publish", "8080:a.b:80"], "--publish"),
    (["--socket", "S", "--switch", "--publish", "8080:[fd00::5]:80"], "--publish"),
    (["--socket", "S", "--switch", "--publish", "8080:vm1:0"], "--publish"),
    (["--socket", "S", "--switch", "--name", "box", "--publish", "8080:vm1:80"], "--publish"),
    (["--socket", "S", "--switch", "--publish", "8080:web:80"], "--publish"),
    (["--socket", "S", "--switch", "-p", "8080:vm1:80", "-p", "8080:vm2:80"], "-p/--publish"),
    (["--socket", "S", "--switch", "--api-socket", "P"], "--api-socket"),
    (["--socket", "S", "--switch", "--events", "/nonexistent/dir/e.jsonl"], "--events"),
    (["--socket", "S", "--lease", "52:54:00:00:0a:01=10.0.2.20"], "--lease"),
    (["--socket", "S", "--switch", "--lease", "52:54:00:00:0a:01"], "--lease"),
    (["--socket", "S", "--switch", "--lease", "01:00:5e:00:00:01=10.0.2.20"], "--lease"),
    (["--socket", "S", "--switch", "--lease", "52:54:00:00:0a:01=10.0.2.2"], "--lease"),
    (["--socket", "S", "--switch", "--lease", "52:54:00:00:0a:01=10.0.3.20"], "--lease"),
    (["--socket", "S", "--switch", "--lease", "52:54:00:00:0a:01=10.0.2.20,a.b"], "--lease"),
    (["--socket", "S", "--switch", "--lease", "52:54:00:00:0a:01=10.0.2.20",
      "--lease", "52:54:00:00:0a:01=10.0.2.21"], "--lease"),
])
def test_qemu_switch_bad_options_are_one_line_exit_2(tmp_path, args, option):
    args = [str(tmp_path / a) if a in ("S", "P") else a for a in args]
    usage_error(aioslirp("qemu", *args), option)


def _stream_frame(frame: bytes) -> bytes:
    return len(frame).to_bytes(4, "big") + frame


def _stream_frames(sock: socket.socket, seconds: float) -> list:
    """Frames read from a QEMU-stream socket within ``seconds``."""
    sock.settimeout(seconds)
    buf = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            buf += data
    except socket.timeout:
        pass
    return [bytes(f) for f in StreamDecoder().feed(buf)]


def test_qemu_switch_serves_two_stream_guests_on_one_network(tmp_path):
    import dpkt

    path = tmp_path / "vms.sock"
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "qemu", "--socket", str(path), "--switch", "--no-ipv6",
                             "--dns", "127.0.0.1:9", "--name", "box", "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(500):
            if path.exists():
                break
            time.sleep(0.02)
        macs = (bytes.fromhex("525400000a01"), bytes.fromhex("525400000a02"))
        socks = []
        offers = []
        for mac in macs:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            socks.append(s)
            time.sleep(0.3)  # joins in connection order: the first gets the first lease
            dhcp = dpkt.dhcp.DHCP(op=1, xid=7, chaddr=mac + bytes(10), opts=[(53, b"\x01")])
            udp = dpkt.udp.UDP(sport=68, dport=67, ulen=8 + len(bytes(dhcp)), data=bytes(dhcp))
            ip = dpkt.ip.IP(src=bytes(4), dst=b"\xff" * 4, p=17, ttl=64, data=udp)
            s.sendall(_stream_frame(bytes(dpkt.ethernet.Ethernet(src=mac, dst=b"\xff" * 6, type=0x0800, data=ip))))
            replies = [dpkt.ethernet.Ethernet(f) for f in _stream_frames(s, 1.0)]
            offer = next(e for e in replies if e.src == bytes.fromhex("52550a000202"))
            offers.append(socket.inet_ntoa(offer.data.data.data[16:20]))  # yiaddr
        assert offers == ["10.0.2.15", "10.0.2.16"]
        # guest 2 broadcasts an ARP request: guest 1 gets it, switched
        arp = dpkt.arp.ARP(op=1, sha=macs[1], spa=socket.inet_aton("10.0.2.16"), tha=bytes(6),
                           tpa=socket.inet_aton("10.0.2.15"))
        socks[1].sendall(_stream_frame(bytes(dpkt.ethernet.Ethernet(src=macs[1], dst=b"\xff" * 6, type=0x0806,
                                                                     data=arp))))
        got = [dpkt.ethernet.Ethernet(f) for f in _stream_frames(socks[0], 1.0)]
        assert any(e.type == 0x0806 and e.src == macs[1] for e in got)
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=15)
        for s in socks:
            s.close()
    assert proc.returncode == 0, err[-2000:]
    assert "guest box1 joined" in err and "guest box2 joined" in err and not path.exists()


def test_qemu_switch_trace_file_has_each_guests_flow_spans(tmp_path):
    """--switch --trace FILE: one tracer provider for every guest's stack; a UDP flow of guest
    box1 reaches a host socket, and its span in the file carries the guest's name."""
    import dpkt

    path, trace = tmp_path / "vms.sock", tmp_path / "spans.jsonl"
    host = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    host.bind(("127.0.0.1", 0))
    host.settimeout(10)
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "qemu", "--socket", str(path), "--switch", "--no-ipv6",
                             "--dns", "127.0.0.1:9", "--name", "box", "--trace", str(trace), "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for _ in range(500):
            if path.exists():
                break
            time.sleep(0.02)
        mac = bytes.fromhex("525400000a01")
        s.connect(str(path))
        assert _dhcp_offer(s, mac) == "10.0.2.15"
        udp = dpkt.udp.UDP(sport=40000, dport=host.getsockname()[1], data=b"hello from box1")
        udp.ulen = 8 + len(udp.data)
        ip = dpkt.ip.IP(src=socket.inet_aton("10.0.2.15"), dst=socket.inet_aton("10.0.2.2"), p=17, ttl=64, data=udp)
        s.sendall(_stream_frame(bytes(dpkt.ethernet.Ethernet(src=mac, dst=bytes.fromhex("52550a000202"),
                                                             type=0x0800, data=ip))))
        data, _ = host.recvfrom(100)
        assert data == b"hello from box1"
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=15)
        s.close()
        host.close()
    assert proc.returncode == 0, err[-2000:]
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    flows = [sp for sp in spans if sp["name"] == "udp.flow"]
    assert flows and all(sp["attributes"].get("aioslirp.guest.name") == "box1" for sp in flows), spans[:3]


def _dhcp_offer(sock: socket.socket, mac: bytes) -> str:
    """Send a DHCPDISCOVER from ``mac`` on a QEMU-stream socket; the address offered (yiaddr)."""
    import dpkt

    dhcp = dpkt.dhcp.DHCP(op=1, xid=7, chaddr=mac + bytes(10), opts=[(53, b"\x01")])
    udp = dpkt.udp.UDP(sport=68, dport=67, ulen=8 + len(bytes(dhcp)), data=bytes(dhcp))
    ip = dpkt.ip.IP(src=bytes(4), dst=b"\xff" * 4, p=17, ttl=64, data=udp)
    sock.sendall(_stream_frame(bytes(dpkt.ethernet.Ethernet(src=mac, dst=b"\xff" * 6, type=0x0800, data=ip))))
    replies = [dpkt.ethernet.Ethernet(f) for f in _stream_frames(sock, 2.0)]
    offer = next(e for e in replies if e.src == bytes.fromhex("52550a000202"))
    return socket.inet_ntoa(offer.data.data.data[16:20])


def test_qemu_switch_lease_gives_a_mac_its_address_and_name_whatever_the_order(tmp_path):
    """--lease MAC=ADDRESS,NAME: the leased guest connects first yet gets its own address and
    name; an unleased guest gets the lowest address the leases leave (10.0.2.15); the leased
    guest reconnecting gets the same address again."""
    path = tmp_path / "vms.sock"
    leased, other = bytes.fromhex("525400000a02"), bytes.fromhex("525400000a01")
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "qemu", "--socket", str(path), "--switch", "--no-ipv6",
                             "--dns", "127.0.0.1:9", "--lease", "52:54:00:00:0a:02=10.0.2.15,web",
                             "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    socks = []
    try:
        for _ in range(500):
            if path.exists():
                break
            time.sleep(0.02)
        offers = []
        for mac in (leased, other):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            socks.append(s)
            offers.append(_dhcp_offer(s, mac))
        socks[0].close()
        time.sleep(0.5)  # the leased guest leaves, then comes back
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        socks.append(s)
        offers.append(_dhcp_offer(s, leased))
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=15)
        for s in socks:
            s.close()
    assert offers == ["10.0.2.15", "10.0.2.16", "10.0.2.15"], (offers, err[-2000:])
    assert proc.returncode == 0, err[-2000:]
    assert "guest web joined" in err and "guest vm2 joined" in err, err[-2000:]


def _some_frames(sock: socket.socket, seconds: float) -> list:
    """The frames of the first read on a QEMU-stream socket within ``seconds`` (completed), or []."""
    sock.settimeout(seconds)
    try:
        buf = sock.recv(65536)
        while len(buf) >= 4 and len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            buf += sock.recv(65536)
    except socket.timeout:
        return []
    return [bytes(f) for f in StreamDecoder().feed(buf)]


def _wait_path(path) -> None:
    for _ in range(500):
        if path.exists():
            return
        time.sleep(0.02)


def test_qemu_switch_publish_events_and_pcap(tmp_path):
    """--switch -p HOST_PORT:box2:80 --events FILE --pcap FILE: a host connection to HOST_PORT
    reaches guest box2 (its stack sends the SYN to 10.0.2.16:80), not box1; the events of both
    guests' stacks are in one file, each naming its guest; the capture holds the network's frames
    as the switch saw them, each once (both guests' DHCP, the SYN to box2)."""
    import dpkt

    path, events, pcap = tmp_path / "vms.sock", tmp_path / "events.jsonl", tmp_path / "net.pcap"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "qemu", "--socket", str(path), "--switch", "--no-ipv6",
                             "--dns", "127.0.0.1:9", "--name", "box", "-p", f"{port}:box2:80",
                             "--events", str(events), "--pcap", str(pcap), "--label", "team=web",
                             "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    macs = (bytes.fromhex("525400000a01"), bytes.fromhex("525400000a02"))
    socks, client = [], None
    syns = []
    try:
        _wait_path(path)
        for mac, want in zip(macs, ("10.0.2.15", "10.0.2.16")):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            socks.append(s)
            assert _dhcp_offer(s, mac) == want
        client = socket.create_connection(("127.0.0.1", port), timeout=5)  # box2's forward listens
        deadline = time.monotonic() + 10
        while not syns and time.monotonic() < deadline:
            for f in _some_frames(socks[1], 0.5):
                eth = dpkt.ethernet.Ethernet(f)
                if eth.type == 0x0806 and eth.data.op == 1 and eth.data.tpa == socket.inet_aton("10.0.2.16"):
                    arp = dpkt.arp.ARP(op=2, sha=macs[1], spa=eth.data.tpa, tha=eth.data.sha, tpa=eth.data.spa)
                    socks[1].sendall(_stream_frame(bytes(dpkt.ethernet.Ethernet(src=macs[1], dst=eth.src,
                                                                                 type=0x0806, data=arp))))
                elif eth.type == 0x0800 and eth.data.p == 6 and eth.data.data.flags & dpkt.tcp.TH_SYN:
                    syns.append(f)
        assert syns, "no SYN reached box2"
        syn = dpkt.ethernet.Ethernet(syns[0])
        assert socket.inet_ntoa(syn.data.dst) == "10.0.2.16" and syn.data.data.dport == 80
        box1 = [dpkt.ethernet.Ethernet(f) for f in _stream_frames(socks[0], 0.3)]
        assert not any(e.type == 0x0800 and e.data.p == 6 for e in box1)
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=15)
        for s in socks:
            s.close()
        if client is not None:
            client.close()
    assert proc.returncode == 0, err[-2000:]
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    ready = {ev["guest_name"]: ev for ev in lines if ev["event"] == "ready"}
    assert set(ready) == {"box1", "box2"} and ready["box1"]["labels"] == {"team": "web"}, lines
    assert {ev["guest_name"] for ev in lines if ev["event"] == "guest_link_up"} == {"box1", "box2"}
    with open(pcap, "rb") as fh:
        frames = [bytes(buf) for _ts, buf in dpkt.pcap.Reader(fh)]
    assert frames.count(syns[0]) == 1
    discovers = [dpkt.ethernet.Ethernet(f).src for f in frames
                 if f[12:14] == b"\x08\x00" and f[23] == 17 and f[36:38] == b"\x00\x43"]
    assert sorted(discovers) == sorted(macs)  # each guest's DHCPDISCOVER, once


def test_qemu_switch_publish_on_a_port_in_use_is_one_line_exit_1(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        p = aioslirp("qemu", "--socket", str(tmp_path / "vms.sock"), "--switch", "-p",
                     f"{busy.getsockname()[1]}:vm1:80")
    finally:
        busy.close()
    assert p.returncode == 1, p.stderr
    line = one_line(p)
    assert line.startswith("aioslirp: error: --publish: cannot listen on 127.0.0.1:") and "in use" in line, line
    assert not (tmp_path / "vms.sock").exists()


def test_qemu_says_at_the_default_log_level_that_it_waits_sees_and_loses_a_guest(tmp_path):
    """A new user's first run: ``aioslirp qemu --socket PATH`` does not wait in silence (warning is
    the default level; the comings and goings of a guest are said all the same, --log-level error
    silences them)."""
    path = tmp_path / "vm.sock"
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "qemu", "--socket", str(path), "--no-ipv6",
                             "--dns", "127.0.0.1:9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(500):
            if path.exists():
                break
            time.sleep(0.02)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        time.sleep(0.3)
        s.close()
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    lines = err.splitlines()
    assert f"aioslirp: INFO: waiting for a QEMU guest on {path} (-netdev stream)" in lines
    assert any(line.startswith("aioslirp: INFO: guest connected on ") for line in lines), err
    assert any(line.startswith("aioslirp: INFO: guest on ") and " left " in line for line in lines), err
    assert "aioslirp: INFO: stopped after 1 guest(s)" in lines
    assert not any("counters:" in line for line in lines)  # the counters only at debug
