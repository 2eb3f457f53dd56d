"""Network namespaces in the tests: an extra address on the test namespace's ``lo``, a process
sitting in a namespace of its own, and who holds a namespace.

pytest runs in a loopback-only namespace of its own (conftest.py), so what is done here stays
in it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time


@contextlib.contextmanager
def namespace_address(addr: str = "198.18.0.1"):
    """A destination that is neither loopback nor the gateway, reachable without leaving the
    namespace (ICMP echo, UDP, TCP all answered locally): the default is 198.18.0.1 (RFC 2544's
    benchmarking range); IPv6 too, e.g. 2001:db8::77.

    Adds ``addr`` (/32, or /128 without duplicate address detection for IPv6) to ``lo`` of the
    current (test) network namespace for the ``with`` block; yields it. Needs CAP_NET_ADMIN in
    the namespace (pytest's own, see conftest.py)."""
    from pyroute2 import IPRoute

    v6 = ":" in addr
    kw = {"prefixlen": 128, "flags": 0x02} if v6 else {"prefixlen": 32}  # IFA_F_NODAD
    with IPRoute() as ipr:
        lo = ipr.link_lookup(ifname="lo")[0]
        ipr.addr("add", index=lo, address=addr, **kw)
        try:
            yield addr
        finally:
            ipr.addr("del", index=lo, address=addr, prefixlen=kw["prefixlen"])


def start_target_namespace() -> subprocess.Popen:
    """A process sitting in a new network namespace (unshare -n sleep)."""
    proc = subprocess.Popen(["unshare", "-n", "sleep", "30"])
    own = os.stat("/proc/self/ns/net").st_ino
    for _ in range(200):
        try:
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino != own:
                return proc
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("unshare -n did not enter a new namespace")


def netns_holders(ino: int) -> list[int]:
    """PIDs whose network namespace has inode ``ino``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}/ns/net").st_ino == ino:
                    out.append(int(d))
            except OSError:
                pass
    return out
