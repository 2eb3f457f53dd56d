"""The asyncio side of every NAT flow: a guest's TCP, UDP and ICMP echo flows relayed to host
sockets, and the port forwards that make flows from the host.

=============== ===========================================================================
``tcp``         :class:`~aioslirp.nat.tcp.TcpFlow`: a sans-IO
                :class:`~aioslirp.tcp.connection.TcpConnection` driven by the loop and
                relayed to a host socket
``forwarded``   :class:`~aioslirp.nat.forwarded.ForwardedTcpFlow`: the TCP flow of a port
                forward, opened towards the guest
``hostsock``    the host side of a TCP flow: connect, :class:`~aioslirp.nat.hostsock.HostSocket`
                read through the stack's own epoll, ``TransportHost``, closing with an RST
``pacing``      :class:`~aioslirp.nat.pacing.FlowPacing`: the rate caps of a TCP flow and what
                it reports at its end
``datagram``    :class:`~aioslirp.nat.datagram.DatagramFlow`: what every UDP and echo flow does
                alike (no flush, the idle sweep's rule), and ``SocketFlow``, one with its own socket
``udp``         :class:`~aioslirp.nat.udp.UdpFlow`: one connected host socket per guest UDP flow
``icmp``        :class:`~aioslirp.nat.icmp.IcmpEcho`, the echo proxy, and its ``IcmpFlow``
``forward``     port forwards host -> guest: :class:`~aioslirp.nat.forward.Forwarder`,
                ``UdpForwardFlow``, ``ForwardError``
=============== ===========================================================================

Every flow here follows :class:`~aioslirp.flow.base.Flow` and lives in the stack's flow table; the
dispatch (:mod:`aioslirp.dispatch.l4`) or a forward makes it. The protocol work is below, sans-IO
(:mod:`aioslirp.tcp`, :mod:`aioslirp.wire`); nothing here imports the dispatch, the handlers, the
services or the stack (the import-linter contract in ``pyproject.toml``).
"""
