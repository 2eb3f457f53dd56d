"""``aioslirp.spawn``: run a command in its own network namespace behind its own :class:`~aioslirp.Stack`.

Usage::

    async with aioslirp.spawn(["curl", "-s", "http://10.0.2.2:8000/"], stdout=asyncio.subprocess.PIPE) as guest:
        body = await guest.stdout.read()
        status = await guest.wait()

The command (the *guest*) runs in a new network + mount namespace (plus a user namespace when
not root), and by default a new PID namespace where it is PID 1's only child, so nothing it
leaves behind outlives it. Its only network interface besides ``lo`` is a TAP device (``tap0``)
served by the stack: address ``config.guest`` (10.0.2.15), gateway ``config.gateway``
(10.0.2.2, which is the host's loopback), DNS ``config.dns`` (10.0.2.3, put in its
``/etc/resolv.conf``), and with IPv6 on a SLAAC address in ``fd00::/64``.

The namespace work is done by the one namespace child (:mod:`aioslirp.host.nschild`, ``run``
mode): it creates the namespaces and the TAP, passes the TAP fd back, waits for "go", gets the
command on its socket and then execs it; in a PID namespace it execs the native init instead
(``aioslirp-init``, a small C program installed with the package), which forks PID 1 of the
namespace; that forks the command, passes signals on and reaps orphans. So the processes a guest
costs outside the service are its own plus two small native ones (about 1 MB RSS together, see
docs/library.md); no interpreter. Where the native init was not built, a Python PID 1 does its
work (about 25 MB PSS more per guest; one INFO line says so). :class:`Guest` is that child's
handle, with ``asyncio.subprocess.Process`` semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Mapping, Sequence

from .. import compiled
from ..config import NetworkConfig
from ..host.nsbase import (DEFAULT_SETUP_TIMEOUT, NamespaceError, iface_spec, log_serve_end, readable,
                           resolv_conf_text, start_helper, stop_serving)
from ..host.command import command_records
from ..host.nschild import native_init, tap_reply

__all__ = ["DEFAULT_STOP_TIMEOUT", "Guest", "spawn"]

log = logging.getLogger("aioslirp.spawn")

#: Seconds :func:`spawn` waits after SIGTERM for the guest to exit before SIGKILL, when its block ends.
DEFAULT_STOP_TIMEOUT = 5.0

PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT


class _WriteProtocol(asyncio.streams.FlowControlMixin):
    """The protocol behind ``guest.stdin`` (``drain()`` flow control, ``wait_closed()``)."""

    def __init__(self) -> None:
        super().__init__()
        self._closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def _get_close_waiter(self, stream) -> asyncio.Future:
        return self._closed


class Guest:
    """A command running behind its own stack (made by :func:`spawn`); like ``asyncio.subprocess.Process``.

    Attributes:
        stack: the :class:`~aioslirp.Stack` serving the guest's TAP (``stack.flows()``, ``stack.stats()``,
            ``stack.add_forward()``, ``stack.events()``...).
        pid: the process id (in the host's PID namespace) of the guest's top process: with
            ``pid_namespace`` the native init that passes signals on to the command (or, without one, the
            Python namespace helper), else the command.
        stdin: an ``asyncio.StreamWriter`` when ``stdin=PIPE``, else ``None``.
        stdout, stderr: ``asyncio.StreamReader`` when ``PIPE``, else ``None``.
        ifname: the TAP device's name in the guest's namespace (``"tap0"``).
    """

    def __init__(self, stack, proc: subprocess.Popen, pidfd: int, ifname: str) -> None:
        self.stack = stack
        self.pid: int = proc.pid
        self.ifname = ifname
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._proc = proc
        self._pidfd = pidfd
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future = self._loop.create_future()
        self._pipes: list[asyncio.BaseTransport] = []
        self._loop.add_reader(pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        rc = self._proc.wait()
        if not self._exited.done():
            self._exited.set_result(rc)

    @property
    def returncode(self) -> int | None:
        """The exit status once the guest exited (``-N`` when killed by signal N), else ``None``."""
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        """Wait for the guest to exit; returns :attr:`returncode`. Read ``stdout``/``stderr`` meanwhile
        (or use :meth:`communicate`) when they are pipes, or a guest writing a lot blocks."""
        return await asyncio.shield(self._exited)

    async def communicate(self, input: bytes | None = None) -> tuple[bytes | None, bytes | None]:
        """Write ``input`` to stdin (then close it), read stdout and stderr to EOF, wait for the exit.
        Returns ``(stdout, stderr)``, ``None`` for those that are not pipes."""

        async def feed() -> None:
            if self.stdin is not None:
                if input:
                    self.stdin.write(input)
                    with contextlib.suppress(ConnectionError):
                        await self.stdin.drain()
                self.stdin.close()

        async def read(stream):
            return None if stream is None else await stream.read()

        _, out, err = await asyncio.gather(feed(), read(self.stdout), read(self.stderr))
        await self.wait()
        return out, err

    def send_signal(self, sig: int) -> None:
        """Send signal ``sig`` to the guest (with ``pid_namespace``, passed on to the command by its
        helper and PID 1; SIGKILL kills the whole PID namespace). No-op once it exited."""
        if self._exited.done() or self._pidfd < 0:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        """Send SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL."""
        self.send_signal(signal.SIGKILL)

    @property
    def exited(self) -> asyncio.Future:
        """A future that completes with the exit status when the guest exits (do not cancel it)."""
        return self._exited

    def adopt_pipe(self, transport: asyncio.BaseTransport) -> None:
        """Own the pipe ``transport`` of a stdin/stdout/stderr stream: closed by :meth:`release`."""
        self._pipes.append(transport)

    async def reap(self, timeout: float = 5.0) -> None:
        """SIGKILL the top process through its ``Popen`` and wait for it (in a thread, at most
        ``timeout`` seconds): for a guest that outlived :meth:`kill`."""
        with contextlib.suppress(Exception):
            self._proc.kill()
            await asyncio.to_thread(self._proc.wait, timeout)

    def release(self) -> None:
        """Close the guest's pipes and its pidfd (after it exited, or when giving up on it). Idempotent."""
        for tr in self._pipes:
            tr.close()
        self._pipes.clear()
        if self._pidfd >= 0:
            if not self._exited.done():
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1


def _check_argv(argv) -> list[str]:
    if isinstance(argv, (str, bytes, bytearray)):
        raise TypeError(f"argv must be a sequence of str, e.g. [{argv!r}], not {type(argv).__name__}")
    try:
        out = list(argv)
    except TypeError:
        raise TypeError(f"argv must be a sequence of str, not {type(argv).__name__}") from None
    if not out:
        raise ValueError("argv is empty: give the command to run, e.g. ['sh']")
    for a in out:
        if not isinstance(a, (str, os.PathLike)):
            raise TypeError(f"argv items must be str, got {type(a).__name__} ({a!r})")
    out = [os.fsdecode(os.fspath(a)) for a in out]
    for a in out:
        if "\0" in a:
            raise ValueError(f"argv items hold no NUL character, got {a!r}")
    return out


def _child_end(spec: Any, name: str, is_input: bool) -> tuple[Any, int | None]:
    """``(what Popen gets, our end of a pipe or None)`` for a stdin/stdout/stderr argument."""
    if spec is None or spec == DEVNULL or (spec == STDOUT and name == "stderr"):
        return spec, None
    if spec == PIPE:
        r, w = os.pipe2(os.O_CLOEXEC)
        return (r, w) if is_input else (w, r)
    if isinstance(spec, int) and spec >= 0 or hasattr(spec, "fileno"):
        return spec, None
    raise ValueError(f"{name} must be None, PIPE, DEVNULL, a file descriptor or a file object, not {spec!r}")


class _Spawn:
    """The async context manager :func:`spawn` returns."""

    def __init__(self, argv: list[str], config, stack, stdio, env, cwd, pid_namespace, stop_timeout, setup_timeout,
                 ifname, offload) -> None:
        self.argv, self.config, self.stack, self.stdio = argv, config, stack, stdio
        self.env, self.cwd, self.pid_namespace = env, cwd, pid_namespace
        self.stop_timeout, self.setup_timeout, self.ifname, self.offload = stop_timeout, setup_timeout, ifname, offload
        self.name, self.labels = None, None  # the made stack's identity (spawn()'s name= and labels=)
        self.guest: Guest | None = None
        self._own_stack = False
        self._serve_task: asyncio.Task | None = None
        self._transport = None
        self._sock: socket.socket | None = None

    async def __aenter__(self) -> Guest:
        try:
            return await self._start()
        except BaseException:
            await self._stop()
            raise

    async def __aexit__(self, *exc) -> None:
        await self._stop()

    async def _start(self) -> Guest:
        from ..transport.tap import TapTransport

        if self.stack is None:
            from ..stack import Stack

            self.stack = Stack(self.config, name=self.name, labels=self.labels)
            self._own_stack = True
            await self.stack.start()
        stack = self.stack
        config = self.config if self.config is not None else stack.config
        offload = self.offload and bool(getattr(stack, "supports_offload", False))
        init = native_init() if self.pid_namespace else None
        if self.pid_namespace and init is None:
            log.info("no native init (aioslirp-init not built, or %s set): a Python PID 1 runs beside the guest",
                     compiled.ENV)
        spec = dict(iface_spec(config, self.ifname), mode="run", resolv_conf=resolv_conf_text(config),
                    pid_namespace=bool(self.pid_namespace), init=init, vnet_hdr=offload)
        loop = asyncio.get_running_loop()
        ours: list[int] = []
        theirs: list[Any] = []
        for name, value, is_input in (("stdin", self.stdio[0], True), ("stdout", self.stdio[1], False),
                                      ("stderr", self.stdio[2], False)):
            child, mine = _child_end(value, name, is_input)
            theirs.append(child)
            ours.append(mine)
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = parent_sock
        spec = dict(spec, ppid=os.getpid())
        try:
            proc = start_helper(spec, child_sock.fileno(), stdin=theirs[0], stdout=theirs[1], stderr=theirs[2])
        except OSError as exc:
            for fd in ours:
                if fd is not None:
                    os.close(fd)
            raise NamespaceError(f"cannot start the namespace helper ({sys.executable}): {exc.strerror}") from None
        finally:
            child_sock.close()
            for child, mine in zip(theirs, ours):
                if mine is not None:
                    os.close(child)
        guest = self.guest = Guest(stack, proc, os.pidfd_open(proc.pid), self.ifname)
        for i, fd in enumerate(ours):
            if fd is None:
                continue
            if i == 0:
                wtr, proto = await loop.connect_write_pipe(_WriteProtocol, open(fd, "wb", 0))
                guest.stdin = asyncio.StreamWriter(wtr, proto, None, loop)
                guest.adopt_pipe(wtr)
            else:
                reader = asyncio.StreamReader(loop=loop)
                rtr, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), open(fd, "rb", 0))
                guest.adopt_pipe(rtr)
                setattr(guest, "stdout" if i == 1 else "stderr", reader)
        parent_sock.setblocking(False)
        info, fd = await self._receive(parent_sock, guest)
        transport = self._transport = TapTransport(fd, ifname=info["ifname"], offload=offload)
        guest.ifname = info["ifname"]
        self._serve_task = asyncio.create_task(stack.serve(transport))
        self._serve_task.add_done_callback(log_serve_end)
        await asyncio.sleep(0)  # serve() opens the transport (add_reader) before the command starts
        if self._serve_task.done():  # the transport could not be served (e.g. a TAP that is down)
            self._serve_task.result()
        wait_ipv6 = bool(config.ipv6) and getattr(getattr(stack, "parts", None), "v6", None) is not None
        await self._send_command(parent_sock, b"g6" if wait_ipv6 else b"g")
        await self._exec_result(parent_sock)
        return guest

    async def _send_command(self, sock: socket.socket, go: bytes) -> None:
        """Send "go", then the command (argv, env, cwd) in records: through the socket, never a
        command line or an environment. A helper gone meanwhile: its exit status tells."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.setup_timeout):
                for record in [go] + command_records(self.argv, self.env, self.cwd):
                    await loop.sock_sendall(sock, record)
        except (OSError, asyncio.TimeoutError):
            pass

    async def _receive(self, sock: socket.socket, guest: Guest) -> tuple[dict, int]:
        waiter = asyncio.ensure_future(readable(sock.fileno()))
        try:
            done, _ = await asyncio.wait([waiter, guest.exited], timeout=self.setup_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not done:
            raise NamespaceError(f"namespace helper did not finish setting up within {self.setup_timeout:g} s")
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 4)
        except BlockingIOError:
            data, fds = b"", []
        except OSError as exc:
            raise NamespaceError(f"lost the namespace helper: {exc.strerror}") from None
        msg, fd = tap_reply(data, fds, NamespaceError, "namespace helper")
        if msg is None:
            rc = await guest.wait()
            how = f"died of signal {-rc}" if rc < 0 else f"exited with status {rc}"
            raise NamespaceError(f"namespace helper {how} before creating the TAP device")
        for warning in msg.get("warnings") or ():
            log.warning("%s", warning)
        return msg, fd

    async def _exec_result(self, sock: socket.socket) -> None:
        """EOF on the socket: the command was executed (close-on-exec); a message: it could not be."""
        try:
            await asyncio.wait_for(readable(sock.fileno()), self.setup_timeout)
            data = sock.recv(65536)
        except (asyncio.TimeoutError, OSError):
            return  # it is running (or gone): wait() tells
        finally:
            sock.close()
            self._sock = None
        if not data:
            return
        with contextlib.suppress(ValueError):
            msg = json.loads(data)
            err = int(msg.get("exec_error") or 0)
            await self.guest.wait()
            raise OSError(err, os.strerror(err), self.cwd if msg.get("cwd") else self.argv[0])

    async def _stop(self) -> None:
        guest, stack = self.guest, self.stack
        try:
            if guest is not None and guest.returncode is None:
                guest.terminate()
                try:
                    await asyncio.wait_for(guest.wait(), self.stop_timeout)
                except asyncio.TimeoutError:
                    guest.kill()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(guest.wait(), 5.0)
            transport = self._transport
            if self._serve_task is not None and transport is not None:
                if getattr(getattr(stack, "parts", None), "flows", None) and not transport.closed.done():
                    # processes left in the namespace (pid_namespace=False) may hold connections:
                    # reset them while the link is up, so none hangs on a stack that is gone
                    with contextlib.suppress(Exception):
                        await stack.farewell()
                await stop_serving(stack, self._serve_task, transport)
            elif transport is not None:
                transport.close()
        finally:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if guest is not None:
                if guest.returncode is None:  # not even SIGKILL helped: reap it in a thread
                    await guest.reap()
                guest.release()
            if self._own_stack:
                await stack.aclose()


def spawn(
    argv: Sequence[str],
    *,
    config: NetworkConfig | None = None,
    stack=None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    pid_namespace: bool = True,
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    ifname: str = "tap0",
    offload: bool = True,
    name: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> _Spawn:
    """Run ``argv`` in a new network namespace behind its own stack: ``async with spawn(argv) as guest:``.

    Args:
        argv: the command and its arguments, a sequence of ``str`` (looked up in ``PATH``).
        config: the :class:`~aioslirp.NetworkConfig` of a stack made for this guest (default
            ``NetworkConfig()``). With ``stack``: what the guest's interface is configured with
            (default ``stack.config``); it should be the stack's.
        stack: serve the guest with this started :class:`~aioslirp.Stack` (``async with Stack(...)``)
            instead of a new one; it is not closed at the end (its serving is: one guest per serve).
        stdin: ``None`` (inherit ours), ``asyncio.subprocess.PIPE`` (``guest.stdin`` is a
            ``StreamWriter``), ``asyncio.subprocess.DEVNULL``, a file descriptor or a file object.
        stdout: as ``stdin`` (with ``PIPE``, ``guest.stdout`` is a ``StreamReader``).
        stderr: as ``stdout``; ``asyncio.subprocess.STDOUT`` too.
        env: the command's whole environment (default: ours).
        cwd: its working directory.
        pid_namespace: make the command the only child of PID 1 of a new PID namespace (its
            ``/proc`` mounted there when allowed), so that everything it starts dies with it.
        stop_timeout: seconds between SIGTERM and SIGKILL when the block ends with the guest running.
        setup_timeout: seconds the namespace and the TAP may take.
        ifname: the TAP device's name.
        offload: a TAP with checksum/segmentation offload.
        name, labels: the guest's identity, given to the stack made for it (``Stack(name=...,
            labels=...)``: its audit records, spans, events and log lines carry them); not with ``stack``.

    Returns an async context manager whose ``__aenter__`` returns a :class:`Guest` once the
    command was executed (its network is up; the IPv6 address, with ``config.ipv6``, too).
    Leaving the block terminates the guest (SIGTERM, then SIGKILL after ``stop_timeout``),
    resets its remaining connections and stops the stack: no fd, task or process is left.

    Raises:
        TypeError: at once, when ``argv`` is a ``str``/``bytes`` or holds a non-string.
        ValueError: at once, for an empty ``argv``, a bad stdio argument, a NUL character in ``argv``,
            ``env`` or ``cwd``, or an ``env`` name that is empty or holds ``=``.
        aioslirp.ConfigError: at once, for an invalid ``config``, ``name`` or ``labels`` (or
            ``name``/``labels`` given with ``stack``).
        NamespaceError: on entering, with one line naming the cause and the fix, when the
            namespace or the TAP cannot be made (no user namespaces, no ``/dev/net/tun``...).
        FileNotFoundError, PermissionError (``OSError``): on entering, when the command (or ``cwd``)
            cannot be executed, as ``asyncio.create_subprocess_exec`` does.
    """
    args = _check_argv(argv)
    if stack is None or config is not None:
        config = (config if config is not None else NetworkConfig()).validate()
    for which, value in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
        if value == STDOUT and which != "stderr":
            raise ValueError(f"{which}=STDOUT is only valid for stderr")
    if name is not None or labels is not None:
        from ..config.identity import GuestIdentity
        from ..errors import ConfigError

        if stack is not None:
            raise ConfigError("name" if name is not None else "labels",
                              "given with stack=: give them to that Stack(name=..., labels=...)")
        GuestIdentity(name, labels)  # a bad one: ConfigError now, not on entering
    env_items = None if env is None else {str(k): str(v) for k, v in env.items()}
    for key, value in (env_items or {}).items():
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"env: illegal environment variable name {key!r}")
        if "\0" in value:
            raise ValueError(f"env: the value of {key} holds a NUL character")
    cwd_path = None if cwd is None else os.fspath(cwd)
    if isinstance(cwd_path, bytes):
        cwd_path = os.fsdecode(cwd_path)
    if cwd_path is not None and "\0" in cwd_path:
        raise ValueError("cwd holds a NUL character")
    sp = _Spawn(args, config, stack, (stdin, stdout, stderr), env_items, cwd_path, pid_namespace, float(stop_timeout),
                float(setup_timeout), ifname, offload)
    sp.name, sp.labels = name, labels
    return sp
