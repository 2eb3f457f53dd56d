"""Sans-IO tests of the DHCPv4 server (RFC 2131/2132): fed payloads, a fake clock."""

from __future__ import annotations

import ipaddress
import random
import struct

import dpkt
import pytest

from aioslirp.config import NetworkConfig
from aioslirp.services.dhcp import DhcpServer, encode_search_list, reply_destination

from support.paths import SHARED
from support.prereqs import need

CORPUS = SHARED / "corpus" / "libslirp-fuzz"
MAC1 = bytes.fromhex("525400123456")
MAC2 = bytes.fromhex("525400abcdef")
IP = lambda s: int(ipaddress.IPv4Address(s))  # noqa: E731


def ip(s: str) -> bytes:
    return ipaddress.IPv4Address(s).packed


def make(mtype: int, mac: bytes = MAC1, *, xid: int = 0x1234, flags: int = 0, ciaddr: int = 0,
         opts: list[tuple[int, bytes]] = ()) -> bytes:
    msg = dpkt.dhcp.DHCP(op=1, xid=xid, flags=flags, ciaddr=ciaddr, chaddr=mac + bytes(10),
                         opts=[(53, bytes([mtype]))] + list(opts))
    return bytes(msg)


def parse(reply: bytes) -> tuple[dpkt.dhcp.DHCP, dict[int, bytes]]:
    msg = dpkt.dhcp.DHCP(reply)
    opts: dict[int, bytes] = {}
    for code, value in msg.opts:
        opts[code] = opts.get(code, b"") + value
    return msg, opts


@pytest.fixture
def server() -> DhcpServer:
    return DhcpServer(NetworkConfig(dns_search=["example.test", "corp.example.test"], lease_time=3600).validate())


def dora(server: DhcpServer, mac: bytes = MAC1, now: float = 0.0) -> str:
    offer, _ = server.handle(make(1, mac), mac, now)
    yi = dpkt.dhcp.DHCP(offer).yiaddr
    ack, _ = server.handle(make(3, mac, opts=[(50, struct.pack("!I", yi)), (54, ip("10.0.2.2"))]), mac, now)
    msg, opts = parse(ack)
    assert opts[53] == bytes([5])
    return str(ipaddress.IPv4Address(msg.yiaddr))


def test_discover_offer_options(server):
    reply, broadcast = server.handle(make(1, xid=0xCAFE), MAC1, 0.0)
    msg, opts = parse(reply)
    assert msg.op == 2 and msg.xid == 0xCAFE and msg.chaddr == MAC1
    assert msg.yiaddr == IP("10.0.2.15") and msg.ciaddr == 0 and msg.giaddr == 0
    assert opts[53] == bytes([2])
    assert opts[1] == ip("255.255.255.0")
    assert opts[3] == ip("10.0.2.2")
    assert opts[6] == ip("10.0.2.3")
    assert opts[54] == ip("10.0.2.2")
    assert opts[51] == struct.pack("!I", 3600)
    assert opts[58] == struct.pack("!I", 1800)
    assert opts[59] == struct.pack("!I", 3150)
    assert opts[26] == struct.pack("!H", 1500)
    assert opts[15] == b"example.test"
    # RFC 3397: second name compressed against the first one's "example.test" suffix (offset 0).
    assert opts[119] == b"\x07example\x04test\x00\x04corp\xc0\x00"
    assert len(reply) >= 300
    assert broadcast is False  # no broadcast flag: unicast to yiaddr / chaddr
    assert reply_destination(reply, broadcast) == "10.0.2.15"


def test_no_search_options_without_search_domains():
    srv = DhcpServer(NetworkConfig(mtu=65520).validate())
    _, opts = parse(srv.handle(make(1), MAC1, 0)[0])
    assert 15 not in opts and 119 not in opts
    assert opts[26] == struct.pack("!H", 65520)
    assert opts[51] == struct.pack("!I", 86400)


def test_search_list_encoding():
    assert encode_search_list(["eng.apple.com", "marketing.apple.com"]) == (
        b"\x03eng\x05apple\x03com\x00\x09marketing\xc0\x04")  # RFC 3397 section 3 example
    assert encode_search_list(["a..b", "x" * 64 + ".test", "ok."]) == b"\x02ok\x00"
    assert encode_search_list(["A.Test", "b.a.test"]) == b"\x01A\x04Test\x00\x01b\xc0\x00"


def test_request_ack_and_lease_stability(server):
    assert dora(server, MAC1) == "10.0.2.15"
    # Same MAC again (new DISCOVER, reboot): same address.
    assert dora(server, MAC1, now=10) == "10.0.2.15"
    assert dora(server, MAC2) == "10.0.2.16"
    assert dora(server, MAC1, now=20) == "10.0.2.15"
    assert server.lease_of(MAC2) == ipaddress.IPv4Address("10.0.2.16")


def test_offer_reserved_for_other_client(server):
    o1 = dpkt.dhcp.DHCP(server.handle(make(1, MAC1), MAC1, 0)[0])
    o2 = dpkt.dhcp.DHCP(server.handle(make(1, MAC2), MAC2, 0)[0])
    assert (o1.yiaddr, o2.yiaddr) == (IP("10.0.2.15"), IP("10.0.2.16"))


def test_ack_contents_and_renew_unicast(server):
    dora(server)
    # RENEWING (RFC 2131 4.3.2): ciaddr set, no server id / requested IP -> unicast ACK to ciaddr.
    reply, broadcast = server.handle(make(3, ciaddr=IP("10.0.2.15")), MAC1, 100)
    msg, opts = parse(reply)
    assert opts[53] == bytes([5]) and msg.yiaddr == IP("10.0.2.15") and msg.ciaddr == IP("10.0.2.15")
    assert opts[51] == struct.pack("!I", 3600)
    assert broadcast is False and reply_destination(reply, broadcast) == "10.0.2.15"


def test_nak_wrong_address(server):
    dora(server)
    for wanted in ("10.0.2.20", "192.168.1.5", "10.0.2.2"):
        reply, broadcast = server.handle(make(3, opts=[(50, ip(wanted))]), MAC1, 1)
        msg, opts = parse(reply)
        assert opts[53] == bytes([6]), wanted
        assert opts[54] == ip("10.0.2.2")
        assert msg.yiaddr == 0 and msg.ciaddr == 0
        assert broadcast is True  # RFC 2131 4.1: NAK always broadcast without relay
    # An unknown client asking for another client's address is NAKed too.
    dora(server, MAC2)
    reply, _ = server.handle(make(3, bytes(5) + b"\x09", opts=[(50, ip("10.0.2.16"))]), bytes(5) + b"\x09", 1)
    assert parse(reply)[1][53] == bytes([6])


def test_init_reboot_unknown_client_granted_when_free(server):
    # A client that remembers a lease from before a restart keeps it when it is free.
    reply, _ = server.handle(make(3, opts=[(50, ip("10.0.2.40"))]), MAC1, 0)
    msg, opts = parse(reply)
    assert opts[53] == bytes([5]) and msg.yiaddr == IP("10.0.2.40")
    assert dora(server, MAC1) == "10.0.2.40"


def test_request_for_other_server_ignored(server):
    server.handle(make(1), MAC1, 0)
    assert server.handle(make(3, opts=[(50, ip("10.0.2.15")), (54, ip("10.0.2.99"))]), MAC1, 0) is None
    assert server.dropped["other_server"] == 1


def test_broadcast_flag(server):
    reply, broadcast = server.handle(make(1, flags=0x8000), MAC1, 0)
    msg, _ = parse(reply)
    assert broadcast is True and msg.flags == 0x8000
    assert reply_destination(reply, broadcast) == "255.255.255.255"
    reply, broadcast = server.handle(make(3, flags=0x8000, opts=[(50, ip("10.0.2.15"))]), MAC1, 0)
    assert parse(reply)[1][53] == bytes([5]) and broadcast is True
    # ciaddr wins over the broadcast flag (RFC 2131 4.1).
    reply, broadcast = server.handle(make(3, flags=0x8000, ciaddr=IP("10.0.2.15")), MAC1, 0)
    assert broadcast is False


def test_inform(server):
    reply, broadcast = server.handle(make(8, ciaddr=IP("10.0.2.77")), MAC1, 0)
    msg, opts = parse(reply)
    assert opts[53] == bytes([5])
    assert msg.yiaddr == 0 and msg.ciaddr == IP("10.0.2.77")
    assert 51 not in opts and 58 not in opts and 59 not in opts  # RFC 2131 4.3.5: no lease
    assert opts[1] == ip("255.255.255.0") and opts[3] == ip("10.0.2.2") and opts[6] == ip("10.0.2.3")
    assert broadcast is False and reply_destination(reply, broadcast) == "10.0.2.77"
    assert server.lease_of(MAC1) is None  # no address allocated


def test_release_and_reuse(server):
    dora(server, MAC1)
    assert server.handle(make(7, ciaddr=IP("10.0.2.15")), MAC1, 5) is None
    assert server.dropped == {}
    # Released but still bound to the MAC: a new client gets the next address...
    assert dora(server, MAC2) == "10.0.2.16"
    # ... and the released client gets its old address back.
    assert dora(server, MAC1) == "10.0.2.15"
    # RELEASE of an address that is not the client's is ignored and counted.
    assert server.handle(make(7, ciaddr=IP("10.0.2.16")), MAC1, 5) is None
    assert server.dropped["release_unknown"] == 1


def test_decline_quarantines_address(server):
    dora(server, MAC1)
    assert server.handle(make(4, opts=[(50, ip("10.0.2.15")), (54, ip("10.0.2.2"))]), MAC1, 1) is None
    assert dora(server, MAC1, now=2) == "10.0.2.16"


def test_pool_exhaustion_and_reclaim():
    srv = DhcpServer(NetworkConfig(cidr="10.0.2.0/28", lease_time=100).validate())
    # /28: hosts .1-.14, guest defaults to .4, gateway .2, dns .3 -> pool .4-.14 (11 addresses).
    macs = [bytes([2, 0, 0, 0, 0, i]) for i in range(12)]
    got = [dora(srv, m, now=0) for m in macs[:11]]
    assert got[0] == "10.0.2.4" and got[-1] == "10.0.2.14"
    assert srv.handle(make(1, macs[11]), macs[11], 50) is None
    assert srv.dropped["pool_exhausted"] == 1
    # After the leases expired, the longest idle binding is reused.
    assert dora(srv, macs[11], now=200) == "10.0.2.4"


def test_option_overload(server):
    # Message type lives in the 'file' field (option 52 = 1).
    base = bytearray(make(1))
    opts_at = 240
    base[opts_at:] = bytes([52, 1, 1, 255])
    base[108:111] = bytes([53, 1, 1])
    base[111] = 255
    reply, _ = server.handle(bytes(base), MAC1, 0)
    assert parse(reply)[1][53] == bytes([2])
    # An overrun inside the overloaded field is dropped and counted.
    base[108:111] = bytes([53, 200, 1])
    assert server.handle(bytes(base), MAC1, 0) is None
    assert server.dropped["option_overrun"] == 1
    base[opts_at:] = bytes([52, 1, 7, 255])
    assert server.handle(bytes(base), MAC1, 0) is None
    assert server.dropped["bad_overload"] == 1


def test_long_client_max_size_and_split(server):
    # With many long search domains the reply exceeds 576 bytes: option 119 is split
    # (RFC 3396) when the client allows a large message, dropped when it does not.
    doms = [f"{'x' * 60}{i}.example.test" for i in range(8)]
    srv = DhcpServer(NetworkConfig(dns_search=doms).validate())
    reply, _ = srv.handle(make(1), MAC1, 0)
    opts = parse(reply)[1]
    assert 119 not in opts and opts[15] == doms[0].encode()
    assert len(reply) + 28 <= 576
    reply, _ = srv.handle(make(1, opts=[(57, struct.pack("!H", 1500))]), MAC1, 0)
    msg = dpkt.dhcp.DHCP(reply)
    assert [c for c, _ in msg.opts].count(119) >= 2
    assert parse(reply)[1][119] == encode_search_list(doms)


def test_client_id_echoed(server):
    reply, _ = server.handle(make(1, opts=[(61, b"\x01" + MAC1)]), MAC1, 0)
    assert parse(reply)[1][61] == b"\x01" + MAC1


@pytest.mark.parametrize(
    "payload,reason",
    [
        (b"", "truncated"),
        (b"\x01" * 100, "truncated"),
        (make(1)[:239], "truncated"),
        (make(1)[:236] + b"\0\0\0\0" + b"\x35\x01\x01\xff", "bad_magic"),
        (make(1)[:240] + b"\x35\x01\x01\x37\x20\x01", "option_overrun"),
        (make(1)[:240] + b"\x35", "option_overrun"),
        (make(1)[:240] + b"\x37\x02\x01\x03\xff", "no_msg_type"),
        (make(1)[:240] + b"\x35\x02\x01\x01\xff", "no_msg_type"),
        (make(2)[:], "unexpected_msg_type"),
        (b"\x02" + make(1)[1:], "not_request"),
        (make(3), "bad_request"),
        (make(3, opts=[(50, b"\x0a\x00")]), "bad_option"),
    ],
)
def test_malformed_inputs_dropped_and_counted(server, payload, reason):
    assert server.handle(payload, MAC1, 0) is None
    assert server.dropped == {reason: 1}


def test_random_garbage_never_raises(server):
    rng = random.Random(1234)
    valid = make(1, opts=[(55, bytes(range(1, 30))), (61, b"\x01" + MAC1), (52, b"\x03")])
    for _ in range(3000):
        if rng.random() < 0.3:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 400)))
        else:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            data = bytes(data[: rng.randrange(200, len(data) + 1)])
        result = server.handle(data, MAC1, rng.random() * 1000)
        assert result is None or (isinstance(result[0], bytes) and isinstance(result[1], bool))
    assert sum(server.dropped.values()) > 0
    assert "error" not in server.dropped


def test_replay_libslirp_corpus_discover(server):
    need(CORPUS.is_dir(), f"the shared corpus is not at {CORPUS}")
    frame = (CORPUS / "IN_dhcp" / "dhcp.pkt").read_bytes()
    payload = frame[14 + 20 + 8 :]
    src_mac = frame[6:12]
    reply, broadcast = server.handle(payload, src_mac, 0.0)
    msg, opts = parse(reply)
    assert opts[53] == bytes([2])
    assert msg.yiaddr == IP("10.0.2.15")
    assert msg.xid == struct.unpack_from("!I", payload, 4)[0]
    assert msg.chaddr == src_mac
    # The PXE client sets the broadcast flag.
    assert broadcast is bool(struct.unpack_from("!H", payload, 10)[0] & 0x8000)


def test_a_pool_of_one_hands_out_that_address_only():
    """``dhcp_pool_size=1`` (each guest's stack on a Switch): the guest's address, to its MAC; a
    second MAC gets no offer while that lease is active (it keeps the address when asking again)."""
    srv = DhcpServer(NetworkConfig(guest="10.0.2.20", dhcp_pool_size=1, lease_time=3600).validate())
    assert dora(srv, MAC1, 0.0) == "10.0.2.20"
    assert srv.handle(make(1, MAC2), MAC2, 10.0) is None
    assert dora(srv, MAC1, 20.0) == "10.0.2.20"
    with pytest.raises(Exception, match="dhcp_pool_size"):
        NetworkConfig(dhcp_pool_size=0).validate()
