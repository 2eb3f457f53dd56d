"""Neighbour caches: guest IP address -> Ethernet MAC, for ARP (IPv4) and NDP (IPv6).

One rule for both families: a cache holds at most :data:`MAX_NEIGHBORS` entries, and learning
an address beyond that forgets the entry learned (or changed) longest ago. A guest can put any
source address of its prefix in its frames (``--cidr`` allows a /8, an IPv6 /64 is 2**64
addresses), and each one is learned, so without the bound the cache grows with every spoofed
address. The guest's real address is learned again from its next frame.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["MAX_NEIGHBORS", "NeighborCache"]

#: Entries per neighbour cache (per address family).
MAX_NEIGHBORS = 1024


class NeighborCache(OrderedDict):
    """A bounded ``OrderedDict`` of address (``bytes``: 4 for IPv4, 16 for IPv6) -> MAC (6 ``bytes``).

    Reads are plain dict reads (``get``, ``in``); write through :meth:`learn`, which keeps the
    bound. Order: least recently learned first.
    """

    __slots__ = ("max_entries",)

    max_entries: int

    def __init__(self, max_entries: int = MAX_NEIGHBORS) -> None:
        super().__init__()
        self.max_entries = max_entries

    def learn(self, addr: bytes, mac: bytes) -> bool:
        """Record ``addr`` -> ``mac`` as the most recent entry.

        Returns True when the oldest entry was forgotten to make room (the caller counts it).
        """
        if addr in self:
            self.move_to_end(addr)
            self[addr] = mac
            return False
        evicted = len(self) >= self.max_entries
        if evicted:
            self.popitem(last=False)
        self[addr] = mac
        return evicted
