"""A small asyncio VM manager: boots a QEMU guest whose only network is an embedded aioslirp Stack.

No socket path, no second process: the manager creates ``socketpair(AF_UNIX, SOCK_STREAM)``,
keeps one end for the :class:`~aioslirp.Stack` running in its own event loop, and lets QEMU
inherit the other as fd N::

    -netdev stream,id=n0,addr.type=fd,addr.str=N -device virtio-net-pci,netdev=n0,mac=...

While the guest runs, the manager watches the stack and reports the guest's connectivity
as it appears (DHCP lease, ARP for the gateway, DNS queries, TCP/UDP flows, ICMP echo);
when QEMU exits (or after ``--timeout`` seconds, when it is killed) it prints one JSON
report on stdout, the last line::

    {"qemu_exit": 0, "lease": "10.0.2.15", "connectivity": {"dhcp": true, "gateway_arp": true,
     "dns": true, "tcp": true, "udp": false, "icmp": false}, "events": [...], "counters": {...},
     "seconds": 4.8}

Exit status: 0 when the guest got a lease and exchanged traffic with the stack, 1 when not,
2 for bad arguments. The guest's serial console goes to stderr (``guest| `` prefix).

Example (kernel and initramfs from ../shared/guestvm, built into its cache)::

    python examples/vm_manager.py --kernel ~/.cache/guestvm/vmlinuz \\
        --initrd ~/.cache/guestvm/initramfs.cpio.gz \\
        --append "console=ttyS0 quiet panic=-1 guestvm.net=dhcp"

Anything after ``--`` is passed to QEMU as is (disks, ``-accel kvm``...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

from aioslirp import ConfigError, NetworkConfig, Stack
from aioslirp.config import parse_hostport
from aioslirp.transport.stream import StreamTransport

log = logging.getLogger("vm_manager")


def accel_args(choice: str) -> list[str]:
    """QEMU accelerator options: ``auto`` picks KVM only when hardware virtualisation is usable."""
    if choice == "tcg" or (choice == "auto" and not kvm_usable()):
        return ["-accel", "tcg", "-cpu", "max"]
    return ["-accel", "kvm", "-accel", "tcg", "-cpu", "max"]


def kvm_usable() -> bool:
    """/dev/kvm read-write, VMX/SVM in /proc/cpuinfo, and not the slow kvm_pvm module."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
        with open("/proc/cpuinfo") as f:
            hw = re.search(r"\b(vmx|svm)\b", f.read()) is not None
        return hw and not os.path.exists("/sys/module/kvm_pvm")
    except OSError:
        return False


class Watcher:
    """Turns stack state into connectivity events (polled; the stack needs no hooks)."""

    CHECKS = (
        ("gateway_arp", "arp_replies", "guest resolved the gateway (ARP)"),
        ("dns", "dns_queries_udp", "guest sent a DNS query to 10.0.2.3"),
        ("tcp", "flows.tcp.opened", "guest opened a TCP connection through the stack"),
        ("udp", "flows.udp.opened", "guest sent UDP through the stack"),
        ("icmp", "icmp_echo_local", "guest pinged the gateway"),
    )

    def __init__(self, stack: Stack, mac: bytes, t0: float) -> None:
        self.stack = stack
        self.mac = mac
        self.t0 = t0
        self.state = {"dhcp": False, **{name: False for name, _, _ in self.CHECKS}}
        self.lease: str | None = None
        self.events: list[dict] = []

    def _event(self, what: str) -> None:
        t = round(time.monotonic() - self.t0, 2)
        self.events.append({"t": t, "event": what})
        log.info("t=%.2fs %s", t, what)

    def poll(self) -> None:
        c = self.stack.counters
        if not self.state["dhcp"] and c["dhcp_replies"] >= 2 and self.stack.dhcp is not None:
            addr = self.stack.dhcp.lease_of(self.mac)
            if addr is not None:
                self.state["dhcp"] = True
                self.lease = str(addr)
                self._event(f"guest leased {addr} by DHCP")
        for name, counter, text in self.CHECKS:
            if not self.state[name] and c[counter] > 0:
                self.state[name] = True
                self._event(text)

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(0.05)


async def manage(args: argparse.Namespace, config: NetworkConfig) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = theirs.fileno()
    argv = [args.qemu, "-nodefaults", "-no-user-config", "-machine", "pc", *accel_args(args.accel),
            "-m", str(args.mem), "-display", "none", "-serial", "stdio", "-no-reboot",
            "-netdev", f"stream,id=n0,addr.type=fd,addr.str={fd}",
            "-device", f"virtio-net-pci,netdev=n0,mac={args.mac},romfile="]
    if args.kernel:
        argv += ["-kernel", args.kernel]
    if args.initrd:
        argv += ["-initrd", args.initrd]
    if args.append:
        argv += ["-append", args.append]
    argv += args.qemu_args
    t0 = time.monotonic()
    async with Stack(config) as stack:
        transport = StreamTransport(ours, name="guest")
        serving = asyncio.ensure_future(stack.serve(transport))
        await asyncio.sleep(0)  # the transport reads before QEMU starts
        qemu = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, pass_fds=[fd])
        theirs.close()  # QEMU holds it now; its exit closes the stream (EOF for the stack)
        log.info("QEMU pid %d started with the guest NIC on fd %d", qemu.pid, fd)
        watcher = Watcher(stack, bytes.fromhex(args.mac.replace(":", "")), t0)
        watching = asyncio.ensure_future(watcher.run())

        async def console() -> None:
            while line := await qemu.stdout.readline():
                sys.stderr.write("guest| " + line.decode(errors="replace").rstrip("\r\n") + "\n")

        copying = asyncio.ensure_future(console())
        try:
            rc = await asyncio.wait_for(qemu.wait(), args.timeout)
        except asyncio.TimeoutError:
            log.warning("guest still running after %.0f s: killing QEMU", args.timeout)
            qemu.kill()
            rc = await qemu.wait()
        await asyncio.wait_for(copying, 5)
        watching.cancel()
        watcher.poll()
        try:  # QEMU's exit closed its end: serve() returns by itself
            await asyncio.wait_for(asyncio.shield(serving), 5)
        except asyncio.TimeoutError:
            stack.close()
            await serving
        report = {
            "qemu_exit": rc,
            "lease": watcher.lease,
            "connectivity": watcher.state,
            "events": watcher.events,
            "transport": {"frames_in": transport.frames_in, "frames_out": transport.frames_out,
                          "send_drops": transport.send_drops, "closed": transport.close_reason},
            "counters": {k: v for k, v in sorted(stack.counters.items())},
            "seconds": round(time.monotonic() - t0, 2),
        }
    print(json.dumps(report))
    ok = watcher.state["dhcp"] and transport.frames_in > 0 and transport.frames_out > 0
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Boot a QEMU guest networked by an embedded aioslirp Stack "
                                     "(socketpair fd, -netdev stream) and report its connectivity.")
    parser.add_argument("--qemu", default="qemu-system-x86_64", help="QEMU binary (default qemu-system-x86_64)")
    parser.add_argument("--kernel", help="kernel image (-kernel)")
    parser.add_argument("--initrd", help="initramfs (-initrd)")
    parser.add_argument("--append", help="kernel command line (-append)")
    parser.add_argument("--mem", type=int, default=256, help="guest RAM in MiB (default 256)")
    parser.add_argument("--mac", default="52:54:00:12:34:56", help="guest MAC (default 52:54:00:12:34:56)")
    parser.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto",
                        help="accelerator (default auto: kvm if hardware virtualisation is usable, else tcg)")
    parser.add_argument("--dns", action="append", metavar="ADDR[:PORT]", help="DNS upstream (default: /etc/resolv.conf)")
    parser.add_argument("--timeout", type=float, default=120.0, help="kill the guest after this many seconds (default 120)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log connectivity events to stderr")
    parser.add_argument("qemu_args", nargs="*", metavar="-- QEMU_ARG", help="extra QEMU arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="vm_manager: %(message)s")
    if not re.fullmatch(r"([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}", args.mac):
        print(f"vm_manager: error: --mac: {args.mac!r} is not a MAC address", file=sys.stderr)
        return 2
    try:
        kwargs = {}
        if args.dns:
            kwargs["dns_upstreams"] = [parse_hostport(d, 53, "--dns") for d in args.dns]
        config = NetworkConfig(**kwargs).validate()
    except ConfigError as exc:
        print(f"vm_manager: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(manage(args, config))


if __name__ == "__main__":
    sys.exit(main())
