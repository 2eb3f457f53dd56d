#!/usr/bin/env python3
"""The down path's cost in instructions over the vhost-user device (issue 27: one copy too many),
for a fixed download, without QEMU: the transport and the native TCP engine in this process, the
front end of the tests (tests/support/vhost.py: guest memory a memfd, 4 KB mergeable RX buffers
posted as a Linux driver does) and a host peer in a child process sending N MB on loopback.

Meant to run under callgrind, which counts instructions (a ``rep movsb`` counts once per byte, so
a copy shows as its length) and not the kernel's work::

    valgrind --tool=callgrind --callgrind-out-file=OUT python benchmarks/vhost_rx_copies.py --mb 32
    callgrind_annotate OUT | head -30

``--copy``: the engine's frames through the copying writer (``Device.set_rx_direct(False)``), the
path before issue 27's change. Prints the bytes received, the frames in place and copied, and the
guest's rounds. The guest side (Python) costs the same both ways; compare totals and the
memmove and extension lines of the two runs. Wall time means nothing here (a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

from aioslirp import native  # noqa: E402
from aioslirp.transport import vhost_user as vu  # noqa: E402

from support.frames import ACK, F4, GUEST_MAC, GW_MAC, tcp_frame  # noqa: E402
from support.vhost import GPA, FakeFrontEnd  # noqa: E402

IRS, ISS, GPORT, WSCALE = 1_000_000, 5_000_000, 40000, 7
DATA_VALID = bytes([2]) + bytes(11)
SENDER = ("import socket,sys\nl=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(1)\n"
          "print(l.getsockname()[1], flush=True)\ns,_=l.accept()\n"
          "b=bytes(range(256))*4096\nn=int(sys.argv[1])\nwhile n>0:\n s.sendall(b[:min(n,len(b))]); n-=len(b)\n"
          "s.shutdown(socket.SHUT_WR)\ntry: s.recv(1)\nexcept OSError: pass\n")


async def run(mb: int, copy: bool) -> None:
    ext = native.extension()
    size = mb * 1024 * 1024
    with tempfile.TemporaryDirectory() as d:
        # the host peer, in a process of its own (not counted): the engine's socket connects to it
        sender = subprocess.Popen([sys.executable, "-c", SENDER, str(size)], stdout=subprocess.PIPE, text=True)
        port = int(sender.stdout.readline())
        t = vu.VhostUserTransport(os.path.join(d, "vu.sock"))
        await t.open(lambda frames, csum=None: None)
        fe = FakeFrontEnd(os.path.join(d, "vu.sock"))
        await asyncio.to_thread(fe.setup)
        while not t.running:
            await asyncio.sleep(0.01)
        if hasattr(t._dev, "set_rx_direct"):
            t._dev.set_rx_direct(not copy)
        elif not copy:
            sys.exit("this tree has no RX in place (no Device.set_rx_direct): run it with --copy")
        engine = ext.TcpEngine(-1, True, True, GW_MAC, 1500, 16, 1 << 20, 60.0, 5.0, 1.0, sink=t.tcp_sink())
        t.attach_tcp(engine)
        p2 = port
        loop = asyncio.get_running_loop()
        status, _, _ = engine.adopt(False, GUEST_MAC, F4.guest, GPORT, F4.gw, p2, socket.inet_aton("127.0.0.1"), p2,
                                    IRS, ISS, 1460, WSCALE, 65535, loop.time())
        assert status == 0
        bufs: dict[int, int] = {}
        outstanding = 0

        def post(n: int) -> None:
            nonlocal outstanding
            first = fe.next_desc[0]
            for i, addr in enumerate(fe.post_rx(n, size=4096)):
                bufs[(first + i) % fe.num] = addr
            outstanding += n

        post(fe.num)
        nxt, got, rounds, direct_before = ISS + 1, 0, 0, 0
        entries: list = []
        while got < size:
            rounds += 1
            fe.send_frame(tcp_frame(F4, GPORT, p2, ACK, seq=IRS + 1, ack=nxt & 0xFFFFFFFF, win=(768 << 10) >> WSCALE),
                          vnet=DATA_VALID)
            await asyncio.sleep(0.001)
            engine.poll()
            entries += fe.used(0)
            outstanding -= len(entries)
            i = 0
            while i < len(entries):
                head, n = entries[i]
                hdr = fe.read(bufs[head], 12 + 54)
                nb = struct.unpack_from("<H", hdr, 10)[0]
                if i + nb > len(entries):
                    break
                total = struct.unpack_from("!H", hdr, 12 + 14 + 2)[0]
                seq = struct.unpack_from("!I", hdr, 12 + 14 + 20 + 4)[0]
                plen = total - 20 - (hdr[12 + 14 + 20 + 12] >> 4) * 4
                if plen > 0 and seq == nxt & 0xFFFFFFFF:
                    nxt += plen
                    got += plen
                i += nb
            entries = entries[i:]
            if fe.num - outstanding > 0:
                post(fe.num - outstanding)
        c = t.counters()
        print(f"received {got} bytes in {rounds} rounds; frames in place {c.get('tcp_frames_direct', 0)}, "
              f"all {c.get('tcp_frames_out')}, waited {c.get('tcp_frames_waited')}")
        engine.close()
        sender.wait()
        t.close()
        fe.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=32, help="MiB downloaded (default 32)")
    ap.add_argument("--copy", action="store_true", help="through the copying writer (the path before)")
    a = ap.parse_args()
    asyncio.run(run(a.mb, a.copy))


if __name__ == "__main__":
    main()
