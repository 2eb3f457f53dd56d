"""aioslirp: an asyncio user-mode network stack (slirp) for VM and namespace guests.

Public names: :class:`Stack`, :class:`NetworkConfig`, :class:`ConfigError`, and the
transports :class:`TapTransport`, :class:`SocketPairTransport`.
"""

from .config import ConfigError, NetworkConfig
from .stack import Stack
from .transport.socketpair import SocketPairTransport

__all__ = ["ConfigError", "NetworkConfig", "Stack", "SocketPairTransport", "TapTransport"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "TapTransport":
        from .transport.tap import TapTransport
        return TapTransport
    raise AttributeError(name)
