"""TCP towards the guest: a sans-IO connection, and the flow that relays it to a host socket.

=============== ===========================================================================
``connection``  :class:`~aioslirp.tcp.connection.TcpConnection`: the theory of operation and
                the user calls (``accept``, ``send``, ``consume``, ``abort``...)
``tcb``         its variables, the RFC 9293 state names, the events, the protocol constants
``arrival``     segment arrival (RFC 9293 3.10.7)
``output``      what goes out, and the timers (RFC 9293 3.8, RFC 6298, RFC 5681)
``buffers``     the send and receive byte queues
``seq``         32-bit sequence number arithmetic
``flow``        :class:`~aioslirp.tcp.flow.TcpFlow` / ``ForwardedTcpFlow``: the asyncio glue
``hostsock``    the host side: connect, :class:`~aioslirp.tcp.hostsock.HostSocket`,
                ``TransportHost``, closing with an RST
``conn``        the old import path of the connection's names
=============== ===========================================================================

Segments, flag bits and frames are the wire layer's (:mod:`aioslirp.wire.tcp`).
"""
