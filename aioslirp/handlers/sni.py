"""``--verify-sni``: a flow a name rule allowed must name an allowed name in its first bytes
(and, over HTTP/1, in each request).

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
``host:port``), framing read two ways (``Content-Length`` twice or a list, a ``Transfer-Encoding``
but one ``chunked``, both, an ``Upgrade`` but one ``websocket``: h2c is refused); a ClientHello
with an extension twice, an encrypted ClientHello (ECH, ESNI), a
``server_name`` list that is not exactly one well-formed ``host_name``, inconsistent lengths.
Then the flow is connected (through the default TCP handler's ``connect`` when it has one, such as
an :class:`~aioslirp.handlers.proxy.UpstreamProxy`, else directly), the held bytes are passed on
and the flow is spliced. A TLS flow is spliced unread from then on; on an HTTP/1 flow every
request is judged as the first (:class:`Requests`: the guest's bytes are framed as a server
frames them, RFC 9112 6, and each head is held until it passes; content is counted, not read),
the server's bytes being read only for its answer to a first ``CONNECT`` or ``Upgrade:
websocket`` (a tunnel after a 2xx or 101). Otherwise (another name, no name, not TLS or HTTP/1,
more than :data:`MAX_HELD` bytes without a name, the timeout; a later request refused) the
guest gets a RST (a later request: the server too), counted as ``egress.sni_denied``, logged once
per address and name, and written to the audit log (``rule``: ``"verify-sni"``); later requests
that pass are counted as ``egress.sni_requests_verified``. A guest that closes before sending
anything is closed (FIN).
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

__all__ = ["MAX_HELD", "Requests", "SniVerifier", "first_name"]

log = logging.getLogger("aioslirp.limits")

#: Guest bytes held at most while looking for the name.
MAX_HELD = 16384
#: Bytes of an HTTP request line at most (RFC 9112 3 suggests servers take at least 8000).
MAX_REQUEST_LINE = 8192
_LOGGED_MAX = 1024
MORE, NAME, NONE = "more", "name", "none"  # first_name() outcomes; any other is why the bytes are refused
#: What follows a request head (RFC 9112 6.3), besides a byte count: the chunked transfer coding
#: (RFC 9112 7.1); a tunnel once the server answers the ``CONNECT`` with a 2xx (RFC 9110 9.3.6);
#: WebSocket frames once it answers the ``Upgrade: websocket`` with a 101 (RFC 9110 7.8, RFC 6455 4.1).
CHUNKED, TUNNEL_2XX, TUNNEL_101 = -1, -2, -3
#: A ``Content-Length`` or chunk size at most (a signed 64-bit reader would read more as negative).
MAX_LENGTH = (1 << 63) - 1
#: Bytes of a chunk-size line at most: 16 hex digits and CRLF (no chunk extension, RFC 9112 7.1.1).
MAX_SIZE_LINE = 18
#: (name, port) pairs a connection remembers as allowed at most (past it each is judged again).
_PASSED_MAX = 16
_HEX = b"0123456789abcdefABCDEF"

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
#: Fields that frame the message or switch the protocol (their ``_`` spellings are refused).
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"upgrade"))
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


def _http_head(data: bytes):
    """An HTTP/1 request head (RFC 9112) at the start of ``data``: ``(outcome, name, port, body)``
    (``outcome`` :data:`NAME`, :data:`NONE` or :data:`MORE`; ``body``: what follows the head, a byte
    count, :data:`CHUNKED`, :data:`TUNNEL_2XX` or :data:`TUNNEL_101`; ``None`` with :data:`MORE`), or
    the reason it is refused. The one place of the rules for every request of a connection."""
    if not (data[:1].isalpha() and data[:1].isupper()):
        return "not an HTTP/1 request line (RFC 9112 3)"
    end = data.find(b"\r\n\r\n")
    head = data[:end] if end >= 0 else data[:len(data) - data.endswith(b"\r")]  # a last CR may be a CRLF's
    # every CR in a CRLF and every LF too (counted, not split: a head arriving byte by byte is read
    # again at each byte, at C speed)
    if not head.count(b"\r") == head.count(b"\n") == head.count(b"\r\n"):
        return "a bare CR or LF in the request head (RFC 9112 2.2)"
    line, crlf, _ = head.partition(b"\r\n")
    if len(line) >= MAX_REQUEST_LINE:  # judged so before its end too
        return "a request line over 8 KiB"
    if not crlf and end < 0:  # no complete request line yet
        return MORE, None, None, None
    parts = line.split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1") or parts[0].translate(None, _TCHAR):
        return "not an HTTP/1 request line (RFC 9112 3)"
    method, target = parts[0], parts[1]
    if target.translate(None, _TARGET_CHAR):
        return "a control or non-ASCII byte in the request target"
    if end < 0:
        return MORE, None, None, None
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
    host = length = None
    chunked = upgrade = False
    for line in head.split(b"\r\n")[1:]:
        field, colon, value = line.partition(b":")
        if not colon or not field or field.translate(None, _TCHAR):
            return "a field line whose name is not a token followed by a colon (RFC 9112 5.1, 5.2)"
        value = value.strip(b" \t")
        if value.translate(None, _FIELD_VCHAR):
            return "a control character in a field value (RFC 9110 5.5)"
        field = field.lower()
        dashed = field.replace(b"_", b"-")
        if dashed in _HOST_OVERRIDES:
            return f"a {field.decode()} field (some servers take the host from it instead of Host)"
        if dashed != field and dashed in _FRAMING:
            return f"a {field.decode()} field (some servers read _ as -)"
        if field == b"host":
            if host is not None:
                return "two Host fields (RFC 9112 3.2)"
            host = _authority(value)
            if host is None:
                return "a Host that is not host[:port] (RFC 9110 7.2)"
        elif field == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 19 or int(value) > MAX_LENGTH:
                return "a Content-Length that is not one decimal number under 2^63 (RFC 9112 6.3)"
            length = int(value)
        elif field == b"transfer-encoding":
            if chunked or value.lower() != b"chunked":
                return "a Transfer-Encoding other than one chunked (RFC 9112 6.1)"
            chunked = True
        elif field == b"upgrade":
            if upgrade or value.lower() != b"websocket":
                return "an Upgrade other than one websocket (h2c: HTTP/2 frames name any host, RFC 9113 8.3.1)"
            upgrade = True
    if chunked and (length is not None or parts[2] == b"HTTP/1.0"):
        return "a Transfer-Encoding with a Content-Length or in HTTP/1.0 (RFC 9112 6.1: read two ways)"
    body = CHUNKED if chunked else length or 0
    if method == b"CONNECT" or upgrade:
        if body:
            return "content on a CONNECT or Upgrade request (RFC 9110 9.3.6)"
        body = TUNNEL_2XX if method == b"CONNECT" else TUNNEL_101
    if named is None:
        return (NAME, host[0], host[1], body) if host is not None else (NONE, None, None, body)
    if host is None or host[0] != named[0] or host[1] not in (None, named[1]):
        return "a Host that is not the request target's host and port (RFC 9112 3.2)"
    return NAME, named[0], named[1], body


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
        got = _http_head(data)
        got = got[:3] if isinstance(got, tuple) else got
    else:
        got = "neither a TLS ClientHello nor an HTTP/1 request"
    return got if isinstance(got, tuple) else (got, None, None)


_HEAD, _BODY, _SIZE, _DATA, _CRLF, _LAST, _WAIT, _TUNNEL = range(8)  # Requests states


def _status(line: bytes) -> int | None:
    """The status code of an HTTP/1 status line (RFC 9112 4), or ``None``."""
    parts = line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.0", b"HTTP/1.1") or len(parts[1]) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


class Requests:
    """Every HTTP/1 request a guest sends on one connection, judged one by one (sans-IO).

    Theory of operation. The guest's bytes are fed in as they come (:meth:`feed`, any split); what
    :meth:`feed` returns may go to the server now, the rest is held until it is judged. The stream
    is framed as a compliant server frames it (RFC 9112 6): a request head (at most
    :data:`MAX_HELD` bytes, judged by the one function of the rules, ``first_name``'s, then by
    ``judge(name, port)``), then its content: ``Content-Length`` bytes (counted, not read), or
    chunks (each chunk-size line exactly 1 to 16 hex digits and CRLF, without chunk extensions;
    the chunk's bytes counted; CRLF; the last chunk followed by CRLF alone: trailer fields are
    refused), or nothing; then the next head. Framing a server could read two ways is refused in
    the head (two or a list of ``Content-Length``, a ``Transfer-Encoding`` but ``chunked``,
    both, ``Upgrade`` but ``websocket``). A ``CONNECT`` or an ``Upgrade: websocket`` switches the
    protocol only if the server agrees, which only its answer tells: the first request of a
    connection may be one, and the guest's bytes after it are held (at most :data:`MAX_HELD`)
    until the server's status line, shown to :meth:`answer` while :attr:`waiting`: a 2xx to the
    ``CONNECT`` or a 101 to the ``Upgrade`` makes the rest a tunnel, passed unread; any other
    answer leaves the connection HTTP/1 and the held bytes are judged as requests. A later one is
    refused (its answer would have to be told from the answers to the requests before it).

    Memory: the head being read (at most :data:`MAX_HELD` bytes), the bytes held during a switch
    and the server's answer head (each at most :data:`MAX_HELD`), a chunk-size line (at most
    :data:`MAX_SIZE_LINE`), counts, and at most 16 (name, port) pairs already allowed on this
    connection, which are not judged again (as an open flow is not when a DNS binding expires).

    Args:
        judge: ``judge(name, port)``: whether a request naming ``name`` (and ``port`` or ``None``)
            may pass.

    Attributes:
        refused: ``None``, or once the stream is refused (then :meth:`feed` returns nothing more)
            :data:`NAME` (:attr:`name` is not allowed), :data:`NONE` (a request names no server)
            or the reason, one phrase.
        name: the name of the refused request (or ``None``).
        count: requests passed.
    """

    __slots__ = ("judge", "refused", "name", "count", "_state", "_buf", "_left", "_switch", "_reply", "_passed")

    def __init__(self, judge) -> None:
        self.judge = judge
        self.refused: str | None = None
        self.name: str | None = None
        self.count = 0
        self._state = _HEAD
        self._buf = b""  # the element being read: a head, a chunk-size line, a CRLF; while waiting, the held bytes
        self._left = 0  # content or chunk bytes still to come
        self._switch = 0  # TUNNEL_2XX or TUNNEL_101 while waiting
        self._reply = b""  # the server's answer so far, while waiting
        self._passed: set = set()

    def __repr__(self) -> str:
        return f"Requests(count={self.count}, refused={self.refused!r})"

    @property
    def waiting(self) -> bool:
        """The first request switches the protocol and the server's answer is not read yet (nor refused)."""
        return self._state == _WAIT and self.refused is None

    def feed(self, data: bytes) -> bytes:
        """The guest's next bytes; returns those that may go to the server now (``b""`` once refused)."""
        if self.refused is not None:
            return b""
        if self._state == _TUNNEL:
            return data
        if len(data) < self._left:  # content (``_left`` is 0 in every other state): counted, not read
            self._left -= len(data)
            return data
        prior = self._buf  # held from before: the stream is prior + data, what stays held its end
        pos, n = 0, len(data)
        while pos < n and self.refused is None:
            state = self._state
            if state == _BODY or state == _DATA:
                take = min(self._left, n - pos)
                pos += take
                self._left -= take
                if not self._left:
                    self._state = _HEAD if state == _BODY else _CRLF
            elif state == _HEAD:
                pos = self._head(data, pos)
            elif state == _SIZE:
                pos = self._size(data, pos)
            elif state == _CRLF or state == _LAST:
                buf = self._buf + data[pos:pos + 2 - len(self._buf)]
                pos += len(buf) - len(self._buf)
                if b"\r\n"[:len(buf)] != buf:
                    self.refused = ("chunk data not followed by CRLF (RFC 9112 7.1)" if state == _CRLF else
                                    "a last chunk not followed by CRLF alone (no trailer field, RFC 9112 7.1.2)")
                elif len(buf) == 2:
                    buf = b""
                    self._state = _SIZE if state == _CRLF else _HEAD
                self._buf = buf
            else:  # _WAIT: held until the server's answer
                self._buf += data[pos:]
                pos = n
                if len(self._buf) > MAX_HELD:
                    self.refused = "over 16 KiB sent before the server answered a CONNECT or Upgrade"
        if self.refused is not None:
            return b""
        keep = len(self._buf)  # the end of prior + data still held
        return prior[:len(prior) + n - keep] if keep >= n else prior + data[:n - keep]

    def _head(self, data: bytes, pos: int) -> int:
        """Read a request head from ``data[pos:]``; returns where it stopped."""
        held = self._buf
        room = MAX_HELD - len(held)  # bytes this head may still take
        if held:  # its end may straddle the join
            tail = held[-3:]
            end = (tail + data[pos:pos + room]).find(b"\r\n\r\n")
            stop = pos + end + 4 - len(tail) if end >= 0 else -1
        else:
            end = data.find(b"\r\n\r\n", pos, pos + room)
            stop = end + 4 if end >= 0 else -1
        if stop < 0:  # not complete: refused at once if it cannot become a valid head
            head = held + data[pos:pos + room]
            got = _http_head(head)
            if isinstance(got, str):
                self.refused = got
            elif len(held) + len(data) - pos > MAX_HELD:
                self.refused = "a request head over 16 KiB"
            self._buf = head
            return len(data)
        head = held + data[pos:stop]
        self._buf = b""
        got = _http_head(head)
        if isinstance(got, str):
            self.refused = got
            return stop
        outcome, name, port, body = got
        if outcome != NAME or not self._allows(name, port):
            self.refused, self.name = outcome, name
            return stop
        if body < 0 and body != CHUNKED:
            if self.count:
                self.refused = "a CONNECT or Upgrade after the first request (its answer would not be told apart)"
                return stop
            self._state, self._switch = _WAIT, body
        elif body == CHUNKED:
            self._state = _SIZE
        elif body:
            self._state, self._left = _BODY, body
        self.count += 1
        return stop

    def _size(self, data: bytes, pos: int) -> int:
        """Read a chunk-size line (RFC 9112 7.1: ``1*16HEXDIG CRLF`` here) from ``data[pos:]``."""
        held = self._buf
        stop = min(len(data), pos + MAX_SIZE_LINE - len(held))
        lf = data.find(b"\n", pos, stop)
        if lf >= 0:
            stop = lf + 1
        line = held + data[pos:stop]
        if lf < 0:
            digits = line[:-1] if line.endswith(b"\r") else line
            if len(digits) > 16 or digits.translate(None, _HEX):
                self.refused = "a chunk size that is not 1 to 16 hex digits and CRLF (no chunk extension, RFC 9112 7.1)"
            self._buf = line
            return stop
        digits = line[:-2]  # at most 16: the line is read to MAX_SIZE_LINE bytes at most
        if line[-2:-1] != b"\r" or not digits or digits.translate(None, _HEX):
            self.refused = "a chunk size that is not 1 to 16 hex digits and CRLF (no chunk extension, RFC 9112 7.1)"
        elif int(digits, 16) > MAX_LENGTH:
            self.refused = "a chunk size over 2^63 - 1"
        else:
            self._left = int(digits, 16)
            self._state = _DATA if self._left else _LAST
        self._buf = b""
        return stop

    def _allows(self, name: str, port: int | None) -> bool:
        key = (name, port)
        if key in self._passed:
            return True
        if not self.judge(name, port):
            return False
        if len(self._passed) < _PASSED_MAX:
            self._passed.add(key)
        return True

    def end(self) -> None:
        """The guest's stream ended (its FIN goes to the server): bytes held for the server's answer
        to a ``CONNECT`` or ``Upgrade`` are dropped, and the answer is not read."""
        if self.waiting:
            self._state, self._buf = _HEAD, b""

    def answer(self, data: bytes) -> bytes:
        """The server's next bytes while :attr:`waiting` (else ignored); returns the guest's held bytes
        that may go to the server now. Only the status lines are read: 1xx heads but 101 are
        skipped; then a 2xx to the ``CONNECT`` or a 101 to the ``Upgrade`` switches, anything else
        (another status, no status line, more than :data:`MAX_HELD` bytes without a head's end)
        does not, and the held bytes are fed again as requests (they may be refused)."""
        if not self.waiting:
            return b""
        reply = self._reply + data
        while True:
            end = reply.find(b"\r\n\r\n")
            if end < 0 and len(reply) <= MAX_HELD:
                self._reply = reply
                return b""
            code = _status(reply[:reply.find(b"\r\n")]) if end >= 0 else None
            if code is None or not 100 <= code < 200 or code == 101:
                break
            reply = reply[end + 4:]  # an interim answer (RFC 9110 15.2)
        switched = code == 101 if self._switch == TUNNEL_101 else code is not None and 200 <= code < 300
        held, self._buf, self._reply = self._buf, b"", b""
        if switched:
            self._state = _TUNNEL
            return held
        self._state = _HEAD
        return self.feed(held)


class _Refused(Exception):
    """A later request of a verified connection is refused (see :class:`Requests`)."""


class _Checked:
    """The guest's reader, giving only what its :class:`Requests` passes; raises :class:`_Refused`."""

    __slots__ = ("reader", "requests")

    def __init__(self, reader, requests: Requests) -> None:
        self.reader, self.requests = reader, requests

    async def read(self, n: int) -> bytes:
        while True:
            data = await self.reader.read(n)
            if not data:
                self.requests.end()
                return data
            out = self.requests.feed(data)
            if self.requests.refused is not None:
                raise _Refused
            if out:
                return out


class _Answered:
    """The server's reader, showing :meth:`Requests.answer` the answer to a ``CONNECT`` or ``Upgrade``;
    what that releases is written to the server (at most :data:`MAX_HELD` bytes, once)."""

    __slots__ = ("reader", "requests", "upstream")

    def __init__(self, reader, requests: Requests, upstream) -> None:
        self.reader, self.requests, self.upstream = reader, requests, upstream

    async def read(self, n: int) -> bytes:
        data = await self.reader.read(n)
        if data and self.requests.waiting:
            out = self.requests.answer(data)
            if self.requests.refused is not None:
                raise _Refused
            if out:
                self.upstream.write(out)
        return data


class SniVerifier:
    """The ``--verify-sni`` handler (see the module documentation).

    Args:
        egress: the stack's :class:`~aioslirp.flow.egress.Egress` (rules, name bindings, audit).
        counters: the stack's counters (``egress.sni_denied``, ``egress.sni_verified``,
            ``egress.sni_requests_verified``).
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
        requests = None
        if outcome == NAME and held[0] != 22:  # HTTP/1: every request on the connection is judged
            requests = Requests(lambda name_, port_: self.allowed(flow, name_, port_))
            held = requests.feed(held)  # the first (again), and what follows it
            if requests.refused is not None:
                self._deny(flow, requests.name, requests.refused, requests.count)
                writer.transport.abort()
                return
        elif outcome != NAME or not self.allowed(flow, name):  # a ClientHello's SNI names no port
            self._deny(flow, name, outcome)
            writer.transport.abort()
            return
        self.counters["egress.sni_verified"] += 1
        connect = getattr(self.onward, "connect", None)
        up_r, up_w = await (connect(flow) if connect is not None else flow.open_upstream())
        up_w.write(held)
        if requests is None:
            await splice(reader, writer, up_r, up_w)
            return
        try:
            await splice(_Checked(reader, requests), writer,
                         _Answered(up_r, requests, up_w) if requests.waiting else up_r, up_w)
        except Exception:  # _Refused, or the guest's reset that splice's reset of both caused first
            if requests.refused is None:
                raise
            self._deny(flow, requests.name, requests.refused, requests.count)
        finally:
            if requests.count > 1:
                self.counters["egress.sni_requests_verified"] += requests.count - 1

    def _deny(self, flow, name, outcome: str, after: int = 0) -> None:
        """Count, log (once per address and name) and audit a refusal, of a request that followed
        ``after`` passed ones on the connection (0: of its first bytes)."""
        self.counters["egress.sni_denied"] += 1
        why = (f"names {name!r}, not allowed for it" if outcome == NAME else "names no server" if outcome == NONE
               else f"refused: {outcome}")
        if after:
            why = f"after {after} request{'s' if after > 1 else ''}, {why}"
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
