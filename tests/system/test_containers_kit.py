"""RootlessKit and Podman drive ``aioslirp-slirp4netns`` in place of slirp4netns.

Runs the kit in ``../shared/containers/`` (its README lists every check):
``rootlesskit-smoke.sh BINARY`` (R1-R5, RootlessKit 1.1.0 as the unprivileged test user)
and ``podman-smoke.sh BINARY`` (P1-P4 rootful and rootless, P5 rootless; Podman 4.3.1),
first with aioslirp, then with the real slirp4netns in the same run for comparison. The
clients are real and unmodified; the checks move data both ways and compare md5 sums.

aioslirp must pass every check, including the one that is only ``KNOWN`` (not counted)
for slirp4netns: replies to a forwarded UDP port under ``--disable-host-loopback``.

Needs root and ``setup.sh`` run once (``.ci/prereqs`` does it): the packages, the test user
``ckit`` and the busybox root filesystem. Missing prerequisites skip these tests, except
under CI (``CI`` set), where they fail. BINARY is the console script of a virtualenv every
user can run (``tests/support/worldvenv.py``): the test user cannot read a venv under /root.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.paths import SHARED
from support.prereqs import need

KIT = SHARED / "containers"
KIT_USER = os.environ.get("CONTAINERS_KIT_USER", "ckit")
KIT_CACHE = Path(os.environ.get("CONTAINERS_KIT_CACHE", os.path.expanduser("~/.cache/containers-kit")))

pytestmark = [pytest.mark.slow, pytest.mark.netns]

#: Checks each script has (with aioslirp every one passes; R4's UDP forward is a PASS too).
EXPECTED_PASSES = {"rootlesskit-smoke.sh": 29, "podman-smoke.sh": 39}

_SUMMARY = re.compile(r"^(?P<prog>\S+): (?P<passed>\d+) passed, (?P<failed>\d+) failed$", re.M)


def _missing() -> list[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for script in ("setup.sh", "rootlesskit-smoke.sh", "podman-smoke.sh"):
        if not (KIT / script).is_file():
            missing.append(str(KIT / script))
    for cmd in ("rootlesskit", "rootlessctl", "podman", "conmon", "runc", "slirp4netns", "newuidmap", "runuser", "flock", "nsenter"):
        if not shutil.which(cmd):
            missing.append(cmd)
    if subprocess.run(["id", KIT_USER], capture_output=True).returncode != 0:
        missing.append(f"user {KIT_USER}")
    if not (KIT_CACHE / "rootfs" / "bin" / "busybox").exists():
        missing.append(f"{KIT_CACHE}/rootfs")
    return missing


@pytest.fixture(scope="module")
def kit_ready():
    missing = _missing()
    if missing:
        need(False, f"containers kit not set up ({', '.join(missing)}): run {KIT}/setup.sh as root")


@pytest.fixture(scope="module")
def aioslirp_binary(kit_ready):
    """``aioslirp-slirp4netns`` from a world-readable venv (the test user must run it)."""
    from support.worldvenv import Unavailable, build_world_venv

    work = Path(tempfile.mkdtemp(prefix="aioslirp-kit-"))
    try:
        try:
            _vpy, vbin = build_world_venv(work)
        except Unavailable as exc:
            need(False, str(exc))
        yield str(vbin / "aioslirp-slirp4netns")
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class KitRun:
    returncode: int
    passed: int
    failed: int
    known: list
    failures: list
    output: str


def run_kit(script: str, binary: str, timeout: float = 420) -> KitRun:
    p = subprocess.run(["bash", str(KIT / script), binary], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "CONTAINERS_KIT_KEEP": "0"})
    out = p.stdout + p.stderr
    m = list(_SUMMARY.finditer(p.stdout))
    assert m, f"{script} printed no summary line:\n{out[-4000:]}"
    last = m[-1]
    return KitRun(
        returncode=p.returncode,
        passed=int(last["passed"]),
        failed=int(last["failed"]),
        known=[line for line in p.stdout.splitlines() if line.startswith("KNOWN:")],
        failures=[line for line in p.stdout.splitlines() if line.startswith("FAIL:")],
        output=out,
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", ["rootlesskit-smoke.sh", "podman-smoke.sh"])
def test_kit_with_aioslirp_and_slirp4netns(script, aioslirp_binary, capsys, record_property):
    ours = run_kit(script, aioslirp_binary)
    real = run_kit(script, shutil.which("slirp4netns"))
    record_property("aioslirp", f"{ours.passed} passed, {ours.failed} failed, {len(ours.known)} known")
    record_property("slirp4netns", f"{real.passed} passed, {real.failed} failed, {len(real.known)} known")
    with capsys.disabled():
        print(f"\n{script}: aioslirp {ours.passed} passed, {ours.failed} failed, {len(ours.known)} known; "
              f"slirp4netns {real.passed} passed, {real.failed} failed, {len(real.known)} known")
        for line in ours.failures + [f"(slirp4netns) {f}" for f in real.failures]:
            print(f"  {line}")
    assert ours.failed == 0 and ours.returncode == 0, "\n".join(ours.failures) + "\n" + ours.output[-6000:]
    assert ours.known == [], ours.known  # no excuses: aioslirp passes what slirp4netns cannot
    assert ours.passed == EXPECTED_PASSES[script], ours.output[-6000:]
    # the same checks, counted the same way, for the real binary (it leaves R4's UDP as KNOWN)
    assert real.passed + real.failed + len(real.known) == ours.passed + ours.failed, real.output[-4000:]
