"""Delayed ACKs in the native TCP engine (aioslirp/native/tcpnat.c, ``ack_data``; RFC 9293 3.8.6.3,
RFC 1122 4.2.3.2), with fake sockets and a fake clock: with ``ack_delay`` (the stack passes
``NetworkConfig.tcp_ack_delay``, as the Python path's TcpConnection takes it) an ACK of the guest's
data or FIN waits that long for a frame of ours to carry it, so that a request and its reply cost
the guest one frame, not a bare ACK and then the reply (in a QEMU guest: 2 frames per round trip
before, docs/performance.md). Two full-sized segments, anything out of order, and the guest's FIN
after ours are acknowledged at once, as on the Python path (tests/unit/tcp/test_tcp_delack.py)."""

from __future__ import annotations

import pytest

from support.frames import GW_MAC
from support.native import need_extension
from support.native_tcp import ACK, FIN, IRS, ISS, PSH, EngineFlow, M

V = pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
DELACK = 0.0005


def mss_of(v6: bool) -> int:
    return 1500 - (60 if v6 else 40)


@V
def test_the_ack_of_a_request_rides_on_the_reply(v6):
    f = EngineFlow(v6, ack_delay=DELACK).established()
    assert f.send(ACK | PSH, data=b"hello")
    assert f.host_received() == b"hello"
    assert f.out() == []  # no bare ACK: it waits for the reply
    f.poll(f.now + DELACK / 5)
    f.host_send(b"world")
    (s,) = f.out()
    assert s.payload == b"world" and s.flags & ACK and s.ack == M(IRS + 6) and s.seq == M(ISS + 1)
    c = f.e.counters()
    assert (c["acks_carried"], c["acks_delayed"]) == (1, 0)
    assert f.send(ACK, seq=IRS + 6, ack=ISS + 6)  # the guest's ACK of the reply: nothing to answer
    f.poll(f.now + 0.1)  # the delay ran out long ago: nothing more was owed
    assert f.out() == []


@V
def test_without_a_reply_the_ack_goes_alone_when_the_delay_runs_out(v6):
    f = EngineFlow(v6, ack_delay=DELACK).established()
    t0 = f.now
    assert f.send(ACK | PSH, data=b"hello")
    f.poll(t0 + DELACK * 0.8)
    assert f.out() == []
    f.poll(t0 + DELACK * 1.2)
    (a,) = f.out()
    assert a.flags == ACK and a.payload == b"" and a.ack == M(IRS + 6)
    assert f.e.counters()["acks_delayed"] == 1
    f.poll(t0 + 1.0)
    assert f.out() == []  # once


@V
def test_every_second_full_sized_segment_is_acknowledged_at_once(v6):
    f = EngineFlow(v6, ack_delay=DELACK).established()
    mss = mss_of(v6)
    assert f.send(ACK, data=b"a" * mss)
    assert f.out() == []
    assert f.send(ACK, seq=IRS + 1 + mss, data=b"b" * mss)
    (a,) = f.out()
    assert a.flags == ACK and a.ack == M(IRS + 1 + 2 * mss)
    assert f.host_received() == b"a" * mss + b"b" * mss
    assert f.e.counters()["acks_delayed"] == 0


@V
def test_a_segment_out_of_order_is_answered_at_once(v6):
    f = EngineFlow(v6, ack_delay=DELACK).established()
    assert f.send(ACK, seq=IRS + 101, data=b"late")
    (a,) = f.out()  # the duplicate ACK the guest's fast retransmit counts (RFC 5681 4.2)
    assert a.flags == ACK and a.ack == M(IRS + 1)
    assert f.host_received() == b""


@V
def test_the_guest_fin_is_acknowledged_by_our_fin_when_the_host_closes_in_time(v6):
    f = EngineFlow(v6, ack_delay=DELACK).established()
    assert f.send(ACK | FIN)
    assert f.out() == []
    f.host_eof()
    (s,) = f.out()  # one frame: our FIN with the ACK of the guest's (not a bare ACK, then the FIN)
    assert s.flags == FIN | ACK and s.ack == M(IRS + 2) and s.seq == M(ISS + 1)
    assert f.e.counters()["acks_carried"] == 1


@V
def test_the_guest_fin_after_ours_is_acknowledged_at_once(v6):
    f = EngineFlow(v6, ack_delay=DELACK).established()
    f.host_eof()
    (fin,) = f.out()
    assert fin.flags & FIN
    assert f.send(ACK | FIN, ack=ISS + 2)
    (a,) = f.out()  # the last segment of the connection: nothing of ours is left to carry its ACK
    assert a.flags == ACK and a.ack == M(IRS + 2)


@V
def test_without_a_delay_every_ack_goes_at_the_end_of_the_call(v6):
    f = EngineFlow(v6).established()  # ack_delay 0: the engine's own default
    assert f.send(ACK | PSH, data=b"hello")
    (a,) = f.out()
    assert a.flags == ACK and a.ack == M(IRS + 6)
    c = f.e.counters()
    assert (c["acks_carried"], c["acks_delayed"]) == (0, 0)


def test_an_ack_delay_outside_0_to_half_a_second_is_refused():
    ext = need_extension()
    for bad in (-0.001, 0.51, float("nan")):
        with pytest.raises(ValueError, match="ack_delay must be 0..0.5 seconds"):
            ext.TcpEngine(-1, False, False, GW_MAC, 1500, 4, 1 << 20, 60.0, 10.0, 1.0, fake=True, ack_delay=bad)
    ext.TcpEngine(-1, False, False, GW_MAC, 1500, 4, 1 << 20, 60.0, 10.0, 1.0, fake=True, ack_delay=0.5).close()


def test_from_16_kib_unacknowledged_the_ack_goes_at_once_whatever_the_mss():
    # two full-sized segments at most 16 KiB, as on the Python path (aioslirp.tcp.connection): at MTU
    # 65520 a 20 KB request is acknowledged at once, a 10 KB one waits
    ext = need_extension()
    for size, at_once in ((10_000, False), (20_000, True)):
        e = ext.TcpEngine(-1, False, False, GW_MAC, 65520, 4, 1 << 20, 60.0, 10.0, 1.0, fake=True, ack_delay=DELACK)
        f = EngineFlow(False, engine=e, mss=65480).established()
        assert f.send(ACK | PSH, data=b"q" * size)
        out = f.out()
        assert len(out) == (1 if at_once else 0), (size, out)
        if at_once:
            assert out[0].flags == ACK and out[0].ack == M(IRS + 1 + size)
        e.close()
