"""The native data plane (issue 26): per-frame work in C under the Python control plane.

Theory of operation
-------------------
The C core (``dataplane.c``, ``dataplane.h``: C11, no Python object in it) and its CPython binding
(``_dataplane.c``, limited API, one ``abi3`` module ``aioslirp.native._dataplane``) are built by
``setup.py`` when a C compiler is there (``aioslirp/native/sources.py`` names the files). This
module imports the extension or records why not, and is the one place that says whether the
native plane runs (:func:`status`, :func:`notice`, the ``native`` key of ``Stack.stats()`` and a
line of ``aioslirp --version``).

What is native so far:

* :func:`classify` / :meth:`Plane.classify`: the sans-IO frame classifier. Every length from the
  wire (virtio-net header, Ethernet, IPv4 IHL and total length, IPv6 payload length, TCP data
  offset and options, UDP length) is checked once against the buffer, giving a fixed-size record
  (:class:`FrameRecord`): ``tcp`` or ``udp`` (a NAT flow's candidate), ``not_native:<why>``
  (ARP, ICMP, an IPv4 fragment, IPv6 extension headers: the Python path), or ``drop:<reason>``
  with the reason the Python dispatch counts (``drop.bad_ip_length``...).
* :meth:`Plane.read_tap`: the TAP reader (:class:`~aioslirp.transport.tap.TapTransport` with
  ``native=True``): one call per readiness reads frames until ``EAGAIN`` (or the batch bound) into
  a preallocated buffer and returns them in one batch, with the virtio-net checksum flags.
* The TCP NAT flows Python admitted, both families (:class:`~aioslirp.nat.native_tcp.NativeTcp`,
  ``aioslirp/native/tcpnat.c``): the host connect, the whole TCP life after it, the host sockets
  behind one epoll; on a TAP and on a vhost-user device's rings.
* The UDP NAT flows Python admitted (IPv4;
  :class:`~aioslirp.nat.native_udp.NativeUdp`): their datagrams move in C both ways (the
  ``Plane.udp_*`` methods), with ``udp_frames`` / ``udp_checksum_ok`` the sans-IO pieces.

The switches:

* ``AIOSLIRP_NO_EXTENSIONS=1`` (:data:`aioslirp.compiled.ENV`): nothing native; the extension is
  not even imported.
* On by default where the extension is built: the TAP reader, guest TCP NAT flows (both
  families; :class:`~aioslirp.nat.native_tcp.NativeTcp`, :func:`tcp_wanted`) and UDP NAT flows
  (IPv4; :class:`~aioslirp.nat.native_udp.NativeUdp`, :func:`udp_wanted`). ``AIOSLIRP_NATIVE``
  (:data:`ENABLE_ENV`) narrows it: ``0`` (or ``off``, :data:`OFF_VALUES`) runs the Python path
  alone, ``tcp`` TCP flows only, ``udp`` UDP flows only, ``tcp,udp`` (or ``1``) both (the
  default, :data:`DEFAULT_PARTS`); an unknown part is warned about once and ignored. A
  transport's ``native=True`` or ``False`` overrides it for that transport. A stack the native
  plane cannot serve alike keeps its flows on the Python path, with one log line: rate caps the
  engine does not take, pcap.
* A missing extension (no compiler at install time), one that does not load, or one whose C
  files changed since it was built (by SHA-256, :data:`~aioslirp.native.sources.RECORD`): off,
  with the reason, and one log line when a transport falls back (:func:`log_fallback`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

from .. import compiled
from .sources import DEPENDS, EXTENSION, RECORD

__all__ = ["ENABLE_ENV", "READ_EOF", "READ_ERROR", "FrameRecord", "classify", "enabled", "extension", "load_extension", "log_fallback", "notice", "record",
           "status", "tcp_wanted", "udp_wanted", "wanted", "why_not"]

log = logging.getLogger("aioslirp.native")

#: ``AIOSLIRP_NATIVE=0`` switches the native data plane off (on by default where it is built).
ENABLE_ENV = "AIOSLIRP_NATIVE"

#: How ``Plane.read_tap`` ended (``enum dp_read_end`` of dataplane.h; the extension's
#: ``READ_EOF``/``READ_ERROR``): a read returned 0 / a read failed (its errno comes along).
READ_EOF = 3
READ_ERROR = 4

_HERE = os.path.dirname(os.path.abspath(__file__))


def load_extension(name: str, record: str, depends: tuple[str, ...]) -> tuple[ModuleType | None, str]:
    """``(module, "")`` for the native extension ``name``, or ``(None, why not)``: switched off
    (``AIOSLIRP_NO_EXTENSIONS``), not built, not loadable, or stale (a file of ``depends`` changed
    since the build hashed it into ``record``, a file beside this module). The one rule for every
    native extension of the package (the data plane's, the vhost-user rings')."""
    if compiled.disabled():
        return None, f"{compiled.ENV} is set"
    try:
        ext = importlib.import_module(name)  # a native module only: no .py of that name
    except ModuleNotFoundError:
        return None, "not built: no C compiler at install time"
    except ImportError as exc:
        return None, f"cannot load {name}: {exc}"
    changed = compiled.changed_since_build(os.path.join(_HERE, record), depends)
    if changed:
        return None, f"stale build: {changed[0]} changed since; {compiled.rebuild_hint()}"
    return ext, ""


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """``(extension, "")``, or ``(None, why not)``: imported once per process."""
    return load_extension(EXTENSION, RECORD, DEPENDS)


def extension() -> ModuleType | None:
    """The extension module ``aioslirp.native._dataplane``, or ``None`` (:func:`why_not` says why)."""
    return _load()[0]


def why_not() -> str:
    """Why the extension is not usable (``"AIOSLIRP_NO_EXTENSIONS is set"``, ``"not built: ..."``,
    ``"stale build: ..."``), or ``""`` when it is."""
    return _load()[1]


#: The values of ``AIOSLIRP_NATIVE`` that switch the native data plane off (the Python path runs).
OFF_VALUES = frozenset({"0", "off", "no", "false", "python"})

#: The values of ``AIOSLIRP_NATIVE`` (or parts of its list) that mean every part, as if unset.
ON_VALUES = frozenset({"1", "on"})

#: What an unset ``AIOSLIRP_NATIVE`` means: the native plane runs guest TCP and UDP NAT flows.
DEFAULT_PARTS = frozenset({"tcp", "udp"})


def _parts() -> set[str]:
    """The parts of ``AIOSLIRP_NATIVE``, a comma list of ``tcp`` and ``udp``: unset, empty, ``1`` or
    ``on`` is :data:`DEFAULT_PARTS`; one of :data:`OFF_VALUES` is none."""
    raw = os.environ.get(ENABLE_ENV, "").replace(" ", "").lower()
    if not raw:
        return set(DEFAULT_PARTS)
    if raw in OFF_VALUES:
        return set()
    parts: set[str] = set()
    for p in raw.split(","):
        parts |= DEFAULT_PARTS if p in ON_VALUES else {p} if p else set()
    unknown = parts - DEFAULT_PARTS
    if unknown:
        _warn_unknown(",".join(sorted(unknown)))
    return parts & DEFAULT_PARTS


@functools.cache
def _warn_unknown(parts: str) -> None:
    log.warning("%s: unknown part %r ignored (give tcp, udp, tcp,udp or 0)", ENABLE_ENV, parts)


def wanted() -> bool:
    """True unless ``AIOSLIRP_NATIVE`` switches the plane off (``0``; :data:`OFF_VALUES`), or names
    neither ``tcp`` nor ``udp`` (read at each call): the default of a transport's ``native``."""
    return bool(_parts() & {"tcp", "udp"})


def udp_wanted() -> bool:
    """True when ``AIOSLIRP_NATIVE`` is unset or holds ``udp``: ``Stack.serve`` moves admitted UDP flows to a native
    TAP transport's plane (:class:`~aioslirp.nat.native_udp.NativeUdp`)."""
    return "udp" in _parts()


def tcp_wanted() -> bool:
    """True when ``AIOSLIRP_NATIVE`` is unset or holds ``tcp`` (or ``1``): ``Stack.serve`` runs admitted guest TCP NAT
    flows on a native TAP transport's engine (:class:`~aioslirp.nat.native_tcp.NativeTcp`)."""
    return "tcp" in _parts()


def enabled() -> bool:
    """True when the extension is usable and :func:`wanted`."""
    return extension() is not None and wanted()


def yield_point() -> Callable[..., object] | None:
    """The native plane's ``set_yield(fd, serve, every_us)`` (the fair scheduler's yield point,
    :meth:`aioslirp.fair.SparseLane.use_yield`) when the plane runs (:func:`enabled`), else None."""
    ext = extension() if wanted() else None
    return getattr(ext, "set_yield", None)


def status() -> str:
    """``"on"`` (every part), ``"on (tcp only)"`` / ``"on (udp only)"`` (``AIOSLIRP_NATIVE`` named one),
    or ``"off (<reason>)"``: switched off, not built, stale."""
    if extension() is None:
        return f"off ({why_not()})"
    parts = _parts()
    if not parts:
        return f"off ({ENABLE_ENV}={os.environ.get(ENABLE_ENV, '')}: the Python path runs)"
    return "on" if parts >= DEFAULT_PARTS else f"on ({', '.join(sorted(parts))} only)"


def notice() -> str:
    """The line ``aioslirp --version`` prints: ``native data plane: on`` or ``native data plane: off (...)``."""
    return f"native data plane: {status()}"


@functools.cache
def log_fallback(what: str) -> None:
    """Log once per process (and per ``what``, e.g. ``"TAP reader"``) that the Python path runs
    because the extension is not usable."""
    log.info("native data plane: off for the %s (%s); the Python path runs", what, why_not())


class FrameRecord(NamedTuple):
    """One frame classified by the C core (offsets from the start of the buffer given, which
    begins with the 12-byte virtio-net header when ``vnet``).

    ``kind``: ``"tcp"``, ``"udp"``, ``"not_native:<why>"`` (``arp``, ``icmp``, ``fragment``,
    ``ipv6_ext``) or ``"drop:<reason>"`` (the name the Python dispatch counts, IPv6 names for an
    IPv6 frame's L4 reasons: ``drop:tcp6_truncated``). ``flags``: 1 checksum flagged valid or
    partial by the vnet header, 2 the buffer has a vnet header, 4 IPv6. ``proto``: the IPv4
    protocol or IPv6 next header. For ``tcp``/``udp``: ``l3_off < l4_off < payload_off``,
    ``payload_off + payload_len <= end <= len(buf)``, ``end`` the end of the IP packet (Ethernet
    padding excluded); ``src``/``dst`` 4 or 16 bytes (``b""`` before the IP header).
    """

    kind: str
    flags: int
    proto: int
    tcp_flags: int
    ethertype: int
    l2_off: int
    l3_off: int
    l4_off: int
    payload_off: int
    payload_len: int
    end: int
    sport: int
    dport: int
    src: bytes
    dst: bytes


@functools.cache
def _names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    ext = extension()
    assert ext is not None
    return ext.reason_names(), ext.reason_names6()


_KINDS = ("drop:", "tcp", "udp", "not_native:")


def record(raw: tuple) -> FrameRecord:
    """A :class:`FrameRecord` from the binding's tuple (``_dataplane.classify``/``Plane.classify``)."""
    kind, reason, flags, *rest = raw
    names4, names6 = _names()
    prefix = _KINDS[kind]
    if kind == 0 or kind == 3:
        prefix += (names6 if flags & 4 else names4)[reason]
    return FrameRecord(prefix, flags, *rest)


def classify(buf, vnet: bool = False) -> FrameRecord:
    """Classify one frame (bytes-like; with a leading virtio-net header when ``vnet``) in C.
    Raises ``RuntimeError`` when the extension is not usable (:func:`why_not`)."""
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the native data plane is off: {why_not()}")
    return record(ext.classify(buf, vnet))
