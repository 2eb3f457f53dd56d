"""The native TCP engine (aioslirp/native/tcpnat.c) driven through its binding with fake sockets and a
fake clock (``TcpEngine(..., fake=True)``): :class:`EngineFlow` plays the guest of one adopted flow
(frames built with dpkt, the engine's frames decoded) and the host peer behind its fake socket.

Sequence numbers start near the top of the 32-bit space (``IRS``, ``ISS``) so that every test
crosses the wrap.
"""

from __future__ import annotations

import errno
import socket
from typing import NamedTuple

import dpkt

from .frames import ACK, F4, F6, FIN, GUEST_MAC, GW_MAC, PSH, RST, SYN, tcp_frame
from .native import need_extension

IRS = 2**32 - 3000  # the guest's ISN
ISS = 2**32 - 1000  # the engine's
GPORT, DPORT = 40000, 8080
MTU = 1500


def M(n: int) -> int:
    """``n`` modulo 2**32: sequence-number arithmetic (RFC 9293 3.4)."""
    return n & 0xFFFFFFFF


def mss_of(v6: bool) -> int:
    """The engine's MSS towards the guest at :data:`MTU` (IPv4 or IPv6 and TCP headers taken off)."""
    return MTU - (60 if v6 else 40)


def pattern_data(n: int) -> bytes:
    """``n`` bytes of a repeating 251-byte pattern (a prime period: a shifted or lost run shows)."""
    return bytes(range(251)) * (n // 251) + bytes(n % 251)


class Seg(NamedTuple):
    """A segment the engine sent to the guest."""

    flags: int
    seq: int
    ack: int
    wnd: int
    payload: bytes
    opts: bytes

    @property
    def end(self) -> int:
        return (self.seq + len(self.payload) + (1 if self.flags & (SYN | FIN) else 0)) & 0xFFFFFFFF


def decode(frame: bytes, v6: bool) -> Seg:
    """One frame to the guest (no vnet header); its checksums are verified."""
    eth = dpkt.ethernet.Ethernet(frame)
    assert eth.dst == GUEST_MAC and eth.src == GW_MAC
    ip = eth.data
    t = ip.data
    raw = bytes(t)
    fam = F6 if v6 else F4
    from .frames import checksum_valid  # word-by-word sums, independent of aioslirp
    assert checksum_valid(ip.src, ip.dst, 6, raw), "bad TCP checksum"
    return Seg(t.flags, t.seq, t.ack, t.win, bytes(t.data), bytes(t.opts))


class EngineFlow:
    """One flow adopted by a fake engine; ``v6`` picks the family; ``rate_up`` / ``rate_down``: the
    engine's rate caps (bytes/s, 0 none); ``ack_delay``: the engine's delayed ACKs (seconds; 0, the
    engine's own default: each ACK at the end of the call that made it)."""

    def __init__(self, v6: bool = False, *, connect: int = 0, wscale: int | None = 7, wnd: int = 65535,
                 mss: int | None = 1460, max_flows: int = 16, idle: float = 60.0, linger: float = 1.0,
                 rcv_buf: int = 1 << 20, engine=None, gport: int = GPORT, rate_up: int = 0,
                 rate_down: int = 0, ack_delay: float = 0.0) -> None:
        ext = need_extension()
        self.v6 = v6
        self.fam = F6 if v6 else F4
        self.e = engine or ext.TcpEngine(-1, False, False, GW_MAC, MTU, max_flows, rcv_buf, idle, 10.0, linger,
                                          fake=True, rate_up=rate_up, rate_down=rate_down, ack_delay=ack_delay)
        self.e.fake_connect_mode(connect)
        self.gport = gport
        self.now = 0.0
        host = socket.inet_pton(self.fam.af, self.fam.loopback)
        self.status, self.slot, self.gen = self.e.adopt(
            v6, GUEST_MAC, self.fam.guest, gport, self.fam.gw, DPORT, host, DPORT, IRS, ISS,
            -1 if mss is None else mss, -1 if wscale is None else wscale, wnd, self.now)
        fds = self.e.fake_fds()
        self.fd = fds[-1] if fds else None
        self.records: list[tuple] = []

    # -- the guest
    def frame(self, flags: int, seq: int | None = None, ack: int | None = None, data: bytes = b"", win: int = 512,
              opts: bytes = b"") -> bytes:
        return tcp_frame(self.fam, self.gport, DPORT, flags, seq=IRS + 1 if seq is None else seq & 0xFFFFFFFF,
                         ack=(ISS + 1 if ack is None else ack) & 0xFFFFFFFF, data=data, win=win, opts=opts)

    def send(self, flags: int, seq: int | None = None, ack: int | None = None, data: bytes = b"", win: int = 512,
             at: float | None = None, csum_ok: bool = False) -> bool:
        """A guest segment in; True when the engine took it."""
        if at is not None:
            self.now = at
        return self.e.input(self.frame(flags, seq, ack, data, win), csum_ok, self.now)

    def out(self) -> list[Seg]:
        """The segments the engine sent to the guest since the last call."""
        return [decode(f, self.v6) for f in self.e.fake_frames()]

    # -- the clock and the host peer
    def poll(self, at: float) -> list[tuple]:
        self.now = at
        recs = self.e.poll(at)
        self.records += recs
        return recs

    def host_send(self, data: bytes) -> None:
        self.e.fake_host_send(self.fd, data, self.now)

    def host_eof(self) -> None:
        self.e.fake_host_eof(self.fd, self.now)

    def host_received(self) -> bytes:
        return self.e.fake_received(self.fd)

    def info(self):
        return self.e.info(self.slot, self.gen)

    def established(self) -> "EngineFlow":
        """Complete the handshake (the engine's SYN-ACK, the guest's ACK)."""
        (synack,) = self.out()
        assert synack.flags == SYN | ACK and synack.seq == ISS and synack.ack == (IRS + 1) & 0xFFFFFFFF
        assert self.send(ACK)
        assert self.out() == []
        assert self.info()[0] == "ESTABLISHED"
        return self


__all__ = ["ACK", "DPORT", "EngineFlow", "FIN", "GPORT", "IRS", "ISS", "PSH", "RST", "SYN", "Seg", "decode", "errno"]
