"""A port forward host -> guest as a value (``-p/--publish``, ``add_hostfwd``), and its parser.

:class:`PortForward` names a host address and port to listen on, a protocol and a guest
address and port; :func:`parse_publish` reads one from the ``--publish`` form. The forwarder
that listens and turns host connections into flows is :class:`~aioslirp.nat.forward.Forwarder`
(``Stack.add_forward()``); it checks a forward against the stack's network when it is added.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, replace

from ..errors import ConfigError

__all__ = ["PROTOS", "PortForward", "parse_publish", "parse_guest_publish"]

#: The protocols a forward carries.
PROTOS = ("tcp", "udp")


@dataclass(frozen=True)
class PortForward:
    """One port forward from the host into the guest.

    Fields (slirp4netns ``add_hostfwd`` names):

    ``proto``
        ``"tcp"`` or ``"udp"``.
    ``host_addr``
        IPv4 or IPv6 address to listen on (default ``127.0.0.1``; ``0.0.0.0`` / ``::``
        for all addresses).
    ``host_port``
        Host port, 1-65535; ``0`` asks the kernel for a free port (library only) and
        :meth:`Stack.add_forward` returns the port it got.
    ``guest_addr``
        Guest IPv4 address (within the stack's network, ``cidr``) or IPv6 address (within
        ``cidr6``, e.g. the SLAAC address the guest took; the stack must serve IPv6); ``None``
        means the configured guest address (``NetworkConfig.guest``, what ``aioslirp run``
        gives the namespace). The host side may be either family whatever the guest's is.
    ``guest_port``
        Guest port, 1-65535.
    ``id``
        Assigned by the stack when added (1, 2, ... per stack), ``None`` before.
    """

    proto: str = "tcp"
    host_addr: str = "127.0.0.1"
    host_port: int = 0
    guest_addr: str | None = None
    guest_port: int = 0
    id: int | None = None

    def spec(self) -> str:
        """The forward as ``HOST_IP:HOST_PORT:[GUEST_IP:]GUEST_PORT/PROTO`` (``[v6]`` in brackets),
        the form :func:`parse_publish` reads."""
        host = f"[{self.host_addr}]" if ":" in self.host_addr else self.host_addr
        g = self.guest_addr
        guest = "" if not g else (f"[{g}]:" if ":" in g else f"{g}:")
        return f"{host}:{self.host_port}:{guest}{self.guest_port}/{self.proto}"

    def to_dict(self) -> dict:
        """A dict with the slirp4netns ``list_hostfwd`` entry fields (and ``id``)."""
        return asdict(self)


_PUBLISH_FORM = "[HOST_IP:]HOST_PORT:[GUEST_IP:]GUEST_PORT[/tcp|/udp] (IPv6 addresses in brackets)"


def _fields(spec: str, option: str, text: str) -> list[tuple[str, bool]]:
    """``spec`` split at ``:`` outside brackets: ``[(field, bracketed), ...]``."""
    out = []
    i, n = 0, len(spec)
    while True:
        if spec.startswith("[", i):
            end = spec.find("]", i)
            if end < 0:
                raise ConfigError(option, f"{text!r}: unterminated '['; expected {_PUBLISH_FORM}")
            out.append((spec[i + 1:end], True))
            i = end + 1
            if i < n and spec[i] != ":":
                raise ConfigError(option, f"{text!r}: expected ':' after ']'; expected {_PUBLISH_FORM}")
        else:
            end = spec.find(":", i)
            end = n if end < 0 else end
            out.append((spec[i:end], False))
            i = end
        if i >= n:
            return out
        i += 1  # the ':'


def _is_addr(field: tuple[str, bool]) -> bool:
    return field[1] or "." in field[0]


def parse_publish(text: str, option: str = "--publish") -> PortForward:
    """Parse ``[HOST_IP:]HOST_PORT:[GUEST_IP:]GUEST_PORT[/tcp|/udp]`` into a :class:`PortForward`.

    ``HOST_IP`` defaults to ``127.0.0.1``, ``GUEST_IP`` to the configured guest address; IPv6
    addresses go in brackets: ``[::1]:8080:80``, ``[::1]:8080:[fd00::100]:80``,
    ``8080:[fd00::100]:80`` (host 127.0.0.1 to the guest's IPv6 address),
    ``0.0.0.0:8080:10.0.2.100:80/udp``. Raises :class:`~aioslirp.config.ConfigError` naming
    ``option`` (one line).
    """
    spec = text.strip()
    proto = "tcp"
    if "/" in spec:
        spec, proto = spec.rsplit("/", 1)
        proto = proto.lower()
        if proto not in PROTOS:
            raise ConfigError(option, f"{text!r}: protocol must be tcp or udp, not {proto!r}")
    fields = _fields(spec, option, text)
    host, guest = ("127.0.0.1", False), None
    if len(fields) == 4:
        host, hport, guest, gport = fields
    elif len(fields) == 3 and _is_addr(fields[1]):
        hport, guest, gport = fields
    elif len(fields) == 3:
        host, hport, gport = fields
    elif len(fields) == 2:
        hport, gport = fields
    else:
        raise ConfigError(option, f"{text!r}: expected {_PUBLISH_FORM}")
    addrs = []
    for what, field in (("host", host), ("guest", guest)):
        if field is None:
            addrs.append(None)
            continue
        try:
            a = ipaddress.ip_address(field[0])
        except ValueError:
            raise ConfigError(option, f"{text!r}: {field[0]!r} is not an IP address ({what})") from None
        if a.version == 6 and not field[1]:
            raise ConfigError(option, f"{text!r}: the IPv6 address {a} needs brackets, [{a}]")
        addrs.append(str(a))
    if hport[1] or gport[1]:
        raise ConfigError(option, f"{text!r}: a port is not bracketed; expected {_PUBLISH_FORM}")
    hp, gp = _port(hport[0], option, text), _port(gport[0], option, text)
    return PortForward(proto=proto, host_addr=addrs[0], host_port=hp, guest_addr=addrs[1], guest_port=gp)


_GUEST_FORM = "[HOST_IP:]HOST_PORT:GUEST:GUEST_PORT[/tcp|/udp] (GUEST a guest's name or IPv4 address, e.g. 8080:vm1:80)"


def parse_guest_publish(text: str, option: str = "--publish") -> tuple[str, PortForward]:
    """Parse ``[HOST_IP:]HOST_PORT:GUEST:GUEST_PORT[/tcp|/udp]``, a forward into one guest of
    several (``aioslirp qemu --switch``): ``GUEST`` is a guest's name (one DNS label, like
    ``vm1``) or its IPv4 address; ``HOST_IP`` defaults to ``127.0.0.1`` (IPv6 in brackets).
    Returns ``(guest, forward)``: ``guest`` lower case, ``forward.guest_addr`` the address when
    ``GUEST`` is one, else ``None`` (the named guest's own address). Raises
    :class:`~aioslirp.config.ConfigError` naming ``option`` (one line).
    """
    from .records import check_name

    spec = text.strip()
    proto = ""
    if "/" in spec:
        spec, proto = spec.rsplit("/", 1)
        proto = "/" + proto
    fields = _fields(spec, option, text)
    if len(fields) == 4:
        host, hport, guest, gport = fields
    elif len(fields) == 3 and not _is_addr(fields[0]):
        host, (hport, guest, gport) = None, fields
    else:
        raise ConfigError(option, f"{text!r}: name the guest, {_GUEST_FORM}")
    if guest[1] or ":" in guest[0]:
        raise ConfigError(option, f"{text!r}: a guest's IPv6 address is its own (SLAAC): name the guest, "
                                  f"{_GUEST_FORM}")
    try:
        addr: str | None = str(ipaddress.IPv4Address(guest[0].strip()))
        name = addr
    except ValueError:
        addr = None
        name = check_name(guest[0], option)
        if "." in name:
            raise ConfigError(option, f"{text!r}: {guest[0]!r} is neither a guest's name (one DNS label) "
                                      "nor an IPv4 address")
    parts = [] if host is None else [f"[{host[0]}]" if host[1] else host[0]]
    try:
        fwd = parse_publish(":".join(parts + [hport[0], gport[0]]) + proto, option)
    except ConfigError as exc:  # its message quotes the forward without GUEST: quote the user's text
        raise ConfigError(option, f"{text!r}: {exc.detail.split(': ', 1)[-1]}") from None
    return name, replace(fwd, guest_addr=addr)


def _port(p: str, option: str, text: str) -> int:
    if not p:
        raise ConfigError(option, f"{text!r}: expected {_PUBLISH_FORM}")
    p = p.strip()
    if not p.isdigit() or not 1 <= int(p) <= 65535:
        raise ConfigError(option, f"{text!r}: port {p!r} is not a number in 1-65535")
    return int(p)
