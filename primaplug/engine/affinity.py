"""Pinning a window's compute threads to distinct cores, when they use all of them.

Why: a process whose compute threads have slept (while other devices of the ring computed) wakes its ggml
worker from the computing thread, and Linux places a woken thread beside its waker while the other cores sit
idle. The two then share one core and each spins at ggml's barriers while the other runs: on the 2-core test
machine the first two tokens after a pause of 50 ms or more took 18-21 ms in a node instead of 7 ms (per-thread
schedstat: twice the CPU time, 4-12 ms runnable but waiting). Pinning each thread to a core of its own, as
llama.cpp's `--cpu-strict 1` does, removes it (`docs/ring.md`).

Only when the threads use every core the process may run on: then nothing is left for the scheduler to choose,
and pinning cannot crowd a core that was free. With fewer threads than cores it stays off (on big.LITTLE phones
the first cores are the slow ones).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from primaplug.core.settings import allowed_cpus


def pinned_cpus(n_threads: int, pin: bool | None) -> list[int] | None:
    """The cores to pin n_threads threads to (ggml's order: workers 1..n-1, then the calling thread), or None.

    pin: True to pin, False never, None where the threads use every allowed core (see the module's note).
    """
    cpus = allowed_cpus()
    if pin is False or cpus is None or n_threads < 2:
        return None
    if pin is None and n_threads < len(cpus):
        return None
    return [cpus[i % len(cpus)] for i in range(n_threads)]


@contextlib.contextmanager
def on_cpu(cpu: int | None) -> Iterator[None]:
    """Run the calling thread on one core (None: leave it be), then give it back the cores it had."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:  # the core was taken from this process since (a cpuset changed): compute unpinned
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
