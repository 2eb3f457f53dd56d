"""What IPv4 and IPv6 share: the upper-layer protocol numbers (IANA "Assigned Internet Protocol Numbers").

The same number names a protocol in the IPv4 Protocol field (RFC 791) and in the IPv6 Next
Header field (RFC 8200 section 3); :mod:`aioslirp.wire.ipv6` also calls them ``NH_TCP``,
``NH_UDP``, ``NH_ICMPV6`` next to the extension-header numbers only IPv6 has.
"""

from __future__ import annotations

__all__ = ["PROTO_ICMP", "PROTO_TCP", "PROTO_UDP", "PROTO_ICMPV6"]

PROTO_ICMP = 1  # RFC 792
PROTO_TCP = 6  # RFC 9293
PROTO_UDP = 17  # RFC 768
PROTO_ICMPV6 = 58  # RFC 4443
