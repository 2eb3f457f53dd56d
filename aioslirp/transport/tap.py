"""TAP transport: Ethernet frames through a Linux ``/dev/net/tun`` device.

A TAP fd carries one whole Ethernet frame (destination MAC first, no preamble, no FCS)
per ``read``/``write``. The device is opened with ``IFF_TAP | IFF_NO_PI``, so there is no
packet-information prefix.

Facts this module is built on (see DESIGN section 6):

* when the last process of the guest's network namespace exits, the TAP fd gives
  neither EOF nor an error (reads say EAGAIN, writes succeed), so the transport can
  :meth:`~TapTransport.watch_pid` the guest process and close itself when it exits;
* interface down: writes fail with ``EIO`` (the frame is dropped and counted);
* interface deleted: ``EBADFD`` plus ``EPOLLERR``, which ends the transport.

Offload (``IFF_VNET_HDR``): a TAP created with ``vnet_hdr=True`` carries a 12-byte
``virtio_net_hdr_v1`` before every frame (:mod:`aioslirp.wire.offload`). :class:`TapTransport`
notices that flag on the fd (``TUNGETIFF``) and then strips the header from guest frames,
writes one before ours, and with ``offload=True`` enables checksum and TCP segmentation
offload (``TUNSETOFFLOAD`` ``CSUM|TSO4|TSO6``; :attr:`TapTransport.offload` says whether that
worked). The guest's TCP and UDP then arrive with partial checksums (``NEEDS_CSUM``) and TCP
as up to ~64 KB segments; the stack trusts the L4 checksum of frames flagged ``NEEDS_CSUM``
or ``DATA_VALID`` (they come from the guest's kernel over memory, never a wire) instead of
verifying it, and TCP flows send ~64 KB segments with partial checksums that the kernel
segments and completes. Measured gains are in ``docs/performance.md``.

Native reader (issue 26, :mod:`aioslirp.native`): with ``native=True`` (the default where the
extension is built, unless ``AIOSLIRP_NATIVE=0`` in the environment) each readiness of the fd is one call
into C (:meth:`aioslirp.native` ``Plane.read_tap``) that reads frames until ``EAGAIN`` or the batch
bound into a preallocated buffer (8 largest frames; a larger batch is read in several fills within
the call) and returns them in one batch, with the same checksum flags: the same frames reach the
same sink, as ``bytes``. Without the extension (not built, ``AIOSLIRP_NO_EXTENSIONS=1``, a stale
build) the Python reader runs, with one log line.

Rootless use needs ``/dev/net/tun`` to be world read-writable (mode 0666) and
``CAP_NET_ADMIN`` in the user namespace that owns the network namespace. Opening, creating
and configuring the device (:func:`~aioslirp.transport.tapdev.open_tap`,
:func:`~aioslirp.transport.tapdev.create_tap`, :func:`~aioslirp.transport.tapdev.set_interface_mtu`,
:func:`~aioslirp.transport.tapdev.enable_offload`, :class:`~aioslirp.transport.tapdev.TapError`) is
in :mod:`aioslirp.transport.tapdev`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from typing import Any, Callable, Sequence

from .. import native as native_plane
from ..wire.offload import VNET_HDR_LEN, VNET_NONE, OffloadFrame
from .base import MAX_FRAME, Transport
from .tapdev import (IFF_VNET_HDR, TapError, in_our_netns, link_is_up, open_tap, set_offload, set_vnet_header_size,
                     tap_flags)

__all__ = ["TapTransport"]

log = logging.getLogger("aioslirp.transport.tap")

#: Write errors after which the frame is dropped but the device is still usable.
_TRANSIENT_WRITE_ERRORS = {
    errno.EAGAIN: "eagain",  # queue full (non-blocking fd): never block the writer
    errno.EIO: "eio",  # interface is down
    errno.EINVAL: "invalid",  # frame the kernel refuses (too short / malformed)
    errno.EMSGSIZE: "too_big",
    errno.ENOBUFS: "nobufs",
    errno.ENOMEM: "nomem",
}


class TapTransport(Transport):
    """Frames to and from an open TAP fd (``IFF_TAP|IFF_NO_PI``, with or without ``IFF_VNET_HDR``).

    ``TapTransport(fd)`` takes ownership of ``fd`` (it is made non-blocking and closed by
    :meth:`close`). Reading uses ``loop.add_reader`` and reads until ``EAGAIN``, handing
    batches of at most ``batch`` frames (``list[bytes]``) to the stack. ``read_size`` is
    the largest frame accepted, in bytes (default :data:`~aioslirp.transport.base.MAX_FRAME`).

    When the device was opened with ``IFF_VNET_HDR`` (``open_tap(..., vnet_hdr=True)``) the
    transport handles the virtio-net header (:mod:`aioslirp.wire.offload`): guest frames are
    handed over as ``memoryview`` slices past it, with a second list of booleans, true where
    the guest's kernel flagged the L4 checksum as partial or valid (``sink(frames, csum_ok)``).
    With ``offload=True`` (the default) it also enables checksum/TSO offload
    (:func:`enable_offload`); :attr:`offload` is True when that succeeded, and then frames
    written may be :class:`~aioslirp.wire.offload.OffloadFrame` objects (partial checksum,
    up to ~64 KB). Without the flag on the fd, ``offload`` is ignored and stays False.

    ``native``: read with the native data plane (:mod:`aioslirp.native`): one call into C per
    readiness instead of one ``os.read`` per frame, the same frames and flags to the same sink
    (as ``bytes``; a preallocated buffer of 8 times ``read_size``). ``None`` (the default):
    native unless ``AIOSLIRP_NATIVE=0`` in the environment (:func:`aioslirp.native.wanted`). Where the extension is not usable the Python
    reader runs (one log line); :attr:`native` says which reader runs.

    Counters: ``frames_in``, ``frames_out``, ``send_errors`` (all dropped writes) and
    ``send_drops`` (dict reason -> count: ``eagain``, ``eio``, ``invalid``, ...).
    """

    __slots__ = ("_fd", "ifname", "_batch", "_read_size", "_reading", "_pidfds", "send_drops", "vnet_hdr", "offload",
                 "created", "native", "plane", "native_taken", "_tcp", "_tcp_ended")

    gone_hint = "the TAP device still exists (ip link show {ifname}) and the namespace holding it was not removed"

    _fd: int
    ifname: str | None
    _batch: int
    _read_size: int
    _reading: bool
    #: ``(pidfd, owned)``.
    _pidfds: list[tuple[int, bool]]
    send_drops: dict[str, int]
    vnet_hdr: bool
    offload: bool
    #: :meth:`open_by_name` made the device (no interface had that name): nothing else is attached to it.
    created: bool
    #: Guest frames are read by the native data plane (:mod:`aioslirp.native`), not ``os.read``.
    native: bool
    #: The native data plane of this transport (``aioslirp.native._dataplane.Plane``: its read buffer,
    #: and the native UDP flows when the stack enables them); ``None`` for the Python reader.
    plane: Any
    #: Called after a read in which native UDP flows moved guest frames in C (set by the stack's
    #: :class:`~aioslirp.nat.native_udp.NativeUdp`, which takes their counts from :attr:`plane`).
    native_taken: Callable[[], None] | None
    #: The native TCP engine given by :meth:`attach_tcp`, or ``None``, and what takes its records.
    _tcp: Any
    _tcp_ended: Callable[[], None] | None

    def __init__(self, fd: int, *, ifname: str | None = None, batch: int = 64, read_size: int = MAX_FRAME,
                 offload: bool = True, native: bool | None = None) -> None:
        super().__init__()
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self._fd = fd
        self.ifname = ifname
        self._batch = batch
        self._read_size = read_size
        self._reading = False
        self._pidfds: list[tuple[int, bool]] = []  # (pidfd, owned)
        self.send_drops: dict[str, int] = {}
        #: The fd carries a virtio-net header before every frame (``IFF_VNET_HDR``).
        self.vnet_hdr = False
        #: Checksum and TCP segmentation offload are on: the stack may write OffloadFrames.
        self.offload = False
        self.created = False
        try:
            self.vnet_hdr = bool(tap_flags(fd) & IFF_VNET_HDR)
        except OSError:  # not a TAP fd (tests pass other fds): plain frames
            pass
        if self.vnet_hdr:
            try:
                set_vnet_header_size(fd)
            except OSError as exc:
                raise TapError(exc.errno or errno.EINVAL,
                               f"TAP {ifname or fd}: cannot set the vnet header size: {exc.strerror}") from None
            self._read_size = read_size + VNET_HDR_LEN
            if offload:
                try:
                    set_offload(fd)
                    self.offload = True
                except OSError as exc:
                    log.warning("TAP %s: checksum/segmentation offload unavailable (%s); computing checksums",
                                ifname or fd, exc.strerror or exc)
        if native is None:
            native = native_plane.wanted()
        if native and native_plane.extension() is None:
            native_plane.log_fallback("TAP reader")
            native = False
        self.native = native
        self.plane = None
        if native:
            ext = native_plane.extension()
            assert ext is not None
            self.plane = ext.Plane(self._read_size, self._batch, self.vnet_hdr)
        self.native_taken = None
        self._tcp = None
        self._tcp_ended = None
        os.set_blocking(fd, False)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def open_by_name(cls, name: str = "tap0", **kwargs) -> "TapTransport":
        """Attach to TAP interface ``name`` in the current network namespace (create it if missing).

        Typical use: an interface made beforehand with ``ip tuntap add dev tap0 mode tap
        [user USER]``. Raises :class:`TapError` (one line: missing driver, ``/dev/net/tun``
        not 0666 for rootless use, no permission, device busy).
        """
        try:
            socket.if_nametoindex(name)
            existed = True
        except OSError:
            existed = False
        fd, actual = open_tap(name)
        t = cls(fd, ifname=actual, **kwargs)
        t.created = not existed
        return t

    @property
    def fd(self) -> int:
        """The TAP fd, or -1 once closed."""
        return self._fd

    def preflight(self) -> None:
        """Check, before serving, that the device can carry frames (:meth:`Stack.serve
        <aioslirp.stack.Stack.serve>` calls it). Raises :class:`TapError` (``ENETDOWN``, one line
        naming the device and the fix) when the TAP is in this network namespace and is down: the
        guest would send nothing and every frame for it would fail with ``EIO``. A TAP in another
        namespace (``aioslirp run`` / ``attach``, the slirp4netns drop-in) is not checked."""
        if self._fd < 0 or not self.ifname or in_our_netns(self._fd) is not True:
            return
        if link_is_up(self.ifname) is False and self.created:
            raise TapError(errno.ENODEV, f"no interface {self.ifname} existed: a new TAP of that name was made, but "
                                         f"nothing is attached to it; check the name (ip link show), or make the "
                                         f"device first (ip tuntap add dev {self.ifname} mode tap; "
                                         f"ip link set {self.ifname} up)")
        if link_is_up(self.ifname) is False:
            raise TapError(errno.ENETDOWN, f"TAP {self.ifname} is down, so no frame can pass: bring it up first "
                                           f"(ip link set {self.ifname} up) and give it an address "
                                           f"(ip addr add 10.0.2.15/24 dev {self.ifname})")

    # -- Transport interface --------------------------------------------------------------

    async def _start_reading(self) -> None:
        if self._fd < 0:  # closed before the stack opened us (e.g. watched process already gone)
            if self.closed is not None and not self.closed.done():
                self.closed.set_result(None)
            return
        assert self._loop is not None
        if self.native:
            self._read_natively()
        else:
            self._loop.add_reader(self._fd, self._on_readable)
        self._reading = True

    def guest_reader(self) -> tuple[int, Callable[[], None]] | None:
        """See :meth:`Transport.guest_reader`: the TAP fd and its reader (the native one with
        :attr:`native`: its frames of native TCP and UDP flows are moved in C, the rest handed on)."""
        if not self._reading or self._fd < 0:
            return None
        return self._fd, self._on_readable_native if self.native else self._on_readable

    def attach_tcp(self, engine, ended: Callable[[], None] | None = None) -> None:
        """Hand the guest frames of native TCP flows to ``engine`` (a ``TcpEngine`` of
        :mod:`aioslirp.native`, or ``None`` to stop) in the native reader, before the sink sees
        them (:mod:`aioslirp.nat.native_tcp`). ``ended()`` is called after a batch in which the
        engine ended flows (its records wait: ``engine.pending()``), instead of a timer wake-up.
        Only with :attr:`native`; ``ValueError`` otherwise."""
        if not self.native:
            raise ValueError("attach_tcp needs the native reader (native=True)")
        self._tcp = engine
        self._tcp_ended = ended
        if engine is not None:
            engine.hook_records(ended is not None)
        self.plane.attach_tcp(engine)
        if self._reading and self._fd >= 0:
            self._read_natively()  # the loop's reader gets the new hook

    def syn_lane(self, syn: Callable[..., bool] | None) -> None:
        """Hand the native reader's plain guest SYNs of no native flow to ``syn`` (``Link.syn``), not
        to the sink's batch, while a TCP engine is attached (:meth:`attach_tcp`); ``None`` stops it.
        Only with :attr:`native`; ``ValueError`` otherwise."""
        if not self.native:
            raise ValueError("syn_lane needs the native reader (native=True)")
        self.plane.syn_lane(syn)

    def after_batch(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook()`` at the end of each batch the native reader takes (``Plane.after``): the
        fair scheduler's safe point between one guest's batches (:meth:`aioslirp.fair.Seat.guest`),
        where the express lane serves the light guests. ``None``: nothing. Without :attr:`native`
        (the Python reader, whose flows have safe points of their own) it does nothing."""
        if self.native:
            self.plane.after(hook)

    def _reader_args(self) -> tuple:
        """The arguments of ``Plane.ready``: the fd, the loop's clock, where the frames left for
        Python go, the hook of frames native UDP flows took and that of ended native TCP flows."""
        loop = self._loop
        assert loop is not None
        return self._fd, loop.time, self._deliver_native, self._taken, self._tcp_ended

    def _read_natively(self) -> None:
        """(Re)register the native reader: ``Plane.ready`` itself, so that a wake-up whose frames all
        belong to native flows runs no Python frame (about 1 us a wake-up, 3 per short connection)."""
        loop = self._loop
        assert loop is not None
        loop.add_reader(self._fd, self.plane.ready, *self._reader_args())

    def _on_readable(self) -> None:
        """Read up to ``batch`` frames (until ``EAGAIN``) and hand them to the stack in one batch.

        With an ``IFF_VNET_HDR`` fd each read starts with the virtio-net header: it is stripped
        (a read of the header alone carries no frame) and its checksum flags go along, per frame,
        as ``csum_ok``. EOF or a read error closes the transport, after the frames read before it.
        """
        fd = self._fd
        if fd < 0:
            return
        read = os.read
        size = self._read_size
        frames: list = []
        csum_ok: list[bool] | None = None
        error: OSError | None = None
        try:
            if self.vnet_hdr:  # chosen once a batch: no per-frame test
                csum_ok = []
                for _ in range(self._batch):
                    data = read(fd, size)
                    if len(data) <= VNET_HDR_LEN:
                        if not data:
                            error = EOFError("TAP fd reached end of file")  # type: ignore[assignment]
                            break
                        continue  # a header without a frame: nothing to deliver
                    frames.append(memoryview(data)[VNET_HDR_LEN:])
                    csum_ok.append(bool(data[0] & 3))  # NEEDS_CSUM or DATA_VALID
            else:
                for _ in range(self._batch):
                    data = read(fd, size)
                    if not data:
                        error = EOFError("TAP fd reached end of file")  # type: ignore[assignment]
                        break
                    frames.append(data)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            error = exc
        self._deliver(frames, csum_ok, error)

    def _on_readable_native(self) -> None:
        """:meth:`_on_readable` in one call into the native data plane (``Plane.ready``, what the
        loop calls itself; this is the express lane's way in, :meth:`guest_reader`): the same frames
        (as ``bytes``), the same ``csum_ok``, the same end on EOF or a read error."""
        if self._fd >= 0:
            self.plane.ready(*self._reader_args())

    def _taken(self, n: int) -> None:
        """``Plane.ready``: native UDP flows took ``n`` guest frames and one of them needs Python now
        (a send failed or was refused; the plane counted the frames in the stack's counters, as it
        does on every read: :attr:`frames_in` counts the frames this transport hands to Python)."""
        hook = self.native_taken
        if hook is not None:
            hook()

    def _deliver_native(self, frames: list, csum_ok: list[bool] | None, end: int, err: int) -> None:
        """``Plane.ready``: frames left for Python, and how the reads ended (EOF, an error)."""
        error: BaseException | None = None
        if end == native_plane.READ_EOF:
            error = EOFError("TAP fd reached end of file")
        elif end == native_plane.READ_ERROR:
            error = OSError(err, os.strerror(err))
        self._deliver(frames, csum_ok, error)

    def _deliver(self, frames: list, csum_ok: list[bool] | None, error: BaseException | None) -> None:
        """Hand a batch read to the sink, then close on ``error`` (EOF or a read error)."""
        fd = self._fd
        if frames:
            self.frames_in += len(frames)
            sink = self._on_frames
            if sink is not None:
                if csum_ok is None:
                    sink(frames)
                else:
                    sink(frames, csum_ok)
        if error is not None:
            log.info("TAP %s: read failed (%s); closing", self.ifname or fd, error)
            self.close_reason = "error"
            self.close(error)

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Write each frame (one Ethernet frame per ``write``); never blocks, never raises for I/O.

        With a vnet header, each frame goes out with ``writev`` behind its header: ``frame.vnet``
        for an :class:`~aioslirp.wire.offload.OffloadFrame`, all zeroes otherwise.

        ``EAGAIN``/``EIO`` (interface down)/``EINVAL`` and similar drop the frame and count it
        in ``send_errors`` and ``send_drops``; ``EBADFD``/``EBADF`` and other fatal errors
        (interface deleted) close the transport with that error.
        """
        fd = self._fd
        if fd < 0:
            self._drop("closed", len(frames))
            return
        write = os.write
        writev = os.writev
        vnet = self.vnet_hdr
        sent = 0
        for i, frame in enumerate(frames):
            try:
                if vnet:
                    writev(fd, (frame.vnet if frame.__class__ is OffloadFrame else VNET_NONE, frame))
                else:
                    write(fd, frame)
                sent += 1
            except OSError as exc:
                reason = _TRANSIENT_WRITE_ERRORS.get(exc.errno or 0)
                if reason is None:
                    self.frames_out += sent
                    self._drop("fatal", len(frames) - i)
                    log.warning("TAP %s: write failed (%s); closing", self.ifname or fd, exc)
                    self.close_reason = "error"
                    self.close(exc)
                    return
                self._drop(reason)
        self.frames_out += sent

    def _drop(self, reason: str, n: int = 1) -> None:
        self.send_errors += n
        first = reason not in self.send_drops
        self.send_drops[reason] = self.send_drops.get(reason, 0) + n
        if first and reason != "closed":
            log.warning("TAP %s: dropping frames written to the guest (%s); counted in send_drops", self.ifname or self._fd, reason)

    def _close_io(self) -> None:
        loop = self._loop
        for pidfd, owned in self._pidfds:
            if loop is not None:
                loop.remove_reader(pidfd)
            if owned:
                os.close(pidfd)
        self._pidfds.clear()
        fd, self._fd = self._fd, -1
        if self._tcp is not None:  # the native TCP engine writes to the fd itself: not after this
            self._tcp.forget_tap()
        if fd >= 0:
            if self._reading and loop is not None:
                loop.remove_reader(fd)
            self._reading = False
            os.close(fd)

    # -- guest process watching -----------------------------------------------------------

    def watch_pid(self, pid: int) -> None:
        """Close this transport when process ``pid`` exits (``os.pidfd_open`` + a reader).

        Needed because a TAP fd gives no EOF when the guest namespace's last process exits.
        Must be called from the event loop thread (a running loop is required). If the
        process is already gone the transport closes at once.
        """
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            log.info("TAP %s: watched pid %d is already gone; closing", self.ifname or self._fd, pid)
            self._loop = self._loop or asyncio.get_running_loop()
            self._loop.call_soon(self.close)
            return
        self._watch(pidfd, owned=True)

    def watch_pidfd(self, pidfd: int) -> None:
        """Close this transport when the process behind ``pidfd`` exits.

        ``pidfd`` stays owned by the caller (it must stay open while watched). Must be
        called with a running event loop.
        """
        self._watch(pidfd, owned=False)

    def _watch(self, pidfd: int, owned: bool) -> None:
        if self._fd < 0:
            if owned:
                os.close(pidfd)
            return
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        self._pidfds.append((pidfd, owned))
        loop.add_reader(pidfd, self._on_pid_exit, pidfd)

    def _on_pid_exit(self, pidfd: int) -> None:
        log.info("TAP %s: watched guest process exited; closing", self.ifname or self._fd)
        self.close_reason = "guest_exited"
        self.close()
