"""Namespace helper process for ``aioslirp run`` and ``aioslirp attach`` (internal).

Started by :mod:`aioslirp.netns` as ``python -m aioslirp._nschild SPEC_JSON`` with one end of
an ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair inherited (its fd number is in the spec).

``run`` mode: new network + mount namespace (plus a user namespace mapping our uid/gid to
0 when not root), ``/`` made rprivate, a generated resolv.conf bind-mounted over
``/etc/resolv.conf``, ``lo`` up, the TAP created and configured; the TAP fd is sent to the
parent, then the helper waits for ``b"g"`` ("go") and execs the command; ``b"g6"`` means "go
once the TAP has its SLAAC address in ``prefix6``" (bounded wait).

``attach`` mode: enter an existing network namespace (and its owning user namespace when
not root), bring ``lo`` up (as ``slirp4netns --configure`` does; a failure is a warning),
create and configure the TAP, send the fd, exit 0.

Messages to the parent are single JSON objects, one per datagram:
``{"ok": true, "ifname": NAME, "warnings": [...]}`` with the TAP fd attached (SCM_RIGHTS), or
``{"ok": false, "error": ONE_LINE}``.

This module imports only the standard library and :mod:`aioslirp` helpers (pyroute2 lazily).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import sys
import tempfile

from ._isolate import CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWUSER, set_loopback_up, unshare

_libc = ctypes.CDLL(None, use_errno=True)

PR_SET_PDEATHSIG = 1
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
NS_GET_USERNS = 0xB701
RESOLV_CONF = "/etc/resolv.conf"


class SetupError(Exception):
    """A setup step failed; ``str()`` is the one line shown to the user."""


def _errno_call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def set_pdeathsig(expected_ppid: int) -> None:
    """Get SIGKILL when the parent dies; exit at once if it already has."""
    _errno_call(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != expected_ppid:
        os._exit(1)


def setns(fd: int, nstype: int) -> None:
    """``setns(2)`` through libc; raises ``OSError``."""
    _errno_call(_libc.setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    """``mount(2)`` through libc (no data argument); raises ``OSError``."""
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _errno_call(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), None), f"mount {target}")


def _enter_new_namespaces() -> None:
    """unshare net+mount (and user when not root) and map our ids to root."""
    if os.geteuid() == 0:
        try:
            unshare(CLONE_NEWNET | CLONE_NEWNS)
        except OSError as exc:
            raise SetupError(f"cannot create network/mount namespaces: {os.strerror(exc.errno or 0)}") from None
        return
    uid, gid = os.geteuid(), os.getegid()
    try:
        unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS)
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
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
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


def _enter_existing_namespace(netns_path: str | None, pid: int | None) -> None:
    """setns into the target netns, first into its owning user namespace when we are not root."""
    path = netns_path if netns_path else f"/proc/{pid}/ns/net"
    try:
        netfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        what = f"process {pid}" if netns_path is None else path
        raise SetupError(f"cannot open the network namespace of {what}: no such {'process' if netns_path is None else 'file'}") from None
    except OSError as exc:
        raise SetupError(f"cannot open network namespace {path}: {exc.strerror}") from None
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
                    if os.fstat(userfd).st_ino != os.stat("/proc/self/ns/user").st_ino:
                        try:
                            setns(userfd, CLONE_NEWUSER)
                        except OSError as exc:
                            raise SetupError(
                                f"cannot enter the user namespace that owns {path}: {os.strerror(exc.errno or 0)} "
                                "(it must be owned by your user, or run as root)"
                            ) from None
                finally:
                    os.close(userfd)
        try:
            setns(netfd, CLONE_NEWNET)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise SetupError(f"{path} is not a network namespace") from None
            raise SetupError(
                f"cannot enter network namespace {path}: {os.strerror(exc.errno or 0)}"
                + (" (run as root or as the owner of its user namespace)" if exc.errno == errno.EPERM else "")
            ) from None
    finally:
        os.close(netfd)


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


def _exec(argv: list[str]) -> int:
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE/SIGXFSZ; exec would keep SIG_IGN
    if not argv or not argv[0]:
        print("aioslirp: : command not found (an empty command name)", file=sys.stderr)
        return 127
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        print(f"aioslirp: {argv[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"aioslirp: {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 126
    return 127  # not reached


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    if len(args) != 1:
        print("aioslirp._nschild is internal to aioslirp (started by 'aioslirp run' / 'aioslirp attach')", file=sys.stderr)
        return 2
    spec = json.loads(args[0])
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sock = socket.socket(fileno=int(spec["sock"]))
    mode = spec["mode"]
    warnings: list[str] = []
    try:
        set_pdeathsig(int(spec["ppid"]))
        if mode == "run":
            _enter_new_namespaces()
            set_pdeathsig(int(spec["ppid"]))  # credentials changed: set again to be sure
            if spec.get("resolv_conf") is not None:
                _install_resolv_conf(spec["resolv_conf"], warnings)
            set_loopback_up()
        elif mode == "attach":
            _enter_existing_namespace(spec.get("netns_path"), spec.get("pid"))
            try:
                set_loopback_up()
            except OSError as exc:
                warnings.append(f"cannot bring lo up in the namespace ({exc.strerror or exc})")
        else:
            raise SetupError(f"unknown helper mode {mode!r}")

        from .netns import configure_interface, configure_ipv6_sysctls
        from .transport.tap import create_tap

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
    if mode == "attach":
        return 0
    try:
        go = sock.recv(2)
    except OSError:
        go = b""
    sock.close()
    if go not in (b"g", b"g6"):
        return 1  # parent went away or aborted: do not run the command
    if go == b"g6" and spec.get("prefix6") and os.path.isdir(f"/proc/sys/net/ipv6/conf/{ifname}"):
        from .netns import IPV6_ADDRESS_TIMEOUT, wait_ipv6_address

        if wait_ipv6_address(ifname, spec["prefix6"]) is None:
            print(f"aioslirp: warning: {ifname} got no IPv6 address in {spec['prefix6']} within "
                  f"{IPV6_ADDRESS_TIMEOUT:g} s; starting the command anyway", file=sys.stderr)
    argv = spec.get("argv") or [os.environ.get("SHELL") or "/bin/sh"]
    return _exec(list(argv))


if __name__ == "__main__":
    sys.exit(main())
