"""Synthetic GGUF models: random weights in a real architecture's layout, quantized by llama.cpp itself.

They load and run in llama.cpp exactly like downloaded models, so they serve for equality, memory and speed
tests at any size and layer count without a download. (Random weights say nothing about output quality or
about a draft model's acceptance rate.)
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from llama_cpp import llama_cpp as _ll

from primaplug.core.errors import EngineError, ModelFormatError
from primaplug.engine import _log

# llama_ftype values of llama.h
FTYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18}
ARCHS = ("llama", "qwen2", "qwen3")


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


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """An SPM vocabulary: <unk> <s> </s>, the 256 byte tokens, then made-up pieces."""
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
    return tokens[:n_vocab], scores[:n_vocab], types[:n_vocab]


def write_synthetic_gguf(path: str | os.PathLike[str], spec: SyntheticSpec) -> Path:
    """Write an F32 GGUF with random weights for spec.arch ("llama", "qwen2" or "qwen3")."""
    if spec.arch not in ARCHS:
        raise ModelFormatError(str(path), f"no synthetic writer for architecture '{spec.arch}' (have {ARCHS})")
    if spec.n_vocab < 260:
        raise ModelFormatError(str(path), "a synthetic vocabulary needs at least 260 tokens (3 special + 256 bytes)")
    rng = np.random.default_rng(spec.seed)
    e, hd = spec.n_embd, spec.n_embd // spec.n_head
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(os.fspath(path), spec.arch)
    w.add_name(f"synthetic-{spec.arch}-{spec.n_layer}L")
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(e)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(FTYPES["F32"])
    tokens, scores, types = _vocab(spec.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    # scaled up so that logits spread widely and greedy choices are far from ties
    w.add_tensor("token_embd.weight", (rng.standard_normal((spec.n_vocab, e))).astype(np.float32))
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(e))
        w.add_tensor(p + "attn_q.weight", mat(q_dim, e))
        w.add_tensor(p + "attn_k.weight", mat(kv_dim, e))
        w.add_tensor(p + "attn_v.weight", mat(kv_dim, e))
        if spec.arch == "qwen2":
            for name, n in (("attn_q.bias", q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)):
                w.add_tensor(p + name, (0.1 * rng.standard_normal(n)).astype(np.float32))
        if spec.arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        w.add_tensor(p + "attn_output.weight", mat(e, q_dim))
        w.add_tensor(p + "ffn_norm.weight", norm(e))
        w.add_tensor(p + "ffn_gate.weight", mat(spec.n_ff, e))
        w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, e))
        w.add_tensor(p + "ffn_down.weight", mat(e, spec.n_ff))
    w.add_tensor("output_norm.weight", norm(e))
    w.add_tensor("output.weight", 4.0 * mat(spec.n_vocab, e))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: str, n_threads: int = 0) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (ftype: "Q4_K_M", "Q8_0", ... see FTYPES)."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    _log.install()
    params = _ll.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = n_threads or os.cpu_count() or 1
    code = _ll.llama_model_quantize(os.fspath(src).encode(), os.fspath(dst).encode(), ctypes.byref(params))
    if code != 0:
        raise EngineError(f"quantizing {src} to {ftype} failed: {_log.take_errors() or 'see the log'}", code)
    return Path(dst)
