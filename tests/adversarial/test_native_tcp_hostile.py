"""Hostile guest frames against a flow the native TCP engine adopted (aioslirp/native/tcpnat.c), with
fake sockets: each is dropped and counted or answered as RFC 9293 / RFC 5961 say, never a crash, and
nothing the guest sends makes the engine hold more than its bounds (in flight at most 1 MiB
towards the guest whatever window the guest claims; no buffer of guest bytes at all).
Also run under ASan/UBSan (tests/adversarial/test_native_sanitized.py)."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest

from support.native_tcp import ACK, FIN, IRS, ISS, PSH, RST, SYN, EngineFlow

V = pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])


def M(n: int) -> int:
    return n & 0xFFFFFFFF


def mangle(frame: bytes, off: int, value: bytes) -> bytes:
    b = bytearray(frame)
    b[off:off + len(value)] = value
    return bytes(b)


@V
def test_bad_checksum_is_dropped_and_counted(v6):
    f = EngineFlow(v6).established()
    fr = bytearray(f.frame(ACK, data=b"payload"))
    fr[-1] ^= 0xFF
    assert f.e.input(bytes(fr), False, 0.0)  # the flow's frame: taken, dropped
    assert f.host_received() == b"" and f.out() == []
    assert f.e.counters()["bad_checksum"] == 1
    assert f.e.input(bytes(fr), True, 0.0)  # vouched for by the vnet header: not verified
    assert f.host_received() == b"payload"[:-1] + bytes([b"payload"[-1] ^ 0xFF])


@V
def test_bad_data_offsets_never_reach_the_engine(v6):
    f = EngineFlow(v6).established()
    l4 = 14 + (40 if v6 else 20)
    good = f.frame(ACK, data=b"x" * 30)
    for doff in (0, 1, 4, 15):  # below 5 words, or past the segment: the classifier drops it for Python to count
        bad = mangle(good, l4 + 12, bytes([doff << 4]))
        assert not f.e.input(bad, True, 0.0)
    for cut in range(0, len(good)):  # every truncation
        f.e.input(good[:cut], True, 0.0)
    assert f.host_received() == b"x" * 30 * 0  # no cut carries a whole, valid segment
    assert f.info()[0] == "ESTABLISHED"


@V
def test_a_huge_window_does_not_grow_what_is_in_flight_past_the_bound(v6):
    f = EngineFlow(v6, wscale=14).established()
    f.send(ACK, win=65535)  # 65535 << 14: about 1 GiB
    f.host_send(b"h" * (3 << 20))
    sent = sum(len(s.payload) for s in f.out())
    assert sent == 1 << 20  # TN_DISCARD: the in-flight bound
    assert f.e.fake_socket(f.fd)["unread"] == 3 << 20  # the rest waits in the (fake) kernel queue


@V
def test_syn_on_an_open_flow_gets_a_challenge_ack_only(v6):
    f = EngineFlow(v6).established()
    f.send(ACK, data=b"abc")
    f.out()
    assert f.send(SYN, seq=IRS + 5000, ack=0)
    (c,) = f.out()
    assert c.flags == ACK and c.ack == M(IRS + 4)
    assert f.info()[0] == "ESTABLISHED" and f.e.counters()["syn_on_open"] == 1


@V
def test_rst_with_a_bad_sequence_number_does_not_end_the_flow(v6):
    f = EngineFlow(v6).established()
    f.send(RST, seq=IRS + 100)  # in the window, not exact: challenge ACK (RFC 5961 3.2)
    (c,) = f.out()
    assert c.flags == ACK and c.ack == M(IRS + 1)
    f.send(RST, seq=IRS + 2**31)  # outside: dropped silently
    assert f.out() == []
    assert f.info()[0] == "ESTABLISHED" and f.e.counters()["rst_bad_seq"] == 2
    f.send(RST, seq=IRS + 1)
    assert f.info() is not None and f.info()[0] == "CLOSED"


@V
def test_a_flood_of_out_of_window_segments_is_counted_and_costs_nothing(v6):
    f = EngineFlow(v6).established()
    for i in range(5000):
        f.send(ACK, seq=IRS + 100000 + i * 1000, data=b"z" * 100)
    assert f.host_received() == b""
    assert f.e.counters()["out_of_window"] == 5000
    assert len(f.out()) == 5000  # one duplicate ACK each (one per batch of guest frames)
    f.send(ACK, data=b"ok")
    assert f.host_received() == b"ok"


@V
def test_an_ack_of_unsent_data_is_dropped(v6):
    f = EngineFlow(v6).established()
    f.send(ACK, ack=ISS + 10**6)
    assert f.e.counters()["bad_ack"] == 1
    assert f.info()[0] == "ESTABLISHED"
    f.send(ACK | PSH, data=b"still fine")
    assert f.host_received() == b"still fine"


@V
def test_segments_without_ack_or_before_the_connect_are_dropped(v6):
    import errno
    f = EngineFlow(v6, connect=errno.EINPROGRESS)
    f.send(ACK, data=b"early")  # nothing was sent to it yet
    f.send(PSH, data=b"no ack flag")
    assert f.e.counters()["bad_ack"] == 2 and f.info()[0] == "SYN-RECEIVED"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v6=st.booleans(), flags=st.integers(0, 0x3F), seq_off=st.integers(-2**31, 2**31 - 1),
       ack_off=st.integers(-2**31, 2**31 - 1), win=st.integers(0, 65535), data=st.binary(max_size=200),
       cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 255)), max_size=4))
def test_random_hostile_segments_keep_the_engine_sound(v6, flags, seq_off, ack_off, win, data, cut, flips):
    """Any segment (random flags, numbers, window; cut short; bytes flipped), checksum trusted or
    not: no crash; the host gets only in-order guest bytes; the flow's state is one of RFC 9293's."""
    f = EngineFlow(v6).established()
    f.send(ACK | PSH, data=b"head")
    f.host_send(b"tail" * 100)
    f.out()
    fr = bytearray(f.frame(flags, seq=IRS + 5 + seq_off, ack=ISS + 1 + ack_off, data=data, win=win))
    for pos, x in flips:
        if pos < len(fr):
            fr[pos] ^= x
    for csum_ok in (False, True):
        f.e.input(bytes(fr[:max(14, len(fr) - cut % 64)]), csum_ok, 0.1)
        f.e.input(bytes(fr), csum_ok, 0.2)
        f.poll(0.3)
    got = f.host_received()
    assert got == b"head" or got.startswith(b"head")  # in order after what was taken
    info = f.info()
    assert info is None or info[0] in ("ESTABLISHED", "CLOSE-WAIT", "CLOSED", "SYN-RECEIVED", "FIN-WAIT-1", "LAST-ACK")
    f.poll(100.0)  # every timer runs out: retransmissions give up, nothing loops
    assert f.e.live() <= 1
