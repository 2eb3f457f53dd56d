"""The native init of ``aioslirp.spawn()`` for the tests that run guests: the one installed with
the package (``pip install -e .`` builds it beside ``aioslirp/host/nschild.py``), else one built
here from ``aioslirp/native/init.c`` with the system's C compiler, as setup.py builds it (a
checkout that was never built, such as a git worktree), handed to aioslirp through
``AIOSLIRP_INIT``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from aioslirp import compiled
from aioslirp.host.nschild import INIT_ENV, INIT_NAME

from .paths import REPO
from .prereqs import need

SOURCE = REPO / "aioslirp" / "native" / "init.c"


def installed() -> str | None:
    """The native init installed with the package, whatever ``AIOSLIRP_INIT`` and ``AIOSLIRP_NO_EXTENSIONS`` say."""
    import aioslirp.host.nschild as nschild

    path = Path(nschild.__file__).with_name(INIT_NAME)
    return str(path) if os.access(path, os.X_OK) else None


def build(where: Path) -> str:
    """The installed native init, else one compiled into the folder ``where`` (static first, as
    setup.py links it); the test needing it is skipped (failed under CI) without a C compiler."""
    found = installed()
    if found:
        return found
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    need(cc, "no C compiler to build aioslirp/native/init.c (apt-get install gcc)")
    out = where / INIT_NAME
    for link in (["-static"], []):
        p = subprocess.run([cc, "-O2", "-Wall", "-s", *link, "-o", str(out), str(SOURCE)], capture_output=True,
                           text=True)
        if p.returncode == 0:
            return str(out)
    raise AssertionError(f"cannot build {SOURCE}: {p.stderr}")


def use(monkeypatch, path: str) -> None:
    """Make spawn() use the native init at ``path`` for this test (``AIOSLIRP_INIT``, the
    compiled-modules switch off)."""
    monkeypatch.setenv(INIT_ENV, path)
    monkeypatch.delenv(compiled.ENV, raising=False)
