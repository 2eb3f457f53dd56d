"""The per-frame path is typed and compile-ready (issue 14 item 9): every class on it has
``__slots__`` (so no instance gets a ``__dict__``, and nothing can add an attribute from
outside the class) and a class-level annotation for each slot it declares.

A later change that drops ``__slots__`` from one of these classes, or adds a base class
without them, fails here rather than silently bringing back per-instance dicts.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys

import pytest

from aioslirp import NetworkConfig, Stack, compiled
from aioslirp.compiled import COMPILED
from aioslirp.config.policy import EgressPolicy
from aioslirp.dispatch.family import Family4, Family6
from aioslirp.dispatch.ipv4 import Ipv4Input
from aioslirp.dispatch.ipv6 import Ipv6Path
from aioslirp.dispatch.l4 import L4
from aioslirp.dispatch.link import Link
from aioslirp.dispatch.reassembly import Ipv6Reassembler, Reassembler, _Pending
from aioslirp.flow.context import FlowContext, Running
from aioslirp.flow.guard import Guard
from aioslirp.flow.info import FlowRecords
from aioslirp.flow.table import FlowTable, IdleOrder
from aioslirp.handlers.routes import Route, Router
from aioslirp.handlers.streams import GuestFlow, GuestTransport, GuestWriter, TcpHandlerHost
from aioslirp.handlers.udp import Datagrams, HandledUdpFlow
from aioslirp.inject import InjectQueue
from aioslirp.nat.datagram import DatagramFlow, SocketFlow
from aioslirp.nat.forward import Forwarder, UdpForwardFlow, _Listener
from aioslirp.nat.hostsock import HostSocket, TransportHost
from aioslirp.nat.icmp import IcmpEcho, IcmpFlow
from aioslirp.nat.pacing import FlowPacing
from aioslirp.nat.forwarded import ForwardedTcpFlow
from aioslirp.nat.tcp import TcpFlow
from aioslirp.nat.udp import UdpFlow
from aioslirp.observe.audit import AuditLog, _Reader
from aioslirp.ratelimit import ByteBucket, TokenBucket
from aioslirp.services.dhcp import DhcpServer, _Lease
from aioslirp.services.dhcpv6 import Dhcpv6Server
from aioslirp.services.dns import DnsForwarder, DnsTcpSession, _UdpQuery
from aioslirp.services.dns_tcp import DnsTcpHost
from aioslirp.services.ndp import NdpResponder
from aioslirp.stack_parts import StackParts
from aioslirp.tcp.arrival import Arrival
from aioslirp.tcp.buffers import ChunkQueue, SendQueue
from aioslirp.tcp.connection import TcpConnection
from aioslirp.tcp.output import Output
from aioslirp.tcp.tcb import Tcb
from aioslirp.transport.base import SocketTransport, Transport, TransportWrapper
from aioslirp.transport.dgram import DgramTransport
from aioslirp.transport.framing import StreamDecoder
from aioslirp.transport.pcap import PcapTransport, PcapWriter
from aioslirp.transport.socketpair import SocketPairTransport
from aioslirp.transport.stream import StreamTransport
from aioslirp.transport.tap import TapTransport
from aioslirp.transport.trace import TraceTransport
from aioslirp.wire.ipv6 import Ipv6
from aioslirp.wire.tcp import Segment, TcpFrameBuilder, TcpOffloadBuilder

pytestmark = pytest.mark.perframe  # run again on the pure-Python modules (.ci/run)

#: The classes of the per-frame path (a guest frame in, frames to the guest out).
PER_FRAME = [
    Stack, StackParts, FlowRecords, Link, Family4, Family6, Ipv4Input, Ipv6Path, L4,
    FlowContext, Running, FlowTable, IdleOrder, Guard, EgressPolicy, InjectQueue, TokenBucket,
    Reassembler, Ipv6Reassembler, _Pending,
    DatagramFlow, SocketFlow, UdpFlow, IcmpFlow, IcmpEcho, UdpForwardFlow, Forwarder, _Listener,
    TcpFlow, ForwardedTcpFlow, TcpConnection, Tcb, Arrival, Output, SendQueue, ChunkQueue, HostSocket, TransportHost,
    DnsForwarder, DnsTcpSession, _UdpQuery, DnsTcpHost, NdpResponder, DhcpServer, _Lease, Dhcpv6Server,
    Transport, SocketTransport, TapTransport, StreamTransport, DgramTransport, SocketPairTransport,
    PcapWriter, PcapTransport, TraceTransport, TransportWrapper, StreamDecoder,
    Segment, TcpFrameBuilder, TcpOffloadBuilder, Ipv6,
    ByteBucket, FlowPacing, AuditLog, _Reader,  # rate caps (per datagram / read), the audit log (per flow)
    # flows handed to Python handlers (per segment / datagram of a handled flow; the router per new flow).
    # GuestReader is an asyncio.StreamReader, which has no __slots__.
    TcpHandlerHost, GuestFlow, GuestWriter, GuestTransport, HandledUdpFlow, Datagrams, Router, Route,
]

#: Classes whose instances are held by weak reference (``aioslirp.observe.metrics``).
WEAKREF = {Stack}


def _name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _native(cls) -> bool:
    """A class of a module the compiled build made native (mypyc): a C struct per instance, no
    ``__slots__`` entry and no ``__dict__`` (its layout comes from the annotations)."""
    return cls.__module__ in COMPILED and compiled.loaded(cls.__module__)


@functools.cache
def _source_module(name: str):
    """Module ``name`` executed from its ``.py`` source (not entered in ``sys.modules``)."""
    path = os.path.join(os.path.dirname(sys.modules[name].__file__), name.rsplit(".", 1)[1] + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _source_class(cls):
    """The uncompiled twin of a native class, read from its source."""
    return getattr(_source_module(cls.__module__), cls.__qualname__)


@pytest.mark.parametrize("cls", PER_FRAME, ids=_name)
def test_every_class_in_the_mro_has_slots(cls):
    """No class of the MRO (but ``object``) lacks its own ``__slots__``, so instances have no
    ``__dict__``; ``__weakref__`` only where a weak reference is taken."""
    for c in cls.__mro__[:-1]:
        assert "__slots__" in c.__dict__ or _native(c), f"{_name(c)} (in the MRO of {_name(cls)}) has no __slots__"
    assert not any("__dict__" in c.__dict__ for c in cls.__mro__), f"{_name(cls)} instances get a __dict__"
    has_weakref = any("__weakref__" in c.__dict__ for c in cls.__mro__)
    assert has_weakref == (cls in WEAKREF), _name(cls)


@pytest.mark.parametrize("cls", PER_FRAME, ids=_name)
def test_every_slot_is_annotated(cls):
    """Each slot a class declares has a class-level annotation (PEP 526) in that class, and no
    class attribute shadows a slot (a slotted class cannot have a default of the slot's name)."""
    if _native(cls):  # compiled: the annotations are the layout (checked on the source, uncompiled)
        cls = _source_class(cls)
    slots = cls.__dict__["__slots__"]
    slots = (slots,) if isinstance(slots, str) else tuple(slots)
    annotations = inspect.get_annotations(cls)
    missing = [s for s in slots if s != "__weakref__" and s not in annotations]
    assert not missing, f"{_name(cls)}: slots without an annotation: {missing}"
    for s in slots:
        if s != "__weakref__":
            assert inspect.ismemberdescriptor(cls.__dict__[s]), f"{_name(cls)}.{s} is not a slot"


def test_a_stack_and_its_parts_have_no_instance_dict():
    """Built instances, the whole per-frame object graph of an IPv4+IPv6 stack: none has a
    ``__dict__``, and setting an attribute no class declares fails."""
    stack = Stack(NetworkConfig(ipv6=True))
    p = stack.parts
    parts = [stack, p, stack.flows, p.ctx, p.link, p.l4, p.ipv4, p.family4, p.table, p.idle_order,
             p.guard, p.guard.policy, p.inject_queue, p.icmp, p.ipv4.reassembler,
             p.family4.err_bucket, p.v6, p.family6, p.v6.ndp, p.v6.dhcp6, p.v6.reassembler,
             DhcpServer(stack.config), DnsForwarder(stack.config), DnsTcpSession(), StreamDecoder()]
    for obj in parts:
        assert not hasattr(obj, "__dict__"), type(obj)
        with pytest.raises(AttributeError):
            obj.not_an_attribute = 1
    for obj in (stack, p.ctx, p.link, p.table, p.inject_queue):
        assert obj.tracer is None, type(obj)
