"""The embedder's surface (issue 25 item 4): ``Stack`` keeps a narrow face, written out here so
that a new public name is a deliberate change; its internals are under one read-only
``stack.parts``; the names renamed in 0.2 still work for one release with a
``DeprecationWarning``; the types an embedder is handed or hands over import from ``aioslirp``.
Sans-IO: a stack is built (and, where said, started), no frame leaves the process."""

from __future__ import annotations

import asyncio
import importlib
import warnings

import pytest

import aioslirp
from aioslirp import NetworkConfig, Stack
from aioslirp.flow.info import FlowInfo, FlowRecords
from aioslirp.host.signals import request_stop
from aioslirp.stack import MOVED, RENAMED
from aioslirp.stack_parts import StackParts

#: Every public name of a Stack (class and instance), one line of docs/library.md each.
FACE = {
    # lifecycle
    "start", "serve", "stop", "farewell", "aclose", "reset_flows",
    # state
    "config", "identity", "counters", "stats", "flows", "frame_outcomes",
    # events and audit
    "events", "on_event", "event_log", "audit_records", "reopen_audit_log",
    # egress and Python handlers
    "policy", "route", "unroute",
    # port forwards
    "add_forward", "remove_forward", "forwards",
    # frames without a transport
    "process_guest_frame", "flush",
    # extension
    "spawn_task", "tracer", "transport_wrappers", "supports_offload",
    # the internals, for tests and debugging
    "parts",
}

#: Where each embedder type lives.
EXPORTED = {
    "Event": "aioslirp.observe.events",
    "EventLog": "aioslirp.observe.events",
    "AuditLog": "aioslirp.observe.audit",
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
    # the shared switch (docs/switch.md): several guests on one network, a stack each
    "Switch": "aioslirp.switch",
    "GuestPort": "aioslirp.switch",
}


def public_names(stack: Stack) -> set[str]:
    """Every name of ``dir()`` of the class and of the instance, and every slot, not starting with ``_``."""
    slots = {s for c in type(stack).__mro__ for s in getattr(c, "__slots__", ())}
    return {n for n in set(dir(Stack)) | set(dir(stack)) | slots if not n.startswith("_")}


def test_stack_face_is_the_listed_names_at_most_30():
    names = public_names(Stack(NetworkConfig()))
    assert names == FACE, f"new: {sorted(names - FACE)}, gone: {sorted(FACE - names)}"
    assert len(names) <= 30


def test_renamed_names_are_out_of_dir_and_not_face():
    stack = Stack(NetworkConfig())
    assert set(RENAMED) == {"close", "spawn", "flow_events", "flow_stats"}
    assert not set(RENAMED) & public_names(stack)
    assert not set(MOVED) & public_names(stack)


def test_renamed_names_still_work_with_a_deprecation_warning():
    async def main():
        async with Stack(NetworkConfig()) as stack:
            with pytest.warns(DeprecationWarning, match=r"Stack\.close is deprecated: it is now Stack\.stop"):
                close = stack.close
            assert close == stack.stop
            with pytest.warns(DeprecationWarning, match=r"Stack\.spawn is deprecated: it is now Stack\.spawn_task"):
                task = stack.spawn(asyncio.sleep(0, "done"), name="t")
            assert await task == "done"
            with pytest.warns(DeprecationWarning, match=r"Stack\.flow_events is deprecated"):
                records = stack.flow_events(maxlen=2)
            assert stack.parts.audit is not None  # started a log without a file, as audit_records() does
            await records.aclose()
            with pytest.warns(DeprecationWarning, match=r"Stack\.flow_stats is deprecated"):
                assert stack.flow_stats() == stack.stats()["flows"] == {}

    asyncio.run(main())


def test_a_moved_internal_names_where_it_went():
    stack = Stack(NetworkConfig())
    for old, new in (("guard", "parts.guard"), ("inject", "parts.inject_queue.put"), ("mtu", "config.mtu"),
                     ("_on_frames", "parts.link.on_frames"), ("icmp_errors", "parts.family4.err_bucket")):
        with pytest.raises(AttributeError, match=rf"'Stack' object has no attribute '{old}': it is stack\.{new} now"):
            getattr(stack, old)
        target = stack
        for part in new.split("."):
            target = getattr(target, part)  # the place named exists
    assert not hasattr(stack, "no_such_name")  # an unknown name: a plain AttributeError
    with pytest.raises(AttributeError, match=r"^'Stack' object has no attribute 'no_such_name'$"):
        stack.no_such_name


def test_parts_are_the_live_parts_and_read_only():
    stack = Stack(NetworkConfig(ipv6=True))
    parts = stack.parts
    assert isinstance(parts, StackParts) and stack.parts is parts
    assert parts.flows is parts.table.flows and type(parts.flows) is dict
    assert parts.ctx.table is parts.table and parts.ctx.guard is parts.guard and parts.ctx.queue is parts.inject_queue
    assert parts.link.fam4 is parts.family4 and parts.v6.family is parts.family6
    assert parts.dns is None and parts.loop is None and parts.audit is None and parts.closed is False
    with pytest.raises(AttributeError, match="stack.parts is read-only: 'guard' cannot be rebound"):
        parts.guard = None
    with pytest.raises(AttributeError, match="read-only"):
        del parts.table
    with pytest.raises(AttributeError):
        stack.parts = None  # a property without a setter
    assert not hasattr(parts, "__dict__")

    async def main():
        async with stack:
            assert parts.dns is parts.ctx.running.dns is not None
            assert parts.loop is asyncio.get_running_loop()
            assert parts.dhcp is parts.family4.dhcp_server is not None
        assert parts.closed is True

    asyncio.run(main())


def test_flows_is_a_method_of_records_and_the_dict_reads_warn():
    async def main():  # flows exist once the stack runs (records are at its loop time)
        async with Stack(NetworkConfig()) as stack:
            stack.parts.flows[flow.key] = flow
            try:
                check(stack)
            finally:
                del stack.parts.flows[flow.key]

    def check(stack):
        assert isinstance(stack.flows, FlowRecords)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # calling it is the interface: no warning
            (info,) = stack.flows()
        assert isinstance(info, FlowInfo)
        assert info.destination == ("93.184.216.34", 443) and info.guest == ("10.0.2.15", 40000)
        assert info.host == "93.184.216.34"
        with pytest.warns(DeprecationWarning, match=r"FlowInfo\.remote is deprecated: it is now FlowInfo\.destination"):
            assert info.remote == info.destination
        for read in (len, bool, list, lambda f: flow.key in f, lambda f: f[flow.key], lambda f: list(f.values()),
                     lambda f: list(f.keys()), lambda f: list(f.items()), lambda f: f.get(flow.key)):
            with pytest.warns(DeprecationWarning, match=r"stack\.parts\.flows"):
                assert read(stack.flows)

    flow = _Flow()
    asyncio.run(main())


def test_request_stop_stops_a_stack_of_ones_own_written_for_0_1():
    class Old:  # a stack_factory's stack of 0.1: close() only
        closed = 0

        def close(self):
            self.closed += 1

    class New:
        stopped = 0

        def stop(self):
            self.stopped += 1

    new = New()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        request_stop(new)
    assert new.stopped == 1
    old = Old()
    with pytest.warns(DeprecationWarning, match=r"Old has no stop\(\): a stack's close\(\) is now stop\(\)"):
        request_stop(old)
    assert old.closed == 1


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_embedder_types_import_from_aioslirp_as_themselves(name):
    assert name in aioslirp.__all__ and name in dir(aioslirp)
    assert getattr(aioslirp, name) is getattr(importlib.import_module(EXPORTED[name]), name)


class _Flow:
    """What ``flow_info`` reads of a flow (:class:`aioslirp.flow.base.Flow`)."""

    key = (6, bytes([10, 0, 2, 15]), 40000, bytes([93, 184, 216, 34]), 443)
    proto_name = "tcp"
    guest_ip, guest_port = bytes([10, 0, 2, 15]), 40000
    dst_ip, dst_port = bytes([93, 184, 216, 34]), 443
    remote = "93.184.216.34"
    name = rule = forward_id = None
    state = "ESTABLISHED"
    bytes_up = bytes_down = 0
    started = last_active = 0.0
    direction = "outbound"
