"""The native TCP engine's core (aioslirp/native/tcpnat.c) with fake sockets and a fake clock: the
lifecycle of one flow, segment by segment, for IPv4 and IPv6 (tests/support/native_tcp.py)."""

from __future__ import annotations

import errno

import pytest

from support.native_tcp import ACK, FIN, IRS, ISS, PSH, RST, SYN, EngineFlow, M

V = pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
REC_CONNECTED, REC_ENDED = 1, 2
OUT_CLOSED, OUT_RESET, OUT_REFUSED, OUT_UNREACHABLE, OUT_TIMEOUT, OUT_SHUTDOWN = 1, 2, 3, 4, 5, 6


def ended(f: EngineFlow) -> tuple:
    (rec,) = [r for r in f.records if r[2] == REC_ENDED]
    return rec


@V
def test_syn_ack_carries_mss_and_window_scale_and_the_handshake_completes(v6):
    f = EngineFlow(v6)
    assert f.status == 0  # connected at once
    (s,) = f.out()
    assert s.flags == SYN | ACK and s.seq == ISS and s.ack == M(IRS + 1)
    mss = 1500 - (60 if v6 else 40)
    assert s.opts == bytes([2, 4, mss >> 8, mss & 0xFF, 1, 3, 3, 5])  # MSS, NOP, WS 5 (1 MiB window)
    assert s.wnd == 65535
    f.send(ACK)
    assert f.info()[0] == "ESTABLISHED"


@V
def test_data_both_ways_is_acknowledged_as_the_socket_takes_it(v6):
    f = EngineFlow(v6).established()
    assert f.send(ACK | PSH, data=b"hello")
    assert f.host_received() == b"hello"
    (a,) = f.out()
    assert a.flags == ACK and a.ack == M(IRS + 6) and a.seq == M(ISS + 1) and a.payload == b""
    f.host_send(b"x" * 4000)
    segs = f.out()
    mss = 1500 - (60 if v6 else 40)
    assert [len(s.payload) for s in segs] == [mss, mss, 4000 - 2 * mss]
    assert [s.seq for s in segs] == [M(ISS + 1), M(ISS + 1 + mss), M(ISS + 1 + 2 * mss)]
    assert all(s.ack == M(IRS + 6) for s in segs) and segs[-1].flags == ACK | PSH
    f.send(ACK, seq=IRS + 6, ack=ISS + 1 + 4000)
    assert f.e.fake_socket(f.fd)["unread"] == 0  # consumed from the kernel queue on the ACK
    assert f.info()[2:4] == (5, 4000)


@V
def test_a_partial_send_acknowledges_only_what_was_taken_and_closes_the_window(v6):
    f = EngineFlow(v6).established()
    assert f.e.fake_socket(f.fd)["watch_out"] == 0  # connected at once: writability not watched
    f.e.fake_send_space(f.fd, 3, f.now)
    f.send(ACK, data=b"abcdef")
    assert f.host_received() == b"abc"
    assert f.e.fake_socket(f.fd)["watch_out"] == 1  # now it is: EPOLLOUT says when the window opens
    (a,) = f.out()
    assert a.ack == M(IRS + 4) and a.wnd == 0
    f.e.fake_send_space(f.fd, -1, f.now)  # writable again: EPOLLOUT
    (u,) = f.out()
    assert u.ack == M(IRS + 4) and u.wnd > 0  # the window update
    f.send(ACK, seq=IRS + 4, data=b"def")
    assert f.host_received() == b"def"


@V
def test_a_window_kept_small_by_a_slow_host_reader_is_watched_and_reopened(v6):
    """Our window is the host socket's room; while it is small and the host peer has bytes to read,
    a timer (1 ms, doubling) looks again and sends a window update when it grew."""
    f = EngineFlow(v6, rcv_buf=200_000).established()  # our window at most 200,000: shift 2
    f.e.fake_send_space(f.fd, 30000, 0.0)  # a host peer reading slowly: 30,000 bytes of room
    f.send(ACK, data=b"u" * 20000)
    (a,) = f.out()
    assert a.ack == M(IRS + 20001) and (a.wnd << 2) < 50_000  # no more room: the edge stays (never back)
    f.e.fake_send_space(f.fd, -1, 0.0)  # it read everything (no event says so: no send was refused)
    assert f.out() == []
    f.poll(0.0011)
    (u,) = f.out()
    assert u.ack == M(IRS + 20001) and (u.wnd << 2) >= 190_000
    assert f.e.counters()["window_updates"] == 1


@V
def test_out_of_order_and_old_data_are_dropped_with_a_duplicate_ack(v6):
    f = EngineFlow(v6).established()
    f.send(ACK, seq=IRS + 11, data=b"later")  # a gap before it
    f.send(ACK, seq=IRS - 100, data=b"old")
    assert f.host_received() == b""
    assert [s.ack for s in f.out()] == [M(IRS + 1)] * 2
    f.send(ACK, seq=IRS + 1, data=b"0123456789")
    f.send(ACK, seq=IRS + 6, data=b"56789ABC")  # overlaps what was taken: the new tail only
    assert f.host_received() == b"0123456789ABC"
    assert f.e.counters()["out_of_window"] == 2


@V
def test_retransmission_timeout_rewinds_with_backoff(v6):
    f = EngineFlow(v6).established()
    f.host_send(b"a" * 100)
    (d,) = f.out()
    f.poll(0.19)
    assert f.out() == []
    f.poll(0.21)
    (r1,) = f.out()
    assert r1.seq == d.seq and r1.payload == d.payload  # the same bytes again, peeked from the queue
    f.poll(0.5)
    assert f.out() == []  # backed off to 0.4 s
    f.poll(0.62)
    (r2,) = f.out()
    assert r2.seq == d.seq
    f.send(ACK, ack=ISS + 101, at=0.63)
    f.poll(5.0)
    assert f.out() == [] and f.e.counters()["rto"] == 2


@V
def test_three_duplicate_acks_retransmit_at_once(v6):
    f = EngineFlow(v6).established()
    f.host_send(b"b" * 3000)
    segs = f.out()
    f.send(ACK, ack=ISS + 1 + len(segs[0].payload))  # the first acknowledged: new data
    for _ in range(3):
        f.send(ACK, ack=ISS + 1 + len(segs[0].payload))
    out = f.out()
    assert out and out[0].seq == segs[1].seq and out[0].payload == segs[1].payload
    assert f.e.counters()["fast_retransmits"] == 1


@V
def test_a_zero_window_is_probed_and_data_resumes_when_it_opens(v6):
    f = EngineFlow(v6).established()
    f.send(ACK, win=0)
    f.host_send(b"c" * 500)
    assert f.out() == []
    f.poll(0.25)
    (probe,) = f.out()
    assert probe.payload == b"" and probe.seq == M(ISS)  # below snd_nxt: the guest must answer
    assert f.e.counters()["zero_window_probes"] == 1
    f.send(ACK, win=512, at=0.3)
    (d,) = f.out()
    assert d.payload == b"c" * 500 and d.seq == M(ISS + 1)


@V
def test_guest_window_bounds_what_is_in_flight(v6):
    f = EngineFlow(v6, wscale=None, wnd=1000).established()
    f.send(ACK, win=1000)
    f.host_send(b"d" * 5000)
    assert sum(len(s.payload) for s in f.out()) == 1000
    f.send(ACK, ack=ISS + 1 + 1000, win=1000)
    assert sum(len(s.payload) for s in f.out()) == 1000


@V
def test_half_close_guest_first_then_host(v6):
    f = EngineFlow(v6).established()
    f.send(ACK | FIN, data=b"req")
    assert f.host_received() == b"req" and f.e.fake_socket(f.fd)["shut_wr"] == 1
    (a,) = f.out()
    assert a.ack == M(IRS + 5)
    assert f.info()[0] == "CLOSE-WAIT"
    f.host_send(b"reply")
    f.host_eof()
    segs = f.out()
    assert segs[0].payload == b"reply" and segs[-1].flags & FIN and segs[-1].seq == M(ISS + 6)
    assert f.info()[0] == "LAST-ACK"
    f.send(ACK, seq=IRS + 5, ack=ISS + 7)
    f.poll(0.1)
    assert ended(f)[3] == OUT_CLOSED and ended(f)[6:] == (3, 5)
    assert f.e.fake_socket(f.fd)["closed"] == 1 and f.e.fake_socket(f.fd)["aborted"] == 0


@V
def test_host_closes_first_then_time_wait_then_a_new_syn_goes_to_python(v6):
    f = EngineFlow(v6, linger=30.0).established()
    f.host_send(b"bye")
    f.host_eof()
    segs = f.out()
    assert segs[-1].flags & FIN
    assert f.info()[0] in ("FIN-WAIT-1",)
    f.send(ACK, ack=ISS + 5)
    assert f.info()[0] == "FIN-WAIT-2"
    f.send(ACK | PSH, ack=ISS + 5, data=b"more")  # the guest may still send: half-close
    assert f.host_received() == b"more"
    f.send(ACK | FIN, seq=IRS + 5, ack=ISS + 5)
    assert f.info()[0] == "TIME-WAIT"
    f.send(ACK | FIN, seq=IRS + 5, ack=ISS + 5)  # its FIN again: acknowledged again
    assert [s.ack for s in f.out()][-1] == M(IRS + 6)
    assert not f.e.input(f.frame(SYN, seq=IRS + 100000, ack=0), False, 1.0)  # a new incarnation: not ours
    f.poll(1.0)
    assert ended(f)[3] == OUT_CLOSED


@V
def test_time_wait_lasts_a_second_after_the_guests_last_segment(v6):
    f = EngineFlow(v6).established()
    f.host_eof()
    f.out()
    f.send(ACK | FIN, seq=IRS + 1, ack=ISS + 2, at=0.5)
    assert f.info()[0] == "TIME-WAIT"
    f.send(ACK | FIN, seq=IRS + 1, ack=ISS + 2, at=1.2)  # again: TIME-WAIT starts over
    f.poll(2.1)
    assert f.info()[0] == "TIME-WAIT"
    f.poll(2.25)
    assert ended(f)[3] == OUT_CLOSED


@V
def test_linger_bounds_fin_wait_2_silence_and_last_ack_without_progress(v6):
    f = EngineFlow(v6, linger=3.0).established()
    f.host_eof()
    f.out()
    f.send(ACK, ack=ISS + 2, at=1.0)  # our FIN acknowledged: FIN-WAIT-2
    f.send(ACK, data=b"x", at=2.0)  # the guest still sends: not silent
    f.poll(4.9)
    assert f.info()[0] == "FIN-WAIT-2"
    f.poll(5.1)
    (rst,) = [s for s in f.out() if s.flags & RST]
    assert ended(f)[3:5] == (OUT_RESET, 6)
    g = EngineFlow(v6, linger=3.0, engine=f.e, gport=40001).established()
    g.send(ACK | FIN, at=6.0)  # the guest closes first: CLOSE-WAIT
    g.host_eof()  # ours goes out at 6.0: LAST-ACK, never acknowledged
    assert g.info()[0] == "LAST-ACK"
    g.poll(8.9)
    assert g.info()[0] == "LAST-ACK"
    g.poll(9.1)
    assert ended(g)[3:5] == (OUT_RESET, 6)


@V
def test_refused_connect_is_a_rst_ack_to_the_guest(v6):
    f = EngineFlow(v6, connect=errno.ECONNREFUSED)
    assert f.status == -errno.ECONNREFUSED
    (r,) = f.out()
    assert r.flags == RST | ACK and r.seq == 0 and r.ack == M(IRS + 1)
    f.poll(0.0)
    assert ended(f)[3:6] == (OUT_REFUSED, 5, errno.ECONNREFUSED)


@V
def test_connect_in_progress_then_done_or_timed_out(v6):
    f = EngineFlow(v6, connect=errno.EINPROGRESS)
    assert f.status == 1 and f.out() == []
    assert f.e.fake_socket(f.fd)["watch_out"] == 1  # the connect's end comes as writability
    assert f.send(SYN, seq=IRS, ack=0)  # its SYN again while connecting: taken, not answered
    assert f.out() == []
    f.e.fake_connect_done(f.fd, 0, 0.01)
    (s,) = f.out()
    assert s.flags == SYN | ACK
    assert f.poll(0.02)[0][2] == REC_CONNECTED
    g = EngineFlow(v6, connect=errno.EINPROGRESS, engine=f.e, gport=40001)
    g.poll(10.5)
    assert ended(g)[3:6] == (OUT_TIMEOUT, 5, errno.ETIMEDOUT)
    g2 = EngineFlow(v6, connect=errno.EINPROGRESS, engine=f.e, gport=40002)
    f.e.fake_connect_done(g2.fd, errno.EHOSTUNREACH, 11.0)
    g2.poll(11.0)
    assert ended(g2)[3:6] == (OUT_UNREACHABLE, 5, errno.EHOSTUNREACH)


@V
def test_resets_both_ways(v6):
    f = EngineFlow(v6).established()
    f.send(RST | ACK, seq=IRS + 1)
    f.poll(0.0)
    assert ended(f)[3:5] == (OUT_RESET, 1)
    assert f.e.fake_socket(f.fd)["aborted"] == 1  # the host peer sees a RST
    g = EngineFlow(v6, engine=f.e, gport=40001).established()
    g.host_send(b"zz")
    g.out()
    g.e.fake_host_reset(g.fd, 0.1)
    (r,) = g.out()
    assert r.flags & RST and r.seq == M(ISS + 3)
    g.poll(0.1)
    assert ended(g)[3:5] == (OUT_RESET, 2)


@V
def test_idle_timeout_resets_both_ways(v6):
    f = EngineFlow(v6, idle=5.0).established()
    f.poll(4.9)
    assert f.out() == []
    f.poll(5.1)
    (r,) = f.out()
    assert r.flags & RST
    assert ended(f)[3:5] == (OUT_TIMEOUT, 3)


@V
def test_close_flow_from_python(v6):
    f = EngineFlow(v6).established()
    assert f.e.close_flow(f.slot, f.gen, 0.5)
    (r,) = f.out()
    assert r.flags & RST
    f.poll(0.5)
    assert ended(f)[3] == OUT_SHUTDOWN
    assert not f.e.close_flow(f.slot, f.gen, 0.6)
    assert f.info() is None


def test_slots_are_reused_only_after_python_took_the_end_record():
    f = EngineFlow(max_flows=1).established()
    f.send(RST | ACK, seq=IRS + 1)
    g = EngineFlow(engine=f.e, gport=40001)
    assert g.status == -28  # -ENOSPC: the slot still holds the ended flow's record
    f.poll(0.0)
    g = EngineFlow(engine=f.e, gport=40002)
    assert g.status == 0 and (g.slot, g.gen) == (f.slot, f.gen + 1)


def test_the_same_tuple_cannot_be_adopted_twice():
    f = EngineFlow()
    g = EngineFlow(engine=f.e)
    assert g.status == -errno.EEXIST


@V
def test_records_takes_the_end_records_alone_without_running_timers(v6):
    """``records()`` (what the TAP reader's hook takes after a batch that ended flows): the records
    waiting, as ``poll()`` returns them, and nothing else: no socket event, no timer runs (a due
    retransmission of another flow waits for ``poll()``)."""
    f = EngineFlow(v6).established()
    other = EngineFlow(v6, engine=f.e, gport=41000)  # its SYN-ACK unacknowledged: a retransmission due later
    assert len(other.out()) == 1 and f.e.records() == []
    f.send(RST | ACK, seq=IRS + 1)
    (rec,) = f.e.records()
    assert rec[:4] == (f.slot, f.gen, REC_ENDED, OUT_RESET)
    assert f.e.records() == [] and other.out() == []  # taken once; no timer ran
    assert f.e.poll(5.0) == [] and [s.flags for s in other.out()] == [SYN | ACK]  # poll() runs them


@V
@pytest.mark.parametrize("when", ["connecting", "syn_received"])
def test_host_bytes_sent_before_the_handshake_completes_reach_the_guest(v6, when):
    """A host that speaks first (an SSH or SMTP banner) before the guest's handshake completed: its
    bytes go to the guest right after the guest's ACK, with no further host event (the socket's
    edge-triggered event came before; no ACK of the guest is needed to look again)."""
    f = EngineFlow(v6, connect=errno.EINPROGRESS)
    assert f.out() == []  # no SYN-ACK before the host connect completes
    if when == "connecting":
        f.host_send(b"SSH-2.0-x\r\n")
    f.e.fake_connect_done(f.fd, 0, 0.0)
    if when == "syn_received":
        f.host_send(b"SSH-2.0-x\r\n")
    (synack,) = f.out()
    assert synack.flags == SYN | ACK
    assert f.send(ACK)
    (seg,) = f.out()
    assert seg.payload == b"SSH-2.0-x\r\n" and seg.seq == M(ISS + 1)


def test_an_engine_whose_init_fails_closes_no_fd_it_does_not_own():
    """A TcpEngine refused at ``__init__`` (a bad argument) owns no fd: its dealloc closes none.
    (Its fd fields were zeroed memory: the refused engine closed fd 0, the process's stdin, and the
    next socket the process opened became fd 0, which libuv refuses to close: an abort at exit.)"""
    import gc
    import os

    from support.frames import GW_MAC
    from support.native import need_extension
    from support.native_tcp import MTU

    ext = need_extension()
    saved = os.dup(0)
    try:
        before = os.fstat(0)
        for bad in ({"rate_up": 1 << 62}, {"sink": object()}):
            with pytest.raises((ValueError, TypeError)):
                ext.TcpEngine(-1, False, False, GW_MAC, MTU, 4, 1 << 20, 60.0, 10.0, 1.0, fake=True, **bad)
        with pytest.raises(TypeError):
            ext.TcpEngine(-1, False)  # too few arguments
        gc.collect()
        after = os.fstat(0)  # OSError (EBADF) when fd 0 was closed
        assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
