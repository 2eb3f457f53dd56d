"""``--verify-sni``: a flow a name rule allowed must name an allowed name in its first bytes.

Two names may share one address (a CDN): a rule allowing ``allowed.test`` admits every flow to the
addresses ``allowed.test`` resolved to, including one that asks the server for ``other.test``. With
``verify_sni`` the stack hands each TCP flow that an egress *name* rule allowed (and that no route
takes) to :class:`SniVerifier`: the guest's handshake is answered at once (no host connect yet),
its first bytes are held (at most :data:`MAX_HELD` bytes, for at most ``timeout`` seconds) until
they name the server:

* a TLS ClientHello (RFC 8446 4.1.2, possibly over several records): its ``server_name``
  extension (RFC 6066 3), the ``host_name`` entry;
* an HTTP/1 request (RFC 9112): its ``Host`` header; with an absolute-form target (RFC 9112
  3.2.2) or a ``CONNECT`` (authority-form, 3.2.3), the target's host, which ``Host`` must name too.

The name must be bound to the flow's address by the virtual DNS for this guest, and allowed by
the rules for the flow's port and for the port the request names, if another (the most specific
name rule allows it; no name rule: ``egress_default``).
What a server could read as another name than ours is refused, not guessed at
(:func:`first_name`; the list is in docs/security.md): a bare CR or LF, a control character, a
field line that is not ``token ":"``, two ``Host``, a host-override field, a malformed or
disagreeing ``Host``, a target that is neither origin-form nor absolute-form (nor a ``CONNECT``'s
``host:port``); a ClientHello with an extension twice, an encrypted ClientHello (ECH, ESNI), a
``server_name`` list that is not exactly one well-formed ``host_name``, inconsistent lengths.
Then the flow is connected (through the default TCP handler's ``connect`` when it has one, such as
an :class:`~aioslirp.handlers.proxy.UpstreamProxy`, else directly), the held bytes are passed on
and the flow is spliced. Otherwise (another name, no name, not TLS or HTTP/1, more than
:data:`MAX_HELD` bytes without a name, the timeout) the guest gets a RST, counted as
``egress.sni_denied``, logged once per address and name, and written to the audit log
(``rule``: ``"verify-sni"``). A guest that closes before sending anything is closed (FIN).
What this changes for the guest: a connect error towards the host arrives as a RST after the
handshake, not as a refused SYN or ICMP unreachable.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import struct
import time

from .splice import splice

__all__ = ["MAX_HELD", "SniVerifier", "first_name"]

log = logging.getLogger("aioslirp.limits")

#: Guest bytes held at most while looking for the name.
MAX_HELD = 16384
#: Bytes of an HTTP request line at most (RFC 9112 3 suggests servers take at least 8000).
MAX_REQUEST_LINE = 8192
_LOGGED_MAX = 1024
MORE, NAME, NONE = "more", "name", "none"  # first_name() outcomes; any other is why the bytes are refused

#: Field-name characters (RFC 9110 5.1, 5.6.2 ``tchar``); also the request method's.
_TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
#: Field-value characters (RFC 9110 5.5: VCHAR, obs-text, SP, HTAB): not a control character.
_FIELD_VCHAR = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))
#: Request-target characters: printable ASCII (no control, space or non-ASCII byte).
_TARGET_CHAR = bytes(range(0x21, 0x7F))
#: Host-name label characters, after lower-casing (RFC 1123 2.1 letters, digits, hyphen; and "_").
_LABEL_CHAR = b"abcdefghijklmnopqrstuvwxyz0123456789-_"
#: Absolute-form schemes and their default ports (RFC 9110 4.2).
_SCHEMES = {b"http": 80, b"https": 443}
#: Fields that some servers, frameworks and proxies take the host from instead of ``Host``.
_HOST_OVERRIDES = frozenset((b"forwarded", b"x-forwarded-host", b"x-forwarded-server", b"x-host",
                             b"x-original-host", b"x-http-host-override"))
#: TLS extensions hiding the real server name: ESNI (draft-ietf-tls-esni-01..05, 0xffce), ECH
#: (drafts -06/-07 0xff02, -08..-12 0xfe08..0xfe0c, RFC 0xfe0d) and ``ech_outer_extensions`` (0xfd00).
_ECH = frozenset((0xFFCE, 0xFF02, 0xFD00, *range(0xFE08, 0xFE0E)))


def _hostname(raw: bytes) -> str | None:
    """``raw`` as a lower-case host name (labels of letters, digits, ``-``, ``_``, 1-63 bytes, at most
    253 in all, no trailing dot), or ``None``."""
    if not 0 < len(raw) <= 253:
        return None
    name = raw.lower()
    for label in name.split(b"."):
        if not 0 < len(label) <= 63 or label.translate(None, _LABEL_CHAR):
            return None
    return name.decode("ascii")


def _authority(raw: bytes) -> tuple[str, int | None] | None:
    """``(host, port or None)`` of ``host[:port]`` (RFC 9110 7.2; ``host`` a name as
    :func:`_hostname` takes it or a bracketed IPv6 literal without a zone), or ``None``."""
    if raw[:1] == b"[":
        close = raw.find(b"]")
        literal, rest = raw[1:close], raw[close + 1:]
        host = None
        if close > 0 and b"%" not in literal:
            try:
                host = ipaddress.IPv6Address(literal.decode("ascii")).compressed
            except ValueError:
                pass
    else:
        literal, colon, port = raw.partition(b":")
        host, rest = _hostname(literal), colon + port
    if host is None:
        return None
    if not rest:
        return host, None
    digits = rest[1:]
    if rest[:1] != b":" or not digits.isdigit() or len(digits) > 5 or not 0 < int(digits) <= 65535:
        return None
    return host, int(digits)


def _client_hello(data: bytes):
    """:func:`first_name` for bytes starting with a TLS record: the ClientHello (RFC 8446 4.1.2)
    gathered from the leading handshake records (RFC 8446 5.1), then its ``server_name``."""
    hs = b""
    pos = 0
    while len(data) - pos >= 5:
        ctype, major, n = data[pos], data[pos + 1], int.from_bytes(data[pos + 3:pos + 5], "big")
        if ctype != 22 or major != 3:
            return "a TLS record that is not a handshake record before the ClientHello's end"
        if not 0 < n <= 16384:
            return "a TLS handshake record of length 0 or over 2^14 (RFC 8446 5.1)"
        hs += data[pos + 5:pos + 5 + n]
        pos += 5 + n
        if len(hs) >= 4 and len(hs) >= 4 + int.from_bytes(hs[1:4], "big"):
            break
    if len(hs) < 4:
        return MORE, None, None
    if hs[0] != 1:
        return "a TLS handshake message that is not a ClientHello"
    n = int.from_bytes(hs[1:4], "big")
    if len(hs) < 4 + n:
        return MORE, None, None
    try:
        return _hello_name(hs[4:4 + n])
    except (IndexError, struct.error):
        return "a truncated ClientHello"


def _hello_name(b: bytes):
    """The ``server_name`` of the ClientHello body ``b``; raises IndexError / struct.error when it is short."""
    if b[34] > 32:  # after legacy_version and random
        return "a ClientHello session id over 32 bytes (RFC 8446 4.1.2)"
    p = 35 + b[34]
    p += 2 + struct.unpack_from("!H", b, p)[0]  # cipher_suites
    p += 1 + b[p]  # legacy_compression_methods
    if p == len(b):
        return NONE, None, None  # no extensions
    end = p + 2 + struct.unpack_from("!H", b, p)[0]
    if end != len(b):
        return "a ClientHello whose extensions do not end where it does"
    p += 2
    seen: set = set()
    name = None
    while p < end:
        etype, elen = struct.unpack_from("!HH", b, p)
        p += 4
        if p + elen > end:
            return "a ClientHello extension longer than the extensions"
        if etype in seen:
            return "a ClientHello extension twice (RFC 8446 4.2)"
        seen.add(etype)
        if etype in _ECH:
            return "an encrypted ClientHello (ECH/ESNI: the server reads the inner, hidden name)"
        if etype == 0:
            name = _server_name(b[p:p + elen])
            if not isinstance(name, tuple):
                return name
        p += elen
    return name if name is not None else (NONE, None, None)


def _server_name(ext: bytes):
    """The ``server_name`` extension's ``ServerNameList`` (RFC 6066 3): exactly one ``host_name``."""
    if len(ext) < 2 or int.from_bytes(ext[:2], "big") != len(ext) - 2:
        return "a server_name list whose length is not the extension's"
    names = []
    q = 2
    while q < len(ext):
        if q + 3 > len(ext):
            return "a server_name entry cut short"
        if ext[q] != 0:
            return "a server_name entry that is not a host_name (RFC 6066 3)"
        nlen = int.from_bytes(ext[q + 1:q + 3], "big")
        q += 3
        if q + nlen > len(ext):
            return "a host_name longer than its server_name list"
        names.append(ext[q:q + nlen])
        q += nlen
    if len(names) != 1:
        return "a server_name list without exactly one host_name (RFC 6066 3)"
    name = _hostname(names[0])
    if name is None:
        return "a host_name that is not a host name (RFC 6066 3: ASCII letters, digits, hyphens, no trailing dot)"
    return NAME, name, None


def _http_request(data: bytes):
    """:func:`first_name` for bytes starting with an upper-case letter: an HTTP/1 request head (RFC 9112)."""
    end = data.find(b"\r\n\r\n")
    head = data[:end] if end >= 0 else data[:len(data) - data.endswith(b"\r")]  # a last CR may be a CRLF's
    lines = head.split(b"\r\n")
    if any(b"\r" in line or b"\n" in line for line in lines):
        return "a bare CR or LF in the request head (RFC 9112 2.2)"
    if len(lines) == 1 and end < 0:  # no complete request line yet
        return (MORE, None, None) if len(data) < MAX_REQUEST_LINE else "a request line over 8 KiB"
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1") or parts[0].translate(None, _TCHAR):
        return "not an HTTP/1 request line (RFC 9112 3)"
    method, target = parts[0], parts[1]
    if target.translate(None, _TARGET_CHAR):
        return "a control or non-ASCII byte in the request target"
    if end < 0:
        return MORE, None, None
    if method == b"CONNECT":  # authority-form (RFC 9112 3.2.3): the proxy opens this host and port
        named = _authority(target)
        if named is None or named[1] is None:
            return "a CONNECT target that is not host:port (RFC 9112 3.2.3)"
    elif target[:1] == b"/":  # origin-form (RFC 9112 3.2.1)
        if target[:2] in (b"//", b"/\\"):
            return "an origin-form target starting with // (an authority to some URL parsers)"
        named = None
    else:  # absolute-form (RFC 9112 3.2.2): a server takes the host from the target, not from Host
        scheme, sep, rest = target.partition(b"://")
        default = _SCHEMES.get(scheme.lower()) if sep else None
        if default is None:
            return "a request target neither origin-form nor absolute-form http(s) (RFC 9112 3.2)"
        cut = min((i for i in (rest.find(b"/"), rest.find(b"?"), rest.find(b"#")) if i >= 0), default=len(rest))
        named = _authority(rest[:cut])
        if named is None:
            return "an absolute-form target whose authority is not host[:port] (no userinfo)"
        named = (named[0], named[1] or default)
    host = None
    for line in lines[1:]:
        field, colon, value = line.partition(b":")
        if not colon or not field or field.translate(None, _TCHAR):
            return "a field line whose name is not a token followed by a colon (RFC 9112 5.1, 5.2)"
        value = value.strip(b" \t")
        if value.translate(None, _FIELD_VCHAR):
            return "a control character in a field value (RFC 9110 5.5)"
        field = field.lower()
        if field in _HOST_OVERRIDES:
            return f"a {field.decode()} field (some servers take the host from it instead of Host)"
        if field == b"host":
            if host is not None:
                return "two Host fields (RFC 9112 3.2)"
            host = _authority(value)
            if host is None:
                return "a Host that is not host[:port] (RFC 9110 7.2)"
    if named is None:
        return (NAME, host[0], host[1]) if host is not None else (NONE, None, None)
    if host is None or host[0] != named[0] or host[1] not in (None, named[1]):
        return "a Host that is not the request target's host and port (RFC 9112 3.2)"
    return NAME, named[0], named[1]


def _guest(g: tuple) -> str:
    return f"[{g[0]}]:{g[1]}" if ":" in g[0] else f"{g[0]}:{g[1]}"


def first_name(data: bytes):
    """The server the guest's first bytes ask for: ``(outcome, name, port)``.

    ``outcome`` is ``"name"`` (``name``: lower case, no trailing dot; ``port``: the port the
    request names, from ``Host``, an absolute-form target (or its scheme's default) or a
    ``CONNECT`` target, else ``None``), ``"more"`` (need more bytes), ``"none"`` (a ClientHello or
    request without a name), or else the reason the bytes are refused (one phrase: anything a
    server could read as another name, see docs/security.md), with ``name`` and ``port`` ``None``.
    """
    if not data:
        return MORE, None, None
    if data[0] == 22:
        got = _client_hello(data)
    elif data[:1].isalpha() and data[:1].isupper():
        got = _http_request(data)
    else:
        got = "neither a TLS ClientHello nor an HTTP/1 request"
    return got if isinstance(got, tuple) else (got, None, None)


class SniVerifier:
    """The ``--verify-sni`` handler (see the module documentation).

    Args:
        egress: the stack's :class:`~aioslirp.flow.egress.Egress` (rules, name bindings, audit).
        counters: the stack's counters (``egress.sni_denied``, ``egress.sni_verified``).
        onward: the stack's default TCP handler, whose ``connect(flow)`` (if it has one) opens the
            verified flow's upstream; else ``flow.open_upstream()``.
        timeout: seconds to wait for the name.
    """

    __slots__ = ("egress", "counters", "onward", "timeout", "_logged")

    def __init__(self, egress, counters, onward=None, timeout: float = 10.0) -> None:
        self.egress = egress
        self.counters = counters
        self.onward = onward
        self.timeout = float(timeout)
        self._logged: set = set()

    def __repr__(self) -> str:
        return "SniVerifier()"

    def allowed(self, flow, name: str, port: int | None = None) -> bool:
        """``name`` is bound to ``flow``'s address and allowed by the rules for its port and for
        ``port``, the one the request names (a proxy would open that one)."""
        eg = self.egress
        if name not in eg.bindings.names(flow.remote, asyncio.get_running_loop().time()):
            return False
        for p in {flow.destination[1], port or flow.destination[1]}:
            r = eg.rules.match_name(name, p, 6)
            if not (r.allow if r is not None else eg.default_allow):
                return False
        return True

    async def __call__(self, flow, reader, writer) -> None:
        held = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        outcome, name, port = MORE, None, None
        while outcome == MORE:
            if len(held) >= MAX_HELD:
                outcome = "too long"
                break
            try:
                chunk = await asyncio.wait_for(reader.read(MAX_HELD - len(held)), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                outcome = "timeout"
                break
            if not chunk:
                if not held:
                    writer.close()
                    return
                outcome = "eof"
                break
            held += chunk
            outcome, name, port = first_name(held)
        if outcome != NAME or not self.allowed(flow, name, port):
            self._deny(flow, name, outcome)
            writer.transport.abort()
            return
        self.counters["egress.sni_verified"] += 1
        connect = getattr(self.onward, "connect", None)
        up_r, up_w = await (connect(flow) if connect is not None else flow.open_upstream())
        up_w.write(held)
        await splice(reader, writer, up_r, up_w)

    def _deny(self, flow, name, outcome: str) -> None:
        self.counters["egress.sni_denied"] += 1
        why = (f"names {name!r}, not allowed for it" if outcome == NAME else "names no server" if outcome == NONE
               else f"refused: {outcome}")
        key = (flow.remote, name)
        if key not in self._logged and len(self._logged) < _LOGGED_MAX:
            self._logged.add(key)
            log.info("verify-sni: guest flow to %s:%d (allowed as %s) %s: reset", flow.remote, flow.destination[1],
                     flow.name, why)
        ctx = self.egress.ctx
        audit = ctx.audit if ctx is not None else None
        if audit is not None:
            audit.record({"event": "deny", "time": time.time(), "proto": "tcp", "guest": _guest(flow.guest),
                          "dst": flow.remote, "port": flow.destination[1], "name": name, "verdict": "deny",
                          "rule": "verify-sni"})
