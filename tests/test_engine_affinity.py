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


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow to one")
def test_default_thread_counts_follow_the_cores_this_process_may_run_on() -> None:
    """`docker --cpuset-cpus` and taskset narrow the cores a process may run on, and os.cpu_count() still counts the
    machine's: one thread per core counts the narrowed cores (a thread per machine core would spin at ggml's
    barriers while another waits for the one core)."""
    from primaplug.core.settings import head_threads, usable_cores
    from primaplug.engine import ContextSettings

    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # this thread only (Linux masks are per thread)
    try:
        assert os.cpu_count() >= 2 and usable_cores() == 1
        assert ContextSettings().threads == 1
        assert head_threads(0, has_nodes=False) == head_threads(0, has_nodes=True) == 1
    finally:
        os.sched_setaffinity(0, mine)
    assert usable_cores() == len(mine) and ContextSettings().threads == len(mine)


@linux_only
@pytest.mark.multiproc
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow to one")
def test_a_node_narrowed_to_one_core_counts_one(gemma_path: Path, tmp_path: Path) -> None:
    """A node started under `taskset -c 0` tells the head it has one core, and refuses more threads than it can
    run, counting that one core."""
    from primaplug.core.errors import NodeError
    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.head.launch import LocalNodes
    from primaplug.node.daemon import THREADS_PER_CORE
    from primaplug.transport import ZmqTransport
    from primaplug.wire import Assignment, ModelIdentity, WindowSpec

    one = min(os.sched_getaffinity(0))
    with LocalNodes(gemma_path, 1, log_dir=tmp_path, preexec=[lambda: os.sched_setaffinity(0, {one})]) as local:
        client = NodeClient(ZmqTransport(), local.nodes[0].address)
        assert client.hello().device.cpu_count == 1
        too_many = THREADS_PER_CORE + 1
        a = Assignment(epoch=1, model=ModelIdentity.of(read_layout(gemma_path), gemma_path.name),
                       windows=(WindowSpec(0, 2),), successor="tcp://127.0.0.1:9", n_ctx=64, n_batch=16, n_ubatch=16,
                       n_threads=too_many)
        with pytest.raises(NodeError, match=f"{too_many} compute threads on a device of 1 cores"):
            client.load(a)


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow to one")
def test_the_plain_reference_takes_the_cores_this_process_may_run_on(gemma_path: Path) -> None:
    """`run --verify`'s plain llama-cpp-python: its own defaults count the machine's cores (half of them, and all of
    them for a prompt's batch); by default the reference takes the cores the ring's windows take."""
    from primaplug.engine.reference import plain_llama

    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})
    try:
        with plain_llama(gemma_path, n_ctx=64, verbose=False) as llm:
            assert (llm.n_threads, llm.n_threads_batch) == (1, 1)
    finally:
        os.sched_setaffinity(0, mine)
