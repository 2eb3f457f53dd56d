"""Internet checksum (RFC 1071) computed in C through Python's big integers.

The one's-complement sum of 16-bit big-endian words equals the buffer read as one
big-endian integer modulo 0xFFFF (because 2**16 == 1 mod 0xFFFF), so
``int.from_bytes(buf, "big") % 0xFFFF`` is the folded sum without a Python loop.
Partial sums of even-length pieces can be added (modulo 0xFFFF) in any order,
which is how pseudo-headers are combined with segments.
"""

from __future__ import annotations

_from_bytes = int.from_bytes


def partial(data) -> int:
    """Partial one's-complement sum of ``data`` (bytes-like), in ``range(0, 0xFFFF)``.

    An odd-length buffer is padded with one zero byte at the end (RFC 1071 section 4.1),
    so only the last piece of a multi-piece sum may have odd length.
    """
    n = _from_bytes(data, "big")
    if len(data) & 1:
        n <<= 8
    return n % 0xFFFF


def finish(total: int) -> int:
    """Turn a sum of :func:`partial` values into the 16-bit checksum field value."""
    total %= 0xFFFF
    # total == 0 is taken as a folded sum of 0xFFFF: checksum 0. Right whenever some word is not
    # zero (always so with a pseudo-header); all-zero data needs 0xFFFF, see checksum().
    return (0xFFFF - total) if total else 0


def checksum(data) -> int:
    """RFC 1071 checksum of ``data``: the value to store in a checksum field.

    All-zero data (an ICMP echo reply with identifier, sequence and payload all zero) sums to
    +0, whose complement is 0xFFFF; 0 there would fail the receiver's check.
    """
    total = partial(data)
    if total == 0 and not any(data):
        return 0xFFFF
    return finish(total)


def verify(total: int) -> bool:
    """True when a sum of partials taken over data *including* its checksum field is valid."""
    return total % 0xFFFF == 0
