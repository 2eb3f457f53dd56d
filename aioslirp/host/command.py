"""The command a ``run`` namespace child executes, on the wire: :func:`command_records` (the
service, after "go") and :func:`read_command` (the child, or its native init,
``aioslirp/native/init.c``, which reads the same records). The command never travels on a
command line or in an environment (docs/security.md)."""

from __future__ import annotations

import os
import socket
import sys
from typing import NamedTuple

__all__ = ["COMMAND_RECORD", "COMMAND_TAG", "Command", "command_records", "read_command"]


class Command(NamedTuple):
    """The command a ``run`` child executes, as :func:`command_records` sends it."""

    argv: list[str]
    env: dict[str, str] | None  # None: the helper's own environment
    cwd: str | None


#: The first record of a command on the socket: this tag, then the payload's length (4 bytes, native order).
COMMAND_TAG = b"AIOC"
#: Bytes of payload per record (well under a socket's send buffer).
COMMAND_RECORD = 32 * 1024


def command_records(argv: list[str], env: dict[str, str] | None, cwd: str | None) -> list[bytes]:
    """The records that carry a command to the ``run`` child (or its native init) after "go", on
    the socket pair: ``COMMAND_TAG`` + length, then the payload in pieces of ``COMMAND_RECORD``
    bytes. The payload is NUL-terminated strings: the count of arguments, of environment entries
    (``-1``: the helper's own environment), 1 or 0 for a working directory, then the arguments,
    ``NAME=value`` entries and the directory (``os.fsencode``). The values must hold no NUL and
    the names no ``=`` (:func:`aioslirp.frontends.spawn.spawn` checks)."""
    items = [str(len(argv)), str(-1 if env is None else len(env)), "1" if cwd is not None else "0", *argv]
    if env is not None:
        items += [f"{k}={v}" for k, v in env.items()]
    if cwd is not None:
        items.append(cwd)
    payload = b"".join(os.fsencode(i) + b"\0" for i in items)
    head = COMMAND_TAG + len(payload).to_bytes(4, sys.byteorder)
    return [head] + [payload[i:i + COMMAND_RECORD] for i in range(0, len(payload), COMMAND_RECORD)]


def read_command(sock: socket.socket) -> Command | None:
    """The command sent by :func:`command_records` on ``sock`` (blocking), or ``None`` when the
    parent closed the socket or sent something else."""
    try:
        head = sock.recv(8)
        if len(head) != 8 or head[:4] != COMMAND_TAG:
            return None
        size = int.from_bytes(head[4:], sys.byteorder)
        chunks, got = [], 0
        while got < size:
            chunk = sock.recv(size - got)
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
    except OSError:
        return None
    items = [os.fsdecode(i) for i in b"".join(chunks).split(b"\0")[:-1]]
    try:
        argc, envc, has_cwd = int(items[0]), int(items[1]), int(items[2])
    except (IndexError, ValueError):
        return None
    rest = items[3:]
    if argc < 1 or len(rest) != argc + max(envc, 0) + has_cwd:
        return None
    env = None if envc < 0 else dict(e.split("=", 1) for e in rest[argc:argc + envc])
    return Command(rest[:argc], env, rest[-1] if has_cwd else None)
