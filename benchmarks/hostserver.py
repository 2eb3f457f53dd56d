"""Host-side benchmark servers: one process, one epoll loop, standard library only.

Started by ``run.py`` outside the guest namespace (but inside the harness's own
loopback-only namespace) as ``python hostserver.py ADDR TCP_PORT UDP_PORT``:

* TCP on ``ADDR:TCP_PORT``: echoes whatever it receives (the benchmarks send 1 byte and
  wait for 1 byte back), closes on EOF or error. Used for CRR, RR, concurrent CRR and the
  idle-flow test (connections that stay open and silent cost nothing here).
* UDP on ``ADDR:UDP_PORT``: echoes every datagram.

When both sockets are bound it prints one JSON line (``{"ready": true, ...}``) on stdout.
On ``SIGTERM`` it prints ``{"accepted": N, "open": M}`` and exits. ``ADDR`` is 127.0.0.1
for the user-mode backends and the host-side veth address for the kernel reference.
"""

from __future__ import annotations

import errno
import json
import resource
import select
import signal
import socket
import sys


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def serve(addr: str, tcp_port: int, udp_port: int) -> None:
    _raise_nofile()
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind((addr, tcp_port))
    lst.listen(4096)
    lst.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    udp.bind((addr, udp_port))
    udp.setblocking(False)

    ep = select.epoll()
    lfd, ufd = lst.fileno(), udp.fileno()
    ep.register(lfd, select.EPOLLIN)
    ep.register(ufd, select.EPOLLIN)
    conns: dict[int, socket.socket] = {}
    stats = {"accepted": 0}
    stopping = []

    def on_term(_sig, _frm):
        stopping.append(1)

    signal.signal(signal.SIGTERM, on_term)
    print(json.dumps({"ready": True, "addr": addr, "tcp": tcp_port, "udp": udp_port}), flush=True)

    EPOLLIN = select.EPOLLIN
    poll = ep.poll
    while not stopping:
        try:
            events = poll(1.0, 1024)
        except InterruptedError:
            continue
        for fd, _ev in events:
            if fd == lfd:
                while True:
                    try:
                        c, _ = lst.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as exc:  # EMFILE and friends: stop accepting this round
                        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            break
                        raise
                    c.setblocking(False)
                    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conns[c.fileno()] = c
                    ep.register(c.fileno(), EPOLLIN)
                    stats["accepted"] += 1
            elif fd == ufd:
                for _ in range(64):
                    try:
                        data, peer = udp.recvfrom(65536)
                    except (BlockingIOError, InterruptedError):
                        break
                    try:
                        udp.sendto(data, peer)
                    except OSError:
                        pass
            else:
                c = conns.get(fd)
                if c is None:
                    continue
                try:
                    data = c.recv(65536)
                    if data:
                        c.send(data)
                        continue
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    pass
                ep.unregister(fd)
                del conns[fd]
                c.close()
    print(json.dumps({"accepted": stats["accepted"], "open": len(conns)}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
