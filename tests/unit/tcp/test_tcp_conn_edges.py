"""Sans-IO TCP endpoint (aioslirp.tcp.connection) at the edges of each rule: windows, timers and
counters at exactly their bounds (the cases a mutation run, see docs/testing.md, found untested).

Same shape as test_tcp_conn.py (the helpers are in support/tcp_conn.py): connections driven through the real
handshake, guest segments from templates, a fake clock, exact segments compared. Each test
names the RFC rule it pins down (see "Mutation testing" in docs/testing.md).
"""

from __future__ import annotations

import tracemalloc

import pytest

from aioslirp.tcp.connection import TcpConnection
from aioslirp.wire.tcp import ACK, FIN, PSH, RST, SYN, Segment

from support.tcp_conn import (GWND, GWS, L, MSS, R, RCV_BUF, X, active, close_wait, established, events, fin_wait_2,
                              new_conn, recv, seg, send, syn)

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)


def unscaled(*, wnd: int, syn_wnd: int | None = None, **kw) -> TcpConnection:
    """ESTABLISHED (passive open) with a guest that does not scale its window: its SYN offers
    ``syn_wnd`` (default ``wnd``) and its handshake ACK ``wnd`` bytes, so the largest window it
    ever offered (the sender SWS reference, RFC 9293 3.8.6.2.1) is known."""
    c = new_conn(**kw)
    c.on_syn(syn(wnd=wnd if syn_wnd is None else syn_wnd, wscale=None), 0.0)
    c.accept(0.0)
    assert [s.flags for s in recv(c)] == [SYN | ACK]
    send(c, seg(wnd=wnd))
    assert c.state == "ESTABLISHED" and c.snd_wnd == wnd
    assert events(c) == [("established",)]
    return c


# ============================================================================ Segment


@pytest.mark.parametrize("field", ["seq", "ack", "flags", "wnd", "payload", "mss", "wscale", "sack_perm"])
def test_segments_differing_in_one_field_are_not_equal(field):
    base = dict(seq=1, ack=2, flags=ACK, wnd=3, payload=b"p", mss=1000, wscale=2, sack_perm=False)
    other = dict(base)
    other[field] = {"seq": 9, "ack": 9, "flags": ACK | PSH, "wnd": 9, "payload": b"q", "mss": 999,
                    "wscale": 3, "sack_perm": True}[field]
    assert Segment(**base) == Segment(**dict(base))
    assert Segment(**base) != Segment(**other)


# ============================================================================ opening


def test_active_open_records_the_time_and_the_guest_isn():
    """RFC 9293 3.10.7.3: the SYN-ACK sets IRS; our RST after an abort acknowledges RCV.NXT."""
    c = active(t=0.25)
    assert c.established_at == 0.25
    assert c.irs == R(0)
    c.abort()
    assert recv(c) == [Segment(L(1), R(1), RST | ACK, 0)]


def test_syn_sent_drops_an_ack_without_syn():
    """RFC 9293 3.10.7.3 fourth: neither SYN nor RST: drop the segment and return."""
    c = new_conn()
    c.connect(0.0)
    recv(c)
    for _ in range(2):
        send(c, Segment(R(0), L(1), ACK, 65535))
    assert c.state == "SYN-SENT"
    assert c.dropped_segments == 2
    assert recv(c) == []
    assert events(c) == []


def test_active_open_window_is_what_the_syn_offered():
    """Our SYN offers min(rcv_buf, 65535) unscaled (RFC 7323 2.2); the guest's ACK window is
    then exactly that, even when the guest's ISN puts RCV.NXT in the upper half of the space."""
    c = active(irs=0x80000005)
    assert recv(c) == [Segment(L(1), 0x80000006, ACK, RCV_BUF)]
    assert c.rcv_wnd == RCV_BUF


def test_active_open_without_scaling_accepts_at_most_65535_bytes():
    """RFC 9293 3.10.7.4: text beyond RCV.NXT + RCV.WND is cut; the unscaled SYN offered 65535."""
    c = active(wscale=None, rcv_buf=100000)
    assert recv(c) == [Segment(L(1), R(1), ACK, 65535)]
    send(c, seg(payload=b"w" * 65536))
    assert c.bytes_received == 65535
    assert c.rcv_nxt == R(1 + 65535)


def test_active_open_guest_wscale_zero_means_unscaled_windows():
    """RFC 7323 2.3: a window-scale option of 0 is scaling on with shift 0."""
    c = active(wscale=0, wnd=1000)
    assert c.snd_wscale == 0
    send(c, seg(wnd=1000))
    c.send(b"z" * 3000)
    assert [len(s.payload) for s in recv(c)] == [1000]


def test_active_open_segment_overlapping_the_syn_updates_the_window():
    """A segment starting at IRS (the SYN's sequence number) is trimmed to its new data and, as
    SND.WL1 = IRS and SND.WL2 = its ACK, updates the window (RFC 9293 3.10.7.4 fifth)."""
    c = active(wnd=1000)
    recv(c)
    send(c, seg(seq=R(0), wnd=50, payload=b"_abc"))
    assert bytes(c.peek()) == b"abc"
    assert c.snd_wnd == 50 << GWS


def test_abort_before_accept_refuses():
    """abort() in SYN-RECEIVED before accept() is refuse(): RST|ACK, seq 0, ack IRS+1."""
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.abort()
    assert recv(c) == [Segment(0, R(1), RST | ACK, 0)]
    assert c.state == "CLOSED"
    assert events(c) == [("closed",)]


def test_abort_in_listen_or_closed_sends_nothing():
    c = new_conn()
    c.abort()  # LISTEN: there is no peer to tell
    assert c.state == "CLOSED"
    assert recv(c) == []
    assert events(c) == [("closed",)]
    c.abort()  # CLOSED: nothing more happens
    assert recv(c) == []
    assert events(c) == []


def test_abort_after_active_open():
    c = active()
    c.abort()
    assert c.state == "CLOSED"
    assert events(c) == [("closed",)]


def test_refuse_outside_syn_received_raises():
    c = new_conn()
    with pytest.raises(RuntimeError, match=r"refuse\(\) in state LISTEN"):
        c.refuse()
    c = active()
    with pytest.raises(RuntimeError, match=r"refuse\(\) in state ESTABLISHED"):
        c.refuse()


def test_misuse_messages_name_the_call():
    c = new_conn()
    c.connect(0.0)
    with pytest.raises(RuntimeError, match=r"^connect\(\) in state SYN-SENT$"):
        c.connect(0.0)
    c = established()
    c.shutdown_write()
    with pytest.raises(RuntimeError, match=r"^send\(\) after shutdown_write\(\)$"):
        c.send(b"x")


def test_closed_ignores_send_and_shutdown_write():
    c = established()
    c.abort()
    recv(c)
    c.shutdown_write()
    c.send(b"late")  # no RuntimeError: shutdown_write() in CLOSED did nothing
    assert c.send_buffered == 0
    assert recv(c) == []


# ============================================================================ CLOSED


def test_closed_rst_answers_cover_the_whole_segment():
    """RFC 9293 3.10.7.1: no ACK bit: <SEQ=0><ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>, SYN and FIN
    counting one each; every segment is counted as dropped."""
    c = established()
    c.abort()
    recv(c)
    before = c.dropped_segments
    cases = [
        (Segment(R(50), 0, 0, 0, X), R(150)),
        (Segment(R(50), 0, SYN, 0), R(51)),
        (Segment(R(50), 0, FIN, 0, X), R(151)),
        (Segment(R(50), 0, SYN | FIN, 0, b"ab"), R(54)),
    ]
    for s, ack in cases:
        send(c, s)
        assert recv(c) == [Segment(0, ack, RST | ACK, 0)]
    send(c, Segment(R(50), 0, RST, 0))
    assert recv(c) == []
    assert c.dropped_segments == before + 5


# ============================================================================ ACK processing


def test_old_ack_still_delivers_its_data():
    """RFC 9293 3.10.7.4 fifth: SEG.ACK < SND.UNA is a duplicate that is ignored, not the
    segment: its text is still processed (an old ACK within the largest window is no attack,
    RFC 5961 5.2)."""
    c = established()
    c.send(X)
    recv(c)
    send(c, seg(ack=L(101)))
    send(c, seg(ack=L(51), payload=b"data"))
    assert bytes(c.peek()) == b"data"
    assert recv(c) == [Segment(L(101), R(5), ACK, RCV_BUF - 4)]


def test_old_ack_exactly_max_window_behind_is_accepted():
    """RFC 5961 5.2: acceptable when SND.UNA - MAX.SND.WND <= SEG.ACK; one byte older draws a
    challenge ACK."""
    c = unscaled(wnd=1000)
    for i in range(2):
        c.send(b"a" * 1000)
        recv(c)
        send(c, seg(ack=L(1 + 1000 * (i + 1)), wnd=1000))
    for _ in range(2):
        send(c, seg(ack=L(1000), payload=b"!"))  # 1001 behind: too old
    assert recv(c) == [Segment(L(2001), R(1), ACK, RCV_BUF)]
    assert c.peek() == b""
    assert c.dropped_segments == 2
    send(c, seg(ack=L(1001), payload=b"!"))  # exactly MAX.SND.WND behind
    assert bytes(c.peek()) == b"!"


def test_ack_of_unsent_data_is_counted_each_time():
    c = established()
    c.send(X)
    recv(c)
    for _ in range(3):
        send(c, seg(ack=L(500)))
    assert c.dropped_segments == 3
    assert recv(c) == [Segment(L(101), R(1), ACK, RCV_BUF)]


def test_fin_with_old_ack_is_not_a_duplicate_ack():
    """RFC 5681 2: a duplicate ACK carries no data and no SYN/FIN: two duplicates and a FIN with
    the same ACK do not trigger a fast retransmit."""
    c = established()
    c.send(b"d" * (4 * MSS))
    assert len(recv(c)) == 4
    send(c, seg(ack=L(1 + MSS)))
    for _ in range(2):
        send(c, seg(ack=L(1 + MSS)))
    send(c, seg(ack=L(1 + MSS), flags=ACK | FIN))
    assert recv(c) == [Segment(L(1 + 4 * MSS), R(2), ACK, RCV_BUF)]
    assert c.retransmitted_segments == 0


def test_ack_covering_data_and_fin_empties_the_send_buffer():
    c = established()
    c.send(X)
    c.shutdown_write()
    assert recv(c) == [Segment(L(1), R(1), ACK | PSH | FIN, RCV_BUF, X)]
    send(c, seg(ack=L(102)))
    assert c.state == "FIN-WAIT-2"
    assert c.send_buffered == 0
    assert c.send_space == 65536


def test_partial_ack_restarts_the_retransmission_timer():
    """RFC 6298 5.3: an ACK of new data restarts the timer at now + RTO."""
    c = established()
    c.send(b"p" * 200)
    recv(c)
    send(c, seg(ack=L(101)), 0.1)
    assert c.get_timer() == pytest.approx(0.1 + c.rto)


def test_probe_byte_accepted_counts_as_sent_data():
    c = established()
    c.send(X)
    assert [len(s.payload) for s in recv(c)] == [100]
    send(c, seg(ack=L(101), wnd=0))
    c.send(b"y" * 10)
    assert recv(c) == []
    t = c.get_timer()
    c.handle_timer(t)
    assert recv(c, t) == [Segment(L(101), R(1), ACK, RCV_BUF, b"y")]
    send(c, seg(ack=L(102), wnd=0), t)
    assert c.bytes_sent == 101


def test_progress_clears_the_retry_count():
    """As BSD: after an ACK of new data, max_retries timeouts in a row are needed again."""
    c = established(max_retries=1)
    c.send(b"r" * 200)
    recv(c)
    c.handle_timer(0.2)  # retry 1
    recv(c, 0.2)
    send(c, seg(ack=L(101)), 0.3)
    t = c.get_timer()
    c.handle_timer(t)  # retry 1 again, not 2
    assert recv(c, t) == [Segment(L(101), R(1), ACK | PSH, RCV_BUF, b"r" * 100)]
    assert c.state == "ESTABLISHED"
    t = c.get_timer()
    c.handle_timer(t)
    assert recv(c, t) == [Segment(L(201), R(1), RST | ACK, 0)]


# ============================================================================ retransmission


def test_rto_backoff_is_capped_at_rto_max():
    """RFC 6298 5.5: back off the timer, 2.5: a maximum may be placed on the RTO."""
    c = established(rto_max=0.5, max_retries=5)
    c.send(X)
    recv(c)
    t = c.get_timer()
    gaps = []
    for _ in range(4):
        c.handle_timer(t)
        recv(c, t)
        gaps.append(round(c.get_timer() - t, 6))
        t = c.get_timer()
    assert gaps == [0.4, 0.5, 0.5, 0.5]


def test_rto_retransmits_one_segment_into_a_zero_window():
    """After a timeout one segment goes out whatever the window (the guest may be stalled)."""
    c = established()
    c.send(b"z" * 300)
    assert [len(s.payload) for s in recv(c)] == [300]
    send(c, seg(wnd=0))  # window update: closed, nothing acknowledged
    c.handle_timer(0.2)
    assert recv(c, 0.2) == [Segment(L(1), R(1), ACK | PSH, RCV_BUF, b"z" * 300)]


def test_three_duplicate_acks_after_a_timeout_fast_retransmit():
    """A timeout ends any recovery and resets the duplicate-ACK count: if the retransmission is
    lost too, exactly three duplicates retransmit it again (RFC 5681 3.2)."""
    c = established()
    c.send(b"t" * (3 * MSS))
    assert len(recv(c)) == 3
    c.handle_timer(0.2)
    assert recv(c, 0.2) == [Segment(L(1), R(1), ACK, RCV_BUF, b"t" * MSS)]
    for _ in range(2):
        send(c, seg(), 0.3)
        assert recv(c, 0.3) == []
    send(c, seg(), 0.3)
    assert recv(c, 0.3) == [Segment(L(1), R(1), ACK, RCV_BUF, b"t" * MSS)]


def test_new_loss_after_recovery_fast_retransmits_again():
    """A full ACK (>= the recovery point) ends the recovery (RFC 6582 3.2 step 3): the next
    three duplicates retransmit again."""
    c = established()
    c.send(b"f" * (4 * MSS))
    assert len(recv(c)) == 4
    for _ in range(3):
        send(c, seg(ack=L(1)))
    assert len(recv(c)) == 1  # fast retransmit of the first segment
    send(c, seg(ack=L(1 + 4 * MSS)))  # full ACK: recovery ends
    assert recv(c) == []
    c.send(b"g" * (4 * MSS))
    assert len(recv(c)) == 4
    for _ in range(3):
        send(c, seg(ack=L(1 + 4 * MSS)))
    assert recv(c) == [Segment(L(1 + 4 * MSS), R(1), ACK, RCV_BUF, b"g" * MSS)]


def test_ack_one_short_of_the_recovery_point_is_partial():
    """RFC 6582: an ACK below the recovery point is partial and retransmits the next hole."""
    c = established()
    c.send(b"h" * (2 * MSS))
    assert len(recv(c)) == 2
    for _ in range(3):
        send(c, seg(ack=L(1)))
    assert len(recv(c)) == 1
    send(c, seg(ack=L(2 * MSS)))  # one byte short
    assert recv(c) == [Segment(L(2 * MSS), R(1), ACK | PSH, RCV_BUF, b"h")]
    send(c, seg(ack=L(1 + 2 * MSS)))  # everything: no more retransmission
    assert recv(c) == []
    assert c.retransmitted_segments == 2


def test_fast_retransmit_stays_within_the_flight():
    """The fast retransmit resends the first unacknowledged segment only, never unsent data
    beyond the guest's window."""
    c = unscaled(wnd=300)
    c.send(b"k" * 1000)
    assert [len(s.payload) for s in recv(c)] == [300]
    for _ in range(3):
        send(c, seg(wnd=300))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF, b"k" * 300)]


def test_fin_alone_fast_retransmitted():
    c = established()
    c.send(X)
    recv(c)
    send(c, seg(ack=L(101)))
    c.shutdown_write()
    assert recv(c) == [Segment(L(101), R(1), ACK | FIN, RCV_BUF)]
    for _ in range(3):
        send(c, seg(ack=L(101)))
    assert recv(c) == [Segment(L(101), R(1), ACK | FIN, RCV_BUF)]


def test_slow_start_after_timeout_counts_bytes_acked():
    """RFC 5681 3.1: after a timeout cwnd = 1 MSS and each ACK grows it by min(acked, SMSS),
    up to ssthresh = max(FlightSize / 2, 2 * SMSS); the sender SWS rule applies to what cwnd leaves."""
    c = established()
    c.send(b"s" * 1000)
    recv(c)
    c.handle_timer(0.2)
    assert [len(s.payload) for s in recv(c, 0.2)] == [1000]  # ssthresh = 2 * SMSS
    c.send(b"s" * 10000)
    send(c, seg(ack=L(101)), 0.3)  # cwnd 1460 + 100: 660 more of 1560, below an MSS: wait
    assert recv(c, 0.3) == []
    send(c, seg(ack=L(1 + 1000)), 0.3)  # cwnd 1560 + 900 = 2460 < ssthresh
    assert [len(s.payload) for s in recv(c, 0.3)] == [1460]
    send(c, seg(ack=L(1 + 2460)), 0.4)  # cwnd >= 2920: no limit any more
    assert sum(len(s.payload) for s in recv(c, 0.4)) == 11000 - 2460


def test_slow_start_threshold_is_half_the_flight():
    c = established()
    c.send(b"s" * (10 * MSS))
    assert len(recv(c)) == 10
    c.handle_timer(0.2)  # ssthresh = 5 MSS
    c.send(b"n" * (10 * MSS))
    sizes = [len(recv(c, 0.2))]
    una = 1
    for t in (0.3, 0.4, 0.5, 0.6):
        una += sizes[-1] * MSS
        send(c, seg(ack=L(una)), t)
        sizes.append(len(recv(c, t)))
    # cwnd 1, 2, 3, 4 MSS, then 5 MSS = ssthresh: unlimited (all 10 new segments)
    assert sizes == [1, 2, 3, 4, 10]
    assert una == 1 + 10 * MSS


def test_zero_window_probes_give_up_with_a_reset_event():
    c = established(max_retries=1)
    send(c, seg(wnd=0))
    c.send(X)
    recv(c)
    for _ in range(2):
        t = c.get_timer()
        c.handle_timer(t)
        out = recv(c, t)
    assert out == [Segment(L(1), R(1), RST | ACK, 0)]
    assert events(c) == [("reset",), ("closed",)]


def test_old_ack_answering_a_probe_counts_as_an_answer():
    """The guest answers each probe (here with an ACK older than SND.UNA, still acceptable):
    the connection is never given up (RFC 9293 3.8.6.1)."""
    c = established(max_retries=1)
    c.send(X)
    recv(c)
    send(c, seg(ack=L(101), wnd=0))
    c.send(b"q" * 10)
    recv(c)
    for _ in range(5):
        t = c.get_timer()
        c.handle_timer(t)
        assert [len(s.payload) for s in recv(c, t)] == [1]
        send(c, seg(ack=L(51), wnd=0), t)
    assert c.state == "ESTABLISHED"


def test_persist_interval_capped_and_probing_goes_on():
    """RFC 9293 3.8.6.1: probe a zero window for as long as the guest answers, the interval
    backed off up to rto_max (no overflow however long it lasts)."""
    c = established(rto_max=2.0, max_retries=1)
    send(c, seg(wnd=0))
    c.send(X)
    recv(c)
    gaps = []
    t = 0.0
    for _ in range(1100):
        nxt = c.get_timer()
        gaps.append(round(nxt - t, 6))
        t = nxt
        c.handle_timer(t)
        assert [len(s.payload) for s in recv(c, t)] == [1]
        send(c, seg(wnd=0), t)
    assert gaps[:5] == [0.2, 0.4, 0.8, 1.6, 2.0]
    assert set(gaps[4:]) == {2.0}
    assert c.state == "ESTABLISHED"


# ============================================================================ sender SWS


def test_last_piece_that_exactly_fits_the_window_goes_out():
    c = unscaled(wnd=1560)
    c.send(b"e" * 1560)
    assert [len(s.payload) for s in recv(c)] == [1460, 100]


def test_one_byte_window_with_nothing_in_flight_is_used():
    """Sender SWS avoidance holds small segments back only while data is in flight."""
    c = unscaled(wnd=1, syn_wnd=65535)
    c.send(X)
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF, b"x")]


def test_sender_sws_uses_half_the_largest_window():
    """RFC 9293 3.8.6.2.1: with data in flight, send a short segment only when the usable window
    is at least half the largest window the guest offered (here 2000 bytes)."""
    c = unscaled(wnd=2000)
    c.send(b"a" * 1400)
    assert [len(s.payload) for s in recv(c)] == [1400]
    c.send(b"b" * 2000)
    assert recv(c) == []  # 600 usable < 1000
    send(c, seg(ack=L(401), wnd=2000))
    assert [len(s.payload) for s in recv(c)] == [1000]  # 1000 usable == half: sent


def test_offload_segments_cut_to_whole_mss_within_the_window():
    c = unscaled(wnd=5840 + 3000, max_segment=4 * MSS)
    c.send(b"o" * 20000)
    assert [len(s.payload) for s in recv(c)] == [5840, 2920]
    c = unscaled(wnd=5840 + MSS, max_segment=4 * MSS)
    c.send(b"o" * 20000)
    assert [len(s.payload) for s in recv(c)] == [5840, MSS]


# ============================================================================ receiver SWS


def test_receiver_sws_threshold_is_half_a_small_buffer():
    """RFC 9293 3.8.6.2.2: the window edge advances by min(rcv_buf / 2, MSS); with a 2000-byte
    buffer that is 1000 bytes."""
    c = new_conn(rcv_buf=2000)
    c.on_syn(syn(wscale=None), 0.0)
    c.accept(0.0)
    recv(c)
    send(c, seg(wnd=65535))
    send(c, seg(payload=b"a" * 1200))
    assert recv(c) == [Segment(L(1), R(1201), ACK, 800)]
    c.consume(1200)  # 1200 more could be offered: >= 1000 and the window more than doubles
    assert recv(c) == [Segment(L(1), R(1201), ACK, 2000)]
    send(c, seg(seq=R(1201), payload=b"b" * 700))
    assert recv(c) == [Segment(L(1), R(1901), ACK, 1300)]
    c.consume(700)
    send(c, seg(seq=R(1901), payload=b"c" * 100))
    # 1200 left, 1900 free: 700 more is below the 1000-byte threshold: the edge stays
    assert recv(c) == [Segment(L(1), R(2001), ACK, 1200)]


def test_window_edge_advances_at_exactly_the_threshold():
    c = established()
    send(c, seg(payload=b"m" * MSS))
    assert recv(c) == [Segment(L(1), R(1 + MSS), ACK, RCV_BUF - MSS)]
    c.consume(MSS)
    assert recv(c) == []  # the window would not double: no update of its own
    send(c, seg(seq=R(1 + MSS), payload=b"n"))
    assert recv(c) == [Segment(L(1), R(2 + MSS), ACK, RCV_BUF - 1)]


# ============================================================================ delayed ACK of a FIN


def test_delayed_ack_of_fin_waits_ack_delay():
    c = established(ack_delay=0.002)
    send(c, seg(flags=ACK | FIN), 1.0)
    assert c.state == "CLOSE-WAIT"
    assert recv(c, 1.0) == []
    assert c.get_timer() == pytest.approx(1.002)
    c.handle_timer(1.001)
    assert recv(c, 1.001) == []
    c.handle_timer(1.002)
    assert recv(c, 1.002) == [Segment(L(1), R(2), ACK, RCV_BUF)]


# ============================================================================ out of order


def test_ooo_pieces_up_to_the_segment_bound():
    """At most 256 out-of-order pieces are kept (here contiguous one-byte pieces); the 257th is
    dropped and must be sent again."""
    c = established()
    for i in range(257):
        send(c, seg(seq=R(101 + i), payload=b"%c" % (65 + i % 26)))
    recv(c)
    send(c, seg(payload=b"h" * 100))
    assert c.rcv_nxt == R(101 + 256)


def test_ooo_bytes_bound_counts_every_piece():
    """Out-of-order bytes held never exceed RCV.WND: overlapping pieces from a hostile guest are
    dropped once the sum reaches it, and memory stays within the window."""
    c = established()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(100):
            send(c, seg(seq=R(101 + i), payload=b"o" * 20000))
            recv(c)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - base < 4 * RCV_BUF  # three pieces of 20000 bytes (all 100 would be 2 MB)
    send(c, seg(payload=b"i" * 100))
    assert c.rcv_nxt == R(1 + 100 + 2 + 20000)


def test_ooo_piece_that_fills_the_window_exactly_is_kept():
    c = new_conn(rcv_buf=1000)
    c.on_syn(syn(wscale=None), 0.0)
    c.accept(0.0)
    recv(c)
    send(c, seg(wnd=65535))
    send(c, seg(seq=R(101), payload=b"1" * 200))
    send(c, seg(seq=R(201), payload=b"2" * 100))  # overlaps: 300 bytes held
    send(c, seg(seq=R(301), payload=b"3" * 700))  # 300 + 700 == RCV.WND
    recv(c)
    send(c, seg(payload=b"0" * 100))
    assert c.rcv_nxt == R(1001)
    assert bytes(c.peek()) == b"0" * 100 + b"1" * 200 + b"3" * 700


def test_ooo_accounting_after_a_hole_fills():
    """Pieces pulled into the stream stop counting against the out-of-order bound: a piece of
    most of the window is kept once the earlier piece was delivered."""
    c = new_conn(rcv_buf=3000)
    c.on_syn(syn(wscale=None), 0.0)
    c.accept(0.0)
    recv(c)
    send(c, seg(wnd=65535))
    send(c, seg(seq=R(1001), payload=b"b" * 1000))
    send(c, seg(payload=b"a" * 1000))
    assert c.rcv_nxt == R(2001)
    c.consume(2000)
    assert recv(c) == [Segment(L(1), R(2001), ACK, 3000)]
    send(c, seg(seq=R(2002), payload=b"d" * 2500))
    send(c, seg(seq=R(2001), payload=b"c"))
    assert c.rcv_nxt == R(4502)
    assert bytes(c.peek()) == b"c" + b"d" * 2500


def test_ooo_retransmissions_take_one_slot():
    """A guest retransmitting the same out-of-order segment (its RTO while the hole persists)
    holds one piece, not one per copy; the first copy is kept (as Linux's tcp_data_queue_ofo)."""
    c = established()
    send(c, seg(seq=R(101), payload=b"a" * 100))
    for _ in range(300):
        send(c, seg(seq=R(101), payload=b"b" * 100))
    send(c, seg(seq=R(201), payload=b"c" * 100))
    recv(c)
    send(c, seg(payload=b"0" * 100))
    assert c.rcv_nxt == R(301)
    assert bytes(c.peek()) == b"0" * 100 + b"a" * 100 + b"c" * 100


def test_bare_ooo_fins_take_no_slot():
    """Zero-length out-of-order segments (a FIN alone) record the FIN position but keep no piece."""
    c = established()
    for i in range(300):
        send(c, seg(seq=R(2001 + i), flags=ACK | FIN))
    send(c, seg(seq=R(1001), payload=b"d" * 500))
    recv(c)
    send(c, seg(payload=b"0" * 1000))
    assert c.rcv_nxt == R(1501)


def test_ooo_data_past_the_guest_fin_is_not_delivered():
    """Nothing past the guest's FIN enters the stream, even from a piece that straddles it."""
    c = established()
    send(c, seg(seq=R(151), flags=ACK | FIN, payload=b"f" * 50))  # FIN at 200
    send(c, seg(seq=R(101), payload=b"s" * 200))  # 101..300: straddles the FIN
    recv(c)
    send(c, seg(payload=b"0" * 100))
    assert c.fin_received and c.state == "CLOSE-WAIT"
    assert bytes(c.peek()) == b"0" * 100 + b"s" * 100
    assert c.rcv_nxt == R(202)


# ============================================================================ buffers


def test_receive_copies_a_read_only_view_of_a_mutable_buffer():
    c = established()
    buf = bytearray(b"guest bytes")
    send(c, seg(payload=memoryview(buf).toreadonly()))
    buf[:] = b"overwritten"
    assert bytes(c.peek()) == b"guest bytes"


def test_send_copies_a_mutable_buffer():
    c = established()
    buf = bytearray(b"host bytes")
    c.send(buf)
    buf[:] = b"XXXXXXXXXX"
    assert [bytes(s.payload) for s in recv(c)] == [b"host bytes"]


def test_segment_of_one_host_chunk_is_a_zero_copy_view():
    c = established()
    data = b"v" * MSS
    c.send(data)
    (s,) = c.segments_to_send(0.0)
    assert s.payload.obj is data


def test_consume_across_chunks_and_reset_clears_receive_buffer():
    c = established()
    for i, part in enumerate((b"a" * 10, b"b" * 10, b"c" * 10)):
        send(c, seg(seq=R(1 + 10 * i), payload=part))
    c.consume(10)  # exactly the first chunk
    assert bytes(c.peek_chunk()) == b"b" * 10
    c.consume(15)
    assert c.recv_buffered == 5
    assert bytes(c.peek_chunk()) == b"c" * 5
    send(c, seg(seq=R(31), flags=RST))
    assert c.state == "CLOSED"
    assert c.recv_buffered == 0
    assert c.peek() == b""


# ============================================================================ added after the second batch


def test_window_update_ignores_an_older_overlapping_segment():
    """RFC 9293 3.10.7.4 fifth: update the window only if SND.WL1 < SEG.SEQ, or SND.WL1 = SEG.SEQ
    and SND.WL2 =< SEG.ACK; an acceptable segment that starts before SND.WL1 (old data
    overlapping RCV.NXT) delivers its new bytes but leaves the window alone."""
    c = established()
    send(c, seg(payload=X, wnd=100))  # SND.WL1 = R(1)
    send(c, seg(seq=R(101), wnd=50))  # SND.WL1 = R(101)
    send(c, seg(seq=R(51), payload=b"o" * 100, wnd=5))
    assert c.snd_wnd == 50 << GWS
    assert c.rcv_nxt == R(151)


@pytest.mark.parametrize(("rcv_buf", "shift"), [(65535, 0), (65536, 1), (1 << 30, 14), (1 << 31, 14)])
def test_window_scale_offered_is_the_smallest_that_fits(rcv_buf, shift):
    """RFC 7323 2.3: the shift makes rcv_buf fit the 16-bit field, at most 14."""
    c = new_conn(rcv_buf=rcv_buf)
    c.connect(0.0)
    assert recv(c) == [Segment(L(0), 0, SYN, 65535, mss=MSS, wscale=shift)]


def test_rtt_is_timed_on_one_new_segment_at_a_time():
    """RFC 6298 3: one measurement at a time, taken when the timed segment is acknowledged in
    full (not by a partial ACK), and never from a segment sent while another is timed."""
    c = established(rto_min=2.0)
    assert (c.srtt, c.rttvar) == (0.0, 0.0)
    c.send(b"a" * 1000)
    recv(c, 0.0)  # timed
    c.send(b"b" * 1000)
    recv(c, 0.5)  # not timed: a measurement is running
    send(c, seg(ack=L(501)), 0.7)  # part of the timed segment
    assert c.srtt == 0.0
    send(c, seg(ack=L(1001)), 1.0)  # R = 1.0
    assert (c.srtt, c.rttvar) == (0.125, 0.25)
    send(c, seg(ack=L(2001)), 2.0)
    assert (c.srtt, c.rttvar) == (0.125, 0.25)


def test_fin_retransmissions_are_counted_once_each():
    c = established()
    c.send(X)
    recv(c)
    send(c, seg(ack=L(101)))
    c.shutdown_write()
    fin = Segment(L(101), R(1), ACK | FIN, RCV_BUF)
    assert recv(c) == [fin]
    assert c.retransmitted_segments == 0  # the first FIN is no retransmission
    for _ in range(3):
        send(c, seg(ack=L(101)))
    assert recv(c) == [fin]
    assert c.retransmitted_segments == 1
    t = c.get_timer()
    c.handle_timer(t)  # RTO: the FIN alone again
    assert recv(c, t) == [fin]
    assert c.retransmitted_segments == 2


def test_zero_window_with_nothing_to_send_arms_no_timer():
    """The persist timer runs only while data waits for a zero window (RFC 9293 3.8.6.1)."""
    c = established()
    send(c, seg(wnd=0, payload=b"hi"))
    assert recv(c) == [Segment(L(1), R(3), ACK, RCV_BUF - 2)]
    assert c.get_timer() is None


def test_reopened_window_resets_the_probe_backoff():
    c = established()
    send(c, seg(wnd=0))
    c.send(X)
    assert recv(c) == []
    c.handle_timer(0.2)
    assert recv(c, 0.2) == [Segment(L(1), R(1), ACK, RCV_BUF, b"x")]
    send(c, seg(wnd=GWND), 0.3)  # reopened
    assert recv(c, 0.3) == [Segment(L(1), R(1), ACK | PSH, RCV_BUF, X)]
    send(c, seg(ack=L(101), wnd=0), 0.4)  # closed again, more data waiting
    c.send(b"more")
    assert recv(c, 0.4) == []
    assert c.get_timer() == pytest.approx(0.4 + c.rto)  # the first interval again, not doubled


def _fill(c: TcpConnection, total: int, t: float = 0.0) -> None:
    """The guest sends ``total`` bytes in MSS-sized segments, each answered as it comes."""
    sent = 0
    while sent < total:
        n = min(MSS, total - sent)
        send(c, seg(seq=R(1 + sent), payload=b"g" * n), t)
        recv(c, t)
        sent += n


def test_window_update_after_consume_needs_the_sws_step():
    """consume() schedules a window update only when the window can grow by min(rcv_buf/2, MSS)
    and at least double (receiver SWS avoidance, RFC 9293 3.8.6.2.2)."""
    c = established()
    _fill(c, RCV_BUF - 500)  # 500 bytes of window left
    c.consume(700)  # could offer 1200: +700 only
    assert recv(c) == []
    c.consume(760)  # 1960 = 500 + MSS exactly
    assert recv(c) == [Segment(L(1), R(1 + RCV_BUF - 500), ACK, 1960)]


def test_window_update_when_the_window_exactly_doubles():
    c = established()
    _fill(c, RCV_BUF - 3000)  # 3000 left (above the immediate-ACK threshold)
    c.consume(3000)  # 6000 = twice as much
    assert recv(c) == [Segment(L(1), R(1 + RCV_BUF - 3000), ACK, 6000)]


def test_window_update_rides_the_delayed_ack_unless_the_guest_is_short_of_window():
    """With a delayed ACK due, a window update waits for it while the guest still has at least
    two full-sized segments of window (2 * (MSS - 40) = 2840 bytes here)."""
    c = established(ack_delay=0.002)
    _fill(c, RCV_BUF - 2840, 1.0)  # the last segments wait for the delayed ACK
    assert c.get_timer() == pytest.approx(1.002)
    c.consume(2840)
    assert recv(c, 1.0) == []
    c.handle_timer(1.002)
    assert recv(c, 1.002) == [Segment(L(1), R(1 + RCV_BUF - 2840), ACK, 5680)]


def test_no_window_update_after_the_guest_fin():
    """After the guest's FIN no more data can come: consuming sends no window update."""
    c = established()
    send(c, seg(payload=b"a" * 30000))
    recv(c)
    send(c, seg(seq=R(30001), flags=ACK | FIN))
    assert recv(c) == [Segment(L(1), R(30002), ACK, 30000)]
    c.consume(30000)
    assert recv(c) == []


def test_consume_more_than_held_raises():
    c = established()
    send(c, seg(payload=b"abc"))
    with pytest.raises(ValueError, match=r"^consume\(5\) with 3 bytes held$"):
        c.consume(5)


def test_handshake_rtt_sample_is_the_synack_round_trip():
    """RFC 6298 2.2: the first sample R sets SRTT = R, RTTVAR = R/2, RTO = SRTT + 4 RTTVAR."""
    c = new_conn()
    c.on_syn(syn(), 1.0)
    c.accept(1.0)
    assert [s.flags for s in recv(c, 1.0)] == [SYN | ACK]
    send(c, seg(), 1.5)
    assert (c.srtt, c.rttvar, c.rto) == (0.5, 0.25, 1.5)


def test_rto_adds_at_least_the_clock_granularity():
    """RFC 6298 2.2: RTO = SRTT + max(G, 4 * RTTVAR), G = 1 ms: a zero RTT still gives 1 ms."""
    c = established(rto_min=1e-4)
    assert (c.srtt, c.rttvar) == (0.0, 0.0)
    assert c.rto == 0.001


def test_retransmitted_syns_before_accept_are_each_counted():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    for _ in range(2):
        c.on_syn(syn(), 0.1)
    assert c.dropped_segments == 2
    assert recv(c) == []


def test_syn_received_only_a_real_syn_draws_the_synack_again():
    """After accept(), only a retransmitted SYN (SYN alone, SEG.SEQ = IRS) repeats the SYN-ACK;
    other unacceptable segments at IRS are dropped silently (nothing before our SYN-ACK is acked)."""
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    assert [s.flags for s in recv(c)] == [SYN | ACK]
    for flags in (0, SYN | ACK):
        send(c, Segment(R(0), L(1), flags, 100))
        assert recv(c) == []
    assert c.retransmitted_segments == 0
    assert c.dropped_segments == 2


def test_segment_at_irs_in_established_is_just_out_of_window():
    c = established()
    send(c, seg(seq=R(0), flags=0))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    assert c.retransmitted_segments == 0


def test_syn_and_fin_count_in_the_segment_length_for_acceptability():
    """RFC 9293 3.3.1 / 3.10.7.4: SEG.LEN counts SYN and FIN; a segment whose last sequence
    number is RCV.NXT is in the window. An RST so placed draws a challenge ACK (RFC 5961 3.2);
    one byte further back it is wholly old and ignored."""
    c = established()
    send(c, seg(payload=b"a" * 10))
    recv(c)
    send(c, seg(seq=R(1), flags=SYN | RST, payload=b"a" * 10))
    assert recv(c) == [Segment(L(1), R(11), ACK, RCV_BUF - 10)]
    send(c, seg(seq=R(0), flags=SYN | RST, payload=b"a" * 10))
    assert recv(c) == []
    send(c, seg(seq=R(0), flags=ACK | FIN, payload=b"a" * 10))  # its FIN (R(10)) is old too
    assert recv(c) == [Segment(L(1), R(11), ACK, RCV_BUF - 10)]
    assert c.state == "ESTABLISHED"


def test_retransmitted_data_with_a_new_fin_closes():
    """The guest resends its last 10 bytes together with its FIN (a retransmission coalesced):
    the data is old, the FIN is new and accepted."""
    c = established()
    send(c, seg(payload=b"a" * 10))
    recv(c)
    send(c, seg(flags=ACK | FIN, payload=b"a" * 10))
    assert c.state == "CLOSE-WAIT" and c.fin_received
    assert recv(c) == [Segment(L(1), R(12), ACK, RCV_BUF - 10)]
    assert bytes(c.peek()) == b"a" * 10


def small_window(rcv_buf: int = 1000) -> TcpConnection:
    """ESTABLISHED with our receive buffer (and window) ``rcv_buf`` bytes, nothing scaled; the
    guest offers 65535 bytes."""
    c = new_conn(rcv_buf=rcv_buf)
    c.on_syn(syn(wscale=None), 0.0)
    c.accept(0.0)
    assert recv(c) == [Segment(L(0), R(1), SYN | ACK, rcv_buf, mss=MSS)]
    send(c, seg(wnd=65535))
    return c


def test_listen_drops_non_syn_segments_and_resets_acks():
    """RFC 9293 3.10.7.2: in LISTEN an RST is ignored, an ACK draws <SEQ=SEG.ACK><CTL=RST>,
    anything else without SYN is dropped."""
    c = new_conn()
    send(c, Segment(R(0), 0, FIN, 100, b"data"))
    assert recv(c) == []
    send(c, Segment(R(0), L(5), ACK, 100))
    assert recv(c) == [Segment(L(5), 0, RST, 0)]
    send(c, Segment(R(0), L(5), ACK | RST, 100))
    assert recv(c) == []
    assert c.dropped_segments == 3
    assert c.state == "LISTEN"


def test_rst_in_window_on_active_open_gets_challenge_ack():
    """RFC 5961 3.2 also for a connection we opened (a port forward into the guest)."""
    c = active()
    recv(c)
    for _ in range(2):
        send(c, seg(seq=R(500), flags=RST))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    assert c.dropped_segments == 2
    assert c.state == "ESTABLISHED"


def test_rst_in_time_wait_ends_it_without_a_reset():
    c = fin_wait_2()
    send(c, seg(ack=L(2), flags=ACK | FIN))
    assert c.state == "TIME-WAIT"
    recv(c)
    assert events(c) == [("fin",)]
    send(c, seg(seq=R(2), ack=L(2), flags=RST))
    assert c.state == "CLOSED" and not c.reset
    assert events(c) == [("closed",)]


def test_ignored_segments_are_counted_once_each():
    c = established()
    for _ in range(2):
        send(c, syn(seq=R(77)))  # SYN in a synchronized state
    assert c.dropped_segments == 2
    for _ in range(2):
        send(c, seg(flags=0, payload=b"x"))  # no ACK bit
    assert c.dropped_segments == 4
    c = close_wait()
    for _ in range(2):
        send(c, seg(seq=R(2), payload=b"late"))  # text after the FIN
    assert c.dropped_segments == 2
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    recv(c)
    for _ in range(2):
        send(c, seg(ack=L(5)))  # SYN-RECEIVED, unacceptable ACK
    assert c.dropped_segments == 2
    assert c.state == "SYN-RECEIVED"


def test_ack_before_our_synack_went_out_is_unacceptable():
    """accept() queued the SYN-ACK but it was not sent yet: an ACK of ISS acknowledges nothing."""
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    send(c, seg(ack=L(0)))
    assert c.state == "SYN-RECEIVED"
    assert c.dropped_segments == 1


def test_data_segments_repeating_the_ack_are_not_duplicate_acks():
    """RFC 5681 2: a segment carrying data is no duplicate ACK, whatever its ACK field."""
    c = established()
    c.send(b"d" * (4 * MSS))
    assert len(recv(c)) == 4
    for i in range(3):
        send(c, seg(seq=R(1 + 10 * i), payload=b"q" * 10))
    assert recv(c) == [Segment(L(1 + 4 * MSS), R(31), ACK, RCV_BUF - 30)]
    assert c.retransmitted_segments == 0


def test_overlapping_segment_is_cut_at_the_right_edge():
    """A segment starting before RCV.NXT is trimmed at both ends: its old bytes and whatever
    lies past RCV.NXT + RCV.WND (RFC 9293 3.10.7.4)."""
    c = small_window(1000)
    send(c, seg(payload=b"a" * 100, wnd=65535))
    assert recv(c) == [Segment(L(1), R(101), ACK, 900)]
    send(c, seg(seq=R(51), payload=b"b" * 1000, wnd=65535))
    assert c.rcv_nxt == R(1001)
    assert bytes(c.peek()) == b"a" * 100 + b"b" * 900


def test_acceptability_at_the_window_edges():
    """RFC 9293 3.10.7.4 first check: a segment at RCV.NXT + RCV.WND is out; with a zero window
    only SEG.SEQ = RCV.NXT is acceptable. An unacceptable segment changes nothing (not even the
    send window) and draws an ACK."""
    c = small_window(1000)
    send(c, seg(seq=R(1001), wnd=7))  # pure ACK at the right edge
    assert (c.snd_wnd, c.dropped_segments) == (65535, 1)
    assert recv(c) == [Segment(L(1), R(1), ACK, 1000)]
    send(c, seg(seq=R(1001), wnd=7, payload=b"x"))  # text starting at the right edge
    assert (c.snd_wnd, c.dropped_segments) == (65535, 2)
    recv(c)
    send(c, seg(payload=b"f" * 1000, wnd=65535))  # fills the window
    assert recv(c) == [Segment(L(1), R(1001), ACK, 0)]
    send(c, seg(seq=R(1002), wnd=7))  # one past RCV.NXT in a zero window
    assert (c.snd_wnd, c.dropped_segments) == (65535, 3)
    send(c, seg(seq=R(1001), wnd=7))  # at RCV.NXT: acceptable
    assert c.snd_wnd == 7


def test_guest_zero_window_probe_is_acked_at_once():
    """With delayed ACKs on, a probe of our zero window (text we cannot take) is answered at
    once: the guest is waiting for the window."""
    c = established(rcv_buf=2000, ack_delay=0.002)
    send(c, seg(payload=b"z" * 2000), 1.0)
    c.handle_timer(1.002)
    assert recv(c, 1.002) == [Segment(L(1), R(2001), ACK, 0)]
    send(c, seg(seq=R(2001), payload=b"p"), 1.5)
    assert recv(c, 1.5) == [Segment(L(1), R(2001), ACK, 0)]


def test_delayed_ack_goes_at_once_at_exactly_two_full_segments():
    """RFC 1122 4.2.3.2: an ACK for at least every second full-sized segment (2 * (MSS - 40))."""
    c = established(ack_delay=0.002)
    send(c, seg(payload=b"a" * 1420), 1.0)
    assert recv(c, 1.0) == []
    send(c, seg(seq=R(1421), payload=b"b" * 1420), 1.0)
    assert recv(c, 1.0) == [Segment(L(1), R(2841), ACK, RCV_BUF - 2840)]


def _growth(step, n: int = 5000) -> int:
    """Bytes still allocated after ``n`` calls of ``step``."""
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(n):
            step(i)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held - base


def test_receive_queue_stays_small_on_a_long_flow_that_never_drains():
    """The receive queue forgets consumed chunks as it goes, even when it never empties (a host
    socket that always lags one byte behind): memory does not grow with the flow's length."""
    c = established()
    send(c, seg(payload=b"0"))
    nxt = [2]

    def step(i):
        send(c, seg(seq=R(nxt[0]), payload=b"0123456789"))
        nxt[0] += 10
        c.consume(10)
        recv(c)

    assert _growth(step) < 20_000  # 5000 chunks would leave a 40 KB list behind
    assert c.recv_buffered == 1


def test_send_queue_stays_small_on_a_long_flow_that_never_drains():
    c = established()
    c.send(b"0")
    recv(c)
    una = [1]

    def step(i):
        c.send(b"0123456789")
        recv(c)
        una[0] += 10
        send(c, seg(ack=L(una[0])))

    assert _growth(step) < 20_000
    assert c.send_buffered == 1


def test_last_ack_linger_restarts_on_progress_then_ends_a_silent_guest():
    """LAST-ACK is bounded by ``linger`` seconds without progress: the bound starts when our
    segments go out and moves on every ACK of new data; a guest that then stops acknowledging
    is reset exactly ``linger`` after its last progress."""
    c = close_wait(rto_min=2.0, linger=1.0)
    c.send(b"a" * (3 * MSS))
    c.shutdown_write()
    out = recv(c, 0.0)
    assert [len(s.payload) for s in out] == [MSS] * 3 and out[-1].flags & FIN
    assert c.get_timer() == 1.0
    send(c, seg(seq=R(2), ack=L(1 + MSS)), 0.8)
    assert recv(c, 0.8) == []
    assert c.get_timer() == pytest.approx(1.8)
    c.handle_timer(1.8)
    assert c.state == "CLOSED" and c.reset
    assert recv(c, 1.8) == [Segment(L(2 + 3 * MSS), R(2), RST | ACK, 0)]
