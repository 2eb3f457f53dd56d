"""Trace points, span export (in-memory, JSON file, OTLP/HTTP), trace-report, metrics.

Real guests: a Linux network namespace behind the stack (in this process for the
in-memory exporter, through ``aioslirp run`` for the exporters); real host servers on
127.0.0.1; an OTLP/HTTP receiver decoding the protobuf payloads with opentelemetry-proto.
"""

from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.frontends.netns import run_in_namespace
from aioslirp.observe import tracing

from support.paths import REPO
from support.servers import free_port

pytestmark = pytest.mark.netns


class EchoOnce:
    """TCP on 127.0.0.1: per connection, read one byte, wait ``delay`` s, echo it, wait for
    EOF, close. One thread; ``close()`` releases the socket."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with c:
                try:
                    d = c.recv(1)
                    if self.delay:
                        time.sleep(self.delay)
                    if d:
                        c.sendall(d)
                    while c.recv(64):
                        pass
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


def crr_script(port: int, n: int, *, refused_port: int | None = None, idle: float = 0.0) -> str:
    return textwrap.dedent(f"""
        import socket, time
        for i in range({n}):
            s = socket.create_connection(("10.0.2.2", {port}), timeout=20)
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            s.close()
            time.sleep({idle})
        if {refused_port!r} is not None:
            try:
                socket.create_connection(("10.0.2.2", {refused_port!r}), timeout=20)
                raise SystemExit("connected to a closed port")
            except ConnectionRefusedError:
                pass
        time.sleep(0.3)  # let the last connection's FIN exchange with the host finish before exiting
    """)


@pytest.fixture
def memory_tracing():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.end_all()
        tracing.disable()
        provider.shutdown()


def _events(span) -> list:
    return [e.name for e in span.events]


def _subsequence(want: list, got: list) -> bool:
    it = iter(got)
    return all(any(w == g for g in it) for w in want)


def _native_tcp() -> bool:
    """The stacks of this test run guest TCP flows on the native plane (the default where it is built)."""
    from aioslirp import native

    return native.extension() is not None and native.tcp_wanted()


async def test_spans_for_one_crr_cycle_and_a_refused_connection(memory_tracing):
    server = EchoOnce()
    refused = free_port()
    try:
        rc = await run_in_namespace(NetworkConfig(trace_level="frames"),
                                    [sys.executable, "-c", crr_script(server.port, 1, refused_port=refused)])
    finally:
        server.close()
    assert rc == 0
    assert tracing.errors == 0
    spans = memory_tracing.get_finished_spans()
    flows = [s for s in spans if s.name == "tcp.flow"]
    (crr,) = [s for s in flows if s.attributes["server.port"] == server.port]
    (ref,) = [s for s in flows if s.attributes["server.port"] == refused]

    a = crr.attributes
    assert a["network.transport"] == "tcp" and a["network.type"] == "ipv4"
    assert a["client.address"] == "10.0.2.15" and a["server.address"] == "10.0.2.2"
    assert a["network.peer.address"] == "127.0.0.1"
    assert a["aioslirp.bytes.from_guest"] == 1 and a["aioslirp.bytes.to_guest"] == 1
    assert a["aioslirp.tcp.outcome"] == "closed" and a["aioslirp.tcp.state"] == "CLOSED"
    ev = _events(crr)
    # the guest closes first: its FIN, then the host server's EOF, then our FIN
    assert _subsequence(["host.connect", "syn_ack.queued", "syn_ack.sent", "established", "guest.data",
                         "host.data", "data.sent", "fin.guest", "fin.host", "fin.sent", "closed"], ev), ev
    times = [e.timestamp for e in crr.events]
    assert times == sorted(times) or _subsequence(["syn_ack.queued", "syn_ack.sent"], ev)
    assert crr.start_time <= min(times) and crr.end_time >= max(times)
    wait = {e.name: e.attributes for e in crr.events}["syn_ack.sent"]["aioslirp.wait_us"]
    assert wait >= 0

    tid, fid = crr.context.trace_id, crr.context.span_id
    children = [s for s in spans if s.parent is not None and s.parent.span_id == fid]
    assert all(s.context.trace_id == tid for s in children)
    names = [s.name for s in children]
    (syn_ack,) = [s for s in children if s.name == "tcp.syn_ack"]
    assert syn_ack.attributes["client.port"] == a["client.port"]
    assert syn_ack.attributes["server.port"] == server.port
    assert syn_ack.attributes["aioslirp.connect.immediate"] is False
    assert syn_ack.attributes["aioslirp.connect_us"] >= 0
    frames = [s for s in children if s.name == "process_guest_frame"]
    flags = [s.attributes.get("aioslirp.tcp.flags") for s in frames]
    assert flags[0] == "S", flags  # the SYN that created the flow is its first child frame
    assert "FA" in flags and any("P" in (f or "") for f in flags), flags
    for s in frames:
        assert s.attributes["aioslirp.ethertype"] == 0x0800 and s.attributes["network.transport"] == "tcp"
        assert s.attributes["aioslirp.processing_us"] >= 0 and s.end_time >= s.start_time
    # the SYN-ACK, then the answer and our FIN (which carries the ACK of the guest's FIN): 2-3 batches
    assert names.count("drain_to_guest") >= 2 and names.count("writer_wake") >= 2
    for s in children:
        if s.name in ("drain_to_guest", "writer_wake"):
            assert s.attributes["aioslirp.frames"] >= 1
            assert [l.context.span_id for l in s.links] == [fid]
    wake = [s for s in children if s.name == "writer_wake"][0]
    if _native_tcp():  # the engine writes each frame at once: no inject queue, no wait to report
        assert "aioslirp.wait_us.max" not in wake.attributes and wake.attributes["aioslirp.plane"] == "native"
    else:
        assert wake.attributes["aioslirp.wait_us.max"] >= wake.attributes["aioslirp.wait_us.min"] >= 0

    r = ref.attributes
    assert r["aioslirp.tcp.outcome"] == "refused"
    assert r["aioslirp.bytes.from_guest"] == 0 and r["aioslirp.bytes.to_guest"] == 0
    assert _subsequence(["connect.refused", "rst.sent"], _events(ref)), _events(ref)
    assert "established" not in _events(ref)
    rchildren = [s for s in spans if s.parent is not None and s.parent.span_id == ref.context.span_id]
    assert "tcp.syn_ack" not in [s.name for s in rchildren]
    assert [s.attributes.get("aioslirp.tcp.flags") for s in rchildren if s.name == "process_guest_frame"] == ["S"]
    assert ref.context.trace_id != tid


async def test_tracing_off_records_nothing(memory_tracing):
    tracing.disable()
    server = EchoOnce()
    stacks = []

    def factory(config):
        stacks.append(Stack(config))
        return stacks[-1]

    try:
        rc = await run_in_namespace(NetworkConfig(), [sys.executable, "-c", crr_script(server.port, 3)],
                                    stack_factory=factory)
    finally:
        server.close()
    assert rc == 0 and server.accepted == 3
    assert memory_tracing.get_finished_spans() == ()
    assert len(stacks) == 1 and stacks[0].tracer is None  # nothing to record into


# ---------------------------------------------------------------------------- OTLP/HTTP


class OtlpReceiver:
    """OTLP/HTTP receiver on 127.0.0.1: decodes /v1/traces and /v1/metrics (protobuf)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        recv = self
        self.traces: list = []
        self.metrics: list = []
        self.headers: list = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                recv.headers.append(dict(self.headers))
                if self.path == "/v1/traces":
                    req = trace_service_pb2.ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    recv.traces.append(req)
                    out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest()
                    req.ParseFromString(body)
                    recv.metrics.append(req)
                    out = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list:
        """``[(resource attributes, span)]`` of everything received."""
        out = []
        for req in self.traces:
            for rs in req.resource_spans:
                res = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        out.append((res, sp))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


def test_otlp_export_of_20_guest_connections():
    native = _native_tcp()
    receiver = OtlpReceiver()
    server = EchoOnce()
    env = dict(os.environ, OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
               OTEL_EXPORTER_OTLP_HEADERS="x-aioslirp-test=yes", OTEL_BSP_SCHEDULE_DELAY="200")
    env.pop("OTEL_SERVICE_NAME", None)
    try:
        p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--otlp-endpoint", f"http://127.0.0.1:{receiver.port}",
                            "--trace-level", "frames", "--", sys.executable, "-c", crr_script(server.port, 20)],
                           capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        assert p.returncode == 0, p.stderr
        assert server.accepted == 20
        spans = receiver.spans()
    finally:
        server.close()
        receiver.close()
    flows = [(res, sp) for res, sp in spans if sp.name == "tcp.flow" and _attrs(sp.attributes).get("server.port") == server.port]
    assert len(flows) == 20
    ports = set()
    for res, sp in flows:
        assert res["service.name"] == "aioslirp"
        assert res["deployment.environment"] == "test"
        a = _attrs(sp.attributes)
        assert a["client.address"] == "10.0.2.15" and a["network.transport"] == "tcp"
        assert a["aioslirp.bytes.from_guest"] == 1 and a["aioslirp.bytes.to_guest"] == 1
        assert a["aioslirp.tcp.outcome"] == "closed"
        ev = [e.name for e in sp.events]
        assert _subsequence(["syn_ack.queued", "established", "guest.data", "host.data", "fin.guest", "closed"], ev), ev
        assert len(sp.parent_span_id) == 0 and sp.end_time_unix_nano > sp.start_time_unix_nano
        ports.add(a["client.port"])
        kids = [s for _r, s in spans if s.trace_id == sp.trace_id and s.parent_span_id == sp.span_id]
        # (on the native plane one engine wake-up may write the frames of two flows back to back
        # (flow i's FIN, flow i+1's answer): that writer_wake is a child of neither; below)
        assert {"tcp.syn_ack", "process_guest_frame", "drain_to_guest",
                *(() if native else ("writer_wake",))} <= {s.name for s in kids}
    if native:
        assert sum(sp.name == "writer_wake" for _r, sp in spans) >= 20
    assert len(ports) == 20
    assert all(h.get("x-aioslirp-test") == "yes" for h in receiver.headers)
    # metrics: the stack's frame counters arrived too (final export at exit)
    points = {}
    for req in receiver.metrics:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for dp in m.sum.data_points:
                        points[(m.name, tuple(sorted(_attrs(dp.attributes).items())))] = dp.as_int
    assert points[("aioslirp.frames", (("network.io.direction", "receive"),))] > 20 * 5
    # at least SYN-ACK, the answer (carrying the delayed ACK of the request), our FIN (carrying the
    # delayed ACK of the guest's FIN)
    assert points[("aioslirp.frames", (("network.io.direction", "transmit"),))] >= 20 * 3
    assert points[("aioslirp.flows.opened", (("network.transport", "tcp"),))] == 20


def test_otlp_without_the_extra_is_one_line():
    code = ("import sys; sys.modules['opentelemetry.exporter.otlp.proto.http.trace_exporter'] = None; "
            "from aioslirp.cli import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, "run", "--otlp-endpoint", "http://127.0.0.1:4318", "--", "true"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "aioslirp: error: --otlp-endpoint: needs the otlp extra: pip install 'aioslirp[otlp]' "
        "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"]


@pytest.mark.parametrize("args, option", [
    (["--otlp-endpoint", "ftp://127.0.0.1"], "--otlp-endpoint"),
    (["--otlp-endpoint", "http://"], "--otlp-endpoint"),
    (["--trace", "/nonexistent-dir/t.jsonl"], "--trace"),
    (["--trace", "/"], "--trace"),
    (["--pcap", "/nonexistent-dir/x.pcap"], "--pcap"),
    (["--pcap-max-bytes", "1M"], "--pcap-max-bytes"),
    (["--pcap", "x.pcap", "--pcap-max-bytes", "lots"], "--pcap-max-bytes"),
    (["--pcap", "x.pcap", "--pcap-max-bytes", "10"], "--pcap-max-bytes"),
])
def test_observability_option_errors_are_one_line(tmp_path, args, option):
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", *args, "--", "true"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "Traceback" not in p.stderr
    assert not (tmp_path / "x.pcap").exists()


# ---------------------------------------------------------------------------- trace file + report


def test_trace_file_and_report_show_the_real_gaps(tmp_path):
    """Host server answers 40 ms after the request; the guest waits 300 ms between connections.
    The report built from the stack's own --trace file must show these gaps: each at least as
    long as what caused it (no upper bounds: a loaded machine only makes them longer), and the
    idle gap the largest stage."""
    from aioslirp.cli.trace_report import IDLE_STAGE, build_report, load_spans, percentile

    server = EchoOnce(delay=0.040)
    trace = tmp_path / "crr.jsonl"
    try:
        p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--trace", str(trace), "--trace-level", "frames",
                            "--", sys.executable, "-c", crr_script(server.port, 6, idle=0.300)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        server.close()
    assert p.returncode == 0, p.stderr
    spans = load_spans(str(trace))
    for s in spans:
        assert set(s) >= {"name", "trace_id", "span_id", "parent_span_id", "start_ns", "end_ns", "attributes", "events"}
    rep = build_report(spans)
    conns = [c for c in rep.connections if c.server.endswith(f":{server.port}")]
    assert len(conns) == 6
    for c in conns:
        gaps = c.gaps()
        assert gaps[0][0] == "syn" and gaps[-1][0] == "flow.end"
        # the gaps add up to the connection's length, and follow its event times
        assert abs(sum(g for _n, _o, g in gaps[1:]) - (c.end_ns - c.start_ns) / 1000) < 1.0
        names = [n for n, _t in c.events]
        assert _subsequence(["guest.data", "host.data"], names)
        # causality: the host's answer left the server 40 ms after the request reached it
        delay_us = (c.time_of("host.data") - c.time_of("guest.data")) / 1000
        assert delay_us >= 40_000, delay_us
    resp = rep.stages["guest.data → host.data"]
    assert percentile(resp, 50) >= 40_000
    idle = rep.stages[IDLE_STAGE]
    # seen by the stack: from processing the guest's FIN (a little after the guest sent it,
    # when the loop is busy) to the next SYN (the guest slept 300 ms in between); half of the
    # sleep leaves room for a FIN processed late, not for a stage that misses the sleep
    assert len(idle) == 5 and all(v >= 150_000 for v in idle), idle
    assert rep.largest == IDLE_STAGE
    assert percentile(rep.cycles, 50) >= 300_000  # a cycle holds the 40 ms answer and the 300 ms sleep

    png = tmp_path / "crr.png"
    p = subprocess.run([sys.executable, "-m", "aioslirp", "trace-report", str(trace), "--connections", "2",
                        "--png", str(png)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "6 TCP connections" in out and out.count("\nconnection ") == 2 and "(4 more connections" in out
    assert "guest.data → host.data" in out and "fin.guest → next syn" in out
    verdict = [line for line in out.splitlines() if line.startswith("verdict:")]
    assert len(verdict) == 1 and IDLE_STAGE in verdict[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_trace_level_records_flow_spans_only_and_the_report_says_what_it_lacks(tmp_path):
    """``aioslirp run --trace`` without --trace-level: one span per flow (the connections, the
    guest's DNS/ND traffic makes none of its own), no events, no per-frame span; trace-report
    reads it, exits 0 and says the stages need --trace-level timeline and the trace points frames."""
    server = EchoOnce()
    trace = tmp_path / "flows.jsonl"
    try:
        p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--trace", str(trace), "--",
                            sys.executable, "-c", crr_script(server.port, 3)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        server.close()
    assert p.returncode == 0, p.stderr
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    assert spans and all(s["name"].endswith(".flow") and not s["parent_span_id"] and not s["events"] for s in spans)
    flows = [s for s in spans if s["name"] == "tcp.flow" and s["attributes"]["server.port"] == server.port]
    assert len(flows) == 3
    assert all(s["attributes"]["aioslirp.tcp.outcome"] == "closed" for s in flows)
    assert all(s["attributes"]["aioslirp.bytes.to_guest"] == 1 for s in flows)
    p = subprocess.run([sys.executable, "-m", "aioslirp", "trace-report", str(trace)], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "trace level flows" in p.stdout
    assert "stage breakdown needs --trace-level timeline or frames" in p.stdout
    assert "per-frame trace points need --trace-level frames" in p.stdout
    (verdict,) = [line for line in p.stdout.splitlines() if line.startswith("verdict:")]
    assert "--trace-level timeline" in verdict


def test_trace_report_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n\n")
    for path in (str(tmp_path / "missing.jsonl"), str(empty)):
        p = subprocess.run([sys.executable, "-m", "aioslirp", "trace-report", path], capture_output=True, text=True,
                           timeout=60, cwd=REPO)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "FILE" in p.stderr


def test_sigterm_flushes_spans(tmp_path):
    """SIGTERM to `aioslirp run`: the command ends, the stack stops, and every span (the
    finished connection's and the one still open at the signal) is in the file."""
    server = EchoOnce()
    trace = tmp_path / "t.jsonl"
    script = textwrap.dedent(f"""
        import socket, sys, time
        s = socket.create_connection(("10.0.2.2", {server.port}), timeout=20)
        s.sendall(b"x"); assert s.recv(1) == b"x"; s.close()
        held = socket.create_connection(("10.0.2.2", {server.port}), timeout=20)
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "aioslirp", "run", "--trace", str(trace), "--trace-level", "timeline",
                             "--", sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.close()
    assert proc.returncode == 128 + signal.SIGTERM, err
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    flows = [s for s in spans if s["name"] == "tcp.flow" and s["attributes"]["server.port"] == server.port]
    assert len(flows) == 2 and len({s["attributes"]["client.port"] for s in flows}) == 2
    first, held = sorted(flows, key=lambda s: s["start_ns"])
    assert first["attributes"]["aioslirp.tcp.outcome"] == "closed"
    assert "established" in [e["name"] for e in held["events"]]
    # the held connection ends with the stack: gracefully if the dying guest's FIN exchange
    # finished first, else reset by the stack's shutdown
    assert held["attributes"]["aioslirp.tcp.outcome"] in ("closed", "reset")


# ---------------------------------------------------------------------------- metrics + stats


async def test_metrics_and_stats_read_the_counters():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from aioslirp.observe.metrics import register

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
            register(stack, provider)
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            guest_mac = bytes.fromhex("525400123456")
            arp = (b"\xff" * 6 + guest_mac + b"\x08\x06" + bytes.fromhex("0001080006040001") + guest_mac
                   + socket.inet_aton("10.0.2.15") + b"\x00" * 6 + socket.inet_aton("10.0.2.2"))
            a.send(arp)
            a.send(b"\x00" * 10)  # truncated_eth
            a.send(b"\x00" * 10)
            a.setblocking(False)
            loop = asyncio.get_running_loop()
            received = []  # everything the stack sent (the ARP reply, and e.g. IPv6 router advertisements)
            while True:
                try:
                    received.append(await asyncio.wait_for(loop.sock_recv(a, 70000), 0.3))
                except asyncio.TimeoutError:
                    break
            (reply,) = [f for f in received if f[12:14] == b"\x08\x06"]
            data = reader.get_metrics_data()
            stats = stack.stats()
            stack.stop()
            await task
    finally:
        a.close()
        provider.shutdown()
    points = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    points[(m.name, tuple(sorted(dp.attributes.items())))] = dp.value
    assert points[("aioslirp.frames", (("network.io.direction", "receive"),))] == 3
    assert points[("aioslirp.frames", (("network.io.direction", "transmit"),))] == len(received)
    assert points[("aioslirp.bytes", (("network.io.direction", "receive"),))] == len(arp) + 20
    assert points[("aioslirp.bytes", (("network.io.direction", "transmit"),))] == sum(map(len, received))
    assert points[("aioslirp.drops", (("aioslirp.drop.reason", "truncated_eth"),))] == 2
    assert stats["counters"]["frames_in"] == 3 and stats["counters"]["drop.truncated_eth"] == 2
    assert stats["counters"]["bytes_out"] == sum(map(len, received))
    assert stats["flows"] == {} and stats["inject_queue"]["depth"] == 0
    assert stats["inject_queue"]["size"] == NetworkConfig().inject_queue_size
    json.dumps(stats)


async def test_two_stacks_trace_into_their_own_providers_and_an_untraced_one_records_nothing():
    """Three stacks in one process at once, each behind its own guest namespace: A traced into
    exporter A, B into exporter B, C untraced (and no process-wide default). Each exporter holds
    the spans of its own stack's connections and nothing else."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    assert not tracing.enabled
    exporters, providers = [], []
    for _ in range(2):
        exporters.append(InMemorySpanExporter())
        providers.append(TracerProvider())
        providers[-1].add_span_processor(SimpleSpanProcessor(exporters[-1]))
    servers = [EchoOnce() for _ in range(3)]
    counts = [2, 3, 4]  # connections of the guests behind A, B, C
    stacks: dict = {}

    def factory_for(name, provider):
        def factory(config):
            stacks[name] = Stack(config) if provider is None else Stack(config, tracer_provider=provider)
            return stacks[name]
        return factory

    try:
        rcs = await asyncio.gather(*(
            run_in_namespace(NetworkConfig(trace_level="frames"), [sys.executable, "-c", crr_script(srv.port, n)],
                             stack_factory=factory_for(name, provider))
            for name, srv, n, provider in zip("ABC", servers, counts, [*providers, None])))
    finally:
        for srv in servers:
            srv.close()
    try:
        assert rcs == [0, 0, 0] and [s.accepted for s in servers] == counts
        a, b, c = stacks["A"], stacks["B"], stacks["C"]
        assert c.tracer is None
        assert a.tracer is not None and b.tracer is not None and a.tracer is not b.tracer
        for st in (a, b):
            assert st.tracer.errors == 0 and not st.tracer.open and not st.tracer.stamps and not st.tracer.records
        ports = [s.port for s in servers]
        for exporter, port, n in zip(exporters, ports, counts):
            spans = exporter.get_finished_spans()
            flows = [s for s in spans if s.name == "tcp.flow"]
            # its own connections, nothing of the other traced stack's nor of the untraced one's
            assert [s.attributes["server.port"] for s in flows] == [port] * n
            assert len({s.attributes["client.port"] for s in flows}) == n
            assert all(s.attributes["aioslirp.tcp.outcome"] == "closed" for s in flows)
            assert all(s.attributes["aioslirp.bytes.from_guest"] == 1 for s in flows)
            by_id = {s.context.span_id for s in spans}
            flow_ids = {s.context.span_id for s in flows}
            children = [s for s in spans if s.parent is not None]
            assert all(s.parent.span_id in by_id for s in children)  # no span parented elsewhere
            syn_acks = [s for s in children if s.name == "tcp.syn_ack"]
            assert len(syn_acks) == n and {s.parent.span_id for s in syn_acks} == flow_ids
            assert all(s.attributes["server.port"] == port for s in syn_acks)
            frames = [s for s in children if s.name == "process_guest_frame"]
            # per connection at least SYN, the ACK of the SYN-ACK, the request, the guest's FIN
            assert len(frames) >= 4 * n and {s.parent.span_id for s in frames} == flow_ids
            assert {s.attributes["aioslirp.tcp.flags"] for s in frames} >= {"S", "FA"}
            drains = [s for s in spans if s.name == "drain_to_guest"]
            assert drains and all(link.context.span_id in flow_ids for s in drains for link in s.links)
    finally:
        for p in providers:
            p.shutdown()


def test_the_tracer_hooks_are_named_apart_from_the_data_path():
    """A name search finds one thing: the tracer records (``record_segment``, ``record_host_data``...),
    the data path acts (``TcpFlow.on_segment``...); no method name is shared between them."""
    import inspect

    from aioslirp.dispatch.l4 import L4
    from aioslirp.dispatch.link import Link
    from aioslirp.flow.table import FlowTable
    from aioslirp.inject import InjectQueue
    from aioslirp.nat.hostsock import HostSocket
    from aioslirp.nat.tcp import TcpFlow
    from aioslirp.transport.trace import TraceTransport

    def methods(cls) -> set[str]:
        return {n for n, v in inspect.getmembers(cls) if callable(v) and not n.startswith("_")}

    hooks = methods(tracing.Tracer)
    data_path = set().union(*(methods(c) for c in (TcpFlow, HostSocket, Link, L4, FlowTable, InjectQueue,
                                                    TraceTransport)))
    assert hooks & data_path == set()
    assert {"record_segment", "record_host_data", "record_batch_start", "record_frame_queued",
            "record_drain"} <= hooks
