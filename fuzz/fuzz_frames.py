"""atheris (libFuzzer) target for ``Stack.process_guest_frame``.

Run it on demand, as long as you like::

    pip install atheris
    python fuzz/fuzz_frames.py -max_len=4096 -artifact_prefix=/tmp/ CORPUS_DIR      # until stopped
    python fuzz/fuzz_frames.py -runs=200000 -max_len=4096 CORPUS_DIR                  # bounded
    python fuzz/fuzz_frames.py --seeds CORPUS_DIR                                     # write seed inputs

The suite runs it bounded (``tests/adversarial/test_fuzz_atheris.py``, a few thousand inputs) when atheris
is importable, and replays every file of ``fuzz/regressions/`` without atheris.

Input format: a sequence of guest frames, each preceded by its length as two big-endian bytes
(the last frame takes whatever is left), so that multi-frame interactions -- fragments, TCP
handshakes, DHCP exchanges -- are reachable. For an input of odd length the IPv4 header and
TCP/UDP/ICMP(v6) checksums of every frame are recomputed first (:func:`fix_checksums`), so
mutations reach the code behind the checksum checks; even-length inputs go in as they are. Property checked per input: nothing escapes
``process_guest_frame`` (``drop.internal_error`` stays 0) and nothing raises out of
``Stack.flush``; a violation raises, which libFuzzer reports as a crash and saves the input.
Every crash becomes a file in ``fuzz/regressions/`` (and a fix).

Safety: the process first moves into a fresh network namespace that has only loopback (unless
already inside one, as under pytest), and the stack's egress policy allows only loopback, so no
made-up destination is ever contacted.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import struct
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

_stack = None
_loop = None
_inputs = 0
#: Reset the flow table after this many inputs (bounds the fuzzer's own memory and fds).
RESET_EVERY = 256


def fix_checksums(frame: bytes) -> bytes:
    """``frame`` with its IPv4 header checksum and its TCP/UDP/ICMP/ICMPv6 checksum recomputed
    (best effort: a frame too broken to find them is returned unchanged), so that mutated frames
    get past the checksum checks to the code behind them."""
    from aioslirp.wire.checksum import checksum

    f = bytearray(frame)
    try:
        if f[12:14] == b"\x08\x00" and len(f) >= 34:
            ihl = (f[14] & 0x0F) * 4
            if ihl < 20 or 14 + ihl > len(f):
                return frame
            f[24:26] = b"\0\0"
            f[24:26] = struct.pack("!H", checksum(bytes(f[14:14 + ihl])))
            total = min(struct.unpack_from("!H", f, 16)[0], len(f) - 14)
            proto, l4 = f[23], 14 + ihl
            if struct.unpack_from("!H", f, 20)[0] & 0x3FFF or total <= ihl:
                return bytes(f)  # a fragment: the checksum covers the whole datagram
            seg = f[l4:14 + total]
            pseudo = bytes(f[26:34]) + struct.pack("!BBH", 0, proto, len(seg))
            off = {6: 16, 17: 6, 1: 2}.get(proto)
            if off is not None and len(seg) >= off + 2:
                seg[off:off + 2] = b"\0\0"
                seg[off:off + 2] = struct.pack("!H", checksum((pseudo if proto != 1 else b"") + bytes(seg)))
                f[l4:14 + total] = seg
        elif f[12:14] == b"\x86\xdd" and len(f) >= 54:
            nh, plen = f[20], struct.unpack_from("!H", f, 18)[0]
            seg = f[54:54 + plen]
            off = {6: 16, 17: 6, 58: 2}.get(nh)
            if off is not None and len(seg) >= off + 2:
                seg[off:off + 2] = b"\0\0"
                pseudo = bytes(f[22:54]) + struct.pack("!IxxxB", len(seg), nh)
                seg[off:off + 2] = struct.pack("!H", checksum(pseudo + bytes(seg)))
                f[54:54 + len(seg)] = seg
    except (struct.error, IndexError, ValueError):
        return frame
    return bytes(f)


def split_frames(data: bytes) -> list[bytes]:
    """The frames of one fuzz input (see the module documentation)."""
    frames = []
    i, n = 0, len(data)
    while i < n:
        if n - i < 2:
            frames.append(data[i:])
            break
        ln = struct.unpack_from("!H", data, i)[0]
        i += 2
        frames.append(data[i:i + ln])
        i += ln
    return frames


def make_stack():
    """A started Stack on its own event loop, policy: loopback only."""
    global _stack, _loop
    from aioslirp import NetworkConfig, Stack

    cfg = NetworkConfig(dns_upstreams=[("127.0.0.1", 9)], dns_timeout=0.05, tcp_connect_timeout=0.2,
                        udp_idle_timeout=0.2, icmp_idle_timeout=0.2, tcp_linger=0.2,
                        egress_deny=["0.0.0.0/0", "::/0"], egress_allow=["127.0.0.0/8", "::1/128"])
    _loop = asyncio.new_event_loop()
    asyncio.set_event_loop(_loop)
    _stack = Stack(cfg)
    _loop.run_until_complete(_stack.start())
    return _stack


def run_input(data: bytes) -> None:
    """Feed one fuzz input to the stack and let its tasks run once; raise on a property violation."""
    global _inputs
    stack = _stack or make_stack()
    fix = len(data) & 1  # odd-length inputs get their checksums fixed up: both paths stay reachable
    for frame in split_frames(data):
        stack.process_guest_frame(fix_checksums(frame) if fix else frame)
    stack.flush()
    _loop.run_until_complete(asyncio.sleep(0))
    if stack.counters["drop.internal_error"] or stack.counters["flow_errors"]:
        raise RuntimeError(f"process_guest_frame failed: {dict(stack.counters)}")
    _inputs += 1
    if _inputs % RESET_EVERY == 0 or len(stack.parts.flows) > 512:
        stack.reset_flows()
        _loop.run_until_complete(asyncio.sleep(0.001))


def close() -> None:
    """Close the stack and its event loop (for callers other than libFuzzer, e.g. the regression replay)."""
    global _stack, _loop
    if _stack is not None:
        _loop.run_until_complete(_stack.aclose())
        _loop.close()
        asyncio.set_event_loop(None)
    _stack = _loop = None


def seed_inputs() -> dict[str, bytes]:
    """A few valid inputs to start from: ARP, DHCP, DNS, TCP SYN, UDP, ICMP echo, fragments, IPv6 NS/echo."""
    from aioslirp.wire.checksum import checksum

    gw_mac, mac = bytes.fromhex("52550a000202"), bytes.fromhex("525400123456")
    guest, gw, dns = socket.inet_aton("10.0.2.15"), socket.inet_aton("10.0.2.2"), socket.inet_aton("10.0.2.3")

    def ip4(proto, payload, dst=gw, src=guest, frag=0, ident=1):
        h = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), ident, frag, 64, proto, 0, src, dst))
        struct.pack_into("!H", h, 10, checksum(bytes(h)))
        return gw_mac + mac + b"\x08\x00" + bytes(h) + payload

    def l4(proto, seg, dst=gw, src=guest, off=16):
        seg = bytearray(seg)
        pseudo = src + dst + struct.pack("!BBH", 0, proto, len(seg))
        struct.pack_into("!H", seg, off, checksum(pseudo + bytes(seg)))
        return bytes(seg)

    def framed(*frames):
        return b"".join(struct.pack("!H", len(f)) + f for f in frames)

    syn = l4(6, struct.pack("!HHIIBBHHH", 40000, 22, 1, 0, 0x60, 0x02, 65535, 0, 0) + b"\x02\x04\x05\xb4")
    ack = l4(6, struct.pack("!HHIIBBHHH", 40000, 22, 2, 1, 0x50, 0x10, 65535, 0, 0) + b"data")
    udp = l4(17, struct.pack("!HHHH", 40001, 7, 12, 0) + b"ping", off=6)
    query = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"\x07example\x03com\x00\x00\x01\x00\x01"
    dnsq = l4(17, struct.pack("!HHHH", 40002, 53, 8 + len(query), 0) + query, dst=dns, off=6)
    echo = bytearray(struct.pack("!BBHHH", 8, 0, 0, 7, 1) + b"abcdefgh")
    struct.pack_into("!H", echo, 2, checksum(bytes(echo)))
    arp = gw_mac + mac + b"\x08\x06" + struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, mac, guest, bytes(6), gw)
    dhcp = struct.pack("!BBBBIHH4s4s4s4s16s192s", 1, 1, 6, 0, 0x55, 0, 0x8000, bytes(4), bytes(4), bytes(4), bytes(4),
                       mac + bytes(10), bytes(192)) + b"\x63\x82\x53\x63\x35\x01\x01\xff"
    dhcp_frame = ip4(17, struct.pack("!HHHH", 68, 67, 8 + len(dhcp), 0) + dhcp, dst=b"\xff" * 4, src=bytes(4))
    body = udp + b"\x00" * 16
    ll = bytes.fromhex("fe800000000000005054" + "00fffe123456")
    ns = struct.pack("!BBHI16s", 135, 0, 0, 0, bytes.fromhex("fd000000000000000000000000000002")) + b"\x01\x01" + mac
    sol = bytes.fromhex("ff0200000000000000000001ff000002")
    ns = bytearray(ns)
    struct.pack_into("!H", ns, 2, checksum(ll + sol + struct.pack("!IxxxB", len(ns), 58) + bytes(ns)))
    ip6 = struct.pack("!IHBB16s16s", 6 << 28, len(ns), 58, 255, ll, sol) + bytes(ns)
    return {
        "arp": framed(arp),
        "dhcp": framed(dhcp_frame),
        "dns": framed(ip4(17, dnsq, dst=dns)),
        "tcp": framed(ip4(6, syn), ip4(6, ack)),
        "udp": framed(ip4(17, udp)),
        "icmp": framed(ip4(1, bytes(echo))),
        "frags": framed(ip4(17, body[:16], frag=0x2000, ident=9), ip4(17, body[16:], frag=2, ident=9)),
        "ndp": framed(b"\x33\x33\xff\x00\x00\x02" + mac + b"\x86\xdd" + ip6),
    }


def _instrument(atheris, obj, modname: str) -> None:
    """Instrument the functions and methods defined in module ``modname`` (for coverage feedback)."""
    import types

    if isinstance(obj, types.FunctionType) and obj.__module__ == modname:
        atheris.instrument_func(obj)
    elif isinstance(obj, type) and obj.__module__ == modname:
        for attr in list(vars(obj).values()):
            fn = getattr(attr, "__func__", attr)
            if isinstance(fn, property):
                for f in (fn.fget, fn.fset):
                    if isinstance(f, types.FunctionType):
                        atheris.instrument_func(f)
            elif isinstance(fn, types.FunctionType):
                atheris.instrument_func(fn)


def isolate() -> None:
    if os.environ.get("AIOSLIRP_TEST_ISOLATED") or os.environ.get("AIOSLIRP_TEST_NO_ISOLATE") == "1":
        return
    from aioslirp.host.isolate import isolate_network

    isolate_network()
    os.environ["AIOSLIRP_TEST_ISOLATED"] = "1"


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--seeds"]:
        out = pathlib.Path(argv[2])
        out.mkdir(parents=True, exist_ok=True)
        for name, data in seed_inputs().items():
            (out / f"seed-{name}").write_bytes(data)
        return 0
    isolate()
    import logging

    logging.disable(logging.CRITICAL)  # the stack logs hostile input at debug/warning: keep libFuzzer's output readable
    import atheris

    make_stack()  # imports every module the stack uses (isolate() already imported the package)
    import aioslirp

    pkg = os.path.dirname(aioslirp.__file__)
    for name, mod in list(sys.modules.items()):  # coverage feedback from aioslirp's code only
        if name.startswith("aioslirp") and getattr(mod, "__file__", "").startswith(pkg):
            for obj in list(vars(mod).values()):
                _instrument(atheris, obj, mod.__name__)
    atheris.Setup(argv, run_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
