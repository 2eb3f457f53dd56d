"""Sans-IO TCP endpoint: its limits and caps (the persist back-off, the 16-bit window, the
delayed-ACK thresholds, the default and constructor bounds), the cases the second mutation run
(over aioslirp/tcp/{tcb,arrival,output,connection,buffers}.py, see "Mutation testing" in
docs/testing.md) found untested.

Same shape as test_tcp_conn_edges.py: connections driven through the real handshake, guest
segments from templates, a fake clock, exact values compared. Each test names the rule it
pins down and the mutants it kills.
"""

from __future__ import annotations

import pytest

from aioslirp.tcp.connection import TcpConnection
from aioslirp.wire.tcp import ACK, FIN, PSH, RST, SYN, Segment

from support.tcp_conn import (ISS, L, MSS, R, RCV_BUF, SND_BUF, X, active, close_wait, established, events,
                              fin_wait_2, new_conn, recv, seg, send, syn)

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)


# ============================================================================ opening


def test_active_open_accepts_data_before_our_ack_went_out():
    """RFC 9293 3.10.7.3: after the guest's SYN-ACK, RCV.WND is what our SYN offered
    (min(rcv_buf, 65535)) at once, even before segments_to_send() sent our ACK: data that
    arrives in between is accepted whole. (Kills arrival _syn_sent_input ``rcv_nxt - window``.)"""
    c = active()
    assert c.rcv_wnd == RCV_BUF
    send(c, seg(payload=X))
    assert c.bytes_received == 100
    assert c.rcv_nxt == R(101)
    assert recv(c) == [Segment(L(1), R(101), ACK, RCV_BUF - 100)]


# ============================================================================ persist


def test_persist_interval_backoff_stops_at_2_to_the_16():
    """RFC 9293 3.8.6.1 probes back off exponentially; from the 16th doubling on the
    interval is rto_max (the shift is not taken further), even when rto * 2**16 < rto_max.
    (Kills output _persist_interval ``backoff <= 16`` and ``< 17``.)"""
    c = established(rto_min=0.001, rto_max=1000.0, max_retries=1)
    assert c.rto == 0.001
    send(c, seg(wnd=0))
    c.send(X)
    assert recv(c) == []
    gaps = []
    t = 0.0
    for _ in range(18):
        nxt = c.get_timer()
        gaps.append(round(nxt - t, 9))
        t = nxt
        c.handle_timer(t)
        assert recv(c, t) == [Segment(L(1), R(1), ACK, RCV_BUF, b"x")]
        send(c, seg(wnd=0), t)
    assert gaps[:16] == [round(0.001 * 2**k, 9) for k in range(16)]
    assert gaps[16:] == [1000.0, 1000.0]
    assert c.state == "ESTABLISHED"


# ============================================================================ receive window


def test_scaled_window_never_offers_more_than_the_buffer():
    """A guest that never fills the window exactly (each segment leaves one byte of it) while
    the host reads nothing: the window closes at rcv_buf. Rounding the scaled window field up
    past the buffer moved the edge right by up to 2**rcv_wscale - 1 bytes per ACK, for ever;
    RFC 7323 appendix F lets the receiver retract the window by less than 2**rcv_wscale
    instead, as long as it still accepts everything up to the edge it advertised."""
    c = established(rcv_buf=1 << 20)
    assert c.rcv_wscale == 5
    sent = 0
    for _ in range(3000):
        w = c.rcv_wnd
        if not w:
            break
        n = max(1, min(w - 1, 65000))
        send(c, seg(seq=R(1 + sent), payload=b"g" * n))
        sent += n
        assert c.bytes_received == sent  # everything up to the advertised edge is accepted
        for s in recv(c):
            assert s.ack == R(1 + sent)
            assert sent + (s.wnd << 5) <= 1 << 20  # never offered past the buffer
        assert c.recv_buffered <= 1 << 20
    assert c.rcv_wnd == 0
    assert (1 << 20) - 32 < sent <= 1 << 20
    send(c, seg(seq=R(1 + sent), payload=b"z"))
    assert c.bytes_received == sent
    assert recv(c) == [Segment(L(1), R(1 + sent), ACK, 0)]


def test_consume_returns_the_bytes_still_held():
    """consume(n) returns recv_pending after the n bytes are gone.
    (Kills connection consume ``held + n``.)"""
    c = established()
    send(c, seg(payload=b"a" * 300))
    assert c.consume(100) == 200
    assert c.consume(0) == 200
    assert c.consume(200) == 0
    assert c.recv_pending == 0


def test_fin_after_old_data_keeps_the_duplicate_acks_owed():
    """RFC 5681 4.2: one immediate duplicate ACK per out-of-order segment. A segment that
    brings no new in-order byte (old data ending at RCV.NXT, then the FIN) does not cancel
    the ones owed: two out-of-order segments, then that FIN, draw two ACKs.
    (Kills arrival _on_text ``n >= 0``.)"""
    c = established()
    send(c, seg(payload=X))
    assert recv(c) == [Segment(L(1), R(101), ACK, RCV_BUF - 100)]
    send(c, seg(seq=R(201), payload=X))
    send(c, seg(seq=R(301), payload=X))
    send(c, seg(seq=R(1), payload=X, flags=ACK | FIN))
    assert c.fin_received and c.state == "CLOSE-WAIT"
    assert c.bytes_received == 100
    assert recv(c) == [Segment(L(1), R(102), ACK, RCV_BUF - 100)] * 2


# ============================================================================ fast retransmit


def test_fast_retransmit_before_our_fin_went_out_carries_no_fin():
    """RFC 5681 3.2: the fast retransmit resends the first unacknowledged segment as it was.
    shutdown_write() queued our FIN, but it has not gone out yet: the retransmitted data
    carries no FIN; the FIN follows in its own segment. (Kills output _output
    ``fin_q or off_max > sqlen`` and ``off_max >= sqlen``.)"""
    c = established()
    c.send(X)
    assert recv(c) == [Segment(L(1), R(1), ACK | PSH, RCV_BUF, X)]
    c.shutdown_write()
    for _ in range(3):
        send(c, seg())
    assert recv(c) == [Segment(L(1), R(1), ACK | PSH, RCV_BUF, X), Segment(L(101), R(1), ACK | FIN, RCV_BUF)]
    assert c.retransmitted_segments == 1
    assert c.state == "FIN-WAIT-1"


# ============================================================================ counting and misuse


def test_ack_of_our_fin_in_last_ack_closes_and_returns():
    """RFC 9293 3.10.7.4 fifth check, LAST-ACK: "if our FIN is now acknowledged, delete the
    TCB, enter the CLOSED state, and return": the text the segment also carries is not looked
    at (not counted as dropped, nothing answered). (Kills arrival _on_ack ``return True``
    after the close.)"""
    c = close_wait()
    c.shutdown_write()
    assert recv(c) == [Segment(L(1), R(2), ACK | FIN, RCV_BUF)]
    send(c, seg(seq=R(2), ack=L(2), payload=b"late"))
    assert c.state == "CLOSED" and not c.reset
    assert c.dropped_segments == 0
    assert recv(c) == []
    assert events(c) == [("closed",)]


def test_rejected_ack_with_data_in_syn_received_is_counted_once():
    """SYN-RECEIVED before accept(): a segment with an ACK (and data) is dropped, and counted
    once, not again as text. (Kills arrival _on_ack_of_syn ``return True``.)"""
    c = new_conn()
    c.on_syn(syn(), 0.0)
    send(c, seg(payload=X))
    send(c, seg(payload=X, flags=ACK | FIN))
    assert c.dropped_segments == 2
    assert c.state == "SYN-RECEIVED" and c.bytes_received == 0
    assert recv(c) == []


def test_syn_retransmissions_are_each_counted():
    """RFC 6298 5.4: each retransmission timeout resends our SYN; each resent SYN counts.
    (Kills output _syn_sent ``retransmitted_segments = 1``.)"""
    c = new_conn()
    c.connect(0.0)
    assert [s.flags for s in recv(c)] == [SYN]
    for k in (1, 2, 3):
        t = c.get_timer()
        c.handle_timer(t)
        assert [(s.seq, s.flags) for s in recv(c, t)] == [(L(0), SYN)]
        assert c.retransmitted_segments == k


def test_accept_misuse_message_names_the_call_and_state():
    """(Kills connection accept ``RuntimeError(None)``.)"""
    c = established()
    with pytest.raises(RuntimeError, match=r"^accept\(\) in state ESTABLISHED$"):
        c.accept(0.0)


# ============================================================================ window update at the 16-bit cap


def test_window_update_needs_the_window_to_double_at_the_16_bit_cap():
    """Unscaled windows (the guest offered no window scale) are capped at 65535 bytes even
    when rcv_buf is larger. consume() schedules a window update only when the window at least
    doubles: 32768 -> 65535 does not; 32767 -> 65535 does. (Kills tcb _avail ``65536 << shift``
    and the cap removed.)"""
    for cur, update in ((32768, False), (32767, True)):
        c = new_conn(rcv_buf=70000)
        c.on_syn(syn(wscale=None), 0.0)
        c.accept(0.0)
        assert recv(c)[0].wnd == 65535
        send(c, seg(wnd=65535))
        assert c.rcv_wscale == 0
        held = 70000 - cur
        send(c, seg(payload=b"d" * held))
        assert recv(c) == [Segment(L(1), R(1 + held), ACK, cur)]  # the buffer's space, < 65535
        c.consume(held)
        assert c.rcv_wnd == cur
        if update:
            assert recv(c) == [Segment(L(1), R(1 + held), ACK, 65535)]
        else:
            assert recv(c) == []


# ============================================================================ on_syn, the SYN-ACK


def test_on_syn_in_listen_takes_only_a_bare_syn():
    """RFC 9293 3.10.7.2, when the glue hands the flow's first segment to on_syn(): a SYN
    with ACK (or RST), or a segment without SYN, is dropped and the state stays LISTEN; an
    ACK draws <SEQ=SEG.ACK><CTL=RST>. (Kills arrival on_syn ``... and not SYN``,
    ``RST & ACK`` and ``not flags | SYN``.)"""
    c = new_conn()
    c.on_syn(syn(flags=SYN | ACK, ack=L(9)), 0.0)
    assert c.state == "LISTEN"
    assert recv(c) == [Segment(L(9), 0, RST, 0)]
    c.on_syn(syn(flags=SYN | RST), 0.0)
    c.on_syn(syn(flags=FIN, payload=b"data"), 0.0)
    c.on_syn(syn(flags=0), 0.0)
    assert c.state == "LISTEN" and c.irs is None
    assert recv(c) == []
    assert c.dropped_segments == 4
    c.on_syn(syn(), 0.0)
    assert c.state == "SYN-RECEIVED" and c.irs == R(0)


def test_on_syn_records_the_unscaled_syn_window():
    """RFC 7323 2.2: the window of a SYN is never scaled: after on_syn() SND.WND is the
    SYN's window field as is, whatever shift the guest offers. (Kills arrival on_syn
    ``snd_wnd = None``.)"""
    c = new_conn()
    c.on_syn(syn(wnd=64240, wscale=7), 0.0)
    assert c.snd_wnd == 64240
    assert c.snd_wscale == 7


def test_passive_open_guest_wscale_zero_means_unscaled_windows():
    """RFC 7323 2.3: a window-scale option of 0 is scaling on with shift 0 (passive open).
    (Kills arrival on_syn ``max(seg.wscale, 1)``.)"""
    c = established(rcv_buf=1 << 20, syn_kw=dict(wscale=0))
    assert (c.snd_wscale, c.rcv_wscale) == (0, 5)
    send(c, seg(wnd=1000))
    assert c.snd_wnd == 1000


def test_on_syn_after_listen_is_receive_segment_at_that_time():
    """on_syn() outside LISTEN is receive_segment() with the same clock: a SYN in TIME-WAIT
    restarts TIME-WAIT from ``now`` and draws an ACK. (Kills arrival on_syn
    ``receive_segment(seg, None)``.)"""
    c = fin_wait_2()
    send(c, seg(ack=L(2), flags=ACK | FIN), 1.0)
    assert recv(c, 1.0) == [Segment(L(2), R(2), ACK, RCV_BUF)]
    assert c.state == "TIME-WAIT" and c.get_timer() == 2.0
    c.on_syn(syn(seq=R(5000)), 1.5)
    assert c.state == "TIME-WAIT" and c.get_timer() == 2.5
    assert recv(c, 1.5) == [Segment(L(2), R(2), ACK, RCV_BUF)]


def test_synack_window_is_at_most_65535():
    """RFC 7323 2.2: the SYN-ACK's window is not scaled, so it offers at most 65535 bytes even
    when rcv_buf (65536, shift 1) holds more. (Kills output segments_to_send ``w > 65536``.)"""
    c = new_conn(rcv_buf=65536)
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    assert recv(c) == [Segment(L(0), R(1), SYN | ACK, 65535, mss=MSS, wscale=1)]
    assert c.rcv_wnd == 65535


def test_no_ack_answers_the_handshake_ack():
    """Nothing may be sent in SYN-RECEIVED but the SYN-ACK; an output call while waiting for
    the guest's ACK owes nothing afterwards: the handshake ACK draws no ACK. (Kills output
    segments_to_send SYN-RECEIVED ``_ack_pending = True``.)"""
    c = new_conn()
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    assert [s.flags for s in recv(c)] == [SYN | ACK]
    assert recv(c) == []
    send(c, seg())
    assert c.state == "ESTABLISHED"
    assert recv(c) == []


# ============================================================================ probes, duplicate ACKs, window edge


def test_ack_beyond_the_probe_byte_is_unacceptable():
    """RFC 9293 3.10.7.4: an ACK of something not yet sent is dropped and answered with an
    ACK. The window probe sent one byte: an ACK of two is beyond it. (Kills output
    segments_to_send probe ``end = (seq + 1) | MASK`` and ``seq + 2``.)"""
    c = established()
    send(c, seg(wnd=0))
    c.send(b"y" * 10)
    assert recv(c) == []
    t = c.get_timer()
    c.handle_timer(t)
    assert recv(c, t) == [Segment(L(1), R(1), ACK, RCV_BUF, b"y")]
    send(c, seg(ack=L(3), wnd=0), t)
    assert c.dropped_segments == 1
    assert c.snd_una == L(1) and c.send_buffered == 10
    assert recv(c, t) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    send(c, seg(ack=L(2), wnd=0), t)
    assert c.snd_una == L(2) and c.send_buffered == 9 and c.bytes_sent == 1


def test_duplicate_acks_are_at_most_16_per_call_and_settle_the_ack_owed():
    """RFC 5681 4.2: one immediate duplicate ACK per out-of-order segment, at most
    MAX_DUPACKS_OUT (16) from one segments_to_send() call; they carry RCV.NXT, so no further
    ACK is owed. (Kills output segments_to_send the cap removed and ``_ack_pending = True``
    after the duplicates.)"""
    c = established()
    for i in range(20):
        send(c, seg(seq=R(101 + 200 * i), payload=X))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)] * 16
    assert recv(c) == []
    send(c, seg(seq=R(5001), payload=X))
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF)]
    assert recv(c) == []


def test_delayed_ack_count_starts_again_after_each_ack():
    """RFC 1122 4.2.3.2: the ACK at once comes at two full-sized segments (2 * (1460 - 40) =
    2840 bytes) received since our last ACK (none before the first data), counted from zero
    again after each ACK. (Kills output segments_to_send ``_rcv_unacked = 1``, connection
    __init__ ``_rcv_unacked = 1`` and ``2 * (mss - 41)``.)"""
    c = established(ack_delay=0.1)
    send(c, seg(payload=b"a" * 2839), 1.0)
    assert recv(c, 1.0) == []
    assert c.get_timer() == 1.0 + 0.1
    c.handle_timer(1.1)
    assert recv(c, 1.1) == [Segment(L(1), R(2840), ACK, RCV_BUF - 2839)]
    send(c, seg(seq=R(2840), payload=b"b" * 2839), 1.2)
    assert recv(c, 1.2) == []
    assert c.get_timer() == 1.2 + 0.1
    send(c, seg(seq=R(5679), payload=b"c"), 1.25)
    assert recv(c, 1.25) == [Segment(L(1), R(5680), ACK, RCV_BUF - 5679)]


def test_delayed_ack_threshold_is_at_most_16_kb():
    """With a large MSS (jumbo frames) the ACK at once still comes every 16384 bytes.
    (Kills connection __init__ ``16385``.)"""
    c = established(mss=9000, ack_delay=0.1)
    send(c, seg(payload=b"a" * 16383), 1.0)
    assert recv(c, 1.0) == []
    send(c, seg(seq=R(16384), payload=b"b"), 1.0)
    assert recv(c, 1.0) == [Segment(L(1), R(16385), ACK, RCV_BUF - 16384)]


def test_fast_retransmit_needs_three_duplicates_from_the_start():
    """RFC 5681 3.2: the third duplicate ACK triggers the fast retransmit, counted from the
    handshake on (two are not enough). (Kills connection __init__ ``_dupacks = 1``.)"""
    c = established()
    c.send(b"a" * 3000)
    assert [len(s.payload) for s in recv(c)] == [1460, 1460, 80]
    for _ in range(2):
        send(c, seg())
    assert recv(c) == []
    send(c, seg())
    assert recv(c) == [Segment(L(1), R(1), ACK, RCV_BUF, b"a" * 1460)]


def test_zero_window_from_the_handshake_ack_probes_after_the_persist_time():
    """RFC 9293 3.8.6.1: the guest's handshake ACK offers a zero window; host data then waits
    for the persist timer (no probe at once), and max_retries unanswered probes are sent
    before the connection gives up. (Kills connection __init__ ``_probe_pending = True``,
    ``_probes_unanswered = 1`` and ``None``.)"""
    c = new_conn(max_retries=2)
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    assert [s.flags for s in recv(c)] == [SYN | ACK]
    send(c, seg(wnd=0))
    assert c.state == "ESTABLISHED" and c.snd_wnd == 0
    c.send(X)
    assert recv(c) == []
    assert c.get_timer() == 0.2
    probes = []
    for _ in range(3):
        t = c.get_timer()
        c.handle_timer(t)
        probes.append((t, [(s.flags, bytes(s.payload)) for s in recv(c, t)]))
    assert [t for t, _ in probes] == pytest.approx([0.2, 0.6, 1.4])
    assert [out for _, out in probes] == [[(ACK, b"x")], [(ACK, b"x")], [(RST | ACK, b"")]]


def test_window_edge_moves_right_by_one_byte():
    """The right edge advertised is committed whenever it moves right, even by one byte: the
    guest's FIN takes one sequence number, the ACK of it offers the whole buffer again, and
    RCV.WND is what that ACK offered. (Kills output segments_to_send ``1 < edge - rcv_adv``.)"""
    c = close_wait()
    assert c.rcv_wnd == RCV_BUF


def test_default_max_retries_is_12():
    """RFC 9293 3.8.3 R2 / RFC 6298: by default the connection gives up after 12 retransmission
    timeouts in a row (then RST). (Kills connection __init__ ``max_retries = 13``.)"""
    c = TcpConnection(iss=L(0), mss=MSS, rcv_buf=RCV_BUF, snd_buf=1000, now=0.0)
    c.connect(0.0)
    assert [s.flags for s in c.segments_to_send(0.0)] == [SYN]
    for _ in range(12):
        t = c.get_timer()
        c.handle_timer(t)
        assert [s.flags for s in c.segments_to_send(t)] == [SYN]
    t = c.get_timer()
    c.handle_timer(t)
    assert [s.flags for s in c.segments_to_send(t)] == [RST]
    assert c.state == "CLOSED" and c.retransmitted_segments == 12


def test_default_rto_bounds():
    """RFC 6298 2.1 / 2.4 / 2.5 defaults: the first RTO is 1 s, it doubles up to rto_max = 60 s;
    an RTT sample of 0 gives rto_min = 0.2 s. (Kills connection __init__ ``rto_max = 61.0``.)"""
    c = TcpConnection(iss=L(0), mss=MSS, rcv_buf=RCV_BUF, snd_buf=1000, now=0.0)
    c.connect(0.0)
    c.segments_to_send(0.0)
    gaps = []
    t = 0.0
    for _ in range(9):
        nxt = c.get_timer()
        gaps.append(nxt - t)
        t = nxt
        c.handle_timer(t)
        c.segments_to_send(t)
    assert gaps == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    c = TcpConnection(iss=L(0), mss=MSS, rcv_buf=RCV_BUF, snd_buf=1000, now=0.0)
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    c.segments_to_send(0.0)
    c.receive_segment(seg(), 0.0)
    assert c.state == "ESTABLISHED" and c.rto == 0.2


@pytest.mark.parametrize("kw, message", [
    (dict(mss=63), r"^mss must be 64\.\.65535, got 63$"),
    (dict(mss=65536), r"^mss must be 64\.\.65535, got 65536$"),
    (dict(ack_delay=-0.001), r"^ack_delay must be 0\.\.0\.5 seconds, got -0\.001$"),
    (dict(ack_delay=0.501), r"^ack_delay must be 0\.\.0\.5 seconds, got 0\.501$"),
    (dict(max_segment=63), r"^max_segment must be 64\.\.65535, got 63$"),
    (dict(max_segment=65536), r"^max_segment must be 64\.\.65535, got 65536$"),
    (dict(rcv_buf=0), r"^rcv_buf must be >= 1 and snd_buf >= 0$"),
    (dict(snd_buf=-1), r"^rcv_buf must be >= 1 and snd_buf >= 0$"),
    (dict(rto_min=0.0), r"^need 0 < rto_min <= rto_max$"),
    (dict(rto_min=2.0, rto_max=1.0), r"^need 0 < rto_min <= rto_max$"),
])
def test_constructor_rejects_values_just_outside_the_bounds(kw, message):
    """(Kills connection __init__ bound checks moved by one, and their messages.)"""
    with pytest.raises(ValueError, match=message):
        new_conn(**kw)


@pytest.mark.parametrize("kw", [
    dict(mss=64), dict(mss=65535), dict(ack_delay=0.0), dict(ack_delay=0.5), dict(max_segment=64),
    dict(max_segment=65535), dict(rcv_buf=1), dict(snd_buf=0), dict(rto_min=1.0, rto_max=1.0),
])
def test_constructor_takes_the_bounds_themselves(kw):
    c = new_conn(**kw)
    for name, value in kw.items():
        assert getattr(c, name) == value
    assert c.state == "LISTEN"


def test_new_connection_status_before_any_segment():
    """The public status of a new connection (LISTEN), before any segment: every sequence
    variable at the ISS, no window either way, no RTT sample (RTO 1 s, RFC 6298 2.1), the
    default send MSS (536, RFC 9293 3.7.1) until the guest's MSS option is known.
    (Kills connection __init__ initial values replaced.)"""
    c = new_conn(now=7.5)
    assert c.state == "LISTEN"
    assert c.iss == c.snd_una == c.snd_nxt == c.snd_max == ISS
    assert c.irs is None
    assert (c.snd_wnd, c.rcv_nxt, c.rcv_wnd) == (0, 0, 0)
    assert c.fin_received is False and c.reset is False
    assert c.established_at is None and c.created_at == 7.5
    assert (c.bytes_received, c.bytes_sent, c.dropped_segments, c.retransmitted_segments) == (0, 0, 0, 0)
    assert c.srtt is None and c.rttvar == 0.0 and c.rto == 1.0
    assert c.effective_mss == 536
    assert (c.snd_wscale, c.rcv_wscale) == (0, 0)
    assert (c.send_buffered, c.recv_buffered, c.recv_pending, c.send_space) == (0, 0, 0, SND_BUF)
    assert not c.has_events and c.next_event() is None
    assert c.get_timer() is None
    assert c.peek() == b"" and c.peek_chunk() == b""
    assert repr(c) == f"<TcpConnection LISTEN snd_una={ISS} snd_nxt={ISS} snd_wnd=0 rcv_nxt=0 rcv_wnd=0>"
    assert new_conn(mss=500).effective_mss == 500
    assert TcpConnection(iss=2**32 + 5, mss=MSS, rcv_buf=1, snd_buf=0, now=0.0).iss == 5


def test_scaled_window_held_by_receiver_sws_is_not_rounded_up():
    """RFC 9293 3.8.6.2.2 receiver SWS avoidance: while the free space grew by less than
    min(rcv_buf / 2, MSS), the window offered is what is left of the last one, exactly when it
    is a multiple of 2**rcv_wscale (no rounding up by one unit). (Kills output _window_field
    ``(field >> shift) < cur``.)"""
    c = established(rcv_buf=1 << 20)
    send(c, seg(payload=b"a" * 64))
    assert recv(c) == [Segment(L(1), R(65), ACK, ((1 << 20) - 64) >> 5)]
    c.consume(64)
    assert recv(c) == []  # 64 more bytes free: below the SWS step, no window update
    send(c, seg(seq=R(65), payload=b"b" * 64))
    assert recv(c) == [Segment(L(1), R(129), ACK, ((1 << 20) - 128) >> 5)]
    assert c.rcv_wnd == (1 << 20) - 128


def test_scaled_window_rounds_up_when_the_buffer_has_exactly_the_room():
    """The field is rounded up (rather than retract the edge already advertised) whenever the
    rounded-up window fits the free space, also when it fills it exactly. (Kills output
    _window_field ``((field + 1) << shift) < avail``.)"""
    c = established(rcv_buf=1 << 20)
    send(c, seg(payload=b"a" * 64))
    assert recv(c) == [Segment(L(1), R(65), ACK, ((1 << 20) - 64) >> 5)]
    c.consume(1)
    assert recv(c) == []
    send(c, seg(seq=R(65), payload=b"b"))
    # 1048511 bytes left of the window, 1048512 free: rounding up to 32766 << 5 fits exactly.
    assert recv(c) == [Segment(L(1), R(66), ACK, 32766)]
    assert c.rcv_wnd == 32766 << 5 == (1 << 20) - c.recv_buffered
