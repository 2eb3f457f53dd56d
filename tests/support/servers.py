"""Real host-side servers on 127.0.0.1 for integration tests (threads, stdlib sockets).

* :class:`DataServer` — TCP. The client sends one command line:
  ``DOWN <nbytes> <seed>``: the server sends that many deterministic bytes, then closes
  at once (data may still be in flight); ``UP``: reads to EOF, answers the SHA-256 hex of
  what it read, closes; ``SLOWUP``: the same, reading 4 KiB every 2 ms (a slow reader);
  ``RSTME``: resets the connection (SO_LINGER 0); ``WAIT``: reads until EOF or reset and
  records which in :attr:`DataServer.events`; ``HTTP`` requests (``GET /<nbytes>``) get a minimal HTTP/1.0 response.
* :class:`UdpEcho` — echoes every datagram.
* :class:`DnsUpstream` — answers every A query with 10.0.2.99 over UDP and TCP (dpkt); AAAA
  queries with ``aaaa`` when given (else no answer records, as before).

Servers bind 127.0.0.1 by default; pass ``host="::1"`` for IPv6 loopback (``DnsUpstream``:
any loopback address, e.g. ``"127.0.0.53"`` like systemd-resolved's stub).
"""

from __future__ import annotations

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


class _Handler(socketserver.BaseRequestHandler):
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
        self.server = (_Server6 if ":" in host else _Server)((host, 0), _Handler)
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
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(65535)
            except OSError:
                return
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
