"""``aioslirp.host.sandbox.enable_seccomp``: each blocked system call, attempted, fails with EPERM.

A child process (the filter cannot be removed) calls every system call of the documented list
(docs/slirp4netns.md, "Sandbox and seccomp") through ``syscall(2)`` with arguments that make it
fail harmlessly or do nothing when it is allowed (a missing path, a bad fd, a pid above
``pid_max``, a wrong reboot magic, ``unshare(0)``, ``prctl(PR_GET_DUMPABLE)``...). The same
probe without the filter is the control: there no call may fail with EPERM (but for a few a host
policy may refuse, see HOST_MAY_REFUSE), so an EPERM under the filter comes from the filter. Calls the process needs (files, sockets, pipes, getpid, fork)
still work under it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from aioslirp.host import sandbox

from support.prereqs import need

#: The blocked calls, as documented. ``umount`` exists on 32-bit ABIs only (there it is tried).
DOCUMENTED = {
    "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "pidfd_open",
    "pidfd_send_signal", "lookup_dcookie", "perf_event_open", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "reboot", "mount", "umount", "umount2", "pivot_root", "chroot", "fsopen",
    "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "setns", "unshare", "open_by_handle_at",
    "name_to_handle_at", "prctl", "bpf", "userfaultfd", "add_key", "request_key", "keyctl",
}

#: Calls a host policy may refuse with EPERM even to root before any filter (kernel lockdown,
#: ``kernel.kexec_load_disabled``, ``kernel.modules_disabled``...): there the control cannot tell
#: the filter's EPERM from the host's, so only they may show EPERM in the control.
HOST_MAY_REFUSE = {"kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf",
                   "perf_event_open", "lookup_dcookie", "userfaultfd"}

PROBE = r'''
import ctypes, errno, json, os, socket, sys

from aioslirp.host import sandbox

lib = sandbox.load_libseccomp()
blocked = sandbox.enable_seccomp() if sys.argv[1] == "filter" else []
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L, S = ctypes.c_long, ctypes.c_char_p
NULL = ctypes.c_void_p(None)
NOPATH = S(b"/nonexistent-aioslirp-probe")
AT_FDCWD, BAD_FD, NO_PID = L(-100), L(-1), L(0x3FFFFFFF)  # NO_PID: above any pid_max
ARGS = {  # each fails harmlessly, or does nothing, when allowed
    "execve": (NOPATH, NULL, NULL),
    "execveat": (AT_FDCWD, NOPATH, NULL, NULL, L(0)),
    "ptrace": (L(2), NO_PID, NULL, NULL),  # PTRACE_PEEKDATA
    "process_vm_readv": (NO_PID, NULL, L(0), NULL, L(0), L(0)),
    "process_vm_writev": (NO_PID, NULL, L(0), NULL, L(0), L(0)),
    "pidfd_getfd": (BAD_FD, L(0), L(0)),
    "pidfd_open": (NO_PID, L(0)),
    "pidfd_send_signal": (BAD_FD, L(0), NULL, L(0)),
    "lookup_dcookie": (L(0), NULL, L(0)),
    "perf_event_open": (NULL, L(0), L(-1), L(-1), L(0)),
    "init_module": (NULL, L(0), S(b"")),
    "finit_module": (BAD_FD, S(b""), L(0)),
    "delete_module": (S(b"aioslirp_no_such_module"), L(os.O_NONBLOCK)),
    "kexec_load": (L(0), L(0), NULL, L(0x7FFF0000)),  # invalid flags: EINVAL
    "kexec_file_load": (BAD_FD, BAD_FD, L(0), NULL, L(0x7FFF0000)),
    "reboot": (L(0), L(0), L(0), NULL),  # wrong magic: EINVAL
    "mount": (NULL, NOPATH, NULL, L(0), NULL),
    "umount": (NOPATH,),
    "umount2": (NOPATH, L(0)),
    "pivot_root": (NOPATH, NOPATH),
    "chroot": (NOPATH,),
    "fsopen": (S(b"aioslirp-no-such-fs"), L(0)),
    "fsconfig": (BAD_FD, L(0), NULL, NULL, L(0)),
    "fsmount": (BAD_FD, L(0), L(0)),
    "fspick": (AT_FDCWD, NOPATH, L(0)),
    "move_mount": (BAD_FD, S(b""), BAD_FD, S(b""), L(0)),
    "open_tree": (AT_FDCWD, NOPATH, L(0)),
    "setns": (BAD_FD, L(0)),
    "unshare": (L(0),),  # no flags: nothing
    "open_by_handle_at": (BAD_FD, NULL, L(0)),
    "name_to_handle_at": (AT_FDCWD, NOPATH, NULL, NULL, L(0)),
    "prctl": (L(3), L(0), L(0), L(0), L(0)),  # PR_GET_DUMPABLE
    "bpf": (L(-1), NULL, L(0)),
    "userfaultfd": (L(0x7FFF0000),),  # invalid flags: EINVAL
    "add_key": (NULL, NULL, NULL, L(0), L(0)),
    "request_key": (NULL, NULL, NULL, L(0)),
    "keyctl": (L(-1), L(0), L(0), L(0), L(0)),
}
calls = {}
for name, args in ARGS.items():
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr < 0:
        continue  # not a system call of this architecture
    ctypes.set_errno(0)
    rc = libc.syscall(L(nr), *args)
    calls[name] = {"rc": rc, "errno": errno.errorcode.get(ctypes.get_errno(), "0") if rc == -1 else None}

# calls the process needs still work
with open("/proc/self/status") as f:
    status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
r, w = os.pipe()
os.write(w, b"pipe")
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("127.0.0.1", 0))
u.sendto(b"udp", u.getsockname())
pid = os.fork()  # clone(2) is not blocked
if pid == 0:
    os._exit(7)
_, st = os.waitpid(pid, 0)
works = {"read": os.read(r, 10).decode(), "udp": u.recv(10).decode(), "fork_status": os.waitstatus_to_exitcode(st),
         "getpid": libc.syscall(L(lib.seccomp_syscall_resolve_name(b"getpid"))) == os.getpid(),
         "seccomp": status["Seccomp"].strip(), "no_new_privs": status["NoNewPrivs"].strip()}
print(json.dumps({"blocked": blocked, "calls": calls, "works": works}))
'''


def probe(mode: str) -> dict:
    p = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_every_blocked_syscall_attempted_fails_with_eperm_and_allowed_calls_work():
    need(os.geteuid() == 0, "needs root (unprivileged, mount, chroot, reboot... fail with EPERM without a filter)")
    need(sandbox.load_libseccomp() is not None, "libseccomp.so.2 is missing (apt-get install libseccomp2)")
    assert set(sandbox.BLOCKED_SYSCALLS) == DOCUMENTED
    control = probe("none")
    filtered = probe("filter")
    # The control: every call of this architecture was made, none failed with EPERM
    tried = set(control["calls"])
    assert DOCUMENTED - {"umount"} <= tried <= DOCUMENTED, tried ^ DOCUMENTED
    refused = {n for n, c in control["calls"].items() if c["errno"] == "EPERM"}
    assert refused <= HOST_MAY_REFUSE, control["calls"]
    assert control["works"]["seccomp"] == "0"
    # Under the filter: each of them fails with EPERM (and nothing else happened)
    assert set(filtered["blocked"]) == tried
    assert {n: c for n, c in filtered["calls"].items() if c != {"rc": -1, "errno": "EPERM"}} == {}
    assert filtered["works"] == {"read": "pipe", "udp": "udp", "fork_status": 7, "getpid": True,
                                 "seccomp": "2", "no_new_privs": "1"}
