"""Windows chained in one process, in ring order: what a pipelined ring computes, without the network.

Used by `primaplug run` when no nodes are given, by the benchmarks, and by the tests that prove a split
model computes what the whole model computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from primaplug.core.windows import LayerRange, check_cover
from primaplug.engine.model import BUSY_POLL, ContextSettings, Model, Window


class WindowChain:
    """Runs a token batch through windows [0, a), [a, b), ..., [z, n_layer) of one Model, in order.

    With head_output=True the last window also returns its hidden state and an output-only window turns
    it into logits, as when the model's last layer runs on a device other than the head.
    """

    def __init__(
        self,
        model: Model,
        windows: Sequence[LayerRange],
        *,
        settings: ContextSettings | None = None,
        head_output: bool = False,
    ) -> None:
        # the windows run back to back: their threads spin between them instead of sleeping and being woken for
        # each (a wake-up cost about 0.4 ms per window on a 2-core VM), and sleep after the last one
        base = settings or ContextSettings()
        settings = dataclasses.replace(base, poll=max(base.poll, BUSY_POLL))
        n_layer = model.layout.n_layer
        check_cover(windows, n_layer)
        self.model = model
        # on a model with per-layer inputs, tokens enter through the input window [0, 0) (engine/model.py)
        entry = [model.window(0, 0, output_hidden=True, settings=settings)] if model.layout.input_window else []
        self.windows: list[Window] = entry + [
            model.window(w.start, w.end, output_hidden=w.end < n_layer or head_output, settings=settings)
            for w in windows
        ]
        if head_output:
            self.windows.append(model.window(n_layer, n_layer, settings=settings))

    def forward(self, tokens: Sequence[int] | np.ndarray, pos0: int, *, seq_id: int = 0,
                logits: str = "last") -> np.ndarray:
        """Logits of the last token (logits="last") or of every token ("all") of the batch."""
        x: Sequence[int] | np.ndarray = tokens
        try:
            for w in self.windows:
                x = w.forward(x, pos0, seq_id=seq_id, logits=logits)
        finally:
            self.model.pause_threads()  # windows poll between each other (BUSY_POLL), never after the last
        return np.asarray(x)

    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        for w in self.windows:
            w.kv_remove(seq_id, p0, p1)

    def kv_clear(self) -> None:
        for w in self.windows:
            w.kv_clear()
