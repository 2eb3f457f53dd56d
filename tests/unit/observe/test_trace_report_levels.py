"""``aioslirp trace-report`` on span files of each trace level (sans-IO: span objects as the
``--trace`` file holds them, docs/observability.md): the report names the level it sees and
says what the level leaves out instead of failing or inventing a breakdown."""

from __future__ import annotations

import json
import types

from aioslirp.cli.trace_report import FRAME_SPANS, IDLE_STAGE, build_report, cli_main, format_report

US = 1000  # ns


def flow_span(n: int, *, events: list | None = None) -> dict:
    """The ``tcp.flow`` span of the guest's connection ``n`` (1 ms apart, 500 us long)."""
    t0 = 1_000_000_000 + n * 1000 * US
    return {"name": "tcp.flow", "trace_id": f"{n:032x}", "span_id": f"{n:016x}", "parent_span_id": None,
            "start_ns": t0, "end_ns": t0 + 500 * US,
            "attributes": {"client.address": "10.0.2.15", "client.port": 40000 + n, "server.address": "10.0.2.2",
                           "server.port": 8080, "aioslirp.tcp.outcome": "closed", "aioslirp.bytes.from_guest": 1,
                           "aioslirp.bytes.to_guest": 1},
            "events": [{"name": name, "time_ns": t0 + off * US, "attributes": {}} for name, off in (events or [])]}


TIMELINE = [("syn_ack.queued", 50), ("established", 100), ("guest.data", 150), ("host.data", 350),
            ("fin.guest", 400), ("closed", 450)]


def child(name: str, n: int, attrs: dict) -> dict:
    t0 = 1_000_000_000 + n * 1000 * US
    return {"name": name, "trace_id": f"{n:032x}", "span_id": f"{n + 100:016x}", "parent_span_id": f"{n:016x}",
            "start_ns": t0, "end_ns": t0 + 10 * US, "attributes": attrs, "events": []}


def test_flows_level_report_has_no_stage_breakdown_and_says_which_level_gives_one():
    rep = build_report([flow_span(n) for n in range(3)])
    assert rep.level == "flows" and len(rep.connections) == 3
    assert rep.largest is None and "--trace-level timeline" in rep.verdict
    out = format_report(rep)
    assert "3 TCP connections, trace level flows" in out
    assert "the stage breakdown needs --trace-level timeline or frames" in out
    assert "(none: the per-frame trace points need --trace-level frames)" in out


def test_timeline_level_report_breaks_into_stages_and_says_frames_give_the_trace_points():
    spans = [flow_span(n, events=TIMELINE) for n in range(3)]
    spans += [child("tcp.syn_ack", n, {"aioslirp.connect.immediate": False, "aioslirp.connect_us": 40})
              for n in range(3)]
    rep = build_report(spans)
    assert rep.level == "timeline"
    assert rep.stages["guest.data → host.data"] == [200.0] * 3
    assert rep.largest == IDLE_STAGE and rep.verdict.startswith("verdict: the largest stage is")
    assert rep.trace_points["tcp.syn_ack: host connect"] == [40.0] * 3
    out = format_report(rep)
    assert "trace level timeline" in out and "needs --trace-level timeline" not in out
    assert "(none: the per-frame trace points need --trace-level frames)" in out


def test_frames_level_report_has_the_per_frame_trace_points():
    spans = [flow_span(n, events=TIMELINE) for n in range(2)]
    spans += [child("process_guest_frame", n, {"aioslirp.processing_us": 7.0}) for n in range(2)]
    spans += [child("drain_to_guest", n, {"aioslirp.drain_us": 3.0}) for n in range(2)]
    rep = build_report(spans)
    assert rep.level == "frames" and {"process_guest_frame", "drain_to_guest", "writer_wake"} == FRAME_SPANS
    assert rep.trace_points["process_guest_frame: processing"] == [7.0, 7.0]
    out = format_report(rep)
    assert "trace level frames" in out and "need --trace-level" not in out


def test_cli_reads_a_flows_level_file(tmp_path, capsys):
    path = tmp_path / "flows.jsonl"
    path.write_text("".join(json.dumps(flow_span(n)) + "\n" for n in range(2)))
    assert cli_main(types.SimpleNamespace(file=str(path), connections=10, png=None)) == 0
    out = capsys.readouterr().out
    assert "2 TCP connections, trace level flows" in out and out.count("\nconnection ") == 2
    assert "verdict: no stage breakdown" in out


def test_the_flows_tail_after_both_fins_is_marked_and_left_out_of_the_verdict():
    """A native CRR trace: once both FINs are in, the flow span lasts on (TIME-WAIT, the end record)
    while the guest's next connection runs; that tail is on no request's path, so the verdict names
    the largest stage before it and mentions the tail apart."""
    events = [("syn_ack.queued", 50), ("established", 100), ("guest.data", 150), ("host.data", 350),
              ("fin.host", 380), ("fin.guest", 400)]
    spans = []
    for n in range(4):
        s = flow_span(n, events=events)
        s["end_ns"] = s["start_ns"] + 30_000 * US  # 30 ms in TIME-WAIT: far past the next SYN
        spans.append(s)
    rep = build_report(spans)
    assert rep.stages["fin.guest → flow.end"] == [29_600.0] * 4
    assert rep.tail == frozenset({"fin.guest → flow.end"})
    assert rep.largest == IDLE_STAGE  # 600 us between connections: the largest off the tail
    assert "left out: the flow's tail after both FINs, largest 'fin.guest → flow.end' p50 29600" in rep.verdict
    out = format_report(rep)
    assert any(line.rstrip().endswith("(after the close)") and "fin.guest → flow.end" in line
               for line in out.splitlines())
    # a connection whose host never sent a FIN has no tail: its last stage stays on the path
    spans = [flow_span(n, events=[("established", 100), ("guest.data", 150), ("fin.guest", 400)]) for n in range(3)]
    for s in spans:
        s["end_ns"] = s["start_ns"] + 30_000 * US
    rep = build_report(spans)
    assert rep.tail == frozenset() and rep.largest == "fin.guest → flow.end"
