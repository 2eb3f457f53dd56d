"""Recording: a TCP handler that passes each flow on and writes its bytes, both ways, to files.

:class:`Recorder` opens the flow's upstream (``connect(flow)``, default ``flow.open_upstream()``;
an :class:`~aioslirp.handlers.proxy.UpstreamProxy`'s ``connect`` to record through a proxy),
splices the guest into it and writes, per flow, in ``directory``:

* ``NNNNNN-GUEST-DEST.up``: the guest's bytes, in order (``GUEST``/``DEST`` as ``addr_port``);
* ``NNNNNN-GUEST-DEST.down``: the bytes towards the guest;
* ``NNNNNN-GUEST-DEST.json``: one JSON object written at the flow's end: ``guest``, ``destination``,
  ``name``, ``started`` (wall-clock seconds), ``ended``, ``up`` and ``down`` (bytes), ``error``.

``NNNNNN`` counts the recorder's flows from 1. At most ``max_bytes`` bytes per direction are written
(the rest passes, unrecorded; ``truncated`` in the JSON). The files are written from the event loop
with buffered writes (a local disk is assumed). An upstream that cannot be opened ends the guest's
connection with a RST.
"""

from __future__ import annotations

import itertools
import json
import os
import time

from .splice import splice

__all__ = ["Recorder"]


def _part(ap: tuple) -> str:
    return f"{ap[0].replace(':', '.')}_{ap[1]}"


class Recorder:
    """A recording TCP handler (see the module documentation).

    Args:
        directory: where the files go (created if missing).
        connect: ``async connect(flow) -> (reader, writer)``; default ``flow.open_upstream()``.
        max_bytes: bytes recorded at most per flow and direction (default 64 MiB).
    """

    __slots__ = ("directory", "connect", "max_bytes", "_serial")

    def __init__(self, directory, connect=None, max_bytes: int = 64 << 20) -> None:
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.connect = connect
        self.max_bytes = int(max_bytes)
        self._serial = itertools.count(1)

    def __repr__(self) -> str:
        return f"Recorder({self.directory!r})"

    async def __call__(self, flow, reader, writer) -> None:
        base = os.path.join(self.directory, f"{next(self._serial):06d}-{_part(flow.guest)}-{_part(flow.destination)}")
        meta = {"guest": list(flow.guest), "destination": list(flow.destination), "name": flow.name,
                "started": flow.started, "up": 0, "down": 0, "truncated": False, "error": None}
        files = [open(base + ".up", "wb"), open(base + ".down", "wb")]
        counts = [0, 0]
        limit = self.max_bytes

        def tap(side: int, data: bytes) -> None:
            room = limit - counts[side]
            if room < len(data):
                meta["truncated"] = True
                data = data[:max(room, 0)]
            if data:
                files[side].write(data)
                counts[side] += len(data)

        try:
            try:
                up_r, up_w = await (self.connect(flow) if self.connect is not None else flow.open_upstream())
            except OSError as exc:
                meta["error"] = f"upstream: {exc}"
                writer.transport.abort()
                return
            try:
                await splice(reader, writer, up_r, up_w, tap=tap)
            except OSError as exc:
                meta["error"] = repr(exc)
        finally:
            for f in files:
                f.close()
            meta["up"], meta["down"], meta["ended"] = counts[0], counts[1], time.time()
            with open(base + ".json", "w") as f:
                json.dump(meta, f)
