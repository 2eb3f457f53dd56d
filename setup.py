"""Optional compiled per-frame path (mypyc), the way aio-libs packages ship theirs.

``pip install .`` / ``pip install -e .`` compile the modules in :data:`COMPILED` with mypyc when a
C compiler is present; the same ``.py`` files stay the source and run uncompiled when the build
is skipped (``AIOSLIRP_NO_EXTENSIONS=1`` at install time), fails (no compiler, no headers: a
warning, then a pure-Python install), or is switched off at run time (``AIOSLIRP_NO_EXTENSIONS=1``,
see :mod:`aioslirp.compiled`). The list lives in ``aioslirp/compiled.py``; docs/performance.md
has the measurements behind it.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _compiled_modules() -> list[str]:
    path = os.path.join(HERE, "aioslirp", "compiled.py")
    ns: dict = {"__file__": path, "__name__": "aioslirp_compiled_list"}
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), ns)  # no package import at build time
    return [m.replace(".", "/") + ".py" for m in ns["COMPILED"]]


class OptionalBuildExt(build_ext):
    """A failed compile leaves a working pure-Python install (with a warning), as yarl/multidict do."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means: no extension
            self._skip(exc)
            return
        # A native module left as it was (its C did not change) still matches the source just
        # translated: give it the build's time, which aioslirp.compiled.stale() compares with.
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            if os.path.exists(path):
                os.utime(path)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._skip(exc)

    @staticmethod
    def _skip(exc: BaseException) -> None:
        print(f"WARNING: aioslirp's compiled per-frame path was not built ({exc}); "
              "the pure-Python modules are used", file=sys.stderr)


def _ext_modules() -> list:
    if os.environ.get("AIOSLIRP_NO_EXTENSIONS"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("WARNING: mypyc is not available; aioslirp is installed without its compiled per-frame path",
              file=sys.stderr)
        return []
    os.chdir(HERE)  # mypycify takes paths relative to the project
    return mypycify(
        _compiled_modules() + ["--ignore-missing-imports", "--follow-imports=silent"],
        opt_level="3",
        group_name="aioslirp",
    )


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
