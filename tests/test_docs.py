"""The documentation builds with ``mkdocs build --strict`` and the README's commands exist."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "tcp" / "index.html").is_file()


def test_readme_has_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert "aioslirp demo" in readme
    assert ".venv/bin/python -m pytest" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest" in ci
