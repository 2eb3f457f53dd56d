"""The per-frame path can be followed statically (issue 25 item 3): mypy checks it, and a static
walk finds every hop of a guest frame as a typed attribute, from the transport's sink to the mover's
``send``.

* The files of ``[tool.mypy]`` in ``pyproject.toml`` (the dispatch, the flow table and context,
  the inject queue, the TCP flow and its movers) type-check with the flags given there.
* ``reveal_type`` along the walk of docs/architecture.md names a class or a Protocol at each hop,
  never ``Any`` or ``object``.
* Each implementation follows the Protocol that types it where it is used: the four movers
  :class:`~aioslirp.nat.mover.HostMover`, every flow :class:`~aioslirp.flow.base.Flow`, the
  families, the tracer, the audit log, the poller, the resolver, the transport and the link's sink.

mypy runs on a cache of its own under ``tmp_path`` (about 2 s each, cold).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from support.paths import REPO  # noqa: E402

pytest.importorskip("mypy", reason="mypy is in the test extra")


def mypy(tmp_path: pathlib.Path, *files: str) -> subprocess.CompletedProcess:
    """``mypy`` with the project's configuration, from the repository's root."""
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "mypy-cache"), *files],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_per_frame_path_type_checks(tmp_path):
    p = mypy(tmp_path)  # the files of [tool.mypy]
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("Success: no issues found"), p.stdout


# The walk of one guest TCP segment (docs/architecture.md, "The per-frame path"), hop by hop: the
# expression, and the type mypy must see there.
WALK = {
    "transport._on_frames": "aioslirp.transport.base.FrameSink | None",
    "link.ipv4": "aioslirp.dispatch.ipv4.Ipv4Input",
    "link.ipv6": "aioslirp.dispatch.ipv6.Ipv6Path | None",
    "ipv4.l4": "aioslirp.dispatch.l4.L4",
    "ipv6.l4": "aioslirp.dispatch.l4.L4",
    "l4.tcp_flow(key)": "aioslirp.nat.tcp.TcpFlow | None",
    "l4.udp_flow(key)": ("aioslirp.nat.udp.UdpFlow | aioslirp.handlers.udp.HandledUdpFlow | "
                         "aioslirp.nat.forward.UdpForwardFlow | None"),
    "l4.icmp": "aioslirp.nat.icmp.IcmpEcho",
    "flow._mark_dirty": "def (aioslirp.flow.base.Flow)",
    "link.table": "aioslirp.flow.table.FlowTable",
    "table.dirty": "set[aioslirp.flow.base.Flow]",
    "flow.transport": "aioslirp.nat.mover.HostMover | None",
    "flow.ctx.inject": "def (bytes | bytearray | memoryview[int]) -> bool",
    "flow.ctx.running": "aioslirp.flow.context.Running",
    "flow.ctx.running.time": "def () -> float",
    "flow.ctx.running.host_poller": "aioslirp.flow.context.ReadPoller",
    "flow.ctx.tracer": "aioslirp.flow.base.TracePoints | None",
    "flow.fam": "aioslirp.flow.base.FlowFamily",
    "queue.transport": "aioslirp.inject.FrameWriter | None",
}

WALK_SOURCE = '''
from aioslirp.dispatch.ipv4 import Ipv4Input
from aioslirp.dispatch.ipv6 import Ipv6Path
from aioslirp.dispatch.l4 import L4
from aioslirp.dispatch.link import Link
from aioslirp.flow.table import FlowTable
from aioslirp.inject import InjectQueue
from aioslirp.nat.tcp import TcpFlow
from aioslirp.transport.base import Transport


def walk(transport: Transport, link: Link, ipv4: Ipv4Input, ipv6: Ipv6Path, l4: L4, flow: TcpFlow,
         table: FlowTable, queue: InjectQueue, key: tuple) -> None:
'''

# Each implementation, where a Protocol of the per-frame path types it.
CONFORMS = '''
from aioslirp.dispatch.family import Family4, Family6
from aioslirp.dispatch.link import Link
from aioslirp.flow.base import AuditSink, Flow, FlowFamily, TracePoints
from aioslirp.flow.context import ReadPoller, Resolver
from aioslirp.handlers.streams import TcpHandlerHost
from aioslirp.handlers.udp import HandledUdpFlow
from aioslirp.inject import FrameWriter, QueueTrace
from aioslirp.nat.forward import UdpForwardFlow
from aioslirp.nat.hostsock import HostPoller, HostSocket, TransportHost
from aioslirp.nat.icmp import IcmpFlow
from aioslirp.nat.mover import HostMover, MoverFlow
from aioslirp.nat.forwarded import ForwardedTcpFlow
from aioslirp.nat.tcp import TcpFlow
from aioslirp.nat.udp import UdpFlow
from aioslirp.observe.audit import AuditLog
from aioslirp.observe.tracing import Tracer
from aioslirp.services.dns import DnsForwarder
from aioslirp.services.dns_tcp import DnsTcpHost
from aioslirp.transport.base import FrameSink, Transport


def movers(a: HostSocket, b: TransportHost, c: DnsTcpHost, d: TcpHandlerHost) -> list[HostMover]:
    return [a, b, c, d]


def flows(a: TcpFlow, b: ForwardedTcpFlow, c: UdpFlow, d: IcmpFlow, e: UdpForwardFlow,
          f: HandledUdpFlow) -> list[Flow]:
    return [a, b, c, d, e, f]


def the_rest(flow: TcpFlow, f4: Family4, f6: Family6, tracer: Tracer, audit: AuditLog, poller: HostPoller,
             dns: DnsForwarder, transport: Transport, link: Link) -> None:
    mover_flow: MoverFlow = flow
    families: list[FlowFamily] = [f4, f6]
    trace_points: TracePoints = tracer
    queue_trace: QueueTrace = tracer
    audit_sink: AuditSink = audit
    read_poller: ReadPoller = poller
    resolver: Resolver = dns
    frame_writer: FrameWriter = transport
    sink: FrameSink = link.on_frames
'''


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """mypy's output over the walk (one ``reveal_type`` per hop) and the conformance module."""
    d = tmp_path_factory.mktemp("types")
    walk = d / "walk.py"
    walk.write_text(WALK_SOURCE + "".join(f"    reveal_type({expr})\n" for expr in WALK))
    conforms = d / "conforms.py"
    conforms.write_text(textwrap.dedent(CONFORMS))
    return mypy(d, str(walk), str(conforms)), walk.name, conforms.name


def test_a_static_walk_follows_the_frame_from_the_sink_to_the_mover(checked):
    p, walk, _ = checked
    revealed = re.findall(rf"{walk}:\d+: note: Revealed type is \"(.*)\"", p.stdout)
    assert dict(zip(WALK, revealed)) == WALK, p.stdout
    assert [line for line in p.stdout.splitlines() if walk in line and ": error:" in line] == [], p.stdout


def test_each_implementation_follows_the_protocol_it_is_typed_by(checked):
    p, _, conforms = checked
    errors = [line for line in p.stdout.splitlines() if conforms in line and ": error:" in line]
    assert errors == [], p.stdout
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_flow_context_is_whole_when_made_and_running_is_set_once_at_start():
    """What the types say holds at run time: every part of the :class:`FlowContext` exists once the
    stack is made (``None`` only for a feature that is off: tracer, audit log, rate caps, native TCP
    flows: set per transport served), and what
    exists once the stack runs (the loop and its clock, DNS, the host poller) comes at its start,
    all at once, in ``ctx.running``; frames need it (``RuntimeError`` before)."""
    import asyncio

    from aioslirp import NetworkConfig, Stack
    from aioslirp.flow.context import FlowContext, Running

    stack = Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)]))
    ctx = stack.parts.ctx
    assert isinstance(ctx, FlowContext) and not ctx.is_started
    off = {"tracer", "audit", "rate_up", "rate_down", "native_udp", "native_tcp"}
    # its fields: __slots__, or compiled (mypyc, no __slots__) the attributes of the native class
    fields = FlowContext.__dict__.get("__slots__") or FlowContext.__mypyc_attrs__
    assert "running" in fields and "table" in fields
    assert {n for n in fields if n != "running" and getattr(ctx, n) is None} <= off
    with pytest.raises(AttributeError):
        ctx.running
    with pytest.raises(RuntimeError, match="not started"):
        stack.process_guest_frame(b"\xff" * 60)

    async def main() -> None:
        async with stack:
            run = ctx.running
            assert isinstance(run, Running) and ctx.is_started
            assert run.loop is asyncio.get_running_loop() and run.time == run.loop.time
            assert run.dns is stack.parts.dns is not None and run.host_poller.loop is run.loop
            with pytest.raises(RuntimeError, match="started already"):
                ctx.start(run)
            stack.process_guest_frame(b"\xff" * 60)  # a broadcast source MAC: dropped, counted
            assert stack.counters["drop.bad_src_mac"] == 1

    asyncio.run(main())
