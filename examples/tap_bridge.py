"""Serve an existing TAP interface with the aioslirp library API.

Make the interface first (as root; ``user`` lets you run this script unprivileged)::

    ip tuntap add dev tap0 mode tap user "$USER"
    ip addr add 10.0.2.15/24 dev tap0        # or run a DHCP client on it
    ip link set tap0 up
    ip route add default via 10.0.2.2 dev tap0   # optional: everything through the stack

then::

    python examples/tap_bridge.py --ifname tap0

Traffic from the TAP side to 10.0.2.2 reaches the host's loopback, 10.0.2.3 is the DNS
server, anything else is NATed onto host sockets. Ctrl-C (SIGINT) or SIGTERM stops it
cleanly (exit status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aioslirp import ConfigError, NetworkConfig, Stack
from aioslirp.transport.tap import TapTransport
from aioslirp.transport.tapdev import TapError


async def serve(ifname: str, config: NetworkConfig) -> None:
    async with Stack(config) as stack:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stack.stop)
        transport = TapTransport.open_by_name(ifname)
        logging.info("serving %s on %s", config.cidr, transport.ifname)
        await stack.serve(transport)  # until a signal, or the interface goes away
        logging.info("stopped; counters: %s", dict(stack.counters))


def main() -> int:
    parser = argparse.ArgumentParser(description="Serve an existing TAP interface with aioslirp.")
    parser.add_argument("--ifname", default="tap0", help="TAP interface to serve (default tap0)")
    parser.add_argument("--cidr", default="10.0.2.0/24", help="virtual network (default 10.0.2.0/24)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="tap_bridge: %(message)s")
    try:
        config = NetworkConfig(cidr=args.cidr).validate()
        asyncio.run(serve(args.ifname, config))
    except ConfigError as exc:
        print(f"tap_bridge: error: {exc}", file=sys.stderr)
        return 2
    except TapError as exc:
        print(f"tap_bridge: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
