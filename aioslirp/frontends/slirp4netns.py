"""Serving a namespace for RootlessKit and Podman: the process side of the slirp4netns drop-in.

:func:`serve` runs once the namespace child (:mod:`aioslirp.host.nschild`, ``join`` mode) has
handed over the TAP fd: the :class:`~aioslirp.stack.Stack` serves it, the API server
(:mod:`aioslirp.frontends.api`) listens on ``--api-socket``, ``--enable-sandbox`` / ``--enable-seccomp``
lock the process down (:mod:`aioslirp.host.sandbox`), and only then is ``"1"`` written to the
ready fd and the fd closed. It runs until the exit fd (``-e``) reports any event (its peer hung
up: Podman's conmon exited), SIGTERM/SIGINT/SIGHUP, the TAP fails (the namespace is gone) or,
with ``--netns-type=pid``, process PID exits; then flows are reset, host sockets and the API
socket file are removed. The command line is :mod:`aioslirp.cli.slirp4netns`.
"""

from __future__ import annotations

import logging
import os
import signal

from ..host.nschild import SetupError

__all__ = ["SetupError", "serve"]

log = logging.getLogger("aioslirp.slirp4netns")


def _write_ready(fd: int) -> None:
    """The ready byte: ``b"1"`` then close, as slirp4netns does. A gone reader is logged only."""
    try:
        while True:
            try:
                os.write(fd, b"1")
                break
            except InterruptedError:
                continue
    except OSError as exc:
        log.warning("--ready-fd %d: cannot write the ready byte: %s", fd, exc.strerror)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


class _ExitFdWatcher:
    """Calls ``on_event`` once when ``fd`` reports any event (hang-up, EOF, data, error).

    Uses the event loop's reader (epoll reports EPOLLHUP to readers) and, for an fd epoll
    refuses (a regular file), a thread polling it.
    """

    def __init__(self, loop, fd: int, on_event) -> None:
        self.loop = loop
        self.fd = fd
        self.on_event = on_event
        self._reader = False
        self._stop_r = self._stop_w = -1
        try:
            loop.add_reader(fd, self._fire)
            self._reader = True
        except (OSError, ValueError):
            self._start_thread()

    def _fire(self) -> None:
        self.close()
        self.on_event()

    def _start_thread(self) -> None:
        import select
        import threading

        self._stop_r, self._stop_w = os.pipe()

        def run() -> None:
            p = select.poll()
            p.register(self.fd, select.POLLIN | select.POLLHUP)
            p.register(self._stop_r, select.POLLIN)
            while True:
                try:
                    events = p.poll()
                except InterruptedError:
                    continue
                if any(fd == self._stop_r for fd, _ in events):
                    return
                if events:
                    self.loop.call_soon_threadsafe(self._fire)
                    return

        threading.Thread(target=run, name="aioslirp-exit-fd", daemon=True).start()

    def close(self) -> None:
        if self._reader:
            self._reader = False
            self.loop.remove_reader(self.fd)
        if self._stop_w >= 0:
            try:
                os.write(self._stop_w, b"x")
            except OSError:
                pass
            os.close(self._stop_w)
            self._stop_w = -1


async def serve(opts, config, tap_fd: int, ifname: str, *, stack_factory=None) -> int:
    """Serve the TAP ``tap_fd`` until told to stop; returns the exit status (0).

    ``opts`` is the drop-in's :class:`~aioslirp.cli.slirp4netns.Options` (``disable_dns``,
    ``api_socket``, ``pid``, ``enable_sandbox``, ``enable_seccomp``, ``exit_fd``, ``ready_fd``
    are read), ``config`` its validated :class:`~aioslirp.config.NetworkConfig`.

    Order (slirp4netns's): stack started, API socket listening, sandbox and seccomp applied,
    then the ready byte. Stops on an exit-fd event, SIGTERM/SIGINT/SIGHUP, the TAP closing,
    or (``--netns-type=pid``) process PID exiting. Raises :class:`SetupError` when the API
    socket, the sandbox or seccomp cannot be set up (before the ready byte).
    """
    import asyncio

    from ..host.signals import request_stop
    from ..transport.tap import TapTransport

    if stack_factory is None:
        from ..stack import Stack as stack_factory  # noqa: N813

    loop = asyncio.get_running_loop()
    stopped = loop.create_future()

    def stop(reason: str) -> None:
        if not stopped.done():
            log.info("stopping: %s", reason)
            stopped.set_result(reason)

    transport = TapTransport(tap_fd, ifname=ifname)
    installed: list[int] = []
    watcher = None
    api = None
    api_leftover: tuple | None = None  # (dir fd, name, (dev, ino)) to remove the socket from a sandbox
    serve_task = None
    async with stack_factory(config) as stack:
        try:
            if opts.disable_dns:
                dns = getattr(getattr(stack, "parts", None), "dns", None)
                if dns is not None:
                    dns.upstreams_off = True  # every query gets SERVFAIL, none leaves
            if opts.api_socket:
                from .api import ApiServer, ApiSocketError

                api = ApiServer(stack, opts.api_socket)
                try:
                    await api.start()
                except ApiSocketError as exc:
                    api = None
                    raise SetupError(str(exc)) from None
            if opts.pid is not None:
                transport.watch_pid(opts.pid)
            serve_task = asyncio.create_task(stack.serve(transport), name="aioslirp-serve")
            serve_task.add_done_callback(lambda t: stop("the TAP closed (the namespace went away)"))
            await asyncio.sleep(0)  # serve() opens the transport (add_reader) before the ready byte
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.add_signal_handler(sig, stop, signal.Signals(sig).name)
                installed.append(sig)
            if opts.enable_sandbox or opts.enable_seccomp:
                from ..host import sandbox

                try:
                    if opts.enable_seccomp and sandbox.load_libseccomp() is None:
                        raise sandbox.SandboxError("--enable-seccomp: libseccomp.so.2 not found (apt-get install libseccomp2)")
                    if opts.enable_sandbox:
                        if api is not None:
                            api_leftover = _hold_socket_dir(opts.api_socket)
                        visible = sandbox.enter_sandbox()
                        log.info("sandbox: file system limited to %s", ", ".join(visible))
                    if opts.enable_seccomp:
                        blocked = sandbox.enable_seccomp()
                        log.info("seccomp: blocked %s", " ".join(blocked))
                except sandbox.SandboxError as exc:
                    raise SetupError(str(exc)) from None
            if opts.exit_fd is not None:
                watcher = _ExitFdWatcher(loop, opts.exit_fd, lambda: stop("the exit fd hung up"))
            if opts.ready_fd is not None:
                _write_ready(opts.ready_fd)
            await stopped
        finally:
            if watcher is not None:
                watcher.close()
            for sig in installed:
                loop.remove_signal_handler(sig)
            request_stop(stack)
            transport.close()
            if serve_task is not None:
                try:
                    await asyncio.wait_for(serve_task, 2.0)
                except BaseException as exc:  # noqa: BLE001 - logged, shutting down anyway
                    if not isinstance(exc, asyncio.CancelledError):
                        log.debug("serve() ended with %r", exc)
            if api is not None:
                await api.close()
            if api_leftover is not None:
                _remove_held_socket(*api_leftover)
    return 0


def _hold_socket_dir(path: str) -> tuple | None:
    """Before the sandbox hides it: an fd of the API socket's folder, its name and identity."""
    try:
        st = os.stat(path)
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    return fd, os.path.basename(path), (st.st_dev, st.st_ino)


def _remove_held_socket(dir_fd: int, name: str, ident: tuple) -> None:
    """Remove the API socket through the held folder fd, if it is still ours."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(name, dir_fd=dir_fd)
    except OSError as exc:
        log.debug("cannot remove the API socket %s: %s", name, exc)
    finally:
        os.close(dir_fd)
