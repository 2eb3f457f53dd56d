"""The namespace/TAP child: one helper process for ``aioslirp run``, ``aioslirp attach`` and
the slirp4netns drop-in (internal).

Theory of operation
-------------------
The TAP device must be created *inside* the guest's network namespace, while every host socket
of the stack stays in ours; joining a user namespace needs a single-threaded process. So a
short-lived child does the namespace work and passes the TAP fd back over one end of an
``AF_UNIX``/``SOCK_SEQPACKET`` socket pair (``SCM_RIGHTS``). :func:`run_child` is its whole
body, whatever started it; ``spec`` (a JSON-able dict) says what to do:

``run`` mode: new network + mount namespace (plus a user namespace mapping our uid/gid to
0 when not root), ``/`` made rprivate, a generated resolv.conf bind-mounted over
``/etc/resolv.conf``, ``lo`` up, the TAP created and configured; the TAP fd is sent to the
parent, then the helper waits for ``b"g"`` ("go"); ``b"g6"`` means "go once the TAP has its
SLAAC address in ``prefix6``" (bounded wait). After "go" the parent sends the command (argv,
env, cwd: :func:`~aioslirp.host.command.command_records`) on the socket, which the helper keeps (close-on-exec) until
the command's exec, so that the parent sees EOF once the command runs; when it cannot be
executed the parent gets ``{"exec_error": ERRNO, "cwd": BOOL}`` instead. Without
``spec["pid_namespace"]`` the helper reads the command and execs it. With it, the ``unshare``
also makes a PID namespace and the helper execs the native init ``spec["init"]``
(``aioslirp-init SOCK_FD``, built from ``aioslirp/native/init.c``: :func:`native_init`), which
reads the command, forks PID 1 (which mounts its ``/proc`` when allowed, forks the command,
passes signals on, reaps orphans, and exits with the command, killing everything left in the
namespace) and ends as the command ended: after the set-up no Python process stays alive for
the guest. Where there is no native init (``spec["init"]`` is ``None``) or it cannot be
executed, the helper does the same in Python (:func:`_run_in_pid_namespace`), staying alive with
its forked PID 1.

``attach`` mode: enter an existing network namespace (and its owning user namespace when
not root), bring ``lo`` up (as ``slirp4netns --configure`` does; a failure is a warning),
create and configure the TAP, send the fd, exit 0.

``join`` mode (the slirp4netns drop-in, :mod:`aioslirp.cli.slirp4netns`): ``setns`` into the
user namespace ``userns_path`` (``/proc/PID/ns/user`` for ``--netns-type=pid``, or
``--userns-path``; skipped when it is already ours; a failure is a warning unless it was given
explicitly), then the network namespace ``netns_path``; open TAP ``ifname`` (``TUNSETIFF``:
attach to a TAP the caller created, or create it), with a virtio-net header when ``vnet_hdr``
and plain frames where the TAP refuses one; with ``configure`` (``-c``): ``lo`` up, the MAC,
the IPv6 sysctls, the MTU, the address and the default route. Send the fd, exit 0.

Two ways to start it, one body:

* **spawned** (``run``, ``attach``; :mod:`aioslirp.frontends.spawn`, :mod:`aioslirp.frontends.netns`):
  ``python -c`` running :func:`main` with two inherited fd numbers, the socket's and that of a
  pipe carrying the spec as JSON (read to its end and closed first): the spec (resolv.conf, the
  interface; the command comes on the socket) is never on a command line or in an environment,
  where every user of the host could read it. The parent already runs an event loop (and maybe threads), and
  ``run`` must exec the command afterwards;
* **forked** (``join``; :class:`ForkedChild`): ``os.fork`` at the drop-in's start-up, before
  any thread or event loop exists, so that the parent imports the stack meanwhile.

Messages to the parent are single JSON objects, one per datagram:
``{"ok": true, "ifname": NAME, "warnings": [...]}`` with the TAP fd attached (SCM_RIGHTS), or
``{"ok": false, "error": ONE_LINE}``.

This module imports only the standard library and :mod:`aioslirp` helpers (pyroute2 lazily).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import socket
import sys
from typing import Callable

from .. import compiled
from .isolate import CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWUSER, map_ids, set_loopback_up, unshare
from .command import Command, read_command

CLONE_NEWPID = 0x20000000

__all__ = ["ForkedChild", "INIT_ENV", "INIT_NAME", "SetupError", "main", "native_init", "run_child", "set_pdeathsig",
           "setns", "tap_reply"]

_libc = ctypes.CDLL(None, use_errno=True)

PR_SET_PDEATHSIG = 1
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
NS_GET_USERNS = 0xB701
RESOLV_CONF = "/etc/resolv.conf"
#: Seconds a forked child may take to open (and configure) the TAP.
SETUP_TIMEOUT = 30.0
#: The native init's file name: setup.py builds it beside this module (``aioslirp/native/init.c``).
INIT_NAME = "aioslirp-init"
#: The environment variable naming a native init to use instead (e.g. one a distribution installs elsewhere).
INIT_ENV = "AIOSLIRP_INIT"


class SetupError(RuntimeError):
    """A set-up step failed (the namespace, the TAP; for the slirp4netns drop-in also the API
    socket or the sandbox); ``str()`` is the one line shown to the user."""


def _errno_call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def set_pdeathsig(expected_ppid: int | None) -> None:
    """Get SIGKILL when the parent dies; exit at once if it already has (not checked when
    ``expected_ppid`` is ``None``: PID 1 of a new PID namespace sees its parent as 0)."""
    _errno_call(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if expected_ppid is not None and os.getppid() != expected_ppid:
        os._exit(1)


def native_init() -> str | None:
    """The path of the native init that ``run`` mode execs with a PID namespace: ``$AIOSLIRP_INIT``
    when set, else :data:`INIT_NAME` beside this module (built by setup.py). ``None`` when it is
    not an executable file, or when ``AIOSLIRP_NO_EXTENSIONS`` is set (as for the compiled
    modules): then a Python PID 1 stays alive per guest."""
    if compiled.disabled():
        return None
    path = os.environ.get(INIT_ENV) or os.path.join(os.path.dirname(os.path.abspath(__file__)), INIT_NAME)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def setns(fd: int, nstype: int) -> None:
    """``setns(2)`` through libc; raises ``OSError``."""
    _errno_call(_libc.setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    """``mount(2)`` through libc (no data argument); raises ``OSError``."""
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _errno_call(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), None), f"mount {target}")


def _enter_new_namespaces(pid_namespace: bool = False) -> None:
    """unshare net+mount (and user when not root; and PID for our children with ``pid_namespace``)
    and map our ids to root."""
    pid_flag = CLONE_NEWPID if pid_namespace else 0
    if os.geteuid() == 0:
        try:
            unshare(CLONE_NEWNET | CLONE_NEWNS | pid_flag)
        except OSError as exc:
            raise SetupError(f"cannot create network/mount{'/PID' if pid_flag else ''} namespaces: "
                             f"{os.strerror(exc.errno or 0)}") from None
        return
    uid, gid = os.geteuid(), os.getegid()
    try:
        unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | pid_flag)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise SetupError(
                "cannot create a user namespace (Operation not permitted): unprivileged user namespaces are "
                "disabled or restricted on this system (check sysctl user.max_user_namespaces, "
                "kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns)"
            ) from None
        if exc.errno == errno.ENOSPC:
            raise SetupError("cannot create a user namespace: limit reached (sysctl user.max_user_namespaces)") from None
        raise SetupError(f"cannot create user/network namespaces: {os.strerror(exc.errno or 0)}") from None
    try:
        map_ids(uid, gid, to_root=True)
    except OSError as exc:
        raise SetupError(f"cannot map uid/gid in the new user namespace: {exc.strerror}") from None


def _install_resolv_conf(content: str, warnings: list[str]) -> None:
    """Make ``/`` rprivate and bind a generated file over /etc/resolv.conf (or its symlink target)."""
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
    except OSError as exc:
        warnings.append(f"cannot make / private in the new mount namespace ({exc.strerror}); /etc/resolv.conf left as is")
        return
    target = os.path.realpath(RESOLV_CONF)
    if not os.path.isfile(target):
        warnings.append(
            f"{RESOLV_CONF} does not exist or points to a missing file ({target}); "
            "the command inside will not use the virtual DNS unless configured by hand"
        )
        return
    import tempfile

    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    try:
        fd, path = tempfile.mkstemp(prefix="aioslirp-resolv.", dir=runtime_dir if runtime_dir else None)
    except OSError:
        try:
            fd, path = tempfile.mkstemp(prefix="aioslirp-resolv.")
        except OSError as exc:
            warnings.append(f"cannot write a temporary resolv.conf ({exc.strerror}); {RESOLV_CONF} left as is")
            return
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(content)
        try:
            mount(path, target, None, MS_BIND)
        except OSError as exc:
            warnings.append(f"cannot bind-mount a generated resolv.conf over {target} ({exc.strerror})")
    finally:
        os.unlink(path)  # the bind mount keeps the (now anonymous) file alive


def _open_netns(path: str, missing: str) -> int:
    """An fd of the network namespace file ``path``. Raises SetupError: ``missing`` when there is no
    such file, else naming the error."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SetupError(missing) from None
    except OSError as exc:
        raise SetupError(f"cannot open network namespace {path}: {exc.strerror}") from None


def _ns_id(path_or_fd) -> tuple[int, int]:
    st = os.fstat(path_or_fd) if isinstance(path_or_fd, int) else os.stat(path_or_fd)
    return st.st_dev, st.st_ino


def _setns_user(userfd: int) -> None:
    """``setns`` into the user namespace open at ``userfd`` unless it is ours already; closes
    ``userfd``. Raises the ``OSError`` of ``setns``."""
    try:
        if _ns_id(userfd) != _ns_id("/proc/self/ns/user"):
            setns(userfd, CLONE_NEWUSER)
    finally:
        os.close(userfd)


def _setns_net(netfd: int, path: str, verb: str, user_problem: str | None = None) -> None:
    """``setns`` into the network namespace open at ``netfd`` (the file ``path``). Raises
    SetupError: ``path`` is no network namespace, or ``cannot {verb} network namespace ...`` with
    why (``user_problem``: joining its user namespace failed before)."""
    try:
        setns(netfd, CLONE_NEWNET)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise SetupError(f"{path} is not a network namespace") from None
        msg = f"cannot {verb} network namespace {path}: {os.strerror(exc.errno or 0)}"
        if user_problem:
            msg += f" ({user_problem})"
        elif exc.errno == errno.EPERM:
            msg += " (run as root or as the owner of its user namespace)"
        raise SetupError(msg) from None


def _enter_existing_namespace(netns_path: str | None, pid: int | None) -> None:
    """setns into the target netns, first into its owning user namespace when we are not root."""
    path = netns_path if netns_path else f"/proc/{pid}/ns/net"
    what = f"process {pid}" if netns_path is None else path
    netfd = _open_netns(path, f"cannot open the network namespace of {what}: "
                              f"no such {'process' if netns_path is None else 'file'}")
    try:
        if os.geteuid() != 0:
            userfd = -1
            try:
                import fcntl

                userfd = fcntl.ioctl(netfd, NS_GET_USERNS)
            except OSError:
                if pid is not None:
                    try:
                        userfd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
                    except OSError:
                        userfd = -1
            if userfd >= 0:
                try:
                    _setns_user(userfd)
                except OSError as exc:
                    raise SetupError(
                        f"cannot enter the user namespace that owns {path}: {os.strerror(exc.errno or 0)} "
                        "(it must be owned by your user, or run as root)"
                    ) from None
        _setns_net(netfd, path, "enter")
    finally:
        os.close(netfd)


def _join_namespaces(spec: dict) -> list[str]:
    """``join`` mode: ``setns`` into the target's user namespace ``spec["userns_path"]`` (when
    one applies and it is not already ours), then its network namespace ``spec["netns_path"]``.
    ``spec["pid"]`` is the target process (``--netns-type=pid``) or ``None``; a failure to join
    the user namespace is a warning unless ``spec["userns_required"]`` (``--userns-path``).
    Returns warnings; raises SetupError."""
    warnings: list[str] = []
    netns_path, userns_path, pid = spec["netns_path"], spec.get("userns_path"), spec.get("pid")
    netfd = _open_netns(netns_path, f"process {pid} does not exist" if pid is not None
                        else f"{netns_path}: no such network namespace file")
    try:
        user_problem = None
        if userns_path is not None:
            try:
                userfd = os.open(userns_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise SetupError(f"cannot open user namespace {userns_path}: {exc.strerror}") from None
            try:
                _setns_user(userfd)
            except OSError as exc:
                user_problem = f"cannot join user namespace {userns_path}: {os.strerror(exc.errno or 0)}"
                if spec.get("userns_required"):
                    raise SetupError(user_problem) from None
                warnings.append(user_problem + " (joining only the network namespace)")
        _setns_net(netfd, netns_path, "join", user_problem)
    finally:
        os.close(netfd)
    return warnings


def _set_mac(ifname: str, mac: str) -> None:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        with IPRoute() as ipr:
            found = ipr.link_lookup(ifname=ifname)
            if not found:
                raise OSError(errno.ENODEV, f"cannot configure {ifname}: no such interface")
            ipr.link("set", index=found[0], address=mac)
    except NetlinkError as exc:
        code = int(exc.code or 0)
        raise OSError(code, f"cannot set MAC address {mac} on {ifname}: {os.strerror(code) if code else exc}") from None


def _configure_joined(ifname: str, spec: dict) -> list[str]:
    """``join`` mode with ``configure`` (``-c``): lo up, MAC (``spec["mac"]``, or none), MTU,
    CIDR+100/prefix, link up, default route via CIDR+2; with ``spec["ipv6"]`` (``-6``) the TAP
    first accepts router advertisements without DAD (SLAAC in fd00::/64). Returns warnings."""
    from .ifconfig import configure_interface, configure_ipv6_sysctls

    try:
        set_loopback_up()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot bring lo up: {exc.strerror}") from None
    if spec.get("mac") is not None:
        _set_mac(ifname, spec["mac"])
    warnings = configure_ipv6_sysctls(ifname, True) if spec.get("ipv6") else []
    configure_interface(
        ifname,
        address=spec["address"],
        prefixlen=int(spec["prefixlen"]),
        gateway=spec["gateway"],
        mtu=int(spec["mtu"]),
    )
    return warnings


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        text = str(exc.strerror) if exc.filename is None else f"{exc.filename}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def _send(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def tap_reply(data: bytes, fds: list[int], error: type[Exception] = SetupError,
              who: str = "the namespace child") -> tuple[dict | None, int]:
    """The parent's reading of the child's answer (see the module documentation): ``data``, the
    datagram received, and ``fds``, the fds that came with it (``SCM_RIGHTS``).

    Returns ``(message, TAP fd)`` for ``{"ok": true, ...}`` with exactly one fd, and
    ``(None, -1)`` when ``data`` is empty (EOF) or not a JSON object: the child is gone or broken,
    and the caller says how it ended. Raises ``error`` (one line) for ``{"ok": false, "error":
    ...}``, or ``ok`` without exactly one fd (``who``: the child's name in that line). Closes
    every fd it does not return."""
    try:
        msg = json.loads(data) if data else None
    except ValueError:
        msg = None
    if isinstance(msg, dict) and msg.get("ok") and len(fds) == 1:
        return msg, fds[0]
    for fd in fds:
        os.close(fd)
    if not isinstance(msg, dict):
        return None, -1
    if not msg.get("ok"):
        raise error(str(msg.get("error") or "namespace setup failed"))
    raise error(f"{who} did not pass the TAP fd")


#: Signals the helper and PID 1 of a new PID namespace pass on to the command (SIGKILL cannot
#: be caught: killing the helper kills PID 1 by PR_SET_PDEATHSIG, and with it the namespace).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGWINCH, signal.SIGALRM)


def _exec(argv: list[str], sock: socket.socket | None = None, env: dict | None = None, cwd: str | None = None) -> int:
    """Exec the command with ``cwd`` and ``env`` (``None``: ours). When it cannot be executed:
    with ``sock`` (kept open until the exec, close-on-exec) send ``{"exec_error": ERRNO, "cwd":
    BOOL}`` to the parent (``cwd``: the directory failed, not the command); else print one line.
    Returns 127 (the command not found) or 126."""
    for sig in (signal.SIGPIPE, signal.SIGXFSZ) + FORWARDED:
        signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE/SIGXFSZ; exec would keep SIG_IGN
    if sock is not None:
        sock.set_inheritable(False)
    in_cwd = False
    try:
        if not argv or not argv[0]:
            raise FileNotFoundError(errno.ENOENT, "command not found (an empty command name)")
        if cwd is not None:
            in_cwd = True
            os.chdir(cwd)
            in_cwd = False
        if env is None:
            os.execvp(argv[0], argv)
        else:
            os.execvpe(argv[0], argv, env)
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) and not in_cwd else 126
        if sock is not None:
            try:
                _send(sock, {"exec_error": exc.errno or errno.ENOENT, "cwd": in_cwd})
                return code
            except OSError:
                pass
        what = argv[0] if argv else ""
        if in_cwd:
            print(f"aioslirp: cannot change to directory {cwd}: {exc.strerror}", file=sys.stderr)
        elif isinstance(exc, FileNotFoundError):
            print(f"aioslirp: {what}: command not found" + ("" if what else " (an empty command name)"),
                  file=sys.stderr)
        else:
            print(f"aioslirp: {what}: {exc.strerror}", file=sys.stderr)
        return code
    return 127  # not reached


def _forward_to(pid: int) -> None:
    """Pass :data:`FORWARDED` signals on to ``pid``."""

    def handler(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, handler)


def _fork(child: Callable[[], int], failed: int = 1) -> int:
    """``os.fork`` (stdout and stderr flushed first, so that nothing buffered is written twice):
    the child runs ``child()`` and exits with the status it returns (``failed`` when it raises),
    never unwinding into the parent's code. Returns the child's pid, in the parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, checked by the integration tests
        status = failed
        try:
            status = child()
        finally:
            os._exit(status)
    return pid


def _run_in_pid_namespace(command: Command, sock: socket.socket) -> int:
    """The Python PID 1, where the native init is absent: fork PID 1 of the PID namespace made by
    ``unshare`` (:func:`_pid1`), pass signals on to it, wait for it and end as the command ended
    (its exit status, or death by the same signal)."""
    r, w = os.pipe()

    def pid1() -> int:
        os.close(r)
        return _pid1(command, sock, w)

    pid = _fork(pid1)
    os.close(w)
    sock.close()
    _forward_to(pid)
    while True:
        try:
            _, pid1_status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            pid1_status = 1 << 8
            break
    data = os.read(r, 32)
    os.close(r)
    try:
        code = os.waitstatus_to_exitcode(int(data)) if data else os.waitstatus_to_exitcode(pid1_status)
    except ValueError:
        code = 1
    if code < 0:  # the command died of a signal: so do we, so that our parent sees it
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def _pid1(command: Command, sock: socket.socket, status_fd: int) -> int:
    """PID 1 of the new PID namespace: mount its /proc (best effort), fork the command, pass
    signals on to it, reap every orphan, and when the command ends write its raw wait status to
    ``status_fd`` and exit, which kills whatever else is left in the namespace."""
    set_pdeathsig(None)
    with contextlib.suppress(OSError):
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    def run() -> int:
        os.close(status_fd)
        return _exec(command.argv, sock, command.env, command.cwd)

    cmd = _fork(run, failed=127)
    sock.close()
    _forward_to(cmd)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            status = 1 << 8
            break
        if pid == cmd:
            break
    os.write(status_fd, str(status).encode())
    return 0


def _enter_run(spec: dict, warnings: list[str]) -> None:
    _enter_new_namespaces(bool(spec.get("pid_namespace")))
    set_pdeathsig(int(spec["ppid"]))  # credentials changed: set again to be sure
    if spec.get("resolv_conf") is not None:
        _install_resolv_conf(spec["resolv_conf"], warnings)
    set_loopback_up()


def _enter_attach(spec: dict, warnings: list[str]) -> None:
    _enter_existing_namespace(spec.get("netns_path"), spec.get("pid"))
    try:
        set_loopback_up()
    except OSError as exc:
        warnings.append(f"cannot bring lo up in the namespace ({exc.strerror or exc})")


def _enter_join(spec: dict, warnings: list[str]) -> None:
    warnings.extend(_join_namespaces(spec))


def _create_tap(spec: dict, warnings: list[str]) -> tuple[int, str]:
    """``run`` / ``attach``: create the TAP with its MTU, set its IPv6 sysctls, address and route."""
    from .ifconfig import configure_interface, configure_ipv6_sysctls
    from ..transport.tapdev import create_tap

    fd, ifname = create_tap(spec["ifname"], spec["mtu"], vnet_hdr=bool(spec.get("vnet_hdr")))
    try:
        if "ipv6" in spec:  # before the link goes up: SLAAC without DAD, or no IPv6 at all
            warnings += configure_ipv6_sysctls(ifname, bool(spec["ipv6"]))
        configure_interface(
            ifname,
            address=spec["address"],
            prefixlen=int(spec["prefixlen"]),
            gateway=spec["gateway"],
            mtu=None,
        )
    except BaseException:
        os.close(fd)
        raise
    return fd, ifname


def _open_tap(spec: dict, warnings: list[str]) -> tuple[int, str]:
    """``join``: attach to (or create) the TAP; configure it only with ``spec["configure"]``."""
    from ..transport.tapdev import open_tap

    offload = bool(spec.get("vnet_hdr"))
    try:
        fd, ifname = open_tap(spec["ifname"], vnet_hdr=offload)
    except OSError as exc:
        if not offload or exc.errno != errno.EINVAL:
            raise
        fd, ifname = open_tap(spec["ifname"])  # a TAP that refuses the header: plain frames
    try:
        if spec.get("configure"):
            warnings += _configure_joined(ifname, spec)
    except BaseException:
        os.close(fd)
        raise
    return fd, ifname


#: mode -> (enter the namespaces, make the TAP); see the module documentation.
_MODES = {
    "run": (_enter_run, _create_tap),
    "attach": (_enter_attach, _create_tap),
    "join": (_enter_join, _open_tap),
}


def run_child(sock: socket.socket, spec: dict) -> int:
    """The child's body: set up what ``spec["mode"]`` asks (see the module documentation), send
    the TAP fd (or one line saying why not) on ``sock``; in ``run`` mode then wait for "go" and
    exec the command. Returns the exit status (0 once the fd is sent); never raises for a
    failed step."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    mode = spec.get("mode")
    warnings: list[str] = []
    try:
        set_pdeathsig(int(spec["ppid"]))
        if mode not in _MODES:
            raise SetupError(f"unknown helper mode {mode!r}")
        enter, make_tap = _MODES[mode]
        enter(spec, warnings)
        fd, ifname = make_tap(spec, warnings)
    except (SetupError, OSError) as exc:
        try:
            _send(sock, {"ok": False, "error": _one_line(exc)})
        except OSError:
            pass
        return 1
    except Exception as exc:  # keep the one-line contract even for the unexpected
        try:
            _send(sock, {"ok": False, "error": f"namespace setup failed: {type(exc).__name__}: {exc}"})
        except OSError:
            pass
        return 1

    try:
        _send(sock, {"ok": True, "ifname": ifname, "warnings": warnings}, [fd])
    except OSError:
        return 1
    finally:
        os.close(fd)
    if mode != "run":
        return 0
    try:
        go = sock.recv(2)
    except OSError:
        go = b""
    if go not in (b"g", b"g6"):
        sock.close()
        return 1  # parent went away or aborted: do not run the command
    if go == b"g6" and spec.get("prefix6") and os.path.isdir(f"/proc/sys/net/ipv6/conf/{ifname}"):
        from .ifconfig import IPV6_ADDRESS_TIMEOUT, wait_ipv6_address

        if wait_ipv6_address(ifname, spec["prefix6"]) is None:
            print(f"aioslirp: warning: {ifname} got no IPv6 address in {spec['prefix6']} within "
                  f"{IPV6_ADDRESS_TIMEOUT:g} s; starting the command anyway", file=sys.stderr)
    if spec.get("pid_namespace") and spec.get("init"):
        _exec_init(spec["init"], sock)  # returns only when it cannot be executed: the Python PID 1 then
    command = read_command(sock)
    if command is None:
        sock.close()
        return 1  # the parent went away before sending the command
    if spec.get("pid_namespace"):
        return _run_in_pid_namespace(command, sock)
    return _exec(command.argv, sock, command.env, command.cwd)


def _exec_init(path: str, sock: socket.socket) -> None:
    """Become the native init (``aioslirp-init SOCK_FD``: see ``aioslirp/native/init.c``), which
    reads the command from ``sock``, forks PID 1 of the new PID namespace and ends as the command
    ends: no interpreter stays alive for the guest. Returns when it cannot be executed."""
    fd = sock.fileno()
    try:
        os.set_inheritable(fd, True)
        os.execv(path, [path, str(fd)])
    except OSError:
        os.set_inheritable(fd, False)


def _read_spec(fd: int) -> dict:
    """The spec from the inherited pipe ``fd`` (written by :func:`aioslirp.host.nsbase.start_helper`),
    read to its end; ``fd`` is closed, so that the command never inherits it."""
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks))


def main(args: list[str] | None = None) -> int:
    """Entry point of the spawned child: ``args`` is ``[SOCK_FD, SPEC_FD]``, the inherited fds of our
    end of the socket pair and of the pipe carrying the spec (JSON). Returns the exit status."""
    args = sys.argv[1:] if args is None else args
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print("aioslirp.host.nschild is internal to aioslirp (started by 'aioslirp run' / 'aioslirp attach')",
              file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(args[0]))
    return run_child(sock, _read_spec(int(args[1])))


class ForkedChild:
    """The child forked to run ``spec`` (``join`` mode, the slirp4netns drop-in) with :func:`run_child`.

    Fork it before any thread or event loop exists (joining a user namespace needs a
    single-threaded process); :meth:`result` waits for its answer and reaps it. Raises
    ``OSError`` when the fork fails.
    """

    def __init__(self, spec: dict) -> None:
        self.sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = dict(spec, ppid=os.getpid())

        def child() -> int:
            self.sock.close()
            return run_child(child_sock, spec)

        self.pid = _fork(child)
        child_sock.close()

    def result(self, timeout: float = SETUP_TIMEOUT) -> tuple[int, str, list]:
        """Wait for the child's answer. Returns ``(tap_fd, ifname, warnings)``; raises SetupError."""
        try:
            self.sock.settimeout(timeout)
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, 2)
            except socket.timeout:
                self._kill()
                raise SetupError(f"the namespace child did not open the TAP within {timeout:g} s") from None
            except OSError as exc:
                self._kill()
                raise SetupError(f"lost the namespace child: {exc.strerror}") from None
            status = self._reap()
            msg, fd = tap_reply(data, fds)
            if msg is None:
                how = f"exited with status {status >> 8}" if os.WIFEXITED(status) else "was killed"
                raise SetupError(f"the namespace child {how} before opening the TAP")
            return fd, str(msg.get("ifname")), list(msg.get("warnings") or ())
        finally:
            self.sock.close()

    def _reap(self) -> int:
        while True:
            try:
                _pid, status = os.waitpid(self.pid, 0)
                return status
            except InterruptedError:
                continue
            except ChildProcessError:
                return 0

    def _kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap()


if __name__ == "__main__":
    sys.exit(main())
