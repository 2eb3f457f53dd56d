"""Rate caps (``--rate-limit up=RATE,down=RATE``, ``NetworkConfig(rate_up=, rate_down=)``).

* sans-IO: :class:`~aioslirp.ratelimit.ByteBucket` and the TCP pacing steps
  (:class:`~aioslirp.nat.pacing.FlowPacing`) on a fake clock;
* parsing: rates with units, one-line errors naming the field;
* in-process: UDP datagrams over the cap are dropped and counted, each way;
* real guest under ``aioslirp run``: TCP at the cap within +-10% both ways, every byte
  delivered (SHA-256 checked); the same cap measured by iperf3 (``-R`` for down) against an
  ``iperf3 -s -1`` on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import socket
import subprocess
import time

import pytest

from aioslirp import NetworkConfig
from aioslirp.config.rates import parse_rate, parse_rate_limit
from aioslirp.errors import ConfigError
from aioslirp.nat.pacing import RATE_MIN_WRITE, FlowPacing
from aioslirp.ratelimit import MIN_BYTE_BURST, ByteBucket, byte_burst

from support.frames import F4, udp_frame
from support.guests import PACED_GUEST, need_tool, run_guest
from support.servers import DataServer, DnsUpstream, UdpEcho, pattern
from support.stacks import recv_frames, served_stack


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize("text, rate", [
    ("10mbit", 1_250_000), ("2MB", 2_000_000), ("500kbit", 62_500), ("1000", 1000), ("64KiB", 65536),
    ("1gbit", 125_000_000), ("3 MiB/s", 3 << 20), (12345, 12345), (2.5, 2.5),
])
def test_parse_rate(text, rate):
    assert parse_rate(text, "rate_up") == rate


@pytest.mark.parametrize("text", ["", "fast", "10 parsecs", "0", "-5MB", "nan", "inf", "1e999kbit"])
def test_bad_rates_name_the_field(text):
    with pytest.raises(ConfigError) as ei:
        NetworkConfig(rate_down=text).validate()
    assert str(ei.value).startswith("rate_down: ") and "\n" not in str(ei.value)


def test_parse_rate_limit_option():
    assert parse_rate_limit("up=10mbit,down=2MB") == {"rate_up": 1_250_000, "rate_down": 2_000_000}
    assert parse_rate_limit("down=1MB") == {"rate_down": 1_000_000}
    for bad, field in (("up", "--rate-limit"), ("left=1MB", "--rate-limit"), ("up=x", "--rate-limit up"), ("", "--rate-limit")):
        with pytest.raises(ConfigError) as ei:
            parse_rate_limit(bad)
        assert ei.value.field == field


def test_config_takes_units():
    cfg = NetworkConfig(rate_up="8mbit", rate_down=None).validate()
    assert (cfg.rate_up, cfg.rate_down) == (1_000_000, None)


# ------------------------------------------------------------------ sans-IO
def test_byte_bucket_take_is_all_or_nothing():
    b = ByteBucket(1000, burst=3000)
    assert b.take(3000, 0.0) and not b.take(1, 0.0)
    assert not b.take(600, 0.5)  # 500 refilled
    assert b.take(500, 0.5) and b.tokens == 0
    assert b.take(3000, 100.0) and not b.take(1, 100.0)  # the refill stops at the burst


def test_byte_bucket_never_refills_an_interval_twice_when_a_time_comes_late():
    """A stream reads the clock for the cut, then spends at its batch's (older) time: the stamp
    stays at the newest time, so the interval between the two is refilled once, not twice."""
    b = ByteBucket(1000, burst=1000)
    assert b.available(10.0) == 1000
    b.spend(1000, 10.0)
    assert b.available(10.5) == 500
    b.spend(500, 10.2)  # an older time: charged, no refill, the stamp stays at 10.5
    assert b.stamp == 10.5 and b.tokens == 0
    assert b.available(11.0) == 500  # 0.5 s since 10.5, not 0.8 s since 10.2
    total = 0  # a paced stream with late times, over 10 s: rate * t + burst, no more
    t = 11.0
    for _ in range(1000):
        t += 0.01
        room = b.available(t)
        if room > 0:
            b.spend(room, t - 0.005)
            total += room
    assert total <= 1000 * 10 + 1000 + 1e-6, total


def test_byte_bucket_spend_and_wait_pay_back_a_debt():
    b = ByteBucket(1000, burst=1000)
    b.spend(5000, 0.0)  # a stream moved 5000 bytes on a 1000-byte bucket: 4000 in debt
    assert b.wait(0.0) == pytest.approx(4.001)
    assert b.wait(4.0) > 0 and b.wait(4.01) == 0.0


def test_burst_is_64k_or_10ms():
    assert byte_burst(1_000_000) == MIN_BYTE_BURST
    assert byte_burst(100_000_000) == 1_000_000
    assert ByteBucket(100).burst == MIN_BYTE_BURST


def test_paced_stream_holds_the_rate_and_bounds_bursts():
    """The down path: read at most max(4096, tokens), spend it, hold off while in debt."""
    rate, now, moved = 2_500_000.0, 0.0, []
    b = ByteBucket(rate)
    while now < 10.0:
        wait = b.wait(now)
        if wait > 0:
            now += wait
            continue
        n = min(256 * 1024, max(4096, int(b.available(now))))
        b.spend(n, now)
        moved.append((now, n))
        now += 0.0001  # the next read
    total = sum(n for _t, n in moved)
    assert total / 10.0 == pytest.approx(rate, rel=0.02)
    for t0 in (0.0, 1.0, 5.0):  # any 100 ms: at most burst + one read + 100 ms of rate
        window = sum(n for t, n in moved if t0 <= t < t0 + 0.1)
        assert window <= b.burst + 4096 + rate * 0.1


class _Handle:
    def __init__(self):
        self.cancelled_ = False

    def cancel(self):
        self.cancelled_ = True

    def cancelled(self):
        return self.cancelled_


class _Loop:
    def __init__(self):
        self.now = 0.0
        self.timers = []

    def time(self):
        return self.now

    def call_at(self, at, cb):
        h = _Handle()
        self.timers.append((at, cb, h))
        return h


class _Flow(FlowPacing):  # the attributes FlowPacing uses, nothing else
    def __init__(self, rate):
        self.loop = _Loop()
        self.ctx = type("Ctx", (), {"counters": collections.Counter()})()
        self.rate_up, self.rate_down = ByteBucket(rate), None
        self.rate_paused = False
        self._rate_timer = None
        self._rate_at = 0.0
        self._finished = False


def test_up_path_writes_what_the_bucket_holds_then_waits():
    f = _Flow(100_000)  # burst 64 KiB
    b = f.rate_up
    data = bytes(100_000)
    cut = f._rate_cut(b, data)
    assert len(cut) == MIN_BYTE_BURST  # what the bucket holds
    b.spend(len(cut), 0.0)
    assert f._rate_cut(b, data) is None  # empty: nothing, and a wake-up at 16 KiB of refill
    assert f._rate_at == pytest.approx(RATE_MIN_WRITE / 100_000)
    assert f.ctx.counters["tcp_rate_held_up"] == 1
    f.loop.now = f._rate_at
    assert len(f._rate_cut(b, data)) == RATE_MIN_WRITE
    small = bytes(10)
    b.spend(b.available(f.loop.now), f.loop.now)
    f.loop.now += 11 / 100_000
    assert f._rate_cut(b, small) == small  # a short tail goes as soon as it fits
    f._rate_timer = None  # (the timer it fired)
    f._rate_wake(f.loop.now + 5)
    first = f._rate_timer
    f._rate_wake(f.loop.now + 9)  # a later wake-up keeps the earlier timer
    assert f._rate_timer is first
    f._rate_wake(f.loop.now + 1)  # an earlier one replaces it
    assert f._rate_timer is not first and first.cancelled()


# ------------------------------------------------------------------ UDP, in process
@pytest.mark.parametrize("direction", ["up", "down"])
async def test_udp_over_the_cap_dropped_and_counted(direction):
    echo = UdpEcho("127.0.0.1")
    kw = {"rate_up": 20_000} if direction == "up" else {"rate_down": 20_000}
    cfg = NetworkConfig(ipv6=False, **kw)
    try:
        async with served_stack(cfg) as (stack, guest, _first):
            for i in range(200):
                guest.send(udp_frame(F4, 44000, echo.port, bytes(1000)))
                if i % 20 == 0:
                    await asyncio.sleep(0.001)
            frames = await recv_frames(guest, 1.0)
            got = sum(1 for f in frames if F4.is_ip(f, 17))
            c = stack.counters
            dropped = c[f"drop.rate_limit_{direction}"]
            flow = next(iter(stack.parts.flows.values()))
            if direction == "up":
                assert echo.count == 200 - dropped == flow.bytes_up // 1000
            else:
                assert echo.count == 200 and got == 200 - dropped == flow.bytes_down // 1000
            # the burst (64 KiB = 65 datagrams) and what refilled meanwhile went through
            assert 60 <= 200 - dropped <= 110, (dropped, c)
    finally:
        echo.sock.close()


# ------------------------------------------------------------------ TCP, a real guest


@pytest.mark.parametrize("direction", ["down", "up"])
def test_tcp_paced_at_the_cap_without_loss(direction):
    dns, srv = DnsUpstream(), DataServer()
    n = 8 * 1000 * 1000
    cap = 20 * 125_000  # 20mbit = 2.5 MB/s: 3.2 s
    try:
        p = run_guest({"dns": dns}, PACED_GUEST.format(port=srv.port, n=n, mode=direction),
                      "--rate-limit", f"{direction}=20mbit")
    finally:
        srv.close()
        dns.close()
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if direction == "down":
        assert out["bytes"] == n and out["sha"] == hashlib.sha256(pattern(n, 7)).hexdigest()
    else:
        assert out["bytes"] == n // 256 * 256 and out["sha"] == out["sent_sha"]
    rate = out["bytes"] / out["seconds"]
    assert cap * 0.9 <= rate <= cap * 1.1, (rate, out)


# ------------------------------------------------------------------ TCP under iperf3, a real guest
def _iperf3_server() -> tuple[subprocess.Popen, int]:
    """``iperf3 -s -1 -J`` (one test, then exit; its report on stdout) on 127.0.0.1 of the test namespace; (process, port)."""
    with socket.socket() as probe:  # a free port (iperf3 reports none when given 0)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-J", "-B", "127.0.0.1", "-p", str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    want = f"0100007F:{port:04X}"
    for _ in range(250):  # until it listens (read from /proc: a probe connection would be its one test)
        with open("/proc/net/tcp") as f:
            if any(ln.split()[1] == want and ln.split()[3] == "0A" for ln in f.readlines()[1:]):
                break
        time.sleep(0.02)
    return srv, port


@pytest.mark.parametrize("direction", ["up", "down"])
def test_iperf3_holds_the_cap_both_ways(direction):
    """``--rate-limit {up,down}=20mbit`` and iperf3 in the guest (``-R`` for down): the rate the
    receiver measured is the cap within 20% (iperf3's clocks on a loaded machine), and the sender reports its retransmits."""
    need_tool("iperf3", "iperf3")
    dns = DnsUpstream()
    srv, port = _iperf3_server()
    cap_bps = 20_000_000
    cmd = ["iperf3", "-c", "10.0.2.2", "-p", str(port), "-t", "4", "-J"] + (["-R"] if direction == "down" else [])
    try:
        p = run_guest({"dns": dns}, "", "--rate-limit", f"{direction}=20mbit", cmd=cmd, timeout=60)
        server_out, _ = srv.communicate(timeout=10)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        dns.close()
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    res = json.loads(p.stdout)
    assert "error" not in res, res.get("error")
    end = res["end"]
    received = end["sum_received"]["bits_per_second"]
    sent = end["sum_sent"]
    # iperf3's own clocks, on a loaded machine, are looser than the cap: a receiver starved of CPU
    # reads in bursts (1-second intervals of 20/24/31 Mbit/s seen under a parallel build), and the
    # totals run over by what the buffers on the way absorb. So iperf3 shows the cap within 20%
    # (the median of the receiver's intervals after the first: the host server's for up, the
    # guest client's for down; the total within -20%/+25%); the exact +-10% of the pacing is
    # asserted above by test_tcp_paced_at_the_cap_without_loss, on bytes the test counts itself.
    receiver = json.loads(server_out) if direction == "up" else res
    steady = sorted(i["sum"]["bits_per_second"] for i in receiver["intervals"][1:])
    median = steady[len(steady) // 2]
    assert cap_bps * 0.8 <= median <= cap_bps * 1.2, (median, steady, received)
    assert cap_bps * 0.8 <= received <= cap_bps * 1.25, (received, sent)
    assert end["sum_received"]["seconds"] >= 3.5
    assert isinstance(sent["retransmits"], int) and sent["retransmits"] >= 0  # the sender (guest or host) reports them
    assert res["start"]["test_start"]["reverse"] == (1 if direction == "down" else 0)
    print(f"iperf3 {direction}: {received / 1e6:.2f} Mbit/s received, {sent['retransmits']} retransmits")
