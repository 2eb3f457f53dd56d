"""Real host-side servers on 127.0.0.1 for integration tests (threads, stdlib sockets).

* :class:`DataServer` — TCP. The client sends one command line:
  ``DOWN <nbytes> <seed>``: the server sends that many deterministic bytes, then closes
  at once (data may still be in flight); ``UP``: reads to EOF, answers the SHA-256 hex of
  what it read, closes; ``SLOWUP``: the same, reading 4 KiB every 2 ms (a slow reader);
  ``RSTME``: resets the connection (SO_LINGER 0); ``WAIT``: reads until EOF or reset and
  records which in :attr:`DataServer.events`; ``HTTP`` requests (``GET /<nbytes>``) get a minimal HTTP/1.0 response.
* :class:`UdpEcho` — echoes every datagram (counts them, by length).
* :class:`DnsUpstream` — answers every A query with 10.0.2.99 over UDP and TCP (dpkt); AAAA
  queries with ``aaaa`` when given (else no answer records, as before).
* :class:`NameServer` — UDP DNS answering A queries by name from a table or a function,
  NXDOMAIN for the names it does not know.
* :func:`host_servers` — a DataServer, a UdpEcho and a DnsUpstream for a ``with`` block.
* :func:`free_port` — a port nothing is bound to: a refused connection, a port unreachable.

Servers bind 127.0.0.1 by default; pass ``host="::1"`` for IPv6 loopback (``DnsUpstream``:
any loopback address, e.g. ``"127.0.0.53"`` like systemd-resolved's stub).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import random
import socket
import socketserver
import struct
import threading
import time

import dpkt


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


class _DataHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(4096)
            if not chunk:
                return
            buf += chunk
        line, rest = buf.split(b"\n", 1)
        parts = line.decode(errors="replace").strip().split()
        self.server.commands.append(parts[0] if parts else "")
        if parts[:1] == ["DOWN"]:
            sock.sendall(pattern(int(parts[1]), int(parts[2])))
        elif parts[:1] in (["UP"], ["SLOWUP"]):
            h = hashlib.sha256(rest)
            n = len(rest)
            slow = parts[0] == "SLOWUP"
            while True:
                chunk = sock.recv(4096 if slow else 1 << 20)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
                if slow:
                    time.sleep(0.002)
            sock.sendall(f"{n} {h.hexdigest()}\n".encode())
        elif parts[:1] == ["RSTME"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif parts[:1] == ["WAIT"]:
            try:
                while sock.recv(4096):
                    pass
                self.server.events.append("eof")
            except ConnectionResetError:
                self.server.events.append("reset")
        elif parts[:1] == ["GET"]:
            size = int(parts[1].strip("/") or 0)
            body = pattern(size, 1)
            sock.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size + body)
        sock.close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


class _Server6(_Server):
    address_family = socket.AF_INET6


class DataServer:
    """Threaded TCP server on ``host`` (default 127.0.0.1; ``"::1"`` for IPv6):<ephemeral>; ``.port``, ``.close()``."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.server = (_Server6 if ":" in host else _Server)((host, 0), _DataHandler)
        self.server.commands = []
        self.server.events = []
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def commands(self) -> list:
        return self.server.commands

    @property
    def events(self) -> list:
        """Outcomes of ``WAIT`` connections: ``"eof"`` or ``"reset"``."""
        return self.server.events

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class UdpEcho:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.count = 0
        #: Datagrams received by length (bytes of UDP payload), and the last sender's address.
        self.lengths: collections.Counter = collections.Counter()
        self.peer = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(65535)
            except OSError:
                return
            self.lengths[len(data)] += 1
            self.peer = addr
            self.count += 1
            self.sock.sendto(data, addr)

    def close(self) -> None:
        self.sock.close()


def _dns_answer(query: bytes, aaaa: str | None = None) -> bytes:
    q = dpkt.dns.DNS(query)
    r = dpkt.dns.DNS(id=q.id, qr=dpkt.dns.DNS_R, opcode=q.opcode, rd=q.rd, ra=1, qd=q.qd)
    an = []
    for qd in q.qd:
        if qd.type == dpkt.dns.DNS_A:
            an.append(dpkt.dns.DNS.RR(name=qd.name, type=dpkt.dns.DNS_A, cls=dpkt.dns.DNS_IN, ttl=60,
                                      ip=socket.inet_aton("10.0.2.99")))
        elif qd.type == dpkt.dns.DNS_AAAA and aaaa is not None:
            an.append(dpkt.dns.DNS.RR(name=qd.name, type=dpkt.dns.DNS_AAAA, cls=dpkt.dns.DNS_IN, ttl=60,
                                      ip6=socket.inet_pton(socket.AF_INET6, aaaa)))
    r.an = an
    return bytes(r)


class DnsUpstream:
    """A DNS server on ``host`` (default 127.0.0.1):<port> (UDP and TCP, same port) answering A with
    10.0.2.99, and AAAA with ``aaaa`` when given (``None``: AAAA queries get no answer records)."""

    def __init__(self, aaaa: str | None = None, host: str = "127.0.0.1") -> None:
        self.aaaa = aaaa
        self.host = host
        # one port for both: take an ephemeral UDP port, retry while its TCP twin is taken
        for _ in range(50):
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind((host, 0))
            self.port = self.udp.getsockname()[1]
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.tcp.bind((host, self.port))
                break
            except OSError:
                self.tcp.close()
                self.udp.close()
        else:
            raise RuntimeError(f"no free UDP+TCP port pair on {host}")
        self.tcp.listen(16)
        self.udp_queries = 0
        self.tcp_queries = 0
        threading.Thread(target=self._udp, daemon=True).start()
        threading.Thread(target=self._tcp, daemon=True).start()

    def _udp(self) -> None:
        while True:
            try:
                data, addr = self.udp.recvfrom(4096)
                self.udp_queries += 1
                self.udp.sendto(_dns_answer(data, self.aaaa), addr)
            except OSError:
                return
            except Exception:
                continue

    def _tcp(self) -> None:
        while True:
            try:
                c, _ = self.tcp.accept()
            except OSError:
                return
            threading.Thread(target=self._tcp_conn, args=(c,), daemon=True).start()

    def _tcp_conn(self, c: socket.socket) -> None:
        with c:
            try:
                self._tcp_serve(c)
            except OSError:  # reset by the stack (a hostile guest's query, a flow ended): its end
                return

    def _tcp_serve(self, c: socket.socket) -> None:
        buf = b""
        while True:
            d = c.recv(4096)
            if not d:
                return
            buf += d
            while len(buf) >= 2 and len(buf) >= 2 + struct.unpack("!H", buf[:2])[0]:
                n = struct.unpack("!H", buf[:2])[0]
                msg, buf = buf[2:2 + n], buf[2 + n:]
                self.tcp_queries += 1
                ans = _dns_answer(msg, self.aaaa)
                c.sendall(struct.pack("!H", len(ans)) + ans)

    def close(self) -> None:
        self.udp.close()
        self.tcp.close()


class NameServer:
    """UDP DNS on 127.0.0.1:<ephemeral> (``.port``) answering A queries (RFC 1035) by name.

    ``names``: a dict name -> IPv4 address (text), or a function name -> list of IPv4 addresses
    (text or 4 bytes); a name it does not know (missing, or ``None``) gets NXDOMAIN; a known name
    asked for another type gets no answer record. Names are looked up in lower case. ``ttl``:
    of every answer record, seconds.
    """

    def __init__(self, names, ttl: int = 60) -> None:
        self.lookup = names if callable(names) else (lambda n, t=names: [t[n]] if n in t else None)
        self.ttl = ttl
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            q = dpkt.dns.DNS(data)
            r = dpkt.dns.DNS(id=q.id, qr=dpkt.dns.DNS_R, rd=q.rd, ra=1, qd=q.qd)
            qd = q.qd[0]
            addrs = self.lookup(qd.name.lower())
            if addrs is None:
                r.rcode = dpkt.dns.DNS_RCODE_NXDOMAIN
            elif qd.type == dpkt.dns.DNS_A:
                r.an = [dpkt.dns.DNS.RR(name=qd.name, type=dpkt.dns.DNS_A, cls=dpkt.dns.DNS_IN, ttl=self.ttl,
                                        ip=a if isinstance(a, bytes) else socket.inet_aton(a)) for a in addrs]
            self.sock.sendto(bytes(r), peer)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def host_servers(host: str = "127.0.0.1", aaaa: str | None = None):
    """A :class:`DataServer` and a :class:`UdpEcho` on ``host`` and a :class:`DnsUpstream` on
    127.0.0.1 (answering AAAA with ``aaaa``) for the ``with`` block; yields ``{"data", "udp",
    "dns"}``. All are closed when it ends."""
    servers = {"data": DataServer(host=host), "udp": UdpEcho(host=host), "dns": DnsUpstream(aaaa=aaaa)}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.close()


def free_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1") -> int:
    """A port of ``host`` (IPv4 or IPv6 loopback) nothing is bound to for ``kind`` (SOCK_STREAM or
    SOCK_DGRAM): bound and closed again at once. A connection to it is refused, a datagram to it
    draws an ICMP port unreachable; or a server started next may listen on it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
