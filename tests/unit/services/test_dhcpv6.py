"""Sans-IO stateless DHCPv6 server (RFC 8415): replies checked field by field; hostile input dropped."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from aioslirp.config.ipv6 import Ipv6Config
from aioslirp.services.dhcpv6 import Dhcpv6Server, duid_ll, encode_domain_list

from support.frames import DNS6, GW_MAC, a6

XID = b"\x12\x34\x56"
CLIENT_DUID = bytes.fromhex("00010001") + bytes.fromhex("2c5a7e10") + bytes.fromhex("525400123456")  # DUID-LLT
OUR_DUID = bytes.fromhex("00030001") + GW_MAC


def opt(code: int, data: bytes = b"") -> bytes:
    return struct.pack("!HH", code, len(data)) + data


def msg(mtype: int, *opts: bytes) -> bytes:
    return bytes((mtype,)) + XID + b"".join(opts)


def parse(reply: bytes) -> tuple[int, bytes, list]:
    """(type, xid, [(code, data)]) parsed independently of the server."""
    out, i = [], 4
    while i < len(reply):
        code, olen = struct.unpack_from("!HH", reply, i)
        out.append((code, reply[i + 4:i + 4 + olen]))
        i += 4 + olen
    assert i == len(reply)
    return reply[0], reply[1:4], out


def status(code: int, text: str) -> tuple:
    return (13, struct.pack("!H", code) + text.encode())


def server(**kw) -> Dhcpv6Server:
    return Dhcpv6Server(Ipv6Config(**kw).validate(), GW_MAC)


CID = opt(1, CLIENT_DUID)
SID = opt(2, OUR_DUID)
ORO = opt(6, struct.pack("!HHH", 23, 24, 32))
ELAPSED = opt(8, b"\x00\x00")
IA_NA = opt(3, struct.pack("!III", 0xDEADBEEF, 3600, 5400))
IA_PD = opt(25, struct.pack("!III", 7, 0, 0))
IA_NA_ADDR = opt(3, struct.pack("!III", 1, 0, 0) + opt(5, a6("fd00::5054:ff:fe12:3456") + struct.pack("!II", 0, 0)))
IA_NA_FOREIGN = opt(3, struct.pack("!III", 1, 0, 0) + opt(5, a6("2001:db8::5") + struct.pack("!II", 0, 0)))


def test_duid_and_domain_encoding():
    assert duid_ll(GW_MAC) == OUR_DUID
    assert encode_domain_list(["example.com", "a.b.", "bad..name", "x" * 64 + ".com"]) == \
        b"\x07example\x03com\x00\x01a\x01b\x00"


def test_information_request_reply_exact():
    s = server()
    reply = s.handle(msg(11, CID, ORO, ELAPSED))
    assert isinstance(reply, bytes)
    mtype, xid, opts = parse(reply)
    assert (mtype, xid) == (7, XID)
    assert opts == [(2, OUR_DUID), (1, CLIENT_DUID), (23, DNS6), (32, struct.pack("!I", 86400))]
    assert s.sent["reply"] == 1


def test_information_request_with_search_list_and_without_client_id():
    s = server(dns_search=["example.com", "corp.example"])
    mtype, _, opts = parse(s.handle(msg(11, ORO)))
    assert mtype == 7
    assert opts == [(2, OUR_DUID), (23, DNS6), (24, b"\x07example\x03com\x00\x04corp\x07example\x00"),
                    (32, struct.pack("!I", 86400))]
    # our own Server ID is accepted
    assert parse(server().handle(msg(11, CID, SID)))[0] == 7


def test_solicit_gets_advertise_no_addrs_avail():
    s = server()
    for extra in ((), (opt(14),)):  # with Rapid Commit: still an Advertise, no commitment
        mtype, xid, opts = parse(s.handle(msg(1, CID, IA_NA, ELAPSED, *extra)))
        assert (mtype, xid) == (2, XID)
        assert opts == [(2, OUR_DUID), (1, CLIENT_DUID), status(2, "addresses by SLAAC only"),
                        (82, struct.pack("!I", 3600))]
    assert s.sent["advertise"] == 2


def test_request_reply_every_ia_refused():
    _, _, opts = parse(server().handle(msg(3, CID, SID, IA_NA, IA_PD, ORO)))
    ia_na = (3, struct.pack("!III", 0xDEADBEEF, 0, 0) + opt(13, struct.pack("!H", 2) + b"no addresses: use SLAAC"))
    ia_pd = (25, struct.pack("!III", 7, 0, 0) + opt(13, struct.pack("!H", 6) + b"no prefixes"))
    assert opts == [(2, OUR_DUID), (1, CLIENT_DUID), ia_na, ia_pd, (23, DNS6)]


def test_request_via_unicast_gets_use_multicast():
    _, _, opts = parse(server().handle(msg(3, CID, SID, IA_NA), unicast=True))
    assert opts == [(2, OUR_DUID), (1, CLIENT_DUID), status(5, "use multicast")]


@pytest.mark.parametrize("mtype", [5, 6])
def test_renew_rebind_no_binding(mtype):
    ids = (CID, SID) if mtype == 5 else (CID,)
    _, _, opts = parse(server().handle(msg(mtype, *ids, IA_NA)))
    assert opts[-2] == (3, struct.pack("!III", 0xDEADBEEF, 0, 0) + opt(13, struct.pack("!H", 3) + b"no binding"))
    assert opts[-1] == (23, DNS6)


def test_confirm_on_link_and_not_on_link():
    assert parse(server().handle(msg(4, CID, IA_NA_ADDR)))[2][-1] == status(0, "on link")
    assert parse(server().handle(msg(4, CID, IA_NA_ADDR, IA_NA_FOREIGN)))[2][-1] == status(4, "not on link")
    assert server().handle(msg(4, CID, IA_NA)) == "confirm_no_addresses"


@pytest.mark.parametrize("mtype", [8, 9])
def test_release_decline_success(mtype):
    _, _, opts = parse(server().handle(msg(mtype, CID, SID, IA_NA)))
    assert opts[2] == status(0, "ok") and opts[3][0] == 3 and opts[3][1][:4] == b"\xde\xad\xbe\xef"


@pytest.mark.parametrize("payload,reason", [
    (b"\x0b\x00", "truncated"),
    (msg(12, CID), "relayed"),
    (msg(2, CID, SID), "not_client_msg"),
    (msg(7, CID, SID), "not_client_msg"),
    (msg(200), "unexpected_msg_type"),
    (msg(11, CID)[:-3], "option_overrun"),
    (msg(11, CID, b"\x00"), "option_overrun"),
    (msg(11, CID, CID), "duplicate_id"),
    (msg(11, opt(1, b"\x00")), "bad_duid"),
    (msg(11, opt(1, bytes(200))), "bad_duid"),
    (msg(11, CID, opt(2, duid_ll(bytes(6)))), "other_server"),
    (msg(11, CID, IA_NA), "unexpected_ia"),
    (msg(1, IA_NA), "no_client_id"),
    (msg(1, CID, SID, IA_NA), "unexpected_server_id"),
    (msg(3, CID, IA_NA), "no_server_id"),
    (msg(3, CID, SID, opt(3, b"\x00\x00")), "bad_ia"),
    (msg(3, CID, SID, opt(3, struct.pack("!III", 1, 0, 0) + b"\x00\x05\x00")), "option_overrun"),
    (msg(4, CID, opt(3, struct.pack("!III", 1, 0, 0) + opt(5, bytes(10)))), "bad_ia"),
])
def test_hostile_messages_dropped_with_reason(payload, reason):
    assert server().handle(payload) == reason


def test_unicast_solicit_dropped():
    assert server().handle(msg(1, CID, IA_NA), unicast=True) == "unicast_not_allowed"


@given(st.binary(max_size=300))
@settings(max_examples=500)
def test_random_payloads_never_raise(data):
    r = server().handle(data)
    assert isinstance(r, (bytes, str)) and r != "error"


@given(st.sampled_from([1, 3, 4, 5, 6, 8, 9, 11]), st.lists(st.sampled_from([CID, SID, ORO, ELAPSED, IA_NA, IA_PD,
                                                                           IA_NA_ADDR, opt(14)]), max_size=6),
       st.binary(max_size=8))
@settings(max_examples=500)
def test_structured_messages_never_raise_and_replies_parse(mtype, opts, tail):
    r = server().handle(msg(mtype, *opts) + tail)
    assert isinstance(r, (bytes, str)) and r != "error"
    if isinstance(r, bytes):
        rtype, xid, ropts = parse(r)
        assert rtype in (2, 7) and xid == XID and ropts[0] == (2, OUR_DUID)
