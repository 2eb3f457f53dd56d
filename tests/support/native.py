"""The native data plane's extension for the tests that drive it (aioslirp/native).

:func:`need_extension` returns ``aioslirp.native._dataplane``, or skips (fails under CI) with how
to build it: ``pip install -e .`` builds it with the rest, ``AIOSLIRP_NO_MYPYC=1 python setup.py
build_ext --inplace`` alone (a second or two). Under ``AIOSLIRP_NO_EXTENSIONS=1`` (the pure pass
of .ci/run, which runs only ``-m perframe``) these tests are not selected.
"""

from __future__ import annotations

from aioslirp import native

from .prereqs import need

BUILD_HINT = ("the native data plane is not usable here ({why}): build it with pip install -e . or "
              "AIOSLIRP_NO_MYPYC=1 python setup.py build_ext --inplace")


def need_extension():
    """The extension module (skip, or fail under CI, when it is not usable)."""
    need(native.extension() is not None, BUILD_HINT.format(why=native.why_not()))
    return native.extension()
