"""``splice``: copy two stream pairs into each other, both ways, with half-close."""

from __future__ import annotations

import asyncio

__all__ = ["splice"]

#: Bytes read at most per step.
CHUNK = 1 << 16


async def _pump(reader, writer, tap, side: int) -> int:
    n = 0
    while True:
        data = await reader.read(CHUNK)
        if not data:
            break
        if tap is not None:
            tap(side, data)
        writer.write(data)
        n += len(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    return n


def _abort(*writers) -> None:
    for w in writers:
        try:
            w.transport.abort()
        except Exception:  # pragma: no cover - a transport already gone
            pass


async def splice(r1, w1, r2, w2, *, tap=None) -> tuple[int, int]:
    """Copy ``r1`` -> ``w2`` and ``r2`` -> ``w1`` until both end; returns the bytes copied each way.

    The pairs are asyncio streams (a handler's guest reader/writer, ``open_upstream()``'s, or any
    ``asyncio.open_connection``'s). Backpressure: each step waits for ``drain()``, so at most
    :data:`CHUNK` bytes wait in either writer. An EOF on one side becomes ``write_eof()`` (a FIN)
    on the other, the opposite direction going on (half-close); once both directions ended, both
    writers are closed. A reset or error on either side aborts both (a guest sees a RST) and is
    raised (``ConnectionError``/``OSError``). Cancelling the caller aborts both. ``tap(side, data)``
    (optional) sees every chunk: ``side`` 0 for ``r1`` -> ``w2``, 1 for ``r2`` -> ``w1``.
    """
    other = asyncio.get_running_loop().create_task(_pump(r2, w1, tap, 1), name="aioslirp-splice")

    def failed(t) -> None:  # the other direction failed: abort both, so the one below ends too
        if not t.cancelled() and t.exception() is not None:
            _abort(w1, w2)

    other.add_done_callback(failed)
    try:
        up = await _pump(r1, w2, tap, 0)
        down = await other
    except (Exception, asyncio.CancelledError):  # (not GeneratorExit: a coroutine closed unfinished awaits nothing)
        _abort(w1, w2)
        if not other.done():
            other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        raise
    w1.close()
    w2.close()
    return up, down
