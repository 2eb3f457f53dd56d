"""The vhost-user-net rings' extension (issue 27): ``aioslirp.native._vhost`` (``vring.c``, the split
virtqueues walked and filled in C over guest memory it maps; ``_vhost.c``, its limited-API binding).

Built by ``setup.py`` beside the data plane's extension (:mod:`aioslirp.native.sources` names the
files, their hashes go to ``_vhost.sha256``). :func:`extension` imports it once, or says why not
(:func:`why_not`): ``AIOSLIRP_NO_EXTENSIONS=1``, not built, a stale build. There is no Python
fallback: :class:`~aioslirp.transport.vhost_user.VhostUserTransport` needs it and says so.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

from .. import compiled
from .sources import VHOST_DEPENDS, VHOST_EXTENSION, VHOST_RECORD

__all__ = ["extension", "why_not"]

_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    if compiled.disabled():
        return None, f"{compiled.ENV} is set"
    try:
        ext = importlib.import_module(VHOST_EXTENSION)
    except ModuleNotFoundError:
        return None, "not built: no C compiler at install time"
    except ImportError as exc:
        return None, f"cannot load {VHOST_EXTENSION}: {exc}"
    changed = compiled.changed_since_build(os.path.join(_HERE, VHOST_RECORD), VHOST_DEPENDS)
    if changed:
        return None, f"stale build: {changed[0]} changed since; {compiled.rebuild_hint()}"
    return ext, ""


def extension() -> ModuleType | None:
    """``aioslirp.native._vhost``, or ``None`` (:func:`why_not` says why)."""
    return _load()[0]


def why_not() -> str:
    """Why the extension is not usable, or ``""`` when it is."""
    return _load()[1]
