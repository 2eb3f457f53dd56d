"""The atheris target ``fuzz/fuzz_vring.py`` (the vhost-user rings' C walker held to its Python
model): a bounded libFuzzer run, a new seed each time (``AIOSLIRP_FUZZ_RUNS``, default 20,000
inputs, about a minute; ``AIOSLIRP_FUZZ_SEED=N`` repeats a run)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from support.native import need_vhost
from support.paths import REPO
from support.prereqs import importable, need

pytestmark = pytest.mark.sanitizer  # .ci/run runs it as a stage of its own (with the ASan build)

TARGET = REPO / "fuzz" / "fuzz_vring.py"


def test_atheris_bounded_run_of_the_vring_walker(tmp_path):
    need_vhost()
    need(importable("atheris"), "atheris is not installed (pip install atheris; it is in the test extra)")
    runs = int(os.environ.get("AIOSLIRP_FUZZ_RUNS", "20000"))
    seed = int(os.environ.get("AIOSLIRP_FUZZ_SEED") or random.randrange(1, 2**31))
    print(f"\natheris (vring): {runs} runs, seed {seed} (AIOSLIRP_FUZZ_SEED={seed} repeats them)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    p = subprocess.run([sys.executable, str(TARGET), f"-runs={runs}", f"-seed={seed}", "-max_len=512",
                        f"-artifact_prefix={tmp_path}/", str(corpus)],
                       capture_output=True, text=True, timeout=max(120, runs // 20))
    crashes = sorted(tmp_path.glob("crash-*")) + sorted(tmp_path.glob("timeout-*")) + sorted(tmp_path.glob("oom-*"))
    assert p.returncode == 0 and not crashes, (f"seed {seed} (AIOSLIRP_FUZZ_SEED={seed}): rc={p.returncode} "
                                               f"artifacts={crashes}\n{p.stderr[-4000:]}")
    assert f"Done {runs} runs" in p.stderr, f"seed {seed}"
