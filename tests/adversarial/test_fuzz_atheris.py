"""The atheris target ``fuzz/fuzz_frames.py``: a bounded libFuzzer run, and the regression replay.

The bounded run (``AIOSLIRP_FUZZ_RUNS`` inputs, default 5,000; set it higher for a longer run on
demand) draws a new libFuzzer seed each time, so that every test run explores other mutations;
the seed is printed (``pytest -s``) and named in the failure message, and
``AIOSLIRP_FUZZ_SEED=N`` repeats a run. It needs atheris (``pip install atheris``, in the ``test`` extra); the replay of
``fuzz/regressions/`` needs nothing. pytest's loopback-only namespace is inherited by the fuzzer,
whose stack also allows only loopback destinations.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys

from support.paths import REPO
from support.prereqs import importable, need

TARGET = REPO / "fuzz" / "fuzz_frames.py"
REGRESSIONS = REPO / "fuzz" / "regressions"


def load_target():
    spec = importlib.util.spec_from_file_location("fuzz_frames", TARGET)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def regression_files():
    return sorted(p for p in REGRESSIONS.iterdir() if p.is_file() and p.suffix != ".md")


def test_regressions_replay():
    target = load_target()
    files = regression_files()
    assert files
    try:
        for path in files:
            target.run_input(path.read_bytes())  # raises on a property violation
            target.run_input(path.read_bytes())  # and again, on the state the first left
        stack = target._stack
        assert stack.counters["drop.internal_error"] == 0
        assert stack.counters["frames_in"] >= len(files)
    finally:
        target.close()


def test_split_frames_format():
    target = load_target()
    assert target.split_frames(b"") == []
    assert target.split_frames(b"\x00\x03abcX") == [b"abc", b"X"]  # a lone trailing byte is a frame
    assert target.split_frames(b"\x00\x02ab\x00\x09cd") == [b"ab", b"cd"]  # the last frame takes the rest


def test_atheris_bounded_run(tmp_path):
    need(importable("atheris"), "atheris is not installed (pip install atheris; it is in the test extra)")
    corpus = tmp_path / "corpus"
    subprocess.run([sys.executable, str(TARGET), "--seeds", str(corpus)], check=True, timeout=60)
    for path in regression_files():
        shutil.copy(path, corpus / path.name)
    runs = int(os.environ.get("AIOSLIRP_FUZZ_RUNS", "5000"))
    seed = int(os.environ.get("AIOSLIRP_FUZZ_SEED") or random.randrange(1, 2**31))
    print(f"\natheris: {runs} runs, seed {seed} (AIOSLIRP_FUZZ_SEED={seed} repeats them)")
    p = subprocess.run([sys.executable, str(TARGET), f"-runs={runs}", f"-seed={seed}", "-max_len=4096",
                        f"-artifact_prefix={tmp_path}/", str(corpus)],
                       capture_output=True, text=True, timeout=max(120, runs // 100))
    crashes = sorted(tmp_path.glob("crash-*")) + sorted(tmp_path.glob("timeout-*")) + sorted(tmp_path.glob("oom-*"))
    assert p.returncode == 0 and not crashes, (f"seed {seed} (AIOSLIRP_FUZZ_SEED={seed}): rc={p.returncode} "
                                               f"artifacts={crashes}\n{p.stderr[-4000:]}")
    assert f"Done {runs} runs" in p.stderr, f"seed {seed}"
    assert f"Seed: {seed}" in p.stderr  # libFuzzer used it
