"""examples/vm_manager.py runs as its docstring, the README and docs/qemu.md say: a real guest under
QEMU, networked by the embedded Stack, checked for DHCP, DNS through the virtual DNS and TCP to
a host server, in seconds; a failed check or a timeout exits 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO
from support.vms import guestvm  # noqa: F401 - the fixture: the kit's kernel + initramfs, built

pytestmark = [pytest.mark.slow]

EXAMPLE = REPO / "examples" / "vm_manager.py"
DOCUMENTED = "python examples/vm_manager.py --kernel "


def run(cache: Path, *extra: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, dict]:
    p = subprocess.run([sys.executable, str(EXAMPLE), "--kernel", str(cache / "vmlinuz"),
                        "--initrd", str(cache / "initramfs.cpio.gz"), *extra],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = p.stdout.strip().splitlines()
    return p, json.loads(lines[-1]) if lines else {}


def test_the_command_is_documented():
    for doc in (EXAMPLE, REPO / "README.md", REPO / "docs" / "qemu.md"):
        assert DOCUMENTED in doc.read_text(), doc


def test_documented_command_checks_the_guest_in_seconds(guestvm):  # noqa: F811
    p, rep = run(guestvm)
    assert p.returncode == 0, p.stderr[-3000:]
    assert rep["checks"] == {"dhcp": True, "dns": True, "tcp": True}, rep
    assert rep["ok"] is True and rep["guest_exit"] == 0 and rep["timed_out"] is False
    assert rep["lease"] == "10.0.2.15"
    assert rep["seconds"] < 30, rep["seconds"]
    assert rep["counters"]["dns_queries_udp"] >= 1 and rep["counters"]["flows.tcp.opened"] >= 1
    assert rep["transport"]["closed"] == "eof"
    err = p.stderr
    assert "guest| CHECK_DNS=10.0.2.2" in err  # host.aioslirp.internal, answered by the virtual DNS
    assert "guest| CHECK_TCP=pong-" in err  # the host server's token, through the NAT
    assert f"vm_manager: checks: dhcp ok, dns ok, tcp ok ({rep['seconds']} s)" in err.splitlines()
    print(f"vm_manager example: {rep['seconds']} s")


def test_a_failed_check_exits_1(guestvm):  # noqa: F811
    # a static address instead of DHCP: DNS and TCP still work, the dhcp check fails
    p, rep = run(guestvm, "--append", "guestvm.net=static guestvm.ip=10.0.2.15/24 guestvm.gw=10.0.2.2")
    assert p.returncode == 1, p.stderr[-3000:]
    assert rep["checks"] == {"dhcp": False, "dns": True, "tcp": True}, rep
    assert rep["ok"] is False and rep["guest_exit"] == 0
    assert "vm_manager: checks: dhcp FAILED, dns ok, tcp ok (" in p.stderr


def test_a_timeout_exits_1(guestvm):  # noqa: F811
    p, rep = run(guestvm, "--timeout", "0.5")
    assert p.returncode == 1, p.stderr[-3000:]
    assert rep["timed_out"] is True and rep["ok"] is False and rep["guest_exit"] is None
    assert "killing QEMU" in p.stderr
    assert "(timed out: QEMU killed)" in p.stderr


def test_bad_kernel_path_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(EXAMPLE), "--kernel", str(tmp_path / "nope"), "--initrd",
                        str(tmp_path / "nope2")], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert p.returncode == 2
    assert p.stderr.startswith("vm_manager: error: --kernel: no file ") and len(p.stderr.splitlines()) == 1
