"""``--verify-sni``: a flow a name rule allowed must name an allowed name in its first bytes.

Two names may share one address (a CDN): a rule allowing ``allowed.test`` admits every flow to the
addresses ``allowed.test`` resolved to, including one that asks the server for ``other.test``. With
``verify_sni`` the stack hands each TCP flow that an egress *name* rule allowed (and that no route
takes) to :class:`SniVerifier`: the guest's handshake is answered at once (no host connect yet),
its first bytes are held (at most :data:`MAX_HELD` bytes, for at most ``timeout`` seconds) until
they name the server:

* a TLS ClientHello (RFC 8446 4.1.2, possibly over several records): its ``server_name``
  extension (RFC 6066 3), the ``host_name`` entry;
* an HTTP/1 request: its ``Host`` header (port removed).

The name must be bound to the flow's address by the virtual DNS for this guest, and allowed for
the port by the rules (the most specific name rule allows it; no name rule: ``egress_default``).
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
import logging
import struct
import time

from .splice import splice

__all__ = ["MAX_HELD", "SniVerifier", "first_name"]

log = logging.getLogger("aioslirp.limits")

#: Guest bytes held at most while looking for the name.
MAX_HELD = 16384
_LOGGED_MAX = 1024
MORE, NAME, NONE = "more", "name", "none"  # first_name() outcomes (and "bad")


def _client_hello(data: bytes):
    """``(outcome, name)`` for bytes starting with a TLS record (see :func:`first_name`)."""
    hs = b""
    pos = 0
    while True:  # gather the handshake bytes of the leading handshake records
        if len(data) - pos < 5:
            break
        ctype, _ver, n = struct.unpack_from("!BHH", data, pos)
        if ctype != 22 or n == 0 or n > 16384 + 2048:
            return "bad", None
        if len(data) - pos - 5 < n:
            hs += data[pos + 5:]
            break
        hs += data[pos + 5:pos + 5 + n]
        pos += 5 + n
        if len(hs) >= 4 and len(hs) >= 4 + int.from_bytes(hs[1:4], "big"):
            break
    if len(hs) < 4:
        return MORE, None
    if hs[0] != 1:  # client_hello
        return "bad", None
    n = int.from_bytes(hs[1:4], "big")
    if len(hs) < 4 + n:
        return MORE, None
    b = hs[4:4 + n]
    try:
        p = 2 + 32  # legacy_version, random
        p += 1 + b[p]  # legacy_session_id
        p += 2 + int.from_bytes(b[p:p + 2], "big")  # cipher_suites
        p += 1 + b[p]  # legacy_compression_methods
        if p == len(b):
            return NONE, None  # no extensions
        end = p + 2 + int.from_bytes(b[p:p + 2], "big")
        if end > len(b):
            return "bad", None
        p += 2
        found = None  # the host_name of the server_name extension once seen ("" when none in it)
        while p + 4 <= end:
            etype, elen = struct.unpack_from("!HH", b, p)
            p += 4
            if etype == 0:  # server_name: ServerNameList (RFC 6066 3: one name per type)
                if found is not None:
                    return "bad", None  # a second server_name extension (RFC 8446 4.2: at most one)
                q, qend = p + 2, p + 2 + int.from_bytes(b[p:p + 2], "big")
                found = ""
                while q + 3 <= min(qend, p + elen):
                    ntype, nlen = b[q], int.from_bytes(b[q + 1:q + 3], "big")
                    if ntype == 0:
                        name = b[q + 3:q + 3 + nlen]
                        if len(name) != nlen or found:
                            return "bad", None  # truncated, or a second host_name (RFC 6066 3)
                        found = name.decode("ascii").lower().rstrip(".")
                    q += 3 + nlen
            p += elen
        if found:
            return NAME, found
    except (IndexError, UnicodeDecodeError):
        return "bad", None
    return NONE, None


def _http_host(data: bytes):
    first = data.find(b"\r\n")
    if first < 0:
        return (MORE, None) if len(data) < 8192 else ("bad", None)
    parts = data[:first].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return "bad", None
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return MORE, None
    lines = data[:end].split(b"\r\n")
    target = parts[1]
    if b"://" in target:  # absolute-form (RFC 9112 3.2.2): the server takes the host from it
        authority = target.split(b"://", 1)[1].split(b"/", 1)[0].split(b"?", 1)[0]
        if b"@" in authority:
            return "bad", None
        return NAME, _host_text(authority)
    found = None
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            return "bad", None  # obs-fold (RFC 9112 5.2): refused rather than guessed at
        k, sep, v = line.partition(b":")
        if not sep or k != k.strip():
            return "bad", None  # no colon, or whitespace around the field name (RFC 9112 5.1: 400)
        if k.lower() == b"host":
            if found is not None:
                return "bad", None  # a second Host (RFC 9112 3.2: 400)
            found = _host_text(v.strip())
    return (NAME, found) if found is not None else (NONE, None)


def _host_text(host: bytes) -> str:
    """``host[:port]`` (or ``[v6][:port]``) as a lower-case name without the port and trailing dot."""
    h = host.decode("ascii", "replace").lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0].rstrip(".") if h.count(":") == 1 else h.rstrip(".")


def _guest(g: tuple) -> str:
    return f"[{g[0]}]:{g[1]}" if ":" in g[0] else f"{g[0]}:{g[1]}"


def first_name(data: bytes):
    """The server name the guest's first bytes ask for: ``(outcome, name)`` with outcome ``"name"``
    (``name``: lower case, no trailing dot), ``"more"`` (need more bytes), ``"none"`` (a ClientHello
    or request without one) or ``"bad"`` (neither a ClientHello nor an HTTP/1 request)."""
    if not data:
        return MORE, None
    if data[0] == 22:
        return _client_hello(data)
    if data[:1].isalpha() and data[:1].isupper():
        return _http_host(data)
    return "bad", None


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

    def allowed(self, flow, name: str) -> bool:
        """``name`` is bound to ``flow``'s address and allowed for its port by the rules."""
        eg = self.egress
        if name not in eg.bindings.names(flow.remote, asyncio.get_running_loop().time()):
            return False
        r = eg.rules.match_name(name, flow.destination[1], 6)
        return r.allow if r is not None else eg.default_allow

    async def __call__(self, flow, reader, writer) -> None:
        held = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        outcome, name = MORE, None
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
            outcome, name = first_name(held)
        if outcome != NAME or not self.allowed(flow, name):
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
        why = f"names {name!r}, not allowed for it" if outcome == NAME else f"no server name ({outcome})"
        key = (flow.remote, name)
        if key not in self._logged and len(self._logged) < _LOGGED_MAX:
            self._logged.add(key)
            log.info("verify-sni: guest flow to %s:%d (allowed as %s) %s: reset", flow.remote, flow.destination[1],
                     flow.name, why)
        ctx = getattr(self.egress, "ctx", None)
        audit = ctx.audit if ctx is not None else None
        if audit is not None:
            audit.record({"event": "deny", "time": time.time(), "proto": "tcp", "guest": _guest(flow.guest),
                          "dst": flow.remote, "port": flow.destination[1], "name": name, "verdict": "deny",
                          "rule": "verify-sni"})
