"""Run a command in a sandbox: default-deny egress, allowed by name, every flow audited."""
import asyncio
import sys

from aioslirp import NetworkConfig, Stack, spawn


async def report(events):
    """Print each denial as it happens (flows and DNS), and how many flows ran."""
    flows = 0
    async for rec in events:
        if rec["verdict"] == "deny":
            print(f"denied {rec['proto']}: {rec['name'] or rec['dst']}:{rec['port']} ({rec['rule']})", file=sys.stderr)
        elif rec["event"] == "flow":
            flows += 1
    print(f"{flows} flows allowed", file=sys.stderr)


async def sandbox(argv, allow, dns=None, audit_log="audit.jsonl"):
    config = NetworkConfig(
        egress_default="deny",  # reach only what a rule allows, resolve only allowed names
        egress_allow=allow,  # "pypi.org:443": the addresses the virtual DNS answers for it
        dns_upstreams=dns,  # None: the host's /etc/resolv.conf
        audit_log=audit_log,  # one JSON line per flow, denial and DNS decision
        rate_up="10mbit", rate_down="100mbit",  # per sandbox
    )
    async with Stack(config) as stack:
        reader = asyncio.create_task(report(stack.audit_records()))
        async with spawn(argv, stack=stack) as guest:
            status = await guest.wait()
    await reader  # the records end when the stack stops
    return status if status >= 0 else 128 - status  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    argv = sys.argv[1:] or ["curl", "-sI", "https://pypi.org/simple/"]
    sys.exit(asyncio.run(sandbox(argv, allow=["pypi.org:443", "files.pythonhosted.org:443"])))
