"""IPv6 wire layer (RFC 8200, RFC 4443): parsing, extension-header bounds, reassembly, checksums, builders.

Checksums are verified against :func:`support.frames.ref_checksum6` (a word-by-word RFC 1071
sum over the RFC 8200 8.1 pseudo-header) and against dpkt's own computation.
"""

from __future__ import annotations

import os
import struct

import dpkt
import pytest
from hypothesis import given, settings, strategies as st

from aioslirp.config.ipv6 import Ipv6Config
from aioslirp.dispatch.reassembly import Ipv6Reassembler
from aioslirp.errors import ConfigError
from aioslirp.ratelimit import TokenBucket
from aioslirp.wire.checksum import finish, partial
from aioslirp.wire.icmp import build_icmp6_error, build_icmp6_packet, echo_reply6, icmp6_error_allowed
from aioslirp.wire.ipv6 import (ALL_NODES, Ipv6, eth6, fragment6, l4_checksum_ok, link_local_from_mac, multicast_mac,
                                parse_ipv6, pseudo_sum6, solicited_node)
from aioslirp.wire.tcp import build_tcp
from aioslirp.wire.udp import build_udp

from support.frames import (DNS6, GUEST6, GUEST_LL, GUEST_MAC, GW6, GW_LL, GW_MAC, UNSPEC, a6, checksum_valid,
                            eth6_frame, icmp6_frame, raw6, ref_checksum6, udp6_frame)

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

REMOTE = a6("2001:db8::1")


# ------------------------------------------------------------------ addresses
def test_address_helpers():
    assert link_local_from_mac(GW_MAC) == GW_LL
    assert link_local_from_mac(bytes.fromhex("525400123456")) == GUEST_LL
    assert solicited_node(GW6) == a6("ff02::1:ff00:2")
    assert solicited_node(GUEST6) == a6("ff02::1:ff12:3456")
    assert multicast_mac(ALL_NODES) == bytes.fromhex("333300000001")
    assert multicast_mac(a6("ff02::1:ff12:3456")) == bytes.fromhex("3333ff123456")
    assert eth6(GUEST_MAC, GW_MAC) == GUEST_MAC + GW_MAC + b"\x86\xdd"


# ------------------------------------------------------------------ checksums and builders
@given(st.binary(max_size=2000), st.sampled_from([6, 17, 58]))
@settings(max_examples=200)
def test_pseudo_header_checksum_matches_reference(data, nh):
    # the checksum field sits at 16 (TCP), 6 (UDP) or 2 (ICMPv6): zero it, fill it, verify with the reference
    pos = {6: 16, 17: 6, 58: 2}[nh]
    msg = bytearray(data.ljust(pos + 2 + (12 if nh == 6 else 0), b"\x01"))
    msg[pos:pos + 2] = b"\0\0"
    csum = finish(pseudo_sum6(GUEST6, REMOTE, nh, len(msg)) + partial(msg))
    msg[pos:pos + 2] = struct.pack("!H", csum)
    assert checksum_valid(GUEST6, REMOTE, nh, bytes(msg))
    if not (nh == 17 and csum == 0):
        assert l4_checksum_ok(GUEST6, REMOTE, nh, memoryview(bytes(msg)))


def test_udp_zero_checksum_refused_over_ipv6():
    pkt = bytearray(build_udp(REMOTE, GUEST6, 53, 5353, b"abc"))
    pkt[46:48] = b"\0\0"
    assert not l4_checksum_ok(REMOTE, GUEST6, 17, memoryview(pkt)[40:])


def test_build_udp6_packet_fields_and_checksum():
    payload = os.urandom(777)
    pkt = bytes(build_udp(REMOTE, GUEST6, 53, 40000, payload))
    ip = dpkt.ip6.IP6(pkt)
    assert (ip.v, ip.plen, ip.nxt, ip.hlim, ip.src, ip.dst) == (6, 785, 17, 64, REMOTE, GUEST6)
    assert (ip.data.sport, ip.data.dport, ip.data.ulen, bytes(ip.data.data)) == (53, 40000, 785, payload)
    assert pkt[:4] == b"\x60\x00\x00\x00"
    assert checksum_valid(REMOTE, GUEST6, 17, pkt[40:])
    want = ip.data.sum
    ip.data.sum = 0
    assert dpkt.ip6.IP6(bytes(ip)).data.sum == want  # dpkt recomputes the same value


def test_build_tcp6_frame_mirrors_ipv4_signature():
    e = eth6(GUEST_MAC, GW_MAC)
    payload = os.urandom(1001)
    frame = bytes(build_tcp(e, REMOTE, GUEST6, 80, 40000, 0xFFFFFFF0, 12345, 0x18, 512, b"\x02\x04\x05\x8c", payload))
    assert frame[:14] == e and len(frame) == 14 + 40 + 24 + 1001
    ip = dpkt.ethernet.Ethernet(frame).data
    t = ip.data
    assert (ip.plen, ip.nxt, ip.hlim, ip.src, ip.dst) == (1025, 6, 64, REMOTE, GUEST6)
    assert (t.sport, t.dport, t.seq, t.ack, t.flags, t.win, t.off) == (80, 40000, 0xFFFFFFF0, 12345, 0x18, 512, 6)
    assert bytes(t.opts) == b"\x02\x04\x05\x8c" and bytes(t.data) == payload
    assert checksum_valid(REMOTE, GUEST6, 6, frame[54:])
    # odd option length is padded with zeros to 4 bytes
    f2 = bytes(build_tcp(e, REMOTE, GUEST6, 1, 2, 0, 0, 0x02, 100, b"\x01\x03\x03\x07"[:3]))
    assert f2[74:78] == b"\x01\x03\x03\x00" and checksum_valid(REMOTE, GUEST6, 6, f2[54:])


def test_build_icmp6_packet_checksum():
    pkt = bytes(build_icmp6_packet(GW6, GUEST6, 129, 0, b"\x12\x34\x00\x01hello!", hlim=255))
    assert pkt[6] == 58 and pkt[7] == 255 and pkt[40] == 129 and pkt[41] == 0
    assert checksum_valid(GW6, GUEST6, 58, pkt[40:])
    assert ref_checksum6(GW6, GUEST6, 58, pkt[40:]) == 0xFFFF


# ------------------------------------------------------------------ parsing
def test_parse_plain_udp_tcp_icmp6():
    f = udp6_frame(GUEST6, REMOTE, 5000, 53, b"query")
    ip = parse_ipv6(f)
    assert isinstance(ip, Ipv6)
    assert (ip.src, ip.dst, ip.proto, ip.hlim, ip.off, ip.l4, ip.end, ip.frag, ip.ext) == \
        (GUEST6, REMOTE, 17, 64, 14, 54, 54 + 13, None, 0)
    # Ethernet padding after the payload is ignored
    ip2 = parse_ipv6(f + bytes(20))
    assert ip2.end == ip.end
    f = icmp6_frame(GUEST6, GW6, 128, 0, b"\0\1\0\2data", hlim=64)
    assert parse_ipv6(f).proto == 58


@pytest.mark.parametrize("pkt,reason", [
    (raw6(GUEST6, GW6, 17, b"")[:39], "ipv6_truncated"),
    (b"\x40" + raw6(GUEST6, GW6, 17, bytes(8))[1:], "ipv6_bad_version"),
    (raw6(GUEST6, GW6, 17, bytes(8), plen=0), "ipv6_jumbogram"),
    (raw6(GUEST6, GW6, 17, bytes(8), plen=9), "ipv6_bad_length"),
    (raw6(a6("ff02::1"), GW6, 17, bytes(8)), "ipv6_bad_src"),
])
def test_parse_hostile_headers(pkt, reason):
    assert parse_ipv6(pkt, 0) == reason
    assert parse_ipv6(eth6_frame(pkt)) == reason


def ext(nh: int, body: bytes = b"") -> bytes:
    """An extension header (HbH/DstOpts/Routing) whose 6-byte+ body is padded to 8n bytes with PadN."""
    n = 2 + len(body)
    pad = -n % 8
    if pad == 1:
        body += b"\x00"
    elif pad:
        body += bytes((1, pad - 2)) + bytes(pad - 2)
    total = 2 + len(body)
    return bytes((nh, total // 8 - 1)) + body


def routing(nh: int, segleft: int) -> bytes:
    return bytes((nh, 2, 4, segleft)) + bytes(4) + a6("2001:db8::99")  # type 4 (SRH-like), one address


UDP8 = struct.pack("!HHHH", 1, 2, 8, 0)


def test_extension_chain_walked_to_upper_layer():
    body = ext(60, b"\x05\x02\x00\x00") + ext(43) + routing(17, 0) + UDP8  # HbH(RA) DstOpts Routing(SL=0) UDP
    ip = parse_ipv6(raw6(GUEST6, REMOTE, 0, body), 0)
    assert isinstance(ip, Ipv6)
    assert ip.proto == 17 and ip.ext == 3 and ip.l4 == 40 + 8 + 8 + 24 and ip.end == 40 + len(body)


def test_extension_chain_eight_allowed_nine_refused():
    def chain(k):
        body = b""
        for i in range(k):
            body += ext(60 if i < k - 1 else 17)
        return raw6(GUEST6, REMOTE, 60, body + UDP8)
    ok = parse_ipv6(chain(8), 0)
    assert isinstance(ok, Ipv6) and ok.ext == 8 and ok.proto == 17
    assert parse_ipv6(chain(9), 0) == "ipv6_ext_too_many"


@pytest.mark.parametrize("nh,body,reason", [
    (60, ext(0) + UDP8, "ipv6_hbh_not_first"),                           # HbH after DstOpts
    (60, bytes((17, 3)) + bytes(6), "ipv6_ext_truncated"),               # hdr len 32 bytes, 8 present
    (60, bytes((17, 0)), "ipv6_ext_truncated"),                          # fewer than 8 bytes
    (60, bytes((17, 0, 1, 5, 0, 0, 0, 0)) + UDP8, "ipv6_bad_option"),    # PadN length past the header
    (60, bytes((17, 0, 0, 0, 0, 0, 0, 5)) + UDP8, "ipv6_bad_option"),    # option type with no length byte
    (60, bytes((17, 0, 0x42, 4, 0, 0, 0, 0)) + UDP8, "ipv6_unknown_option"),  # action 01: discard
    (0, bytes((17, 0, 0xC2, 4, 0, 0, 0, 0)) + UDP8, "ipv6_jumbogram"),
    (43, routing(17, 1) + UDP8, "ipv6_routing_header"),
    (44, bytes((44, 0, 0, 0, 0, 0, 0, 1)) + bytes((17, 0, 0, 0, 0, 0, 0, 1)) + UDP8, "ipv6_multiple_fragment"),
    (44, bytes((60, 0, 0, 1, 0, 0, 0, 1)) + bytes((17, 4)) + bytes(6), "ipv6_frag_incomplete_chain"),
    (44, bytes((17, 0, 0, 1, 0, 0, 0, 1)) + bytes(13), "ipv6_bad_fragment"),  # M=1, 13 bytes
])
def test_extension_chain_hostile(nh, body, reason):
    assert parse_ipv6(raw6(GUEST6, REMOTE, nh, body), 0) == reason


def test_unknown_option_with_skip_action_is_ignored():
    body = bytes((17, 0, 0x1E, 4, 1, 2, 3, 4)) + UDP8  # type 0x1e: action 00 (skip)
    ip = parse_ipv6(raw6(GUEST6, REMOTE, 60, body), 0)
    assert isinstance(ip, Ipv6) and ip.proto == 17 and ip.l4 == 48


def test_no_next_header_and_empty_payload():
    ip = parse_ipv6(raw6(GUEST6, REMOTE, 59, b""), 0)
    assert isinstance(ip, Ipv6) and ip.proto == 59 and ip.l4 == ip.end == 40


@given(st.binary(max_size=300), st.sampled_from([0, 43, 44, 60, 6, 17, 58, 59, 51, 255]), st.integers(0, 400))
@settings(max_examples=500)
def test_parse_never_raises_and_stays_in_bounds(body, nh, plen):
    pkt = raw6(GUEST6, REMOTE, nh, body, plen=min(plen, 0xFFFF))
    r = parse_ipv6(pkt, 0)
    if isinstance(r, str):
        assert r.startswith("ipv6_")
    else:
        assert 40 <= r.l4 <= r.end <= len(pkt) and r.ext <= 8


# ------------------------------------------------------------------ fragmentation and reassembly
def test_fragment6_and_reassemble_round_trip_out_of_order():
    payload = os.urandom(5000)
    pkt = bytes(build_udp(REMOTE, GUEST6, 53, 5353, payload))
    frags = fragment6(pkt, 1280)
    assert len(frags) == 5 and all(len(f) <= 1280 for f in frags)
    parsed = [parse_ipv6(f, 0) for f in frags]
    assert all(isinstance(p, Ipv6) and p.frag is not None and p.proto == 17 for p in parsed)
    assert [p.frag[0] for p in parsed] == [0, 1232, 2464, 3696, 4928]
    assert [p.frag[1] for p in parsed] == [True] * 4 + [False]
    assert len({p.frag[2] for p in parsed}) == 1
    r = Ipv6Reassembler()
    order = [3, 0, 4, 2, 1]
    out = [r.add(frags[i], parsed[i], now=1.0) for i in order]
    assert out[:4] == [None] * 4
    assert out[4] == pkt and len(r) == 0
    assert fragment6(pkt, 9000) == [pkt]


def test_reassembly_overlap_discards_whole_datagram_rfc5722():
    pkt = bytes(build_udp(REMOTE, GUEST6, 53, 5353, os.urandom(3000)))
    frags = fragment6(pkt, 1280)
    p = [parse_ipv6(f, 0) for f in frags]
    r = Ipv6Reassembler()
    assert r.add(frags[0], p[0], 1.0) is None
    # an overlapping fragment: same ident, offset 8, different bytes
    hdr = bytearray(frags[1][:48])
    struct.pack_into("!H", hdr, 42, 8 | 1)
    struct.pack_into("!H", hdr, 4, 8 + 1224)
    evil = bytes(hdr) + os.urandom(1224)
    ev = parse_ipv6(evil, 0)
    assert r.add(evil, ev, 1.0) is None
    assert r.drops.get("frag_overlap") == 1 and len(r) == 0
    # the remaining legitimate fragments never complete the discarded datagram
    assert r.add(frags[1], p[1], 1.0) is None and r.add(frags[2], p[2], 1.0) is None


def test_reassembly_exact_duplicate_ignored_and_timeout():
    pkt = bytes(build_udp(REMOTE, GUEST6, 53, 5353, os.urandom(2000)))
    frags = fragment6(pkt, 1280)
    p = [parse_ipv6(f, 0) for f in frags]
    r = Ipv6Reassembler(timeout=15.0)
    assert r.add(frags[0], p[0], 1.0) is None
    assert r.add(frags[0], p[0], 1.0) is None
    assert r.drops == {"frag_duplicate": 1}
    assert r.add(frags[1], p[1], 2.0) == pkt
    r2 = Ipv6Reassembler(timeout=15.0)
    r2.add(frags[0], p[0], 1.0)
    assert r2.add(frags[1], p[1], 17.0) is None  # first fragment expired
    assert r2.drops.get("frag_timeout") == 1


def test_reassembly_keeps_unfragmentable_headers_and_patches_next_header():
    udp = bytes(build_udp(REMOTE, GUEST6, 1, 2, os.urandom(100)))[40:]
    hbh = ext(44, b"\x05\x02\x00\x00")
    f0 = raw6(REMOTE, GUEST6, 0, hbh + struct.pack("!BxHI", 17, 0 | 1, 77) + udp[:64])
    f1 = raw6(REMOTE, GUEST6, 0, hbh + struct.pack("!BxHI", 17, 64, 77) + udp[64:])
    r = Ipv6Reassembler()
    assert r.add(f0, parse_ipv6(f0, 0), 1.0) is None
    whole = r.add(f1, parse_ipv6(f1, 0), 1.0)
    ip = parse_ipv6(whole, 0)
    assert ip.frag is None and ip.proto == 17 and ip.ext == 1 and whole[40] == 17 and whole[6] == 0
    assert bytes(whole[ip.l4:ip.end]) == udp and struct.unpack_from("!H", whole, 4)[0] == 8 + len(udp)
    assert l4_checksum_ok(REMOTE, GUEST6, 17, memoryview(whole)[ip.l4:ip.end])


def test_atomic_fragment_processed_in_isolation_rfc6946():
    udp = bytes(build_udp(REMOTE, GUEST6, 1, 2, b"x" * 20))[40:]
    f = raw6(REMOTE, GUEST6, 44, struct.pack("!BxHI", 17, 0, 5) + udp)
    ip = parse_ipv6(f, 0)
    assert ip.frag == (0, False, 5)
    whole = Ipv6Reassembler().add(f, ip, 1.0)
    assert whole == raw6(REMOTE, GUEST6, 17, udp)


def test_fragmented_ndp_dropped_rfc6980():
    ns = bytes(dpkt.ethernet.Ethernet(icmp6_frame(GUEST6, GW6, 135, 0, bytes(4) + GW6)).data)
    icmp = ns[40:]
    f = raw6(GUEST6, GW6, 44, struct.pack("!BxHI", 58, 0, 9) + icmp, hlim=255)
    r = Ipv6Reassembler()
    assert r.add(f, parse_ipv6(f, 0), 1.0) is None
    assert r.drops == {"ndp_fragmented": 1}


def test_reassembly_bounded_datagrams():
    r = Ipv6Reassembler(max_datagrams=4)
    for ident in range(10):
        f = raw6(REMOTE, GUEST6, 44, struct.pack("!BxHI", 17, 1, ident) + bytes(8))
        assert r.add(f, parse_ipv6(f, 0), 1.0) is None
    assert len(r) == 4 and r.drops["frag_evicted"] == 6
    assert r.held == 4 * (8 + 40)  # the first fragments' headers live with their datagrams, bounded with them


# ------------------------------------------------------------------ ICMPv6 errors and echo
def test_dest_unreachable_quotes_as_much_as_fits_in_1280():
    orig = bytes(build_udp(GUEST6, REMOTE, 5000, 9, os.urandom(1400)))
    err = bytes(build_icmp6_error(1, 4, orig))
    assert len(err) == 1280
    ip = dpkt.ip6.IP6(err)
    assert (ip.src, ip.dst, ip.nxt, ip.plen) == (REMOTE, GUEST6, 58, 1240)
    assert err[40:44] == b"\x01\x04" + err[42:44] and err[44:48] == bytes(4)
    assert err[48:] == orig[:1232]
    assert checksum_valid(REMOTE, GUEST6, 58, err[40:])
    small = bytes(build_udp(GUEST6, REMOTE, 5000, 9, b"hi"))
    err2 = bytes(build_icmp6_error(1, 3, small, src=GW6))
    assert err2[48:] == small and err2[8:24] == GW6 and len(err2) == 48 + len(small)


def test_packet_too_big_carries_mtu():
    orig = bytes(build_udp(GUEST6, REMOTE, 5000, 9, bytes(2000)))
    err = bytes(build_icmp6_error(2, 0, orig, src=GW6, param=1500))
    assert err[40] == 2 and err[41] == 0 and struct.unpack_from("!I", err, 44)[0] == 1500
    assert checksum_valid(GW6, GUEST6, 58, err[40:])
    # PTB is allowed about multicast destinations (RFC 4443 2.4 (e.3))
    mc = bytes(build_udp(GUEST6, a6("ff0e::1"), 5000, 9, bytes(2000)))
    assert build_icmp6_error(2, 0, mc, src=GW6, param=1500) is not None
    assert build_icmp6_error(1, 4, mc) is None


def test_icmp6_errors_never_about_errors_or_unspecified_sources():
    err = bytes(build_icmp6_error(1, 4, bytes(build_udp(GUEST6, REMOTE, 1, 2, b"x"))))
    assert not icmp6_error_allowed(err, 1, 4)
    assert build_icmp6_error(1, 4, err) is None
    redirect = bytes(build_icmp6_packet(GUEST6, REMOTE, 137, 0, bytes(36)))
    assert build_icmp6_error(1, 0, redirect) is None
    echo = bytes(build_icmp6_packet(GUEST6, REMOTE, 128, 0, bytes(8)))
    assert build_icmp6_error(1, 0, echo) is not None
    assert build_icmp6_error(1, 0, bytes(build_udp(UNSPEC, REMOTE, 1, 2, b"x"))) is None
    assert build_icmp6_error(1, 0, bytes(build_udp(GUEST6, REMOTE, 1, 2, b"x")), link_multicast=True) is None
    assert build_icmp6_error(1, 0, b"short") is None


def test_echo_reply6():
    f = icmp6_frame(GUEST6, GW6, 128, 0, b"\xab\xcd\x00\x07" + b"ping-data", hlim=64)
    ip = parse_ipv6(f)
    reply = bytes(echo_reply6(f, ip))
    r = dpkt.ip6.IP6(reply)
    assert (r.src, r.dst, r.nxt, r.hlim) == (GW6, GUEST6, 58, 64)
    assert reply[40] == 129 and reply[41] == 0 and reply[44:] == b"\xab\xcd\x00\x07ping-data"
    assert checksum_valid(GW6, GUEST6, 58, reply[40:])
    bad = bytearray(f)
    bad[-1] ^= 0xFF
    assert echo_reply6(bytes(bad), parse_ipv6(bytes(bad))) == "icmp6_bad_checksum"
    mc = icmp6_frame(GUEST6, ALL_NODES, 128, 0, b"\0\1\0\1", hlim=64)
    assert echo_reply6(mc, parse_ipv6(mc)) == "icmp6_echo_multicast"
    assert echo_reply6(mc, parse_ipv6(mc), local=GW6)[8:24] == GW6
    f = icmp6_frame(GUEST6, GW6, 129, 0, b"\0\1\0\1", hlim=64)
    assert echo_reply6(f, parse_ipv6(f)) == "icmp6_not_echo"


def test_token_bucket():
    tb = TokenBucket(rate=10, burst=3)
    assert [tb.allow(0.0) for _ in range(4)] == [True, True, True, False]
    assert tb.allow(0.05) is False and tb.allow(0.15) is True


# ------------------------------------------------------------------ Ipv6Config
def test_config6_defaults_and_policy():
    c = Ipv6Config().validate()
    assert str(c.cidr6) == "fd00::/64" and str(c.gateway6) == "fd00::2" and str(c.dns6) == "fd00::3"
    assert c.gateway6_bytes == GW6 and c.dns6_bytes == DNS6 and c.rdnss_lifetime == 1800
    assert c.remote_for(GW6) == "::1" and c.remote_for(GW6, host_loopback=False) is None
    assert c.remote_for(DNS6) is None and c.remote_for(a6("fd00::99")) is None
    assert c.remote_for(a6("2001:db8::1")) == "2001:db8::1"
    for bad in ("ff02::1", "fe80::1", "::1", "::", "::ffff:10.0.2.2", "fec0::1", "::10.0.0.1"):
        assert c.remote_for(a6(bad)) is None, bad
    assert c.check_guest_source(GUEST6) is None and c.check_guest_source(GUEST_LL) is None
    assert c.check_guest_source(GW6) == "ipv6_spoofed_src" and c.check_guest_source(a6("fd00::")) == "ipv6_spoofed_src"
    assert c.check_guest_source(REMOTE) == "ipv6_bad_src"


@pytest.mark.parametrize("kw,field", [
    ({"cidr6": "fd00::/48"}, "cidr6"), ({"cidr6": "nonsense"}, "cidr6"), ({"cidr6": "ff00::/64"}, "cidr6"),
    ({"gateway6": "fd01::2"}, "gateway6"), ({"dns6": "fd00::2"}, "dns6"), ({"mtu": 576}, "mtu"),
    ({"router_lifetime": 10000}, "router_lifetime"), ({"ra_interval": 2}, "ra_interval"),
    ({"router_lifetime": 100}, "router_lifetime"), ({"preferred_lifetime": 10**6}, "preferred_lifetime"),
])
def test_config6_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError) as ei:
        Ipv6Config(**kw).validate()
    assert ei.value.field == field and "\n" not in str(ei.value)


def test_config6_from_network():
    from aioslirp.config import NetworkConfig
    c = Ipv6Config.from_network(NetworkConfig(mtu=9000, dns_search=["example.com"]).validate())
    assert c.mtu == 9000 and c.dns_search == ["example.com"]
