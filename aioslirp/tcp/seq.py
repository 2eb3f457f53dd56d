"""Modular arithmetic on 32-bit TCP sequence numbers (RFC 9293 section 3.4).

Sequence and acknowledgment numbers live in the space ``0 .. 2**32 - 1`` and wrap.
Comparisons are only meaningful between numbers less than ``2**31`` apart: ``a`` is
"less than" ``b`` when ``b - a`` taken modulo ``2**32`` lies in ``1 .. 2**31 - 1``.
Two numbers exactly ``2**31`` apart compare neither less nor greater (and neither
``<=`` nor ``>=``); TCP never lets numbers drift that far apart within a window.

All functions take and return plain ``int`` values in ``0 .. 2**32 - 1``
(:func:`seq_diff` returns a signed distance). The hot path of
:mod:`aioslirp.tcp.connection` (and its :mod:`~aioslirp.tcp.arrival` and
:mod:`~aioslirp.tcp.output` parts) inlines the same expressions instead of calling these.
"""

from __future__ import annotations

__all__ = [
    "SEQ_HALF",
    "SEQ_MASK",
    "SEQ_MOD",
    "seq_add",
    "seq_diff",
    "seq_ge",
    "seq_gt",
    "seq_in",
    "seq_le",
    "seq_lt",
    "seq_max",
]

#: Size of the sequence space, 2**32.
SEQ_MOD = 1 << 32
#: Mask that reduces an int modulo 2**32.
SEQ_MASK = SEQ_MOD - 1
#: Half the sequence space, 2**31: distances ``d`` (modulo 2**32) with ``0 < d < SEQ_HALF`` are "ahead".
SEQ_HALF = _HALF = 1 << 31


def seq_add(a: int, n: int) -> int:
    """``a + n`` modulo 2**32 (``n`` may be negative)."""
    return (a + n) & SEQ_MASK


def seq_diff(a: int, b: int) -> int:
    """Signed distance ``a - b`` in ``-2**31 .. 2**31 - 1``."""
    d = (a - b) & SEQ_MASK
    return d - SEQ_MOD if d >= _HALF else d


def seq_lt(a: int, b: int) -> bool:
    """``a < b`` in sequence space."""
    return 0 < ((b - a) & SEQ_MASK) < _HALF


def seq_le(a: int, b: int) -> bool:
    """``a <= b`` in sequence space."""
    return ((b - a) & SEQ_MASK) < _HALF


def seq_gt(a: int, b: int) -> bool:
    """``a > b`` in sequence space."""
    return 0 < ((a - b) & SEQ_MASK) < _HALF


def seq_ge(a: int, b: int) -> bool:
    """``a >= b`` in sequence space."""
    return ((a - b) & SEQ_MASK) < _HALF


def seq_in(x: int, lo: int, hi: int) -> bool:
    """``lo <= x < hi`` in sequence space (the half-open window starting at ``lo``)."""
    return ((x - lo) & SEQ_MASK) < ((hi - lo) & SEQ_MASK)


def seq_max(a: int, b: int) -> int:
    """The later of ``a`` and ``b``."""
    return b if 0 < ((b - a) & SEQ_MASK) < _HALF else a
