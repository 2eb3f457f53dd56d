"""The Stack in this process: what one address family has and the other has not.

ARP for IPv4; for IPv6 the Router Advertisement when serving starts, NDP, DHCPv6, Packet
Too Big and the ``ipv6`` switch. Each test says why it runs for one family only; what both
families share is in tests/stack/test_dispatch_l4.py. Frames go in over a socketpair and what comes
back is decoded with dpkt, checksums verified independently.
"""

from __future__ import annotations

import struct

import dpkt
import pytest

from aioslirp import NetworkConfig

from support.frames import (DNS6, DNS_AAAA, F4, F6, GUEST6, GUEST_LL, GUEST_MAC, GW6, GW_LL, GW_MAC, a6, icmp6_frame,
                            icmp_of, udp6_frame)
from support.servers import DnsUpstream
from support.stacks import eth_to, ipv6_guest_mac, ipv6_path, ndp_neighbours, recv_frames, served_stack

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

SLLA = bytes((1, 1)) + GUEST_MAC
ALL_DHCP = a6("ff02::1:2")


@pytest.fixture
async def s6():
    """(stack, guest socket, frames sent within 0.5 s of serving) of a Stack with IPv6 on."""
    dns = DnsUpstream(aaaa=DNS_AAAA)
    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", dns.port)], dns_timeout=1.0, tcp_connect_timeout=1.0)
    try:
        async with served_stack(cfg) as served:
            yield served
    finally:
        dns.close()


async def test_arp_request_for_gateway_answered(s6):
    """IPv4 only: ARP is IPv4's address resolution (IPv6's, NDP, is tested below)."""
    stack, guest, _ = s6
    arp = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REQUEST, sha=GUEST_MAC, spa=F4.guest, tha=b"\0" * 6, tpa=F4.gw)
    guest.send(bytes(dpkt.ethernet.Ethernet(src=GUEST_MAC, dst=b"\xff" * 6, type=0x0806, data=arp)))
    frames = await recv_frames(guest)
    arps = [dpkt.ethernet.Ethernet(f).data for f in frames if f[12:14] == b"\x08\x06"]
    assert arps and arps[0].op == dpkt.arp.ARP_OP_REPLY and arps[0].sha == GW_MAC and arps[0].spa == F4.gw


async def test_ra_when_serving_starts_and_ndp_through_the_stack(s6):
    """IPv6 only: Router Advertisements and NDP (RFC 4861) have no IPv4 counterpart."""
    stack, guest, first = s6
    (ra,) = icmp_of(F6, first, 134)
    e, ip, _m = ra
    assert (e.dst, e.src, ip.src, ip.dst, ip.hlim) == (bytes.fromhex("333300000001"), GW_MAC, GW_LL, a6("ff02::1"), 255)
    assert stack.counters["ndp.ra_sent_unsolicited"] == 1
    # Neighbor Solicitation for the gateway -> NA; Router Solicitation -> unicast RA
    ns = icmp6_frame(GUEST_LL, a6("ff02::1:ff00:2"), 135, 0, bytes(4) + GW6 + SLLA)
    rs = icmp6_frame(GUEST_LL, a6("ff02::2"), 133, 0, bytes(4) + SLLA)
    guest.send(ns)
    guest.send(rs)
    out = await recv_frames(guest)
    (na,) = icmp_of(F6, out, 136)
    assert (na[0].dst, na[1].src, na[1].dst) == (GUEST_MAC, GW6, GUEST_LL)
    assert na[2][8:24] == GW6 and na[2][4] == 0xE0  # R, S, O
    (ra2,) = icmp_of(F6, out, 134)
    assert (ra2[0].dst, ra2[1].dst) == (GUEST_MAC, GUEST_LL)
    assert stack.counters["ndp.na_sent"] == 1 and stack.counters["ndp.ra_sent_solicited"] == 1
    # DAD for the guest's own tentative address is never answered
    dad = icmp6_frame(bytes(16), a6("ff02::1:ff12:3456"), 135, 0, bytes(4) + GUEST6)
    guest.send(dad)
    assert await recv_frames(guest, 0.3) == []
    assert stack.counters["ndp.ns_dad_ignored"] == 1
    assert ndp_neighbours(stack)[GUEST_LL] == GUEST_MAC


async def test_dhcpv6_information_request_answered_from_link_local(s6):
    """IPv6 only: DHCPv6 (RFC 8415); DHCPv4 through the Stack is tested in tests/unit/services/test_dhcp.py."""
    stack, guest, _ = s6
    duid = bytes.fromhex("000300015254001234560000")[:10]
    msg = bytes((11,)) + b"\x01\x02\x03" + struct.pack("!HH", 1, len(duid)) + duid + struct.pack("!HHH", 6, 2, 23)
    guest.send(udp6_frame(GUEST_LL, ALL_DHCP, 546, 547, msg, dst_mac=bytes.fromhex("333300010002")))
    (f,) = await recv_frames(guest)
    e, ip = F6.decode(f)
    assert (e.dst, ip.src, ip.dst, ip.data.sport, ip.data.dport) == (GUEST_MAC, GW_LL, GUEST_LL, 547, 546)
    reply = ip.data.data
    assert reply[0] == 7 and reply[1:4] == b"\x01\x02\x03"
    assert struct.pack("!HH", 23, 16) + DNS6 in reply
    assert stack.counters["dhcpv6_replies"] == 1


async def test_packet_too_big_for_datagram_above_mtu():
    """IPv6 only: IPv6 routers never fragment (RFC 8200 5) and answer Packet Too Big (RFC 4443 3.2)."""
    async with served_stack(NetworkConfig(mtu=1280, dns_upstreams=[("127.0.0.1", 9)]), settle=0.3) as (stack, a, _f):
        a.send(udp6_frame(GUEST6, a6("2001:db8::77"), 44000, 9, bytes(1400)))
        (ptb,) = icmp_of(F6, await recv_frames(a), 2)
        _e, ip, msg = ptb
        assert ip.src == GW6 and ip.dst == GUEST6
        assert struct.unpack_from("!I", msg, 4)[0] == 1280
        assert len(bytes(ip)) <= 1280
        assert stack.counters["drop.ipv6_too_big"] == 1


async def test_ipv6_off_drops_and_sends_no_ra():
    """IPv6 only: the ``ipv6`` switch; IPv4 cannot be switched off."""
    async with served_stack(NetworkConfig(ipv6=False, mtu=1000), settle=0) as (stack, a, first):
        assert ipv6_path(stack) is None
        a.send(icmp6_frame(GUEST_LL, a6("ff02::2"), 133, 0, bytes(4) + SLLA))
        assert first + await recv_frames(a, 0.3) == []
        assert stack.counters["drop.ipv6_disabled"] == 1


async def test_unknown_neighbour_solicited_and_reset_forgets(s6):
    """IPv6 only: the stack solicits unknown IPv6 neighbours (RFC 4861 7.2.2); for IPv4 it
    learns MACs from the guest's frames and sends to broadcast before, never asking."""
    stack, guest, _ = s6
    other = a6("fd00::abcd")
    hdr = eth_to(stack, other)
    assert hdr[:6] == bytes.fromhex("3333ff00abcd")  # no guest MAC yet: its solicited-node MAC
    assert eth_to(stack, other) == hdr  # a second look-up within a second sends no second NS
    (ns,) = icmp_of(F6, await recv_frames(guest), 135)
    assert ns[2][8:24] == other and ns[1].dst == a6("ff02::1:ff00:abcd")
    assert (ns[1].src, ns[1].hlim) == (GW6, 255)
    # once the guest spoke, its MAC is used for unknown addresses too, and learned for its own
    guest.send(icmp6_frame(GUEST6, GW6, 128, 0, struct.pack("!HH", 1, 1), hlim=64))
    await recv_frames(guest)
    assert eth_to(stack, GUEST6)[:6] == GUEST_MAC and eth_to(stack, a6("fd00::beef"))[:6] == GUEST_MAC
    stack.reset_flows()
    assert not ndp_neighbours(stack) and ipv6_guest_mac(stack) is None
