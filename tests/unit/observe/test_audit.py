"""The audit log (aioslirp/observe/audit.py): one record per flow at its end, the bounded
``Stack.flow_events()`` readers, the JSON-lines file and its rotation, and ``--audit-log``
under ``aioslirp run`` with a real guest (curl).

In-process tests drive a Stack over a socketpair with real host sockets on loopback
(tests/support/stacks.py), for IPv4 and IPv6.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import socket

import dpkt
import pytest

from aioslirp import NetworkConfig
from aioslirp.observe.audit import AuditLog

from support.frames import ACK, FAMILIES, FIN, PSH, RST, SYN, of_proto, tcp_frame, udp_frame
from support.guests import need_tool, run_guest
from support.servers import DataServer, DnsUpstream, UdpEcho, pattern
from support.stacks import recv_frames, served_stack

MSS = b"\x02\x04\x05\xb4"


@pytest.fixture(params=FAMILIES, ids=lambda f: f.name)
def fam(request):
    return request.param


def _records(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


async def _until(cond, timeout: float = 3.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.02)


async def _handshake(fam, guest, lst, sport):
    """SYN from the guest to ``lst``'s port; returns (host side socket, stack's ISN)."""
    loop = asyncio.get_running_loop()
    port = lst.getsockname()[1]
    guest.send(tcp_frame(fam, sport, port, SYN, opts=MSS))
    conn, _peer = await asyncio.wait_for(loop.sock_accept(lst), 2)
    conn.setblocking(False)
    (syn_ack,) = [ip for _e, ip in of_proto(fam, await recv_frames(guest), 6)]
    assert syn_ack.data.flags == SYN | ACK
    guest.send(tcp_frame(fam, sport, port, ACK, seq=1001, ack=syn_ack.data.seq + 1))
    return conn, syn_ack.data.seq


def _listener(fam):
    lst = socket.socket(fam.af, socket.SOCK_STREAM)
    lst.bind((fam.loopback, 0))
    lst.listen(4)
    lst.setblocking(False)
    return lst


async def test_tcp_flows_closed_reset_refused_one_record_each(fam):
    buf = io.StringIO()
    cfg = NetworkConfig(audit_log=buf, tcp_connect_timeout=1.0)
    loop = asyncio.get_running_loop()
    async with served_stack(cfg) as (stack, guest, _first):
        lst = _listener(fam)
        port = lst.getsockname()[1]
        # 1. closed: the guest sends 5 bytes and its FIN, the host answers 4 bytes and closes
        conn, isn = await _handshake(fam, guest, lst, 41000)
        guest.send(tcp_frame(fam, 41000, port, ACK | PSH | FIN, seq=1001, ack=isn + 1, data=b"hello"))
        got = b""
        while len(got) < 5 or (await loop.sock_recv(conn, 100)) != b"":
            got += await asyncio.wait_for(loop.sock_recv(conn, 100), 2)
        assert got == b"hello"
        await loop.sock_sendall(conn, b"back")
        conn.close()
        segs = [ip.data for _e, ip in of_proto(fam, await recv_frames(guest), 6)]
        assert b"back" in [s.data for s in segs] and any(s.flags & FIN for s in segs)
        guest.send(tcp_frame(fam, 41000, port, ACK, seq=1007, ack=isn + 1 + 4 + 1))
        await _until(lambda: (6, fam.guest, 41000, fam.gw, port) not in stack.parts.flows)
        # 2. reset by the guest after 3 bytes
        conn2, isn2 = await _handshake(fam, guest, lst, 41001)
        guest.send(tcp_frame(fam, 41001, port, ACK | PSH, seq=1001, ack=isn2 + 1, data=b"abc"))
        assert await asyncio.wait_for(loop.sock_recv(conn2, 100), 2) == b"abc"
        guest.send(tcp_frame(fam, 41001, port, RST, seq=1004))
        await _until(lambda: (6, fam.guest, 41001, fam.gw, port) not in stack.parts.flows)
        conn2.close()
        # 3. refused: nothing listens
        probe = socket.socket(fam.af)
        probe.bind((fam.loopback, 0))
        closed_port = probe.getsockname()[1]
        probe.close()
        guest.send(tcp_frame(fam, 41002, closed_port, SYN, opts=MSS))
        await recv_frames(guest, 0.3)
        await _until(lambda: stack.counters["tcp_connect_refused"] == 1 and not stack.parts.flows)
        lst.close()
        stack.parts.audit.flush()
        recs = _records(buf)
    assert [r["end"] for r in recs] == ["closed", "reset", "refused"], recs
    guest_text, gw_text = fam.addr_text(fam.guest), fam.addr_text(fam.gw)
    for r, gport, dport in zip(recs, (41000, 41001, 41002), (port, port, closed_port)):
        assert (r["event"], r["proto"], r["direction"], r["verdict"], r["rule"], r["name"]) == (
            "flow", "tcp", "outbound", "allow", None, None)
        assert (r["guest"], r["guest_port"], r["dst"], r["port"]) == (guest_text, gport, gw_text, dport)
        assert 0 <= r["duration"] < 10 and abs(r["time"] - __import__("time").time()) < 60
    assert (recs[0]["bytes_up"], recs[0]["bytes_down"]) == (5, 4)
    assert (recs[1]["bytes_up"], recs[1]["bytes_down"]) == (3, 0)
    assert (recs[2]["bytes_up"], recs[2]["bytes_down"]) == (0, 0)


async def test_udp_flow_idles_out_one_record(fam):
    echo = UdpEcho(fam.loopback)
    buf = io.StringIO()
    cfg = NetworkConfig(audit_log=buf, udp_idle_timeout=0.2)
    try:
        async with served_stack(cfg) as (stack, guest, _first):
            guest.send(udp_frame(fam, 42000, echo.port, b"x" * 100))
            guest.send(udp_frame(fam, 42000, echo.port, b"y" * 50))
            replies = [ip for _e, ip in of_proto(fam, await recv_frames(guest), 17)]
            assert len(replies) == 2
            await _until(lambda: stack.counters["udp_idle_closed"] == 1)
            stack.parts.audit.flush()
            recs = _records(buf)
    finally:
        echo.sock.close()
    assert len(recs) == 1, recs
    (r,) = recs
    assert (r["proto"], r["end"], r["bytes_up"], r["bytes_down"], r["port"], r["guest_port"]) == (
        "udp", "idle", 150, 150, echo.port, 42000)
    assert 0.2 <= r["duration"] < 3


async def test_flow_events_slow_reader_loses_oldest(fam):
    cfg = NetworkConfig(udp_idle_timeout=30)
    echo = UdpEcho(fam.loopback)
    try:
        async with served_stack(cfg) as (stack, guest, _first):
            assert stack.parts.audit is None
            events = stack.audit_records(maxlen=3)  # starts an audit log without a file
            for i in range(10):
                guest.send(udp_frame(fam, 43000 + i, echo.port, b"z" * (i + 1)))
            await recv_frames(guest, 0.3)
            assert len(stack.parts.flows) == 10
            for flow in list(stack.parts.flows.values()):
                flow.shutdown()
            got = [await asyncio.wait_for(events.__anext__(), 1) for _ in range(3)]
            assert stack.parts.audit.records_dropped == 7
            assert stack.counters["audit.records_dropped"] == 7
            assert stack.parts.audit.records == 10
            assert all(r["end"] == "closed" and r["dst"] == fam.addr_text(fam.gw) for r in got)
            # the last three flows shut down are the ones kept
            ports = [r["guest_port"] for r in got]
            order = sorted(range(10), key=lambda i: i)  # shutdown order = table order = insertion
            assert ports == [43000 + i for i in order[-3:]]
            await events.aclose()
            assert not stack.parts.audit._readers
    finally:
        echo.sock.close()


async def test_flow_events_end_when_the_stack_closes():
    async with served_stack(NetworkConfig(ipv6=False)) as (stack, _guest, _first):
        events = stack.audit_records()
        stack.parts.audit.record({"event": "dns", "guest": bytes([10, 0, 2, 15]), "dst": None})
    got = [r async for r in events]
    assert got == [{"event": "dns", "guest": "10.0.2.15", "dst": None}]


async def test_audit_file_json_lines_batched_and_reopened_when_rotated(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), flush_interval=0.05, flush_lines=4)
    log.bind(asyncio.get_running_loop())
    for i in range(3):
        log.record({"event": "x", "i": i})
    assert path.read_text() == ""  # buffered: fewer than flush_lines, the timer has not fired
    await asyncio.sleep(0.15)
    assert [json.loads(x)["i"] for x in path.read_text().splitlines()] == [0, 1, 2]
    os.rename(path, tmp_path / "audit.jsonl.1")  # logrotate
    for i in range(3, 7):  # the fourth pending record makes a write at once
        log.record({"event": "x", "i": i})
    assert [json.loads(x)["i"] for x in path.read_text().splitlines()] == [3, 4, 5, 6]
    os.rename(path, tmp_path / "audit.jsonl.2")
    log.reopen()  # SIGHUP
    log.record({"event": "x", "i": 7})
    log.close()
    assert [json.loads(x)["i"] for x in path.read_text().splitlines()] == [7]
    assert len((tmp_path / "audit.jsonl.1").read_text().splitlines()) == 3


def test_audit_log_cli_under_run_with_curl(tmp_path):
    need_tool("curl", "curl")
    dns = DnsUpstream()
    srv = DataServer()
    log_path = tmp_path / "audit.jsonl"
    sizes = (20000, 300000)
    try:
        script = ";".join(f"curl -sS -o /dev/null -w '%{{size_download}}\\n' http://10.0.2.2:{srv.port}/{n}"
                          for n in sizes)
        p = run_guest({"dns": dns}, "", "--audit-log", str(log_path), cmd=["sh", "-c", script])
    finally:
        srv.close()
        dns.close()
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == [str(n) for n in sizes]
    recs = [json.loads(x) for x in log_path.read_text().splitlines()]
    tcp = [r for r in recs if r["event"] == "flow" and r["proto"] == "tcp" and r["port"] == srv.port]
    assert len(tcp) == 2, recs
    for r, n in zip(sorted(tcp, key=lambda r: r["bytes_down"]), sizes):
        header = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % n
        assert r["bytes_down"] == len(header) + n  # what the server sent
        request = f"GET /{n} HTTP/1.1\r\nHost: 10.0.2.2:{srv.port}\r\n"
        assert r["bytes_up"] > len(request)
        assert (r["dst"], r["guest"], r["end"], r["verdict"]) == ("10.0.2.2", "10.0.2.15", "closed", "allow")
    assert hashlib.sha256(pattern(10, 1)).hexdigest()  # (the server's body generator, as curl read it)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _deny(port: int = 9, dst: str = "192.0.2.1", rule: str = "egress-default deny") -> dict:
    return {"event": "deny", "time": 5.0, "proto": "udp", "dst": dst, "port": port, "rule": rule}


def _dns(name: str = "blocked.test", rule: str = "egress-default deny") -> dict:
    return {"event": "dns", "time": 5.0, "proto": "dns", "name": name, "qtype": "A", "rule": rule}


def test_a_flood_of_denials_is_written_at_a_bounded_rate_and_counted():
    """A guest sending to one denied destination again and again makes one deny record each: the
    first, then DECISION_BURST more, are written; beyond them they are counted as
    audit.records_suppressed, not written, so the log cannot grow without bound, and a
    ``suppressed`` record with the count is written at close; flow records are never suppressed."""
    from aioslirp.observe.audit import DECISION_BURST

    out = io.StringIO()
    log = AuditLog(out, clock=Clock())
    for _ in range(300):
        log.record(_deny())
    for i in range(50):
        log.record({"event": "flow", "time": 0.0, "proto": "udp", "dst": "192.0.2.2", "port": 9 + i})
    log.close()
    recs = _records(out)
    denies = sum(r["event"] == "deny" for r in recs)
    assert denies == 1 + DECISION_BURST
    assert log.counters["audit.records_suppressed"] == 300 - denies
    assert [r for r in recs if r["event"] == "suppressed"] == [
        {"event": "suppressed", "time": recs[-1]["time"], "kind": "deny", "count": 300 - denies, "first": 5.0,
         "last": 5.0}]
    assert sum(r["event"] == "flow" for r in recs) == 50


def test_a_dns_flood_does_not_hide_the_next_denial():
    """Issue 24 (5): 250 DNS records for blocked names (one name, so they are repeats) spend the
    DNS budget, not the denials': the denied connection that follows is written; the DNS
    records held back are summed up in a ``suppressed`` record of kind ``dns`` with their count.
    Before the fix the deny record was suppressed and nothing said so."""
    from aioslirp.observe.audit import DECISION_BURST

    out = io.StringIO()
    clock = Clock()
    log = AuditLog(out, clock=clock)
    for _ in range(250):
        log.record(_dns())
    log.record(_deny(port=443, dst="198.51.100.7"))
    clock.t += 10  # the DNS bucket refills: the next dns record is written, after the summary
    log.record(_dns())
    log.close()
    recs = _records(out)
    assert [(r["dst"], r["port"]) for r in recs if r["event"] == "deny"] == [("198.51.100.7", 443)]
    held = 250 - 1 - DECISION_BURST
    summaries = [r for r in recs if r["event"] == "suppressed"]
    assert [(r["kind"], r["count"]) for r in summaries] == [("dns", held)]
    assert recs.index(summaries[0]) == len(recs) - 2 and recs[-1]["event"] == "dns"
    assert log.counters["audit.records_suppressed"] == held


def test_the_first_record_of_each_new_destination_port_and_rule_is_written():
    """Once the deny budget is spent, a record whose (destination, port, rule) is new is still
    written; at most FIRST_KEYS new keys a window, after FIRST_WINDOW seconds they count as new
    again."""
    from aioslirp.observe.audit import DECISION_BURST, FIRST_KEYS, FIRST_WINDOW

    out = io.StringIO()
    clock = Clock()
    log = AuditLog(out, clock=clock)
    for _ in range(500):
        log.record(_deny())  # the budget is spent
    log.record(_deny(port=10))
    log.record(_deny(rule="192.0.2.0/24"))
    log.record(_deny(dst="192.0.2.2"))
    log.record(_deny())  # a repeat: suppressed
    for i in range(FIRST_KEYS + 10):
        log.record(_deny(port=1000 + i))
    clock.t += FIRST_WINDOW
    log.record(_deny())  # a new window: new again
    log.close()
    recs = [r for r in _records(out) if r["event"] == "deny"]
    burst = int(DECISION_BURST)
    firsts = [(r["dst"], r["port"], r["rule"]) for r in recs[1 + burst:1 + burst + 3]]
    assert firsts == [("192.0.2.1", 10, "egress-default deny"), ("192.0.2.1", 9, "192.0.2.0/24"),
                      ("192.0.2.2", 9, "egress-default deny")]
    # the first key, the burst, FIRST_KEYS - 1 more new keys (the 14 past them waited for the
    # budget: suppressed), and the first key again in the new window
    assert len(recs) == 1 + burst + (FIRST_KEYS - 1) + 1
    assert (recs[-1]["port"], recs[-2]["port"]) == (9, 1000 + FIRST_KEYS - 5)


async def test_a_suppressed_record_follows_a_flood_through_the_stack():
    """In process, a guest behind a Stack under default deny: 500 DNS queries for one blocked name,
    a SYN to a denied destination (its deny record is written), then 500 SYNs to one other denied
    destination and port; a second later the log holds a ``suppressed`` record per kind, and the
    records written plus the counts they sum up equal the policy's counters. (The summaries come
    from the loop's timer, at most one per kind a second.)"""
    from support.frames import F4

    buf = io.StringIO()
    cfg = NetworkConfig(egress_default="deny", ipv6=False, audit_log=buf, dns_upstreams=[("127.0.0.1", 9)])
    q = bytes(dpkt.dns.DNS(id=1, rd=1, qd=[dpkt.dns.DNS.Q(name="c2vjcmv0.attacker.example", type=1, cls=1)]))

    async def send(frames):
        for i, f in enumerate(frames):
            guest.send(f)
            if i % 32 == 31:  # let the stack read them (and drain its answers)
                await recv_frames(guest, 0.02)
        await recv_frames(guest, 0.3)

    async with served_stack(cfg, settle=0.1) as (stack, guest, _):
        await send([udp_frame(F4, 20000 + i, 53, q, dst=socket.inet_aton("10.0.2.3")) for i in range(500)])
        await send([tcp_frame(F4, 30000, 443, SYN, dst=socket.inet_aton("198.51.100.7"))])
        await send([tcp_frame(F4, 30001 + i, 80, SYN, dst=socket.inet_aton("198.51.100.8")) for i in range(500)])
        await asyncio.sleep(1.2)  # SUMMARY_DELAY: the timer writes the summaries
        stack.parts.audit.flush()
        recs = _records(buf)
        c = dict(stack.counters)
    denies = [r for r in recs if r["event"] == "deny"]
    assert ("198.51.100.7", 443) in [(r["dst"], r["port"]) for r in denies]
    sums: dict = {}
    for r in recs:
        if r["event"] == "suppressed":
            sums[r["kind"]] = sums.get(r["kind"], 0) + r["count"]
    assert set(sums) == {"dns", "deny"}, (sums, {k: v for k, v in c.items() if "dns" in k or "audit" in k})
    assert sum(sums.values()) == c["audit.records_suppressed"]
    assert len(denies) + sums["deny"] == c["drop.egress_denied"] == 501
    assert sum(r["event"] == "dns" for r in recs) + sums["dns"] == c["egress.dns_blocked"] == 500
