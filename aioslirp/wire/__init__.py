"""The wire layer: protocol headers parsed from guest frames and built for the guest.

Contract (smoltcp's ``wire/mod.rs``, in Python):

* **parse** takes a buffer (``bytes``/``bytearray``/``memoryview``, usually the whole Ethernet
  frame and an offset) and returns either a parsed view or a **drop reason**. The view is a
  slotted object or tuple filled eagerly by one precompiled ``struct.Struct.unpack_from``
  (measured faster than lazy per-field properties); its payload is a ``memoryview`` slice of
  the caller's buffer, never a copy. After the length checks no accessor can fail. A drop
  reason is a ``str`` (``"ipv6_bad_length"``), counted by the caller as ``drop.<reason>``;
  where one reason is enough the parser returns ``None`` and the caller names it
  (:func:`~aioslirp.wire.tcp.parse_segment`: ``bad_tcp_header``). Guest input never raises.
* **emit** builds bytes: a whole frame (:class:`~aioslirp.wire.tcp.TcpFrameBuilder`) or an IP
  packet without Ethernet header (:func:`~aioslirp.wire.udp.build_udp`,
  :mod:`~aioslirp.wire.icmp` builders) in one ``bytearray``, checksums filled in.
* **no state, no clock, no I/O**: nothing here remembers a frame, reads the time or touches a
  socket. What keeps state lives above the wire layer (fragment reassembly:
  :mod:`aioslirp.dispatch.reassembly`). Left here for now: the identification counters of the
  datagrams we originate (:func:`~aioslirp.wire.ipv4.next_ident`,
  :func:`~aioslirp.wire.ipv6.next_ident6`), and one stateful helper that is to move up with
  the dispatch: :mod:`~aioslirp.wire.neighbors` (the neighbour caches). The ICMP error rate
  limit is :class:`aioslirp.ratelimit.TokenBucket`, which the dispatch holds.

One module per protocol, each defining its constants once:

=============== ===========================================================================
``ethernet``    Ethernet II header, EtherTypes
``arp``         ARP requests and replies (RFC 826)
``ip``          the protocol numbers IPv4 and IPv6 share
``ipv4``        IPv4 header, pseudo-header sum, fragmentation (RFC 791)
``ipv6``        IPv6 header, extension headers, fragmentation, addresses (RFC 8200, RFC 4291)
``tcp``         TCP flags, header, options, :class:`~aioslirp.wire.tcp.Segment`, RST for a
                segment no flow owns, the frame builder for both families (RFC 9293)
``udp``         UDP header and packets for both families (RFC 768)
``icmp``        ICMP and ICMPv6 types and codes, unreachable kinds, echo and error builders
                (RFC 792, RFC 4443, RFC 4861 types)
``checksum``    the Internet checksum (RFC 1071)
``offload``     virtio-net headers for checksum/segmentation offload
=============== ===========================================================================
"""
