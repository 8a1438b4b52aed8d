"""Routed experts read as tokens choose them (memory/experts.py): what is read, kept, predicted and released; and
the engine's report of each layer's choice (engine/progress.py), which must leave the outputs as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from primaplug.memory.experts import ExpertCache, Router
from tests.ring_helpers import THREADS

N_EXPERT, SLICE = 8, 3 * 4096  # 3 tensors a layer, each expert's slice of each 12 KiB


class _Releases:
    """An Advisor that records what is released (the real one drops pages of a mapping this test has not)."""

    def __init__(self) -> None:
        self.released: list[tuple[int, int]] = []

    def release(self, ranges: list[tuple[int, int]]) -> int:
        self.released += ranges
        return sum(n for _, n in ranges)

    def close(self) -> None:
        pass


def _cache(tmp_path: Path, budget_experts: int, **kw) -> tuple[ExpertCache, _Releases, dict]:
    """Two layers of three expert tensors each, laid out one after the other in a file of known bytes."""
    path = tmp_path / "experts.bin"
    layers, slices, off = (0, 1), {}, 0
    for il in layers:
        slices[il] = tuple((off + k * N_EXPERT * SLICE, SLICE) for k in range(3))
        off += 3 * N_EXPERT * SLICE
    path.write_bytes(np.random.default_rng(0).integers(0, 256, off, dtype=np.uint8).tobytes())
    releases = _Releases()
    cache = ExpertCache(str(path), slices, N_EXPERT, budget_experts * 3 * SLICE, advisor=releases, **kw)
    return cache, releases, slices


def test_only_the_chosen_experts_are_read_and_kept_ones_are_not_read_again(tmp_path: Path) -> None:
    cache, releases, _ = _cache(tmp_path, budget_experts=16)
    try:
        cache.on_route(0, np.array([[1, 3], [3, 5]], dtype=np.int32), None)  # two tokens: experts 1, 3, 5
        s = cache.stats
        assert (s.needed, s.resident, s.bytes_read, s.bytes_needed) == (3, 0, 3 * 3 * SLICE, 3 * 3 * SLICE)
        cache.token_done()
        cache.on_route(0, np.array([[3, 6]], dtype=np.int32), None)
        assert (s.needed, s.resident, s.bytes_read) == (5, 1, 4 * 3 * SLICE)  # 3 was resident, 6 read
        assert cache.resident_experts() == 4 and not releases.released
    finally:
        cache.close()


def test_over_budget_the_coldest_experts_go_never_the_ones_just_chosen(tmp_path: Path) -> None:
    cache, releases, slices = _cache(tmp_path, budget_experts=3)
    try:
        for _ in range(3):  # expert 2 of layer 0 is used three tokens running: the hottest
            cache.need(0, [2])
            cache.token_done()
        cache.need(0, [4])
        cache.need(1, [0])
        cache.token_done()
        cache.need(1, [5, 6])  # five experts' worth: two must go, the coldest that was not just chosen
        assert cache.resident_experts() == 3
        gone = {(off - slices[il][0][0]) // SLICE for il in (0, 1) for off, _ in releases.released
                if slices[il][0][0] <= off < slices[il][0][0] + N_EXPERT * SLICE}
        assert gone == {4, 0}, releases.released  # layer 0's expert 4 and layer 1's expert 0; 2 stays
        assert cache.stats.bytes_released == 2 * 3 * SLICE
    finally:
        cache.close()


def test_a_prediction_reads_ahead_and_is_counted_when_chosen_or_wasted(tmp_path: Path) -> None:
    weight = np.eye(N_EXPERT, 4, dtype=np.float32)  # expert e scores x[e] (e < 4)
    cache, _, _ = _cache(tmp_path, budget_experts=16, routers={1: Router(weight)}, n_used=2)
    try:
        x = np.array([[0.0, 5.0, 4.0, 0.0]], dtype=np.float32)  # layer 1's router would choose experts 1 and 2
        cache.on_route(0, np.array([[7, 0]], dtype=np.int32), x)
        cache.wait_idle()
        assert cache.stats.bytes_read == 4 * 3 * SLICE  # 7 and 0 of layer 0, predicted 1 and 2 of layer 1
        cache.need(1, [1, 3])
        s = cache.stats
        assert (s.needed, s.predicted, s.resident) == (4, 1, 0)
        cache.token_done()
        assert s.bytes_predicted_unused == 3 * SLICE  # expert 2 of layer 1 was predicted, not chosen
    finally:
        cache.close()


def test_router_choice_with_logit_bias_and_sigmoid_selection_bias() -> None:
    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((16, 8)), rng.standard_normal((5, 8))
    b, sel = rng.standard_normal(16), 3.0 * rng.standard_normal(16)
    got = Router(w, b, sel).choose(x, 4)
    scores = 1 / (1 + np.exp(-(x @ w.T + b))) + sel
    want = np.argsort(-scores, axis=1)[:, :4]
    assert [set(r) for r in got.tolist()] == [set(r) for r in want.tolist()]


def test_router_choice_within_expert_groups_as_deepseek_v3() -> None:
    """DeepSeek-V3's grouped routing: sigmoid scores plus the selection bias; each group scored by its two best
    experts; the token's experts only from the best groups, even where another group holds a better one."""
    w = np.eye(8)  # the scores are the hidden state itself
    x = np.array([[5.0, -9, -9, -9, 4.0, 3.9, -9, -9]])  # group 0 (experts 0, 1) has the best expert, group 2 (4, 5)
    got = Router(w, None, np.zeros(8), gating="sigmoid", groups=4, groups_used=1).choose(x, 2)  # the best pair
    assert set(got[0]) == {4, 5}
    assert set(Router(w, None, np.zeros(8)).choose(x, 2)[0]) == {0, 4}  # ungrouped
    sm = Router(w, None, None, gating="softmax", groups=4, groups_used=2).choose(x, 3)
    assert set(sm[0]) == {0, 4, 5}  # groups 0 and 2; experts 1 and 6, 7 masked out


@pytest.mark.parametrize(("arch", "ftype"), [("qwen3moe", "Q4_K_M"), ("gpt-oss", "MXFP4_MOE"),
                                             ("glm4moe", "Q4_K_M"), ("qwen35moe", "Q4_K_M"), ("gemma4", "Q4_K_M"),
                                             ("llama4", "Q4_K_M"), ("deepseek2", "Q4_K_M"),
                                             ("deepseek2-lite", "Q8_0"), ("lfm2moe", "Q4_K_M"),
                                             ("qwen3next", "Q4_K_M"), ("minimax-m2", "Q4_K_M"),
                                             ("kimi-linear", "Q4_K_M"), ("deepseek32", "Q4_K_M"),
                                             ("glm-dsa", "Q4_K_M")])
def test_a_window_tells_each_layers_choice_and_computes_the_same(model_dir: Path, arch: str, ftype: str) -> None:
    """The choice llama.cpp made, read from its graph, and the router input beside it: applying the layer's own
    router (read from the file) to that input gives the same choice; the outputs are bit for bit those of a window
    that reports nothing."""
    from primaplug.engine import ContextSettings, Model, read_layout
    from primaplug.memory.experts import load_routers
    from tests.conftest import synthetic_path

    path = synthetic_path(model_dir, arch, 7, ftype)
    layout = read_layout(path)
    routers = load_routers(range(layout.n_layer), layout.read_tensor, gating=layout.expert_gating,
                           groups=layout.expert_groups, groups_used=layout.expert_groups_used)
    settings = ContextSettings(n_ctx=128, n_batch=32, n_ubatch=16, n_threads=THREADS)
    tokens = list(range(5, 45))  # three micro-batches of 16
    seen: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    with Model(path, [(0, 7)]) as m:
        want = m.window(0, 7, settings=settings).forward(tokens, 0, logits="all")
        told = m.window(0, 7, settings=settings, on_route=lambda il, chosen, x: seen.append((il, chosen, x)))
        got = told.forward(tokens, 0, logits="all")
    np.testing.assert_array_equal(got, want)
    moe_layers = [il for il in range(layout.n_layer) if layout.expert_slices(il)]
    assert sorted({il for il, _, _ in seen}) == moe_layers  # glm4moe's dense first layer has no router
    rows = 0
    for il, chosen, x in seen:
        assert chosen.shape[1] == layout.n_expert_used and x is not None and x.shape == (len(chosen), layout.n_embd)
        assert ((chosen >= 0) & (chosen < layout.n_expert)).all()
        again = routers[il].choose(x, layout.n_expert_used)
        assert [set(r) for r in again.tolist()] == [set(r) for r in chosen.tolist()]
        rows += len(chosen)
    assert rows >= 40 * (len(moe_layers) - 1)  # every token in every layer (the last: the output rows only)


def test_an_engine_whose_tensor_layout_is_not_known_streams_whole_layers(model_dir: Path, monkeypatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Were ggml's tensor struct to change, the routers' choices could not be read: the device says so and
    streams the mixture of experts' layers whole, rather than reading nothing and faulting its experts in."""
    from primaplug.core import LayerRange
    from primaplug.device import DeviceWindows, MemorySettings
    from primaplug.engine import ContextSettings, read_layout
    from primaplug.engine import progress as engine_progress
    from tests.conftest import synthetic_path

    path = synthetic_path(model_dir, "qwen3moe", 7, "Q4_K_M")
    monkeypatch.setattr(engine_progress, "ROUTES_READABLE", False)
    settings = ContextSettings(n_ctx=64, n_batch=32, n_ubatch=16, n_threads=1)
    device = DeviceWindows.load(path, read_layout(path), [LayerRange(0, 4)], context=settings,
                                memory=MemorySettings(budget_bytes=1 << 20))
    try:
        assert device.experts is None and device.plan.experts is None and device.plan.prefetch.mode == "stream"
        assert "reads whole layers" in caplog.text
    finally:
        device.close()
