"""The byte queues of a TCP connection: what the host sent that the guest has not acknowledged
(:class:`SendQueue`) and what the guest sent that the host has not taken (:class:`ChunkQueue`).

Both hold the chunks they were given (``bytes`` from a host socket, read-only views of the
frames a TAP read produced) instead of one growing buffer: appending copies nothing more,
dropping the head frees whole chunks without moving bytes, and the consumer gets views. Only
:class:`~aioslirp.tcp.connection.TcpConnection` uses them; the glue goes through its methods
(``send``, ``peek_chunk``, ``consume``, ``recv_pending``).
"""

from __future__ import annotations

from bisect import bisect_right

__all__ = ["SendQueue", "ChunkQueue"]


class SendQueue:
    """The send buffer: a FIFO of immutable chunks (the ``bytes`` objects the host socket
    produced, kept as they are) with views at any offset.

    Appending copies nothing for ``bytes`` (anything else is copied once); dropping the
    acknowledged head frees whole chunks without moving bytes. :meth:`view` returns a zero-copy
    ``memoryview`` when the range lies in one chunk, else a view of the joined pieces. Views
    handed out are released (``ValueError`` on use) by :meth:`release_views`, which the
    connection calls on its next output: payloads are valid until the next call, as documented.
    """

    __slots__ = ("_chunks", "_ends", "_i0", "_base", "_total", "views")

    _chunks: list[bytes]  # b"" where a chunk was dropped (freed)
    _ends: list[int]
    _i0: int
    _base: int
    _total: int
    #: Views handed out by :meth:`view` and not yet released (read-only outside the class).
    views: list[memoryview]

    def __init__(self) -> None:
        self._chunks = []
        self._ends = []  # absolute stream offset just past each chunk
        self._i0 = 0  # first live chunk
        self._base = 0  # absolute offset of the head (bytes dropped so far)
        self._total = 0  # absolute offset of the tail
        self.views = []

    def __len__(self) -> int:
        return self._total - self._base

    def release_views(self) -> None:
        """Release every view :meth:`view` handed out (using one then raises ``ValueError``)."""
        views = self.views
        if views:
            for v in views:
                try:
                    v.release()
                except BufferError:  # pragma: no cover - someone holds a raw buffer of it
                    pass
            views.clear()

    def append(self, data) -> None:
        """Queue ``data`` (bytes-like) at the tail; ``bytes`` are kept as they are, anything else copied once."""
        n = len(data)
        if not n:
            return
        if self.views:
            self.release_views()  # "valid until the next call into the connection"
        if data.__class__ is not bytes:
            data = bytes(data)
        self._chunks.append(data)
        self._total += n
        self._ends.append(self._total)

    def view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` counted from the head (``0 <= start < end <= len``)."""
        a = self._base + start
        b = self._base + end
        ends = self._ends
        k = bisect_right(ends, a, self._i0)
        chunk = self._chunks[k]
        cend = ends[k]
        cstart = cend - len(chunk)
        if b <= cend:
            v = memoryview(chunk)[a - cstart:b - cstart]
        else:
            parts = [memoryview(chunk)[a - cstart:]]
            while cend < b:
                k += 1
                chunk = self._chunks[k]
                cstart, cend = cend, ends[k]
                parts.append(memoryview(chunk)[:b - cstart] if b < cend else memoryview(chunk))
            v = memoryview(b"".join(parts))
        self.views.append(v)
        return v

    def drop(self, n: int) -> None:
        """Forget the first ``n`` bytes."""
        base = self._base = self._base + n
        ends = self._ends
        chunks = self._chunks
        i = self._i0
        last = len(ends)
        while i < last and ends[i] <= base:
            chunks[i] = b""
            i += 1
        if i >= 64 and i * 2 >= last:
            del chunks[:i]
            del ends[:i]
            i = 0
        self._i0 = i

    def clear(self) -> None:
        """Forget everything held (views handed out are released)."""
        self.release_views()
        self._chunks.clear()
        self._ends.clear()
        self._i0 = 0
        self._base = self._total = 0


class ChunkQueue:
    """A FIFO of bytes kept as a list of immutable chunks (the receive queue).

    Appending keeps a read-only ``memoryview`` of a ``bytes`` object as it is (what a TAP
    read produces: the bytes cannot change under us) and copies anything else once into its
    own ``bytes`` (the caller's buffer may be reused); nothing is ever re-copied to grow a
    buffer, and :meth:`first` hands the oldest chunk out as is, so a consumer that writes
    chunk by chunk (the flow, to the host socket) copies nothing more. :meth:`joined` merges
    everything into one chunk when asked. Chunks are immutable: views of them stay valid.
    A list with a start index rather than a deque: an idle flow's empty queue stays small.
    """

    __slots__ = ("_chunks", "_i0", "_head", "nbytes")

    _chunks: list[bytes | memoryview]  # b"" where a chunk was dropped (freed)
    _i0: int
    _head: int
    #: Bytes held (read-only outside the class; ``len()`` says the same).
    nbytes: int

    def __init__(self) -> None:
        self._chunks = []
        self._i0 = 0  # first live chunk
        self._head = 0  # bytes of the first live chunk already consumed
        self.nbytes = 0

    def __len__(self) -> int:
        return self.nbytes

    def append(self, data) -> None:
        """Queue ``data`` (bytes-like) at the tail: a ``bytes`` or a read-only view of one as it is,
        anything else copied once."""
        n = len(data)
        if n:
            if data.__class__ is not bytes and not (
                    data.__class__ is memoryview and data.readonly and data.obj.__class__ is bytes):
                data = bytes(data)
            self._chunks.append(data)
            self.nbytes += n

    def first(self) -> memoryview | bytes:
        """The oldest unconsumed piece (``b""`` when empty)."""
        if not self.nbytes:
            return b""
        c = self._chunks[self._i0]
        h = self._head
        return memoryview(c)[h:] if h else c

    def joined(self) -> bytes:
        """Everything held, as one ``bytes`` (merging the chunks into one)."""
        if not self.nbytes:
            return b""
        chunks = self._chunks
        i0 = self._i0
        if len(chunks) - i0 > 1 or self._head or chunks[i0].__class__ is not bytes:
            whole = b"".join(chunks[i0:])[self._head:]
            chunks.clear()
            chunks.append(whole)
            self._i0 = self._head = 0
            return whole
        return chunks[i0]  # type: ignore[return-value]  # the one chunk, checked to be bytes above

    def drop(self, n: int) -> None:
        """Forget the first ``n`` bytes (``0 <= n <= len``)."""
        left = self.nbytes = self.nbytes - n
        chunks = self._chunks
        if not left:
            chunks.clear()
            self._i0 = self._head = 0
            return
        i = self._i0
        h = self._head + n
        while h >= len(chunks[i]):
            h -= len(chunks[i])
            chunks[i] = b""
            i += 1
        if i >= 64 and i * 2 >= len(chunks):
            del chunks[:i]
            i = 0
        self._i0 = i
        self._head = h

    def clear(self) -> None:
        """Forget everything held."""
        self._chunks.clear()
        self._i0 = self._head = self.nbytes = 0
