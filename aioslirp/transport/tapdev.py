"""TAP devices: open, create and configure them through ``/dev/net/tun`` (the ``ioctl`` side).

A TAP is opened with ``IFF_TAP | IFF_NO_PI`` (whole Ethernet frames, no packet-information
prefix), optionally ``IFF_VNET_HDR`` (a 12-byte ``virtio_net_hdr_v1`` before every frame,
:mod:`aioslirp.wire.offload`), in the network namespace of the calling thread.
:class:`~aioslirp.transport.tap.TapTransport` moves the frames; the namespace children
(:mod:`aioslirp.host.nschild`) create the device where the guest lives.

Rootless use needs ``/dev/net/tun`` to be world read-writable (mode 0666) and
``CAP_NET_ADMIN`` in the user namespace that owns the network namespace; every failure is a
:class:`TapError` whose ``str()`` is one line saying what to do.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct

from ..wire.offload import VNET_HDR_LEN

__all__ = [
    "TapError",
    "check_ifname",
    "open_tap",
    "create_tap",
    "set_interface_mtu",
    "enable_offload",
    "set_offload",
    "set_vnet_header_size",
    "tap_flags",
    "TUN_PATH",
]

#: The clone device every TUN/TAP fd is opened from.
TUN_PATH = "/dev/net/tun"

TUNSETIFF = 0x400454CA
TUNGETIFF = 0x800454D2
TUNSETOFFLOAD = 0x400454D0
TUNSETVNETHDRSZ = 0x400454D8
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
#: TUNSETOFFLOAD bits: checksum offload, TCP segmentation offload for IPv4 and IPv6.
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
SIOCSIFMTU = 0x8922
IFNAMSIZ = 16

# struct ifreq: char ifr_name[16]; union { short flags; int mtu; ... } padded to 40 bytes.
_IFREQ_FLAGS = struct.Struct("16sH22x")
_IFREQ_INT = struct.Struct("16si20x")


class TapError(OSError):
    """Opening or creating a TAP device failed. ``str(err)`` is one line saying what to do.

    ``err.errno`` is the underlying errno (``EACCES``, ``ENOENT``, ``EPERM``, ``EBUSY``...).
    """

    def __init__(self, err: int, message: str) -> None:
        super().__init__(err, message)

    def __str__(self) -> str:
        return str(self.strerror)


def check_ifname(name: str) -> bytes:
    """``name`` as the bytes of an ``ifr_name``; raises :class:`TapError` (``EINVAL``, one line) for a name
    the kernel would refuse: empty, 16 bytes or more, ``/``, ``:``, a space, tab or newline, ``.`` / ``..``."""
    raw = name.encode()
    if not raw or len(raw) >= IFNAMSIZ or any(c in name for c in "/ \t\n:") or name in (".", ".."):
        raise TapError(errno.EINVAL, f"invalid interface name {name!r} (1-15 characters, no '/', ':' or spaces)")
    return raw


def open_tap(name: str = "tap0", *, vnet_hdr: bool = False) -> tuple[int, str]:
    """Open (and create if missing) TAP device ``name`` in the *current* network namespace.

    ``name`` may contain ``%d`` to let the kernel pick a free number. Returns
    ``(fd, actual_name)``; the fd is blocking, close-on-exec, and owned by the caller.
    The namespace is the one the calling thread is in when ``/dev/net/tun`` is opened.

    With ``vnet_hdr=True`` every frame carries a ``virtio_net_hdr`` prefix (``IFF_VNET_HDR``),
    which :class:`TapTransport` detects and handles (and uses for checksum/TSO offload).

    Raises :class:`TapError` with a one-line explanation: ``ENOENT`` (no tun driver),
    ``EACCES`` (``/dev/net/tun`` not mode 0666 for rootless use), ``EPERM`` (no
    ``CAP_NET_ADMIN``), ``EBUSY`` (device in use), ``EINVAL`` (bad name / not a TAP).
    """
    raw = check_ifname(name)
    try:
        fd = os.open(TUN_PATH, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TapError(
            errno.ENOENT,
            f"{TUN_PATH} does not exist: load the tun driver (modprobe tun) or create it (mknod {TUN_PATH} c 10 200)",
        ) from None
    except PermissionError:
        raise TapError(
            errno.EACCES,
            f"permission denied opening {TUN_PATH}: for rootless use it must be mode 0666 "
            f"(as root: chmod 0666 {TUN_PATH})",
        ) from None
    except OSError as exc:
        raise TapError(exc.errno or errno.EIO, f"cannot open {TUN_PATH}: {exc.strerror}") from None
    flags = IFF_TAP | IFF_NO_PI | (IFF_VNET_HDR if vnet_hdr else 0)
    try:
        res = fcntl.ioctl(fd, TUNSETIFF, _IFREQ_FLAGS.pack(raw, flags))
    except OSError as exc:
        os.close(fd)
        e = exc.errno or errno.EIO
        if e == errno.EPERM:
            msg = (
                f"creating TAP device {name!r} needs CAP_NET_ADMIN: run as root, inside a user namespace "
                f"(aioslirp run does this), or use a TAP made for your user (ip tuntap add dev {name} mode tap user $USER)"
            )
        elif e == errno.EBUSY:
            msg = f"TAP device {name!r} is already in use by another process"
        elif e == errno.EINVAL:
            msg = f"cannot attach to {name!r}: it exists but is not a TAP device with these flags"
        else:
            msg = f"TUNSETIFF on {name!r} failed: {os.strerror(e)}"
        raise TapError(e, msg) from None
    actual = _IFREQ_FLAGS.unpack(res)[0].rstrip(b"\0").decode()
    return fd, actual


def set_interface_mtu(name: str, mtu: int) -> None:
    """Set the MTU (bytes) of interface ``name`` in the current network namespace (``SIOCSIFMTU``).

    Raises :class:`TapError` (``EINVAL`` for an MTU the device refuses, ``EPERM`` without CAP_NET_ADMIN).
    """
    raw = check_ifname(name)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            fcntl.ioctl(s, SIOCSIFMTU, _IFREQ_INT.pack(raw, int(mtu)))
        except OSError as exc:
            raise TapError(exc.errno or errno.EIO, f"cannot set MTU {mtu} on {name!r}: {exc.strerror}") from None


def create_tap(name: str = "tap0", mtu: int | None = 1500, *, vnet_hdr: bool = False) -> tuple[int, str]:
    """Create TAP device ``name`` in the current network namespace and set its MTU.

    Meant to run inside the guest's namespace (``aioslirp run`` / ``attach`` helpers), with
    ``CAP_NET_ADMIN`` there. Returns ``(fd, actual_name)`` like :func:`open_tap`; the
    link is left down and unaddressed (see :func:`aioslirp.host.ifconfig.configure_interface`).
    ``mtu=None`` keeps the kernel default (1500). Raises :class:`TapError`.
    """
    fd, actual = open_tap(name, vnet_hdr=vnet_hdr)
    if mtu is not None:
        try:
            set_interface_mtu(actual, mtu)
        except BaseException:
            os.close(fd)
            raise
    return fd, actual


def tap_flags(fd: int) -> int:
    """The ``IFF_*`` flags of the TAP behind ``fd`` (``TUNGETIFF``); raises ``OSError``."""
    return _IFREQ_FLAGS.unpack(fcntl.ioctl(fd, TUNGETIFF, bytes(_IFREQ_FLAGS.size)))[1]


def set_vnet_header_size(fd: int) -> None:
    """On a TAP fd opened with ``IFF_VNET_HDR``: use the 12-byte ``virtio_net_hdr_v1``
    (``TUNSETVNETHDRSZ``). Raises ``OSError``."""
    fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", VNET_HDR_LEN))


def set_offload(fd: int) -> None:
    """On a TAP fd with a vnet header: turn on checksum and TCP segmentation offload
    (``TUNSETOFFLOAD`` ``CSUM|TSO4|TSO6``). Raises ``OSError`` (e.g. ``EINVAL`` from a kernel or
    device without these features)."""
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)


def enable_offload(fd: int) -> None:
    """On a TAP fd opened with ``IFF_VNET_HDR``: use the 12-byte header (``TUNSETVNETHDRSZ``) and
    turn on checksum and TCP segmentation offload (``TUNSETOFFLOAD`` ``CSUM|TSO4|TSO6``).

    Works rootless (the kernel checks no capability for these two). Raises ``OSError``
    (e.g. ``EINVAL`` from a kernel or device without these features).
    """
    set_vnet_header_size(fd)
    set_offload(fd)


TUNGETDEVNETNS = 0x54E3  # _IO('T', 227), Linux 5.9+
SIOCGIFFLAGS = 0x8913
IFF_UP = 0x1
_IFREQ_SHORT = struct.Struct("16sH14x")


def in_our_netns(fd: int) -> bool | None:
    """Whether the TAP behind ``fd`` lives in the calling thread's network namespace
    (``TUNGETDEVNETNS``); ``None`` when the kernel cannot tell (before 5.9, no
    ``CAP_NET_ADMIN`` over its namespace, not a TAP fd)."""
    try:
        nsfd = fcntl.ioctl(fd, TUNGETDEVNETNS)
    except OSError:
        return None
    try:
        st, ours = os.fstat(nsfd), os.stat("/proc/thread-self/ns/net")
        return (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino)
    except OSError:
        return None
    finally:
        os.close(nsfd)


def link_is_up(name: str) -> bool | None:
    """Whether interface ``name`` of the current network namespace is administratively up
    (``SIOCGIFFLAGS`` ``IFF_UP``); ``None`` when there is no such interface or it cannot be read."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            res = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, _IFREQ_SHORT.pack(check_ifname(name), 0))
    except (OSError, ValueError):
        return None
    return bool(_IFREQ_SHORT.unpack(res)[1] & IFF_UP)
