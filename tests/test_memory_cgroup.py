"""The prefetcher under a real memory cap: two node processes, each in its own cgroup with its own copy of the
model, capped so that only part of a window fits. The node computes its budget from the cgroup, streams, and
release keeps its windows' resident bytes within that budget; the tokens are the same with prefetch on and
off, and no node is killed. Skipped, saying why, where cgroups cannot be created (not root, no controller)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.ring_helpers import LLAMA_KWARGS, greedy_scores

pytestmark = pytest.mark.multiproc

MiB = 1 << 20
WEIGHTS_FRACTION = 0.6  # of one window: what the cap leaves for weights


@pytest.fixture(scope="module")
def cgroups_available() -> None:
    from benchmarks.testbed import cgroups

    try:
        probe = cgroups.Cgroup(f"probe-{os.getpid()}", cgroups.Caps(memory_bytes=256 * MiB), None).create()
        probe.remove()
    except cgroups.CgroupUnavailableError as e:
        pytest.skip(f"cgroups cannot be created here: {e}")


def _run(model: Path, work: Path, flags: list[str]) -> tuple[list[int], list, list[int]]:
    import primaplug
    from benchmarks.testbed.cluster import Testbed
    from benchmarks.testbed.devices import Device
    from primaplug.core import LayerRange
    from primaplug.core.budget import MARGIN
    from primaplug.device import reserved_bytes
    from primaplug.engine import read_layout

    layout = read_layout(model)
    window = sum(n for _, n in layout.window_ranges(LayerRange(0, 4)))
    reserve = reserved_bytes(layout, [LayerRange(0, 4)], LLAMA_KWARGS["n_ctx"], LLAMA_KWARGS["n_batch"],
                             LLAMA_KWARGS["n_ubatch"])
    devices = [Device(f"t{os.getpid()}-n{i}", memory_mib=512, disk_mbps=1000) for i in (1, 2)]
    with Testbed(devices, model, work, node_args=flags, links=False, drop_caches=False) as tb:
        caps = []
        for g in tb.groups:  # the cap is set on the running node: its own memory, measured, plus the reserve
            cap = int((g.working_set_bytes() + reserve + WEIGHTS_FRACTION * window) / (1 - MARGIN))
            g.set_memory(cap)
            caps.append(cap)
        llm = primaplug.Llama(model, nodes=tb.addresses, scheduler="even", node_threads=1, **LLAMA_KWARGS)
        try:
            tokens, _ = greedy_scores(llm, [3 + 5 * i for i in range(40)], 16)
            statuses = [n.status(detail=True) for n in llm.cluster.nodes]
        finally:
            llm.close()
        assert tb.nodes is not None
        assert all(n.proc.poll() is None for n in tb.nodes.nodes), "a node died under its cap"
    return tokens, statuses, caps


def test_release_keeps_windows_within_the_cgroup_budget(cgroups_available: None, streaming_model: Path,
                                                        tmp_path: Path) -> None:
    from primaplug.core import LayerRange
    from primaplug.engine import read_layout

    window = sum(n for _, n in read_layout(streaming_model).window_ranges(LayerRange(0, 4)))
    on_tokens, on, caps = _run(streaming_model, tmp_path / "on", [])
    off_tokens, off, _ = _run(streaming_model, tmp_path / "off", ["--no-prefetch"])
    assert on_tokens == off_tokens, "prefetch must not change a token"
    for s, cap in zip(on, caps, strict=True):
        assert 0 < s.memory_budget_bytes < window, f"the cap ({cap >> 20} MiB) should leave less than a window"
        assert "POPULATE_READ" in s.memory_mode or "pread" in s.memory_mode, s.memory_mode
        assert s.bytes_prefetched > 0 and s.bytes_released > 0
        assert s.resident_bytes <= s.memory_budget_bytes + 4 * 4096, (s.resident_bytes, s.memory_budget_bytes)
        assert 0.0 <= s.memory_pressure < 1.0
    assert all(s.bytes_prefetched == 0 and s.bytes_released > 0 for s in off)
