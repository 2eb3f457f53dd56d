"""Which modules run compiled (the optional mypyc build of the per-frame path), and the switch.

:data:`COMPILED` lists the modules that ``setup.py`` compiles with mypyc when a C compiler is
present: the TCP frame builder and parser and the checksum (:mod:`aioslirp.wire`) and the TCP
state machine (:mod:`aioslirp.tcp`), which carry most of the gain (docs/performance.md); and
the Python each connection still runs on the native data plane (the default): the
link and IPv4 dispatch, the L4 handling of the SYN (:mod:`aioslirp.dispatch.l4`) and the native
TCP engine's adoption and end records (:mod:`aioslirp.nat.native_tcp`), about 3 us of backend
CPU per connection there (issue 26), and the native UDP flows' per-datagram upcall
(:mod:`aioslirp.nat.native_udp`: a host datagram's counters and last activity); and the
admission of each new flow: the rate limiter (:mod:`aioslirp.ratelimit`), the egress policy's
decision (:mod:`aioslirp.flow.egress`), the guard (:mod:`aioslirp.flow.guard`), the flow table's
add, remove and flush (:mod:`aioslirp.flow.table`) and the family's Ethernet header, routing and
ICMP quote (:mod:`aioslirp.dispatch.family`), the inject queue's write at the end of a batch
(:mod:`aioslirp.inject`) and the flow context's counts (:mod:`aioslirp.flow.context`); and the fair
scheduler's charge of each engine poll and read batch (:mod:`aioslirp.fair`); and the tracer's
hooks while tracing is on (:mod:`aioslirp.observe.tracer`) with the direct span sink behind them
(:mod:`aioslirp.observe.sink`): with them,
a connection of the native plane runs three interpreted Python functions, the TAP reader's
callbacks and :func:`aioslirp.flow.base.admission` (docs/performance.md, "The admission
compiled"). The host sockets and UDP flows type-check for mypyc too but are left out (no gain
measured), and each module adds seconds of C compilation to ``pip install``. A compiled module checks its annotations at run time (a
``bytes`` parameter refuses a ``memoryview``), so the annotations of the compiled modules must
say what really arrives. They are ordinary ``.py`` files; the build puts a native module beside
each (``tcp.cpython-311-x86_64-linux-gnu.so`` next to ``tcp.py``), which Python imports first.

``AIOSLIRP_NO_EXTENSIONS=1`` in the environment (any non-empty value) makes every
``aioslirp`` module load from its ``.py`` source even where a native module exists:
:func:`install_source_finder` (run by ``aioslirp/__init__``) puts a finder first on
``sys.meta_path`` that offers only source and bytecode loaders for the package. It does the
same when the build is stale (:func:`stale`: some compiled module's ``.py`` is not the source
its native module was built from, by the SHA-256 the build recorded in :data:`RECORD`; an edit
after ``pip install -e .``): the edit runs, not the old build, and :func:`notice` says to
rebuild. Content, not file times: an install writes the native modules and the sources in no
set order, and a ``touch`` changes nothing that runs. The compiled modules go together (a native class cannot be
subclassed by an interpreted one), so it is all of them or none.
:func:`status` says which way each module loaded, for ``aioslirp --version`` and the stats.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys

try:  # CPython's own SHA-256: no OpenSSL to load at import (hashlib costs about 3 ms, this 0.5 ms of hashing)
    from _sha256 import sha256 as _sha256  # Python 3.11
except ImportError:
    try:
        from _sha2 import sha256 as _sha256  # Python >= 3.12
    except ImportError:
        from hashlib import sha256 as _sha256

__all__ = ["COMPILED", "ENV", "RECORD", "changed_since_build", "disabled", "install_source_finder", "loaded", "notice",
           "rebuild_hint", "stale", "status"]

#: The environment variable that switches the compiled modules off (install time and run time).
ENV = "AIOSLIRP_NO_EXTENSIONS"

#: Modules compiled by the optional build (dotted names), in the order of the per-frame path, then
#: the per-connection path of the native data plane.
COMPILED: tuple[str, ...] = (
    "aioslirp.wire.checksum",
    "aioslirp.wire.tcp",
    "aioslirp.tcp.seq",
    "aioslirp.tcp.buffers",
    "aioslirp.tcp.tcb",
    "aioslirp.tcp.output",
    "aioslirp.tcp.arrival",
    "aioslirp.tcp.connection",
    "aioslirp.dispatch.link",
    "aioslirp.dispatch.ipv4",
    "aioslirp.dispatch.l4",
    "aioslirp.nat.native_tcp",
    "aioslirp.nat.native_udp",
    "aioslirp.ratelimit",
    "aioslirp.flow.egress",
    "aioslirp.flow.guard",
    "aioslirp.flow.table",
    "aioslirp.dispatch.family",
    "aioslirp.inject",
    "aioslirp.flow.context",
    "aioslirp.fair",
    "aioslirp.observe.tracer",
    "aioslirp.observe.sink",
)


def disabled() -> bool:
    """True when ``AIOSLIRP_NO_EXTENSIONS`` is set (non-empty) in the environment."""
    return bool(os.environ.get(ENV))


#: The build's record, in the package beside the native modules (written by ``setup.py``): one
#: ``sha256sum`` line per compiled module, ``<hex digest>  aioslirp/tcp/tcb.py``, the hash of the
#: source that module was translated from.
RECORD = "compiled.sha256"

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _recorded(path: str | None = None) -> dict[str, str]:
    """``{"aioslirp/tcp/tcb.py": hex digest}`` from the record at ``path`` (default :data:`RECORD`
    in the package); ``{}`` when there is none."""
    try:
        with open(path or os.path.join(_PKG_DIR, RECORD), encoding="ascii") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return {}
    out = {}
    for line in lines:
        digest, _, path = line.partition("  ")
        out[path] = digest
    return out


def _native(base: str) -> bool:
    return any(os.path.exists(base + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def stale() -> list[str]:
    """The modules of :data:`COMPILED` that have a native module whose source, as recorded in
    :data:`RECORD` at build time, is not the ``.py`` present now (by SHA-256: an edit since the
    build; a module missing from the record counts as stale). ``[]`` when the build is current or
    absent. Reads and hashes the sources only where a native module exists (about 95 kB, 0.5 ms)."""
    out = []
    record = None
    for name in COMPILED:
        rel = name.replace(".", "/") + ".py"
        base = os.path.join(_PKG_DIR, *name.split(".")[1:])
        if not _native(base):
            continue
        try:
            with open(base + ".py", "rb") as f:
                source = f.read()
        except OSError:
            continue
        if record is None:
            record = _recorded()
        if record.get(rel) != _sha256(source).hexdigest():
            out.append(name)
    return out


def changed_since_build(record: str, sources: tuple[str, ...]) -> list[str]:
    """The files of ``sources`` (paths relative to the project, ``"aioslirp/native/dataplane.c"``)
    whose SHA-256 is not the one a build recorded in ``record`` (the path of a ``sha256sum``-format
    file, as :data:`RECORD`); a file missing from the record, or a missing record, counts as
    changed; a file that is not there (a wheel ships no C sources) cannot have changed. For the
    native data plane (:mod:`aioslirp.native`), whose C files are not modules."""
    recorded = _recorded(record)
    project = os.path.dirname(_PKG_DIR)
    out = []
    for rel in sources:
        try:
            with open(os.path.join(project, rel), "rb") as f:
                digest = _sha256(f.read()).hexdigest()
        except OSError:
            continue
        if recorded.get(rel) != digest:
            out.append(rel)
    return out


def rebuild_hint() -> str:
    """How to rebuild this install (see :func:`_rebuild`)."""
    return _rebuild()


def _rebuild() -> str:
    """How to rebuild: in a source checkout (an editable install, or the tree on ``sys.path``)
    ``pip install -e .``; an installed package is reinstalled."""
    project = os.path.dirname(_PKG_DIR)
    if os.path.exists(os.path.join(project, "setup.py")) and os.path.exists(os.path.join(project, "pyproject.toml")):
        return "rebuild with pip install -e ."
    return "rebuild by reinstalling aioslirp (pip install --force-reinstall --no-deps)"


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
        changed = f"{old[0]}.py changed since" if _recorded() else f"no {RECORD} to check it against"
        _reason = f"stale build: {changed}; {_rebuild()}"
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
    """One line, the same for the life of the process: ``compiled per-frame path: on (23/23
    modules)``, or off and why (``AIOSLIRP_NO_EXTENSIONS``, a stale build, not built)."""
    st = status()
    n = sum(st.values())
    if n == len(st):
        return f"compiled per-frame path: on ({n}/{len(st)} modules)"
    if n == 0:
        why = _reason or "not built: no C compiler or mypyc at install time"
        return f"compiled per-frame path: off ({why}); pure Python"
    return f"compiled per-frame path: partial ({n}/{len(st)} modules; {_rebuild()})"
