"""The shared switch's layer 2, sans-IO (aioslirp.switch.l2): MAC learning, where each frame goes
(the sender's stack, one guest, every guest), isolation, the MAC table's bound, spoofing."""

from __future__ import annotations

from aioslirp.switch.l2 import L2, MacTable

GW = bytes.fromhex("52550a000202")
A, B, C = (bytes.fromhex(f"5254000000{i:02x}") for i in (0x0A, 0x0B, 0x0C))
BCAST = b"\xff" * 6
ND_MCAST = bytes.fromhex("3333ff000001")  # a solicited-node multicast MAC (IPv6 ND)


def eth(dst: bytes, src: bytes, payload: bytes = b"x" * 50) -> bytes:
    return dst + src + b"\x08\x00" + payload


def three(**iso) -> L2:
    l2 = L2(GW, max_macs=4, mac_age=300.0)
    for port, mac in ((1, A), (2, B), (3, C)):
        l2.add_port(port, isolated=iso.get(f"p{port}", False), mac=mac, ipv4=bytes([10, 0, 2, 14 + port]))
        l2.attach(port)
    return l2


def test_frames_to_the_gateway_go_to_the_senders_stack_only():
    l2 = three()
    f = eth(GW, A)
    stack, out = l2.forward(1, [f], 1.0)
    assert stack == [f] and out == {}
    assert l2.ports[1].counters["to_stack"] == 1


def test_broadcast_and_multicast_go_to_the_senders_stack_and_every_other_guest():
    l2 = three()
    arp, nd = eth(BCAST, A), eth(ND_MCAST, A)
    stack, out = l2.forward(1, [arp, nd], 1.0)
    assert stack == [arp, nd]
    assert out == {2: [arp, nd], 3: [arp, nd]}
    assert l2.ports[1].counters["flooded"] == 2 and l2.ports[2].counters["frames_from_guests"] == 2


def test_unicast_to_a_learned_guest_goes_to_that_guest_only():
    l2 = L2(GW)
    l2.add_port(1)  # MACs learned, not given
    l2.add_port(2)
    l2.attach(1)
    l2.attach(2)
    l2.forward(2, [eth(BCAST, B)], 1.0)  # B speaks: learned on port 2
    assert l2.table.owner(B, 1.0) == 2 and l2.ports[2].mac == B
    f = eth(B, A)
    stack, out = l2.forward(1, [f], 1.1)
    assert stack == [] and out == {2: [f]}
    assert l2.ports[1].counters["switched"] == 1 and l2.table.owner(A, 1.1) == 1


def test_unknown_unicast_is_flooded_to_the_guests_not_to_the_stack():
    l2 = three()
    f = eth(bytes.fromhex("5254000000ff"), A)
    stack, out = l2.forward(1, [f], 1.0)
    assert stack == [] and out == {2: [f], 3: [f]}
    assert l2.ports[1].counters["flooded_unknown"] == 1


def test_an_isolated_guest_reaches_only_its_stack_and_no_guest_reaches_it():
    l2 = three(p3=True)
    stack, out = l2.forward(3, [eth(BCAST, C), eth(A, C), eth(GW, C)], 1.0)
    assert len(stack) == 2 and out == {}  # the broadcast and the gateway frame: its own stack
    assert l2.ports[3].counters["drop.isolated"] == 1
    stack, out = l2.forward(1, [eth(BCAST, A), eth(C, A)], 1.0)
    assert out == {2: [eth(BCAST, A)]}  # not flooded to 3, and unicast to C dropped
    assert l2.ports[1].counters["drop.isolated"] == 1


def test_a_guest_spoofing_another_guests_mac_steals_nothing():
    l2 = three()
    # port 3 sends from A's MAC (pinned on port 1): dropped, A stays on port 1
    stack, out = l2.forward(3, [eth(BCAST, A), eth(B, A)], 1.0)
    assert stack == [] and out == {}
    assert l2.ports[3].counters["drop.mac_in_use"] == 2
    assert l2.table.owner(A, 1.0) == 1
    f = eth(A, B)
    assert l2.forward(2, [f], 1.0)[1] == {1: [f]}  # traffic for A still goes to port 1


def test_a_guest_claiming_another_guests_address_is_dropped():
    """Gratuitous ARP for another guest's address (ARP spoofing to steal its traffic) and IPv4
    from another guest's source address are dropped; the guest's own address passes."""
    import socket

    def arp(sha: bytes, spa: str, tpa: str) -> bytes:
        body = b"\x00\x01\x08\x00\x06\x04\x00\x02" + sha + socket.inet_aton(spa) + BCAST + socket.inet_aton(tpa)
        return BCAST + sha + b"\x08\x06" + body

    def ip4(src_mac: bytes, dst_mac: bytes, src: str, dst: str) -> bytes:
        hdr = b"\x45\x00\x00\x1c\x00\x00\x00\x00\x40\x11\x00\x00" + socket.inet_aton(src) + socket.inet_aton(dst)
        return dst_mac + src_mac + b"\x08\x00" + hdr + bytes(8)

    l2 = three()
    spoof = [arp(C, "10.0.2.16", "10.0.2.16"), ip4(C, A, "10.0.2.16", "10.0.2.15")]
    assert l2.forward(3, spoof, 1.0) == ([], {})
    c = l2.ports[3].counters
    assert (c["drop.arp_spoofed"], c["drop.ip_spoofed"]) == (1, 1)
    own = [arp(C, "10.0.2.17", "10.0.2.17"), ip4(C, A, "10.0.2.17", "10.0.2.15")]
    assert l2.forward(3, own, 1.0) == ([own[0]], {1: own, 2: [own[0]]})


def test_a_learned_mac_of_another_guest_is_held_until_it_ages():
    l2 = L2(GW, mac_age=10.0)
    for p in (1, 2):
        l2.add_port(p)
        l2.attach(p)
    extra = bytes.fromhex("0200000000aa")
    l2.forward(1, [eth(BCAST, A)], 0.0)  # A: port 1's own (pinned)
    l2.forward(1, [eth(BCAST, extra)], 0.0)  # a second MAC behind port 1: learned, ages
    l2.forward(2, [eth(BCAST, B)], 0.0)
    assert l2.forward(2, [eth(BCAST, extra)], 5.0) == ([], {})  # held by port 1
    assert l2.ports[2].counters["drop.mac_in_use"] == 1
    assert l2.forward(2, [eth(BCAST, A)], 500.0) == ([], {})  # a pinned MAC never ages
    l2.forward(2, [eth(BCAST, extra)], 11.0)  # aged: it may move
    assert l2.table.owner(extra, 11.0) == 2


def test_a_guest_flooding_macs_cannot_grow_the_table_past_its_bound():
    l2 = three()  # max_macs=4 per port
    frames = [eth(BCAST, bytes([2, 0, 0, i >> 8, i & 255, 1])) for i in range(5000)]
    stack, out = l2.forward(1, frames, 1.0)
    assert len(l2.table) <= 4 * 3
    assert len(l2.table.macs(1)) == 4  # A plus 3 learned
    assert l2.ports[1].counters["drop.mac_limit"] == 5000 - 3
    assert len(stack) == 3  # only the frames of admitted MACs went anywhere
    # the others are unharmed: their own MACs still switch
    f = eth(A, B)
    assert l2.forward(2, [f], 1.0)[1] == {1: [f]}


def test_bad_source_macs_are_dropped_and_counted():
    l2 = three()
    frames = [eth(BCAST, BCAST), eth(BCAST, bytes(6)), eth(A, GW), b"short"]
    assert l2.forward(2, frames, 1.0) == ([], {})
    c = l2.ports[2].counters
    assert (c["drop.bad_src_mac"], c["drop.gateway_mac"], c["drop.truncated"], c["frames_dropped"]) == (2, 1, 1, 4)
    assert c["frames_in"] == 4


def test_a_frame_to_the_senders_own_mac_is_dropped():
    l2 = three()
    assert l2.forward(1, [eth(A, A)], 1.0) == ([], {})
    assert l2.ports[1].counters["drop.to_self"] == 1


def test_a_port_that_left_gets_no_flood_and_its_learned_macs_go():
    l2 = three()
    extra = bytes.fromhex("0200000000bb")
    l2.forward(2, [eth(BCAST, extra)], 1.0)
    l2.attach(2, False)
    assert l2.table.owner(extra, 1.0) is None and l2.table.owner(B, 1.0) == 2  # the pinned MAC stays
    f = eth(BCAST, A)
    assert l2.forward(1, [f], 1.0)[1] == {3: [f]}
    assert l2.forward(1, [eth(B, A)], 1.0)[1] == {}
    assert l2.ports[1].counters["drop.not_attached"] == 1
    l2.remove_port(2)
    assert l2.table.owner(B, 1.0) is None and len(l2.table) == 2


def test_mac_table_pin_refuses_a_mac_another_port_holds():
    t = MacTable(max_macs=2, mac_age=5.0)
    assert t.pin(1, A, 0.0)
    assert not t.pin(2, A, 100.0)  # pinned: never ages
    assert t.learn(2, B, 0.0) is None
    assert not t.pin(1, B, 1.0)  # learned by 2 and fresh
    assert t.pin(1, B, 6.0)  # aged: moves
    assert t.owner(B, 100.0) == 1


def test_any_frames_are_switched_or_dropped_once_and_never_raise():
    """Hostile input (hypothesis): every frame has one outcome on its port, the table stays bounded."""
    from hypothesis import given, settings, strategies as st

    macs = st.sampled_from([A, B, C, GW, BCAST, ND_MCAST, bytes(6), bytes.fromhex("0200000000aa")]) | st.binary(
        min_size=6, max_size=6)
    frame = st.tuples(macs, macs, st.binary(max_size=20)).map(lambda t: t[0] + t[1] + t[2]) | st.binary(max_size=13)
    v6 = st.sampled_from([bytes(16), addr6(1), addr6(2), addr6(0x1000), GW6, eui64(A), eui64(B)]) | st.binary(
        min_size=16, max_size=16)
    frame = frame | st.tuples(macs, v6, st.sampled_from([135, 136, 1]), v6, st.integers(40, 78)).map(
        lambda t: nd(t[0], t[1], t[2], t[3])[: t[4]])  # ND and IPv6 frames, whole or cut short

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.tuples(st.integers(1, 3), st.lists(frame, max_size=20), st.floats(0, 1000)), max_size=8))
    def run(batches):
        l2 = three(p3=True)
        l2.prefix6, l2.max_ipv6 = PREFIX6, 2  # IPv6 learning on: the bound holds too
        for port, frames, now in batches:
            l2.forward(port, frames, now)
        for state in l2.ports.values():
            c = state.counters
            outcomes = c["to_stack"] + c["switched"] + c["flooded"] + c["flooded_unknown"] + c["frames_dropped"]
            assert c["frames_in"] == outcomes
        assert len(l2.table) <= 4 * 3
        assert all(len(state.ipv6) <= 2 for state in l2.ports.values())

    run()


# ------------------------------------------------------------------ IPv6 addresses (AAAA records)
PREFIX6 = bytes.fromhex("fd00000000000000")
GW6, DNS6 = PREFIX6 + (2).to_bytes(8, "big"), PREFIX6 + (3).to_bytes(8, "big")
ALL_NODES, SOLICITED = bytes.fromhex("333300000001"), bytes.fromhex("3333ff000001")


def addr6(iid: int) -> bytes:
    return PREFIX6 + iid.to_bytes(8, "big")


def eui64(mac: bytes) -> bytes:
    """The modified EUI-64 SLAAC address of ``mac`` in fd00::/64 (RFC 4291 2.5.1)."""
    return PREFIX6 + bytes((mac[0] ^ 2, mac[1], mac[2], 0xFF, 0xFE, mac[3], mac[4], mac[5]))


def ip6(src_mac: bytes, dst_mac: bytes, src: bytes, dst: bytes, nh: int = 17, payload: bytes = bytes(8)) -> bytes:
    hdr = b"\x60\x00\x00\x00" + len(payload).to_bytes(2, "big") + bytes((nh, 255)) + src + dst
    return dst_mac + src_mac + b"\x86\xdd" + hdr + payload


def nd(src_mac: bytes, src: bytes, icmp_type: int, target: bytes) -> bytes:
    """A Neighbor Solicitation (135) or Advertisement (136) for ``target`` (RFC 4861 4.3/4.4)."""
    body = bytes((icmp_type, 0, 0, 0)) + bytes(4) + target
    return ip6(src_mac, SOLICITED, src, bytes.fromhex("ff020000000000000000000001ff0001"), 58, body)


def three6(max_ipv6: int = 2) -> L2:
    l2 = L2(GW, max_macs=4, prefix6=PREFIX6, reserved6=(GW6, DNS6), max_ipv6=max_ipv6)
    for port, mac in ((1, A), (2, B), (3, C)):
        l2.add_port(port, mac=mac, ipv4=bytes([10, 0, 2, 14 + port]))
        l2.attach(port)
    return l2


def test_a_guests_ipv6_addresses_are_learned_from_its_dad_probes_and_source_addresses():
    l2 = three6()
    v = l2.ipv6_version
    stable = addr6(0x1234_5678_9ABC_DEF0)  # a stable-privacy address (RFC 7217): not from the MAC
    dad = nd(A, bytes(16), 135, stable)  # RFC 4862 5.4.2: from ::, before the address is used
    assert l2.forward(1, [dad], 1.0)[1] == {2: [dad], 3: [dad]}  # flooded: every guest's DAD sees it
    assert l2.ports[1].ipv6 == [stable] and l2.ipv6_version == v + 1
    other = addr6(0x42)
    l2.forward(1, [ip6(A, GW, other, bytes.fromhex("20010db8" + "00" * 12))], 1.1)
    assert l2.ports[1].ipv6 == [stable, other] and l2.ports[1].counters["ipv6_learned"] == 2
    # outside the prefix, link-local, the reserved ones: never learned
    for src in (bytes.fromhex("fe80" + "00" * 6) + bytes(range(8)), bytes.fromhex("20010db8" + "00" * 11 + "01"),
                GW6, PREFIX6 + bytes(8)):
        l2.forward(2, [nd(B, bytes(16), 135, src), ip6(B, GW, src, GW6)], 2.0)
    assert l2.ports[2].ipv6 == []


def test_at_most_max_ipv6_addresses_per_guest_the_first_ones():
    l2 = three6(max_ipv6=2)
    frames = [ip6(A, GW, addr6(i), GW6) for i in range(0x100, 0x140)]
    stack, _ = l2.forward(1, frames, 1.0)
    assert len(stack) == 64  # used, not dropped
    assert l2.ports[1].ipv6 == [addr6(0x100), addr6(0x101)]
    assert l2.ports[1].counters["ipv6_not_learned"] == 62


def test_no_guest_claims_another_guests_ipv6_address():
    """Its source address, a Neighbor Advertisement for it (ND spoofing) are dropped; a DAD probe
    for it goes through unlearned (the holder's kernel defends it); a squatter cannot take the
    EUI-64 address of another guest's MAC before that guest probes it."""
    l2 = three6()
    a_addr = addr6(0xA)
    l2.forward(1, [nd(A, bytes(16), 135, a_addr)], 1.0)
    spoof = [ip6(C, B, a_addr, addr6(0xB)), nd(C, addr6(0xC), 136, a_addr)]
    assert l2.forward(3, spoof, 1.1) == ([], {})
    c = l2.ports[3].counters
    assert (c["drop.ip6_spoofed"], c["drop.nd_spoofed"]) == (1, 1)
    probe = nd(C, bytes(16), 135, a_addr)
    assert l2.forward(3, [probe], 1.2)[1] == {1: [probe], 2: [probe]}
    assert l2.ports[3].ipv6 == [] and l2.ports[1].ipv6 == [a_addr]
    # B's EUI-64 address: C may not take it, B may
    l2.forward(3, [nd(C, bytes(16), 135, eui64(B)), ip6(C, GW, eui64(B), GW6)], 1.3)
    assert l2.ports[3].ipv6 == []
    l2.forward(2, [nd(B, bytes(16), 135, eui64(B))], 1.4)
    assert l2.ports[2].ipv6 == [eui64(B)]


def test_a_guest_that_leaves_frees_its_ipv6_addresses():
    l2 = three6()
    l2.forward(1, [nd(A, bytes(16), 135, addr6(0xA))], 1.0)
    v = l2.ipv6_version
    l2.attach(1, False)
    assert l2.ports[1].ipv6 == [] and l2.ipv6_version == v + 1
    l2.forward(2, [ip6(B, GW, addr6(0xA), GW6)], 2.0)
    assert l2.ports[2].ipv6 == [addr6(0xA)]
    l2.remove_port(2)
    l2.forward(3, [ip6(C, GW, addr6(0xA), GW6)], 3.0)
    assert l2.ports[3].ipv6 == [addr6(0xA)]
