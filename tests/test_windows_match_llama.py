"""A model split into layer windows computes exactly what plain llama-cpp-python computes on the whole model.

For every test model and several partitions (one window, two, three uneven, two rounds of three windows in
ring order, and the last layer off the head with an output-only window), a prompt longer than n_ubatch and
n_batch, then 32 greedy steps: the same tokens, and every logit row within 1e-3 of the row's largest |logit|.
"""

from __future__ import annotations

from functools import cache

import llama_cpp
import numpy as np
import pytest

from primaplug.core import LayerRange, even_split, execution_order, ring_windows
from primaplug.engine import ContextSettings, Model, WindowChain, read_layout

N_STEPS = 32
SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32)


def partitions(n_layer: int) -> dict[str, tuple[list[LayerRange], bool]]:
    def chain(sizes: list[int]) -> list[LayerRange]:
        return execution_order(ring_windows(sizes, 1, n_layer))

    six = even_split(n_layer, 6)
    two_rounds = [LayerRange(sum(six[:i]), sum(six[: i + 1])) for i in range(6)]  # device d: windows d and d+3
    uneven = [1, n_layer - 4, 3]
    return {
        "one-window": (chain([n_layer]), False),
        "two-windows": (chain(even_split(n_layer, 2)), False),
        "three-uneven": (chain(uneven), False),
        "two-rounds-of-three": (two_rounds, False),
        "output-on-head": (chain(uneven), True),
    }


@cache
def reference(path: str, prompt: tuple[int, ...]) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and logit rows (every prompt row, then one per step) from an ordinary Llama."""
    llm = llama_cpp.Llama(path, n_ctx=SETTINGS.n_ctx, n_batch=SETTINGS.n_batch, n_ubatch=SETTINGS.n_ubatch,
                          logits_all=True, verbose=False)
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
    n_layer = read_layout(path).n_layer
    windows, head_output = partitions(n_layer)[partition]
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
