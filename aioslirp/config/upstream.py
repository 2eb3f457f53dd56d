"""The upstream proxy settings: its URL (``--upstream-proxy``) and the ``NO_PROXY``-style exclusions.

Sans-I/O: parsing and matching only; :mod:`aioslirp.handlers.proxy` speaks to the proxy.

* URL: ``http://HOST:PORT`` (HTTP ``CONNECT``, RFC 9110 9.3.6) or ``socks5://HOST:PORT`` (RFC 1928;
  ``socks5h://`` is the same: the proxy resolves the names we pass); optional ``USER:PASSWORD@``
  (percent-encoded), else the credentials come from the environment variables
  ``AIOSLIRP_PROXY_USER`` and ``AIOSLIRP_PROXY_PASSWORD`` (HTTP Basic, RFC 7617; SOCKS5
  user/password, RFC 1929). The guest never supplies proxy credentials.
* exclusions (``--no-proxy``, else the ``NO_PROXY`` / ``no_proxy`` environment variable): a list
  separated by commas or spaces of ``*`` (everything), domain names (``example.com`` or
  ``.example.com``: the name and every name under it; ``*.example.com`` likewise), addresses
  and CIDR networks, each optionally followed by ``:PORT``. A name entry matches the flow's DNS
  name (when the virtual DNS bound one), an address or network entry the destination address.
"""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError

__all__ = ["NoProxy", "ProxyUrl", "parse_proxy_url"]

_SCHEMES = {"http": "http", "socks5": "socks5", "socks5h": "socks5"}
_DEFAULT_PORTS = {"http": 3128, "socks5": 1080}


class ProxyUrl:
    """A parsed proxy URL: ``kind`` (``"http"`` or ``"socks5"``), ``host``, ``port``, ``user`` and
    ``password`` (``None`` when none)."""

    __slots__ = ("kind", "host", "port", "user", "password")

    kind: str
    host: str
    port: int
    user: str | None
    password: str | None

    def __repr__(self) -> str:  # never the password
        return f"ProxyUrl({self.kind}://{self.host}:{self.port}{' with credentials' if self.user else ''})"


def parse_proxy_url(text: str, field_name: str = "upstream_proxy", env=None) -> ProxyUrl:
    """Parse ``text`` (see the module documentation); credentials not in the URL are taken from
    ``env`` (default ``os.environ``). Raises :class:`ConfigError` naming ``field_name``."""
    env = os.environ if env is None else env
    try:
        u = urlsplit(str(text).strip())
        port = u.port
    except ValueError as exc:
        raise ConfigError(field_name, f"{text!r}: {exc}") from None
    kind = _SCHEMES.get(u.scheme.lower())
    if kind is None:
        raise ConfigError(field_name, f"{text!r}: the scheme must be http://, socks5:// or socks5h://")
    if not u.hostname:
        raise ConfigError(field_name, f"{text!r}: no proxy host")
    if u.path not in ("", "/") or u.query or u.fragment:
        raise ConfigError(field_name, f"{text!r}: expected SCHEME://[USER:PASSWORD@]HOST:PORT and nothing more")
    p = ProxyUrl()
    p.kind, p.host, p.port = kind, u.hostname, port or _DEFAULT_PORTS[kind]
    if u.username is not None:
        p.user, p.password = unquote(u.username), unquote(u.password or "")
    else:
        user = env.get("AIOSLIRP_PROXY_USER")
        p.user, p.password = (user, env.get("AIOSLIRP_PROXY_PASSWORD", "")) if user else (None, None)
    if p.user is not None and kind == "socks5" and (len(p.user.encode()) > 255 or len(p.password.encode()) > 255):
        raise ConfigError(field_name, "SOCKS5 user names and passwords are at most 255 bytes (RFC 1929)")
    return p


class NoProxy:
    """``NO_PROXY``-style exclusions (see the module documentation). ``text`` ``None``: the
    ``NO_PROXY`` (or ``no_proxy``) variable of ``env`` (default ``os.environ``); empty: none."""

    __slots__ = ("everything", "names", "nets")

    everything: bool
    #: ``(suffix, port or None)``: the name and the names under it.
    names: list
    #: ``(network, port or None)``.
    nets: list

    def __init__(self, text: str | None = None, env=None) -> None:
        if text is None:
            env = os.environ if env is None else env
            text = env.get("NO_PROXY", env.get("no_proxy", ""))
        self.everything = False
        self.names: list = []
        self.nets: list = []
        for entry in str(text).replace(",", " ").split():
            entry = entry.strip().lower()
            if entry == "*":
                self.everything = True
                continue
            host, port = entry, None
            if entry.startswith("["):  # [v6]:port
                end = entry.find("]")
                host, rest = entry[1:end], entry[end + 1:]
                port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
            elif entry.count(":") == 1:
                h, _, p = entry.partition(":")
                if p.isdigit():
                    host, port = h, int(p)
            try:
                self.nets.append((ipaddress.ip_network(host, strict=False), port))
                continue
            except ValueError:
                pass
            host = host.removeprefix("*.").lstrip(".").rstrip(".")
            if host:
                self.names.append((host, port))

    def excluded(self, name: str | None, addr: str, port: int) -> bool:
        """True when a flow to ``addr`` (text) and ``port``, whose destination is bound to DNS ``name``
        (or ``None``), goes direct, not through the proxy."""
        if self.everything:
            return True
        if name:
            name = name.lower().rstrip(".")
            for suffix, p in self.names:
                if (p is None or p == port) and (name == suffix or name.endswith("." + suffix)):
                    return True
        if self.nets:
            try:
                a = ipaddress.ip_address(addr.split("%", 1)[0])
            except ValueError:
                return False
            for net, p in self.nets:
                if (p is None or p == port) and a.version == net.version and a in net:
                    return True
        return False

    def __bool__(self) -> bool:
        return self.everything or bool(self.names or self.nets)
