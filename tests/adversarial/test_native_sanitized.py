"""The native data plane under AddressSanitizer and UndefinedBehaviorSanitizer.

``AIOSLIRP_SANITIZE=1`` makes ``setup.py`` build the native extension alone with
``-fsanitize=address,undefined -fno-omit-frame-pointer`` (``-fno-sanitize-recover``: undefined
behaviour aborts). The test builds a copy of the checkout that way in a temporary directory and
runs the classifier's and the UDP pieces' unit tests, the corpus replay, the TAP reader's tests and
the native UDP flows' differential test, and the vhost-user rings against hostile front ends
(tests/adversarial/test_vhost_hostile.py) in a child interpreter with gcc's ``libasan`` preloaded (``ASAN_OPTIONS=detect_leaks=0``: the
interpreter's own allocations at exit are not the extension's). Any out-of-bounds access, use
after free or undefined behaviour in C aborts the child: the test asserts a clean exit.
Skipped (failed under CI) without gcc's libasan.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from aioslirp import compiled
from aioslirp.native import sources

from support.paths import REPO, SHARED
from support.prereqs import need

pytestmark = [pytest.mark.timeout(900), pytest.mark.sanitizer]  # .ci/run runs it as a stage of its own

#: The test files run under the sanitizers (relative to the checkout).
SANITIZED_TESTS = ("tests/unit/native/test_classify.py", "tests/unit/native/test_udp_native.py",
                   "tests/unit/native/test_udp_table.py",
                   "tests/adversarial/test_native_corpus.py",
                   "tests/system/test_tap_reader.py", "tests/stack/test_native_udp.py",
                   "tests/adversarial/test_vhost_hostile.py", "tests/adversarial/test_vring_model.py",
                   "tests/adversarial/test_vhost_native_tcp.py", "tests/adversarial/test_vhost_rx_in_place.py",
                   "tests/unit/native/test_tcp_engine.py", "tests/unit/native/test_tcp_differential.py",
                   "tests/adversarial/test_native_tcp_hostile.py", "tests/system/test_native_tcp.py",
                   "tests/unit/native/test_tcp_trace.py", "tests/unit/native/test_tcp_trace_events.py",
                   "tests/unit/native/test_tcp_rate.py", "tests/system/test_native_trace.py",
                   "tests/unit/native/test_tcp_allow.py", "tests/stack/test_native_tcp_fair.py",
                   "tests/unit/native/test_tcp_gather.py", "tests/stack/test_native_tcp_stack.py",
                   "tests/adversarial/test_vhost_rx_reserve_race.py", "tests/adversarial/test_native_reader_divert.py",
                   "tests/adversarial/test_native_tcp_gather_hostile.py", "tests/unit/native/test_tcp_trace_json.py",
                   "tests/unit/observe/test_sink.py", "tests/system/test_trace_sink.py",
                   "tests/stack/test_syn_lane.py", "tests/adversarial/test_vhost_tx_in_place.py",
                   "tests/unit/native/test_tcp_engine_delack.py", "tests/adversarial/test_vhost_tx_defer.py")


def _libasan() -> Path | None:
    cc = (sysconfig.get_config_var("CC") or "gcc").split()[0]
    if not shutil.which(cc):
        return None
    out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return Path(out) if os.path.isabs(out) and Path(out).exists() else None


def test_native_plane_is_clean_under_asan_and_ubsan(tmp_path):
    libasan = _libasan()
    need(libasan is not None, "gcc's libasan is missing (apt-get install gcc: libasan8 comes with it)")
    tree = tmp_path / "aioslirp-asan"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "build", "site", "docs",
                                                              "benchmarks", "examples", "mutants", "__pycache__",
                                                              "*.so", "*.sha256", ".hypothesis", ".pytest_cache"))
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED)  # ../shared beside the copy: the corpus
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", compiled.ENV)}
    env[sources.SANITIZE_ENV] = "1"
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (so,) = (tree / "aioslirp" / "native").glob("_dataplane*.so")
    (vso,) = (tree / "aioslirp" / "native").glob("_vhost*.so")  # the vhost-user rings
    for lib in (so, vso):
        assert b"__asan_report_load" in lib.read_bytes() and b"__ubsan_handle" in lib.read_bytes()
    env.pop(sources.SANITIZE_ENV)
    env.update(PYTHONPATH=str(tree), LD_PRELOAD=str(libasan), ASAN_OPTIONS=f"detect_leaks=0:abort_on_error=1:log_path={tmp_path}/asan",
               PYTHONMALLOC="malloc",  # every object from malloc, whose bounds ASan guards (not pymalloc arenas)
               UBSAN_OPTIONS=f"halt_on_error=1:print_stacktrace=1:log_path={tmp_path}/ubsan")
    where = subprocess.run([sys.executable, "-c", "from aioslirp import native; print(native.extension().__file__)"],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0 and Path(where.stdout.strip()) == so, where.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        *SANITIZED_TESTS], cwd=tree, env=env, capture_output=True, text=True, timeout=800)
    reports = "".join(f.read_text(errors="replace") for f in sorted(tmp_path.glob("[au]*san.*")))
    tail = p.stdout[-2000:] + (reports[:4000] or p.stderr[-3000:])
    assert p.returncode == 0 and not reports, tail
    assert " passed" in p.stdout and " skipped" not in p.stdout, tail
