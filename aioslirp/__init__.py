"""aioslirp: an asyncio user-mode network stack (slirp) for VM and namespace guests.

Public names: :class:`Stack`, :class:`NetworkConfig`, :class:`ConfigError`, and the
transports :class:`TapTransport`, :class:`SocketPairTransport`, :class:`StreamTransport`
(QEMU ``-netdev stream``), :class:`DgramTransport` (QEMU ``-netdev dgram``); :class:`QemuServer`;
:class:`Switch` (several guests on one virtual network, each behind a stack of its own; a :class:`GuestPort` each); port forwards
:class:`PortForward` and :class:`ForwardError`; :func:`spawn` (a command in its own network namespace
behind its own stack; a :class:`Guest`), :func:`attach` (serve an existing namespace) and :class:`NamespaceError`; :class:`FlowInfo`, the records of
``Stack.flows()``; flows to Python (docs/handlers.md):
:func:`splice`, :class:`GuestFlow`; :class:`TapError` (a TAP that cannot be opened or served).

The types an embedder is handed or hands over: :class:`Event` and :class:`EventLog` (``Stack.events()``,
``Stack.event_log``), :class:`AuditLog` (``Stack(audit=...)``), :class:`PolicyRequest` (what the egress
hook ``Stack(policy=...)`` is asked), :class:`Route` (``Stack.route()``), :class:`GuestReader`,
:class:`GuestWriter` and :class:`Datagrams` (a handler's arguments), :class:`UpstreamProxy` (a built-in
handler), :class:`Transport` and :class:`TransportWrapper` (the bases of a transport of one's own),
:class:`PcapTransport` (a wrapper for ``Stack.transport_wrappers``).
"""

from .compiled import install_source_finder as _install_source_finder

_install_source_finder()  # AIOSLIRP_NO_EXTENSIONS=1: the .py sources even where compiled modules exist

from .config import NetworkConfig  # noqa: E402
from .errors import ConfigError  # noqa: E402

__all__ = ["ConfigError", "ForwardError", "NetworkConfig", "PortForward", "Stack", "SocketPairTransport", "TapTransport",
           "StreamTransport", "DgramTransport", "QemuServer", "Switch", "GuestPort", "spawn", "Guest", "attach", "NamespaceError", "FlowInfo",
           "splice", "GuestFlow", "TapError",
           # the types an embedder is handed or hands over
           "Event", "EventLog", "AuditLog", "PolicyRequest", "Route", "GuestReader", "GuestWriter", "Datagrams",
           "UpstreamProxy", "Transport", "TransportWrapper", "PcapTransport"]
__version__ = "0.2.0"


# The heavier names are imported on first use (PEP 562), so that entry points that do not
# need the stack (``aioslirp-slirp4netns --help``, which RootlessKit and Podman run before
# every start) stay fast.
_LAZY = {
    "ForwardError": ".nat.forward",
    "PortForward": ".config.forward",
    "Stack": ".stack",
    "SocketPairTransport": ".transport.socketpair",
    "TapTransport": ".transport.tap",
    "StreamTransport": ".transport.stream",
    "DgramTransport": ".transport.dgram",
    "QemuServer": ".frontends.qemu",
    "Switch": ".switch",
    "GuestPort": ".switch",
    "spawn": ".frontends.spawn",
    "Guest": ".frontends.spawn",
    "NamespaceError": ".host.nsbase",
    "attach": ".frontends.netns",
    "FlowInfo": ".flow.info",
    "splice": ".handlers.splice",
    "GuestFlow": ".handlers.streams",
    "TapError": ".transport.tapdev",
    "Event": ".observe.events",
    "EventLog": ".observe.events",
    "AuditLog": ".observe.audit",
    "PolicyRequest": ".flow.egress",
    "Route": ".handlers.routes",
    "GuestReader": ".handlers.streams",
    "GuestWriter": ".handlers.streams",
    "Datagrams": ".handlers.udp",
    "UpstreamProxy": ".handlers.proxy",
    "Transport": ".transport.base",
    "TransportWrapper": ".transport.base",
    "PcapTransport": ".transport.pcap",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aioslirp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
