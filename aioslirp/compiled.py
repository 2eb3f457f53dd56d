"""Which modules run compiled (the optional mypyc build of the per-frame path), and the switch.

:data:`COMPILED` lists the modules that ``setup.py`` compiles with mypyc when a C compiler is
present: the TCP frame builder and parser and the checksum (:mod:`aioslirp.wire`) and the TCP
state machine (:mod:`aioslirp.tcp`), which carry most of the gain (docs/performance.md); the
dispatch, the inject queue, the host sockets and UDP flows type-check for mypyc too but are left
out: compiled as they are, they measured no faster end to end, and each module adds seconds of
C compilation to ``pip install``. They are ordinary ``.py`` files; the build puts a native module
beside each (``tcp.cpython-311-x86_64-linux-gnu.so`` next to ``tcp.py``), which Python imports first.

``AIOSLIRP_NO_EXTENSIONS=1`` in the environment (any non-empty value) makes every
``aioslirp`` module load from its ``.py`` source even where a native module exists:
:func:`install_source_finder` (run by ``aioslirp/__init__``) puts a finder first on
``sys.meta_path`` that offers only source and bytecode loaders for the package. It does the
same when the build is stale, some compiled module's ``.py`` being newer than its native
module (an edit after ``pip install -e .``): the edit runs, not the old build, and
:func:`notice` says to rebuild. The compiled modules go together (a native class cannot be
subclassed by an interpreted one), so it is all of them or none.
:func:`status` says which way each module loaded, for ``aioslirp --version`` and the stats.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys

__all__ = ["COMPILED", "ENV", "disabled", "install_source_finder", "loaded", "notice", "stale", "status"]

#: The environment variable that switches the compiled modules off (install time and run time).
ENV = "AIOSLIRP_NO_EXTENSIONS"

#: Modules compiled by the optional build (dotted names), in the order of the per-frame path.
COMPILED: tuple[str, ...] = (
    "aioslirp.wire.checksum",
    "aioslirp.wire.tcp",
    "aioslirp.tcp.seq",
    "aioslirp.tcp.buffers",
    "aioslirp.tcp.tcb",
    "aioslirp.tcp.output",
    "aioslirp.tcp.arrival",
    "aioslirp.tcp.connection",
)


def disabled() -> bool:
    """True when ``AIOSLIRP_NO_EXTENSIONS`` is set (non-empty) in the environment."""
    return bool(os.environ.get(ENV))


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def stale() -> list[str]:
    """The modules of :data:`COMPILED` whose ``.py`` is newer than their native module (an edit
    since the last build); ``[]`` when the build is current or absent."""
    out = []
    for name in COMPILED:
        base = os.path.join(_PKG_DIR, *name.split(".")[1:])
        try:
            src = os.stat(base + ".py").st_mtime
        except OSError:
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            try:
                if os.stat(base + suffix).st_mtime < src:
                    out.append(name)
                break
            except OSError:
                continue
    return out


class _SourceOnlyFinder:
    """A ``sys.meta_path`` finder for ``aioslirp.*`` that ignores native modules."""

    _loaders = [(importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
                (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES)]

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):
        if not fullname.startswith("aioslirp.") or not path:
            return None
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, *cls._loaders).find_spec(fullname, target)
            if spec is not None:
                return spec
        return None


#: Why the sources were chosen over a build, set by :func:`install_source_finder` ("" if not).
_reason = ""


def install_source_finder() -> None:
    """With ``AIOSLIRP_NO_EXTENSIONS`` set or a stale build (:func:`stale`), load ``aioslirp``
    submodules from source (idempotent)."""
    global _reason
    if _SourceOnlyFinder in sys.meta_path:
        return
    if disabled():
        _reason = f"{ENV} is set"
    else:
        old = stale()
        if not old:
            return
        _reason = f"stale build: {old[0]}.py changed since; rebuild with pip install -e ."
    sys.meta_path.insert(0, _SourceOnlyFinder)


def loaded(name: str) -> bool:
    """True when module ``name`` (imported now) came from a native extension."""
    __import__(name)
    return isinstance(getattr(sys.modules[name], "__loader__", None), importlib.machinery.ExtensionFileLoader)


def status() -> dict[str, bool]:
    """``{module: compiled}`` for every module of :data:`COMPILED` (imports them)."""
    return {name: loaded(name) for name in COMPILED}


@functools.cache
def notice() -> str:
    """One line, the same for the life of the process: ``compiled per-frame path: on (8/8
    modules)``, or off and why (``AIOSLIRP_NO_EXTENSIONS``, a stale build, not built)."""
    st = status()
    n = sum(st.values())
    if n == len(st):
        return f"compiled per-frame path: on ({n}/{len(st)} modules)"
    if n == 0:
        why = _reason or "not built: no C compiler or mypyc at install time"
        return f"compiled per-frame path: off ({why}); pure Python"
    return f"compiled per-frame path: partial ({n}/{len(st)} modules; rebuild with pip install -e .)"
