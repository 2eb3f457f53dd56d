"""aioslirp.Switch in process: guests over socket pairs on one network, each behind its own stack
(DHCP hands each its own address, ARP between guests crosses the switch, the gateway answers
every guest with one MAC, guests' names in the DNS, per-guest policy and counters, isolation,
bad arguments named, nothing left running after the switch closes)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import dpkt
import pytest

import aioslirp
from aioslirp import ConfigError, NetworkConfig, SocketPairTransport

from support.frames import GW_MAC, dns_query
from support.stacks import GuestEnd, fd_count, listener

MAC_A, MAC_B, MAC_C = (bytes.fromhex(f"5254000000{i:02x}") for i in (0x0A, 0x0B, 0x0C))
BCAST = b"\xff" * 6


def cfg(**kw) -> NetworkConfig:
    kw.setdefault("ipv6", False)
    kw.setdefault("dns_upstreams", [("127.0.0.1", 9)])
    kw.setdefault("dns_timeout", 0.3)
    return NetworkConfig(**kw)


def arp_request(mac: bytes, spa: str, tpa: str) -> bytes:
    arp = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REQUEST, sha=mac, spa=socket.inet_aton(spa), tha=bytes(6),
                       tpa=socket.inet_aton(tpa))
    return bytes(dpkt.ethernet.Ethernet(src=mac, dst=BCAST, type=0x0806, data=arp))


def udp_frame(mac: bytes, dst_mac: bytes, src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    udp = dpkt.udp.UDP(sport=sport, dport=dport, ulen=8 + len(payload), data=payload)
    ip = dpkt.ip.IP(src=socket.inet_aton(src), dst=socket.inet_aton(dst), p=17, ttl=64, data=udp)
    return bytes(dpkt.ethernet.Ethernet(src=mac, dst=dst_mac, type=0x0800, data=ip))


def discover(mac: bytes) -> bytes:
    msg = dpkt.dhcp.DHCP(op=1, xid=0x77, chaddr=mac + bytes(10), opts=[(53, b"\x01")])
    return udp_frame(mac, BCAST, "0.0.0.0", "255.255.255.255", 68, 67, bytes(msg))


def is_udp_from(port: int):
    return lambda e: isinstance(e.data, dpkt.ip.IP) and e.data.p == 17 and e.data.data.sport == port


async def guest_on(sw, stack) -> tuple[GuestEnd, asyncio.Task, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    task = asyncio.ensure_future(sw.serve(stack, SocketPairTransport(b)))
    await asyncio.sleep(0.05)
    return GuestEnd(a), task, a


async def test_two_guests_get_own_leases_see_one_gateway_and_reach_each_other():
    async with aioslirp.Switch(cfg()) as sw:
        sa = await sw.add_guest(MAC_A, name="alpha")
        sb = await sw.add_guest(MAC_B, name="beta")
        ga, ta, ka = await guest_on(sw, sa)
        gb, tb, kb = await guest_on(sw, sb)
        # DHCP: each stack offers its own guest's address
        ga.send(discover(MAC_A))
        offer_a = dpkt.dhcp.DHCP((await ga.expect(is_udp_from(67))).data.data.data)
        gb.send(discover(MAC_B))
        offer_b = dpkt.dhcp.DHCP((await gb.expect(is_udp_from(67))).data.data.data)
        assert (str(ipaddress.IPv4Address(offer_a.yiaddr)), str(ipaddress.IPv4Address(offer_b.yiaddr))) == \
            ("10.0.2.15", "10.0.2.16")
        assert sa.config.guest != sb.config.guest and sa.config.gateway == sb.config.gateway
        # the gateway answers each guest with the same MAC
        ga.send(arp_request(MAC_A, "10.0.2.15", "10.0.2.2"))
        gb.send(arp_request(MAC_B, "10.0.2.16", "10.0.2.2"))
        is_reply = lambda e: e.type == 0x0806 and e.data.op == dpkt.arp.ARP_OP_REPLY  # noqa: E731
        rep_a, rep_b = await ga.expect(is_reply), await gb.expect(is_reply)
        assert rep_a.data.sha == rep_b.data.sha == GW_MAC
        # A asks for B's address: B gets the request (broadcast), B's reply reaches A unicast
        ga.send(arp_request(MAC_A, "10.0.2.15", "10.0.2.16"))
        req = await gb.expect(lambda e: e.type == 0x0806 and e.data.tpa == socket.inet_aton("10.0.2.16"))
        assert req.src == MAC_A
        reply = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REPLY, sha=MAC_B, spa=socket.inet_aton("10.0.2.16"), tha=MAC_A,
                             tpa=socket.inet_aton("10.0.2.15"))
        gb.send(bytes(dpkt.ethernet.Ethernet(src=MAC_B, dst=MAC_A, type=0x0806, data=reply)))
        got = await ga.expect(lambda e: is_reply(e) and e.data.sha == MAC_B)
        assert got.dst == MAC_A
        # unicast UDP A -> B goes to B only, and not through either stack
        frames_in = sa.counters["frames_in"], sb.counters["frames_in"]
        ga.send(udp_frame(MAC_A, MAC_B, "10.0.2.15", "10.0.2.16", 4000, 5000, b"hello beta"))
        e = await gb.expect(lambda e: isinstance(e.data, dpkt.ip.IP) and e.data.p == 17 and e.data.data.dport == 5000)
        assert e.data.data.data == b"hello beta"
        await asyncio.sleep(0.05)
        assert (sa.counters["frames_in"], sb.counters["frames_in"]) == frames_in
        pa, pb = sw.port_of(sa), sw.port_of(sb)
        assert pa.counters["switched"] == 1 and pb.counters["frames_from_guests"] == 4  # 3 flooded + 1
        assert (pa.mac, pb.mac, str(pa.address), pa.name) == ("52:54:00:00:00:0a", "52:54:00:00:00:0b",
                                                              "10.0.2.15", "alpha")
        # names: A's stack answers beta.aioslirp.internal with B's address
        ga.send(udp_frame(MAC_A, GW_MAC, "10.0.2.15", "10.0.2.3", 5353, 53, dns_query("beta.aioslirp.internal")))
        ans = dpkt.dns.DNS((await ga.expect(is_udp_from(53))).data.data.data)
        assert [socket.inet_ntoa(rr.rdata) for rr in ans.an] == ["10.0.2.16"]
        ka.close()
        kb.close()
        await asyncio.wait_for(asyncio.gather(ta, tb), 5)


def dad_probe(mac: bytes, target: str) -> bytes:
    """The Neighbor Solicitation a guest sends from :: before it uses ``target`` (RFC 4862 5.4.2)."""
    t = ipaddress.IPv6Address(target)
    ns = dpkt.icmp6.ICMP6(type=135, code=0, data=bytes(4) + t.packed)
    dst = ipaddress.IPv6Address("ff02::1:ff00:0") + (int(t) & 0xFFFFFF)
    ip = dpkt.ip6.IP6(src=bytes(16), dst=dst.packed, nxt=58, hlim=255, plen=len(bytes(ns)), data=ns)
    return bytes(dpkt.ethernet.Ethernet(src=mac, dst=b"\x33\x33" + dst.packed[12:], type=0x86DD, data=ip))


async def test_a_guests_name_gets_aaaa_records_of_the_ipv6_address_it_probed():
    """B probes its stable-privacy address (DAD): A's stack answers AAAA beta with it; C, probing
    the same address, gets nothing; B leaving takes the record away."""
    async with aioslirp.Switch(cfg(ipv6=True)) as sw:
        sa = await sw.add_guest(MAC_A, name="alpha")
        sb = await sw.add_guest(MAC_B, name="beta")
        sc = await sw.add_guest(MAC_C, name="gamma")
        ga, ta, ka = await guest_on(sw, sa)
        gb, tb, kb = await guest_on(sw, sb)
        gc, tc, kc = await guest_on(sw, sc)
        addr = "fd00::8d3c:11f2:7a04:9e51"
        gb.send(dad_probe(MAC_B, addr))
        gc.send(dad_probe(MAC_C, addr))
        await asyncio.sleep(0.05)
        assert sw.port_of(sb).ipv6 == (ipaddress.IPv6Address(addr),) and sw.port_of(sc).ipv6 == ()

        async def aaaa(name: str) -> list:
            ga.send(udp_frame(MAC_A, GW_MAC, "10.0.2.15", "10.0.2.3", 5353, 53, dns_query(name, qtype=28)))
            ans = dpkt.dns.DNS((await ga.expect(is_udp_from(53))).data.data.data)
            return [str(ipaddress.IPv6Address(rr.rdata)) for rr in ans.an]

        assert await aaaa("beta.aioslirp.internal") == [addr]
        assert await aaaa("gamma.aioslirp.internal") == []
        assert sw.port_of(sb).info()["ipv6"] == [addr]
        kb.close()
        await asyncio.wait_for(tb, 5)
        assert await aaaa("beta.aioslirp.internal") == []
        ka.close()
        kc.close()
        await asyncio.wait_for(asyncio.gather(ta, tc), 5)


async def test_the_capture_records_every_frame_of_the_network_once():
    """Switch(capture=...): a broadcast flooded to two guests and the stack, a frame switched to one
    guest, the stack's ARP reply: each recorded once, in order, as sent."""

    class Capture:
        def __init__(self):
            self.frames = []

        def record(self, frames, loop=None):
            self.frames.extend(bytes(f) for f in frames)

    cap = Capture()
    async with aioslirp.Switch(cfg(), capture=cap) as sw:
        sa, sb, sc = [await sw.add_guest(mac) for mac in (MAC_A, MAC_B, MAC_C)]
        (ga, ta, ka), (gb, tb, kb), (gc, tc, kc) = [await guest_on(sw, s) for s in (sa, sb, sc)]
        ask_gw = arp_request(MAC_A, "10.0.2.15", "10.0.2.2")
        ga.send(ask_gw)
        reply = await ga.expect(lambda e: e.type == 0x0806 and e.data.op == dpkt.arp.ARP_OP_REPLY)
        to_b = udp_frame(MAC_A, MAC_B, "10.0.2.15", "10.0.2.16", 4000, 5000, b"to beta")
        ga.send(to_b)
        await gb.expect(lambda e: e.type == 0x0800)
        assert cap.frames == [ask_gw, bytes(reply), to_b]
        for k in (ka, kb, kc):
            k.close()
        await asyncio.wait_for(asyncio.gather(ta, tb, tc), 5)


async def test_each_guest_keeps_its_own_policy_and_counters():
    with listener() as srv:
        port = srv.getsockname()[1]
        async with aioslirp.Switch(cfg()) as sw:
            open_ = await sw.add_guest(MAC_A, name="open")
            shut = await sw.add_guest(MAC_B, name="shut", config=cfg(egress_default="deny"), labels={"team": "x"})
            assert shut.identity.labels == {"team": "x"} and shut.config.egress_default == "deny"
            assert open_.config.egress_default == "allow"
            ga, ta, ka = await guest_on(sw, open_)
            gb, tb, kb = await guest_on(sw, shut)
            for g, mac, me in ((ga, MAC_A, "10.0.2.15"), (gb, MAC_B, "10.0.2.16")):
                tcp = dpkt.tcp.TCP(sport=40000, dport=port, seq=1, flags=dpkt.tcp.TH_SYN, win=65535)
                ip = dpkt.ip.IP(src=socket.inet_aton(me), dst=socket.inet_aton("10.0.2.2"), p=6, ttl=64, data=tcp)
                g.send(bytes(dpkt.ethernet.Ethernet(src=mac, dst=GW_MAC, type=0x0800, data=ip)))
            syn_ack = await ga.expect_tcp()
            assert syn_ack.flags & dpkt.tcp.TH_SYN and syn_ack.flags & dpkt.tcp.TH_ACK
            denied = await gb.expect(lambda e: isinstance(e.data, dpkt.ip.IP) and e.data.p == 1)
            assert (denied.data.data.type, denied.data.data.code) == (3, 13)  # administratively prohibited
            assert shut.counters["drop.egress_denied"] == 1 and open_.counters["drop.egress_denied"] == 0
            assert open_.counters["flows.tcp.opened"] == 1 and shut.counters["flows.tcp.opened"] == 0
            ka.close()
            kb.close()
            await asyncio.wait_for(asyncio.gather(ta, tb), 5)


async def test_an_isolated_guest_reaches_only_its_stack_and_is_named_to_itself_only():
    async with aioslirp.Switch(cfg()) as sw:
        sa = await sw.add_guest(MAC_A, name="alpha")
        sc = await sw.add_guest(MAC_C, name="lonely", isolated=True)
        ga, ta, ka = await guest_on(sw, sa)
        gc, tc, kc = await guest_on(sw, sc)
        ga.send(arp_request(MAC_A, "10.0.2.15", "10.0.2.16"))
        gc.send(arp_request(MAC_C, "10.0.2.16", "10.0.2.15"))
        gc.send(udp_frame(MAC_C, MAC_A, "10.0.2.16", "10.0.2.15", 1, 2, b"x"))
        assert not [e for e in await gc.recv(0.3) if e.src != GW_MAC]  # nothing from A
        assert not [e for e in await ga.recv(0.3) if e.src != GW_MAC]  # nothing from C
        assert sw.port_of(sc).counters["drop.isolated"] == 1
        assert "lonely.aioslirp.internal" not in sa.config.dns_records
        assert "alpha.aioslirp.internal" not in sc.config.dns_records
        assert sc.config.dns_records["lonely.aioslirp.internal"] == (ipaddress.IPv4Address("10.0.2.16"),)
        # its stack still serves it: the gateway answers its ARP
        gc.send(arp_request(MAC_C, "10.0.2.16", "10.0.2.2"))
        rep = await gc.expect(lambda e: e.type == 0x0806 and e.data.op == dpkt.arp.ARP_OP_REPLY)
        assert rep.data.sha == GW_MAC
        ka.close()
        kc.close()
        await asyncio.wait_for(asyncio.gather(ta, tc), 5)


async def test_names_follow_guests_joining_and_leaving():
    async with aioslirp.Switch(cfg(), domain="vms.test") as sw:
        sa = await sw.add_guest(name="a")
        assert set(sa.config.dns_records) == {"host.aioslirp.internal", "a.vms.test"}
        sb = await sw.add_guest(name="b", address="10.0.2.40")
        assert sa.config.dns_records["b.vms.test"] == (ipaddress.IPv4Address("10.0.2.40"),)
        await sw.remove_guest(sb)
        assert "b.vms.test" not in sa.config.dns_records
        assert [p.name for p in sw.ports()] == ["a"]
        assert str((await sw.add_guest(name="b")).config.guest) == "10.0.2.16"


async def test_bad_arguments_are_one_line_naming_the_field():
    async with aioslirp.Switch(cfg()) as sw:
        await sw.add_guest(MAC_A, name="a")
        for kwargs, field in (({"mac": "nonsense"}, "mac"), ({"mac": "01:00:5e:00:00:01"}, "mac"),
                              ({"mac": MAC_A}, "mac"), ({"mac": "52:55:0a:00:02:02"}, "mac"),
                              ({"name": "a"}, "name"), ({"name": "a.b"}, "name"), ({"name": "a b"}, "name"),
                              ({"address": "10.0.3.1"}, "address"), ({"address": "10.0.2.2"}, "address"),
                              ({"address": "10.0.2.15"}, "address"),
                              ({"config": cfg(cidr="10.9.0.0/24")}, "cidr"), ({"config": cfg(mtu=9000)}, "mtu")):
            with pytest.raises(ConfigError) as exc:
                await sw.add_guest(**kwargs)
            assert exc.value.field == field and "\n" not in str(exc.value), kwargs
        assert len(sw.ports()) == 1
    with pytest.raises(ConfigError, match="max_macs_per_guest"):
        aioslirp.Switch(max_macs_per_guest=0)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ConfigError) as exc:
            aioslirp.Switch(max_ipv6_per_guest=bad)
        assert exc.value.field == "max_ipv6_per_guest"
    with pytest.raises(RuntimeError, match="async with"):
        await aioslirp.Switch().add_guest()


async def test_a_vnet_header_tap_is_refused_as_a_port():
    class VnetTap(SocketPairTransport):
        vnet_hdr = True

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a:
        async with aioslirp.Switch(cfg()) as sw:
            s = await sw.add_guest()
            with pytest.raises(ConfigError, match="virtio-net header"):
                await sw.serve(s, VnetTap(b))


async def test_nothing_is_left_running_after_the_switch_exits():
    before_fds = fd_count()
    before_tasks = {t for t in asyncio.all_tasks() if not t.done()}
    keep = []
    async with aioslirp.Switch(cfg()) as sw:
        tasks = []
        for mac in (MAC_A, MAC_B, MAC_C):
            s = await sw.add_guest(mac)
            g, t, k = await guest_on(sw, s)
            keep.append(k)
            tasks.append(t)
            g.send(arp_request(mac, "10.0.2.99", "10.0.2.2"))
        await asyncio.sleep(0.1)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)  # every serve() returned
    for k in keep:
        assert k.recv(70000, socket.MSG_DONTWAIT) is not None  # drained or EOF: the switch closed its end
        k.close()
    await asyncio.sleep(0.05)
    assert {t for t in asyncio.all_tasks() if not t.done()} - before_tasks == {asyncio.current_task()} - before_tasks
    assert fd_count() <= before_fds
