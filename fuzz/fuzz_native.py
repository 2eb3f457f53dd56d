"""atheris (libFuzzer) target for the native frame classifier (``aioslirp/native/dataplane.c``).

Run it on demand, as long as you like (the native data plane must be built: ``pip install -e .``
or ``AIOSLIRP_NO_MYPYC=1 python setup.py build_ext --inplace``)::

    python fuzz/fuzz_native.py -max_len=4096 -artifact_prefix=/tmp/ CORPUS_DIR       # until stopped
    python fuzz/fuzz_native.py --seeds CORPUS_DIR                                      # the libslirp corpus as seeds

The suite runs it bounded (``tests/adversarial/test_fuzz_native.py``); under the sanitizer build
(``AIOSLIRP_SANITIZE=1``, ``tests/adversarial/test_native_sanitized.py``) an out-of-bounds read
in C aborts with ASan's report.

Input format: the first byte's low bit says whether a 12-byte virtio-net header leads the frame;
the rest is the buffer classified. Property checked per input (``tests/support/native.py``
``check``): the C record agrees with the Python parsers of ``aioslirp.wire`` (kind, drop reason,
offsets, lengths, 5-tuple) and never points outside the buffer; a violation raises, which
libFuzzer reports as a crash and saves. Coverage feedback comes from the Python reference (the
C code is built by gcc, without libFuzzer's instrumentation), whose branches follow the C ones.
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

_plane = None


def run_input(data: bytes) -> None:
    """Classify one fuzz input in C (bare and in a counting Plane) and hold it to the reference."""
    global _plane
    from aioslirp import native

    from support.native import check

    if not data:
        return
    vnet = bool(data[0] & 1)
    buf = data[1:]
    rec = check(buf, vnet)
    if _plane is None:
        _plane = native.extension().Plane(2048, 8, vnet)
    if native.record(_plane.classify(buf)).kind != rec.kind and not vnet:
        raise AssertionError("Plane.classify and classify disagree")


def seed_inputs() -> dict[str, bytes]:
    """The libslirp corpus frames (../shared/corpus), bare and behind a virtio-net header."""
    from support.corpus import CORPUS, corpus_frames

    if not CORPUS.is_dir():
        return {}
    out = {}
    for i, (name, frame) in enumerate(corpus_frames()):
        out[f"{i:04d}-{name}"] = b"\x00" + frame
        out[f"{i:04d}-{name}-vnet"] = b"\x01" + b"\x01" + bytes(11) + frame
    return out


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--seeds"]:
        out = pathlib.Path(argv[2])
        out.mkdir(parents=True, exist_ok=True)
        for name, data in seed_inputs().items():
            (out / f"seed-{name}").write_bytes(data)
        return 0
    import atheris

    from aioslirp import native

    if native.extension() is None:
        print(f"the native data plane is not usable: {native.why_not()}", file=sys.stderr)
        return 2
    import support.native
    from aioslirp.wire import ipv6, tcp

    for fn in (support.native.reference, support.native._l4, ipv6.parse_ipv6, ipv6.walk_ext, ipv6._check_options,
               tcp.parse_segment):
        if hasattr(fn, "__code__"):  # a Python function (a compiled mypyc build has none to instrument)
            atheris.instrument_func(fn)
    atheris.Setup(argv, run_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
