"""The virtual DNS under the egress policy: blocked answers (RFC 8914) and the addresses an answer binds.

* :func:`blocked_response` — NXDOMAIN for a name the policy denies, with an Extended DNS Error
  option (RFC 8914 section 2: OPT option code 15, INFO-CODE 15 "Blocked" or 18 "Prohibited",
  EXTRA-TEXT the rule) when the query carried an OPT RR (RFC 6891 6.1.1); the upstream is never asked.
* :func:`answer_addresses` — the A / AAAA addresses of an answer for the name asked, following
  its CNAME chain (RFC 1034 3.6.2), each with the smallest TTL along the chain (seconds).
* :func:`qname_text` — a wire-form name as lower-case text without the trailing dot.
* :func:`plain_name` — whether that text reads the name as the upstream does (no label holds a
  ``.``, a ``\\``, a space, a control or a non-ASCII byte): only such names are matched against
  rules or shown to the hook; any other is refused under the policy (:data:`ODD_NAME`).

Everything here is bounded: names are read with :func:`~aioslirp.services.dns.read_name`
(pointer loops and length checked), records at most the message's counts, CNAME hops at most
:data:`MAX_CNAME_HOPS`.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["EDE_BLOCKED", "EDE_PROHIBITED", "ODD_NAME", "answer_addresses", "blocked_response", "has_edns",
           "plain_name", "qname_text"]

#: RFC 8914 section 4.16 / 4.19: INFO-CODEs of a blocked and a prohibited query.
EDE_BLOCKED = 15
EDE_PROHIBITED = 18
OPTION_EDE = 15  # RFC 8914 section 2: the EDNS option code
RCODE_NXDOMAIN = 3
MAX_CNAME_HOPS = 16
_TYPE_A, _TYPE_CNAME, _TYPE_AAAA, _TYPE_OPT = 1, 5, 28, 41
_RR = struct.Struct("!HHIH")  # type, class, ttl, rdlength (RFC 1035 4.1.3)
#: UDP payload size we advertise in our own OPT RR (RFC 6891 6.2.5; the common 1232).
EDNS_PAYLOAD = 1232


#: The rule text (EXTRA-TEXT, audit ``rule``) of a name refused for its bytes (:func:`plain_name`).
ODD_NAME = "odd name (a label with '.', '\\', a space, a control or non-ASCII byte)"
#: Bytes a label may hold and still read the same as text: printable ASCII but '.' and '\\'.
_PLAIN = bytes(b for b in range(0x21, 0x7F) if b not in b".\\")


def plain_name(wire: bytes) -> bool:
    """True when every label of the wire-form name ``wire`` holds only printable ASCII other than
    ``.`` and ``\\``: then :func:`qname_text` reads the labels as the upstream does (a label
    ``b"x.pypi"`` under ``org`` would read ``"x.pypi.org"``, under the rule ``*.pypi.org``, though the
    upstream resolves it under ``org``; a NUL could end the name early for a resolver that keeps
    names as C strings). Malformed (a label running past the end): False."""
    off, end = 0, len(wire)
    while off < end and wire[off]:
        n = wire[off]
        label = wire[off + 1:off + 1 + n]
        if len(label) != n or label.translate(None, _PLAIN):
            return False
        off += 1 + n
    return off < end


def qname_text(wire: bytes) -> str:
    """``b"\\x04pypi\\x03org\\x00"`` -> ``"pypi.org"`` (bytes outside ASCII kept as escapes)."""
    labels = []
    off = 0
    while off < len(wire) and wire[off]:
        n = wire[off]
        labels.append(wire[off + 1:off + 1 + n].decode("ascii", "backslashreplace").lower())
        off += 1 + n
    return ".".join(labels)


def _records(msg: bytes, start: int, count: int, read_name):
    """Yield ``(owner_wire, type, ttl, rdata_offset, rdlength)`` of ``count`` records from ``start``."""
    off = start
    for _ in range(count):
        owner, off = read_name(msg, off)
        rtype, _rclass, ttl, rdlen = _RR.unpack_from(msg, off)
        off += 10
        if off + rdlen > len(msg):
            raise ValueError("record runs past the message")
        yield owner, rtype, ttl, off, rdlen
        off += rdlen


def has_edns(query: bytes, qend: int, read_name) -> bool:
    """True when ``query`` (its question ending at ``qend``) carries an OPT RR in its additional
    section (RFC 6891 6.1.1). Malformed records: False."""
    try:
        _, _, _, an, ns, ar = struct.unpack_from("!HHHHHH", query, 0)
        for i, (_o, rtype, _t, _off, _n) in enumerate(_records(query, qend, an + ns + ar, read_name)):
            if rtype == _TYPE_OPT and i >= an + ns:
                return True
    except (ValueError, struct.error):
        pass
    return False


def blocked_response(query: bytes, qend: int, code: int, text: str, edns: bool) -> bytes:
    """NXDOMAIN (RCODE 3) for ``query`` (ID, opcode, RD copied; RA set; its question, ending at
    ``qend``, echoed) with, when ``edns``, an OPT RR holding one Extended DNS Error option:
    INFO-CODE ``code`` (:data:`EDE_BLOCKED` / :data:`EDE_PROHIBITED`) and EXTRA-TEXT ``text``
    (UTF-8, at most 255 bytes)."""
    qid, flags = struct.unpack_from("!HH", query, 0)
    flags = 0x8000 | (flags & (0x7800 | 0x0100)) | 0x0080 | RCODE_NXDOMAIN
    out = struct.pack("!HHHHHH", qid, flags, 1, 0, 0, 1 if edns else 0) + query[12:qend]
    if edns:
        extra = text.encode("utf-8", "replace")[:255]
        option = struct.pack("!HHH", OPTION_EDE, 2 + len(extra), code) + extra
        out += b"\x00" + struct.pack("!HHIH", _TYPE_OPT, EDNS_PAYLOAD, 0, len(option)) + option
    return out


def answer_addresses(reply: bytes, qname: bytes, read_name, limit: int = 4096) -> list[tuple[str, int]]:
    """``[(address text, ttl seconds), ...]`` of the A / AAAA records of ``reply`` that answer
    ``qname`` (lower-case wire form) directly or through its CNAME chain, each TTL the smallest
    along the chain; at most ``limit`` records read. Malformed: what was read before the fault."""
    out: list[tuple[str, int]] = []
    try:
        _, flags, qd, an, _, _ = struct.unpack_from("!HHHHHH", reply, 0)
        if flags & 0x000F:
            return out
        off = 12
        for _ in range(qd):
            _, off = read_name(reply, off)
            off += 4
        cnames: dict = {}
        addrs: list = []
        for owner, rtype, ttl, roff, rdlen in _records(reply, off, min(an, limit), read_name):
            if rtype == _TYPE_CNAME:
                cnames[owner] = (read_name(reply, roff)[0], ttl)
            elif rtype == _TYPE_A and rdlen == 4:
                addrs.append((owner, socket.inet_ntop(socket.AF_INET, reply[roff:roff + 4]), ttl))
            elif rtype == _TYPE_AAAA and rdlen == 16:
                addrs.append((owner, socket.inet_ntop(socket.AF_INET6, reply[roff:roff + 16]), ttl))
    except (ValueError, struct.error):
        return out
    chain = {qname: 1 << 31}
    name, ttl = qname, 1 << 31
    for _ in range(MAX_CNAME_HOPS):
        nxt = cnames.get(name)
        if nxt is None or nxt[0] in chain:
            break
        name, ttl = nxt[0], min(ttl, nxt[1])
        chain[name] = ttl
    for owner, addr, rttl in addrs:
        cttl = chain.get(owner)
        if cttl is not None:
            out.append((addr, min(cttl, rttl)))
    return out
