"""The guest -> stack data path: L2 and L3 per family, L4 once.

::

    Transport ──frames──▶ link.Link.on_frames(frames, csum_ok)      now = ctx.running.time(), once per batch
                              │ Ethernet demux; ARP answered, ARP cache learned
                 ┌────────────┴─────────────┐
        ipv4.Ipv4Input.input        ipv6.Ipv6Path.dispatch          header checks, source check,
        (ICMP echo here)            (NDP, MLD, local echo, RA)      reassembly
                 │ packet view: fam, src, dst, l4, pkt, ..., trusted, now
                 └────────────┬─────────────┘
                       l4.L4.tcp / .udp / .echo                     the one TCP/UDP/DNS/DHCP dispatch
                              │                     family.Family4 / Family6: eth_to, inject_ip,
                              │                     icmp_error(kind), remote_for, quote, builders
               flow table (aioslirp.flow) ── TcpFlow / UdpFlow / IcmpFlow ── host sockets
                              │
                       frames for the guest ──▶ inject queue (aioslirp.inject) ──▶ Transport

Every guest frame has exactly one outcome, counted where it happens: ``handled.<reason>`` or
``drop.<reason>`` (see ``Stack.frame_outcomes``).
"""
