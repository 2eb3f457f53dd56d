"""The package's floors hold: ``lint-imports`` (import-linter) checks the contracts of
``pyproject.toml`` ([tool.importlinter]) and exits 0 only when no module imports a floor above it."""

import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_import_layers_contract_is_kept():
    script = pathlib.Path(sys.executable).parent / "lint-imports"
    command = str(script) if script.exists() else shutil.which("lint-imports")
    assert command, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([command, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout and "KEPT" in p.stdout, p.stdout
