"""The atheris target ``fuzz/fuzz_native.py`` (the native frame classifier held to the Python
parsers): a bounded libFuzzer run from the libslirp corpus, a new seed each time
(``AIOSLIRP_FUZZ_RUNS``, default 50,000 inputs; ``AIOSLIRP_FUZZ_SEED=N`` repeats a run)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from support.native import need_extension
from support.paths import REPO
from support.prereqs import importable, need

pytestmark = pytest.mark.sanitizer  # .ci/run runs it as a stage of its own (with the ASan build)

TARGET = REPO / "fuzz" / "fuzz_native.py"


def test_atheris_bounded_run_of_the_native_classifier(tmp_path):
    need_extension()
    need(importable("atheris"), "atheris is not installed (pip install atheris; it is in the test extra)")
    corpus = tmp_path / "corpus"
    subprocess.run([sys.executable, str(TARGET), "--seeds", str(corpus)], check=True, timeout=60)
    assert len(list(corpus.iterdir())) > 100
    runs = int(os.environ.get("AIOSLIRP_FUZZ_RUNS", "50000"))
    seed = int(os.environ.get("AIOSLIRP_FUZZ_SEED") or random.randrange(1, 2**31))
    print(f"\natheris (native): {runs} runs, seed {seed} (AIOSLIRP_FUZZ_SEED={seed} repeats them)")
    p = subprocess.run([sys.executable, str(TARGET), f"-runs={runs}", f"-seed={seed}", "-max_len=2048",
                        f"-artifact_prefix={tmp_path}/", str(corpus)],
                       capture_output=True, text=True, timeout=max(120, runs // 50))
    crashes = sorted(tmp_path.glob("crash-*")) + sorted(tmp_path.glob("timeout-*")) + sorted(tmp_path.glob("oom-*"))
    assert p.returncode == 0 and not crashes, (f"seed {seed} (AIOSLIRP_FUZZ_SEED={seed}): rc={p.returncode} "
                                               f"artifacts={crashes}\n{p.stderr[-4000:]}")
    assert f"Done {runs} runs" in p.stderr, f"seed {seed}"
