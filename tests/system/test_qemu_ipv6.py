"""IPv6 for a real QEMU guest (Linux kernel + busybox, ../shared/guestvm) served by ``aioslirp qemu``.

The guest's kernel configures itself by SLAAC from our Router Advertisements — with its own
Duplicate Address Detection running, which our NDP must leave unanswered — then resolves an
AAAA name through ``fd00::3`` over IPv6, pings ``fd00::2``, downloads 20 MB with busybox wget
from ``http://[fd00::2]:PORT/`` (a server on the host's ``::1``) and uploads 4 MB with nc;
SHA-256 is checked on both sides. Slow (one TCG boot); bounded by ``VM_TIMEOUT``.
"""

from __future__ import annotations

import hashlib
import ipaddress

import pytest

from support import qemu
from support.servers import host_servers, pattern
from support.vms import MB20, VM_TIMEOUT, check_vm, cli_server, report, wait_path
from support.vms import guestvm  # noqa: F401 - a fixture: the kit's kernel + initramfs, built

pytestmark = [pytest.mark.slow]

AAAA = "2001:db8::99"
ROUTER_LL = "fe80::5055:aff:fe00:202"
MB4 = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def servers6():
    with host_servers("::1", aaaa=AAAA) as s:
        yield s


async def test_guest_slaac_dns_ping_and_transfer_over_ipv6(guestvm, servers6, tmp_path, request):  # noqa: F811
    port = servers6["data"].port
    cmd = f"""
i=0
while [ $i -lt 150 ]; do
  A=$(ip -6 -o addr show dev eth0 | grep 'scope global' | grep -v tentative | awk '{{print $4; exit}}')
  [ -n "$A" ] && break
  sleep 0.1; i=$((i+1))
done
read U _ < /proc/uptime; echo IP6_AT=$U
echo GUEST_IP6=$A
ip -6 route show | awk '/^default/ {{print "GW6=" $3; exit}}'
nslookup -type=AAAA www.example.test fd00::3 | awk '/^Address/ && !/#|:53$/ {{a=$NF}} END {{print "AAAA=" a}}'
ping -6 -c 2 -W 3 fd00::2 | awk '/packets received/ {{print "PING6_RECEIVED=" $4}}'
read U _ < /proc/uptime; echo DL_START=$U
wget -q -O - http://[fd00::2]:{port}/{MB20} | sha256sum | {{ read h _; echo DOWN6_SHA=$h; }}
read U _ < /proc/uptime; echo DL_END=$U
head -c {MB4} /dev/urandom > /tmp/up
sha256sum /tmp/up | {{ read h _; echo UP_LOCAL_SHA=$h; }}
(echo UP; cat /tmp/up) | nc fd00::2 {port} | {{ read n h; echo UP_HOST_N=$n; echo UP_HOST_SHA=$h; }}
"""
    sock = tmp_path / "s.sock"
    async with cli_server(tmp_path, "--socket", str(sock), "--dns", f"127.0.0.1:{servers6['dns'].port}"):
        await wait_path(sock)
        argv = qemu.qemu_argv(f"stream,server=off,addr.type=unix,addr.path={sock}", cmd, workdir=tmp_path)
        res = await qemu.run_vm(argv, VM_TIMEOUT)
    check_vm(res)
    v = res.values
    iface = ipaddress.IPv6Interface(v.get("GUEST_IP6") or "::/128")
    assert iface.network == ipaddress.IPv6Network("fd00::/64"), res.tail()
    # SLAAC with the modified EUI-64 of the guest's MAC 52:54:00:12:34:56 (RFC 4291 App. A)
    assert iface.ip == ipaddress.IPv6Address("fd00::5054:ff:fe12:3456"), res.tail()
    assert v["GW6"] == ROUTER_LL, res.tail()
    assert v["AAAA"] == AAAA, res.tail()
    assert v["PING6_RECEIVED"] == "2", res.tail()
    assert v.get("DOWN6_SHA") == hashlib.sha256(pattern(MB20, 1)).hexdigest(), res.tail()
    assert v["UP_HOST_N"] == str(MB4) and v["UP_HOST_SHA"] == v["UP_LOCAL_SHA"], res.tail()
    secs = float(v["DL_END"]) - float(v["DL_START"])
    report(request, "ipv6_address_at_guest_uptime_s", float(v["IP6_AT"]))
    report(request, "ipv6_download_20MB_s", round(secs, 2))
    report(request, "ipv6_download_Mbit_s", round(MB20 * 8 / max(secs, 0.01) / 1e6, 1))
