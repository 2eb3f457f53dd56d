"""An interface inside a network namespace: its address, default route and MTU (rtnetlink), and
its IPv6 sysctls and SLAAC address (``/proc``).

The namespace child (:mod:`aioslirp.host.nschild`) runs these in the namespace, on the TAP it
created (``run``, ``spawn``) or was given (``attach``, the slirp4netns drop-in), before the
command starts. With IPv6 on, the TAP accepts router advertisements and skips DAD
(:data:`IPV6_SYSCTLS_ON`), so it takes a ``fd00::/64`` address by SLAAC from the stack's first
RA; :func:`wait_ipv6_address` waits for it (at most :data:`IPV6_ADDRESS_TIMEOUT` seconds).
"""

from __future__ import annotations

import ipaddress
import os

__all__ = ["IPV6_ADDRESS_TIMEOUT", "IPV6_SYSCTLS_OFF", "IPV6_SYSCTLS_ON", "configure_interface",
           "configure_ipv6_sysctls", "ipv6_addresses", "wait_ipv6_address"]


def configure_interface(
    ifname: str,
    *,
    address: str,
    prefixlen: int,
    gateway: str | None,
    mtu: int | None = None,
    up: bool = True,
) -> None:
    """Configure ``ifname`` in the current network namespace with rtnetlink (pyroute2).

    Sets the MTU (bytes) when given, adds ``address/prefixlen``, brings the link up and adds
    a default route via ``gateway`` (skipped when ``None``). Needs ``CAP_NET_ADMIN`` in the
    namespace. Raises ``OSError`` whose ``strerror`` is one line naming the failed step.
    """
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    step = "open rtnetlink"
    try:
        with IPRoute() as ipr:
            step = "find the interface"
            found = ipr.link_lookup(ifname=ifname)
            if not found:
                raise OSError(19, f"cannot configure {ifname}: no such interface")
            index = found[0]
            if mtu is not None:
                step = f"set MTU {mtu}"
                ipr.link("set", index=index, mtu=int(mtu))
            step = f"add address {address}/{prefixlen}"
            ipr.addr("add", index=index, address=str(address), prefixlen=int(prefixlen))
            if up:
                step = "bring the link up"
                ipr.link("set", index=index, state="up")
            if gateway is not None:
                step = f"add a default route via {gateway}"
                ipr.route("add", dst="0.0.0.0/0", gateway=str(gateway), oif=index)
    except NetlinkError as exc:
        code = int(exc.code or 0)
        raise OSError(code, f"cannot configure {ifname}: {step}: {os.strerror(code) if code else exc}") from None


#: IPv6 sysctls of the TAP when IPv6 is on: SLAAC from our RAs (accept_ra 2: even with
#: forwarding on), no DAD delay (we never claim the guest's addresses, RFC 4862 5.4 allows
#: DupAddrDetectTransmits 0), so the global address is usable as soon as the RA arrives.
IPV6_SYSCTLS_ON = (("disable_ipv6", "0"), ("accept_ra", "2"), ("autoconf", "1"), ("accept_dad", "0"))
#: With IPv6 off: no IPv6 at all on the TAP (no link-local, no router solicitations).
IPV6_SYSCTLS_OFF = (("disable_ipv6", "1"),)
#: Seconds ``aioslirp run`` waits for the SLAAC address before starting the command anyway.
IPV6_ADDRESS_TIMEOUT = 5.0


def configure_ipv6_sysctls(ifname: str, enable: bool) -> list[str]:
    """Set ``/proc/sys/net/ipv6/conf/IFNAME/*`` in the current network namespace, before the link goes up.

    ``enable``: :data:`IPV6_SYSCTLS_ON` (SLAAC from router advertisements, no DAD), else
    :data:`IPV6_SYSCTLS_OFF`. Returns warnings (one line each) for settings that could not be
    written, e.g. a kernel without IPv6; never raises.
    """
    base = f"/proc/sys/net/ipv6/conf/{ifname}"
    if not os.path.isdir(base):
        return [f"IPv6 is not available in the namespace ({base} missing); {ifname} gets IPv4 only"] if enable else []
    warnings = []
    for name, value in IPV6_SYSCTLS_ON if enable else IPV6_SYSCTLS_OFF:
        try:
            with open(f"{base}/{name}", "w") as f:
                f.write(value)
        except OSError as exc:
            warnings.append(f"cannot set net.ipv6.conf.{ifname}.{name}={value}: {exc.strerror}")
    return warnings


def ipv6_addresses(ifname: str) -> list[tuple[str, int, int]]:
    """IPv6 addresses of ``ifname`` in the current network namespace, from ``/proc/self/net/if_inet6``.

    Returns ``(address, scope, flags)`` tuples: ``scope`` 0 global, 0x20 link; ``flags`` the
    ``IFA_F_*`` bits (0x40 tentative, 0x08 DAD failed). Empty when IPv6 is unavailable.
    """
    out = []
    try:
        with open("/proc/self/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 6 and parts[5] == ifname:
                    addr = str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))
                    out.append((addr, int(parts[3], 16), int(parts[4], 16)))
    except OSError:
        pass
    return out


def wait_ipv6_address(ifname: str, prefix: str, timeout: float = IPV6_ADDRESS_TIMEOUT) -> str | None:
    """Poll until ``ifname`` has a usable (not tentative) global address inside ``prefix``.

    Returns the address, or ``None`` after ``timeout`` seconds. Blocking (``time.sleep``); used by
    the namespace helper between "go" and exec, so the command starts with IPv6 configured.
    """
    import time

    net = ipaddress.IPv6Network(prefix)
    deadline = time.monotonic() + timeout
    while True:
        for addr, scope, flags in ipv6_addresses(ifname):
            if scope == 0 and not flags & 0x48 and ipaddress.IPv6Address(addr) in net:
                return addr
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)
