"""aioslirp.heap: glibc's trim threshold set once per process, by Stack.start."""

from __future__ import annotations

import subprocess
import sys


def test_a_started_stack_keeps_freed_heap_in_a_fresh_process():
    """In a fresh interpreter: not set before a Stack starts; set (True) once one did; idempotent."""
    code = (
        "import asyncio, aioslirp.heap as h\n"
        "from aioslirp import Stack\n"
        "before = h._done\n"
        "async def main():\n"
        "    async with Stack():\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "print(before, h._done, h.keep_freed_heap())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True", "True"]
