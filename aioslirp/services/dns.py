"""DNS forwarder behind the virtual DNS address (``config.dns``, 10.0.2.3 by default).

* :func:`read_resolv_conf` — the host's upstreams from ``resolv.conf``.
* :class:`DnsForwarder` — forwards one DNS message (RFC 1035) to the upstreams over UDP,
  failing over on timeout or error, retrying over TCP (RFC 7766) when the answer is
  truncated and the guest asked over TCP, answering SERVFAIL when every upstream failed.
* :class:`DnsTcpSession` — splits a DNS-over-TCP byte stream into messages (RFC 1035
  section 4.2.2: each message is preceded by a two-byte big-endian length).

Spoofing resistance: every upstream attempt uses a new UDP socket (a fresh kernel-chosen,
randomised source port) and a fresh random message ID; replies are accepted only when
ID and question (qname case-insensitively, qtype, qclass) match. The guest's ID is
restored in the reply.

Open files: a query holds at most one upstream socket at a time, opened and closed by the
query itself (plain non-blocking sockets, closed synchronously, not asyncio transports whose
close waits for the next loop iteration), so the sockets held never exceed the queries in
flight, :attr:`DnsForwarder.max_inflight`. The stack's :class:`~aioslirp.flow.guard.Guard` lowers
that cap to its DNS share of the open-file limit.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
import socket
import struct
import time

from ..config import NetworkConfig
from ..flow.egress import DNS_PENDING, guest_fields
from .dns_local import LocalRecords
from .dns_policy import EDE_BLOCKED, ODD_NAME, answer_addresses, blocked_response, has_edns, plain_name, qname_text

__all__ = ["DnsForwarder", "DnsTcpSession", "read_resolv_conf"]

#: Query types named in audit records (others: the number).
_QTYPES = {1: "A", 5: "CNAME", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA", 33: "SRV", 65: "HTTPS", 255: "ANY"}

log = logging.getLogger(__name__)

_HDR = struct.Struct("!HHHHHH")  # id, flags, qdcount, ancount, nscount, arcount (RFC 1035 4.1.1)
_LEN = struct.Struct("!H")
HEADER_LEN = 12
FLAG_QR = 0x8000
FLAG_OPCODE = 0x7800
FLAG_TC = 0x0200
FLAG_RD = 0x0100
FLAG_RA = 0x0080
FLAG_AD = 0x0020  # RFC 4035 3.2.3, RFC 6840 5.7
FLAG_CD = 0x0010  # RFC 4035 3.2.2
FLAG_DO = 0x8000  # in an OPT RR's TTL field (RFC 3225 3)
RCODE_NOTIMP = 4
RCODE_FORMERR = 1
RCODE_SERVFAIL = 2
TYPE_OPT = 41  # EDNS(0), RFC 6891
#: Fallback when resolv.conf names no server (glibc does the same).
DEFAULT_UPSTREAMS = [("127.0.0.1", 53)]


def read_resolv_conf(path: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    """Return the ``nameserver`` entries of a resolv.conf as ``[(address, 53), ...]``.

    IPv4 and IPv6 addresses are accepted (an IPv6 scope, ``fe80::1%eth0``, is kept);
    comments (``#``, ``;``), other keywords, invalid addresses and duplicates are
    skipped. A missing or unreadable file gives ``[]``.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return []
    out: list[tuple[str, int]] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        fields = line.split()
        if len(fields) < 2 or fields[0] != "nameserver":
            continue
        addr = fields[1]
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            continue
        entry = (str(ip), 53)
        if entry not in out:
            out.append(entry)
    return out


def _skip_name(msg: bytes, off: int) -> int:
    """Offset just past the (possibly compressed) name at ``off``; raises ``ValueError``."""
    while True:
        if off >= len(msg):
            raise ValueError("name runs past the message")
        n = msg[off]
        if n == 0:
            return off + 1
        if n & 0xC0 == 0xC0:
            if off + 2 > len(msg):
                raise ValueError("truncated pointer")
            return off + 2
        if n & 0xC0:
            raise ValueError("bad label type")
        off += 1 + n


def read_name(msg: bytes, off: int) -> tuple[bytes, int]:
    """The name at ``off`` lower-cased in wire form (pointers followed) and the offset past it."""
    labels: list[bytes] = []
    end = None
    hops = 0
    total = 0
    while True:
        if off >= len(msg):
            raise ValueError("name runs past the message")
        n = msg[off]
        if n == 0:
            if end is None:
                end = off + 1
            break
        if n & 0xC0 == 0xC0:
            if off + 2 > len(msg):
                raise ValueError("truncated pointer")
            if end is None:
                end = off + 2
            hops += 1
            if hops > 64:
                raise ValueError("pointer loop")
            off = ((n & 0x3F) << 8) | msg[off + 1]
            continue
        if n & 0xC0:
            raise ValueError("bad label type")
        label = msg[off + 1 : off + 1 + n]
        if len(label) != n:
            raise ValueError("label runs past the message")
        total += n + 1
        if total > 255:
            raise ValueError("name too long")
        labels.append(label.lower())
        off += 1 + n
    return b"".join(bytes([len(lab)]) + lab for lab in labels) + b"\0", end


def _question(msg: bytes) -> tuple[tuple[bytes, int, int], int]:
    """The first question ``(qname_lower, qtype, qclass)`` and the offset past it."""
    name, off = read_name(msg, HEADER_LEN)
    if off + 4 > len(msg):
        raise ValueError("truncated question")
    qtype, qclass = struct.unpack_from("!HH", msg, off)
    return (name, qtype, qclass), off + 4


def _error_response(query: bytes, rcode: int, question: bytes = b"") -> bytes:
    """A response header (QR=1, opcode and RD copied, RA=1) plus ``question`` (raw, 0 or 1)."""
    qid, flags = struct.unpack_from("!HH", query, 0)
    flags = FLAG_QR | (flags & (FLAG_OPCODE | FLAG_RD)) | FLAG_RA | rcode
    return _HDR.pack(qid, flags, 1 if question else 0, 0, 0, 0) + question


def upstream_query(query: bytes, question: tuple[bytes, int, int], limit: int | None) -> bytes:
    """The query an upstream gets for the guest's ``query``, rebuilt from what was parsed, never
    the guest's bytes: a header with ID 0 (each send sets its own), opcode QUERY, and of the
    flags RD, AD and CD copied (RFC 1035 4.1.1, RFC 6840 5.7-5.9); one question, the name in
    lower case (``question``: ``(qname_lower, qtype, qclass)``); and only when the guest's query
    carried an OPT RR (RFC 6891 6.1.1), an OPT RR of our own holding its UDP payload size
    (lowered to ``limit``, if given) and DO bit (RFC 3225), no option. Nothing else the guest
    wrote (other records, EDNS options, case, bytes after the message) reaches the upstream:
    none of it can carry data past the name policy."""
    flags = struct.unpack_from("!H", query, 2)[0] & (FLAG_RD | FLAG_AD | FLAG_CD)
    name, qtype, qclass = question
    opt = _guest_opt(query)
    out = _HDR.pack(0, flags, 1, 0, 0, 0 if opt is None else 1) + name + struct.pack("!HH", qtype, qclass)
    if opt is not None:
        payload, do = opt
        if limit is not None and payload > limit:
            payload = limit
        out += b"\x00" + struct.pack("!HHIH", TYPE_OPT, max(payload, 512), do, 0)
    return out


def _guest_opt(msg: bytes) -> tuple[int, int] | None:
    """``(UDP payload size, DO bit as in the TTL field)`` of the OPT RR in ``msg``'s additional
    section (RFC 6891 6.1.2-6.1.3), or ``None`` (none, or a message that cannot be walked)."""
    try:
        _, _, qd, an, ns, ar = _HDR.unpack_from(msg, 0)
        off = HEADER_LEN
        for _ in range(qd):
            off = _skip_name(msg, off) + 4
        for i in range(an + ns + ar):
            off = _skip_name(msg, off)
            rtype, rclass, ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
            if rtype == TYPE_OPT and i >= an + ns:
                return rclass, ttl & FLAG_DO
            off += 10 + rdlen
    except (ValueError, struct.error):
        pass
    return None


def _hostport(upstream: tuple[str, int]) -> str:
    """``127.0.0.1:53``, ``[::1]:53``."""
    host, port = upstream
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _sockaddr(upstream: tuple[str, int], kind: int) -> tuple[int, tuple]:
    """``(family, sockaddr)`` of a numeric ``(address, port)`` upstream (an IPv6 scope kept);
    raises ``OSError`` (``socket.gaierror``) for anything but a numeric address."""
    family, _, _, _, addr = socket.getaddrinfo(upstream[0], upstream[1], 0, kind, 0, socket.AI_NUMERICHOST)[0]
    return family, addr


class _UdpQuery:
    """One outstanding query on its own connected, non-blocking UDP socket (``add_reader``)."""

    __slots__ = ("forwarder", "sock", "qid", "question", "done")

    forwarder: DnsForwarder
    sock: socket.socket
    qid: int
    question: tuple[bytes, int, int]
    done: asyncio.Future[bytes]

    def __init__(self, forwarder: "DnsForwarder", sock: socket.socket, qid: int,
                 question: tuple[bytes, int, int]) -> None:
        self.forwarder = forwarder
        self.sock = sock
        self.qid = qid
        self.question = question
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def readable(self) -> None:
        for _ in range(16):
            if self.done.done():
                return
            try:
                data = self.sock.recv(0xFFFF)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ECONNREFUSED (ICMP port unreachable) and the like
                self.done.set_exception(exc)
                return
            if self.forwarder.matches(data, self.qid, self.question):
                self.done.set_result(data)
                return
            self.forwarder.count("mismatched")

    def abort(self) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionAbortedError("DNS forwarder closed"))


class DnsForwarder:
    """Forwards guest DNS messages to the host's resolvers.

    ``config.dns_upstreams`` (a list of ``(address, port)``) wins when non-empty; else the
    ``nameserver`` lines of ``resolv_conf`` (re-read when its mtime, size or inode change,
    checked at most once per ``resolv_check_interval`` seconds), else 127.0.0.1:53.
    ``max_inflight`` (default ``config.dns_max_inflight``) bounds concurrent upstream queries
    (beyond it a query gets no answer, counted as ``overload``; the guest retries). ``stats`` counts ``queries``, ``answered``,
    ``timeouts``, ``failovers``, ``servfail``, ``malformed``, ``refused``, ``errors``,
    ``mismatched``, ``tcp_retries``, ``overload``, ``upstream_denied``, ``blocked`` (answered NXDOMAIN by the
    egress policy), ``local`` (answered from ``config.dns_records``, :attr:`local`).
    """

    __slots__ = ("config", "resolv_conf", "resolv_check_interval", "max_inflight", "policy", "timeout",
                 "max_udp_payload", "stats", "_resolv_sig", "_resolv_checked", "_resolv_upstreams", "_inflight",
                 "_queries", "_tcp_tasks", "_closed", "upstreams_off", "local", "_records", "down")

    config: NetworkConfig
    resolv_conf: str
    resolv_check_interval: float
    max_inflight: int
    policy: object
    timeout: float
    max_udp_payload: int
    stats: dict[str, int]
    _resolv_sig: tuple | None
    _resolv_checked: float
    _resolv_upstreams: list[tuple[str, int]]
    _inflight: int
    _queries: set[_UdpQuery]
    _tcp_tasks: set[asyncio.Task]
    _closed: bool
    #: No upstream may be queried: every query gets SERVFAIL (``slirp4netns --disable-dns``).
    upstreams_off: bool
    #: The names answered here (``config.dns_records``), or ``None`` when there are none.
    local: LocalRecords | None
    #: The ``config.dns_records`` mapping :attr:`local` was built from.
    _records: dict | None
    #: Upstreams whose last query failed -> why (``"connection refused"``...): each is logged once
    #: (WARNING) when it goes down and once (INFO) when it answers again, not once per query.
    down: dict[tuple[str, int], str]

    def __init__(
        self,
        config: NetworkConfig,
        *,
        resolv_conf: str = "/etc/resolv.conf",
        resolv_check_interval: float = 1.0,
        max_inflight: int | None = None,
    ) -> None:
        self.config = config
        self.resolv_conf = resolv_conf
        self.resolv_check_interval = resolv_check_interval
        self.max_inflight = int(max_inflight if max_inflight is not None else getattr(config, "dns_max_inflight", 512))
        #: The stack's :class:`~aioslirp.config.policy.EgressPolicy` (set by its Guard), or None.
        self.policy = None
        self.timeout = float(config.dns_timeout)
        # Largest UDP answer the guest link carries without IP fragmentation.
        self.max_udp_payload = max(512, int(config.mtu) - 28)
        self.stats: dict[str, int] = dict.fromkeys(
            ("queries", "answered", "timeouts", "failovers", "servfail", "malformed",
             "refused", "errors", "mismatched", "tcp_retries", "overload", "upstream_denied", "blocked", "local"), 0)
        self._resolv_sig: tuple | None = None
        self._resolv_checked = float("-inf")
        self._resolv_upstreams: list[tuple[str, int]] = []
        self._inflight = 0
        self._queries: set[_UdpQuery] = set()
        self._tcp_tasks: set[asyncio.Task] = set()
        self._closed = False
        self.upstreams_off = False
        self.down = {}
        self.local = None
        self._records = None
        self.set_records(getattr(config, "dns_records", None))

    def set_records(self, records: dict | None) -> None:
        """Answer ``records`` here from now on (:attr:`local`), in the shape
        :func:`~aioslirp.config.records.parse_dns_records` returns (``{name: (addresses)}``);
        ``None`` or empty: no local names. A query also notices ``config.dns_records`` replaced
        by a new mapping of that shape (how :class:`aioslirp.Switch` names the guests of one
        network in every guest's stack)."""
        config = self.config
        self._records = records
        host_side = {str(getattr(config, a)): lo for a, lo in (("gateway", "127.0.0.1"), ("gateway6", "::1"))
                     if getattr(config, a, None) is not None}
        self.local = LocalRecords(records, host_side=host_side) if records else None

    # ------------------------------------------------------------------ upstreams

    def allow_upstream(self, addr: tuple[str, int]) -> bool:
        """Egress-policy hook: may ``addr`` (``(address, port)``) be queried?

        The user's ``--allow`` / ``--deny`` rules of :attr:`policy` apply (a denied upstream is
        skipped, counted in ``upstream_denied``); the built-in link-local defaults do not (an
        upstream from resolv.conf is the operator's choice, e.g. a cloud resolver at
        169.254.169.254). ``disable_host_loopback`` deliberately does not apply either: a
        loopback resolver such as 127.0.0.53 is reached from the host side, which is correct,
        and it only ever receives questions the forwarder parsed. None may be queried (and
        nothing is counted) while :attr:`upstreams_off` is set.
        """
        if self.upstreams_off:
            return False
        policy = self.policy
        if policy is None or policy.allows(addr[0], user_only=True, port=addr[1], proto=17):
            return True
        self.count("upstream_denied")
        return False

    @property
    def upstreams(self) -> list[tuple[str, int]]:
        """Current upstream list (re-reads resolv.conf when it changed, checked at most once per
        ``resolv_check_interval`` seconds of the running loop's clock)."""
        if self.config.dns_upstreams:
            return list(self.config.dns_upstreams)
        now = asyncio.get_running_loop().time()
        if now - self._resolv_checked >= self.resolv_check_interval:
            self._resolv_checked = now
            try:
                st = os.stat(self.resolv_conf)
                sig = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
            except OSError:
                sig = None
            if sig != self._resolv_sig or self._resolv_sig is None:
                self._resolv_sig = sig
                ups = read_resolv_conf(self.resolv_conf) if sig is not None else []
                if ups != self._resolv_upstreams:
                    log.info("DNS upstreams from %s: %s", self.resolv_conf, ups or DEFAULT_UPSTREAMS)
                self._resolv_upstreams = ups
        return list(self._resolv_upstreams or DEFAULT_UPSTREAMS)

    # ------------------------------------------------------------------ forwarding

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to :attr:`stats` ``[key]``."""
        self.stats[key] = self.stats.get(key, 0) + n

    @staticmethod
    def matches(resp: bytes, qid: int, question: tuple[bytes, int, int]) -> bool:
        """RFC 5452 section 9.1: accept only a response whose ID and question match the query."""
        try:
            rid, flags, qd, _, _, _ = _HDR.unpack_from(resp, 0)
            if rid != qid or not flags & FLAG_QR or qd != 1:
                return False
            return _question(resp)[0] == question
        except (ValueError, struct.error):
            return False

    async def resolve(self, query: bytes, *, tcp: bool = False, now: float | None = None,
                      guest=None) -> bytes | None:
        """Forward one DNS message; return the response to send back to the guest, or ``None``.

        ``tcp``: the guest asked over TCP (a truncated UDP answer is then retried over TCP;
        the EDNS payload size is left alone). ``now``: loop time of the query's batch (seconds;
        default the running loop's), when the answer's addresses are bound to the name asked;
        ``guest``: the guest's endpoint (``(address bytes, port)``), for the audit log.

        Under the egress policy (:attr:`policy` with names on, :mod:`aioslirp.flow.egress`), a
        query for a denied name is answered NXDOMAIN here with an Extended DNS Error when it
        carried EDNS (:func:`~aioslirp.services.dns_policy.blocked_response`, RFC 8914), the
        upstream never asked (``egress.dns_blocked``); an allowed answer's A / AAAA addresses are
        bound to the name asked (``policy.bind_answer``). Returns FORMERR for a query with a readable
        header but no parsable single question, ``None`` for input shorter than a header,
        for messages that are responses (QR=1), after :meth:`close` and under overload, and
        SERVFAIL (same ID and question) when every upstream failed.
        """
        query = bytes(query)
        self.count("queries")
        if len(query) < HEADER_LEN:
            self.count("malformed")
            return None
        qid, flags, qdcount = struct.unpack_from("!HHH", query, 0)
        if flags & FLAG_QR:
            self.count("malformed")
            return None  # never answer a response (reflection loops)
        if flags & FLAG_OPCODE:  # UPDATE, NOTIFY, ...: a stub resolver asks QUERY (RFC 1035 4.1.1)
            self.count("notimp")
            return _error_response(query, RCODE_NOTIMP)
        try:
            if qdcount != 1:
                raise ValueError("QDCOUNT must be 1")
            question, qend = _question(query)
        except (ValueError, struct.error):
            self.count("malformed")
            return _error_response(query, RCODE_FORMERR)
        if self._closed:
            return None
        policy = self.policy
        records = getattr(self.config, "dns_records", None)
        if records is not self._records:  # replaced while the stack runs (a Switch naming its guests)
            self.set_records(records)
        local = self.local
        if local is not None and local.lookup(question[0]) is not None:
            return self._local(local, query, qend, question, policy, now, guest)
        rule = None
        if policy is not None and getattr(policy, "names_on", False):
            name = qname_text(question[0])
            if now is None:
                now = asyncio.get_running_loop().time()
            server = self._server(guest)
            if plain_name(question[0]):
                code, rule = policy.dns_verdict(name, now, guest, server)
            else:  # its text would not read as the upstream reads it: no rule or hook can judge it
                code, rule = EDE_BLOCKED, ODD_NAME
            if code == DNS_PENDING:  # an async hook decides the name: a query in flight meanwhile
                if self._inflight >= self.max_inflight:
                    self.count("overload")
                    return None
                self._inflight += 1
                try:
                    code, rule = await policy.dns_ask(name, guest, server)
                finally:
                    self._inflight -= 1
                if self._closed:
                    return None
            if code:
                self.count("blocked")
                reply = blocked_response(query, qend, code, rule, has_edns(query, qend, read_name))
                policy.counters["egress.dns_blocked"] = policy.counters.get("egress.dns_blocked", 0) + 1
                self._audit(policy, name, guest, "deny", rule, question[1], "blocked")
                return reply
        if self._inflight >= self.max_inflight:
            self.count("overload")
            return None
        self._inflight += 1
        try:
            reply = await self._forward(query, question, tcp)
        finally:
            self._inflight -= 1
        if reply is None:
            if self._closed:
                return None
            self.count("servfail")
            if rule is not None:  # allowed, but no upstream answered
                self._audit(policy, qname_text(question[0]), guest, "allow", rule, question[1], "servfail")
            return _error_response(query, RCODE_SERVFAIL, query[HEADER_LEN:qend])
        self.count("answered")
        if rule is not None:
            if now is None:
                now = asyncio.get_running_loop().time()
            addrs = answer_addresses(reply, question[0], read_name)
            if addrs:
                policy.bind_answer(qname_text(question[0]), addrs, now)
            self._audit(policy, qname_text(question[0]), guest, "allow", rule, question[1])
        # the upstream was asked the name in lower case: the guest gets its own spelling back
        # (a resolver matching 0x20-randomised case, draft-vixie-dnsext-dns0x20, compares it)
        asked, qname = query[HEADER_LEN:qend - 4], question[0]
        body = reply[HEADER_LEN:]
        if len(asked) == len(qname) and body[:len(qname)].lower() == qname:
            body = asked + body[len(qname):]
        return _HDR.pack(qid, *_HDR.unpack_from(reply, 0)[1:]) + body

    def _local(self, local: LocalRecords, query: bytes, qend: int, question, policy, now, guest) -> bytes:
        """Answer a query for a local name (``config.dns_records``) here: never upstream, never
        blocked by a name rule; its addresses are bound to the name under the policy."""
        self.count("local")
        reply, bind = local.answer(query, qend, question, has_edns(query, qend, read_name))
        if policy is not None and getattr(policy, "names_on", False):
            name = qname_text(question[0])
            if bind:
                policy.bind_answer(name, bind, asyncio.get_running_loop().time() if now is None else now, trusted=True)
            self._audit(policy, name, guest, "allow", "dns-record", question[1])
        return reply

    def _server(self, guest) -> str:
        """The virtual DNS address (text) a guest endpoint ``(address bytes, port)`` asked: the IPv6
        one for an IPv6 guest; ``""`` when there is none."""
        v6 = guest is not None and not isinstance(guest, str) and len(guest[0]) == 16
        dst = getattr(self.config, "dns6" if v6 else "dns", None)
        return "" if dst is None else str(dst)

    def _audit(self, policy, name: str, guest, verdict: str, rule: str, qtype: int, answer: str = "answered") -> None:
        """One ``dns`` audit record (docs/audit.md): the name asked, its type, the verdict and rule,
        and ``answer``: ``"answered"``, ``"blocked"`` (NXDOMAIN + EDE) or ``"servfail"``."""
        ctx = getattr(policy, "ctx", None)
        a = ctx.audit if ctx is not None else None
        if a is not None:
            g, gport = guest_fields(guest)
            a.record({"event": "dns", "time": time.time(), "proto": "dns", "guest": g, "guest_port": gport,
                      "dst": self._server(guest) or None, "port": 53, "name": name,
                      "qtype": _QTYPES.get(qtype, qtype), "verdict": verdict, "rule": rule, "answer": answer})

    async def _forward(self, query: bytes, question, tcp: bool) -> bytes | None:
        upstreams = [u for u in self.upstreams if self.allow_upstream(u)]
        query = upstream_query(query, question, None if tcp else self.max_udp_payload)
        for i, upstream in enumerate(upstreams):
            if self._closed:
                return None
            if i:
                self.count("failovers")
            qid = secrets.randbits(16)
            wire = _LEN.pack(qid) + query[2:]
            last = i == len(upstreams) - 1
            try:
                reply = await self._udp(upstream, wire, qid, question)
            except asyncio.TimeoutError:
                self.count("timeouts")
                self._went_down(upstream, f"no answer within {self.timeout:g} s", last)
                continue
            except ConnectionRefusedError:
                self.count("refused")
                self._went_down(upstream, "connection refused", last)
                continue
            except (OSError, ValueError) as exc:  # unreachable, bad address, closed socket, ...
                self.count("errors")
                self._went_down(upstream, getattr(exc, "strerror", None) or str(exc), last)
                continue
            if self.down.pop(upstream, None) is not None:
                log.info("DNS upstream %s answers again", _hostport(upstream))
            if tcp and _HDR.unpack_from(reply, 0)[1] & FLAG_TC:
                self.count("tcp_retries")
                qid = secrets.randbits(16)
                try:
                    return await self._tcp(upstream, _LEN.pack(qid) + query[2:], qid, question)
                except (asyncio.TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
                    self.count("errors")
                    log.debug("DNS: TCP retry to %s failed: %s; returning truncated answer", upstream, exc)
            return reply
        return None

    def _went_down(self, upstream: tuple[str, int], cause: str, last: bool) -> None:
        """Log an upstream's failure once, when it goes down (:attr:`down`); DEBUG afterwards."""
        if self._closed or upstream in self.down:
            log.debug("DNS upstream %s failed: %s", _hostport(upstream), cause)
            return
        if len(self.down) >= 64:  # bounded: upstreams replaced in resolv.conf are forgotten
            self.down.clear()
        self.down[upstream] = cause
        log.warning("DNS upstream %s unreachable: %s; %s", _hostport(upstream), cause,
                    "answering SERVFAIL" if last else "trying the next upstream")

    async def _udp(self, upstream: tuple[str, int], wire: bytes, qid: int, question) -> bytes:
        loop = asyncio.get_running_loop()
        family, addr = _sockaddr(upstream, socket.SOCK_DGRAM)
        sock = socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        try:
            sock.connect(addr)  # UDP: no packet sent; fixes the peer and a fresh random source port
            sock.send(wire)
            q = _UdpQuery(self, sock, qid, question)
            fd = sock.fileno()
            self._queries.add(q)
            loop.add_reader(fd, q.readable)
            try:
                return await asyncio.wait_for(q.done, self.timeout)
            finally:
                loop.remove_reader(fd)
                self._queries.discard(q)
        finally:
            sock.close()

    async def _tcp(self, upstream: tuple[str, int], wire: bytes, qid: int, question) -> bytes:
        loop = asyncio.get_running_loop()
        family, addr = _sockaddr(upstream, socket.SOCK_STREAM)
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)

        async def exchange() -> bytes:
            await loop.sock_connect(sock, addr)
            await loop.sock_sendall(sock, DnsTcpSession.frame(wire))
            buf = bytearray()
            while True:  # skip anything that does not answer our question
                while len(buf) < 2 or len(buf) < 2 + _LEN.unpack_from(buf, 0)[0]:
                    data = await loop.sock_recv(sock, 0x10001)
                    if not data:
                        raise asyncio.IncompleteReadError(bytes(buf), None)
                    buf += data
                end = 2 + _LEN.unpack_from(buf, 0)[0]
                resp = bytes(buf[2:end])
                del buf[:end]
                if self.matches(resp, qid, question):
                    return resp
                self.count("mismatched")

        try:
            # A task of its own, so that close() can stop it; waited for to its end (also when
            # cancelled) before the socket is closed, so no reader or writer is left on the fd.
            task = loop.create_task(exchange())
            self._tcp_tasks.add(task)
            try:
                return await asyncio.wait_for(task, self.timeout)
            except asyncio.CancelledError:
                if task.cancelled() and self._closed and not asyncio.current_task().cancelling():
                    raise ConnectionAbortedError("DNS forwarder closed") from None
                raise
            finally:
                self._tcp_tasks.discard(task)
        finally:
            sock.close()

    async def close(self) -> None:
        """Abort outstanding upstream queries (their ``resolve`` returns ``None``); idempotent."""
        self._closed = True
        for q in list(self._queries):
            q.abort()
        for t in list(self._tcp_tasks):
            t.cancel()
        await asyncio.sleep(0)


class DnsTcpSession:
    """Framing of DNS over TCP (RFC 1035 section 4.2.2, RFC 7766 section 8).

    :meth:`feed` takes stream bytes and returns the complete messages in order; a partial
    message stays buffered (at most 65,536 bytes, so the buffer is bounded). Zero-length
    frames carry no message and are skipped (counted in ``empty_frames``).
    """

    MAX_MESSAGE = 0xFFFF

    __slots__ = ("_buf", "empty_frames")

    _buf: bytearray
    empty_frames: int

    def __init__(self) -> None:
        self._buf = bytearray()
        self.empty_frames = 0

    @staticmethod
    def frame(msg: bytes) -> bytes:
        """``msg`` with its two-byte big-endian length prefix; raises ``ValueError`` above 65,535 bytes."""
        if len(msg) > DnsTcpSession.MAX_MESSAGE:
            raise ValueError(f"DNS message of {len(msg)} bytes does not fit a TCP frame")
        return _LEN.pack(len(msg)) + bytes(msg)

    @property
    def pending(self) -> int:
        """Bytes of an incomplete message buffered."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Append stream bytes; return the complete messages now available, in order."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        off = 0
        n = len(buf)
        while n - off >= 2:
            (length,) = _LEN.unpack_from(buf, off)
            if n - off - 2 < length:
                break
            if length == 0:
                self.empty_frames += 1
            else:
                out.append(bytes(buf[off + 2 : off + 2 + length]))
            off += 2 + length
        if off:
            del buf[:off]
        return out

    @property
    def wanted(self) -> int:
        """Bytes that complete what is buffered: the rest of the length prefix, or of the message."""
        buf = self._buf
        if len(buf) < 2:
            return 2 - len(buf)
        return 2 + _LEN.unpack_from(buf, 0)[0] - len(buf)

    def feed_some(self, data, max_messages: int, max_bytes: int) -> tuple[list[bytes], int]:
        """Take a prefix of ``data``: stop after ``max_messages`` complete messages or ``max_bytes``
        bytes, whichever comes first. Returns ``(messages, bytes taken)``; the bytes not taken
        are the caller's to offer again (a flow keeps them in its connection, RFC 7766 6.2.3's
        "backpressure" on a pipelining client). Messages as :meth:`feed`; a partial one stays
        buffered and counts in :attr:`pending`.
        """
        buf = self._buf
        out: list[bytes] = []
        mv = memoryview(data)
        end = min(len(mv), max(0, max_bytes))
        off = 0
        while len(out) < max_messages:
            need = self.wanted  # > 0: a completed frame is never left in the buffer
            k = min(need, end - off)
            if k > 0:
                buf += mv[off:off + k]
                off += k
            if k < need:
                break  # out of data or of max_bytes
            if len(buf) == 2:  # the length prefix is complete
                if buf[0] or buf[1]:
                    continue  # now the message itself
                self.empty_frames += 1
                buf.clear()
                continue
            out.append(bytes(buf[2:]))
            buf.clear()
        return out, off
