"""The vhost-user-net rings' extension (issue 27): ``aioslirp.native._vhost`` (``vring.c``, the split
virtqueues walked and filled in C over guest memory it maps; ``_vhost.c``, its limited-API binding).

Built by ``setup.py`` beside the data plane's extension (:mod:`aioslirp.native.sources` names the
files, their hashes go to ``_vhost.sha256``). :func:`extension` imports it once, or says why not
(:func:`why_not`): ``AIOSLIRP_NO_EXTENSIONS=1``, not built, a stale build. There is no Python
fallback: :class:`~aioslirp.transport.vhost_user.VhostUserTransport` needs it and says so.
"""

from __future__ import annotations

import functools
from types import ModuleType

from . import load_extension
from .sources import VHOST_DEPENDS, VHOST_EXTENSION, VHOST_RECORD

__all__ = ["extension", "why_not"]



@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    return load_extension(VHOST_EXTENSION, VHOST_RECORD, VHOST_DEPENDS)


def extension() -> ModuleType | None:
    """``aioslirp.native._vhost``, or ``None`` (:func:`why_not` says why)."""
    return _load()[0]


def why_not() -> str:
    """Why the extension is not usable, or ``""`` when it is."""
    return _load()[1]
