"""The QEMU tests' shared parts: the guestvm kit built once per module (:func:`guestvm`),
``aioslirp qemu`` as a subprocess (:func:`cli_server`), and the checks of a guest's result.

Booting a guest is :mod:`support.qemu` (also used by benchmarks/qemu_vs_passt.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import pytest

from support import qemu
from support.prereqs import need


MB20 = 20 * 1024 * 1024
VM_TIMEOUT = 150  # seconds, per guest (TCG boot is ~3 s; 20 MB each way is a few more)


@pytest.fixture(scope="module")
def guestvm():
    need(qemu.KIT.is_dir(), f"the guestvm kit is not at {qemu.KIT} (the project's shared/ folder "
         "beside the clone, or set GUESTVM_DIR); CI always has it")
    try:
        return qemu.ensure_built()
    except RuntimeError as exc:
        pytest.fail(str(exc))


@contextlib.asynccontextmanager
async def cli_server(tmp_path: Path, *args: str, pass_fds=(), command: str = "qemu"):
    """``aioslirp COMMAND ARGS`` (``qemu``, ``vhost-user``) as a subprocess; yields it, then SIGTERM
    and expects exit 0."""
    log = open(tmp_path / "aioslirp.log", "w+")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "aioslirp", command, *args,
                                                "--log-level", "info", stdout=log, stderr=log, pass_fds=pass_fds)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            rc = await asyncio.wait_for(proc.wait(), 15)
        except asyncio.TimeoutError:
            proc.kill()
            rc = await proc.wait()
        log.seek(0)
        proc.log_text = log.read()
        log.close()
        assert rc == 0, proc.log_text[-3000:]


async def wait_path(path: Path, timeout: float = 10) -> None:
    for _ in range(int(timeout / 0.02)):
        if path.exists():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def check_vm(res: qemu.VmResult) -> None:
    assert not res.timed_out, "guest timed out:\n" + res.tail()
    assert res.rc == 0, f"guest exit {res.rc} (qemu rc {res.qemu_rc}):\n" + res.tail()


def report(request, name: str, value) -> None:
    request.node.user_properties.append((name, value))
    print(f"{request.node.name}: {name} = {value}")
