"""``aioslirp vhost-user``: serve one VM at a time over vhost-user-net (QEMU, libvirt, cloud-hypervisor).

:func:`serve_vhost_user` puts a :class:`~aioslirp.stack.Stack` behind a
:class:`~aioslirp.transport.vhost_user.VhostUserTransport` on ``path`` (listening, or with
``client`` connecting to a front end that listens there, again whenever it goes) until SIGINT or
SIGTERM. When a front end disconnects (the VM powered off, QEMU killed or restarted) every flow
its guest had is torn down (:meth:`Stack.reset_flows`), and the next front end on the same
socket is served by the same stack. SIGUSR1 logs the rings' state (a stalled guest's debug aid:
:meth:`VhostUserTransport.ring_state`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from ..host.signals import request_stop
from ..transport.vhost_proto import TX_COALESCE, TX_DEFER
from ..transport.vhost_user import VhostUserTransport

__all__ = ["serve_vhost_user"]

log = logging.getLogger("aioslirp.vhost_user")


async def serve_vhost_user(config, *, path: str, client: bool = False, handle_signals: bool = False,
                           stack_factory=None, tx_coalesce: int = TX_COALESCE, tx_defer: float = TX_DEFER) -> int:
    """Serve vhost-user front ends on ``path`` until stopped (SIGINT/SIGTERM with ``handle_signals``).
    ``tx_coalesce``: the transport's TX moderation threshold in bytes (0: off); ``tx_defer``: seconds
    a small TX walk's completion may wait (0: off); see
    :class:`~aioslirp.transport.vhost_user.VhostUserTransport`.
    Returns 0 on a clean stop. Raises :class:`~aioslirp.transport.unixpath.SocketInUse` or
    ``OSError`` (binding ``path``), ``RuntimeError`` (the native extension is not usable)."""
    import signal

    from ..stack import Stack

    factory = stack_factory or Stack
    loop = asyncio.get_running_loop()
    async with factory(config) as stack:

        def front_end(up: bool) -> None:
            if not up:
                n = stack.reset_flows()
                log.info("vhost-user %s: the guest left; %d flow(s) torn down", path, n)

        transport = VhostUserTransport(path, server=not client, on_front_end=front_end, tx_coalesce=tx_coalesce,
                                       tx_defer=tx_defer)
        installed = []
        try:
            if handle_signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, request_stop, stack)
                    installed.append(sig)
                # SIGUSR1: log the rings' state (indexes, notification words, pending kicks)
                loop.add_signal_handler(signal.SIGUSR1, lambda: log.warning(
                    "vhost-user %s: ring state: %s", path, json.dumps(transport.ring_state(), sort_keys=True)))
                installed.append(signal.SIGUSR1)
                reopen = getattr(stack, "reopen_audit_log", None)
                if reopen is not None:  # SIGHUP: reopen the --audit-log file (log rotation)
                    loop.add_signal_handler(signal.SIGHUP, reopen)
                    installed.append(signal.SIGHUP)
            await stack.serve(transport)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            transport.close()
        log.info("stopped after %d front end(s)", transport.front_ends)
        log.debug("rings: %s", transport.counters())
    return 0
