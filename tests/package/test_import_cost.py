"""What importing the stack loads: dpkt (about 5 MB of RSS) only on the first DHCP message, so a
process whose guests have static addresses (the namespace guests, the benchmark's 10,000 idle
flows, many guests in one process) never pays for it."""

from __future__ import annotations

import subprocess
import sys

CODE = r"""
import asyncio, struct, sys
import aioslirp.cli.main
from aioslirp import NetworkConfig, Stack
from aioslirp.services.dhcp import DhcpServer

async def main():
    async with Stack(NetworkConfig()):
        assert "dpkt" not in sys.modules, "a started stack imported dpkt"
    mac = bytes.fromhex("525400123456")
    discover = (struct.pack("!BBBBIHHIIII", 1, 1, 6, 0, 0x1234, 0, 0, 0, 0, 0, 0) + mac + bytes(10)
                + bytes(192) + bytes.fromhex("63825363") + bytes([53, 1, 1, 255]))
    reply = DhcpServer(NetworkConfig()).handle(discover, mac, 0.0)
    assert reply is not None and reply[0][:1] == b"\x02", reply  # a BOOTREPLY (the offer)
    assert "dpkt" in sys.modules
asyncio.run(main())
print("ok")
"""


def test_dpkt_is_imported_on_the_first_dhcp_message_only():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
