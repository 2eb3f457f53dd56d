"""Move the calling process into a fresh network namespace that has only loopback.

Used by the test suite and benchmarks so that no test traffic can leave the machine:
inside, every non-loopback destination is unreachable at once.
"""

from __future__ import annotations

import ctypes
import os
import socket
import fcntl
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def unshare(flags: int) -> None:
    """``unshare(2)``; raises ``OSError`` on failure."""
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def map_ids(uid: int, gid: int, to_root: bool = False) -> None:
    """In a user namespace this process just made (``unshare(CLONE_NEWUSER)``): deny
    ``setgroups`` and map our ``uid`` and ``gid`` outside, one id each, to the same ids inside, or
    to 0 (``to_root``), as user_namespaces(7) asks of an unprivileged process. Raises ``OSError``."""
    inside_uid, inside_gid = (0, 0) if to_root else (uid, gid)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inside_uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inside_gid} {gid} 1")


def set_loopback_up() -> None:
    """Bring ``lo`` up in the current network namespace (SIOCSIFFLAGS)."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def isolate_network() -> None:
    """Enter a new network namespace (with a user namespace when not root) with ``lo`` up."""
    if os.geteuid() == 0:
        unshare(CLONE_NEWNET)
    else:
        uid, gid = os.geteuid(), os.getegid()
        unshare(CLONE_NEWUSER | CLONE_NEWNET)
        map_ids(uid, gid)
    set_loopback_up()
