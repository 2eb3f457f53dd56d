"""The native TCP engine's gather (tcpnat.c ``tn_frame_kept`` / ``tn_gather_flush``) against a
guest (and a host peer) that end a flow while its payload waits in the gather.

frame_in() looked up the frame's flow, then sent the gather first (a pure ACK, a FIN or a RST of
the gather's own flow ends it); when that sendmsg failed (the host peer had reset the connection,
not yet seen by epoll) the flow was aborted there: RST to the guest, the flow ended. frame_in then
went on with the ended flow: take_ack() on it queued an ACK (ack_later), which linked the ended
flow into the ACK list a second time (finish() leaves it linked, its ACK_DUE cleared): the list
became a loop's prefix and the flows linked behind it were cut off with ACK_DUE still set, so
another flow's ACK was never sent, nor any later one (ack_later() saw ACK_DUE and did nothing): its
guest's upload stalled for good. And an ACK of the ended flow went to the guest after its RST.

Fake sockets and clock (tests/support/native_tcp.py); ``fake_host_reset(fd, now, False)``: the
socket fails before the engine polls it."""

from __future__ import annotations

import struct

from support.native_tcp import ACK, IRS, ISS, PSH, RST, EngineFlow, M, pattern_data


def _to_port(frames: list[bytes], port: int) -> list[tuple[int, int, int]]:
    """(flags, seq, ack) of the IPv4 frames sent to guest port ``port``."""
    out = []
    for f in frames:
        t = f[14 + 20:]
        if struct.unpack_from("!H", t, 2)[0] == port:
            out.append((t[13], struct.unpack_from("!I", t, 4)[0], struct.unpack_from("!I", t, 8)[0]))
    return out


def test_a_flow_ended_by_its_gather_flush_is_not_processed_further_nor_cuts_the_ack_list():
    a = EngineFlow(False).established()
    b = EngineFlow(False, engine=a.e, gport=40001).established()
    c = EngineFlow(False, engine=a.e, gport=40002).established()
    e = a.e
    e.fake_frames()
    e.fake_host_reset(a.fd, a.now, False)  # a's host peer is gone; epoll has not said so yet
    dc = pattern_data(100)
    bad = M(ISS + 1000)  # acknowledges what was never sent: answered with an ACK (ack_later)
    frames = [
        c.frame(ACK | PSH, seq=IRS + 1, data=dc),  # c's gather
        a.frame(ACK, ack=bad),  # c's gather sent (c's ACK queued); a's ACK queued
        b.frame(ACK, ack=bad),  # b's ACK queued: b, a, c
        a.frame(ACK | PSH, seq=IRS + 1, data=b"to a dead host"),  # a's gather
        a.frame(ACK, ack=bad),  # sends a's gather: the sendmsg fails, a is reset and ends
    ]
    e.input_batch(frames, False, a.now)
    out = e.fake_frames()
    to_a, to_c = _to_port(out, a.gport), _to_port(out, c.gport)
    assert c.host_received() == dc
    assert (ACK, M(ISS + 1), M(IRS + 1 + len(dc))) in to_c, to_c  # c's data acknowledged
    assert to_a and to_a[-1][0] & RST, to_a  # nothing of a after its RST
    assert a.info() is None or a.info()[0] != "ESTABLISHED"
    # c goes on: its next segment is acknowledged too
    e.input_batch([c.frame(ACK | PSH, seq=IRS + 1 + len(dc), data=dc)], False, a.now)
    assert (ACK, M(ISS + 1), M(IRS + 1 + 2 * len(dc))) in _to_port(e.fake_frames(), c.gport)
    assert c.host_received() == dc
