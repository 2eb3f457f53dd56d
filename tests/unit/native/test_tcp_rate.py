"""The native TCP engine's rate caps (``rate_up`` / ``rate_down``, aioslirp/native/tcpnat.c) with
fake sockets and a fake clock: one byte bucket per direction per engine, the rule of
:class:`aioslirp.ratelimit.ByteBucket` (the rate, a burst of max(64 KiB, 10 ms), full at the
start), paced without loss, a held flow woken by the engine's timer."""

from __future__ import annotations

import pytest

from aioslirp.nat.native_tcp import RATE_MAX, _engine_rate
from aioslirp.ratelimit import ByteBucket, byte_burst

from support.frames import GW_MAC
from support.native import need_extension
from support.native_tcp import ACK, IRS, ISS, M, MTU, EngineFlow, mss_of, pattern_data

V = pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
RATE = 1_000_000  # bytes/s: the burst is 64 KiB
BURST = 65536
BATCH = 16 * 1024  # TN_RATE_BATCH: a held flow resumes once this much has refilled


@V
def test_down_cap_paces_the_host_bytes_at_the_rate_without_loss(v6):
    """Host -> guest under rate_down: in any first t seconds the guest gets rate * t + burst bytes
    within one segment (above) and one batch and a clock step (below); every byte arrives, in order."""
    f = EngineFlow(v6, rate_down=RATE).established()
    mss = mss_of(v6)
    data = pattern_data(1_500_000)
    f.host_send(data)
    got = bytearray()
    t, step = 0.0, 0.001
    while len(got) < len(data):
        for s in f.out():
            assert s.seq == M(ISS + 1 + len(got))  # in order, no retransmission (nothing lost)
            got += s.payload
        assert len(got) <= BURST + RATE * t + mss, (t, len(got))
        if len(got) < len(data):
            assert len(got) >= BURST + RATE * t - BATCH - mss - RATE * step, (t, len(got))
        f.send(ACK, ack=ISS + 1 + len(got), win=0xFFFF, at=t)  # the guest takes all at once (8 MiB window)
        t = round(t + step, 6)
        f.poll(t)
        assert t < 3.0
    assert bytes(got) == data
    assert t == pytest.approx((len(data) - BURST) / RATE, rel=0.03)  # the burst, then the rate
    c = f.e.counters()
    assert c["rate_paused_down"] >= len(data) // BATCH // 2 and c["rto"] == 0


@V
def test_down_cap_holds_then_the_timer_wakes_the_flow(v6):
    f = EngineFlow(v6, rate_down=RATE).established()
    mss = mss_of(v6)
    f.send(ACK, win=0xFFFF)  # the guest's window (8 MiB) is not what holds it
    f.host_send(pattern_data(300_000))
    burst = sum(len(s.payload) for s in f.out())
    assert BURST <= burst <= BURST + mss  # the full bucket, one segment over at most
    assert f.e.counters()["rate_paused_down"] == 1
    debt = burst - BURST
    wake = (BATCH + debt) / RATE  # when 16 KiB have refilled past the debt
    f.poll(wake - 0.0002)
    assert f.out() == []  # no guest frame, no socket event: only the timer can resume it
    f.poll(wake + 0.0001)
    more = sum(len(s.payload) for s in f.out())
    assert BATCH <= more <= BATCH + mss
    assert f.e.counters()["rate_paused_down"] == 2  # held again


@V
def test_up_cap_closes_our_window_and_the_timer_reopens_it(v6):
    """Guest -> host under rate_up: our window is at most what the bucket holds, so the guest's
    bytes wait in the guest; the host gets rate * t + burst bytes within one segment; window
    updates come from the timer (no guest segment asks for them); every byte arrives."""
    f = EngineFlow(v6, rate_up=RATE).established()
    mss = mss_of(v6)
    data = pattern_data(1_000_000)
    sent = 0
    edge = M(IRS + 1 + (512 << 5))  # the guest's view of our window: the SYN-ACK's (65535) or more
    received = bytearray()
    t, step = 0.0, 0.001
    updates = 0
    while len(received) < len(data):
        while sent < len(data) and ((edge - (IRS + 1 + sent)) & 0xFFFFFFFF) and \
                ((edge - (IRS + 1 + sent)) & 0xFFFFFFFF) < 1 << 31:
            room = (edge - (IRS + 1 + sent)) & 0xFFFFFFFF
            n = min(mss, room, len(data) - sent)
            assert f.send(ACK, seq=IRS + 1 + sent, data=data[sent:sent + n], at=t)
            sent += n
            for a in f.out():
                edge = M(a.ack + (a.wnd << 5))
        received += f.host_received()
        assert len(received) <= BURST + RATE * t + mss, (t, len(received))
        t = round(t + step, 6)
        f.poll(t)
        for a in f.out():  # from the timer alone
            updates += 1
            assert a.ack == M(IRS + 1 + len(received)) and a.wnd > 0
            edge = M(a.ack + (a.wnd << 5))
        assert t < 3.0
    assert bytes(received) == data
    assert t == pytest.approx((len(data) - BURST) / RATE, rel=0.03)
    c = f.e.counters()
    assert updates >= 10 and c["rate_held_up"] >= updates // 2
    assert c["out_of_window"] == 0  # the guest never had to send what would be dropped


def test_a_long_idle_refills_to_the_burst_only():
    """No overflow after a long idle: the bucket refills to its burst, not rate * idle."""
    f = EngineFlow(False, rate_down=RATE_MAX).established()
    f.e.close()
    f = EngineFlow(False, rate_down=RATE, idle=0.0).established()
    mss = mss_of(False)
    f.send(ACK, win=0xFFFF)
    f.host_send(pattern_data(400_000))
    first = sum(len(s.payload) for s in f.out())
    f.send(ACK, ack=ISS + 1 + first, win=0xFFFF)  # all acknowledged: nothing to retransmit
    f.poll(10.0 ** 6)  # eleven days later, the timer
    assert BURST <= sum(len(s.payload) for s in f.out()) <= BURST + mss


def test_rates_are_checked():
    ext = need_extension()
    with pytest.raises(ValueError, match="rate_up"):
        ext.TcpEngine(-1, False, False, GW_MAC, MTU, 4, 1 << 20, 60.0, 10.0, 1.0, fake=True, rate_up=RATE_MAX + 1)
    with pytest.raises(ValueError, match="rate_down"):  # (-1 as unsigned: above the largest)
        ext.TcpEngine(-1, False, False, GW_MAC, MTU, 4, 1 << 20, 60.0, 10.0, 1.0, fake=True, rate_down=-1)
    ext.TcpEngine(-1, False, False, GW_MAC, MTU, 4, 1 << 20, 60.0, 10.0, 1.0, fake=True, rate_up=RATE_MAX).close()
    assert _engine_rate(None) == 0
    assert _engine_rate(ByteBucket(2_500_000)) == 2_500_000
    assert _engine_rate(ByteBucket(2.6)) == 3
    assert _engine_rate(ByteBucket(0.4)) is None and _engine_rate(ByteBucket(1e30)) is None
    assert byte_burst(RATE) == BURST


def test_flows_of_one_engine_share_its_bucket():
    """Two flows reading their host sockets at once: together they get the rate (one bucket per
    direction per engine), each held in turn, every byte delivered."""
    a = EngineFlow(False, rate_down=RATE).established()
    b = EngineFlow(False, engine=a.e, gport=40001).established()
    mss = mss_of(False)
    for f in (a, b):
        f.send(ACK, win=0xFFFF)
        f.host_send(pattern_data(600_000))
    t, step = 0.0, 0.001
    total = 0
    while total < 1_200_000:
        total += sum(len(s.payload) for s in a.out())  # (the frames of both flows)
        assert total <= BURST + RATE * t + 2 * mss, (t, total)
        for f in (a, b):
            f.send(ACK, ack=ISS + 1 + f.info()[3], win=0xFFFF, at=t)
        t = round(t + step, 6)
        a.poll(t)
        assert t < 3.0
    assert t == pytest.approx((1_200_000 - BURST) / RATE, rel=0.03)
    assert a.info()[3] == b.info()[3] == 600_000
    assert a.e.counters()["rto"] == 0
