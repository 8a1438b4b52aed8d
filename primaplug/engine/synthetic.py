"""Synthetic GGUF models: random weights in a real architecture's layout, quantized by llama.cpp itself.

They load and run in llama.cpp exactly like downloaded models, so they serve for equality, memory and speed
tests at any size and layer count without a download. (Random weights say nothing about output quality or
about a draft model's acceptance rate.)
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from primaplug.core.errors import EngineError, ModelFormatError
from primaplug.core.settings import usable_cores
from primaplug.engine.layout import glm5_2_own_indexer

if TYPE_CHECKING:  # gguf (3 MiB) loads when a model is written: `primaplug synth`'s parser reads the names below
    from gguf import GGUFWriter

# llama_ftype values of llama.h (MXFP4_MOE: experts in MXFP4, as gpt-oss ships; the rest Q8_0)
FTYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18, "MXFP4_MOE": 38}
# each written with its real tensor names, shapes and hyper-parameters (llama.cpp's src/models/<arch>.cpp)
ARCHS = ("llama", "llama4", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "gpt-oss", "glm4moe", "mistral3",
         "granite", "gemma2", "gemma4", "olmo2", "phi3", "lfm2", "lfm2moe", "deepseek2",
         "qwen3next", "minimax-m2", "kimi-linear", "deepseek32", "glm-dsa")
MOE_ARCHS = ("llama4", "qwen3moe", "qwen35moe", "gpt-oss", "glm4moe", "gemma4", "lfm2moe", "deepseek2", "qwen3next",
             "minimax-m2", "kimi-linear", "deepseek32", "glm-dsa")
# DeepSeek's latent attention; V3.2's lightning indexer (deepseek32), and GLM 5's the same with an indexer in every
# layer (glm-dsa: GLM 5 and 5.1; GLM 5.2 shares one indexer's choice over several layers)
_DEEPSEEK_ARCHS = ("deepseek2", "deepseek32", "glm-dsa")
_INDEXER_ARCHS = ("deepseek32", "glm-dsa")
# DeepSeek V3.2's lightning indexer: heads, their width (at least the rotated part) and the keys each query attends
# to (few, so that the tests' prompts are attended sparsely)
_INDEXER_HEADS, _INDEXER_HEAD, _INDEXER_TOP_K = 4, 64, 16
_LFM2_ARCHS = ("lfm2", "lfm2moe")
# named shapes of an architecture that differ in which tensors they have: DeepSeek-V2-Lite's queries come from one
# projection (no q LoRA) and it routes by softmax over all experts, where V3 and R1 (deepseek2) route by sigmoid with a
# selection bias, within the best groups of experts
# Gemma 4 E2B and E4B are dense, with a per-layer input to every layer and their last layers reading earlier
# layers' keys and values
VARIANTS = {"deepseek2-lite": {"arch": "deepseek2", "q_lora_rank": 0, "expert_groups": 0},
            "gemma4-e2b": {"arch": "gemma4", "n_expert": 0, "n_embd_per_layer": 256, "n_kv_shared": 1},
            # GLM 5.2: an indexer of their own in the first two layers and every fourth from the third; the layers
            # between attend to the keys the last of them chose
            "glm-5.2": {"arch": "glm-dsa", "shared_indexers": True}}
SYNTH_NAMES = ARCHS + tuple(VARIANTS)
# gated delta-net layers (recurrent state) with full attention every QWEN35_ATTENTION_INTERVAL-th layer (the real
# models: every 4th; here every 3rd, so that 7 layers hold two attention layers); Qwen3-Next is their predecessor,
# with plain rope where Qwen 3.5 has M-RoPE
QWEN35_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
QWEN35_ATTENTION_INTERVAL = 3
_QKV_BIAS = ("qwen2", "gpt-oss", "glm4moe")
_POST_ATTN_NORM = ("gemma2", "olmo2", "gpt-oss", "glm4moe")  # the last two: it is also the FFN's input norm
_SLIDING = ("gpt-oss", "gemma2", "gemma4")  # sliding-window attention on alternate layers (gemma4: gemma4_sliding)


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic model. K-quants need n_embd and n_ff to be multiples of 256."""

    arch: str = "llama"
    n_layer: int = 7
    n_embd: int = 256
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2  # fewer KV heads than query heads: grouped-query attention
    n_vocab: int = 512
    n_ctx_train: int = 4096
    seed: int = 0
    # mixture of experts (MOE_ARCHS): each layer's FFN is n_expert experts of n_ff_exp rows, n_expert_used per token
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    # glm4moe: a shared expert beside the routed ones, dense leading layers (gemma4 too), and the multi-token-prediction
    # layers (NextN) that follow the trunk in the file (blk.{n_layer}...) and that a plain run skips
    n_expert_shared: int = 1
    n_dense_lead: int = 1
    n_nextn: int = 1
    sliding_window: int = 32  # _SLIDING archs: short, so that the tests' prompts outgrow it
    # deepseek2's multi-head latent attention: queries through a rank-q_lora_rank bottleneck (0: one projection),
    # keys and values from one compressed vector of kv_lora_rank (what the cache holds, with the rotated part of the
    # key, mla_rope wide); heads of mla_nope + mla_rope for keys and mla_v for values once decompressed.
    # expert_groups > 0: experts in that many groups, a token's chosen from the best expert_groups_used of them
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    mla_rope: int = 32
    mla_nope: int = 64
    mla_v: int = 64
    expert_groups: int = 4
    expert_groups_used: int = 2
    # > 0: expert e's router row scaled by (e + 1) ** -router_skew (then to a mean of 1): its logits spread more,
    # so it is chosen more often, the low-numbered experts most. Random weights otherwise route uniformly.
    router_skew: float = 0.0
    # > 0: the layers from this one on add deep_scale times as much to the residual stream (their attention output
    # and FFN down projections scaled), so that the first layers nearly decide the output and, alone, make a draft
    # that agrees with the model as often as deep_scale allows (benchmarks/drafts.py: truncated_draft)
    shallow_layers: int = 0
    deep_scale: float = 1.0
    # gemma4 as E2B/E4B: each layer's per-layer input of this width (0: none), and the last n_kv_shared layers with
    # no keys and values of their own (each reads the last layer of its kind before them)
    n_embd_per_layer: int = 0
    n_kv_shared: int = 0
    # glm-dsa as GLM 5.2: layers with no indexer of their own (glm5_2_own_indexer)
    shared_indexers: bool = False

    def out_scale(self, il: int) -> float:
        """How much layer il's outputs (attention output, FFN down) are scaled: deep_scale past shallow_layers."""
        return self.deep_scale if 0 < self.shallow_layers <= il else 1.0

    @property
    def n_blocks(self) -> int:
        """Blocks in the file: the layers, and glm4moe's NextN layers after them."""
        return self.n_layer + (self.n_nextn if self.arch == "glm4moe" else 0)


def _vocab(n_vocab: int, specials: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    """An SPM vocabulary: <unk> <s> </s>, the 256 byte tokens, then made-up pieces; `specials` (control tokens that
    llama.cpp looks up by name for an architecture) take the last places."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte...
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        piece = "\u2581" + letters[i % 26] + letters[(i // 26) % 26] + (str(i // 676) if i >= 676 else "")
        tokens.append(piece)
        types.append(1)
        i += 1
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(k) for k in range(n_vocab - 259)]
    tokens, scores, types = tokens[:n_vocab], scores[:n_vocab], types[:n_vocab]
    for k, name in enumerate(specials, start=n_vocab - len(specials)):
        tokens[k], scores[k], types[k] = name, 0.0, 3
    return tokens, scores, types


def _tensors(spec: SyntheticSpec,
             rng: np.random.Generator) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """Every tensor of the model in file order: name, shape (rows, cols) and a maker that draws its values.
    Makers must be called in this order: they share one random generator, so the same seed gives the same model."""
    e, hd = spec.n_embd, spec.n_embd // spec.n_head
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd

    def mat(rows: int, cols: int, scale: float = 1.0) -> Callable[[], np.ndarray]:
        return lambda: (scale * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def experts(n: int, rows: int, cols: int) -> Callable[[], np.ndarray]:
        return lambda: (rng.standard_normal((n, rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int, gain: float = 1.0) -> Callable[[], np.ndarray]:
        return lambda: (gain * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    def bias(*shape: int) -> Callable[[], np.ndarray]:
        return lambda: (0.1 * rng.standard_normal(shape)).astype(np.float32)

    # scaled up so that logits spread widely and greedy choices are far from ties
    # (LFM2's small: its lm_head is its embedding and no post-norm scales its layers' outputs up, so a large one
    # would outweigh them in the residual stream and every step would repeat its input token)
    embd = 0.25 if spec.arch in _LFM2_ARCHS else 1.0
    yield "token_embd.weight", (spec.n_vocab, e), lambda: (embd * rng.standard_normal((spec.n_vocab, e))).astype(
        np.float32)
    if spec.n_embd_per_layer:  # Gemma 4 E2B/E4B: every layer's per-layer input, from the token and the embedding
        n = spec.n_embd_per_layer * spec.n_layer
        yield "per_layer_token_embd.weight", (spec.n_vocab, n), lambda: rng.standard_normal(
            (spec.n_vocab, n)).astype(np.float32)
        yield "per_layer_model_proj.weight", (n, e), mat(n, e)
        yield "per_layer_proj_norm.weight", (spec.n_embd_per_layer,), norm(spec.n_embd_per_layer)
    a = spec.arch
    for il in range(spec.n_blocks):
        p = f"blk.{il}."
        if a == "gemma4":
            yield from _gemma4_layer(spec, il, mat, norm, experts)
            continue
        if a in QWEN35_ARCHS:
            yield from _qwen35_layer(spec, il, mat, norm, bias, experts)
            continue
        if a in _LFM2_ARCHS:
            yield from _lfm2_layer(spec, il, mat, norm, bias, experts)
            continue
        if a in _DEEPSEEK_ARCHS:
            yield from _deepseek2_layer(spec, il, mat, norm, bias, experts)
            continue
        if a == "kimi-linear":
            yield from _kimi_linear_layer(spec, il, mat, norm, bias, experts)
            continue
        if a != "olmo2":  # olmo2 normalises after attention and FFN only
            yield p + "attn_norm.weight", (e,), norm(e)
        if a == "phi3":  # one fused projection
            yield p + "attn_qkv.weight", (q_dim + 2 * kv_dim, e), mat(q_dim + 2 * kv_dim, e)
        else:
            yield p + "attn_q.weight", (q_dim, e), mat(q_dim, e)
            yield p + "attn_k.weight", (kv_dim, e), mat(kv_dim, e)
            yield p + "attn_v.weight", (kv_dim, e), mat(kv_dim, e)
        if a in _QKV_BIAS:
            for name, n in (("attn_q.bias", q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)):
                yield p + name, (n,), bias(n)
        if a in ("qwen3", "qwen3moe"):
            yield p + "attn_q_norm.weight", (hd,), norm(hd)
            yield p + "attn_k_norm.weight", (hd,), norm(hd)
        if a in ("olmo2", "minimax-m2"):  # over all heads at once
            yield p + "attn_q_norm.weight", (q_dim,), norm(q_dim)
            yield p + "attn_k_norm.weight", (kv_dim,), norm(kv_dim)
        yield p + "attn_output.weight", (e, q_dim), mat(e, q_dim, spec.out_scale(il))
        if a == "gpt-oss":
            yield p + "attn_output.bias", (e,), bias(e)
            yield p + "attn_sinks.weight", (spec.n_head,), bias(spec.n_head)
        if a in _POST_ATTN_NORM:
            yield p + "post_attention_norm.weight", (e,), norm(e)
        if a not in ("olmo2", "gpt-oss", "glm4moe"):
            yield p + "ffn_norm.weight", (e,), norm(e)
        if a in MOE_ARCHS and not (a == "glm4moe" and il < spec.n_dense_lead) and not (
                a == "llama4" and not llama4_moe(il)):
            yield from _moe_ffn(spec, p, mat, experts, bias)
        elif a == "phi3":  # gate and up fused
            yield p + "ffn_up.weight", (2 * spec.n_ff, e), mat(2 * spec.n_ff, e)
            yield p + "ffn_down.weight", (e, spec.n_ff), mat(e, spec.n_ff)
        else:
            yield from _dense_ffn(spec, p, mat, spec.out_scale(il))
        if a in ("gemma2", "olmo2"):
            yield p + "post_ffw_norm.weight", (e,), norm(e)
        if il >= spec.n_layer:  # glm4moe's NextN layer: the hidden state and the next token's embedding, joined
            yield p + "nextn.eh_proj.weight", (e, 2 * e), mat(e, 2 * e)
            for name in ("nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"):
                yield p + name, (e,), norm(e)
    yield ("token_embd_norm.weight" if a in _LFM2_ARCHS else "output_norm.weight"), (e,), norm(e)  # lfm2's name
    if a not in ("gemma2", "gemma4", *_LFM2_ARCHS):  # their lm_head is their token embedding
        yield "output.weight", (spec.n_vocab, e), mat(spec.n_vocab, e, 4.0)


Maker = Callable[[], np.ndarray]


def _dense_ffn(spec: SyntheticSpec, p: str, mat: Callable[..., Maker],
               out_scale: float = 1.0) -> Iterator[tuple[str, tuple[int, ...], Maker]]:
    """A gated FFN of n_ff rows: gate, up and down (scaled by out_scale)."""
    e, f = spec.n_embd, spec.n_ff
    yield p + "ffn_gate.weight", (f, e), mat(f, e)
    yield p + "ffn_up.weight", (f, e), mat(f, e)
    yield p + "ffn_down.weight", (e, f), mat(e, f, out_scale)


def llama4_moe(il: int) -> bool:
    """Whether layer il of a synthetic Llama 4 is a mixture of experts (every second, as Maverick; Scout: all)."""
    return (il + 1) % 2 == 0


def lfm2_attention(il: int) -> bool:
    """Whether layer il of a synthetic LFM2 is attention (else a short convolution): every third."""
    return (il + 1) % 3 == 0


_LFM2_CONV = 3  # the short convolution's kernel (shortconv.l_cache)


def _lfm2_layer(spec: SyntheticSpec, il: int, mat: Callable[..., Maker], norm: Callable[..., Maker],
                bias: Callable[..., Maker],
                experts: Callable[[int, int, int], Maker]) -> Iterator[tuple[str, tuple[int, ...], Maker]]:
    """An LFM2 block (llama.cpp's models/lfm2.cpp): a gated short convolution (its last inputs are the layer's
    recurrent state) or attention with Q/K norms and no KV head in the others; then a dense FFN, or in LFM2-MoE
    (lfm2moe) past its dense leading layers, routed experts (sigmoid routing with a selection bias)."""
    e, p, hd = spec.n_embd, f"blk.{il}.", spec.n_embd // spec.n_head
    yield p + "attn_norm.weight", (e,), norm(e)
    if lfm2_attention(il):
        kv = spec.n_head_kv * hd
        yield p + "attn_q_norm.weight", (hd,), norm(hd)
        yield p + "attn_k_norm.weight", (hd,), norm(hd)
        yield p + "attn_q.weight", (e, e), mat(e, e)
        yield p + "attn_k.weight", (kv, e), mat(kv, e)
        yield p + "attn_v.weight", (kv, e), mat(kv, e)
        yield p + "attn_output.weight", (e, e), mat(e, e)
    else:
        yield p + "shortconv.conv.weight", (e, _LFM2_CONV), mat(e, _LFM2_CONV)
        yield p + "shortconv.in_proj.weight", (3 * e, e), mat(3 * e, e)
        yield p + "shortconv.out_proj.weight", (e, e), mat(e, e)
    yield p + "ffn_norm.weight", (e,), norm(e)
    if spec.arch == "lfm2moe" and il >= spec.n_dense_lead:
        yield from _moe_ffn(spec, p, mat, experts, bias)
    else:
        yield from _dense_ffn(spec, p, mat)


def qwen35_recurrent(il: int) -> bool:
    """Whether layer il of a synthetic Qwen 3.5 is a gated delta-net layer (else full attention)."""
    return (il + 1) % QWEN35_ATTENTION_INTERVAL != 0


# a synthetic Qwen 3.5's gated delta-net: key heads (ssm.group_count), value heads (ssm.time_step_rank), their width
# (ssm.state_size) and the causal convolution's kernel
_DELTA_K_HEADS, _DELTA_V_HEADS, _DELTA_HEAD, _DELTA_CONV = 2, 4, 32, 4


def _qwen35_layer(spec: SyntheticSpec, il: int, mat: Callable[..., Maker], norm: Callable[..., Maker],
                  bias: Callable[..., Maker],
                  experts: Callable[[int, int, int], Maker]) -> Iterator[tuple[str, tuple[int, ...], Maker]]:
    """A Qwen 3.5 block (llama.cpp's models/qwen35.cpp, qwen35moe.cpp): a gated delta-net layer (a fused QKV that a
    causal convolution mixes, a gate, the decay's alpha and beta, the state's norm) or full attention whose query
    projection also makes an output gate; then a dense FFN (qwen35) or routed experts beside a gated shared expert.
    Qwen3-Next (qwen3next, models/qwen3next.cpp) is the same block with beta and alpha in one projection."""
    e, p, hd = spec.n_embd, f"blk.{il}.", spec.n_embd // spec.n_head
    yield p + "attn_norm.weight", (e,), norm(e)
    if qwen35_recurrent(il):
        key, value = _DELTA_K_HEADS * _DELTA_HEAD, _DELTA_V_HEADS * _DELTA_HEAD
        conv = 2 * key + value
        yield p + "attn_qkv.weight", (conv, e), mat(conv, e)
        yield p + "attn_gate.weight", (value, e), mat(value, e)
        yield p + "ssm_conv1d.weight", (conv, _DELTA_CONV), mat(conv, _DELTA_CONV)
        yield p + "ssm_dt.bias", (_DELTA_V_HEADS,), bias(_DELTA_V_HEADS)
        yield p + "ssm_a", (_DELTA_V_HEADS,), lambda: -np.linspace(0.2, 1.0, _DELTA_V_HEADS, dtype=np.float32)
        if spec.arch == "qwen3next":  # beta and alpha in one projection
            yield p + "ssm_ba.weight", (2 * _DELTA_V_HEADS, e), mat(2 * _DELTA_V_HEADS, e)
        else:
            yield p + "ssm_beta.weight", (_DELTA_V_HEADS, e), mat(_DELTA_V_HEADS, e)
            yield p + "ssm_alpha.weight", (_DELTA_V_HEADS, e), mat(_DELTA_V_HEADS, e)
        yield p + "ssm_norm.weight", (_DELTA_HEAD,), norm(_DELTA_HEAD)
        yield p + "ssm_out.weight", (e, value), mat(e, value)
    else:
        q, kv = 2 * spec.n_head * hd, spec.n_head_kv * hd
        yield p + "attn_q.weight", (q, e), mat(q, e)
        yield p + "attn_k.weight", (kv, e), mat(kv, e)
        yield p + "attn_v.weight", (kv, e), mat(kv, e)
        yield p + "attn_output.weight", (e, spec.n_head * hd), mat(e, spec.n_head * hd)
        yield p + "attn_q_norm.weight", (hd,), norm(hd)
        yield p + "attn_k_norm.weight", (hd,), norm(hd)
    yield p + "post_attention_norm.weight", (e,), norm(e)
    if spec.arch == "qwen35":
        yield from _dense_ffn(spec, p, mat)
        return
    x, f = spec.n_expert, spec.n_ff_exp
    yield p + "ffn_gate_inp.weight", (x, e), mat(x, e, 4.0)
    yield p + "ffn_gate_exps.weight", (x, f, e), experts(x, f, e)
    yield p + "ffn_up_exps.weight", (x, f, e), experts(x, f, e)
    yield p + "ffn_down_exps.weight", (x, e, f), experts(x, e, f)
    yield p + "ffn_gate_inp_shexp.weight", (e,), bias(e)
    yield p + "ffn_gate_shexp.weight", (f, e), mat(f, e)
    yield p + "ffn_up_shexp.weight", (f, e), mat(f, e)
    yield p + "ffn_down_shexp.weight", (e, f), mat(e, f)


def _deepseek2_layer(spec: SyntheticSpec, il: int, mat: Callable[..., Maker], norm: Callable[..., Maker],
                     bias: Callable[..., Maker],
                     experts: Callable[[int, int, int], Maker]) -> Iterator[tuple[str, tuple[int, ...], Maker]]:
    """A DeepSeek V2/V3 block (llama.cpp's models/deepseek2.cpp, as today's converter writes it): multi-head latent
    attention with the key's and value's decompressions as per-head matrices (attn_k_b, attn_v_b), then a dense FFN
    in the leading layers and routed experts beside shared ones after them."""
    e, p, h = spec.n_embd, f"blk.{il}.", spec.n_head
    q, kv, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.mla_rope
    k_head = spec.mla_nope + rope
    yield p + "attn_norm.weight", (e,), norm(e)
    if q:
        yield p + "attn_q_a_norm.weight", (q,), norm(q)
    yield p + "attn_kv_a_norm.weight", (kv,), norm(kv)
    if q:
        yield p + "attn_q_a.weight", (q, e), mat(q, e)
        yield p + "attn_q_b.weight", (h * k_head, q), mat(h * k_head, q)
    else:
        yield p + "attn_q.weight", (h * k_head, e), mat(h * k_head, e)
    yield p + "attn_kv_a_mqa.weight", (kv + rope, e), mat(kv + rope, e)
    yield p + "attn_k_b.weight", (h, kv, spec.mla_nope), experts(h, kv, spec.mla_nope)
    yield p + "attn_v_b.weight", (h, spec.mla_v, kv), experts(h, spec.mla_v, kv)
    yield p + "attn_output.weight", (e, h * spec.mla_v), mat(e, h * spec.mla_v, spec.out_scale(il))
    if spec.arch in _INDEXER_ARCHS and (not spec.shared_indexers or glm5_2_own_indexer(il)):
        # V3.2's lightning indexer, which picks the keys each query attends to
        n, w = _INDEXER_HEADS, _INDEXER_HEAD
        yield p + "indexer.k_norm.weight", (w,), norm(w)
        yield p + "indexer.k_norm.bias", (w,), bias(w)
        yield p + "indexer.proj.weight", (n, e), mat(n, e)
        yield p + "indexer.attn_k.weight", (w, e), mat(w, e)
        yield p + "indexer.attn_q_b.weight", (n * w, q), mat(n * w, q)
    yield p + "ffn_norm.weight", (e,), norm(e)
    if il < spec.n_dense_lead:
        yield from _dense_ffn(spec, p, mat, spec.out_scale(il))
    else:
        yield from _moe_ffn(spec, p, mat, experts, bias)


def kimi_attention(il: int) -> bool:
    """Whether layer il of a synthetic Kimi-Linear is latent attention (else Kimi delta attention): every third (the
    real model: every fourth)."""
    return (il + 1) % 3 == 0


_KDA_CONV = 4  # Kimi delta attention's short convolutions' kernel


def _kimi_linear_layer(spec: SyntheticSpec, il: int, mat: Callable[..., Maker], norm: Callable[..., Maker],
                       bias: Callable[..., Maker],
                       experts: Callable[[int, int, int], Maker]) -> Iterator[tuple[str, tuple[int, ...], Maker]]:
    """A Kimi-Linear block (llama.cpp's models/kimi-linear.cpp): Kimi delta attention (queries, keys and values each
    through a short convolution, a decay from a low-rank projection, a gate, a gated norm; a recurrent state), or
    latent attention without q LoRA, as deepseek2's; then a dense FFN in the leading layers, else routed experts
    (sigmoid with a bias) beside a shared one."""
    e, p, h = spec.n_embd, f"blk.{il}.", spec.n_head
    hd = e // h
    inner = h * hd
    yield p + "attn_norm.weight", (e,), norm(e)
    if kimi_attention(il):
        kv, rope, k_head = spec.kv_lora_rank, spec.mla_rope, spec.mla_nope + spec.mla_rope
        yield p + "attn_kv_a_norm.weight", (kv,), norm(kv)
        yield p + "attn_q.weight", (h * k_head, e), mat(h * k_head, e)
        yield p + "attn_kv_a_mqa.weight", (kv + rope, e), mat(kv + rope, e)
        yield p + "attn_k_b.weight", (h, kv, spec.mla_nope), experts(h, kv, spec.mla_nope)
        yield p + "attn_v_b.weight", (h, spec.mla_v, kv), experts(h, spec.mla_v, kv)
        yield p + "attn_output.weight", (e, h * spec.mla_v), mat(e, h * spec.mla_v)
    else:
        for x in ("q", "k", "v"):
            yield p + f"ssm_conv1d_{x}.weight", (inner, 1, _KDA_CONV), lambda: (
                0.5 * np.ones((inner, 1, _KDA_CONV), dtype=np.float32) / _KDA_CONV)
        for x in ("q", "k", "v"):
            yield p + f"attn_{x}.weight", (inner, e), mat(inner, e)
        yield p + "ssm_f_a.weight", (hd, e), mat(hd, e)
        yield p + "ssm_f_b.weight", (inner, hd), mat(inner, hd)
        yield p + "ssm_beta.weight", (h, e), mat(h, e)
        yield p + "ssm_a", (h, 1), lambda: -np.linspace(0.2, 1.0, h, dtype=np.float32).reshape(h, 1)
        yield p + "ssm_dt.bias", (inner,), bias(inner)
        yield p + "ssm_g_a.weight", (hd, e), mat(hd, e)
        yield p + "ssm_g_b.weight", (inner, hd), mat(inner, hd)
        yield p + "ssm_norm.weight", (hd,), norm(hd)
        yield p + "attn_output.weight", (e, inner), mat(e, inner)
    yield p + "ffn_norm.weight", (e,), norm(e)
    if il < spec.n_dense_lead:
        yield from _dense_ffn(spec, p, mat)
    else:
        yield from _moe_ffn(spec, p, mat, experts, bias)


def gemma4_sliding(il: int) -> bool:
    """Gemma 4's synthetic layer pattern: two sliding-window layers, then a global one (the real models: five, one)."""
    return il % 3 < 2


def _gemma4_layer(spec: SyntheticSpec, il: int, mat: Callable[..., Maker], norm: Callable[..., Maker],
                  experts: Callable[[int, int, int], Maker]) -> Iterator[tuple[str, tuple[int, ...], Maker]]:
    """A Gemma 4 block (llama.cpp's models/gemma4.cpp, as Gemma 4 26B-A4B): sliding layers with heads of e/n_head
    and n_head_kv key-value heads; global ones with heads twice as wide, one key-value head whose keys are also its
    values (no attn_v) and proportional rope (rope_freqs); a scalar on the block's output; after the dense first
    layers (n_dense_lead), a dense MLP beside the routed experts, whose gate and up are one tensor."""
    e, p = spec.n_embd, f"blk.{il}."
    sliding = gemma4_sliding(il)
    hd = spec.n_embd // spec.n_head * (1 if sliding else 2)
    kv = hd * (spec.n_head_kv if sliding else 1)
    own_kv = il < spec.n_layer - spec.n_kv_shared  # E2B/E4B: the last layers read earlier layers' keys and values
    yield p + "attn_norm.weight", (e,), norm(e)
    yield p + "attn_q.weight", (spec.n_head * hd, e), mat(spec.n_head * hd, e)
    if own_kv:
        yield p + "attn_k.weight", (kv, e), mat(kv, e)
    if sliding and own_kv:
        yield p + "attn_v.weight", (kv, e), mat(kv, e)
    if not sliding and all(gemma4_sliding(j) for j in range(il)):  # the first global layer holds the rope_freqs
        yield "rope_freqs.weight", (hd // 2,), norm(hd // 2)
    yield p + "attn_q_norm.weight", (hd,), norm(hd)
    if own_kv:
        yield p + "attn_k_norm.weight", (hd,), norm(hd)
    yield p + "attn_output.weight", (e, spec.n_head * hd), mat(e, spec.n_head * hd)
    # the embedding is scaled by sqrt(e) and is also the lm_head: post-norms as large let the layers, not the token
    # itself, decide the next token
    big = float(np.sqrt(e))
    yield p + "post_attention_norm.weight", (e,), norm(e, big)
    yield p + "layer_output_scale.weight", (1,), lambda: np.full(1, 0.9, dtype=np.float32)
    yield p + "ffn_norm.weight", (e,), norm(e)
    yield from _dense_ffn(spec, p, mat)
    yield p + "post_ffw_norm.weight", (e,), norm(e, big)
    if spec.n_embd_per_layer:  # the per-layer input, gated by the layer's output and added back to it
        n = spec.n_embd_per_layer
        yield p + "inp_gate.weight", (n, e), mat(n, e)
        yield p + "proj.weight", (e, n), mat(e, n)
        yield p + "post_norm.weight", (e,), norm(e)
    if spec.n_expert and il >= spec.n_dense_lead:
        x, f = spec.n_expert, spec.n_ff_exp
        yield p + "ffn_gate_inp.weight", (x, e), mat(x, e, 4.0 * np.sqrt(e))  # its input is scaled by 1/sqrt(e)
        yield p + "ffn_gate_inp.scale", (e,), norm(e)
        for name in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
            yield p + name + ".weight", (e,), norm(e)
        yield p + "ffn_gate_up_exps.weight", (x, 2 * f, e), experts(x, 2 * f, e)
        yield p + "ffn_down_exps.weight", (x, e, f), experts(x, e, f)


def _moe_ffn(spec: SyntheticSpec, p: str, mat: Callable[..., Maker], experts: Callable[[int, int, int], Maker],
             bias: Callable[..., Maker]) -> Iterator[tuple[str, tuple[int, ...], Maker]]:
    """A mixture-of-experts FFN: the router, then the experts as 3-D tensors (expert, row, column)."""
    e, x, f = spec.n_embd, spec.n_expert, spec.n_ff_exp
    gain = (np.arange(1, x + 1, dtype=np.float32) ** -spec.router_skew)[:, None]
    gain /= gain.mean()
    router = mat(x, e, 4.0)  # spread, so that routes are far from ties
    yield p + "ffn_gate_inp.weight", (x, e), lambda: router() * gain
    if spec.arch == "gpt-oss":
        yield p + "ffn_gate_inp.bias", (x,), bias(x)
    if spec.arch in ("glm4moe", "lfm2moe", "minimax-m2", "kimi-linear") or (
            spec.arch in _DEEPSEEK_ARCHS and spec.expert_groups):
        yield p + "exp_probs_b.bias", (x,), bias(x)  # the routing bias of DeepSeek-V3's auxiliary-loss-free balancing
    yield p + "ffn_gate_exps.weight", (x, f, e), experts(x, f, e)
    yield p + "ffn_up_exps.weight", (x, f, e), experts(x, f, e)
    yield p + "ffn_down_exps.weight", (x, e, f), experts(x, e, f)
    if spec.arch == "gpt-oss":
        yield p + "ffn_gate_exps.bias", (x, f), bias(x, f)
        yield p + "ffn_up_exps.bias", (x, f), bias(x, f)
        yield p + "ffn_down_exps.bias", (x, e), bias(x, e)
    if spec.arch in ("glm4moe", "llama4", "kimi-linear", *_DEEPSEEK_ARCHS):
        s = f * spec.n_expert_shared
        yield p + "ffn_gate_shexp.weight", (s, e), mat(s, e)
        yield p + "ffn_up_shexp.weight", (s, e), mat(s, e)
        yield p + "ffn_down_shexp.weight", (e, s), mat(e, s)


def write_synthetic_gguf(path: str | os.PathLike[str], spec: SyntheticSpec, *, dtype: str = "F32",
                         progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a GGUF with random weights for spec.arch (one of ARCHS), matrices in `dtype` ("F32"
    or "F16"; norms and biases stay F32). Tensors are drawn and written one at a time, so models larger than
    memory can be written; `progress(done, total)` is called with bytes after each tensor."""
    if spec.arch not in ARCHS:
        raise ModelFormatError(str(path), f"no synthetic writer for architecture '{spec.arch}' (have {ARCHS})")
    if spec.n_vocab < 260:
        raise ModelFormatError(str(path), "a synthetic vocabulary needs at least 260 tokens (3 special + 256 bytes)")
    if dtype not in ("F32", "F16"):
        raise ValueError(f"synthetic matrices are written as F32 or F16, not {dtype}")
    rng = np.random.default_rng(spec.seed)
    e, hd = spec.n_embd, spec.n_embd // spec.n_head

    from gguf import ExpertGatingFuncType, GGUFWriter

    w = GGUFWriter(os.fspath(path), spec.arch)
    w.add_name(f"synthetic-{spec.arch}-{spec.n_layer}L")
    w.add_block_count(spec.n_blocks)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(e)
    # MiniMax-M2's experts take their width from feed_forward_length (it has no dense FFN)
    w.add_feed_forward_length(spec.n_ff_exp if spec.arch == "minimax-m2" else spec.n_ff)
    w.add_head_count(spec.n_head)
    if spec.arch == "gemma4":  # sliding layers, then global ones with wider heads and one KV head (_gemma4_layer)
        w.add_head_count_kv([spec.n_head_kv if gemma4_sliding(il) else 1 for il in range(spec.n_layer)])
        w.add_key_length(2 * hd)
        w.add_value_length(2 * hd)
        w.add_key_length_swa(hd)
        w.add_value_length_swa(hd)
        w.add_rope_dimension_count_swa(hd)
        w.add_sliding_window_pattern([gemma4_sliding(il) for il in range(spec.n_layer)])
        w.add_embedding_length_per_layer_input(spec.n_embd_per_layer)  # E2B and E4B: a per-layer input each
        if spec.n_kv_shared:
            w.add_shared_kv_layers(spec.n_kv_shared)
        w.add_final_logit_softcapping(100.0)  # far from saturation: no near-ties at the cap
        w.add_rope_freq_base_swa(10000.0)
    elif spec.arch in _DEEPSEEK_ARCHS:  # MLA as one key-value head over the compressed vector (the converter's layout)
        w.add_head_count_kv(1)
        _add_mla(w, spec)
        w.add_q_lora_rank(spec.q_lora_rank)
    elif spec.arch == "kimi-linear":  # no KV head in a delta-attention layer; latent attention as one KV head
        w.add_head_count_kv([1 if kimi_attention(il) else 0 for il in range(spec.n_layer)])
        _add_mla(w, spec)
        w.add_ssm_conv_kernel(_KDA_CONV)
        w.add_kda_head_dim(hd)
    elif spec.arch in _LFM2_ARCHS:  # no KV head where a layer is a convolution: how llama.cpp tells them apart
        w.add_head_count_kv([spec.n_head_kv if lfm2_attention(il) else 0 for il in range(spec.n_layer)])
        w.add_uint32(f"{spec.arch}.shortconv.l_cache", _LFM2_CONV)
    else:
        w.add_head_count_kv(spec.n_head_kv)
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    if spec.arch == "mistral3":  # Llama 4's attention temperature: queries scaled by log(floor(pos / 64) + 1)
        w.add_attn_temperature_scale(0.1)
        w.add_rope_scaling_orig_ctx_len(64)
    if spec.arch == "granite":  # IBM Granite 3: scaled embeddings, residuals, attention and logits
        w.add_embedding_scale(12.0)
        w.add_residual_scale(0.22)
        w.add_attention_scale(1.0 / 64)
        w.add_logit_scale(0.25)
    if spec.arch in MOE_ARCHS and spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.arch == "glm4moe":  # GLM-4.5: sigmoid routing, normalised and scaled weights, partial rotary
        w.add_expert_shared_count(spec.n_expert_shared)
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_nextn_predict_layers(spec.n_nextn)
        w.add_rope_dimension_count(hd // 2)
    if spec.arch == "minimax-m2":  # MiniMax-M2: experts in every layer, sigmoid routing with a bias, half-rotary heads
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(1.0)
        w.add_rope_dimension_count(hd // 2)
    if spec.arch == "kimi-linear":  # Kimi-Linear-48B-A3B: a dense first layer, sigmoid routing with a bias
        w.add_expert_shared_count(spec.n_expert_shared)
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_weights_scale(2.5)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if spec.arch == "lfm2moe":  # LFM2-8B-A1B: dense leading layers, sigmoid routing with a bias, normalised weights
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(1.0)
    if spec.arch in _INDEXER_ARCHS:
        w.add_uint32(f"{spec.arch}.attention.indexer.head_count", _INDEXER_HEADS)
        w.add_uint32(f"{spec.arch}.attention.indexer.key_length", _INDEXER_HEAD)
        w.add_uint32(f"{spec.arch}.attention.indexer.top_k", _INDEXER_TOP_K)
        if spec.shared_indexers:
            w.add_array(f"{spec.arch}.attention.indexer.types",
                        [int(glm5_2_own_indexer(il)) for il in range(spec.n_layer)])
    if spec.arch in _DEEPSEEK_ARCHS:  # V3: sigmoid routing with a selection bias within groups; V2-Lite: softmax
        w.add_expert_shared_count(spec.n_expert_shared)
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_weights_scale(2.5 if spec.expert_groups else 1.0)
        w.add_expert_weights_norm(bool(spec.expert_groups))
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if spec.expert_groups else ExpertGatingFuncType.SOFTMAX)
        if spec.expert_groups:
            w.add_expert_group_count(spec.expert_groups)
            w.add_expert_group_used_count(spec.expert_groups_used)
    if spec.arch in _SLIDING:
        w.add_sliding_window(spec.sliding_window)
    if spec.arch in QWEN35_ARCHS:  # partial (M-)RoPE (a quarter of each head, as the real models), the delta-net
        half = hd // 8  # rotated pairs, split over M-RoPE's time, height and width sections
        w.add_rope_dimension_count(2 * half)
        if spec.arch != "qwen3next":
            w.add_rope_dimension_sections([3 * half // 8, 3 * half // 8, half - 2 * (3 * half // 8), 0])
        w.add_full_attention_interval(QWEN35_ATTENTION_INTERVAL)
        w.add_ssm_conv_kernel(_DELTA_CONV)
        w.add_ssm_inner_size(_DELTA_V_HEADS * _DELTA_HEAD)
        w.add_ssm_state_size(_DELTA_HEAD)
        w.add_ssm_time_step_rank(_DELTA_V_HEADS)
        w.add_ssm_group_count(_DELTA_K_HEADS)
    if spec.arch in ("qwen35moe", "qwen3next"):
        w.add_expert_shared_feed_forward_length(spec.n_ff_exp)
    if spec.arch == "llama4":  # experts every second layer beside a shared one, sigmoid routing; chunked attention
        w.add_uint32("llama4.interleave_moe_layer_step", 2)
    if spec.arch == "gemma2":  # soft-capped attention scores and logits
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(FTYPES[dtype])
    # llama.cpp sets Phi-3's special tokens' attributes by name
    tokens, scores, types = _vocab(spec.n_vocab, ("<|endoftext|>", "<|end|>") if spec.arch == "phi3" else ())
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def np_dtype(name: str, shape: tuple[int, ...]) -> type:
        # biases stay F32 however many dimensions they have (gpt-oss's expert biases are 2-D): ggml adds only F32;
        # so do the delta-net's and LFM2's convolution kernels, which ggml computes in F32 only
        return (np.float16 if dtype == "F16" and len(shape) >= 2 and name.endswith(".weight")
                and "ssm_conv1d" not in name and "shortconv.conv" not in name else np.float32)

    tensors = list(_tensors(spec, rng))
    total = 0
    for name, shape, _ in tensors:
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype(name, shape)).itemsize
        w.add_tensor_info(name, shape, np.dtype(np_dtype(name, shape)), nbytes)
        total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    done = 0
    for name, shape, make in tensors:
        data = make().astype(np_dtype(name, shape), copy=False)
        w.write_tensor_data(data)
        done += data.nbytes
        if progress:
            progress(done, total)
    w.close()
    return Path(path)


def _add_mla(w: GGUFWriter, spec: SyntheticSpec) -> None:
    """Latent attention's hyper-parameters as the converter writes them: the cached key is the compressed vector and
    its rotated part, the value the vector; the heads' widths once decompressed."""
    w.add_key_length(spec.kv_lora_rank + spec.mla_rope)
    w.add_value_length(spec.kv_lora_rank)
    w.add_key_length_mla(spec.mla_nope + spec.mla_rope)
    w.add_value_length_mla(spec.mla_v)
    w.add_kv_lora_rank(spec.kv_lora_rank)
    w.add_rope_dimension_count(spec.mla_rope)


def synthetic_spec(name: str, **shape: Any) -> SyntheticSpec:
    """The spec of an architecture (ARCHS) or of a named variant of one (VARIANTS), with `shape`'s fields."""
    if name in VARIANTS:
        return SyntheticSpec(**{**VARIANTS[name], **shape})
    if name not in ARCHS:
        raise ValueError(f"no synthetic writer for {name!r} (have {', '.join(SYNTH_NAMES)})")
    return SyntheticSpec(arch=name, **shape)


def spec_for_size(size_bytes: int, n_layer: int, *, ftype: str = "Q4_K_M", n_vocab: int = 4096, seed: int = 0,
                  arch: str = "llama", n_expert: int = 64, n_expert_used: int = 8,
                  router_skew: float = 0.0, shallow_layers: int = 0, deep_scale: float = 1.0) -> SyntheticSpec:
    """A shape of `arch` whose `ftype` file is about `size_bytes`: Llama-3-like proportions (head dim 128, a quarter
    as many KV heads, FFN 3.5x the embedding), the embedding a multiple of 256 for k-quants. A mixture of experts
    (MOE_ARCHS) gets n_expert experts of half the embedding's width each, n_expert_used a token (Qwen3-30B-A3B:
    128 of 0.375x, 8 a token). `arch` may name a variant (VARIANTS)."""
    if arch not in SYNTH_NAMES:
        raise ValueError(f"no synthetic writer for architecture {arch!r} (have {', '.join(SYNTH_NAMES)})")
    variant, arch = arch, VARIANTS.get(arch, {"arch": arch})["arch"]
    bits = {"Q4_K_M": 4.85, "Q4_K_S": 4.6, "Q5_K_M": 5.7, "Q6_K": 6.6, "Q8_0": 8.5, "F16": 16, "F32": 32,
            "MXFP4_MOE": 4.25}[ftype]
    moe = arch in MOE_ARCHS and VARIANTS.get(variant, {}).get("n_expert", 1) != 0  # gemma4-e2b: dense
    # weights per layer in units of e^2: q and o (1 each), k and v (1/4 each); then gate, up and down (3 x 3.5),
    # or for experts of width e/2, 1.5 per expert (and what is beside them)
    beside = {"glm4moe": 1.5, "kimi-linear": 1.5, "gemma4": 10.5, **dict.fromkeys(_DEEPSEEK_ARCHS, 1.5)}.get(arch, 0.0)
    per_e2 = 2.5 + (1.5 * n_expert + beside if moe else 10.5)
    per_layer_weights = size_bytes * 8 / bits / n_layer
    e = max(256, int(round((per_layer_weights / per_e2) ** 0.5 / 256)) * 256)
    n_head = e // 128 if e >= 512 else 4
    n_head_kv = max(d for d in range(1, n_head + 1) if n_head % d == 0 and d <= max(1, n_head // 4))
    n_ff = int(round(3.5 * e / 256)) * 256
    # the experts' width from what is left of the layer once e is rounded (a multiple of 256, for k-quants)
    left = per_layer_weights - (2.5 + beside) * e * e
    n_ff_exp = max(256, int(round(left / (3 * e * n_expert) / 256)) * 256)
    extra: dict[str, Any] = dict(n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp,
                                 router_skew=router_skew) if moe else {}
    if arch in _DEEPSEEK_ARCHS:  # DeepSeek-V3's proportions: q LoRA about e/4, the cached vector e/14 (128 at least)
        extra |= dict(kv_lora_rank=max(128, e // 14 // 128 * 128),
                      q_lora_rank=max(128, e // 4 // 128 * 128) if VARIANTS.get(variant, {}).get("q_lora_rank", 1)
                      else 0,
                      expert_groups=min(8, n_expert // 2) if VARIANTS.get(variant, {}).get("expert_groups", 1)
                      else 0)
        if extra["expert_groups"]:
            extra["expert_groups_used"] = max(1, extra["expert_groups"] // 2)
    return synthetic_spec(variant, n_layer=n_layer, n_embd=e, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                          n_vocab=n_vocab, seed=seed, shallow_layers=shallow_layers, deep_scale=deep_scale, **extra)


def write_sized_model(path: str | os.PathLike[str], size_bytes: int, n_layer: int, *, ftype: str = "Q4_K_M",
                      seed: int = 0, progress: Callable[[str, int, int], None] | None = None,
                      arch: str = "llama", n_expert: int = 64, n_expert_used: int = 8,
                      router_skew: float = 0.0, shallow_layers: int = 0, deep_scale: float = 1.0) -> Path:
    """A GGUF of `arch` of about `size_bytes` with `n_layer` layers (spec_for_size), quantized by llama.cpp to
    `ftype`. The F16 original is written beside `path` (about 16/bits as large) and deleted afterwards."""
    spec = spec_for_size(size_bytes, n_layer, ftype=ftype, seed=seed, arch=arch, n_expert=n_expert,
                         n_expert_used=n_expert_used, router_skew=router_skew, shallow_layers=shallow_layers,
                         deep_scale=deep_scale)
    out = Path(path)
    tmp = out.with_name(out.name + ".f16.tmp")
    try:
        write_synthetic_gguf(tmp, spec, dtype="F16",
                             progress=(lambda d, t: progress("writing F16", d, t)) if progress else None)
        if progress:
            progress(f"quantizing to {ftype} (llama.cpp)", 0, 1)
        quantize(tmp, out, ftype)
        if progress:
            progress(f"quantizing to {ftype} (llama.cpp)", 1, 1)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: str, n_threads: int = 0) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (ftype: "Q4_K_M", "Q8_0", ... see FTYPES)."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    from llama_cpp import llama_cpp as _ll  # here: writing a model, and `primaplug synth --help`, need no engine

    from primaplug.engine import _log

    _log.install()
    params = _ll.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = n_threads or usable_cores()
    code = _ll.llama_model_quantize(os.fspath(src).encode(), os.fspath(dst).encode(), ctypes.byref(params))
    if code != 0:
        raise EngineError(f"quantizing {src} to {ftype} failed: {_log.take_errors() or 'see the log'}", code)
    return Path(dst)
