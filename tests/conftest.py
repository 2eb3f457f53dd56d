"""Test-suite setup.

The whole pytest process moves into a fresh network namespace with only loopback before
any test runs, so nothing a test sends can leave the machine (unreachable destinations
fail at once). Set ``AIOSLIRP_TEST_NO_ISOLATE=1`` only when already inside such a namespace.

Missing prerequisites (the ``../shared`` kits, ``/dev/net/tun``, ``setpriv``, IPv6 loopback,
...) go through :func:`need`: a skip on a developer's machine, a failure under CI, which has
them all (a CI run reports 0 skipped).
"""

import importlib.util
import os

import pytest

from aioslirp.host.isolate import isolate_network


def pytest_configure(config):
    if os.environ.get("AIOSLIRP_TEST_NO_ISOLATE") != "1" and not os.environ.get("AIOSLIRP_TEST_ISOLATED"):
        isolate_network()
        os.environ["AIOSLIRP_TEST_ISOLATED"] = "1"
    config.addinivalue_line("markers", "slow: real-VM or long tests (still run in CI, bounded)")
    config.addinivalue_line("markers", "netns: needs namespaces and /dev/net/tun (root or rootless)")


def in_ci() -> bool:
    """True when ``CI`` is set to anything but empty, ``0`` or ``false`` (CI sets ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def need(condition, reason: str) -> None:
    """Go on only if ``condition`` is true: else skip the calling test, or fail it under CI.

    Works in a test, a fixture and at module level (then the whole module is skipped, or its
    collection fails under CI). ``reason`` says what is missing and how to get it.
    """
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI must have this prerequisite: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def importable(name: str) -> bool:
    """True when the (dotted) module ``name`` can be imported; for :func:`need`."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def have_ipv6_loopback() -> bool:
    """True when ``::1`` can be bound here (the test namespace's loopback has IPv6)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


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
