"""Whether the native data plane runs, and why not: ``aioslirp --version``, ``Stack.stats()["native"]``,
the switches (``AIOSLIRP_NO_EXTENSIONS``, ``AIOSLIRP_NATIVE``) and a build older than its C files."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aioslirp import Stack, compiled, native
from aioslirp.native import sources

from support.native import need_extension

PKG = Path(native.__file__).resolve().parents[1]


def _version(env_extra: dict, pythonpath: Path = PKG.parent) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in (compiled.ENV, native.ENABLE_ENV)}
    env.update(env_extra, PYTHONPATH=str(pythonpath))
    p = subprocess.run([sys.executable, "-m", "aioslirp", "--version"], env=env, capture_output=True, text=True,
                       timeout=60, check=True, cwd=pythonpath)
    return p.stdout.splitlines()


def test_version_says_on_off_and_why():
    need_extension()
    assert _version({})[-1] == "native data plane: on"  # the default where it is built
    assert _version({native.ENABLE_ENV: "0"})[-1] == "native data plane: off (AIOSLIRP_NATIVE=0: the Python path runs)"
    assert _version({native.ENABLE_ENV: "1"})[-1] == "native data plane: on"
    assert _version({native.ENABLE_ENV: "tcp"})[-1] == "native data plane: on (tcp only)"
    assert _version({native.ENABLE_ENV: "1", compiled.ENV: "1"})[-1] == ("native data plane: off "
                                                                          "(AIOSLIRP_NO_EXTENSIONS is set)")


async def test_stack_stats_carry_the_same():
    async with Stack() as stack:
        assert stack.stats()["native"] == native.status()
        assert native.notice() == "native data plane: " + stack.stats()["native"]


def _copy(tmp_path: Path) -> Path:
    """A copy of the package with its native build and record (an installed package: no setup.py)."""
    shutil.copytree(PKG, tmp_path / "aioslirp", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_an_edit_of_a_c_file_after_the_build_turns_it_off(tmp_path):
    need_extension()
    root = _copy(tmp_path)
    assert _version({native.ENABLE_ENV: "1"}, root)[-1] == "native data plane: on"
    src = root / "aioslirp" / "native" / "dataplane.c"
    src.write_text(src.read_text() + "\n/* an edit */\n")
    assert _version({native.ENABLE_ENV: "1"}, root)[-1] == (
        "native data plane: off (stale build: aioslirp/native/dataplane.c changed since; rebuild by reinstalling "
        "aioslirp (pip install --force-reinstall --no-deps))")
    src.unlink()  # an installed wheel has no C files: nothing to compare, the build runs
    (root / "aioslirp" / "native" / "dataplane.h").unlink()
    (root / "aioslirp" / "native" / "_dataplane.c").unlink()
    assert _version({native.ENABLE_ENV: "1"}, root)[-1] == "native data plane: on"


def test_no_extension_is_off_with_the_reason(tmp_path):
    root = _copy(tmp_path)
    for so in (root / "aioslirp" / "native").glob("_dataplane*.so"):
        so.unlink()
    assert _version({native.ENABLE_ENV: "1"}, root)[-1] == ("native data plane: off (not built: no C compiler at "
                                                            "install time)")


def test_changed_since_build_goes_by_content(tmp_path, monkeypatch):
    pkg = tmp_path / "aioslirp"
    (pkg / "native").mkdir(parents=True)
    for rel in sources.DEPENDS:
        (tmp_path / rel).write_bytes(rel.encode())
    record = pkg / "native" / sources.RECORD
    record.write_text("".join(f"{hashlib.sha256(rel.encode()).hexdigest()}  {rel}\n" for rel in sources.DEPENDS))
    monkeypatch.setattr(compiled, "_PKG_DIR", str(pkg))
    assert compiled.changed_since_build(str(record), sources.DEPENDS) == []
    (tmp_path / sources.SOURCES[0]).write_bytes(b"other")
    assert compiled.changed_since_build(str(record), sources.DEPENDS) == [sources.SOURCES[0]]
    record.unlink()
    assert compiled.changed_since_build(str(record), sources.DEPENDS) == list(sources.DEPENDS)


@pytest.mark.parametrize("value, reader, tcp, udp", [
    (None, True, True, True), ("", True, True, True), ("0", False, False, False), ("off", False, False, False),
    ("1", True, True, True), ("on", True, True, True), ("tcp", True, True, False), ("udp", True, False, True),
    ("1,udp", True, True, True), ("udp, tcp", True, True, True), ("TCP", True, True, False),
    ("yes", False, False, False), ("tcp,bogus", True, True, False),
])
def test_the_native_switch_is_a_comma_list_of_parts(monkeypatch, caplog, value, reader, tcp, udp):
    """``AIOSLIRP_NATIVE``: unset (the default), ``1`` or ``on`` every part; ``0`` or ``off`` none (the
    Python path); ``tcp`` the TAP reader and native TCP flows, ``udp`` the reader and native UDP flows,
    a comma list for both; an unknown part is ignored with one warning naming the variable."""
    if value is None:
        monkeypatch.delenv("AIOSLIRP_NATIVE", raising=False)
    else:
        monkeypatch.setenv("AIOSLIRP_NATIVE", value)
    native._warn_unknown.cache_clear()
    with caplog.at_level("WARNING", logger="aioslirp.native"):
        assert (native.wanted(), native.tcp_wanted(), native.udp_wanted()) == (reader, tcp, udp)
    warned = [r.getMessage() for r in caplog.records if r.name == "aioslirp.native"]
    if value in ("yes", "tcp,bogus"):
        assert warned and warned[0].startswith("AIOSLIRP_NATIVE: unknown part"), warned
    else:
        assert warned == []
