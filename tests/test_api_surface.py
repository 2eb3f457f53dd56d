"""The embedder's surface (issue 25 item 4): the types an embedder is handed or hands over import
from ``aioslirp`` as the very objects of their home modules."""

from __future__ import annotations

import importlib

import pytest

import aioslirp

#: Where each embedder type lives.
EXPORTED = {
    "Event": "aioslirp.lifecycle",
    "EventLog": "aioslirp.lifecycle",
    "AuditLog": "aioslirp.audit",
    "PolicyRequest": "aioslirp.flow.egress",
    "Route": "aioslirp.handlers.routes",
    "GuestReader": "aioslirp.handlers.streams",
    "GuestWriter": "aioslirp.handlers.streams",
    "Datagrams": "aioslirp.handlers.udp",
    "UpstreamProxy": "aioslirp.handlers.proxy",
    "Transport": "aioslirp.transport.base",
    "TransportWrapper": "aioslirp.transport.base",
    "PcapTransport": "aioslirp.transport.pcap",
    "FlowInfo": "aioslirp.flow.info",
}


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_embedder_types_import_from_aioslirp_as_themselves(name):
    assert name in aioslirp.__all__ and name in dir(aioslirp)
    assert getattr(aioslirp, name) is getattr(importlib.import_module(EXPORTED[name]), name)
