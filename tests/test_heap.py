"""What a process frees goes back to the OS (memory/heap.py): glibc keeps it otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, threading
from primaplug.memory import heap
def anon():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon"))
if sys.argv[1] == "fixed":
    assert heap.map_large_blocks()
before = anon()
def work():  # as a profile or a load does, off the main thread: the same large block twice
    for _ in range(2):
        block = bytearray(20 << 20)
        del block
t = threading.Thread(target=work)
t.start()
t.join()
heap.return_freed_memory()
print(anon() - before)
"""


def _growth(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in sys.version, reason="glibc's allocator")
def test_a_node_keeps_no_freed_block_even_off_the_main_thread() -> None:
    """With glibc's rising threshold the second 20 MiB block comes from the thread's heap and stays after it is
    freed, trim or not; a node fixes the threshold (`primaplug node`) and keeps nothing."""
    assert _growth("fixed") < 4 << 20, f"{_growth('fixed') >> 20} MiB kept"
