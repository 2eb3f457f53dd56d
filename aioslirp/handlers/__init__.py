"""Guest flows handed to Python coroutines (issue 17): the handler API and built-in handlers.

A TCP handler is ``async def handler(flow: GuestFlow, reader, writer)`` with asyncio stream
semantics (:mod:`aioslirp.handlers.streams`); a UDP handler ``async def handler(flow, datagrams)``
(:mod:`aioslirp.handlers.udp`). ``Stack(tcp_handler=..., udp_handler=...)`` and
``Stack.route(match, handler)`` choose them (:mod:`aioslirp.handlers.routes`); :func:`splice`
copies two stream pairs into each other. Built-ins: :mod:`aioslirp.handlers.proxy` (upstream HTTP
CONNECT and SOCKS5 proxies) and :mod:`aioslirp.handlers.record` (per-flow recording).
See docs/handlers.md.
"""

from .routes import Route, Router
from .splice import splice
from .streams import GuestFlow, GuestReader, GuestWriter

__all__ = ["GuestFlow", "GuestReader", "GuestWriter", "Route", "Router", "splice"]
