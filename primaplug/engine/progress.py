"""Which layer a window is computing, told while it computes: what a node streaming its weights layer by layer
needs to release a layer's weights as soon as it is done and to page in the next ones.

llama.cpp's scheduler asks an eval callback, for every tensor of the graph in order, whether to stop there
("ask"); where the answer is yes it computes up to that tensor and calls back ("observe"). Stopping at the first
tensor of each layer (names end in "-<layer>") gives one call per layer, when the previous layer is done. The
results do not change (the same operations run in the same order, `tests/test_engine_progress.py`); the splits
cost about 1 ms a token on Gemma 3 270M, so windows that do not stream their weights go without it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from llama_cpp import llama_cpp as _ll

from primaplug.engine import _native

log = logging.getLogger(__name__)

_ggml_get_name = _native._ggml_base.ggml_get_name
_ggml_get_name.argtypes = [ctypes.c_void_p]
_ggml_get_name.restype = ctypes.c_char_p


def tensor_layer(name: bytes) -> int | None:
    """The layer a graph tensor belongs to ("attn_norm-5", "ffn_out-12 (reshaped)"), or None ("result_norm")."""
    stem = name.split(b" ", 1)[0]
    _, dash, tail = stem.rpartition(b"-")
    return int(tail) if dash and tail.isdigit() else None


class LayerProgress:
    """The eval callback of one window: calls on_layer(il) when layer il starts (the layer before it is done)."""

    def __init__(self, on_layer: Callable[[int], None]) -> None:
        self.on_layer = on_layer
        self._asked: int | None = None
        self._failed = False
        self.callback = _ll.ggml_backend_sched_eval_callback(self._call)  # kept alive as long as the window

    def reset(self) -> None:
        """Before each llama_decode: the graph starts from the window's first layer again."""
        self._asked = None

    def _call(self, tensor: int, ask: bool, _user: int) -> bool:
        il = tensor_layer(_ggml_get_name(tensor) or b"")
        if ask:
            if il is None or il == self._asked:
                return False
            self._asked = il
            return True
        try:
            if il is not None:
                self.on_layer(il)
        except Exception:  # a callback must not stop the computation (False would abort it)
            if not self._failed:
                log.exception("layer progress callback failed (further failures are not logged)")
            self._failed = True
        return True
