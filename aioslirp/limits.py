"""Old import path of the admission control and the ``--limit`` fields (kept for users and tests).

Admission control (:class:`Guard`, :data:`DENIED`, :func:`fd_budgets`, :data:`FD_RESERVE`...)
lives in :mod:`aioslirp.flow.guard`, with its theory of operation; idle flows are reset or
closed by the flow table's sweep (:mod:`aioslirp.flow.table`). The ``--limit`` fields are in
:mod:`aioslirp.config.limits`, the token bucket in :mod:`aioslirp.ratelimit`.
"""

from __future__ import annotations

from .config.limits import LIMIT_FIELDS, parse_limits
from .flow.guard import DENIED, FD_RESERVE, PRUNE_INTERVAL, Guard, fd_budgets, raise_fd_limit
from .ratelimit import TokenBucket

__all__ = ["DENIED", "FD_RESERVE", "PRUNE_INTERVAL", "Guard", "LIMIT_FIELDS", "TokenBucket", "fd_budgets",
           "parse_limits", "raise_fd_limit"]
