"""OpenTelemetry metrics for a :class:`~aioslirp.stack.Stack`, read from its counters.

:func:`register` creates asynchronous (observable) instruments whose callbacks read
``stack.counters`` and the flow table only when a metric reader collects, so the data
path pays nothing for them. Instruments (OpenTelemetry semantic-convention attribute
names where they exist):

==============================  =====================  ==========================================
name                            kind, unit             attributes
==============================  =====================  ==========================================
``aioslirp.frames``             counter, ``{frame}``   ``network.io.direction``: ``receive``
                                                       (from the guest) / ``transmit`` (to it)
``aioslirp.bytes``              counter, ``By``        ``network.io.direction``
``aioslirp.drops``              counter, ``{frame}``   ``aioslirp.drop.reason`` (the ``drop.*``
                                                       counter names, e.g. ``bad_tcp_checksum``)
``aioslirp.flows.opened``       counter, ``{flow}``    ``network.transport``
``aioslirp.flows.active``       up-down, ``{flow}``    ``network.transport``, ``aioslirp.tcp.state``
                                                       (TCP only: RFC 9293 state name)
==============================  =====================  ==========================================

The same values are in :meth:`Stack.stats() <aioslirp.stack.Stack.stats>`, which the API
socket's ``get_stats`` returns.
"""

from __future__ import annotations

import weakref

__all__ = ["native_frames", "register"]


def native_frames(stack) -> tuple[int, int]:
    """``(from the guest, to the guest)``: the frames of the stack's native TCP flows, which its
    ``frames_in`` / ``frames_out`` leave out (the engine counts them: ``native_tcp.frames`` and
    ``.frames_out``, added to the stack's counters when its engine closes; the live engine's
    too). The native UDP flows' frames are in ``frames_in`` / ``frames_out`` already."""
    c = stack.counters
    fin, fout = c["native_tcp.frames"], c["native_tcp.frames_out"]
    plane = stack.parts.ctx.native_tcp
    if plane is not None:
        live = plane.counters()
        fin, fout = fin + live.get("frames", 0), fout + live.get("frames_out", 0)
    return fin, fout

def register(stack, meter_provider=None) -> list:
    """Register the stack's observable instruments on ``meter_provider`` (default: the global one).

    Needs only ``opentelemetry-api`` (without an SDK the instruments are no-ops). The
    callbacks hold a weak reference to ``stack``; after it is gone they report nothing.
    Returns the instruments created.
    """
    from opentelemetry import metrics
    from opentelemetry.metrics import Observation

    meter = metrics.get_meter("aioslirp", meter_provider=meter_provider)
    ref = weakref.ref(stack)

    def _counters():
        s = ref()
        return None if s is None else s.counters

    def frames(_options):
        s = ref()
        if s is None:
            return []
        fin, fout = native_frames(s)
        c = s.counters
        return [Observation(c["frames_in"] + fin, {"network.io.direction": "receive"}),
                Observation(c["frames_out"] + fout, {"network.io.direction": "transmit"})]

    def nbytes(_options):
        c = _counters()
        if c is None:
            return []
        return [Observation(c["bytes_in"], {"network.io.direction": "receive"}),
                Observation(c["bytes_out"], {"network.io.direction": "transmit"})]

    def drops(_options):
        c = _counters()
        if c is None:
            return []
        return [Observation(v, {"aioslirp.drop.reason": k[5:]}) for k, v in list(c.items()) if k.startswith("drop.")]

    def opened(_options):
        c = _counters()
        if c is None:
            return []
        out = []
        for k, v in list(c.items()):
            if k.startswith("flows.") and k.endswith(".opened"):
                out.append(Observation(v, {"network.transport": k[6:-7]}))
        return out

    def active(_options):
        s = ref()
        if s is None:
            return []
        out = []
        for proto, v in s.stats()["flows"].items():
            if isinstance(v, dict):
                for state, n in v.items():
                    out.append(Observation(n, {"network.transport": proto, "aioslirp.tcp.state": state}))
            else:
                out.append(Observation(v, {"network.transport": proto}))
        return out

    return [
        meter.create_observable_counter("aioslirp.frames", [frames], unit="{frame}",
                                        description="Ethernet frames from and to the guest"),
        meter.create_observable_counter("aioslirp.bytes", [nbytes], unit="By",
                                        description="Ethernet frame bytes from and to the guest"),
        meter.create_observable_counter("aioslirp.drops", [drops], unit="{frame}",
                                        description="guest frames (and frames for the guest) dropped, by reason"),
        meter.create_observable_counter("aioslirp.flows.opened", [opened], unit="{flow}",
                                        description="NAT flows created"),
        meter.create_observable_up_down_counter("aioslirp.flows.active", [active], unit="{flow}",
                                                description="NAT flows in the flow table"),
    ]
