"""A model split into layer windows computes exactly what plain llama-cpp-python computes on the whole model.

For every test model and several partitions (one window, two, three uneven, two rounds of three windows in
ring order, and the last layer off the head with an output-only window), a prompt longer than n_ubatch and
n_batch, then 32 greedy steps: the same tokens, and every logit row within 1e-3 of the row's largest |logit|.
"""

from __future__ import annotations

import itertools
from functools import cache

import llama_cpp
import numpy as np
import pytest

from primaplug.core import LayerRange, even_split
from primaplug.engine import ContextSettings, Model, ModelLayout, WindowChain, read_layout
from tests.conftest import quantized_once
from tests.ring_helpers import THREADS

N_STEPS = 32
SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32, n_threads=THREADS)


def partitions(layout: ModelLayout) -> dict[str, tuple[list[LayerRange], bool]]:
    """The partitions of the model's layers; with a shared-KV tail (ModelLayout.kv_tail), a boundary inside it moves
    to its first layer, so that those layers share the last window (Gemma 4 E2B/E4B: 7 layers, 3 of them in the tail,
    make at most 5 windows); one at a barred start (GLM 5.2) moves down to a layer a window may start at
    (ModelLayout.snap_sizes)."""
    n_layer, tail = layout.n_layer, layout.kv_tail

    def cut(sizes: list[int]) -> list[LayerRange]:
        ends = sorted({min(e, n_layer - tail) if e < n_layer else e for e in itertools.accumulate(sizes)} - {0})
        snapped = layout.snap_sizes([b - a for a, b in zip([0, *ends], ends, strict=False)])
        starts = [0, *itertools.accumulate(snapped)]
        return [LayerRange(a, a + n) for a, n in zip(starts, snapped, strict=False) if n]

    six = even_split(n_layer, 6)  # device d: windows d and d+3
    uneven = [1, n_layer - 4, 3]
    return {
        "one-window": (cut([n_layer]), False),
        "two-windows": (cut(even_split(n_layer, 2)), False),
        "three-uneven": (cut(uneven), False),
        "two-rounds-of-three": (cut(six), False),
        "output-on-head": (cut(uneven), True),
    }


@cache
def reference(path: str, prompt: tuple[int, ...]) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and logit rows (every prompt row, then one per step) from an ordinary Llama."""
    llm = llama_cpp.Llama(path, n_ctx=SETTINGS.n_ctx, n_batch=SETTINGS.n_batch, n_ubatch=SETTINGS.n_ubatch,
                          n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, verbose=False)
    try:
        llm.eval(list(prompt))
        rows = [llm.scores[i].copy() for i in range(len(prompt))]
        tokens = []
        for _ in range(N_STEPS):
            tok = int(np.argmax(rows[-1]))
            tokens.append(tok)
            llm.eval([tok])
            rows.append(llm.scores[llm.n_tokens - 1].copy())
        return tokens, rows
    finally:
        llm.close()


def assert_rows_close(expected: np.ndarray, got: np.ndarray, what: str) -> None:
    expected, got = np.atleast_2d(expected), np.atleast_2d(got)
    tol = 1e-3 * np.abs(expected).max(axis=-1)
    diff = np.abs(expected - got).max(axis=-1)
    bad = np.nonzero(diff > tol)[0]
    assert bad.size == 0, (f"{what}: rows {bad[:5].tolist()} differ by {diff[bad[:5]].tolist()} "
                           f"(tolerance {tol[bad[:5]].tolist()})")


@pytest.mark.parametrize("partition",
                         ["one-window", "two-windows", "three-uneven", "two-rounds-of-three", "output-on-head"])
def test_split_model_matches_whole_model(test_model, partition: str) -> None:
    path = str(test_model.path)
    layout = read_layout(path)
    windows, head_output = partitions(layout)[partition]
    want_tokens, want_rows = reference(path, test_model.prompt)

    with Model(path, windows) as model:
        chain = WindowChain(model, windows, settings=SETTINGS, head_output=head_output)
        prompt = list(test_model.prompt)
        assert len(prompt) > SETTINGS.n_batch > SETTINGS.n_ubatch
        rows = chain.forward(prompt, 0, logits="all")
        assert_rows_close(np.stack(want_rows[: len(prompt)]), rows, f"{test_model.name} {partition} prompt")
        tokens, last, pos = [], rows[-1], len(prompt)
        for step in range(N_STEPS):
            tok = int(np.argmax(last))
            tokens.append(tok)
            last = chain.forward([tok], pos)[0]
            pos += 1
            assert_rows_close(want_rows[len(prompt) + step], last, f"{test_model.name} {partition} step {step}")
        assert tokens == want_tokens


def test_gemma4_shared_kv_of_both_kinds_and_a_split_inside_it(model_dir) -> None:
    """Gemma 4 E2B/E4B: three last layers read earlier layers' keys and values, two a sliding layer's and one a global
    layer's. Windows that keep them with those layers give plain's logits; a split between them is refused before
    anything loads, saying where to split instead."""
    import primaplug
    from primaplug.core import WindowRangeError
    from primaplug.engine.synthetic import synthetic_spec

    path = quantized_once(model_dir / "gemma4-e2b-9L-shared3-Q8_0.gguf",
                          synthetic_spec("gemma4-e2b", n_layer=9, seed=9, n_kv_shared=3), "Q8_0")
    layout = read_layout(path)
    assert [layout.kv_source(il) for il in range(6, 9)] == [4, 4, 5] and not layout.swa_layers[5]
    prompt = tuple(int(t) for t in np.random.default_rng(9).integers(3, 512, size=100))
    want_tokens, want_rows = reference(str(path), prompt)
    windows = [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 9)]
    with Model(path, windows) as model:
        chain = WindowChain(model, windows, settings=SETTINGS, head_output=True)
        rows = chain.forward(list(prompt), 0, logits="all")
        assert_rows_close(np.stack(want_rows[: len(prompt)]), rows, "gemma4-e2b shared KV prompt")
        tokens, last = [], rows[-1]
        for step in range(8):
            tokens.append(int(np.argmax(last)))
            last = chain.forward([tokens[-1]], len(prompt) + step)[0]
        assert tokens == want_tokens[:8]
    with pytest.raises(WindowRangeError, match=r"layer 6, which reads the keys and values of layer 4.*before layer 5"):
        primaplug.Llama(path, layers=[5, 4], n_ctx=256, verbose=False)
