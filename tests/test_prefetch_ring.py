"""The prefetcher in real node processes: a memory budget smaller than the windows makes them stream, the
tokens stay those of the same nodes without prefetch, and the nodes report what they did."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.ring_helpers import LLAMA_KWARGS, greedy_scores

pytestmark = pytest.mark.multiproc

MiB = 1 << 20


def _run(model: Path, log_dir: Path, node_args: list[str]) -> tuple[list[int], list]:
    import primaplug
    from primaplug.head.launch import LocalNodes

    with LocalNodes(model, 2, log_dir=log_dir, extra_args=node_args) as local:
        llm = primaplug.Llama(model, nodes=local.addresses, scheduler="even", node_threads=1, **LLAMA_KWARGS)
        try:
            tokens, _ = greedy_scores(llm, [3 + 5 * i for i in range(40)], 16)
            statuses = [n.status(detail=True) for n in llm.cluster.nodes]
        finally:
            llm.close()
    return tokens, statuses


def test_streaming_windows_prefetch_release_and_keep_the_tokens(streaming_model: Path, tmp_path: Path) -> None:
    from primaplug.core import LayerRange
    from primaplug.engine import read_layout

    layout = read_layout(streaming_model)
    window_bytes = sum(n for _, n in layout.window_ranges(LayerRange(0, 4)))
    budget_mib = max(1, int(window_bytes * 0.6) // MiB)  # less than one window: everything streams

    resident_tokens, resident = _run(streaming_model, tmp_path / "a", [])
    assert all(s.memory_mode.startswith("resident") and s.bytes_released == 0 for s in resident)

    off_tokens, off = _run(streaming_model, tmp_path / "b", ["--memory-budget", str(budget_mib), "--no-prefetch"])
    on_tokens, on = _run(streaming_model, tmp_path / "c", ["--memory-budget", str(budget_mib)])
    assert on_tokens == off_tokens, "prefetch must not change a token"
    for s in on:
        assert "POPULATE_READ" in s.memory_mode or "pread" in s.memory_mode
        assert s.bytes_prefetched >= window_bytes * 0.5 and s.bytes_released > 0
        # after the last token the node has released its window: what stays is the kept part and at most
        # the next window's prefetch, within the budget
        assert s.resident_bytes <= budget_mib * MiB + 4 * 4096, (s.resident_bytes, budget_mib * MiB)
        assert 0.0 <= s.memory_pressure < 1.0
    assert all(s.bytes_prefetched == 0 for s in off)
    # streamed weights are not repacked, resident ones are: the tokens may round differently, but the
    # resident ring reproduces plain llama-cpp-python (tests/test_ring.py); here both runs must be sane
    assert len(resident_tokens) == len(on_tokens) == 16


def test_a_head_whose_windows_do_not_fit_streams_them(streaming_model: Path, tmp_path: Path) -> None:
    """The head follows the nodes' memory policy: over budget, its windows are streamed, and the ring gives the
    tokens of the same windows chained in one process, with the same kernels: the weights this CPU repacks mapped
    from the repacked copy, as everywhere (on x86 this model's Q8_0 is repacked by none; on ARM with dotprod it is,
    into q8_0_4x4, and a chain without repacking parts from the ring at the 8th token: the aarch64 rung)."""
    import numpy as np

    import primaplug
    from primaplug.core import LayerRange
    from primaplug.engine import ContextSettings, Model, WindowChain
    from primaplug.head.launch import LocalNodes

    prompt = [3 + 5 * i for i in range(40)]
    windows = [LayerRange(0, 4), LayerRange(4, 8)]
    settings = ContextSettings(n_ctx=LLAMA_KWARGS["n_ctx"], n_batch=LLAMA_KWARGS["n_batch"],
                               n_ubatch=LLAMA_KWARGS["n_ubatch"], n_threads=LLAMA_KWARGS["n_threads"])
    with Model(streaming_model, windows) as m:
        chain = WindowChain(m, windows, settings=settings)
        expected, pos, logits = [], len(prompt), chain.forward(prompt, 0)
        for _ in range(12):
            expected.append(int(np.argmax(logits)))
            logits = chain.forward([expected[-1]], pos)
            pos += 1

    with LocalNodes(streaming_model, 1, log_dir=tmp_path, extra_args=["--memory-budget", "2"]) as local:
        llm = primaplug.Llama(streaming_model, nodes=local.addresses, layers=[4, 4], memory_budget=2 * MiB,
                              node_threads=1, **LLAMA_KWARGS)
        try:
            tokens, _ = greedy_scores(llm, prompt, 12)
            p = llm.session.ring.ring.local.prefetcher  # the head's windows, on the device layer as a node's
            assert p is not None and p.plan.mode == "stream"
            assert p.stats.bytes_prefetched > 0 and p.stats.bytes_released > 0
            assert p.wait_idle(10), "the prefetcher did not finish"
            assert p.resident_bytes() <= 2 * MiB + 4 * 4096
        finally:
            llm.close()
    assert tokens == expected



def _released_per_token(model: Path, log_dir: Path, node_args: list[str], **head: object
                        ) -> tuple[list[int], list[float]]:
    """Greedy tokens, and the bytes each node released per decoded token (the prompt left out); `head`: more
    arguments for the head (primaplug.Llama)."""
    import numpy as np

    import primaplug
    from primaplug.head.launch import LocalNodes

    with LocalNodes(model, 2, log_dir=log_dir, extra_args=node_args) as local:
        llm = primaplug.Llama(model, nodes=local.addresses, scheduler="even", node_threads=1, **LLAMA_KWARGS, **head)
        try:
            llm.reset()
            llm.eval([3 + 5 * i for i in range(40)])
            before = [n.status(detail=True).bytes_released for n in llm.cluster.nodes]
            tokens = []
            for _ in range(8):
                tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([tokens[-1]])
            after = _settled(lambda: [n.status(detail=True).bytes_released for n in llm.cluster.nodes])
        finally:
            llm.close()
    return tokens, [(a - b) / 8 for a, b in zip(after, before, strict=True)]


def _settled(read, timeout_s: float = 5.0):  # noqa: ANN001, ANN202
    """The value once it stops changing: a node's prefetcher counts a release after the window that asked for it
    has returned."""
    value, end = read(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        time.sleep(0.2)
        again = read()
        if again == value:
            break
        value = again
    return value


def test_streaming_layer_by_layer_releases_what_its_plan_streams(streaming_model: Path, tmp_path: Path) -> None:
    """A window larger than the budget: whole-window streaming (--layer-streaming=off) re-reads all of it every
    token; layer by layer (what a node chooses by itself here), each layer is released as soon as it is done and no
    more than the plan streams is released (the plan leaves room for a window's layers ahead, and keeps a part of
    every layer only where the budget holds more). With room for one streamed layer at a time, as a plan may send
    it (Assignment.stream_room, scheduler/rooms.py), more of every layer is kept and less released. Same tokens."""
    from primaplug.core import LayerRange
    from primaplug.engine import read_layout
    from primaplug.memory.policy import plan_prefetch

    layout = read_layout(streaming_model)
    window = LayerRange(0, layout.n_layer // 2)  # each of the two nodes holds half the layers
    window_bytes = sum(n for _, n in layout.window_ranges(window))
    budget_mib = int(window_bytes * 0.8) // MiB
    layers = [layout.window_ranges(LayerRange(i, i + 1)) for i in range(window.start, window.end)]
    per_layer = plan_prefetch(layers, budget_mib * MiB, unit="layer", slots=window.n_layers + 1)  # device/memory.py
    one_room = plan_prefetch(layers, budget_mib * MiB, unit="layer", slots=1)
    assert one_room.keep_fraction > per_layer.keep_fraction

    budget = ["--memory-budget", str(budget_mib)]
    whole_tokens, whole = _released_per_token(streaming_model, tmp_path / "a", [*budget, "--layer-streaming=off"])
    layer_tokens, layered = _released_per_token(streaming_model, tmp_path / "b", budget)  # auto: layer by layer
    room_tokens, one = _released_per_token(streaming_model, tmp_path / "c", budget, stream_rooms=[1, 1])
    assert layer_tokens == whole_tokens == room_tokens
    for w, s, r in zip(whole, layered, one, strict=True):
        assert w >= 0.9 * window_bytes, "whole windows: all of it released, and re-read, every token"
        assert 0 < s <= (1 - per_layer.keep_fraction) * window_bytes * 1.05, (s, window_bytes)
        assert 0 < r <= (1 - one_room.keep_fraction) * window_bytes * 1.05, (r, window_bytes)


def test_a_streaming_mixture_of_experts_reads_only_the_chosen_experts(model_dir: Path, tmp_path: Path) -> None:
    """qwen3moe over two nodes whose budget of 1 MiB holds no window: each reads its routed experts as the tokens
    choose them (memory/experts.py), and the tokens are plain llama-cpp-python's. What it read is no more than
    the chosen experts plus its predictions; with --whole-experts it streams whole layers instead."""
    import llama_cpp

    from tests.conftest import synthetic_path

    model = synthetic_path(model_dir, "qwen3moe", 7, "Q4_K_M")
    plain = llama_cpp.Llama(str(model), **LLAMA_KWARGS)
    try:
        want, _ = greedy_scores(plain, [3 + 5 * i for i in range(40)], 16)
    finally:
        plain.close()
    tokens, statuses = _run(model, tmp_path / "experts", ["--memory-budget", "1"])
    assert tokens == want
    for s in statuses:
        e = s.experts
        assert e is not None and "routed experts read as tokens choose them" in s.memory_mode, s
        assert e.tokens == 17 and e.chosen >= 17 * 3 * 2, e  # the prompt and 16 steps; 3 or 4 layers, 2 experts
        assert 0 < e.bytes_read <= e.bytes_chosen + e.bytes_predicted_unused, e
        assert e.resident + e.predicted <= e.chosen
    whole_tokens, whole = _run(model, tmp_path / "whole", ["--memory-budget", "1", "--whole-experts"])
    assert whole_tokens == want
    assert all(s.experts is None and "routed experts" not in s.memory_mode and s.bytes_released > 0 for s in whole)
