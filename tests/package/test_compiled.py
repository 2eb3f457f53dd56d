"""The optional compiled per-frame path (aioslirp.compiled, setup.py): loaded when built, switched
off by ``AIOSLIRP_NO_EXTENSIONS=1`` and by a stale build, and bit-for-bit the same as the
pure-Python modules (the same frames out of the same lossy two-way transfer)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from aioslirp import compiled

from support.paths import TESTS
from support.prereqs import need


pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

PKG = Path(compiled.__file__).resolve().parent

#: A lossy, reordering transfer both ways between two TcpConnections (the simulation of
#: support/tcp_conn.py), every segment also built into a frame and parsed back; prints a digest of all
#: of it, the transferred bytes' hashes and the compiled notice.
SCENARIO = r"""
import hashlib, random, sys
sys.path.insert(0, sys.argv[1])
from aioslirp import compiled
from aioslirp.tcp.connection import TcpConnection
from aioslirp.wire.tcp import TcpFrameBuilder, parse_segment, syn_options, SYN
from support.tcp_conn import App, LossyWire, MSS, run_transfer

rng = random.Random(5)
size = 1 << 17
host_data, guest_data = rng.randbytes(size), rng.randbytes(size)
stack = TcpConnection(iss=2**32 - 500_000, mss=MSS, rcv_buf=128 * 1024, snd_buf=64 * 1024, now=0.0)
guest = TcpConnection(iss=2**32 - 700_000, mss=MSS, rcv_buf=256 * 1024, snd_buf=64 * 1024, now=0.0)
to_stack, to_guest = LossyWire(rng, 0.05, 0.001, 0.002), LossyWire(rng, 0.05, 0.001, 0.002)
apps = (App(stack, host_data, rng), App(guest, guest_data, rng))
b4 = TcpFrameBuilder(b"e" * 14, bytes([10, 0, 2, 2]), bytes([10, 0, 2, 15]), 80, 40000)
b6 = TcpFrameBuilder(b"e" * 14, bytes(range(16)), bytes(range(16, 32)), 80, 40000, True)
h = hashlib.sha256()


def on_step(now, out):
    for s in out:
        opts = syn_options(s) if s.flags & SYN else b""
        f4 = b4.build(s.seq, s.ack, s.flags, s.wnd, opts, s.payload)
        f6 = b6.build(s.seq, s.ack, s.flags, s.wnd, opts, s.payload, 1400)
        h.update(f4); h.update(f6); h.update(f6.vnet)
        h.update(repr(parse_segment(memoryview(bytes(f4))[34:])).encode())
    h.update(repr((now, stack.state, guest.state, stack.snd_una, stack.rcv_nxt, stack.get_timer())).encode())


run_transfer(stack, guest, to_stack, to_guest, apps, on_step)
for a in apps:
    a.drain()
print(h.hexdigest(), hashlib.sha256(apps[0].received).hexdigest() == hashlib.sha256(guest_data).hexdigest(),
      hashlib.sha256(apps[1].received).hexdigest() == hashlib.sha256(host_data).hexdigest(), stack.retransmitted_segments)
print(compiled.notice())
"""


def _run(env_extra: dict, pythonpath: Path | None = None) -> list[str]:
    env = dict(os.environ)
    env.pop(compiled.ENV, None)
    env.update(env_extra)
    pythonpath = pythonpath or PKG.parent  # the aioslirp this process imported, whatever is installed
    env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(TESTS)], env=env, capture_output=True, text=True,
                         timeout=240, check=True, cwd=pythonpath)
    return out.stdout.splitlines()


def _built() -> bool:
    return any(p.name.startswith("tcb.") and p.suffix == ".so" for p in (PKG / "tcp").iterdir())


def test_the_build_is_loaded_unless_switched_off():
    """With a C compiler the install built the extension (CI installs gcc), and this process
    loaded every compiled module from it; under AIOSLIRP_NO_EXTENSIONS=1 (the pure CI pass)
    none."""
    st = compiled.status()
    assert set(st) == set(compiled.COMPILED)
    if compiled.disabled():
        assert not any(st.values())
        assert compiled.notice() == "compiled per-frame path: off (AIOSLIRP_NO_EXTENSIONS is set); pure Python"
    elif shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") and not compiled.stale():
        # A tree on PYTHONPATH that no install built (a git worktree) has nothing compiled.
        need(_built(), "the compiled modules are not built here: pip install -e . (with gcc)")
        assert all(st.values()), st
        assert compiled.notice() == f"compiled per-frame path: on ({len(st)}/{len(st)} modules)"
    else:
        pytest.skip("no C compiler, or an edit since the build: nothing compiled to check")


def test_compiled_and_pure_give_the_same_frames():
    """The same seeded lossy transfer, compiled and pure: the same segments, frames (IPv4 complete
    checksums; IPv6 offload with GSO and its virtio-net header), timers and states, step by step."""
    if not _built():
        pytest.skip("the extension is not built here")
    compiled_run = _run({})
    pure_run = _run({compiled.ENV: "1"})
    assert compiled_run[1].startswith("compiled per-frame path: on")
    assert pure_run[1] == "compiled per-frame path: off (AIOSLIRP_NO_EXTENSIONS is set); pure Python"
    digest, up_ok, down_ok, retransmitted = compiled_run[0].split()
    assert up_ok == down_ok == "True" and int(retransmitted) > 0
    assert compiled_run[0] == pure_run[0]


def test_an_edit_after_the_build_runs_the_source(tmp_path):
    """A compiled module's ``.py`` that is not the source its native module was built from (an
    edit since the install): every compiled module loads from source and the notice says to
    rebuild; a copy outside a checkout is an installed package, to be reinstalled."""
    if not _built():
        pytest.skip("the extension is not built here")
    copy = tmp_path / "aioslirp"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for lib in PKG.parent.glob("aioslirp__mypyc*.so"):
        shutil.copy2(lib, tmp_path)
    src = copy / "tcp" / "output.py"
    src.write_text(src.read_text() + "\n# an edit\n")
    lines = _run({}, pythonpath=tmp_path)
    assert lines[1] == ("compiled per-frame path: off (stale build: aioslirp.tcp.output.py changed since; "
                        "rebuild by reinstalling aioslirp (pip install --force-reinstall --no-deps)); pure Python")


def _fake_build(root: Path, record: bool = True) -> Path:
    """``root/aioslirp``: the compiled modules' sources as they are, an (empty) native module
    beside each, and the build's record of their hashes; returns the package directory."""
    pkg = root / "aioslirp"
    lines = []
    for name in compiled.COMPILED:
        rel = name.replace(".", "/") + ".py"
        src = root / rel
        src.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PKG.parent / rel, src)
        src.with_suffix(importlib.machinery.EXTENSION_SUFFIXES[0]).write_bytes(b"")
        lines.append(f"{hashlib.sha256(src.read_bytes()).hexdigest()}  {rel}\n")
    if record:
        (pkg / compiled.RECORD).write_text("".join(lines))
    return pkg


def test_stale_goes_by_content_not_by_time(tmp_path, monkeypatch):
    """An install writes the native modules before the sources (newer times, same content): not
    stale. A ``touch`` long after the build: not stale. A changed byte: stale, that module only."""
    pkg = _fake_build(tmp_path)
    monkeypatch.setattr(compiled, "_PKG_DIR", str(pkg))
    assert compiled.stale() == []
    tcb = pkg / "tcp" / "tcb.py"
    later = tcb.stat().st_mtime + 3600
    for src in pkg.rglob("*.py"):
        os.utime(src, (later, later))
    assert compiled.stale() == []
    tcb.write_bytes(tcb.read_bytes().replace(b"\n", b"\n ", 1)[:-1] + b"\n")  # same size, other bytes
    old = pkg.stat().st_mtime - 3600
    os.utime(tcb, (old, old))  # older than its native module: the time would say current
    assert compiled.stale() == ["aioslirp.tcp.tcb"]


def test_stale_without_a_record_or_a_native_module(tmp_path, monkeypatch):
    """Native modules with no record (a build by an older setup.py) cannot be checked: stale.
    Sources with no native module beside them (a pure install): nothing stale."""
    pkg = _fake_build(tmp_path, record=False)
    monkeypatch.setattr(compiled, "_PKG_DIR", str(pkg))
    assert compiled.stale() == list(compiled.COMPILED)
    for so in pkg.rglob("*" + importlib.machinery.EXTENSION_SUFFIXES[0]):
        so.unlink()
    assert compiled.stale() == []


def test_the_remedy_names_the_kind_of_install(tmp_path, monkeypatch):
    """In a source checkout (setup.py and pyproject.toml beside the package, an editable install)
    the remedy is ``pip install -e .``; elsewhere (site-packages) a reinstall."""
    pkg = _fake_build(tmp_path)
    monkeypatch.setattr(compiled, "_PKG_DIR", str(pkg))
    assert compiled._rebuild() == "rebuild by reinstalling aioslirp (pip install --force-reinstall --no-deps)"
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("")
    assert compiled._rebuild() == "rebuild with pip install -e ."
