"""docs/sandbox.md's Python example (examples/sandbox.py) runs as shown: a real namespace, a
local DNS upstream and web server, an allowed name, a denied name and a literal address."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.egress_world import world  # noqa: F401 - the fixture: DNS upstream, web servers, addresses
from support.paths import REPO

pytestmark = pytest.mark.netns

EXAMPLE = REPO / "examples" / "sandbox.py"

DRIVER = r'''
import asyncio, runpy, sys
port, audit = int(sys.argv[1]), sys.argv[2]
sandbox = runpy.run_path(sys.argv[3])["sandbox"]
guest = ["sh", "-c", f"curl -s -o /dev/null -w '%{{http_code}}\\n' http://allowed.test:{port}/; "
         f"curl -s --max-time 3 http://denied.test:{port}/ || echo resolve-failed; "
         f"curl -s --max-time 3 http://192.0.2.30:{port}/ || echo connect-failed"]
# 192.0.2.0/24:9/udp covers the test names' documentation addresses (an upstream answer binds no
# special-purpose address without a CIDR rule over it; pypi.org's are global) and opens no port used here
sys.exit(asyncio.run(sandbox(guest, allow=[f"allowed.test:{port}", "192.0.2.0/24:9/udp"], dns=["127.0.0.1:53"],
                             audit_log=audit)))
'''


def test_docs_show_the_example_verbatim():
    doc = (REPO / "docs" / "sandbox.md").read_text()
    assert EXAMPLE.read_text().strip() in doc
    assert len(EXAMPLE.read_text().splitlines()) <= 45


def test_python_sandbox_example_runs(world, tmp_path):  # noqa: F811
    port = world["port"]
    audit = tmp_path / "audit.jsonl"
    p = subprocess.run([sys.executable, "-c", DRIVER, str(port), str(audit), str(EXAMPLE)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"stdout={p.stdout[-2000:]}\nstderr={p.stderr[-4000:]}"
    assert p.stdout.split() == ["200", "resolve-failed", "connect-failed"], p.stdout
    err = p.stderr
    assert "denied dns: denied.test:53 (egress-default deny)" in err, err
    assert f"denied tcp: 192.0.2.30:{port} (egress-default deny)" in err, err
    flows = int(err.strip().splitlines()[-1].split()[0])
    assert err.strip().endswith("flows allowed") and flows >= 1
    recs = [json.loads(line) for line in audit.read_text().splitlines()]
    assert any(r["event"] == "flow" and r["name"] == "allowed.test" and r["rule"] == f"allowed.test:{port}"
               for r in recs), recs
    assert sum(r["event"] == "flow" for r in recs) == flows
