"""Tests of the sans-IO guest-facing TCP endpoint (aioslirp.tcp.connection).

Shape borrowed from smoltcp's socket tests: connections are built directly in the state a
test needs (by driving the real handshake, so no internals are poked), segments are written
from templates overridden field by field, and each step is ``send(c, seg)`` followed by
``assert recv(c) == [Segment(...)]``. Time is a plain float passed in; nothing sleeps.

Sequence numbers sit near the top of the 32-bit space (ISS, IRS below) so that ordinary
tests already cross the wrap; ``L(n)``/``R(n)`` are our/the guest's sequence number ``n``
bytes after the ISN. These helpers, shared with the other TCP tests, are in ``support/tcp_conn.py``.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from aioslirp.tcp.connection import TcpConnection
from aioslirp.wire.tcp import ACK, FIN, PSH, RST, SYN, Segment
from aioslirp.tcp.seq import (
    SEQ_MASK,
    seq_add,
    seq_diff,
    seq_ge,
    seq_gt,
    seq_in,
    seq_le,
    seq_lt,
    seq_max,
)

from support.tcp_conn import (GWND, GWS, L, MSS, R, RCV_BUF, SND_BUF, X, App, LossyWire, close_wait, established,
                              events, fin_wait_1, fin_wait_2, new_conn, recv, run_transfer, seg, send, syn)

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

# ============================================================================ seq.py


def test_seq_helpers_wrap():
    top = SEQ_MASK
    assert seq_add(top, 1) == 0
    assert seq_add(5, -10) == 2**32 - 5
    assert seq_diff(2, top) == 3
    assert seq_diff(top, 2) == -3
    assert seq_lt(top, 2) and seq_le(top, 2) and not seq_lt(2, top)
    assert seq_gt(2, top) and seq_ge(2, top) and seq_ge(7, 7) and not seq_gt(7, 7)
    assert seq_le(7, 7) and not seq_lt(7, 7)
    assert not seq_lt(0, 2**31) and not seq_gt(0, 2**31)  # exactly half apart: unordered
    assert seq_in(1, top - 1, 5) and not seq_in(5, top - 1, 5) and not seq_in(top - 2, top - 1, 5)
    assert seq_max(top, 3) == 3 and seq_max(3, top) == 3


# ============================================================================ LISTEN -> SYN-RECEIVED


def test_passive_open_with_options():
    c = new_conn()
    assert c.state == "LISTEN"
    c.on_syn(syn(), 0.0)
    assert c.state == "SYN-RECEIVED"
    assert recv(c) == []  # nothing until the host connect succeeded
    assert c.get_timer() is None
    c.accept(0.0)
    assert recv(c) == [Segment(L(0), R(1), SYN | ACK, RCV_BUF, mss=MSS, wscale=0)]
    assert c.get_timer() == 1.0  # initial RTO, RFC 6298 2.1
    send(c, seg(wnd=100), 0.5)
    assert c.state == "ESTABLISHED"
    assert events(c) == [("established",)]
    assert c.established_at == 0.5
    assert (c.snd_una, c.snd_nxt, c.rcv_nxt) == (L(1), L(1), R(1))
    assert c.snd_wnd == 100 << GWS
    assert c.effective_mss == MSS
    assert (c.snd_wscale, c.rcv_wscale) == (GWS, 0)
    assert c.get_timer() is None
    # RTT sample 0.5 s from the SYN-ACK (RFC 6298 2.2): SRTT 0.5, RTTVAR 0.25, RTO 0.5 + 4 * 0.25
    assert (c.srtt, c.rttvar, c.rto) == (0.5, 0.25, 1.5)


def test_passive_open_without_options():
    c = new_conn(rcv_buf=100000)
    c.on_syn(syn(mss=None, wscale=None, sack_perm=False), 0.0)
    c.accept(0.0)
    # No scaling offered by the guest: we neither offer nor use it; window capped at 65535.
    assert recv(c) == [Segment(L(0), R(1), SYN | ACK, 65535, mss=MSS)]
    send(c, seg(wnd=3000))
    assert c.snd_wnd == 3000  # unscaled
    assert c.effective_mss == 536  # RFC 9293 default MSS
    c.send(b"a" * 1000)
    assert recv(c) == [
        Segment(L(1), R(1), ACK, 65535, b"a" * 536),
        Segment(L(537), R(1), ACK | PSH, 65535, b"a" * 464),
    ]


def test_passive_open_scales_large_receive_buffer():
    c = new_conn(rcv_buf=1 << 20)
    c.on_syn(syn(wscale=2, mss=1000), 0.0)
    c.accept(0.0)
    # Smallest shift with rcv_buf >> shift <= 65535 is 5; the SYN-ACK window is never scaled.
    assert recv(c) == [Segment(L(0), R(1), SYN | ACK, 65535, mss=MSS, wscale=5)]
    send(c, seg(wnd=1000))
    assert c.snd_wnd == 4000
    assert c.effective_mss == 1000
    send(c, seg(payload=X))
    assert recv(c) == [Segment(L(1), R(101), ACK, ((1 << 20) - 100) >> 5)]


def test_scaled_window_rounds_up_rather_than_shrink():
    c = new_conn(rcv_buf=1 << 20)
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    recv(c)
    send(c, seg())
    send(c, seg(payload=X))
    assert recv(c) == [Segment(L(1), R(101), ACK, ((1 << 20) - 100) >> 5)]  # 32764 << 5 = 1048448
    edge = R(101 + (32764 << 5))
    send(c, seg(seq=R(101), payload=X))
    # 1048348 bytes remain before the edge; rounding down (32760) would pull it left by 28 bytes.
    assert recv(c) == [Segment(L(1), R(201), ACK, 32761)]
    assert seq_ge(R(201) + (32761 << 5), edge)
    assert c.rcv_wnd == 32761 << 5


def test_listen_answers_stray_ack_with_rst_and_takes_syn():
    c = new_conn()
    send(c, seg(ack=L(77)))
    assert recv(c) == [Segment(L(77), 0, RST, 0)]
    assert c.state == "LISTEN"
    send(c, syn())  # receive_segment() in LISTEN is on_syn()
    assert c.state == "SYN-RECEIVED"
    assert c.dropped_segments == 1


def test_guest_wscale_above_14_is_clamped():
    c = established(syn_kw=dict(wscale=20))
    assert c.snd_wscale == 14
    send(c, seg(wnd=2))
    assert c.snd_wnd == 2 << 14


def test_syn_retransmitted_before_accept_is_ignored():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.on_syn(syn(), 1.0)
    assert recv(c, 1.0) == []
    assert c.dropped_segments == 1
    c.accept(1.5)
    assert recv(c, 1.5) == [Segment(L(0), R(1), SYN | ACK, RCV_BUF, mss=MSS, wscale=0)]


def test_syn_retransmitted_after_accept_gets_synack_again():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    synack = Segment(L(0), R(1), SYN | ACK, RCV_BUF, mss=MSS, wscale=0)
    assert recv(c) == [synack]
    c.on_syn(syn(), 0.3)
    assert recv(c, 0.3) == [synack]
    assert c.retransmitted_segments == 1
    send(c, seg(), 0.4)
    assert c.state == "ESTABLISHED"
    assert c.srtt is None  # Karn: the SYN-ACK was sent twice, no sample


def test_synack_retransmitted_on_rto_with_backoff():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    synack = Segment(L(0), R(1), SYN | ACK, RCV_BUF, mss=MSS, wscale=0)
    assert recv(c) == [synack]
    c.handle_timer(0.9)
    assert recv(c, 0.9) == []
    c.handle_timer(1.0)
    assert recv(c, 1.0) == [synack]
    assert c.get_timer() == 3.0  # RTO doubled to 2 s
    send(c, seg(), 3.5)
    assert c.state == "ESTABLISHED"
    assert c.rto == 3.0  # RFC 6298 5.7
    assert c.get_timer() is None


def test_refuse_sends_rst_ack():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.refuse()
    assert recv(c) == [Segment(0, R(1), RST | ACK, 0)]
    assert c.state == "CLOSED"
    assert c.reset is True
    assert events(c) == [("closed",)]


def test_guest_rst_in_syn_received_before_accept():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    send(c, seg(flags=RST, ack=0))
    assert c.state == "CLOSED"
    assert events(c) == [("reset",), ("closed",)]
    c.accept(0.1)  # the host connect finished late: ignored
    assert recv(c, 0.1) == []


def test_bad_ack_in_syn_received_draws_rst():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    recv(c)
    send(c, seg(ack=L(500)))
    assert recv(c) == [Segment(L(500), 0, RST, 0)]
    assert c.state == "SYN-RECEIVED"


def test_syn_payload_and_fin_are_ignored():
    c = new_conn()
    c.on_syn(syn(payload=b"early data", flags=SYN | FIN), 0.0)
    c.accept(0.0)
    assert recv(c) == [Segment(L(0), R(1), SYN | ACK, RCV_BUF, mss=MSS, wscale=0)]
    assert c.rcv_nxt == R(1) and not c.fin_received


def test_handshake_ack_carrying_data_and_fin():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    recv(c)
    send(c, seg(flags=ACK | PSH | FIN, payload=b"GET /"))
    assert c.state == "CLOSE-WAIT"
    assert events(c) == [("established",), ("fin",)]
    assert bytes(c.peek()) == b"GET /"
    assert recv(c) == [Segment(L(1), R(7), ACK, RCV_BUF - 5)]


def test_host_eof_before_handshake_completes():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    recv(c)
    c.send(b"bye")
    c.shutdown_write()
    send(c, seg())
    assert c.state == "FIN-WAIT-1"
    assert recv(c) == [Segment(L(1), R(1), ACK | PSH | FIN, RCV_BUF, b"bye")]


# ============================================================================ SYN-SENT (active open)


def test_active_open():
    c = new_conn()
    c.connect(0.0)
    assert c.state == "SYN-SENT"
    assert recv(c) == [Segment(L(0), 0, SYN, RCV_BUF, mss=MSS, wscale=0)]
    send(c, Segment(R(0), L(1), SYN | ACK, 65535, mss=1400, wscale=GWS), 0.25)
    assert c.state == "ESTABLISHED"
    assert events(c) == [("established",)]
    assert recv(c, 0.25) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    assert c.snd_wnd == 65535  # the SYN-ACK window is not scaled
    assert c.effective_mss == 1400
    assert c.srtt == 0.25
    send(c, seg(wnd=10))
    assert c.snd_wnd == 10 << GWS


def test_active_open_sends_data_queued_before_synack():
    c = new_conn()
    c.connect(0.0)
    recv(c)
    c.send(b"hello")
    send(c, Segment(R(0), L(1), SYN | ACK, 1000, mss=MSS, wscale=0))
    assert recv(c) == [Segment(L(1), R(1), ACK | PSH, RCV_BUF, b"hello")]


def test_active_open_guest_without_wscale_disables_scaling():
    c = new_conn(rcv_buf=1 << 20)
    c.connect(0.0)
    assert recv(c) == [Segment(L(0), 0, SYN, 65535, mss=MSS, wscale=5)]
    send(c, Segment(R(0), L(1), SYN | ACK, 8000))
    assert (c.snd_wscale, c.rcv_wscale) == (0, 0)
    assert recv(c) == [Segment(L(1), R(1), ACK, 65535)]
    send(c, seg(wnd=9000))
    assert c.snd_wnd == 9000
    assert c.effective_mss == 536


def test_active_open_rst_means_refused():
    c = new_conn()
    c.connect(0.0)
    recv(c)
    send(c, Segment(0, L(1), RST | ACK, 0))
    assert c.state == "CLOSED"
    assert c.reset is True
    assert events(c) == [("reset",), ("closed",)]


def test_active_open_ignores_rst_with_bad_ack_and_resets_bad_synack():
    c = new_conn()
    c.connect(0.0)
    recv(c)
    send(c, Segment(0, L(7), RST | ACK, 0))
    assert c.state == "SYN-SENT" and recv(c) == []
    send(c, Segment(R(0), L(7), SYN | ACK, 100))
    assert recv(c) == [Segment(L(7), 0, RST, 0)]
    assert c.state == "SYN-SENT"
    assert c.dropped_segments == 2


def test_active_open_syn_retransmits_then_gives_up():
    c = new_conn(max_retries=2)
    c.connect(0.0)
    first = recv(c)
    c.handle_timer(1.0)
    assert recv(c, 1.0) == first
    c.handle_timer(3.0)
    assert recv(c, 3.0) == first
    assert c.get_timer() == 7.0
    c.handle_timer(7.0)
    assert recv(c, 7.0) == [Segment(L(1), 0, RST, 0)]
    assert c.state == "CLOSED" and c.reset
    assert events(c) == [("reset",), ("closed",)]


def test_simultaneous_open():
    c = new_conn()
    c.connect(0.0)
    recv(c)
    send(c, syn())
    assert c.state == "SYN-RECEIVED"
    assert recv(c) == [Segment(L(0), R(1), SYN | ACK, RCV_BUF, mss=MSS, wscale=0)]
    send(c, seg())
    assert c.state == "ESTABLISHED"


# ============================================================================ ESTABLISHED: guest -> host


def test_receive_data_and_consume():
    c = established()
    send(c, seg(flags=ACK | PSH, payload=b"hello"))
    assert recv(c) == [Segment(L(1), R(6), ACK, RCV_BUF - 5)]
    assert bytes(c.peek()) == b"hello"
    assert c.bytes_received == 5
    c.consume(2)
    assert bytes(c.peek()) == b"llo"
    c.consume(3)
    assert c.peek() == b""
    assert recv(c) == []  # 5 bytes freed: below the SWS threshold, no update
    with pytest.raises(ValueError):
        c.consume(1)


def test_ack_coalescing():
    c = established()
    for i in range(5):
        send(c, seg(seq=R(1 + 100 * i), payload=X))
    assert recv(c) == [Segment(L(1), R(501), ACK, RCV_BUF - 500)]
    assert recv(c) == []


def test_ack_rides_on_data():
    c = established()
    send(c, seg(payload=X))
    c.send(b"reply")
    assert recv(c) == [Segment(L(1), R(101), ACK | PSH, RCV_BUF - 100, b"reply")]


def test_window_shrinks_then_update_after_consume():
    c = established()
    for i in range(4):
        send(c, seg(seq=R(1 + 15000 * i), payload=b"d" * 15000))
        assert recv(c) == [Segment(L(1), R(1 + 15000 * (i + 1)), ACK, RCV_BUF - 15000 * (i + 1))]
    assert c.rcv_wnd == 0
    # The guest probes the closed window with one byte: not accepted, re-ACKed.
    send(c, seg(seq=R(60001), payload=b"p"))
    assert recv(c) == [Segment(L(1), R(60001), ACK, 0)]
    assert c.bytes_received == 60000
    c.consume(1000)
    assert recv(c) == []  # 1000 < min(rcv_buf / 2, MSS): receiver SWS avoidance
    c.consume(1000)
    assert recv(c) == [Segment(L(1), R(60001), ACK, 2000)]
    c.consume(58000)
    assert recv(c) == [Segment(L(1), R(60001), ACK, RCV_BUF)]


def test_small_consume_does_not_move_the_edge():
    c = established()
    send(c, seg(payload=b"a" * 30000))
    assert recv(c) == [Segment(L(1), R(30001), ACK, 30000)]
    c.consume(1000)
    assert recv(c) == []  # window 30000 of 31000 possible: no update
    send(c, seg(seq=R(30001), payload=X))
    # The edge moved by 1000 >= min(30000, 1460)? No: 1000 < 1460, so the old edge stays.
    assert recv(c) == [Segment(L(1), R(30101), ACK, 29900)]
    c.consume(1000)
    send(c, seg(seq=R(30101), payload=X))
    assert recv(c) == [Segment(L(1), R(30201), ACK, 29900 - 100 + 2000)]


def test_never_accepts_data_beyond_window():
    c = established(rcv_buf=1000)
    send(c, seg(payload=b"z" * 1500))
    assert recv(c) == [Segment(L(1), R(1001), ACK, 0)]
    assert len(c.peek()) == 1000
    assert c.bytes_received == 1000
    send(c, seg(seq=R(1001), flags=ACK | FIN, payload=b"z" * 500))
    assert recv(c) == [Segment(L(1), R(1001), ACK, 0)]
    assert not c.fin_received


def test_fin_at_closed_window_edge_is_accepted():
    c = established(rcv_buf=1000)
    send(c, seg(payload=b"z" * 1000))
    assert recv(c) == [Segment(L(1), R(1001), ACK, 0)]
    send(c, seg(seq=R(1001), flags=ACK | FIN))
    assert c.fin_received and c.state == "CLOSE-WAIT"
    assert recv(c) == [Segment(L(1), R(1002), ACK, 0)]


def test_duplicate_data_is_reacked_not_duplicated():
    c = established()
    send(c, seg(payload=X))
    recv(c)
    send(c, seg(payload=X))
    assert recv(c) == [Segment(L(1), R(101), ACK, RCV_BUF - 100)]
    assert bytes(c.peek()) == X
    assert c.dropped_segments == 1


def test_partially_duplicate_segment_is_trimmed():
    c = established()
    send(c, seg(payload=b"a" * 100))
    send(c, seg(seq=R(51), payload=b"b" * 100))
    assert recv(c) == [Segment(L(1), R(151), ACK, RCV_BUF - 150)]
    assert bytes(c.peek()) == b"a" * 100 + b"b" * 50


def test_out_of_order_segment_is_held_until_the_hole_fills():
    c = established()
    send(c, seg(seq=R(101), payload=b"2" * 100))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]  # immediate duplicate ACK
    send(c, seg(seq=R(301), flags=ACK | FIN, payload=b"4" * 50))
    send(c, seg(seq=R(201), payload=b"3" * 100))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)] * 2  # one per out-of-order segment
    assert c.peek() == b""
    send(c, seg(seq=R(1), payload=b"1" * 100))
    assert recv(c) == [Segment(L(1), R(352), ACK, RCV_BUF - 350)]
    assert bytes(c.peek()) == b"1" * 100 + b"2" * 100 + b"3" * 100 + b"4" * 50
    assert c.fin_received and c.state == "CLOSE-WAIT"


def test_out_of_window_segment_gets_ack():
    c = established()
    send(c, seg(seq=R(200000), payload=X))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    send(c, seg(seq=R(-5000), payload=X))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    assert c.dropped_segments == 2
    assert c.peek() == b""


# ============================================================================ ESTABLISHED: host -> guest


def test_send_data_exact_fields():
    c = established()
    c.send(X)
    assert c.send_space == SND_BUF - 100
    assert recv(c) == [Segment(L(1), R(1), ACK | PSH, RCV_BUF, X)]
    assert (c.snd_una, c.snd_nxt, c.bytes_sent) == (L(1), L(101), 100)
    assert c.get_timer() == 0.2
    send(c, seg(ack=L(101)), 0.05)
    assert c.snd_una == L(101)
    assert c.send_space == SND_BUF
    assert c.get_timer() is None
    assert recv(c) == []  # a pure ACK needs no answer


def test_segmentation_at_effective_mss():
    c = established()
    data = bytes(range(256)) * 16  # 4096 bytes
    c.send(data)
    assert recv(c) == [
        Segment(L(1), R(1), ACK, RCV_BUF, data[:1460]),
        Segment(L(1461), R(1), ACK, RCV_BUF, data[1460:2920]),
        Segment(L(2921), R(1), ACK | PSH, RCV_BUF, data[2920:]),
    ]


def test_segmentation_at_guest_mss():
    c = established(syn_kw=dict(mss=1000))
    c.send(b"q" * 2500)
    assert [len(s.payload) for s in recv(c)] == [1000, 1000, 500]


def test_send_is_always_accepted_and_send_space_goes_negative():
    c = established(snd_buf=1000)
    c.send(b"a" * 3000)
    assert c.send_space == -2000
    recv(c)
    send(c, seg(ack=L(2921)))
    assert c.send_space == 1000 - 80


def test_window_full_stops_sending():
    c = established()
    send(c, seg(wnd=23))  # 23 << 7 = 2944 bytes
    c.send(b"w" * 5000)
    out = recv(c)
    assert out == [
        Segment(L(1), R(1), ACK, RCV_BUF, b"w" * 1460),
        Segment(L(1461), R(1), ACK, RCV_BUF, b"w" * 1460),
    ]  # 24 bytes of window left: held back (sender SWS avoidance)
    assert recv(c) == []
    send(c, seg(ack=L(1461), wnd=23))
    assert recv(c) == [Segment(L(2921), R(1), ACK, RCV_BUF, b"w" * 1460)]
    send(c, seg(ack=L(4381), wnd=23))
    assert recv(c) == [Segment(L(4381), R(1), ACK | PSH, RCV_BUF, b"w" * 620)]


def test_ack_of_unsent_data_is_answered_and_dropped():
    c = established()
    c.send(X)
    recv(c)
    send(c, seg(ack=L(5000), payload=b"ignored"))
    assert recv(c) == [Segment(L(101), R(1), ACK, RCV_BUF)]
    assert c.snd_una == L(1)
    assert c.peek() == b""
    assert c.dropped_segments == 1


def test_window_update_rule_ignores_older_segments():
    c = established()
    send(c, seg(seq=R(1), payload=X, wnd=100))
    assert c.snd_wnd == 100 << GWS
    send(c, seg(seq=R(1), wnd=5))  # older SEG.SEQ than SND.WL1: no window update
    assert c.snd_wnd == 100 << GWS
    send(c, seg(seq=R(101), wnd=5))
    assert c.snd_wnd == 5 << GWS


# ============================================================================ retransmission


def test_rtt_estimate_rfc6298():
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    recv(c)
    send(c, seg(), 0.5)
    assert (c.srtt, c.rttvar, c.rto) == (0.5, 0.25, 1.5)
    c.send(X)
    recv(c, 1.0)
    send(c, seg(ack=L(101)), 1.1)
    # RTTVAR = 3/4 * 0.25 + 1/4 * |0.5 - 0.1|, SRTT = 7/8 * 0.5 + 1/8 * 0.1, RTO = SRTT + 4 * RTTVAR
    assert c.rttvar == pytest.approx(0.2875)
    assert c.srtt == pytest.approx(0.45)
    assert c.rto == pytest.approx(1.6)


def test_rto_retransmits_with_exponential_backoff():
    c = established()
    c.send(X)
    first = recv(c)
    assert c.get_timer() == 0.2
    c.handle_timer(0.2)
    assert recv(c, 0.2) == first
    assert (c.rto, c.get_timer()) == (0.4, pytest.approx(0.6))
    t = c.get_timer()
    c.handle_timer(t)
    assert recv(c, t) == first
    assert (c.rto, c.get_timer()) == (0.8, pytest.approx(1.4))
    assert c.retransmitted_segments == 2
    send(c, seg(ack=L(101)), 1.0)
    assert c.get_timer() is None
    assert c.srtt == 0.0  # Karn: no sample from a retransmitted segment
    assert c.rto == 0.2  # progress clears the backoff (BSD)
    assert c.bytes_sent == 100


def test_rto_goes_back_and_slow_starts():
    c = established()
    c.send(b"s" * (5 * MSS))
    assert len(recv(c)) == 5
    c.handle_timer(0.2)
    assert recv(c, 0.2) == [Segment(L(1), R(1), ACK, RCV_BUF, b"s" * MSS)]  # cwnd = 1 MSS
    assert c.snd_nxt == L(1 + MSS) and c.snd_max == L(1 + 5 * MSS)
    send(c, seg(ack=L(1 + MSS)), 0.3)
    assert [s.seq for s in recv(c, 0.3)] == [L(1 + MSS), L(1 + 2 * MSS)]  # cwnd 2 MSS
    send(c, seg(ack=L(1 + 3 * MSS)), 0.4)
    # cwnd reached ssthresh (half the 5-segment flight): no limit any more
    assert [s.seq for s in recv(c, 0.4)] == [L(1 + 3 * MSS), L(1 + 4 * MSS)]
    assert c.bytes_sent == 5 * MSS
    assert c.retransmitted_segments == 5


def test_fast_retransmit_on_third_duplicate_ack():
    c = established()
    c.send(b"f" * (6 * MSS))
    assert len(recv(c)) == 6
    send(c, seg(ack=L(1 + MSS)))  # new ACK
    for _ in range(2):
        send(c, seg(ack=L(1 + MSS)))
        assert recv(c) == []
    send(c, seg(ack=L(1 + MSS)))
    assert recv(c) == [Segment(L(1 + MSS), R(1), ACK, RCV_BUF, b"f" * MSS)]
    send(c, seg(ack=L(1 + MSS)))  # a 4th duplicate does not retransmit again
    assert recv(c) == []
    send(c, seg(ack=L(1 + 3 * MSS)))  # partial ACK: the next hole goes out at once
    assert recv(c) == [Segment(L(1 + 3 * MSS), R(1), ACK, RCV_BUF, b"f" * MSS)]
    send(c, seg(ack=L(1 + 6 * MSS)))
    assert recv(c) == []
    assert c.get_timer() is None
    assert c.retransmitted_segments == 2


def test_window_change_is_not_a_duplicate_ack():
    c = established()
    c.send(b"f" * (4 * MSS))
    recv(c)
    for w in (500, 501, 502):
        send(c, seg(wnd=w))
    assert recv(c) == []


def test_max_retries_resets():
    c = established(max_retries=2)
    c.send(X)
    recv(c)
    for expect in (0.2, 0.6, 1.4):
        t = c.get_timer()
        assert t == pytest.approx(expect)
        c.handle_timer(t)
        out = recv(c, t)
    assert out == [Segment(L(101), R(1), RST | ACK, 0)]
    assert c.state == "CLOSED" and c.reset
    assert events(c) == [("reset",), ("closed",)]
    assert c.get_timer() is None


# ============================================================================ zero window / persist


def test_zero_window_persist_probes_and_reopen():
    c = established()
    send(c, seg(wnd=0))
    c.send(X)
    assert recv(c) == []
    assert c.get_timer() == 0.2
    probe = Segment(L(1), R(1), ACK, RCV_BUF, b"x")
    c.handle_timer(0.2)
    assert recv(c, 0.2) == [probe]
    assert c.get_timer() == pytest.approx(0.6)  # backoff doubles
    send(c, seg(wnd=0), 0.25)  # the guest answers the probe: still closed
    for expect_next in (1.4, 3.0):
        t = c.get_timer()
        c.handle_timer(t)
        assert recv(c, t) == [probe]
        assert c.get_timer() == pytest.approx(expect_next)
    assert c.state == "ESTABLISHED"  # probes never count as retransmission timeouts
    send(c, seg(wnd=GWND), 2.0)
    assert c.get_timer() is None
    assert recv(c, 2.0) == [Segment(L(1), R(1), ACK | PSH, RCV_BUF, X)]
    assert c.bytes_sent == 100


def test_zero_window_probe_byte_accepted():
    c = established()
    send(c, seg(wnd=0))
    c.send(X)
    recv(c)
    c.handle_timer(0.2)
    assert recv(c, 0.2) == [Segment(L(1), R(1), ACK, RCV_BUF, b"x")]
    send(c, seg(ack=L(2), wnd=0), 0.3)
    assert (c.snd_una, c.snd_nxt, c.snd_max) == (L(2), L(2), L(2))
    assert c.bytes_sent == 1
    send(c, seg(ack=L(2), wnd=1), 0.4)  # 1 << 7 = 128 bytes
    assert recv(c, 0.4) == [Segment(L(2), R(1), ACK | PSH, RCV_BUF, b"x" * 99)]


def test_unanswered_probes_give_up():
    c = established(max_retries=2)
    send(c, seg(wnd=0))
    c.send(X)
    recv(c)
    for _ in range(3):
        t = c.get_timer()
        c.handle_timer(t)
        out = recv(c, t)
    assert out == [Segment(L(1), R(1), RST | ACK, 0)]
    assert c.state == "CLOSED" and c.reset


# ============================================================================ closing


def test_guest_fin_close_wait_then_last_ack():
    c = close_wait()
    assert c.fin_received
    c.send(b"more")
    assert recv(c) == [Segment(L(1), R(2), ACK | PSH, RCV_BUF, b"more")]
    c.shutdown_write()
    assert c.state == "LAST-ACK"
    assert recv(c) == [Segment(L(5), R(2), ACK | FIN, RCV_BUF)]
    send(c, seg(seq=R(2), ack=L(5)))
    assert c.state == "LAST-ACK"
    send(c, seg(seq=R(2), ack=L(6)))
    assert c.state == "CLOSED"
    assert not c.reset
    assert events(c) == [("closed",)]


def test_data_after_guest_fin_is_ignored():
    c = close_wait()
    send(c, seg(seq=R(2), payload=b"late"))
    assert recv(c) == [Segment(L(1), R(2), ACK, RCV_BUF)]
    assert c.peek() == b""
    assert c.bytes_received == 0


def test_last_ack_fin_retransmitted_then_linger_bound():
    c = close_wait(linger=5.0)
    c.shutdown_write()
    fin = Segment(L(1), R(2), ACK | FIN, RCV_BUF)
    assert recv(c, 1.0) == [fin]
    c.handle_timer(1.2)
    assert recv(c, 1.2) == [fin]
    assert c.get_timer() == pytest.approx(1.6)
    c.handle_timer(1.6)
    c.handle_timer(2.4)
    c.handle_timer(4.0)
    recv(c, 4.0)
    c.handle_timer(6.0)  # 1.0 + linger
    assert recv(c, 6.0) == [Segment(L(2), R(2), RST | ACK, 0)]
    assert c.state == "CLOSED"


def test_host_eof_fin_after_data_to_time_wait():
    c = established(time_wait=1.0)
    c.send(X)
    c.shutdown_write()
    assert c.state == "FIN-WAIT-1"
    with pytest.raises(RuntimeError):
        c.send(b"no")
    assert recv(c) == [Segment(L(1), R(1), ACK | PSH | FIN, RCV_BUF, X)]
    send(c, seg(ack=L(101)))
    assert c.state == "FIN-WAIT-1"
    send(c, seg(ack=L(102)), 0.5)
    assert c.state == "FIN-WAIT-2"
    assert c.get_timer() == 60.5  # linger
    # The guest may keep sending in FIN-WAIT-2 (half-close).
    send(c, seg(ack=L(102), payload=b"still talking"), 1.0)
    assert recv(c, 1.0) == [Segment(L(102), R(14), ACK, RCV_BUF - 13)]
    assert c.get_timer() == 61.0  # guest activity restarts the linger bound
    send(c, seg(seq=R(14), ack=L(102), flags=ACK | FIN), 2.0)
    assert c.state == "TIME-WAIT"
    assert recv(c, 2.0) == [Segment(L(102), R(15), ACK, RCV_BUF - 13)]
    assert c.get_timer() == 3.0
    c.handle_timer(3.0)
    assert c.state == "CLOSED" and not c.reset
    assert events(c) == [("fin",), ("closed",)]
    assert bytes(c.peek()) == b"still talking"  # graceful close keeps acknowledged data


def test_fin_wait_1_with_ack_and_fin_together():
    c = fin_wait_1()
    send(c, seg(ack=L(2), flags=ACK | FIN), 0.0)
    assert c.state == "TIME-WAIT"
    assert recv(c) == [Segment(L(2), R(2), ACK, RCV_BUF)]


def test_simultaneous_close_closing():
    c = fin_wait_1()
    send(c, seg(ack=L(1), flags=ACK | FIN), 0.0)  # the guest's FIN crosses ours
    assert c.state == "CLOSING"
    assert recv(c) == [Segment(L(2), R(2), ACK, RCV_BUF)]
    send(c, seg(seq=R(2), ack=L(2)), 0.1)
    assert c.state == "TIME-WAIT"
    assert c.get_timer() == pytest.approx(1.1)


def test_fin_wait_2_linger_timeout():
    c = fin_wait_2(linger=10.0)
    assert c.get_timer() == 10.0
    c.handle_timer(10.0)
    assert recv(c, 10.0) == [Segment(L(2), R(1), RST | ACK, 0)]
    assert c.state == "CLOSED" and c.reset
    assert events(c) == [("reset",), ("closed",)]


def test_time_wait_reacks_retransmitted_fin_and_restarts():
    c = fin_wait_2()
    send(c, seg(ack=L(2), flags=ACK | FIN), 1.0)
    ack = Segment(L(2), R(2), ACK, RCV_BUF)
    assert recv(c, 1.0) == [ack]
    assert c.get_timer() == 2.0
    send(c, seg(ack=L(2), flags=ACK | FIN), 1.5)
    assert recv(c, 1.5) == [ack]
    assert c.get_timer() == 2.5
    c.handle_timer(2.5)
    assert c.state == "CLOSED"


def test_closed_connection_answers_with_rst():
    c = fin_wait_2()
    send(c, seg(ack=L(2), flags=ACK | FIN))
    c.handle_timer(100.0)
    assert c.state == "CLOSED"
    recv(c)
    send(c, seg(seq=R(2), ack=L(2), payload=X))
    assert recv(c) == [Segment(L(2), 0, RST, 0)]
    send(c, seg(seq=R(2), flags=RST))
    assert recv(c) == []


# ============================================================================ RST


def test_guest_rst_exact_resets():
    c = established()
    c.send(X)
    send(c, seg(flags=RST | ACK))
    assert c.state == "CLOSED" and c.reset
    assert events(c) == [("reset",), ("closed",)]
    assert recv(c) == []
    assert c.send_space == SND_BUF


def test_guest_rst_in_window_but_not_exact_gets_challenge_ack():
    c = established()
    send(c, seg(seq=R(500), flags=RST))
    assert c.state == "ESTABLISHED"
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]


def test_guest_rst_out_of_window_ignored():
    c = established()
    send(c, seg(seq=R(100000), flags=RST))
    send(c, seg(seq=R(-1), flags=RST))
    assert c.state == "ESTABLISHED"
    assert recv(c) == []
    assert c.dropped_segments == 2


def test_abort_sends_rst():
    c = established()
    c.send(X)
    recv(c)
    c.abort()
    assert recv(c) == [Segment(L(101), R(1), RST | ACK, 0)]
    assert c.state == "CLOSED" and c.reset
    assert events(c) == [("closed",)]
    c.send(b"ignored")
    assert recv(c) == []


def test_syn_in_established_gets_challenge_ack():
    c = established()
    send(c, syn(seq=R(77)))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    assert c.state == "ESTABLISHED"


# ============================================================================ wrap and garbage


def test_transfer_across_sequence_wrap():
    iss = irs = 2**32 - 10
    c = TcpConnection(iss=iss, mss=MSS, rcv_buf=RCV_BUF, snd_buf=SND_BUF, now=0.0)
    c.on_syn(Segment(irs, 0, SYN, 65535, mss=MSS), 0.0)
    c.accept(0.0)
    assert recv(c) == [Segment(iss, irs + 1, SYN | ACK, RCV_BUF, mss=MSS)]
    send(c, Segment(irs + 1, iss + 1, ACK, 65535))
    data = bytes(random.Random(1).randrange(256) for _ in range(10000))
    c.send(data)
    out = recv(c)
    assert [s.seq for s in out] == [(iss + 1 + i * MSS) & SEQ_MASK for i in range(7)]
    assert b"".join(s.payload for s in out) == data
    send(c, Segment(irs + 1, (iss + 1 + 10000) & SEQ_MASK, ACK, 65535))
    assert c.snd_una == 9991 and c.send_space == SND_BUF
    got = b""
    seq = irs + 1
    for i in range(0, 10000, 1000):
        send(c, Segment(seq & SEQ_MASK, 9991, ACK, 65535, data[i:i + 1000]))
        seq += 1000
        got += bytes(c.peek())
        c.consume(len(c.peek()))
    assert got == data
    assert c.rcv_nxt == 9991
    assert recv(c) == [Segment(9991, 9991, ACK, RCV_BUF)]


def test_garbage_segments_never_raise():
    c = established()
    before = c.dropped_segments
    send(c, seg(flags=0, payload=b"no ack flag"))
    assert recv(c) == [] and c.peek() == b""
    send(c, seg(flags=0xFF00 | ACK, seq=R(-3), wnd=0xFFFF))
    send(c, seg(flags=SYN | FIN | RST | PSH | ACK | 0x20, payload=b"all"))
    assert c.state == "CLOSED"  # RST at RCV.NXT wins
    assert c.dropped_segments == before + 2  # no-ACK segment, out-of-window segment
    assert events(c) == [("reset",), ("closed",)]
    assert recv(c) == []


@pytest.mark.parametrize("builder", [new_conn, established, fin_wait_1, fin_wait_2, close_wait])
def test_random_segments_never_raise(builder):
    rng = random.Random(1234)
    for _ in range(20):
        c = builder()
        if c.state in ("ESTABLISHED", "CLOSE-WAIT"):
            c.send(b"x" * 3000)
        t = 0.0
        for _ in range(150):
            t += rng.random() * 0.1
            near = rng.random() < 0.7
            s = Segment(
                R(rng.randrange(-100, 3000)) if near else rng.randrange(2**32),
                L(rng.randrange(-100, 3000)) if near else rng.randrange(2**32),
                rng.randrange(256),
                rng.randrange(65536),
                bytes(rng.randrange(0, 2000)),
                mss=rng.choice([None, 0, 1, 536, 65535]),
                wscale=rng.choice([None, 0, 14, 255]),
            )
            c.receive_segment(s, t)
            if rng.random() < 0.3:
                c.handle_timer(t)
            for out in c.segments_to_send(t):
                assert 0 <= out.seq <= SEQ_MASK and 0 <= out.ack <= SEQ_MASK and 0 <= out.wnd <= 0xFFFF
                assert len(out.payload) <= MSS
            if rng.random() < 0.2:
                c.consume(len(c.peek()))
        assert c.state in ("LISTEN", "SYN-RECEIVED", "ESTABLISHED", "FIN-WAIT-1", "FIN-WAIT-2", "CLOSE-WAIT",
                           "CLOSING", "LAST-ACK", "TIME-WAIT", "CLOSED")


def test_payload_views_are_released_on_next_call():
    c = established()
    c.send(b"abc")
    (s,) = c.segments_to_send(0.0)
    assert bytes(s.payload) == b"abc"
    c.send(b"def")
    with pytest.raises(ValueError):
        bytes(s.payload)
    view = c.peek()
    assert view == b""
    send(c, seg(payload=b"12"))
    view = c.peek()
    held = view[0:1]  # a derived view the connection cannot release
    send(c, seg(seq=R(3), payload=b"34"))
    assert bytes(held) == b"1"
    assert bytes(c.peek()) == b"1234"


def test_misuse_raises():
    c = new_conn()
    with pytest.raises(RuntimeError):
        c.accept(0.0)
    c.connect(0.0)
    with pytest.raises(RuntimeError):
        c.connect(0.0)
    with pytest.raises(ValueError):
        new_conn(mss=10)


# ============================================================================ simulation


@pytest.mark.parametrize(
    "seed, size, loss, jitter",
    [
        (20240607, 1 << 20, 0.10, 0.0),  # 1 MB each way, 10 % loss both ways
        (7, 1 << 18, 0.02, 0.004),  # jitter 4x the latency: heavy reordering, some loss
    ],
)
def test_simulated_bulk_transfer_both_ways_with_loss(seed, size, loss, jitter):
    rng = random.Random(seed)
    host_data = rng.randbytes(size)
    guest_data = rng.randbytes(size)
    stack = TcpConnection(iss=2**32 - 500_000, mss=MSS, rcv_buf=128 * 1024, snd_buf=64 * 1024, now=0.0)
    guest = TcpConnection(iss=2**32 - 700_000, mss=MSS, rcv_buf=256 * 1024, snd_buf=64 * 1024, now=0.0)
    to_stack = LossyWire(rng, loss, 0.001, jitter)
    to_guest = LossyWire(rng, loss, 0.001, jitter)
    stack_app = App(stack, host_data, rng)
    guest_app = App(guest, guest_data, rng)

    run_transfer(stack, guest, to_stack, to_guest, (stack_app, guest_app))
    assert stack.state == "CLOSED" and guest.state == "CLOSED", (stack, guest)
    assert not stack.reset and not guest.reset
    # Drain what the apps have not read yet (graceful close keeps it).
    stack_app.drain()
    guest_app.drain()
    assert hashlib.sha256(stack_app.received).digest() == hashlib.sha256(guest_data).digest()
    assert hashlib.sha256(guest_app.received).digest() == hashlib.sha256(host_data).digest()
    assert stack.bytes_sent == guest.bytes_received == size
    assert guest.bytes_sent == stack.bytes_received == size
    assert to_stack.lost > 0 and to_guest.lost > 0
    assert stack.retransmitted_segments > 0 and guest.retransmitted_segments > 0
