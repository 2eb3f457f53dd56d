"""Ending a guest's session cleanly.

:func:`farewell` runs while the guest's link is still up, when the stack is asked to stop
(SIGINT/SIGTERM of ``aioslirp attach`` / ``aioslirp qemu``, :meth:`Stack.close
<aioslirp.stack.Stack.close>`, the grace period of ``aioslirp run`` running out): every TCP
flow is reset towards the guest (an RST the guest's applications see as ECONNRESET instead
of a connection that hangs until its own timeout) and its host socket is closed with a RST
to the host peer; UDP and ICMP flows close their sockets; with IPv6 the final Router
Advertisement withdraws the default route (RFC 4861 6.2.5). Then those frames are written to
the transport at once (:meth:`InjectQueue.drain <aioslirp.inject.InjectQueue.drain>`), which the
caller closes afterwards.

When the guest itself went away (the TAP's process exited, QEMU disconnected) there is no
one to tell: the flows are torn down without it (:meth:`Stack.aclose`, :meth:`Stack.reset_flows`).

``aioslirp run``'s SIGTERM handling (:class:`~aioslirp.host.signals.GracefulStop`) is host
plumbing, in :mod:`aioslirp.host.signals`.
"""

from __future__ import annotations

import asyncio

__all__ = ["farewell"]

#: Former longest wait, in seconds, for the inject queue to drain after the RSTs were queued;
#: kept for callers of :func:`farewell` (the queue is now written out at once, nothing waits).
DRAIN_TIMEOUT = 0.25


async def farewell(stack, timeout: float = DRAIN_TIMEOUT) -> int:
    """Reset every flow towards the guest, withdraw the IPv6 router, let the writer flush.

    Returns the number of flows torn down. Never raises for a flow that fails to shut down
    (logged by :meth:`Stack.reset_flows`). The transport must still be open for the guest to
    see anything; closing it is the caller's job. ``timeout`` is accepted for compatibility and
    unused: the frames are written to the transport without waiting.
    """
    n = stack.reset_flows()
    stack.counters["flows_reset_at_stop"] += n
    if stack.v6 is not None:
        stack.v6.final_ra()
    await stack.inject_queue.drain()  # written to the transport now, then one loop iteration
    return n
