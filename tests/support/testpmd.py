"""DPDK's ``dpdk-testpmd`` (Debian package ``dpdk-dev``) as a vhost-user front end: its
``net_virtio_user`` device is DPDK's own virtio-net driver talking vhost-user to a back end, with
no VM; testpmd is driven in interactive mode over its standard input.

No hugepages are needed: ``--no-huge`` memory is memfd-backed (DPDK >= 20.11), so it can be
shared with the back end in ``SET_MEM_TABLE``. Two lcores on one CPU: the main one reads the
commands, the forwarding one busy-polls the rings between ``start`` and ``stop`` only (keep those
windows short: it burns that CPU).

Frames it makes: ``start tx_first N`` sends ``N`` bursts of ``--burst`` UDP/IPv4 frames from the
txonly engine (addresses set by :func:`Testpmd.start`: ``guest_ip:sport`` to ``peer_ip:dport``,
to ``peer_mac``, 64 bytes each, UDP checksum 0) and then runs the forwarding mode: ``icmpecho``
(counts what it receives, answers ARP and ICMP echo, drops the rest) or ``5tswap`` (sends every
frame back with MAC, IP and L4 source and destination swapped).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil

TESTPMD = shutil.which("dpdk-testpmd")
PROMPT = b"testpmd> "
GUEST_MAC = "52:54:00:12:34:56"
#: testpmd's ``--rx-offloads`` (UDP and TCP checksum, LRO) and ``--tx-offloads`` (UDP and TCP
#: checksum, TSO): what virtio_user asks for with them is GUEST_CSUM, GUEST_TSO4/6, CSUM and
#: HOST_TSO4/6 (DPDK drivers/net/virtio virtio_dev_configure).
RX_OFFLOADS = 0x1C
TX_OFFLOADS = 0x2C

_FEATURES = re.compile(rb"set features: (0x[0-9a-f]+)")
_STAT = re.compile(rb"(RX-packets|RX-missed|RX-bytes|RX-errors|RX-nombuf|TX-packets|TX-errors|TX-bytes):\s*(\d+)")


class TestpmdError(AssertionError):
    pass


class Testpmd:
    """One ``dpdk-testpmd`` process with one virtio_user port (port 0) on a vhost-user socket."""

    __test__ = False  # not a test class for pytest

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.output = bytearray()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, path: str, *, server: bool = False, mode: str = "icmpecho", offloads: bool = False,
                    guest_ip: str = "10.0.2.15", peer_ip: str = "10.0.2.2", peer_mac: str = "52:55:0a:00:02:02",
                    sport: int = 5555, dport: int = 9, burst: int = 32, extra: tuple[str, ...] = (),
                    timeout: float = 30) -> "Testpmd":
        """Start testpmd on the vhost-user socket ``path`` (``server``: testpmd listens there, the
        back end connects; a socket file left there is not replaced: "Address already in use") and
        wait for its prompt: the port is started (virtio_user has set the
        features, the memory table and both rings by then)."""
        vdev = f"net_virtio_user0,path={path},queues=1,mac={GUEST_MAC}" + (",server=1" if server else "")
        cpu = min(os.sched_getaffinity(0))  # both lcores on one CPU: the main one mostly waits for input
        # stdbuf: its printf output is block-buffered into a pipe, the prompt is not (it came first)
        argv = ["stdbuf", "-o0", TESTPMD, "--no-huge", "-m", "256", "--no-pci", "--no-shconf", f"--lcores=0@{cpu},1@{cpu}",
                "--log-level=pmd.net.virtio.*:debug", f"--vdev={vdev}", "--",
                "-i", "--total-num-mbufs=2048", f"--forward-mode={mode}", f"--burst={burst}",
                f"--tx-ip={guest_ip},{peer_ip}", f"--tx-udp={sport},{dport}", f"--eth-peer=0,{peer_mac}"]
        if offloads:
            argv += [f"--rx-offloads={RX_OFFLOADS:#x}", f"--tx-offloads={TX_OFFLOADS:#x}"]
        argv += extra
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        self = cls(proc)
        await self._until_prompt(0, timeout)
        if b"failed to initialize net_virtio_user0" in self.output or b"Start ports failed" in self.output:
            # testpmd goes on to its prompt without the port
            await self.close()
            raise TestpmdError(f"virtio_user did not start:\n{self.tail()}")
        return self

    async def _read(self) -> None:
        stream = self.proc.stdout
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            self.output += chunk

    async def _until_prompt(self, start: int, timeout: float) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            at = self.output.find(PROMPT, start)
            if at >= 0:
                return bytes(self.output[start:at])
            if self._reader.done():
                raise TestpmdError(f"testpmd exited (rc {self.proc.returncode}):\n{self.tail()}")
            if loop.time() > deadline:
                raise TestpmdError(f"no testpmd prompt in {timeout} s:\n{self.tail()}")
            await asyncio.sleep(0.02)

    async def cmd(self, line: str, timeout: float = 15) -> str:
        """Run one interactive command; its output (up to the next prompt)."""
        start = len(self.output)
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        out = await self._until_prompt(start, timeout)
        return out.decode(errors="replace")

    async def stats(self) -> dict[str, int]:
        """``show port stats 0``: ``RX-packets``, ``RX-bytes``, ``RX-missed``, ``RX-errors``,
        ``RX-nombuf``, ``TX-packets``, ``TX-bytes``, ``TX-errors`` (since the port started)."""
        out = await self.cmd("show port stats 0")
        return {k.decode(): int(v) for k, v in _STAT.findall(out.encode())}

    def features(self) -> int:
        """The virtio features virtio_user last set (``SET_FEATURES``), from its debug log."""
        found = _FEATURES.findall(self.output)
        if not found:
            raise TestpmdError(f"testpmd logged no 'set features':\n{self.tail()}")
        return int(found[-1], 16)

    def tail(self, n: int = 4000) -> str:
        return self.output[-n:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL (the front end dies without a word to the back end)."""
        if self.proc.returncode is None:
            self.proc.kill()

    async def close(self, timeout: float = 15) -> int:
        """``quit`` (or a kill when it does not go); its exit status."""
        if self.proc.returncode is None and not self._reader.done():
            try:
                self.proc.stdin.write(b"stop\nquit\n")
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
        try:
            rc = await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            self.kill()
            rc = await self.proc.wait()
        await self._reader
        return rc
