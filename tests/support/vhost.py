"""A vhost-user-net front end written for the tests: guest memory is a memfd mapped here, the
rings are laid out in it by hand, the control messages go over the socket as QEMU sends them.

:class:`FakeFrontEnd` (blocking socket, used from a test while the transport runs on the
loop: every call that needs the back end to act is followed by ``await settle()``) sets the
device up like QEMU does (features, owner, memory table with the memfd in SCM_RIGHTS, both
vrings: num, addr, base, call, kick, enable) and then lets a test write any descriptor table,
avail ring and index it likes: valid frames, and hostile ones (addresses outside the memory
table, chains that loop, lengths past the region, avail index jumps).

Guest-physical layout (``GPA`` base, ``SIZE`` bytes, the front end's virtual address ``UVA``):
queue ``q``'s descriptor table, avail ring and used ring at ``ring_base(q)``, data buffers
from ``DATA``.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import struct

from aioslirp.transport import vhost_proto as vp

GPA = 0x100000
UVA = 0x7F0000000000
SIZE = 4 * 1024 * 1024
NUM = 256
DATA = 0x40000  # offset of the first data buffer
VNET_HDR = 12


def ring_base(q: int) -> int:
    return 0x1000 + q * 0x10000  # offset in the memfd; desc (16*NUM), avail at +0x1000, used at +0x2000


class FakeFrontEnd:
    """The front end's side of one connection, over ``path`` (a listening back end)."""

    def __init__(self, path: str, *, features: int = vp.OFFERED_FEATURES, size: int = SIZE) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(5)
        self.fd = os.memfd_create("guest", 0)
        os.ftruncate(self.fd, size)
        self.size = size
        self.mem = mmap.mmap(self.fd, size)
        self.features = features
        self.kick = [os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)]
        self.call = [os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)]
        self.err = [os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)]
        self.avail_idx = [0, 0]
        self.next_desc = [0, 0]
        self.used_seen = [0, 0]
        self.buf_next = DATA

    # -- messages ---------------------------------------------------------------------------------
    def send(self, request: int, payload: bytes = b"", fds=(), need_reply: bool = False) -> None:
        flags = vp.VERSION | (vp.FLAG_NEED_REPLY if need_reply else 0)
        data = vp.HEADER.pack(request, flags, len(payload)) + payload
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self.sock.sendmsg([data], anc)

    def recv_reply(self, request: int) -> bytes:
        head = self._recv_exact(vp.HEADER.size)
        req, flags, size = vp.HEADER.unpack(head)
        assert req == request and flags & vp.FLAG_REPLY, (req, flags)
        return self._recv_exact(size)

    def _recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the back end closed the connection")
            out += chunk
        return out

    def call_u64(self, request: int) -> int:
        self.send(request)
        return vp.U64.unpack(self.recv_reply(request))[0]

    def ack(self, request: int, payload: bytes = b"", fds=()) -> int:
        """Send with NEED_REPLY (REPLY_ACK negotiated): the back end's status (0 success)."""
        self.send(request, payload, fds, need_reply=True)
        return vp.U64.unpack(self.recv_reply(request))[0]

    def setup(self, *, num: int = NUM) -> None:
        """What QEMU sends before the guest's driver runs, and the rings of a running driver."""
        assert self.hello() == vp.OFFERED_FEATURES
        for q in (0, 1):
            self.setup_ring(q, num)

    def hello(self) -> int:
        """Features, protocol features, owner and the memory table, as a front end starts; the
        features the back end offered."""
        offered = self.call_u64(vp.GET_FEATURES)
        self.send(vp.SET_FEATURES, vp.U64.pack(self.features & offered))
        self.call_u64(vp.GET_PROTOCOL_FEATURES)
        self.send(vp.SET_PROTOCOL_FEATURES, vp.U64.pack(vp.P_REPLY_ACK))
        self.send(vp.SET_OWNER)
        assert self.ack(vp.SET_MEM_TABLE, self.mem_table(), [self.fd]) == 0
        return offered

    def mem_table(self, regions=None) -> bytes:
        regions = regions or [(GPA, self.size, UVA, 0)]
        return vp.MEM_HEADER.pack(len(regions), 0) + b"".join(vp.MEM_REGION.pack(*r) for r in regions)

    def setup_ring(self, q: int, num: int = NUM) -> None:
        self.num = num
        base = ring_base(q)
        self.mem[base:base + 0x3000] = bytes(0x3000)
        self.avail_idx[q] = self.next_desc[q] = self.used_seen[q] = 0
        self.send(vp.SET_VRING_NUM, vp.VRING_STATE.pack(q, num))
        self.send(vp.SET_VRING_ADDR, vp.VRING_ADDR.pack(q, 0, UVA + base, UVA + base + 0x2000, UVA + base + 0x1000, 0))
        self.send(vp.SET_VRING_BASE, vp.VRING_STATE.pack(q, 0))
        self.send(vp.SET_VRING_CALL, vp.U64.pack(q), [self.call[q]])
        self.send(vp.SET_VRING_ERR, vp.U64.pack(q), [self.err[q]])
        self.send(vp.SET_VRING_KICK, vp.U64.pack(q), [self.kick[q]])
        assert self.ack(vp.SET_VRING_ENABLE, vp.VRING_STATE.pack(q, 1)) == 0

    def resume(self, path: str) -> None:
        """Connect again (a back end that restarted) and set the device up as DPDK virtio_user does
        then (``server=1``): the rings as they are, in its order (num, base 0, addr)."""
        self.sock.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(5)
        self.hello()
        for q in (0, 1):
            base = ring_base(q)
            self.send(vp.SET_VRING_NUM, vp.VRING_STATE.pack(q, self.num))
            self.send(vp.SET_VRING_BASE, vp.VRING_STATE.pack(q, 0))
            self.send(vp.SET_VRING_ADDR, vp.VRING_ADDR.pack(q, 0, UVA + base, UVA + base + 0x2000,
                                                            UVA + base + 0x1000, 0))
            self.send(vp.SET_VRING_CALL, vp.U64.pack(q), [self.call[q]])
            self.send(vp.SET_VRING_KICK, vp.U64.pack(q), [self.kick[q]])
            assert self.ack(vp.SET_VRING_ENABLE, vp.VRING_STATE.pack(q, 1)) == 0

    # -- rings ------------------------------------------------------------------------------------
    def put_desc(self, q: int, i: int, addr: int, length: int, flags: int = 0, nxt: int = 0) -> None:
        struct.pack_into("<QIHH", self.mem, ring_base(q) + 16 * i, addr, length, flags, nxt)

    def alloc(self, data: bytes | int) -> int:
        """Guest-physical address of a new buffer holding ``data`` (or ``data`` zero bytes)."""
        n = data if isinstance(data, int) else len(data)
        off = self.buf_next
        if off + n > self.size:
            off = self.buf_next = DATA
        if not isinstance(data, int):
            self.mem[off:off + n] = data
        self.buf_next = (off + n + 63) & ~63
        return GPA + off

    def publish(self, q: int, heads, *, idx: int | None = None, kick: bool | str = True) -> bool:
        """Put ``heads`` in the avail ring and move its index (to ``idx`` if given: a jump). ``kick``:
        True, False, or ``"event"``: only when the device's avail_event asks for it (EVENT_IDX, as a
        Linux driver does: virtio 1.1 2.6.10.2). Returns whether it kicked."""
        a = ring_base(q) + 0x1000
        old = self.avail_idx[q]
        for h in heads:
            struct.pack_into("<H", self.mem, a + 4 + 2 * (self.avail_idx[q] % self.num), h)
            self.avail_idx[q] = (self.avail_idx[q] + 1) & 0xFFFF
        new = self.avail_idx[q] if idx is None else idx & 0xFFFF
        struct.pack_into("<H", self.mem, a + 2, new)
        if kick == "event":
            event = struct.unpack_from("<H", self.mem, ring_base(q) + 0x2000 + 4 + 8 * self.num)[0]
            kick = (new - event - 1) & 0xFFFF < (new - old) & 0xFFFF
        if kick:
            os.eventfd_write(self.kick[q], 1)
        return bool(kick)

    def send_frame(self, frame: bytes, *, vnet: bytes = bytes(VNET_HDR), split: bool = False, kick: bool = True,
                   pieces: list[int] | None = None) -> int:
        """A guest frame on the TX queue (header and frame in one descriptor, or two; or, with
        ``pieces``, the header and then the frame in descriptors of those lengths, the last one
        taking the rest); its head."""
        q = 1
        head = self.next_desc[q] % self.num
        if pieces is not None:
            parts, at = [vnet], 0
            for n in pieces:
                parts.append(frame[at:at + n])
                at += n
            parts.append(frame[at:])
            parts = [p for p in parts if p]
            for k, part in enumerate(parts):
                i = (head + k) % self.num
                last = k == len(parts) - 1
                self.put_desc(q, i, self.alloc(part), len(part), 0 if last else vu_next(), (i + 1) % self.num)
            self.next_desc[q] += len(parts)
        elif split:
            self.put_desc(q, head, self.alloc(vnet), len(vnet), vu_next(), (head + 1) % self.num)
            self.put_desc(q, (head + 1) % self.num, self.alloc(frame), len(frame))
            self.next_desc[q] += 2
        else:
            self.put_desc(q, head, self.alloc(vnet + frame), len(vnet) + len(frame))
            self.next_desc[q] += 1
        self.publish(q, [head], kick=kick)
        return head

    def post_rx(self, count: int, size: int = 2048, *, kick: bool | str = True) -> list[int]:
        """``count`` device-writable buffers of ``size`` bytes on the RX queue; their addresses.
        ``kick`` as for :meth:`publish`."""
        q = 0
        addrs = []
        heads = []
        for _ in range(count):
            head = self.next_desc[q] % self.num
            addr = self.alloc(size)
            self.put_desc(q, head, addr, size, 2)  # VRING_DESC_F_WRITE
            self.next_desc[q] += 1
            addrs.append(addr)
            heads.append(head)
        self.publish(q, heads, kick=kick)
        return addrs

    def set_used_event(self, q: int, idx: int) -> None:
        """The driver's ``used_event`` for queue ``q`` (EVENT_IDX: call me once the used index
        passes ``idx``; a Linux driver sets it to the entries it has taken back)."""
        struct.pack_into("<H", self.mem, ring_base(q) + 0x1000 + 4 + 2 * self.num, idx & 0xFFFF)

    def used_idx(self, q: int) -> int:
        """The device's published used index of queue ``q``."""
        return struct.unpack_from("<H", self.mem, ring_base(q) + 0x2000 + 2)[0]

    def used(self, q: int) -> list[tuple[int, int]]:
        """The used entries added since the last call: ``(head, len)``."""
        u = ring_base(q) + 0x2000
        idx = struct.unpack_from("<H", self.mem, u + 2)[0]
        out = []
        while self.used_seen[q] != idx:
            out.append(struct.unpack_from("<II", self.mem, u + 4 + 8 * (self.used_seen[q] % self.num)))
            self.used_seen[q] = (self.used_seen[q] + 1) & 0xFFFF
        return out

    def read(self, gpa: int, n: int) -> bytes:
        return bytes(self.mem[gpa - GPA:gpa - GPA + n])

    def calls(self, q: int) -> int:
        try:
            return os.eventfd_read(self.call[q])
        except BlockingIOError:
            return 0

    def close(self) -> None:
        self.sock.close()
        self.mem.close()
        for fd in [self.fd, *self.kick, *self.call, *self.err]:
            os.close(fd)


def vu_next() -> int:
    return 1  # VRING_DESC_F_NEXT


async def engine_device(path: str, made: list, features: int, *, af: int = socket.AF_INET, loopback: str = "127.0.0.1",
                        setup=None, **transport_options):
    """A vhost-user transport serving ``path`` with a :class:`FakeFrontEnd` of ``features`` set up
    on it (``setup(fe)``, default ``fe.setup()``, run off the loop) and running, and a listening
    socket on ``loopback`` (family ``af``) for a flow to connect to. Returns ``(transport, front
    end, listener, port, python_frames)``: the frames the transport handed to its sink land in
    ``python_frames``; ``transport_options`` go to the transport. Everything made is appended to ``made`` for :func:`close_made`."""
    import asyncio

    from aioslirp.transport import vhost_user as vu

    from support.stacks import until

    lst = socket.socket(af)
    lst.bind((loopback, 0))
    lst.listen(1)
    t = vu.VhostUserTransport(path, **transport_options)
    python_frames: list = []
    await t.open(lambda frames, csum=None: python_frames.extend(frames))
    fe = FakeFrontEnd(path, features=features)
    made.append((t, fe, lst))
    await asyncio.to_thread(setup or fe.setup, *((fe,) if setup else ()))
    assert await until(lambda: t.running, 5.0)
    return t, fe, lst, lst.getsockname()[1], python_frames


def close_made(made: list) -> None:
    """Close what :func:`engine_device` and a test's fixture made: each ``(transport, front end,
    listener)`` and each other object (an engine, a socket)."""
    for m in made:
        if isinstance(m, tuple):
            t, fe, lst = m
            t.close()
            fe.close()
            lst.close()
        else:
            m.close()
