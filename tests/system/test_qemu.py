"""Real QEMU guests (Linux kernel + busybox, ../shared/guestvm) served by ``aioslirp qemu`` and by an
embedded Stack: DHCP, DNS, 20 MB each way with SHA-256 checked, ping, refused ports, iperf3, and a
guest killed mid-transfer.

Each test boots one or two guests under TCG (a few seconds each) with a hard time bound. The
kernel and initramfs are built on first use into ``$GUESTVM_CACHE`` (default
``<repo>/.cache/guestvm``; ``.ci/prereqs`` builds it before pytest). Figures (boot-to-download,
iperf3) are printed: see them with ``pytest -rP tests/system/test_qemu.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from aioslirp.config import NetworkConfig

from support import qemu
from support.paths import REPO
from support.servers import host_servers, pattern
from support.vms import MB20, VM_TIMEOUT, check_vm, cli_server, report, wait_path
from support.vms import guestvm  # noqa: F401 - a fixture: the kit's kernel + initramfs, built

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def servers():
    with host_servers() as s:
        yield s


def dns_opt(servers) -> list[str]:
    return ["--dns", f"127.0.0.1:{servers['dns'].port}"]


def download_snippet(port: int) -> str:
    return f"""
read U _ < /proc/uptime; echo DL_START=$U
wget -q -O - http://10.0.2.2:{port}/{MB20} | sha256sum | {{ read h _; echo DOWN_SHA=$h; }}
read U _ < /proc/uptime; echo DL_END=$U
"""


def assert_download(res, request) -> None:
    assert res.values.get("DOWN_SHA") == hashlib.sha256(pattern(MB20, 1)).hexdigest(), res.tail()
    secs = float(res.values["DL_END"]) - float(res.values["DL_START"])
    report(request, "boot_to_download_done_wall_s", round(res.at["DL_END"], 2))
    report(request, "guest_uptime_at_download_done_s", float(res.values["DL_END"]))
    report(request, "download_20MB_s", round(secs, 2))
    report(request, "download_Mbit_s", round(MB20 * 8 / max(secs, 0.01) / 1e6, 1))


# ----------------------------------------------------------------------------- stream
async def test_stream_dhcp_dns_download_upload(guestvm, servers, tmp_path, request):
    port = servers["data"].port
    sock = tmp_path / "s.sock"
    cmd = f"""
ip -4 -o addr show dev eth0 | awk '{{print "GUEST_IP=" $4}}'
awk '/^nameserver/ {{print "GUEST_DNS=" $2; exit}}' /etc/resolv.conf
nslookup www.example.test | awk '/^Address/ && !/#|:53/ {{a=$2}} END {{print "RESOLVED=" a}}'
{download_snippet(port)}
head -c {MB20} /dev/urandom > /tmp/up
sha256sum /tmp/up | {{ read h _; echo UP_LOCAL_SHA=$h; }}
(echo UP; cat /tmp/up) | nc 10.0.2.2 {port} | {{ read n h; echo UP_HOST_N=$n; echo UP_HOST_SHA=$h; }}
"""
    async with cli_server(tmp_path, "--socket", str(sock), *dns_opt(servers)) as srv:
        await wait_path(sock)
        argv = qemu.qemu_argv(f"stream,server=off,addr.type=unix,addr.path={sock}", cmd, workdir=tmp_path)
        res = await qemu.run_vm(argv, VM_TIMEOUT)
    check_vm(res)
    v = res.values
    assert v["GUEST_IP"] == "10.0.2.15/24"
    assert v["GUEST_DNS"] == "10.0.2.3"
    assert v["RESOLVED"] == "10.0.2.99", res.tail()  # the answer of our upstream on 127.0.0.1
    assert servers["dns"].udp_queries > 0
    assert_download(res, request)
    assert v["UP_HOST_N"] == str(MB20), res.tail()
    assert v["UP_HOST_SHA"] == v["UP_LOCAL_SHA"], res.tail()  # hashed by the host server
    assert "guest closed the connection" in srv.log_text


# ----------------------------------------------------------------------------- dgram, fd
async def test_dgram_download(guestvm, servers, tmp_path, request):
    sock = tmp_path / "d.sock"
    async with cli_server(tmp_path, "--dgram", "--socket", str(sock), *dns_opt(servers)):
        await wait_path(sock)
        netdev = f"dgram,local.type=unix,local.path={tmp_path / 'qemu.sock'},remote.type=unix,remote.path={sock}"
        res = await qemu.run_vm(qemu.qemu_argv(netdev, download_snippet(servers["data"].port),
                                                           workdir=tmp_path), VM_TIMEOUT)
    check_vm(res)
    assert_download(res, request)


@pytest.mark.parametrize("kind, netdev", [
    ("stream", "stream,addr.type=fd,addr.str={fd}"),
    ("dgram", "dgram,local.type=fd,local.str={fd}"),
    ("stream", "socket,fd={fd}"),  # the old -netdev socket: same framing as stream
], ids=["stream-fd", "dgram-fd", "socket-fd"])
async def test_socketpair_fd_download(guestvm, servers, tmp_path, request, kind, netdev):
    ours, qemus = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM if kind == "stream" else socket.SOCK_DGRAM)
    async with cli_server(tmp_path, "--fd", str(ours.fileno()), *dns_opt(servers), pass_fds=[ours.fileno()]) as srv:
        ours.close()
        argv = qemu.qemu_argv(netdev.format(fd=qemus.fileno()), download_snippet(servers["data"].port),
                                    workdir=tmp_path)
        vm = await qemu.Vm.start(argv, pass_fds=[qemus.fileno()])
        qemus.close()
        res = await vm.wait(VM_TIMEOUT)
        if kind == "stream":  # the guest left (EOF): `aioslirp qemu --fd` ends by itself with status 0
            await asyncio.wait_for(srv.wait(), 15)
    check_vm(res)
    assert_download(res, request)


# ----------------------------------------------------------------------------- ping, refused, iperf3
async def test_ping_refused_port_iperf3(guestvm, servers, tmp_path, request):
    if not shutil.which("iperf3"):
        pytest.fail("iperf3 is required (apt-get install iperf3)")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    iperf_ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        iperf_ports.append(s.getsockname()[1])
        s.close()
    servers_ = [subprocess.Popen(["iperf3", "-s", "-1", "-J", "-B", "127.0.0.1", "-p", str(p)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in iperf_ports]
    cmd = f"""
ping -c 3 -W 2 10.0.2.2 | awk '/packets received/ {{print "PING_RECEIVED=" $4}}'
read A _ < /proc/uptime
NC_ERR=$(nc 10.0.2.2 {closed_port} </dev/null 2>&1); echo NC_RC=$?
read B _ < /proc/uptime
echo "NC_ERR=$NC_ERR"
echo NC_SECONDS=$(awk -v a=$A -v b=$B 'BEGIN {{print b - a}}')
iperf3 -c 10.0.2.2 -p {iperf_ports[0]} -t 3 >/tmp/up.txt 2>&1; echo IPERF_UP_RC=$?
tail -4 /tmp/up.txt
iperf3 -c 10.0.2.2 -p {iperf_ports[1]} -t 3 -R >/tmp/down.txt 2>&1; echo IPERF_DOWN_RC=$?
tail -4 /tmp/down.txt
"""
    sock = tmp_path / "s.sock"
    try:
        async with cli_server(tmp_path, "--socket", str(sock), *dns_opt(servers)):
            await wait_path(sock)
            argv = qemu.qemu_argv(f"stream,server=off,addr.type=unix,addr.path={sock}", cmd, workdir=tmp_path)
            res = await qemu.run_vm(argv, VM_TIMEOUT)
        outs = []
        for p in servers_:
            out, _ = p.communicate(timeout=20)
            outs.append(json.loads(out) if out.strip() else {})
    finally:
        for p in servers_:
            if p.poll() is None:
                p.kill()
    check_vm(res)
    v = res.values
    assert v["PING_RECEIVED"] == "3", res.tail()
    assert v["NC_RC"] != "0"
    # refused by our RST, sent because the host refused (not because our 10 s connect timeout ran out)
    assert "refused" in v["NC_ERR"].lower(), res.tail()
    assert float(v["NC_SECONDS"]) < NetworkConfig().tcp_connect_timeout, res.tail()
    assert v["IPERF_UP_RC"] == "0" and v["IPERF_DOWN_RC"] == "0", res.tail()
    up = outs[0]["end"]["sum_received"]["bits_per_second"] / 1e6
    down = outs[1]["end"]["sum_sent"]["bits_per_second"] / 1e6  # reverse: the host server sends
    assert up > 0 and down > 0
    report(request, "iperf3_guest_to_host_Mbit_s", round(up, 1))
    report(request, "iperf3_host_to_guest_Mbit_s", round(down, 1))


# ----------------------------------------------------------------------------- guest killed mid-transfer
class EndlessHttp:
    """HTTP/1.0 server on 127.0.0.1 sending zeros until the client goes away; counts open connections."""

    def __init__(self) -> None:
        import socketserver
        import threading

        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner.open += 1
                owner.total += 1
                try:
                    self.request.recv(4096)
                    self.request.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 107374182400\r\n\r\n")
                    chunk = bytes(65536)
                    while True:
                        self.request.sendall(chunk)
                except OSError:
                    pass
                finally:
                    owner.open -= 1

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.open = 0
        self.total = 0
        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                n += 1
    return n


def aioslirp_tasks() -> list:
    return [t for t in asyncio.all_tasks() if not t.done() and t.get_name().startswith("aioslirp")
            and t.get_name() != "aioslirp-writer"]


async def test_guest_killed_mid_transfer_leaves_nothing_behind(guestvm, servers, tmp_path, request):
    from aioslirp import NetworkConfig, Stack
    from aioslirp.frontends.qemu import QemuServer

    endless = EndlessHttp()
    sock = tmp_path / "s.sock"
    config = NetworkConfig(dns_upstreams=[("127.0.0.1", servers["dns"].port)])
    try:
        async with Stack(config) as stack:
            server = QemuServer(stack, path=str(sock))
            await server.start()
            serving = asyncio.ensure_future(server.serve())
            base_fds = socket_fds()
            # guest 1: two endless downloads and a DNS lookup in flight, then QEMU is killed
            cmd1 = f"""
wget -q -O /dev/null http://10.0.2.2:{endless.port}/ &
wget -q -O /dev/null http://10.0.2.2:{endless.port}/ &
sleep 1
echo TRANSFERRING=1
sleep 600
"""
            netdev = f"stream,server=off,addr.type=unix,addr.path={sock}"
            vm1 = await qemu.Vm.start(qemu.qemu_argv(netdev, cmd1, workdir=tmp_path))
            try:
                assert await vm1.wait_for_key("TRANSFERRING", 90), vm1.result.tail()
                for _ in range(100):  # both downloads moving through the stack
                    tcp = [f for f in stack.parts.flows.values() if f.proto_name == "tcp" and f.state == "ESTABLISHED"]
                    if len(tcp) == 2 and stack.counters["bytes_out"] > 4_000_000:
                        break
                    await asyncio.sleep(0.05)
                assert len(tcp) == 2 and endless.open == 2, stack.stats()["flows"]
                moved = stack.counters["bytes_out"]
            finally:
                vm1.kill()  # SIGKILL: no FIN, no RST from the guest, the stream just ends
            await vm1.wait(10)
            # everything of guest 1 goes away: flows, host sockets, tasks, the accepted stream
            for _ in range(200):
                if (not stack.parts.flows and not aioslirp_tasks() and endless.open == 0 and server.transport is None
                        and socket_fds() <= base_fds):
                    break
                await asyncio.sleep(0.05)
            assert stack.parts.flows == {}, stack.stats()["flows"]
            assert aioslirp_tasks() == []
            assert not [t for t in stack.parts.tasks if not t.done()]
            assert all(f.host_closed and f.task.done() for f in tcp)
            assert endless.open == 0  # the host server saw both connections end
            assert socket_fds() <= base_fds
            assert server.transport is None and stack.parts.neighbors == {}
            assert stack.counters["flows_reset"] >= 2
            report(request, "bytes_moved_before_kill", moved)
            # guest 2 is served by the same stack
            vm2 = await qemu.Vm.start(qemu.qemu_argv(netdev, download_snippet(servers["data"].port),
                                                                 workdir=tmp_path))
            res = await vm2.wait(VM_TIMEOUT)
            check_vm(res)
            assert "lease of 10.0.2.15 obtained" in res.console
            assert_download(res, request)
            assert server.guests == 2
            server.close()
            await asyncio.wait_for(serving, 10)
            assert not sock.exists()
    finally:
        endless.close()


# ----------------------------------------------------------------------------- examples/vm_manager.py
async def test_vm_manager_example_custom_snippet(guestvm, servers, tmp_path):
    """``--cmd`` runs the user's snippet instead of the built-in checks (tests/system/test_vm_manager_example.py
    runs the documented command): DNS through an upstream, 1 MB from a host server."""
    port = servers["data"].port
    cmd = f"nslookup www.example.test >/dev/null; wget -q -O - http://10.0.2.2:{port}/1000000 | sha256sum"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "examples" / "vm_manager.py"), "--kernel", str(guestvm / "vmlinuz"),
        "--initrd", str(guestvm / "initramfs.cpio.gz"), "--cmd", cmd, "--accel", qemu.accel(),
        "--dns", f"127.0.0.1:{servers['dns'].port}", "--timeout", "120", "-v",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 150)
    err_text = err.decode(errors="replace")
    assert proc.returncode == 0, err_text[-3000:]
    rep = json.loads(out.decode().strip().splitlines()[-1])
    assert rep["checks"] == {"dhcp": True} and rep["guest_exit"] == 0 and rep["qemu_exit"] == 0
    assert rep["lease"] == "10.0.2.15"
    assert rep["connectivity"] == {"dhcp": True, "gateway_arp": True, "dns": True, "tcp": True,
                                   "udp": False, "icmp": False}
    assert rep["transport"]["closed"] == "eof" and rep["transport"]["send_drops"] == {}
    assert hashlib.sha256(pattern(1000000, 1)).hexdigest() in err_text  # the guest's console, via stderr
    assert "guest leased 10.0.2.15 by DHCP" in err_text