"""The package's floors hold: ``lint-imports`` (import-linter) checks the contracts of
``pyproject.toml`` ([tool.importlinter]) and exits 0 only when no module imports a floor above it.
Each name has one import path: the old paths of moved modules are gone and nothing imports them,
and every ``from aioslirp.X import N`` names the module that defines ``N``."""

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

from support.paths import REPO


def test_import_layers_contract_is_kept():
    script = pathlib.Path(sys.executable).parent / "lint-imports"
    command = str(script) if script.exists() else shutil.which("lint-imports")
    assert command, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([command, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout and "KEPT" in p.stdout, p.stdout


# Import paths that once re-exported a module moved elsewhere, with the real path. Each went in
# issue 25; import-linter cannot forbid a module that does not exist, so these tests keep them out.
OLD_PATHS = {
    "aioslirp._isolate": "aioslirp.host.isolate",
    "aioslirp._nschild": "aioslirp.host.nschild",
    "aioslirp.netns": "aioslirp.frontends.netns",
    "aioslirp.slirp4netns": "aioslirp.cli.slirp4netns",
    "aioslirp.trace_report": "aioslirp.cli.trace_report",
    "aioslirp.config6": "aioslirp.config.ipv6",
    "aioslirp.policy": "aioslirp.config.policy",
    "aioslirp.limits": "aioslirp.flow.guard, aioslirp.config.limits, aioslirp.ratelimit",
    "aioslirp.stack6": "aioslirp.dispatch.ipv6",
    "aioslirp.tcp.conn": "aioslirp.tcp.connection, aioslirp.tcp.tcb, aioslirp.wire.tcp",
    "aioslirp.wire.reassembly": "aioslirp.dispatch.reassembly",
    "aioslirp.wire._moved": "(the lazy re-exports of wire.ipv4, wire.ipv6, wire.offload)",
    "aioslirp.host.tapdev": "aioslirp.transport.tapdev",
    # issue 25 item 2: modules grouped by role
    "aioslirp.tcp.flow": "aioslirp.nat.tcp",
    "aioslirp.tcp.hostsock": "aioslirp.nat.hostsock",
    "aioslirp.tcp.pacing": "aioslirp.nat.pacing",
    "aioslirp.udp": "aioslirp.nat.udp",
    "aioslirp.icmp": "aioslirp.nat.icmp",
    "aioslirp.forward": "aioslirp.nat.forward, aioslirp.config.forward",
    "aioslirp.tracing": "aioslirp.observe.tracing",
    "aioslirp.metrics": "aioslirp.observe.metrics",
    "aioslirp.audit": "aioslirp.observe.audit",
    "aioslirp.lifecycle": "aioslirp.observe.events, Stack.farewell(), Transport.gone_before_first_frame()",
    "aioslirp.reassembly": "aioslirp.dispatch.reassembly",
    "aioslirp.qemu": "aioslirp.frontends.qemu",
    "aioslirp.api": "aioslirp.frontends.api",
    "aioslirp.host.spawn": "aioslirp.frontends.spawn",
    "aioslirp.host.netns": "aioslirp.frontends.netns, aioslirp.host.ifconfig",
    "aioslirp.host.slirp4netns": "aioslirp.frontends.slirp4netns",
}
SOURCE_DIRS = ("aioslirp", "tests", "benchmarks", "fuzz", "examples")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".sh", ".yml", ".yaml", ".txt", ""}


def _module_file(name: str) -> pathlib.Path | None:
    path = REPO.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _python_files():
    for top in SOURCE_DIRS:
        yield from sorted(p for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)
    if (REPO / "setup.py").is_file():
        yield REPO / "setup.py"


def _text_files():
    for name in ("README.md", "pyproject.toml", "mkdocs.yml", "setup.py"):
        if (REPO / name).is_file():
            yield REPO / name
    for top in SOURCE_DIRS + ("docs", ".ci"):
        for p in sorted((REPO / top).rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts and ".cache" not in p.parts:
                yield p


def test_old_import_paths_are_gone():
    """No module of the checkout answers to an old path (an installed copy elsewhere might, so
    the files are looked for, not imported)."""
    left = [f"{old} (now {new}): {_module_file(old).relative_to(REPO)}"
            for old, new in OLD_PATHS.items() if _module_file(old)]
    assert not left, "\n".join(left)


def _old_path_pattern():
    dotted = "|".join(re.escape(old) for old in OLD_PATHS)
    by_parent: dict[str, list[str]] = {}
    for old in OLD_PATHS:
        parent, _, leaf = old.rpartition(".")
        by_parent.setdefault(parent, []).append(leaf)
    from_parent = "|".join(rf"from\s+{re.escape(parent)}\s+import\s+\(?[\w\s,]*?\b(?:{'|'.join(leaves)})\b"
                           for parent, leaves in by_parent.items())
    # `import X` / `from X import`, `python -m X`, an entry point `X:main`, a mkdocstrings `::: X.Name`
    return re.compile(rf"(?:\b(?:from|import)\s+|-m\s+|:::\s*)(?:{dotted})\b|(?:{dotted}):\w|{from_parent}")


def test_nothing_imports_an_old_path():
    """No code, script string, doc snippet, entry point or API-reference directive names an old
    path as something to import or run. (Logger names such as ``aioslirp.limits`` are not imports.)"""
    pattern = _old_path_pattern()
    this = pathlib.Path(__file__).resolve()
    found = []
    for path in _text_files():
        if path.resolve() == this:
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not found, "\n".join(found)


def _defined_names(module_file: pathlib.Path) -> set[str]:
    """Names a module defines at its top level, plus its ``__all__``: what it may be imported for."""
    names: set[str] = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if isinstance(target, ast.Name) and target.id == "__all__":
                    names.update(ast.literal_eval(node.value))
    return names


def _imports(tree: ast.AST, package: str | None):
    """``(line, module, names)`` of every import of an ``aioslirp`` module in ``tree``, relative
    ones resolved against ``package``; the Python in string constants (child scripts) too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                if package is None:
                    continue
                parts = package.split(".")
                module = ".".join(parts[:len(parts) - node.level + 1] + ([module] if module else []))
            if module.split(".")[0] == "aioslirp":
                yield node.lineno, module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "aioslirp":
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "aioslirp" in node.value:
            try:
                with warnings.catch_warnings():  # a string that is not Python may hold "\\." and such
                    warnings.simplefilter("ignore")
                    inner = ast.parse(node.value)
            except SyntaxError:
                continue
            for lineno, module, names in _imports(inner, None):
                yield node.lineno + lineno - 1, module, names


def test_every_import_names_the_module_that_defines_it():
    """``from aioslirp.X import N`` only where X defines N or lists it in ``__all__`` (or N is a
    submodule): a name has one import path, so no re-export can keep a moved name's old home alive
    (``wire.ipv4.build_tcp``, ``nat.tcp.TransportHost``, ``transport.tap.open_tap``...)."""
    defined: dict[str, set[str]] = {}
    wrong = []
    for path in _python_files():
        rel = path.relative_to(REPO)
        package = ".".join(rel.parent.parts) if rel.parts[0] == "aioslirp" else None
        for lineno, module, names in _imports(ast.parse(path.read_text()), package):
            module_file = _module_file(module)
            if module_file is None:
                wrong.append(f"{rel}:{lineno}: no module {module}")
                continue
            if module not in defined:
                defined[module] = _defined_names(module_file)
            for name in names:
                if name != "*" and name not in defined[module] and _module_file(f"{module}.{name}") is None:
                    wrong.append(f"{rel}:{lineno}: {name} is not defined in {module}")
    assert not wrong, "\n".join(wrong)


def test_tcp_holds_the_compiled_core_only():
    """``aioslirp/tcp`` is the sans-IO TCP connection and nothing else: exactly the ``aioslirp.tcp``
    modules that ``compiled.COMPILED`` lists (what ``setup.py`` builds with mypyc); the asyncio flow,
    its host sockets and pacing are ``aioslirp.nat``. Read from the files, not imported."""
    compiled_py = REPO / "aioslirp" / "compiled.py"
    listed = next(ast.literal_eval(node.value) for node in ast.parse(compiled_py.read_text()).body
                  if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "COMPILED")
    in_tcp = {f"aioslirp.tcp.{p.stem}" for p in (REPO / "aioslirp" / "tcp").glob("*.py") if p.name != "__init__.py"}
    assert in_tcp == {name for name in listed if name.startswith("aioslirp.tcp.")}
    assert all(_module_file(name) for name in listed), [name for name in listed if not _module_file(name)]
