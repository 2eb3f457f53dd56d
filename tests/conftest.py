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
