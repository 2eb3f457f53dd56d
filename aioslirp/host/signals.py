"""Signal handling of ``aioslirp run``: :class:`GracefulStop`, its SIGTERM (like ``docker stop``).

The command keeps its network while it shuts down after the first SIGTERM; a command that
outlives the grace period has its connections reset (:meth:`Stack.farewell()
<aioslirp.stack.Stack.farewell>`, run by :meth:`Stack.stop <aioslirp.stack.Stack.stop>`), then gets SIGKILL.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import warnings


__all__ = ["DEFAULT_STOP_TIMEOUT", "KILL_DELAY", "GracefulStop", "request_stop"]

log = logging.getLogger("aioslirp.netns")


#: Seconds ``aioslirp run`` gives the command after forwarding SIGTERM before it stops the network.
DEFAULT_STOP_TIMEOUT = 10.0
#: Seconds between stopping the network and SIGKILL for a command that still did not exit.
KILL_DELAY = 1.0


def reopen_audit_log(stack) -> None:
    """SIGHUP: reopen the stack's ``--audit-log`` file (log rotation); nothing without one."""
    reopen = getattr(stack, "reopen_audit_log", None)
    if reopen is not None:
        reopen()


class GracefulStop:
    """SIGTERM handling of ``aioslirp run`` (like ``docker stop``).

    The first SIGTERM is forwarded to the command (``send_signal(SIGTERM)``), which keeps its
    network while it shuts down. If it is still running ``timeout`` seconds later (at once on
    a second SIGTERM), the stack is stopped: :meth:`Stack.farewell` resets every guest connection
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
            request_stop(self.stack)
        except Exception:  # pragma: no cover - a custom stack factory
            pass
        self._kill = asyncio.get_running_loop().call_later(KILL_DELAY, self.send_signal, signal.SIGKILL)

    def cancel(self) -> None:
        for t in (self._timer, self._kill):
            if t is not None:
                t.cancel()
        self._timer = self._kill = None


def request_stop(stack) -> None:
    """Ask ``stack`` to make its ``serve()`` return: :meth:`Stack.stop <aioslirp.stack.Stack.stop>`.

    A stack of one's own (the ``stack_factory`` of ``attach``, ``run_in_namespace``, ``aioslirp
    qemu``) written for 0.1 has ``close()`` instead: it is called, with a ``DeprecationWarning``,
    until the next release.
    """
    stop = getattr(stack, "stop", None)
    if stop is None:
        warnings.warn(f"{type(stack).__name__} has no stop(): a stack's close() is now stop() (close() is "
                      "called instead until the next release)", DeprecationWarning, stacklevel=2)
        stop = stack.close
    stop()
