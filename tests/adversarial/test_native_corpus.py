"""The libslirp fuzzing corpus through the native frame classifier (aioslirp/native/dataplane.c).

Every frame, as captured and with its checksums fixed, bare and behind a virtio-net header (both
checksum flags), whole and cut at every length up to its end: the C record agrees with the
Python parsers (``support.native.check``) and never points outside the buffer. The sanitizer
test (test_native_sanitized.py) runs this under ASan/UBSan.
"""

from __future__ import annotations

import struct

from support.corpus import CORPUS, corpus_frames, fix_checksums, fix_checksums6
from support.native import check, need_extension
from support.prereqs import need


def test_corpus_frames_and_every_cut_of_them_classify_as_the_python_parsers_do():
    need_extension()
    need(CORPUS.is_dir(), f"the shared corpus is not at {CORPUS}")
    frames = corpus_frames()
    assert len(frames) > 50
    kinds: dict[str, int] = {}
    seen = set()
    for _name, raw in frames:
        for buf in (raw, fix_checksums(raw), fix_checksums6(raw)):
            if buf in seen:
                continue
            seen.add(buf)
            for vnet_flags in (None, 0, 1):
                data = buf if vnet_flags is None else struct.pack("=BBHHHHH", vnet_flags, 0, 0, 0, 0, 0, 0) + buf
                rec = check(data, vnet_flags is not None)
                kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
                for cut in range(len(data)):
                    rec = check(data[:cut], vnet_flags is not None)
                    kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
    # the corpus and its cuts reach every class: NAT candidates, the Python path, the length drops
    for kind in ("tcp", "udp", "not_native:arp", "not_native:icmp", "drop:truncated_eth", "drop:truncated_ip",
                 "drop:bad_ip_length", "drop:ipv6_truncated", "drop:ipv6_bad_length", "drop:truncated_vnet"):
        assert kinds.get(kind, 0), (kind, kinds)
