"""``aioslirp qemu --socket PATH --switch``: many QEMU guests on one virtual network.

:class:`QemuSwitchServer` listens on PATH (``-netdev stream``, as :class:`~aioslirp.frontends.qemu.QemuServer`
does) and puts every QEMU that connects on one :class:`~aioslirp.Switch` as a new guest, with a
stack of its own: the next free address (``config.guest``, then up: its DHCP lease), the name
``PREFIX<N>`` (``vm1``, ``vm2``..., N the guest's port number; ``PREFIX1.aioslirp.internal`` in the
other guests' DNS) and the labels given. A guest that disconnects leaves the switch (its flows,
address and name are freed). At most ``max_guests`` guests at once: a connection beyond is closed
at once, with a warning. Guest-to-guest traffic is switched at layer 2; each guest's traffic to
the outside goes through its own stack (docs/qemu.md, docs/switch.md).

With ``leases`` (``--lease MAC=ADDRESS[,NAME]``), a guest waits for its first frame before it
joins: a guest sending from a leased MAC gets that address (and that name) whenever it connects,
and the other guests get the free addresses the leases leave. Such an address is the static
lease of that MAC: DHCP hands it out to that guest only.

With ``forwards`` (``--publish [HOST_IP:]HOST_PORT:GUEST:GUEST_PORT``), the host port of a
forward listens while its guest (named ``GUEST``, or holding the IPv4 address ``GUEST``) is on
the switch: it is added to that guest's stack when the guest joins and closes when it leaves.
Each host port is tried once at :meth:`QemuSwitchServer.start`, so a port in use is an error
there, not a warning when the guest joins.

Every VM needs its own MAC (QEMU's default, ``52:54:00:12:34:56``, is the same for all): the
switch keeps a MAC with the first guest that sent from it and drops another guest's frames from
it (``drop.mac_in_use``), logged once per guest here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from ..errors import ConfigError
from ..switch import Switch
from ..switch.guests import mac_text, parse_mac
from ..transport.stream import StreamTransport
from ..transport.unixpath import bind_path

__all__ = ["QemuSwitchServer", "serve_qemu_switch", "parse_lease", "DEFAULT_MAX_GUESTS", "DEFAULT_NAME_PREFIX",
           "FIRST_FRAME_TIMEOUT"]

log = logging.getLogger("aioslirp.qemu")

#: Guests served at once by default.
DEFAULT_MAX_GUESTS = 16
#: Guests are named ``vm1``, ``vm2``... by default.
DEFAULT_NAME_PREFIX = "vm"
#: Seconds a connection may take to send its first frame when there are leases; then it is closed.
FIRST_FRAME_TIMEOUT = 60.0


def parse_lease(text: str, field: str = "--lease") -> tuple[bytes, str, str | None]:
    """``MAC=ADDRESS[,NAME]`` -> ``(mac, address, name)``: a static lease of the switch's network
    (the address and name are checked when the switch reserves them). Raises :class:`ConfigError`
    naming ``field``."""
    mac, eq, rest = str(text).partition("=")
    if not eq or not rest:
        raise ConfigError(field, f"{text!r} is not MAC=ADDRESS[,NAME]")
    address, _, name = rest.partition(",")
    try:
        mac_b = parse_mac(mac.strip(), field)
    except ConfigError as exc:
        raise ConfigError(field, f"{text!r}: {exc.detail}") from None
    return mac_b, address.strip(), (name.strip() or None)


class QemuSwitchServer:
    """Serve every QEMU connecting to ``path`` as a guest of ``switch`` (an entered
    :class:`~aioslirp.Switch`), until :meth:`close`.

    Args:
        switch: the switch the guests join.
        path: the UNIX socket to listen on (a stale socket is replaced; a live one raises
            :class:`~aioslirp.frontends.qemu.SocketInUse` from :meth:`start`).
        max_guests: guests at once (>= 1); more connections are closed at once (``refused``).
        name_prefix: guest N is named ``f"{name_prefix}{N}"``.
        leases: static leases, ``{mac (6 bytes): (address, name or None)}``: the address is
            reserved on the switch at :meth:`start` (a ``ConfigError`` naming ``--lease`` when the
            switch refuses it), and a guest whose first frame comes from that MAC gets it.
        forwards: ``[(guest, PortForward)]`` (:func:`~aioslirp.config.forward.parse_guest_publish`):
            each is added to the guest named ``guest`` (or holding that IPv4 address) when it
            joins; its host port listens while that guest is on the switch.
        on_event: called with every lifecycle event of every guest's stack
            (:class:`~aioslirp.observe.events.Event`, carrying ``guest_name`` and ``labels``).
        guest_options: keywords for every :meth:`Switch.add_guest <aioslirp.Switch.add_guest>`
            (``labels``, ``audit``...).

    Attributes:
        guests: guests served so far; ``refused``: connections refused (over ``max_guests``).
    """

    def __init__(self, switch: Switch, path: str, *, max_guests: int = DEFAULT_MAX_GUESTS,
                 name_prefix: str = DEFAULT_NAME_PREFIX, leases=None, forwards=None, on_event=None,
                 **guest_options) -> None:
        self.switch = switch
        self.forwards: list = list(forwards or ())
        self.on_event = on_event
        self.leases: dict[bytes, tuple[str, str | None]] = dict(leases or {})
        self.path = path
        self.max_guests = int(max_guests)
        self.name_prefix = name_prefix
        self.guest_options = guest_options
        self.guests = 0
        self.refused = 0
        self._listener: socket.socket | None = None
        self._ino: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Future | None = None
        self._serving: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listen on the path (QEMU may connect once this returns). Idempotent."""
        if self._listener is not None:
            return
        self._loop = asyncio.get_running_loop()
        names = set()
        for mac, (address, name) in self.leases.items():
            try:
                self.switch.reserve(address)
            except ConfigError as exc:
                raise ConfigError("--lease", f"{mac_text(mac)}={address}: {exc.detail}") from None
            if name is not None and name in names:
                raise ConfigError("--lease", f"the name {name!r} is given twice")
            names.add(name)
        for _guest, fwd in self.forwards:
            _try_listen(fwd)
        self._stopping = self._loop.create_future()
        sock = bind_path(self.path, socket.SOCK_STREAM)
        self._ino = os.stat(self.path).st_ino
        sock.listen(16)
        sock.setblocking(False)
        self._listener = sock
        self._loop.add_reader(sock.fileno(), self._accept)
        log.info("waiting for QEMU guests on %s (-netdev stream; one switch, up to %d guests)", self.path,
                 self.max_guests)

    async def serve(self) -> None:
        """Serve guests until :meth:`close`; then every guest's serving ends and the path goes."""
        await self.start()
        try:
            await self._stopping
        finally:
            self._release()
            tasks = list(self._serving)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept on %s failed: %s", self.path, exc)
                return
            if len(self._serving) >= self.max_guests:
                self.refused += 1
                log.warning("refusing a guest on %s: %d guests already (--max-guests)", self.path, self.max_guests)
                conn.close()
                continue
            t = self._loop.create_task(self._guest(conn))
            self._serving.add(t)
            t.add_done_callback(self._serving.discard)

    async def _guest(self, conn: socket.socket) -> None:
        sw = self.switch
        self.guests += 1
        n = self.guests
        transport = StreamTransport(conn, name=f"{self.path}#{n}")
        options = dict(self.guest_options, name=f"{self.name_prefix}{n}")
        if self.leases:
            mac = await self._first_mac(conn)
            if mac is None:
                log.info("guest %d on %s sent no frame: closed", n, self.path)
                conn.close()
                return
            address, name = self.leases.get(mac, (None, None))
            options.update(mac=mac, address=address)
            if name is not None:
                options["name"] = name
        try:
            stack = await sw.add_guest(**options)
        except Exception as exc:
            log.warning("guest %d on %s refused: %s", n, self.path, exc)
            conn.close()
            return
        port = sw.port_of(stack)
        log.info("guest %s joined on %s: %s", port.name, self.path, port.address)
        if self.on_event is not None:
            stack.on_event(self.on_event)
        await self._publish(port)
        warn = self._loop.call_later(10.0, self._check_mac, port)
        try:
            await sw.serve(stack, transport)
        except Exception as exc:
            log.warning("guest %s on %s: %s", port.name, self.path, exc)
        finally:
            warn.cancel()
            log.info("guest %s left %s: %d frames in, %d switched, %d dropped", port.name, self.path,
                     port.counters["frames_in"], port.counters["switched"], port.counters["frames_dropped"])
            with contextlib.suppress(KeyError):
                await sw.remove_guest(stack)

    async def _publish(self, port) -> None:
        """Add the forwards that name ``port``'s guest (its name or its address) to its stack; one
        that cannot listen now is a warning (the guest is served all the same)."""
        for guest, fwd in self.forwards:
            if guest != str(port.address) and guest != (port.name or "").lower():
                continue
            try:
                await port.stack.add_forward(fwd)
            except (ConfigError, OSError) as exc:
                log.warning("guest %s: --publish %s not served: %s", port.name, fwd.spec(), exc)

    async def _first_mac(self, conn: socket.socket) -> bytes | None:
        """The source MAC of the connection's first frame, peeked (the stream keeps it), or
        ``None`` at EOF, after :data:`FIRST_FRAME_TIMEOUT`, or for a first frame too short to
        carry an Ethernet header (4-byte length prefix, then the frame: source MAC at 10..16)."""
        conn.setblocking(False)
        deadline = self._loop.time() + FIRST_FRAME_TIMEOUT
        while self._loop.time() < deadline:
            try:
                head = conn.recv(16, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                head = None
            except OSError:
                return None
            if head == b"":
                return None
            if head is not None and len(head) >= 4 and int.from_bytes(head[:4], "big") < 14:
                return None
            if head is not None and len(head) == 16:
                return head[10:16]
            await asyncio.sleep(0.005 if head else 0.05)
        return None

    @staticmethod
    def _check_mac(port) -> None:
        if port.counters["drop.mac_in_use"]:
            log.warning("guest %s sends from a MAC another guest holds; its frames are dropped: give every VM its "
                        "own MAC (-device virtio-net-pci,netdev=...,mac=52:54:00:12:34:NN)", port.name)

    def close(self) -> None:
        """Stop: every guest's serving ends, the listener and the path go."""
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)

    def _release(self) -> None:
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        if self._ino is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
            self._ino = None


async def serve_qemu_switch(config, *, path: str, max_guests: int = DEFAULT_MAX_GUESTS,
                            name_prefix: str = DEFAULT_NAME_PREFIX, labels=None, leases=None, forwards=None,
                            events=None, capture=None, handle_signals: bool = False, tracer_provider=None) -> int:
    """``aioslirp qemu --socket PATH --switch``: serve QEMU guests on one switch until stopped
    (SIGINT/SIGTERM with ``handle_signals``). Returns 0. Raises :class:`~aioslirp.frontends.qemu.SocketInUse`,
    ``OSError`` (binding), :class:`~aioslirp.nat.forward.ForwardError` (a ``forwards`` host port
    that cannot listen). ``config.audit_log``: one audit log for every guest (its records carry
    ``guest_name``); ``tracer_provider``: one OpenTelemetry provider for every guest's stack (its
    spans carry ``aioslirp.guest.name``), ``None``: the global one; ``forwards``: as
    :class:`QemuSwitchServer` takes them; ``events``: an :class:`~aioslirp.observe.events.EventFile`
    taking every guest's events (closed on return); ``capture``: the switch's capture
    (:class:`~aioslirp.Switch`'s ``capture``, a :class:`~aioslirp.transport.pcap.PcapWriter`)."""
    import signal

    audit = None
    if config.audit_log is not None:
        from ..observe.audit import AuditLog

        audit = AuditLog(config.audit_log)
    loop = asyncio.get_running_loop()
    installed = []
    try:
        async with Switch(config, capture=capture) as sw:
            server = QemuSwitchServer(sw, path, max_guests=max_guests, name_prefix=name_prefix, labels=labels,
                                      leases=leases, forwards=forwards,
                                      on_event=None if events is None else events.write,
                                      **({"audit": audit} if audit is not None else {}),
                                      **({"tracer_provider": tracer_provider} if tracer_provider is not None else {}))
            try:
                await server.start()
                if handle_signals:
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        loop.add_signal_handler(sig, server.close)
                        installed.append(sig)
                    if audit is not None:
                        loop.add_signal_handler(signal.SIGHUP, audit.reopen)
                        installed.append(signal.SIGHUP)
                await server.serve()
            finally:
                for sig in installed:
                    loop.remove_signal_handler(sig)
                server.close()
            log.info("stopped after %d guest(s)", server.guests)
    finally:
        if audit is not None:
            audit.close()
        if events is not None:
            events.close()
    return 0


def _try_listen(fwd) -> None:
    """Bind ``fwd``'s host address and port once and let go: ``ForwardError`` naming ``--publish``
    when it cannot (in use, no permission), before any guest joins."""
    from ..nat.forward import ForwardError, listen

    try:
        listen(fwd).close()
    except ForwardError as exc:
        raise ForwardError(f"--publish: {exc.message}", exc.errno) from None
