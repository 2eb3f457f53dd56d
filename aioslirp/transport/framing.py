"""Sans-IO framing of QEMU's ``-netdev stream`` byte stream (also the old ``-netdev socket``).

Theory of operation
-------------------
QEMU writes every Ethernet frame to a stream socket as a 4-byte big-endian length
followed by that many bytes of frame (``htonl(size)`` then the frame; no preamble, no FCS,
no virtio-net header), and reads the same format back. The byte stream gives no other
boundaries: one ``recv`` may hold half a length prefix, many whole frames, or the end of
one frame and the start of the next.

:class:`StreamDecoder` turns arbitrary chunks into whole frames. It never reads a socket
and never reads a clock: the caller feeds bytes with :meth:`StreamDecoder.feed` and gets
back the frames completed by them. The length prefix is checked against ``max_frame`` as
soon as its 4 bytes are in, *before* any buffer is sized for the frame, so a hostile or
corrupt length cannot make us allocate; :class:`FrameTooLarge` is raised and the stream
cannot be resynchronised (the caller closes the connection).

A zero length is legal on the wire and yields an empty frame (the stack counts it as a
truncated Ethernet frame and drops it).

:func:`encode_frames` is the other direction: the list of buffers (prefix, frame, prefix,
frame, ...) for one vectored write.
"""

from __future__ import annotations

import struct
from typing import Iterable

from .base import MAX_FRAME

__all__ = ["FrameTooLarge", "StreamDecoder", "encode_frames", "LENGTH"]

#: The 4-byte big-endian length prefix.
LENGTH = struct.Struct("!I")
_unpack_from = LENGTH.unpack_from
_pack = LENGTH.pack


class FrameTooLarge(ValueError):
    """A length prefix exceeds the decoder's ``max_frame``; the stream is unusable.

    ``length`` is the announced frame length in bytes, ``max_frame`` the limit.
    """

    def __init__(self, length: int, max_frame: int) -> None:
        self.length = length
        self.max_frame = max_frame
        super().__init__(f"frame length {length} exceeds the maximum of {max_frame} bytes")


class StreamDecoder:
    """Incremental decoder: bytes in, whole frames (``bytes``) out.

    ``max_frame`` is the largest frame accepted, in bytes (default
    :data:`~aioslirp.transport.base.MAX_FRAME`). After :class:`FrameTooLarge` the decoder
    stays failed: every later :meth:`feed` raises the same error.
    """

    __slots__ = ("max_frame", "_buf", "_need", "_error")

    max_frame: int
    _buf: bytearray
    _need: int
    _error: FrameTooLarge | None

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        #: Bytes of an incomplete prefix or frame carried over to the next feed.
        self._buf = bytearray()
        #: Length of the frame whose prefix has been read and whose body is in ``_buf`` (-1: none).
        self._need = -1
        self._error: FrameTooLarge | None = None

    @property
    def pending(self) -> int:
        """Bytes buffered that do not form a whole frame yet (prefix included)."""
        return len(self._buf) + (4 if self._need >= 0 else 0)

    def feed(self, data) -> list[bytes]:
        """Add ``data`` (bytes-like, any length) and return the frames it completed, in order.

        Raises :class:`FrameTooLarge` when a length prefix exceeds ``max_frame``; frames
        completed before the bad prefix in the same ``data`` are lost with it (the
        connection is going away anyway).
        """
        if self._error is not None:
            raise self._error
        out: list[bytes] = []
        buf = self._buf
        n = len(data)
        pos = 0
        max_frame = self.max_frame
        # 1. finish what the previous feed left incomplete
        if self._need >= 0 or buf:
            if self._need < 0:  # partial prefix
                take = min(4 - len(buf), n)
                buf += data[:take]
                pos = take
                if len(buf) < 4:
                    return out
                need = _unpack_from(buf, 0)[0]
                if need > max_frame:
                    raise self._fail(need)
                del buf[:]
                self._need = need
            need = self._need
            take = min(need - len(buf), n - pos)
            if take:
                buf += data[pos:pos + take]
                pos += take
            if len(buf) < need:
                return out
            out.append(bytes(buf))
            del buf[:]
            self._need = -1
        # 2. whole frames straight out of ``data``
        mv = memoryview(data) if not isinstance(data, memoryview) else data
        while n - pos >= 4:
            need = _unpack_from(mv, pos)[0]
            if need > max_frame:
                raise self._fail(need)
            start = pos + 4
            end = start + need
            if end > n:
                self._need = need
                buf += mv[start:n]
                return out
            out.append(bytes(mv[start:end]))
            pos = end
        # 3. keep a partial prefix
        if pos < n:
            buf += mv[pos:n]
        return out

    def _fail(self, length: int) -> FrameTooLarge:
        self._error = FrameTooLarge(length, self.max_frame)
        self._buf = bytearray()
        self._need = -1
        return self._error


def encode_frames(frames: Iterable[bytes]) -> list:
    """Buffers for one vectored write of ``frames``: ``[prefix, frame, prefix, frame, ...]``.

    Each prefix is the frame's length as 4 bytes, big-endian. Frames are not copied.
    """
    out: list = []
    append = out.append
    for f in frames:
        append(_pack(len(f)))
        append(f)
    return out
