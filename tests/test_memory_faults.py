"""The node's fault counter: major faults of compute, the prefetcher's own faults left out."""

from __future__ import annotations

import mmap
import os
import sys
import threading

import pytest

from primaplug.memory import drop_file_cache
from primaplug.memory.system import major_faults

PAGES = 64


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread fault counts are read from /proc")
def test_faults_of_an_excluded_thread_are_left_out(tmp_path) -> None:
    path = tmp_path / "data"
    with open(path, "wb") as f:
        f.write(os.urandom(PAGES * mmap.PAGESIZE))
        os.fsync(f.fileno())  # dirty pages cannot be dropped from the page cache
    drop_file_cache(path)
    go, done, leave = threading.Event(), threading.Event(), threading.Event()

    def reader() -> None:  # stays alive until measured, as the prefetcher's thread lives as long as its windows
        go.wait()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m.madvise(mmap.MADV_RANDOM)  # no readahead: every page is a fault of its own
            sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))
        done.set()
        leave.wait()

    t = threading.Thread(target=reader)
    t.start()
    try:
        all_before, rest_before = major_faults(), major_faults(frozenset({t.native_id}))
        go.set()
        done.wait(10)
        all_after, rest_after = major_faults(), major_faults(frozenset({t.native_id}))
    finally:
        leave.set()
        t.join()
    assert all_after - all_before >= PAGES // 2  # the reader's faults count in the process's total
    assert rest_after - rest_before <= 2  # and not when its thread is left out
