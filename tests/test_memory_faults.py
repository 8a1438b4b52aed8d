"""The node's fault counter: major faults of compute, the prefetcher's own faults left out."""

from __future__ import annotations

import mmap
import os
import sys
import threading

import pytest

from primaplug.memory import drop_file_cache
from primaplug.memory.system import major_faults, thread_major_faults

PAGES = 64


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread fault counts are read from /proc")
def test_a_threads_own_faults_are_told_apart(tmp_path) -> None:
    path = tmp_path / "data"
    with open(path, "wb") as f:
        f.write(os.urandom(PAGES * mmap.PAGESIZE))
        os.fsync(f.fileno())  # dirty pages cannot be dropped from the page cache
    drop_file_cache(path)
    go, done, leave = threading.Event(), threading.Event(), threading.Event()
    own: list[int] = []

    def reader() -> None:  # stays alive until measured, as the prefetcher's thread lives as long as its windows
        go.wait()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m.madvise(mmap.MADV_RANDOM)  # no readahead: every page is a fault of its own
            before = thread_major_faults()
            sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))
            own.append(thread_major_faults() - before)  # as the prefetch thread counts its own
        done.set()
        leave.wait()

    t = threading.Thread(target=reader)
    t.start()
    try:
        all_before, its_before = major_faults(), thread_major_faults(t.native_id)
        go.set()
        done.wait(10)
        all_after, its_after = major_faults(), thread_major_faults(t.native_id)
    finally:
        leave.set()
        t.join()
    assert all_after - all_before >= PAGES // 2  # the reader's faults count in the process's total
    # and the same faults are the reader's own, read by another thread (/proc) or by the reader itself
    assert all_after - all_before - 2 <= its_after - its_before <= all_after - all_before
    assert own == [its_after - its_before]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread fault counts are Linux's")
def test_prefetcher_counts_compute_faults_not_its_own(tmp_path) -> None:
    """Window 0 is prefetched by the prefetcher's thread (its faults), then compute touches an unplanned region
    (compute's faults); window 1's prefetch runs while window 1 starts, so its count is read while busy."""
    from primaplug.memory.policy import plan_prefetch
    from primaplug.memory.prefetcher import Prefetcher

    page = mmap.PAGESIZE
    path = tmp_path / "model"
    with open(path, "wb") as f:
        f.write(os.urandom(3 * PAGES * page))
        os.fsync(f.fileno())
    drop_file_cache(path)
    windows = [[(0, PAGES * page)], [(PAGES * page, PAGES * page)]]
    plan = plan_prefetch(windows, int(1.5 * PAGES * page), keep=False)  # one window at a time: no early prefetch
    assert plan.mode == "stream" and not plan.early
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:  # as llama.cpp maps it
        p = Prefetcher(str(path), plan)
        try:
            assert p.advisor.populate, "the prefetcher should populate the mapping (its own faults)"
            assert p.wait_idle(10)  # window 0 is in, faulted by the prefetch thread
            p.window_started(0)
            unplanned = range(2 * PAGES * page, 3 * PAGES * page, page)
            m.madvise(mmap.MADV_RANDOM)
            sum(m[i] for i in unplanned)  # compute's own faults
            p.window_done(0, last_of_token=False)  # releases 0, prefetches 1: the thread is busy now
            first = p.stats.compute_major_faults
            p.window_started(1)
            assert p.wait_idle(10)
            p.window_done(1, last_of_token=True)
        finally:
            p.close()
    assert PAGES // 2 <= first <= PAGES + 2  # the unplanned pages, not window 0's prefetch
    assert p.stats.compute_major_faults - first <= 2  # window 1's prefetch is not compute's
