"""The egress tests' world, on the test namespace (see conftest.py: nothing leaves the machine):
a DNS upstream and HTTP servers on documentation addresses put on its ``lo``.

The upstream (:class:`Dns`) answers ``allowed.test`` (192.0.2.10, 2001:db8::10), ``denied.test``
(192.0.2.20) and ``cdn-b.test`` (192.0.2.10: it shares allowed.test's address) and listens on
127.0.0.1:53, the upstream of the stack, and on 192.0.2.30:53, "another resolver" the guest must
not reach. Both web servers (IPv4 and IPv6 on all addresses) answer every GET with :data:`BODY`.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import socket
import socketserver
import struct
import threading

import dpkt
import pytest

from support.guests import need_tool
from support.namespaces import namespace_address
from support.prereqs import have_ipv6_loopback, need


NAMES = {"allowed.test": ("192.0.2.10", "2001:db8::10"), "denied.test": ("192.0.2.20", None),
         "cdn-b.test": ("192.0.2.10", None)}
BODY = hashlib.sha256(b"egress").digest() * 4096  # 128 KiB


def dns_answer(query: bytes) -> bytes:
    q = dpkt.dns.DNS(query)
    r = dpkt.dns.DNS(id=q.id, qr=dpkt.dns.DNS_R, rd=q.rd, ra=1, qd=q.qd)
    an = []
    for qd in q.qd:
        v4, v6 = NAMES.get(qd.name.lower().rstrip("."), (None, None))
        if v4 is None:
            r.rcode = dpkt.dns.DNS_RCODE_NXDOMAIN
        elif qd.type == dpkt.dns.DNS_A:
            an.append(dpkt.dns.DNS.RR(name=qd.name, type=1, cls=1, ttl=300, ip=socket.inet_aton(v4)))
        elif qd.type == dpkt.dns.DNS_AAAA and v6:
            an.append(dpkt.dns.DNS.RR(name=qd.name, type=28, cls=1, ttl=300, ip6=socket.inet_pton(socket.AF_INET6, v6)))
    r.an = an
    return bytes(r)


class Dns:
    """UDP and TCP DNS on ``host``:53 answering :data:`NAMES`; counts the questions by name."""

    def __init__(self, host: str) -> None:
        self.asked: list[str] = []
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((host, 53))
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((host, 53))
        self.tcp.listen(8)
        threading.Thread(target=self._udp, daemon=True).start()
        threading.Thread(target=self._tcp, daemon=True).start()

    def _note(self, data: bytes) -> None:
        with contextlib.suppress(Exception):
            self.asked.append(dpkt.dns.DNS(data).qd[0].name.lower())

    def _udp(self) -> None:
        while True:
            try:
                data, addr = self.udp.recvfrom(4096)
                self._note(data)
                self.udp.sendto(dns_answer(data), addr)
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
            with c:
                try:
                    n = struct.unpack("!H", c.recv(2))[0]
                    data = b""
                    while len(data) < n:
                        data += c.recv(n - len(data))
                    self._note(data)
                    a = dns_answer(data)
                    c.sendall(struct.pack("!H", len(a)) + a)
                except Exception:
                    continue

    def close(self) -> None:
        for s in (self.udp, self.tcp):  # shutdown wakes the thread blocked on it: port 53 is free again
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class _BodyHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args):
        pass


class _Http6(socketserver.ThreadingMixIn, http.server.HTTPServer):
    address_family = socket.AF_INET6
    daemon_threads = True

    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


@pytest.fixture(scope="module")
def world():
    need(have_ipv6_loopback(), "IPv6 on the test namespace's loopback")
    need_tool("curl", "curl")
    need_tool("dig", "bind9-dnsutils")
    with contextlib.ExitStack() as es:
        for a in ("192.0.2.10", "192.0.2.20", "192.0.2.30", "2001:db8::10"):
            es.enter_context(namespace_address(a))
        up, other = Dns("127.0.0.1"), Dns("192.0.2.30")
        es.callback(up.close)
        es.callback(other.close)
        web, web2 = _Http6(("::", 0), _BodyHandler), _Http6(("::", 0), _BodyHandler)
        for w in (web, web2):
            threading.Thread(target=w.serve_forever, daemon=True).start()
            es.callback(w.server_close)
            es.callback(w.shutdown)
        yield {"up": up, "other": other, "port": web.server_address[1], "port2": web2.server_address[1]}
