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
"""

from __future__ import annotations

import asyncio
import logging
import signal

__all__ = ["DEFAULT_STOP_TIMEOUT", "GracefulStop", "farewell"]

log = logging.getLogger("aioslirp.netns")

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


#: Seconds ``aioslirp run`` gives the command after forwarding SIGTERM before it stops the network.
DEFAULT_STOP_TIMEOUT = 10.0
#: Seconds between stopping the network and SIGKILL for a command that still did not exit.
KILL_DELAY = 1.0


class GracefulStop:
    """SIGTERM handling of ``aioslirp run`` (like ``docker stop``).

    The first SIGTERM is forwarded to the command (``send_signal(SIGTERM)``), which keeps its
    network while it shuts down. If it is still running ``timeout`` seconds later (at once on
    a second SIGTERM), the stack is stopped: :func:`farewell` resets every guest connection
    (the command sees ECONNRESET) and the TAP closes; :data:`KILL_DELAY` seconds after that the
    command gets SIGKILL. ``cancel()`` disarms the timers (the command exited).
    """

    def __init__(self, stack, send_signal, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        self.stack = stack
        self.send_signal = send_signal
        self.timeout = float(timeout)
        self.terms = 0
        self._timer: asyncio.TimerHandle | None = None
        self._kill: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        """The SIGTERM handler (``loop.add_signal_handler(SIGTERM, graceful)``)."""
        self.terms += 1
        loop = asyncio.get_running_loop()
        if self.terms == 1:
            self.send_signal(signal.SIGTERM)
            self._timer = loop.call_later(self.timeout, self.expire)
        else:
            self.expire()

    def expire(self) -> None:
        """Stop the network now; SIGKILL the command :data:`KILL_DELAY` seconds later."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._kill is not None:
            return
        log.warning(
            "the command did not exit after SIGTERM: stopping its network, SIGKILL in %g s", KILL_DELAY)
        try:
            self.stack.close()
        except Exception:  # pragma: no cover - a custom stack factory
            pass
        self._kill = asyncio.get_running_loop().call_later(KILL_DELAY, self.send_signal, signal.SIGKILL)

    def cancel(self) -> None:
        for t in (self._timer, self._kill):
            if t is not None:
                t.cancel()
        self._timer = self._kill = None
