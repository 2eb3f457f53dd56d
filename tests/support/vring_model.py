"""A Python model of the vhost-user rings' C walker (``aioslirp/native/vring.c``), for differential
fuzzing (``fuzz/fuzz_vring.py``): the same rules, written plainly from ``vring.h``, over a
``bytearray`` image of guest memory.

:func:`build` lays out one fuzz input as guest memory (two regions: data and rings) and
a :class:`Case`; :func:`run_c` runs it through ``aioslirp.native._vhost.Device`` (memory in a
memfd), :func:`run_model` through this model; :func:`check` asserts both give the same frames,
used entries, broken state and drop counters.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

DATA_GPA, DATA_SIZE = 0x10000, 0x2000  # region 0: frame bytes (a pattern)
RING_GPA, RING_SIZE = 0x40000, 0x1000  # region 1: the rings, at front-end address RING_UVA
RING_UVA = 0x7F00_0000_0000
DESC, AVAIL, USED = 0x000, 0x400, 0x800  # offsets in region 1 (queue size <= 32)
MAX_FRAME = 3000
BATCH = 64


@dataclass
class Case:
    num: int
    base: int
    avail_idx: int
    hdr_len: int
    desc: list  # (addr, len, flags, next)
    ring: list  # avail ring entries
    rx_frames: list = field(default_factory=list)


def _pattern() -> bytes:
    return bytes((i * 7 + (i >> 8)) & 0xFF for i in range(DATA_SIZE))


def build(data: bytes) -> Case | None:
    """One fuzz input: [log2 num (mod 6) | hdr flag 0x20][base lo][base hi][avail delta: bit 7 a jump][RX frames]
    then 7 bytes per descriptor (address offset u16 around the data region, length u16, flags: NEXT 1,
    WRITE 2, INDIRECT when 0x1c are all set, a length near 4 GiB 0x40, the ring region 0x80; next; pad)
    and the avail ring (one byte per entry, heads up to the queue size)."""
    if len(data) < 5:
        return None
    num = 1 << (data[0] & 31) % 6  # a power of 2, 1..32
    hdr_len = 10 if data[0] & 32 else 12
    base = data[1] | (data[2] << 8)
    d3 = data[3]
    if d3 & 0x80:  # a jump: past the queue, or "behind" (a huge unsigned distance)
        delta = num + 1 + (d3 & 0x3F) if d3 & 0x40 else 0x10000 - 1 - (d3 & 0x3F)
    else:
        delta = d3 % (num + 1)
    nrx = data[4] & 7
    p = 5
    desc = []
    for _ in range(num):
        d = data[p:p + 7].ljust(7, b"\0")
        p += 7
        off = d[0] | (d[1] << 8)
        f = d[4]
        addr = RING_GPA + off if f & 0x80 else DATA_GPA - 256 + off % (DATA_SIZE + 512)
        length = (d[2] | (d[3] << 8)) % 4096
        if f & 0x40:
            length = 0xFFFFFFFF - length
        flags = (f & 3) | (4 if f & 0x1C == 0x1C else 0)
        desc.append((addr, length, flags, d[5] % (num + 2)))
    ring = []
    for _ in range(num):
        b = data[p] if p < len(data) else 0
        p += 1
        ring.append(b % (num + 1))
    rx = [700 * (1 + i % 3) + i for i in range(nrx)]
    return Case(num, base, (base + delta) & 0xFFFF, hdr_len, desc, ring, [bytes([i]) * n for i, n in enumerate(rx)])


def _ring_image(c: Case) -> bytearray:
    img = bytearray(RING_SIZE)
    for i, (addr, length, flags, nxt) in enumerate(c.desc):
        struct.pack_into("<QIHH", img, DESC + 16 * i, addr, length, flags, nxt)
    struct.pack_into("<HH", img, AVAIL, 0, c.avail_idx)
    struct.pack_into("<HH", img, USED, 0, c.base)  # the used index where the driver left it
    for i, h in enumerate(c.ring):
        struct.pack_into("<H", img, AVAIL + 4 + 2 * i, h)
    return img


def run_c(ext, c: Case, queue: int) -> dict:
    """Run the case on queue ``queue`` (1: TX, ``tx()``; 0: RX, ``rx(rx_frames)``) through the C walker."""
    fd = os.memfd_create("fuzz", 0)
    try:
        os.ftruncate(fd, DATA_SIZE + RING_SIZE)
        m = mmap.mmap(fd, DATA_SIZE + RING_SIZE)
        m[:DATA_SIZE] = _pattern()
        m[DATA_SIZE:] = _ring_image(c)
        dev = ext.Device(MAX_FRAME, BATCH)
        dev.set_mem_table([(DATA_GPA, DATA_SIZE, 0x1000_0000, 0, fd), (RING_GPA, RING_SIZE, RING_UVA, DATA_SIZE, fd)])
        dev.set_features(c.hdr_len, True, False)
        dev.set_num(queue, c.num)
        dev.set_addr(queue, RING_UVA + DESC, RING_UVA + USED, RING_UVA + AVAIL)
        dev.set_base(queue, c.base)
        out: dict = {}
        if queue == 1:
            frames, csum, _more = dev.tx(-1)
            out["frames"] = [bytes(f) for f in frames]
        else:
            out["next"], out["state"], out["delivered"] = dev.rx(c.rx_frames, 0)
        used_idx = struct.unpack_from("<H", m, DATA_SIZE + USED + 2)[0]
        n = (used_idx - c.base) & 0xFFFF
        out["used"] = [struct.unpack_from("<II", m, DATA_SIZE + USED + 4 + 8 * ((c.base + k) % c.num)) for k in range(min(n, c.num))]
        out["n_used"] = n
        out["broken"] = dev.broken(queue)
        out["drops"] = {k: v for k, v in dev.counters().items()
                        if k not in ("tx_frames", "rx_frames", "calls", "kicks", "rx_dropped",
                                      "tx_coalesced", "tx_calls_deferred", "tx_calls_saved", "tx_calls_late")}
        out["data"] = bytes(m[:DATA_SIZE])
        del dev
        m.close()
        return out
    finally:
        os.close(fd)


class _Model:
    def __init__(self, c: Case) -> None:
        self.c = c
        self.mem = bytearray(_pattern())
        self.last = c.base
        self.used: list = []
        self.broken = None
        self.drops: dict = {}

    def gpa(self, addr: int, n: int):
        """Offset in the data region of [addr, addr + n), or None (the ring region is not written by frames
        in this model: an address there reads the ring image)."""
        if DATA_GPA <= addr and addr - DATA_GPA < DATA_SIZE and n <= DATA_SIZE - (addr - DATA_GPA):
            return ("d", addr - DATA_GPA)
        if RING_GPA <= addr and addr - RING_GPA < RING_SIZE and n <= RING_SIZE - (addr - RING_GPA):
            return ("r", addr - RING_GPA)
        return None

    def count(self, why: str) -> None:
        self.drops[why] = self.drops.get(why, 0) + 1

    def avail(self) -> int:
        n = (self.c.avail_idx - self.last) & 0xFFFF
        if n > self.c.num:
            self.broken = "avail_jump"
            self.count("avail_jump")
            return -1
        return n

    def head(self):
        h = self.c.ring[self.last % self.c.num]
        if h >= self.c.num:
            self.broken = "bad_head"
            self.count("bad_head")
            return None
        self.last = (self.last + 1) & 0xFFFF
        return h


def run_model(c: Case, queue: int, ring_img: bytes | None = None) -> dict:
    m = _Model(c)
    ring = bytes(ring_img if ring_img is not None else _ring_image(c))

    def read(where, n):
        kind, off = where
        if kind == "r" and off + n > USED:  # the used ring, which the walk writes: not followed here
            raise Unmodelled
        return bytes(m.mem[off:off + n]) if kind == "d" else ring[off:off + n]

    out: dict = {}
    if queue == 1:
        frames = []
        while len(frames) < BATCH:
            n = m.avail()
            if n <= 0:
                break
            h = m.head()
            if h is None:
                break
            skip, got, body, why, count, i = c.hdr_len, 0, b"", None, 0, h
            while True:
                if count >= c.num:
                    why = "chain_loop"
                    break
                count += 1
                addr, length, flags, nxt = c.desc[i]
                if flags & 4:
                    why = "indirect"
                    break
                if flags & 2:
                    why = "tx_writable"
                    break
                if length:
                    where = m.gpa(addr, length)
                    if where is None:
                        why = "desc_out_of_region"
                        break
                    chunk = read(where, length)
                    take = min(skip - got, length) if got < skip else 0
                    got += take
                    if length > take:
                        if len(body) + length - take > MAX_FRAME:
                            why = "tx_too_large"
                            break
                        body += chunk[take:]
                if not flags & 1:
                    break
                if nxt >= c.num:
                    why = "bad_next"
                    break
                i = nxt
            if why is None and (got < skip or not body):
                why = "tx_truncated"
            m.used.append((h, 0))
            if why:
                m.count(why)
            else:
                frames.append(body)
        out["frames"] = frames
    else:
        state, k, delivered = 0, 0, 0
        for k, frame in enumerate(c.rx_frames):
            n = m.avail()
            if n < 0:
                state = 2
                k = len(c.rx_frames)
                break
            need = bytes(c.hdr_len) + frame
            saved, chains, written, why, first = m.last, [], 0, None, None
            res = None
            while written < len(need):
                if len(chains) == n:
                    m.last = saved
                    if n < c.num:
                        res = "empty"
                    else:
                        m.count("rx_too_small")
                        res = "dropped"
                    break
                h = m.head()
                if h is None:
                    m.last = saved
                    res = "broken"
                    break
                i, in_chain, count = h, 0, 0
                while True:
                    if count >= c.num:
                        why = "chain_loop"
                        break
                    count += 1
                    addr, length, flags, nxt = c.desc[i]
                    if flags & 4:
                        why = "indirect"
                        break
                    if not flags & 2:
                        why = "rx_readonly"
                        break
                    if length:
                        where = m.gpa(addr, length)
                        if where is None:
                            why = "desc_out_of_region"
                            break
                        if first is None:
                            if length < c.hdr_len:
                                why = "rx_hdr_split"
                                break
                            first = where
                        take = min(len(need) - written, length)
                        if where[0] == "d":
                            m.mem[where[1]:where[1] + take] = need[written:written + take]
                        else:  # into the ring region: the model does not follow ring writes
                            raise Unmodelled
                        written += take
                        in_chain += take
                        if written == len(need):
                            break
                    if not flags & 1:
                        break
                    if nxt >= c.num:
                        why = "bad_next"
                        break
                    i = nxt
                chains.append((h, in_chain))
                if why:
                    break
            if res == "empty":
                state = 1
                break
            if res == "broken":
                state = 2
                k = len(c.rx_frames)
                break
            if res == "dropped":
                continue
            if why:
                m.count(why)
                m.used += [(h, 0) for h, _ in chains]
                continue
            if c.hdr_len >= 12:
                m.mem[first[1] + 10:first[1] + 12] = struct.pack("<H", len(chains))
            m.used += chains
            delivered += 1
        else:
            k = len(c.rx_frames)
        out["next"], out["state"] = k, state
        out["delivered"] = delivered
        out["data"] = bytes(m.mem)
    out["used"] = m.used
    out["n_used"] = len(m.used)
    out["broken"] = m.broken
    out["drops"] = m.drops
    return out


class Unmodelled(Exception):
    """A frame read from the used ring or written into the ring region (the model does not follow
    the walk's own writes there): the input is skipped for that queue."""


def check(ext, data: bytes) -> None:
    """Run one fuzz input through C and the model, on TX and on RX; raise AssertionError on a difference."""
    c = build(data)
    if c is None:
        return
    for queue in (1, 0):
        try:
            want = run_model(c, queue)
        except Unmodelled:
            continue
        got = run_c(ext, c, queue)
        if queue == 1:
            got.pop("data")
        if got != want:
            diff = {k: (str(got[k])[:300], str(want.get(k))[:300]) for k in got if got[k] != want.get(k)}
            raise AssertionError(f"queue {queue}: C != model: {diff}; case num={c.num} base={c.base} "
                                 f"avail_idx={c.avail_idx} hdr_len={c.hdr_len} desc={c.desc} ring={c.ring} "
                                 f"rx={[len(f) for f in c.rx_frames]}")
