"""The backends the harness compares, each attached to a fresh network namespace.

Every backend gives the namespace the same view: interface ``tap0`` (``eth0`` for veth)
with 10.0.2.15/24 and a default route via 10.0.2.2, where 10.0.2.2 reaches the host-side
servers:

* ``aioslirp`` / ``aioslirp-65520``: ``python -m aioslirp attach --netns NS tap0`` (default
  options / ``--mtu 65520``); 10.0.2.2 is mapped to the host's 127.0.0.1.
* ``slirp4netns-1500`` / ``slirp4netns-65520``: ``slirp4netns --configure --mtu M
  --netns-type=path NS tap0``; 10.0.2.2 reaches 127.0.0.1 (host loopback is allowed by
  default, i.e. no ``--disable-host-loopback``).
* ``pasta`` (the one in PATH, Debian's) and ``pasta-RELEASE`` for each ``--pasta PATH`` (e.g.
  ``pasta-2026_07_16``, built by ``../shared/peers/build.sh``): ``pasta -f --runas 0:0 --config-net
  -a 10.0.2.15 -n 24 -g 10.0.2.2 --netns NS`` with its
  default MTU 65520 and no automatic port forwarding (``-t/-u/-T/-U none``); connections
  to the gateway address are mapped to the host's loopback (pasta's default; ``--no-map-gw``
  would turn that off).
* ``veth``: a kernel veth pair, 10.0.2.2 on the host side; the servers bind that address.

Only ``Backend.pid`` processes are counted as backend CPU and memory (the veth reference
has none: the kernel's work is charged to the client and servers).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Sequence

GW = "10.0.2.2"
GUEST = "10.0.2.15"
PREFIX = 24


class BackendError(RuntimeError):
    pass


def _sh(cmd: Sequence[str]) -> None:
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if p.returncode != 0:
        raise BackendError(f"{' '.join(cmd)}: {p.stderr.strip() or p.returncode}")


def in_ns(ns: str, cmd: Sequence[str]) -> list[str]:
    return ["nsenter", f"--net={ns}", "--", *cmd]


class Backend:
    """One backend. ``start(ns, preexec, log)`` attaches it to namespace file ``ns``."""

    name = "?"
    server_addr = "127.0.0.1"
    gateway = GW
    description = ""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def argv(self, ns: str) -> list[str]:
        raise NotImplementedError

    def start(self, ns: str, preexec: Callable[[], None], log_path: str) -> None:
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(self.argv(ns), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=preexec)
        time.sleep(0.05)
        if self.proc.poll() is not None:
            raise BackendError(f"{self.name} exited at once with status {self.proc.returncode} (see {log_path})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def version(self) -> str:
        return ""

    def stats(self) -> dict | None:
        """The backend's own counters (``{name: n}``), when it can tell them; else ``None``."""
        return None


def _dpkg_version(pkg: str) -> str:
    p = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "unknown"


class Aioslirp(Backend):
    def __init__(self, mtu: int | None = None, python: str | None = None, extra: Sequence[str] = (),
                 python_args: Sequence[str] = (), name: str | None = None, tree: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__()
        #: Environment variables for the backend's process (e.g. ``AIOSLIRP_NATIVE=1``: the native data plane).
        self.env = dict(env or {})
        self.mtu = mtu
        self.python = python or sys.executable
        self.extra = list(extra)
        self.python_args = list(python_args)  # e.g. ["-m", "cProfile", "-o", FILE] for profiling
        #: Directory holding another ``aioslirp`` package to run instead (A/B of code changes).
        self.tree = tree
        self.name = name or ("aioslirp" if mtu is None else f"aioslirp-{mtu}")
        self.description = "aioslirp attach, default options" if mtu is None else f"aioslirp attach --mtu {mtu}"
        if extra:
            self.description += " " + " ".join(extra)
        if tree:
            self.description += f" (package from {tree})"
        if self.env:
            self.description += " with " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))

    def start(self, ns: str, preexec: Callable[[], None], log_path: str) -> None:
        # The control API beside the log (idle on its Unix socket: no cost per frame): the idle test
        # reads the counters through it (stats()), e.g. the connects the guard refused.
        self.api_path = log_path + ".api"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.api_path)
        if not self.tree and not self.env:
            return super().start(ns, preexec, log_path)
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *self.env)}
        if self.tree:
            old = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = self.tree + (os.pathsep + old if old else "")
        os.environ.update(self.env)
        try:
            # cwd "/" so that "-m" does not import a package from the current directory first
            self._log = open(log_path, "ab")
            self.proc = subprocess.Popen(self.argv(ns), stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=preexec, cwd="/")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        time.sleep(0.05)
        if self.proc.poll() is not None:
            raise BackendError(f"{self.name} exited at once with status {self.proc.returncode} (see {log_path})")

    def argv(self, ns: str) -> list[str]:
        mtu = ["--mtu", str(self.mtu)] if self.mtu else []
        api = ["--api-socket", self.api_path] if getattr(self, "api_path", None) else []
        return [self.python, *self.python_args, "-m", "aioslirp", "attach", "--netns", ns, *mtu, *api, *self.extra,
                "tap0"]

    def stats(self) -> dict | None:
        """Every non-zero counter of the running backend (``get_stats`` on its control API), or
        ``None`` when it does not answer within 5 s."""
        path = getattr(self, "api_path", None)
        if not path:
            return None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
                s.sendall(b'{"execute": "get_stats"}')
                s.shutdown(socket.SHUT_WR)
                buf = b""
                while chunk := s.recv(65536):
                    buf += chunk
            counters = json.loads(buf)["return"]["counters"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return {k: v for k, v in sorted(counters.items()) if v}

    def version(self) -> str:
        """``0.1.0 (compiled)`` / ``0.1.0 (pure Python)``: the first line of ``aioslirp --version``
        and whether its second says the compiled per-frame path is on."""
        p = subprocess.run([self.python, "-m", "aioslirp", "--version"], capture_output=True, text=True)
        lines = p.stdout.strip().splitlines() or ["unknown"]
        version = lines[0].split()[-1]
        if len(lines) > 1:
            version += " (compiled)" if ": on" in lines[1] else " (pure Python)"
        return version


class Slirp4netns(Backend):
    def __init__(self, mtu: int) -> None:
        super().__init__()
        self.mtu = mtu
        self.name = f"slirp4netns-{mtu}"
        self.description = f"slirp4netns --configure --mtu {mtu}"
        self._ready_w: int | None = None

    def argv(self, ns: str) -> list[str]:
        assert self._ready_w is not None
        return ["slirp4netns", "--configure", f"--mtu={self.mtu}", "--netns-type=path",
                f"--ready-fd={self._ready_w}", ns, "tap0"]

    def start(self, ns: str, preexec: Callable[[], None], log_path: str) -> None:
        r, w = os.pipe()
        self._ready_w = w
        self._log = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(ns), stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=preexec, pass_fds=(w,))
        finally:
            os.close(w)
        try:
            ready, _, _ = select.select([r], [], [], 15)
            if not ready or os.read(r, 1) != b"1":
                raise BackendError(f"slirp4netns did not report ready (see {log_path})")
        finally:
            os.close(r)

    def version(self) -> str:
        return _dpkg_version("slirp4netns")


def pasta_version(binary: str) -> str:
    """The release a pasta binary reports (``pasta 2026_07_16.090d739`` -> ``2026_07_16.090d739``), or ""."""
    try:
        p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    first = (p.stdout or p.stderr).strip().splitlines()[:1]
    words = first[0].split() if first else []
    return words[1] if len(words) >= 2 and words[0] in ("pasta", "passt") else ""


def pasta_name(version: str) -> str:
    """Backend name of a pasta build: ``pasta-`` and its release date
    (``2026_07_16.090d739`` -> ``pasta-2026_07_16``)."""
    return "pasta-" + (version.split(".")[0] or "custom") if version else "pasta-custom"


class Pasta(Backend):
    """pasta: the one in PATH (Debian's, named ``pasta``) or the binary ``binary`` (named by its
    ``--version``, e.g. ``pasta-2026_07_16``, unless ``name`` is given)."""

    def __init__(self, mtu: int = 65520, binary: str | None = None, name: str | None = None) -> None:
        super().__init__()
        self.mtu = mtu
        self.binary = binary
        self._version = pasta_version(binary) if binary else None
        if name:
            self.name = name
        elif binary:
            self.name = pasta_name(self._version or "")
        else:
            self.name = "pasta" if mtu == 65520 else f"pasta-{mtu}"
        self.description = f"pasta --config-net (MTU {mtu}, gateway mapped to host loopback)"
        if binary:
            self.description += f", built from upstream ({os.path.basename(binary)} {self._version or '?'})"

    def available(self) -> bool:
        if self.binary:
            return os.access(self.binary, os.X_OK)
        return shutil.which("pasta") is not None

    def argv(self, ns: str) -> list[str]:
        # As root pasta would switch to "nobody", which may not setns() into our namespace.
        return [self.binary or "pasta", "-f", "-q", "--runas", "0:0", "-4", "--config-net", "-a", GUEST, "-n",
                str(PREFIX), "-g", GW, "-m", str(self.mtu), "-I", "tap0", "-t", "none", "-u", "none", "-T", "none",
                "-U", "none", "--netns", ns]

    def version(self) -> str:
        if self.binary:
            return self._version or "unknown"
        return _dpkg_version("passt")


def pasta_from_spec(spec: str, taken: Sequence[str] = ()) -> Pasta:
    """A pasta backend from ``PATH`` or ``NAME=PATH``; a name already in ``taken`` gets a suffix."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = "", spec
    b = Pasta(binary=os.path.abspath(path), name=name or None)
    base, i = b.name, 2
    while b.name in taken:
        b.name = f"{base}-{i}"
        i += 1
    return b


class Veth(Backend):
    """Kernel reference: a veth pair; no user-space process."""

    name = "veth"
    server_addr = GW
    description = "kernel veth pair (reference; no backend process)"

    def __init__(self) -> None:
        super().__init__()
        self.host_if = "bveth0"

    def start(self, ns: str, preexec: Callable[[], None], log_path: str) -> None:
        _sh(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _sh(["ip", "addr", "add", f"{GW}/{PREFIX}", "dev", self.host_if])
        _sh(["ip", "link", "set", self.host_if, "up"])
        _sh(in_ns(ns, ["ip", "addr", "add", f"{GUEST}/{PREFIX}", "dev", "eth0"]))
        _sh(in_ns(ns, ["ip", "link", "set", "eth0", "up"]))
        _sh(in_ns(ns, ["ip", "route", "add", "default", "via", GW]))

    def stop(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)

    def version(self) -> str:
        return os.uname().release


def all_backends(python: str | None = None) -> list[Backend]:
    """The default line-up, in the order tables list them."""
    return [
        Aioslirp(None, python),
        Aioslirp(65520, python),
        Pasta(65520),
        Slirp4netns(1500),
        Slirp4netns(65520),
        Veth(),
    ]
