"""The native trace ring formatted in C for the direct span sink (``TcpEngine.trace_json``, used by
``Tracer.record_native_ring`` with a :class:`~aioslirp.observe.sink.JsonLinesSink`) against the
OpenTelemetry SDK path (the ``record_native_*`` hooks, an SDK span each): the same traffic through
two fake engines gives the same spans (names, parents, trace ids, links, attributes, the flow span's
events), but for ids and the clock's values; the floats are Python's repr; a full ring is counted,
not grown, and the lines still come out whole."""

from __future__ import annotations

import json
import re

import pytest

from aioslirp.observe.sink import JsonLinesSink
from aioslirp.observe.spanfile import span_to_dict
from aioslirp.observe.tracing import Tracer

from support.native import need_extension
from support.native_tcp import ACK, FIN, GW_MAC, IRS, ISS, MTU, PSH, EngineFlow

pytest.importorskip("opentelemetry.sdk")

TIMING = re.compile(r"_us(\.max|\.min)?$")


class _Flow:
    """What the tracer reads of a native flow (``NativeTcpFlow``): its key, ports, slot and generation."""

    proto_name = "tcp"
    direction = None
    remote = "127.0.0.1"
    opened_ns = None

    def __init__(self, ef: EngineFlow) -> None:
        self.key = (6, ef.fam.guest, ef.gport, ef.fam.gw, 80)
        self.guest_port, self.dst_port = ef.gport, 80
        self.slot, self.gen = ef.slot, ef.gen


def _traffic(tracer: Tracer, frames: bool, v6: bool = False) -> None:
    ext = need_extension()
    e = ext.TcpEngine(-1, False, False, GW_MAC, MTU, 16, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    e.trace(1024)
    f = EngineFlow(v6, engine=e)
    flow = _Flow(f)
    tracer.record_flow_opened(flow)
    flows = {(f.slot, f.gen): flow}
    f.send(ACK)
    f.send(ACK | PSH, data=b"hello")
    f.host_send(b"y" * 4000)
    tracer.record_native_ring(e, flows, frames)
    f.send(ACK, seq=IRS + 6, ack=ISS + 4001)
    f.send(ACK | FIN, seq=IRS + 6, ack=ISS + 4001)
    f.host_eof()
    f.send(ACK, seq=IRS + 7, ack=ISS + 4002)
    f.poll(0.1)
    tracer.record_native_ring(e, flows, frames)
    tracer.end_all()


def _sdk_spans(frames: bool, v6: bool) -> list:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    _traffic(Tracer(tp), frames, v6)
    return [json.loads(json.dumps(span_to_dict(s))) for s in mem.get_finished_spans()]


def _direct_spans(tmp_path, frames: bool, v6: bool) -> list:
    path = tmp_path / "direct.jsonl"
    sink = JsonLinesSink(str(path), resource={})
    tr = Tracer(sink)
    _traffic(tr, frames, v6)
    sink.shutdown()
    text = path.read_text()
    for m in re.finditer(r'"aioslirp\.(processing|drain|wake)_us":([0-9.]+)', text):
        assert repr(float(m.group(2))) == m.group(2)  # the float's text is Python's repr
    return [json.loads(line) for line in text.splitlines()]


def _shape(spans: list) -> list:
    """The spans without ids, times and timing figures, parents and links as the flow's name."""
    by_id = {s["span_id"]: s for s in spans}
    flow_traces = {s["trace_id"] for s in spans if s["name"].endswith(".flow")}
    out = []
    for s in spans:
        parent = by_id.get(s["parent_span_id"])
        if s["parent_span_id"] is not None:
            assert parent is not None and parent["trace_id"] == s["trace_id"]
        attrs = {k: v for k, v in s["attributes"].items() if not TIMING.search(k)}
        events = [(e["name"], {k: v for k, v in e["attributes"].items() if not TIMING.search(k)}) for e in s["events"]]
        assert all(e["time_ns"] > 0 for e in s["events"])
        assert s["end_ns"] >= s["start_ns"] > 0
        out.append((s["name"], parent["name"] if parent else None, s["trace_id"] in flow_traces,
                    json.dumps(attrs, sort_keys=True), json.dumps(events),
                    [by_id[l["span_id"]]["name"] for l in s["links"]]))
    return sorted(out)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "timeline"])
@pytest.mark.parametrize("v6", [False, True], ids=["v4", "v6"])
def test_the_c_formatter_writes_the_spans_the_sdk_path_makes(tmp_path, frames, v6):
    sdk = _sdk_spans(frames, v6)
    direct = _direct_spans(tmp_path, frames, v6)
    assert _shape(direct) == _shape(sdk)
    names = {s["name"] for s in direct}
    assert names == ({"tcp.flow", "tcp.syn_ack", "process_guest_frame", "drain_to_guest", "writer_wake"} if frames
                     else {"tcp.flow", "tcp.syn_ack"})
    (flow,) = [s for s in direct if s["name"] == "tcp.flow"]
    ev = [e["name"] for e in flow["events"]]
    assert ev[:2] == ["host.connect", "syn_ack.queued"] and "established" in ev and ev[-1] == "closed"
    # key order of every line is the SDK exporter's
    sdk_keys = list(sdk[0])
    assert all(list(s) == sdk_keys for s in direct)


def test_the_guest_identity_and_the_resource_are_on_every_line(tmp_path):
    from aioslirp.config.identity import GuestIdentity

    path = tmp_path / "t.jsonl"
    sink = JsonLinesSink(str(path), resource={"service.name": "x", "k": "é"})
    tr = Tracer(sink, identity=GuestIdentity("vm1", {"team": "a\"b"}))
    _traffic(tr, True)
    sink.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(spans) > 5
    assert all(s["attributes"]["aioslirp.guest.name"] == "vm1" and s["attributes"]["aioslirp.guest.label.team"]
               == 'a"b' and s["resource"] == {"service.name": "x", "k": "é"} for s in spans)


def test_a_full_ring_is_counted_not_grown_and_the_lines_stay_whole(tmp_path):
    ext = need_extension()
    e = ext.TcpEngine(-1, False, False, GW_MAC, MTU, 16, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    e.trace(4)
    path = tmp_path / "t.jsonl"
    sink = JsonLinesSink(str(path))
    tr = Tracer(sink)
    f = EngineFlow(engine=e).established()
    flow = _Flow(f)
    tr.record_flow_opened(flow)
    for _ in range(5):
        f.send(ACK)
    tr.record_native_ring(e, {(f.slot, f.gen): flow}, True)
    assert e.counters()["trace_overflow"] == 6  # the oldest four kept, the rest counted
    tr.end_all()
    sink.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["name"] for s in spans] == ["tcp.syn_ack", "drain_to_guest", "tcp.flow"]
    assert sink.written == 3 and sink.dropped == 0
