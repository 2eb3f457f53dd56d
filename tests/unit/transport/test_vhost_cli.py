"""``aioslirp vhost-user``: a front end written in the test (tests/support/vhost.py) sets the device up
through the command's socket, sends an ARP request on the TX queue and finds the stack's ARP reply in
its RX buffers; SIGTERM stops it and removes the socket; bad options are one line naming the field."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from support.frames import GUEST_MAC
from support.native import need_vhost
from support.vhost import FakeFrontEnd


def arp_request() -> bytes:
    eth = b"\xff" * 6 + GUEST_MAC + b"\x08\x06"
    return eth + struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, GUEST_MAC, bytes([10, 0, 2, 15]), b"\0" * 6,
                             bytes([10, 0, 2, 2]))


def _cli(*args):
    return subprocess.Popen([sys.executable, "-m", "aioslirp", "vhost-user", *args, "--log-level", "info"],
                            stderr=subprocess.PIPE, text=True)


def _wait(cond, what, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_cli_serves_a_front_end_and_stops_on_sigterm(tmp_path):
    need_vhost()
    path = str(tmp_path / "vu.sock")
    p = _cli("--socket", path, "--tx-defer", "0.5")
    fe = None
    try:
        _wait(lambda: os.path.exists(path), "the socket never appeared")
        fe = FakeFrontEnd(path)
        fe.setup()
        addrs = fe.post_rx(16, 2048)
        fe.send_frame(arp_request())
        replies = []

        def arp_reply() -> bool:
            for head, n in fe.used(0):
                data = fe.read(addrs[head], n)[12:]
                if data[12:14] == b"\x08\x06":
                    replies.append(data)
            return bool(replies)

        _wait(arp_reply, "no ARP reply in the guest's buffers")
        assert replies[0][20:22] == b"\x00\x02" and replies[0][28:32] == bytes([10, 0, 2, 2])
        assert replies[0][:6] == GUEST_MAC
        fe.send_frame(arp_request())  # a small walk after the first: its call waits (--tx-defer)
        _wait(lambda: arp_reply() and len(replies) > 1, "no second ARP reply")
        p.send_signal(signal.SIGTERM)
        rc = p.wait(20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if fe is not None:
            fe.close()
    err = p.stderr.read()
    assert rc == 0, err
    assert not os.path.exists(path), err
    assert "rings running" in err and "tx_frames=2" in err, err
    assert "tx_calls_deferred=1" in err, err


@pytest.mark.parametrize("args, needle", [
    (["--socket", "/nonexistent-dir/x.sock"], "--socket"),
    (["--socket", "/" + "x" * 120], "--socket"),
    (["--socket", "x.sock", "--ifname", "tap0"], "--ifname"),
    (["--socket", "x.sock", "--tx-coalesce", "-1"], "--tx-coalesce"),
    (["--socket", "x.sock", "--tx-coalesce", "lots"], "--tx-coalesce"),
    (["--socket", "x.sock", "--tx-defer", "2"], "--tx-defer"),
    (["--socket", "x.sock", "--tx-defer", "-0.5"], "--tx-defer"),
    (["--socket", "x.sock", "--tx-defer", "nan"], "--tx-defer"),
    (["--socket", "x.sock", "--tx-defer", "soon"], "--tx-defer"),
    ([], "--socket"),
])
def test_cli_bad_options_exit_2(args, needle):
    p = subprocess.run([sys.executable, "-m", "aioslirp", "vhost-user", *args], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_cli_client_mode_refuses_a_path_that_is_not_a_socket(tmp_path):
    f = tmp_path / "plain"
    f.write_text("")
    p = subprocess.run([sys.executable, "-m", "aioslirp", "vhost-user", "--client", "--socket", str(f)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--socket" in p.stderr and "not a socket" in p.stderr, p.stderr


def test_cli_socket_in_use_exit_1(tmp_path):
    need_vhost()
    path = str(tmp_path / "busy.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(1)
    p = subprocess.run([sys.executable, "-m", "aioslirp", "vhost-user", "--socket", path], capture_output=True,
                       text=True, timeout=30)
    live.close()
    assert p.returncode == 1, p.stderr
    assert "in use" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
