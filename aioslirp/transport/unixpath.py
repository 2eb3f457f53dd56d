"""Listening on a UNIX socket path: the one rule for a path that already exists (a stale socket
left by a crashed server is replaced; a live one is refused with :class:`SocketInUse`). Used by
``aioslirp qemu`` (:mod:`aioslirp.frontends.qemu`) and the vhost-user transport
(:mod:`aioslirp.transport.vhost_user`)."""

from __future__ import annotations

import errno
import os
import socket

__all__ = ["SocketInUse", "bind_path"]


class SocketInUse(OSError):
    """Another process serves the socket path already. ``str(err)`` is one line."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EADDRINUSE, f"{path} is in use by another running server")

    def __str__(self) -> str:
        return str(self.strerror)


def bind_path(path: str, kind: int) -> socket.socket:
    """Bind a new ``AF_UNIX`` socket of type ``kind`` at ``path``, replacing a stale socket file.

    Raises :class:`SocketInUse` when a live socket answers there, ``OSError`` otherwise.
    """
    if os.path.exists(path) or os.path.islink(path):
        probe = socket.socket(socket.AF_UNIX, kind)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise SocketInUse(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, kind)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    return sock
