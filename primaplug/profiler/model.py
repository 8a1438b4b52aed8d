"""The model profiler: what one token costs, per layer and for the output layer, read from the GGUF header alone.

FLOPs are counted per token and split by the quantization type of the weights they multiply (the paper's f^q and
f^q_out), so a device's time for a layer is sum_q f^q / s^q with s^q measured by the device profiler on the same
kinds of weights. Counting rules (docs/profiler.md has the reasoning):

- a weight with two or more dimensions is a matmul: 2 * n_in * n_out FLOPs in the weight's type (normalised to
  the measured set QUANT_TYPES by `normalise_type`);
- attention scores and values read the F16 KV cache: 2 * n_head * (head_dim_k + head_dim_v) * n_kv FLOPs as F16
  (llama.cpp multiplies over every cell of the cache, sliding-window layers included: the engine's SWA cache is
  full size);
- everything else (norms, RoPE, softmax, activations, residual adds) is F32.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from primaplug.core.profiles import QUANT_TYPES, ModelProfile
from primaplug.engine.ggml_types import block
from primaplug.engine.layout import ModelLayout, TensorSpan

# float and integer types that are not block quantizations map by kind, not by bits per weight
_BY_KIND = {"BF16": "F16", "F64": "F32", "I8": "F32", "I16": "F32", "I32": "F32", "I64": "F32"}
# llama.cpp's KV cache holds F16 keys and values (the engine does not change type_k/type_v)
KV_TYPE = "F16"
# llama.cpp pads the KV cache to 256 cells and attends over all of them
KV_PAD = 256

# F32 operations per element of the non-matmul steps (approximate; they are a few percent of a layer at most)
_NORM_FLOPS = 4  # square, sum, scale, multiply by the norm weight
_ROPE_FLOPS = 3  # 4 multiplies and 2 adds per rotated pair
_SOFTMAX_FLOPS = 5  # scale, mask, max, exp, normalise
_GLU_FLOPS = 5  # activation (about 4) and the gate multiply
_RESIDUAL_ADDS = 2  # after attention and after the FFN


def _bits_per_weight(type_name: str) -> float:
    per_block, size = block(type_name)
    return 8 * size / per_block


_MEASURED_BPW = {q: _bits_per_weight(q) for q in QUANT_TYPES}


def normalise_type(type_name: str) -> str:
    """The measured type (QUANT_TYPES) whose speed stands for a tensor type's speed.

    Floats and integers map by kind (BF16 -> F16; F64 and integer tensors -> F32). Block quantizations map to the
    measured type with the nearest bits per weight, the lower one on a tie: Q4_0, Q4_1, IQ4_*, MXFP4 and the
    sub-4-bit types -> Q4_K; Q5_0, Q5_1 -> Q5_K; Q8_1, Q8_K -> Q8_0. Their kernels differ, but their weights are
    read at the same rate, which is what a device's compute speed mostly follows on CPUs.
    """
    if type_name in _MEASURED_BPW:
        return type_name
    if type_name in _BY_KIND:
        return _BY_KIND[type_name]
    bpw = _bits_per_weight(type_name)  # KeyError for a name ggml does not know
    return min(QUANT_TYPES, key=lambda q: (abs(_MEASURED_BPW[q] - bpw), _MEASURED_BPW[q]))


def kv_cells(n_ctx: int) -> int:
    """KV-cache cells llama.cpp allocates and attends over for a context of n_ctx tokens."""
    return -(-max(1, n_ctx) // KV_PAD) * KV_PAD


def _matmul_flops(t: TensorSpan) -> float:
    n_out = 1
    for d in t.shape[1:]:
        n_out *= d
    return 2.0 * t.shape[0] * n_out


def _ffn_width(tensors: tuple[TensorSpan, ...], n_expert_used: int = 0) -> int:
    """The FFN's width a token computes: the dense FFN's, or each routed expert's times the experts it uses."""
    for t in tensors:
        if ".ffn_up." in t.name and len(t.shape) >= 2:
            return t.shape[1]
        if ".ffn_up_exps." in t.name and len(t.shape) == 3:
            return t.shape[1] * n_expert_used
    return 0


def _token_share(t: TensorSpan, layout: ModelLayout) -> float:
    """The share of a tensor's weights one token multiplies with: n_expert_used of the n_expert experts of a routed
    expert tensor ([cols, rows, n_expert] in GGUF's order), all of any other."""
    if layout.is_routed_expert(t):
        return layout.n_expert_used / layout.n_expert
    return 1.0


def layer_flops(layout: ModelLayout, layer: int, n_kv: int) -> dict[str, float]:
    """FLOPs one token costs in one layer, by measured type, with n_kv tokens in the KV cache. A mixture of experts'
    token computes its router and only the experts it is routed to (n_expert_used of n_expert)."""
    out: dict[str, float] = defaultdict(float)
    tensors = layout.layer_tensors(layer)
    elementwise = 0.0
    has_gate = False
    for t in tensors:
        if len(t.shape) >= 2:
            out[normalise_type(t.type_name)] += _matmul_flops(t) * _token_share(t, layout)
            has_gate = has_gate or ".ffn_gate." in t.name or ".ffn_gate_exps." in t.name
        else:
            elementwise += t.shape[0] * (_NORM_FLOPS if "norm" in t.name else 1)
    e, n_head = layout.n_embd, layout.n_head
    dim_k, dim_v = layout.head_dims(layer)
    q_dim, k_dim = n_head * dim_k, layout.n_head_kv[layer] * dim_k
    elementwise += _ROPE_FLOPS * (q_dim + k_dim) + _SOFTMAX_FLOPS * n_head * n_kv + _RESIDUAL_ADDS * e
    elementwise += (_GLU_FLOPS if has_gate else _GLU_FLOPS - 1) * _ffn_width(tensors, layout.n_expert_used)
    out["F32"] += elementwise
    out[KV_TYPE] += 2.0 * n_head * (dim_k + dim_v) * n_kv
    return dict(out)


def output_flops(layout: ModelLayout) -> dict[str, float]:
    """FLOPs one token costs in the output layer (output norm and lm_head), by measured type."""
    out: dict[str, float] = defaultdict(float)
    for t in layout.output_tensors:
        if len(t.shape) >= 2:
            out[normalise_type(t.type_name)] += _matmul_flops(t)
        else:
            out["F32"] += _NORM_FLOPS * t.shape[0]
    return dict(out)


def compute_buffer_layers_bytes(layout: ModelLayout, n_ctx: int, n_batch: int, n_ubatch: int) -> int:
    """llama.cpp's CPU compute buffer for a context over a window of layers that outputs hidden states.

    llama.cpp sizes it once, for its worst case: a full micro-batch of T = n_ubatch tokens against a full cache of
    n_kv cells. Two phases of a layer can be the peak (F32 throughout):
      attention: the scores of every head, T*n_kv*n_head, plus the KQ masks (T*n_kv each; Gemma 3's sliding
                 window layers add a second) and about 2(e + n_ff) per token live around them;
      FFN:       the masks plus about 3*n_ff + 5e per token.
    Checked against llama.cpp's own figure (tests/test_profiler.py, docs/profiler.md): within -10% to +27% over
    synthetic models and Gemma 3 for n_ctx 256..8192 and n_ubatch 32..512, closest when attention dominates.
    """
    t = _ubatch(n_ctx, n_batch, n_ubatch)
    n_kv = kv_cells(n_ctx)
    n_masks = 2 if layout.sliding_window and any(layout.swa_layers) else 1
    e = layout.n_embd
    ff = max((_ffn_width(layout.layer_tensors(il), layout.n_expert_used) for il in range(layout.n_layer)), default=0)
    attention = t * n_kv * (layout.n_head + n_masks) + t * 2 * (e + ff)
    ffn = t * n_kv * n_masks + t * (3 * ff + 5 * e)
    return 4 * max(attention, ffn)


def compute_buffer_output_bytes(layout: ModelLayout, n_ctx: int, n_batch: int, n_ubatch: int) -> int:
    """llama.cpp's CPU compute buffer for the output-only context: the logits of a full micro-batch (T*V floats)
    and about three hidden rows per token. Exact (to 0.1%) against llama.cpp for Gemma 3 and synthetic models."""
    t = _ubatch(n_ctx, n_batch, n_ubatch)
    return 4 * t * (layout.n_vocab + 3 * layout.n_embd)


def _ubatch(n_ctx: int, n_batch: int, n_ubatch: int) -> int:
    # llama.cpp clamps n_batch to the context and n_ubatch to n_batch
    return max(1, min(n_ubatch, n_batch, kv_cells(n_ctx)))


def model_types(profile: ModelProfile) -> tuple[str, ...]:
    """The measured types a model's layers and output layer use: what a device must be profiled for."""
    used = {q for q, f in (*profile.layer_flops.items(), *profile.output_flops.items()) if f > 0}
    return tuple(q for q in QUANT_TYPES if q in used)


def profile_model(layout: ModelLayout, *, n_ctx: int, n_batch: int, n_ubatch: int) -> ModelProfile:
    """The model as Halda sees it, for a context of n_ctx tokens and the given batch sizes."""
    n_layer = layout.n_layer
    per_layer: dict[str, float] = defaultdict(float)
    for il in range(n_layer):
        for q, f in layer_flops(layout, il, n_ctx).items():
            per_layer[q] += f
    kv = sum(layout.kv_bytes_per_token(il) for il in range(n_layer)) / n_layer
    layers_buffer = compute_buffer_layers_bytes(layout, n_ctx, n_batch, n_ubatch)
    return ModelProfile(
        name=Path(layout.path).stem,
        n_layer=n_layer,
        n_vocab=layout.n_vocab,
        n_embd=layout.n_embd,
        layer_bytes=round(sum(layout.layer_bytes(il) for il in range(n_layer)) / n_layer),
        input_bytes=layout.input_bytes,
        output_bytes=layout.output_bytes,
        output_copy_bytes=layout.output_copy_bytes,
        layer_flops={q: per_layer[q] / n_layer for q in QUANT_TYPES if per_layer.get(q)},
        output_flops={q: f for q, f in sorted(output_flops(layout).items(), key=lambda x: QUANT_TYPES.index(x[0]))},
        kv_bytes_per_token_layer=round(kv),
        n_kv=n_ctx,
        compute_buffer_cpu_bytes=layers_buffer,
        # a window on the GPU builds the same graph there; its CPU side then keeps only inputs and outputs
        compute_buffer_gpu_bytes=layers_buffer,
        compute_buffer_output_bytes=compute_buffer_output_bytes(layout, n_ctx, n_batch, n_ubatch),
        compute_buffer_row_bytes=compute_buffer_layers_bytes(layout, n_ctx, 1, 1),
        layer_expert_bytes=round(sum(layout.n_expert * layout.expert_bytes(il) for il in range(n_layer)) / n_layer),
        expert_token_share=layout.n_expert_used / layout.n_expert if layout.n_expert else 0.0,
        state_bytes_layer=round(sum(layout.cache_bytes(il, n_ctx) for il in range(n_layer) if layout.is_recurrent(il))
                                / n_layer),
        # the head keeps those of the shared-KV tail, which it runs (head/ring.py): the others travel
        per_layer_input_bytes=4 * (layout.row_width(0, layout.n_layer - layout.kv_tail) - layout.n_embd),
        tail_layers=layout.kv_tail,
        barred_starts=layout.barred_starts,
    )
