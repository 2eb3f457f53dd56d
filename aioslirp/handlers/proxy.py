"""Upstream proxy chaining: the guest's TCP flows leave through an HTTP CONNECT or a SOCKS5 proxy.

:class:`UpstreamProxy` is a TCP handler (``Stack(tcp_handler=UpstreamProxy("http://proxy:3128"))``,
or ``--upstream-proxy``): for each flow it opens a tunnel through the proxy to the flow's
destination and splices the guest's streams into it. The destination given to the proxy is the
flow's DNS name when the virtual DNS bound one (so that the proxy resolves it and applies its
own name policy), else its address; the port is the guest's. Every TCP flow is tunnelled,
plain HTTP included (``CONNECT host:80``): the guest's bytes pass unchanged.

* HTTP (RFC 9110 9.3.6): ``CONNECT host:port HTTP/1.1`` with ``Proxy-Authorization: Basic``
  when credentials are configured; a 2xx answer opens the tunnel (at most :data:`MAX_HEAD`
  bytes of answer head are read).
* SOCKS5 (RFC 1928): no authentication, or user/password (RFC 1929) when configured; ``CONNECT``
  with a domain name (ATYP 3) or an address (ATYP 1 / 4).

Credentials come from the proxy URL or the environment (:mod:`aioslirp.config.upstream`), never
from the guest. Destinations excluded by ``no_proxy`` are connected directly
(``flow.open_upstream()``). A proxy that cannot be reached, refuses, or answers with an error
ends the guest's connection with a RST (the guest's ``connect()`` already succeeded: the SYN
was answered at once), logged once per reason at INFO and counted in :attr:`UpstreamProxy.failures`.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import struct

from ..config.upstream import NoProxy, parse_proxy_url
from .splice import splice

__all__ = ["MAX_HEAD", "ProxyError", "UpstreamProxy"]

log = logging.getLogger("aioslirp.handlers")

#: Bytes of a proxy's answer head read at most (an HTTP status line and headers).
MAX_HEAD = 16384

_SOCKS_ERRORS = {1: "general SOCKS server failure", 2: "connection not allowed by ruleset", 3: "network unreachable",
                 4: "host unreachable", 5: "connection refused", 6: "TTL expired", 7: "command not supported",
                 8: "address type not supported"}


class ProxyError(ConnectionError):
    """The proxy refused the tunnel (its answer in the message)."""


class UpstreamProxy:
    """A TCP handler tunnelling every flow through the proxy at ``url`` (see the module documentation).

    Args:
        url: ``http://[USER:PASSWORD@]HOST:PORT`` or ``socks5://...`` (:func:`~aioslirp.config.upstream.parse_proxy_url`;
            ``ConfigError`` when it does not parse).
        no_proxy: ``NO_PROXY``-style exclusions (text); ``None``: the ``NO_PROXY`` environment variable.
        timeout: seconds for reaching the proxy and its answer.
        env: the environment to read credentials and ``NO_PROXY`` from (default ``os.environ``).

    Attributes:
        failures: flows that could not be tunnelled (ended with a RST).
        direct: flows excluded by ``no_proxy`` (connected directly).
    """

    __slots__ = ("url", "no_proxy", "timeout", "failures", "direct", "_logged")

    def __init__(self, url: str, *, no_proxy: str | None = None, timeout: float = 10.0, env=None) -> None:
        self.url = parse_proxy_url(url, "upstream_proxy", env)
        self.no_proxy = NoProxy(no_proxy, env)
        self.timeout = float(timeout)
        self.failures = 0
        self.direct = 0
        self._logged: set = set()

    @classmethod
    def from_config(cls, config) -> "UpstreamProxy":
        """The handler for ``config.upstream_proxy`` / ``config.no_proxy`` (connect timeout: ``tcp_connect_timeout``)."""
        return cls(config.upstream_proxy, no_proxy=config.no_proxy, timeout=float(config.tcp_connect_timeout))

    def __repr__(self) -> str:
        return f"UpstreamProxy({self.url!r})"

    async def __call__(self, flow, reader, writer) -> None:
        try:
            up_r, up_w = await self.connect(flow)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self.failures += 1
            why = type(exc).__name__ if not isinstance(exc, ProxyError) else str(exc)
            if why not in self._logged and len(self._logged) < 64:
                self._logged.add(why)
                log.info("upstream proxy %s: %r failed: %s (reset; logged once per reason)", self.url, flow, exc)
            writer.transport.abort()
            return
        await splice(reader, writer, up_r, up_w)

    async def connect(self, flow):
        """Open ``flow``'s upstream: through the proxy, or directly when excluded. Returns
        ``(reader, writer)`` owned by the flow; raises ``OSError`` (:class:`ProxyError` when the proxy
        answered with a refusal), ``TimeoutError``, ``asyncio.IncompleteReadError``."""
        host, port = flow.destination[0], flow.destination[1]
        if self.no_proxy and self.no_proxy.excluded(flow.name, flow.remote, port):
            self.direct += 1
            return await flow.open_upstream()
        u = self.url
        r, w = await asyncio.wait_for(asyncio.open_connection(u.host, u.port, limit=MAX_HEAD), self.timeout)
        flow.own(w)
        target = flow.name or flow.remote or host
        if u.kind == "http":
            await asyncio.wait_for(self._http(r, w, target, port), self.timeout)
        else:
            await asyncio.wait_for(self._socks5(r, w, target, port), self.timeout)
        return r, w

    async def _http(self, r, w, target: str, port: int) -> None:
        u = self.url
        hostport = f"[{target}]:{port}" if ":" in target else f"{target}:{port}"
        head = f"CONNECT {hostport} HTTP/1.1\r\nHost: {hostport}\r\n"
        if u.user is not None:
            token = base64.b64encode(f"{u.user}:{u.password}".encode()).decode()
            head += f"Proxy-Authorization: Basic {token}\r\n"
        w.write((head + "\r\n").encode())
        answer = await r.readuntil(b"\r\n\r\n")  # LimitOverrunError past MAX_HEAD
        status_line = answer.split(b"\r\n", 1)[0].decode("latin-1")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise ProxyError(f"not an HTTP answer: {status_line[:80]!r}")
        if not 200 <= int(parts[1]) < 300:
            raise ProxyError(f"proxy answered {status_line[:80]!r}")

    async def _socks5(self, r, w, target: str, port: int) -> None:
        u = self.url
        w.write(b"\x05\x02\x00\x02" if u.user is not None else b"\x05\x01\x00")
        ver, method = await r.readexactly(2)
        if ver != 5 or method not in (0, 2) or (method == 2 and u.user is None):
            raise ProxyError("SOCKS5: no acceptable authentication method")
        if method == 2:
            user, pw = u.user.encode(), u.password.encode()
            w.write(bytes([1, len(user)]) + user + bytes([len(pw)]) + pw)
            ver, status = await r.readexactly(2)
            if status != 0:
                raise ProxyError("SOCKS5: user/password authentication failed")
        try:
            a = ipaddress.ip_address(target)
            addr = (b"\x01" if a.version == 4 else b"\x04") + a.packed
        except ValueError:
            name = target.encode("idna")
            addr = b"\x03" + bytes([len(name)]) + name
        w.write(b"\x05\x01\x00" + addr + struct.pack("!H", port))
        ver, rep, _rsv, atyp = await r.readexactly(4)
        if ver != 5 or rep != 0:
            raise ProxyError(f"SOCKS5: {_SOCKS_ERRORS.get(rep, f'error {rep}')}")
        n = {1: 4, 4: 16}.get(atyp)
        if n is None:
            if atyp != 3:
                raise ProxyError(f"SOCKS5: unknown address type {atyp}")
            n = (await r.readexactly(1))[0]
        await r.readexactly(n + 2)  # BND.ADDR, BND.PORT
