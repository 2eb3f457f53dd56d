"""Sans-IO NDP responder (RFC 4861, RFC 4862, RFC 8106) and the libslirp IPv6 corpus replay.

Requests are built with dpkt (dpkt.ip6 / dpkt.icmp6 compute the checksums); answers are checked
field by field against the RFCs and their checksums against an independent reference.
"""

from __future__ import annotations

import ipaddress
import random
import struct

import dpkt
import pytest
from hypothesis import given, settings, strategies as st

from aioslirp.config.ipv6 import Ipv6Config
from aioslirp.dispatch.reassembly import Ipv6Reassembler
from aioslirp.services.dhcpv6 import Dhcpv6Server
from aioslirp.services.ndp import NdpResponder, parse_nd_options
from aioslirp.wire.ipv6 import Ipv6, l4_checksum_ok, parse_ipv6, solicited_node

from support.frames import (DNS6, GUEST6, GUEST_LL, GUEST_MAC, GW6, GW_LL, GW_MAC, UNSPEC, a6, checksum_valid,
                            icmp6_frame)
from support.paths import SHARED
from support.prereqs import need

ALL_NODES_MAC = bytes.fromhex("333300000001")
SLLA = bytes((1, 1)) + GUEST_MAC


def responder(**kw) -> NdpResponder:
    return NdpResponder(Ipv6Config(**kw).validate(), GW_MAC, rng=random.Random(7))


def feed(ndp: NdpResponder, frame: bytes, now: float = 100.0):
    ip = parse_ipv6(frame)
    assert isinstance(ip, Ipv6), ip
    return ndp.handle(frame, ip, frame[6:12], now)


def ns(target: bytes, src: bytes = GUEST_LL, dst: bytes | None = None, opts: bytes = SLLA, hlim: int = 255,
       code: int = 0) -> bytes:
    dst = solicited_node(target) if dst is None else dst
    return icmp6_frame(src, dst, 135, code, bytes(4) + target + opts, hlim=hlim)


def rs(src: bytes = GUEST_LL, opts: bytes = SLLA, hlim: int = 255) -> bytes:
    return icmp6_frame(src, a6("ff02::2"), 133, 0, bytes(4) + opts, hlim=hlim)


def decode(frame) -> tuple:
    """(eth dst, eth src, IPv6 src, dst, hop limit, ICMPv6 bytes) of an answer, checksum verified."""
    frame = bytes(frame)
    e = dpkt.ethernet.Ethernet(frame)
    assert e.type == 0x86DD
    ip = e.data
    assert ip.nxt == 58 and ip.plen == len(frame) - 54
    icmp = frame[54:]
    assert checksum_valid(ip.src, ip.dst, 58, icmp)
    return e.dst, e.src, ip.src, ip.dst, ip.hlim, icmp


# ------------------------------------------------------------------ Neighbor Solicitation
@pytest.mark.parametrize("target,router", [(GW6, True), (DNS6, False), (GW_LL, True)])
def test_ns_for_our_addresses_answered_with_na(target, router):
    ndp = responder()
    out = feed(ndp, ns(target))
    assert isinstance(out, list) and len(out) == 1
    edst, esrc, src, dst, hlim, icmp = decode(out[0])
    assert (edst, esrc, src, dst, hlim) == (GUEST_MAC, GW_MAC, target, GUEST_LL, 255)
    flags = (0x80 if router else 0) | 0x40 | 0x20  # R, S, O (RFC 4861 4.4, 7.2.4)
    assert icmp == bytes((136, 0)) + icmp[2:4] + bytes((flags, 0, 0, 0)) + target + bytes((2, 1)) + GW_MAC
    assert ndp.counters["na_sent"] == 1
    assert ndp.neighbors[GUEST_LL] == GUEST_MAC  # learned from the Source Link-Layer Address option


def test_unicast_nud_probe_without_sllao_answered_to_ethernet_source():
    ndp = responder()
    other_mac = bytes.fromhex("0a0000000001")
    f = icmp6_frame(GUEST6, GW6, 135, 0, bytes(4) + GW6, hlim=255, src_mac=other_mac)
    out = feed(ndp, f)
    edst, _, src, dst, _, icmp = decode(out[0])
    assert (edst, src, dst) == (other_mac, GW6, GUEST6) and icmp[4] == 0xE0


@pytest.mark.parametrize("tentative", [GUEST6, GUEST_LL, a6("fd00::4"), a6("fd00::1234:5678:9abc:def0"),
                                       a6("fd00::1"), a6("fe80::1")])
def test_dad_for_guest_addresses_never_answered(tentative):
    ndp = responder()
    # RFC 4862 5.4.2: DAD probe from ::, to the solicited-node group of the tentative address, no SLLAO
    out = feed(ndp, ns(tentative, src=UNSPEC, opts=b""))
    assert out == []
    assert ndp.counters["ns_dad_ignored"] == 1 and ndp.counters["na_sent"] == 0
    assert tentative not in ndp.neighbors and UNSPEC not in ndp.neighbors


@given(st.binary(min_size=16, max_size=16))
@settings(max_examples=300)
def test_dad_never_answered_for_any_address_but_ours(target):
    ndp = responder()
    out = feed(ndp, ns(target, src=UNSPEC, opts=b""))
    if target[0] == 0xFF:
        assert out == "ndp_multicast_target"
    elif target in (GW6, DNS6, GW_LL):
        assert len(out) == 1
    else:
        assert out == []


def test_dad_for_our_address_is_defended_to_all_nodes():
    ndp = responder()
    out = feed(ndp, ns(GW6, src=UNSPEC, opts=b""))
    edst, _, src, dst, hlim, icmp = decode(out[0])
    # RFC 4861 7.2.4: source unspecified -> multicast to all-nodes with S=0
    assert (edst, src, dst, hlim) == (ALL_NODES_MAC, GW6, a6("ff02::1"), 255)
    assert icmp[4] == 0x80 | 0x20 and icmp[8:24] == GW6 and icmp[24:32] == bytes((2, 1)) + GW_MAC
    assert ndp.counters["na_sent_dad"] == 1


def test_ns_for_other_target_from_guest_not_answered():
    ndp = responder()
    assert feed(ndp, ns(a6("fd00::99"), src=GUEST6)) == []
    assert ndp.counters["ns_other_target"] == 1


@pytest.mark.parametrize("frame,reason", [
    (ns(GW6, hlim=64), "ndp_bad_hop_limit"),
    (ns(GW6, code=1), "ndp_bad_code"),
    (ns(a6("ff02::1")), "ndp_multicast_target"),
    (ns(GW6, opts=bytes((1, 0)) + bytes(6)), "ndp_bad_option"),
    (ns(GW6, opts=bytes((1, 2)) + bytes(6)), "ndp_bad_option"),
    (ns(GW6, src=UNSPEC), "ndp_sllao_from_unspecified"),
    (ns(GW6, src=UNSPEC, dst=GW6, opts=b""), "ndp_ns_bad_dst"),
    (ns(GW6, dst=DNS6), "ndp_ns_bad_dst"),
    (ns(GW6, src=DNS6), "ndp_spoofed_src"),
    (icmp6_frame(GUEST_LL, a6("ff02::1:ff00:2"), 135, 0, bytes(4) + GW6[:12]), "ndp_truncated"),
    (icmp6_frame(GUEST_LL, a6("ff02::2"), 137, 0, bytes(36)), "ndp_redirect_from_guest"),
    (icmp6_frame(GUEST_LL, a6("ff02::1"), 134, 0, bytes(12)), "ndp_ra_from_guest"),
    (icmp6_frame(GUEST_LL, GW6, 128, 0, bytes(4)), "ndp_not_nd"),
])
def test_invalid_ndp_dropped_with_reason(frame, reason):
    ndp = responder()
    assert feed(ndp, frame) == reason
    assert not ndp.neighbors or reason == "ndp_ns_bad_dst"


def test_bad_checksum_dropped():
    f = bytearray(ns(GW6))
    f[56] ^= 0x55
    assert feed(responder(), bytes(f)) == "icmp6_bad_checksum"


# ------------------------------------------------------------------ Router Solicitation / Advertisement
EXPECTED_RA = (
    bytes((64, 0x40)) + struct.pack("!HII", 1800, 0, 0)                     # hop limit 64, M=0 O=1, 1800 s
    + bytes((1, 1)) + GW_MAC                                                  # Source Link-Layer Address
    + bytes((5, 1, 0, 0)) + struct.pack("!I", 1500)                          # MTU
    + bytes((3, 4, 64, 0xC0)) + struct.pack("!III", 86400, 14400, 0) + a6("fd00::")  # Prefix, L+A
    + bytes((25, 3, 0, 0)) + struct.pack("!I", 1800) + DNS6                  # RDNSS (RFC 8106)
)


def test_rs_answered_with_ra_exact_fields():
    ndp = responder()
    out = feed(ndp, rs())
    edst, esrc, src, dst, hlim, icmp = decode(out[0])
    assert (edst, esrc, src, dst, hlim) == (GUEST_MAC, GW_MAC, GW_LL, GUEST_LL, 255)
    assert icmp[:2] == bytes((134, 0)) and icmp[4:] == EXPECTED_RA
    assert ipaddress.IPv6Address(src).is_link_local  # RFC 4861 6.1.2: hosts drop RAs from non-link-local sources
    assert ndp.counters["ra_sent_solicited"] == 1
    opts = parse_nd_options(icmp, 16)
    assert set(opts) == {1, 3, 5, 25}


def test_ra_with_search_domains_and_without_dhcpv6():
    ndp = responder(dns_search=["example.com", "corp.example"], dhcpv6=False, mtu=9000, ra_interval=100,
                    router_lifetime=300)
    _, _, _, _, _, icmp = decode(feed(ndp, rs())[0])
    assert icmp[4:8] == bytes((64, 0)) + struct.pack("!H", 300)
    assert struct.unpack_from("!I", icmp, 16 + 8 + 4)[0] == 9000
    names = b"\x07example\x03com\x00\x04corp\x07example\x00"
    names += bytes(-len(names) % 8)
    dnssl = bytes((31, 1 + len(names) // 8, 0, 0)) + struct.pack("!I", 300) + names
    assert icmp.endswith(dnssl)
    rdnss = icmp[-len(dnssl) - 24:-len(dnssl)]
    assert rdnss == bytes((25, 3, 0, 0)) + struct.pack("!I", 300) + DNS6


def test_rs_from_unspecified_multicast_and_rate_limited():
    ndp = responder()
    out = feed(ndp, rs(src=UNSPEC, opts=b""), now=10.0)
    edst, _, src, dst, _, icmp = decode(out[0])
    assert (edst, src, dst) == (ALL_NODES_MAC, GW_LL, a6("ff02::1")) and icmp[4:] == EXPECTED_RA
    assert feed(ndp, rs(src=UNSPEC, opts=b""), now=11.0) == []
    assert ndp.counters["ra_rate_limited"] == 1
    assert len(feed(ndp, rs(src=UNSPEC, opts=b""), now=13.5)) == 1  # MIN_DELAY_BETWEEN_RAS = 3 s
    # a unicast answer is not rate limited
    assert len(feed(ndp, rs(), now=13.6)) == 1


@pytest.mark.parametrize("frame,reason", [
    (rs(hlim=254), "ndp_bad_hop_limit"),
    (rs(src=UNSPEC), "ndp_sllao_from_unspecified"),
    (rs(opts=bytes((1, 0))), "ndp_bad_option"),
    (rs(opts=bytes((1, 1)) + bytes(3)), "ndp_bad_option"),
])
def test_invalid_rs_dropped(frame, reason):
    assert feed(responder(), frame) == reason


def test_periodic_ra_and_schedule():
    ndp = responder()
    edst, _, src, dst, hlim, icmp = decode(ndp.periodic_ra(0.0))
    assert (edst, src, dst, hlim) == (ALL_NODES_MAC, GW_LL, a6("ff02::1"), 255) and icmp[4:] == EXPECTED_RA
    delays = []
    for i in range(20):
        delays.append(ndp.next_ra_delay())
        ndp.periodic_ra(float(i))
    # the first three unsolicited RAs (one sent above) come at most 16 s apart, then every [200, 600] s
    assert all(d <= 16.0 for d in delays[:2])
    assert all(200.0 <= d <= 600.0 for d in delays[2:])
    assert ndp.counters["ra_sent_unsolicited"] == 21


def test_final_ra_withdraws_router_and_prefix():
    _, _, _, _, _, icmp = decode(responder().final_ra())
    assert icmp[6:8] == b"\0\0"
    pio = icmp.find(bytes((3, 4, 64, 0xC0)))
    assert icmp[pio + 4:pio + 12] == bytes(8)


def test_solicit_builds_ns_for_guest_address():
    ndp = responder()
    edst, _, src, dst, hlim, icmp = decode(ndp.solicit(GUEST6))
    assert (edst, src, dst, hlim) == (bytes.fromhex("3333ff123456"), GW6, a6("ff02::1:ff12:3456"), 255)
    assert icmp[:2] == bytes((135, 0)) and icmp[4:8] == bytes(4) and icmp[8:24] == GUEST6
    assert icmp[24:] == bytes((1, 1)) + GW_MAC
    _, _, src, _, _, _ = decode(ndp.solicit(GUEST_LL))
    assert src == GW_LL


# ------------------------------------------------------------------ Neighbor Advertisements from the guest
def na(target, flags=0x20, dst=a6("ff02::1"), opts=None, src=GUEST6):
    opts = bytes((2, 1)) + GUEST_MAC if opts is None else opts
    return icmp6_frame(src, dst, 136, 0, bytes((flags, 0, 0, 0)) + target + opts)


def test_na_from_guest_learned_and_conflicts_counted():
    ndp = responder()
    assert feed(ndp, na(GUEST6)) == [] and ndp.neighbors[GUEST6] == GUEST_MAC
    assert feed(ndp, na(GW6)) == [] and ndp.counters["na_conflict"] == 1
    assert feed(ndp, na(GUEST6, flags=0x40)) == "ndp_na_solicited_multicast"


def test_neighbor_table_bounded():
    ndp = responder()
    for i in range(1100):
        feed(ndp, na(a6(f"fd00::1:{i:x}")))
    assert len(ndp.neighbors) == 1024 and a6("fd00::1:0") not in ndp.neighbors


def test_local_echo_to_gateway():
    ndp = responder()
    f = icmp6_frame(GUEST6, GW6, 128, 0, b"\x00\x2a\x00\x01abcdef", hlim=64)
    out = ndp.local_echo(f, parse_ipv6(f), GUEST_MAC)
    edst, _, src, dst, _, icmp = decode(out[0])
    assert (edst, src, dst) == (GUEST_MAC, GW6, GUEST6) and icmp[0] == 129 and icmp[4:] == b"\x00\x2a\x00\x01abcdef"
    f = icmp6_frame(GUEST6, a6("2001:db8::1"), 128, 0, b"\0\1\0\1", hlim=64)
    assert ndp.local_echo(f, parse_ipv6(f), GUEST_MAC) == "icmp6_echo_not_local"


@given(st.sampled_from([133, 134, 135, 136, 137]), st.binary(max_size=120),
       st.sampled_from([GUEST_LL, UNSPEC, GUEST6]), st.sampled_from([a6("ff02::1"), a6("ff02::1:ff00:2"), GW6]))
@settings(max_examples=400)
def test_random_ndp_never_raises(t, body, src, dst):
    ndp = responder()
    out = feed(ndp, icmp6_frame(src, dst, t, 0, body))
    assert isinstance(out, str) or (isinstance(out, list) and len(out) <= 1)


# ------------------------------------------------------------------ libslirp corpus replay
CORPUS = SHARED / "corpus" / "libslirp-fuzz"
FOLDERS = ("IN_icmp6", "IN_ndp", "IN_ip6-header", "IN_tcp6", "IN_udp6", "IN_tftp6")
SLIRP_MAC = bytes.fromhex("525600000002")  # the captures' gateway MAC


def corpus_ipv6_frames():
    """(file, Ethernet frame) of every IPv6 record; LINUX_SLL2 records get an Ethernet header."""
    out = []
    for folder in FOLDERS:
        for path in sorted((CORPUS / folder).glob("*.pcap")):
            with open(path, "rb") as fh:
                reader = dpkt.pcap.Reader(fh)
                link = reader.datalink()
                for _ts, buf in reader:
                    if link == 276:  # LINUX_SLL2: 20-byte header, protocol type first
                        if buf[:2] != b"\x86\xdd":
                            continue
                        buf = bytes(6) + GUEST_MAC + b"\x86\xdd" + buf[20:]
                    elif buf[12:14] != b"\x86\xdd":
                        continue
                    out.append((f"{folder}/{path.name}", bytes(buf)))
    return out


def fix_checksum(frame: bytes) -> bytes:
    e = dpkt.ethernet.Ethernet(frame)
    if isinstance(e.data, dpkt.ip6.IP6) and hasattr(e.data.data, "sum"):
        e.data.data.sum = 0
        return bytes(e)
    return frame


def test_corpus_ipv6_replay():
    need(CORPUS.is_dir(), f"the shared corpus is not at {CORPUS}")
    cfg = Ipv6Config(cidr6="fec0::/64").validate()
    ndp = NdpResponder(cfg, SLIRP_MAC, rng=random.Random(1))
    dhcp6 = Dhcpv6Server(cfg, SLIRP_MAC)
    reasm = Ipv6Reassembler()
    frames = corpus_ipv6_frames()
    assert len(frames) >= 60
    own = {cfg.gateway6_bytes, cfg.dns6_bytes}
    outcome = {"parsed": 0, "dropped": 0, "answered": 0}
    answers = {}
    for variant in ("raw", "fixed"):
        for name, frame in frames:
            if variant == "fixed":
                frame = fix_checksum(frame)
            ip = parse_ipv6(frame)
            if isinstance(ip, str):
                outcome["dropped"] += 1
                continue
            outcome["parsed"] += 1
            if ip.src in own:  # the stack's own replies kept in the capture (the harness skips them)
                continue
            assert ip.frag is None
            l4 = memoryview(frame)[ip.l4:ip.end]
            ok = l4_checksum_ok(ip.src, ip.dst, ip.proto, l4)
            if ip.proto == 58 and ok and 133 <= l4[0] <= 137:
                out = ndp.handle(frame, ip, frame[6:12], 0.0)
            elif ip.proto == 58 and ok and l4[0] == 128 and ip.dst in ndp.ours:
                out = ndp.local_echo(frame, ip, frame[6:12])
            elif ip.proto == 17 and ok and len(l4) >= 8 and l4[2:4] == b"\x02\x23":
                out = dhcp6.handle(l4[8:])
            else:
                out = "not_local" if ok else "bad_checksum"
            assert isinstance(out, (str, list, bytes))
            if isinstance(out, list) and out:
                outcome["answered"] += 1
                answers.setdefault((variant, name, bytes(l4[:1])), []).extend(bytes(f) for f in out)
    assert outcome["parsed"] + outcome["dropped"] == 2 * len(frames)
    assert outcome["dropped"] == 0  # every IPv6 header in the corpus is well formed
    # The NS for fec0::2 is answered byte for byte as libslirp answered it (IN_ndp/ndp.pcap frame 2).
    with open(CORPUS / "IN_ndp" / "ndp.pcap", "rb") as fh:
        want_na = [bytes(b) for _, b in dpkt.pcap.Reader(fh)][1]
    assert answers[("raw", "IN_ndp/ndp.pcap", b"\x87")] == [want_na]
    assert answers[("fixed", "IN_icmp6/ndp.pcap", b"\x87")] == [want_na]
    # The echo to fec0::2 gets libslirp's reply, except the hop limit (libslirp sends 255, we send 64).
    with open(CORPUS / "IN_icmp6" / "ping_10-0-2-2.pcap", "rb") as fh:
        want_echo = [bytes(b) for _, b in dpkt.pcap.Reader(fh)][1]
    got = answers[("raw", "IN_icmp6/ping_10-0-2-2.pcap", b"\x80")][0]
    assert got[:21] == want_echo[:21] and got[22:] == want_echo[22:] and got[21] == 64
