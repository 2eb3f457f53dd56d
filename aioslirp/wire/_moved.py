"""Old import paths of names that moved to another module: a module ``__getattr__`` (PEP 562).

``from aioslirp.wire.ipv4 import build_tcp`` keeps working although :func:`build_tcp` now lives
in :mod:`aioslirp.wire.tcp`, which itself imports :mod:`aioslirp.wire.ipv4`. The moved name is
looked up on first use and then cached in the old module, so the new module may import the old
one without an import cycle at start-up, and later look-ups cost a plain global read.
"""

from __future__ import annotations

import importlib
import sys


def moved_names(module: str, names: dict[str, tuple[str, str]]):
    """A module ``__getattr__`` for ``module`` (its ``__name__``) serving ``names``: old name ->
    ``(new module, name there)``. Other names raise ``AttributeError`` as usual."""

    def __getattr__(name: str):
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[0]), where[1])
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__
