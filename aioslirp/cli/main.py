"""Command line: ``aioslirp run``, ``attach``, ``qemu``, ``demo``, ``trace-report`` and ``slirp4netns``.

``main(argv=None) -> int`` is the console-script entry point. Exit status: the command's
status for ``run`` (``128 + N`` when it died of signal N), 0 for a clean ``attach`` end,
2 for bad arguments or options not supported yet (one line naming the option), 1 when
the namespace or TAP cannot be set up (one line saying why).

Each sub-command's parser names its handler (``set_defaults(run=handler)``); ``main`` parses
and calls it. The commands that serve a guest share :func:`_serve`: options to a validated
config, the observability set-up, the stack factory (``--publish``, ``--api-socket``), then
the command's own session on uvloop.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Sequence

from ..config import NetworkConfig, parse_hostport
from ..config.limits import LIMIT_FIELDS, parse_limits
from ..config.rates import parse_rate_limit
from ..config.records import parse_dns_record
from ..errors import ConfigError

__all__ = ["main", "build_parser", "config_from_args"]



#: NetworkConfig field -> the option that sets it, for error messages.
_FIELD_OPTION = {
    "cidr": "--cidr",
    "cidr6": "--cidr6",
    "gateway6": "--cidr6",
    "dns6": "--cidr6",
    "mtu": "--mtu",
    "dns_upstreams": "--dns",
    "dns_search": "--dns-search",
    "dns_records": "--dns-record",
    "egress_allow": "--allow",
    "egress_deny": "--deny",
    "rate_up": "--rate-limit up",
    "rate_down": "--rate-limit down",
    "audit_log": "--audit-log",
    "upstream_proxy": "--upstream-proxy",
    "egress_default": "--egress-default",
    "trace_level": "--trace-level",
}
_FIELD_OPTION.update({name: f"--limit {name}" for name in LIMIT_FIELDS})

from .options import (_ATTACH_EPILOG, _DESCRIPTION, _QEMU_EPILOG, _RUN_EPILOG, _VHOST_USER_EPILOG, PROG,  # noqa: F401
                      _fd_number, _Parser, check_switch_args, common_options, open_events)


def _terminate(signum, _frame) -> None:
    raise SystemExit(128 + signum)


class _VersionAction(argparse.Action):
    """``--version``: the version, then one line on the compiled per-frame path and one on the native
    data plane (imported only here)."""

    def __init__(self, option_strings, version: str, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None) -> None:  # noqa: A002 - argparse's name
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)
        self.version = version

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from ..compiled import notice
        from ..native import notice as native_notice

        print(self.version.replace("%(prog)s", parser.prog))
        print(notice())
        print(native_notice())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for ``aioslirp`` (sub-commands ``run`` and ``attach``)."""
    from .. import __version__

    common = common_options()

    parser = _Parser(
        prog=PROG,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run 'aioslirp run --help', 'aioslirp attach --help' or 'aioslirp qemu --help' for examples.",
    )
    parser.add_argument("--version", action=_VersionAction, version=f"%(prog)s {__version__}",
                        help="print the version, whether the compiled per-frame path is loaded and whether "
                             "the native data plane is on, then exit")
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
    run.add_argument(
        "--stop-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="after forwarding SIGTERM to CMD, wait this long (default 10) before resetting its connections, "
        "stopping the network and killing CMD (a second SIGTERM: at once)",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="command and arguments (default: $SHELL)")
    run.set_defaults(run=_cmd_run)

    sub.add_parser(
        "demo",
        parents=[common],
        help="offline demo: a guest in a new namespace fetches a page from a host server through the stack",
        description="Start an HTTP server and a DNS upstream on 127.0.0.1, run a Python client in a new "
        "network namespace behind aioslirp, and show what happened. Nothing leaves the machine.",
    ).set_defaults(run=_cmd_demo)

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
    att.set_defaults(run=_cmd_attach)
    for p in (run, att):
        p.add_argument(
            "--no-offload",
            dest="offload",
            action="store_false",
            help="plain TAP frames: no virtio-net header, no checksum/segmentation offload (by default the guest's "
            "TCP arrives in up to 64 KB segments whose checksums the kernel vouches for, and ours go out the same way)",
        )

    rep = sub.add_parser(
        "trace-report",
        help="per-connection timeline and per-stage percentiles from a --trace file",
        description="Read the spans of a --trace FILE and print, per TCP connection, the timeline of its "
        "events with the gap between consecutive events; per stage (pair of consecutive events) the "
        "p50/p90/p99 over all connections; the trace points' own durations; and a verdict naming the "
        "largest stage.",
        epilog="example:\n  aioslirp run --trace crr.jsonl --trace-level timeline -- python3 client.py\n"
        "  aioslirp trace-report crr.jsonl --png crr.png\n\n"
        "The stages need --trace-level timeline or frames (the default, flows, records one span per\n"
        "flow and no events); the per-frame trace points need --trace-level frames.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("file", metavar="FILE", help="span file written by --trace")
    rep.add_argument("--png", metavar="OUT", help="also draw the stages as a PNG (needs the plot extra: matplotlib)")
    rep.add_argument(
        "--connections", type=int, default=10, metavar="N", help="timelines to print (default 10; 0: all)"
    )
    rep.add_argument(
        "--guest", metavar="NAME", help="only the spans of the guest NAME (aioslirp.guest.name: run --name NAME)"
    )
    rep.set_defaults(run=_cmd_trace_report)

    qemu = sub.add_parser(
        "qemu",
        parents=[common],
        help="serve QEMU guests over a UNIX socket (-netdev stream / -netdev dgram)",
        description="Serve QEMU virtual machines: listen on a UNIX socket for QEMU's -netdev stream "
        "(or -netdev dgram with --dgram), or serve an already connected socket inherited as fd N. "
        "One guest at a time; the next guest is served after one disconnects.",
        usage="%(prog)s [OPTIONS] (--socket PATH [--dgram] | --fd N)",
        epilog=_QEMU_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Listed here for --help only: main() hands "aioslirp slirp4netns ..." to aioslirp.cli.slirp4netns as is.
    s4 = sub.add_parser(
        "slirp4netns",
        add_help=False,
        help="drop-in for the slirp4netns binary (RootlessKit, Podman); see 'aioslirp slirp4netns --help'",
    )
    s4.add_argument("slirp4netns_args", nargs=argparse.REMAINDER)
    s4.set_defaults(run=_cmd_slirp4netns)

    where = qemu.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", metavar="PATH", help="UNIX socket path to listen on (created; removed on exit)")
    where.add_argument("--fd", type=_fd_number, metavar="N", help="serve the connected socket inherited as fd N (e.g. a socketpair end)")
    qemu.add_argument("--dgram", action="store_true", help="-netdev dgram: one frame per datagram (default: -netdev stream)")
    qemu.add_argument("--switch", action="store_true",
                      help="every QEMU connecting to --socket joins one virtual network as a new guest with its own "
                      "stack (10.0.2.15, .16, ... by DHCP; named vm1, vm2, ..., or --name PREFIX; docs/qemu.md)")
    qemu.add_argument("--max-guests", type=int, default=None, metavar="N",
                      help="with --switch: guests at once (default 16); more connections are closed at once")
    qemu.add_argument("--lease", action="append", metavar="MAC=ADDRESS[,NAME]",
                      help="with --switch (repeatable): the guest sending from MAC gets ADDRESS by DHCP (and the DNS "
                      "name NAME) whenever it connects; the other guests get the addresses left")
    qemu.set_defaults(run=_cmd_qemu)

    vu = sub.add_parser(
        "vhost-user",
        parents=[common],
        help="serve a VM over vhost-user-net (QEMU -netdev vhost-user, libvirt, cloud-hypervisor)",
        description="Serve a virtual machine's virtio-net NIC as a vhost-user back end on a UNIX socket: "
        "the front end shares the guest's memory and the rings are read and written in place. One front "
        "end at a time; the next is served after one disconnects.",
        usage="%(prog)s [OPTIONS] --socket PATH [--client]",
        epilog=_VHOST_USER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    vu.add_argument("--socket", metavar="PATH", required=True,
                    help="UNIX socket path to listen on (created; removed on exit), or with --client to connect to")
    vu.add_argument("--client", action="store_true",
                    help="connect to a front end listening on PATH (QEMU -chardev socket,server=on), again "
                         "whenever it goes")
    from ..transport.vhost_proto import TX_COALESCE, TX_DEFER

    vu.add_argument("--tx-coalesce", metavar="BYTES", type=int, default=TX_COALESCE,
                    help="TX interrupt moderation: a walk of the guest's TX ring that took at least BYTES asks for "
                         "no kick and the ring is walked again 1 ms later (fewer wake-ups in a bulk upload; small "
                         "frames are never delayed); 0 turns it off (default %(default)s)")
    vu.add_argument("--tx-defer", metavar="SECONDS", type=float, default=TX_DEFER,
                    help="TX completion deferral: after a walk of the guest's TX ring that took under 4 KiB, the "
                         "interrupt that hands the buffers back waits up to SECONDS for the guest to take them "
                         "back by itself (a Linux guest does when it next receives: one interrupt per request/"
                         "response instead of two); 0 turns it off, at most 1 (default %(default)s)")
    vu.set_defaults(run=_cmd_vhost_user)
    return parser


def _check_audit_path(path: str) -> None:
    """``--audit-log FILE`` can be appended to (created if missing); else ConfigError."""
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError("--audit-log", f"cannot write {path!r}: {exc.strerror}") from None


def config_from_args(args: argparse.Namespace) -> NetworkConfig:
    """Build and validate the :class:`NetworkConfig` the options describe.

    Raises :class:`ConfigError` whose field is the option name (``--mtu``, ``--dns``...).
    """
    kwargs: dict = {}
    if args.cidr is not None:
        _check_family("--cidr", args.cidr, 4)
        kwargs["cidr"] = args.cidr
    if args.mtu is not None:
        kwargs["mtu"] = args.mtu
    kwargs["disable_host_loopback"] = bool(args.disable_host_loopback)
    if args.ipv6 is not None:
        kwargs["ipv6"] = args.ipv6
    if args.cidr6 is not None:
        if args.ipv6 is False:
            raise ConfigError("--cidr6", "not used with --no-ipv6")
        _check_family("--cidr6", args.cidr6, 6)
        kwargs["cidr6"] = args.cidr6
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
    if getattr(args, "dns_record", None):
        kwargs["dns_records"] = [parse_dns_record(v, "--dns-record") for v in args.dns_record]
    if getattr(args, "allow", None):
        kwargs["egress_allow"] = list(args.allow)
    if getattr(args, "deny", None):
        kwargs["egress_deny"] = list(args.deny)
    if getattr(args, "egress_default", None):
        kwargs["egress_default"] = args.egress_default
    kwargs.update(parse_limits(getattr(args, "limit", None)))
    if getattr(args, "rate_limit", None) is not None:
        kwargs.update(parse_rate_limit(args.rate_limit, "--rate-limit"))
    if getattr(args, "verify_sni", None):
        kwargs["verify_sni"] = True
    if getattr(args, "trace_level", None) is not None:
        kwargs["trace_level"] = args.trace_level
    if getattr(args, "upstream_proxy", None) is not None:
        kwargs["upstream_proxy"] = args.upstream_proxy
    if getattr(args, "no_proxy", None) is not None:
        if getattr(args, "upstream_proxy", None) is None:
            raise ConfigError("--no-proxy", "used only with --upstream-proxy")
        kwargs["no_proxy"] = args.no_proxy
    audit_log = getattr(args, "audit_log", None)
    if audit_log is not None:
        if not audit_log.strip():
            raise ConfigError("--audit-log", "empty path")
        if audit_log != "-":
            _check_audit_path(audit_log)
        kwargs["audit_log"] = audit_log
    if getattr(args, "stop_timeout", None) is not None and not args.stop_timeout >= 0:
        raise ConfigError("--stop-timeout", f"{args.stop_timeout!r} must be a number of seconds >= 0")
    config = NetworkConfig(**kwargs)
    try:
        config.validate()
    except ConfigError as exc:
        option = _FIELD_OPTION.get(exc.field)
        if option is None:
            raise
        raise ConfigError(option, str(exc).split(": ", 1)[-1]) from None
    return config


def _check_family(option: str, text: str, version: int) -> None:
    """``--cidr`` takes an IPv4 network, ``--cidr6`` an IPv6 prefix: a network of the other
    family raises :class:`ConfigError` pointing to the right option (other bad values are
    left to :meth:`NetworkConfig.validate`)."""
    import ipaddress

    try:
        net = ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        return
    if net.version != version:
        if version == 4:
            raise ConfigError(option, f"{text!r} is an IPv6 network; --cidr takes the IPv4 network "
                                      "(like 10.0.2.0/24), --cidr6 the IPv6 /64 prefix")
        raise ConfigError(option, f"{text!r} is an IPv4 network; --cidr6 takes the IPv6 /64 prefix "
                                  "(like fd00::/64), --cidr the IPv4 network")


def _check_publish_clashes(forwards) -> None:
    """Two ``-p`` giving the same host port (and protocol) on the same address, or on an address
    and the wildcard of its family, could not both listen: :class:`ConfigError` naming -p/--publish."""
    import ipaddress

    seen: dict = {}
    for fwd in forwards:
        addr = ipaddress.ip_address(fwd.host_addr)
        key = (fwd.proto, fwd.host_port, addr.version)
        for other in seen.get(key, ()):
            port = f"host port {fwd.host_port}/{fwd.proto}"
            if other == addr:
                raise ConfigError("-p/--publish", f"{port} on {addr} given twice")
            if other.is_unspecified or addr.is_unspecified:
                raise ConfigError("-p/--publish", f"{port} given on {other} and on {addr}; "
                                                  f"{other if other.is_unspecified else addr} already means every address")
        seen.setdefault(key, []).append(addr)


def _api_socket_problem(path: str) -> str | None:
    """Why ``--api-socket PATH`` cannot be created (one line), or None: the checks of a UNIX
    socket path, plus a writable directory."""
    import os

    from ..frontends.qemu import check_socket_path

    problem = check_socket_path(path)
    if problem is None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.access(parent, os.W_OK | os.X_OK):
            problem = f"cannot create a socket in {parent}: permission denied"
    return problem


def _identity_factory(args: argparse.Namespace):
    """``--name NAME`` and ``--label KEY=VALUE`` (repeatable): a ``Stack`` maker giving the stack that
    name and those labels (``None`` when neither is given). ``ConfigError`` naming ``--name`` or
    ``--label`` for a bad one."""
    import functools

    from ..config.identity import GuestIdentity

    name = getattr(args, "name", None)
    labels: dict[str, str] = {}
    for item in getattr(args, "label", None) or ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError("--label", f"{item!r} is not KEY=VALUE")
        if key in labels:
            raise ConfigError("--label", f"{key!r} given twice")
        labels[key] = value
    if name is None and not labels:
        return None
    try:
        GuestIdentity(name, labels)
    except ConfigError as exc:
        detail = str(exc).split(": ", 1)[-1]
        if exc.field == "name":
            raise ConfigError("--name", detail) from None
        raise ConfigError("--label", f"{exc.field[7:-1]}: {detail}" if exc.field != "labels" else detail) from None
    from ..stack import Stack

    return functools.partial(Stack, name=name, labels=labels or None)


def _events_factory(base, path: str):
    """Wrap the stack factory ``base`` (``None``: :class:`~aioslirp.Stack`) so that every lifecycle
    event of the stack is appended to ``path`` as one JSON line (:class:`~aioslirp.observe.events.EventFile`).
    ``ConfigError`` naming ``--events`` when ``path`` cannot be opened for appending."""
    import contextlib

    out = open_events(path)

    @contextlib.asynccontextmanager
    async def factory(config):
        from ..stack import Stack

        try:
            async with (base or Stack)(config) as stack:
                remove = stack.on_event(out.write)
                try:
                    yield stack
                finally:
                    remove()
        finally:
            out.close()

    return factory


def _stack_factory(args: argparse.Namespace, obs, unused_by: str | None = None):
    """``stack_factory`` for the entry points: the observability's (``obs``: pcap, spans,
    metrics) when active, with ``--publish``/``--api-socket`` served on top when given; else None.

    Parses every ``--publish`` (``ConfigError`` naming ``--publish``); the forwards are bound
    and the API socket listens before the guest starts (a port in use: ``ForwardError``).
    ``unused_by``: the command that takes neither option (``"demo"``): ``ConfigError`` when given.
    """
    from ..config.forward import parse_publish

    base = _identity_factory(args)
    if obs.active:
        base = obs.stack_factory(base)
    forwards = [parse_publish(v, "--publish") for v in args.publish or ()]
    _check_publish_clashes(forwards)
    api_socket = getattr(args, "api_socket", None)
    events = getattr(args, "events", None)
    if events is not None and unused_by is not None:
        raise ConfigError("--events", f"not used by 'aioslirp {unused_by}'")
    if events is not None:
        base = _events_factory(base, events)
    if not forwards and not api_socket:
        return base
    if unused_by is not None:
        raise ConfigError("--publish" if forwards else "--api-socket", f"not used by 'aioslirp {unused_by}'")
    if api_socket is not None and not api_socket.strip():
        raise ConfigError("--api-socket", "empty path")
    if api_socket is not None:
        problem = _api_socket_problem(api_socket)
        if problem:
            raise ConfigError("--api-socket", problem)

    def factory(config):
        from ..frontends.api import serving_stack

        return serving_stack(config, forwards=forwards, api_socket=api_socket, stack_factory=base)

    return factory


def _check_qemu_args(args: argparse.Namespace) -> None:
    """Validate ``aioslirp qemu`` options; raises ConfigError naming the option."""
    from ..frontends.qemu import check_socket_path

    if args.ifname:
        raise ConfigError("--ifname", "not used by 'aioslirp qemu' (the guest's NIC is QEMU's)")
    if args.socket is not None:
        problem = check_socket_path(args.socket)
        if problem:
            raise ConfigError("--socket", problem)
    if args.fd is not None:
        import os
        import stat

        try:
            mode = os.fstat(args.fd).st_mode
        except OSError:
            raise ConfigError("--fd", f"{args.fd} is not an open file descriptor") from None
        if not stat.S_ISSOCK(mode):
            raise ConfigError("--fd", f"{args.fd} is not a socket")


def _ifname(args: argparse.Namespace, positional: str | None) -> str:
    from ..transport.tapdev import TapError, check_ifname

    if args.ifname and positional and args.ifname != positional:
        raise ConfigError("IFNAME", f"{positional!r} conflicts with --ifname {args.ifname!r}")
    name = positional or args.ifname or "tap0"
    try:
        check_ifname(name)
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


#: The loggers of a served VM's comings and goings ("waiting for a QEMU guest on PATH", "guest
#: connected", "front end gone", "stopped after N guest(s)"): at the default log level (warning)
#: they still speak, so that ``aioslirp qemu`` and ``vhost-user`` do not wait in silence.
LIFECYCLE_LOGGERS = ("aioslirp.qemu", "aioslirp.vhost_user", "aioslirp.transport.vhost_user")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"{PROG}: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    if level == "warning":  # the default: a VM's comings and goings too (--log-level error: silent)
        for name in LIFECYCLE_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aioslirp`` command. Returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["slirp4netns"]:  # slirp4netns's own command line, parsed by its module
        return _slirp4netns(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


def _slirp4netns(argv: list[str]) -> int:
    """``aioslirp slirp4netns ARGS``: the drop-in (:mod:`aioslirp.cli.slirp4netns`), with ``ARGS`` as is."""
    from .slirp4netns import main as slirp4netns_main

    return slirp4netns_main(argv)


def _cmd_slirp4netns(args: argparse.Namespace) -> int:
    """The ``slirp4netns`` sub-parser's handler (``main`` hands its argv over before parsing)."""
    return _slirp4netns(args.slirp4netns_args)


def _cmd_trace_report(args: argparse.Namespace) -> int:
    """``aioslirp trace-report FILE``: :func:`aioslirp.cli.trace_report.cli_main`."""
    from .trace_report import cli_main

    return cli_main(args)


def _cmd_run(args: argparse.Namespace) -> int:
    """``aioslirp run [--] [CMD [ARG ...]]``: CMD (default: $SHELL) in a new network namespace; exits
    with its status."""

    def prepare(config, obs):
        stack_factory = _stack_factory(args, obs)
        cmd = list(args.cmd)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        ifname = _ifname(args, None)
        stop_kw = {} if args.stop_timeout is None else {"stop_timeout": args.stop_timeout}

        def start():
            from ..frontends.netns import run_in_namespace

            return run_in_namespace(config, cmd, ifname=ifname, forward_signals=True, stack_factory=stack_factory,
                                    offload=args.offload, **stop_kw)

        return start

    return _serve(args, prepare)


def _cmd_attach(args: argparse.Namespace) -> int:
    """``aioslirp attach (--netns PATH | PID) [IFNAME]``: serve an existing network namespace."""

    def prepare(config, obs):
        stack_factory = _stack_factory(args, obs)
        netns_path, pid, positional_ifname = _attach_target(args)
        ifname = _ifname(args, positional_ifname)

        def start():
            from ..frontends.netns import attach

            return attach(config, netns_path=netns_path, pid=pid, ifname=ifname, handle_signals=True,
                          stack_factory=stack_factory, offload=args.offload)

        return start

    return _serve(args, prepare)


def _cmd_qemu(args: argparse.Namespace) -> int:
    """``aioslirp qemu (--socket PATH [--dgram] [--switch] | --fd N)``: serve QEMU guests."""

    def prepare(config, obs):
        switch = check_switch_args(args, obs)
        if switch:
            _check_publish_clashes([fwd for _guest, fwd in switch["forwards"] or ()])
            _check_qemu_args(args)

            def start_switch():
                from ..frontends.qemu_switch import serve_qemu_switch

                # --trace / --otlp-endpoint: one tracer provider for every guest's stack (their
                # spans carry the guest's name); it exists once obs has started, as here
                return serve_qemu_switch(config, path=args.socket, handle_signals=True,
                                         tracer_provider=obs.tracer_provider, capture=obs.pcap_writer, **switch)

            return start_switch
        stack_factory = _stack_factory(args, obs)
        _check_qemu_args(args)

        def start():
            from ..frontends.qemu import serve_qemu

            return serve_qemu(config, path=args.socket, fd=args.fd, dgram=args.dgram, handle_signals=True,
                              stack_factory=stack_factory)

        return start

    return _serve(args, prepare, socket_errors=True)


def _cmd_vhost_user(args: argparse.Namespace) -> int:
    """``aioslirp vhost-user --socket PATH [--client]``: serve a VM over vhost-user-net."""

    def prepare(config, obs):
        stack_factory = _stack_factory(args, obs)
        _check_vhost_user_args(args)

        def start():
            from ..frontends.vhost_user import serve_vhost_user

            return serve_vhost_user(config, path=args.socket, client=args.client, handle_signals=True,
                                    stack_factory=stack_factory, tx_coalesce=args.tx_coalesce,
                                    tx_defer=args.tx_defer)

        return start

    return _serve(args, prepare, socket_errors=True)


def _check_vhost_user_args(args: argparse.Namespace) -> None:
    """Validate ``aioslirp vhost-user`` options; raises ConfigError naming the option."""
    from ..frontends.qemu import check_socket_path
    from ..native import vhost

    if args.ifname:
        raise ConfigError("--ifname", "not used by 'aioslirp vhost-user' (the guest's NIC is the front end's)")
    if args.tx_coalesce < 0:
        raise ConfigError("--tx-coalesce", f"{args.tx_coalesce} is negative (bytes; 0 turns moderation off)")
    if not 0 <= args.tx_defer <= 1:
        raise ConfigError("--tx-defer", f"{args.tx_defer:g} is not within 0..1 (seconds; 0 turns it off)")
    if vhost.extension() is None:
        raise ConfigError("--socket", f"vhost-user needs the native extension, which is not usable: {vhost.why_not()}")
    if args.client:
        import os

        if not os.path.exists(args.socket):
            return  # the front end may start later: connected to then
        import stat

        if not stat.S_ISSOCK(os.stat(args.socket).st_mode):
            raise ConfigError("--socket", f"{args.socket} exists and is not a socket")
        return
    problem = check_socket_path(args.socket)
    if problem:
        raise ConfigError("--socket", problem)


def _cmd_demo(args: argparse.Namespace) -> int:
    """``aioslirp demo``: the offline demo (:mod:`aioslirp.cli.demo`)."""

    def prepare(config, obs):
        if args.pcap:
            raise ConfigError("--pcap", "not used by 'aioslirp demo'")
        factory = _stack_factory(args, obs, unused_by="demo")

        def start():
            from .demo import demo

            return demo(config, stack_factory=factory)

        return start

    return _serve(args, prepare)


def _serve(args: argparse.Namespace, prepare, *, socket_errors: bool = False) -> int:
    """Run a sub-command that serves a guest; returns the exit status.

    Options -> a validated config and the observability set-up, then ``prepare(config, obs)``
    checks the command's own options and returns ``start()``, which makes the session's
    coroutine. Any :class:`ConfigError` up to there prints one line and returns 2, before
    logging and observability start. The session then runs on uvloop: set-up failures (the
    namespace, the TAP, a port forward, the API socket) print one line and return 1.
    ``socket_errors`` (``qemu``): an ``OSError`` / ``ValueError`` names ``--socket`` / ``--fd``.
    """
    from .observe import Observability

    obs = Observability.from_args(args)
    try:
        config = config_from_args(args)
        obs.check()
        start = prepare(config, obs)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    _setup_logging(args.log_level)
    try:
        obs.start()
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    import asyncio

    from ..frontends.api import ApiSocketError
    from ..host.nsbase import NamespaceError
    from ..nat.forward import ForwardError
    from ..transport.tapdev import TapError

    coro = start()
    try:
        if obs.active:
            # SIGTERM outside the entry points' own handlers: unwind (stack closed, spans flushed).
            signal.signal(signal.SIGTERM, _terminate)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return int(runner.run(coro))
    except (NamespaceError, TapError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except (ForwardError, ApiSocketError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if not socket_errors:
            raise
        where = f"--socket {args.socket}" if args.socket else f"--fd {args.fd}"
        print(f"{PROG}: error: {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        if not socket_errors:
            raise
        print(f"{PROG}: error: --fd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        obs.shutdown()
