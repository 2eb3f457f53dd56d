"""Bounded IPv4 fragment reassembly (RFC 791 section 3.2, RFC 815).

Fragments are keyed by ``(src, dst, proto, ident)``. Limits protect the host from a
hostile guest: at most ``max_datagrams`` datagrams in progress (the oldest is evicted),
at most ``max_fragments`` fragments each, reassembled size at most 65,535 bytes, and
``timeout`` seconds from the first fragment. Overlapping fragments invalidate the whole
datagram (as RFC 5722 requires for IPv6; a guest has no good reason to send them).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Reassembler"]


class _Pending:
    __slots__ = ("first_seen", "frags", "total", "size")

    def __init__(self, now: float) -> None:
        self.first_seen = now
        self.frags: list[tuple[int, bytes]] = []  # (offset in bytes, data)
        self.total = -1  # payload length once the last fragment (MF=0) arrived
        self.size = 0


class Reassembler:
    """Collects IPv4 fragments; :meth:`add` returns the whole payload when complete."""

    def __init__(self, *, max_datagrams: int = 64, max_fragments: int = 64, timeout: float = 15.0) -> None:
        self.max_datagrams = max_datagrams
        self.max_fragments = max_fragments
        self.timeout = timeout
        self._pending: OrderedDict[tuple, _Pending] = OrderedDict()
        #: Drop reasons -> count, merged into the stack's counters by the caller.
        self.drops: dict[str, int] = {}

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def __len__(self) -> int:
        return len(self._pending)

    def expire(self, now: float) -> None:
        """Forget datagrams older than ``timeout`` seconds."""
        while self._pending:
            key, p = next(iter(self._pending.items()))
            if now - p.first_seen < self.timeout:
                break
            del self._pending[key]
            self._drop("frag_timeout")

    def add(self, key: tuple, offset: int, more: bool, data, now: float) -> bytes | None:
        """Add one fragment.

        ``offset`` in bytes (fragment offset field * 8), ``more`` the MF flag, ``data``
        the fragment's payload. Returns the reassembled payload (bytes) or ``None``.
        """
        self.expire(now)
        n = len(data)
        end = offset + n
        if end > 65535 - 20 or (more and (n == 0 or n & 7)):
            self._drop("frag_bad_length")
            self._pending.pop(key, None)
            return None
        p = self._pending.get(key)
        if p is None:
            if len(self._pending) >= self.max_datagrams:
                self._pending.popitem(last=False)
                self._drop("frag_evicted")
            p = self._pending[key] = _Pending(now)
        if not more:
            if p.total >= 0 and p.total != end:
                del self._pending[key]
                self._drop("frag_inconsistent")
                return None
            p.total = end
        if p.total >= 0 and end > p.total:
            del self._pending[key]
            self._drop("frag_inconsistent")
            return None
        for o, d in p.frags:
            if offset < o + len(d) and o < end:
                if o == offset and bytes(d) == bytes(data):
                    self._drop("frag_duplicate")
                    return None
                del self._pending[key]
                self._drop("frag_overlap")
                return None
        if len(p.frags) >= self.max_fragments:
            del self._pending[key]
            self._drop("frag_too_many")
            return None
        p.frags.append((offset, bytes(data)))
        p.size += n
        if p.total >= 0 and p.size == p.total:
            del self._pending[key]
            p.frags.sort()
            return b"".join(d for _, d in p.frags)
        return None
