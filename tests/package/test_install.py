"""A non-editable install keeps the compiled per-frame path (issue 29): a wheel built from a
checkout, and an sdist built by pip, installed into fresh virtual environments, load all their
compiled modules (``aioslirp --version``: ``compiled per-frame path: on (20/20 modules)``), and
the native init of ``spawn()`` (``aioslirp/host/aioslirp-init``, from ``aioslirp/native/init.c``),
which ``aioslirp.host.nschild.native_init()`` finds there (issue 28).

An install writes the native modules before the ``.py`` sources; the staleness check goes by
the SHA-256 that the build recorded (``aioslirp/compiled.sha256``), not by file times.

Offline (pytest runs in a loopback-only namespace): the builds use this environment's
setuptools and mypy (``--no-build-isolation``, the test extra carries them), and the new
environments see this one's packages through a ``.pth`` line for the dependencies only (a path
a ``.pth`` file adds is not a site directory: the editable install here is not loaded). Each
test checks that the ``aioslirp`` it ran is the one installed in its new environment. About
40 s of mypyc and gcc each, so slow; CI (which has gcc) runs them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from aioslirp import compiled

from support.paths import REPO
from support.prereqs import importable, need

N = len(compiled.COMPILED)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

#: What a checkout holds that no build reads (and build products of an editable install).
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "site", "mutants", "benchmarks", "tests",
                                     "fuzz", "__pycache__", "*.egg-info", "*.so", compiled.RECORD, ".pytest_cache",
                                     ".hypothesis", "aioslirp-init")


def _env() -> dict:
    """The environment for the builds and the new interpreters: no PYTHONPATH (it would put the
    tree under test first), no switch-off of the compiled modules or the native plane."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", compiled.ENV, "AIOSLIRP_NATIVE", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(argv: list, cwd: Path, timeout: float = 900) -> str:
    p = subprocess.run([str(a) for a in argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{argv}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the project as a clone has it (no build products, no venv)."""
    need(importable("mypyc"), "mypy (mypyc) is not installed here: pip install -e '.[test]'")
    need(importable("wheel") or importable("setuptools.command.bdist_wheel"),
         "the wheel package is not installed here: pip install -e '.[test]'")
    need(shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc"), "no C compiler (apt-get install gcc)")
    dst = tmp_path_factory.mktemp("checkout") / "aioslirp"
    shutil.copytree(REPO, dst, ignore=_NOT_SOURCE)
    return dst


def _venv(path: Path) -> Path:
    """A fresh virtual environment (pip from the interpreter's own bundled wheel, offline) that
    sees this environment's installed packages as dependencies, after its own."""
    _run([sys.executable, "-m", "venv", path], cwd=path.parent, timeout=300)
    site = Path(_run([path / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=path.parent).strip())
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(here)))
    return path


def _check_installed(venv: Path, cwd: Path) -> None:
    """The ``aioslirp`` imported is the one in ``venv``, it runs compiled, and its native data plane
    was built and is on (the default), the vhost-user rings' extension too."""
    where = _run([venv / "bin" / "python", "-c", "import aioslirp; print(aioslirp.__file__)"], cwd=cwd).strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    lines = _run([venv / "bin" / "aioslirp", "--version"], cwd=cwd).splitlines()
    assert lines[-2] == f"compiled per-frame path: on ({N}/{N} modules)", lines
    assert lines[-1] == "native data plane: on", lines
    init = _run([venv / "bin" / "python", "-c", "from aioslirp.host.nschild import native_init; print(native_init())"],
                cwd=cwd).strip()
    assert init == str(Path(where).parent / "host" / "aioslirp-init"), init
    p = subprocess.run([init], capture_output=True, text=True, timeout=60)  # no fd given: its usage line
    assert (p.returncode, p.stderr) == (2, "aioslirp-init is internal to aioslirp (started by aioslirp.spawn)\n")
    vhost = _run([venv / "bin" / "python", "-c", "from aioslirp.native import vhost; print(vhost.why_not() or 'usable')"],
                 cwd=cwd).strip()
    assert vhost == "usable", vhost  # the vhost-user rings' extension, built and recorded beside it


def test_sdist_to_wheel_install_runs_compiled(checkout, tmp_path):
    """The sdist carries what the build needs (setup.py, the module list, the C sources); ``pip
    wheel`` of it (what ``pip install`` of an sdist builds: one mypyc and C build, where a checkout's
    own build is the editable install the suite runs on) makes a wheel with every compiled module,
    the native init and its record; installed into a new venv it runs compiled."""
    out = _run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                "print(build_meta.build_sdist(sys.argv[1]))", tmp_path / "sdist"], cwd=checkout)
    sdist = tmp_path / "sdist" / out.strip().splitlines()[-1]
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "aioslirp/compiled.py", "aioslirp/tcp/tcb.py",
            "aioslirp/native/init.c", "aioslirp/native/sources.py", "aioslirp/native/dataplane.c",
            "aioslirp/native/dataplane.h", "aioslirp/native/_dataplane.c", "aioslirp/native/vring.c",
            "aioslirp/native/vring.h", "aioslirp/native/_vhost.c", "aioslirp/native/tcpnat.c",
            "aioslirp/native/_tcpnat.c"} <= names
    assert not [n for n in names if n.endswith(".so") or n.endswith(compiled.RECORD) or n.endswith("aioslirp-init")]
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index",
          "-w", dist, sdist], cwd=tmp_path)
    (wheel,) = dist.glob("aioslirp-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read(f"aioslirp/{compiled.RECORD}").decode().splitlines()
        init = z.getinfo("aioslirp/host/aioslirp-init")
    assert (init.external_attr >> 16) & 0o111 == 0o111, oct(init.external_attr >> 16)  # executable
    native = [m for m in compiled.COMPILED if any(n.startswith(m.replace(".", "/") + ".") and n.endswith(".so")
                                                   for n in names)]
    assert native == list(compiled.COMPILED)
    assert sorted(line.split("  ")[1] for line in record) == sorted(m.replace(".", "/") + ".py"
                                                                    for m in compiled.COMPILED)
    venv = _venv(tmp_path / "venv")
    _run([venv / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", wheel], cwd=tmp_path)
    _check_installed(venv, tmp_path)
