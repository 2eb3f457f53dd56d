"""atheris (libFuzzer) target for the vhost-user rings' C walker (``aioslirp/native/vring.c``),
held to a plain Python model of the same rules (``tests/support/vring_model.py``).

Run it on demand (the extension must be built: ``pip install -e .`` or ``AIOSLIRP_NO_MYPYC=1
python setup.py build_ext --inplace``)::

    python fuzz/fuzz_vring.py -max_len=512 -artifact_prefix=/tmp/ CORPUS_DIR      # until stopped

The suite runs it bounded (``tests/adversarial/test_fuzz_vring.py``); under the sanitizer build
(``AIOSLIRP_SANITIZE=1``) an out-of-bounds access in C aborts with ASan's report.

Input: a queue size (1..32), a start index, an avail index (near or far: jumps), then a
descriptor table (addresses below, inside and past the two memory regions, lengths up to
4 GiB, NEXT/WRITE/INDIRECT flags, next indexes past the queue: loops) and an avail ring (heads
past the queue). Each input runs on the TX queue (``Device.tx``: the frames copied out) and on
the RX queue (``Device.rx``: frames written into guest buffers); frames, used entries, drop
counters, the broken state and guest memory must equal the model's. Coverage feedback comes
from the model (the C code is built by gcc without libFuzzer's instrumentation).
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))


def main(argv: list[str]) -> int:
    import atheris

    from aioslirp.native import vhost

    ext = vhost.extension()
    if ext is None:
        print(f"the vhost-user rings' extension is not usable: {vhost.why_not()}", file=sys.stderr)
        return 2
    with atheris.instrument_imports():
        import support.vring_model as model

    def one(data: bytes) -> None:
        model.check(ext, data)

    atheris.Setup(argv, one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
