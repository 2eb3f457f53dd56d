"""A small asyncio VM manager: boots a QEMU guest whose only network is an embedded aioslirp Stack,
checks that the guest is online through it, and exits.

No socket path, no second process: the manager creates ``socketpair(AF_UNIX, SOCK_STREAM)``,
keeps one end for the :class:`~aioslirp.Stack` running in its own event loop, and lets QEMU
inherit the other as fd N::

    -netdev stream,id=n0,addr.type=fd,addr.str=N -device virtio-net-pci,netdev=n0,mac=...

The guest is the guestvm kit's kernel and initramfs (``../shared/guestvm``; its ``/init``
configures eth0 by DHCP, runs the shell snippet given as ``guestvm.cmd=BASE64`` on the kernel
command line, prints ``GUESTVM-EXIT=<status>`` and powers off). The manager hands it a check
snippet and verifies each step on the host side:

* ``dhcp``: the stack leased the guest an address (``10.0.2.15``);
* ``dns``: the guest resolved ``host.aioslirp.internal`` through the virtual DNS (``10.0.2.3``)
  to the gateway (``10.0.2.2``);
* ``tcp``: the guest connected to that address and the manager's TCP server on host
  ``127.0.0.1`` (through the stack's NAT) received the guest's token, and the guest printed
  the server's reply token.

It prints one JSON report on stdout, the last line::

    {"checks": {"dhcp": true, "dns": true, "tcp": true}, "ok": true, "guest_exit": 0,
     "timed_out": false, "lease": "10.0.2.15", "connectivity": {...}, "events": [...],
     "counters": {...}, "seconds": 5.1}

and one summary line on stderr (``vm_manager: checks: dhcp ok, dns ok, tcp ok (5.1 s)``).
``--cmd SNIPPET`` runs your snippet instead of the checks (then only ``dhcp`` and the
snippet's exit status count). While the guest runs, ``-v`` logs its connectivity as it appears
(DHCP lease, ARP for the gateway, DNS queries, TCP/UDP flows, ICMP echo); its serial console
goes to stderr (``guest| `` prefix).

Exit status: 0 when every check passed and the guest's snippet exited 0; 1 when a check failed,
the snippet failed or the guest did not power off within ``--timeout`` seconds (QEMU is killed;
the report says ``"timed_out": true``); 2 for bad arguments. Under TCG (no KVM) the whole run
takes about 4 s.

Example (kernel and initramfs built by ``../shared/guestvm/build.sh`` into its cache; these are
the defaults, from ``$GUESTVM_CACHE`` or ``~/.cache/guestvm``)::

    python examples/vm_manager.py --kernel ~/.cache/guestvm/vmlinuz \\
        --initrd ~/.cache/guestvm/initramfs.cpio.gz

Anything after ``--`` is passed to QEMU as is (disks, ``-accel kvm``...).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from aioslirp import ConfigError, NetworkConfig, Stack
from aioslirp.config import parse_hostport
from aioslirp.transport.stream import StreamTransport

log = logging.getLogger("vm_manager")

#: The name the guest resolves: the virtual DNS answers it itself with the gateway's address.
CHECK_NAME = "host.aioslirp.internal"
#: The guest's check snippet (busybox sh). It prints KEY=VALUE lines the manager reads.
CHECK_SNIPPET = """\
ADDR=$(nslookup -type=a {name} {dns} 2>&1 | sed -n '/^Name:/,$ s/^Address:[[:space:]]*//p' | head -1)
echo CHECK_DNS=$ADDR
[ -n "$ADDR" ] || exit 3
REPLY=$(echo {token} | nc -w 5 $ADDR {port})
echo CHECK_TCP=$REPLY
[ -n "$REPLY" ] || exit 4
"""


def default_image(name: str) -> str:
    """``$GUESTVM_CACHE/NAME``, else ``~/.cache/guestvm/NAME`` (where the kit's build.sh puts it)."""
    cache = os.environ.get("GUESTVM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "guestvm")
    return os.path.join(cache, name)


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
        ("dns", "dns_queries_udp", "guest sent a DNS query to the virtual DNS"),
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

    def event(self, what: str) -> None:
        t = round(time.monotonic() - self.t0, 2)
        self.events.append({"t": t, "event": what})
        log.info("t=%.2fs %s", t, what)

    def poll(self) -> None:
        c = self.stack.counters
        if not self.state["dhcp"] and c["dhcp_replies"] >= 2 and self.stack.parts.dhcp is not None:
            addr = self.stack.parts.dhcp.lease_of(self.mac)
            if addr is not None:
                self.state["dhcp"] = True
                self.lease = str(addr)
                self.event(f"guest leased {addr} by DHCP")
        for name, counter, text in self.CHECKS:
            if not self.state[name] and c[counter] > 0:
                self.state[name] = True
                self.event(text)

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(0.05)


class TokenServer:
    """The host side of the ``tcp`` check: a TCP server on 127.0.0.1 that reads one line from
    each connection, remembers it, and answers with its own token line."""

    def __init__(self) -> None:
        self.reply = "pong-" + secrets.token_hex(8)
        self.received: list[str] = []
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            self.received.append(line.decode(errors="replace").strip())
            writer.write(self.reply.encode() + b"\n")
            await writer.drain()
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def manage(args: argparse.Namespace, config: NetworkConfig) -> int:
    token = "ping-" + secrets.token_hex(8)
    tokens = TokenServer()
    port = await tokens.start()
    if args.cmd is None:
        snippet = CHECK_SNIPPET.format(name=CHECK_NAME, dns=config.dns, token=token, port=port)
    else:
        snippet = args.cmd + "\n"
    kargs = ["console=ttyS0", "panic=-1", "quiet", "loglevel=4", "i8042.noaux", "i8042.nokbd",
             "guestvm.net=dhcp", "guestvm.cmd=" + base64.b64encode(snippet.encode()).decode()]
    if args.append:
        kargs.append(args.append)  # later options win in the guest's /init
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = theirs.fileno()
    argv = [args.qemu, "-nodefaults", "-no-user-config", "-machine", "pc", *accel_args(args.accel),
            "-m", str(args.mem), "-display", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", args.kernel, "-initrd", args.initrd, "-append", " ".join(kargs),
            "-netdev", f"stream,id=n0,addr.type=fd,addr.str={fd}",
            "-device", f"virtio-net-pci,netdev=n0,mac={args.mac},romfile=", *args.qemu_args]
    t0 = time.monotonic()
    values: dict[str, str] = {}
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
                text = line.decode(errors="replace").replace("\r", "").rstrip("\n")
                sys.stderr.write("guest| " + text + "\n")
                m = re.fullmatch(r"(CHECK_[A-Z]+|GUESTVM-EXIT)=(.*)", text.strip())
                if m:
                    values[m.group(1)] = m.group(2)

        copying = asyncio.ensure_future(console())
        timed_out = False
        try:
            rc = await asyncio.wait_for(qemu.wait(), args.timeout)
        except asyncio.TimeoutError:
            timed_out = True
            log.warning("guest still running after %.0f s: killing QEMU", args.timeout)
            qemu.kill()
            rc = await qemu.wait()
        await asyncio.wait_for(copying, 5)
        watching.cancel()
        watcher.poll()
        try:  # QEMU's exit closed its end: serve() returns by itself
            await asyncio.wait_for(asyncio.shield(serving), 5)
        except asyncio.TimeoutError:
            stack.stop()
            await serving
        tokens.close()
        guest_exit = int(values["GUESTVM-EXIT"]) if values.get("GUESTVM-EXIT", "").isdigit() else None
        checks = {"dhcp": watcher.state["dhcp"]}
        if args.cmd is None:
            checks["dns"] = values.get("CHECK_DNS") == str(config.gateway) and watcher.state["dns"]
            checks["tcp"] = token in tokens.received and values.get("CHECK_TCP") == tokens.reply
        ok = all(checks.values()) and guest_exit == 0 and not timed_out
        seconds = round(time.monotonic() - t0, 2)
        report = {
            "checks": checks,
            "ok": ok,
            "guest_exit": guest_exit,
            "timed_out": timed_out,
            "qemu_exit": rc,
            "lease": watcher.lease,
            "connectivity": watcher.state,
            "events": watcher.events,
            "transport": {"frames_in": transport.frames_in, "frames_out": transport.frames_out,
                          "send_drops": transport.send_drops, "closed": transport.close_reason},
            "counters": {k: v for k, v in sorted(stack.counters.items())},
            "seconds": seconds,
        }
    print(json.dumps(report))
    summary = ", ".join(f"{name} {'ok' if passed else 'FAILED'}" for name, passed in checks.items())
    why = " (timed out: QEMU killed)" if timed_out else f" (guest exit {guest_exit})" if guest_exit != 0 else ""
    print(f"vm_manager: checks: {summary}{why} ({seconds} s)", file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Boot a QEMU guest networked by an embedded aioslirp Stack "
                                     "(socketpair fd, -netdev stream), check DHCP, DNS and TCP through it, exit.")
    parser.add_argument("--qemu", default="qemu-system-x86_64", help="QEMU binary (default qemu-system-x86_64)")
    parser.add_argument("--kernel", default=default_image("vmlinuz"),
                        help="kernel image (default $GUESTVM_CACHE/vmlinuz, else ~/.cache/guestvm/vmlinuz)")
    parser.add_argument("--initrd", default=default_image("initramfs.cpio.gz"),
                        help="the guestvm kit's initramfs (default beside the kernel's default)")
    parser.add_argument("--append", help="extra kernel command line (guestvm.* options override the manager's)")
    parser.add_argument("--cmd", metavar="SNIPPET", help="guest shell snippet run instead of the DNS/TCP checks")
    parser.add_argument("--mem", type=int, default=256, help="guest RAM in MiB (default 256)")
    parser.add_argument("--mac", default="52:54:00:12:34:56", help="guest MAC (default 52:54:00:12:34:56)")
    parser.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto",
                        help="accelerator (default auto: kvm if hardware virtualisation is usable, else tcg)")
    parser.add_argument("--dns", action="append", metavar="ADDR[:PORT]", help="DNS upstream (default: /etc/resolv.conf)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="kill the guest after this many seconds and exit 1 (default 60)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log connectivity events to stderr")
    parser.add_argument("qemu_args", nargs="*", metavar="-- QEMU_ARG", help="extra QEMU arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="vm_manager: %(message)s")
    if not re.fullmatch(r"([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}", args.mac):
        print(f"vm_manager: error: --mac: {args.mac!r} is not a MAC address", file=sys.stderr)
        return 2
    for option, path in (("--kernel", args.kernel), ("--initrd", args.initrd)):
        if not Path(path).is_file():
            print(f"vm_manager: error: {option}: no file {path} (build the guestvm kit: "
                  "../shared/guestvm/build.sh, or set GUESTVM_CACHE)", file=sys.stderr)
            return 2
    if not args.timeout > 0:
        print(f"vm_manager: error: --timeout: {args.timeout} is not a positive number of seconds", file=sys.stderr)
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
