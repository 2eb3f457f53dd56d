"""The SYN lane (issue 26): a plain guest SYN of no native flow goes from the native TAP reader
straight to the admission (``Link.syn``), without the dispatch's parse, and ends exactly as the
full Python path ends it.

Two stacks, each with a TCP engine of fake sockets (``TcpEngine(fake=True)``): one reads the guest's
frames with a real ``Plane`` from a datagram socket pair standing for the TAP fd (one frame per
read, as a TAP gives) with the lane on, the other gets the same frames through ``Link.on_frames``
(the full path). For every frame of a list of plain and not-so-plain SYNs, the two must end with
the same counters (but the lane's own), the same flows and the same frames towards the guest; and
the lane must have taken exactly the frames it may take (``native_tcp.syn_lane``).
"""

from __future__ import annotations

import contextlib
import socket
import struct

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.nat.native_tcp import NativeTcp

from support.frames import ACK, F4, F6, FIN, GW_MAC, PSH, RST, SYN, echo_frame, tcp_frame
from support.native import need_extension
from support.stacks import CollectTransport

WSCALE = struct.pack("!BBB", 3, 3, 7) + b"\x01"  # window scale 7, NOP
SACK = b"\x04\x02\x01\x01"  # SACK-permitted, NOP NOP


class Side:
    """A started stack whose TCP flows run in a fake-socket engine; what it sends the guest is
    collected (the engine's frames and the inject queue's)."""

    def __init__(self, cfg: NetworkConfig, tracer_provider=None) -> None:
        self.stack = Stack(cfg, tracer_provider=tracer_provider)
        self.out = CollectTransport()

    async def start(self) -> None:
        ext = need_extension()
        await self.stack.start()
        self.engine = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 64, 1 << 20, 60.0, 10.0, 1.0, fake=True)
        ctx = self.stack.parts.ctx
        ctx.native_tcp = NativeTcp(ctx, self.engine)
        self.stack.parts.inject_queue.transport = self.out

    def sent(self) -> list[bytes]:
        return [bytes(f) for f in self.engine.fake_frames()] + [bytes(f) for f in self.out.out]

    def counters(self) -> dict:
        return {k: v for k, v in self.stack.counters.items() if v and k != "native_tcp.syn_lane"}

    def flows(self) -> list:
        return sorted((f.key, type(f).__name__, f.rule) for f in self.stack.parts.flows.values())

    async def close(self) -> None:
        ctx = self.stack.parts.ctx
        if ctx.native_tcp is not None:
            ctx.native_tcp.close()
            ctx.native_tcp = None
        await self.stack.aclose()


class LaneSide(Side):
    """A :class:`Side` whose guest frames come through a real ``Plane`` with the SYN lane on."""

    async def start(self) -> None:
        await super().start()
        ext = need_extension()
        self.plane = ext.Plane(65536, 64, False)
        self.plane.attach_tcp(self.engine)
        self.plane.syn_lane(self.stack.parts.link.syn)
        self.tap, self.guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.tap.setblocking(False)

    def feed(self, frames: list[bytes]) -> list[bytes]:
        """The frames sent by the guest, read in one batch; the Python path's share delivered to the
        link as the TAP transport does. Returns what went to that batch."""
        for f in frames:
            self.guest.send(f)
        now = self.stack.parts.ctx.running.time()
        left, _csum, _end, _err, _taken = self.plane.read_tap(self.tap.fileno(), now)
        if left:
            self.stack.parts.link.on_frames(left)
        return left

    async def close(self) -> None:
        self.plane.syn_lane(None)
        self.plane.attach_tcp(None)
        self.tap.close()
        self.guest.close()
        await super().close()


def _bad_checksum(frame: bytes) -> bytes:
    b = bytearray(frame)
    b[14 + 20 + 17] ^= 0xFF  # the TCP checksum's low byte (IPv4, no IP options)
    return bytes(b)


def _with_ip_options(frame: bytes) -> bytes:
    """An IPv4 frame with 4 bytes of IP options (NOP NOP NOP EOL) added: the TCP header at 38."""
    ip = bytearray(frame[14:34]) + b"\x01\x01\x01\x00"
    ip[0] = 0x46
    ip[2:4] = struct.pack("!H", len(frame) - 14 + 4)
    ip[10:12] = b"\x00\x00"
    s = sum(struct.unpack("!12H", bytes(ip)))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    ip[10:12] = struct.pack("!H", ~s & 0xFFFF)
    return frame[:14] + bytes(ip) + frame[34:]


REMOTE4 = socket.inet_aton(F4.remote)
REMOTE6 = socket.inet_pton(socket.AF_INET6, F6.remote)


def _cases() -> list[tuple[str, bytes, bool]]:
    """(name, frame, whether the lane may take it)."""
    t = tcp_frame
    other_subnet = bytes([192, 0, 2, 9])  # TEST-NET-1, not the guest's subnet
    in_subnet = F4.gw[:3] + b"\x63"  # another address of the guest's subnet: unroutable
    return [
        ("plain", t(F4, 41000, 8080, SYN, seq=7, dst=REMOTE4, mss=1460), True),
        ("options", t(F4, 41001, 8080, SYN, seq=8, dst=REMOTE4, mss=1400, opts=WSCALE + SACK), True),
        ("no-options", t(F4, 41002, 8080, SYN, seq=9, dst=REMOTE4), True),
        ("ip-options", _with_ip_options(t(F4, 41019, 8080, SYN, seq=9, dst=REMOTE4, mss=1460)), True),
        ("ipv6", t(F6, 41003, 8080, SYN, seq=10, dst=REMOTE6, mss=1440, opts=WSCALE), True),
        ("ipv6-to-the-gateway", t(F6, 41020, 8080, SYN, seq=10, mss=1440), True),
        ("to-the-gateway", t(F4, 41004, 8080, SYN, seq=11, mss=1460), True),
        ("unroutable", t(F4, 41005, 8080, SYN, seq=12, dst=in_subnet, mss=1460), True),
        ("bad-source", t(F4, 41006, 8080, SYN, seq=13, src=other_subnet, dst=REMOTE4, mss=1460), True),
        ("unspecified-source", t(F4, 41007, 8080, SYN, seq=14, src=bytes(4), dst=REMOTE4, mss=1460), True),
        ("dns-port-53", t(F4, 41008, 53, SYN, seq=15, dst=F4.dns, mss=1460), True),
        ("dns-other-port", t(F4, 41009, 80, SYN, seq=16, dst=F4.dns, mss=1460), True),
        ("denied", t(F4, 41010, 9999, SYN, seq=17, dst=REMOTE4, mss=1460), True),
        ("port-zero", t(F4, 41011, 0, SYN, seq=18, dst=REMOTE4, mss=1460), False),
        ("bad-checksum", _bad_checksum(t(F4, 41012, 8080, SYN, seq=19, dst=REMOTE4)), False),
        ("with-data", t(F4, 41013, 8080, SYN, seq=20, dst=REMOTE4, data=b"early"), False),
        ("syn-fin", t(F4, 41014, 8080, SYN | FIN, seq=21, dst=REMOTE4), False),
        ("syn-ack", t(F4, 41015, 8080, SYN | ACK, seq=22, ack=5, dst=REMOTE4), False),
        ("syn-rst", t(F4, 41016, 8080, SYN | RST, seq=23, dst=REMOTE4), False),
        ("bad-option", t(F4, 41017, 8080, SYN, seq=24, dst=REMOTE4, opts=b"\x02\x00\x00\x00"), False),
        ("ack", t(F4, 41018, 8080, ACK | PSH, seq=25, ack=1, dst=REMOTE4, data=b"x"), False),
    ]


CASES = _cases()


@contextlib.contextmanager
def _reader(engine: bool = True, lane=None):
    """A ``Plane`` reading a datagram socket pair (the TAP fd), with a fake-socket engine attached
    (``engine``) and the lane ``lane`` (default: one that records its calls in ``asked`` and takes
    the SYN). Yields ``(plane, engine or None, tap, guest, asked)``."""
    ext = need_extension()
    eng = ext.TcpEngine(-1, False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 1.0, fake=True) if engine else None
    plane = ext.Plane(65536, 8, False)
    if eng is not None:
        plane.attach_tcp(eng)
    asked: list = []
    plane.syn_lane(lane or (lambda *a: asked.append(a) or True))
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    tap.setblocking(False)
    try:
        yield plane, eng, tap, guest, asked
    finally:
        plane.syn_lane(None)
        plane.attach_tcp(None)
        if eng is not None:
            eng.close()
        tap.close()
        guest.close()


@pytest.mark.parametrize("name,frame,lane", CASES, ids=[c[0] for c in CASES])
async def test_a_syn_ends_on_the_lane_as_on_the_full_path(name, frame, lane):
    cfg = dict(egress_deny=["0.0.0.0/0:9999/tcp"])
    full, fast = Side(NetworkConfig(**cfg)), LaneSide(NetworkConfig(**cfg))
    await full.start()
    await fast.start()
    try:
        full.stack.parts.link.on_frames([frame])
        left = fast.feed([frame])
        assert (left == []) is lane, name
        assert fast.stack.counters["native_tcp.syn_lane"] == (1 if lane else 0)
        assert fast.counters() == full.counters(), name
        assert fast.flows() == full.flows(), name
        sent_full, sent_fast = full.sent(), fast.sent()
        # the SYN-ACK's ISS is random: compare with the sequence number field (and the checksum) cut out
        cut = (lambda f: f[:38] + f[42:50] + f[52:]) if frame[12:14] == b"\x08\x00" else (
            lambda f: f[:58] + f[62:70] + f[72:])
        assert [cut(f) for f in sent_fast] == [cut(f) for f in sent_full], name
    finally:
        await full.close()
        await fast.close()


async def test_the_lane_takes_a_syn_only_ahead_of_every_frame_for_python():
    """A frame for the Python path (an ICMP echo request) read before a plain SYN: the SYN stays behind it
    in the batch (the lane reorders nothing); a SYN read first takes the lane, the ARP after it not."""
    side = LaneSide(NetworkConfig())
    await side.start()
    try:
        other = echo_frame(F4, 7)  # an echo request to the gateway: always Python's
        syn = tcp_frame(F4, 42001, 8080, SYN, seq=2, mss=1460)
        assert side.feed([other, syn]) == [other, syn]
        assert side.stack.counters["native_tcp.syn_lane"] == 0
        syn2 = tcp_frame(F4, 42002, 8080, SYN, seq=3, mss=1460)
        assert side.feed([syn2, other]) == [other]
        assert side.stack.counters["native_tcp.syn_lane"] == 1
        assert side.engine.live() == 2  # both SYNs made flows
    finally:
        await side.close()


async def test_a_syn_for_a_flow_of_the_python_path_goes_to_that_flow():
    """The 5-tuple is held by a flow of the Python path (DNS over TCP: the DNS service stands where a
    host socket would): a repeated SYN of it is not the lane's (``False``, nothing done), and the
    reader then puts it in the batch, where the flow takes it, as before."""
    side = LaneSide(NetworkConfig())
    await side.start()
    try:
        syn = tcp_frame(F4, 42100, 53, SYN, seq=2, dst=F4.dns, mss=1460)
        link = side.stack.parts.link
        assert side.feed([syn]) == []
        (key,) = list(side.stack.parts.flows)
        assert type(side.stack.parts.flows[key]).__name__ == "TcpFlow"
        before = dict(side.stack.counters)
        assert link.syn(syn, False, 34, len(syn), 42100, 53, 2, 65535, 1460, -1, False, 0.0) is False
        assert dict(side.stack.counters) == before  # nothing counted, nothing done
        assert side.feed([syn]) == [syn]
        assert list(side.stack.parts.flows) == [key]
        c = side.stack.counters
        assert c["native_tcp.syn_lane"] == 1 and c["handled.tcp_syn"] == 1
        assert c["handled.tcp"] == before.get("handled.tcp", 0) + 1  # the flow took its retransmitted SYN
    finally:
        await side.close()


def test_the_lane_needs_a_callable_and_the_native_reader():
    ext = need_extension()
    with pytest.raises(TypeError):
        ext.Plane(65536, 8, False).syn_lane(42)
    # no engine attached: every frame is the batch's, the lane is never asked
    with _reader(engine=False) as (plane, _eng, tap, guest, asked):
        syn = tcp_frame(F4, 42200, 8080, SYN, seq=2, mss=1460)
        guest.send(syn)
        frames, *_ = plane.read_tap(tap.fileno())
        assert frames == [syn] and asked == []


def test_the_lane_gets_the_fields_the_full_path_parses():
    """What ``syn()`` is called with, against the frame's own bytes (IPv4 with an IP option, so that
    the TCP header does not start at 34, and IPv6)."""
    with _reader() as (plane, _eng, tap, guest, asked):
        frames = [tcp_frame(F4, 42300, 8443, SYN, seq=0xFEDCBA98, win=29200, mss=1460, opts=WSCALE + SACK),
                  tcp_frame(F6, 42301, 443, SYN, seq=5, win=64800),
                  _with_ip_options(tcp_frame(F4, 42302, 80, SYN, seq=6, win=1000, mss=536))]
        for f in frames:
            guest.send(f)
        left, *_ = plane.read_tap(tap.fileno(), 12.5)
        assert left == []
        assert asked == [
            (frames[0], False, 34, len(frames[0]), 42300, 8443, 0xFEDCBA98, 29200, 1460, 7, True, 12.5),
            (frames[1], True, 54, len(frames[1]), 42301, 443, 5, 64800, -1, -1, False, 12.5),
            (frames[2], False, 38, len(frames[2]), 42302, 80, 6, 1000, 536, -1, False, 12.5),
        ]


def test_a_lane_that_detaches_and_drops_the_engine_leaves_the_rest_of_the_batch_to_python():
    """Python runs inside the reader's loop: were the engine detached and freed there (nothing in
    the stack does that from an admission, but nothing may count on it), the reader must not touch
    it again: the frames after the SYN go to Python, the SYN stays taken (under ASan in CI)."""
    ext = need_extension()
    held = [ext.TcpEngine(-1, False, False, GW_MAC, 1500, 8, 1 << 20, 60.0, 10.0, 1.0, fake=True)]
    plane = ext.Plane(65536, 8, False)
    plane.attach_tcp(held[0])

    def lane(*args) -> bool:
        plane.attach_tcp(None)
        held.pop().close()  # the last reference: the engine object is freed here
        return True

    plane.syn_lane(lane)
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        tap.setblocking(False)
        frames = [tcp_frame(F4, 42400, 80, SYN, seq=1, mss=1460), tcp_frame(F4, 42401, 80, SYN, seq=2, mss=1460),
                  tcp_frame(F4, 42400, 80, ACK, seq=2, ack=1)]
        for f in frames:
            guest.send(f)
        left, *_ = plane.read_tap(tap.fileno())
        assert left == frames[1:] and held == []
    finally:
        plane.syn_lane(None)
        tap.close()
        guest.close()


class ReadySide(LaneSide):
    """A :class:`LaneSide` read as the TAP transport reads it (``Plane.ready``: the engine's records
    taken after the batch, before its frames for Python are delivered); ``lane``: the SYN lane on."""

    def __init__(self, cfg: NetworkConfig, lane: bool) -> None:
        super().__init__(cfg)
        self.lane = lane

    async def start(self) -> None:
        await super().start()
        if not self.lane:
            self.plane.syn_lane(None)

    def feed(self, frames: list[bytes]) -> list[bytes]:
        for f in frames:
            self.guest.send(f)
        got = []
        link = self.stack.parts.link

        def deliver(frames, csum, end, err):
            got.extend(frames)
            if frames:
                link.on_frames(frames, csum)

        self.plane.ready(self.tap.fileno(), self.stack.parts.ctx.running.time, deliver, None,
                         self.stack.parts.ctx.native_tcp.take)
        return got


async def test_a_syn_after_a_native_flow_ended_in_its_batch_is_admitted_as_on_the_full_path():
    """A native flow ends in C on a guest RST and a SYN follows in the same batch: the full path
    takes the engine's records (the flow out of the table and the guard) before its frames; the
    lane must not admit the SYN against the ended flow's count (``max_tcp_flows`` 1 here): it takes
    the records first too (``Plane.ready``'s hook), then the SYN."""
    cfg = dict(max_tcp_flows=1)
    full, fast = ReadySide(NetworkConfig(**cfg), False), ReadySide(NetworkConfig(**cfg), True)
    await full.start()
    await fast.start()
    try:
        syn_a = tcp_frame(F4, 43000, 8080, SYN, seq=100, dst=REMOTE4, mss=1460)
        rst_a = tcp_frame(F4, 43000, 8080, RST, seq=101, dst=REMOTE4)
        syn_b = tcp_frame(F4, 43001, 8080, SYN, seq=200, dst=REMOTE4, mss=1460)
        for side in (full, fast):
            side.feed([syn_a])
            assert side.engine.live() == 1
            side.feed([rst_a, syn_b])
        assert full.counters().get("drop.limit_tcp_flows", 0) == 0
        assert fast.counters() == full.counters()
        assert fast.flows() == full.flows()
        assert fast.engine.live() == full.engine.live() == 1
        assert fast.stack.counters["native_tcp.syn_lane"] == 2  # (both SYNs took the lane)
    finally:
        await full.close()
        await fast.close()


@pytest.mark.parametrize("reenter", ["read_tap", "init"])
def test_the_reader_refuses_to_be_reentered_from_the_lane(reenter):
    """Python runs inside the reader's loop over its buffer and slots: a lane that reads the plane
    again (the same frames would be walked twice) or re-initialises it (buffer and slots freed under
    the loop: a use-after-free) must get an error, and the outer batch stays whole."""
    errors = []
    held: list = []

    def lane(*args) -> bool:
        plane, tap = held
        try:
            if reenter == "init":
                plane.__init__(1500, 1, False)
            else:
                plane.read_tap(tap.fileno())
        except RuntimeError as e:
            errors.append(e)
        return True

    with _reader(lane=lane) as (plane, _eng, tap, guest, _asked):
        held[:] = [plane, tap]
        frames = [tcp_frame(F4, 42600, 80, SYN, seq=1, mss=1460), echo_frame(F4, 9),
                  tcp_frame(F4, 42601, 80, SYN, seq=2, mss=1460)]
        for f in frames:
            guest.send(f)
        left, *_ = plane.read_tap(tap.fileno())
        assert left == frames[1:]
        assert len(errors) == 1


async def test_at_trace_level_frames_the_lane_records_the_frame_span_the_full_path_records():
    """At trace level ``frames`` the lane is on too and records the SYN's ``process_guest_frame``
    span (a child of the new flow's span) as :meth:`Link.on_frames` does."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    seen = {}
    syn = tcp_frame(F4, 44000, 8080, SYN, seq=7, dst=REMOTE4, mss=1460)
    for lane in (False, True):
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        side = (LaneSide if lane else Side)(NetworkConfig(trace_level="frames"), provider)
        await side.start()
        try:
            if lane:
                assert side.feed([syn]) == []
                assert side.stack.counters["native_tcp.syn_lane"] == 1
            else:
                side.stack.parts.link.on_frames([syn])
            assert len(side.stack.parts.flows) == 1
        finally:
            await side.close()  # (the flow's span ends)
            provider.shutdown()
        spans = exporter.get_finished_spans()
        (flow_span,) = [sp for sp in spans if sp.name == "tcp.flow"]
        (frame,) = [sp for sp in spans if sp.name == "process_guest_frame"]
        assert frame.parent is not None and frame.parent.span_id == flow_span.context.span_id
        seen[lane] = {k: v for k, v in frame.attributes.items() if k != "aioslirp.processing_us"}
    assert seen[True] == seen[False] and seen[True]["aioslirp.tcp.flags"] == "S"


async def test_a_syn_an_async_policy_hook_holds_is_replayed_from_the_lane_as_from_the_full_path():
    """An async egress hook holds the SYN (answer nothing until its verdict, ``drop.egress_held``),
    then the SYN is replayed from the bytes kept: the lane keeps the same bytes (its packet and TCP
    header as ``bytes``, not views), and both paths end with the same flow, counters and frames."""
    import asyncio

    async def hook(req):
        await asyncio.sleep(0.01)
        return req.port == 8080, "port 8080 only"

    syn_ok = tcp_frame(F4, 45000, 8080, SYN, seq=70, dst=REMOTE4, mss=1460, opts=WSCALE)
    syn_no = tcp_frame(F4, 45001, 8081, SYN, seq=80, dst=REMOTE4, mss=1460)
    full, fast = Side(NetworkConfig(policy=hook)), LaneSide(NetworkConfig(policy=hook))
    await full.start()
    await fast.start()
    try:
        full.stack.parts.link.on_frames([syn_ok, syn_no])
        assert fast.feed([syn_ok, syn_no]) == []
        for side in (full, fast):
            assert side.stack.counters["drop.egress_held"] == 2 and not side.stack.parts.flows
        for _ in range(100):
            await asyncio.sleep(0.005)
            if full.stack.parts.guard.held == fast.stack.parts.guard.held == 0:
                break
        assert fast.stack.counters["native_tcp.syn_lane"] == 2
        assert fast.counters() == full.counters() and full.counters()["egress.denied_hook"] == 1
        assert fast.flows() == full.flows() and len(fast.flows()) == 1
        cut = lambda f: f[:38] + f[42:50] + f[52:]  # (the SYN-ACK's random ISS and its checksum)
        assert [cut(f) for f in fast.sent()] == [cut(f) for f in full.sent()]
    finally:
        await full.close()
        await fast.close()
