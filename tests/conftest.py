"""Test-suite setup.

The whole pytest process moves into a fresh network namespace with only loopback before
any test runs, so nothing a test sends can leave the machine (unreachable destinations
fail at once). Set ``AIOSLIRP_TEST_NO_ISOLATE=1`` only when already inside such a namespace.

Missing prerequisites go through :func:`support.prereqs.need` (a skip on a developer's machine, a
failure under CI). The helpers every test folder shares are the ``support`` package beside this
file (``tests/`` is on ``sys.path``: ``pythonpath`` in pyproject's ``[tool.pytest.ini_options]``).
"""

import os

import pytest

from aioslirp.host.isolate import isolate_network


def pytest_configure(config):
    if os.environ.get("AIOSLIRP_TEST_NO_ISOLATE") != "1" and not os.environ.get("AIOSLIRP_TEST_ISOLATED"):
        isolate_network()
        os.environ["AIOSLIRP_TEST_ISOLATED"] = "1"
    config.addinivalue_line("markers", "slow: real-VM or long tests (still run in CI, bounded)")
    config.addinivalue_line("markers", "netns: needs namespaces and /dev/net/tun (root or rootless)")
    config.addinivalue_line("markers", "perframe: drives the per-frame path that aioslirp/compiled.py compiles; CI "
                            "runs these once more on the pure-Python modules (AIOSLIRP_NO_EXTENSIONS=1, .ci/run)")
    config.addinivalue_line("markers", "sanitizer: the native C code under ASan/UBSan and its bounded libFuzzer runs; "
                            "left out of the default run (pyproject addopts), a CI stage of its own (.ci/run: "
                            "pytest -m sanitizer)")


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


#: The io fds open before the first test (the interpreter's and pytest's own), set by
#: :func:`no_leaked_fds_after_suite`; ``None`` until then.
_fds_before_suite: dict | None = None

#: fd -> (target, node id of the test during whose setup, call or teardown it appeared), for every
#: fd the tests opened that is still open; brought up to date after each phase of each test.
_fd_opened_by: dict[int, tuple[str, str]] = {}

#: The node id of the test being run (its setup, call or teardown).
_current_test = ""


def _track_fds(nodeid: str) -> None:
    """Forget the fds closed since the last look; charge the new ones to test ``nodeid``."""
    if _fds_before_suite is None:
        return
    now = _open_io_fds()
    for fd, (target, _) in list(_fd_opened_by.items()):
        if now.get(fd) != target:
            del _fd_opened_by[fd]
    for fd, target in now.items():
        if fd not in _fd_opened_by and _fds_before_suite.get(fd) != target:
            _fd_opened_by[fd] = (target, nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    global _current_test
    _current_test = item.nodeid
    try:
        return (yield)
    finally:
        _track_fds(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:
        _track_fds(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        _track_fds(item.nodeid)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_fds_after_suite():
    """After the whole suite: no socket, TAP or pidfd opened by the tests is left open. Each one
    left is reported with the test during which it was opened (a fixture's setup or teardown
    counts for the test that ran it), so a leak names its test even when that test failed."""
    import gc

    global _fds_before_suite
    _fds_before_suite = before = _open_io_fds()
    yield
    gc.collect()
    _track_fds(_current_test)  # what this last test's teardown opened before this point
    leaked = {fd: t for fd, t in _open_io_fds().items() if before.get(fd) != t}
    lines = [f"fd {fd} {t} opened during {_fd_opened_by.get(fd, (t, 'an unknown test'))[1]}"
             for fd, t in sorted(leaked.items())]
    assert not leaked, "leaked fds after the suite:\n" + "\n".join(lines)
