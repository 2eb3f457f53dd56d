"""DNS forwarder tests against real UDP/TCP upstreams on 127.0.0.1 (built with dpkt)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.services.dns import DnsForwarder, DnsTcpSession, read_resolv_conf

from support.prereqs import have_ipv6_loopback, need
from support.servers import free_port

ANSWER_IP = socket.inet_aton("192.0.2.7")  # data inside the answer only, never contacted


def query(name: str = "example.test", qid: int = 0x4242, qtype: int = dpkt.dns.DNS_A) -> bytes:
    q = dpkt.dns.DNS(id=qid, op=dpkt.dns.DNS_RD, qd=[dpkt.dns.DNS.Q(name=name, type=qtype)], an=[], ns=[], ar=[])
    return bytes(q)


def answer(req: bytes, *, qid: int | None = None, name: str | None = None, tc: bool = False,
           count: int = 1, qtype: int | None = None) -> bytes:
    q = dpkt.dns.DNS(req)
    qd = q.qd[0]
    resp = dpkt.dns.DNS(id=q.id if qid is None else qid, op=dpkt.dns.DNS_QR | dpkt.dns.DNS_RD | dpkt.dns.DNS_RA,
                        qd=[dpkt.dns.DNS.Q(name=name or qd.name, type=qd.type if qtype is None else qtype)],
                        an=[], ns=[], ar=[])
    if tc:
        resp.op |= dpkt.dns.DNS_TC
    else:
        for i in range(count):
            resp.an.append(dpkt.dns.DNS.RR(name=qd.name, type=dpkt.dns.DNS_A, ttl=60,
                                           rdata=ANSWER_IP[:3] + bytes([i % 256])))
    return bytes(resp)


class Upstream(asyncio.DatagramProtocol):
    """A scripted UDP upstream: ``script(request) -> list of datagrams`` to send back."""

    def __init__(self, script):
        self.script = script
        self.received: list[bytes] = []
        self.peers: list[tuple[str, int]] = []  # source address of each received datagram

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        self.received.append(data)
        self.peers.append(addr)
        for out in self.script(data):
            self.transport.sendto(out, addr)


async def udp_upstream(script, port: int = 0):
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(lambda: Upstream(script), local_addr=("127.0.0.1", port))
    return transport, proto, transport.get_extra_info("sockname")[1]


def forwarder(*ports: int, timeout: float = 0.3, **kw) -> DnsForwarder:
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", p) for p in ports], dns_timeout=timeout).validate()
    return DnsForwarder(cfg, **kw)


@pytest.fixture
async def good():
    transport, proto, port = await udp_upstream(lambda req: [answer(req)])
    yield proto, port
    transport.close()


@pytest.fixture
async def silent():
    transport, proto, port = await udp_upstream(lambda req: [])
    yield proto, port
    transport.close()


def check_answer(resp: bytes, qid: int = 0x4242, name: str = "example.test") -> dpkt.dns.DNS:
    msg = dpkt.dns.DNS(resp)
    assert msg.id == qid
    assert msg.qr == dpkt.dns.DNS_R
    assert msg.rcode == dpkt.dns.DNS_RCODE_NOERR
    assert msg.qd[0].name == name
    assert msg.an[0].rdata == ANSWER_IP[:3] + b"\0"
    return msg


async def test_answer_and_id_randomised(good):
    proto, port = good
    fwd = forwarder(port)
    resp = await fwd.resolve(query())
    check_answer(resp)
    # The upstream saw the guest's message under another ID; the guest sees its own back.
    assert len(proto.received) == 1
    assert proto.received[0][2:] == query()[2:]
    assert proto.received[0][:2] != query()[:2]
    assert fwd.stats["queries"] == 1 and fwd.stats["answered"] == 1
    await fwd.close()


async def test_upstream_ids_and_source_ports_fresh_per_query(good):
    """RFC 5452 section 9.2: each upstream query has its own random ID and source port.

    16 queries, all with the guest ID 0x4242: the upstream IDs are not the guest's, not one
    value, not a counter; the source ports are not one reused socket. Thresholds leave room
    for chance collisions (about 0.2% per pair of queries for ports, 0.03% for IDs).
    """
    proto, port = good
    fwd = forwarder(port)
    n = 16
    for _ in range(n):
        check_answer(await fwd.resolve(query()))
    assert len(proto.received) == n
    ids = [struct.unpack_from("!H", m)[0] for m in proto.received]
    assert sum(i == 0x4242 for i in ids) <= 1, ids
    assert len(set(ids)) >= n - 2, ids
    steps = {(b - a) % 0x10000 for a, b in zip(ids, ids[1:])}
    assert len(steps) > 1, ids  # not an arithmetic sequence
    ports = [peer[1] for peer in proto.peers]
    assert len(set(ports)) >= n - 2, ports
    assert fwd.stats["answered"] == n
    await fwd.close()


async def test_failover_after_timeout(good, silent):
    fwd = forwarder(silent[1], good[1], timeout=0.3)
    t0 = time.monotonic()
    resp = await fwd.resolve(query())
    elapsed = time.monotonic() - t0
    check_answer(resp)
    assert elapsed >= 0.28  # causality: the failover waited for the timeout (no upper bound)
    assert len(silent[0].received) == 1 and len(good[0].received) == 1
    assert fwd.stats["timeouts"] == 1 and fwd.stats["failovers"] == 1
    await fwd.close()


async def test_failover_on_refused_is_immediate(good):
    fwd = forwarder(free_port(socket.SOCK_DGRAM), good[1], timeout=2.0)
    resp = await fwd.resolve(query())
    check_answer(resp)
    # Immediate: the ICMP port unreachable moved on, no timeout ran (counted below).
    assert fwd.stats["refused"] == 1 and fwd.stats["failovers"] == 1 and fwd.stats["timeouts"] == 0
    await fwd.close()


def wrong_class(resp: bytes) -> bytes:
    off = 12 + len(b"\x07example\x04test\x00") + 2  # qclass of the first question
    return resp[:off] + struct.pack("!H", dpkt.dns.DNS_CHAOS) + resp[off + 2 :]


async def test_mismatched_responses_ignored():
    def script(req):
        rid = struct.unpack("!H", req[:2])[0]
        return [
            answer(req, qid=rid ^ 0x5555),  # wrong ID
            answer(req, name="other.test"),  # wrong qname
            answer(req, qtype=dpkt.dns.DNS_AAAA),  # wrong qtype
            wrong_class(answer(req)),  # wrong qclass
            b"\x00\x01",  # garbage
            answer(req, name="ExAmPlE.TeSt"),  # right (qname compared case-insensitively)
        ]

    transport, _, port = await udp_upstream(script)
    try:
        fwd = forwarder(port)
        resp = await fwd.resolve(query())
        check_answer(resp, name="example.test")  # the guest gets its own spelling of the name back
        assert fwd.stats["mismatched"] == 5 and fwd.stats["answered"] == 1
        await fwd.close()
    finally:
        transport.close()


async def test_all_upstreams_dead_servfail(silent):
    fwd = forwarder(free_port(socket.SOCK_DGRAM), silent[1], free_port(socket.SOCK_DGRAM), timeout=0.2)
    q = query(qid=0xBEEF)
    resp = await fwd.resolve(q)
    msg = dpkt.dns.DNS(resp)
    assert msg.id == 0xBEEF and msg.qr == dpkt.dns.DNS_R
    assert msg.rcode == dpkt.dns.DNS_RCODE_SERVFAIL
    assert msg.qd[0].name == "example.test" and msg.qd[0].type == dpkt.dns.DNS_A
    assert msg.an == []
    assert resp[12:] == q[12:]  # question copied verbatim
    assert fwd.stats["servfail"] == 1 and fwd.stats["failovers"] == 2
    await fwd.close()


async def test_down_upstream_logged_once_with_its_cause_and_again_after_recovery(caplog):
    """An upstream with nothing listening: one WARNING naming it and the cause (not one per
    query), one INFO when it answers again, and a WARNING again when it fails after that."""
    caplog.set_level(logging.DEBUG, logger="aioslirp.services.dns")
    port = free_port(socket.SOCK_DGRAM)
    fwd = forwarder(port, timeout=0.3)
    down = f"DNS upstream 127.0.0.1:{port} unreachable: connection refused; answering SERVFAIL"

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level]

    for qid in range(3):
        assert dpkt.dns.DNS(await fwd.resolve(query(qid=qid))).rcode == dpkt.dns.DNS_RCODE_SERVFAIL
    assert said(logging.WARNING) == [down]
    assert fwd.stats["refused"] == 3 and fwd.down == {("127.0.0.1", port): "connection refused"}
    transport, _, _ = await udp_upstream(lambda req: [answer(req)], port=port)
    try:
        check_answer(await fwd.resolve(query()))
        check_answer(await fwd.resolve(query()))
    finally:
        transport.close()
        await asyncio.sleep(0)  # the transport closes its socket in the next loop iteration
    assert said(logging.INFO) == [f"DNS upstream 127.0.0.1:{port} answers again"] and fwd.down == {}
    for qid in range(2):
        assert dpkt.dns.DNS(await fwd.resolve(query(qid=qid))).rcode == dpkt.dns.DNS_RCODE_SERVFAIL
    assert said(logging.WARNING) == [down, down]
    await fwd.close()


async def test_down_upstream_before_a_good_one_says_it_fails_over(good, silent, caplog):
    caplog.set_level(logging.INFO, logger="aioslirp.services.dns")
    fwd = forwarder(silent[1], good[1], timeout=0.2)
    for _ in range(2):
        check_answer(await fwd.resolve(query()))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"DNS upstream 127.0.0.1:{silent[1]} unreachable: no answer within 0.2 s; trying the next upstream"]
    assert fwd.stats["timeouts"] == 2
    await fwd.close()


async def test_truncated_answer_retried_over_tcp():
    big = {}

    def script(req):
        return [answer(req, tc=True)]

    async def handle(reader, writer):
        (n,) = struct.unpack("!H", await reader.readexactly(2))
        req = await reader.readexactly(n)
        big["req"] = req
        # a mismatching message first, then the real (large) answer
        for resp in (answer(req, name="other.test"), answer(req, count=200)):
            writer.write(DnsTcpSession.frame(resp))
        await writer.drain()
        writer.close()

    # TCP listener first (an ephemeral TCP port may sit in TIME-WAIT; UDP ports do not),
    # then the UDP upstream on the same number
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, proto, _ = await udp_upstream(script, port)
    try:
        fwd = forwarder(port)
        # Guest asked over UDP: the truncated answer goes back as is (the guest retries over TCP).
        resp = await fwd.resolve(query())
        assert dpkt.dns.DNS(resp).op & dpkt.dns.DNS_TC and "req" not in big
        # Guest asked over TCP: the forwarder retries the same upstream over TCP.
        resp = await fwd.resolve(query(), tcp=True)
        msg = dpkt.dns.DNS(resp)
        assert msg.id == 0x4242 and not msg.op & dpkt.dns.DNS_TC
        assert len(msg.an) == 200 and len(resp) > 512
        assert big["req"][2:] == query()[2:]
        assert fwd.stats["tcp_retries"] == 1 and fwd.stats["mismatched"] == 1
        await fwd.close()
    finally:
        server.close()
        await server.wait_closed()
        transport.close()


async def test_malformed_queries():
    fwd = forwarder(free_port(socket.SOCK_DGRAM))
    assert await fwd.resolve(b"\x12\x34\x01") is None  # not even a header
    resp = await fwd.resolve(b"\x12\x34\x01\x00" + b"\x00" * 8)  # no question
    msg = dpkt.dns.DNS(resp)
    assert msg.id == 0x1234 and msg.rcode == dpkt.dns.DNS_RCODE_FORMERR and msg.qr == dpkt.dns.DNS_R
    resp = await fwd.resolve(query()[:-3])  # question cut short
    assert dpkt.dns.DNS(resp).rcode == dpkt.dns.DNS_RCODE_FORMERR
    resp = await fwd.resolve(b"\x00\x07\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01")  # ptr loop
    assert dpkt.dns.DNS(resp).rcode == dpkt.dns.DNS_RCODE_FORMERR
    assert await fwd.resolve(answer(query())) is None  # a response is never answered
    assert fwd.stats["malformed"] == 5
    await fwd.close()


async def test_edns_size_clamped_to_mtu_for_udp(good):
    proto, port = good
    q = dpkt.dns.DNS(query())
    q.ar = [dpkt.dns.DNS.RR(name="", type=41, cls=4096, rdata=b"")]
    fwd = forwarder(port)
    await fwd.resolve(bytes(q))
    assert struct.unpack_from("!H", proto.received[-1], len(proto.received[-1]) - 8)[0] == 1472
    await fwd.close()


async def test_resolv_conf_upstreams_and_reread(tmp_path, good):
    path = tmp_path / "resolv.conf"
    path.write_text("# test\nsearch example.test\nnameserver 127.0.0.1\n")
    cfg = NetworkConfig(dns_timeout=0.3).validate()
    fwd = DnsForwarder(cfg, resolv_conf=str(path), resolv_check_interval=0.0)
    assert fwd.upstreams == [("127.0.0.1", 53)]
    path.write_text("nameserver 127.0.0.9\nnameserver ::1\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert fwd.upstreams == [("127.0.0.9", 53), ("::1", 53)]
    # Throttled: with the default interval a change is not seen within the same second.
    fwd2 = DnsForwarder(cfg, resolv_conf=str(path))
    assert fwd2.upstreams == [("127.0.0.9", 53), ("::1", 53)]
    path.write_text("nameserver 127.0.0.10\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert fwd2.upstreams == [("127.0.0.9", 53), ("::1", 53)]
    fwd2._resolv_checked -= 1.0
    assert fwd2.upstreams == [("127.0.0.10", 53)]
    # Explicit upstreams win over the file.
    cfg2 = NetworkConfig(dns_upstreams=[("127.0.0.1", good[1])]).validate()
    assert DnsForwarder(cfg2, resolv_conf=str(path)).upstreams == [("127.0.0.1", good[1])]
    # Empty / missing file: glibc's default.
    assert DnsForwarder(cfg, resolv_conf=str(tmp_path / "missing")).upstreams == [("127.0.0.1", 53)]
    await fwd.close()


def test_read_resolv_conf(tmp_path):
    path = tmp_path / "resolv.conf"
    path.write_text(
        "; comment\n"
        "nameserver 127.0.0.53\n"
        "nameserver 127.0.0.53\n"
        "  nameserver   ::1   # trailing comment\n"
        "nameserver fe80::1%lo\n"
        "nameserver not-an-ip\n"
        "nameserver\n"
        "#nameserver 127.0.0.2\n"
        "options edns0 trust-ad\n"
        "search a.test b.test\n"
    )
    assert read_resolv_conf(str(path)) == [("127.0.0.53", 53), ("::1", 53), ("fe80::1%lo", 53)]
    assert read_resolv_conf(str(tmp_path / "nope")) == []


async def test_ipv6_loopback_upstream():
    loop = asyncio.get_running_loop()
    need(have_ipv6_loopback(), "no IPv6 loopback")
    transport, _ = await loop.create_datagram_endpoint(
        lambda: Upstream(lambda req: [answer(req)]), local_addr=("::1", 0))
    port = transport.get_extra_info("sockname")[1]
    try:
        cfg = NetworkConfig(dns_upstreams=[("::1", port)], dns_timeout=0.3).validate()
        fwd = DnsForwarder(cfg)
        check_answer(await fwd.resolve(query()))
        await fwd.close()
    finally:
        transport.close()


async def test_concurrent_queries_and_close(silent, good):
    fwd = forwarder(silent[1], timeout=5.0)
    tasks = [asyncio.create_task(fwd.resolve(query(qid=i))) for i in range(20)]
    await asyncio.sleep(0.05)
    await fwd.close()
    results = await asyncio.gather(*tasks)
    assert results == [None] * 20
    assert fwd.stats["timeouts"] == 0  # aborted by close, not ended by the 5 s timeout
    fwd = forwarder(good[1])
    results = await asyncio.gather(*(fwd.resolve(query(qid=i)) for i in range(50)))
    assert [dpkt.dns.DNS(r).id for r in results] == list(range(50))
    await fwd.close()


def test_tcp_session_framing():
    msgs = [query(qid=i) for i in range(3)]
    stream = b"".join(DnsTcpSession.frame(m) for m in msgs)
    s = DnsTcpSession()
    assert s.feed(stream) == msgs and s.pending == 0
    s = DnsTcpSession()
    got = []
    for i in range(len(stream)):
        got += s.feed(stream[i : i + 1])
    assert got == msgs
    s = DnsTcpSession()
    assert s.feed(stream + DnsTcpSession.frame(msgs[0])[:5]) == msgs
    assert s.pending == 5
    assert s.feed(DnsTcpSession.frame(msgs[0])[5:]) == [msgs[0]] and s.pending == 0
    # Zero-length frames are skipped; a partial 64 KiB message stays bounded.
    assert s.feed(b"\x00\x00" + DnsTcpSession.frame(b"x")) == [b"x"] and s.empty_frames == 1
    assert s.feed(b"\xff\xff" + b"a" * 70000) == [b"a" * 65535]
    assert s.pending == 70000 - 65535
    big = b"z" * 65535
    assert DnsTcpSession.frame(big)[:2] == b"\xff\xff"
    with pytest.raises(ValueError):
        DnsTcpSession.frame(b"z" * 65536)


async def test_the_upstream_gets_a_query_rebuilt_from_what_was_parsed(good):
    """A hostile guest's query for a name it may resolve carried data past the name policy: other
    records, EDNS options, letter case and bytes after the message went to the upstream verbatim.
    The upstream now gets header, question and (only if the guest had one) an option-less OPT RR
    rebuilt from the parse; the guest still gets its own spelling of the name back."""
    proto, port = good
    fwd = forwarder(port)
    q = dpkt.dns.DNS(query("ExAmPlE.TeSt"))
    q.an = [dpkt.dns.DNS.RR(name="x.test", type=dpkt.dns.DNS_TXT, ttl=1, rdata=b"\x08EXFIL123")]
    q.ar = [dpkt.dns.DNS.RR(name="", type=41, cls=1232, ttl=0x8000,  # DO set
                            rdata=struct.pack("!HH", 65001, 6) + bytes.fromhex("deadbeefcafe"))]
    raw = bytes(q) + b"J" * 170
    resp = await fwd.resolve(raw)
    msg = check_answer(resp, name="ExAmPlE.TeSt")
    assert msg.qd[0].name == "ExAmPlE.TeSt"
    sent = proto.received[-1]
    expected = dpkt.dns.DNS(query("example.test"))
    expected.ar = [dpkt.dns.DNS.RR(name="", type=41, cls=1232, ttl=0x8000, rdata=b"")]
    assert sent[2:] == bytes(expected)[2:]
    for leak in (b"EXFIL123", bytes.fromhex("deadbeefcafe"), b"JJJJ", b"ExAmPlE"):
        assert leak not in sent
    await fwd.close()


@pytest.mark.parametrize("opcode", [dpkt.dns.DNS_IQUERY, dpkt.dns.DNS_STATUS, 4, dpkt.dns.DNS_UPDATE])
async def test_an_opcode_other_than_query_is_not_implemented_and_never_forwarded(good, opcode):
    """UPDATE (RFC 2136), NOTIFY (RFC 1996), STATUS, IQUERY: a stub resolver only asks QUERY; the
    rest is answered NOTIMP here (RFC 1035 4.1.1) and reaches no upstream."""
    proto, port = good
    fwd = forwarder(port)
    q = dpkt.dns.DNS(query())
    q.opcode = opcode
    resp = dpkt.dns.DNS(await fwd.resolve(bytes(q)))
    assert resp.id == 0x4242 and resp.qr == dpkt.dns.DNS_R and resp.rcode == 4 and resp.opcode == opcode
    assert proto.received == [] and fwd.stats["notimp"] == 1
    await fwd.close()
