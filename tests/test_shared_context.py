"""A device's windows on one llama.cpp context (Model.shared_windows): the same logits as plain llama-cpp-python,
one context's memory instead of one per window, and clear errors where a shared context cannot be used."""

from __future__ import annotations

import numpy as np
import pytest

from primaplug.core import LayerRange, even_split
from primaplug.core.errors import EngineError, WindowRangeError
from primaplug.engine import ContextSettings, Model, read_layout
from primaplug.engine.model import one_per_context
from tests.conftest import synthetic_path
from tests.ring_helpers import THREADS
from tests.test_window_memory import _in_fresh_process, linux_only
from tests.test_windows_match_llama import N_STEPS, SETTINGS, assert_rows_close, reference

ROLLBACK = 5  # positions taken back (a rejected speculative draft) and computed again


def test_a_devices_windows_on_one_context_match_the_whole_model(test_model) -> None:
    """Three devices with two rounds each, every device's two windows on one context, run in ring order; a prompt
    of several batches and micro-batches, greedy steps, then a rollback of the last steps, computed again."""
    path = str(test_model.path)
    layout = read_layout(path)
    if any(layout.swa_layers) or layout.has_recurrent_layers or layout.indexer_key_length:
        pytest.skip(f"{test_model.name} has sliding-window attention, recurrent layers or sparse attention: its "
                    "windows keep a context each (Model.can_share_context)")
    n = layout.n_layer
    six = even_split(n, 6)
    ring = [LayerRange(sum(six[:i]), sum(six[: i + 1])) for i in range(6)]  # device d runs windows d and d + 3
    want_tokens, want_rows = reference(path, test_model.prompt)
    prompt = list(test_model.prompt)
    assert len(prompt) > SETTINGS.n_batch > SETTINGS.n_ubatch

    with Model(path, ring) as model:
        devices = [model.shared_windows([ring[d], ring[d + 3]], settings=SETTINGS) for d in range(3)]
        order = [devices[i % 3][i // 3] for i in range(6)]
        assert len(one_per_context(order)) == 3
        head = model.window(n, n, settings=SETTINGS)

        def forward(inputs: list[int], pos: int) -> np.ndarray:
            x: list[int] | np.ndarray = inputs
            for w in order:
                x = w.forward(x, pos)
            return head.forward(x, pos, logits="all")

        rows = forward(prompt, 0)
        assert_rows_close(np.stack(want_rows[: len(prompt)]), rows, f"{test_model.name} prompt")
        tokens, last, pos = [], rows[-1], len(prompt)
        for step in range(N_STEPS):
            tokens.append(int(np.argmax(last)))
            last = forward(tokens[-1:], pos)[0]
            assert_rows_close(want_rows[len(prompt) + step], last, f"{test_model.name} step {step}")
            pos += 1
        assert tokens == want_tokens

        # take the last ROLLBACK positions back: once per context reaches both of its windows
        pos -= ROLLBACK
        for w in [*one_per_context(order), head]:
            w.kv_remove(0, pos)
        assert all(w.kv_pos_max(0) == pos - 1 for w in order)
        for step in range(N_STEPS - ROLLBACK, N_STEPS):
            last = forward([want_tokens[step]], pos)[0]
            assert_rows_close(want_rows[len(prompt) + step], last, f"{test_model.name} step {step} after rollback")
            pos += 1


@linux_only
def test_windows_on_one_context_keep_one_contexts_memory(model_dir) -> None:
    """Eight one-layer windows: on one context they take what one window takes plus their KV cache, where eight
    contexts take eight times a context's buffers and tables. Same tokens either way."""
    path = synthetic_path(model_dir, "llama", 9, "Q8_0")
    layout = read_layout(path)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, layout.n_vocab, size=64)]
    windows = [LayerRange(il, il + 1) for il in range(8)] + [LayerRange(8, 9)]
    settings = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32, n_threads=THREADS)
    apart_tokens, apart_growth, _ = _in_fresh_process(str(path), windows, settings, 4, prompt, False, True)
    shared_tokens, shared_growth, _ = _in_fresh_process(str(path), windows, settings, 4, prompt, True, True)
    assert shared_tokens == apart_tokens
    kv = sum(layout.kv_bytes_per_token(il) for il in range(8)) * settings.n_ctx
    # seven contexts fewer: at least seven times a one-row graph's tables and batch buffers (about 1 MiB each here)
    assert shared_growth < apart_growth - 7 * 2**20, (shared_growth, apart_growth)
    assert shared_growth < apart_growth / 2 + kv, (shared_growth, apart_growth, kv)


def test_shared_context_errors_and_round_windows(model_dir, gemma_path) -> None:
    path = synthetic_path(model_dir, "llama", 7, "Q8_0")
    settings = ContextSettings(n_ctx=64, n_batch=16, n_ubatch=16)
    with Model(path, [(0, 7)]) as model:
        with pytest.raises(WindowRangeError, match="overlap or are out of order"):
            model.shared_windows([(2, 4), (0, 2)], settings=settings)
        with pytest.raises(WindowRangeError, match="empty"):
            model.shared_windows([(0, 2), (3, 3)], settings=settings)
        with pytest.raises(WindowRangeError, match="one on_layer entry per window"):
            model.shared_windows([(0, 2), (3, 4)], settings=settings, on_layer=[None])
        with pytest.raises(WindowRangeError, match="2 round"):
            model.round_windows([LayerRange(0, 2), LayerRange(3, 4)], settings=settings, on_layer=[None])
        first, later = model.shared_windows([(0, 2), (3, 5)], settings=settings)
        hidden = np.zeros((4, model.layout.n_embd), dtype=np.float32)
        # a later window computes positions the first has placed, never before it
        with pytest.raises(EngineError, match="first window must run a batch before"):
            later.forward(hidden, 0)
        first.forward([5, 6, 7, 8], 0)
        assert later.forward(hidden, 0).shape == hidden.shape
        with pytest.raises(EngineError, match="first window must run a batch before"):
            later.forward(hidden[:1], 4)
        first.kv_clear()  # one clear empties the cache of both
        assert later.kv_pos_max(0) == -1
    with Model(path, [(0, 2), (4, 6)], output=False) as model:
        assert model.can_share_context
        with pytest.raises(WindowRangeError, match="was not loaded for"):
            model.shared_windows([(0, 2), (2, 4)], settings=settings)
        # a device's windows, one per round (none in the second): one context for both
        windows = model.round_windows([LayerRange(0, 2), LayerRange(3, 3), LayerRange(4, 6)], settings=settings)
        assert windows[1] is None and len(one_per_context(windows)) == 1
    with Model(gemma_path, [(0, 2), (6, 8)], output=False) as gemma:
        assert not gemma.can_share_context
        with pytest.raises(WindowRangeError, match="sliding-window attention"):
            gemma.shared_windows([(0, 2), (6, 8)], settings=settings)
        # a device's windows then keep a context each
        windows = gemma.round_windows([LayerRange(0, 2), LayerRange(4, 4), LayerRange(6, 8)], settings=settings)
        assert windows[1] is None and len(one_per_context(windows)) == 2
