"""The span sinks of aioslirp.observe.sink: the direct JSON-lines sink writes what the SDK path's
exporter writes for the same hooks (ids and nothing else apart), formats a line in C exactly as in
Python, writes everything by its shutdown and leaves no thread running, drops (and counts) rather
than grows without bound, and turns a failed write into one warning."""

from __future__ import annotations

import json
import logging
import random
import threading

import pytest

from aioslirp.observe import sink as sink_mod
from aioslirp.observe.sink import JsonLinesSink, SdkSink, as_sink
from aioslirp.observe.tracing import Tracer

pytest.importorskip("opentelemetry.sdk")


class _Conn:
    irs, rcv_nxt, fin_received, state, reset = 1, 120, True, "CLOSED", False


class _Flow:
    proto_name, direction, remote, name, rule = "tcp", "outbound", "127.0.0.1", None, None
    guest_port, dst_port, bytes_down, outcome = 40000, 80, 200, "closed"

    def __init__(self) -> None:
        self.key = (6, bytes([10, 0, 2, 15]), 40000, bytes([10, 0, 2, 2]), 80)
        self.conn = _Conn()


def _hooks(tr: Tracer) -> None:
    """The Python path's hooks of one connection with fixed times."""
    f = _Flow()
    tr.flows = {f.key: f}
    f.opened_ns = 1_000
    tr.record_flow_opened(f)
    tr.record_syn_ack(f, 0.000123, False, at=2_000_000)
    tr.record_native_event(f, "established", 0, 3_000_000)
    tr.record_native_event(f, "guest.data", 17, 4_000_000)
    tr.record_native_event(f, "data.sent", 0, 4_500_000)
    tr.record_native_frame(f, 4_000_000, 4_001_500, 66, 1, 0x18)
    tr.record_native_drain((f,), 5_000_000, 5_000_250, 2)
    tr.record_native_wake((), 6_000_000, 6_000_001, 1, 0, 0)
    tr.record_flow_closed(f)


def _strip(spans: list) -> list:
    ids = {}

    def rename(x):
        return ids.setdefault(x, f"id{len(ids)}") if x is not None else None

    out = []
    for s in sorted(spans, key=lambda s: (s["start_ns"], s["name"])):
        s = dict(s, end_ns=None if s["name"] == "tcp.flow" else s["end_ns"],  # (ended "now")
                 trace_id=rename(s["trace_id"]), span_id=rename(s["span_id"]),
                 parent_span_id=rename(s["parent_span_id"]), resource=None,
                 links=[{"trace_id": rename(l["trace_id"]), "span_id": rename(l["span_id"])} for l in s["links"]])
        out.append(s)
    return out


def test_the_direct_sink_writes_what_the_sdk_exporter_writes(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from aioslirp.observe.spanfile import JsonLinesSpanExporter

    a, b = tmp_path / "sdk.jsonl", tmp_path / "direct.jsonl"
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(a))))
    _hooks(Tracer(tp))
    tp.shutdown()
    sink = JsonLinesSink(str(b))
    _hooks(Tracer(sink))
    sink.shutdown()
    sdk = [json.loads(x) for x in a.read_text().splitlines()]
    direct = [json.loads(x) for x in b.read_text().splitlines()]
    assert len(direct) == 5 and _strip(direct) == _strip(sdk)
    flow = [s for s in direct if s["name"] == "tcp.flow"][0]
    assert [e["name"] for e in flow["events"]] == ["host.connect", "syn_ack.queued", "established", "guest.data",
                                                   "data.sent"]
    assert json.loads(b.read_text().splitlines()[0])["resource"] == {"service.name": "aioslirp"}


@pytest.mark.skipif(sink_mod._C_LINES is None, reason="no native extension")
def test_a_line_and_a_batch_formatted_in_c_are_the_python_ones_byte_for_byte():
    rnd = random.Random(7)
    batch: list = []
    values = [0, -1, 1 << 63, -(1 << 70), 1.5, -0.0, 1e-7, 1e22, 123.456, float("nan"), float("inf"),
              float("-inf"), True, False, None, "", "plain", 'q"\\\n\r\t\b\f\x01\x1f\x7f', "é", "\u2028", "😀", [1, "a"],
              (2, 3), b"x"]
    for _ in range(300):
        attrs = {rnd.choice(["a", "b.c", "k\"ey", "é"]) + str(i): rnd.choice(values) for i in range(rnd.randrange(6))}
        events = [rnd.choice([("ev", rnd.randrange(1 << 62), None), ("e\n", 5, {"x": rnd.choice(values)}),
                              '{"name":"raw","time_ns":1,"attributes":{}}']) for _ in range(rnd.randrange(4))]
        entry = (rnd.choice(["tcp.flow", "process_guest_frame", "na\u00efve"]), "a" * 32, "b" * 16,
                 rnd.choice(["null", '"' + "c" * 16 + '"']), rnd.randrange(1 << 62), rnd.randrange(1 << 62), attrs,
                 events or None, rnd.choice(["[]", '[{"trace_id":"t","span_id":"s"}]']))
        assert sink_mod._C_LINES([entry], '{"r":1}', sink_mod._encode) == (
            sink_mod._line(entry, '{"r":1}').encode(), 1)
        batch.append(entry)
        if rnd.random() < 0.3:  # lines already formatted (the native ring's), between the spans
            k = rnd.randrange(3)
            batch.append(("".join('{"name":"n%d"}\n' % j for j in range(k)).encode(), k))
    # a writer's whole batch in C: the same bytes and the same line count as in Python
    assert sink_mod._C_LINES(batch, '{"r":1}', sink_mod._encode) == sink_mod._lines(batch, '{"r":1}')
    data, n = sink_mod._lines(batch, '{"r":1}')
    assert n == data.count(b"\n") > 300
    with pytest.raises(TypeError):
        sink_mod._C_LINES([(b"x\n", -1)], "{}", sink_mod._encode)
    with pytest.raises(TypeError):
        sink_mod._C_LINES([("x\n", 1)], "{}", sink_mod._encode)


def test_written_completely_at_shutdown_and_no_thread_left(tmp_path):
    path = tmp_path / "t.jsonl"
    sink = JsonLinesSink(str(path), interval=60.0)  # the writer would not wake by itself
    tr = Tracer(sink)
    for _ in range(500):
        _hooks(tr)
    assert any(t.name == "aioslirp-trace-writer" for t in threading.enumerate())
    tr.record_stack_closed()  # a stack's exit writes what it left in the sink
    assert len(path.read_text().splitlines()) == 2500 == sink.written
    sink.shutdown()
    sink.shutdown()  # idempotent
    assert not any(t.name == "aioslirp-trace-writer" for t in threading.enumerate())
    tr.sink.emit("late", None, {}, 1, 2)  # after shutdown: dropped, counted
    assert sink.dropped == 1 and len(path.read_text().splitlines()) == 2500


def test_a_full_queue_drops_and_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(sink_mod, "MAX_PENDING", 10)
    sink = JsonLinesSink(str(tmp_path / "t.jsonl"), interval=60.0)
    for i in range(25):
        sink.emit("s", None, {"i": i}, 1, 2)
    sink.put_text(b'{"name":"x"}\n{"name":"y"}\n', 2)
    assert sink.dropped == 17
    sink.shutdown()
    assert sink.written == 10


def test_a_failed_write_is_one_warning_then_drops(caplog):
    sink = JsonLinesSink("/dev/full", label="--trace /dev/full", interval=60.0)
    with caplog.at_level(logging.WARNING, logger="aioslirp.observe"):
        for _ in range(3):
            sink.emit("s", None, {"x": "y" * 100}, 1, 2)
            sink.flush()
    sink.shutdown()
    assert [r.getMessage() for r in caplog.records] == [
        "--trace /dev/full: cannot write spans (No space left on device); spans from now on are not recorded"]
    assert sink.written == 0 and sink.dropped == 3 and sink.error == "No space left on device"


def test_as_sink_keeps_a_sink_and_wraps_a_provider(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider

    sink = JsonLinesSink(str(tmp_path / "t.jsonl"))
    assert as_sink(sink) is sink
    assert isinstance(as_sink(TracerProvider()), SdkSink)
    with sink.current_span("block", {"a": 1}):
        pass
    sink.shutdown()
    (line,) = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(line)["name"] == "block" and json.loads(line)["attributes"] == {"a": 1}
