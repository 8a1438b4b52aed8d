"""Which layer a window is computing, told while it computes: what a node streaming its weights layer by layer
needs to release a layer's weights as soon as it is done and to page in the next ones. For a mixture of experts,
also which experts each layer's router chose, before they compute: what a node reading only those needs
(memory/experts.py).

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

import numpy as np
from llama_cpp import llama_cpp as _ll

from primaplug.engine import _native

log = logging.getLogger(__name__)

_ggml_get_name = _native._ggml_base.ggml_get_name
_ggml_get_name.argtypes = [ctypes.c_void_p]
_ggml_get_name.restype = ctypes.c_char_p
_ggml_tensor_overhead = _native._ggml_base.ggml_tensor_overhead
_ggml_tensor_overhead.restype = ctypes.c_size_t

GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
_GGML_OBJECT_SIZE = 32  # ggml-impl.h: struct ggml_object, which ggml_tensor_overhead() counts with the tensor

# names llama-graph.cpp gives a mixture of experts' router (build_moe_ffn): its matmul, whose second source is
# the router's input, and the experts it chose for each token ([n_expert_used, n_tokens] int32)
ROUTER_LOGITS, ROUTER_CHOICE = b"ffn_moe_logits", b"ffn_moe_topk"


class _Tensor(ctypes.Structure):
    """ggml.h's struct ggml_tensor, as far as reading a computed tensor needs; checked against the library's size
    at import (ROUTES_READABLE), since a change of ggml's layout would read garbage."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


ROUTES_READABLE = ctypes.sizeof(_Tensor) == _ggml_tensor_overhead() - _GGML_OBJECT_SIZE


def read_2d(tensor: int, dtype: type) -> np.ndarray | None:
    """A computed 2-D tensor in host memory as a (rows, cols) copy (ggml's ne[1] rows of ne[0]), or None when it
    is not of that type or not on the host."""
    t = _Tensor.from_address(tensor)
    want = GGML_TYPE_F32 if dtype is np.float32 else GGML_TYPE_I32
    if t.type != want or not t.data or t.ne[2] != 1 or t.ne[3] != 1:
        return None
    cols, rows = int(t.ne[0]), int(t.ne[1])
    if rows == 0:  # a last layer computes only the rows that give outputs: in some micro-batches, none
        return np.zeros((0, cols), dtype=dtype)
    span = (rows - 1) * t.nb[1] + (cols - 1) * t.nb[0] + np.dtype(dtype).itemsize
    buf = (ctypes.c_char * span).from_address(t.data)
    return np.ndarray((rows, cols), dtype=dtype, buffer=buf, strides=(t.nb[1], t.nb[0])).copy()


def router_input(tensor: int) -> np.ndarray | None:
    """The router's input (n_tokens, n_embd) of an observed ffn_moe_logits tensor: the matmul's second source."""
    src = _Tensor.from_address(tensor).src[1]
    return read_2d(src, np.float32) if src else None


def tensor_layer(name: bytes) -> int | None:
    """The layer a graph tensor belongs to ("attn_norm-5", "ffn_out-12 (reshaped)"), or None ("result_norm")."""
    stem = name.split(b" ", 1)[0]
    _, dash, tail = stem.rpartition(b"-")
    return int(tail) if dash and tail.isdigit() else None


# on_route(layer, chosen experts (n_tokens, n_expert_used) int32, router input (n_tokens, n_embd) float32 or None)
OnRoute = Callable[[int, np.ndarray, "np.ndarray | None"], None]


class LayerProgress:
    """The eval callback of one window: calls on_layer(il) when layer il starts (the layer before it is done), and
    on_route(il, experts, x) when a mixture of experts' router of layer il has chosen, before the experts compute.
    Either may be None. llama.cpp computes up to each tensor it stops at, so a stop costs a split of the graph."""

    def __init__(self, on_layer: Callable[[int], None] | None, on_route: OnRoute | None = None) -> None:
        self.on_layer, self.on_route = on_layer, on_route
        self._asked: int | None = None
        self._x: np.ndarray | None = None  # the router input of the layer whose choice comes next
        self._failed = False
        self.callback = _ll.ggml_backend_sched_eval_callback(self._call)  # kept alive as long as the window

    def reset(self) -> None:
        """Before each llama_decode: the graph starts from the window's first layer again."""
        self._asked = None

    def _call(self, tensor: int, ask: bool, _user: int) -> bool:
        name = _ggml_get_name(tensor) or b""
        il = tensor_layer(name)
        if il is None:
            return not ask
        routes = self.on_route is not None and ROUTES_READABLE
        stem = name.split(b" ", 1)[0].rpartition(b"-")[0]
        if ask:
            if routes and stem in (ROUTER_LOGITS, ROUTER_CHOICE):
                return True
            if self.on_layer is None or il == self._asked:
                return False
            self._asked = il
            return True
        try:
            if routes and stem == ROUTER_LOGITS:
                self._x = router_input(tensor)
            elif routes and stem == ROUTER_CHOICE:
                chosen = read_2d(tensor, np.int32)
                if chosen is not None and self.on_route is not None:
                    self.on_route(il, chosen, self._x)
                self._x = None
            elif self.on_layer is not None:
                self.on_layer(il)
        except Exception:  # a callback must not stop the computation (False would abort it)
            if not self._failed:
                log.exception("window eval callback failed (further failures are not logged)")
            self._failed = True
        return True
