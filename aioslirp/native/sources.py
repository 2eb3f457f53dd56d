"""What the native data plane is built from (read by ``setup.py`` without importing the package).

:data:`EXTENSION` is the extension module's name, :data:`SOURCES` the C files compiled into it,
:data:`DEPENDS` those plus the header (all hashed into :data:`RECORD` by the build, so that
:func:`aioslirp.native.status` can tell a source edited since the build), paths relative to the
project. This module imports nothing.
"""

from __future__ import annotations

__all__ = ["DEPENDS", "EXTENSION", "RECORD", "SANITIZE_ENV", "NO_MYPYC_ENV", "SOURCES", "VHOST_DEPENDS",
           "VHOST_EXTENSION", "VHOST_RECORD", "VHOST_SOURCES"]

#: The extension module (limited API, abi3).
EXTENSION = "aioslirp.native._dataplane"
#: The C sources: the core (no Python object in it) and the CPython binding.
SOURCES: tuple[str, ...] = ("aioslirp/native/dataplane.c", "aioslirp/native/_dataplane.c", "aioslirp/native/tcpnat.c",
                            "aioslirp/native/_tcpnat.c", "aioslirp/native/_tracejson.c")
#: Every file the build reads: the sources and the header.
DEPENDS: tuple[str, ...] = SOURCES + ("aioslirp/native/dataplane.h", "aioslirp/native/tcpnat.h", "aioslirp/native/_tcpnat.h",
                                      "aioslirp/native/_tracejson.h", "aioslirp/native/tcpsink.h")
#: The build's record beside the extension: one ``sha256sum`` line per file of :data:`DEPENDS`.
RECORD = "_dataplane.sha256"
#: ``AIOSLIRP_SANITIZE=1`` at build time: the native data plane alone, with ASan and UBSan
#: (``-fsanitize=address,undefined -fno-omit-frame-pointer``); no mypyc translation.
SANITIZE_ENV = "AIOSLIRP_SANITIZE"
#: ``AIOSLIRP_NO_MYPYC=1`` at build time: the native data plane alone (no mypyc translation).
NO_MYPYC_ENV = "AIOSLIRP_NO_MYPYC"

#: The vhost-user-net rings (issue 27): a second limited-API extension, built the same way.
VHOST_EXTENSION = "aioslirp.native._vhost"
VHOST_SOURCES: tuple[str, ...] = ("aioslirp/native/vring.c", "aioslirp/native/_vhost.c")
VHOST_DEPENDS: tuple[str, ...] = VHOST_SOURCES + ("aioslirp/native/vring.h", "aioslirp/native/tcpsink.h")
VHOST_RECORD = "_vhost.sha256"
