"""Old import path of :mod:`aioslirp.reassembly` (reassembly keeps state, so it left the wire layer)."""

from __future__ import annotations

from ..reassembly import DEFAULT_MAX_BYTES, Ipv6Reassembler, Reassembler

__all__ = ["DEFAULT_MAX_BYTES", "Reassembler", "Ipv6Reassembler"]
