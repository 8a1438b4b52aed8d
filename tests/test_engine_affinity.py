"""Compute threads pinned to cores of their own when they use every core (engine/affinity.py says why)."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from primaplug.engine import affinity

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is a Linux call")


@pytest.mark.parametrize(("allowed", "threads", "pin", "want"), [
    ([0, 1], 2, None, [0, 1]),  # every core used: pinned, the calling thread last (ggml's order)
    ([0, 1, 2, 3], 2, None, None),  # cores left over: the scheduler chooses
    ([0, 1, 2, 3], 2, True, [0, 1]),
    ([0, 1], 2, False, None),
    ([2, 5], 3, None, [2, 5, 2]),  # more threads than cores: round the allowed cores
    ([0, 1], 1, True, None),  # one thread: nothing to keep apart
    (None, 4, True, None),  # the OS does not say (macOS)
])
def test_which_cores(monkeypatch, allowed, threads: int, pin, want) -> None:
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: allowed)
    assert affinity.pinned_cpus(threads, pin) == want


def _thread_cpus() -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinned_window_computes_the_same_and_gives_the_caller_its_cores_back(gemma_path: Path) -> None:
    from primaplug.engine import ContextSettings, Model

    mine = os.sched_getaffinity(0)
    before = set(_thread_cpus())
    hidden = {}
    with Model(gemma_path, [(0, 4)], output=False) as model:
        for pin in (False, True):
            w = model.window(0, 4, settings=ContextSettings(n_ctx=64, n_batch=16, n_ubatch=16, n_threads=2,
                                                           pin_threads=pin))
            hidden[pin] = w.forward([2, 105, 2364, 107], 0)
            assert os.sched_getaffinity(0) == mine  # pinned only while it computed
            if pin:
                assert w.cpu == sorted(mine)[1]
                workers = {t: c for t, c in _thread_cpus().items() if t not in before}
                assert {sorted(mine)[0]} in workers.values(), "the pinned pool's worker runs on its own core"
            else:
                assert w.cpu is None
    np.testing.assert_array_equal(hidden[True], hidden[False])


@linux_only
def test_on_cpu_restores_the_threads_cores() -> None:
    mine = os.sched_getaffinity(0)
    cpu = sorted(mine)[-1]
    with affinity.on_cpu(cpu):
        assert os.sched_getaffinity(0) == {cpu}
    assert os.sched_getaffinity(0) == mine
    with affinity.on_cpu(None):
        assert os.sched_getaffinity(0) == mine
    with affinity.on_cpu(4095):  # a core this process may not use (no machine here has 4096): runs unpinned
        assert os.sched_getaffinity(0) == mine
    assert os.sched_getaffinity(0) == mine


def _single_core_threads(pid: int) -> int:
    """How many threads of a process may run on one core only."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread has gone
            n += len(os.sched_getaffinity(int(tid))) == 1
    return n


@linux_only
@pytest.mark.multiproc
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_node_cpu_strict_flag(gemma_path: Path, tmp_path: Path) -> None:
    """`primaplug node --cpu-strict 1` pins its compute threads, `--cpu-strict 0` never does; tokens are the same."""
    import primaplug
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 2, log_dir=tmp_path, node_args=[["--cpu-strict", "1"], ["--cpu-strict", "0"]]) \
            as local:
        pinned = {}
        tokens = {}
        for node in local.nodes:
            llm = primaplug.Llama(gemma_path, nodes=[node.address], layers=[18], node_threads=2, n_ctx=64,
                                  n_threads=1, verbose=False)
            try:
                tokens[node.name] = list(itertools.islice(llm.generate([2, 105, 2364], temp=0.0), 4))
                pinned[node.name] = _single_core_threads(node.proc.pid)
            finally:
                llm.close()
    assert pinned["node1"] >= 1, "--cpu-strict 1: the pool's worker is pinned"
    assert pinned["node2"] == 0, "--cpu-strict 0: nothing is pinned"
    assert tokens["node1"] == tokens["node2"]
