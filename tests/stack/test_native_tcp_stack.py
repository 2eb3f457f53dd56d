"""The Python side of native TCP flows (aioslirp.nat.native_tcp) in a Stack in this process, with the
engine's fake sockets (no TAP, no kernel TCP): what L4 hands it, what stays in the flow table."""

from __future__ import annotations

import asyncio

import errno
import gc

from aioslirp import NetworkConfig, Stack
from aioslirp.nat.native_tcp import NativeTcp, NativeTcpFlow

from support.frames import ACK, F4, GW_MAC, PSH, RST, SYN, tcp_frame
from support.native import need_extension


async def _stack_with_fake_engine(connect: int = 0, max_flows: int = 8):
    ext = need_extension()
    stack = Stack(NetworkConfig())
    await stack.start()
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, max_flows, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    eng.fake_connect_mode(connect)
    ctx = stack.parts.ctx
    ctx.native_tcp = NativeTcp(ctx, eng)
    return stack, eng


async def test_a_syn_read_in_the_same_batch_as_the_first_is_not_a_second_flow():
    """Two copies of a guest SYN in one batch: the first is adopted by the engine; the second was
    read before the adoption (so it reaches Python) and is dropped, not made a second flow."""
    stack, eng = await _stack_with_fake_engine()
    try:
        syn = tcp_frame(F4, 40000, 8080, SYN, seq=1000, mss=1460)
        stack.parts.link.on_frames([syn, syn])
        flows = list(stack.parts.flows.values())
        assert len(flows) == 1 and isinstance(flows[0], NativeTcpFlow)
        assert eng.live() == 1 and len(eng.fake_frames()) == 1  # one SYN-ACK
        assert stack.counters["handled.tcp_syn"] == 1 and stack.counters["handled.tcp"] == 1
        assert stack.counters["native_tcp.syn_repeated"] == 1
        assert flows[0].state == "SYN-RECEIVED" and flows[0].transport is not None
    finally:
        stack.parts.ctx.native_tcp.close()
        stack.parts.ctx.native_tcp = None
        await stack.aclose()


async def test_a_refused_connect_is_counted_and_recorded_as_on_the_python_path():
    stack, eng = await _stack_with_fake_engine(errno.ECONNREFUSED)
    try:
        stack.parts.link.on_frames([tcp_frame(F4, 40001, 8080, SYN, seq=5, mss=1460)])
        assert list(stack.parts.flows)  # until its SYN's batch is over (its frame span finds the flow)
        await asyncio.sleep(0)
        assert not stack.parts.flows
        c = stack.counters
        assert c["tcp_connect_refused"] == 1 and c["flows.tcp.opened"] == c["flows.tcp.closed"] == 1
        (rst,) = eng.fake_frames()
        assert rst[47] == RST | ACK
    finally:
        stack.parts.ctx.native_tcp.close()
        stack.parts.ctx.native_tcp = None
        await stack.aclose()


async def test_a_guest_rst_ends_the_flow_and_its_table_entry():
    """The engine's end record takes the flow out of the table, counted as the Python path counts it."""
    stack, eng = await _stack_with_fake_engine()
    try:
        stack.parts.link.on_frames([tcp_frame(F4, 40002, 8080, SYN, seq=5, mss=1460)])
        (flow,) = stack.parts.flows.values()
        assert eng.input(tcp_frame(F4, 40002, 8080, RST, seq=6), False, 0.0)  # as the TAP reader hands it
        stack.parts.ctx.native_tcp.poll()
        assert not stack.parts.flows and flow.outcome == "reset"
        assert stack.counters["tcp_resets"] == 1 and stack.counters["handled.tcp"] == 0
    finally:
        stack.parts.ctx.native_tcp.close()
        stack.parts.ctx.native_tcp = None
        await stack.aclose()


async def test_an_ended_native_flow_is_freed_at_once_not_by_the_cycle_collector():
    """The Python side of a native flow (its table entry and what the guard asks of it) holds no
    reference cycle: once its end record is taken nothing of it is left for the cyclic GC, which
    would otherwise run and walk every live object again and again at thousands of connections
    a second. Flows connected at once, after a pending connect, and refused."""
    stack, eng = await _stack_with_fake_engine(max_flows=64)
    ctx = stack.parts.ctx
    gc.collect()
    gc.disable()
    try:
        for port in range(41000, 41020):  # connected at once: a guest RST ends each
            stack.parts.link.on_frames([tcp_frame(F4, port, 8080, SYN, seq=5, mss=1460)])
            assert eng.input(tcp_frame(F4, port, 8080, RST, seq=6), False, 0.0)
            ctx.native_tcp.poll()
        eng.fake_connect_mode(errno.EINPROGRESS)
        for port in range(41100, 41110):  # a pending connect, then connected, then reset
            stack.parts.link.on_frames([tcp_frame(F4, port, 8080, SYN, seq=5, mss=1460)])
            eng.fake_connect_done(eng.fake_fds()[-1], 0, 0.0)
            ctx.native_tcp.poll()
            assert eng.input(tcp_frame(F4, port, 8080, RST, seq=6), False, 0.0)
            ctx.native_tcp.poll()
        eng.fake_connect_mode(errno.ECONNREFUSED)
        for port in range(41200, 41210):
            stack.parts.link.on_frames([tcp_frame(F4, port, 8080, SYN, seq=5, mss=1460)])
        await asyncio.sleep(0)  # the refused flows' ends are taken after their batch
        assert not stack.parts.flows and stack.counters["flows.tcp.opened"] == 40
        assert stack.counters["tcp_connect_refused"] == 10 and stack.counters["tcp_resets"] == 30
        assert [o for o in gc.get_objects() if isinstance(o, NativeTcpFlow)] == []
    finally:
        gc.enable()
        ctx.native_tcp.close()
        ctx.native_tcp = None
        await stack.aclose()


async def test_a_flow_the_full_engine_leaves_to_python_keeps_the_egress_rule_that_allowed_it():
    """The engine has no room: the Python path takes the SYN, and its flow carries the egress rule
    that let it through (the audit record's ``rule``), as the native flows do; the admission's
    decision is not taken by a native flow that was never made."""
    ext = need_extension()
    stack = Stack(NetworkConfig(egress_allow=["127.0.0.0/8"]))
    await stack.start()
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 1, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    ctx = stack.parts.ctx
    ctx.native_tcp = NativeTcp(ctx, eng)
    try:
        stack.parts.link.on_frames([tcp_frame(F4, 40010, 8080, SYN, seq=5, mss=1460)])
        stack.parts.link.on_frames([tcp_frame(F4, 40011, 8080, SYN, seq=5, mss=1460)])  # no room in the engine
        flows = {f.guest_port: f for f in stack.parts.flows.values()}
        assert isinstance(flows[40010], NativeTcpFlow) and not isinstance(flows[40011], NativeTcpFlow)
        assert flows[40010].rule == flows[40011].rule == "127.0.0.0/8"
    finally:
        ctx.native_tcp.close()
        ctx.native_tcp = None
        await stack.aclose()


async def test_syns_to_a_destination_whose_connects_hang_meet_the_pending_bound():
    """Native flows count as pending connects in the guard until the engine connects them (or they
    end), as Python flows do: a flood of SYNs to one destination meets the per-destination bound
    (``max_pending_connects`` / 4), with no internal error."""
    stack, eng = await _stack_with_fake_engine(errno.EINPROGRESS, max_flows=1024)
    try:
        frames = [tcp_frame(F4, 10000 + i, 8080, SYN, seq=i, mss=1460) for i in range(600)]
        for i in range(0, len(frames), 64):
            stack.parts.link.on_frames(frames[i:i + 64])
        c = stack.counters
        per_dest = stack.config.max_pending_connects // 4
        assert eng.live() == per_dest == c["handled.tcp_syn"]
        assert c["drop.limit_pending_connects"] == 600 - per_dest and c["drop.internal_error"] == 0
        fd = eng.fake_fds()[0]
        eng.fake_connect_done(fd, 0, 0.0)  # one connects: it no longer counts as pending
        stack.parts.ctx.native_tcp.poll()
        stack.parts.link.on_frames([tcp_frame(F4, 30000, 8080, SYN, seq=1, mss=1460)])
        assert c["handled.tcp_syn"] == per_dest + 1
    finally:
        stack.parts.ctx.native_tcp.close()
        stack.parts.ctx.native_tcp = None
        await stack.aclose()


async def test_a_native_flow_gets_its_flow_span_at_trace_level_flows():
    """At ``trace_level`` ``flows`` (the default) TCP flows stay native and the flow table gives each
    its span, as for a Python flow: the bytes from and to the guest, the state and the outcome."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    ext = need_extension()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = Stack(NetworkConfig(trace_level="flows"), tracer_provider=provider)
    await stack.start()
    ctx = stack.parts.ctx
    assert ctx.tracer is None  # no timeline: the engine's trace points stay off
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    ctx.native_tcp = NativeTcp(ctx, eng)
    try:
        stack.parts.link.on_frames([tcp_frame(F4, 40003, 8080, SYN, seq=5, mss=1460)])
        (synack,) = eng.fake_frames()
        iss = int.from_bytes(synack[38:42], "big")
        assert eng.input(tcp_frame(F4, 40003, 8080, ACK, seq=6, ack=iss + 1, data=b"abc"), False, 0.0)
        assert eng.input(tcp_frame(F4, 40003, 8080, RST, seq=9), False, 0.0)
        ctx.native_tcp.poll()
        assert not stack.parts.flows
        (span,) = [s for s in exporter.get_finished_spans() if s.attributes.get("aioslirp.tcp.outcome")]
        assert span.attributes["aioslirp.bytes.from_guest"] == 3 and span.attributes["aioslirp.bytes.to_guest"] == 0
        assert span.attributes["aioslirp.tcp.outcome"] == "reset"
        assert stack.tracer.errors == 0
    finally:
        ctx.native_tcp.close()
        ctx.native_tcp = None
        await stack.aclose()


async def test_at_trace_level_frames_native_flows_stay_native_and_trace_from_the_ring():
    """At ``trace_level`` ``frames`` the engine's trace points are on and :meth:`NativeTcp.poll` drains
    its ring into the Python path's spans: ``tcp.syn_ack`` and ``process_guest_frame`` children of
    the native flow's span, ``drain_to_guest`` of that flow, ``writer_wake`` with its event counts."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    ext = need_extension()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = Stack(NetworkConfig(trace_level="frames"), tracer_provider=provider)
    await stack.start()
    ctx = stack.parts.ctx
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    eng.fake_connect_mode(errno.EINPROGRESS)
    ctx.native_tcp = NativeTcp(ctx, eng, frames_traced=True)
    try:
        stack.parts.link.on_frames([tcp_frame(F4, 40004, 8080, SYN, seq=5, mss=1460)])
        (flow,) = stack.parts.flows.values()
        assert isinstance(flow, NativeTcpFlow)  # traced, and still native
        eng.fake_connect_done(eng.fake_fds()[0], 0, flow.started + 0.002)  # 2 ms of host connect
        (synack,) = eng.fake_frames()
        iss = int.from_bytes(synack[38:42], "big")
        assert eng.input(tcp_frame(F4, 40004, 8080, ACK, seq=6, ack=iss + 1, data=b"abc"), False, flow.started + 0.003)
        ctx.native_tcp.poll()
        spans = exporter.get_finished_spans()
        by_name: dict = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        (syn_ack,) = by_name["tcp.syn_ack"]
        assert syn_ack.attributes["aioslirp.connect_us"] == 2000 and syn_ack.attributes["server.port"] == 8080
        flow_ctx = syn_ack.parent
        assert flow_ctx is not None
        (frame,) = [s for s in by_name["process_guest_frame"] if s.attributes.get("aioslirp.plane") == "native"]
        assert frame.parent.span_id == flow_ctx.span_id
        assert frame.attributes["aioslirp.tcp.flags"] == "A"
        assert frame.attributes["aioslirp.frame.bytes"] == 57 and frame.attributes["network.type"] == "ipv4"
        drains = [s for s in by_name["drain_to_guest"] if s.attributes.get("aioslirp.plane") == "native"]
        assert [d.attributes["aioslirp.frames"] for d in drains] == [1, 1]  # the SYN-ACK, the data's ACK
        assert all(d.parent.span_id == flow_ctx.span_id for d in drains)
        (wake,) = by_name["writer_wake"]
        assert wake.attributes["aioslirp.events.socket"] == 1 and wake.attributes["aioslirp.frames"] == 1
        assert all(s.end_time >= s.start_time for s in spans)
        assert stack.tracer.errors == 0 and eng.counters()["trace_overflow"] == 0
    finally:
        ctx.native_tcp.close()
        ctx.native_tcp = None
        await stack.aclose()


async def test_segments_read_after_a_fragmented_one_wait_for_it_in_python_not_pass_it():
    """One TAP read: a native flow's segment in two IPv4 fragments (Python reassembles them), then
    the next in-order segment (the engine's). The native reader hands that next one to Python
    too (``reorders_later``), behind the fragments, so the engine gets both in order and the host
    both bytes runs. Before: it reached the engine first, ahead of the reassembled segment, and
    was dropped as out of order (a real guest retransmitted it). A datagram socket pair stands for
    the TAP fd (one frame per read, as a TAP gives)."""
    import socket

    ext = need_extension()
    stack, eng = await _stack_with_fake_engine()
    plane = ext.Plane(65536, 64, False)
    plane.attach_tcp(eng)
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    tap.setblocking(False)
    try:
        stack.parts.link.on_frames([tcp_frame(F4, 40011, 8080, SYN, seq=99, mss=1460)])
        (synack,) = eng.fake_frames()
        iss = int.from_bytes(synack[38:42], "big")
        assert eng.input(tcp_frame(F4, 40011, 8080, ACK, seq=100, ack=iss + 1), False, 0.0)
        first, second = bytes(range(256)) * 8, b"after the fragments" * 10
        seg = tcp_frame(F4, 40011, 8080, ACK | PSH, seq=100, ack=iss + 1, data=first)[14 + 20:]
        guest.send(F4.frame(F4.packet(seg[:1024], 6, id=9, mf=1, offset=0)))
        guest.send(F4.frame(F4.packet(seg[1024:], 6, id=9, mf=0, offset=1024 >> 3)))
        guest.send(tcp_frame(F4, 40011, 8080, ACK | PSH, seq=100 + len(first), ack=iss + 1, data=second))
        frames, _csum, _end, _err, _taken = plane.read_tap(tap.fileno())
        assert len(frames) == 3  # the fragments and the segment after them: all to Python, in order
        stack.parts.link.on_frames(frames)
        (fd,) = eng.fake_fds()
        assert eng.fake_received(fd) == first + second
        assert stack.counters["native_tcp.via_python"] == 2
        # a plain read again: the engine's own segment no longer goes through Python
        third = b"plain"
        guest.send(tcp_frame(F4, 40011, 8080, ACK | PSH, seq=100 + len(first) + len(second), ack=iss + 1,
                             data=third))
        frames, *_ = plane.read_tap(tap.fileno())
        assert frames == [] and eng.fake_received(fd) == third
    finally:
        plane.attach_tcp(None)
        tap.close()
        guest.close()
        stack.parts.ctx.native_tcp.close()
        stack.parts.ctx.native_tcp = None
        await stack.aclose()


async def test_a_segment_of_a_native_flow_sent_in_ip_fragments_reaches_the_host():
    """A native flow's data segment that the classifier leaves to Python (IPv4 fragments, which
    Python reassembles) is handed to the engine as the plain segment: its bytes reach the host
    socket and are acknowledged, counted as ``native_tcp.via_python`` (before: taken and lost, the
    guest retransmitting into the void). Mutant: ``on_segment`` answering True alone."""
    stack, eng = await _stack_with_fake_engine()
    try:
        stack.parts.link.on_frames([tcp_frame(F4, 40010, 8080, SYN, seq=99, mss=1460)])
        (flow,) = stack.parts.flows.values()
        (synack,) = eng.fake_frames()
        iss = int.from_bytes(synack[38:42], "big")
        assert eng.input(tcp_frame(F4, 40010, 8080, ACK, seq=100, ack=iss + 1), False, 0.0)
        data = bytes(range(256)) * 8
        seg = tcp_frame(F4, 40010, 8080, ACK | PSH, seq=100, ack=iss + 1, data=data)[14 + 20:]  # TCP header + data
        frags = [F4.frame(F4.packet(seg[:1024], 6, id=7, mf=1, offset=0)),
                 F4.frame(F4.packet(seg[1024:], 6, id=7, mf=0, offset=1024 >> 3))]
        stack.parts.link.on_frames(frags)
        (fd,) = eng.fake_fds()
        assert eng.fake_received(fd) == data
        assert stack.counters["native_tcp.via_python"] == 1 and stack.counters["ip_reassembled"] == 1
        acks = [int.from_bytes(f[42:46], "big") for f in eng.fake_frames()]
        assert acks and acks[-1] == (100 + len(data)) & 0xFFFFFFFF
        assert flow.bytes_up == len(data)
    finally:
        stack.parts.ctx.native_tcp.close()
        stack.parts.ctx.native_tcp = None
        await stack.aclose()
