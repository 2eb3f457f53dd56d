"""Stateful fuzzing of ``Stack.process_guest_frame``: a hypothesis ``RuleBasedStateMachine``.

The machine owns one in-process :class:`~aioslirp.Stack` served over a ``SOCK_SEQPACKET``
socketpair, on an event loop it drives itself (asyncio's or uvloop's, drawn per run): each
rule builds guest frames, hands them to ``process_guest_frame`` from a callback of the running
loop (as a transport does), flushes, lets the loop run a few iterations and reads back what
the stack sent to the guest. It keeps a model of the guest's TCP connections (sequence
numbers, the stack's ISN from its SYN-ACK, what has been received) so that ACKs, data, FINs
and RSTs hit live flows, and a bundle of every valid frame it sent, which the ``mutate``
rule flips, truncates, extends or re-checksums and sends again.

Rules: ARP; DHCPv4 discover/request/release/inform; DHCPv6; DNS over UDP (both families) and
over TCP, and bursts of queries past ``dns_max_inflight``; ICMP echo to the gateway and DNS (v4),
to ``fd00::2`` / ``fd00::3`` / the router's link-local address (v6) and, proxied, to a remote
address on this namespace's ``lo`` (198.18.0.1, 2001:db8::77); NDP RS/NS/NA; TCP SYN (MSS, window scale, SACK-permitted,
timestamps, SACK blocks, zero-length, short and garbage options) then ACK / data (in order,
ahead, old, far out of window) / window updates / duplicate ACKs / FIN / RST towards a real
echo listener and a real sender on 127.0.0.1 and ::1 (reached through 10.0.2.2 / fd00::2),
towards closed ports, towards the DNS service, towards a listener that never accepts (its host
connects hang: pending connects) and towards an unroutable address of the subnet; echo round
trips and graceful closes (FIN both ways) on established connections; floods of new TCP, UDP
and ICMP flows in one batch, past every per-protocol cap and the flow table's size (eviction);
UDP to a real echo server, a closed port and the DNS address; IPv4 fragments (in
order, shuffled, overlapping, duplicated, oversized, incomplete); IPv6 with Hop-by-Hop,
Destination Options, Routing and atomic Fragment headers, and IPv6 fragments; replays,
batches of several frames, and time passing (timers: delayed ACK, retransmission, linger,
idle timeouts, TIME-WAIT).

Invariants, checked after every step: nothing escapes ``process_guest_frame`` or the loop
(``drop.internal_error``, ``flow_errors``, the DHCP/DHCPv6 catch-alls, the loop's exception
handler and ERROR logs of ``aioslirp`` all stay empty); every frame given is counted once in
``frames_in``; the flow table stays within ``max_flows`` and each per-protocol cap, and the
admission guard's per-protocol counts equal the table's; the sum of the ``drop.*`` counters
never decreases; every frame sent to the guest parses and carries correct IPv4 header and
TCP/UDP/ICMP/ICMPv6 checksums; the process's open fds stay within
``FD_SLACK + 2 * flows + dns_max_inflight`` above the baseline (a flow's host socket and,
for TCP to a listener of this process, the accepted peer socket). After ``teardown`` (stop,
``aclose``, servers closed, loop closed) no flow and no task are left and ``/proc/self/fd``
is exactly what it was before the run.

Reach, checked when the module ends (:data:`REACHED`): summed over the runs, the machine must
have hit every bound it is sized for (``drop.limit_tcp_flows``, ``drop.limit_udp_flows``,
``drop.limit_icmp_flows``, ``flows_evicted``, ``drop.limit_pending_connects``,
``drop.dns_too_many_queries``), opened ICMP flows, had bytes echoed back by the host and closed
connections gracefully; a machine that stopped reaching them fails the module instead of
passing without testing them. (Skipped for runs of fewer than :data:`REACH_MIN_RUNS` examples.)

Bounded in CI: ``AIOSLIRP_FUZZ_EXAMPLES`` runs (default 60) of ``AIOSLIRP_FUZZ_STEPS`` steps
(default 40), about 10 seconds in all; raise both for a longer run on demand, e.g.
``AIOSLIRP_FUZZ_EXAMPLES=5000 AIOSLIRP_FUZZ_STEPS=100 pytest tests/adversarial/test_fuzz_state.py``.
Every failure hypothesis finds becomes a plain regression test at the end of this file.

Safety: pytest runs in a loopback-only network namespace (conftest.py); the stack's egress
policy allows only loopback, so a mutated destination is refused and never contacted; the
crafted destinations are the gateway (host loopback), the DNS address, one unused address of
10.0.2.0/24, link-local/multicast addresses of the virtual link and the two remote addresses,
which exist only on ``lo`` of this namespace while the module runs.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import logging
import os
import random
import socket
import struct

import dpkt
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from aioslirp import NetworkConfig, SocketPairTransport, Stack

from support.frames import dns_query
from support.namespaces import namespace_address
from support.paths import REPO
from support.servers import free_port

GUEST_MAC = bytes.fromhex("525400123456")
GW_MAC = bytes.fromhex("52550a000202")
BCAST_MAC = b"\xff" * 6
GUEST = socket.inet_aton("10.0.2.15")
GW = socket.inet_aton("10.0.2.2")
DNS = socket.inet_aton("10.0.2.3")
SUBNET_OTHER = socket.inet_aton("10.0.2.77")  # in the virtual network, nobody there: never routed
REMOTE4_TEXT, REMOTE6_TEXT = "198.18.0.1", "2001:db8::77"  # on lo of pytest's namespace (module fixture)
REMOTE4 = socket.inet_aton(REMOTE4_TEXT)
A6 = lambda text: socket.inet_pton(socket.AF_INET6, text)  # noqa: E731
GUEST6 = A6("fd00::5054:ff:fe12:3456")
GUEST_LL = A6("fe80::5054:ff:fe12:3456")
GW6 = A6("fd00::2")
DNS6 = A6("fd00::3")
OTHER6 = A6("fd00::77")
REMOTE6 = A6(REMOTE6_TEXT)
GW_LL = A6("fe80::5055:aff:fe00:202")
ALL_ROUTERS = A6("ff02::2")
ALL_DHCP = A6("ff02::1:2")
UNSPEC6 = bytes(16)

SYN, FIN, RST, PSH, ACK = 0x02, 0x01, 0x04, 0x08, 0x10

#: Bounds small enough for the machine to reach them in 40 steps: the ``flood`` rule opens up to
#: 7 TCP, 5 UDP and 4 ICMP flows in one batch, one past each cap, and the caps add up to more than
#: ``max_flows`` (6 + 4 + 3 > 10), so the table fills and evicts; 2 pending connects per
#: destination (a quarter of 8) and 4 DNS queries in flight are passed by one burst each.
CONFIG = dict(
    dns_timeout=0.05, tcp_connect_timeout=0.3, tcp_linger=0.05, tcp_idle_timeout=0.3,
    udp_idle_timeout=0.05, icmp_idle_timeout=0.05, max_flows=10, max_tcp_flows=6, max_udp_flows=4,
    max_icmp_flows=3, max_pending_connects=8, dns_max_inflight=4, inject_queue_size=512, tcp_buffer=64 * 1024,
    egress_deny=["0.0.0.0/0", "::/0"],
    egress_allow=["127.0.0.0/8", "::1/128", REMOTE4_TEXT + "/32", REMOTE6_TEXT + "/128"],
)
#: What the runs of the module must have reached, summed (checked when the module ends).
REACHED = ("drop.limit_tcp_flows", "drop.limit_udp_flows", "drop.limit_icmp_flows", "flows_evicted",
           "drop.limit_pending_connects", "drop.dns_too_many_queries", "flows.icmp.opened",
           "model.tcp_echo_bytes", "model.tcp_graceful_closes")
#: The reach check needs this many runs (a short run on demand may miss a bound by chance).
REACH_MIN_RUNS = 30
#: Fds the machine may hold above its baseline besides the flows' (loop, socketpair, servers, probes).
FD_SLACK = 32
#: Loop iterations after each rule: enough for a loopback round trip through an echo server.
PUMP = 12

EXAMPLES = int(os.environ.get("AIOSLIRP_FUZZ_EXAMPLES", "60"))
STEPS = int(os.environ.get("AIOSLIRP_FUZZ_STEPS", "40"))
pytestmark = [pytest.mark.perframe]  # run again on the pure-Python modules (.ci/run)
# A long run on demand is not cut by the suite's per-test timeout (pyproject.toml).
if "AIOSLIRP_FUZZ_EXAMPLES" in os.environ:
    pytestmark.append(pytest.mark.timeout(0))


def _load_fix_checksums():
    spec = importlib.util.spec_from_file_location("fuzz_frames_for_state", REPO / "fuzz" / "fuzz_frames.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fix_checksums


fix_checksums = _load_fix_checksums()


def _warm_up_uvloop() -> None:
    """libuv opens one pipe pair for good with the first loop of the process (its signal lock):
    open it now, so that the fd comparison of each run sees only what the run itself opened."""
    import uvloop

    loop = uvloop.new_event_loop()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


_warm_up_uvloop()

#: Counters of every run, summed (printed at the end of the module with ``pytest -s``): shows
#: what the machine reached (flows opened, bytes echoed back, drops by reason).
TOTALS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _remote_addresses():
    """The machine's remote destinations (ICMP echo flows) exist on ``lo`` while the module runs."""
    with namespace_address(REMOTE4_TEXT), namespace_address(REMOTE6_TEXT):
        yield


@pytest.fixture(scope="module", autouse=True)
def _print_totals():
    yield
    runs = TOTALS.pop("runs", 0)
    print(f"\n{runs} runs; stack counters summed over them:")
    for k, v in sorted(TOTALS.items()):
        print(f"  {k} {v}")
    if runs >= REACH_MIN_RUNS:
        missing = [k for k in REACHED if not TOTALS.get(k)]
        assert not missing, f"{runs} runs of the state machine never reached {missing}"
    TOTALS.clear()


# ------------------------------------------------------------------------------ wire helpers
def csum(data: bytes) -> int:
    """RFC 1071 Internet checksum (written out here, independent of aioslirp.wire)."""
    if len(data) & 1:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def pseudo4(src: bytes, dst: bytes, proto: int, n: int) -> bytes:
    return src + dst + struct.pack("!BBH", 0, proto, n)


def pseudo6(src: bytes, dst: bytes, nh: int, n: int) -> bytes:
    return src + dst + struct.pack("!IxxxB", n, nh)


def with_sum(msg: bytes, at: int, pseudo: bytes = b"", udp: bool = False) -> bytes:
    """``msg`` with its 16-bit checksum field at ``at`` filled (RFC 768: a UDP 0 is sent as 0xFFFF)."""
    msg = msg[:at] + b"\0\0" + msg[at + 2:]
    s = csum(pseudo + msg)
    if udp and s == 0:
        s = 0xFFFF
    return msg[:at] + struct.pack("!H", s) + msg[at + 2:]


def eth(payload: bytes, ethertype: int, dst: bytes = GW_MAC) -> bytes:
    return dst + GUEST_MAC + struct.pack("!H", ethertype) + payload


def ip4(proto: int, l4: bytes, dst: bytes, src: bytes = GUEST, ident: int = 1, frag: int = 0, ttl: int = 64) -> bytes:
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), ident, frag, ttl, proto, 0, src, dst)
    return with_sum(hdr, 10) + l4


def mac_for6(dst: bytes) -> bytes:
    return b"\x33\x33" + dst[12:] if dst[0] == 0xFF else GW_MAC


def ip6(nh: int, payload: bytes, dst: bytes, src: bytes = GUEST6, hlim: int = 64) -> bytes:
    return struct.pack("!IHBB16s16s", 6 << 28, len(payload), nh, hlim, src, dst) + payload


def tcp_bytes(sport, dport, seq, ack, flags, win, opts=b"", payload=b"") -> bytes:
    opts = opts[:40]
    opts += b"\0" * (-len(opts) % 4)
    return struct.pack("!HHIIHHHH", sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF,
                       ((20 + len(opts)) // 4) << 12 | flags, win, 0, 0) + opts + payload


def l4_frame(v6: bool, proto: int, seg: bytes, dst: bytes, sum_at: int, src: bytes | None = None) -> bytes:
    """A whole Ethernet frame around the TCP/UDP/ICMP(v6) message ``seg``, checksums filled."""
    if v6:
        src = GUEST6 if src is None else src
        seg = with_sum(seg, sum_at, pseudo6(src, dst, proto, len(seg)), udp=proto == 17)
        return eth(ip6(proto, seg, dst, src, hlim=255 if proto == 58 else 64), 0x86DD, mac_for6(dst))
    src = GUEST if src is None else src
    pseudo = b"" if proto == 1 else pseudo4(src, dst, proto, len(seg))
    seg = with_sum(seg, sum_at, pseudo, udp=proto == 17)
    return eth(ip4(proto, seg, dst, src), 0x0800)


def udp_msg(sport: int, dport: int, payload: bytes) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# --------------------------------------------------------------------------- hypothesis bits
LINUX_SYN_OPTS = b"\x02\x04\x05\xb4\x04\x02\x08\x0a\x00\x01\x02\x03\x00\x00\x00\x00\x01\x03\x03\x07"
TCP_OPTION = st.one_of(
    st.just(b"\x01"),                                                                     # NOP
    st.integers(0, 65535).map(lambda m: b"\x02\x04" + struct.pack("!H", m)),              # MSS (0, tiny, huge)
    st.integers(0, 255).map(lambda s: b"\x03\x03" + bytes((s,))),                         # window scale, > 14 too
    st.just(b"\x04\x02"),                                                                 # SACK-permitted
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)).map(
        lambda t: b"\x08\x0a" + struct.pack("!II", *t)),                                  # timestamps
    st.integers(1, 4).map(lambda n: b"\x05" + bytes((2 + 8 * n,)) + bytes(8 * n)),        # SACK blocks
    st.sampled_from([b"\x08\x00", b"\x02\x00", b"\x02\x01", b"\x03\x01", b"\x02\x04\x05", b"\x00",
                     b"\x02\x28" + bytes(38)]),                                           # zero-length, short, EOL, overrun
    st.tuples(st.integers(9, 255), st.binary(max_size=6)).map(
        lambda t: bytes((t[0], 2 + len(t[1]))) + t[1]),                                   # unknown kinds
    st.binary(min_size=1, max_size=8),                                                    # garbage
)
TCP_OPTIONS = st.one_of(st.just(LINUX_SYN_OPTS), st.just(b""),
                        st.lists(TCP_OPTION, max_size=5).map(lambda parts: b"".join(parts)[:40]))
FAMILY = st.sampled_from([False, True])  # v6?


class Conn:
    """The guest's side of one TCP connection, as the machine models it."""

    def __init__(self, v6: bool, sport: int, dst: bytes, dport: int, kind: str, isn: int, win: int) -> None:
        self.v6, self.sport, self.dst, self.dport, self.kind = v6, sport, dst, dport, kind
        self.snd_nxt = (isn + 1) & 0xFFFFFFFF  # after our SYN
        self.rcv_nxt: int | None = None  # the stack's next sequence number, from its SYN-ACK on
        self.win = win
        self.state = "syn-sent"  # "open" after a SYN-ACK, "reset" after a RST either way
        self.fin_sent = False
        self.fin_received = False  # the stack's FIN, in order
        self.got = 0

    def ack_no(self) -> int:
        return self.rcv_nxt if self.rcv_nxt is not None else 0


# ------------------------------------------------------------------------------ host servers
class _Peers:
    def __init__(self) -> None:
        self.transports: set = set()


class _Echo(asyncio.Protocol):
    """TCP echo: writes back what it reads; closes on EOF."""

    def __init__(self, peers: _Peers) -> None:
        self.peers = peers

    def connection_made(self, transport) -> None:
        self.tr = transport
        self.peers.transports.add(transport)

    def data_received(self, data: bytes) -> None:
        self.tr.write(data)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.peers.transports.discard(self.tr)


class _Sender(_Echo):
    """TCP: sends 5,000 bytes (several segments), then closes (a host FIN)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.write(pattern(5000, 3))
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass


class _UdpEcho(asyncio.DatagramProtocol):
    def connection_made(self, transport) -> None:
        self.tr = transport

    def datagram_received(self, data, addr) -> None:
        self.tr.sendto(data, addr)


class _DnsUp(_UdpEcho):
    """DNS upstream: every A question gets 10.0.2.99 (dpkt), anything else an empty answer."""

    def datagram_received(self, data, addr) -> None:
        try:
            q = dpkt.dns.DNS(data)
            r = dpkt.dns.DNS(id=q.id, qr=dpkt.dns.DNS_R, rd=q.rd, ra=1, qd=q.qd)
            r.an = [dpkt.dns.DNS.RR(name=qd.name, type=1, cls=1, ttl=60, ip=socket.inet_aton("10.0.2.99"))
                    for qd in q.qd if qd.type == 1]
            self.tr.sendto(bytes(r), addr)
        except (dpkt.UnpackError, struct.error, ValueError):
            pass


def fd_table() -> dict:
    """fd -> what it points at, for this process."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list = []

    def emit(self, record) -> None:
        self.records.append(record.getMessage())


# --------------------------------------------------------------------------------- the machine
class StackMachine(RuleBasedStateMachine):
    """See the module documentation."""

    sent = Bundle("sent")

    def __init__(self) -> None:
        super().__init__()
        self.loop = None

    # ------------------------------------------------------------------ set-up and tear-down
    @initialize(loop_kind=st.sampled_from(["asyncio", "uvloop"]))
    def start(self, loop_kind: str) -> None:
        self.fds0 = fd_table()
        if loop_kind == "uvloop":
            import uvloop

            self.loop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.loop_errors: list = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(ctx))
        self.log_errors = _Errors()
        logging.getLogger("aioslirp").addHandler(self.log_errors)
        self.peers = _Peers()
        self.servers: list = []
        self.dgram: list = []
        self.guest, stack_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.guest.setblocking(False)
        self.ports = self.loop.run_until_complete(self._servers())
        cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", self.ports["dns"])], **CONFIG)
        self.stack = Stack(cfg)
        self.loop.run_until_complete(self.stack.start())
        self.serve_task = self.loop.create_task(self.stack.serve(SocketPairTransport(stack_end)))
        self.conns: dict[int, Conn] = {}
        self.next_port = 40000
        self.next_udp_port = 3000
        self.next_ident = 1
        self.graceful_closes = 0
        self.frames_given = 0
        self.frames_out = 0
        self.malformed_out: list = []
        self.drops_seen = 0
        #: Frames the stack sent since the last frames were given (for the regression tests).
        self.replies: list[bytes] = []
        self._spin(PUMP)

    async def _servers(self) -> dict:
        loop = asyncio.get_running_loop()
        ports = {}
        for fam, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            tag = "6" if fam == socket.AF_INET6 else "4"
            for name, proto in (("echo", _Echo), ("sender", _Sender)):
                srv = await loop.create_server(lambda p=proto: p(self.peers), host, 0, family=fam)
                self.servers.append(srv)
                ports[name + tag] = srv.sockets[0].getsockname()[1]
            tr, _ = await loop.create_datagram_endpoint(_UdpEcho, local_addr=(host, 0), family=fam)
            self.dgram.append(tr)
            ports["uecho" + tag] = tr.get_extra_info("sockname")[1]
            ports["closed" + tag] = free_port(socket.SOCK_STREAM, host)  # nobody listens: connect refused
            ports["uclosed" + tag] = free_port(socket.SOCK_DGRAM, host)  # nobody bound: ICMP port unreachable
        tr, _ = await loop.create_datagram_endpoint(_DnsUp, local_addr=("127.0.0.1", 0))
        self.dgram.append(tr)
        ports["dns"] = tr.get_extra_info("sockname")[1]
        # never accepts: once its queue (one connection) is full, host connects to it hang
        self.hole = socket.socket()
        self.hole.bind(("127.0.0.1", 0))
        self.hole.listen(0)
        ports["hole4"] = self.hole.getsockname()[1]
        return ports

    def teardown(self) -> None:
        if self.loop is None:
            return
        if not hasattr(self, "serve_task"):  # the set-up itself failed: just release what exists
            self.loop.close()
            return
        loop, stack = self.loop, self.stack
        problems = []
        try:
            stack.stop()
            loop.run_until_complete(asyncio.wait_for(self.serve_task, 5))
            loop.run_until_complete(stack.aclose())
            self._drain()
            TOTALS.update(stack.counters)
            TOTALS.update({"runs": 1, "model.tcp_opened": len(self.conns),
                           "model.tcp_synack": sum(c.rcv_nxt is not None for c in self.conns.values()),
                           "model.tcp_bytes_from_stack": sum(c.got for c in self.conns.values()),
                           "model.tcp_echo_bytes": sum(c.got for c in self.conns.values() if c.kind == "echo"),
                           "model.tcp_graceful_closes": self.graceful_closes,
                           "model.frames_to_guest": self.frames_out})
            for srv in self.servers:
                srv.close()
            for tr in list(self.peers.transports):
                tr.abort()
            for tr in self.dgram:
                tr.close()
            self.hole.close()
            self._spin(PUMP)
            for srv in self.servers:
                loop.run_until_complete(srv.wait_closed())
            if stack.parts.flows:
                problems.append(f"flows left: {list(stack.parts.flows)}")
            if any(not t.done() for t in stack.parts.tasks):
                problems.append(f"stack tasks left: {stack.parts.tasks}")
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if left:
                problems.append(f"tasks left on the loop: {left}")
            if self.peers.transports:
                problems.append(f"server connections left: {self.peers.transports}")
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            for t in asyncio.all_tasks(loop):
                t.cancel()
            loop.close()
            self.guest.close()
            logging.getLogger("aioslirp").removeHandler(self.log_errors)
            self.loop = None
        fds = fd_table()
        if fds != self.fds0:
            gone = {k: v for k, v in self.fds0.items() if fds.get(k) != v}
            new = {k: v for k, v in fds.items() if self.fds0.get(k) != v}
            problems.append(f"fds differ after teardown: new {new}, gone {gone}")
        assert not problems, problems
        assert not self.loop_errors, self.loop_errors

    # ------------------------------------------------------------------ plumbing
    def _spin(self, n: int) -> None:
        async def spin() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())
        self._drain()

    def _give(self, *frames: bytes) -> None:
        """Hand ``frames`` to the stack as one batch, from a callback of the running loop (as a
        transport does), flush, let the loop run, read what came back."""
        stack = self.stack
        done = self.loop.create_future()

        def deliver() -> None:
            try:
                for f in frames:
                    stack.process_guest_frame(f)
                stack.flush()
            except BaseException as exc:  # the invariant: nothing escapes
                done.set_exception(exc)
            else:
                done.set_result(None)

        self.frames_given += len(frames)
        self.replies = []
        self.loop.call_soon(deliver)
        self.loop.run_until_complete(done)
        self._spin(PUMP)

    def _drain(self) -> None:
        while True:
            try:
                f = self.guest.recv(70000)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not f:
                return
            self.frames_out += 1
            self.replies.append(f)
            self._observe(f)

    def _observe(self, f: bytes) -> None:
        """Check one frame the stack sent to the guest and update the TCP model from it."""
        if len(f) < 14:
            self.malformed_out.append(("short", f))
            return
        et = struct.unpack_from("!H", f, 12)[0]
        if et == 0x0806:
            return
        if et == 0x0800:
            ihl = (f[14] & 0x0F) * 4
            total = struct.unpack_from("!H", f, 16)[0]
            if f[14] >> 4 != 4 or ihl < 20 or 14 + total > len(f) or csum(f[14:14 + ihl]) != 0:
                self.malformed_out.append(("ipv4 header", f))
                return
            proto, src, dst = f[23], f[26:30], f[30:34]
            if struct.unpack_from("!H", f, 20)[0] & 0x3FFF:  # a fragment: its L4 checksum spans the datagram
                return
            seg = f[14 + ihl:14 + total]
            pseudo = b"" if proto == 1 else pseudo4(src, dst, proto, len(seg))
            if proto in (1, 6, 17) and not (proto == 17 and seg[6:8] == b"\0\0") and csum(pseudo + seg) != 0:
                self.malformed_out.append(("ipv4 l4 checksum", f))
                return
            v6 = False
        elif et == 0x86DD:
            if len(f) < 54:
                self.malformed_out.append(("ipv6 header", f))
                return
            plen, nh = struct.unpack_from("!HB", f, 18)
            src, dst = f[22:38], f[38:54]
            if 54 + plen > len(f):
                self.malformed_out.append(("ipv6 length", f))
                return
            if nh == 44:  # a fragment of a datagram larger than the MTU
                return
            seg = f[54:54 + plen]
            if nh in (6, 17, 58) and csum(pseudo6(src, dst, nh, len(seg)) + seg) != 0:
                self.malformed_out.append(("ipv6 l4 checksum", f))
                return
            proto, v6 = nh, True
        else:
            self.malformed_out.append(("ethertype", f))
            return
        if proto != 6 or len(seg) < 20:
            return
        sport, dport, seq, ack, off_flags = struct.unpack_from("!HHIIH", seg, 0)
        conn = self.conns.get(dport)
        if conn is None or conn.v6 != v6 or conn.dport != sport or conn.dst != src:
            return
        flags = off_flags & 0x3F
        data_len = len(seg) - ((off_flags >> 12) << 2)
        if flags & RST:
            conn.state = "reset"
            return
        if flags & SYN and flags & ACK:
            conn.rcv_nxt = (seq + 1) & 0xFFFFFFFF
            conn.state = "open"
            return
        if conn.rcv_nxt is not None and seq == conn.rcv_nxt:
            conn.rcv_nxt = (seq + data_len + (1 if flags & FIN else 0)) & 0xFFFFFFFF
            conn.got += data_len
            if flags & FIN:
                conn.fin_received = True

    def _tcp_frame(self, c: Conn, flags: int, seq: int | None = None, payload: bytes = b"",
                   win: int | None = None, ack: int | None = None, opts: bytes = b"") -> bytes:
        seg = tcp_bytes(c.sport, c.dport, c.snd_nxt if seq is None else seq, c.ack_no() if ack is None else ack,
                        flags, c.win if win is None else win, opts, payload)
        return l4_frame(c.v6, 6, seg, c.dst, 16)

    def _conn(self, data) -> Conn:
        return self.conns[data.draw(st.sampled_from(sorted(self.conns)), label="conn")]

    def _open_echo(self) -> list:
        """Ports of the connections to an echo listener that are established and not closing."""
        return sorted(p for p, c in self.conns.items()
                      if c.kind == "echo" and c.state == "open" and not c.fin_sent and c.win)

    def _syn(self, v6: bool, dst: bytes, dport: int, kind: str, isn: int) -> tuple[Conn, bytes]:
        self.next_port += 1
        c = self.conns[self.next_port] = Conn(v6, self.next_port, dst, dport, kind, isn, 65535)
        return c, self._tcp_frame(c, SYN, seq=isn, ack=0, opts=LINUX_SYN_OPTS)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def nothing_escapes(self) -> None:
        c = self.stack.counters
        assert c["drop.internal_error"] == 0, dict(c)
        assert c["flow_errors"] == 0, dict(c)
        assert c["drop.dhcpv6_error"] == 0, dict(c)
        assert self.stack.parts.dhcp.dropped.get("error", 0) == 0, self.stack.parts.dhcp.dropped
        assert not self.loop_errors, self.loop_errors
        assert not self.log_errors.records, self.log_errors.records

    @invariant()
    def every_frame_counted(self) -> None:
        assert self.stack.counters["frames_in"] == self.frames_given
        # each frame has exactly one outcome, counted where it happened (handled.* or a drop)
        frames_in, handled, dropped = self.stack.frame_outcomes()
        assert frames_in == handled + dropped, sorted(self.stack.counters.items())

    @invariant()
    def flows_within_bounds(self) -> None:
        stack = self.stack
        cfg = stack.config
        by_proto = {"tcp": 0, "udp": 0, "icmp": 0}
        for f in stack.parts.flows.values():
            by_proto[f.proto_name] += 1
        assert len(stack.parts.flows) <= cfg.max_flows
        assert by_proto["tcp"] <= cfg.max_tcp_flows
        assert by_proto["udp"] <= cfg.max_udp_flows
        assert by_proto["icmp"] <= cfg.max_icmp_flows
        assert stack.parts.guard.active == by_proto, (stack.parts.guard.active, by_proto)

    @invariant()
    def drops_monotonic(self) -> None:
        total = sum(v for k, v in self.stack.counters.items() if k.startswith("drop."))
        assert total >= self.drops_seen
        self.drops_seen = total

    @invariant()
    def frames_to_guest_well_formed(self) -> None:
        assert not self.malformed_out, self.malformed_out[:3]

    @invariant()
    def fds_bounded(self) -> None:
        extra = len(os.listdir("/proc/self/fd")) - len(self.fds0)
        bound = FD_SLACK + 2 * len(self.stack.parts.flows) + self.stack.config.dns_max_inflight
        assert extra <= bound, (extra, bound, len(self.stack.parts.flows))

    # ------------------------------------------------------------------ link-layer and services
    @rule(target=sent, tpa=st.sampled_from([GW, DNS, SUBNET_OTHER, GUEST]), op=st.sampled_from([1, 1, 2]))
    def arp(self, tpa, op):
        f = eth(bytes(dpkt.arp.ARP(op=op, sha=GUEST_MAC, spa=GUEST, tha=bytes(6), tpa=tpa)), 0x0806, BCAST_MAC)
        self._give(f)
        return f

    @rule(target=sent, mtype=st.sampled_from([1, 3, 3, 7, 8]), xid=st.integers(0, 2**32 - 1),
          broadcast=st.booleans(), req_ip=st.sampled_from([None, GUEST, SUBNET_OTHER, GW]),
          server_id=st.booleans())
    def dhcp(self, mtype, xid, broadcast, req_ip, server_id):
        opts = [(dpkt.dhcp.DHCP_OPT_MSGTYPE, bytes((mtype,)))]
        if req_ip is not None:
            opts.append((dpkt.dhcp.DHCP_OPT_REQ_IP, req_ip))
        if server_id:
            opts.append((dpkt.dhcp.DHCP_OPT_SERVER_ID, GW))
        opts.append((dpkt.dhcp.DHCP_OPT_PARAM_REQ, bytes((1, 3, 6, 15, 26, 119))))
        msg = bytes(dpkt.dhcp.DHCP(op=1, chaddr=GUEST_MAC, xid=xid, flags=0x8000 if broadcast else 0,
                                   ciaddr=int.from_bytes(GUEST if mtype in (7, 8) else bytes(4), "big"), opts=opts))
        src = GUEST if mtype in (7, 8) else bytes(4)
        seg = with_sum(udp_msg(68, 67, msg), 6, pseudo4(src, b"\xff" * 4, 17, 8 + len(msg)), udp=True)
        f = eth(ip4(17, seg, b"\xff" * 4, src), 0x0800, BCAST_MAC)
        self._give(f)
        return f

    @rule(target=sent, mtype=st.sampled_from([1, 1, 11, 3, 5]), xid=st.integers(0, 2**24 - 1),
          unicast=st.booleans(), ia=st.booleans())
    def dhcpv6(self, mtype, xid, unicast, ia):
        def opt(code: int, body: bytes) -> bytes:
            return struct.pack("!HH", code, len(body)) + body

        body = opt(1, struct.pack("!HH", 3, 1) + GUEST_MAC) + opt(8, b"\0\0") + opt(6, struct.pack("!HH", 23, 24))
        if ia:
            body += opt(3, struct.pack("!III", 1, 0, 0))
        msg = bytes((mtype,)) + xid.to_bytes(3, "big") + body
        dst = GW_LL if unicast else ALL_DHCP
        f = l4_frame(True, 17, udp_msg(546, 547, msg), dst, 6, src=GUEST_LL)
        self._give(f)
        return f

    @rule(target=sent, v6=FAMILY, qid=st.integers(0, 65535), name=st.sampled_from(["a.test", "x" * 63 + ".test", "."]),
          qtype=st.sampled_from([1, 28, 16]), sport=st.integers(1024, 1030))
    def dns_udp(self, v6, qid, name, qtype, sport):
        f = l4_frame(v6, 17, udp_msg(sport, 53, dns_query(name, qid, qtype)), DNS6 if v6 else DNS, 6)
        self._give(f)
        return f

    @rule(target=sent, v6=FAMILY, where=st.sampled_from(["gw", "dns", "ll", "other", "remote"]), ident=st.integers(0, 65535),
          seq=st.integers(0, 65535), size=st.sampled_from([0, 8, 56, 1400]))
    def icmp_echo(self, v6, where, ident, seq, size):
        payload = pattern(size, seq)
        if v6:
            dst = {"gw": GW6, "dns": DNS6, "ll": GW_LL, "other": OTHER6, "remote": REMOTE6}[where]
            f = l4_frame(True, 58, struct.pack("!BBHHH", 128, 0, 0, ident, seq) + payload, dst, 2)
        else:
            dst = {"gw": GW, "dns": DNS, "ll": GW, "other": SUBNET_OTHER, "remote": REMOTE4}[where]
            f = l4_frame(False, 1, struct.pack("!BBHHH", 8, 0, 0, ident, seq) + payload, dst, 2)
        self._give(f)
        return f

    @rule(target=sent, kind=st.sampled_from(["rs", "ns", "ns_dad", "ns_ll", "na"]), slla=st.booleans())
    def ndp(self, kind, slla):
        opt = b"\x01\x01" + GUEST_MAC if slla else b""
        src = GUEST_LL
        if kind == "rs":
            dst, msg = ALL_ROUTERS, struct.pack("!BBHI", 133, 0, 0, 0) + opt
        elif kind == "na":
            dst, msg = GW_LL, struct.pack("!BBHI", 136, 0, 0, 0x60000000) + GUEST6 + (b"\x02\x01" + GUEST_MAC)
        else:
            target = GW_LL if kind == "ns_ll" else GW6
            dst = A6("ff02::1:ff00:0")[:13] + target[13:]
            if kind == "ns_dad":
                src, target, opt = UNSPEC6, GUEST6, b""
                dst = A6("ff02::1:ff00:0")[:13] + GUEST6[13:]
            msg = struct.pack("!BBHI", 135, 0, 0, 0) + target + opt
        f = l4_frame(True, 58, msg, dst, 2, src=src)
        self._give(f)
        return f

    # ------------------------------------------------------------------ UDP
    @rule(target=sent, v6=FAMILY, to=st.sampled_from(["uecho", "uecho", "uclosed", "dns_other_port", "subnet"]),
          sport=st.integers(2000, 2007), size=st.sampled_from([0, 1, 100, 1472, 1600]), seed=st.integers(0, 9))
    def udp(self, v6, to, sport, size, seed):
        tag = "6" if v6 else "4"
        if to == "dns_other_port":
            dst, dport = (DNS6 if v6 else DNS), 54
        elif to == "subnet":
            dst, dport = (OTHER6 if v6 else SUBNET_OTHER), 9
        else:
            dst, dport = (GW6 if v6 else GW), self.ports[to + tag]
        f = l4_frame(v6, 17, udp_msg(sport, dport, pattern(size, seed)), dst, 6)
        self._give(f)
        return f

    # ------------------------------------------------------------------ TCP
    @precondition(lambda self: len(self.conns) < 30)
    @rule(target=sent, v6=FAMILY, kind=st.sampled_from(["echo", "echo", "sender", "closed", "dns", "subnet"]),
          opts=TCP_OPTIONS, isn=st.integers(0, 2**32 - 1), win=st.sampled_from([0, 1, 512, 29200, 65535]))
    def tcp_open(self, v6, kind, opts, isn, win):
        tag = "6" if v6 else "4"
        if kind == "dns":
            dst, dport = (DNS6 if v6 else DNS), 53
        elif kind == "subnet":
            dst, dport = (OTHER6 if v6 else SUBNET_OTHER), 80
        else:
            dst, dport = (GW6 if v6 else GW), self.ports[kind + tag]
        self.next_port += 1
        c = self.conns[self.next_port] = Conn(v6, self.next_port, dst, dport, kind, isn, win)
        f = self._tcp_frame(c, SYN, seq=isn, ack=0, opts=opts)
        self._give(f)
        return f

    @precondition(lambda self: self.conns)
    @rule(target=sent, data=st.data())
    def tcp_ack(self, data):
        c = self._conn(data)
        f = self._tcp_frame(c, ACK)
        self._give(f)
        return f

    @precondition(lambda self: self.conns)
    @rule(target=sent, data=st.data(), size=st.sampled_from([1, 100, 1460, 3000]),
          where=st.sampled_from(["next", "next", "next", "ahead", "old", "far"]), push=st.booleans())
    def tcp_data(self, data, size, where, push):
        c = self._conn(data)
        if c.kind == "dns" and where == "next":
            q = dns_query("t.test", c.snd_nxt & 0xFFFF, 1)
            payload = struct.pack("!H", len(q)) + q
        else:
            payload = pattern(size, c.snd_nxt)
        seq = {"next": c.snd_nxt, "ahead": c.snd_nxt + 1000, "old": c.snd_nxt - 500, "far": c.snd_nxt + 2**31}[where]
        f = self._tcp_frame(c, ACK | (PSH if push else 0), seq=seq, payload=payload)
        if where == "next":
            c.snd_nxt = (c.snd_nxt + len(payload)) & 0xFFFFFFFF
        self._give(f)
        return f

    @precondition(lambda self: self.conns)
    @rule(target=sent, data=st.data(), win=st.sampled_from([0, 0, 1, 1000, 65535]), dup=st.integers(1, 4))
    def tcp_window(self, data, win, dup):
        """Window updates, zero windows (persist timer) and duplicate ACKs (fast retransmit)."""
        c = self._conn(data)
        c.win = win
        f = self._tcp_frame(c, ACK)
        self._give(*[f] * dup)
        return f

    @precondition(lambda self: self.conns)
    @rule(target=sent, data=st.data(), with_data=st.booleans())
    def tcp_fin(self, data, with_data):
        c = self._conn(data)
        payload = b"last words" if with_data else b""
        f = self._tcp_frame(c, FIN | ACK, payload=payload)
        if not c.fin_sent:
            c.snd_nxt = (c.snd_nxt + len(payload) + 1) & 0xFFFFFFFF
            c.fin_sent = True
        self._give(f)
        return f

    @precondition(lambda self: self.conns)
    @rule(target=sent, data=st.data(), exact=st.booleans(), with_ack=st.booleans())
    def tcp_rst(self, data, exact, with_ack):
        c = self._conn(data)
        f = self._tcp_frame(c, RST | (ACK if with_ack else 0), seq=c.snd_nxt if exact else c.snd_nxt + 7)
        self._give(f)
        return f

    @precondition(lambda self: self.conns)
    @rule(target=sent, data=st.data(), opts=TCP_OPTIONS)
    def tcp_syn_again(self, data, opts):
        """A SYN on a tracked connection: a retransmission, or a new SYN in or out of TIME-WAIT."""
        c = self._conn(data)
        f = self._tcp_frame(c, SYN, seq=c.snd_nxt - 1, ack=0, opts=opts)
        self._give(f)
        return f

    # ------------------------------------------------------------------ bounds: floods and bursts
    @precondition(lambda self: len(self.conns) < 150)
    @rule(target=sent, v6=FAMILY, n_tcp=st.integers(0, 7), n_udp=st.integers(0, 5), n_icmp=st.integers(0, 4),
          rnd=st.randoms(use_true_random=False))
    def flood(self, v6, n_tcp, n_udp, n_icmp, rnd):
        """New flows in one batch, in a random order: TCP to the echo listener, UDP to the echo
        server from new ports, echo requests with new identifiers to the remote address -- past
        ``max_tcp_flows``, ``max_udp_flows``, ``max_icmp_flows`` and, together with the flows
        already open, ``max_flows`` (eviction). Then the handshakes the stack answered are
        completed (one ACK each, one batch)."""
        tag = "6" if v6 else "4"
        gw = GW6 if v6 else GW
        frames, new = [], []
        for _ in range(n_tcp):
            c, f = self._syn(v6, gw, self.ports["echo" + tag], "echo", rnd.getrandbits(32))
            new.append(c)
            frames.append(f)
        for _ in range(n_udp):
            self.next_udp_port = 3000 + (self.next_udp_port - 2999) % 20000
            frames.append(l4_frame(v6, 17, udp_msg(self.next_udp_port, self.ports["uecho" + tag], b"flood"), gw, 6))
        for _ in range(n_icmp):
            self.next_ident = self.next_ident % 65535 + 1
            if v6:
                frames.append(l4_frame(True, 58, struct.pack("!BBHHH", 128, 0, 0, self.next_ident, 1) + b"flood",
                                       REMOTE6, 2))
            else:
                frames.append(l4_frame(False, 1, struct.pack("!BBHHH", 8, 0, 0, self.next_ident, 1) + b"flood",
                                       REMOTE4, 2))
        if not frames:
            return multiple()
        rnd.shuffle(frames)
        self._give(*frames)
        acks = [self._tcp_frame(c, ACK) for c in new if c.state == "open"]
        if acks:
            self._give(*acks)
        return multiple(*frames, *acks)

    @precondition(lambda self: len(self.conns) < 150)
    @rule(target=sent, n=st.integers(3, 6), isn=st.integers(0, 2**32 - 1))
    def syn_burst_to_hole(self, n, isn):
        """SYNs in one batch to the listener that never accepts: past the one connection its
        queue holds, the host connects hang (pending, until ``tcp_connect_timeout``); beyond a
        quarter of ``max_pending_connects`` towards it they are refused (RST)."""
        frames = [self._syn(False, GW, self.ports["hole4"], "hole", (isn + i) & 0xFFFFFFFF)[1] for i in range(n)]
        self._give(*frames)
        return multiple(*frames)

    @rule(target=sent, v6=FAMILY, n=st.integers(3, 8), first=st.integers(0, 65000))
    def dns_burst(self, v6, n, first):
        """DNS queries in one batch, more than ``dns_max_inflight`` can take."""
        frames = [l4_frame(v6, 17, udp_msg(1100 + i, 53, dns_query("burst.test", first + i, 1)), DNS6 if v6 else DNS, 6)
                  for i in range(n)]
        self._give(*frames)
        return multiple(*frames)

    @precondition(lambda self: self._open_echo())
    @rule(target=sent, data=st.data(), size=st.sampled_from([1, 100, 1460, 4000]))
    def tcp_echo_roundtrip(self, data, size):
        """In-order data on an established echo connection; the host echoes it; then an ACK of
        what came back."""
        c = self.conns[data.draw(st.sampled_from(self._open_echo()), label="conn")]
        payload = pattern(size, c.snd_nxt)
        frames = []
        for i in range(0, size, 1000):
            chunk = payload[i:i + 1000]
            frames.append(self._tcp_frame(c, ACK | PSH, payload=chunk))
            c.snd_nxt = (c.snd_nxt + len(chunk)) & 0xFFFFFFFF
        self._give(*frames)
        ack = self._tcp_frame(c, ACK)
        self._give(ack)
        return multiple(*frames, ack)

    @precondition(lambda self: self._open_echo())
    @rule(target=sent, data=st.data())
    def tcp_close_gracefully(self, data):
        """A FIN on an established echo connection: the host closes on EOF, so the stack's FIN
        follows; the guest ACKs it and the flow leaves the table (counted when it did, no RST)."""
        c = self.conns[data.draw(st.sampled_from(self._open_echo()), label="conn")]
        fin = self._tcp_frame(c, FIN | ACK)
        c.snd_nxt = (c.snd_nxt + 1) & 0xFFFFFFFF
        c.fin_sent = True
        self._give(fin)
        if not (c.fin_received and c.state == "open"):
            return fin
        ack = self._tcp_frame(c, ACK)
        self._give(ack)
        if (6, GUEST6 if c.v6 else GUEST, c.sport, c.dst, c.dport) not in self.stack.parts.flows and c.state == "open":
            self.graceful_closes += 1
        return multiple(fin, ack)

    # ------------------------------------------------------------------ fragments, extension headers
    @rule(target=sent, inner=st.sampled_from(["uecho", "dns", "icmp", "tcp_closed"]), size=st.sampled_from([24, 600, 3000]),
          piece=st.sampled_from([8, 16, 512, 1480]), mode=st.sampled_from(
              ["in_order", "reverse", "shuffle", "overlap", "duplicate", "oversized", "incomplete", "bad_mf"]),
          ident=st.integers(0, 65535), rnd=st.randoms(use_true_random=False))
    def ipv4_fragments(self, inner, size, piece, mode, ident, rnd):
        if inner == "uecho":
            proto, dst, l4 = 17, GW, udp_msg(2100, self.ports["uecho4"], pattern(size, ident))
        elif inner == "dns":
            proto, dst, l4 = 17, DNS, udp_msg(2101, 53, dns_query("f.test", ident, 1) + bytes(size))
        elif inner == "icmp":
            proto, dst, l4 = 1, GW, struct.pack("!BBHHH", 8, 0, 0, ident, 1) + pattern(size, ident)
        else:
            proto, dst, l4 = 6, GW, tcp_bytes(2102, self.ports["closed4"], 1, 0, SYN, 1000, b"", pattern(size, 1))
        at = {17: 6, 1: 2, 6: 16}[proto]
        l4 = with_sum(l4, at, b"" if proto == 1 else pseudo4(GUEST, dst, proto, len(l4)), udp=proto == 17)
        pieces = [(o, l4[o:o + piece]) for o in range(0, len(l4), piece)]
        if len(pieces) < 2:
            pieces = [(0, l4[:8]), (8, l4[8:])]
        if mode == "reverse":
            pieces.reverse()
        elif mode == "shuffle":
            rnd.shuffle(pieces)
        elif mode == "overlap":
            pieces.insert(1, (max(0, pieces[1][0] - 8), bytes(len(pieces[1][1]) + 8)))
        elif mode == "duplicate":
            pieces.append(pieces[0])
        elif mode == "oversized":
            pieces.append((65528, b"x" * 64))
        elif mode == "incomplete":
            pieces.pop(len(pieces) // 2)
        last = max(o for o, _ in pieces)
        frames = []
        for o, d in pieces:
            more = o != last if mode != "bad_mf" else True
            frames.append(eth(ip4(proto, d, dst, ident=ident, frag=(0x2000 if more else 0) | ((o >> 3) & 0x1FFF)), 0x0800))
        self._give(*frames)
        return multiple(*frames)

    @rule(target=sent, chain=st.lists(st.sampled_from(["hbh", "dst", "rt0", "rt_segleft", "atomic", "pad1", "unknown_opt"]),
                                      min_size=1, max_size=4),
          inner=st.sampled_from(["uecho", "echo_gw", "syn_echo"]))
    def ipv6_extensions(self, chain, inner):
        if inner == "uecho":
            nh, msg, at = 17, udp_msg(2200, self.ports["uecho6"], b"ext"), 6
        elif inner == "echo_gw":
            nh, msg, at = 58, struct.pack("!BBHHH", 128, 0, 0, 77, 1) + b"ext", 2
        else:
            self.next_port += 1
            nh, msg, at = 6, tcp_bytes(self.next_port, self.ports["echo6"], 5, 0, SYN, 1000, LINUX_SYN_OPTS), 16
        msg = with_sum(msg, at, pseudo6(GUEST6, GW6, nh, len(msg)), udp=nh == 17)
        body = msg
        for kind in reversed(chain):
            if kind in ("hbh", "dst", "pad1", "unknown_opt"):
                opts = {"hbh": b"\x01\x04" + bytes(4), "dst": b"\x01\x04" + bytes(4), "pad1": b"\x00" * 6,
                        "unknown_opt": b"\x3e\x04" + bytes(4)}[kind]
                this = 0 if kind in ("hbh", "pad1") else 60
                body = bytes((nh, 0)) + opts + body
            elif kind in ("rt0", "rt_segleft"):
                this = 43
                body = bytes((nh, 0, 4 if kind == "rt0" else 0, 0 if kind == "rt0" else 1)) + bytes(4) + body
            else:  # an atomic fragment (RFC 6946): offset 0, M clear
                this = 44
                body = struct.pack("!BBHI", nh, 0, 0, 0xA70) + body
            nh = this
        f = eth(ip6(nh, body, GW6), 0x86DD)
        self._give(f)
        return f

    @rule(target=sent, size=st.sampled_from([16, 1200, 3000]), piece=st.sampled_from([8, 512, 1232]),
          mode=st.sampled_from(["in_order", "reverse", "overlap", "duplicate", "oversized", "incomplete"]),
          ident=st.integers(0, 2**32 - 1))
    def ipv6_fragments(self, size, piece, mode, ident):
        msg = with_sum(udp_msg(2300, self.ports["uecho6"], pattern(size, 6)), 6,
                       pseudo6(GUEST6, GW6, 17, 8 + size), udp=True)
        pieces = [(o, msg[o:o + piece]) for o in range(0, len(msg), piece)]
        if len(pieces) < 2:
            pieces = [(0, msg[:8]), (8, msg[8:])]
        if mode == "reverse":
            pieces.reverse()
        elif mode == "overlap":
            pieces.insert(1, (max(0, pieces[1][0] - 8), bytes(len(pieces[1][1]) + 8)))
        elif mode == "duplicate":
            pieces.append(pieces[-1])
        elif mode == "oversized":
            pieces.append((65528, b"y" * 64))
        elif mode == "incomplete":
            pieces.pop(len(pieces) // 2)
        last = max(o for o, _ in pieces)
        frames = [eth(ip6(44, struct.pack("!BBHI", 17, 0, (o & 0xFFF8) | (o != last), ident) + d, GW6), 0x86DD)
                  for o, d in pieces]
        self._give(*frames)
        return multiple(*frames)

    # ------------------------------------------------------------------ mutations, replays, batches, time
    @rule(frame=sent, op=st.sampled_from(["flip", "flip", "truncate", "extend", "field", "zero"]),
          fix=st.booleans(), data=st.data())
    def mutate(self, frame, op, fix, data):
        f = bytearray(frame)
        if op == "flip":
            for _ in range(data.draw(st.integers(1, 4), label="flips")):
                i = data.draw(st.integers(0, len(f) - 1), label="at")
                f[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif op == "truncate":
            f = f[:data.draw(st.integers(0, len(f) - 1), label="keep")]
        elif op == "extend":
            f += data.draw(st.binary(min_size=1, max_size=64), label="tail")
        elif op == "field":  # a 16-bit field set to an extreme (lengths, ports, offsets, windows)
            i = data.draw(st.integers(12, max(12, len(f) - 2)), label="field")
            f[i:i + 2] = data.draw(st.sampled_from([b"\x00\x00", b"\xff\xff", b"\x00\x01", b"\x80\x00"]), label="value")
        else:
            i = data.draw(st.integers(0, len(f) - 1), label="from")
            f[i:] = bytes(len(f) - i)
        out = bytes(f)
        if fix:
            out = fix_checksums(out)
        self._give(out)

    @rule(frame=sent, times=st.integers(1, 3))
    def replay(self, frame, times):
        self._give(*[frame] * times)

    @rule(frames=st.lists(sent, min_size=2, max_size=8))
    def batch(self, frames):
        self._give(*frames)

    @rule(dt=st.sampled_from([0.002, 0.002, 0.01, 0.03, 0.07]))
    def advance(self, dt):
        self.loop.run_until_complete(asyncio.sleep(dt))
        self._spin(PUMP)


StackMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    # Under CI the examples follow a fixed seed: the reach check above (a random walk reaches the
    # ICMP flow limit in most runs, not all: 2 of 10 local runs missed one counter) must not fail a
    # landing by chance. Local runs stay random and explore; AIOSLIRP_FUZZ_RANDOM=1 forces that.
    derandomize=bool(os.environ.get("CI")) and not os.environ.get("AIOSLIRP_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
TestStackMachine = StackMachine.TestCase


# ------------------------------------------------------------------------------ regressions
# Every failure the machine finds becomes a plain test here (see the module documentation).


def test_regression_echo_reply_with_all_zero_message_has_checksum_ffff():
    """Found by the machine: an echo request to the gateway with identifier 0, sequence 0 and no
    payload got a reply whose ICMP message is all zero, checksum included. All-zero data sums to
    +0, so its checksum is 0xFFFF (RFC 1071); 0 fails the receiver's check (Linux drops it as
    InCsumErrors, see the next test). Fixed in aioslirp.wire.checksum.checksum."""
    machine = StackMachine()
    machine.start(loop_kind="asyncio")
    try:
        machine.icmp_echo(ident=0, seq=0, size=0, v6=False, where="gw")
        machine.frames_to_guest_well_formed()
        replies = [f for f in machine.replies if f[12:14] == b"\x08\x00" and f[23] == 1]
        assert len(replies) == 1
        assert replies[0][34:] == bytes.fromhex("0000ffff00000000")
        machine.nothing_escapes()
    finally:
        machine.teardown()


ZERO_ECHO_GUEST = r"""
import json, socket, struct
def icmp_stats():
    rows = [line.split() for line in open("/proc/net/snmp") if line.startswith("Icmp:")]
    return dict(zip(rows[0][1:], map(int, rows[1][1:])))
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(5)
before = icmp_stats()
s.sendto(struct.pack("!BBHHH", 8, 0, 0xF7FF, 0, 0), ("10.0.2.2", 0))  # echo, id 0, seq 0, no payload
reply = s.recv(100)  # raw sockets see it before the kernel checks the checksum
after = icmp_stats()
print(json.dumps({"reply": reply[20:].hex(), **{k: after[k] - before[k] for k in ("InEchoReps", "InCsumErrors")}}))
"""


@pytest.mark.netns
def test_regression_echo_reply_with_all_zero_message_accepted_by_linux(tmp_path):
    """The same echo through `aioslirp run` to the Linux kernel in the namespace: it counts the
    reply as an echo reply, not as a checksum error (before the fix: InCsumErrors +1)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "zero_echo.py"
    script.write_text(ZERO_ECHO_GUEST)
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--no-ipv6", "--", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r == {"reply": "0000ffff00000000", "InEchoReps": 1, "InCsumErrors": 0}
