"""Bounded IPv4 fragment reassembly (RFC 791 section 3.2, RFC 815).

Fragments are keyed by ``(src, dst, proto, ident)``. Bounds protect the host from a hostile
guest; each one, when hit, counts a distinct drop reason in :attr:`Reassembler.drops`:

* ``max_datagrams`` datagrams in progress: a fragment of a new datagram beyond it evicts the
  oldest one (``frag_evicted``);
* ``max_fragments`` fragments per datagram: one more discards the datagram (``frag_too_many``);
* ``max_bytes`` bytes held across all datagrams in progress (fragment payloads, plus what the
  caller stores per datagram, e.g. IPv6 headers): a fragment that would go over it is dropped
  (``frag_memory_full``), unless it completes its datagram (that frees the bytes at once).
  The same rule as Linux's ``ipfrag_high_thresh`` (4 MiB by default there too);
* ``timeout`` seconds from a datagram's first fragment: it is forgotten (``frag_timeout``,
  checked on each :meth:`Reassembler.add`);
* reassembled size at most 65,535 bytes with the IPv4 header (``frag_bad_length``).

Overlapping fragments invalidate the whole datagram (``frag_overlap``, as RFC 5722 requires for
IPv6; a guest has no good reason to send them); an exact duplicate is ignored
(``frag_duplicate``); a second, different end discards it (``frag_inconsistent``).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["DEFAULT_MAX_BYTES", "Reassembler"]

#: Default of ``max_bytes``: 4 MiB per reassembler (per address family).
DEFAULT_MAX_BYTES = 4 << 20


class _Pending:
    __slots__ = ("first_seen", "frags", "total", "size", "charge", "meta")

    def __init__(self, now: float) -> None:
        self.first_seen = now
        self.frags: list[tuple[int, bytes]] = []  # (offset in bytes, data)
        self.total = -1  # payload length once the last fragment (MF=0) arrived
        self.size = 0  # payload bytes held
        self.charge = 0  # bytes counted against max_bytes (payload + meta_size)
        self.meta = None  # what the caller attached with the fragment at offset 0


class Reassembler:
    """Collects IPv4 fragments; :meth:`add` returns the whole payload when complete.

    Args:
        max_datagrams: datagrams in progress at once (the oldest is evicted beyond it).
        max_fragments: fragments per datagram.
        max_bytes: bytes held across all datagrams in progress.
        timeout: seconds a datagram may take from its first fragment to completion.

    Attributes:
        held: bytes held now, counted against ``max_bytes``.
        drops: drop reason -> count, for the caller to merge into its counters and clear.
    """

    def __init__(self, *, max_datagrams: int = 64, max_fragments: int = 64, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout: float = 15.0) -> None:
        self.max_datagrams = max_datagrams
        self.max_fragments = max_fragments
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.held = 0
        self._pending: OrderedDict[tuple, _Pending] = OrderedDict()
        #: Drop reasons -> count, merged into the stack's counters by the caller.
        self.drops: dict[str, int] = {}

    @classmethod
    def from_config(cls, config) -> "Reassembler":
        """One built with the ``reassembly_*`` bounds of a :class:`~aioslirp.config.NetworkConfig`."""
        return cls(max_datagrams=int(config.reassembly_max_datagrams),
                   max_fragments=int(config.reassembly_max_fragments),
                   max_bytes=int(config.reassembly_max_bytes), timeout=float(config.reassembly_timeout))

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def _discard(self, key: tuple, reason: str) -> None:
        """Forget the datagram ``key`` (if pending) and count ``reason``."""
        p = self._pending.pop(key, None)
        if p is not None:
            self.held -= p.charge
        self._drop(reason)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: tuple) -> bool:
        return key in self._pending

    def expire(self, now: float) -> None:
        """Forget datagrams older than ``timeout`` seconds (``now`` in seconds)."""
        pending = self._pending
        while pending:
            key, p = next(iter(pending.items()))
            if now - p.first_seen < self.timeout:
                break
            self._discard(key, "frag_timeout")

    def add(self, key: tuple, offset: int, more: bool, data, now: float) -> bytes | None:
        """Add one fragment.

        ``offset`` in bytes (fragment offset field * 8), ``more`` the MF flag, ``data``
        the fragment's payload, ``now`` in seconds. Returns the reassembled payload (bytes)
        or ``None``.
        """
        done = self.add_fragment(key, offset, more, data, now)
        return None if done is None else done[0]

    def add_fragment(self, key: tuple, offset: int, more: bool, data, now: float, meta=None,
                     meta_size: int = 0) -> tuple[bytes, object] | None:
        """:meth:`add`, attaching ``meta`` to the datagram when ``offset`` is 0.

        ``meta`` (e.g. the IPv6 headers of the first fragment) is kept with the datagram and
        ``meta_size`` bytes are counted against ``max_bytes`` while it is pending. Returns
        ``(payload, meta)`` once the datagram is complete, else ``None``.
        """
        self.expire(now)
        n = len(data)
        end = offset + n
        if end > 65535 - 20 or (more and (n == 0 or n & 7)):
            self._discard(key, "frag_bad_length")
            return None
        pending = self._pending
        p = pending.get(key)
        if p is None:
            if len(pending) >= self.max_datagrams:
                self._discard(next(iter(pending)), "frag_evicted")
            p = pending[key] = _Pending(now)
        if not more:
            if p.total >= 0 and p.total != end:
                self._discard(key, "frag_inconsistent")
                return None
            p.total = end
        if p.total >= 0 and end > p.total:
            self._discard(key, "frag_inconsistent")
            return None
        for o, d in p.frags:
            if offset < o + len(d) and o < end:
                if o == offset and bytes(d) == bytes(data):
                    self._drop("frag_duplicate")
                    return None
                self._discard(key, "frag_overlap")
                return None
        if len(p.frags) >= self.max_fragments:
            self._discard(key, "frag_too_many")
            return None
        if offset:
            meta_size = 0
        complete = p.total >= 0 and p.size + n == p.total
        if not complete and self.held + n + meta_size > self.max_bytes:
            if not p.frags:  # created for this fragment: leave nothing behind
                del pending[key]
            self._drop("frag_memory_full")
            return None
        if complete:
            del pending[key]
            self.held -= p.charge
            p.frags.append((offset, data))
            p.frags.sort(key=_offset)
            return b"".join(d for _, d in p.frags), (meta if offset == 0 else p.meta)
        p.frags.append((offset, bytes(data)))
        p.size += n
        p.charge += n + meta_size
        self.held += n + meta_size
        if offset == 0:
            p.meta = meta
        return None


def _offset(item: tuple) -> int:
    return item[0]
