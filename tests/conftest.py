"""Test-suite setup.

The whole pytest process moves into a fresh network namespace with only loopback before
any test runs, so nothing a test sends can leave the machine (unreachable destinations
fail at once). Set ``AIOSLIRP_TEST_NO_ISOLATE=1`` only when already inside such a namespace.
"""

import os

import pytest

from aioslirp._isolate import isolate_network


def pytest_configure(config):
    if os.environ.get("AIOSLIRP_TEST_NO_ISOLATE") != "1" and not os.environ.get("AIOSLIRP_TEST_ISOLATED"):
        isolate_network()
        os.environ["AIOSLIRP_TEST_ISOLATED"] = "1"
    config.addinivalue_line("markers", "slow: real-VM or long tests (still run in CI, bounded)")
    config.addinivalue_line("markers", "netns: needs namespaces and /dev/net/tun (root or rootless)")


def _open_io_fds() -> dict:
    """fd -> target for this process's sockets, TAP devices and pidfds."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:") or target == "/dev/net/tun" or "pidfd" in target:
            out[int(fd)] = target
    return out


@pytest.fixture(scope="session", autouse=True)
def no_leaked_fds_after_suite():
    """After the whole suite: no socket, TAP or pidfd opened by the tests is left open."""
    import gc

    before = _open_io_fds()
    yield
    gc.collect()
    leaked = {fd: t for fd, t in _open_io_fds().items() if before.get(fd) != t}
    assert not leaked, f"leaked fds after the suite: {leaked}"
