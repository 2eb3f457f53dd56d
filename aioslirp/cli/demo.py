"""``aioslirp demo``: the main job, offline, on an embedded default.

Starts an HTTP server and a DNS upstream on host loopback (127.0.0.1), then runs a Python
client in a fresh network namespace behind the stack. The client gets its address, resolves
``host.aioslirp.test`` through the virtual DNS 10.0.2.3 (forwarded to the embedded upstream,
which answers 10.0.2.2), fetches a 1 MiB page from the host server via the gateway, checks
its SHA-256, and prints what happened; then the stack's counters are printed.
Nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import http.server
import socket
import sys
import threading

from ..config import NetworkConfig

PAGE = bytes(range(256)) * 4096  # 1 MiB

GUEST = r"""
import hashlib, socket, subprocess, sys, time, urllib.request
port, dns_addr = int(sys.argv[1]), sys.argv[2]
def say(msg): print("  guest | " + msg, flush=True)
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "tap0"], capture_output=True, text=True).stdout.split()
say("tap0 address " + (addr[3] if len(addr) > 3 else "?"))
say("resolv.conf: " + " ".join(l.strip() for l in open("/etc/resolv.conf") if l.strip()))
t0 = time.monotonic()
ip = socket.gethostbyname("host.aioslirp.test")
say(f"host.aioslirp.test -> {ip} (via DNS {dns_addr}, {1000 * (time.monotonic() - t0):.1f} ms)")
t0 = time.monotonic()
with urllib.request.urlopen(f"http://host.aioslirp.test:{port}/", timeout=20) as r:
    body = r.read()
    status = r.status
dt = time.monotonic() - t0
say(f"GET http://host.aioslirp.test:{port}/ -> HTTP {status}, {len(body)} bytes in {dt * 1000:.1f} ms")
say("sha256 " + hashlib.sha256(body).hexdigest())
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args):
        pass


def _dns_stub(answer: str) -> tuple[socket.socket, int]:
    """A tiny DNS upstream on 127.0.0.1: every A query is answered with ``answer`` (the gateway)."""
    import dpkt

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                data, addr = sock.recvfrom(4096)
            except OSError:
                return
            try:
                q = dpkt.dns.DNS(data)
                r = dpkt.dns.DNS(id=q.id, qr=1, rd=q.rd, ra=1, qd=q.qd)
                r.an = [dpkt.dns.DNS.RR(name=qd.name, type=1, cls=1, ttl=60, ip=socket.inet_aton(answer))
                        for qd in q.qd if qd.type == 1]
                sock.sendto(bytes(r), addr)
            except Exception:
                continue

    threading.Thread(target=serve, daemon=True).start()
    return sock, sock.getsockname()[1]


async def demo(config: NetworkConfig | None = None, stack_factory=None) -> int:
    """Run the demo; returns 0 when the guest fetched the page intact. ``stack_factory(config)``
    makes the stack (default: :class:`~aioslirp.stack.Stack`)."""
    from ..frontends.netns import run_in_namespace
    from ..stack import Stack

    cfg = (config or NetworkConfig()).validate()
    if cfg.disable_host_loopback:
        print("aioslirp: error: --disable-host-loopback: the demo fetches from host loopback via the gateway",
              file=sys.stderr)
        return 2
    if config is not None and config.dns_upstreams:
        print("aioslirp: error: --dns: the demo uses its own DNS upstream on 127.0.0.1", file=sys.stderr)
        return 2
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    dns_sock, dns_port = _dns_stub(str(cfg.gateway))
    port = httpd.server_address[1]
    cfg.dns_upstreams = [("127.0.0.1", dns_port)]
    stacks = []

    def factory(c):
        s = (stack_factory or Stack)(c)
        stacks.append(s)
        return s

    print(f"host  | HTTP server on 127.0.0.1:{port}, DNS upstream on 127.0.0.1:{dns_port}")
    print(f"host  | starting a guest in a new network namespace behind aioslirp (gateway {cfg.gateway} -> host loopback)")
    sys.stdout.flush()
    rc = await run_in_namespace(cfg, [sys.executable, "-c", GUEST, str(port), str(cfg.dns)], stack_factory=factory)
    httpd.shutdown()
    dns_sock.close()
    want = hashlib.sha256(PAGE).hexdigest()
    print(f"host  | expected sha256 {want}")
    if stacks:
        c = stacks[0].counters
        keys = ["frames_in", "frames_out", "bytes_in", "arp_replies", "dhcp_replies", "dns_queries_udp",
                "flows.tcp.opened", "flows.tcp.closed", "flows.udp.opened"]
        print("stack | " + ", ".join(f"{k}={c[k]}" for k in keys))
        if c["native_tcp.adopted"]:  # the native data plane's TCP flows: their frames are counted there
            native = ["native_tcp.adopted", "native_tcp.frames", "native_tcp.frames_out", "native_tcp.bytes_down"]
            print("stack | native plane (TCP flows in C): " + ", ".join(f"{k[11:]}={c[k]}" for k in native))
        drops = {k: v for k, v in c.items() if k.startswith("drop.")}
        print("stack | drops: " + (", ".join(f"{k[5:]}={v}" for k, v in sorted(drops.items())) or "none"))
    print("demo  | " + ("OK: the guest fetched the page through aioslirp" if rc == 0 else f"FAILED (guest exit {rc})"))
    return rc
