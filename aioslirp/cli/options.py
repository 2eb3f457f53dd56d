"""The ``aioslirp`` command line's shared parts: help texts, value parsers and the options every
command that serves a guest takes (network, egress policy and limits, observability), as one
parent parser (:func:`common_options`). :mod:`aioslirp.cli.main` builds the sub-commands on it."""

from __future__ import annotations

import argparse

from ..errors import ConfigError

__all__ = ["check_switch_args", "common_options", "open_events"]

PROG = "aioslirp"

_LOG_LEVELS = ("debug", "info", "warning", "error")

_DESCRIPTION = """\
User-mode networking for network namespaces, without root: a process in its own network
namespace gets connectivity through a TAP device whose frames an asyncio stack NATs onto
ordinary host sockets (the job of slirp4netns and pasta).

Inside, the network looks like QEMU's user networking: the namespace has 10.0.2.15/24,
the gateway 10.0.2.2 (which also reaches the host's 127.0.0.1 unless
--disable-host-loopback), and the DNS server 10.0.2.3 (forwarding to the host's resolvers
or to --dns). IPv6 likewise: an fd00::/64 address by SLAAC, gateway fd00::2 (the host's
::1), DNS fd00::3 (--no-ipv6 turns IPv6 off).
"""

_RUN_EPILOG = """\
examples:
  aioslirp run                                  an interactive shell with its own network
  aioslirp run -- curl -sI https://example.org  one command; exits with its status
  aioslirp run --mtu 65520 -- iperf3 -c 10.0.2.2
                                                10.0.2.2 is the host's loopback
  aioslirp run --dns 9.9.9.9 --dns-search corp.example -- sh
  aioslirp run -p 8080:80 -p 5353:53/udp -- python3 -m http.server 80
                                                host 127.0.0.1:8080 -> the command's port 80
  aioslirp run --api-socket /tmp/ns.sock -- sh  add/list/remove forwards at run time

Rootless use needs unprivileged user namespaces and /dev/net/tun readable and writable
by you (mode 0666, the usual distribution default). Inside, you appear as root (uid 0)
in a new user namespace; /etc/resolv.conf shows the virtual DNS server, the host's file
is untouched.
"""

_QEMU_EPILOG = """\
examples:
  aioslirp qemu --socket /tmp/vm1.sock &
  qemu-system-x86_64 ... -netdev stream,id=n0,server=off,addr.type=unix,addr.path=/tmp/vm1.sock \\
                         -device virtio-net-pci,netdev=n0

  aioslirp qemu --dgram --socket /tmp/vm1.sock &
  qemu-system-x86_64 ... -netdev dgram,id=n0,local.type=unix,local.path=/tmp/vm1-qemu.sock,\\
                         remote.type=unix,remote.path=/tmp/vm1.sock -device virtio-net-pci,netdev=n0

The guest sees QEMU's user-networking layout: DHCP gives 10.0.2.15/24, the gateway
10.0.2.2 reaches the host's 127.0.0.1, the DNS server is 10.0.2.3; IPv6 by SLAAC in
fd00::/64, gateway fd00::2 (the host's ::1), DNS fd00::3. One guest at a time: a
second stream connection is closed at once (logged), datagrams from a second sender are
dropped (logged). After a guest leaves, its flows are torn down and the next one is
served. SIGINT/SIGTERM stop it (exit 0) and remove the socket. With --fd (stream or
datagram socket, detected), serving ends when that guest leaves.

Many guests on one network (--switch, stream sockets only): every QEMU that connects
joins one virtual switch as a new guest with a stack of its own: 10.0.2.15, 10.0.2.16,
... by DHCP, named vm1, vm2, ... (--name PREFIX) and vm1.aioslirp.internal in the other
guests' DNS (A, and AAAA of the SLAAC address the switch learns from the guest's traffic).
Guests reach each other on the subnet and the host through the gateway.
With --switch, -p/--publish names its guest: [HOST_IP:]HOST_PORT:GUEST:GUEST_PORT, GUEST
a guest's name (vm1, a --lease NAME) or IPv4 address (e.g. -p 8080:vm1:80); it listens
while that guest is on the switch. --events FILE takes every guest's events (each with
its guest_name); --pcap FILE captures the network as the switch sees it, each frame once.
Give every VM its own MAC:
  aioslirp qemu --socket /tmp/vms.sock --switch &
  qemu-system-x86_64 ... -netdev stream,id=n0,server=off,addr.type=unix,addr.path=/tmp/vms.sock \
                         -device virtio-net-pci,netdev=n0,mac=52:54:00:12:34:01
  qemu-system-x86_64 ... (the same socket) -device virtio-net-pci,netdev=n0,mac=52:54:00:12:34:02
"""

_VHOST_USER_EPILOG = """\
examples:
  aioslirp vhost-user --socket /tmp/vm1.sock &
  qemu-system-x86_64 ... -chardev socket,id=c0,path=/tmp/vm1.sock \\
      -netdev vhost-user,id=n0,chardev=c0 -device virtio-net-pci,netdev=n0 \\
      -object memory-backend-memfd,id=mem0,size=1G,share=on -machine memory-backend=mem0

  cloud-hypervisor ... --memory size=1G,shared=on --net vhost_user=true,socket=/tmp/vm1.sock

The guest's memory must be shared (memfd, share=on). With --client the front end listens
(QEMU -chardev socket,...,server=on) and aioslirp connects, again whenever it goes. One
front end at a time; when it leaves, its guest's flows are torn down and the next one is
served. The guest sees the same network as with 'aioslirp qemu'. SIGINT/SIGTERM stop it.
"""

_ATTACH_EPILOG = """\
examples:
  unshare -rn sleep infinity &                  a rootless namespace, then:
  aioslirp attach $!                            serve it through a TAP named tap0
  sudo ip netns add ns1
  sudo aioslirp attach --netns /run/netns/ns1 eth0

Like slirp4netns --configure: lo is brought up, the TAP gets 10.0.2.15/24 (see --cidr),
the MTU and a default route via 10.0.2.2. aioslirp serves until SIGINT/SIGTERM or until process PID
exits. Use a namespace's /etc/resolv.conf with nameserver 10.0.2.3 for DNS.
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _fd_number(text: str) -> int:
    try:
        fd = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file descriptor number") from None
    if fd < 0:
        raise argparse.ArgumentTypeError(f"{fd} is not a file descriptor number")
    return fd


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _byte_count(text: str) -> int:
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in ("K", "M", "G") else ""
    try:
        n = int(float(value[: len(value) - len(unit)]) * _BYTE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1000000, 100M, 2G)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return n


def _log_level(text: str) -> str:
    value = text.lower()
    if value not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(_LOG_LEVELS)}")
    return value


def common_options() -> argparse.ArgumentParser:
    """The parent parser (``add_help=False``) of ``run``, ``attach`` and ``qemu``: their network,
    egress-policy/limits and observability options."""
    common = argparse.ArgumentParser(add_help=False)
    net = common.add_argument_group("network options")
    net.add_argument("--mtu", type=int, metavar="BYTES", help="MTU of the guest link, 576-65520 (default 1500)")
    net.add_argument("--cidr", metavar="CIDR", help="IPv4 network of the guest link (default 10.0.2.0/24)")
    net.add_argument(
        "--ipv6",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve IPv6 (default on): the guest configures itself by SLAAC in --cidr6, gateway PREFIX::2 "
        "(reaches the host's ::1), DNS PREFIX::3; --no-ipv6 turns it off (needed for --mtu below 1280)",
    )
    net.add_argument("--cidr6", metavar="PREFIX", help="IPv6 /64 prefix of the guest link (default fd00::/64)")
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
    net.add_argument(
        "--dns-record", action="append", metavar="NAME=ADDR",
        help="answer NAME with ADDR in the virtual DNS (repeatable; A for IPv4, AAAA for IPv6; never sent "
        "upstream, not subject to --deny/--egress-default; default host.aioslirp.internal=the gateway)",
    )
    net.add_argument("--ifname", metavar="NAME", help="name of the TAP device in the namespace (default tap0)")
    net.add_argument(
        "-p",
        "--publish",
        action="append",
        metavar="[HOST_IP:]HOST_PORT:[GUEST_IP:]GUEST_PORT[/tcp|udp]",
        help="forward a host port into the guest (repeatable; HOST_IP defaults to 127.0.0.1, GUEST_IP to the "
        "guest's address; IPv6 in brackets: [::1]:8080:[fd00::100]:80; protocol tcp by default); with "
        "'qemu --switch': [HOST_IP:]HOST_PORT:GUEST:GUEST_PORT, GUEST a guest's name or IPv4 address (8080:vm1:80)",
    )
    sec = common.add_argument_group("egress policy and limits (see docs/security.md)")
    sec.add_argument(
        "--deny",
        action="append",
        metavar="RULE",
        help="refuse guest traffic to RULE = TARGET[:PORTS][/tcp|udp], TARGET a CIDR (host-side address; the "
        "gateway's is 127.0.0.1 / ::1), a name (pypi.org) or a wildcard (*.example.org); e.g. pypi.org:443, "
        "10.0.0.0/8:8000-8999/tcp, [fd00::/8]:53/udp (repeatable; ICMP 'administratively prohibited', DNS "
        "NXDOMAIN for a denied name); 169.254.0.0/16, fe80::/10 and fd00:ec2::254 (cloud metadata) are denied "
        "by default",
    )
    sec.add_argument(
        "--allow",
        action="append",
        metavar="RULE",
        help="allow RULE (as --deny; repeatable); the most specific rule wins (docs/security.md), e.g. "
        "--egress-default deny --allow pypi.org:443 --allow '*.githubusercontent.com', or "
        "--allow 169.254.169.254/32 to reach a metadata service",
    )
    sec.add_argument(
        "--egress-default",
        choices=("allow", "deny"),
        default=None,
        help="verdict for traffic no rule decides (default allow); under deny only names and addresses "
        "an --allow rule matches are reachable and resolvable",
    )
    sec.add_argument(
        "--limit",
        action="append",
        metavar="NAME=VALUE",
        help="set a resource bound (repeatable): max_flows, max_tcp_flows, max_udp_flows, max_icmp_flows, "
        "max_pending_connects, new_flow_rate (per second, 0: off), new_flow_burst, dns_max_inflight, "
        "tcp_idle_timeout (s, 0: off), udp_idle_timeout, icmp_idle_timeout, tcp_connect_timeout, tcp_linger, "
        "inject_queue_size, tcp_buffer, reassembly_max_datagrams, reassembly_max_fragments, "
        "reassembly_max_bytes, reassembly_timeout (s; IPv4 and IPv6 fragment reassembly, each family)",
    )
    sec.add_argument(
        "--rate-limit",
        metavar="up=RATE,down=RATE",
        help="cap the guest's traffic each way (either or both; e.g. up=10mbit,down=2MB; units B, kB, MB, GB, "
        "KiB, MiB, GiB, bit, kbit, mbit, gbit, per second): TCP is paced without loss, UDP datagrams over the cap "
        "are dropped (drop.rate_limit_up/down); bursts up to 64 KiB or 10 ms of the rate",
    )
    sec.add_argument(
        "--upstream-proxy",
        metavar="URL",
        help="send the guest's TCP flows through an upstream proxy: http://HOST:PORT (CONNECT) or "
        "socks5://HOST:PORT; credentials from AIOSLIRP_PROXY_USER / AIOSLIRP_PROXY_PASSWORD (or USER:PASSWORD@ in "
        "the URL), never from the guest. A flow the proxy refuses is reset. See docs/handlers.md",
    )
    sec.add_argument(
        "--no-proxy",
        metavar="LIST",
        help="destinations that bypass --upstream-proxy: names (example.com, .example.com), addresses, CIDRs, "
        "each optionally :PORT, or '*'; comma-separated (default: the NO_PROXY environment variable)",
    )
    sec.add_argument(
        "--verify-sni",
        action="store_true",
        default=None,
        help="a TCP flow a name rule (--allow NAME) let through must name an allowed name bound to its address "
        "in its TLS ClientHello (SNI) or in each HTTP/1 request's Host, else it is reset (egress.sni_denied); its "
        "handshake is answered before the host connect",
    )
    sec.add_argument(
        "--audit-log",
        metavar="FILE",
        help="append one JSON line per flow at its end (and per denial, per DNS decision) to FILE ('-': "
        "stderr); SIGHUP or a renamed FILE reopens it (logrotate). Format: docs/audit.md",
    )
    obs = common.add_argument_group("observability")
    obs.add_argument(
        "--name",
        metavar="NAME",
        help="the guest's name (printable, up to 64 characters), carried by its audit records (guest_name), "
        "spans (aioslirp.guest.name), events, list_flows and log lines ([NAME] first)",
    )
    obs.add_argument(
        "--label",
        action="append",
        metavar="KEY=VALUE",
        help="a label of the guest (repeatable, up to 32; KEY an attribute name, VALUE up to 256 characters), "
        "carried as --name is (labels, aioslirp.guest.label.KEY)",
    )
    obs.add_argument("--pcap", metavar="FILE", help="write every frame both ways to a pcap file (tshark, tcpdump, dpkt)")
    obs.add_argument(
        "--pcap-max-bytes", type=_byte_count, metavar="BYTES", help="stop capturing when the pcap file reaches BYTES (e.g. 100M)"
    )
    obs.add_argument(
        "--events",
        metavar="FILE",
        help="append the stack's lifecycle events to FILE as JSON lines: ready, guest_link_up, guest_link_down, "
        "error (gvproxy's Ready, ConnectionEstablished, ConnectionClosed, HypervisorError)",
    )
    obs.add_argument(
        "--api-socket",
        metavar="PATH",
        help="serve the slirp4netns-compatible control API on a Unix socket (add_hostfwd, list_hostfwd, "
        "remove_hostfwd, get_stats, list_flows; egress rules: add_rule, remove_rule, list_rules)",
    )
    obs.add_argument(
        "--trace", metavar="FILE", help="record OpenTelemetry spans as JSON lines in FILE (see 'aioslirp trace-report')"
    )
    obs.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export spans and metrics over OTLP/HTTP to URL, e.g. http://127.0.0.1:4318 (Jaeger, OpenTelemetry "
        "Collector, Tempo; OTEL_* variables apply; needs the otlp extra)",
    )
    obs.add_argument(
        "--trace-level",
        choices=("flows", "timeline", "frames"),
        default=None,
        help="what --trace/--otlp-endpoint record (docs/observability.md, 'Trace levels'): flows (default) one "
        "span per NAT flow, nothing per frame; timeline also the TCP timeline as the flow spans' events (what "
        "'aioslirp trace-report' breaks into stages); frames also a span per guest frame and per write to the "
        "guest (process_guest_frame, drain_to_guest, writer_wake), several spans per packet",
    )
    obs.add_argument(
        "--log-level", type=_log_level, default="warning", metavar="LEVEL",
        help="debug, info, warning (default; qemu and vhost-user also say when they wait for, see and lose a "
        "guest) or error"
    )
    return common


def open_events(path: str):
    """``--events FILE`` opened for appending (:class:`~aioslirp.observe.events.EventFile`);
    ``ConfigError`` naming ``--events`` when it cannot be."""
    from ..observe.events import EventFile

    if not path.strip():
        raise ConfigError("--events", "empty path")
    try:
        return EventFile(path)
    except OSError as exc:
        raise ConfigError("--events", f"cannot open {path}: {exc.strerror}") from None


def check_switch_args(args: argparse.Namespace, obs) -> dict:
    """``aioslirp qemu --switch``: its options (ConfigError naming the option) -> the keywords of
    :func:`~aioslirp.frontends.qemu_switch.serve_qemu_switch` beyond the config and path."""
    from ..config.records import check_name
    from ..frontends.qemu_switch import DEFAULT_MAX_GUESTS, DEFAULT_NAME_PREFIX

    if not args.switch:
        for option, given in (("--max-guests", args.max_guests is not None), ("--lease", args.lease)):
            if given:
                raise ConfigError(option, "only with --switch")
        return {}
    if args.socket is None:
        raise ConfigError("--switch", "needs --socket PATH (every QEMU connecting there joins the network)")
    if args.dgram:
        raise ConfigError("--switch", "serves -netdev stream guests only: drop --dgram")
    if getattr(args, "api_socket", None):
        raise ConfigError("--api-socket", "not used with --switch yet: its commands speak for one stack, and a "
                                          "switch's (guests, their forwards) need a design of their own")
    max_guests = DEFAULT_MAX_GUESTS if args.max_guests is None else args.max_guests
    if max_guests < 1:
        raise ConfigError("--max-guests", f"{max_guests}: must be at least 1")
    prefix = DEFAULT_NAME_PREFIX if args.name is None else args.name
    try:
        check_name(f"{prefix}1", "--name")
    except ConfigError:
        raise ConfigError("--name", f"{prefix!r}: with --switch a prefix of DNS names (letters, digits, -)") from None
    if "." in prefix:
        raise ConfigError("--name", f"{prefix!r}: with --switch a prefix of one DNS label (no dots)")
    labels: dict[str, str] = {}
    for item in getattr(args, "label", None) or ():
        key, eq, value = item.partition("=")
        if not eq or not key or key in labels:
            raise ConfigError("--label", f"{item!r} is not KEY=VALUE (once per KEY)")
        labels[key] = value
    from ..frontends.qemu_switch import parse_lease

    leases: dict[bytes, tuple[str, str | None]] = {}
    for item in args.lease or ():
        mac, address, name = parse_lease(item)
        if mac in leases:
            raise ConfigError("--lease", f"{item!r}: that MAC has a lease already")
        if name is not None and ("." in check_name(name, "--lease")):
            raise ConfigError("--lease", f"{item!r}: NAME is one DNS label (no dots)")
        leases[mac] = (address, name)
    from ..config.forward import parse_guest_publish

    forwards = [parse_guest_publish(item, "--publish") for item in args.publish or ()]
    names = {n.lower() for _address, n in leases.values() if n is not None}
    for item, (guest, _fwd) in zip(args.publish or (), forwards):
        numbered = guest.startswith(prefix.lower()) and guest[len(prefix):].isdigit()
        if not (numbered or guest in names or guest[:1].isdigit()):
            raise ConfigError("--publish", f"{item!r}: {guest!r} names no guest (they are {prefix}1, {prefix}2, ... "
                                           "or a --lease NAME)")
    events = getattr(args, "events", None)
    return {"max_guests": max_guests, "name_prefix": prefix, "labels": labels or None, "leases": leases or None,
            "forwards": forwards or None, "events": None if events is None else open_events(events)}
