"""Delayed ACK and large (offload) segments of the sans-IO TCP endpoint (aioslirp.tcp.connection).

Same shape as test_tcp_conn.py (helpers in support/tcp_conn.py): a connection driven through the
real handshake, guest segments from templates, a fake clock.

* ``ack_delay`` (RFC 1122 4.2.3.2, RFC 9293 3.8.6.3): the pure ACK for in-order guest data
  waits up to ``ack_delay`` seconds so that host data can carry it; it goes at once for two
  full-sized segments, out-of-order data, a filled hole, old data, a window update the guest
  may be waiting for, and a FIN in FIN-WAIT-1/2; a FIN in ESTABLISHED waits like data so
  that our FIN can carry its ACK.
* ``max_segment`` (TCP segmentation offload): segments up to ``max_segment`` bytes, whole
  multiples of the effective MSS except the tail of the send buffer.
"""

from __future__ import annotations

import pytest

from aioslirp.tcp.connection import TcpConnection
from aioslirp.wire.tcp import ACK, FIN, PSH, Segment

from support.tcp_conn import L, MSS, R, RCV_BUF, X, events, recv, seg, send, syn

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

DELAY = 0.002


def established(**kw) -> TcpConnection:
    args = dict(iss=L(0), mss=MSS, rcv_buf=RCV_BUF, snd_buf=1 << 20, now=0.0, ack_delay=DELAY)
    args.update(kw)
    c = TcpConnection(**args)
    c.on_syn(syn(), 0.0)
    c.accept(0.0)
    assert [s.flags for s in recv(c)] == [0x12]
    send(c, seg())
    assert c.state == "ESTABLISHED"
    assert events(c) == [("established",)]
    return c


def test_small_segment_ack_waits_for_the_delay_then_goes_alone():
    c = established()
    send(c, seg(payload=X), 1.0)
    assert recv(c, 1.0) == []  # nothing yet: the ACK is delayed
    assert c.get_timer() == pytest.approx(1.0 + DELAY)
    c.handle_timer(1.0 + DELAY / 2)
    assert recv(c, 1.0 + DELAY / 2) == []
    c.handle_timer(1.0 + DELAY)
    assert recv(c, 1.0 + DELAY) == [Segment(L(1), R(101), ACK, RCV_BUF - 100)]
    assert c.get_timer() is None


def test_host_answer_within_the_delay_carries_the_ack():
    c = established()
    send(c, seg(payload=b"q"), 1.0)
    assert recv(c, 1.0) == []
    c.consume(1)  # the host socket took the byte: no window update due for 1 byte
    assert recv(c, 1.0) == []
    c.send(b"answer")
    out = recv(c, 1.0005)
    assert out == [Segment(L(1), R(2), ACK | PSH, RCV_BUF - 1, b"answer")]  # SWS: edge kept
    # the delayed ACK was paid by the data segment: only the retransmission timer is left
    assert c.get_timer() == pytest.approx(1.0005 + c.rto)
    c.handle_timer(1.0 + DELAY)
    assert recv(c, 1.0 + DELAY) == []


def test_two_full_sized_segments_are_acked_at_once():
    c = established()
    full = b"f" * (MSS - 12)  # full-sized with a 12-byte timestamp option's worth less
    send(c, seg(payload=full), 1.0)
    assert recv(c, 1.0) == []
    send(c, seg(seq=R(1 + len(full)), payload=full), 1.0)
    out = recv(c, 1.0)
    assert [(s.flags, s.ack) for s in out] == [(ACK, R(1 + 2 * len(full)))]
    assert c.get_timer() is None


def test_one_large_offloaded_segment_is_acked_at_once():
    c = established()
    send(c, seg(payload=b"g" * 20000), 1.0)  # a GSO super-segment from the guest's kernel
    assert [(s.flags, s.ack) for s in recv(c, 1.0)] == [(ACK, R(20001))]
    assert c.bytes_received == 20000


def test_out_of_order_and_hole_fill_are_acked_at_once():
    c = established()
    send(c, seg(seq=R(101), payload=X), 1.0)  # bytes 100..199 before 0..99
    assert recv(c, 1.0) == [Segment(L(1), R(1), ACK, RCV_BUF)]  # duplicate ACK at once
    send(c, seg(payload=X), 1.0)  # fills the hole
    out = recv(c, 1.0)
    assert [(s.flags, s.ack) for s in out] == [(ACK, R(201))]


def test_fin_in_established_ack_waits_and_rides_on_our_fin():
    c = established()
    send(c, seg(payload=X), 1.0)
    assert recv(c, 1.0) == []
    send(c, seg(seq=R(101), flags=ACK | FIN), 1.0)
    assert c.state == "CLOSE-WAIT" and ("fin",) in events(c)
    assert recv(c, 1.0) == []  # delayed: the host's EOF usually follows at once
    assert c.get_timer() == pytest.approx(1.0 + DELAY)
    c.shutdown_write()  # host EOF within the delay: one FIN|ACK acknowledges data and FIN
    assert [(s.flags, s.ack) for s in recv(c, 1.001)] == [(ACK | FIN, R(102))]
    assert c.state == "LAST-ACK"


def test_fin_in_established_ack_goes_alone_at_the_deadline():
    c = established()
    send(c, seg(seq=R(1), flags=ACK | FIN), 1.0)
    assert recv(c, 1.0) == []
    c.handle_timer(1.0 + DELAY)
    assert [(s.flags, s.ack) for s in recv(c, 1.0 + DELAY)] == [(ACK, R(2))]
    assert c.state == "CLOSE-WAIT" and c.get_timer() is None


def test_fin_after_hole_is_acked_at_once():
    c = established()
    send(c, seg(seq=R(101), payload=X), 1.0)  # out of order: a hole at R(1)
    assert [s.ack for s in recv(c, 1.0)] == [R(1)]
    send(c, seg(seq=R(1), payload=X), 1.0)  # fills the hole
    send(c, seg(seq=R(201), flags=ACK | FIN), 1.0)
    out = recv(c, 1.0)
    assert out and out[-1].ack == R(202) and c.state == "CLOSE-WAIT"


def test_fin_after_our_fin_is_acked_at_once():
    c = established()
    c.shutdown_write()
    assert [s.flags for s in recv(c, 1.0)] == [ACK | FIN]
    send(c, seg(ack=L(2)), 1.0)
    assert c.state == "FIN-WAIT-2"
    send(c, seg(flags=ACK | FIN, ack=L(2)), 1.1)
    assert [(s.flags, s.ack) for s in recv(c, 1.1)] == [(ACK, R(2))]
    assert c.state == "TIME-WAIT"


def test_old_data_again_is_acked_at_once():
    c = established()
    send(c, seg(payload=X), 1.0)
    c.handle_timer(1.0 + DELAY)
    assert len(recv(c, 1.0 + DELAY)) == 1
    send(c, seg(payload=X), 2.0)  # the guest did not see our ACK: it retransmits
    assert [(s.flags, s.ack) for s in recv(c, 2.0)] == [(ACK, R(101))]


def test_window_update_is_not_delayed():
    c = established(rcv_buf=4000)
    send(c, seg(payload=b"w" * 1000), 1.0)
    send(c, seg(seq=R(1001), payload=b"w" * 1000), 1.0)
    send(c, seg(seq=R(2001), payload=b"w" * 1000), 1.0)
    out = recv(c, 1.0)  # 3000 bytes >= two full segments of a 1460 MSS: ACK at once
    assert [(s.ack, s.wnd) for s in out] == [(R(3001), 1000)]
    c.consume(3000)  # the window can grow from 1000 to 4000: an update at once
    assert [(s.ack, s.wnd) for s in recv(c, 1.0)] == [(R(3001), 4000)]


def test_zero_delay_acks_at_once():
    c = established(ack_delay=0.0)
    send(c, seg(payload=X), 1.0)
    assert recv(c, 1.0) == [Segment(L(1), R(101), ACK, RCV_BUF - 100)]


def test_delay_is_cancelled_by_close():
    c = established()
    send(c, seg(payload=X), 1.0)
    c.abort()
    assert c.get_timer() is None


@pytest.mark.parametrize("bad", [-0.001, 0.6])
def test_ack_delay_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="ack_delay"):
        TcpConnection(iss=0, mss=MSS, rcv_buf=1000, snd_buf=1000, now=0.0, ack_delay=bad)


def test_max_segment_out_of_range_is_refused():
    with pytest.raises(ValueError, match="max_segment"):
        TcpConnection(iss=0, mss=MSS, rcv_buf=1000, snd_buf=1000, now=0.0, max_segment=70000)


# ---------------------------------------------------------------------------------- large segments


def test_large_segments_are_whole_multiples_of_the_mss():
    c = established(max_segment=65495)
    data = bytes(range(256)) * 800  # 204800 bytes; the guest offers 65536 (512 << 7)
    c.send(data)
    out = recv(c, 1.0)
    assert c.effective_mss == MSS
    # the guest's window (65536) allows 44 whole segments (64240 bytes) in one GSO frame
    assert [len(s.payload) for s in out] == [44 * MSS]
    assert bytes(out[0].payload) == data[:44 * MSS]
    send(c, seg(ack=L(1 + 44 * MSS), wnd=4096), 1.001)  # a 512 KB window now
    out = recv(c, 1.001)
    sizes = [len(s.payload) for s in out]
    assert sizes[:-1] == [44 * MSS] * (len(sizes) - 1) and sum(sizes) == len(data) - 44 * MSS
    assert out[-1].flags == ACK | PSH
    assert b"".join(bytes(s.payload) for s in out) == data[44 * MSS:]


def test_large_segment_tail_and_fin():
    c = established(max_segment=65495)
    c.send(b"z" * 5000)
    c.shutdown_write()
    out = recv(c, 1.0)
    assert [(len(s.payload), s.flags) for s in out] == [(5000, ACK | PSH | FIN)]


def test_after_a_timeout_one_mss_segment_is_resent():
    c = established(max_segment=65495)
    c.send(b"r" * 20000)
    assert [len(s.payload) for s in recv(c, 1.0)] == [20000]
    t = c.get_timer()
    c.handle_timer(t)
    out = recv(c, t)
    assert [(s.seq, len(s.payload)) for s in out] == [(L(1), MSS)]


def test_window_update_after_the_handshake_rides_the_delayed_ack():
    # The SYN-ACK could offer only 65535 (unscaled); the first consume() can offer 1 MB, but
    # the guest still has ~64 KB of window: the update waits for the delayed ACK (or data).
    c = established(rcv_buf=1 << 20)
    send(c, seg(payload=b"q"), 1.0)
    c.consume(1)
    assert recv(c, 1.0) == []
    c.handle_timer(1.0 + DELAY)
    (a,) = recv(c, 1.0 + DELAY)
    assert a.ack == R(2) and a.wnd << c.rcv_wscale >= (1 << 20) - 1024


# ---------------------------------------------------------------------------------- buffers


def test_peek_chunk_hands_out_pieces_without_copies():
    c = established()
    frame1 = b"HDR" + b"a" * 100  # as a TAP read: immutable bytes, the payload a view into it
    frame2 = b"HDR" + b"b" * 50
    send(c, seg(payload=memoryview(frame1)[3:]), 1.0)
    send(c, seg(seq=R(101), payload=memoryview(frame2)[3:]), 1.0)
    first = c.peek_chunk()
    assert first.obj is frame1 and bytes(first) == b"a" * 100  # the TAP's bytes, not a copy
    c.consume(60)
    assert bytes(c.peek_chunk()) == b"a" * 40
    assert bytes(c.peek()) == b"a" * 40 + b"b" * 50  # peek() joins what is left
    c.consume(90)
    assert c.peek_chunk() == b"" and c.peek() == b""
    mutable = bytearray(b"c" * 10)
    send(c, seg(seq=R(151), payload=memoryview(mutable)), 1.0)
    mutable[:] = b"x" * 10  # a reused buffer: the connection kept its own copy
    assert bytes(c.peek_chunk()) == b"c" * 10


def test_send_queue_views_across_host_reads():
    c = established(max_segment=65495)
    parts = [bytes([i]) * n for i, n in enumerate((700, 1500, 3000, 10))]  # four host reads
    for p in parts:
        c.send(p)
    out = recv(c, 1.0)
    assert b"".join(bytes(s.payload) for s in out) == b"".join(parts)
    send(c, seg(ack=L(1 + 2000)), 1.0)  # half of the second read acknowledged
    c.handle_timer(c.get_timer())  # RTO: resend from SND.UNA, one MSS
    (r,) = recv(c, 10.0)
    assert r.seq == L(2001) and bytes(r.payload) == (b"".join(parts))[2000:2000 + MSS]
