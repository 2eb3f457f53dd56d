"""Bounded fragment reassembly: IPv4 (RFC 791 section 3.2, RFC 815) and IPv6 (RFC 8200 4.5, RFC 5722).

Reassembly keeps state (fragments held across frames, a timeout), so it lives above the wire
layer, which only parses and builds: :class:`Reassembler` collects the fragments of any
datagram by key, :class:`Ipv6Reassembler` puts the IPv6 headers back around what it returns.
IPv4 fragments are keyed by ``(src, dst, proto, ident)``, IPv6 ones by ``(src, dst, ident)``.
Bounds protect the host from a hostile guest; each one, when hit, counts a distinct drop
reason in :attr:`Reassembler.drops`:

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

import struct
from collections import OrderedDict

from ..wire.icmp import ND_REDIRECT, ND_ROUTER_SOLICIT
from ..wire.ipv6 import IPV6_HLEN, NH_FRAGMENT, NH_ICMPV6, Ipv6, parse_ipv6

__all__ = ["DEFAULT_MAX_BYTES", "Reassembler", "Ipv6Reassembler"]

#: Default of ``max_bytes``: 4 MiB per reassembler (per address family).
DEFAULT_MAX_BYTES = 4 << 20

_H = struct.Struct("!H")


class _Pending:
    """One datagram in progress."""

    __slots__ = ("first_seen", "frags", "total", "size", "charge", "meta")

    first_seen: float
    frags: list[tuple[int, bytes]]
    total: int
    size: int
    charge: int
    meta: tuple | None

    def __init__(self, now: float) -> None:
        self.first_seen = now
        self.frags = []  # (offset in bytes, data)
        self.total = -1  # payload length once the last fragment (MF=0) arrived
        self.size = 0  # payload bytes held
        self.charge = 0  # bytes counted against max_bytes (payload + meta_size)
        self.meta = None  # what the caller attached with the fragment at offset 0


class Reassembler:
    """Collects fragments (IPv4's, and IPv6's for :class:`Ipv6Reassembler`); :meth:`add` returns the
    whole payload when complete.

    Args:
        max_datagrams: datagrams in progress at once (the oldest is evicted beyond it).
        max_fragments: fragments per datagram.
        max_bytes: bytes held across all datagrams in progress.
        timeout: seconds a datagram may take from its first fragment to completion.

    Attributes:
        held: bytes held now, counted against ``max_bytes``.
        drops: drop reason -> count, for the caller to merge into its counters and clear.
    """

    __slots__ = ("max_datagrams", "max_fragments", "max_bytes", "timeout", "held", "_pending", "drops")

    max_datagrams: int
    max_fragments: int
    max_bytes: int
    timeout: float
    held: int
    _pending: OrderedDict[tuple, _Pending]
    drops: dict[str, int]

    def __init__(self, *, max_datagrams: int = 64, max_fragments: int = 64, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout: float = 15.0) -> None:
        self.max_datagrams = max_datagrams
        self.max_fragments = max_fragments
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.held = 0
        self._pending = OrderedDict()
        #: Drop reasons -> count, merged into the stack's counters by the caller.
        self.drops = {}

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

    def add_fragment(self, key: tuple, offset: int, more: bool, data, now: float, meta: tuple | None = None,
                     meta_size: int = 0) -> tuple[bytes, tuple | None] | None:
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


class Ipv6Reassembler:
    """Bounded IPv6 reassembly (RFC 8200 4.5, RFC 5722) on top of :class:`Reassembler`.

    Keyed by ``(src, dst, ident)``. The bounds are those of :class:`Reassembler` (datagrams
    in progress, fragments each, bytes held, ``timeout`` seconds), with the same drop reasons;
    the first fragment's headers (IPv6 header and unfragmentable extension headers), kept
    with its datagram until it completes, count against ``max_bytes`` too. Overlapping
    fragments discard the whole datagram, exact duplicates are ignored. The reassembled
    fragmentable part is limited to 65,515 bytes by the shared reassembler (RFC 8200 allows
    65,535 minus the unfragmentable part; UDP payloads up to 65,507 bytes reassemble). NDP
    messages (ICMPv6 133-137) that arrive fragmented are dropped (RFC 6980).

    :meth:`add` returns the whole datagram as an unfragmented IPv6 packet (``bytes``: the
    first fragment's header and unfragmentable extension headers, Next Header patched, payload
    length recomputed, the fragmentable part appended) for the caller to parse again, or
    ``None``. Drop reasons accumulate in :attr:`drops` (merge and clear them, as with
    :class:`Reassembler`).
    """

    __slots__ = ("_r", "drops", "timeout")

    _r: Reassembler
    drops: dict[str, int]
    timeout: float

    def __init__(self, *, max_datagrams: int = 64, max_fragments: int = 64, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout: float = 15.0) -> None:
        self._r = Reassembler(max_datagrams=max_datagrams, max_fragments=max_fragments, max_bytes=max_bytes,
                              timeout=timeout)
        self.drops = self._r.drops
        self.timeout = timeout

    @classmethod
    def from_config(cls, config) -> "Ipv6Reassembler":
        """One built with the ``reassembly_*`` bounds of a :class:`~aioslirp.config.NetworkConfig`."""
        return cls(max_datagrams=int(config.reassembly_max_datagrams),
                   max_fragments=int(config.reassembly_max_fragments),
                   max_bytes=int(config.reassembly_max_bytes), timeout=float(config.reassembly_timeout))

    def __len__(self) -> int:
        return len(self._r)

    @property
    def held(self) -> int:
        """Bytes held now (fragment payloads and first-fragment headers), at most ``max_bytes``."""
        return self._r.held

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def add(self, buf, ip: Ipv6, now: float) -> bytes | None:
        """Add the fragment ``ip`` (parsed from ``buf`` by :func:`parse_ipv6`, ``ip.frag`` set).
        ``now``: loop time in seconds (the batch's)."""
        frag = ip.frag
        assert frag is not None, "a fragment"
        foff, more, ident = frag
        mv = memoryview(buf)
        if foff == 0 and not more:  # atomic fragment (RFC 6946): process in isolation
            return self._rebuild(bytes(mv[ip.off:ip.l4 - 8]), self._nh_pos(buf, ip), ip.proto, mv[ip.l4:ip.end])
        if foff == 0:
            head = bytes(mv[ip.off:ip.l4 - 8])
            done = self._r.add_fragment((ip.src, ip.dst, ident), 0, more, mv[ip.l4:ip.end], now,
                                        (head, self._nh_pos(buf, ip), ip.proto), len(head))
        else:
            done = self._r.add_fragment((ip.src, ip.dst, ident), foff, more, mv[ip.l4:ip.end], now)
        if done is None:
            return None
        data, info = done
        if info is None:  # cannot happen: completion needs the offset-0 fragment
            self._drop("frag_no_first")
            return None
        return self._rebuild(info[0], info[1], info[2], data)

    @staticmethod
    def _nh_pos(buf, ip: Ipv6) -> int:
        """Offset (relative to the IPv6 header) of the Next Header byte that says 44."""
        pos, nh = ip.off + IPV6_HLEN, buf[ip.off + 6]
        at = 6
        while nh != NH_FRAGMENT:
            at = pos - ip.off
            nh = buf[pos]
            pos += (buf[pos + 1] + 1) << 3
        return at

    def _rebuild(self, head: bytes, nh_at: int, nh: int, data) -> bytes | None:
        pkt = bytearray(head)
        pkt += data
        pkt[nh_at] = nh
        plen = len(pkt) - IPV6_HLEN
        if plen > 0xFFFF:
            self._drop("frag_bad_length")
            return None
        _H.pack_into(pkt, 4, plen)
        ip = parse_ipv6(pkt, 0)
        if type(ip) is str:
            self._drop(ip)
            return None
        if ip.proto == NH_ICMPV6 and ip.l4 < ip.end and ND_ROUTER_SOLICIT <= pkt[ip.l4] <= ND_REDIRECT:
            self._drop("ndp_fragmented")
            return None
        return bytes(pkt)
