"""TCP loss recovery against a real Linux guest: 5 MB each way over a lossy, reordering link.

The guest is a Linux kernel in a namespace behind the stack (``run_in_namespace`` in this
process, so the test sees the stack's connections). Between the guest's TAP and the stack sits
:class:`LossyLink`, a transport wrapper (``Stack.transport_wrappers``) that, in each direction
and independently for each frame, loses it (5 %) or holds it back 1 ms so that the frames after
it overtake it (10 %) -- what ``tc qdisc add dev tap0 root netem loss 5% reorder 10% delay 1ms``
would do, but on both directions of the link. netem itself is not used: on the kernel this
suite runs on ``sch_netem`` is missing (``tc qdisc add ... netem`` answers "Error: Specified
qdisc kind is unknown."), and a qdisc on the guest's TAP would only shape what the guest sends,
while the stack's retransmissions need loss on what it sends to the guest (ingress of the TAP:
an ifb device and a ``mirred`` filter, whose classifiers this kernel lacks too).

Without SACK (the stack offers none, RFC 2018) a Linux sender recovers a lost retransmission only
by its retransmission timeout, doubled at each one in a row (Karn), and after each timeout
resends everything in flight: the upload's socket keeps its send buffer at 64 KiB so that an
episode costs ~90 segments, not a whole window. Karn's rule keeps the doubled RTO until a segment
sent once is ACKed, and without timestamps (RFC 7323, not offered either) an ACK of a resent
segment is no sample, so when a resent segment is lost again, episode after episode, the guest's
RTO compounds: 5 MB up took 7-30 s at 5 % loss in most runs, 43-71 s in 2 of 18 (a backoff of 5,
an RTO of 6.5 s) and over 240 s once in CI. The guest's upload socket therefore caps its RTO at
1 s (``TCP_RTO_MAX_MS``, Linux 6.15; on an older kernel the option is refused and the cap left
out): each lost retransmission then costs at most a second, and 5 MB up take 5-10 s. The download
(the stack sending) takes 2-3 s. The guest's upload may take up to 240 s before the test calls it
a failure.

The fates are drawn from ``random.Random(seed)``; the seed is printed (``pytest -s``) and can be
fixed with ``AIOSLIRP_NETEM_SEED``. Which segment meets which fate still depends on the guest
kernel's timing.

Asserted: both transfers byte-exact (SHA-256), frames lost and reordered in both directions,
the stack's connection of the download retransmitted (``TcpConnection.retransmitted_segments``;
the stack has no stack-wide retransmit counter) and the guest's kernel retransmitted during the
upload (``RetransSegs`` of its ``/proc/net/snmp``), nothing escaped the stack.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys

import pytest

from aioslirp import NetworkConfig, Stack
from aioslirp.frontends.netns import run_in_namespace
from aioslirp.transport.base import Transport

from support.servers import DataServer, pattern

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(600)]

N = 5 * 1024 * 1024
LOSS, REORDER, DELAY = 0.05, 0.10, 0.001


class LossyLink(Transport):
    """Wraps a transport: each frame, either way, is lost with probability ``loss`` or, with
    probability ``reorder``, delivered ``delay`` seconds late (frames after it overtake it);
    the rest pass at once, in order. ``lost`` / ``reordered``: frames per direction
    (``"to_guest"``, ``"to_stack"``)."""

    def __init__(self, inner: Transport, seed: int, loss: float = LOSS, reorder: float = REORDER,
                 delay: float = DELAY) -> None:
        super().__init__()
        self.inner = inner
        self.rng = random.Random(seed)
        self.loss, self.reorder, self.delay = loss, reorder, delay
        self.lost = {"to_guest": 0, "to_stack": 0}
        self.reordered = {"to_guest": 0, "to_stack": 0}
        self._sink = None

    @property
    def offload(self) -> bool:
        return bool(getattr(self.inner, "offload", False))

    def _fate(self, direction: str) -> str:
        x = self.rng.random()
        if x < self.loss:
            self.lost[direction] += 1
            return "lose"
        if x < self.loss + self.reorder:
            self.reordered[direction] += 1
            return "hold"
        return "pass"

    async def open(self, on_frames) -> None:
        self._loop = asyncio.get_running_loop()
        self._sink = on_frames
        await self.inner.open(self._from_guest)
        self.closed = self.inner.closed

    def _from_guest(self, frames, csum_ok=None) -> None:
        keep, flags = [], []
        for i, f in enumerate(frames):
            ok = None if csum_ok is None else csum_ok[i]
            fate = self._fate("to_stack")
            if fate == "hold":
                self._loop.call_later(self.delay, self._late_to_stack, f, ok)
            elif fate == "pass":
                keep.append(f)
                flags.append(ok)
        if keep:
            self._sink(keep, None if csum_ok is None else flags)

    def _late_to_stack(self, frame, ok) -> None:
        if not self.closed.done():
            self._sink([frame], None if ok is None else [ok])

    def send_frames(self, frames) -> None:
        keep = []
        for f in frames:
            fate = self._fate("to_guest")
            if fate == "hold":
                self._loop.call_later(self.delay, self._late_to_guest, f)
            elif fate == "pass":
                keep.append(f)
        if keep:
            self.inner.send_frames(keep)

    def _late_to_guest(self, frame) -> None:
        if not self.closed.done():
            self.inner.send_frames([frame])

    def close(self, exc: BaseException | None = None) -> None:
        self.inner.close(exc)


class FinishedTcp:
    """The flow table's watch (``FlowTable.guard``, a :class:`~aioslirp.flow.base.FlowWatch`) put
    in front of the stack's guard: every flow that was in the table is told to it once as it leaves
    (``FlowTable.remove``); it keeps, for each TCP flow, the public counters of its connection
    ``(bytes_sent, bytes_received, retransmitted_segments)``, and passes everything on to the guard.
    (Not a patch of ``FlowTable.remove``: the table may be compiled, a class that takes no patch.)"""

    def __init__(self, guard, finished: list) -> None:
        self.guard, self.finished = guard, finished

    def opened(self, flow) -> None:
        self.guard.opened(flow)

    def closed(self, flow) -> None:
        if flow.proto_name == "tcp":
            c = flow.conn
            self.finished.append((c.bytes_sent, c.bytes_received, c.retransmitted_segments))
        self.guard.closed(flow)

    def recount(self, flows) -> None:
        self.guard.recount(flows)


class RecordingStack(Stack):
    """A Stack that keeps, for every TCP flow leaving its table, the public counters of its
    connection: ``(bytes_sent, bytes_received, retransmitted_segments)`` (:class:`FinishedTcp`)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.finished_tcp: list[tuple[int, int, int]] = []
        table = self.parts.table
        table.guard = FinishedTcp(table.guard, self.finished_tcp)


GUEST = r"""
import hashlib, json, random, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])

def retrans():
    rows = [line.split() for line in open("/proc/net/snmp") if line.startswith("Tcp:")]
    return int(dict(zip(rows[0][1:], rows[1][1:]))["RetransSegs"])

out = {}
s = socket.create_connection(("10.0.2.2", port), timeout=60)
s.sendall(b"DOWN %d 21\n" % n)
h = hashlib.sha256(); got = 0
while True:
    d = s.recv(1 << 20)
    if not d: break
    h.update(d); got += len(d)
s.close()
out["down"] = [got, h.hexdigest()]
before = retrans()
data = random.Random(22).randbytes(n)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # see the module documentation
s.settimeout(240)  # for sendall: the whole upload
try:  # TCP_RTO_MAX_MS (Linux 6.15): see the module documentation
    s.setsockopt(socket.IPPROTO_TCP, 44, 1000)
except OSError:
    pass
s.connect(("10.0.2.2", port))
s.sendall(b"UP\n" + data)
s.shutdown(socket.SHUT_WR)
reply = b""
while True:
    d = s.recv(4096)
    if not d: break
    reply += d
s.close()
out["up"] = reply.decode().split()
out["guest_retransmits_up"] = retrans() - before
print(json.dumps(out))
"""


async def test_tcp_recovers_from_loss_and_reordering_both_ways(capfd):
    """5 MB down and 5 MB up through LossyLink (5 % loss, 10 % reordered by 1 ms, each way): both
    byte-exact; the stack retransmitted towards the guest, the guest's kernel towards the stack.

    Mutants: the stack's fast retransmit resending the bytes one further along (``sq.view(0, n)``
    -> ``sq.view(1, n + 1)`` in ``TcpConnection.segments_to_send``): the download's SHA-256
    differs (or it stalls); out-of-order guest data stored one byte off (``_ooo_store(
    self.bytes_received + off + 1, ...)``): the upload's SHA-256 differs (or it stalls)."""
    seed = int(os.environ.get("AIOSLIRP_NETEM_SEED", random.randrange(1 << 32)))
    print(f"\nLossyLink seed {seed} (AIOSLIRP_NETEM_SEED={seed} to replay the fates)")
    data = DataServer()
    stacks: list = []
    links: list = []

    def factory(cfg):
        stack = RecordingStack(cfg)

        def wrap(tr):
            links.append(LossyLink(tr, seed))
            return links[-1]

        stack.transport_wrappers.append(wrap)
        stacks.append(stack)
        return stack

    try:
        cfg = NetworkConfig(ipv6=False, dns_upstreams=[("127.0.0.1", 9)])
        rc = await run_in_namespace(cfg, [sys.executable, "-c", GUEST, str(data.port), str(N)],
                                    stack_factory=factory, offload=False)
        out, err = capfd.readouterr()
        assert rc == 0, f"seed {seed}\n{err[-3000:]}"
        r = json.loads(out.strip().splitlines()[-1])
    finally:
        data.close()
    stack, link = stacks[0], links[0]
    print(f"seed {seed}: lost {link.lost}, reordered {link.reordered}, stack TCP flows {stack.finished_tcp}, "
          f"guest retransmits (upload) {r['guest_retransmits_up']}")
    assert r["down"] == [N, hashlib.sha256(pattern(N, 21)).hexdigest()], seed
    assert r["up"] == [str(N), hashlib.sha256(random.Random(22).randbytes(N)).hexdigest()], seed
    assert min(link.lost.values()) > 0 and min(link.reordered.values()) > 0, (seed, link.lost, link.reordered)
    down = [t for t in stack.finished_tcp if t[0] == N]
    up = [t for t in stack.finished_tcp if t[1] == N + 3]  # "UP\n" and the data
    assert len(down) == 1 and len(up) == 1, (seed, stack.finished_tcp)
    assert down[0][2] > 0, (seed, down)  # the stack retransmitted towards the guest
    assert r["guest_retransmits_up"] > 0, seed  # and the guest towards the stack
    c = stack.counters
    assert c["drop.internal_error"] == 0 and c["flow_errors"] == 0, seed
    assert not stack.parts.flows
