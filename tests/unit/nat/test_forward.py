"""Port forwards at the library level: ``Stack.add_forward()/remove_forward()/forwards()``,
the active open towards the guest, UDP flows back to host clients, and the API handler.

The guest here is this test, speaking Ethernet frames over a socket pair (built and
parsed with dpkt), so every field of what the stack sends into the guest can be checked:
the ARP request for an unknown guest, the SYN's source (gateway), MSS and window-scale
options, the handshake, half-close both ways, RST. Host clients are real sockets on
127.0.0.1 (pytest runs in a loopback-only namespace).
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import time

import dpkt
import pytest

from aioslirp import ConfigError, ForwardError, NetworkConfig, PortForward, SocketPairTransport, Stack
from aioslirp.config.forward import parse_publish
from aioslirp.frontends.api import ApiServer
from aioslirp.nat.forward import SOURCE_PORTS, UnknownForwardError

from support.frames import ACK, F4, FIN, GUEST4, GW4, PSH, RST, SYN, ip_frame, tcp_frame
from support.prereqs import have_ipv6_loopback, need
from support.stacks import GuestEnd, guest_accept, host_connect, is_arp_request
from support.stacks import stack_guest  # noqa: F401 - a fixture

# ----------------------------------------------------------------------------- parsing


def test_parse_publish():
    assert parse_publish("8080:80") == PortForward("tcp", "127.0.0.1", 8080, None, 80)
    assert parse_publish("0.0.0.0:53:5353/udp") == PortForward("udp", "0.0.0.0", 53, None, 5353)
    assert parse_publish("[::1]:8080:80/tcp") == PortForward("tcp", "::1", 8080, None, 80)
    assert parse_publish("10.1.2.3:1:65535/TCP").host_port == 1
    for bad in ("80", "a:80", "1.2.3:80:80", "8080:80/sctp", "::1:8080:80", "[::1]8080:80", "0:80",
                "8080:70000", "1:2:3:4", "[nope]:1:2", ""):
        with pytest.raises(ConfigError) as ei:
            parse_publish(bad)
        assert ei.value.field == "--publish"


# ----------------------------------------------------------------------------- management


async def test_add_list_remove_forwards(stack_guest):
    stack, guest = stack_guest
    f1 = await stack.add_forward(PortForward(host_port=0, guest_port=80))
    f2 = await stack.add_forward(PortForward(proto="udp", host_port=0, guest_port=53))
    assert (f1.id, f2.id) == (1, 2)
    assert f1.host_port > 0 and f1.guest_addr == "10.0.2.15" and f1.host_addr == "127.0.0.1"
    assert stack.forwards() == [f1, f2]
    # the same host port again: a clear error naming it, errno EADDRINUSE
    with pytest.raises(ForwardError) as ei:
        await stack.add_forward(PortForward(host_port=f1.host_port, guest_port=81))
    assert ei.value.errno == errno.EADDRINUSE
    assert f"127.0.0.1:{f1.host_port}/tcp" in str(ei.value) and "in use" in str(ei.value)
    for bad in (PortForward(guest_port=80, guest_addr="10.0.2.2"), PortForward(guest_port=80, guest_addr="192.0.2.1"),
                PortForward(guest_port=0), PortForward(proto="sctp", guest_port=1),
                PortForward(host_addr="localhost", guest_port=1)):
        with pytest.raises(ConfigError):
            await stack.add_forward(bad)
    assert stack.remove_forward(f1.id) == f1
    assert stack.forwards() == [f2]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", f1.host_port), timeout=2).close()
    with pytest.raises(KeyError):
        stack.remove_forward(f1.id)
    stack.remove_forward(f2)
    assert stack.forwards() == []
    assert stack.counters["forwards.tcp.added"] == 1 and stack.counters["forwards.udp.removed"] == 1


async def test_remove_unknown_forward_names_the_id(stack_guest):
    stack, _ = stack_guest
    for fid in (99, PortForward(guest_port=80)):  # never added: an id, a forward without one
        with pytest.raises(ForwardError) as ei:
            stack.remove_forward(fid)
        assert isinstance(ei.value, KeyError) and isinstance(ei.value, UnknownForwardError)
        assert ei.value.errno == errno.ENOENT
    assert str(ei.value) == "remove_forward: no forward with id None (active ids: none)"  # never added: no id
    f1 = await stack.add_forward(PortForward(host_port=0, guest_port=80))
    with pytest.raises(KeyError) as ei:  # what callers caught before still works
        stack.remove_forward(99)
    assert str(ei.value) == "remove_forward: no forward with id 99 (active ids: 1)" and ei.value.forward_id == 99
    stack.remove_forward(f1)


async def test_ipv6_host_address(stack_guest):
    stack, guest = stack_guest
    need(have_ipv6_loopback(), "no IPv6 loopback in this namespace")
    fwd = await stack.add_forward(PortForward(host_addr="::1", host_port=0, guest_port=80))
    reader, writer = await host_connect(fwd.host_port, socket.AF_INET6, "::1")
    sport, seq, ack, _ = await guest_accept(guest, 80)
    writer.write(b"v6")
    seg = await guest.expect_tcp()
    assert seg.data == b"v6"
    writer.close()
    stack.remove_forward(fwd.id)


# ----------------------------------------------------------------------------- TCP active open


async def test_active_open_options_data_and_half_close(stack_guest):
    stack, guest = stack_guest
    fwd = await stack.add_forward(PortForward(host_port=0, guest_port=8080))
    reader, writer = await host_connect(fwd.host_port)
    writer.write(b"early bytes")  # before the guest even saw our SYN: queued, sent after the handshake
    arp = await guest.expect(is_arp_request)
    guest.answer_arp(arp)
    syn = await guest.expect_tcp()
    assert syn.flags == SYN and syn.dport == 8080
    assert SOURCE_PORTS[0] <= syn.sport <= SOURCE_PORTS[1]
    opts = dict(dpkt.tcp.parse_opts(syn.opts))
    assert opts[dpkt.tcp.TCP_OPT_MSS] == (1500 - 40).to_bytes(2, "big")
    assert dpkt.tcp.TCP_OPT_WSCALE in opts  # window scaling offered, as for outbound flows
    key = (6, GUEST4, 8080, GW4, syn.sport)
    assert stack.parts.flows[key].state == "SYN-SENT"
    guest.send(tcp_frame(F4, 8080, syn.sport, SYN | ACK, 5000, syn.seq + 1, opts=b"\x02\x04\x05\xb4\x01\x03\x03\x07",
                         win=64240))
    seg = await guest.expect_tcp()
    while not seg.data:  # the ACK of the SYN-ACK may come alone
        seg = await guest.expect_tcp()
    assert seg.data == b"early bytes" and seg.ack == 5001
    assert stack.parts.flows[key].state == "ESTABLISHED"
    assert stack.parts.flows[key].conn.snd_wscale == 7
    my_seq = 5001
    their = seg.seq + len(seg.data)
    # host client half-closes: the guest gets a FIN, and can still send the reply
    writer.write_eof()
    fin = await guest.expect_tcp()
    assert fin.flags & FIN and fin.seq == their
    their += 1
    guest.send(tcp_frame(F4, 8080, syn.sport, ACK | PSH, my_seq, their, data=b"reply from guest"))
    my_seq += len(b"reply from guest")
    assert await asyncio.wait_for(reader.readexactly(16), 3) == b"reply from guest"
    guest.send(tcp_frame(F4, 8080, syn.sport, ACK | FIN, my_seq, their))
    assert await asyncio.wait_for(reader.read(), 3) == b""  # EOF after the guest's FIN
    writer.close()
    # both sides closed: the flow leaves the table (after a short TIME-WAIT), no host socket kept
    for _ in range(300):
        if key not in stack.parts.flows:
            break
        assert stack.parts.flows[key].host_closed
        await asyncio.sleep(0.01)
    assert key not in stack.parts.flows
    assert stack.counters["flows.tcp.opened"] == stack.counters["flows.tcp.closed"] == 1


async def test_guest_closes_first_host_sees_eof(stack_guest):
    stack, guest = stack_guest
    fwd = await stack.add_forward(PortForward(host_port=0, guest_port=22))
    reader, writer = await host_connect(fwd.host_port)
    sport, seq, their, _ = await guest_accept(guest, 22)
    guest.send(tcp_frame(F4, 22, sport, ACK | PSH | FIN, seq, their, data=b"banner\n"))
    assert await asyncio.wait_for(reader.read(), 3) == b"banner\n"
    # the host client can still send after the guest's FIN (half-close the other way)
    writer.write(b"still here")
    seg = await guest.expect_tcp()
    while not seg.data:
        seg = await guest.expect_tcp()
    assert seg.data == b"still here"
    writer.close()
    await guest.expect_tcp()  # our FIN follows
    # a second connection: its own source port
    reader2, writer2 = await host_connect(fwd.host_port)
    sport2, *_ = await guest_accept(guest, 22, mac_known=True)
    assert sport2 != sport
    writer2.close()


async def test_guest_rst_resets_host_client_at_once(stack_guest):
    stack, guest = stack_guest
    fwd = await stack.add_forward(PortForward(host_port=0, guest_port=9))
    reader, writer = await host_connect(fwd.host_port)
    arp = await guest.expect(is_arp_request)
    guest.answer_arp(arp)
    syn = await guest.expect_tcp()
    guest.send(tcp_frame(F4, 9, syn.sport, RST | ACK, 0, syn.seq + 1))  # what a kernel sends for a closed port
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(100), 3)
    assert stack.counters["forward_connect_timeout"] == 0  # reset by the guest's RST, not our 2 s timeout
    writer.close()
    await asyncio.sleep(0.05)
    assert not [f for f in stack.parts.flows.values() if f.proto_name == "tcp"]


async def test_guest_not_answering_arp_resets_host_client(stack_guest):
    stack, guest = stack_guest
    fwd = await stack.add_forward(PortForward(host_port=0, guest_port=9))
    reader, writer = await host_connect(fwd.host_port)
    t0 = time.monotonic()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(100), 5)
    assert time.monotonic() - t0 > 0.5  # causality: after the ARP retries (no upper bound)
    assert stack.counters["forward_guest_unresolved"] == 1
    assert stack.counters["arp_requests"] >= 3  # retried
    writer.close()


async def test_guest_silent_after_arp_times_out(stack_guest):
    stack, guest = stack_guest  # tcp_connect_timeout=2.0 in the fixture
    fwd = await stack.add_forward(PortForward(host_port=0, guest_port=9))
    reader, writer = await host_connect(fwd.host_port)
    guest.answer_arp(await guest.expect(is_arp_request))
    await guest.expect_tcp()  # the SYN, never answered
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(100), 5)
    rst = await guest.expect_tcp()
    while not rst.flags & RST:
        rst = await guest.expect_tcp()
    assert stack.counters["forward_connect_timeout"] == 1
    writer.close()


async def test_host_client_reset_resets_guest(stack_guest):
    stack, guest = stack_guest
    fwd = await stack.add_forward(PortForward(host_port=0, guest_port=7))
    s = socket.create_connection(("127.0.0.1", fwd.host_port), timeout=2)
    sport, seq, their, _ = await guest_accept(guest, 7)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    rst = await guest.expect_tcp()
    assert rst.flags & RST and rst.sport == sport


async def test_stack_exit_closes_listeners_and_flows():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    async with Stack(NetworkConfig(dns_upstreams=[("127.0.0.1", 9)])) as stack:
        task = asyncio.ensure_future(stack.serve(SocketPairTransport(b)))
        await asyncio.sleep(0)
        guest = GuestEnd(a)
        fwd = await stack.add_forward(PortForward(host_port=0, guest_port=80))
        ufwd = await stack.add_forward(PortForward(proto="udp", host_port=0, guest_port=53))
        reader, writer = await host_connect(fwd.host_port)
        await guest_accept(guest, 80)
        stack.stop()
        await task
    a.close()
    with pytest.raises(ConnectionResetError):  # the forwarded connection was reset at exit
        await asyncio.wait_for(reader.read(), 2)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", fwd.host_port), timeout=2).close()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("127.0.0.1", ufwd.host_port))  # the UDP port is free again
    u.close()
    writer.close()


# ----------------------------------------------------------------------------- UDP


@pytest.mark.parametrize("stack_guest", [{}, {"disable_host_loopback": True}], indirect=True,
                         ids=["default", "disable_host_loopback"])
async def test_udp_forward_routes_replies_to_each_client(stack_guest):
    stack, guest = stack_guest
    fwd = await stack.add_forward(PortForward(proto="udp", host_port=0, guest_port=5353))
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for c in clients:
        c.setblocking(False)
    loop = asyncio.get_running_loop()
    clients[0].sendto(b"one", ("127.0.0.1", fwd.host_port))
    guest.answer_arp(await guest.expect(is_arp_request))
    u1 = (await guest.expect(lambda e: isinstance(e.data, dpkt.ip.IP) and e.data.p == 17)).data
    assert u1.src == GW4 and u1.dst == GUEST4 and u1.data.dport == 5353 and u1.data.data == b"one"
    big = bytes(range(256)) * 31 + b"x" * 64  # 8,000 bytes: fragmented both ways at MTU 1500
    clients[1].sendto(big, ("127.0.0.1", fwd.host_port))
    frags = []
    while sum(len(f.data) if isinstance(f.data, bytes) else len(bytes(f.data)) for f in frags) < 8008:
        e = await guest.expect(lambda e: isinstance(e.data, dpkt.ip.IP) and e.data.p == 17)
        frags.append(e.data)
    payload = b"".join(bytes(f.data) for f in sorted(frags, key=lambda f: f.offset))
    sport2 = int.from_bytes(payload[0:2], "big")
    assert payload[8:] == big and sport2 != u1.data.sport
    # the guest answers each client from its port; each reply reaches the right client
    guest.send(ip_frame(F4, dpkt.udp.UDP(sport=5353, dport=u1.data.sport, data=b"to one", ulen=8 + 6), 17))
    guest.send(ip_frame(F4, dpkt.udp.UDP(sport=5353, dport=sport2, data=b"to two", ulen=8 + 6), 17))
    r0 = await asyncio.wait_for(loop.sock_recv(clients[0], 100), 2)
    r1 = await asyncio.wait_for(loop.sock_recv(clients[1], 100), 2)
    assert (r0, r1) == (b"to one", b"to two")
    flows = [f for f in stack.parts.flows.values() if getattr(f, "direction", "") == "inbound"]
    assert len(flows) == 2
    stack.remove_forward(fwd.id)
    assert not [f for f in stack.parts.flows.values() if getattr(f, "direction", "") == "inbound"]
    for c in clients:
        c.close()


# ----------------------------------------------------------------------------- API handler (no socket)


async def test_api_handler_replies(stack_guest):
    stack, guest = stack_guest
    api = ApiServer(stack, "/nonexistent/never-bound.sock")

    async def call(obj) -> dict:
        raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        return json.loads(await api.handle(raw))

    r = await call({"execute": "add_hostfwd", "arguments": {"proto": "tcp", "host_addr": "127.0.0.1", "host_port": 0,
                                                             "guest_addr": "", "guest_port": 80}})
    assert r == {"error": {"desc": "bad request: add_hostfwd: bad arguments.host_port"}}
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    r = await call({"execute": "add_hostfwd", "arguments": {"proto": "tcp", "host_addr": "127.0.0.1",
                                                             "host_port": port, "guest_addr": "", "guest_port": 80}})
    assert r == {"return": {"id": 1}}
    entry = {"id": 1, "proto": "tcp", "host_addr": "127.0.0.1", "host_port": port, "guest_addr": "10.0.2.15",
             "guest_port": 80}
    assert await call({"execute": "list_hostfwd"}) == {"return": {"entries": [entry]}, "entries": [entry]}
    r = await call({"execute": "add_hostfwd", "arguments": {"proto": "tcp", "host_addr": "127.0.0.1",
                                                             "host_port": port, "guest_port": 81}})
    assert r["error"]["desc"].startswith("bad request: add_hostfwd: cannot listen on 127.0.0.1:")
    assert "Address already in use" in r["error"]["desc"]
    bad = {
        b"{not json": "bad request: cannot parse JSON",
        b"\xff\xfe": "bad request: cannot parse JSON",
        b"[" * 100000: "bad request: cannot parse JSON",
        b"[1,2]": "bad request: json_object() failed",
        b'{"x":1}': "bad request: no execute found",
        b'{"execute":5}': "bad request: no execute found",
        b'{"execute":"bogus"}': "bad request: unknown execute",
        b'{"execute":"add_hostfwd"}': "bad request: add_hostfwd: bad arguments.proto",
        b'{"execute":"add_hostfwd","arguments":[]}': "bad request: add_hostfwd: bad arguments.proto",
        b'{"execute":"add_hostfwd","arguments":{"proto":"udp","host_addr":"x","host_port":1,"guest_port":1}}':
            "bad request: add_hostfwd: bad arguments.host_addr",
        b'{"execute":"add_hostfwd","arguments":{"proto":"udp","host_port":true,"guest_port":1}}':
            "bad request: add_hostfwd: bad arguments.host_port",
        b'{"execute":"add_hostfwd","arguments":{"proto":"udp","host_port":1.5,"guest_port":1}}':
            "bad request: add_hostfwd: bad arguments.host_port",
        b'{"execute":"add_hostfwd","arguments":{"proto":"udp","host_port":12345,"guest_port":"80"}}':
            "bad request: add_hostfwd: bad arguments.guest_port",
        b'{"execute":"add_hostfwd","arguments":{"proto":"udp","host_port":12345,"guest_addr":"1.2.3","guest_port":80}}':
            "bad request: add_hostfwd: bad arguments.guest_addr",
        b'{"execute":"remove_hostfwd","arguments":{"id":99}}': "bad request: remove_hostfwd: bad arguments.id",
        b'{"execute":"remove_hostfwd"}': "bad request: remove_hostfwd: bad arguments.id",
    }
    for raw, desc in bad.items():
        assert await call(raw) == {"error": {"desc": desc}}, raw
    r = await call({"execute": "add_hostfwd", "arguments": {"proto": "udp", "host_port": 12345, "guest_port": 80,
                                                             "guest_addr": "192.0.2.1"}})
    assert r["error"]["desc"].startswith("bad request: add_hostfwd: bad arguments.guest_addr")
    assert await call({"execute": "remove_hostfwd", "arguments": {"id": 1}}) == {"return": {}}
    assert await call({"execute": "list_hostfwd"}) == {"return": {"entries": []}, "entries": []}
    stats = (await call({"execute": "get_stats"}))["return"]
    assert set(stats) >= {"frames", "bytes", "drops", "flows", "flows_total", "forwards", "counters"}
    assert stats["forwards"] == 0 and stats["frames"]["in"] == stack.counters["frames_in"]
    assert (await call({"execute": "list_flows"})) == {"return": {"flows": []}}


async def test_api_socket_of_a_live_server_is_not_taken_over(tmp_path):
    from aioslirp.frontends.api import ApiSocketError

    path = str(tmp_path / "api.sock")
    async with Stack(NetworkConfig()) as stack:
        first = ApiServer(stack, path)
        await first.start()
        try:
            second = ApiServer(stack, path)
            with pytest.raises(ApiSocketError, match="in use by another running server"):
                await second.start()
            # the first server still answers
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(b'{"execute": "list_hostfwd"}')
            await writer.drain()
            reply = json.loads(await reader.read(2048))
            writer.close()
            assert reply["entries"] == [] or reply["return"]["entries"] == []
        finally:
            await first.close()
        # a stale socket file (no server behind it) is replaced
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)
        stale.close()
        third = ApiServer(stack, path)
        await third.start()
        await third.close()
