"""The native plane's UDP flow table (``Plane.udp_*``, dp_udp_* in aioslirp/native/dataplane.c),
driven directly with real sockets: adoption and its bounds, the guest direction inside the TAP
reader (what it moves, what it leaves to Python), the host direction (frames as the Python path
builds them, with and without the virtio-net header), and the errors it reports."""

from __future__ import annotations

import collections
import errno
import os
import socket
import struct

import pytest

from aioslirp.wire.checksum import checksum
from aioslirp.wire.ethernet import ETH, ETHERTYPE_IPV4
from aioslirp.wire.ipv4 import fragment
from aioslirp.wire.udp import build_udp

from support.native import need_extension

GUEST_MAC, GW_MAC = bytes.fromhex("525400123456"), bytes.fromhex("52550a000202")
GUEST, GW = bytes([10, 0, 2, 15]), bytes([10, 0, 2, 2])
ETH_TO_GUEST = ETH.pack(GUEST_MAC, GW_MAC, ETHERTYPE_IPV4)


@pytest.fixture
def world():
    """A plane with UDP on; a TAP stand-in (SEQPACKET pair: ``tap`` the plane's end, ``guest``
    the guest's); a host socket connected to a loopback ``server``."""
    ext = need_extension()
    plane = ext.Plane(2048, 16, False)
    plane.udp_enable(4)
    tap, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tap.setblocking(False)
    guest.setblocking(False)
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    host = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    host.connect(server.getsockname())
    host.setblocking(False)
    yield plane, tap, guest, host, server
    for s in (tap, guest, host, server):
        s.close()


def _adopt(plane, host, gport=40000, rport=5353, mtu=1500) -> int:
    return plane.udp_adopt(host.fileno(), GUEST, gport, GW, rport, ETH_TO_GUEST, 64, mtu, 1.0)


def guest_frame(payload: bytes, sport=40000, dport=5353, src_mac=GUEST_MAC) -> bytes:
    pkt = build_udp(GUEST, GW, sport, dport, payload)
    return ETH.pack(GW_MAC, src_mac, ETHERTYPE_IPV4) + bytes(pkt)


def test_adoption_bounds_duplicates_and_release(world):
    plane, _tap, _guest, host, _server = world
    slots = [_adopt(plane, host, gport=40000 + i) for i in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert _adopt(plane, host, gport=50000) == -1  # full
    plane.udp_release(slots[1])
    assert _adopt(plane, host, gport=40000) == -1  # that 5-tuple is there already
    assert _adopt(plane, host, gport=50000) == slots[1]  # the freed slot again
    with pytest.raises(ValueError, match="no native UDP flow"):
        plane.udp_release(7)
    with pytest.raises(ValueError, match="mtu 576"):
        plane.udp_adopt(host.fileno(), GUEST, 1, GW, 2, ETH_TO_GUEST, 64, 575, 1.0)
    with pytest.raises(ValueError, match="once"):
        plane.udp_enable(4)


def test_the_reader_moves_an_adopted_flows_datagrams_and_leaves_the_rest(world):
    plane, tap, guest, host, server = world
    slot = _adopt(plane, host)
    frames = [guest_frame(b"one"), guest_frame(b"two"), guest_frame(b"other port", sport=40001),
              guest_frame(b"other mac", src_mac=bytes.fromhex("525400999999"))]
    bad = bytearray(guest_frame(b"bad sum"))
    bad[40] ^= 0xFF
    frames.append(bytes(bad))
    for f in frames:
        guest.send(f)
    delivered, _csum, _end, _err, taken = plane.read_tap(tap.fileno(), 5.5)
    assert taken == 2 and delivered == frames[2:]  # another flow, another MAC, a bad checksum: Python's
    assert [server.recv(100), server.recv(100)] == [b"one", b"two"]
    got_frames, got_bytes, touched = plane.udp_touched()
    assert (got_frames, got_bytes) == (2, len(frames[0]) + len(frames[1]))
    assert touched == [(slot, 2, 6, 0, 0, 5.5, 0)]  # ..., bytes_down 0
    assert plane.udp_touched() == (0, 0, [])  # taken once
    assert plane.udp_last_header(slot) == frames[1][14:14 + 28]  # the IP header + 8 of the last one


def _sink(plane, fd: int, vnet: bool = False) -> tuple[collections.Counter, list]:
    """udp_sink() with fresh counters and an error list: what udp_readable() reports."""
    counters: collections.Counter = collections.Counter()
    errors: list = []
    plane.udp_sink(fd, vnet, counters, lambda slot, err: errors.append((slot, err)))
    return counters, errors


@pytest.mark.parametrize("vnet", [False, True])
def test_host_datagrams_become_the_python_paths_frames(world, vnet):
    plane, tap, guest, host, server = world
    slot = _adopt(plane, host, mtu=1500)
    counters, errors = _sink(plane, tap.fileno(), vnet)
    client = host.getsockname()
    payloads = [b"short", os.urandom(3000)]
    for p in payloads:
        server.sendto(p, client)
    plane.udp_readable(slot)
    assert errors == [] and counters["udp_datagrams_down"] == 2 and counters["frames_out"] == 1 + 3
    assert plane.udp_touched()[2][0][6] == 5 + 3000  # the flow's bytes_down
    got = [guest.recv(70000) for _ in range(counters["frames_out"])]
    if vnet:
        assert all(g[:12] == bytes(12) for g in got)
        got = [g[12:] for g in got]
    assert counters["bytes_out"] == sum(map(len, got))
    want = []
    for p, first in zip(payloads, (got[0], got[1])):
        ident = struct.unpack_from("!H", first, 18)[0]  # the plane's own identification
        pkt = bytearray(build_udp(GW, GUEST, 5353, 40000, p))
        struct.pack_into("!HHHH", pkt, 4, ident, 0, struct.unpack_from("!H", pkt, 8)[0], 0)
        struct.pack_into("!H", pkt, 10, checksum(bytes(pkt[:20])))
        want += [ETH_TO_GUEST + bytes(f) for f in fragment(pkt, 1500)]
    assert got == want


def test_host_errors_and_tap_write_errors_are_reported(world):
    plane, tap, guest, host, server = world
    slot = _adopt(plane, host)
    closed = os.dup(tap.fileno())
    os.close(closed)
    counters, errors = _sink(plane, closed)
    server.sendto(b"x", host.getsockname())
    plane.udp_readable(slot)
    assert counters == {"udp_datagrams_down": 1, "native.tap_write_errors": 1} and errors == []  # counted
    counters, errors = _sink(plane, tap.fileno())
    server.close()  # nothing listens: the next send draws ECONNREFUSED
    host.send(b"probe")
    for _ in range(100):
        plane.udp_readable(slot)
        if errors:
            break
    assert errors == [(slot, errno.ECONNREFUSED)] and counters["udp_datagrams_down"] == 0  # an ICMP error next


def test_the_c_reader_counts_in_the_stacks_counters_and_reports_the_flow_later(world):
    """udp_readable(slot), the loop's reader of the host socket: the frames go to the guest, the
    stack's counters move at once, the flow's bytes and activity wait for udp_touched()."""
    import time

    plane, tap, guest, host, server = world
    slot = _adopt(plane, host, mtu=1500)
    with pytest.raises(ValueError, match="udp_sink"):
        plane.udp_readable(slot)
    counters, errors = _sink(plane, tap.fileno())
    server.sendto(b"a" * 10, host.getsockname())
    server.sendto(b"b" * 3000, host.getsockname())
    before = time.monotonic()
    assert plane.udp_readable(slot) is None
    got = [guest.recv(70000) for _ in range(4)]  # 10 bytes in one frame, 3,000 in three at MTU 1500
    assert counters == {"udp_datagrams_down": 2, "frames_out": 4, "bytes_out": sum(map(len, got))}
    _f, _b, touched = plane.udp_touched()
    ((s, dgrams, up, blocked, err, last_active, down),) = touched
    assert (s, dgrams, up, blocked, err, down) == (slot, 0, 0, 0, 0, 3010)
    assert before <= last_active <= time.monotonic()  # the plane's clock: CLOCK_MONOTONIC
    assert plane.udp_touched() == (0, 0, []) and errors == []  # errors: test_host_errors_...
    with pytest.raises(ValueError, match="no native UDP flow"):
        plane.udp_readable(slot + 1)


def test_the_loop_reader_counts_taken_frames_in_c_and_calls_python_only_for_a_failed_send(world):
    """Plane.ready with a udp_sink(): the frames native flows took are counted in the stack's
    counters by C (frames_in, bytes_in, handled.udp: one outcome per frame) and no Python runs; a
    guest datagram whose send fails (the remote's port closed: ECONNREFUSED) calls taken(n) at
    once, for the ICMP error to the guest."""
    import time

    plane, tap, guest, host, server = world
    slot = _adopt(plane, host)
    counters, _errors = _sink(plane, tap.fileno())
    calls: list = []

    def ready() -> None:
        plane.ready(tap.fileno(), time.monotonic, lambda *a: calls.append(("deliver", a[0])),
                    lambda n: calls.append(("taken", n)), None)

    frames = [guest_frame(b"one"), guest_frame(b"two")]
    for f in frames:
        guest.send(f)
    ready()
    assert [server.recv(100), server.recv(100)] == [b"one", b"two"]
    assert counters == {"frames_in": 2, "bytes_in": len(frames[0]) + len(frames[1]), "handled.udp": 2}
    assert calls == []  # all native, nothing wrong: no Python frame ran
    assert plane.udp_touched()[:2] == (0, 0)  # counted once, by C
    server.close()
    for i in range(50):  # the first send draws the ICMP error; a later one returns it
        guest.send(guest_frame(b"probe %d" % i))
        ready()
        if calls:
            break
        time.sleep(0.01)
    assert calls and calls[0][0] == "taken"
    (entry,) = plane.udp_touched()[2]
    assert entry[0] == slot and entry[4] == errno.ECONNREFUSED


def test_a_plane_in_a_reference_cycle_through_its_sink_is_collected():
    """NativeUdp holds its plane and gives the plane its own bound method as on_error: a cycle
    through a C object, which the cycle collector must see (Plane's tp_traverse): without it every
    stack served natively leaked (about 0.75 MB a spawn())."""
    import gc
    import weakref

    ext = need_extension()

    class Owner:
        def on_error(self, slot, err):
            pass

    owner = Owner()
    owner.plane = ext.Plane(2048, 4, False)
    owner.plane.udp_enable(4)
    owner.plane.udp_sink(-1, False, {}, owner.on_error)
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None


def test_the_loop_reader_calls_its_after_hook_once_per_batch(world):
    """Plane.after(hook): hook() at the end of every ready() batch (frames for Python, frames a
    native flow took, or none: a spurious wake-up), after the deliver callback; None stops it; a
    hook that raises propagates (the loop logs it); anything but a callable or None: TypeError."""
    import time

    plane, tap, guest, host, server = world
    _adopt(plane, host)
    order: list = []

    def ready() -> None:
        plane.ready(tap.fileno(), time.monotonic, lambda *a: order.append(("deliver", len(a[0]))), None, None)

    plane.after(lambda: order.append("after"))
    guest.send(guest_frame(b"taken"))  # a native flow's: no Python frame but the hook
    ready()
    assert server.recv(100) == b"taken" and order == ["after"]
    guest.send(guest_frame(b"other", dport=9))  # no flow: for Python, then the hook
    ready()
    assert order == ["after", ("deliver", 1), "after"]
    ready()  # nothing to read: still a batch's end
    assert order[-1] == "after" and len(order) == 4
    plane.after(None)
    ready()
    assert len(order) == 4

    def fail() -> None:
        raise RuntimeError("hook")

    plane.after(fail)
    with pytest.raises(RuntimeError, match="hook"):
        ready()
    with pytest.raises(TypeError, match="callable or None"):
        plane.after(5)
