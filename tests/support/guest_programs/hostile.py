"""Guest-side programs for tests/adversarial/test_hardening_ns.py; run inside `aioslirp run` (a real Linux namespace).

Usage: ``python hostile.py MODE JSON_ARGS``. Each mode prints one JSON line at the end.

* ``hostile``: from a raw AF_PACKET socket on the TAP, send hostile frames (truncated headers,
  lying lengths, zero-length TCP options, overlapping and overflowing fragments, long IPv6
  extension chains, DHCP option overruns, seeded random frames), a DNS query with a
  compression loop over a normal UDP socket, then download ``n`` bytes from the host.
  Reads the stack's counters before and after through the API socket.
* ``synflood``: ``count`` raw SYNs from distinct ports to the gateway's ``hole_port`` (a
  host listener that never accepts), then a download while they are pending.
* ``crr``: short connections in a loop, in phases the test drives over stdin/stdout.
* ``sigterm``: download a long stream slowly; report how the connection ended.
* ``policy``: connections to denied and allowed destinations; report each outcome.
* ``fragtcp``: a TCP connection played from the raw socket (the kernel's RSTs for it dropped by
  iptables), its first data segment sent as two IPv4 fragments, the rest plain; report what the
  host server counted and hashed, and the stack's counters.

Crafted destinations are the gateway (10.0.2.2, the host's loopback), the DNS address and
169.254.169.254 (refused by the stack's default policy, never sent anywhere).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

IFNAME = "tap0"
GW_MAC = bytes.fromhex("52550a000202")
GUEST = socket.inet_aton("10.0.2.15")
GW = socket.inet_aton("10.0.2.2")
DNS = socket.inet_aton("10.0.2.3")


def csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def my_mac() -> bytes:
    """The TAP's MAC (from a bound packet socket: /sys here still shows the host's namespace)."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        s.bind((IFNAME, 0))
        return s.getsockname()[4]
    finally:
        s.close()


def ipv4(proto: int, payload: bytes, *, dst: bytes = GW, ident: int = 1, frag: int = 0, total: int | None = None,
         ihl: int = 5, bad_sum: bool = False, src: bytes = GUEST) -> bytes:
    hdr = bytearray(struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, 20 + len(payload) if total is None else total,
                                ident, frag, 64, proto, 0, src, dst))
    struct.pack_into("!H", hdr, 10, csum(bytes(hdr)) ^ (0xFFFF if bad_sum else 0))
    return bytes(hdr) + payload


def l4sum(proto: int, seg: bytes, dst: bytes = GW) -> int:
    return csum(GUEST + dst + struct.pack("!BBH", 0, proto, len(seg)) + seg)


def tcp_seg(sport: int, dport: int, flags: int, *, seq: int = 1, opts: bytes = b"", doff: int | None = None,
            dst: bytes = GW, bad_sum: bool = False, payload: bytes = b"") -> bytes:
    off = (5 + len(opts) // 4) if doff is None else doff
    seg = bytearray(struct.pack("!HHIIBBHHH", sport, dport, seq, 0, off << 4, flags, 65535, 0, 0) + opts + payload)
    struct.pack_into("!H", seg, 16, l4sum(6, bytes(seg), dst) ^ (0x5555 if bad_sum else 0))
    return bytes(seg)


def udp_dgram(sport: int, dport: int, payload: bytes, *, dst: bytes = GW, ulen: int | None = None) -> bytes:
    d = bytearray(struct.pack("!HHHH", sport, dport, 8 + len(payload) if ulen is None else ulen, 0) + payload)
    if ulen is None:
        struct.pack_into("!H", d, 6, l4sum(17, bytes(d), dst) or 0xFFFF)
    return bytes(d)


def ipv6(nh: int, payload: bytes, *, plen: int | None = None) -> bytes:
    src = bytes.fromhex("fe800000000000000000000000000001")
    dst = bytes.fromhex("fd000000000000000000000000000002")
    return struct.pack("!IHBB16s16s", 6 << 28, len(payload) if plen is None else plen, nh, 64, src, dst) + payload


def api(path: str, execute: str, **arguments) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    req = {"execute": execute}
    if arguments:
        req["arguments"] = arguments
    s.sendall(json.dumps(req).encode())
    s.shutdown(socket.SHUT_WR)
    buf = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        buf += d
    s.close()
    return json.loads(buf)["return"]


def counters(path: str) -> dict:
    return api(path, "get_stats")["counters"]


def download(port: int, n: int, seed: int, host: str = "10.0.2.2", family=socket.AF_INET) -> tuple[int, str]:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect((host, port))
    s.sendall(b"DOWN %d %d\n" % (n, seed))
    h = hashlib.sha256()
    got = 0
    while True:
        d = s.recv(1 << 20)
        if not d:
            break
        h.update(d)
        got += len(d)
    s.close()
    return got, h.hexdigest()


# ------------------------------------------------------------------------------------ modes
def hostile(a: dict) -> dict:
    mac = my_mac()
    eth4 = GW_MAC + mac + b"\x08\x00"
    eth6 = GW_MAC + mac + b"\x86\xdd"
    frames: list = []  # (counter expected to grow by one -- or a tuple of them --, frame)
    good_syn = tcp_seg(40000, 9, 0x02)
    frames += [
        ("drop.truncated_ip", eth4 + b"\x45\x00\x00\x14\x00\x01"),
        ("drop.bad_ip_length", eth4 + ipv4(6, good_syn, total=1400)),  # total length lies (too long)
        ("drop.bad_ip_length", eth4 + ipv4(6, good_syn, ihl=15)),  # header length past the packet
        ("drop.bad_ip_header", eth4 + ipv4(6, good_syn, ihl=3)),
        ("drop.bad_ip_checksum", eth4 + ipv4(6, good_syn, bad_sum=True)),
        ("drop.truncated_tcp", eth4 + ipv4(6, good_syn[:12])),
        ("drop.bad_tcp_header", eth4 + ipv4(6, tcp_seg(40001, 9, 0x02, opts=b"\x08\x00\x00\x00"))),  # zero-length option
        ("drop.bad_tcp_header", eth4 + ipv4(6, tcp_seg(40002, 9, 0x02, doff=15))),  # data offset past the segment
        ("drop.bad_tcp_header", eth4 + ipv4(6, tcp_seg(40003, 9, 0x02, opts=b"\x01\x02\x04\x05"))),  # option runs out
        ("drop.bad_tcp_checksum", eth4 + ipv4(6, tcp_seg(40004, 9, 0x02, bad_sum=True))),
        ("drop.truncated_udp", eth4 + ipv4(17, b"\x00\x35\x00")),
        ("drop.bad_udp_length", eth4 + ipv4(17, udp_dgram(40005, 9, b"abcd", ulen=900))),
        ("drop.bad_udp_length", eth4 + ipv4(17, udp_dgram(40006, 9, b"abcd", ulen=3))),
        ("drop.truncated_icmp", eth4 + ipv4(1, b"\x08\x00\x00")),
        ("drop.bad_icmp_checksum", eth4 + ipv4(1, b"\x08\x00\x12\x34\x00\x01\x00\x01")),
        ("drop.bad_arp", GW_MAC + mac + b"\x08\x06" + b"\x00\x01\x08\x00\x06"),
        ("drop.unknown_ip_proto", eth4 + ipv4(99, b"\x00" * 8)),
        ("drop.bad_src_ip", eth4 + ipv4(6, good_syn, src=socket.inet_aton("192.0.2.1"))),
    ]
    # fragments: overlapping (the second invalidates the datagram), overflowing 64 KiB, inconsistent ends
    body = udp_dgram(40010, 9, b"F" * 40)
    # (every fragment that does not complete a datagram also counts in ip_fragments, held or dropped)
    frags = [
        ("ip_fragments", eth4 + ipv4(17, body[:24], ident=0x111, frag=0x2000)),
        ("drop.frag_overlap", eth4 + ipv4(17, body[8:32], ident=0x111, frag=0x2000 | 1)),
        ("drop.frag_bad_length", eth4 + ipv4(17, b"X" * 32, ident=0x222, frag=0x1FFC)),  # offset 65504 + 32
        ("drop.frag_bad_length", eth4 + ipv4(17, b"X" * 13, ident=0x333, frag=0x2000)),  # MF with 13 bytes
        ("ip_fragments", eth4 + ipv4(17, body[:16], ident=0x444, frag=1)),  # last fragment, ends at 24
        ("drop.frag_inconsistent", eth4 + ipv4(17, body[:24], ident=0x444, frag=2)),  # a different end
    ]
    frames += [(k if k == "ip_fragments" else (k, "ip_fragments"), f) for k, f in frags]
    # IPv6: long extension-header chains, hop-by-hop not first, lying payload length, bad version
    dest_opt = lambda nh: bytes((nh, 0)) + b"\x01\x04\x00\x00\x00\x00"  # noqa: E731 (PadN)
    chain = b""
    nh = 59
    for _ in range(12):
        chain = dest_opt(nh) + chain
        nh = 60
    frames += [
        ("drop.ipv6_ext_too_many", eth6 + ipv6(60, chain)),
        ("drop.ipv6_hbh_not_first", eth6 + ipv6(60, dest_opt(0) + dest_opt(59))),
        ("drop.ipv6_bad_length", eth6 + ipv6(59, b"\x00" * 8, plen=900)),
        ("drop.ipv6_ext_truncated", eth6 + ipv6(60, b"\x3b\x05\x00\x00")),
        ("drop.ipv6_truncated", eth6 + b"\x60\x00\x00"),
    ]
    # DHCP option overrun: a DISCOVER whose last option claims more bytes than follow
    dhcp = struct.pack("!BBBBIHH4s4s4s4s16s64s128s", 1, 1, 6, 0, 0x1234, 0, 0x8000, bytes(4), bytes(4), bytes(4),
                       bytes(4), mac + bytes(10), bytes(64), bytes(128))
    dhcp += b"\x63\x82\x53\x63" + b"\x35\x01\x01" + b"\x0c\xc8abc"
    dgram = bytearray(struct.pack("!HHHH", 68, 67, 8 + len(dhcp), 0) + dhcp)
    hdr = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(dgram), 9, 0, 64, 17, 0, bytes(4), b"\xff" * 4))
    struct.pack_into("!H", hdr, 10, csum(bytes(hdr)))
    frames.append(("dhcp_ignored", b"\xff" * 6 + mac + b"\x08\x00" + bytes(hdr) + bytes(dgram)))
    # seeded random frames: one drop each (random IPv4/IPv6/ARP bodies, unknown EtherTypes)
    rnd = random.Random(a.get("seed", 1234))
    n_random = a.get("random", 300)
    random_frames = []
    for i in range(n_random):
        kind = i % 4
        body = rnd.randbytes(rnd.randrange(0, 200))
        if kind == 0:
            random_frames.append(eth4 + body)
        elif kind == 1:
            random_frames.append(eth6 + body)
        elif kind == 2:
            random_frames.append(GW_MAC + mac + b"\x08\x06" + body[:20])
        else:
            random_frames.append(GW_MAC + mac + struct.pack("!H", rnd.choice([0x88CC, 0x8100, 0x0842, 0x9000, 0x1234]))
                                 + body)

    path = a["api"]
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    raw.bind((IFNAME, 0))
    time.sleep(0.3)  # let the kernel's own start-up traffic (RS, MLD) pass
    def delta(after: dict, before: dict) -> dict:
        return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
                if after.get(k, 0) != before.get(k, 0)}

    c0 = counters(path)
    for _, f in frames:
        raw.send(f)
    time.sleep(0.2)
    c1 = counters(path)
    for f in random_frames:
        raw.send(f)
    time.sleep(0.2)
    c2 = counters(path)
    raw.close()
    # DNS with a compression loop (the question's name points at itself), over a normal socket
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(5)
    u.sendto(struct.pack("!HHHHHH", 0xBEEF, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01", ("10.0.2.3", 53))
    reply = u.recv(512)
    u.close()
    got, sha = download(a["port"], a["n"], a["seed"])
    return {"crafted": delta(c1, c0), "random_delta": delta(c2, c1), "expected": [n for k, _ in frames for n in ((k,) if isinstance(k, str) else k)],
            "crafted_frames": len(frames),
            "random": n_random, "dns_rcode": reply[3] & 0x0F, "dns_id": reply[0] << 8 | reply[1], "got": got, "sha": sha}


def synflood(a: dict) -> dict:
    mac = my_mac()
    eth4 = GW_MAC + mac + b"\x08\x00"
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    raw.bind((IFNAME, 0))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    rnd = random.Random(7)
    count, port = a["count"], a["hole_port"]
    print(json.dumps({"phase": "ready"}), flush=True)
    sys.stdin.readline()  # the test has its baseline
    t0 = time.monotonic()
    for i in range(count):
        sport = 10000 + i % 50000
        raw.send(eth4 + ipv4(6, tcp_seg(sport, port, 0x02, seq=rnd.getrandbits(32), opts=b"\x02\x04\x05\xb4"),
                            ident=i & 0xFFFF))
        if i % 64 == 63:
            time.sleep(a.get("pause", 0.002))  # about the rate the stack drains its TAP
    sent_s = time.monotonic() - t0
    print(json.dumps({"phase": "flooded", "sent_s": sent_s}), flush=True)
    sys.stdin.readline()  # the test has measured the peak
    got, sha = download(a["port"], a["n"], a["seed"])  # other destinations keep working meanwhile
    stats = api(a["api"], "get_stats")
    raw.close()
    return {"got": got, "sha": sha, "counters": stats["counters"], "flows": stats["flows"], "sent_s": sent_s}


def crr(a: dict) -> dict:
    port = a["port"]

    def one(i: int) -> None:
        s = socket.create_connection(("10.0.2.2", port), timeout=10)
        s.sendall(b"DOWN 64 %d\n" % (i & 0xFF))
        n = 0
        while True:
            d = s.recv(4096)
            if not d:
                break
            n += len(d)
        s.close()
        assert n == 64, n

    for i in range(a["warm"]):
        one(i)
    print(json.dumps({"phase": "warm"}), flush=True)
    sys.stdin.readline()
    took = 0.0
    for _ in range(a.get("rounds", 1)):
        t0 = time.monotonic()
        for i in range(a["count"]):
            one(i)
        took = time.monotonic() - t0
        print(json.dumps({"phase": "done", "took": took}), flush=True)
        sys.stdin.readline()
    return {"count": a["count"], "took": took}


def sigterm(a: dict) -> dict:
    terms = []
    if a.get("ignore_term"):
        signal.signal(signal.SIGTERM, lambda *_: terms.append(time.monotonic()))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)  # little buffered data to read after a RST
    s.settimeout(30)
    s.connect(("10.0.2.2", a["port"]))
    s.sendall(b"DOWN %d 1\n" % a["n"])
    got = 0
    ended = "eof"
    announced = False
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            got += len(d)
            if not announced and got >= 1 << 20:
                announced = True
                print(json.dumps({"phase": "started", "netns": os.stat("/proc/self/ns/net").st_ino}), flush=True)
            if announced:
                time.sleep(0.01)  # a slow reader: the transfer is still running when SIGTERM comes
    except ConnectionResetError:
        ended = "reset"
    except OSError as exc:
        ended = errno.errorcode.get(exc.errno, str(exc.errno))
    return {"got": got, "ended": ended, "sigterm_seen": bool(terms), "after_term_s": time.monotonic() - terms[0]
            if terms else None}


def retrans_segs() -> int:
    """The guest kernel's Tcp RetransSegs (/proc/net/snmp): how many segments it sent again."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def policy(a: dict) -> dict:
    out = {}

    def tcp(name: str, family, addr) -> None:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(5)
        t0 = time.monotonic()
        r0 = retrans_segs()
        try:
            s.connect(addr)
            s.sendall(b"DOWN 1000 3\n")
            n = 0
            while True:
                d = s.recv(4096)
                if not d:
                    break
                n += len(d)
            out[name] = {"ok": n, "s": time.monotonic() - t0}
        except OSError as exc:
            out[name] = {"errno": errno.errorcode.get(exc.errno, str(exc.errno)), "s": time.monotonic() - t0,
                         "syn_retries": retrans_segs() - r0}
        finally:
            s.close()

    def udp(name: str, family, addr) -> None:
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.settimeout(3)
        t0 = time.monotonic()
        try:
            s.connect(addr)
            s.send(b"ping")
            out[name] = {"ok": s.recv(100).decode(), "s": time.monotonic() - t0}
        except OSError as exc:
            out[name] = {"errno": errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "timeout",
                         "s": time.monotonic() - t0}
        finally:
            s.close()

    def ping(name: str, dst: str) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        msg = bytearray(struct.pack("!BBHHH", 8, 0, 0, 0x4242, 1) + b"policy")
        struct.pack_into("!H", msg, 2, csum(bytes(msg)))
        s.sendto(bytes(msg), (dst, 0))
        deadline = time.monotonic() + 3
        res = {"answer": None}
        while time.monotonic() < deadline:
            r, _, _ = select.select([s], [], [], deadline - time.monotonic())
            if not r:
                break
            data = s.recv(2000)
            ihl = (data[0] & 0x0F) * 4
            t, code = data[ihl], data[ihl + 1]
            if t == 0 and data[12:16] == socket.inet_aton(dst):
                res = {"answer": "echo_reply"}
                break
            if t == 3:
                res = {"answer": "unreachable", "code": code}
                break
        s.close()
        out[name] = res

    tcp("tcp_metadata", socket.AF_INET, ("169.254.169.254", 80))
    udp("udp_metadata", socket.AF_INET, ("169.254.169.254", 53))
    ping("ping_metadata", "169.254.169.254")
    tcp("tcp_gw4_allowed", socket.AF_INET, ("10.0.2.2", a["port4"]))
    tcp("tcp_gw6_denied", socket.AF_INET6, ("fd00::2", a["port6"]))
    udp("udp_gw6_denied", socket.AF_INET6, ("fd00::2", a["udp6"]))
    udp("udp_gw4_allowed", socket.AF_INET, ("10.0.2.2", a["udp4"]))
    out["counters"] = {k: v for k, v in counters(a["api"]).items() if k.startswith("drop.")}
    return out


def fragtcp(a: dict) -> dict:
    """``UP`` to the data server over a TCP flow this program plays itself from the raw socket:
    the handshake, a first segment carried by two IPv4 fragments (reassembled by the stack, then
    handed to the flow wherever it runs), a plain second segment, FIN; the server's answer is read
    and acknowledged from the raw socket too."""
    import subprocess

    port, sport, body = a["port"], 47000 + random.Random().randrange(1000), pattern_bytes(a["n"])
    rule = ["OUTPUT", "-p", "tcp", "--sport", str(sport), "--tcp-flags", "RST", "RST", "-j", "DROP"]
    subprocess.run(["iptables", "-A", *rule], check=True)  # the kernel knows nothing of this flow
    mac = my_mac()
    eth4 = GW_MAC + mac + b"\x08\x00"
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    raw.bind((IFNAME, 0))
    raw.settimeout(5)
    iss = 1000

    def seg(flags: int, seq: int, ack: int, payload: bytes = b"", opts: bytes = b"") -> bytes:
        s_ = bytearray(struct.pack("!HHIIBBHHH", sport, port, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF,
                                   (5 + len(opts) // 4) << 4, flags, 65535, 0, 0) + opts + payload)
        struct.pack_into("!H", s_, 16, l4sum(6, bytes(s_)))
        return bytes(s_)

    def frames_from_flow(until: float):
        while time.monotonic() < until:
            try:
                f = raw.recv(70000)
            except socket.timeout:
                return
            if len(f) < 54 or f[12:14] != b"\x08\x00" or f[23] != 6:
                continue
            ihl = (f[14] & 0x0F) * 4
            t = f[14 + ihl:]
            if struct.unpack("!HH", t[:4]) != (port, sport):
                continue
            yield t

    raw.send(eth4 + ipv4(6, seg(0x02, iss, 0, opts=b"\x02\x04\x05\xb4")))
    synack = next(t for t in frames_from_flow(time.monotonic() + 5) if t[13] & 0x12 == 0x12)
    irs = struct.unpack("!I", synack[4:8])[0]
    rcv_nxt = irs + 1
    raw.send(eth4 + ipv4(6, seg(0x10, iss + 1, rcv_nxt)))
    data = b"UP\n" + body
    first, rest = data[:1400], data[1400:]
    whole = ipv4(6, seg(0x18, iss + 1, rcv_nxt, first), ident=4242)
    ip_payload = whole[20:]
    cut = 16 * 50  # 800 bytes of the segment in the first fragment (a multiple of 8)
    frag1 = ipv4(6, ip_payload[:cut], ident=4242, frag=0x2000)  # MF, offset 0
    frag2 = ipv4(6, ip_payload[cut:], ident=4242, frag=cut // 8)
    raw.send(eth4 + frag2)  # the second half first: reassembly, not order of arrival
    raw.send(eth4 + frag1)
    seq = iss + 1 + len(first)
    # its ACK before the rest (frames after it in the same read would reach a native flow before the
    # reassembled segment does: dropped as out of order, for a real guest to send again)
    first_acked = any(struct.unpack("!I", t[8:12])[0] == seq for t in frames_from_flow(time.monotonic() + 5))
    for i in range(0, len(rest), 1400):
        raw.send(eth4 + ipv4(6, seg(0x18, seq, rcv_nxt, rest[i:i + 1400]), ident=5000 + i))
        seq += len(rest[i:i + 1400])
    raw.send(eth4 + ipv4(6, seg(0x11, seq, rcv_nxt), ident=4999))  # FIN
    answer = b""
    acked_fin = False
    end = time.monotonic() + 10
    for t in frames_from_flow(end):
        doff = (t[12] >> 4) * 4
        tseq = struct.unpack("!I", t[4:8])[0]
        acked_fin = acked_fin or struct.unpack("!I", t[8:12])[0] == (seq + 1) & 0xFFFFFFFF
        payload = t[doff:]
        if payload and tseq == rcv_nxt & 0xFFFFFFFF:
            answer += payload
            rcv_nxt += len(payload)
        if t[13] & 0x01 and tseq + len(payload) == rcv_nxt & 0xFFFFFFFF:
            rcv_nxt += 1
        raw.send(eth4 + ipv4(6, seg(0x10, seq + 1, rcv_nxt)))
        if t[13] & 0x05:  # FIN or RST: done
            break
    raw.close()
    subprocess.run(["iptables", "-D", *rule], check=True)
    return {"answer": answer.decode(errors="replace").strip(), "want": f"{len(body)} {hashlib.sha256(body).hexdigest()}",
            "first_acked": first_acked, "acked_fin": acked_fin, "counters": counters(a["api"])}


def pattern_bytes(n: int) -> bytes:
    return bytes((i * 7 + 3) & 0xFF for i in range(n))


if __name__ == "__main__":
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"result": globals()[mode](args)}), flush=True)
