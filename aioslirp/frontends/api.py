"""The control API socket (``--api-socket PATH``), compatible with slirp4netns.

Protocol
--------
A UNIX stream socket. One request per connection: the client writes one JSON object
(optionally followed by a newline) and, as slirp4netns clients do, shuts down its write
side; the server answers with one JSON object in a single write (no trailing newline,
well under the 2,048 bytes Podman reads in one go for the port-forward commands) and
closes. A request is processed as soon as it parses, so clients that do not half-close
work too. Requests are at most :data:`MAX_REQUEST` bytes; a client that sends nothing
parseable within :data:`REQUEST_TIMEOUT` seconds gets the parse error.

Commands (``{"execute": NAME, "arguments": {...}}``) and replies:

``add_hostfwd``
    ``arguments``: ``proto`` (``"tcp"``/``"udp"``), ``host_addr`` (default ``127.0.0.1``;
    IPv6 accepted), ``host_port`` (1-65535), ``guest_addr`` (``""`` or absent: the
    configured guest address; an IPv6 address of the guest, e.g. ``"fd00::100"``, with or
    without brackets, forwards to it from the IPv6 gateway), ``guest_port``.
    Reply ``{"return":{"id":N}}``, ids 1, 2, ...
``list_hostfwd``
    Reply ``{"return":{"entries":[E...]},"entries":[E...]}`` with
    ``E = {"id","proto","host_addr","host_port","guest_addr","guest_port"}``. slirp4netns
    documents the ``return`` envelope but its binary (1.2.0) sends the bare ``entries``
    object; both are given so that clients written against either work.
``remove_hostfwd``
    ``arguments``: ``id``. Reply ``{"return":{}}``.
``get_stats``
    Reply ``{"return":{"frames":{"in","out"},"bytes":{"in","out"},"drops":{REASON:N},
    "flows":{PROTO:{STATE:N}},"flows_total":{PROTO:{"opened","closed"}},"forwards":N,
    "counters":{NAME:N}}}``: frames and bytes moved to/from the guest, guest frames
    dropped by reason, active flows by protocol and state, every counter.
``list_flows``
    Reply ``{"return":{"flows":[{"proto","direction","state","guest_addr","guest_port",
    "remote_addr","remote_port","host","idle_s"}...]}}``; ``direction`` is ``outbound``
    (the guest connected out) or ``inbound`` (a port forward); ``host`` is the host side
    (the remote for outbound flows, the host client for inbound ones); ``idle_s`` seconds
    since the flow's last activity; ``name`` (the DNS name whose binding let the flow through
    the egress policy) and ``rule`` (the egress rule that allowed it) when known;
    ``guest_name`` when the stack has a name (``--name``).

``add_rule``
    ``arguments``: ``rule`` (egress rule text, e.g. ``"pypi.org:443"``, ``"10.0.0.0/8:8000-8999/tcp"``),
    ``verdict`` (``"allow"``, the default, or ``"deny"``), ``close`` (default false: flows already
    open stay; true: the open flows the policy no longer allows, e.g. under a new deny rule, are
    ended). Reply ``{"return":{"rule":CANONICAL}}``, with ``"closed":N`` when ``close`` was given;
    the verdict cache is cleared (:mod:`aioslirp.flow.egress`).
``remove_rule``
    ``arguments``: ``rule``, ``close`` (default false: flows already open stay; true: the open
    flows the policy no longer allows are ended). Reply ``{"return":{"closed":N}}``; a rule that
    is not there: ``bad request: remove_rule: no such rule``.
``list_rules``
    Reply ``{"return":{"rules":[{"rule","verdict"}...],"default":"allow"|"deny","builtin":[...]}}``:
    the user's rules in the order given, the default verdict, and the built-in deny rules
    (``egress_deny_builtin``: link-local and metadata addresses and the like), which hold whatever
    the default says.

Errors are ``{"error":{"desc":"..."}}`` with slirp4netns's texts (``bad request: cannot
parse JSON``, ``bad request: json_object() failed``, ``bad request: no execute found``,
``bad request: unknown execute``, ``bad request: add_hostfwd: bad arguments.proto``, ...).
A host port already in use gives ``bad request: add_hostfwd: cannot listen on ADDR:PORT/PROTO:
Address already in use``. No request can make the server raise.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import socket
import stat

from ..config.forward import PortForward
from ..errors import ConfigError
from ..nat.forward import ForwardError

__all__ = ["ApiServer", "ApiSocketError", "MAX_REQUEST", "REQUEST_TIMEOUT"]

log = logging.getLogger("aioslirp.api")

#: Largest request in bytes (slirp4netns: 4,096).
MAX_REQUEST = 65536
#: Seconds a client has to send a complete request.
REQUEST_TIMEOUT = 10.0
#: ``sun_path`` holds 108 bytes including the terminating NUL.
_SUN_PATH_MAX = 107


class ApiSocketError(RuntimeError):
    """The API socket cannot be created. ``str(err)`` is one line naming the path."""


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _unknown_arguments(args: dict, known: tuple[str, ...]) -> str | None:
    """The first key of ``args`` that is not in ``known`` (sorted, so the reply is stable), or ``None``."""
    extra = sorted(k for k in args if k not in known)
    return extra[0] if extra else None


def _error(desc: str) -> dict:
    return {"error": {"desc": desc}}


def _port(value) -> int | None:
    """A JSON port number (int, or an integral float as parson gives) in 1-65535, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 1 <= value <= 65535:
        return value
    return None


def _socket_alive(path: str) -> bool:
    """True when something accepts connections on the UNIX socket ``path`` (a live server)."""
    import socket as _socket

    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class ApiServer:
    """Serves the control API for ``stack`` on the UNIX socket ``path``.

    ``await start()`` binds and listens (a stale socket file at ``path`` is replaced;
    any other file there is an error); ``await close()`` stops and removes the socket
    file. :meth:`handle` answers one raw request (bytes) without any socket, for tests
    and embedding. Raises :class:`ApiSocketError` from ``start``.
    """

    def __init__(self, stack, path: str) -> None:
        self.stack = stack
        self.path = os.fspath(path)
        self._server: asyncio.AbstractServer | None = None
        self._ino: tuple[int, int] | None = None
        self._clients: set[asyncio.Task] = set()
        self.requests = 0

    async def __aenter__(self) -> "ApiServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        path = self.path
        if len(os.fsencode(path)) > _SUN_PATH_MAX:
            raise ApiSocketError(f"--api-socket {path}: path is longer than {_SUN_PATH_MAX} bytes")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ApiSocketError(f"--api-socket {path}: {exc.strerror}") from None
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise ApiSocketError(f"--api-socket {path}: exists and is not a socket")
            if _socket_alive(path):
                raise ApiSocketError(f"--api-socket {path}: is in use by another running server")
            try:
                os.unlink(path)  # a stale socket of an earlier run (as slirp4netns does)
            except OSError as exc:
                raise ApiSocketError(f"--api-socket {path}: cannot remove the old socket: {exc.strerror}") from None
        try:
            self._server = await asyncio.start_unix_server(self._client, path=path)
        except OSError as exc:
            raise ApiSocketError(f"--api-socket {path}: {exc.strerror}") from None
        st = os.stat(path)
        self._ino = (st.st_dev, st.st_ino)
        log.info("API socket listening on %s", path)

    async def close(self) -> None:
        """Stop listening, end open requests, remove the socket file (if it is still ours)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._clients):
            t.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)
        if self._ino is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._ino:
                    os.unlink(self.path)
            except OSError:
                pass
            self._ino = None

    # ------------------------------------------------------------------ connection
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._clients.add(task)
        try:
            buf = b""
            too_large = False
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT):
                    while True:
                        chunk = await reader.read(MAX_REQUEST)
                        buf += chunk
                        if len(buf) >= MAX_REQUEST:
                            too_large = True
                            break
                        if not chunk or _parses(buf):
                            break
            except TimeoutError:
                if not buf.strip():
                    return
            self.requests += 1
            if too_large:
                reply = _dumps(_error("bad request: too large message"))
            else:
                reply = await self.handle(buf)
            writer.write(reply)
            await writer.drain()
        except (ConnectionError, OSError) as exc:
            log.debug("API client: %s", exc)
        except asyncio.CancelledError:
            pass
        finally:
            self._clients.discard(task)
            writer.close()

    # ------------------------------------------------------------------ requests
    async def handle(self, raw: bytes) -> bytes:
        """Answer one request (raw JSON bytes) with the reply bytes. Never raises."""
        try:
            reply = await self._handle(raw)
        except Exception as exc:  # a bug of ours: still one error reply
            log.exception("API request failed")
            reply = _error(f"internal error: {type(exc).__name__}: {exc}")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("API %r -> %r", raw[:200], reply)
        return _dumps(reply)

    async def _handle(self, raw: bytes) -> dict:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return _error("bad request: cannot parse JSON")
        if not isinstance(obj, dict):
            return _error("bad request: json_object() failed")
        execute = obj.get("execute")
        if not isinstance(execute, str):
            return _error("bad request: no execute found")
        args = obj.get("arguments")
        if not isinstance(args, dict):
            args = {}
        handler = {
            "add_hostfwd": self._add_hostfwd,
            "list_hostfwd": self._list_hostfwd,
            "remove_hostfwd": self._remove_hostfwd,
            "get_stats": self._get_stats,
            "list_flows": self._list_flows,
            "add_rule": self._add_rule,
            "remove_rule": self._remove_rule,
            "list_rules": self._list_rules,
        }.get(execute)
        if handler is None:
            return _error("bad request: unknown execute")
        return await handler(args)

    async def _add_hostfwd(self, args: dict) -> dict:
        pre = "bad request: add_hostfwd: "
        proto = args.get("proto")
        if proto not in ("tcp", "udp"):
            return _error(pre + "bad arguments.proto")
        host_addr = args.get("host_addr")
        if host_addr is None or host_addr == "":
            host_addr = "127.0.0.1"
        if not isinstance(host_addr, str):
            return _error(pre + "bad arguments.host_addr")
        try:
            host_addr = str(ipaddress.ip_address(host_addr))
        except ValueError:
            return _error(pre + "bad arguments.host_addr")
        host_port = _port(args.get("host_port"))
        if host_port is None:
            return _error(pre + "bad arguments.host_port")
        guest_addr = args.get("guest_addr")
        if guest_addr == "":
            guest_addr = None
        if guest_addr is not None:
            if not isinstance(guest_addr, str):
                return _error(pre + "bad arguments.guest_addr")
            try:
                guest_addr = str(ipaddress.ip_address(guest_addr.strip().strip("[]")))
            except ValueError:
                return _error(pre + "bad arguments.guest_addr")
        guest_port = _port(args.get("guest_port"))
        if guest_port is None:
            return _error(pre + "bad arguments.guest_port")
        fwd = PortForward(proto=proto, host_addr=host_addr, host_port=host_port,
                          guest_addr=guest_addr, guest_port=guest_port)
        try:
            added = await self.stack.add_forward(fwd)
        except ConfigError as exc:
            return _error(pre + f"bad arguments.{exc.field}: {str(exc).split(': ', 1)[-1]}")
        except ForwardError as exc:
            return _error(pre + str(exc))
        except RuntimeError as exc:
            return _error(pre + str(exc))
        return {"return": {"id": added.id}}

    async def _list_hostfwd(self, args: dict) -> dict:
        entries = [{"id": f.id, "proto": f.proto, "host_addr": f.host_addr, "host_port": f.host_port,
                    "guest_addr": f.guest_addr, "guest_port": f.guest_port} for f in self.stack.forwards()]
        return {"return": {"entries": entries}, "entries": entries}

    async def _remove_hostfwd(self, args: dict) -> dict:
        fid = args.get("id")
        if isinstance(fid, float) and fid.is_integer():
            fid = int(fid)
        if isinstance(fid, bool) or not isinstance(fid, int):
            return _error("bad request: remove_hostfwd: bad arguments.id")
        try:
            self.stack.remove_forward(fid)
        except KeyError:
            return _error("bad request: remove_hostfwd: bad arguments.id")
        return {"return": {}}

    async def _add_rule(self, args: dict) -> dict:
        pre = "bad request: add_rule: "
        unknown = _unknown_arguments(args, ("rule", "verdict", "close"))
        if unknown:  # e.g. "action": "deny" must not pass as an allow rule with a key ignored
            return _error(pre + f"bad arguments.{unknown}: not an argument (rule, verdict, close)")
        rule, verdict = args.get("rule"), args.get("verdict", "allow")
        if not isinstance(rule, str) or not rule.strip():
            return _error(pre + "bad arguments.rule")
        if verdict not in ("allow", "deny"):
            return _error(pre + "bad arguments.verdict")
        close = args.get("close", False)
        if not isinstance(close, bool):
            return _error(pre + "bad arguments.close")
        policy = self.stack.policy
        try:
            text = policy.add(rule, allow=verdict == "allow")
        except ConfigError as exc:
            return _error(pre + f"bad arguments.rule: {str(exc).split(': ', 1)[-1]}")
        log.info("egress policy: %s %s added over the API socket", verdict, text)
        if close:
            return {"return": {"rule": text, "closed": policy.close_denied()}}
        return {"return": {"rule": text}}

    async def _remove_rule(self, args: dict) -> dict:
        pre = "bad request: remove_rule: "
        unknown = _unknown_arguments(args, ("rule", "close"))
        if unknown:
            return _error(pre + f"bad arguments.{unknown}: not an argument (rule, close)")
        rule, close = args.get("rule"), args.get("close", False)
        if not isinstance(rule, str) or not rule.strip():
            return _error(pre + "bad arguments.rule")
        if not isinstance(close, bool):
            return _error(pre + "bad arguments.close")
        policy = self.stack.policy
        try:
            removed = policy.remove(rule)
        except ConfigError as exc:
            return _error(pre + f"bad arguments.rule: {str(exc).split(': ', 1)[-1]}")
        if removed is None:
            return _error(pre + "no such rule")
        closed = policy.close_denied() if close else 0
        log.info("egress policy: %s removed over the API socket (%d flows closed)", removed.text, closed)
        return {"return": {"closed": closed}}

    async def _list_rules(self, args: dict) -> dict:
        policy = self.stack.policy
        return {"return": {"rules": policy.list_rules(), "default": "allow" if policy.default_allow else "deny",
                           "builtin": policy.builtin_rules()}}

    async def _get_stats(self, args: dict) -> dict:
        stack = self.stack
        c = stack.counters
        drops = {k[5:]: v for k, v in sorted(c.items()) if k.startswith("drop.")}
        # by proto and state; UDP and ICMP flows are all "OPEN"
        active = {proto: v if isinstance(v, dict) else {"OPEN": v} for proto, v in stack.stats()["flows"].items()}
        totals: dict = {}
        for k, v in c.items():
            parts = k.split(".")
            if len(parts) == 3 and parts[0] == "flows" and parts[2] in ("opened", "closed"):
                totals.setdefault(parts[1], {"opened": 0, "closed": 0})[parts[2]] = v
        return {"return": {
            "frames": {"in": c.get("frames_in", 0), "out": c.get("frames_out", 0)},
            "bytes": {"in": c.get("bytes_in", 0), "out": c.get("bytes_out", 0)},
            "drops": drops,
            "flows": active,
            "flows_total": totals,
            "forwards": len(stack.forwards()),
            "counters": dict(sorted(c.items())),
        }}

    async def _list_flows(self, args: dict) -> dict:
        out = []
        started = self.stack.parts.loop is not None  # idle_s only once there is a loop clock
        for info in self.stack.flows():  # FlowInfo records (aioslirp/flow/info.py)
            entry = {
                "proto": info.protocol,
                "direction": info.direction,
                "state": info.state,
                "guest_addr": info.guest[0],
                "guest_port": info.guest[1],
                "remote_addr": info.destination[0],
                "remote_port": info.destination[1],
                "host": info.host,
            }
            if started:
                entry["idle_s"] = round(info.idle, 3)
            if info.forward_id is not None:
                entry["forward_id"] = info.forward_id
            if info.name is not None:
                entry["name"] = info.name
            if info.rule is not None:
                entry["rule"] = info.rule
            if info.guest_name is not None:
                entry["guest_name"] = info.guest_name
            out.append(entry)
        return {"return": {"flows": out}}


def _parses(buf: bytes) -> bool:
    try:
        json.loads(buf.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return True


def serving_stack(config, *, forwards=(), api_socket: str | None = None, stack_factory=None):
    """A stack factory result for the entry points: ``async with serving_stack(cfg, ...) as stack``.

    Creates the stack (``stack_factory(config)``, default :class:`~aioslirp.Stack`), adds
    ``forwards`` (:class:`PortForward` objects) and starts the API socket at
    ``api_socket`` before the body runs, so both are ready before the guest starts; on
    exit the API socket file is removed and the stack closed. Raises
    :class:`~aioslirp.nat.forward.ForwardError` (a host port cannot be bound; its text begins
    ``--publish: ``, the option the forwards come from) or :class:`ApiSocketError` during setup.
    """
    import contextlib

    @contextlib.asynccontextmanager
    async def cm():
        from ..stack import Stack

        factory = stack_factory or Stack
        async with factory(config) as stack:
            for fwd in forwards:
                try:
                    await stack.add_forward(fwd)
                except ForwardError as exc:  # one line naming the option, as the switch's -p says it
                    raise ForwardError(f"--publish: {exc.message}", exc.errno) from None
            api = ApiServer(stack, api_socket) if api_socket else None
            if api is not None:
                await api.start()
            try:
                yield stack
            finally:
                if api is not None:
                    await api.close()

    return cm()
