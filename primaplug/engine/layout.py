"""Where a GGUF model's weights lie in its file, read from the header alone.

The prefetcher pages windows in and out by these byte ranges, and the planner sizes windows by these byte
counts. Reading the layout never loads the native engine and never touches tensor data.

The header is parsed here, with ggml's type tables (engine/ggml_types.py), rather than with `gguf.GGUFReader`:
the reader turns every vocabulary entry into numpy views and took 30 s on Gemma 3's 262k-token vocabulary
on a 2-core machine; this parser skips the arrays it does not need and takes well under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from primaplug.core.errors import ModelFormatError, UnsupportedArchitectureError, WindowRangeError
from primaplug.core.windows import LayerRange, snap_sizes
from primaplug.engine.ggml_types import GGUFValueType, block, type_name

# Architectures whose graphs the patch (patches/0001) can split into windows; must match
# llama_window_supported_archs() in the engine (a test checks it).
SUPPORTED_ARCHS = ("llama", "llama4", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "gpt-oss", "glm4moe",
                   "mistral3", "granite", "gemma3", "gemma2", "gemma4", "olmo2", "phi3", "lfm2", "deepseek2",
                   "lfm2moe", "qwen3next", "minimax-m2", "kimi-linear",
                   "deepseek32", "glm-dsa")
# Architectures with recurrent layers (gated delta-net) beside attention, each layer marked in the file or full
# attention every `full_attention_interval`-th layer (llama.cpp's default for them: 4); Qwen 3.5 rotates positions
# with M-RoPE, which takes four positions per hidden-state row. LFM2's recurrent layers are short convolutions, the
# layers with no KV head.
_HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# Recurrent architectures whose states llama.cpp can roll back a few tokens (llm_arch_supports_rs_rollback): with
# n_rs_seq snapshots a token, a rejected draft is forgotten exactly. Qwen3-Next and Kimi-Linear keep none.
ROLLBACK_ARCHS = frozenset({"qwen35", "qwen35moe", "lfm2", "lfm2moe"})
_MROPE_ARCHS = ("qwen35", "qwen35moe")  # Qwen3-Next rotates with plain rope

# ggml types that llama.cpp's CPU backend can repack for faster kernels (ggml-cpu/repack.cpp; engine/repacked.py)
REPACKABLE = frozenset({"Q1_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q8_0", "IQ4_NL", "MXFP4"})
# Sliding-window layers where the file has no per-layer pattern: Gemma 3 alternates five with one global layer
# (llama.cpp: load_swa_pattern(ml, 6)), gpt-oss and Gemma 2 one with one, OLMo 2's sliding variants and Llama 4's
# chunked layers three with one.
_SWA_PATTERN = {"gemma3": 6, "gpt-oss": 2, "gemma2": 2, "olmo2": 4, "llama4": 4}
# Llama 4's chunked attention: llama.cpp uses chunks of 8192 whatever the file says, unless it says 0 (none)
_LLAMA4_CHUNK = 8192

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_U64 = struct.Struct("<Q")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")
# arrays longer than this (vocabularies, merges) are skipped, not decoded
_MAX_DECODED_ARRAY = 4096


@dataclass(frozen=True)
class TensorSpan:
    """One tensor's place in the file."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    layer: int | None  # the block it belongs to, or None for embedding/output tensors

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class ModelLayout:
    """A GGUF model's shape and the byte ranges of its tensors."""

    path: str
    file_size: int
    header_sha256: str  # hash of everything before the tensor data: metadata and tensor table
    arch: str
    n_layer: int  # the layers a token runs through, the ones windows split
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    sliding_window: int | None
    swa_layers: tuple[bool, ...]  # per layer: True for a sliding-window attention layer
    data_offset: int
    tensors: tuple[TensorSpan, ...] = field(repr=False)
    has_chat_template: bool = False  # tokenizer.chat_template is in the metadata
    # mixture of experts: experts per layer, and how many of them each token is routed to (0 for a dense model)
    n_expert: int = 0
    n_expert_used: int = 0
    # layers in the file past n_layer that a plain run skips: multi-token-prediction heads (glm4moe's NextN)
    n_layer_nextn: int = 0
    # sliding-window layers' head dims where they differ from the global layers' (gemma4), else None
    head_dim_k_swa: int | None = None
    head_dim_v_swa: int | None = None
    # why the engine cannot split this model into windows although its architecture is supported, or None
    unsupported_reason: str | None = None
    # per layer: True for a recurrent layer (gated delta-net), whose state cannot forget positions; empty: none
    recurrent_layers: tuple[bool, ...] = ()
    # positions per row of a hidden-state batch: 4 with M-RoPE (section-major: t, h, w, then 0), else 1
    positions_per_row: int = 1
    # one sequence's recurrent state in a recurrent layer: the convolution's last inputs and the delta-net's matrix
    recurrent_state_bytes: int = 0
    # multi-head latent attention (deepseek2): the cache holds keys only, the compressed vector and its rotated part
    # (head_dim_k wide, one head), whose first head_dim_v values llama.cpp reads as the values
    keys_only_cache: bool = False
    # DeepSeek V3.2's sparse attention: its lightning indexer caches a key of this width a token in every layer too
    indexer_key_length: int = 0
    # how a token's experts are chosen (llama.cpp's expert_gating_func): "softmax" or "sigmoid" of the router's
    # logits (or "softmax_weight"), then within the best expert_groups_used of expert_groups groups where those are set
    expert_gating: str = "softmax"
    expert_groups: int = 0
    expert_groups_used: int = 0
    # Gemma 4 E2B/E4B: a vector of this width for every layer, computed from the tokens before layer 0, which a
    # hidden-state row carries for the layers still ahead of it (row_width); 0: none
    n_embd_per_layer: int = 0
    # layers from this one on hold no keys and values of their own: each reads those of the last layer of its kind
    # (sliding or global) before it (Gemma 4's shared KV, kv_source); n_layer: none share
    n_layer_kv_from_start: int = 0
    # per layer: True where it reuses the keys an earlier layer's lightning indexer chose (GLM 5.2); empty: none
    shared_indexer: tuple[bool, ...] = ()

    def row_width(self, layer: int, row_end: int = 0) -> int:
        """The floats of a hidden-state row entering `layer` (n_layer: the output layer's): n_embd, then the
        per-layer inputs of the layers from `layer` up to row_end (0: the last; llama.cpp's llama_window_row_width
        and llama_window_set_row_end)."""
        return self.n_embd + self.n_embd_per_layer * max(0, (row_end or self.n_layer) - layer)

    @property
    def input_window(self) -> bool:
        """Whether tokens enter through the input window [0, 0), which gives the rows entering layer 0: on a model
        with per-layer inputs, which the head computes once and every later window reads from its rows."""
        return self.n_embd_per_layer > 0

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values `layer` reads, when they are not its own (llama.cpp's reuse for Gemma 4:
        the last sliding or global layer before n_layer_kv_from_start), else None."""
        if layer < self.n_layer_kv_from_start or self.n_layer_kv_from_start >= self.n_layer:
            return None
        return self.n_layer_kv_from_start - (2 if self.swa_layers[layer] else 1)

    @property
    def kv_tail(self) -> int:
        """How many last layers must share one window: those with shared KV and the layers they read; 0: none."""
        if self.n_layer_kv_from_start >= self.n_layer or not self.n_layer_kv_from_start:
            return 0
        return self.n_layer - (self.n_layer_kv_from_start - 2)

    @property
    def barred_starts(self) -> tuple[int, ...]:
        """Layers no window may start at: GLM 5.2's with a shared indexer, which attend to the keys the last layer
        with an indexer of its own chose (llama.cpp's prev_top_k), found only in the same window."""
        return tuple(il for il, shared in enumerate(self.shared_indexer) if shared)

    def snap_sizes(self, sizes: Sequence[int]) -> list[int]:
        """Layers per device of one round with no window starting at a barred start (core.windows.snap_sizes)."""
        return snap_sizes(sizes, self.n_layer, self.barred_starts)

    def check_windows(self, windows: Iterable[LayerRange]) -> None:
        """Raise WindowRangeError unless every layer that reads what another layer computed shares a window with it:
        Gemma 4's shared keys and values (a window's cache holds its own layers only: a sliding-window model's windows
        keep a context each), GLM 5.2's shared indexers."""
        barred = set(self.barred_starts)
        for w in windows:
            if w.n_layers and w.start in barred:
                start = max(il for il in range(w.start) if il not in barred)
                raise WindowRangeError(
                    f"window {w} starts at layer {w.start}, which attends to the keys the indexer of layer {start} "
                    f"chose: a window of this {self.arch} starts at a layer with an indexer of its own "
                    f"(not {spans(barred)})")
            for il in range(w.start, w.end):
                src = self.kv_source(il)
                if src is not None and src < w.start:
                    first = self.n_layer_kv_from_start - 2
                    raise WindowRangeError(
                        f"window {w} holds layer {il}, which reads the keys and values of layer {src}: layers "
                        f"{first}-{self.n_layer - 1} of this {self.arch} share keys and values and must be in one "
                        f"window; split the model before layer {first + 1}")

    @property
    def n_layer_all(self) -> int:
        """Every block of the file: llama.cpp's placement of a windowed load has one entry per block, then the
        output layer's."""
        return self.n_layer + self.n_layer_nextn

    # --- identity and support ---------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """Names this exact model: file size plus a hash of its header and tensor table."""
        return f"{self.file_size}:{self.header_sha256[:32]}"

    @property
    def supports_windows(self) -> bool:
        return self.arch in SUPPORTED_ARCHS and self.unsupported_reason is None

    def check_supported(self) -> None:
        if not self.supports_windows:
            raise UnsupportedArchitectureError(self.arch, SUPPORTED_ARCHS, self.unsupported_reason)

    # --- tensors by role ----------------------------------------------------------------------------------

    @cached_property
    def _by_layer(self) -> dict[int | None, tuple[TensorSpan, ...]]:
        groups: dict[int | None, list[TensorSpan]] = {}
        for t in self.tensors:
            groups.setdefault(t.layer, []).append(t)
        return {k: tuple(v) for k, v in groups.items()}

    def layer_tensors(self, layer: int) -> tuple[TensorSpan, ...]:
        return self._by_layer.get(layer, ())

    def layer_bytes(self, layer: int) -> int:
        return sum(t.nbytes for t in self.layer_tensors(layer))

    def tensor(self, name: str) -> TensorSpan | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def input_tensors(self) -> tuple[TensorSpan, ...]:
        """What the head reads to embed tokens: the token embedding, and the per-layer inputs' (Gemma 4 E2B/E4B)."""
        names = ("token_embd.weight", "per_layer_token_embd.weight", "per_layer_model_proj.weight",
                 "per_layer_proj_norm.weight")
        return tuple(t for t in map(self.tensor, names) if t)

    @property
    def output_tensors(self) -> tuple[TensorSpan, ...]:
        """What the output layer reads: the output norm and the lm_head (the token embedding when tied)."""
        head = self.tensor("output.weight") or self.tensor("token_embd.weight")
        norm = self.tensor("output_norm.weight") or self.tensor("token_embd_norm.weight")  # LFM2 names it so
        return tuple(t for t in (norm, head) if t)

    @property
    def output_tied(self) -> bool:
        """True when the lm_head is the token embedding matrix (no output.weight in the file)."""
        return self.tensor("output.weight") is None

    @property
    def output_copy_bytes(self) -> int:
        """What the output layer copies out of the mapping at load, as plain llama.cpp does: a tied lm_head's
        repacked copy of the token embedding (the embedding lookup needs the file's bytes as they are). An upper
        bound: a CPU that repacks nothing copies nothing."""
        embd = self.tensor("token_embd.weight")
        return embd.nbytes if self.output_tied and embd and embd.type_name in REPACKABLE else 0

    @property
    def input_bytes(self) -> int:
        return sum(t.nbytes for t in self.input_tensors)

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.output_tensors)

    # --- byte ranges ---------------------------------------------------------------------------------------

    def window_ranges(self, window: LayerRange, *, experts: bool = True) -> list[tuple[int, int]]:
        """Merged (offset, length) byte ranges of the tensors of the layers in the window; without their routed
        experts when `experts` is False (a node that reads those as tokens route to them, memory/experts.py)."""
        window.check_within(self.n_layer)
        spans = [t for il in range(window.start, window.end) for t in self.layer_tensors(il)
                 if experts or not self.is_routed_expert(t)]
        return merge_ranges((t.offset, t.nbytes) for t in spans)

    # --- mixture of experts -------------------------------------------------------------------------------

    def is_routed_expert(self, t: TensorSpan) -> bool:
        """A routed experts' weight ([cols, rows, n_expert] in GGUF's order): expert e's matrix is the e-th of
        n_expert equal, contiguous slices. Their biases (gpt-oss) are small and go with the rest of the layer."""
        return (bool(self.n_expert) and t.layer is not None and t.name.endswith("_exps.weight")
                and len(t.shape) == 3 and t.shape[2] == self.n_expert)

    def expert_slices(self, layer: int) -> tuple[tuple[int, int], ...]:
        """(offset, bytes per expert) of each routed expert weight of a layer: expert e reads [offset + e * n, n)
        of each. Empty for a dense layer (glm4moe's first)."""
        return tuple((t.offset, t.nbytes // self.n_expert) for t in self.layer_tensors(layer)
                     if self.is_routed_expert(t))

    def read_tensor(self, name: str) -> np.ndarray | None:
        """A tensor's values as float32, dequantized by gguf (ggml's dimensions reversed: a matrix is (rows,
        cols)), or None when the file has no such tensor. For small tensors: it is read whole."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensor(name)
        if t is None:
            return None
        with open(self.path, "rb") as f:
            raw = np.frombuffer(os.pread(f.fileno(), t.nbytes, t.offset), dtype=np.uint8)
        rows = max(1, int(np.prod(t.shape[1:])))
        values = dequantize(raw.reshape(rows, -1), GGMLQuantizationType[t.type_name])
        return np.asarray(values, dtype=np.float32).reshape(tuple(reversed(t.shape)))

    def expert_bytes(self, layer: int) -> int:
        """What one routed expert of the layer takes, over its gate, up and down matrices."""
        return sum(n for _, n in self.expert_slices(layer))

    def output_ranges(self) -> list[tuple[int, int]]:
        return merge_ranges((t.offset, t.nbytes) for t in self.output_tensors)

    # --- KV cache ----------------------------------------------------------------------------------------

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether some layer keeps a recurrent state: a sequence then cannot be rewound part way (only cleared),
        and one device's windows cannot share a context."""
        return any(self.recurrent_layers)

    @property
    def can_roll_back(self) -> bool:
        """Whether a recurrent model's state can forget its last few tokens (with ContextSettings.n_rs_seq)."""
        return self.arch in ROLLBACK_ARCHS

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    def head_dims(self, layer: int) -> tuple[int, int]:
        """A layer's key and value head dims."""
        if self.swa_layers[layer] and self.head_dim_k_swa is not None:
            return self.head_dim_k_swa, self.head_dim_v_swa or self.head_dim_k_swa
        return self.head_dim_k, self.head_dim_v

    def kv_bytes_per_token(self, layer: int, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one token takes in one layer (F16 cache by default); none in a recurrent layer, whose state
        (recurrent_state_bytes a sequence) does not grow."""
        if self.is_recurrent(layer) or self.kv_source(layer) is not None:
            return 0
        k, v = self.head_dims(layer)
        return (self.n_head_kv[layer] * (k + (0 if self.keys_only_cache else v)) + self.indexer_key_length) * \
            bytes_per_value

    def cache_bytes(self, layer: int, n_ctx: int, n_seq: int = 1, n_rs_seq: int = 0) -> int:
        """What a layer's cache takes for n_ctx positions over n_seq sequences: keys and values, or a recurrent
        layer's states (one a sequence, whatever its length, and n_rs_seq snapshots of it to roll back to)."""
        if self.is_recurrent(layer):
            return self.recurrent_state_bytes * n_seq * (1 + n_rs_seq)
        return self.kv_bytes_per_token(layer) * n_ctx


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort (offset, length) ranges and merge those that touch or overlap."""
    out: list[list[int]] = []
    for off, length in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + length - out[-1][0])
        else:
            out.append([off, length])
    return [(a, b) for a, b in out]


# --- units: the parts of a file a set of layers reads ------------------------------------------------------

INPUT, OUTPUT, GLOBALS = "input", "output", "globals"


def units_for(layout: ModelLayout, cpu_layers: Iterable[int], gpu_layers: Iterable[int], output: bool) -> list[str]:
    """The parts of the file a model of these layers (and the output layer) reads."""
    cpu, gpu = sorted(set(cpu_layers)), sorted(set(gpu_layers))
    units = [GLOBALS] + [f"blk.{il}" for il in cpu] + [f"blk.{il}.raw" for il in gpu]
    # the token embedding: the first window looks tokens up (with per-layer inputs, the head's input window does);
    # a tied lm_head copies it
    if (0 in cpu + gpu and not layout.input_window) or (output and (layout.output_tied or layout.input_window)):
        units.append(INPUT)
    if output:
        units.append(OUTPUT)
    return units


def layer_of_unit(unit: str) -> int | None:
    return int(unit.split(".")[1]) if unit.startswith("blk.") else None


def unit_tensors(layout: ModelLayout, unit: str) -> list[TensorSpan]:
    il = layer_of_unit(unit)
    if il is not None:
        return list(layout.layer_tensors(il))
    embd = layout.tensor("token_embd.weight")
    if unit == INPUT:
        return list(layout.input_tensors)
    out = [t for t in layout.output_tensors if t is not embd]  # a tied lm_head is the input unit's tensor
    if unit == OUTPUT:
        return out
    taken = {t.name for t in out} | {t.name for t in layout.input_tensors}
    return [t for t in layout.tensors if t.layer is None and t.name not in taken]


# --- parsing ---------------------------------------------------------------------------------------------


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelFormatError(self.path, "the GGUF header is truncated")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = int(self.unpack("<Q"))
        if self.pos + n > len(self.buf):
            raise ModelFormatError(self.path, "the GGUF header is truncated")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip(self, etype: int, count: int) -> None:
        """Step over an array's `count` items unread: a vocabulary's strings only by their lengths (decoding Gemma 3's
        262k tokens took 0.34 s of every header read on a 2-core machine, a node's start and a head's among them)."""
        if etype in _SCALAR:
            self.pos += struct.calcsize(_SCALAR[GGUFValueType(etype)]) * count
        elif etype == GGUFValueType.STRING:
            buf, pos, length = self.buf, self.pos, _U64.unpack_from
            try:
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
            except struct.error:
                pos = len(buf) + 1
            self.pos = pos
        else:  # arrays of arrays: item by item
            for _ in range(count):
                self.value(etype)
        if self.pos > len(self.buf):
            raise ModelFormatError(self.path, "the GGUF header is truncated")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = int(self.unpack("<I")), int(self.unpack("<Q"))
            if count > _MAX_DECODED_ARRAY:
                self.skip(etype, count)
                return count
            return [self.value(etype) for _ in range(count)]
        try:
            return self.unpack(_SCALAR[GGUFValueType(vtype)])
        except (KeyError, ValueError):
            raise ModelFormatError(self.path, f"unknown GGUF value type {vtype}") from None


def read_layout(path: str | os.PathLike[str]) -> ModelLayout:
    """Read a GGUF model's layout from its header (tensor data is not read)."""
    path = str(path)
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(open(path, "rb"))
        except OSError as e:
            raise ModelFormatError(path, f"cannot open: {e.strerror}") from e
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 24:
            raise ModelFormatError(path, "too small to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, file_size)


def _parse(buf: mmap.mmap, path: str, file_size: int) -> ModelLayout:
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise ModelFormatError(path, "not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelFormatError(path, f"GGUF version {version} is not supported (need 2 or 3)")
    n_tensors, n_kv = int(cur.unpack("<Q")), int(cur.unpack("<Q"))
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        kv[key] = cur.value(int(cur.unpack("<I")))

    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = int(cur.unpack("<I"))
        shape = tuple(int(cur.unpack("<Q")) for _ in range(n_dims))
        raw.append((name, shape, int(cur.unpack("<I")), int(cur.unpack("<Q"))))
    alignment = int(kv.get("general.alignment", 32))
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    header_sha256 = hashlib.sha256(buf[:data_offset]).hexdigest()

    tensors = tuple(_span(path, name, shape, ttype, data_offset + rel) for name, shape, ttype, rel in raw)
    for t in tensors:
        if t.end > file_size:
            raise ModelFormatError(path, f"tensor {t.name} ends at byte {t.end}, past the end of the file")
    return _layout(path, file_size, header_sha256, data_offset, kv, tensors)


def _span(path: str, name: str, shape: tuple[int, ...], ttype: int, offset: int) -> TensorSpan:
    try:
        qtype = type_name(ttype)
    except ValueError as e:
        raise ModelFormatError(path, f"tensor {name}: {e}") from None
    per_block, type_size = block(qtype)
    n = 1
    for d in shape:
        n *= d
    m = _LAYER_TENSOR.match(name)
    return TensorSpan(name, qtype, shape, offset, n // per_block * type_size, int(m.group(1)) if m else None)


def _layout(
    path: str, file_size: int, header_sha256: str, data_offset: int, kv: dict[str, Any],
    tensors: tuple[TensorSpan, ...],
) -> ModelLayout:
    arch = str(kv.get("general.architecture", ""))
    if not arch:
        raise ModelFormatError(path, "no general.architecture in the GGUF metadata")

    def get(key: str, default: Any = None) -> Any:
        value = kv.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(path, f"no {arch}.{key} in the GGUF metadata")
        return value

    n_layer_nextn = int(kv.get(f"{arch}.nextn_predict_layers") or 0)
    n_layer = int(get("block_count")) - n_layer_nextn
    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    head_kv = get("attention.head_count_kv", n_head)
    n_head_kv = tuple(int(h) for h in head_kv) if isinstance(head_kv, list) else (int(head_kv),) * n_layer
    head_dim_k = int(get("attention.key_length", n_embd // n_head))
    head_dim_v = int(get("attention.value_length", head_dim_k))
    tokens = kv.get("tokenizer.ggml.tokens")
    vocab_size = int(kv.get(f"{arch}.vocab_size") or (tokens if isinstance(tokens, int) else len(tokens or [])))
    n_vocab = vocab_size  # what the metadata counts, unless the embedding says otherwise
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is not None and len(embd.shape) == 2:
        n_vocab = embd.shape[1]
    swa_k, swa_v = kv.get(f"{arch}.attention.key_length_swa"), kv.get(f"{arch}.attention.value_length_swa")
    sliding = kv.get(f"{arch}.attention.sliding_window")
    if arch == "llama4" and sliding != 0:
        sliding = _LLAMA4_CHUNK
    pattern = _SWA_PATTERN.get(arch)
    given = kv.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(given, list) and len(given) >= n_layer:
        swa = tuple(bool(sliding) and bool(v) for v in given[:n_layer])
    else:
        swa = tuple(bool(sliding) and pattern is not None and il % pattern < pattern - 1 for il in range(n_layer))
    return ModelLayout(
        path=path, file_size=file_size, header_sha256=header_sha256, arch=arch, n_layer=n_layer, n_embd=n_embd,
        n_vocab=n_vocab, n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v,
        n_ctx_train=int(get("context_length", 0)),
        sliding_window=int(sliding) if sliding else None,
        swa_layers=swa, data_offset=data_offset, tensors=tensors,
        has_chat_template=bool(kv.get("tokenizer.chat_template")),
        n_expert=int(kv.get(f"{arch}.expert_count") or 0), n_expert_used=int(kv.get(f"{arch}.expert_used_count") or 0),
        n_layer_nextn=n_layer_nextn,
        head_dim_k_swa=int(swa_k) if swa_k else None, head_dim_v_swa=int(swa_v) if swa_v else None,
        unsupported_reason=NOT_YET[arch] + "; run it with plain llama-cpp-python" if arch in NOT_YET else None,
        keys_only_cache=bool(kv.get(f"{arch}.attention.key_length_mla")) and bool(
            kv.get(f"{arch}.attention.value_length_mla")),
        indexer_key_length=int(kv.get(f"{arch}.attention.indexer.key_length") or 0),
        shared_indexer=tuple(not full for full in _full_indexers(kv, n_layer)) if arch == "glm-dsa" else (),
        n_embd_per_layer=int(kv.get(f"{arch}.embedding_length_per_layer_input") or 0),
        n_layer_kv_from_start=n_layer - int(kv.get(f"{arch}.attention.shared_kv_layers") or 0),
        **_routing(arch, kv, n_layer, vocab_size),
        **_recurrence(arch, kv, n_layer, n_head_kv),
    )


# llama.cpp's llama_expert_gating_func_type
_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}


def _routing(arch: str, kv: dict[str, Any], n_layer: int, vocab_size: int) -> dict[str, Any]:
    """How a mixture of experts chooses (llama.cpp's load_hparams and build_moe_ffn): the gating function, which
    deepseek2 files may leave out (then softmax, as DeepSeek V2; sigmoid for GLM-4.7-Flash, as llama.cpp tells it by
    its 47 or 48 layers and the 154880 tokens its metadata counts), and the expert groups."""
    gating = kv.get(f"{arch}.expert_gating_func")
    if not gating and arch == "deepseek2":
        gating = 2 if n_layer in (47, 48) and vocab_size == 154880 else 1
    default = "sigmoid" if arch in ("glm4moe", "llama4") else "softmax"
    return {"expert_gating": _GATING.get(int(gating or 0), default),
            "expert_groups": int(kv.get(f"{arch}.expert_group_count") or 0),
            "expert_groups_used": int(kv.get(f"{arch}.expert_group_used_count") or 0)}


def _recurrence(arch: str, kv: dict[str, Any], n_layer: int, n_head_kv: tuple[int, ...]) -> dict[str, Any]:
    """Which layers are recurrent, and what a sequence's state takes in each (llama.cpp's qwen35.cpp and
    llama_hparams::n_embd_r/n_embd_s, F32). LFM2's and Kimi-Linear's recurrent layers are those with no KV head."""
    no_kv_head = tuple(h == 0 for h in n_head_kv[:n_layer])
    if arch in ("lfm2", "lfm2moe"):  # a convolution's last l_cache - 1 inputs, F32
        n_embd = int(kv.get(f"{arch}.embedding_length") or 0)
        state = 4 * n_embd * max(0, int(kv.get(f"{arch}.shortconv.l_cache") or 0) - 1)
        return {"recurrent_layers": no_kv_head, "recurrent_state_bytes": state}
    if arch == "kimi-linear":  # Kimi delta attention, the layers with no KV head: three short convolutions' last
        # inputs (queries, keys, values) and a head_dim x head_dim matrix a head, F32 (llama_hparams::n_embd_r/s)
        n_head, hd = int(kv.get(f"{arch}.attention.head_count") or 0), int(kv.get(f"{arch}.kda.head_dim") or 0)
        conv = 3 * max(0, int(kv.get(f"{arch}.ssm.conv_kernel") or 4) - 1) * n_head * hd
        return {"recurrent_layers": no_kv_head, "recurrent_state_bytes": 4 * (conv + hd * hd * n_head)}
    if arch not in _HYBRID_ARCHS:
        return {}
    marked = kv.get(f"{arch}.attention.recurrent_layers")
    if isinstance(marked, list) and len(marked) >= n_layer:
        recurrent = tuple(bool(v) for v in marked[:n_layer])
    else:
        interval = int(kv.get(f"{arch}.full_attention_interval") or 4)
        recurrent = tuple((il + 1) % interval != 0 for il in range(n_layer))
    d_conv, d_inner = int(kv.get(f"{arch}.ssm.conv_kernel") or 0), int(kv.get(f"{arch}.ssm.inner_size") or 0)
    d_state, n_group = int(kv.get(f"{arch}.ssm.state_size") or 0), int(kv.get(f"{arch}.ssm.group_count") or 0)
    conv = max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state)
    state = d_state * d_inner
    return {"recurrent_layers": recurrent, "positions_per_row": 4 if arch in _MROPE_ARCHS else 1,
            "recurrent_state_bytes": 4 * (conv + state)}


# architectures the engine's llama.cpp runs but windows do not split yet, and what they would need (docs/engine.md)
NOT_YET = {
    "deepseek4": "its hyper-connections carry a hidden state several times n_embd wide from layer to layer, and its "
                 "graph and its own cache (llama.cpp's llama_kv_cache_dsv4: compressed keys, per-layer compression "
                 "states) are not split into windows yet",
}


def _full_indexers(kv: dict[str, Any], n_layer: int) -> list[bool]:
    """Which layers of a GLM 5 model have a lightning indexer of their own (llama.cpp's glm-dsa.cpp: the file's
    `indexer.types`, else all for a context under 1M tokens (GLM 5, 5.1), else GLM 5.2's pattern)."""
    types = kv.get("glm-dsa.attention.indexer.types")
    if isinstance(types, list) and len(types) >= n_layer:
        return [bool(int(t)) for t in types[:n_layer]]
    if int(kv.get("glm-dsa.context_length") or 0) < 1048576:
        return [True] * n_layer
    return [glm5_2_own_indexer(il) for il in range(n_layer)]


def glm5_2_own_indexer(il: int) -> bool:
    """Whether layer il of GLM 5.2 has a lightning indexer of its own (llama.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES):
    the first two layers, then every fourth from the third."""
    return il < 2 or (il - 2) % 4 == 0


def spans(layers: Iterable[int]) -> str:
    """0-5, 9, 12-14: runs of consecutive layers."""
    runs: list[list[int]] = []
    for il in sorted(layers):
        if runs and il == runs[-1][1] + 1:
            runs[-1][1] = il
        else:
            runs.append([il, il])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)

