"""Where things are: the checkout, its ``tests/`` folder and the shared kits beside it.

``SHARED`` is ``../shared`` next to the checkout (the guestvm, containers and peers kits and
the libslirp fuzzing corpus); a test that needs one of them goes through
:func:`support.prereqs.need`.
"""

from __future__ import annotations

from pathlib import Path

#: ``tests/`` of this checkout.
TESTS = Path(__file__).resolve().parents[1]
#: The checkout (holds ``aioslirp/``, ``docs/``, ``examples/``, ``benchmarks/``).
REPO = TESTS.parent
#: The shared kits: ``../shared`` beside the checkout.
SHARED = REPO.parent / "shared"
#: Programs run by path inside a guest's namespace (``python PATH ARGS``): they import nothing of
#: the tests or of aioslirp.
GUEST_PROGRAMS = Path(__file__).resolve().parent / "guest_programs"
