"""Gemma 4 E2B/E4B's rows that carry per-layer inputs: a node refuses rows whose width or per-layer count its window
does not take, naming both, and the head refuses rows that come back to its window without the inputs it kept.
No engine: the windows here are stand-ins with the widths a real one has (engine/model.py, Window.in_width)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from primaplug.core import LayerRange
from primaplug.core.errors import ProtocolError
from primaplug.wire import PROTOCOL_VERSION, Activation, Assignment, ModelIdentity, Part, WindowSpec

N_EMBD, PER_LAYER, N_LAYER = 8, 4, 6


def _msg(width: int, per_layer: int, n_rows: int = 2) -> Activation:
    return Activation(proto=PROTOCOL_VERSION, epoch=1, step=1, round=0, parts=(Part(0, 0, n_rows),), width=width,
                      dtype="float32", per_layer=per_layer)


def _window(start: int, end: int) -> types.SimpleNamespace:
    """Layers [start, end) of a model whose rows carry every later layer's per-layer inputs."""
    return types.SimpleNamespace(layers=LayerRange(start, end), takes_tokens=False, n_embd=N_EMBD,
                                 in_width=N_EMBD + PER_LAYER * (N_LAYER - start))


def test_a_node_refuses_rows_its_window_does_not_take() -> None:
    from primaplug.node.deployment import Deployment

    window = _window(2, 4)
    computed: list[int] = []

    def compute(_round: int, rows: np.ndarray, _pos: np.ndarray, seq_id: np.ndarray) -> np.ndarray:
        computed.append(rows.shape[1])
        return np.zeros((len(rows), N_EMBD + PER_LAYER * (N_LAYER - 4)), np.float32)

    ident = ModelIdentity(identity="1:ab", file_name="m.gguf", n_layer=N_LAYER, n_embd=N_EMBD)
    node = Deployment(assignment=Assignment(epoch=1, model=ident, windows=(WindowSpec(2, 4),), successor="", n_ctx=64,
                                            n_batch=8, n_ubatch=8),
                      device=types.SimpleNamespace(window=lambda _r: window, compute=compute),  # type: ignore[arg-type]
                      out=None, n_layer=N_LAYER)  # type: ignore[arg-type]
    for width, per_layer in ((N_EMBD, 0), (window.in_width, 0), (window.in_width + PER_LAYER, 5 * PER_LAYER)):
        with pytest.raises(ProtocolError, match=rf"hidden states of width {width} \({per_layer} of them per-layer "
                                                rf"inputs\), window \[2, 4\) takes 24 \(16\)"):
            node._run(_msg(width, per_layer), np.zeros((2, width), np.float32))
    assert not computed
    nxt, out = node._run(_msg(24, 16), np.zeros((2, 24), np.float32))
    assert computed == [24] and nxt.per_layer == 8 and nxt.width == out.shape[1] == 16  # layers 4-5's go on


def test_the_head_refuses_rows_back_without_the_inputs_it_kept() -> None:
    from primaplug.head.ring import RingHead

    window = _window(4, 6)  # the head's last window: it kept layers 4-5's inputs when the tokens entered
    local = types.SimpleNamespace(window=lambda _r: window)
    head = RingHead([], None, None, 1, local, rounds=1, n_layer=N_LAYER, n_embd=N_EMBD,  # type: ignore[arg-type]
                    keep_from=4)
    with pytest.raises(ProtocolError, match="sequence 0 from position 0 came back without the per-layer inputs"):
        head.local_round(0, _msg(N_EMBD, 0), np.zeros((2, N_EMBD), np.float32))
