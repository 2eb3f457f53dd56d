"""Trace levels (``NetworkConfig.trace_level``): what a traced stack records at each.

A stack in this process, traced into an in-memory exporter, served over a socketpair: the guest
sends an IPv6 Router Solicitation (a frame of no flow: the stack answers with a Router
Advertisement) and makes one CRR cycle (SYN, request, guest FIN, the host's FIN, last ACK) to a
real host server on 127.0.0.1. The span names recorded are counted per level.
"""

from __future__ import annotations

import asyncio
import collections
import socket

import pytest

from aioslirp import NetworkConfig, SocketPairTransport, Stack

from support.frames import ACK, F4, FIN, GUEST_LL, GUEST_MAC, PSH, SYN, icmp6_frame, tcp_frame
from support.stacks import GuestEnd, until

ALL_ROUTERS = bytes.fromhex("ff020000000000000000000000000002")

#: The flow span's events the TCP timeline holds for one CRR cycle, in order (docs/observability.md).
TIMELINE = ["host.connect", "syn_ack.queued", "established", "guest.data", "host.data", "fin.guest", "fin.host",
            "closed"]
#: The events stamped by the writer, recorded at level "frames" only.
SENT = {"syn_ack.sent", "data.sent", "fin.sent", "rst.sent"}


def router_solicitation() -> bytes:
    """ICMPv6 Router Solicitation (RFC 4861 4.1) from the guest's link-local address, with its
    source link-layer address option."""
    return icmp6_frame(GUEST_LL, ALL_ROUTERS, 133, 0, bytes(4) + b"\x01\x01" + GUEST_MAC,
                       dst_mac=b"\x33\x33\x00\x00\x00\x02")


async def echo_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Per connection: echo one byte, wait for EOF, close."""
    data = await reader.read(1)
    writer.write(data)
    await writer.drain()
    await reader.read()
    writer.close()


async def traced_crr(level: str) -> tuple[list, int]:
    """Spans a stack at ``level`` recorded for a Router Solicitation and one CRR cycle, and the
    host server's port."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = await asyncio.start_server(echo_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], trace_level=level)
    try:
        async with Stack(cfg, tracer_provider=provider) as stack:
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            guest = GuestEnd(a)
            await guest.recv(0.3)  # the RA sent when serving starts
            guest.send(router_solicitation())
            ra = await guest.expect(lambda e: e.type == 0x86DD and e.data.nxt == 58 and e.data.data.type == 134)
            assert ra.dst == GUEST_MAC

            guest.send(tcp_frame(F4, 40000, port, SYN, 1000, mss=1460))
            syn_ack = await guest.expect_tcp()
            assert syn_ack.flags == SYN | ACK and syn_ack.ack == 1001
            y = syn_ack.seq + 1
            guest.send(tcp_frame(F4, 40000, port, ACK | PSH, 1001, y, data=b"x"))
            answer = await guest.expect(lambda e: e.type == 0x0800 and e.data.p == 6 and e.data.data.data == b"x")
            assert answer.data.data.seq == y
            guest.send(tcp_frame(F4, 40000, port, FIN | ACK, 1002, y + 1))
            fin = await guest.expect(lambda e: e.type == 0x0800 and e.data.p == 6 and e.data.data.flags & FIN)
            assert fin.data.data.seq == y + 1 and fin.data.data.ack == 1003
            guest.send(tcp_frame(F4, 40000, port, ACK, 1003, y + 2))
            assert await until(lambda: not stack.flows())
            await guest.recv(0.1)
            assert stack.tracer.errors == 0
            stack.stop()
            await task
    finally:
        a.close()
        server.close()
        await server.wait_closed()
        provider.shutdown()
    return list(exporter.get_finished_spans()), port


def _flow(spans, port):
    (flow,) = [s for s in spans if s.name == "tcp.flow" and s.attributes["server.port"] == port]
    assert flow.parent is None
    assert flow.attributes["aioslirp.tcp.outcome"] == "closed"
    assert flow.attributes["aioslirp.bytes.from_guest"] == 1 and flow.attributes["aioslirp.bytes.to_guest"] == 1
    return flow


def _subsequence(want: list, got: list) -> bool:
    it = iter(got)
    return all(any(w == g for g in it) for w in want)


async def test_flows_level_is_the_default_and_records_flow_spans_only():
    assert NetworkConfig().trace_level == "flows"
    spans, port = await traced_crr("flows")
    assert collections.Counter(s.name for s in spans) == {"tcp.flow": 1}
    flow = _flow(spans, port)
    assert [e.name for e in flow.events] == []
    # the Router Solicitation, the RAs, ARP: frames of no flow made no span at all
    assert all(s.parent is None and s.name.endswith(".flow") for s in spans)


async def test_timeline_level_adds_the_tcp_timeline_and_nothing_per_frame():
    spans, port = await traced_crr("timeline")
    assert collections.Counter(s.name for s in spans) == {"tcp.flow": 1, "tcp.syn_ack": 1}
    flow = _flow(spans, port)
    names = [e.name for e in flow.events]
    assert _subsequence(TIMELINE, names), names
    assert not SENT & set(names), names
    (syn_ack,) = [s for s in spans if s.name == "tcp.syn_ack"]
    assert syn_ack.parent.span_id == flow.context.span_id


async def test_frames_level_adds_the_per_frame_spans():
    spans, port = await traced_crr("frames")
    names = collections.Counter(s.name for s in spans)
    assert names["tcp.flow"] == 1 and names["tcp.syn_ack"] == 1
    # SYN, request, FIN, last ACK (and the ACK of the SYN-ACK, if any), the RS: one span each
    assert names["process_guest_frame"] >= 5
    assert names["drain_to_guest"] >= 4 and names["writer_wake"] >= 1
    flow = _flow(spans, port)
    events = [e.name for e in flow.events]
    assert _subsequence(TIMELINE, events) and {"syn_ack.sent", "data.sent", "fin.sent"} <= set(events), events
    frames = [s for s in spans if s.name == "process_guest_frame"]
    in_flow = [s for s in frames if s.parent is not None and s.parent.span_id == flow.context.span_id]
    assert [s.attributes.get("aioslirp.tcp.flags") for s in in_flow][:1] == ["S"]
    # the frame of no flow: a root span of its own (what the level "flows" leaves out)
    (rs,) = [s for s in frames if s.parent is None and s.attributes.get("network.transport") == "icmp"]
    assert rs.attributes["aioslirp.ethertype"] == 0x86DD


@pytest.mark.parametrize("level", ["flows", "timeline"])
async def test_below_frames_the_served_transport_is_not_wrapped(level):
    """The level is decided when the stack is made: below "frames" the stack serves the transport
    itself (no TraceTransport) and hands no tracer to the per-frame trace points."""
    from opentelemetry.sdk.trace import TracerProvider

    from aioslirp.transport.trace import TraceTransport

    provider = TracerProvider()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seen = {}
    try:
        async with Stack(NetworkConfig(ipv6=False, trace_level=level), tracer_provider=provider) as stack:
            task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
            await asyncio.sleep(0.05)
            parts = stack.parts
            seen = {"transport": type(parts.inject_queue.transport), "queue": parts.inject_queue.tracer,
                    "link": parts.link.tracer, "flows": parts.ctx.tracer, "table": parts.table.tracer}
            stack.stop()
            await task
    finally:
        a.close()
        provider.shutdown()
    assert seen["transport"] is not TraceTransport and seen["transport"] is SocketPairTransport
    assert seen["queue"] is None and seen["link"] is None
    assert seen["table"] is stack.tracer is not None
    assert (seen["flows"] is None) == (level == "flows")

