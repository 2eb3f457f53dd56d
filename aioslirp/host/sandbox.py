"""Process lock-down for ``aioslirp-slirp4netns --enable-sandbox`` / ``--enable-seccomp``.

Both are applied once everything the process needs is open (the TAP fd, the API socket,
the stack's services) and before the ready byte, as slirp4netns does.

:func:`enter_sandbox`
    A new mount namespace (plus, when not root, a new user namespace in which we are root,
    so that this works unprivileged: our uid/gid are mapped to 0, nothing else changes on
    the host side, and the network namespace stays the host's). In it, the root becomes an
    empty tmpfs holding read-only bind mounts of ``/etc`` and ``/run`` (as slirp4netns
    keeps them, for ``resolv.conf``), of ``/usr`` and of the Python runtime's directories
    (``sys.prefix``, ``sys.base_prefix``, the ``sys.path`` entries: a Python process still
    imports lazily), and the symlinks ``/lib``, ``/lib64``... when they are symlinks. The
    old root is detached. Then ``PR_SET_NO_NEW_PRIVS``, the ambient capabilities cleared,
    every capability dropped from the bounding set and from the effective, permitted and
    inheritable sets except ``CAP_NET_BIND_SERVICE`` (for port forwards below 1024).
    Everything else on the host's file system (homes, ``/tmp``, ``/var``, ``/proc``,
    ``/sys``, ``/dev``) is out of reach afterwards.

:func:`enable_seccomp`
    A seccomp filter (through libseccomp, ``libseccomp.so.2``) on top of "allow": the
    system calls in :data:`BLOCKED_SYSCALLS` (slirp4netns's list: program execution,
    debugging of other processes, kernel modules, mounts, namespaces, kexec/reboot, file
    handles, ``prctl``; plus ``bpf``, ``perf_event_open``, ``userfaultfd`` and the kernel
    keyring) fail with ``EPERM``. slirp4netns kills the process instead; a Python process
    gets an ``OSError`` it can log, which blocks the call just as well.

Both raise :class:`SandboxError` (one line) when a step fails; the caller exits before
writing the ready byte, so a client never runs with less isolation than it asked for.
Linux only; the process must be single-threaded for :func:`enter_sandbox` (user
namespaces require it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import sys

__all__ = ["SandboxError", "enter_sandbox", "enable_seccomp", "load_libseccomp", "BLOCKED_SYSCALLS", "sandbox_paths"]

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 0x400, 0x800, 0x1000
MNT_DETACH = 2
#: statvfs f_flag bits that a bind remount must keep (same values as the MS_ flags).
_KEEP_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME | MS_RELATIME
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_NET_BIND_SERVICE = 10
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

#: ``pivot_root`` has no glibc wrapper: its number per architecture.
_SYS_PIVOT_ROOT = {
    "x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "loongarch64": 41,
    "i386": 217, "i686": 217, "armv7l": 218, "armv6l": 218, "ppc64le": 203, "ppc64": 203, "s390x": 217,
}

#: System calls ``--enable-seccomp`` makes fail with EPERM.
BLOCKED_SYSCALLS = (
    # program execution
    "execve", "execveat",
    # other processes' memory, debugging
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "pidfd_open", "pidfd_send_signal",
    "lookup_dcookie", "perf_event_open",
    # kernel modules, kexec, reboot
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    # mounts and namespaces
    "mount", "umount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "setns", "unshare",
    # file handles
    "open_by_handle_at", "name_to_handle_at",
    # process attributes, BPF, keyring, userfaultfd
    "prctl", "bpf", "userfaultfd", "add_key", "request_key", "keyctl",
)


class SandboxError(RuntimeError):
    """A lock-down step failed. ``str(err)`` is one line naming the step."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"--enable-sandbox: {what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def sandbox_paths() -> list[str]:
    """Directories bind-mounted read-only into the sandbox (absolute, real, existing, minimal)."""
    wanted = ["/etc", "/run", "/usr", sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    wanted += [p for p in sys.path if p]
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wanted.append(pkg)
    real: set[str] = set()
    for p in wanted:
        try:
            rp = os.path.realpath(p)
        except OSError:
            continue
        if os.path.isdir(rp) and rp != "/":
            real.add(rp)
    out: list[str] = []
    for p in sorted(real):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _new_namespaces() -> None:
    n = _threads()
    if n > 1:
        raise SandboxError(f"--enable-sandbox: the process has {n} threads (a new namespace needs one)")
    if os.geteuid() == 0:
        _check(_libc.unshare(ctypes.c_int(CLONE_NEWNS)), "unshare(CLONE_NEWNS)")
        return
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(ctypes.c_int(CLONE_NEWUSER | CLONE_NEWNS)), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
    except OSError as exc:
        raise SandboxError(f"--enable-sandbox: cannot map ids in the new user namespace: {exc.strerror}") from None


def _bind_readonly(source_fd: int, source: str, target: str, noexec: bool) -> None:
    _mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND | MS_REC)
    try:
        keep = os.statvfs(target).f_flag & _KEEP_FLAGS
    except OSError:
        keep = 0
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep | (MS_NOEXEC if noexec else 0)
    try:
        _mount(None, target, None, flags)
    except SandboxError as exc:
        raise SandboxError(f"{exc} (read-only remount of {source})") from None


def enter_sandbox() -> list[str]:
    """Lock this process into a minimal file system view and drop capabilities (see module doc).

    Returns the directories left visible. Raises :class:`SandboxError`.
    """
    machine = platform.machine()
    nr_pivot = _SYS_PIVOT_ROOT.get(machine)
    if nr_pivot is None:
        raise SandboxError(f"--enable-sandbox: pivot_root is not known on {machine}")
    paths = sandbox_paths()
    fds: dict[str, int] = {}
    try:
        links = {}
        for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(name):
                links[name] = os.readlink(name)
        _new_namespaces()
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        # Hold every source open (in the new mount namespace: a bind source must be in ours)
        # before the new root, a tmpfs mounted over /tmp, hides some of them.
        for p in paths:
            try:
                fds[p] = os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise SandboxError(f"--enable-sandbox: cannot open {p}: {exc.strerror}") from None
        root = "/tmp"
        _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for p in paths:
            target = root + p
            os.makedirs(target, mode=0o755, exist_ok=True)
            _bind_readonly(fds[p], p, target, noexec=p in ("/etc", "/run"))
        for name, dest in links.items():
            if not os.path.lexists(root + name):
                os.symlink(dest, root + name)
        os.mkdir(root + "/old", 0o700)
        os.chdir(root)
        _check(_libc.syscall(ctypes.c_long(nr_pivot), b".", b"old"), "pivot_root")
        os.chdir("/")
        _check(_libc.umount2(b"/old", ctypes.c_int(MNT_DETACH)), "umount /old")
        os.rmdir("/old")
        try:
            _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        except SandboxError:
            pass  # a writable empty tmpfs root is harmless (slirp4netns ignores this too)
    except OSError as exc:
        raise SandboxError(f"--enable-sandbox: {exc.strerror or exc}") from None
    finally:
        for fd in fds.values():
            os.close(fd)
    _drop_privileges()
    return paths


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_privileges() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL on old kernels: nothing to clear
    cap = 0
    while True:
        if cap != CAP_NET_BIND_SERVICE:
            if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                err = ctypes.get_errno()
                if err == errno.EINVAL:
                    break  # past the last capability this kernel knows
                raise SandboxError(f"--enable-sandbox: prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(err)}")
        cap += 1
        if cap > 63:
            break
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    bit = 1 << CAP_NET_BIND_SERVICE
    data[0].effective = data[0].permitted = data[0].inheritable = bit
    if _libc.capset(ctypes.byref(hdr), data) != 0:
        err = ctypes.get_errno()
        if err != errno.EPERM:
            raise SandboxError(f"--enable-sandbox: capset: {os.strerror(err)}")
        # We never had CAP_NET_BIND_SERVICE: drop everything.
        data[0].effective = data[0].permitted = data[0].inheritable = 0
        _check(_libc.capset(ctypes.byref(hdr), data), "capset")


# ------------------------------------------------------------------------------ seccomp

_SCMP_ACT_ALLOW = 0x7FFF0000


def _scmp_act_errno(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


_libseccomp_handle = None


def load_libseccomp():
    """Load libseccomp (``libseccomp.so.2``) once; ``None`` when it is not installed.

    Call it before :func:`enter_sandbox` when both are wanted: the sandbox hides ``/tmp``,
    which ``ctypes.util.find_library`` needs."""
    global _libseccomp_handle
    if _libseccomp_handle is None:
        _libseccomp_handle = _libseccomp()
    return _libseccomp_handle


def _candidates():
    yield "libseccomp.so.2"
    yield ctypes.util.find_library("seccomp")


def _libseccomp():
    for name in _candidates():
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add.restype = ctypes.c_int
        lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
        lib.seccomp_load.restype = ctypes.c_int
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        lib.seccomp_release.restype = None
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        return lib
    return None


def enable_seccomp(blocked=BLOCKED_SYSCALLS) -> list[str]:
    """Install the seccomp filter; returns the system calls actually blocked.

    Names this kernel/libseccomp does not know are skipped. Raises :class:`SandboxError`
    when libseccomp is missing or the filter cannot be loaded.
    """
    lib = load_libseccomp()
    if lib is None:
        raise SandboxError("--enable-seccomp: libseccomp.so.2 not found (apt-get install libseccomp2)")
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SandboxError("--enable-seccomp: seccomp_init failed")
    done: list[str] = []
    try:
        action = _scmp_act_errno(errno.EPERM)
        for name in blocked:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a system call on this architecture
            rc = lib.seccomp_rule_add(ctx, action, nr, 0)
            if rc != 0:
                raise SandboxError(f"--enable-seccomp: cannot add a rule for {name}: {os.strerror(-rc)}")
            done.append(name)
        rc = lib.seccomp_load(ctx)
        if rc != 0:
            raise SandboxError(f"--enable-seccomp: seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)
    return done
