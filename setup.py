"""Optional compiled per-frame path (mypyc), the way aio-libs packages ship theirs.

``pip install .`` / ``pip install -e .`` compile the modules in :data:`COMPILED` with mypyc when a
C compiler is present; the same ``.py`` files stay the source and run uncompiled when the build
is skipped (``AIOSLIRP_NO_EXTENSIONS=1`` at install time), fails (no compiler, no headers: a
warning, then a pure-Python install), or is switched off at run time (``AIOSLIRP_NO_EXTENSIONS=1``,
see :mod:`aioslirp.compiled`). The list lives in ``aioslirp/compiled.py``; docs/performance.md
has the measurements behind it.

The same build compiles the native init of ``aioslirp.spawn()``'s PID namespace
(``aioslirp/native/init.c``, a small C program, into ``aioslirp/host/aioslirp-init``; linked
statically where the C library allows, for the smallest resident set), whether or not mypyc is
there; without a C compiler, or with ``AIOSLIRP_NO_EXTENSIONS=1``, it is left out and a Python
PID 1 runs per guest instead.

Beside the native modules the build writes ``aioslirp/compiled.sha256``: the SHA-256 of each
source that mypyc translated, in ``sha256sum`` format, so that ``aioslirp.compiled.stale()``
can tell an edited source by content (an install writes files in no particular order, so their
times say nothing).

The same build compiles the native data plane (``aioslirp/native/``: a C11 core and its
CPython binding, limited API, one ``abi3`` module) when a C compiler is there, and records the
hashes of its C files in ``aioslirp/native/_dataplane.sha256``. ``AIOSLIRP_NO_MYPYC=1`` builds
that alone; ``AIOSLIRP_SANITIZE=1`` builds it alone with AddressSanitizer and
UndefinedBehaviorSanitizer (tests/adversarial/test_native_sanitized.py). The file names are in
``aioslirp/native/sources.py``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _compiled_list() -> dict:
    path = os.path.join(HERE, "aioslirp", "compiled.py")
    ns: dict = {"__file__": path, "__name__": "aioslirp_compiled_list"}
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), ns)  # no package import at build time
    return ns


def _native_sources() -> dict:
    path = os.path.join(HERE, "aioslirp", "native", "sources.py")
    ns: dict = {"__file__": path, "__name__": "aioslirp_native_sources"}
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), ns)  # no package import at build time
    return ns


def _compiled_modules() -> list[str]:
    return [m.replace(".", "/") + ".py" for m in _compiled_list()["COMPILED"]]


#: ``(module, sha256 of its source)`` for each module mypyc translates, taken as it reads them.
_TRANSLATED: list[tuple[str, str]] = []


#: The native init's source, and where the build puts the program (in the package, beside
#: ``aioslirp/host/nschild.py``, which looks for it there).
INIT_SOURCE = os.path.join("aioslirp", "native", "init.c")
INIT_MODULE = "aioslirp.host.aioslirp-init"


class OptionalBuildExt(build_ext):
    """A failed compile leaves a working pure-Python install (with a warning), as yarl/multidict do."""

    def run(self) -> None:
        self.parallel = self.parallel or os.cpu_count() or 1  # the small per-module shims side by side
        if not os.environ.get("AIOSLIRP_NO_EXTENSIONS"):
            self._build_init()
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means: no extension
            self._skip(exc)
            return
        self._write_record()
        self._write_native_record()

    def _write_native_record(self) -> None:
        """``aioslirp/native/_dataplane.sha256`` beside the native data plane, when it was built:
        the hash of each C file it was compiled from."""
        native = _native_sources()
        for prefix in ("", "VHOST_"):  # the data plane, the vhost-user rings
            path = self.get_ext_fullpath(native[prefix + "EXTENSION"])
            if not os.path.exists(path):
                continue
            lines = []
            for rel in native[prefix + "DEPENDS"]:
                with open(os.path.join(HERE, rel), "rb") as f:
                    lines.append(f"{hashlib.sha256(f.read()).hexdigest()}  {rel}\n")
            with open(os.path.join(os.path.dirname(path), native[prefix + "RECORD"]), "w", encoding="ascii") as f:
                f.writelines(lines)

    def _write_record(self) -> None:
        """``aioslirp/compiled.sha256`` beside the native modules (in the build tree, which goes
        into the wheel, or in the source tree for ``pip install -e .``): one line per module
        built, the hash of the source it was translated from."""
        if not _TRANSLATED:
            return
        # The package's directory as this build lays it out: where a native aioslirp.compiled would go.
        pkg_dir = os.path.dirname(self.get_ext_fullpath("aioslirp.compiled"))
        lines = [f"{digest}  {name.replace('.', '/')}.py\n" for name, digest in _TRANSLATED
                 if os.path.exists(self.get_ext_fullpath(name))]
        with open(os.path.join(pkg_dir, _compiled_list()["RECORD"]), "w", encoding="ascii") as f:
            f.writelines(lines)

    def build_extension(self, ext) -> None:
        compile_one = self.compiler.compile

        def compile_parallel(sources, *args, **kwargs):  # one C file per module (multi_file): every CPU
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                parts = list(pool.map(lambda src: compile_one([src], *args, **kwargs), sources))
            return [obj for objs in parts for obj in objs]

        self.compiler.compile = compile_parallel
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._skip(exc)

    def _init_path(self, inplace: bool) -> str:
        """Where the native init goes: the package in the build tree, or the source tree (``pip install -e .``)."""
        old, self.inplace = self.inplace, inplace
        try:
            return os.path.join(os.path.dirname(self.get_ext_fullpath(INIT_MODULE)), "aioslirp-init")
        finally:
            self.inplace = old

    def get_outputs(self) -> list:
        """The extension modules and the native init (when built), for the install's record."""
        out = super().get_outputs()
        path = self._init_path(bool(self.inplace))
        return out + [path] if os.path.exists(path) else out

    def _build_init(self) -> None:
        """Compile and link ``aioslirp/native/init.c`` into the package: statically first (about
        half the resident memory per process), else against the shared C library. A failure is a
        warning: spawn() then runs a Python PID 1."""
        from setuptools._distutils.ccompiler import new_compiler
        from setuptools._distutils.sysconfig import customize_compiler

        cc = new_compiler()  # (no verbose/dry_run/force: newer setuptools dropped them)
        customize_compiler(cc)
        src = INIT_SOURCE if os.path.abspath(os.getcwd()) == HERE else os.path.join(HERE, INIT_SOURCE)
        target = self._init_path(False)
        tmp = os.path.join(self.build_temp, "aioslirp-init")
        try:
            objs = cc.compile([src], output_dir=tmp, extra_postargs=["-O2", "-Wall"])
            try:
                cc.link_executable(objs, "aioslirp-init", output_dir=tmp, extra_postargs=["-static", "-s"])
            except Exception:  # noqa: BLE001 - no static C library: the shared one
                cc.link_executable(objs, "aioslirp-init", output_dir=tmp, extra_postargs=["-s"])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self.copy_file(os.path.join(tmp, "aioslirp-init"), target)
            if self.inplace:  # pip install -e .: beside the sources
                self.copy_file(target, self._init_path(True))
        except Exception as exc:  # noqa: BLE001 - any failure means: no native init
            print(f"WARNING: aioslirp's native init (aioslirp-init) was not built ({exc}); "
                  "spawn() runs a Python PID 1 per guest instead", file=sys.stderr)

    @staticmethod
    def _skip(exc: BaseException) -> None:
        print(f"WARNING: aioslirp's compiled per-frame path or native data plane was not built ({exc}); "
              "the pure-Python modules are used", file=sys.stderr)


#: The setup.py commands that build; for the others (the metadata that pip asks for first) the
#: translation by mypyc (several seconds) is not run.
_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def _native_extension() -> list:
    """The native data plane: limited-API (abi3) extensions from the C cores and their bindings (the
    data plane, the vhost-user-net rings)."""
    from setuptools import Extension

    native = _native_sources()
    cflags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"]
    ldflags: list[str] = []
    if os.environ.get(native["SANITIZE_ENV"]):
        cflags = ["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
        ldflags = ["-fsanitize=address,undefined"]
    return [Extension(native[prefix + "EXTENSION"], sources=list(native[prefix + "SOURCES"]),
                      depends=list(native[prefix + "DEPENDS"]), define_macros=[("Py_LIMITED_API", "0x030B0000")],
                      py_limited_api=True, extra_compile_args=cflags, extra_link_args=ldflags)
            for prefix in ("", "VHOST_")]  # the data plane, the vhost-user rings


def _ext_modules() -> list:
    if os.environ.get("AIOSLIRP_NO_EXTENSIONS") or not _BUILDS.intersection(sys.argv[1:]):
        return []
    os.chdir(HERE)  # the extensions name their sources relative to the project
    native = _native_sources()
    if os.environ.get(native["SANITIZE_ENV"]) or os.environ.get(native["NO_MYPYC_ENV"]):
        return _native_extension()
    return _native_extension() + _mypyc_modules()


def _mypyc_modules() -> list:
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("WARNING: mypyc is not available; aioslirp is installed without its compiled per-frame path",
              file=sys.stderr)
        return []
    sources = _compiled_modules()
    for path in sources:  # hashed before mypyc reads them: an edit meanwhile shows as stale
        with open(path, "rb") as f:
            _TRANSLATED.append((path[:-3].replace("/", "."), hashlib.sha256(f.read()).hexdigest()))
    # -O1, one C file per module compiled in parallel: the install stays short (about 15 s of
    # build on 2 CPUs instead of 60 s at -O3 in one file) for 0.5% more instructions per
    # connection (docs/performance.md).
    return mypycify(
        sources + ["--ignore-missing-imports", "--follow-imports=skip"],
        opt_level="1",
        multi_file=True,
        group_name="aioslirp",
    )


class NativeDistribution(Distribution):
    """A distribution with native code even when mypyc is absent (the native init): ``build_ext``
    runs and the wheel is tagged for the platform; not with ``AIOSLIRP_NO_EXTENSIONS=1``."""

    def has_ext_modules(self) -> bool:
        return super().has_ext_modules() or not os.environ.get("AIOSLIRP_NO_EXTENSIONS")


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt}, distclass=NativeDistribution)
