"""DNS over TCP at the virtual DNS address (RFC 1035 4.2.2, RFC 7766).

:class:`DnsTcpHost` stands where a host socket would for a :class:`~aioslirp.tcp.flow.TcpFlow`
to DNS:53: it takes the guest's byte stream, splits it into 2-byte-length-prefixed
messages, forwards each through the :class:`~aioslirp.services.dns.DnsForwarder` and
answers in order. It offers the subset of ``asyncio.Transport`` the flow uses.
"""

from __future__ import annotations

import asyncio
import logging

from .dns import DnsTcpSession

log = logging.getLogger("aioslirp.dns")


class DnsTcpHost:
    """Transport-like DNS responder for one guest TCP connection."""

    def __init__(self, flow, forwarder) -> None:
        self.flow = flow
        self.forwarder = forwarder
        self.session = DnsTcpSession()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.task = asyncio.get_running_loop().create_task(self._answer(), name="aioslirp-dns-tcp")
        flow.stack.tasks.add(self.task)
        self.task.add_done_callback(flow.stack.tasks.discard)

    async def _answer(self) -> None:
        while True:
            msg = await self.queue.get()
            if msg is None:
                if not self.closed:
                    self.flow.eof_received()
                return
            reply = await self.forwarder.resolve(msg, tcp=True)
            if self.closed:
                return
            if reply:
                self.flow.stack.counters["dns_queries_tcp"] += 1
                self.flow.data_received(DnsTcpSession.frame(reply))

    # --- the asyncio.Transport subset used by TcpFlow
    def write(self, data) -> None:
        try:
            msgs = self.session.feed(bytes(data))
        except ValueError:
            self.flow.stack.drop("dns_tcp_bad_framing")
            self.abort()
            return
        for m in msgs:
            self.queue.put_nowait(m)

    def send(self, data) -> int:
        """Take all of ``data`` (the :class:`~aioslirp.tcp.hostsock.HostSocket` interface)."""
        self.write(data)
        return len(data)

    def get_extra_info(self, name, default=None):
        return default

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.queue.put_nowait(None)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        self.queue.put_nowait(None)

    def abort(self) -> None:
        self.closed = True
        self.task.cancel()
