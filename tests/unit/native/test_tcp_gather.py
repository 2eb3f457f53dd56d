"""The native TCP engine's gather (tcpnat.c ``tn_frame_kept``): consecutive in-order guest segments of one
flow in one batch reach its host socket in one sendmsg, acknowledged only for what the socket took; any
other frame, a gap, a FIN or a RST sends the gather first. Driven through ``TcpEngine.input_batch`` with
fake sockets and a fake clock (tests/support/native_tcp.py); the TAP reader (``Plane.ready``) uses the
same path on its read buffer."""

from __future__ import annotations

import pytest

from support.native_tcp import ACK, FIN, IRS, PSH, RST, EngineFlow, M, pattern_data

V = pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])


def sends(f: EngineFlow) -> int:
    return f.e.fake_socket(f.fd)["sends"]


@V
def test_consecutive_segments_go_in_one_sendmsg_and_one_ack(v6):
    f = EngineFlow(v6).established()
    data = pattern_data(3 * 1000)
    frames = [f.frame(ACK | PSH, seq=IRS + 1 + i * 1000, data=data[i * 1000:(i + 1) * 1000]) for i in range(3)]
    assert f.e.input_batch(frames, False, f.now) == [True] * 3
    assert f.host_received() == data
    assert sends(f) == 1  # one sendmsg for the three
    assert f.e.counters()["gathered"] == 3
    (a,) = f.out()  # one ACK, after the socket took them
    assert a.flags == ACK and a.ack == M(IRS + 1 + 3000)


@V
def test_a_partial_sendmsg_acknowledges_the_prefix_and_the_guest_resends_the_rest(v6):
    f = EngineFlow(v6).established()
    f.e.fake_send_space(f.fd, 1500, f.now)
    data = pattern_data(3000)
    frames = [f.frame(ACK, seq=IRS + 1 + i * 1000, data=data[i * 1000:(i + 1) * 1000]) for i in range(3)]
    f.e.input_batch(frames, False, f.now)
    assert f.host_received() == data[:1500]
    (a,) = f.out()
    assert a.ack == M(IRS + 1 + 1500) and a.wnd == 0  # the window closes until EPOLLOUT
    assert f.e.counters()["host_write_paused"] == 1
    f.e.fake_send_space(f.fd, -1, f.now)
    (u,) = f.out()
    assert u.ack == M(IRS + 1501) and u.wnd > 0
    # the guest resends from the ACK: the same bytes, once
    f.e.input_batch([f.frame(ACK, seq=IRS + 1501, data=data[1500:])], False, f.now)
    assert f.host_received() == data[1500:]


def test_two_flows_interleaved_keep_each_ones_bytes_in_order():
    a = EngineFlow(False).established()
    b = EngineFlow(False, engine=a.e, gport=40001).established()
    da, db = pattern_data(4000), bytes(reversed(pattern_data(4000)))

    def seg(f: EngineFlow, d: bytes, i: int) -> bytes:
        return f.frame(ACK, seq=IRS + 1 + i * 1000, data=d[i * 1000:(i + 1) * 1000])

    order = [(a, da, 0), (b, db, 0), (a, da, 1), (a, da, 2), (b, db, 1), (b, db, 2), (b, db, 3), (a, da, 3)]
    assert all(a.e.input_batch([seg(*x) for x in order], False, a.now))
    assert a.host_received() == da and b.host_received() == db
    assert sends(a) == 3 and sends(b) == 2  # runs of one flow: [0], [1, 2], [3]; [0], [1, 2, 3]
    assert a.e.counters()["gathered"] == 5


@V
def test_a_gap_sends_the_gather_then_drops_the_segment_after_it(v6):
    f = EngineFlow(v6).established()
    frames = [f.frame(ACK, seq=IRS + 1, data=b"a" * 100), f.frame(ACK, seq=IRS + 101, data=b"b" * 100),
              f.frame(ACK, seq=IRS + 301, data=b"d" * 100)]  # 201..300 lost
    f.e.input_batch(frames, False, f.now)
    assert f.host_received() == b"a" * 100 + b"b" * 100
    assert f.e.counters()["out_of_window"] == 1
    assert {s.ack for s in f.out()} == {M(IRS + 201)}


@V
def test_a_fin_after_data_in_one_batch_delivers_the_data_then_the_eof(v6):
    f = EngineFlow(v6).established()
    frames = [f.frame(ACK, seq=IRS + 1, data=b"x" * 500), f.frame(ACK, seq=IRS + 501, data=b"y" * 500),
              f.frame(ACK | FIN, seq=IRS + 1001)]
    f.e.input_batch(frames, False, f.now)
    assert f.host_received() == b"x" * 500 + b"y" * 500
    assert f.e.fake_socket(f.fd)["shut_wr"] == 1
    assert [s.ack for s in f.out()] == [M(IRS + 1002)]  # data and FIN, one ACK


@V
def test_a_rst_after_data_sends_the_data_then_resets(v6):
    f = EngineFlow(v6).established()
    frames = [f.frame(ACK, seq=IRS + 1, data=b"x" * 500), f.frame(RST, seq=IRS + 501)]
    f.e.input_batch(frames, False, f.now)
    assert f.host_received() == b"x" * 500
    sock = f.e.fake_socket(f.fd)
    assert sock["closed"] == 1 and sock["aborted"] == 1
    assert f.info() is None or f.info()[0] != "ESTABLISHED"


@V
def test_a_segment_past_our_window_ends_the_gather_at_the_edge(v6):
    f = EngineFlow(v6, rcv_buf=4096).established()  # our window: 4096 bytes
    data = pattern_data(6000)
    frames = [f.frame(ACK, seq=IRS + 1 + i * 1500, data=data[i * 1500:(i + 1) * 1500]) for i in range(4)]
    f.e.input_batch(frames, False, f.now)
    got = f.host_received()
    assert got == data[:len(got)] and len(got) <= 4096  # a prefix, never past the window
    assert f.e.counters()["out_of_window"] >= 1
