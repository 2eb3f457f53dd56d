"""Every kind of egress rule, for both address families, under both defaults, on real flows.

In process: a Stack served over a socketpair (tests/support/stacks.py), crafted guest frames, host
servers on 127.0.0.1 and ``::1`` behind the gateway (10.0.2.2 / fd00::2, which the rules see as
the host-side loopback address). Each case sets ``egress_allow`` / ``egress_deny`` and runs under
``egress_default`` allow and deny; the verdict of each probe is read off the wire:

* ``tcp1`` / ``tcp2``: a SYN to two listeners (ports P1, P2): a SYN-ACK is ``open``, ICMP
  administratively prohibited (type 3 code 13; ICMPv6 type 1 code 1) is ``denied``;
* ``udp``: a datagram to a UDP echo server (port U): the echo back is ``open`` (the server
  counted it), ICMP administratively prohibited is ``denied`` (the server saw nothing).

Name and wildcard rules go through the virtual DNS first: the guest asks 10.0.2.3 / fd00::3 for a
``dns_records`` name (the gateway), and the answer binds the name to the host-side address.
Sans-I/O coverage of the same rules: tests/unit/flow/test_egress_names.py.
"""

from __future__ import annotations

import socket

import dpkt
import pytest

from aioslirp import NetworkConfig

from support.frames import ACK, F4, F6, RST, SYN, dns_query, icmp_of, tcp_frame, udp_frame
from support.prereqs import have_ipv6_loopback, need
from support.servers import UdpEcho
from support.stacks import recv_frames, served_stack

NAMES = ["svc.test", "a.svc.test", "x.y.svc.test", "evilsvc.test"]
RECORDS = {n: ["10.0.2.2", "fd00::2"] for n in NAMES}
ADMIN = {F4: (3, 13), F6: (1, 1)}  # (type, code) of "administratively prohibited"

# (id, allow, deny, names resolved first, {default: (open probes)}); P1, P2, LO-HI, HOST and NET
# are filled in per family and per run (P1 inside LO-HI, P2 outside; NET the loopback network).
ALL = ("tcp1", "tcp2", "udp")
#: cases where a name rule opens flows: those flows (the "deny" column) carry the name resolved last
NAMED = {"name-allow", "name-ports", "wildcard-allow", "name-beats-cidr-deny", "exact-name-beats-wildcard"}
CASES = [
    ("no-rules", [], [], [], {"allow": ALL, "deny": ()}),
    ("cidr-allow", ["NET"], [], [], {"allow": ALL, "deny": ALL}),
    ("cidr-deny", [], ["NET"], [], {"allow": (), "deny": ()}),
    ("host-allow", ["HOST"], [], [], {"allow": ALL, "deny": ALL}),
    ("name-allow-unresolved", ["svc.test"], [], [], {"allow": ALL, "deny": ()}),
    ("name-allow", ["svc.test"], [], ["svc.test"], {"allow": ALL, "deny": ALL}),
    ("name-deny", [], ["svc.test"], ["svc.test"], {"allow": (), "deny": ()}),
    ("name-ports", ["svc.test:P1/tcp"], [], ["svc.test"], {"allow": ALL, "deny": ("tcp1",)}),
    ("wildcard-allow", ["*.svc.test"], [], ["x.y.svc.test"], {"allow": ALL, "deny": ALL}),
    ("wildcard-not-its-suffix", ["*.svc.test"], [], ["svc.test", "evilsvc.test"], {"allow": ALL, "deny": ()}),
    ("wildcard-deny", [], ["*.svc.test"], ["a.svc.test"], {"allow": (), "deny": ()}),
    ("port-range-allow", ["NET:LO-HI"], [], [], {"allow": ALL, "deny": ("tcp1",)}),
    ("port-range-deny", [], ["NET:LO-HI"], [], {"allow": ("tcp2", "udp"), "deny": ()}),
    ("proto-tcp-allow", ["NET/tcp"], [], [], {"allow": ALL, "deny": ("tcp1", "tcp2")}),
    ("proto-udp-allow", ["NET/udp"], [], [], {"allow": ALL, "deny": ("udp",)}),
    ("proto-udp-deny", [], ["NET/udp"], [], {"allow": ("tcp1", "tcp2"), "deny": ()}),
    ("specific-port-deny-in-allowed-net", ["NET"], ["NET:P2"], [], {"allow": ("tcp1", "udp"), "deny": ("tcp1", "udp")}),
    ("specific-host-port-allow-in-denied-net", ["HOST:P1/tcp"], ["NET"], [], {"allow": ("tcp1",), "deny": ("tcp1",)}),
    ("longer-prefix-deny-wins", ["NET:LO-HI"], ["HOST"], [], {"allow": (), "deny": ()}),
    ("proto-deny-beats-plain-allow", ["NET:P1"], ["NET:P1/tcp"], [], {"allow": ("tcp2", "udp"), "deny": ()}),
    ("name-beats-cidr-deny", ["svc.test"], ["NET"], ["svc.test"], {"allow": ALL, "deny": ALL}),
    ("exact-name-beats-wildcard", ["a.svc.test"], ["*.svc.test"], ["a.svc.test"], {"allow": ALL, "deny": ALL}),
]


class Servers:
    """Two TCP listeners (P1 inside a port range LO-HI, P2 outside) and a UDP echo on ``host``."""

    def __init__(self, host: str) -> None:
        af = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.tcp = []
        while True:
            s = socket.socket(af)
            s.bind((host, 0))
            s.listen(16)
            s.settimeout(5)
            self.tcp.append(s)
            ports = [t.getsockname()[1] for t in self.tcp]
            if len(ports) >= 2 and abs(ports[-1] - ports[0]) > 10:
                break
        self.p1, self.p2 = ports[0], ports[-1]
        self.lo, self.hi = self.p1 - 5, self.p1 + 5
        self.udp = UdpEcho(host)

    def close(self) -> None:
        for s in self.tcp:
            s.close()
        self.udp.close()


@pytest.fixture(scope="module", params=[F4, F6], ids=["ipv4", "ipv6"])
def fam_servers(request):
    fam = request.param
    if fam is F6:
        need(have_ipv6_loopback(), "IPv6 loopback (::1) in the test namespace")
    srv = Servers(fam.loopback)
    yield fam, srv
    srv.close()


def rule_text(text: str, fam, srv: Servers) -> str:
    # the rules see the gateway as the host-side loopback; NET is a network around it (HOST is a longer prefix)
    host, net = ("127.0.0.1", "127.0.0.0/8") if fam is F4 else ("[::1]", "[::/64]")
    return (text.replace("NET", net).replace("HOST", host).replace("LO", str(srv.lo)).replace("HI", str(srv.hi))
            .replace("P1", str(srv.p1)).replace("P2", str(srv.p2)))


async def resolve(fam, guest, ident: int, name: str) -> None:
    guest.send(udp_frame(fam, 5300 + ident, 53, dns_query(name, ident, fam.dns_qtype), dst=fam.dns))
    frames = await recv_frames(guest, 2.0)
    replies = [dpkt.dns.DNS(fam.l4(f)[8:]) for f in frames if fam.is_ip(f, 17)]
    (d,) = [r for r in replies if r.id == ident]
    assert d.rcode == 0 and len(d.an) == 1, (name, d.rcode)
    assert (d.an[0].ip if fam is F4 else d.an[0].ip6) == fam.gw


def admin_prohibited(fam, frames) -> bool:
    t, code = ADMIN[fam]
    return any(msg[1] == code for *_e, msg in icmp_of(fam, frames, t))


async def probe(fam, guest, srv: Servers, what: str, sport: int, stack, names_of: dict) -> str:
    """``"open"`` or ``"denied"``: what the stack did with one new flow (see the module's doc);
    ``names_of[what]``: the name an open flow carries."""
    if what == "udp":
        before = srv.udp.count
        guest.send(udp_frame(fam, sport, srv.udp.port, b"probe"))
        frames = await recv_frames(guest, 2.0)
        echoed = [f for f in frames if fam.is_ip(f, 17) and fam.l4(f)[8:] == b"probe"]
        if admin_prohibited(fam, frames):
            assert not echoed and srv.udp.count == before
            return "denied"
        assert len(echoed) == 1 and srv.udp.count == before + 1, frames
        names_of[what] = stack.parts.flows[(17, fam.guest, sport, fam.gw, srv.udp.port)].name
        return "open"
    port = srv.p1 if what == "tcp1" else srv.p2
    guest.send(tcp_frame(fam, sport, port, SYN, seq=1000))
    frames = await recv_frames(guest, 2.0)
    segs = [fam.decode(f)[1].data for f in frames if fam.is_ip(f, 6)]
    if admin_prohibited(fam, frames):
        assert not segs
        return "denied"
    (seg,) = segs
    assert seg.flags & (SYN | ACK) == SYN | ACK and seg.ack == 1001 and seg.sport == port
    names_of[what] = stack.parts.flows[(6, fam.guest, sport, fam.gw, port)].name
    conn, _peer = srv.tcp[0 if what == "tcp1" else -1].accept()  # the host side was connected
    conn.close()
    guest.send(tcp_frame(fam, sport, port, RST | ACK, seq=1001, ack=seg.seq + 1))  # done with it
    return "open"


@pytest.mark.parametrize("default", ["allow", "deny"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_rule_kind_verdict_on_real_flows(fam_servers, case, default):
    fam, srv = fam_servers
    _id, allow, deny, names, expected = case
    cfg = NetworkConfig(ipv6=True, dns_upstreams=[("127.0.0.1", 9)], dns_records=RECORDS,
                        dns_binding_ttl_min=60, egress_default=default,
                        egress_allow=[rule_text(r, fam, srv) for r in allow],
                        egress_deny=[rule_text(r, fam, srv) for r in deny])
    async with served_stack(cfg, settle=0.05) as (stack, guest, _first):
        for i, name in enumerate(names):
            await resolve(fam, guest, i + 1, name)
        got, names_of = {}, {}
        for i, what in enumerate(ALL):
            got[what] = await probe(fam, guest, srv, what, 41000 + i, stack, names_of)
        c = stack.counters
        denied = [w for w in ALL if got[w] == "denied"]
        assert c["drop.egress_denied"] == len(denied)  # every denial counted, by reason
        assert c["egress.denied_rule"] + c["egress.denied_default"] == len(denied)
        if default == "allow":  # only a rule denies
            assert c["egress.denied_rule"] == len(denied)
        elif not deny:  # only the default denies
            assert c["egress.denied_default"] == len(denied)
    want = {w: ("open" if w in expected[default] else "denied") for w in ALL}
    assert got == want
    # a flow a name rule allowed carries the name it was resolved by; no other flow has one
    assert names_of == {w: (names[-1] if _id in NAMED and w in expected["deny"] else None)
                        for w in ALL if got[w] == "open"}
