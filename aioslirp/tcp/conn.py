"""Old import path of the sans-IO TCP endpoint: every name it had is importable from here.

The endpoint is :class:`~aioslirp.tcp.connection.TcpConnection` (the theory of operation is in
:mod:`aioslirp.tcp.connection`); its variables, states, events and constants are in
:mod:`aioslirp.tcp.tcb`, its buffers in :mod:`aioslirp.tcp.buffers`, and the segment and flag
bits in :mod:`aioslirp.wire.tcp`.
"""

from __future__ import annotations

from ..wire.tcp import ACK, FIN, PSH, RST, SYN, URG, Segment
from .buffers import ChunkQueue, SendQueue
from .connection import TcpConnection
from .tcb import (CLOCK_GRANULARITY, CLOSE_WAIT, CLOSED, CLOSING, DEFAULT_MSS, DUPACK_THRESHOLD, ESTABLISHED,
                  FIN_WAIT_1, FIN_WAIT_2, INITIAL_RTO, LAST_ACK, LISTEN, MAX_DUPACKS_OUT, MAX_OOO_SEGMENTS,
                  MAX_WSCALE, MIN_MSS, SYN_RECEIVED, SYN_SENT, SYN_TIMEOUT_RTO, TIME_WAIT, ClosedEvent,
                  EstablishedEvent, FinEvent, ResetEvent, TcpEvent)

__all__ = [
    "ACK", "FIN", "PSH", "RST", "SYN", "URG", "Segment", "TcpConnection", "SendQueue", "ChunkQueue",
    "LISTEN", "SYN_SENT", "SYN_RECEIVED", "ESTABLISHED", "FIN_WAIT_1", "FIN_WAIT_2", "CLOSE_WAIT",
    "CLOSING", "LAST_ACK", "TIME_WAIT", "CLOSED",
    "TcpEvent", "EstablishedEvent", "FinEvent", "ResetEvent", "ClosedEvent",
    "DEFAULT_MSS", "MIN_MSS", "MAX_WSCALE", "INITIAL_RTO", "SYN_TIMEOUT_RTO", "CLOCK_GRANULARITY",
    "DUPACK_THRESHOLD", "MAX_OOO_SEGMENTS", "MAX_DUPACKS_OUT",
]
