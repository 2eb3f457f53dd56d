"""Servers run *inside* the guest namespace for the port-forward tests (the CMD of ``aioslirp run``).

Usage: ``python forward_servers.py TCP_PORT UDP_PORT``. Prints ``READY`` once both listen, then
serves until its stdin reaches EOF.

* TCP ``TCP_PORT`` (0.0.0.0): the client sends a line ``N SEED`` and then any bytes up
  to its half-close. The server reads them all, answers ``<count> <sha256 hex>\\n`` of
  those bytes followed by ``N`` bytes of ``random.Random(SEED).randbytes(N)`` and closes.
  A line ``HOLD`` instead: the server closes its side at once without reading (to see
  the host client get EOF while it still may send). A line ``SIZED NUP N SEED``: the
  same, but the server reads exactly ``NUP`` bytes instead of waiting for the half-close.
* UDP ``UDP_PORT``: echoes every datagram to its sender.
"""

import hashlib
import random
import socket
import sys
import threading


def serve_tcp(conn: socket.socket) -> None:
    with conn:
        buf = b""
        while b"\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
        line, rest = buf.split(b"\n", 1)
        if line.strip() == b"HOLD":
            return
        words = line.split()
        nup = None
        if words[0] == b"SIZED":
            nup = int(words.pop(1))
            words.pop(0)
        n, seed = (int(x) for x in words)
        h = hashlib.sha256(rest)
        count = len(rest)
        while nup is None or count < nup:
            chunk = conn.recv(1 << 20 if nup is None else min(1 << 20, nup - count))
            if not chunk:
                break
            h.update(chunk)
            count += len(chunk)
        conn.sendall(f"{count} {h.hexdigest()}\n".encode())
        if n:
            conn.sendall(random.Random(seed).randbytes(n))
        conn.shutdown(socket.SHUT_WR)


def tcp_server(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(512)

    def run() -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=serve_tcp, args=(c,), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return s


def udp_server(port: int) -> socket.socket:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    u.bind(("0.0.0.0", port))

    def run() -> None:
        while True:
            try:
                data, addr = u.recvfrom(65535)
                u.sendto(data, addr)
            except OSError:
                return

    threading.Thread(target=run, daemon=True).start()
    return u


def main() -> None:
    tcp_port, udp_port = int(sys.argv[1]), int(sys.argv[2])
    tcp_server(tcp_port)
    udp_server(udp_port)
    print("READY", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
