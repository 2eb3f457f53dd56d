"""The native TCP engine's flow events (``TN_TR_EVENT`` of aioslirp/native/tcpnat.h) with fake sockets:
from trace level ``timeline`` the engine writes the moments of each flow's TCP timeline into its trace
ring (the guest's ACK of the SYN-ACK, guest and host data, each FIN, a reset, the end), the data
ones for the first eight of each direction of each flow only; ``NativeTcp`` drains them into the
flow span's events under the Python path's names (aioslirp.observe.tracing), with the engine's
timestamps."""

from __future__ import annotations

import errno

import pytest

from support.native import need_extension
from support.native_tcp import ACK, FIN, GW_MAC, IRS, ISS, MTU, PSH, RST, EngineFlow

EVENT, WAKE = 5, 4
ESTABLISHED, GUEST_DATA, HOST_DATA, FIN_GUEST, FIN_HOST, RESET, CLOSED = range(1, 8)
CONNECT_REFUSED, CONNECT_UNREACHABLE = 8, 9
SYN_ACK_SENT, DATA_SENT, FIN_SENT, RST_SENT = range(10, 14)
DATA_EVENTS = 8  # TN_TRACE_DATA_EVENTS


def _engine():
    ext = need_extension()
    e = ext.TcpEngine(-1, False, False, GW_MAC, MTU, 16, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    e.trace(1024)
    return e


def _events(e, f: EngineFlow | None = None, sent: bool = False) -> list:
    """(event, bytes) of the flow events in the ring (of ``f`` only when given; the ``*.sent`` ones
    with ``sent`` only), oldest first."""
    recs, overflow = e.trace_take()
    assert overflow == 0
    return [(r[5], r[6]) for r in recs
            if r[0] == EVENT and (f is None or r[1:3] == (f.slot, f.gen)) and (sent or r[5] < SYN_ACK_SENT)]


def test_the_timeline_of_a_flow_in_order_with_its_byte_counts():
    e = _engine()
    f = EngineFlow(engine=e)
    assert _events(e) == []  # the SYN-ACK is its own record (TN_TR_SYN_ACK), not an event
    f.send(ACK)
    f.send(ACK | PSH, data=b"hello")
    f.host_send(b"y" * 4000)  # one read, three segments to the guest: one event
    f.send(ACK, seq=IRS + 6, ack=ISS + 4001)
    f.send(ACK | FIN, seq=IRS + 6, ack=ISS + 4001)
    f.host_eof()
    assert f.out()[-1].flags & FIN
    f.send(ACK, seq=IRS + 7, ack=ISS + 4002)  # our FIN acknowledged: the end
    recs, _ = e.trace_take()
    events = [r for r in recs if r[0] == EVENT and r[5] < SYN_ACK_SENT]
    assert all(r[1:3] == (f.slot, f.gen) for r in events)
    assert [(r[5], r[6]) for r in events] == [(ESTABLISHED, 0), (GUEST_DATA, 5), (HOST_DATA, 4000), (FIN_GUEST, 0),
                                              (FIN_HOST, 0), (CLOSED, 0)]
    ts = [r[3] for r in events]
    assert ts == sorted(ts) and ts[0] > 0  # CLOSED is written where the end is decided, before its record
    f.poll(0.1)
    assert [r[2] for r in f.records] == [2]  # (the ENDED record follows)


def test_data_events_stop_at_eight_per_direction_of_each_flow():
    e = _engine()
    f = EngineFlow(engine=e).established()
    g = EngineFlow(engine=e, gport=40001)
    g.send(ACK)
    _events(e)
    for i in range(20):
        f.send(ACK | PSH, seq=IRS + 1 + 10 * i, data=b"0123456789")
        f.host_send(b"z" * 100)
        f.send(ACK, seq=IRS + 11 + 10 * i, ack=ISS + 101 + 100 * i)  # consumed: the next read is new
    assert f.info()[2:4] == (200, 2000)  # every byte moved
    got = _events(e, f)
    assert got.count((GUEST_DATA, 10)) == DATA_EVENTS and got.count((HOST_DATA, 100)) == DATA_EVENTS
    assert len(got) == 2 * DATA_EVENTS
    g.send(ACK | PSH, data=b"abc")  # another flow has its own count
    assert _events(e) == [(GUEST_DATA, 3)]


def test_host_data_sent_again_is_no_new_event():
    e = _engine()
    f = EngineFlow(engine=e).established()
    assert _events(e) == [(ESTABLISHED, 0)]
    f.host_send(b"r" * 100)
    f.out()
    f.poll(5.0)  # the retransmission timeout: the same 100 bytes again
    assert [len(s.payload) for s in f.out()] == [100]
    assert _events(e) == [(HOST_DATA, 100)]


def test_the_ends_say_reset_and_closed_as_the_python_path():
    e = _engine()
    f = EngineFlow(engine=e).established()
    f.send(RST | ACK, seq=IRS + 1)  # the guest resets: "reset", then "closed"
    assert _events(e) == [(ESTABLISHED, 0), (RESET, 0), (CLOSED, 0)]
    g = EngineFlow(engine=e, gport=40001).established()
    _events(e)
    g.e.fake_host_reset(g.fd, 0.1)  # the host peer lost: the flow is closed, the guest was not the one to reset
    assert _events(e) == [(CLOSED, 0)]
    assert g.out()[-1].flags & RST
    h = EngineFlow(engine=e, gport=40002).established()
    _events(e)
    assert e.close_flow(h.slot, h.gen, 0.2)  # Python's shutdown: no event of the connection's
    assert _events(e) == []


def test_frames_written_are_sent_events_data_ones_capped():
    e = _engine()
    f = EngineFlow(engine=e)
    f.send(ACK)
    assert _events(e, sent=True) == [(SYN_ACK_SENT, 0), (ESTABLISHED, 0)]
    for i in range(12):
        f.host_send(b"d" * 10)
        f.send(ACK, ack=ISS + 11 + 10 * i)
    f.send(ACK | PSH, data=b"q")  # its ACK: no event
    f.host_eof()
    got = _events(e, sent=True)
    assert [ev for ev in got if ev[0] >= SYN_ACK_SENT] == [(DATA_SENT, 10)] * DATA_EVENTS + [(FIN_SENT, 0)]
    assert f.out()[-1].flags & FIN
    g = EngineFlow(engine=e, gport=40001).established()
    _events(e)
    assert e.close_flow(g.slot, g.gen, 0.5)
    assert _events(e, sent=True) == [(RST_SENT, 0)]


def test_a_failed_connect_says_why_before_its_rst():
    e = _engine()
    e.fake_connect_mode(errno.ECONNREFUSED)
    EngineFlow(engine=e, connect=errno.ECONNREFUSED)
    assert _events(e, sent=True) == [(CONNECT_REFUSED, 0), (RST_SENT, 0)]  # and no "closed"
    e.fake_connect_mode(errno.EINPROGRESS)
    g = EngineFlow(engine=e, connect=errno.EINPROGRESS, gport=40001)
    g.poll(10.5)  # the connect timeout: ICMP from Python, nothing to the guest from C
    assert _events(e, sent=True) == [(CONNECT_UNREACHABLE, 0)]


def test_a_wake_up_that_wrote_one_flows_frames_names_it():
    e = _engine()
    f = EngineFlow(engine=e).established()
    e.trace_take()
    f.host_send(b"w" * 100)
    (wake,) = [r for r in e.trace_take()[0] if r[0] == WAKE]
    assert wake[1:3] == (f.slot, f.gen) and wake[7] == 1
    f.send(ACK, ack=ISS + 101)
    f.e.fake_host_send(f.fd, b"", 0.1)  # a readiness that finds nothing to send: no frame, no flow
    (wake,) = [r for r in e.trace_take()[0] if r[0] == WAKE]
    assert wake[1] == -1 and wake[7] == 0


# ------------------------------------------------------------------ into the flow span


def _flow(plane, f: EngineFlow):
    """The flow table's entry of engine flow ``f`` (a real ``NativeTcpFlow``: the compiled module
    takes no stand-in), as adoption makes it, with no guard (no policy name or rule)."""
    from aioslirp.nat.native_tcp import NativeTcpFlow

    key = (6, b"\x0a\x00\x02\x0f", f.gport, b"\x0a\x00\x02\x02", 8080)
    return NativeTcpFlow(plane, None, key, "127.0.0.1", b"", 0.0, f.slot, f.gen, plane)


@pytest.fixture
def exporter():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    exp.provider = provider
    yield exp
    provider.shutdown()


@pytest.mark.parametrize("frames", [False, True], ids=["timeline", "frames"])
async def test_native_tcp_drains_the_events_into_the_flow_span_before_its_end(exporter, frames):
    from aioslirp import NetworkConfig, Stack
    from aioslirp.nat.native_tcp import NativeTcp
    from aioslirp.observe.tracing import MAX_DATA_EVENTS

    assert MAX_DATA_EVENTS == DATA_EVENTS  # the engine's cap is the tracer's
    stack = Stack(NetworkConfig(trace_level="timeline"), tracer_provider=exporter.provider)
    await stack.start()
    ctx = stack.parts.ctx
    tracer = ctx.tracer
    ext = need_extension()
    engine = ext.TcpEngine(-1, False, False, GW_MAC, MTU, 16, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    plane = NativeTcp(ctx, engine, frames)  # tracing at "timeline" or "frames": the engine's trace points on
    try:
        _drain_into_the_span(exporter, tracer, engine, plane, frames)
    finally:
        plane.close()
        await stack.aclose()


def _drain_into_the_span(exporter, tracer, engine, plane, frames: bool) -> None:
    from aioslirp.observe.tracing import MAX_DATA_EVENTS

    f = EngineFlow(engine=engine)
    flow = _flow(plane, f)
    plane.ctx.table.add(flow)  # (its span opens)
    plane.flows[(f.slot, f.gen)] = flow
    f.send(ACK)
    for i in range(10):
        f.send(ACK | PSH, seq=IRS + 1 + 3 * i, data=b"abc")
    f.send(ACK | FIN, seq=IRS + 31)
    f.host_send(b"ok")
    f.host_eof()
    f.send(ACK, seq=IRS + 32, ack=ISS + 4)  # the end: its events and its record in one take
    plane.take()
    assert flow.key not in plane.ctx.table.flows and plane.ctx.counters["flows.tcp.closed"] == 1
    assert flow.ended and (flow.bytes_up, flow.bytes_down, flow.outcome) == (30, 2, "closed")
    tracer.end_all()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "tcp.flow"]
    names = [ev.name for ev in span.events]
    sent = (lambda name: [name]) if frames else (lambda name: [])  # the *.sent events: at "frames" only
    assert names == ["host.connect", "syn_ack.queued", *sent("syn_ack.sent"), "established",
                     *["guest.data"] * MAX_DATA_EVENTS, "fin.guest", "host.data", *sent("data.sent"), "fin.host",
                     *sent("fin.sent"), "closed"]
    assert all(ev.attributes["aioslirp.wait_us"] == 0 for ev in span.events if ev.name.endswith(".sent"))
    assert [ev.attributes["aioslirp.bytes"] for ev in span.events if ev.name.endswith(".data")] == [3] * 8 + [2]
    times = [ev.timestamp for ev in span.events]
    assert times == sorted(times) and times[-1] - times[0] < 10**9  # the engine's moments, on the span's clock
