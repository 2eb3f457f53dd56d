"""The suite's fd-leak check (tests/conftest.py) names the test during which each leaked fd was
opened: a child pytest run of a tiny suite, with this conftest, where one test leaks a socket,
one fixture opens a socket and fails (the leak of a test whose tool is missing), and a module
fixture opens one in its first test and closes it at the module's end (not a leak)."""

from __future__ import annotations

import os
import subprocess
import sys

from support.paths import REPO, TESTS

LEAKY = '''
import socket

import pytest

kept = []


@pytest.fixture(scope="module")
def server():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    yield s
    s.close()


@pytest.fixture
def broken():
    kept.append(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    pytest.fail("the tool this fixture drives is missing")


def test_a_uses_the_module_server(server):
    assert server.fileno() >= 0


def test_b_leaks_a_socket():
    kept.append(socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))


def test_c_fixture_fails(broken):
    pass


def test_d_uses_the_module_server(server):
    assert server.fileno() >= 0
'''


def test_a_leaked_fd_names_its_test(tmp_path):
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(TESTS), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        "-W", "ignore::pytest.PytestConfigWarning", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout
    assert p.returncode == 1, out + p.stderr
    assert out.splitlines()[-1].startswith("3 passed, 2 errors"), out  # the fixture's, then the leak check's
    leaked = [line for line in out.splitlines() if line.startswith("E   ") and " opened during " in line]
    assert [line.split(" opened during ")[1] for line in leaked] == [
        "test_leaky.py::test_b_leaks_a_socket", "test_leaky.py::test_c_fixture_fails"], out
    assert all(" socket:[" in line for line in leaked), leaked
    assert "ERROR at teardown of test_d_uses_the_module_server" in out, out
