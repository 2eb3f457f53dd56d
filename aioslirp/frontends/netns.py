"""Namespace plumbing: ``aioslirp run`` and ``aioslirp attach``.

``run_in_namespace`` is ``aioslirp run``: a thin user of :func:`aioslirp.spawn`
(:mod:`aioslirp.frontends.spawn`) with the CLI's signal handling. Spawn starts a helper process (:mod:`aioslirp.host.nschild`) that creates a
network + mount namespace (plus a user namespace when not root, so it works rootless),
puts a generated resolv.conf over ``/etc/resolv.conf`` there, brings ``lo`` up, creates and
configures a TAP device (address ``config.guest``, default route via ``config.gateway``,
MTU ``config.mtu``) and passes the TAP fd back over a Unix socket. The stack serves that
fd; then the helper is told to go and execs the command. When the command exits the stack
stops and its exit status is returned.

With ``config.ipv6`` (the default) the TAP accepts router advertisements and skips DAD
(:data:`~aioslirp.host.ifconfig.IPV6_SYSCTLS_ON`), so it configures a ``fd00::/64`` address by SLAAC from the
stack's first RA; the helper waits for that address (at most :data:`~aioslirp.host.ifconfig.IPV6_ADDRESS_TIMEOUT`
seconds) before it execs the command, and resolv.conf lists ``config.dns6`` after
``config.dns``. With IPv6 off the TAP has IPv6 disabled.

``attach`` does the same for an existing namespace (like ``slirp4netns --configure``).

Both raise :class:`NamespaceError` (one line, no traceback needed) when setup fails:
no ``/dev/net/tun``, ``/dev/net/tun`` not 0666 for rootless use, user namespaces
disabled, target namespace missing, and so on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
from typing import Any, Callable, Sequence

from ..config import NetworkConfig
from ..host.nsbase import DEFAULT_SETUP_TIMEOUT, NamespaceError, iface_spec, readable, start_helper
from ..host.nschild import tap_reply
from ..host.signals import DEFAULT_STOP_TIMEOUT, GracefulStop, reopen_audit_log, request_stop
from ..transport.tap import TapTransport
from .spawn import spawn

__all__ = [
    "run_in_namespace",
    "attach",
    "exit_status",
]

log = logging.getLogger("aioslirp.netns")


#: Signals ``run`` passes on to the command (a terminal's SIGINT/SIGQUIT reach it directly).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


StackFactory = Callable[[NetworkConfig], Any]


def _hup(stack, send_signal) -> None:  # send_signal(): SIGHUP to the command
    """SIGHUP under ``aioslirp run``: reopen the ``--audit-log`` file, then pass it to the command."""
    try:
        reopen_audit_log(stack)
    finally:
        send_signal()


def _default_stack_factory(config: NetworkConfig):
    from ..stack import Stack

    return Stack(config)


def exit_status(returncode: int) -> int:
    """Shell-style exit status: ``returncode`` for a normal exit, ``128 + N`` for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------------------------
# helper process management (parent side)


class _Helper:
    """One :mod:`aioslirp.host.nschild` process plus our end of its socket pair and its pidfd."""

    def __init__(self, spec: dict) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = dict(spec, ppid=os.getpid())
        try:
            self.proc = start_helper(spec, child_sock.fileno())
        except OSError as exc:
            parent_sock.close()
            raise NamespaceError(f"cannot start the namespace helper ({sys.executable}): {exc.strerror}") from None
        finally:
            child_sock.close()
        self.sock = parent_sock
        self.sock.setblocking(False)
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid)

    async def receive(self, timeout: float) -> tuple[dict, int]:
        """Wait for the helper's reply. Returns ``(info, tap_fd)``; raises :class:`NamespaceError`."""
        try:
            await asyncio.wait_for(readable(self.sock.fileno()), timeout)
        except asyncio.TimeoutError:
            raise NamespaceError(f"namespace helper did not finish setting up within {timeout:g} s") from None
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, 4)
        except OSError as exc:
            raise NamespaceError(f"lost the namespace helper: {exc.strerror}") from None
        msg, fd = tap_reply(data, fds, NamespaceError, "namespace helper")
        if msg is None:
            if data:
                raise NamespaceError("namespace helper sent a malformed reply")
            with contextlib.suppress(asyncio.TimeoutError):
                await self.wait_exit(5.0)
            rc = self.proc.poll()
            how = "was killed" if rc is None else (f"died of signal {-rc}" if rc < 0 else f"exited with status {rc}")
            raise NamespaceError(f"namespace helper {how} before creating the TAP device")
        for warning in msg.get("warnings") or ():
            log.warning("%s", warning)
        return msg, fd

    def go(self, wait_ipv6: bool = False) -> None:
        """Let the helper exec the command (``wait_ipv6``: once the SLAAC address is there)."""
        try:
            self.sock.send(b"g6" if wait_ipv6 else b"g")
        except OSError:
            pass  # it died meanwhile: wait_exit reports its status
        self.sock.close()

    async def wait_exit(self, timeout: float | None = None) -> int:
        """Wait until the helper (or the command it became) exits; returns its ``returncode``."""
        if self.proc.poll() is None:
            await asyncio.wait_for(readable(self.pidfd), timeout)
        return self.proc.wait()

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, sig)

    def cleanup(self) -> None:
        """Kill the helper if still running, reap it, close our fds. Idempotent."""
        if self.proc.poll() is None:
            self.send_signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(5)
        self.sock.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


# --------------------------------------------------------------------------------------------
# public entry points


async def run_in_namespace(
    config: NetworkConfig,
    argv: Sequence[str] | None,
    *,
    ifname: str = "tap0",
    stack_factory: StackFactory | None = None,
    forward_signals: bool = False,
    setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    offload: bool = True,
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
) -> int:
    """Run ``argv`` in a new network namespace whose only uplink is the user-mode stack.

    ``argv`` empty or ``None`` runs ``$SHELL`` (or ``/bin/sh``). ``stack_factory(config)``
    must return an async context manager with ``serve(transport)`` and ``close()``
    (default :class:`aioslirp.stack.Stack`). The command starts only once the stack serves
    the TAP fd. With ``offload`` (the default) the TAP has a virtio-net header and checksum
    and TCP segmentation offload (:class:`~aioslirp.transport.tap.TapTransport`; falls back
    to computed checksums, with a warning, where the kernel refuses offload).
    With ``forward_signals`` (the CLI sets it), SIGTERM/SIGHUP/SIGUSR1/SIGUSR2
    are passed to the command and SIGINT/SIGQUIT are left to it (a terminal sends them to
    the whole process group); this needs the main thread.

    Returns the command's exit status (``128 + N`` when killed by signal N; 127 when not
    found). Raises :class:`aioslirp.errors.ConfigError` for a bad ``config`` and
    :class:`NamespaceError` (one line) when the namespace or TAP cannot be set up. If this
    process dies the command gets SIGKILL (``PR_SET_PDEATHSIG``). With ``forward_signals``, a
    command still running ``stop_timeout`` seconds after SIGTERM (at once after a second
    SIGTERM) has its network stopped, every connection reset, and is killed one second later
    (:class:`~aioslirp.host.signals.GracefulStop`). When the command exits while processes it
    left behind still hold connections through the stack, those are reset (RST) before the
    stack stops, so that none of them waits on a network that is gone.
    """
    config.validate()
    factory = stack_factory or _default_stack_factory
    argv = list(argv or ()) or [os.environ.get("SHELL") or "/bin/sh"]
    loop = asyncio.get_running_loop()
    async with factory(config) as stack:
        guest = None
        pending: list[int] = []  # signals that came before the command ran: passed on once it does

        def send_signal(sig: int) -> None:
            if guest is None:
                pending.append(sig)
            else:
                guest.send_signal(sig)

        installed: list[int] = []
        graceful = GracefulStop(stack, send_signal, stop_timeout)
        try:
            if forward_signals:
                for sig in FORWARDED_SIGNALS:
                    if sig == signal.SIGTERM:
                        loop.add_signal_handler(sig, graceful)
                    elif sig == signal.SIGHUP:  # the command's, and the --audit-log file is reopened
                        loop.add_signal_handler(sig, _hup, stack, functools.partial(send_signal, sig))
                    else:
                        loop.add_signal_handler(sig, send_signal, sig)
                    installed.append(sig)
                for sig in (signal.SIGINT, signal.SIGQUIT):
                    loop.add_signal_handler(sig, lambda: None)
                    installed.append(sig)
            try:
                async with spawn(argv, stack=stack, config=config, pid_namespace=False, setup_timeout=setup_timeout, ifname=ifname,
                                 offload=offload, stop_timeout=stop_timeout) as guest:
                    for sig in pending:
                        guest.send_signal(sig)
                    returncode = await guest.wait()
            except OSError as exc:
                if isinstance(exc, NamespaceError):
                    raise
                # the command could not be executed: one line and the shell's status, as before
                name = argv[0]
                if isinstance(exc, FileNotFoundError):
                    print(f"aioslirp: {name}: command not found" + ("" if name else " (an empty command name)"),
                          file=sys.stderr)
                    returncode = 127
                else:
                    print(f"aioslirp: {name}: {exc.strerror}", file=sys.stderr)
                    returncode = 126
        finally:
            graceful.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)
    return exit_status(returncode)


async def attach(
    config: NetworkConfig,
    *,
    netns_path: str | None = None,
    pid: int | None = None,
    ifname: str = "tap0",
    stack_factory: StackFactory | None = None,
    handle_signals: bool = False,
    setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    offload: bool = True,
    stack=None,
) -> int:
    """Serve an existing network namespace, like ``slirp4netns --configure`` (``aioslirp.attach``).

    Give exactly one of ``netns_path`` (e.g. ``/run/netns/NAME`` or ``/proc/PID/ns/net``)
    or ``pid`` (its network namespace; when not root, also the user namespace owning it).
    ``lo`` is brought up there, and a TAP ``ifname`` is created with address ``config.guest``,
    MTU ``config.mtu`` and a default route via ``config.gateway``; then the stack serves it until cancelled, until
    SIGINT/SIGTERM (with ``handle_signals``), or until process ``pid`` exits. A namespace
    given only by path stays alive while we hold its TAP fd, so it never "goes away".
    ``offload``: as for :func:`run_in_namespace`. ``stack``: serve with this started
    :class:`~aioslirp.Stack` (``async with Stack(config) as stack``), which is not closed at the
    end, instead of one made by ``stack_factory(config)``; so the caller can read
    ``stack.flows()``, ``stack.events()`` and add port forwards while it runs (cancel the task, or
    ``stack.stop()``, to stop).

    Returns 0 on those clean ends. Raises :class:`NamespaceError` (one line) when the
    namespace cannot be entered or the TAP cannot be made, ``ValueError`` for bad arguments.
    """
    if (netns_path is None) == (pid is None):
        raise ValueError("give exactly one of netns_path or pid")
    if pid is not None and pid <= 0:
        raise ValueError(f"invalid pid {pid}")
    config.validate()
    factory = stack_factory or _default_stack_factory
    spec = dict(iface_spec(config, ifname), mode="attach", netns_path=netns_path, pid=pid)
    loop = asyncio.get_running_loop()
    async with (factory(config) if stack is None else contextlib.nullcontext(stack)) as stack:
        # Offload changes what the transport hands its sink (frames plus checksum flags): only
        # for stacks that say they take it (aioslirp.Stack does).
        offload = offload and bool(getattr(stack, "supports_offload", False))
        spec["vnet_hdr"] = offload
        transport = None
        stopping = False
        setup_task = asyncio.current_task()

        def stop() -> None:
            nonlocal stopping
            log.info("signal received; stopping")
            stopping = True
            if transport is None:  # still setting the namespace up: stop waiting for the child
                setup_task.cancel()
                return
            with contextlib.suppress(Exception):
                request_stop(stack)  # serve() resets the guest's flows, then closes the transport
            loop.call_later(2.0, transport.close)  # in any case

        # Installed before the namespace is touched, so that SIGINT/SIGTERM at any moment after
        # the TAP appears in it is a clean stop (exit 0), not death by the signal.
        installed: list[int] = []
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop)
                installed.append(sig)
            loop.add_signal_handler(signal.SIGHUP, reopen_audit_log, stack)  # log rotation
            installed.append(signal.SIGHUP)
        try:
            helper = _Helper(spec)
            fd = None
            try:
                info, fd = await helper.receive(setup_timeout)
                with contextlib.suppress(asyncio.TimeoutError):
                    await helper.wait_exit(5.0)
            except asyncio.CancelledError:
                if not stopping:
                    raise
                setup_task.uncancel()
                if fd is not None:
                    os.close(fd)
                return 0
            finally:
                helper.cleanup()
            transport = TapTransport(fd, ifname=info["ifname"], offload=offload)
            try:
                if pid is not None:
                    transport.watch_pid(pid)
                if stopping:  # a signal between the set-up and now
                    request_stop(stack)
                log.info("serving %s in %s", info["ifname"], netns_path or f"the network namespace of pid {pid}")
                await stack.serve(transport)
            finally:
                transport.close()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
    return 0
