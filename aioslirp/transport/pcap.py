"""Capture wrapper: every frame in both directions of any transport, to a pcap file.

:class:`PcapTransport` wraps another :class:`~aioslirp.transport.base.Transport` (TAP,
QEMU stream/dgram, socket pair...): frames the guest sends are recorded before the stack
sees them, frames for the guest once the inner transport took them. Records go to a
:class:`PcapWriter`: appended to an in-memory buffer on the event loop (one ``struct.pack``
and two list appends per frame) and written by a writer thread, so a slow disk never
stalls the loop. The buffer is handed to the thread when it holds :data:`FLUSH_BYTES` or
every :data:`FLUSH_INTERVAL` seconds; :meth:`PcapWriter.close` hands over the rest and
waits for the thread, so the file is complete when it returns. (aiofiles would run the
same writes on a thread pool; one dedicated thread keeps them in order and lets ``close``
flush synchronously from a transport's ``close``.)

File format: classic libpcap (magic ``0xa1b2c3d4``, version 2.4, microsecond timestamps,
link type 1 = Ethernet, snap length 262144), readable by tcpdump, tshark/Wireshark and
``dpkt.pcap.Reader``. ``max_bytes`` bounds the file: once the next record would pass it,
capturing stops (counted in :attr:`PcapWriter.not_captured`, logged once). If the writer
falls behind by more than :data:`MAX_BACKLOG` bytes, frames are left out of the capture
(counted the same way) rather than growing memory without bound.
"""

from __future__ import annotations


import logging
import queue
import struct
import threading
import time
from typing import Sequence

from .base import Transport, TransportWrapper

log = logging.getLogger("aioslirp.transport.pcap")

__all__ = ["PcapTransport", "PcapWriter", "PCAP_HEADER_LEN", "SNAPLEN", "FLUSH_BYTES", "FLUSH_INTERVAL", "MAX_BACKLOG"]

#: libpcap global header: magic, version 2.4, thiszone, sigfigs, snaplen, linktype (Ethernet).
SNAPLEN = 262144
_GLOBAL = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, SNAPLEN, 1)
PCAP_HEADER_LEN = len(_GLOBAL)
_REC = struct.Struct("<IIII")  # ts_sec, ts_usec, incl_len, orig_len

#: Buffered bytes that trigger a hand-off to the writer thread.
FLUSH_BYTES = 256 * 1024
#: Seconds between hand-offs when traffic is light.
FLUSH_INTERVAL = 0.25
#: Bytes handed to the writer thread but not yet written, beyond which frames are not captured.
MAX_BACKLOG = 64 * 1024 * 1024


class PcapWriter:
    """A pcap file being written: the buffer on the loop's side, the writer thread, the bound.

    ``PcapWriter(path, max_bytes=None)`` creates (truncates) ``path`` and writes the global
    header at once (``OSError`` if it cannot). :meth:`record` is called on the event loop
    thread with a batch of frames; :meth:`close` writes out the rest and waits for the
    thread (idempotent). Several :class:`PcapTransport` objects may share one writer (a
    stack serving one guest after another).

    Counters: ``captured`` (frames recorded), ``not_captured`` (frames left out: bound
    reached or writer backlog), ``bytes_written`` (file size, bytes handed to the thread
    included).
    """

    __slots__ = ("path", "max_bytes", "captured", "not_captured", "bytes_written", "_file", "_chunks", "_buffered",
                 "_backlog", "_backlog_lock", "_full", "_timer", "_closed", "_q", "_thread")

    path: str
    max_bytes: int | None
    captured: int
    not_captured: int
    bytes_written: int
    _file: object
    #: Records waiting on the loop's side for the next hand-over to the thread.
    _chunks: list
    _buffered: int
    #: Bytes handed to the thread and not written yet.
    _backlog: int
    _backlog_lock: threading.Lock
    _full: bool
    _timer: object
    _closed: bool
    _q: queue.SimpleQueue
    _thread: threading.Thread

    def __init__(self, path: str, *, max_bytes: int | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.captured = 0
        self.not_captured = 0
        self.bytes_written = PCAP_HEADER_LEN
        self._file = open(path, "wb")
        self._file.write(_GLOBAL)
        self._chunks: list = []
        self._buffered = 0
        self._backlog = 0
        self._backlog_lock = threading.Lock()
        self._full = False
        self._timer = None
        self._closed = False
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="aioslirp-pcap", daemon=True)
        self._thread.start()

    def record(self, frames, loop=None) -> None:
        """Append one record per frame (timestamp now); never blocks. ``loop`` arms the flush timer."""
        if self._closed or self._full:
            if frames:
                self.not_captured += len(frames)
            return
        t = time.time()
        sec = int(t)
        usec = int((t - sec) * 1e6)
        chunks = self._chunks
        pack = _REC.pack
        limit = self.max_bytes
        added = 0
        for i, f in enumerate(frames):
            n = len(f)
            incl = n if n <= SNAPLEN else SNAPLEN
            size = 16 + incl
            if limit is not None and self.bytes_written + size > limit:
                self._full = True
                self.not_captured += len(frames) - i
                log.warning("pcap %s reached --pcap-max-bytes (%d bytes); capture stopped", self.path, limit)
                break
            if self._backlog + self._buffered + added > MAX_BACKLOG:
                self.not_captured += 1
                continue
            chunks.append(pack(sec, usec, incl, n))
            chunks.append(f if incl == n and type(f) is bytes else bytes(memoryview(f)[:incl]))
            added += size
            self.bytes_written += size
            self.captured += 1
        self._buffered += added
        if self._buffered >= FLUSH_BYTES or self._full:
            self.flush()
        elif chunks and self._timer is None and loop is not None and not loop.is_closed():
            self._timer = loop.call_later(FLUSH_INTERVAL, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        """Hand the buffered records to the writer thread (does not wait for the write)."""
        if not self._chunks:
            return
        data = b"".join(self._chunks)
        self._chunks = []
        self._buffered = 0
        with self._backlog_lock:
            self._backlog += len(data)
        self._q.put(data)

    def _write_loop(self) -> None:
        f = self._file
        while True:
            data = self._q.get()
            if data is None:
                break
            try:
                f.write(data)
                f.flush()
            except OSError as exc:
                log.error("pcap %s: write failed (%s); capture stopped", self.path, exc)
                self._full = True
            with self._backlog_lock:
                self._backlog -= len(data)
        try:
            f.close()
        except OSError:  # pragma: no cover
            pass

    def close(self, timeout: float = 30.0) -> None:
        """Write out everything buffered, close the file, wait for the thread (``timeout`` s)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()
        self._q.put(None)
        self._thread.join(timeout)
        if self.not_captured:
            log.warning("pcap %s: %d frames not captured", self.path, self.not_captured)


class PcapTransport(TransportWrapper):
    """Wrap ``inner`` and record every frame both ways to a pcap file.

    Give ``path`` (a new :class:`PcapWriter` with ``max_bytes``, closed with this
    transport) or ``writer`` (a shared :class:`PcapWriter`, left open by :meth:`close`).
    Implements the transport interface by delegation (:class:`~aioslirp.transport.base.TransportWrapper`);
    :attr:`closed` is the inner transport's. ``OSError`` when ``path`` cannot be created.
    """

    __slots__ = ("_own", "writer")

    #: The writer was made here (closed with this transport).
    _own: bool
    writer: PcapWriter

    def __init__(self, inner: Transport, path: str | None = None, *, max_bytes: int | None = None,
                 writer: PcapWriter | None = None) -> None:
        if (path is None) == (writer is None):
            raise ValueError("give exactly one of path or writer")
        super().__init__(inner)
        self._own = writer is None
        self.writer = writer if writer is not None else PcapWriter(path, max_bytes=max_bytes)

    def _guest_sink(self, on_frames):
        return self._from_guest

    def _from_guest(self, frames, *extra) -> None:
        self.writer.record(frames, self._loop)
        self._on_frames(frames, *extra)  # extra: the per-frame checksum flags of an offload TAP

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Hand ``frames`` to the inner transport, then record them."""
        self.inner.send_frames(frames)
        self.writer.record(frames, self._loop)

    def close(self, exc: BaseException | None = None) -> None:
        """Close the inner transport; write out and close the file when this transport owns it. Idempotent."""
        try:
            self.inner.close(exc)
        finally:
            if self._own:
                self.writer.close()
            else:
                self.writer.flush()
