"""The libslirp fuzzing corpus (``../shared/corpus/libslirp-fuzz``) as guest frames, for the replays
(tests/adversarial/test_corpus_replay.py through the stack, test_native_corpus.py through the
native classifier): :func:`corpus_frames`, and the checksum fix-ups the corpus README asks for
(:func:`fix_checksums`, :func:`fix_checksums6`)."""

from __future__ import annotations

import dpkt

from .paths import SHARED

CORPUS = SHARED / "corpus" / "libslirp-fuzz"


def corpus_frames() -> list[tuple[str, bytes]]:
    """``(file name, Ethernet frame)`` for every frame of the corpus (.pkt files and Ethernet pcaps)."""
    out = []
    for path in sorted(CORPUS.glob("IN_*/*")):
        data = path.read_bytes()
        if path.suffix == ".pkt":
            out.append((path.name, data))
            continue
        try:
            reader = dpkt.pcap.Reader(open(path, "rb"))
        except Exception:
            continue
        if reader.datalink() != dpkt.pcap.DLT_EN10MB:
            continue
        for _ts, buf in reader:
            out.append((path.name, buf))
    return out


def fix_checksums(buf: bytes) -> bytes:
    """Recompute IPv4 header and L4 checksums (dpkt does it when sum fields are zeroed)."""
    try:
        eth = dpkt.ethernet.Ethernet(buf)
    except Exception:
        return buf
    ip = eth.data
    if isinstance(ip, dpkt.ip.IP):
        ip.sum = 0
        if isinstance(ip.data, (dpkt.tcp.TCP, dpkt.udp.UDP, dpkt.icmp.ICMP)):
            ip.data.sum = 0
        ip.len = 0
        return bytes(eth)
    return buf


def fix_checksums6(buf: bytes) -> bytes:
    """Recompute the TCP/UDP/ICMPv6 checksum of an IPv6 frame (dpkt does it when the sum is zeroed)."""
    try:
        eth = dpkt.ethernet.Ethernet(buf)
    except Exception:
        return buf
    ip = eth.data
    if isinstance(ip, dpkt.ip6.IP6) and isinstance(ip.data, (dpkt.tcp.TCP, dpkt.udp.UDP, dpkt.icmp6.ICMP6)):
        ip.data.sum = 0
        return bytes(eth)
    return buf
