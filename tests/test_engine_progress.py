"""A window tells which layer it is computing while it computes, without changing what it computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from primaplug.engine.progress import tensor_layer


def test_layer_of_a_tensor_name() -> None:
    assert tensor_layer(b"attn_norm-5") == 5
    assert tensor_layer(b"ffn_out-12 (reshaped)") == 12
    assert tensor_layer(b"result_norm") is None
    assert tensor_layer(b"inp_embd") is None
    assert tensor_layer(b"") is None


def test_a_window_reports_its_layers_in_order_and_computes_the_same(gemma_path: Path) -> None:
    from primaplug.engine import ContextSettings, Model

    settings = ContextSettings(n_ctx=128, n_batch=32, n_ubatch=16, n_threads=2)
    seen: list[int] = []
    tokens = list(range(5, 45))  # 40 tokens: three ubatches of 16, each a graph of its own
    with Model(gemma_path, [(4, 11)], output=False) as m:
        first = Model(gemma_path, [(0, 4)], output=False)
        try:
            hidden = first.window(0, 4, settings=settings).forward(tokens, 0)
        finally:
            first.close()
        plain = m.window(4, 11, settings=settings)
        told = m.window(4, 11, settings=settings, on_layer=seen.append)
        want = plain.forward(hidden, 0)
        got = told.forward(hidden, 0)
        np.testing.assert_array_equal(got, want)
        assert seen == list(range(4, 11)) * 3, seen
        seen.clear()
        np.testing.assert_array_equal(told.forward(want[-1:], 40), plain.forward(want[-1:], 40))
        assert seen == list(range(4, 11))


def test_a_failing_callback_does_not_stop_the_window(gemma_path: Path) -> None:
    from primaplug.engine import ContextSettings, Model

    def boom(il: int) -> None:
        raise RuntimeError(f"layer {il}")

    with Model(gemma_path, [(0, 3)], output=False) as m:
        w = m.window(0, 3, settings=ContextSettings(n_ctx=64, n_batch=16, n_ubatch=16, n_threads=2), on_layer=boom)
        assert w.forward([2, 105, 2364], 0).shape == (3, m.layout.n_embd)
