"""RX in place (vring.c vr_rx_reserve) against a guest that moves its avail index while the
engine reserves a turn's frames (reserve_frames(): up to 4 reservations; the guest's vCPUs run
beside the device). Each reservation checked the chains it took against the index it read, not
the chains the reservation held already: frame 1 took the ring's 2 chains (one empty, one of
128 KB), the guest published both entries again, frame 2 took 2 more and wrote the queue's heads
and lens arrays (num entries) at [2] and [3], past their end. A reservation holds at most num
chains: frame 2 is refused (0), the engine then copies.

The case is driven in C (tests/support/vring_rsv_race.c built with vring.c, under ASan/UBSan
when gcc has them): the index moves between the two calls exactly, as a guest's may."""

from __future__ import annotations

import os
import shutil
import subprocess

from support.paths import REPO
from support.prereqs import need


def test_a_reservation_never_takes_more_chains_than_the_queue_holds(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    need(cc, "no C compiler for tests/support/vring_rsv_race.c (apt-get install gcc)")
    exe = tmp_path / "vring_rsv_race"
    base = [cc, "-std=c11", "-D_GNU_SOURCE", "-O1", "-g", "-Wall", "-I", str(REPO / "aioslirp/native"),
            "-o", str(exe), str(REPO / "tests/support/vring_rsv_race.c")]
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover", "-fno-omit-frame-pointer"]
    if subprocess.run(base + san, capture_output=True).returncode != 0:  # no libasan: plain
        subprocess.run(base, check=True)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    env.pop("LD_PRELOAD", None)
    p = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    words = p.stdout.split()
    got = dict(zip(words[::2], map(int, words[1::2])))
    assert got["frame1"] == 1, p.stdout
    assert got["frame2"] == 0 and got["chains"] <= got["num"], p.stdout
