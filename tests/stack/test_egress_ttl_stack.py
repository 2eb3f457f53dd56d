"""A DNS name binding expiring through the whole stack, on a fake loop clock.

A Stack (``egress_default="deny"``, ``egress_allow=["allowed.test"]``, the binding floor
``dns_binding_ttl_min`` at 0 so that the record's TTL decides) is driven with crafted guest
frames through :class:`~test_fake_clock_stack.FakeTransport`; the loop's clock moves only when
the test says so. The virtual DNS (10.0.2.3) forwards to a local upstream on 127.0.0.1 that
answers ``allowed.test`` with 192.0.2.77 (an address on the test namespace's ``lo``) and TTL 1.

* after the lookup, a SYN to 192.0.2.77 gets a SYN-ACK (the host listener accepts it);
* 0.9 s later still allowed; at 1.0 s the binding is gone: a new SYN gets ICMP administratively
  prohibited (type 3 code 13), ``egress.denied_default`` counts it, the listener sees nothing;
* resolving the name again re-allows a new flow, carrying the name.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import dpkt

from aioslirp import NetworkConfig, Stack

from support.fake_clock import START, FakeClockLoop, FakeTransport, settle, tcp_out, udp_out
from support.frames import ACK, DNS4, F4, SYN, dns_query, tcp_frame, udp_frame
from support.namespaces import namespace_address

ADDR = "192.0.2.77"


class TtlOneDns:
    """UDP DNS on 127.0.0.1:<ephemeral>: ``allowed.test`` A -> :data:`ADDR` with TTL 1, else NXDOMAIN."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.asked = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            if not data:  # (shut down)
                return
            q = dpkt.dns.DNS(data)
            r = dpkt.dns.DNS(id=q.id, qr=dpkt.dns.DNS_R, rd=q.rd, ra=1, qd=q.qd)
            name = q.qd[0].name.lower().rstrip(".")
            self.asked += 1
            if name == "allowed.test" and q.qd[0].type == dpkt.dns.DNS_A:
                r.an = [dpkt.dns.DNS.RR(name=q.qd[0].name, type=1, cls=1, ttl=1, ip=socket.inet_aton(ADDR))]
            elif name != "allowed.test":
                r.rcode = dpkt.dns.DNS_RCODE_NXDOMAIN
            self.sock.sendto(bytes(r), peer)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def admin_prohibited(frames: list[bytes]) -> list[tuple[int, int]]:
    """(quoted destination port, code) of the ICMPv4 destination-unreachable code 13 among ``frames``."""
    out = []
    for f in frames:
        if f[12:14] == b"\x08\x00" and f[23] == 1:
            t = 14 + (f[14] & 0x0F) * 4
            if f[t] == 3:
                q = t + 8 + (f[t + 8] & 0x0F) * 4  # the quoted IP header, then its TCP header
                out.append((struct.unpack_from("!H", f, q + 2)[0], f[t + 1]))
    return out


def test_binding_ttl_expires_through_the_stack_and_a_new_lookup_reopens():
    upstream = TtlOneDns()
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    loop = FakeClockLoop()
    out: dict = {}
    with namespace_address(ADDR):
        lst.bind((ADDR, 0))
        lst.listen(8)
        lst.settimeout(5)
        port = lst.getsockname()[1]
        cfg = NetworkConfig(ipv6=False, dns_upstreams=[("127.0.0.1", upstream.port)], egress_default="deny",
                            # 192.0.2.0/24:9/udp: covers ADDR, a documentation address, so that the
                            # upstream's answer may bind it (docs/security.md); opens nothing used here
                            egress_allow=["allowed.test", "192.0.2.0/24:9/udp"], dns_binding_ttl_min=0)
        dst = socket.inet_aton(ADDR)

        async def resolve(tr: FakeTransport, ident: int, sport: int) -> bytes:
            tr.out.clear()
            tr.deliver(udp_frame(F4, sport, 53, dns_query("allowed.test", ident), dst=DNS4))
            assert await settle(lambda: any(s == 53 for s, _d, _p in udp_out(tr.out)), turns=20000)
            (reply,) = [p for s, _d, p in udp_out(tr.out) if s == 53]
            d = dpkt.dns.DNS(reply)
            assert (d.id, d.rcode, len(d.an)) == (ident, 0, 1) and d.an[0].ttl == 1
            return d.an[0].ip

        async def syn(tr: FakeTransport, sport: int) -> str:
            """``"synack"`` or ``"prohibited"``: what the stack answered a SYN from ``sport``."""
            tr.out.clear()
            tr.deliver(tcp_frame(F4, sport, port, SYN, seq=100, dst=dst, mss=1460))
            assert await settle(lambda: tcp_out(tr.out) or admin_prohibited(tr.out), turns=20000)
            if admin_prohibited(tr.out):
                assert admin_prohibited(tr.out) == [(port, 13)] and not tcp_out(tr.out)
                return "prohibited"
            ((iss, ack, flags, _),) = tcp_out(tr.out)
            assert flags == SYN | ACK and ack == 101
            conn, peer = lst.accept()
            assert peer[1] != 0
            conn.close()
            return "synack"

        async def main() -> None:
            async with Stack(cfg) as stack:
                tr = FakeTransport()
                serving = asyncio.ensure_future(stack.serve(tr))
                await settle()
                c = stack.counters
                loop.now = START + 1
                # before any lookup: no name was bound to the address, default deny
                out["before"] = await syn(tr, 40000)
                assert c["egress.denied_default"] == 1
                assert await resolve(tr, 1, 50000) == dst
                out["resolved"] = await syn(tr, 40001)
                flow = stack.parts.flows[(6, socket.inet_aton("10.0.2.15"), 40001, dst, port)]
                out["name"] = flow.name
                loop.now = START + 1.9
                out["at_0.9"] = await syn(tr, 40002)
                loop.now = START + 2.0  # TTL 1, floor 0: the binding (and the cached verdict) end here
                out["at_1.0"] = await syn(tr, 40003)
                out["denied_default"] = c["egress.denied_default"]
                out["dropped"] = c["drop.egress_denied"]
                loop.now = START + 5.0
                out["later"] = await syn(tr, 40004)
                assert await resolve(tr, 2, 50001) == dst  # asked upstream again
                out["again"] = await syn(tr, 40005)
                flow = stack.parts.flows[(6, socket.inet_aton("10.0.2.15"), 40005, dst, port)]
                out["name_again"] = flow.name
                out["asked"] = upstream.asked
                out["denied_final"] = c["egress.denied_default"]
                stack.stop()
                await serving

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()
            lst.close()
            upstream.close()
    assert out == {"before": "prohibited", "resolved": "synack", "name": "allowed.test", "at_0.9": "synack",
                   "at_1.0": "prohibited", "denied_default": 2, "dropped": 2, "later": "prohibited",
                   "again": "synack", "name_again": "allowed.test", "asked": 2, "denied_final": 3}
