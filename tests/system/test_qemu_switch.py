"""Two real QEMU guests (../shared/guestvm) on one ``aioslirp qemu --socket PATH --switch``: each
gets its own DHCP lease, they ping each other, move 10 MB byte-exact (SHA-256) from one to the
other, resolve each other's names (vm2's AAAA record too: the SLAAC address the switch learned
from its traffic, which vm1 then pings), and both reach the host through their own stacks.

Two VMs under TCG on a small machine are slow: run this module alone; the time bounds are generous.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from support import qemu
from support.servers import host_servers, pattern
from support.vms import check_vm, cli_server, report, wait_path
from support.vms import guestvm  # noqa: F401 - a fixture: the kit's kernel + initramfs, built

pytestmark = [pytest.mark.slow]

TIMEOUT = 420  # seconds per guest: two TCG guests share the machine's cores

# busybox nc: the receiver's stdin is /dev/null, and nc -l with a plain stdin gives up on its EOF;
# with -e the socket is the program's stdin, which ends when the sender closes.

RECEIVER = """
ip -4 -o addr show dev eth0 | awk '{print "GUEST_IP=" $4}'
i=0
while [ $i -lt 150 ]; do
  A=$(ip -6 -o addr show dev eth0 | grep 'scope global' | grep -v tentative | awk '{print $4; exit}')
  [ -n "$A" ] && break
  sleep 0.1; i=$((i+1))
done
echo GUEST_IP6=$A
nslookup vm1.aioslirp.internal 10.0.2.3 | awk '/^Address/ && !/#|:53/ && $2 !~ /:/ {a=$2} END {print "PEER_RESOLVED=" a}'
ok=1
for i in $(seq 1 60); do
  if ping -c 1 -W 2 10.0.2.15 > /dev/null 2>&1; then ok=0; break; fi
done
echo PING_PEER_RC=$ok
echo 'cat > /tmp/recv' > /tmp/rx.sh
echo LISTENING=1
nc -l -p 9000 -e /bin/sh /tmp/rx.sh
sha256sum /tmp/recv | { read h _; echo RECV_SHA=$h; }
wc -c < /tmp/recv | { read n; echo RECV_N=$n; }
wget -q -O - http://10.0.2.2:DATAPORT/1000000 | sha256sum | { read h _; echo HOST_SHA=$h; }
"""

SENDER = """
ip -4 -o addr show dev eth0 | awk '{print "GUEST_IP=" $4}'
nslookup vm2.aioslirp.internal 10.0.2.3 | awk '/^Address/ && !/#|:53/ && $2 !~ /:/ {a=$2} END {print "PEER_RESOLVED=" a}'
head -c 10485760 /dev/urandom > /tmp/blob
sha256sum /tmp/blob | { read h _; echo SENT_SHA=$h; }
ok=1
for i in $(seq 1 120); do
  if ping -c 1 -W 2 10.0.2.16 > /dev/null 2>&1; then ok=0; break; fi
done
echo PING_PEER_RC=$ok
p=""
for i in $(seq 1 60); do
  p=$(nslookup -type=AAAA vm2.aioslirp.internal 10.0.2.3 | awk '/^Address/ && !/#|:53$/ {a=$NF} END {print a}')
  [ -n "$p" ] && break
  sleep 0.5
done
echo PEER_AAAA=$p
ping -6 -c 2 -W 3 "$p" > /dev/null 2>&1
echo PING6_PEER_RC=$?
for i in $(seq 1 60); do
  if nc 10.0.2.16 9000 < /tmp/blob; then echo SENT=1; break; fi
  sleep 2
done
wget -q -O - http://10.0.2.2:DATAPORT/1000000 | sha256sum | { read h _; echo HOST_SHA=$h; }
"""


async def test_two_vms_on_one_switch(guestvm, tmp_path, request):
    with host_servers() as servers:
        port = servers["data"].port
        sock = tmp_path / "vms.sock"
        host_sha = hashlib.sha256(pattern(1000000, 1)).hexdigest()
        async with cli_server(tmp_path, "--socket", str(sock), "--switch", "--dns",
                              f"127.0.0.1:{servers['dns'].port}") as srv:
            await wait_path(sock)
            netdev = f"stream,server=off,addr.type=unix,addr.path={sock}"
            (tmp_path / "a").mkdir()
            (tmp_path / "b").mkdir()
            # vm1 connects first (the first lease, 10.0.2.15), then vm2 (10.0.2.16)
            a = await qemu.Vm.start(qemu.qemu_argv(netdev, SENDER.replace("DATAPORT", str(port)),
                                                   workdir=tmp_path / "a", mac="52:54:00:12:34:01"))
            await asyncio.sleep(1.0)
            b = await qemu.Vm.start(qemu.qemu_argv(netdev, RECEIVER.replace("DATAPORT", str(port)),
                                                   workdir=tmp_path / "b", mac="52:54:00:12:34:02"))
            ra, rb = await asyncio.gather(a.wait(TIMEOUT), b.wait(TIMEOUT))
        log = srv.log_text
    check_vm(ra)
    check_vm(rb)
    assert ra.values["GUEST_IP"] == "10.0.2.15/24" and rb.values["GUEST_IP"] == "10.0.2.16/24", log[-2000:]
    assert ra.values["PEER_RESOLVED"] == "10.0.2.16" and rb.values["PEER_RESOLVED"] == "10.0.2.15"
    assert ra.values["PING_PEER_RC"] == "0" and rb.values["PING_PEER_RC"] == "0", rb.tail()
    # vm2's SLAAC address, learned by the switch from its traffic: vm1 resolves AAAA vm2 and pings it
    assert rb.values["GUEST_IP6"].startswith("fd00::") and rb.values["GUEST_IP6"].endswith("/64"), rb.tail()
    assert ra.values["PEER_AAAA"] == rb.values["GUEST_IP6"][:-3], ra.tail()
    assert ra.values["PING6_PEER_RC"] == "0", ra.tail()
    assert ra.values.get("SENT") == "1", ra.tail()
    assert rb.values["RECV_N"] == str(10 * 1024 * 1024) and rb.values["RECV_SHA"] == ra.values["SENT_SHA"]
    assert ra.values["HOST_SHA"] == rb.values["HOST_SHA"] == host_sha
    assert "guest vm1 joined" in log and "guest vm2 joined" in log
    secs = rb.at["RECV_SHA"] - rb.at["LISTENING"]
    report(request, "vm_to_vm_10MB_wall_s_upper_bound", round(secs, 1))
