"""A drop-in for the ``slirp4netns`` binary: ``aioslirp-slirp4netns`` / ``aioslirp slirp4netns``.

RootlessKit (``--net=slirp4netns --slirp4netns-binary=PATH``) and Podman
(``network_cmd_path`` in containers.conf) start a ``slirp4netns`` binary with a fixed
command line and a few inherited file descriptors. This module speaks that interface
(slirp4netns 1.2's options, its ready/exit fd protocol and its JSON API socket) and
serves the namespace with :class:`aioslirp.Stack`.

Theory of operation
-------------------
The process has two jobs in two network namespaces: the TAP device must be opened
*inside* the target namespace, while every host socket (NAT flows, DNS, port forwards,
the API socket) must be created in the namespace we were started in (the host's).
A network namespace is per thread, but joining a *user* namespace (RootlessKit's case:
``/proc/PID/ns/user`` before ``/proc/PID/ns/net``) needs a single-threaded process, so,
like slirp4netns, we fork a short-lived child at start-up, before any thread or event
loop exists:

1. **child** (:mod:`aioslirp.host.nschild`, ``join`` mode, the same child as ``aioslirp run``
   and ``attach`` use): ``PR_SET_PDEATHSIG``; ``setns`` into the user namespace
   (``--netns-type=pid``: ``/proc/PID/ns/user``; or ``--userns-path``; skipped when it is
   already ours) and then the network namespace (``/proc/PID/ns/net`` or the PATH given);
   open TAPNAME with ``TUNSETIFF`` (``IFF_TAP|IFF_NO_PI``), which attaches to a TAP the
   caller created or creates it; with ``-c``: ``lo`` up, MAC (``--macaddress``), MTU,
   address CIDR+100 with the CIDR's prefix, link up, default route via CIDR+2. The TAP fd
   goes to the parent over a ``SOCK_SEQPACKET`` pair (``SCM_RIGHTS``) with a one-line JSON
   status, and the child exits.
2. **parent**, meanwhile still in the host's namespaces, imports the stack (this overlaps
   with the child's work), receives the fd, reaps the child and runs the event loop: the
   :class:`~aioslirp.stack.Stack` serves the TAP (:func:`aioslirp.frontends.slirp4netns.serve`);
   the API server (:mod:`aioslirp.frontends.api`) listens on ``--api-socket``; ``--enable-sandbox`` /
   ``--enable-seccomp`` lock the process down (:mod:`aioslirp.host.sandbox`); only then is
   ``"1"`` written to the ready fd and the fd closed.
3. It runs until the exit fd (``-e``) reports any event (its peer hung up: Podman's
   conmon exited), SIGTERM/SIGINT/SIGHUP, the TAP fails (the namespace is gone) or, with
   ``--netns-type=pid``, process PID exits. Then flows are reset, host sockets and the
   API socket file are removed and the process exits 0. Set-up failures print one line
   and exit 1 *before* the ready byte, which both clients report; bad options print one
   line naming the option and exit 2.

Option by option (what aioslirp does with each) is in ``docs/slirp4netns.md`` and
:data:`HELP`. This module parses the command line and runs the three steps; the child and the
serving are host plumbing (:mod:`aioslirp.host.nschild`, :mod:`aioslirp.frontends.slirp4netns`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import stat
import sys
from typing import Sequence

__all__ = ["Options", "UsageError", "SetupError", "parse_args", "build_config", "HELP", "PROG", "main"]

PROG = "aioslirp-slirp4netns"

log = logging.getLogger("aioslirp.slirp4netns")

#: slirp4netns's offsets from the network address: gateway, DNS, recommended guest address.
GATEWAY_OFFSET, DNS_OFFSET, GUEST_OFFSET = 2, 3, 100
#: Prefix lengths slirp4netns accepts for ``--cidr`` (CIDR+100 must stay inside the network).
CIDR_PREFIX_RANGE = (1, 25)
#: MTU range the stack supports (slirp4netns: 1-65521; both clients pass 1500-65520).
MTU_RANGE = (576, 65520)

# The option names below are an API: RootlessKit and Podman run ``--help`` and look for them.
HELP = f"""\
Usage: {PROG} [OPTION]... PID|PATH TAPNAME
User-mode networking for a network namespace, with the command line, ready/exit fd
protocol and API socket of slirp4netns 1.2 (for RootlessKit and Podman). The network
stack is aioslirp: the namespace reaches the host and the Internet through ordinary
host sockets, no root needed.

-c, --configure          set TAPNAME up: address CIDR+100 (10.0.2.100/24), the MTU, a
                         default route via CIDR+2 (10.0.2.2), and lo up
-e, --exit-fd=FD         exit as soon as FD reports an event (its peer hung up)
-r, --ready-fd=FD        write "1" to FD and close it once the TAP is attached (and
                         configured) and the API socket listens
-m, --mtu=MTU            MTU of the link (default 1500, {MTU_RANGE[0]}-{MTU_RANGE[1]})
-6, --enable-ipv6        serve IPv6 too: prefix fd00::/64 (router advertisements for
                         SLAAC), gateway and host loopback fd00::2, DNS fd00::3; with
                         -c the TAP accepts the advertisements (no DAD delay)
-a, --api-socket=PATH    serve the JSON API on this UNIX socket (add_hostfwd,
                         list_hostfwd, remove_hostfwd, get_stats, list_flows)
--cidr=CIDR              IPv4 network (default 10.0.2.0/24, prefix /1-/25); gateway and
                         host loopback CIDR+2, DNS CIDR+3, guest CIDR+100
--disable-host-loopback  prohibit connecting to 127.0.0.1:* on the host through the
                         gateway address
--netns-type=TYPE        what PID|PATH is: pid (default; joins /proc/PID/ns/user, then
                         /proc/PID/ns/net), path (a network namespace file), tapfd (an
                         open TAP fd number; TAPNAME optional)
--userns-path=PATH       user namespace to join before the network namespace
--enable-sandbox         once set up: a new mount namespace with only /etc, /run and the
                         Python runtime (read-only), all capabilities dropped except
                         CAP_NET_BIND_SERVICE, no_new_privs
--enable-seccomp         once set up: a seccomp filter makes dangerous system calls
                         (execve, mount, ptrace, setns, unshare, kexec, ...) fail with EPERM
--outbound-addr=IPv4     not supported: refused (exit status 2)
--outbound-addr6=IPv6    not supported: refused (exit status 2)
--disable-dns            do not forward DNS queries to CIDR+3 (they get SERVFAIL)
--macaddress=MAC         MAC address of TAPNAME (only with -c)
--target-type=TYPE       netns (default); bess is not supported
--log-level=LEVEL        (aioslirp) debug, info, warning (default) or error, on stderr
--rate-limit=up=RATE,down=RATE
                         (aioslirp) cap the guest's traffic each way, e.g. up=10mbit,down=2MB:
                         TCP paced without loss, UDP over the cap dropped
--audit-log=FILE         (aioslirp) one JSON line per flow at its end to FILE ('-': stderr);
                         a renamed FILE is reopened at the next write
-h, --help               show this help and exit
-v, --version            show version and exit

Exit status: 0 after the exit fd hung up, SIGTERM/SIGINT/SIGHUP, or the namespace went
away; 1 when the namespace or TAP cannot be set up (before the ready byte); 2 for bad
options (one line naming the option).
"""

_LOG_LEVELS = ("debug", "info", "warning", "error")


class UsageError(ValueError):
    """A bad command line. ``str(err)`` is one line naming the option; exit status 2."""

    def __init__(self, option: str, message: str) -> None:
        self.option = option
        super().__init__(f"{option}: {message}")


def __getattr__(name):
    """``SetupError`` and ``serve`` (:mod:`aioslirp.host`), imported on first use (PEP 562): ``--help``,
    which RootlessKit and Podman run before every start, needs neither."""
    if name == "SetupError":
        from ..host.nschild import SetupError as value
    elif name == "serve":
        from ..frontends.slirp4netns import serve as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


class _Info(Exception):
    """``--help`` / ``--version``: print ``text`` to stdout and exit 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


@dataclasses.dataclass
class Options:
    """The parsed command line (slirp4netns's option names).

    ``target`` is the PID (``netns_type == "pid"``), the namespace file (``"path"``) or
    the TAP fd number (``"tapfd"``) as a string; ``pid`` is set for ``"pid"``, ``tap_fd``
    for ``"tapfd"``. ``mtu`` is in bytes; fds are ``None`` when not given.
    """

    target: str
    tapname: str | None
    netns_type: str = "pid"
    pid: int | None = None
    tap_fd: int | None = None
    userns_path: str | None = None
    configure: bool = False
    mtu: int = 1500
    cidr: str = "10.0.2.0/24"
    disable_host_loopback: bool = False
    enable_ipv6: bool = False
    ready_fd: int | None = None
    exit_fd: int | None = None
    api_socket: str | None = None
    enable_sandbox: bool = False
    enable_seccomp: bool = False
    disable_dns: bool = False
    macaddress: str | None = None
    log_level: str = "warning"
    #: (aioslirp) ``--rate-limit``: bytes/s each way, ``None``: no cap.
    rate_up: float | None = None
    rate_down: float | None = None
    #: (aioslirp) ``--audit-log`` path.
    audit_log: str | None = None
    #: Extra positional arguments (ignored with a warning, as slirp4netns does).
    extra_args: list = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------ argv


def _parser():
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            # argparse says "argument -r/--ready-fd: expected one argument" or
            # "unrecognized arguments: --foo": name the option first, like our other errors.
            if message.startswith("argument "):
                names, _, why = message[len("argument "):].partition(": ")
                longs = [n for n in names.split("/") if n.startswith("--")]
                raise UsageError(longs[0] if longs else names, why)
            if message.startswith("unrecognized arguments: "):
                first = message.split(": ", 1)[1].split()[0]
                raise UsageError(first, f"unknown option (see {PROG} --help)")
            raise UsageError("usage", message)

    class InfoAction(argparse.Action):
        def __init__(self, option_strings, dest, text_fn, **kw):
            super().__init__(option_strings, dest, nargs=0, **kw)
            self.text_fn = text_fn

        def __call__(self, parser, namespace, values, option_string=None):
            raise _Info(self.text_fn())

    p = Parser(prog=PROG, add_help=False, allow_abbrev=False)
    p.add_argument("-h", "--help", action=InfoAction, text_fn=lambda: HELP)
    p.add_argument("-v", "--version", action=InfoAction, text_fn=_version_text)
    p.add_argument("-c", "--configure", action="store_true")
    p.add_argument("-e", "--exit-fd")
    p.add_argument("-r", "--ready-fd")
    p.add_argument("-m", "--mtu")
    p.add_argument("-6", "--enable-ipv6", action="store_true")
    p.add_argument("-a", "--api-socket")
    p.add_argument("--cidr")
    p.add_argument("--disable-host-loopback", "--no-host-loopback", dest="disable_host_loopback", action="store_true")
    p.add_argument("--netns-type")
    p.add_argument("--userns-path")
    p.add_argument("--enable-sandbox", "--create-sandbox", dest="enable_sandbox", action="store_true")
    p.add_argument("--enable-seccomp", action="store_true")
    p.add_argument("--outbound-addr")
    p.add_argument("--outbound-addr6")
    p.add_argument("--disable-dns", action="store_true")
    p.add_argument("--macaddress")
    p.add_argument("--target-type")
    p.add_argument("--log-level")
    p.add_argument("--rate-limit")
    p.add_argument("--audit-log")
    p.add_argument("positional", nargs="*")
    return p


def _version_text() -> str:
    from .. import __version__

    return (
        f"{PROG} version {__version__}\n"
        f"aioslirp: {__version__}\n"
        "command line and API: slirp4netns 1.2 compatible (IPv4)\n"
    )


def _fd(option: str, text: str) -> int:
    try:
        fd = int(text, 10)
    except ValueError:
        raise UsageError(option, f"{text!r} is not a file descriptor number") from None
    if fd < 0:
        raise UsageError(option, f"{fd} is not a file descriptor number (must be >= 0)")
    return fd


def _mac(text: str) -> str:
    parts = text.split(":")
    try:
        if len(parts) != 6 or not all(1 <= len(p) <= 2 for p in parts):
            raise ValueError
        raw = bytes(int(p, 16) for p in parts)
    except ValueError:
        raise UsageError("--macaddress", f"{text!r} is not a MAC address (six hex bytes separated by ':')") from None
    if raw[0] & 1:
        raise UsageError("--macaddress", f"{text!r} is a multicast address")
    return ":".join(f"{b:02x}" for b in raw)


def parse_args(argv: Sequence[str]) -> Options:
    """Parse slirp4netns's command line (``argv`` without the program name).

    Short options may be glued (``-r3``) or separate (``-r 3``); long ones take ``=`` or a
    separate value. Returns :class:`Options`. Raises :class:`UsageError` (one line naming
    the option) for anything invalid, and the internal ``_Info`` for ``--help`` /
    ``--version`` (``main`` prints its text and exits 0). Only syntax and values are
    checked here, not whether the fds or paths exist (see :func:`check_environment`).
    """
    ns = _parser().parse_intermixed_args(list(argv))
    if ns.target_type not in (None, "netns"):
        if ns.target_type == "bess":
            raise UsageError("--target-type", "bess is not supported by aioslirp (only netns)")
        raise UsageError("--target-type", f"{ns.target_type!r} must be netns or bess")
    if ns.outbound_addr is not None:
        raise UsageError(
            "--outbound-addr",
            "not supported by aioslirp: host sockets would not be bound to the address asked for",
        )
    if ns.outbound_addr6 is not None:
        raise UsageError(
            "--outbound-addr6",
            "not supported by aioslirp: host sockets would not be bound to the address asked for",
        )
    netns_type = ns.netns_type or "pid"
    if netns_type not in ("pid", "path", "tapfd"):
        raise UsageError("--netns-type", f"{netns_type!r} must be pid, path or tapfd")
    pos = list(ns.positional)
    if not pos:
        what = {"pid": "PID", "path": "PATH", "tapfd": "TAPFD"}[netns_type]
        raise UsageError(what, f"missing: usage is {PROG} [OPTION]... PID|PATH TAPNAME (see --help)")
    target = pos[0]
    opts = Options(target=target, tapname=None, netns_type=netns_type)
    if netns_type == "pid":
        try:
            opts.pid = int(target, 10)
        except ValueError:
            opts.pid = -1
        if opts.pid <= 0:
            raise UsageError("PID", f"{target!r} is not a positive process id (use --netns-type=path for a file)")
    elif netns_type == "tapfd":
        opts.tap_fd = _fd("TAPFD", target)
    elif not target:
        raise UsageError("PATH", "empty network namespace path")
    if netns_type == "tapfd":
        opts.tapname = pos[1] if len(pos) > 1 else None
        opts.extra_args = pos[2:]
    else:
        if len(pos) < 2:
            raise UsageError("TAPNAME", f"missing: usage is {PROG} [OPTION]... PID|PATH TAPNAME (see --help)")
        opts.tapname = pos[1]
        opts.extra_args = pos[2:]
    if opts.tapname is not None:
        from ..transport.tapdev import TapError, check_ifname

        try:
            check_ifname(opts.tapname)
        except TapError as exc:
            raise UsageError("TAPNAME", str(exc)) from None
    if ns.userns_path is not None:
        if netns_type == "tapfd":
            raise UsageError("--userns-path", "has no meaning with --netns-type=tapfd")
        if not ns.userns_path:
            raise UsageError("--userns-path", "empty path")
        opts.userns_path = ns.userns_path
    opts.configure = bool(ns.configure)
    if opts.configure and netns_type == "tapfd":
        raise UsageError("--configure", "cannot configure a TAP given by fd (--netns-type=tapfd)")
    if ns.mtu is not None:
        try:
            mtu = int(ns.mtu, 10)
        except ValueError:
            raise UsageError("--mtu", f"{ns.mtu!r} is not a number") from None
        if not MTU_RANGE[0] <= mtu <= MTU_RANGE[1]:
            raise UsageError("--mtu", f"{mtu} is out of range {MTU_RANGE[0]}-{MTU_RANGE[1]}")
        opts.mtu = mtu
    if ns.cidr is not None:
        try:
            net = ipaddress.IPv4Network(ns.cidr, strict=True)
        except ipaddress.NetmaskValueError:
            raise UsageError("--cidr", f"{ns.cidr!r} has an invalid prefix length") from None
        except ValueError as exc:
            if "host bits set" in str(exc):
                raise UsageError(
                    "--cidr", f"{ns.cidr!r} must be a network address such as 10.0.2.0/24, not a host address"
                ) from None
            raise UsageError("--cidr", f"{ns.cidr!r} is not an IPv4 network (like 10.0.2.0/24)") from None
        if "/" not in ns.cidr or not CIDR_PREFIX_RANGE[0] <= net.prefixlen <= CIDR_PREFIX_RANGE[1]:
            raise UsageError(
                "--cidr", f"{ns.cidr!r}: the prefix length must be {CIDR_PREFIX_RANGE[0]}-{CIDR_PREFIX_RANGE[1]}"
            )
        opts.cidr = str(net)
    opts.disable_host_loopback = bool(ns.disable_host_loopback)
    opts.enable_ipv6 = bool(ns.enable_ipv6)
    if ns.ready_fd is not None:
        opts.ready_fd = _fd("--ready-fd", ns.ready_fd)
    if ns.exit_fd is not None:
        opts.exit_fd = _fd("--exit-fd", ns.exit_fd)
    if opts.ready_fd is not None and opts.ready_fd == opts.exit_fd:
        raise UsageError("--ready-fd", f"fd {opts.ready_fd} is also the --exit-fd")
    if ns.api_socket is not None:
        path = ns.api_socket
        if not path:
            raise UsageError("--api-socket", "empty path")
        if len(os.fsencode(path)) > 107:
            raise UsageError("--api-socket", f"{path}: longer than the 107 bytes a UNIX socket path can hold")
        opts.api_socket = path
    opts.enable_sandbox = bool(ns.enable_sandbox)
    opts.enable_seccomp = bool(ns.enable_seccomp)
    opts.disable_dns = bool(ns.disable_dns)
    if ns.macaddress is not None:
        if not opts.configure:
            raise UsageError("--macaddress", "only valid with -c/--configure")
        opts.macaddress = _mac(ns.macaddress)
    if ns.log_level is not None:
        level = ns.log_level.lower()
        if level not in _LOG_LEVELS:
            raise UsageError("--log-level", f"{ns.log_level!r} is not one of {', '.join(_LOG_LEVELS)}")
        opts.log_level = level
    if ns.rate_limit is not None:
        from ..config.rates import parse_rate_limit
        from ..errors import ConfigError

        try:
            rates = parse_rate_limit(ns.rate_limit, "--rate-limit")
        except ConfigError as exc:
            raise UsageError("--rate-limit", str(exc).split(": ", 1)[-1]) from None
        opts.rate_up, opts.rate_down = rates.get("rate_up"), rates.get("rate_down")
    if ns.audit_log is not None:
        if not ns.audit_log:
            raise UsageError("--audit-log", "empty path")
        opts.audit_log = ns.audit_log
    return opts


def check_environment(opts: Options) -> None:
    """Check what the command line refers to before anything starts.

    The fds (``--ready-fd``, ``--exit-fd``, TAPFD) must be open, the namespace file and
    ``--userns-path`` must exist. Raises :class:`UsageError` naming the option.
    """
    for option, fd in (("--ready-fd", opts.ready_fd), ("--exit-fd", opts.exit_fd), ("TAPFD", opts.tap_fd)):
        if fd is None:
            continue
        try:
            os.fstat(fd)
        except OSError:
            raise UsageError(option, f"{fd} is not an open file descriptor") from None
    if opts.audit_log is not None and opts.audit_log != "-":
        try:
            with open(opts.audit_log, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise UsageError("--audit-log", f"cannot write {opts.audit_log!r}: {exc.strerror}") from None
    if opts.netns_type == "path" and not os.path.exists(opts.target):
        raise UsageError("PATH", f"{opts.target}: no such network namespace file")
    if opts.userns_path is not None and not os.path.exists(opts.userns_path):
        raise UsageError("--userns-path", f"{opts.userns_path}: no such file")


def build_config(opts: Options):
    """The :class:`~aioslirp.config.NetworkConfig` slirp4netns's options describe.

    Network ``--cidr`` (default 10.0.2.0/24), gateway CIDR+2, DNS CIDR+3 and guest CIDR+100
    (the ``-c`` address, the first DHCP lease and the default ``guest_addr`` of
    ``add_hostfwd``), ``--mtu``, ``--disable-host-loopback``. Raises
    :class:`UsageError` when the stack refuses a value.
    """
    from ..config import NetworkConfig
    from ..errors import ConfigError

    net = ipaddress.IPv4Network(opts.cidr)
    base = net.network_address
    config = NetworkConfig(
        cidr=str(net),
        gateway=str(base + GATEWAY_OFFSET),
        dns=str(base + DNS_OFFSET),
        guest=str(base + GUEST_OFFSET),
        mtu=opts.mtu,
        disable_host_loopback=opts.disable_host_loopback,
        ipv6=opts.enable_ipv6,  # slirp4netns's IPv6 defaults: fd00::/64, gateway ::2, DNS ::3
        rate_up=opts.rate_up,
        rate_down=opts.rate_down,
        audit_log=opts.audit_log,
    )
    try:
        return config.validate()
    except ConfigError as exc:
        option = {"cidr": "--cidr", "mtu": "--mtu"}.get(exc.field, "--cidr")
        raise UsageError(option, str(exc).split(": ", 1)[-1]) from None


# ------------------------------------------------------------------------------ main


def _child_spec(opts: Options, config) -> dict:
    """The ``join`` spec of :mod:`aioslirp.host.nschild` for ``opts``: the namespaces to join
    (``--netns-type=pid``: ``/proc/PID/ns/user`` unless ``--userns-path``, then
    ``/proc/PID/ns/net``; ``path``: the file, and ``--userns-path`` when given), TAPNAME, and
    with ``-c`` what to configure (address CIDR+100, gateway CIDR+2, MTU, ``-6``, MAC)."""
    if opts.netns_type == "pid":
        netns_path = f"/proc/{opts.pid}/ns/net"
        userns_path = opts.userns_path or f"/proc/{opts.pid}/ns/user"
    else:
        netns_path = opts.target
        userns_path = opts.userns_path
    return {
        "mode": "join",
        "netns_path": netns_path,
        "userns_path": userns_path,
        "userns_required": opts.userns_path is not None,
        "pid": opts.pid,
        "ifname": opts.tapname,
        # A virtio-net header on the TAP we create: checksum and TCP segmentation offload, as for
        # `aioslirp run`/`attach` (TapTransport detects it; AIOSLIRP_NO_OFFLOAD=1 for plain frames).
        "vnet_hdr": os.environ.get("AIOSLIRP_NO_OFFLOAD", "") in ("", "0"),
        "configure": opts.configure,
        "address": str(config.guest),
        "prefixlen": config.cidr.prefixlen,
        "gateway": str(config.gateway),
        "mtu": config.mtu,
        "ipv6": bool(config.ipv6),
        "mac": opts.macaddress,
    }


def _banner(opts: Options, config) -> str:
    lines = [
        "Starting aioslirp (slirp4netns-compatible)",
        f"* MTU:             {config.mtu}",
        f"* Network:         {config.cidr.network_address}",
        f"* Netmask:         {config.cidr.netmask}",
        f"* Gateway:         {config.gateway}",
        f"* DNS:             {config.dns}" + (" (disabled)" if opts.disable_dns else ""),
        f"* Recommended IP:  {config.guest}",
    ]
    if config.ipv6:
        lines += [
            f"* IPv6 prefix:     {config.cidr6} (SLAAC)",
            f"* IPv6 gateway:    {config.gateway6}",
            f"* IPv6 DNS:        {config.dns6}" + (" (disabled)" if opts.disable_dns else ""),
        ]
    if opts.api_socket:
        lines.append(f"* API Socket:      {opts.api_socket}")
    if opts.macaddress:
        lines.append(f"* MAC address:     {opts.macaddress}")
    if not opts.disable_host_loopback:
        lines.append(
            f"WARNING: 127.0.0.1:* on the host is accessible as {config.gateway} "
            "(set --disable-host-loopback to prohibit connecting to 127.0.0.1:*)"
        )
    return "\n".join(lines) + "\n"


def _loop_factory():
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aioslirp-slirp4netns`` (and ``aioslirp slirp4netns``).

    Returns the exit status for ``--help``/``--version``, bad options (2) and set-up
    failures (1). Once the network has been served the process ends with ``os._exit``
    (status 0) right after the clean-up, without the interpreter's teardown.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = parse_args(args)
        check_environment(opts)
        config = build_config(opts)
    except _Info as info:
        sys.stdout.write(info.text)
        sys.stdout.flush()
        return 0
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, opts.log_level.upper()),
        format=f"{PROG}: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    if opts.extra_args:
        log.warning("ignoring extra arguments: %s", " ".join(opts.extra_args))

    # 1. the TAP, from a child in the target namespaces (the parent stays in the host's)
    from ..frontends.slirp4netns import serve
    from ..host.nschild import ForkedChild, SetupError

    child = None
    if opts.netns_type == "tapfd":
        tap_fd, ifname = opts.tap_fd, opts.tapname or f"fd{opts.tap_fd}"
        try:
            if not stat.S_ISCHR(os.fstat(tap_fd).st_mode):
                raise UsageError("TAPFD", f"fd {tap_fd} is not a TAP device")
        except UsageError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            child = ForkedChild(_child_spec(opts, config))
        except OSError as exc:
            print(f"{PROG}: error: cannot fork the namespace child: {exc.strerror}", file=sys.stderr)
            return 1
    # 2. meanwhile: the stack's imports
    import asyncio

    from ..stack import Stack  # noqa: F401 - imported while the child works

    try:
        if child is not None:
            tap_fd, ifname, warnings = child.result()
            for w in warnings:
                log.warning("%s", w)
    except SetupError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(_banner(opts, config))
    sys.stdout.flush()
    # 3. serve
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            status = int(runner.run(serve(opts, config, tap_fd, ifname)))
        # Everything is closed and the API socket is gone: skip the interpreter's teardown
        # (tens of ms for the stack's modules), clients wait for the exit.
        for flush in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
            try:
                flush()
            except (OSError, ValueError):
                pass  # the reader of our output is gone: nothing left to tell it
        os._exit(status)
    except SetupError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled inside
        return 130
    except Exception as exc:  # a bug of ours: still one line for the client's error message
        log.debug("internal error", exc_info=True)
        print(f"{PROG}: error: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
