"""A virtualenv every user can run, for tests that start aioslirp as an unprivileged user.

The interpreter running the tests may live where other users cannot read it (pyenv under
``/root``), so the tests build a venv from ``/usr/bin/python3`` (Debian's 3.11) in a
world-readable temporary folder, install a wheel of this checkout into it (with every
console script of ``pyproject.toml``), and copy the dependencies the package imports from
the test environment (same Python version, so compiled extensions fit). The same recipe
as ``tests/system/test_netns.py``'s ``rootless_env`` fixture, usable from any test module.

``build_world_venv(work) -> (python, bin_dir)`` raises :class:`Unavailable` (a reason to
skip) when ``/usr/bin/python3`` is missing or of another minor version.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from support.paths import REPO

BASE_PYTHON = "/usr/bin/python3"

__all__ = ["Unavailable", "build_world_venv", "console_scripts"]


class Unavailable(RuntimeError):
    """The venv cannot be built here; ``str()`` says why (for ``conftest.need``)."""


def console_scripts() -> dict[str, str]:
    """``name -> "module:function"`` from ``[project.scripts]`` of pyproject.toml."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"].get("scripts", {}))


def _build_wheel(dest: Path) -> Path:
    from aioslirp import __version__

    name = f"aioslirp-{__version__}"
    whl = dest / f"{name}-py3-none-any.whl"
    records = []

    def add(zf: zipfile.ZipFile, arcname: str, data: bytes) -> None:
        zf.writestr(arcname, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        records.append(f"{arcname},sha256={digest},{len(data)}")

    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted((REPO / "aioslirp").rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".typed", ".json"):
                add(zf, str(path.relative_to(REPO)), path.read_bytes())
        info = f"{name}.dist-info"
        add(zf, f"{info}/METADATA", f"Metadata-Version: 2.1\nName: aioslirp\nVersion: {__version__}\n".encode())
        add(zf, f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: aioslirp-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        scripts = "".join(f"{k} = {v}\n" for k, v in sorted(console_scripts().items()))
        add(zf, f"{info}/entry_points.txt", f"[console_scripts]\n{scripts}".encode())
        records.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return whl


# Imports everything aioslirp may import, then prints the site-packages entries that served them.
_CLOSURE_SCRIPT = """
import asyncio, importlib, json, pkgutil, site, sys
import aioslirp, uvloop, dpkt
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
for info in pkgutil.walk_packages(aioslirp.__path__, "aioslirp."):
    try:
        importlib.import_module(info.name)
    except Exception:
        pass
async def start_stack():
    async with aioslirp.Stack(aioslirp.NetworkConfig()):
        pass
asyncio.run(start_stack())
roots = [p for p in site.getsitepackages() + [site.getusersitepackages()] if p]
tops = set()
for mod in list(sys.modules.values()):
    f = getattr(mod, '__file__', None) or ''
    for root in roots:
        if f.startswith(root.rstrip('/') + '/'):
            top = f[len(root.rstrip('/')) + 1:].split('/')[0]
            tops.add((root, top))
print(json.dumps(sorted(tops)))
"""


def build_world_venv(work: Path) -> tuple[Path, Path]:
    """Build ``work/venv`` readable and runnable by every user. Returns ``(python, bin_dir)``.

    ``work`` must exist; it and everything below are made world-readable (directories
    0755). Raises :class:`Unavailable` or ``subprocess.CalledProcessError``.
    """
    if not os.path.exists(BASE_PYTHON):
        raise Unavailable(f"{BASE_PYTHON} is missing: cannot make a virtualenv an unprivileged user can run")
    work.chmod(0o755)
    venv = work / "venv"
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    vpy = venv / "bin" / "python"
    vver = subprocess.run(
        [str(vpy), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if vver != "%d.%d" % sys.version_info[:2]:
        raise Unavailable(
            f"{BASE_PYTHON} is {vver}, tests run {sys.version_info[0]}.{sys.version_info[1]}: cannot share dependencies"
        )
    whl = _build_wheel(work)
    # Without PYTHONPATH: a checkout on it (PYTHONPATH=$PWD, as the worktrees run the suite) holds
    # aioslirp.egg-info, so pip would find aioslirp "already installed" and install no scripts.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(vpy), "install", "-q", "--no-deps", "--no-index", str(whl)],
        check=True,
        timeout=120,
        env=env,
    )
    if not (venv / "bin" / "aioslirp").exists():
        raise RuntimeError(f"pip installed no console scripts into {venv}")
    site_dir = Path(
        subprocess.run(
            [str(vpy), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    closure = json.loads(
        subprocess.run([sys.executable, "-c", _CLOSURE_SCRIPT], capture_output=True, text=True, check=True, cwd=REPO).stdout
    )
    for root, top in closure:
        if top.startswith(("aioslirp", "__editable__", "_distutils_hack")) or (site_dir / top).exists():
            continue
        src = Path(root) / top
        if src.is_dir():
            shutil.copytree(src, site_dir / top, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, site_dir / top)
    # Byte-compile now (as the builder): the unprivileged users who run it cannot write
    # __pycache__, and compiling pyroute2 & co. at every start costs seconds.
    subprocess.run([str(vpy), "-m", "compileall", "-q", str(site_dir)], check=False, timeout=300,
                   stdout=subprocess.DEVNULL)
    for dirpath, dirnames, filenames in os.walk(work):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        for f in filenames:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | 0o444)
    return vpy, venv / "bin"
