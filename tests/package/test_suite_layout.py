"""The test suite's own layout (docs/testing.md, "Where the tests are"): every test module in a
layer folder, no test module imported by another (shared helpers live in ``tests/support/``),
test module names unique (pytest imports them by base name), and no class of the tests named
like a class of aioslirp (a reader must not take a test double for the product's class).
"""

from __future__ import annotations

import ast
import collections

from support.paths import REPO, TESTS

LAYERS = ("unit", "stack", "system", "adversarial", "package")


def _test_modules() -> list:
    return sorted(TESTS.rglob("test_*.py"))


def _classes(root) -> dict[str, list[str]]:
    """Class name -> files defining it (at any depth), under ``root``."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[node.name].append(str(path.relative_to(REPO)))
    return out


def test_every_test_module_is_in_a_layer_folder():
    misplaced = [str(p.relative_to(TESTS)) for p in _test_modules()
                 if p.relative_to(TESTS).parts[0] not in LAYERS]
    assert not misplaced, misplaced
    unit = {p.relative_to(TESTS).parts[1] for p in _test_modules() if p.relative_to(TESTS).parts[0] == "unit"}
    groups = {p.name for p in (REPO / "aioslirp").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert unit <= groups | {"utils"}, unit - groups  # a folder of tests/unit/ is named after a module group


def test_test_module_names_are_unique():
    names = collections.Counter(p.name for p in _test_modules())
    assert [n for n, c in names.items() if c > 1] == []


def test_no_test_module_imports_another():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0].startswith("test_") or name == "conftest":
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not found, "\n".join(found)


def test_no_test_class_is_named_like_a_product_class():
    product = _classes(REPO / "aioslirp")
    reused = {name: files for name, files in _classes(TESTS).items() if name in product}
    assert not reused, reused
