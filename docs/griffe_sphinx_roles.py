"""A griffe extension for the API reference (mkdocs.yml loads it): the docstrings' Sphinx roles
become cross-references.

The docstrings write references the Sphinx way (``:class:`~aioslirp.NetworkConfig```,
``:meth:`Stack.stats```, ``:mod:`.network```, ``:attr:`returncode```, ``:meth:`title <target>```),
which mkdocstrings' Markdown would show as raw text. Once griffe has loaded the package, each role
in each docstring becomes an autorefs cross-reference to the object's canonical path (the path
under which docs/api.md renders it), titled as Sphinx titles it: the target as written, only its
last part after ``~``, ``()`` after a function or method, or the explicit title. A name is looked
up as Sphinx does, from the docstring's own object outwards (its members, its class, its module,
their imports), then as a name the package exports, then as an absolute dotted path; an imported name (``aioslirp.Stack``) is
followed to where it is defined. The reference is optional: a target the reference does not
render (an internal module, the standard library) stays code, without a link and without a
warning.
"""

from __future__ import annotations

import html
import importlib
import re
import types

import griffe

#: A Sphinx cross-reference role of the Python domain; the target may wrap across lines.
ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|data|attr|exc|obj|const):`([^`]+)`")

_CALLABLE_ROLES = {"meth", "func"}


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring of the loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = ROLE.sub(lambda m, scope=obj: _crossref(scope, m[1], m[2]), obj.docstring.value)
                obj.docstring.__dict__.pop("parsed", None)  # parsed again from the new text


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def _crossref(scope: griffe.Object, role: str, text: str) -> str:
    text = " ".join(text.split())
    explicit = re.fullmatch(r"(.*\S)\s*<([^<>]+)>", text)
    if explicit:
        title, target = explicit[1], explicit[2]
    else:
        target = text
        shown = target.lstrip("!~").lstrip(".")
        title = shown.rsplit(".", 1)[-1] if target.lstrip("!").startswith("~") else shown
        if role in _CALLABLE_ROLES and not title.endswith(")"):
            title += "()"
    target = target.lstrip("!~").lstrip(".").removesuffix("()")
    identifier = _canonical(_resolve(scope, target))
    return (f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(title)}</code></autoref>")


def _resolve(scope: griffe.Object, target: str) -> str:
    """``target``'s full dotted path, its first name looked up from ``scope`` outwards."""
    first, dot, rest = target.partition(".")
    try:
        base = scope.resolve(first)
    except (griffe.NameResolutionError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        package = scope.package.path
        if first != package and hasattr(importlib.import_module(package), first):
            return f"{package}.{target}"  # a public name (aioslirp.PortForward) not imported here
        return target  # absolute already (aioslirp.x.Y), or outside the package (asyncio.Queue)
    return base + dot + rest


def _canonical(path: str) -> str:
    """Where ``path`` is defined: imported names followed to their module (``aioslirp.Stack`` ->
    ``aioslirp.stack.Stack``); the path as it is when nothing of it imports."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        break
    else:
        return path
    where = obj.__name__
    for j, name in enumerate(parts[i:], i):
        try:
            obj = getattr(obj, name)
        except AttributeError:  # an instance attribute, documented on its class
            return ".".join([where, *parts[j:]])
        if isinstance(obj, types.ModuleType):
            where = obj.__name__
        elif isinstance(obj, (type, types.FunctionType)) or hasattr(obj, "__wrapped__"):
            where = f"{obj.__module__}.{obj.__qualname__}"
        else:  # a property, a constant: named by its owner
            where = f"{where}.{name}"
    return where
