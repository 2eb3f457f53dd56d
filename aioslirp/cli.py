"""Command line: ``aioslirp run`` and ``aioslirp attach``.

``main(argv=None) -> int`` is the console-script entry point. Exit status: the command's
status for ``run`` (``128 + N`` when it died of signal N), 0 for a clean ``attach`` end,
2 for bad arguments or options not supported yet (one line naming the option), 1 when
the namespace or TAP cannot be set up (one line saying why).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Sequence

from .config import ConfigError, NetworkConfig, parse_hostport

__all__ = ["main", "build_parser", "config_from_args"]

PROG = "aioslirp"

#: Options accepted now but whose feature has not landed yet: dest -> flag shown to the user.
#: Remove an entry when the feature is wired in (see ``_apply_extras``).
NOT_YET_SUPPORTED = {
    "publish": "--publish",
    "pcap": "--pcap",
    "api_socket": "--api-socket",
    "trace": "--trace",
    "otlp_endpoint": "--otlp-endpoint",
}

#: NetworkConfig field -> the option that sets it, for error messages.
_FIELD_OPTION = {
    "cidr": "--cidr",
    "mtu": "--mtu",
    "dns_upstreams": "--dns",
    "dns_search": "--dns-search",
}

_LOG_LEVELS = ("debug", "info", "warning", "error")

_DESCRIPTION = """\
User-mode networking for network namespaces, without root: a process in its own network
namespace gets connectivity through a TAP device whose frames an asyncio stack NATs onto
ordinary host sockets (the job of slirp4netns and pasta).

Inside, the network looks like QEMU's user networking: the namespace has 10.0.2.15/24,
the gateway 10.0.2.2 (which also reaches the host's 127.0.0.1 unless
--disable-host-loopback), and the DNS server 10.0.2.3 (forwarding to the host's resolvers
or to --dns).
"""

_RUN_EPILOG = """\
examples:
  aioslirp run                                  an interactive shell with its own network
  aioslirp run -- curl -sI https://example.org  one command; exits with its status
  aioslirp run --mtu 65520 -- iperf3 -c 10.0.2.2
                                                10.0.2.2 is the host's loopback
  aioslirp run --dns 9.9.9.9 --dns-search corp.example -- sh

Rootless use needs unprivileged user namespaces and /dev/net/tun readable and writable
by you (mode 0666, the usual distribution default). Inside, you appear as root (uid 0)
in a new user namespace; /etc/resolv.conf shows the virtual DNS server, the host's file
is untouched.
"""

_ATTACH_EPILOG = """\
examples:
  unshare -rn sleep infinity &                  a rootless namespace, then:
  aioslirp attach $!                            serve it through a TAP named tap0
  sudo ip netns add ns1
  sudo aioslirp attach --netns /run/netns/ns1 eth0

Like slirp4netns --configure: the TAP gets 10.0.2.15/24 (see --cidr), the MTU and a
default route via 10.0.2.2. aioslirp serves until SIGINT/SIGTERM or until process PID
exits. Use a namespace's /etc/resolv.conf with nameserver 10.0.2.3 for DNS.
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _log_level(text: str) -> str:
    value = text.lower()
    if value not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(_LOG_LEVELS)}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for ``aioslirp`` (sub-commands ``run`` and ``attach``)."""
    from . import __version__

    common = argparse.ArgumentParser(add_help=False)
    net = common.add_argument_group("network options")
    net.add_argument("--mtu", type=int, metavar="BYTES", help="MTU of the guest link, 576-65520 (default 1500)")
    net.add_argument("--cidr", metavar="CIDR", help="IPv4 network of the guest link (default 10.0.2.0/24)")
    net.add_argument(
        "--disable-host-loopback",
        action="store_true",
        help="refuse connections to the gateway address that would reach the host's loopback",
    )
    net.add_argument(
        "--dns",
        action="append",
        metavar="ADDR[:PORT]",
        help="upstream DNS server for the virtual DNS (repeatable; default: the host's /etc/resolv.conf)",
    )
    net.add_argument(
        "--dns-search", action="append", metavar="DOMAIN", help="search domain handed to the guest (repeatable)"
    )
    net.add_argument("--ifname", metavar="NAME", help="name of the TAP device in the namespace (default tap0)")
    net.add_argument(
        "-p",
        "--publish",
        action="append",
        metavar="[HOST_IP:]HOST_PORT:GUEST_PORT[/tcp|udp]",
        help="forward a host port into the guest (repeatable)",
    )
    obs = common.add_argument_group("observability")
    obs.add_argument("--pcap", metavar="FILE", help="write all guest traffic to a pcap file")
    obs.add_argument("--api-socket", metavar="PATH", help="serve the control API (counters, port forwards) on a Unix socket")
    obs.add_argument("--trace", action="store_true", help="record OpenTelemetry spans")
    obs.add_argument("--otlp-endpoint", metavar="URL", help="export spans over OTLP/HTTP to URL")
    obs.add_argument(
        "--log-level", type=_log_level, default="warning", metavar="LEVEL", help="debug, info, warning (default) or error"
    )

    parser = _Parser(
        prog=PROG,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run 'aioslirp run --help' or 'aioslirp attach --help' for examples.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a command (default: your shell) in a new network namespace",
        description="Run CMD in a new network namespace (plus user and mount namespaces when not root) "
        "whose only network is the user-mode stack. Exits with CMD's status.",
        usage="%(prog)s [OPTIONS] [--] [CMD [ARG ...]]",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="command and arguments (default: $SHELL)")

    sub.add_parser(
        "demo",
        parents=[common],
        help="offline demo: a guest in a new namespace fetches a page from a host server through the stack",
        description="Start an HTTP server and a DNS upstream on 127.0.0.1, run a Python client in a new "
        "network namespace behind aioslirp, and show what happened. Nothing leaves the machine.",
    )

    att = sub.add_parser(
        "attach",
        parents=[common],
        help="serve an existing network namespace (like slirp4netns)",
        description="Create a TAP device in an existing network namespace, configure it and serve it.",
        usage="%(prog)s [OPTIONS] (--netns PATH | PID) [IFNAME]",
        epilog=_ATTACH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    att.add_argument("--netns", metavar="PATH", help="network namespace file, e.g. /run/netns/NAME or /proc/PID/ns/net")
    att.add_argument("target", nargs="*", metavar="PID [IFNAME]", help="process whose namespace to serve, and the TAP name")
    return parser


def config_from_args(args: argparse.Namespace) -> NetworkConfig:
    """Build and validate the :class:`NetworkConfig` the options describe.

    Raises :class:`ConfigError` whose field is the option name (``--mtu``, ``--dns``...).
    """
    kwargs: dict = {}
    if args.cidr is not None:
        kwargs["cidr"] = args.cidr
    if args.mtu is not None:
        kwargs["mtu"] = args.mtu
    kwargs["disable_host_loopback"] = bool(args.disable_host_loopback)
    if args.dns:
        kwargs["dns_upstreams"] = [parse_hostport(v, 53, "--dns") for v in args.dns]
    if args.dns_search:
        domains = []
        for d in args.dns_search:
            name = d.strip().rstrip(".")
            if not name or len(name) > 253 or any(c.isspace() for c in name) or ".." in name:
                raise ConfigError("--dns-search", f"{d!r} is not a domain name")
            domains.append(name)
        kwargs["dns_search"] = domains
    config = NetworkConfig(**kwargs)
    try:
        config.validate()
    except ConfigError as exc:
        option = _FIELD_OPTION.get(exc.field)
        if option is None:
            raise
        raise ConfigError(option, str(exc).split(": ", 1)[-1]) from None
    return config


def _apply_extras(args: argparse.Namespace) -> None:
    """Refuse options whose feature is not implemented yet (exit 2 via ConfigError-like line)."""
    for dest, flag in NOT_YET_SUPPORTED.items():
        if getattr(args, dest, None):
            raise _Unsupported(flag)


class _Unsupported(Exception):
    pass


def _ifname(args: argparse.Namespace, positional: str | None) -> str:
    from .transport.tap import TapError, _check_ifname

    if args.ifname and positional and args.ifname != positional:
        raise ConfigError("IFNAME", f"{positional!r} conflicts with --ifname {args.ifname!r}")
    name = positional or args.ifname or "tap0"
    try:
        _check_ifname(name)
    except TapError as exc:
        raise ConfigError("--ifname" if not positional else "IFNAME", str(exc)) from None
    return name


def _attach_target(args: argparse.Namespace) -> tuple[str | None, int | None, str | None]:
    rest = list(args.target)
    if args.netns:
        if len(rest) > 1:
            raise ConfigError("PID", "give either --netns PATH or a PID, not both")
        return args.netns, None, (rest[0] if rest else None)
    if not rest:
        raise ConfigError("PID", "attach needs --netns PATH or the PID of a process in the namespace")
    if len(rest) > 2:
        raise ConfigError("PID", f"unexpected arguments: {' '.join(rest[2:])}")
    try:
        pid = int(rest[0])
        if pid <= 0:
            raise ValueError
    except ValueError:
        raise ConfigError("PID", f"{rest[0]!r} is not a process id") from None
    return None, pid, (rest[1] if len(rest) > 1 else None)


def _loop_factory():
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay usable without it
        return None
    return uvloop.new_event_loop


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"{PROG}: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aioslirp`` command. Returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        _apply_extras(args)
        config = config_from_args(args)
        if args.command_name == "demo":
            ifname = "tap0"
        elif args.command_name == "run":
            cmd = list(args.cmd)
            if cmd and cmd[0] == "--":
                cmd = cmd[1:]
            ifname = _ifname(args, None)
        else:
            netns_path, pid, positional_ifname = _attach_target(args)
            ifname = _ifname(args, positional_ifname)
    except _Unsupported as exc:
        print(f"{PROG}: {exc} is not supported yet", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    _setup_logging(args.log_level)
    from .netns import NamespaceError, attach, run_in_namespace
    from .transport.tap import TapError

    if args.command_name == "demo":
        from .demo import demo

        coro = demo(config)
    elif args.command_name == "run":
        coro = run_in_namespace(config, cmd, ifname=ifname, forward_signals=True)
    else:
        coro = attach(config, netns_path=netns_path, pid=pid, ifname=ifname, handle_signals=True)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return int(runner.run(coro))
    except (NamespaceError, TapError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
