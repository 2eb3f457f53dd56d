"""TCP towards the guest, sans-IO: a connection fed segments and time, no socket, no loop.

=============== ===========================================================================
``connection``  :class:`~aioslirp.tcp.connection.TcpConnection`: the theory of operation and
                the user calls (``accept``, ``send``, ``consume``, ``abort``...)
``tcb``         its variables, the RFC 9293 state names, the events, the protocol constants
``arrival``     segment arrival (RFC 9293 3.10.7)
``output``      what goes out, and the timers (RFC 9293 3.8, RFC 6298, RFC 5681)
``buffers``     the send and receive byte queues
``seq``         32-bit sequence number arithmetic
=============== ===========================================================================

These are the modules the optional mypyc build compiles (:data:`aioslirp.compiled.COMPILED`,
with :mod:`aioslirp.wire.checksum` and :mod:`aioslirp.wire.tcp`). Segments, flag bits and
frames are the wire layer's (:mod:`aioslirp.wire.tcp`). The asyncio flow that drives a
connection and relays it to a host socket is :class:`~aioslirp.nat.tcp.TcpFlow` (:mod:`aioslirp.nat`).
"""
