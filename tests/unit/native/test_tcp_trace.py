"""The native TCP engine's trace points (aioslirp/native/tcpnat.c, ``tn_trace_*``) with fake sockets:
off by default (no record, no ring), on with ``TcpEngine.trace(capacity)`` they write fixed-size
records into a bounded ring, in the order things happened, that ``trace_take()`` drains; a full
ring drops new records and counts them (``trace_overflow``), never grows."""

from __future__ import annotations

import errno

from support.native import need_extension
from support.native_tcp import ACK, GW_MAC, MTU, PSH, SYN, EngineFlow

FRAME, SYN_ACK, DRAIN, WAKE, EVENT = 1, 2, 3, 4, 5
ESTABLISHED, GUEST_DATA, HOST_DATA, SYN_ACK_SENT, DATA_SENT = 1, 2, 3, 10, 11  # enum tn_flow_event


def _engine(trace: int = 0):
    ext = need_extension()
    e = ext.TcpEngine(-1, False, False, GW_MAC, MTU, 16, 1 << 20, 60.0, 10.0, 1.0, fake=True)
    if trace:
        e.trace(trace)
    return e


def _kinds(records) -> list:
    return [(r[0], r[5], r[6], r[7]) for r in records]  # type, a, b, c


def test_off_by_default_no_record_is_written():
    e = _engine()
    f = EngineFlow(engine=e).established()
    f.send(ACK | PSH, data=b"hi")
    f.host_send(b"x" * 100)
    assert e.trace_take() == ([], 0)
    assert e.counters()["trace_overflow"] == 0


def test_records_say_what_happened_in_order_with_their_counts():
    e = _engine(64)
    e.fake_connect_mode(errno.EINPROGRESS)
    f = EngineFlow(engine=e, connect=errno.EINPROGRESS)
    assert f.status == 1 and e.trace_take() == ([], 0)  # connecting: nothing sent yet
    e.fake_connect_done(f.fd, 0, 0.004)  # the host connect completes 4 ms later (fake clock)
    recs, overflow = e.trace_take()
    assert overflow == 0
    # the socket's wake-up: one event, the SYN-ACK written while running it; the SYN-ACK point
    # (4000 us of host connect, not at once); then its drain: one frame of this flow
    assert [r[0] for r in recs] == [SYN_ACK, EVENT, WAKE, DRAIN]  # (the event: the SYN-ACK written)
    syn_ack, sent, wake, drain = recs
    assert syn_ack[1:3] == (f.slot, f.gen) and syn_ack[5] == 4000 and syn_ack[6] == 0
    assert sent[1:3] == (f.slot, f.gen) and sent[5] == SYN_ACK_SENT
    assert wake[1:3] == (f.slot, f.gen) and (wake[5], wake[6], wake[7]) == (1, 0, 1)  # its one frame: this flow's
    assert drain[1:3] == (f.slot, f.gen) and (drain[5], drain[6]) == (1, 0)
    assert f.out()[0].flags == SYN | ACK
    assert f.send(ACK)  # completes the handshake: one frame processed, nothing queued
    assert f.send(ACK | PSH, data=b"hello")  # data: its ACK leaves at the flush, not in the frame
    recs, _ = e.trace_take()
    # each frame's flow events (timeline) come before its own record, written when it was done
    assert _kinds(recs) == [(EVENT, ESTABLISHED, 0, 0), (FRAME, 54, 0, 0), (EVENT, GUEST_DATA, 5, 0),
                            (FRAME, 59, 0, 0), (DRAIN, 1, 0, 0)]
    assert [r[8] for r in recs if r[0] == FRAME] == [ACK, ACK | PSH]  # the frames' TCP flags
    assert all(r[1:3] == (f.slot, f.gen) for r in recs)
    assert [s.flags for s in f.out()] == [ACK]  # the drained frame
    f.host_send(b"y" * 4000)  # three segments to the guest from one socket event
    recs, _ = e.trace_take()
    assert _kinds(recs) == [(EVENT, HOST_DATA, 4000, 0), *[(EVENT, DATA_SENT, n, 0) for n in (1460, 1460, 1080)],
                            (WAKE, 1, 0, 3), (DRAIN, 3, 0, 0)]
    ts = [r[3] for r in recs]
    assert ts == sorted(ts) and all(r[4] < 10**9 for r in recs)  # monotonic ns; durations in ns
    assert len(f.out()) == 3


def test_a_full_ring_drops_new_records_and_counts_them():
    e = _engine(4)
    f = EngineFlow(engine=e).established()  # SYN-ACK, EVENT (sent), DRAIN, EVENT (established): 4 of 4
    for _ in range(5):
        f.send(ACK)
    recs, overflow = e.trace_take()
    assert [r[0] for r in recs] == [SYN_ACK, EVENT, DRAIN, EVENT]  # the oldest four kept
    assert overflow == 6 and e.counters()["trace_overflow"] == 6  # the handshake's FRAME and five more
    f.send(ACK)  # room again
    recs, overflow = e.trace_take()
    assert [r[0] for r in recs] == [FRAME] and overflow == 6


def test_trace_off_again_frees_the_ring_and_a_bad_capacity_is_refused():
    import pytest

    e = _engine(8)
    f = EngineFlow(engine=e)
    e.trace(0)
    f.send(ACK)
    assert e.trace_take() == ([], 0)
    with pytest.raises(ValueError, match="capacity"):
        e.trace(1 << 21)
