"""The native data plane's trace points against the Linux kernel (issue 26): a guest in a network
namespace behind a Stack in this process, its TAP read natively (``AIOSLIRP_NATIVE=1,udp``), traced
at ``trace_level`` ``frames`` into a JSON-lines span file (the exporter of ``aioslirp run
--trace``). Tracing must not move the flows: the stack's counters say every TCP flow ran in the
engine and the UDP flow was adopted; the file holds the native plane's ``tcp.syn_ack``,
``process_guest_frame``, ``drain_to_guest`` and ``writer_wake`` spans with sane attributes, and
``trace-report`` reads it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.frontends.netns import run_in_namespace

from support.guests import need_tool
from support.native import need_extension
from support.paths import REPO
from support.servers import DataServer, UdpEcho

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

N_CURL = 5


def guest_script(port: int, udp_port: int) -> str:
    return textwrap.dedent(f"""
        import json, socket, subprocess
        out = {{"curl": []}}
        for i in range({N_CURL}):
            p = subprocess.run(["curl", "-sS", "--max-time", "30", "-o", "/dev/null", "-w", "%{{size_download}}",
                                "http://10.0.2.2:{port}/20000"], capture_output=True, text=True)
            out["curl"].append(p.stdout if p.returncode == 0 else p.stderr)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(10)
        u.connect(("10.0.2.2", {udp_port}))
        got = 0
        for i in range(20):
            u.send(b"ping %d" % i); got += u.recv(100) == b"ping %d" % i
        out["udp"] = got
        print(json.dumps(out))
    """)


async def test_traced_native_flows_stay_native_and_their_spans_reach_the_file(monkeypatch, tmp_path):
    need_extension()
    need_tool("curl", "curl")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from aioslirp.observe.spanfile import JsonLinesSpanExporter
    from aioslirp.cli.trace_report import build_report, load_spans

    monkeypatch.setenv("AIOSLIRP_NATIVE", "1,udp")
    trace = tmp_path / "native.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(str(trace))))
    data, echo = DataServer(), UdpEcho()
    stacks: list = []
    out_path = tmp_path / "out.json"
    try:
        def factory(c):
            stacks.append(Stack(c, tracer_provider=provider))
            return stacks[-1]

        argv = ["env", "-u", "LD_PRELOAD", "sh", "-c", f'exec "$0" -c "$1" > {out_path}', sys.executable,
                guest_script(data.port, echo.port)]
        rc = await run_in_namespace(NetworkConfig(trace_level="frames"), argv, stack_factory=factory)
    finally:
        data.close()
        echo.close()
        provider.shutdown()
    text = out_path.read_text()
    assert rc == 0, text
    r = json.loads(text.strip().splitlines()[-1])
    assert r["curl"] == ["20000"] * N_CURL and r["udp"] == 20
    # tracing on, the flows stayed on the native plane
    (stack,) = stacks
    c = stack.counters
    opened = c["flows.tcp.opened"]
    assert opened == N_CURL and c["native_tcp.adopted"] == opened == c["flows.tcp.closed"]
    # Python saw the SYNs only: each flow's first, and any the guest sent again before the first was read
    # (a slow first connection: the kernel's 1 s SYN retransmission, both read in one batch; ASan makes it so)
    assert c["handled.tcp"] == c["native_tcp.syn_repeated"] and c["handled.tcp_syn"] == opened
    assert c["native_tcp.frames"] >= N_CURL * 4
    assert c["native.udp_flows_adopted"] == 1
    assert c["native_tcp.trace_overflow"] == 0
    # the native plane's spans, in the file, with sane attributes
    spans = load_spans(str(trace))
    flows = {s["span_id"]: s for s in spans if s["name"] == "tcp.flow" and s["attributes"]["server.port"] == data.port}
    assert len(flows) == N_CURL
    assert all(s["attributes"]["aioslirp.tcp.outcome"] == "closed" for s in flows.values())
    assert all(s["attributes"]["aioslirp.bytes.to_guest"] > 20000 for s in flows.values())
    syn_acks = [s for s in spans if s["name"] == "tcp.syn_ack"]
    assert sorted(s["parent_span_id"] for s in syn_acks) == sorted(flows)  # one per flow, its child
    assert all(0 <= s["attributes"]["aioslirp.connect_us"] < 5_000_000 for s in syn_acks)
    native = [s for s in spans if s["attributes"].get("aioslirp.plane") == "native"]
    frames = [s for s in native if s["name"] == "process_guest_frame"]
    # every guest frame of a native flow but the SYN (Python's) has its span, under its flow
    assert len(frames) == c["native_tcp.frames"]
    assert {s["parent_span_id"] for s in frames} == set(flows)
    assert all(s["attributes"]["network.transport"] == "tcp" and s["attributes"]["aioslirp.frame.bytes"] >= 54
               and s["attributes"]["aioslirp.processing_us"] >= 0 for s in frames)
    assert any("F" in s["attributes"].get("aioslirp.tcp.flags", "") for s in frames)  # the guests' FINs
    drains = [s for s in native if s["name"] == "drain_to_guest"]
    assert sum(s["attributes"]["aioslirp.frames"] for s in drains) == c["native_tcp.frames_out"]
    assert all(s["attributes"]["aioslirp.frames"] >= 1 and s["end_ns"] >= s["start_ns"] for s in drains)
    wakes = [s for s in native if s["name"] == "writer_wake"]
    assert wakes and all(s["attributes"]["aioslirp.events.socket"] + s["attributes"]["aioslirp.events.timer"] >= 1
                         for s in wakes)
    assert sum(s["attributes"]["aioslirp.frames"] for s in wakes) > 0  # host data written on a wake-up
    # trace-report reads them as the Python path's
    rep = build_report(spans)
    assert rep.level == "frames"
    assert len(rep.trace_points["process_guest_frame: processing"]) >= len(frames)
    assert len(rep.trace_points["writer_wake: native poll wake-up"]) == len(wakes)
    p = subprocess.run([sys.executable, "-m", "aioslirp", "trace-report", str(trace)], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "writer_wake: native poll wake-up" in p.stdout
