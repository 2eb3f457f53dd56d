"""What a test needs before it can run, and what to do when it is missing.

A missing prerequisite (the ``../shared`` kits, ``/dev/net/tun``, ``setpriv``, IPv6 loopback, a
tool, a Python package) goes through :func:`need`: a skip on a developer's machine, a failure
under CI, which has them all (a CI run reports 0 skipped).
"""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest


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
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True
