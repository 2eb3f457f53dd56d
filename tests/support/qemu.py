"""Boot real Linux guests under QEMU for tests and benchmarks (kit: ``../shared/guestvm``).

The kit builds a Debian kernel plus a busybox initramfs whose ``/init`` configures eth0
(DHCP by default), runs a shell snippet, prints ``GUESTVM-EXIT=<status>`` and powers off.
This module builds it when missing (into ``$GUESTVM_CACHE``, default ``<repo>/.cache/guestvm``),
assembles QEMU command lines for any ``-netdev`` and runs a guest with a hard time bound,
timestamping every console line.

Guest snippets print ``KEY=VALUE`` lines; :attr:`VmResult.values` collects them.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import gzip
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.paths import REPO, SHARED

#: The guestvm kit (read-only): ../shared/guestvm next to the repository, or $GUESTVM_DIR.
KIT = Path(os.environ.get("GUESTVM_DIR") or SHARED / "guestvm")
GUEST_MAC = "52:54:00:12:34:56"
QEMU = os.environ.get("QEMU", "qemu-system-x86_64")


def cache_dir() -> Path:
    return Path(os.environ.get("GUESTVM_CACHE") or REPO / ".cache" / "guestvm")


def _built(cache: Path) -> bool:
    return (cache / "vmlinuz").is_file() and (cache / "initramfs.cpio.gz").is_file()


def ensure_built(timeout: float = 600) -> Path:
    """Return the cache folder holding ``vmlinuz`` and ``initramfs.cpio.gz``; build it if missing.

    Runs the kit's ``build.sh --no-install`` (host packages must be installed: qemu-system-x86,
    cpio, iperf3; ``.ci/prereqs`` installs them and builds before pytest). The kernel and busybox
    .debs are reused from ``$GUESTVM_CACHE/debs`` or, if present, the kit's default cache
    ``~/.cache/guestvm/debs`` (pytest runs without network). Raises ``RuntimeError`` with
    the build log's tail when the build fails.
    """
    cache = cache_dir()
    if _built(cache):
        return cache
    if shutil.which(QEMU) is None:
        raise RuntimeError(f"{QEMU} not found: apt-get install qemu-system-x86 (bash .ci/prereqs installs it)")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(cache):
            return cache
        seed = Path.home() / ".cache" / "guestvm" / "debs"
        if seed.is_dir() and seed.resolve() != (cache / "debs").resolve():
            (cache / "debs").mkdir(exist_ok=True)
            for deb in seed.glob("*.deb"):
                if not (cache / "debs" / deb.name).exists():
                    shutil.copy2(deb, cache / "debs" / deb.name)
        env = dict(os.environ, GUESTVM_CACHE=str(cache))
        p = subprocess.run([str(KIT / "build.sh"), "--no-install"], env=env, capture_output=True, text=True,
                           timeout=timeout)
        if p.returncode != 0 or not _built(cache):
            raise RuntimeError(f"guestvm build failed (rc={p.returncode}); run bash .ci/prereqs or "
                               f"GUESTVM_CACHE={cache} {KIT}/build.sh as root:\n{p.stderr[-3000:]}")
    return cache


def kvm_usable() -> bool:
    """Same rule as the kit's run.sh: /dev/kvm read-write, VMX/SVM in cpuinfo, no kvm_pvm."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(vmx|svm)\b", flags)) and not Path("/sys/module/kvm_pvm").exists()


def accel() -> str:
    return os.environ.get("GUESTVM_ACCEL") or ("kvm" if kvm_usable() else "tcg")


def qemu_argv(netdev: str, cmd: str | None, *, workdir: Path, cache: Path | None = None, net: str = "dhcp",
              mac: str = GUEST_MAC, mem: int = 256, mtu: int | None = None, append: str = "",
              initrd: Path | None = None) -> list[str]:
    """QEMU argv booting the guestvm kernel with one virtio-net NIC on ``-netdev netdev``.

    ``netdev`` is the option value without ``id`` (``id=n0`` is added), e.g.
    ``"stream,server=off,addr.type=unix,addr.path=/run/x.sock"``. ``cmd`` is the guest's
    shell snippet (long snippets go through fw_cfg, a file in ``workdir``). ``initrd``: another
    initramfs to boot instead of the kit's (e.g. one from :func:`initrd_with`).
    """
    cache = cache or ensure_built()
    kargs = f"console=ttyS0 panic=-1 quiet loglevel=4 i8042.noaux i8042.nokbd guestvm.net={net}"
    if mtu:
        kargs += f" guestvm.mtu={mtu}"
    extra: list[str] = []
    if cmd is not None:
        b64 = base64.b64encode((cmd + "\n").encode()).decode()
        if len(b64) <= 1200:
            kargs += f" guestvm.cmd={b64}"
        else:
            f = workdir / "guest-cmd.sh"
            f.write_text(cmd + "\n")
            extra = ["-fw_cfg", f"name=opt/guestvm/cmd,file={f}"]
    if append:
        kargs += " " + append
    acc = accel()
    accel_args = ["-accel", "kvm", "-accel", "tcg", "-cpu", "max"] if acc == "kvm" else ["-accel", "tcg", "-cpu", "max"]
    return [QEMU, "-nodefaults", "-no-user-config", "-machine", "pc", *accel_args, "-smp", "1", "-m", str(mem),
            "-display", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", str(cache / "vmlinuz"), "-initrd", str(initrd or cache / "initramfs.cpio.gz"), "-append", kargs,
            "-netdev", f"{netdev},id=n0", "-device", f"virtio-net-pci,netdev=n0,mac={mac},romfile=", *extra]


def vhost_user_argv(path, cmd: str | None, *, workdir: Path, listen: bool = False, mem: int = 256, smp: int = 1,
                    **kwargs) -> list[str]:
    """:func:`qemu_argv` for a ``-netdev vhost-user`` NIC on the UNIX socket ``path`` (QEMU connects;
    with ``listen`` QEMU listens there and waits for the back end), the guest's RAM in a shared memfd
    (vhost-user needs it). ``smp``: guest CPUs."""
    argv = qemu_argv("vhost-user,chardev=vu0", cmd, workdir=workdir, mem=mem, **kwargs)
    at = argv.index("-netdev")
    argv[at:at] = ["-chardev", f"socket,id=vu0,path={path},server={'on' if listen else 'off'}",
                   "-object", f"memory-backend-memfd,id=mem0,size={mem}M,share=on", "-machine", "memory-backend=mem0"]
    if smp != 1:
        argv[argv.index("-smp") + 1] = str(smp)
    return argv


def newc_archive(files: dict[str, tuple[bytes, int]]) -> bytes:
    """A cpio archive in the kernel's initramfs format ("newc", ``070701`` headers) holding
    ``files``: archive path (no leading ``/``, e.g. ``"bin/bench"``) -> (content, permission
    bits, e.g. ``0o755``); regular files owned by root, then the ``TRAILER!!!`` entry.
    The folders must exist in the archive this one is unpacked over."""
    out = bytearray()

    def entry(ino: int, name: str, mode: int, data: bytes) -> None:
        raw = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0)
        out.extend(b"070701" + b"".join(b"%08X" % f for f in fields) + raw)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, (data, perm)) in enumerate(files.items(), start=1):
        entry(ino, name.lstrip("/"), 0o100000 | (perm & 0o7777), data)
    entry(0, "TRAILER!!!", 0, b"")
    return bytes(out)


def initrd_with(files: dict[str, tuple[bytes, int]], dest: Path, cache: Path | None = None) -> Path:
    """Write to ``dest`` the kit's ``initramfs.cpio.gz`` followed by a second gzip'd
    :func:`newc_archive` of ``files`` (the kernel unpacks concatenated archives in order, so
    these files are added to, or replace, the kit's); the kit's cache is left untouched.
    Returns ``dest``, for :func:`qemu_argv`'s ``initrd``."""
    cache = cache or ensure_built()
    dest.write_bytes((cache / "initramfs.cpio.gz").read_bytes() + gzip.compress(newc_archive(files), mtime=0))
    return dest


@dataclass
class VmResult:
    """What a guest run produced. ``rc``: the snippet's status (None: no marker); ``lines``:
    ``(seconds since QEMU start, text)``; ``values``: ``KEY=VALUE`` lines (last wins)."""

    rc: int | None
    qemu_rc: int | None
    wall: float
    timed_out: bool
    lines: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    at: dict = field(default_factory=dict)  # KEY -> seconds since QEMU start when printed

    @property
    def console(self) -> str:
        return "\n".join(t for _, t in self.lines)

    def tail(self, n: int = 60) -> str:
        return "\n".join(t for _, t in self.lines[-n:])


_KV = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


class Vm:
    """A running guest: ``await Vm.start(argv)``, then ``await vm.wait(timeout)`` or ``vm.kill()``."""

    def __init__(self, proc: asyncio.subprocess.Process, t0: float) -> None:
        self.proc = proc
        self.t0 = t0
        self.result = VmResult(None, None, 0.0, False)
        self.seen: dict[str, asyncio.Event] = {}
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, argv: list[str], pass_fds=()) -> "Vm":
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, pass_fds=tuple(pass_fds))
        return cls(proc, t0)

    async def _read(self) -> None:
        res = self.result
        while True:
            raw = await self.proc.stdout.readline()
            if not raw:
                return
            text = raw.decode(errors="replace").rstrip("\r\n").replace("\r", "")
            now = time.monotonic() - self.t0
            res.lines.append((now, text))
            m = _KV.match(text.strip())
            if m:
                key, value = m.group(1), m.group(2)
                res.values[key] = value
                res.at.setdefault(key, now)
                ev = self.seen.get(key)
                if ev is not None:
                    ev.set()
            if text.startswith("GUESTVM-EXIT="):
                res.rc = int(text.split("=", 1)[1])

    async def wait_for_key(self, key: str, timeout: float) -> bool:
        if key in self.result.values:
            return True
        ev = self.seen.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait(self, timeout: float) -> VmResult:
        try:
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
        except asyncio.TimeoutError:
            self.result.timed_out = True
            self.kill()
            await self.proc.wait()
        await asyncio.wait_for(self._reader, 10)
        self.result.qemu_rc = self.proc.returncode
        self.result.wall = time.monotonic() - self.t0
        return self.result

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def run_vm(argv: list[str], timeout: float, pass_fds=()) -> VmResult:
    """Boot, run, power off; kills QEMU after ``timeout`` seconds (``timed_out`` set)."""
    vm = await Vm.start(argv, pass_fds)
    return await vm.wait(timeout)
