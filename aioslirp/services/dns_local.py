"""Names the virtual DNS answers itself (``--dns-record``, ``NetworkConfig.dns_records``).

:class:`LocalRecords` turns a query for one of these names into an authoritative answer
(RFC 1035 4.1.1: QR, AA, RA set; opcode and RD copied) with its A (RFC 1035 3.4.1) or AAAA
(RFC 3596 2.2) records, TTL :data:`LOCAL_TTL` seconds, the name as a compression pointer to the
question (RFC 1035 4.1.4). A query for another type (or an A query for a name with IPv6
addresses only) gets NOERROR with no answer (NODATA, RFC 2308 2.2); ANY gets every address. When
the query carried an OPT RR (RFC 6891 6.1.1) the answer carries one too. No upstream is asked
and the egress policy's name denials do not apply (the names are the owner's own); the
addresses are bound to the name (:meth:`Egress.bind_answer
<aioslirp.flow.egress.Egress.bind_answer>`), so a name rule (``--allow
host.aioslirp.internal:8080``) opens them under ``--egress-default deny``.
"""

from __future__ import annotations

import struct

__all__ = ["LOCAL_TTL", "LocalRecords"]

#: Seconds the answers of local records may be cached (their TTL).
LOCAL_TTL = 60
_TYPE_A, _TYPE_AAAA, _TYPE_ANY, _CLASS_IN, _CLASS_ANY = 1, 28, 255, 1, 255
_EDNS_PAYLOAD = 1232


class LocalRecords:
    """The local names of one stack.

    Args:
        records: ``{name: (ipaddress addresses)}`` as :func:`~aioslirp.config.records.parse_dns_records`
            returns (names lower case, no trailing dot).
        ttl: seconds (default :data:`LOCAL_TTL`).
        host_side: ``{address text: host-side address text}`` for binding: the gateways map to
            the host's loopback (``127.0.0.1`` / ``::1``), as flows to them are decided.

    Attributes:
        by_wire: ``{lower-case wire name: [(rtype, rdata bytes, address text), ...]}``.
    """

    __slots__ = ("by_wire", "ttl", "host_side")

    by_wire: dict
    ttl: int
    host_side: dict

    def __init__(self, records: dict, ttl: int = LOCAL_TTL, host_side: dict | None = None) -> None:
        self.ttl = int(ttl)
        self.host_side = dict(host_side or {})
        self.by_wire = {}
        for name, addrs in records.items():
            wire = b"".join(bytes([len(lb)]) + lb.encode("ascii") for lb in name.split(".")) + b"\x00"
            self.by_wire[wire] = [(_TYPE_A if a.version == 4 else _TYPE_AAAA, a.packed, str(a)) for a in addrs]

    def __len__(self) -> int:
        return len(self.by_wire)

    def lookup(self, qname: bytes):
        """The records of ``qname`` (lower-case wire form), or ``None`` when it is not local."""
        return self.by_wire.get(qname)

    def answer(self, query: bytes, qend: int, question: tuple, edns: bool) -> tuple[bytes, list]:
        """``(response, [(host-side address text, ttl)...])`` for ``query`` (its single question
        ``question`` = ``(qname, qtype, qclass)`` ending at ``qend``) about a local name; the list
        is what to bind to the name (the addresses answered)."""
        qname, qtype, qclass = question
        recs = self.by_wire.get(qname, ())
        rrs = []
        bind = []
        if qclass in (_CLASS_IN, _CLASS_ANY):
            for rtype, rdata, text in recs:
                if qtype == rtype or qtype == _TYPE_ANY:
                    rrs.append(b"\xc0\x0c" + struct.pack("!HHIH", rtype, _CLASS_IN, self.ttl, len(rdata)) + rdata)
                    bind.append((self.host_side.get(text, text), self.ttl))
        qid, flags = struct.unpack_from("!HH", query, 0)
        flags = 0x8000 | (flags & (0x7800 | 0x0100)) | 0x0400 | 0x0080  # QR, opcode, AA, RD, RA; NOERROR
        out = struct.pack("!HHHHHH", qid, flags, 1, len(rrs), 0, 1 if edns else 0) + query[12:qend] + b"".join(rrs)
        if edns:
            out += b"\x00" + struct.pack("!HHIH", 41, _EDNS_PAYLOAD, 0, 0)
        return out, bind
