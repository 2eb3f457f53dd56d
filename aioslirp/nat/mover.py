"""The mover seam of a TCP flow: who moves its bytes to and from the host, as two typed interfaces.

A :class:`~aioslirp.nat.tcp.TcpFlow` keeps the guest-facing state machine (a sans-IO
:class:`~aioslirp.tcp.connection.TcpConnection`) and hands the bytes to a *mover*, its
``transport``, which moves them to and from the host side. The flow talks to it through
:class:`HostMover` only, and the mover answers through :class:`MoverFlow` only (asyncio's
transport / protocol split, as passt's ``tcp_buf.c`` and ``tcp_vu.c`` sit behind one interface
for ``tcp.c``). The movers today:

=============================================== ==============================================================
:class:`~aioslirp.nat.hostsock.HostSocket`      a connected host socket read through the stack's epoll
                                                (connection set-up, request/response traffic)
:class:`~aioslirp.nat.hostsock.TransportHost`   an asyncio (uvloop) transport, for bulk flows
                                                (``TcpFlow.request_upgrade``)
``services.dns_tcp.DnsTcpHost``                 the DNS service, for a flow to the DNS address's port 53
``handlers.streams.TcpHandlerHost``             a Python handler's reader and writer
=============================================== ==============================================================

**This is where the native data path of issue 26 plugs in:** an established flow adopted by the
native engine gets a mover of its own that follows :class:`HostMover` (the flow keeps calling
``send`` / ``write_eof`` / ``pause_reading``... while the bytes move in C) and calls the flow back
through :class:`MoverFlow` when it hands the flow back. Nothing else in the flow changes.

Both are :class:`typing.Protocol`: a mover does not subclass anything (``DnsTcpHost`` and
``TcpHandlerHost`` live on floors that do not import this one); ``tests/package/test_types.py`` has mypy
check that each of the four follows :class:`HostMover`.
"""

from __future__ import annotations

from typing import Protocol, Union, runtime_checkable

from ..tcp.connection import TcpConnection

__all__ = ["Bytes", "HostMover", "MoverFlow"]

#: What a mover is handed to send: a chunk of the connection's receive queue, or a slice of one.
Bytes = Union[bytes, bytearray, memoryview]


@runtime_checkable
class HostMover(Protocol):
    """The host side of one TCP flow, as the flow drives it (``TcpFlow.transport``).

    Exactly the calls :class:`~aioslirp.nat.tcp.TcpFlow` makes; none raises for an I/O error (a
    failure reaches the flow as ``connection_lost(exc)``, :class:`MoverFlow`).
    """

    def send(self, data: Bytes) -> int:
        """Take what the host side accepts of ``data`` now; returns that many bytes (0..len(data)).
        Short of ``len(data)``, the mover calls ``pause_writing`` and later ``resume_writing``;
        the flow keeps the rest in the connection (its receive window closes)."""
        ...

    def can_write_eof(self) -> bool:
        """Whether :meth:`write_eof` is supported (a half close towards the host)."""
        ...

    def write_eof(self) -> None:
        """The guest's FIN: shut the write side towards the host (the other direction stays open)."""
        ...

    def pause_reading(self) -> None:
        """Stop delivering host bytes (``data_received``): the connection's send buffer is full, or a
        rate cap is in debt."""
        ...

    def resume_reading(self) -> None:
        """Deliver host bytes again."""
        ...

    def close(self) -> None:
        """Close the host side gracefully (a FIN to the host peer after what is written)."""
        ...

    def abort(self) -> None:
        """Close the host side at once (an RST to the host peer)."""
        ...


class MoverFlow(Protocol):
    """The flow as a mover calls it back: asyncio's protocol callbacks, plus what a
    :class:`~aioslirp.nat.hostsock.HostSocket` asks of it (:class:`~aioslirp.nat.tcp.TcpFlow`)."""

    @property
    def key(self) -> tuple:
        """The flow-table key (for log lines)."""
        ...

    @property
    def conn(self) -> TcpConnection:
        """The sans-IO connection: a read is sized by its ``send_space``."""
        ...

    def data_received(self, data: bytes) -> None:
        """Bytes from the host for the guest."""
        ...

    def eof_received(self) -> bool:
        """The host peer shut down its write side (reading has stopped)."""
        ...

    def connection_lost(self, exc: BaseException | None) -> None:
        """The host side is closed: ``exc`` the error, or ``None`` (a clean end)."""
        ...

    def pause_writing(self) -> None:
        """The host side takes no more for now (:meth:`HostMover.send` was short)."""
        ...

    def resume_writing(self) -> None:
        """The host side has room again."""
        ...

    def request_upgrade(self) -> None:
        """Bulk traffic: the flow may move to an asyncio transport (:class:`~aioslirp.nat.hostsock.TransportHost`)."""
        ...

    def failed_internally(self) -> None:
        """A callback into the flow raised: count it and end the flow alone."""
        ...
