"""A guest's identity (issue 28 item 3): ``Stack(name=..., labels=...)`` is carried by every audit
record, span, event, ``FlowInfo`` and the stack's log lines, so that one audit log and one tracer
provider serve many stacks; bad input is one ``ConfigError`` line naming the field; ``aioslirp
run --name --label`` reaches the audit log of a real guest.

In-process stacks are served over socketpairs with real host sockets on loopback (a UDP echo
server), as tests/unit/observe/test_audit.py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack
from aioslirp.errors import ConfigError
from aioslirp.frontends.spawn import spawn
from aioslirp.observe.audit import AuditLog

from support.frames import F4 as V4, udp_frame
from support.guests import run_guest
from support.servers import DnsUpstream, UdpEcho
from support.stacks import recv_frames

RED = {"team": "red", "tier.env": "ci-1"}


@contextlib.asynccontextmanager
async def _served(cfg, **kw):
    """A Stack(``cfg``, ``kw``) served over a socketpair; yields ``(stack, guest socket)``."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        async with Stack(cfg, **kw) as stack:
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0)
            await recv_frames(a, 0.2)
            yield stack, a
            stack.stop()
            await task
    finally:
        a.close()


async def _one_udp_flow(guest, port: int, sport: int) -> None:
    """The guest sends one datagram to the host's ``port`` (via the gateway) and gets its echo."""
    guest.send(udp_frame(V4, sport, port, b"ping"))
    got = await recv_frames(guest, 1.0)
    assert any(b"ping" in f for f in got)


async def test_one_audit_log_for_two_stacks_tells_their_guests_apart():
    buf = io.StringIO()
    audit = AuditLog(buf)
    echo = UdpEcho()
    cfg = NetworkConfig(egress_deny=["127.0.0.1:9/udp"])
    try:
        async with _served(cfg, name="alpha", labels=RED, audit=audit) as (a, ga), \
                _served(cfg, audit=audit) as (b, gb):
            await _one_udp_flow(ga, echo.port, 40001)
            await _one_udp_flow(gb, echo.port, 40002)
            ga.send(udp_frame(V4, 40003, 9, b"x"))  # denied: a deny record
            gb.send(udp_frame(V4, 40004, 9, b"x"))
            await recv_frames(ga, 0.3)
            a.reset_flows()
            b.reset_flows()
    finally:
        echo.sock.close()
        audit.close()
    recs = [json.loads(line) for line in buf.getvalue().splitlines()]
    mine = {(r["event"], r["guest_port"]): r for r in recs if r["event"] in ("flow", "deny")}
    for port in (40001, 40003):  # alpha's flow and denial
        r = mine[("flow" if port == 40001 else "deny", port)]
        assert r["guest_name"] == "alpha" and r["labels"] == RED
    for port in (40002, 40004):  # the unnamed stack's: no guest field beyond today's
        r = mine[("flow" if port == 40002 else "deny", port)]
        assert "guest_name" not in r and "labels" not in r


async def test_flows_and_events_carry_the_name():
    echo = UdpEcho()
    seen: list = []
    try:
        async with _served(NetworkConfig(), name="beta", labels={"team": "blue"}) as (stack, guest):
            stack.on_event(seen.append)
            guest.send(udp_frame(V4, 40010, echo.port, b"ping"))
            await recv_frames(guest, 0.5)
            (info,) = stack.flows()
            assert (info.protocol, info.guest_name) == ("udp", "beta")
            events = stack.event_log.history()
    finally:
        echo.sock.close()
    assert [e.name for e in events] == ["ready", "guest_link_up"]
    assert all(e.data["guest_name"] == "beta" and e.data["labels"] == {"team": "blue"} for e in events + seen)
    assert events[0].to_json()["guest_name"] == "beta"
    assert stack.identity.name == "beta" and dict(stack.identity.labels) == {"team": "blue"}
    async with _served(NetworkConfig()) as (plain, guest):
        guest.send(udp_frame(V4, 40011, 9, b"x"))
        await recv_frames(guest, 0.3)
        assert [i.guest_name for i in plain.flows()] == [None]
        assert "guest_name" not in plain.event_log.history()[0].data
        assert plain.identity.name is None and not plain.identity.labels


async def test_one_tracer_provider_serves_two_stacks_split_by_guest_name():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    echo = UdpEcho()
    try:
        frames = NetworkConfig(trace_level="frames")  # the per-frame spans too, each with its guest
        async with _served(frames, name="g1", labels={"team": "red"}, tracer_provider=provider) as (a, ga), \
                _served(NetworkConfig(trace_level="frames"), name="g2", tracer_provider=provider) as (b, gb):
            await _one_udp_flow(ga, echo.port, 40021)
            await _one_udp_flow(ga, echo.port, 40022)
            await _one_udp_flow(gb, echo.port, 40023)
    finally:
        echo.sock.close()
        provider.shutdown()
    spans = exporter.get_finished_spans()
    assert spans
    by = {}
    for s in spans:  # every span says whose it is
        by.setdefault(s.attributes["aioslirp.guest.name"], []).append(s)
    assert set(by) == {"g1", "g2"}
    flows = {g: sorted(s.attributes["client.port"] for s in ss if s.name == "udp.flow") for g, ss in by.items()}
    assert flows == {"g1": [40021, 40022], "g2": [40023]}
    assert {s.name for s in by["g1"]} >= {"udp.flow", "process_guest_frame", "drain_to_guest"}
    assert all(s.attributes["aioslirp.guest.label.team"] == "red" for s in by["g1"])
    assert not any("aioslirp.guest.label.team" in s.attributes for s in by["g2"])


def test_the_json_span_file_keeps_the_resource(tmp_path):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from aioslirp.observe.spanfile import JsonLinesSpanExporter

    exporter = JsonLinesSpanExporter(str(tmp_path / "t.jsonl"))
    tp = TracerProvider(resource=Resource.create({"service.name": "aioslirp", "host.name": "box-7"}))
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    tp.get_tracer("t").start_span("s", attributes={"aioslirp.guest.name": "g"}).end()
    tp.shutdown()
    (line,) = (tmp_path / "t.jsonl").read_text().splitlines()
    obj = json.loads(line)
    assert obj["resource"]["service.name"] == "aioslirp" and obj["resource"]["host.name"] == "box-7"
    assert obj["attributes"] == {"aioslirp.guest.name": "g"}


async def test_log_lines_about_the_guest_carry_its_name(caplog):
    caplog.set_level(logging.INFO, logger="aioslirp")
    async with Stack(NetworkConfig(), name="gamma") as stack:
        stack.route("10.0.2.2:80", lambda *a: None)  # a route on the guest-side gateway: one warning
    msgs = [r for r in caplog.records if r.name == "aioslirp.stack"]
    texts = [r.getMessage() for r in msgs]
    assert any(t.startswith("[gamma] stack started: guest 10.0.2.15") for t in texts), texts
    assert any(t.startswith("[gamma] route '10.0.2.2:80'") for t in texts), texts
    assert "[gamma] stack closed" in texts
    assert all(r.guest_name == "gamma" and r.guest_labels == {} for r in msgs)


@pytest.mark.parametrize("kw, field", [
    ({"name": ""}, "name"),
    ({"name": "a\nb"}, "name"),
    ({"name": "x" * 65}, "name"),
    ({"name": 7}, "name"),
    ({"labels": {"1team": "a"}}, "labels"),
    ({"labels": {"team": "v" * 257}}, "labels[team]"),
    ({"labels": {"team": 3}}, "labels[team]"),
    ({"labels": {f"k{i}": "v" for i in range(33)}}, "labels"),
    ({"labels": ["team=a"]}, "labels"),
])
def test_bad_name_or_labels_is_one_config_error_line_naming_the_field(kw, field):
    with pytest.raises(ConfigError) as err:
        Stack(NetworkConfig(), **kw)
    assert err.value.field == field
    text = str(err.value)
    assert text.startswith(f"{field}: ") and "\n" not in text and len(text) < 200
    with pytest.raises(ConfigError, match=f"^{field.replace('[', '.').replace(']', '.')}: "):
        spawn(["true"], **kw)  # at once, before any namespace


def test_limits_are_inclusive():
    stack = Stack(NetworkConfig(), name="n" * 64, labels={f"k{i}": "v" * 256 for i in range(32)})
    assert len(stack.identity.name) == 64 and len(stack.identity.labels) == 32
    with pytest.raises(TypeError):
        stack.identity.labels["k0"] = "x"  # read-only
    with pytest.raises(AttributeError):
        stack.identity.name = "other"


@pytest.mark.parametrize("args, want", [
    (["--name", ""], "--name: '' must be printable"),
    (["--label", "team"], "--label: 'team' is not KEY=VALUE"),
    (["--label", "1x=a"], "--label: key '1x' is not an attribute name"),
    (["--label", "a=1", "--label", "a=2"], "--label: 'a' given twice"),
])
def test_cli_identity_errors_are_one_line(args, want):
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", *args, "--", "true"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("aioslirp: error: " + want), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_name_and_labels_reach_the_audit_log_of_a_real_guest(tmp_path):
    """``aioslirp run --name --label`` with a guest (python in the namespace) sending one UDP datagram."""
    dns = DnsUpstream()
    echo = UdpEcho()
    log_path = tmp_path / "audit.jsonl"
    script = f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(5)
        s.sendto(b"hi", ("10.0.2.2", {echo.port}))
        print(s.recv(100).decode())
    """
    try:
        p = run_guest({"dns": dns}, script, "--audit-log", str(log_path), "--name", "sandbox-7",
                      "--label", "team=red", "--label", "job=42")
    finally:
        echo.sock.close()
        dns.close()
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "hi"
    recs = [json.loads(x) for x in log_path.read_text().splitlines()]
    (udp,) = [r for r in recs if r["event"] == "flow" and r["port"] == echo.port]
    assert udp["guest_name"] == "sandbox-7" and udp["labels"] == {"team": "red", "job": "42"}


def test_trace_report_picks_one_guest_of_a_shared_span_file(tmp_path):
    """A span file of two guests (one provider): ``trace-report --guest NAME`` reports that guest's
    connections only; an unknown name is one error line."""
    path = tmp_path / "t.jsonl"
    lines = []
    for i, (guest, port) in enumerate((("g1", 41001), ("g1", 41002), ("g2", 41003))):
        t = 10**18 + i * 10**9
        lines.append({"name": "tcp.flow", "trace_id": f"{i:032x}", "span_id": f"{i:016x}", "parent_span_id": None,
                      "kind": "INTERNAL", "start_ns": t, "end_ns": t + 5 * 10**6, "status": "UNSET",
                      "attributes": {"aioslirp.guest.name": guest, "client.address": "10.0.2.15",
                                     "client.port": port, "server.address": "10.0.2.2", "server.port": 80},
                      "events": [{"name": "established", "time_ns": t + 10**6, "attributes": {}},
                                 {"name": "closed", "time_ns": t + 4 * 10**6, "attributes": {}}],
                      "links": [], "resource": {"service.name": "aioslirp"}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))

    def report(*args):
        return subprocess.run([sys.executable, "-m", "aioslirp", "trace-report", str(path), *args],
                              capture_output=True, text=True, timeout=60)

    whole, g1, g2 = report(), report("--guest", "g1"), report("--guest", "g2")
    assert whole.returncode == g1.returncode == g2.returncode == 0, whole.stderr + g1.stderr
    assert all(f":{p}" in whole.stdout for p in (41001, 41002, 41003))
    assert ":41001" in g1.stdout and ":41002" in g1.stdout and ":41003" not in g1.stdout
    assert ":41003" in g2.stdout and ":41001" not in g2.stdout
    none = report("--guest", "g9")
    assert none.returncode == 2 and none.stderr.strip() == f"aioslirp: error: --guest: no span of guest 'g9' in {path}"


def test_the_span_file_exporter_is_importable_where_the_docs_say():
    """docs/observability.md and docs/many-guests.md import it from ``aioslirp.observe.spanfile``
    (a module of the library, not of the command line); ``aioslirp.cli.observe`` re-exports it."""
    from aioslirp.cli import observe as cli_observe
    from aioslirp.observe import spanfile

    assert cli_observe.JsonLinesSpanExporter is spanfile.JsonLinesSpanExporter
    docs = Path(__file__).resolve().parents[2] / "docs"
    for page in ("observability.md", "many-guests.md"):
        text = (docs / page).read_text()
        assert "from aioslirp.observe.spanfile import JsonLinesSpanExporter" in text, page
        assert "aioslirp.cli.observe import" not in text, page
