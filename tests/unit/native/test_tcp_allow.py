"""The native TCP engine's allowances (``TcpEngine.allow``, ``tn_allow`` of aioslirp/native/tcpnat.c),
the holds the loop's fair scheduler puts on a guest over its share (:mod:`aioslirp.nat.native_tcp`),
with fake sockets and a fake clock: held down, no host socket is read; held up, our window does not
open past the edge already advertised; raising the allowance resumes every held flow at the next
poll, without another event; ``moved()`` gives the engine's byte totals each way."""

from __future__ import annotations

import pytest

from support.native_tcp import ACK, IRS, ISS, M, EngineFlow, mss_of, pattern_data

V = pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
WND = 16384  # rcv_buf of the up test: window scale 0, the socket asked for its room each time


@V
def test_a_down_hold_stops_host_reads_and_raising_it_resumes_at_the_next_poll(v6):
    f = EngineFlow(v6).established()
    f.send(ACK, win=0xFFFF)  # the guest's window (8 MiB) is not what holds it
    assert f.e.allow(down=0) == 0  # nothing held yet: nothing to resume
    f.host_send(pattern_data(100_000))
    assert f.out() == []  # held: the bytes stay in the host socket
    assert f.e.fake_socket(f.fd)["unread"] == 100_000
    assert f.e.counters()["held_down"] == 1 and f.e.moved() == (0, 0)
    f.poll(0.5)
    assert f.out() == []  # a timer pass does not lift it
    assert f.e.allow(down=None) == 1  # the held flow is due
    f.poll(0.6)  # no socket event: the allowance alone resumes it
    got = b"".join(s.payload for s in f.out())
    assert got == pattern_data(100_000)
    assert f.e.moved() == (0, 100_000)
    assert f.e.counters()["held_down"] == 1


@V
def test_a_down_allowance_is_the_most_a_turn_reads(v6):
    f = EngineFlow(v6).established()
    f.send(ACK, win=0xFFFF)
    f.e.allow(down=20_000)
    f.host_send(pattern_data(300_000))
    first = [s for s in f.out()]
    assert sum(len(s.payload) for s in first) == 20_000  # cut to the allowance, then held
    assert f.e.counters()["held_down"] == 1
    f.send(ACK, ack=ISS + 1 + 20_000, win=0xFFFF)  # an ACK of all: still held
    assert f.out() == []
    assert f.e.allow(down=30_000) == 1
    f.poll(0.1)
    assert sum(len(s.payload) for s in f.out()) == 30_000
    f.e.allow(down=None)
    f.poll(0.2)
    rest = f.out()
    assert sum(len(s.payload) for s in rest) == 250_000 and rest[0].seq == M(ISS + 1 + 50_000)
    assert f.e.moved()[1] == 300_000 and f.e.counters()["held_down"] == 2


@V
def test_an_up_hold_keeps_our_window_from_opening_and_raising_it_sends_the_update(v6):
    f = EngineFlow(v6, rcv_buf=WND).established()
    mss = mss_of(v6)
    data = pattern_data(WND + 2 * mss)
    assert f.send(ACK, data=data[:mss])
    (a,) = f.out()
    edge = M(a.ack + a.wnd)
    assert edge == M(IRS + 1 + mss + WND)  # the whole rcv_buf (scale 0)
    assert f.e.moved() == (mss, 0)  # taken
    f.e.allow(up=0)
    assert f.send(ACK, seq=IRS + 1 + mss, data=data[mss:2 * mss])
    (a,) = f.out()
    assert M(a.ack + a.wnd) == edge  # the edge did not move: the window shrinks
    assert f.e.moved() == (mss + WND, 0)  # held: the window given is charged at once, in full
    sent = 2 * mss
    while sent < mss + WND:  # the guest fills the window it was given: taken, the edge never moves
        n = min(mss, mss + WND - sent)
        assert f.send(ACK, seq=IRS + 1 + sent, data=data[sent:sent + n])
        sent += n
        (a,) = f.out()
        assert a.ack == M(IRS + 1 + sent) and M(a.ack + a.wnd) == edge
    assert a.wnd == 0
    assert f.host_received() == data[:sent]
    assert f.e.counters()["held_up"] == 1 and f.e.moved() == (sent, 0)  # nothing charged twice
    f.poll(0.5)
    assert f.out() == []  # no window update while held
    assert f.e.allow(up=3000) == 1
    f.poll(0.6)
    (u,) = f.out()  # the window update, from the allowance alone: as far as it goes
    assert u.ack == M(IRS + 1 + sent) and u.wnd == 3000
    assert f.e.moved() == (sent + 3000, 0) and f.e.counters()["held_up"] == 2  # (held again at its end)
    f.e.allow(up=None)
    f.poll(0.7)
    (u,) = f.out()
    assert u.ack == M(IRS + 1 + sent) and u.wnd == WND
    assert f.e.counters()["window_updates"] == 2
    assert f.e.moved() == (sent + 3000, 0)  # no bound: the bytes when taken, not the window


def test_a_flow_that_ends_while_held_leaves_the_others_to_resume():
    a = EngineFlow(False).established()
    b = EngineFlow(False, engine=a.e, gport=40001).established()
    a.e.allow(down=0)
    for f in (a, b):
        f.send(ACK, win=0xFFFF)
        f.host_send(pattern_data(10_000))
    assert a.out() == [] and a.e.counters()["held_down"] == 2
    a.e.fake_host_reset(a.fd, 0.0)  # a is over (its RST to the guest)
    assert [s.flags & 0x04 for s in a.out()] == [0x04]
    a.e.allow(down=None)
    b.poll(0.1)
    out = b.out()
    assert sum(len(s.payload) for s in out) == 10_000 and b.e.live() == 1


def test_moved_and_the_metered_pending():
    f = EngineFlow(False).established()
    f.e.hook_records(True)
    f.send(ACK, win=0xFFFF)
    f.host_send(pattern_data(5_000))
    assert f.e.pending() is False  # not metered: records only
    f.e.meter(True)
    assert f.e.pending() is True  # bytes moved since the last moved()
    assert f.e.moved() == (0, 5_000)
    assert f.e.pending() is False
    assert f.send(ACK, ack=ISS + 1 + 5_000, data=b"x" * 100, win=0xFFFF)
    assert f.e.pending() is True and f.e.moved() == (100, 5_000)
    with pytest.raises(ValueError, match="up"):
        f.e.allow(up=-1)
    c = f.e.counters()
    assert (c["bytes_up"], c["bytes_down"]) == (100, 5_000)


def test_a_metering_threshold_spares_small_exchanges_the_upcall():
    """``meter(True, min_bytes)``: pending() once at least min_bytes moved both ways together since
    moved() (what NativeTcp asks while no allowance bounds the guest: TURN_MIN), not for a few bytes."""
    f = EngineFlow(False).established()
    f.e.hook_records(True)
    f.send(ACK, win=0xFFFF)
    f.e.meter(True, 1000)
    f.host_send(pattern_data(600))
    assert f.e.pending() is False  # 600 bytes down: under the threshold
    assert f.send(ACK, ack=ISS + 1 + 600, data=b"x" * 300, win=0xFFFF)
    assert f.e.pending() is False  # 900 both ways
    assert f.send(ACK, ack=ISS + 1 + 600, seq=IRS + 1 + 300, data=b"y" * 100, win=0xFFFF)
    assert f.e.pending() is True and f.e.moved() == (400, 600)  # 1000: charged now
    assert f.e.pending() is False
    f.e.meter(True, 0)
    f.host_send(pattern_data(1))
    assert f.e.pending() is True  # no threshold: any byte


def test_raising_one_allowance_leaves_the_other_direction_held():
    f = EngineFlow(False, rcv_buf=WND).established()
    mss = mss_of(False)
    f.e.allow(up=0, down=0)
    assert f.send(ACK, data=pattern_data(mss), win=0xFFFF)  # our window would open: held up
    f.host_send(pattern_data(10_000))  # held down
    (a,) = f.out()
    edge = M(a.ack + a.wnd)
    c = f.e.counters()
    assert (c["held_up"], c["held_down"]) == (1, 1)
    assert f.e.allow(down=None) == 1
    f.poll(0.1)
    out = f.out()
    assert sum(len(s.payload) for s in out) == 10_000  # down resumed...
    assert all(M(s.ack + s.wnd) == edge for s in out)  # ...up still held: its edge never moved
    c = f.e.counters()
    assert (c["held_up"], c["held_down"]) == (1, 1)  # (still the same hold, not counted again)
    assert f.e.allow(up=None) == 1
    f.poll(0.2)
    (u,) = f.out()
    assert M(u.ack + u.wnd) == M(IRS + 1 + mss + WND)
