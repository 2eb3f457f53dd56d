"""The embedding API: ``aioslirp.spawn`` (a command in its own namespaces behind its own stack),
``Stack.flows()``, ``Stack.events()``; through the public API only.

pytest runs in a loopback-only network namespace (conftest.py): the host servers listen on
127.0.0.1 there and the guests reach them through the gateway 10.0.2.2.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import shutil
import signal
import sys
import textwrap
import time

import pytest

import aioslirp

from support import nativeinit
from support.paths import REPO
from support.prereqs import need
from support.servers import DataServer, pattern

pytestmark = pytest.mark.netns

need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")

PIPE = asyncio.subprocess.PIPE


@pytest.fixture(scope="module")
def native_init(tmp_path_factory) -> str:
    """The native init (installed, or built here from aioslirp/native/init.c)."""
    return nativeinit.build(tmp_path_factory.mktemp("init"))


@pytest.fixture(autouse=True)
def _with_native_init(native_init, monkeypatch):
    """Every guest here gets the native init, also in a checkout that was never built."""
    monkeypatch.setenv("AIOSLIRP_INIT", native_init)


@pytest.fixture
def server():
    srv = DataServer()
    yield srv
    srv.close()


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def sleeping_pids(marker: str) -> list[int]:
    """Pids of processes whose command line contains ``marker``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(int(name))
    return out


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_a_string_argv_raises_type_error_at_once():
    with pytest.raises(TypeError, match="argv"):
        aioslirp.spawn("true")
    with pytest.raises(TypeError, match="argv"):
        aioslirp.spawn(b"true")


async def test_fetch_20mb_through_the_gateway_sha256_on_stdout(server):
    n = 20 * 1024 * 1024
    code = f"""
        import hashlib, socket
        s = socket.create_connection(("10.0.2.2", {server.port}))
        s.sendall(b"DOWN {n} 7\\n")
        h, got = hashlib.sha256(), 0
        while True:
            b = s.recv(1 << 20)
            if not b:
                break
            h.update(b); got += len(b)
        print(got, h.hexdigest())
    """
    async with aioslirp.spawn(py(code), stdout=PIPE) as guest:
        out = await guest.stdout.read()
        assert await guest.wait() == 0
    got, digest = out.decode().split()
    assert int(got) == n
    assert digest == hashlib.sha256(pattern(n, 7)).hexdigest()


@pytest.mark.parametrize("pid_namespace", [True, False])
async def test_exit_status_is_passed_through(pid_namespace):
    async with aioslirp.spawn(["sh", "-c", "exit 7"], pid_namespace=pid_namespace) as guest:
        assert await guest.wait() == 7
        assert guest.returncode == 7
    async with aioslirp.spawn(["sleep", "100"], pid_namespace=pid_namespace) as guest:
        guest.kill()
        assert await guest.wait() == -9


async def test_terminate_reaches_the_command_in_its_pid_namespace():
    async with aioslirp.spawn(["sleep", "100"]) as guest:
        await asyncio.sleep(0.2)
        guest.terminate()
        assert await asyncio.wait_for(guest.wait(), 5) == -15


async def test_a_background_process_left_behind_does_not_outlive_the_block():
    marker = "1000.25"  # a sleep argument nothing else uses
    async with aioslirp.spawn(["sh", "-c", f"sleep {marker} & echo started; exit 0"], stdout=PIPE) as guest:
        assert (await guest.stdout.readline()).strip() == b"started"
        assert await guest.wait() == 0
    for _ in range(50):
        if not sleeping_pids(f"sleep {marker}"):
            break
        await asyncio.sleep(0.05)
    assert sleeping_pids(f"sleep {marker}") == []


async def test_env_and_cwd_reach_the_guest(tmp_path):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "AIOSLIRP_TEST_VALUE": "forty-two"}
    async with aioslirp.spawn(["sh", "-c", 'echo "$AIOSLIRP_TEST_VALUE"; pwd'], env=env, cwd=tmp_path,
                              stdout=PIPE) as guest:
        out, _ = await guest.communicate()
    assert out.decode().split() == ["forty-two", str(tmp_path)]


async def test_a_large_environment_and_a_low_file_size_limit_reach_the_guest():
    """The spec travels through a pipe to the namespace child: larger than a pipe's default 64 KiB,
    and under an RLIMIT_FSIZE of 4 KiB, less than the spec (a file, even a memory file, would fail
    with EFBIG; the child writes only a small resolv.conf)."""
    import resource

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env.update({f"AIOSLIRP_BIG{i}": "x" * 100_000 for i in range(3)})  # one string may be 128 KiB at most
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
    try:
        async with aioslirp.spawn(["sh", "-c", 'printf %s "$AIOSLIRP_BIG0$AIOSLIRP_BIG1$AIOSLIRP_BIG2" | wc -c'], env=env, stdout=PIPE) as guest:
            out, _ = await guest.communicate()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    assert out.split() == [b"300000"] and guest.returncode == 0


async def test_stdin_pipe_and_stderr():
    async with aioslirp.spawn(["sh", "-c", "cat; echo oops >&2"], stdin=PIPE, stdout=PIPE, stderr=PIPE) as guest:
        out, err = await guest.communicate(b"hello\n")
    assert out == b"hello\n" and err == b"oops\n" and guest.returncode == 0


async def test_a_missing_command_raises_file_not_found():
    with pytest.raises(FileNotFoundError):
        async with aioslirp.spawn(["aioslirp-no-such-command"]):
            pass


async def test_ten_spawns_leave_fds_and_rss_where_they_started():
    async def once():
        async with aioslirp.spawn(["true"], stdout=PIPE, stderr=PIPE) as guest:
            await guest.communicate()

    await once()  # warm up imports and caches
    gc.collect()
    fds, rss = len(os.listdir("/proc/self/fd")), rss_kb()
    for _ in range(10):
        await once()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert rss_kb() - rss < 8 * 1024  # KiB
    assert {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} == set()


async def test_flows_show_a_long_lived_connection_with_its_bytes_growing(server):
    code = f"""
        import socket, sys, time
        s = socket.create_connection(("10.0.2.2", {server.port}))
        s.sendall(b"UP\\n")
        print("connected", flush=True)
        while True:
            s.sendall(b"x" * 16384)
            time.sleep(0.05)
    """
    async with aioslirp.spawn(py(code), stdout=PIPE) as guest:
        assert (await guest.stdout.readline()).strip() == b"connected"

        def ours():
            found = [f for f in guest.stack.flows()
                     if f.protocol == "tcp" and f.destination == ("10.0.2.2", server.port)]
            assert len(found) == 1, guest.stack.flows()
            return found[0]

        first = ours()
        await asyncio.sleep(0.5)
        second = ours()
        assert isinstance(first, aioslirp.FlowInfo)
        assert first.state == second.state == "ESTABLISHED"
        assert first.guest[0] == "10.0.2.15" and first.name is None and first.direction == "outbound"
        assert second.bytes_from_guest > first.bytes_from_guest > 0
        assert second.age > first.age >= 0
        assert second.bytes_to_guest == 0


async def test_events_yield_ready_then_guest_link_up_then_down():
    seen = []
    async with aioslirp.spawn(["sh", "-c", "ping -c1 -W1 10.0.2.2 >/dev/null 2>&1; sleep 0.2"]) as guest:
        remove = guest.stack.on_event(lambda ev: seen.append(ev.name))
        names = []
        async for ev in guest.stack.events():
            names.append(ev.name)
            if ev.name == "guest_link_up":
                break
        assert names == ["ready", "guest_link_up"]
        assert await guest.wait() == 0
    remove()
    assert seen[-1:] == ["guest_link_down"]
    history = [ev.name for ev in guest.stack.event_log.history()]
    assert history[:2] == ["ready", "guest_link_up"] and history[-1] == "guest_link_down"


async def test_the_event_history_is_bounded():
    async with aioslirp.Stack() as stack:
        for i in range(1000):
            stack.event_log.emit("error", message=str(i))
        kept = stack.event_log.history()
        assert len(kept) < 1000 and kept[-1].data["message"] == "999"
        assert stack.event_log.dropped == 1000 - len(kept)


def test_cli_events_file_gets_json_lines(tmp_path):
    import json
    import subprocess

    path = tmp_path / "events.jsonl"
    p = subprocess.run([sys.executable, "-m", "aioslirp", "run", "--events", str(path), "--", "sh", "-c",
                        "ping -c1 -W1 10.0.2.2 >/dev/null 2>&1; exit 0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    events = [json.loads(line) for line in path.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[:2] == ["ready", "guest_link_up"] and names[-1] == "guest_link_down", names
    assert events[0]["gvproxy"] == "Ready" and events[0]["ifname"] == "tap0"


async def test_serving_a_tap_that_is_down_is_one_clear_error_at_once():
    import subprocess

    subprocess.run(["ip", "tuntap", "add", "dev", "aiodown0", "mode", "tap"], check=True)
    try:
        async with aioslirp.Stack() as stack:
            transport = aioslirp.TapTransport.open_by_name("aiodown0")
            with pytest.raises(OSError) as info:
                await asyncio.wait_for(stack.serve(transport), 5)
            transport.close()
            assert "ip link set aiodown0 up" in str(info.value) and "\n" not in str(info.value)
            assert [ev.name for ev in stack.event_log.history()] == ["error"]
    finally:
        subprocess.run(["ip", "tuntap", "del", "dev", "aiodown0", "mode", "tap"], check=True)


async def test_serving_a_tap_name_that_did_not_exist_says_so():
    """A mistyped name: opening it makes a new, unattached TAP; serving it says the name did not
    exist (not "bring it up", which would not help)."""
    async with aioslirp.Stack() as stack:
        transport = aioslirp.TapTransport.open_by_name("aionosuch0")
        try:
            with pytest.raises(aioslirp.TapError) as info:
                await asyncio.wait_for(stack.serve(transport), 5)
        finally:
            transport.close()
        msg = str(info.value)
        assert "no interface aionosuch0 existed" in msg and "ip tuntap add dev aionosuch0" in msg, msg
        assert "\n" not in msg


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    after = text[text.index("Embedding:"):]
    start = after.index("```python\n") + len("```python\n")
    return after[start:after.index("```", start)]


def test_the_readme_embedding_example_runs_as_written(tmp_path):
    import subprocess

    script = tmp_path / "example.py"
    script.write_text(readme_example())
    # In a network namespace of its own: the example listens on the fixed port 8000, which another
    # test (in random order) may still hold in the suite's shared namespace.
    p = subprocess.run(["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$1"', sys.executable,
                        str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "hello from the host" and lines[1] == "exit status 0", p.stdout
    assert "'ready', 'guest_link_up'" in lines[2]


async def test_attach_serves_an_existing_namespace_with_a_given_stack():
    import subprocess

    target = subprocess.Popen(["unshare", "--net", "sleep", "30"])
    try:
        await asyncio.sleep(0.2)
        async with aioslirp.Stack() as stack:
            task = asyncio.create_task(aioslirp.attach(stack.config, pid=target.pid, ifname="eth9", stack=stack))

            async def first_event():
                async for ev in stack.events():
                    return ev.name

            assert await asyncio.wait_for(first_event(), 10) == "ready"
            stack.stop()
            assert await asyncio.wait_for(task, 10) == 0
    finally:
        target.kill()
        target.wait()


async def test_a_namespace_that_cannot_be_set_up_is_one_line_at_once():
    import time

    start = time.monotonic()
    with pytest.raises(aioslirp.NamespaceError) as info:
        async with aioslirp.spawn(["true"], ifname="x" * 40):  # longer than IFNAMSIZ
            pass
    assert time.monotonic() - start < 10
    assert "\n" not in str(info.value) and "x" * 15 in str(info.value)


# ---------------------------------------------------------------------------- what helpers publish


def descendants(root: int) -> dict[int, tuple[bytes, bytes]]:
    """``{pid: (cmdline, environ)}`` of every process below ``root`` (from ``/proc/*/stat``'s ppid)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parent[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    below, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in below]
        below.update(kids)
        todo += kids
    out = {}
    for pid in below:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        out[pid] = (cmd, env)
    return out


class ProcWatch:
    """A thread polling :func:`descendants` of ``root`` every millisecond: ``seen`` is every distinct
    ``(pid, cmdline, environ)`` met, so a helper's short-lived states (before it execs) are caught too."""

    def __init__(self, root: int) -> None:
        import threading

        self.root, self.seen, self._stop = root, set(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        while not self._stop.is_set():
            for pid, (cmd, env) in descendants(self.root).items():
                self.seen.add((pid, cmd, env))
            time.sleep(0.001)

    def stop(self) -> set:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def helpers_showing(seen: set, secret: bytes, guest: tuple) -> tuple[list, list]:
    """``(helper command lines seen, those of them whose cmdline or environ holds secret)``: helpers are
    every process seen but the guest's own (its cmdline's first word is in ``guest``)."""
    # A guest process in the middle of its execve or exit can show an empty cmdline beside its own
    # environ: a sample with no cmdline is the guest's when that PID was also seen running a guest word.
    guest_pids = {pid for pid, cmd, _ in seen if cmd.split(b"\0", 1)[0] in guest}
    helpers = [(pid, cmd, env) for pid, cmd, env in seen
               if cmd.split(b"\0", 1)[0] not in guest and not (cmd == b"" and pid in guest_pids)]
    return [cmd for _, cmd, _ in helpers], [cmd for _, cmd, env in helpers if secret in cmd or secret in env]


@pytest.mark.parametrize("pid_namespace", [True, False])
async def test_argv_env_and_config_never_show_in_a_helpers_proc_entries(pid_namespace):
    """Issue 24 item 7: what a caller hands spawn() (argv, env, a config value that ends up in the
    guest's resolv.conf) is readable by every host user in a process's ``/proc/PID/cmdline`` (and
    by its owner in ``environ``): no helper process (the namespace child, the PID 1 it forks, in
    any state before the exec) shows it, while the guest still gets all of it."""
    secret = os.urandom(6).hex()
    watch = ProcWatch(os.getpid())
    try:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "API_KEY": f"env-{secret}"}
        config = aioslirp.NetworkConfig(dns_search=[f"cfg-{secret}.test"])
        argv = ["sh", "-c", 'echo "$API_KEY" "$1"; grep ^search /etc/resolv.conf; sleep 0.5', "sh", f"arg-{secret}"]
        async with aioslirp.spawn(argv, config=config, env=env, stdout=PIPE, pid_namespace=pid_namespace) as guest:
            out, _ = await guest.communicate()
    finally:
        seen = watch.stop()
    assert out.decode().split() == [f"env-{secret}", f"arg-{secret}", "search", f"cfg-{secret}.test"]
    cmds, leaks = helpers_showing(seen, secret.encode(), (b"sh", b"grep", b"sleep"))
    assert any(b"aioslirp.host.nschild" in c for c in cmds), cmds  # the watch did see the helper
    if pid_namespace:  # and the native init it became, and the PID 1 it forked (same command line)
        inits = {pid for pid, cmd, _ in seen if cmd.split(b"\0", 1)[0].endswith(b"/aioslirp-init")}
        assert len(inits) >= 2, cmds
    assert leaks == []


def test_aioslirp_run_helpers_show_nothing_of_the_command_or_config():
    """The same for ``aioslirp run``: its own command line holds what its user typed, its helper's
    holds none of it."""
    import subprocess

    secret = os.urandom(6).hex()
    watch = ProcWatch(os.getpid())
    try:
        p = subprocess.Popen([sys.executable, "-m", "aioslirp", "run", "--dns-search", f"cfg-{secret}.test", "--",
                              "sh", "-c", 'echo "$1"; grep ^search /etc/resolv.conf', "sh", f"arg-{secret}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=60)
    finally:
        seen = watch.stop()
    assert p.returncode == 0, err
    assert out.split() == [f"arg-{secret}", "search", f"cfg-{secret}.test"]
    own = {cmd for pid, cmd, _ in seen if pid == p.pid}
    # aioslirp run itself, and its forks in the instant before they exec the helper (its own cmdline)
    seen = {s for s in seen if s[0] != p.pid and s[1] not in own}
    cmds, leaks = helpers_showing(seen, secret.encode(), (b"sh", b"grep"))
    assert any(b"aioslirp.host.nschild" in c for c in cmds), cmds
    assert leaks == []


# ------------------------------------------------------------- the native init: no interpreter per guest


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    return [root, *descendants(root)]


def exe(pid: int) -> str:
    return os.path.realpath(f"/proc/{pid}/exe")


def memory_kb(pid: int) -> tuple[int, int]:
    """``(RSS, PSS)`` of ``pid`` in KiB (``/proc/PID/smaps_rollup``)."""
    got = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                got[key] = int(rest.split()[0])
    return got["Rss"], got["Pss"]


def helpers_of(guest) -> list[int]:
    """The helper processes of a guest in its PID namespace: its top process (the namespace
    helper) and that one's only child (PID 1 of the namespace), top first."""
    kids = []
    for pid in descendants(guest.pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == guest.pid:
                    kids.append(pid)
    return [guest.pid, *kids]


async def test_twenty_guests_leave_no_interpreter_beside_the_service(native_init):
    """Issue 28 item 1: 20 guests alive at once; below each, besides its command, only the native
    init (the namespace helper, which execed it, and PID 1 of the guest's PID namespace): no
    Python interpreter, and a few hundred KiB each."""
    sleep = os.path.realpath(shutil.which("sleep"))
    n = 20
    async with contextlib.AsyncExitStack() as stack:
        guests = [await stack.enter_async_context(aioslirp.spawn(["sleep", "30"])) for _ in range(n)]
        await asyncio.sleep(0.3)  # every PID 1 has forked its command
        below = {pid: exe(pid) for pid in descendants(os.getpid())}  # everything this service started
        others = [path for path in below.values() if path != sleep]
        assert not [path for path in others if "python" in os.path.basename(path)], others
        assert others == [os.path.realpath(native_init)] * (2 * n), others
        rss = pss = 0
        for guest in guests:
            tree = process_tree(guest.pid)
            helpers = helpers_of(guest)
            assert [exe(pid) for pid in helpers] == [os.path.realpath(native_init)] * 2, \
                [(pid, exe(pid)) for pid in tree]
            assert len(tree) == 3  # the init, its PID 1, the command
            for pid in helpers:
                r, p = memory_kb(pid)
                rss, pss = rss + r, pss + p
        print(f"\n{n} guests: helpers RSS {rss / n:.0f} KiB/guest, PSS {pss / n:.0f} KiB/guest")
        assert rss / n < 3 * 1024, rss  # KiB per guest, both processes
        assert pss / n < 1024, pss
        for guest in guests:
            assert guest.returncode is None
    assert [g.returncode for g in guests] == [-15] * n  # the block's end: SIGTERM reached each command


def native_and_fallback(request, monkeypatch, native_init) -> str:
    """Set up the parametrized mode: ``"native"`` (the native init), ``"fallback"`` (``AIOSLIRP_NO_EXTENSIONS=1``:
    the Python PID 1). Returns the mode."""
    if request.param == "native":
        nativeinit.use(monkeypatch, native_init)
    else:
        monkeypatch.setenv("AIOSLIRP_NO_EXTENSIONS", "1")
    return request.param


@pytest.fixture(params=["native", "fallback"])
def init_mode(request, monkeypatch, native_init) -> str:
    return native_and_fallback(request, monkeypatch, native_init)


def assert_helpers(guest, mode: str, native_init: str) -> None:
    """The guest's helpers are two native inits (``native``) or two Python interpreters (``fallback``)."""
    helpers = [exe(pid) for pid in helpers_of(guest)]
    if mode == "native":
        assert helpers == [os.path.realpath(native_init)] * 2, helpers
    else:
        assert len(helpers) == 2 and all("python" in os.path.basename(h) for h in helpers), helpers


@pytest.mark.parametrize("script, status", [("exit 0", 0), ("exit 7", 7), ("exit 255", 255),
                                            ("kill -TERM $$", -15), ("kill -USR1 $$", -10),
                                            ("kill -SEGV $$", -11), ("kill -QUIT $$", -3)])
async def test_exit_status_and_death_by_signal_are_the_commands(init_mode, native_init, script, status):
    """The guest's ``returncode`` is the command's: its exit status, or ``-N`` when it died of
    signal N (with no core file of the helpers'), the native init as the Python PID 1."""
    async with aioslirp.spawn(["sh", "-c", f"read x; {script}"], stdin=PIPE) as guest:
        assert_helpers(guest, init_mode, native_init)
        await guest.communicate(b"go\n")
        assert guest.returncode == status


async def test_signals_are_passed_on_to_the_command(init_mode, native_init):
    """SIGUSR1, SIGHUP, SIGTERM sent to the guest reach the command (through the init and its PID 1)."""
    script = "trap 'echo usr1' USR1; trap 'echo hup' HUP; trap 'echo term; exit 3' TERM; echo ready; " \
             "while :; do sleep 0.05; done"
    async with aioslirp.spawn(["sh", "-c", script], stdout=PIPE) as guest:
        assert await guest.stdout.readline() == b"ready\n"
        assert_helpers(guest, init_mode, native_init)
        for sig, line in ((signal.SIGUSR1, b"usr1\n"), (signal.SIGHUP, b"hup\n"), (signal.SIGTERM, b"term\n")):
            guest.send_signal(sig)
            assert await asyncio.wait_for(guest.stdout.readline(), 5) == line
        assert await asyncio.wait_for(guest.wait(), 5) == 3


async def test_orphans_are_reaped_and_killed_with_the_command(init_mode, native_init):
    """Orphans of the command become PID 1's: one that exits is reaped at once (no zombie), one
    that lives on is killed when the command exits."""
    marker = "1000.75"
    script = f"(sh -c 'exit 0' &); (sleep {marker} &); echo forked; read x"
    async with aioslirp.spawn(["sh", "-c", script], stdin=PIPE, stdout=PIPE) as guest:
        assert await guest.stdout.readline() == b"forked\n"
        assert_helpers(guest, init_mode, native_init)
        await asyncio.sleep(0.3)
        tree = process_tree(guest.pid)
        states = {}
        for pid in tree:
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/stat", "rb") as f:
                    states[pid] = f.read().rsplit(b")", 1)[1].split()[0]
        assert b"Z" not in states.values(), states
        assert [exe(pid) for pid in tree].count(os.path.realpath(shutil.which("sleep"))) == 1, tree
        await guest.communicate(b"done\n")
        assert guest.returncode == 0
        for _ in range(50):
            if not sleeping_pids(f"sleep {marker}"):
                break
            await asyncio.sleep(0.05)
        assert sleeping_pids(f"sleep {marker}") == []


async def test_killing_the_top_process_kills_the_whole_namespace(init_mode, native_init):
    """SIGKILL to the guest's top process (the native init cannot pass it on): its PID 1 dies
    of ``PR_SET_PDEATHSIG``, and with it every process of the namespace."""
    marker = "1000.5"
    async with aioslirp.spawn(["sh", "-c", f"sleep {marker} & echo ok; wait"], stdout=PIPE) as guest:
        assert await guest.stdout.readline() == b"ok\n"
        assert_helpers(guest, init_mode, native_init)
        guest.kill()
        assert await asyncio.wait_for(guest.wait(), 5) == -9
        for _ in range(50):
            if not sleeping_pids(f"sleep {marker}"):
                break
            await asyncio.sleep(0.05)
        assert sleeping_pids(f"sleep {marker}") == []


async def test_exec_errors_in_the_native_init_are_raised_as_before(native_init, monkeypatch, tmp_path):
    """A missing command, a directory that is no executable, a missing cwd: the same ``OSError``
    as ``asyncio.create_subprocess_exec`` (with the name), the native init as the Python helper."""
    nativeinit.use(monkeypatch, native_init)
    with pytest.raises(FileNotFoundError) as info:
        async with aioslirp.spawn(["aioslirp-no-such-command"]):
            pass
    assert info.value.filename == "aioslirp-no-such-command"
    with pytest.raises(PermissionError):
        async with aioslirp.spawn([str(tmp_path)]):
            pass
    with pytest.raises(FileNotFoundError) as info:
        async with aioslirp.spawn(["true"], cwd=tmp_path / "gone"):
            pass
    assert info.value.filename == str(tmp_path / "gone")
    env = {"PATH": str(tmp_path)}  # looked up in the command's own PATH, as os.execvpe does
    (tmp_path / "hello").write_text("#!/bin/sh\nread x; echo hello from $0\n")
    (tmp_path / "hello").chmod(0o755)
    async with aioslirp.spawn(["hello"], env=env, stdin=PIPE, stdout=PIPE) as guest:
        assert_helpers(guest, "native", native_init)
        out, _ = await guest.communicate(b"\n")
    assert out == f"hello from {tmp_path}/hello\n".encode()


def test_nul_characters_and_bad_env_names_are_one_error_at_once():
    with pytest.raises(ValueError, match="NUL"):
        aioslirp.spawn(["echo", "a\0b"])
    with pytest.raises(ValueError, match="env: the value of X"):
        aioslirp.spawn(["true"], env={"X": "a\0b"})
    with pytest.raises(ValueError, match="env: illegal environment variable name 'A=B'"):
        aioslirp.spawn(["true"], env={"A=B": "c"})


async def test_without_a_native_init_a_python_pid1_runs_and_says_so_once_per_guest(monkeypatch, caplog, tmp_path):
    """The fallback: no native init (``AIOSLIRP_NO_EXTENSIONS=1``, or ``AIOSLIRP_INIT`` naming no
    executable) is one INFO line and today's Python PID 1; an init that cannot be executed
    (not a program) makes the helper fall back by itself. The guest runs the same in each case."""
    import logging

    bogus = tmp_path / "aioslirp-init"
    bogus.write_text("not a program\n")
    for setting, executable, says in (("AIOSLIRP_NO_EXTENSIONS", False, True), ("AIOSLIRP_INIT", False, True),
                                      ("AIOSLIRP_INIT", True, False)):
        monkeypatch.delenv("AIOSLIRP_NO_EXTENSIONS", raising=False)
        monkeypatch.setenv("AIOSLIRP_INIT", str(bogus))
        bogus.chmod(0o755 if executable else 0o644)
        if setting == "AIOSLIRP_NO_EXTENSIONS":
            monkeypatch.setenv(setting, "1")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="aioslirp.spawn"):
            async with aioslirp.spawn(["sh", "-c", "read x; echo $x; exit 5"], stdin=PIPE, stdout=PIPE) as guest:
                assert_helpers(guest, "fallback", "")
                out, _ = await guest.communicate(b"fine\n")
        assert (out, guest.returncode) == (b"fine\n", 5)
        notes = [r for r in caplog.records if "Python PID 1" in r.getMessage()]
        assert [(r.levelname, "\n" in r.getMessage()) for r in notes] == ([("INFO", False)] if says else []), \
            (setting, executable, caplog.text)


def sleeps(marker: str) -> list[int]:
    """Pids of the ``sleep MARKER`` processes (not of a shell whose script names it)."""
    return [pid for pid in sleeping_pids(f"sleep {marker}")
            if _cmdline(pid) == f"sleep\0{marker}\0".encode()]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_when_the_service_dies_its_guests_die_with_it(init_mode, native_init, tmp_path):
    """The service SIGKILLed (no clean-up of its own): the guest's top process gets SIGKILL
    (``PR_SET_PDEATHSIG``, kept across the exec of the native init), its PID 1 too, and with it
    everything in the namespace."""
    import subprocess

    marker = "1000.125"
    script = tmp_path / "service.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, os, sys
        import aioslirp

        async def main():
            async with aioslirp.spawn(["sh", "-c", "sleep {marker} & wait"]) as guest:
                print(guest.pid, flush=True)
                await asyncio.sleep(60)

        asyncio.run(main())
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    service = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        top = int(service.stdout.readline())
        for _ in range(100):
            if sleeps(marker) and len(descendants(service.pid)) >= 4:
                break
            time.sleep(0.05)
        helpers = [exe(pid) for pid in [top, *[p for p in descendants(top) if exe(p) == exe(top)]]]
        if init_mode == "native":
            assert helpers == [os.path.realpath(native_init)] * 2, helpers
        assert len(sleeps(marker)) == 1
        service.kill()
        service.wait(10)
        for _ in range(100):
            if not sleeps(marker) and not os.path.exists(f"/proc/{top}"):
                break
            time.sleep(0.05)
        assert sleeps(marker) == [] and not os.path.exists(f"/proc/{top}")
    finally:
        service.kill()
        service.wait(10)
        service.stdout.close()
