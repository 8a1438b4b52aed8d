"""A GGUF model mapped for layer windows, and the windows that run on it.

One `Model` per process maps the file once; any number of `Window`s share it. A window computes only its layers
on a llama.cpp context that keeps only their KV cache: its own (`Model.window`), or one shared by a device's
windows, one per round of the ring, which run one at a time (`Model.shared_windows`). The first window takes
tokens; later windows take the previous window's hidden state. A window that ends at the last layer returns logits, or
its hidden state when the output layer runs elsewhere (then an output-only window [n_layer, n_layer)
turns that hidden state into logits).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
from llama_cpp import llama_cpp as _ll

from primaplug.core.errors import EngineError, WindowRangeError, no_gpu_backend
from primaplug.core.settings import RunSettings, usable_cores
from primaplug.core.windows import LayerRange
from primaplug.engine import _log, _native
from primaplug.engine.affinity import on_cpu, pinned_cpus
from primaplug.engine.layout import ModelLayout, read_layout, spans
from primaplug.engine.progress import LayerProgress, OnRoute
from primaplug.engine.repacked import (
    CHUNK_BYTES,
    RepackedCopy,
    RepackedForms,
    Room,
    can_repack_in_place,
    needs_copy,
    repack_in_place,
    repacked_copy,
)

# ggml's polling level (llama.cpp's own default) for compute threads that are about to be given work: windows
# chained in one process, and a node's window from the moment its input arrives. Whoever sets it pauses the pool
# right after the work (Model.pause_threads), so that the threads never spin while another process computes.
BUSY_POLL = 50
_RUN = RunSettings()


@dataclass(frozen=True)
class ContextSettings:
    """Sizes and threads of a window's llama.cpp context."""

    n_ctx: int = _RUN.n_ctx
    n_batch: int = _RUN.n_batch  # tokens per forward call handed to llama.cpp (longer inputs are split)
    n_ubatch: int = _RUN.n_ubatch  # tokens per compute step inside llama.cpp
    n_threads: int = 0  # 0: one per core this process may run on (usable_cores)
    n_seq_max: int = 1
    # off by default, as in llama_cpp.Llama: the two attention kernels round differently, and a split model
    # must reproduce the tokens of the whole one
    flash_attn: bool = False
    # how long idle compute threads spin before sleeping (ggml's 0-100). 0 frees the cores between calls for
    # the apps people use; a higher level saves waking them for each call. Windows that run back to back in one
    # process (WindowChain) poll and pause the pool after the last (Model.pause_threads), so they never spin
    # outside a token
    poll: int = 0
    # each compute thread on a core of its own: True, False, or None (when the threads use every core the
    # process may run on; engine/affinity.py says why)
    pin_threads: bool | None = None
    # give the compute buffer's pages back to the OS after a batch of more than one row (a prompt): they hold
    # nothing a later call reads, and a one-token decode touches only a small part of a buffer sized for n_ubatch
    # rows, so a device keeps that small part per window instead of a prompt-sized buffer each (docs/memory.md)
    release_compute: bool = True
    # the output-only window of a model used for embeddings: llama.cpp also keeps the output norm's rows (pooled as
    # pooling_type says; -1: the model's own), which Window.embed reads
    embeddings: bool = False
    pooling_type: int = -1
    # snapshots of each sequence's recurrent state, one a token, so that its last n_rs_seq tokens can be forgotten
    # (a rejected draft: ModelLayout.can_roll_back); 0: none, and no partial rewind
    n_rs_seq: int = 0
    # per-layer inputs (ModelLayout.input_window): the rows of a window that ends by this layer carry those of the
    # layers up to it only, the device running the layers from it on keeping theirs (head/ring.py); 0: every layer's
    row_end: int = 0

    @property
    def threads(self) -> int:
        return self.n_threads or usable_cores()

    def params(self) -> _ll.llama_context_params:
        p = _ll.llama_context_default_params()
        threads = self.threads
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = self.n_ctx, self.n_batch, self.n_ubatch, self.n_seq_max
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        p.flash_attn_type = _ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else _ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.embeddings, p.pooling_type = self.embeddings, self.pooling_type
        p.n_rs_seq = self.n_rs_seq
        return p


def _as_range(w: LayerRange | tuple[int, int]) -> LayerRange:
    return w if isinstance(w, LayerRange) else LayerRange(*w)


# enum ggml_backend_dev_type (ggml-backend.h): the kinds of device llama.cpp puts GPU layers on
_GGML_DEVICE_GPU, _GGML_DEVICE_IGPU = 1, 2


@functools.cache
def ggml_devices() -> tuple[tuple[str, ...], str | None]:
    """(the ggml backends this engine registered, e.g. ("CPU",) or ("CUDA", "CPU"); the GPU device llama.cpp puts
    LLAMA_WINDOW_PLACEMENT_GPU layers on, as "name (description)", or None when it finds none)."""
    ggml, base = _native._sibling("ggml"), _native._ggml_base
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_get.argtypes, ggml.ggml_backend_reg_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes, ggml.ggml_backend_dev_by_type.restype = [ctypes.c_int], ctypes.c_void_p
    for fn in (base.ggml_backend_reg_name, base.ggml_backend_dev_name, base.ggml_backend_dev_description):
        fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_char_p
    backends = tuple(base.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)).decode(errors="replace")
                     for i in range(ggml.ggml_backend_reg_count()))
    for kind in (_GGML_DEVICE_GPU, _GGML_DEVICE_IGPU):
        dev = ggml.ggml_backend_dev_by_type(kind)
        if dev:
            name = base.ggml_backend_dev_name(dev).decode(errors="replace")
            return backends, f"{name} ({base.ggml_backend_dev_description(dev).decode(errors='replace')})"
    return backends, None


def gpu_problem() -> str:
    """"" when llama.cpp has a GPU for GPU layers; else why not, and what to do. Without one, llama.cpp itself runs
    a layer placed on the GPU on the CPU without a word (patches/0002: no device, the CPU's buffer types), from a
    copy repacked into anonymous memory: the plan counted those layers in VRAM, so that is refused instead."""
    backends, device = ggml_devices()
    if device is not None:
        return ""
    gpus = [b for b in backends if b not in ("CPU", "BLAS", "RPC")]
    if not gpus:
        return no_gpu_backend("this engine", ", ".join(backends) or "none", without="run")
    return (f"this engine has the {', '.join(gpus)} backend, but llama.cpp finds no GPU device (no driver, or "
            "CUDA_VISIBLE_DEVICES hides them): check nvidia-smi, or run without GPU layers (-ngl 0)")


class Model:
    """A GGUF model mapped (never read whole) for running the given layer windows.

    Args:
        path: the GGUF file.
        windows: the windows this process will run; their layers are the only ones ever read.
        output: whether this process runs the output layer (output norm and lm_head).
        gpu_layers: layers (from the windows) to run on the first GPU; the rest run on the CPU.
        repack: compute as plain llama.cpp does on this CPU: the weights it repacks for faster kernels (which
            round differently) are mapped from a repacked copy of the file, written once to the cache
            (engine/repacked.py), so they stay page cache and may stream. False runs the file's bytes as they
            are, with the slower kernels: other logits than plain llama.cpp.
        layout: the file's layout when the caller has already read it (read from the header otherwise).
        progress: told (fraction, what) how writing the repacked copy goes, when it must be written.
        copy_chunk_bytes: layers loaded at a time to write the repacked copy: the anonymous memory that takes (a
            larger layer in parts of its weights).
        copy_room: the memory available now: writing the repacked copy is refused before it starts where its
            largest load would not fit (EngineError).
        repack_in: the record of a file the caller owns (a node's fetched copy, store/copy.py): its CPU layers are
            repacked in that file itself rather than in a copy beside it, so the layers take disk once.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        windows: Iterable[LayerRange | tuple[int, int]],
        *,
        output: bool = True,
        gpu_layers: Iterable[int] = (),
        repack: bool = True,
        layout: ModelLayout | None = None,
        progress: Callable[[float, str], None] | None = None,
        copy_chunk_bytes: int = CHUNK_BYTES,
        copy_room: Room | None = None,
        repack_in: RepackedForms | None = None,
        vocab: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        self.layout: ModelLayout = layout or read_layout(self.path)
        self.layout.check_supported()
        n_layer = self.layout.n_layer
        self.windows = tuple(_as_range(w) for w in windows)
        for w in self.windows:
            w.check_within(n_layer)
        self.layers = frozenset(il for w in self.windows for il in range(w.start, w.end))
        self.output = output
        gpu = frozenset(gpu_layers)
        if not gpu <= self.layers:
            raise WindowRangeError(f"GPU layers {sorted(gpu - self.layers)} are not in this model's windows")
        if gpu and (problem := gpu_problem()):
            raise EngineError(f"GPU layers {spans(gpu)} asked for: {problem}")

        cpu_layers = self.layers - gpu
        self.repack = repack
        self.copy: RepackedCopy | None = None
        if repack and needs_copy(self.layout, cpu_layers, output):
            if repack_in is not None and can_repack_in_place(self.layout, cpu_layers, output):
                self.copy = repack_in_place(self.layout, repack_in, cpu_layers, gpu, output=output,
                                            progress=progress, chunk_bytes=copy_chunk_bytes, room=copy_room)
            else:
                self.copy = repacked_copy(self.layout, cpu_layers, gpu, output=output, progress=progress,
                                          chunk_bytes=copy_chunk_bytes, room=copy_room)
        self.source = self.copy.path if self.copy else self.path  # the file mapped: prefetch and release this one
        cpu = _native.LLAMA_WINDOW_PLACEMENT_CPU_REPACKED if self.copy else _native.LLAMA_WINDOW_PLACEMENT_CPU
        n_all = self.layout.n_layer_all
        placement = (ctypes.c_uint8 * (n_all + 1))()
        for il in self.layers:
            placement[il] = _native.LLAMA_WINDOW_PLACEMENT_GPU if il in gpu else cpu
        placement[n_all] = cpu if output else _native.LLAMA_WINDOW_PLACEMENT_SKIP

        # without its vocabulary's tokens, a model keeps their number only: 41 MiB and 0.5 s less for Gemma 3's 262k
        self.has_vocab = vocab
        self._ptr = ptr = _native.load_for_windows(self.source, placement, repack=repack, purpose="for windows",
                                                   vocab=vocab)
        if _native.llama_window_row_width(ptr, 0) != self.layout.row_width(0):  # the rows the engine and we agree on
            _ll.llama_model_free(ptr)
            raise EngineError(f"the engine's rows entering layer 0 of {self.layout.arch} are "
                              f"{_native.llama_window_row_width(ptr, 0)} floats wide, this primaplug's "
                              f"{self.layout.row_width(0)}: rebuild the engine (make engine)")
        self.copied_bytes = self._copied_bytes()
        self._vocab = _ll.llama_model_get_vocab(ptr)
        self._stack = ExitStack()
        self._stack.callback(_ll.llama_model_free, ptr)
        self._pools: dict[tuple[int, int, bool], tuple[int, int | None]] = {}

    def describe_kernels(self) -> str:
        """Which weights this model runs, and so which kernels: what a node says of its windows at load."""
        if self.copy is None:
            if not self.repack:
                return "the file's weights as they are (repacking off: llama.cpp's other kernels, other logits)"
            return "mapped from the model file: this CPU repacks none of their types (plain llama.cpp runs the same)"
        if not self.copy.repacked:
            return (f"mapped from {self.copy.path}, which holds them as the file does: llama.cpp repacks none of them "
                    "on this CPU")
        where = "the file, repacked in place" if self.copy.path == self.path else f"the repacked copy {self.copy.path}"
        return (f"mapped from {where} ({self.copy.repacked_bytes / 2**20:.0f} MiB "
                "repacked as plain llama.cpp repacks them on this CPU, so with its kernels)")

    def _copied_bytes(self) -> int:
        """Weights llama.cpp repacked into anonymous memory at load, as plain llama.cpp does: those not in the
        repacked copy (a tied lm_head's copy of the token embedding). Memory pressure, unlike the mapping."""
        mapped = self.copy.repacked if self.copy else frozenset()
        total = 0

        def add(name: bytes, _data: int, size: int, _user: object) -> None:
            nonlocal total
            total += 0 if name.decode() in mapped else size

        _native.llama_model_repacked_tensors(self._ptr, _native.llama_repacked_tensor_callback(add), None)
        return total

    # --- windows -------------------------------------------------------------------------------------------

    def window(
        self,
        start: int,
        end: int,
        *,
        output_hidden: bool | None = None,
        settings: ContextSettings | None = None,
        on_layer: Callable[[int], None] | None = None,
        on_route: OnRoute | None = None,
    ) -> Window:
        """Open a context over layers [start, end) of this model.

        output_hidden defaults to True for a window that ends before the last layer, False otherwise.
        [n_layer, n_layer) is the output-only window: hidden state in, logits out. On a model with per-layer inputs
        (ModelLayout.input_window), [0, 0) is the input window: tokens in, the rows entering layer 0 out.
        on_layer(il) is called from the computing thread when layer il starts, on_route(il, experts, x) when a
        mixture of experts' layer il has chosen its experts, before they compute (engine/progress.py).
        """
        rng = LayerRange(start, end)
        n_layer = self.layout.n_layer
        rng.check_within(n_layer)
        hidden = end < n_layer if output_hidden is None else output_hidden
        if end < n_layer and not hidden:
            raise WindowRangeError(f"window {rng} does not reach the last layer ({n_layer - 1}): "
                                   "it outputs hidden states")
        input_window = start == end == 0 and hidden and self.layout.input_window
        if start == end and not input_window and (end != n_layer or hidden):
            raise WindowRangeError(f"an empty window must be the output-only window [{n_layer}, {n_layer})"
                                   + (" or the input window [0, 0)" if self.layout.input_window else ""))
        self.layout.check_windows([rng])
        self._check_loaded(rng)
        if not hidden and not self.output:
            raise WindowRangeError(f"window {rng} outputs logits, but this Model was loaded with output=False")
        settings = settings or ContextSettings()
        context = _Context(
            self, settings, on_layer is not None, on_route,
            lambda params: _native.llama_init_window_from_model(self._ptr, params, start, end, hidden),
            f"window {rng}")
        # rows carrying per-layer inputs up to row_end: windows that end by it, but for the input window
        row_end = settings.row_end if self.layout.input_window and 0 < end <= settings.row_end < n_layer else 0
        if row_end and _native.llama_window_set_row_end(context.ptr, row_end) != 0:
            context.close()
            raise EngineError(f"window {rng}: its rows cannot carry per-layer inputs up to layer {row_end}: "
                              f"{_log.take_errors() or 'see the log'}")
        return Window(self, rng, hidden, context, on_layer=on_layer, row_end=row_end)

    def _check_loaded(self, rng: LayerRange) -> None:
        missing = sorted(set(range(rng.start, rng.end)) - self.layers)
        if missing:
            raise WindowRangeError(
                f"window {rng} needs layers {missing[0]}..{missing[-1]}, which this Model was not loaded for "
                f"(its windows: {', '.join(map(str, self.windows))})"
            )

    @property
    def can_share_context(self) -> bool:
        """Whether this model's windows can share one llama.cpp context (shared_windows): not with sliding-window
        attention, whose cache may drop cells that a later window still needs while the first runs a long batch, nor
        with recurrent layers, whose state a later window would find neither zeroed for a new sequence nor placed,
        nor with DeepSeek V3.2's sparse attention, whose two caches (llama.cpp's llama_kv_cache_dsa) a later window
        finds placed for the first window's batch, not its own (measured: other logits from the second window on)."""
        return (not any(self.layout.swa_layers) and not self.layout.has_recurrent_layers
                and not self.layout.indexer_key_length)

    def shared_windows(
        self,
        windows: Sequence[LayerRange | tuple[int, int]],
        *,
        settings: ContextSettings | None = None,
        on_layer: Sequence[Callable[[int], None] | None] | None = None,
        on_route: OnRoute | None = None,
    ) -> list[Window]:
        """Open windows that run one at a time, in the given order, on one llama.cpp context: a device's windows,
        one per round of a pipelined ring. They output hidden states. One KV cache holds all their layers, and
        they share one compute buffer, one output buffer and one graph's tables, where separate windows (window())
        pay each once per window: about 3.6 MiB a window on the memory testbed's model (docs/memory.md).

        The first window places each batch's tokens in the cache; a later one must compute the same positions after
        it (the ring's order) and writes its layers into the same cells. The KV methods of any of them apply to all.
        windows: non-empty, disjoint, in increasing layer order. on_layer: one callback (or None) per window;
        on_route: one for all (window()).
        """
        ranges = [_as_range(w) for w in windows]
        hooks = list(on_layer) if on_layer is not None else [None] * len(ranges)
        if not ranges or len(hooks) != len(ranges):
            raise WindowRangeError(f"need at least one window and one on_layer entry per window, got {len(ranges)} "
                                   f"window(s) and {len(hooks)} entries")
        if not self.can_share_context:
            raise WindowRangeError(f"{self.layout.arch} uses sliding-window attention or recurrent layers: open its "
                                   "windows one context each (Model.window)")
        for a, b in itertools.pairwise(ranges):
            if b.start < a.end:
                raise WindowRangeError(f"windows {a} and {b} overlap or are out of order")
        for r in ranges:
            if not r.n_layers:
                raise WindowRangeError(f"window {r} is empty: a shared context runs layers")
            self._check_loaded(r)
        bounds = (ctypes.c_int32 * (2 * len(ranges)))(*(x for r in ranges for x in (r.start, r.end)))
        context = _Context(
            self, settings or ContextSettings(), any(h is not None for h in hooks), on_route,
            lambda params: _native.llama_init_windows_from_model(self._ptr, params, bounds, len(ranges)),
            f"a context for windows {', '.join(map(str, ranges))}")
        context.selected = 0
        return [Window(self, r, True, context, index=i, on_layer=h)
                for i, (r, h) in enumerate(zip(ranges, hooks, strict=True))]

    def round_windows(
        self,
        ranges: Sequence[LayerRange],
        *,
        settings: ContextSettings | None = None,
        on_layer: Sequence[Callable[[int], None] | None] | None = None,
        on_route: OnRoute | None = None,
    ) -> list[Window | None]:
        """A device's windows, one per round of a ring (None for a round in which it runs no layer), all outputting
        hidden states: on one shared context where the model allows it (shared_windows), one context each
        otherwise. on_layer: one callback (or None) per round; on_route: one for all (window())."""
        hooks = list(on_layer) if on_layer is not None else [None] * len(ranges)
        if len(hooks) != len(ranges):
            raise WindowRangeError(f"{len(ranges)} round(s) but {len(hooks)} on_layer entries")
        used = [i for i, r in enumerate(ranges) if r.n_layers]
        if len(used) > 1 and self.can_share_context:
            shared = iter(self.shared_windows([ranges[i] for i in used], settings=settings,
                                              on_layer=[hooks[i] for i in used], on_route=on_route))
            return [next(shared) if r.n_layers else None for r in ranges]
        return [self.window(r.start, r.end, output_hidden=True, settings=settings, on_layer=h, on_route=on_route)
                if r.n_layers else None for r, h in zip(ranges, hooks, strict=True)]

    def _threadpool(self, settings: ContextSettings) -> tuple[int, int | None]:
        """The CPU thread pool shared by this model's windows with the same settings, and the core its calling
        thread runs on while it computes (None: not pinned)."""
        cpus = pinned_cpus(settings.threads, settings.pin_threads)
        main = cpus[-1] if cpus else None  # ggml's order: the workers first, the calling thread last
        key = (settings.threads, settings.poll, cpus is not None)
        if key not in self._pools:
            params = _native.ggml_threadpool_params_default(settings.threads)
            params.poll = settings.poll
            if cpus is not None:
                for cpu in cpus:
                    params.cpumask[cpu] = True
                params.strict_cpu = True
            # ggml pins the thread that creates a strict pool to the pool's own core for good: on_cpu gives it its
            # cores back. A window pins whichever thread computes, and only while it computes (Window._decode)
            with on_cpu(main):
                pool = _native.ggml_threadpool_new(ctypes.byref(params))
            if not pool:
                raise EngineError(f"could not start a pool of {settings.threads} compute threads")
            self._pools[key] = (pool, main)
            self._stack.callback(_native.ggml_threadpool_free, pool)  # after the windows created later
        return self._pools[key]

    def pause_threads(self) -> None:
        """Put the compute threads of every pool to sleep now, polling or not; the next call wakes them."""
        for pool, _ in self._pools.values():
            _native.ggml_threadpool_pause(pool)

    def resume_threads(self) -> None:
        """Wake the paused compute threads now, ahead of a call (they poll until it comes, if polling is on):
        their wake-up then overlaps with what the caller does before computing."""
        for pool, _ in self._pools.values():
            _native.ggml_threadpool_resume(pool)

    # --- vocabulary ----------------------------------------------------------------------------------------

    def _check_vocab(self) -> None:
        if not self.has_vocab:
            raise EngineError(f"{self.path} was loaded for windows that never tokenize (vocab=False): load it with "
                              "its vocabulary to tokenize")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._check_vocab()
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (_ll.llama_token * cap)()
        n = _ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (_ll.llama_token * cap)()
            n = _ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        self._check_vocab()
        buf = ctypes.create_string_buffer(256)
        n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def is_special(self, text: str) -> bool:
        """Whether text is one special token of the vocabulary (it tokenizes to one token only when specials are
        parsed)."""
        special = self.tokenize(text, add_special=False, parse_special=True)
        return len(special) == 1 and self.tokenize(text, add_special=False) != special

    def is_eog(self, token: int) -> bool:
        self._check_vocab()
        return bool(_ll.llama_vocab_is_eog(self._vocab, token))

    # --- lifetime ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the windows' contexts, then the model (also done by leaving a `with` block)."""
        self._stack.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Batch:
    """A llama_batch allocated once: token ids (n_embd 0) or hidden rows of n_embd floats, one sequence per row.
    Hidden rows of a model with M-RoPE take `positions` positions each, section-major (llama_batch_compat)."""

    def __init__(self, n_batch: int, n_embd: int, positions: int = 1) -> None:
        self.raw = _ll.llama_batch_init(n_batch, n_embd, 1)
        self.n_batch = n_batch
        self.tokens = n_embd == 0
        self.sections = 1 if self.tokens else positions
        # llama_batch_free frees the array llama_batch_init gave: put its address back first (an address, not the
        # field's pointer object, which shares the struct's memory)
        self._own_pos = ctypes.cast(self.raw.pos, ctypes.c_void_p).value
        if self.sections > 1:  # four positions a row: llama_batch_init allocated one
            self._pos_sections = np.zeros(self.sections * n_batch, dtype=np.int32)
            self.raw.pos = self._pos_sections.ctypes.data_as(type(self.raw.pos))
        self.pos = np.ctypeslib.as_array(self.raw.pos, (n_batch,))
        self.want = np.ctypeslib.as_array(self.raw.logits, (n_batch,))
        for k in range(n_batch):
            self.raw.n_seq_id[k] = 1
        self._seqs = np.zeros(n_batch, dtype=np.int32)  # what seq_id[k][0] holds, to write only what changes
        for k in range(n_batch):
            self.raw.seq_id[k][0] = 0

    def fill(self, rows: np.ndarray, pos: np.ndarray, want: np.ndarray, seqs: np.ndarray) -> None:
        b, n = self.raw, len(rows)
        ctypes.memmove(b.token if self.tokens else b.embd, rows.ctypes.data, rows.nbytes)
        if self.sections > 1:  # M-RoPE: the position for time, height and width, then 0, as llama.cpp gives a token
            sections = self._pos_sections[: self.sections * n].reshape(self.sections, n)
            sections[:3] = pos
            sections[3:] = 0
        else:
            self.pos[:n] = pos
        self.want[:n] = want
        for k in np.flatnonzero(self._seqs[:n] != seqs):
            b.seq_id[k][0] = int(seqs[k])
        self._seqs[:n] = seqs
        b.n_tokens = n

    def free(self) -> None:
        self.raw.pos = ctypes.cast(self._own_pos, type(self.raw.pos))
        _ll.llama_batch_free(self.raw)


class _Context:
    """A llama.cpp context with its batches: one window's own, or one shared by several windows of a Model
    (Model.shared_windows), which run one at a time and select themselves before they compute."""

    def __init__(self, model: Model, settings: ContextSettings, with_progress: bool, on_route: OnRoute | None,
                 create: Callable[[_ll.llama_context_params], int | None], what: str) -> None:
        self.settings = settings
        self.n_embd = model.layout.n_embd
        self.positions = model.layout.positions_per_row
        pool, self.cpu = model._threadpool(settings)  # the core the calling thread computes on, if pinned
        params = settings.params()
        # one callback per context; a shared context points it at the selected window's on_layer
        self.progress = LayerProgress(None, on_route) if with_progress or on_route is not None else None
        if self.progress is not None:
            params.cb_eval = self.progress.callback
        ptr = create(params)
        if not ptr:
            raise EngineError(f"could not create {what}: {_log.take_errors() or 'see the log'}")
        if _ll.llama_n_rs_seq(ptr) != settings.n_rs_seq:  # llama.cpp gives 0 where the architecture keeps none
            _ll.llama_free(ptr)
            raise EngineError(f"{what}: llama.cpp keeps no snapshots of {model.layout.arch}'s recurrent states, so "
                              "its last tokens cannot be forgotten (n_rs_seq): run it without a draft model")
        self.ptr = ptr
        _native.llama_attach_threadpool(ptr, pool, pool)
        self._batches: dict[int, _Batch] = {}
        self.selected: int | None = None
        self.windows_open = 0
        self.closed = False
        # freed before the model, in reverse order of creation (llama.cpp needs contexts gone first)
        model._stack.callback(self.close)

    def batch(self, width: int) -> _Batch:
        """The batch for token ids (width 0) or for hidden rows of `width` floats, allocated on first use and kept."""
        if width not in self._batches:
            self._batches[width] = _Batch(self.settings.n_batch, width, self.positions)
        return self._batches[width]

    def window_closed(self) -> None:
        self.windows_open -= 1
        if self.windows_open <= 0:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for b in self._batches.values():
                b.free()
            _ll.llama_free(self.ptr)


class Window:
    """Layers [start, end) of a Model, computed by a llama.cpp context: the window's own (Model.window) or one
    shared with the device's other windows (Model.shared_windows)."""

    def __init__(self, model: Model, layers: LayerRange, output_hidden: bool, context: _Context,
                 index: int | None = None, on_layer: Callable[[int], None] | None = None, row_end: int = 0) -> None:
        self.model = model
        self.layers = layers
        self.output_hidden = output_hidden
        self.settings = context.settings
        self.n_embd = model.layout.n_embd
        # the floats of a row it takes (hidden states: n_embd, then any per-layer inputs ahead) and gives
        self.in_width = 0 if self.takes_tokens else model.layout.row_width(layers.start, row_end)
        self.out_width = model.layout.row_width(layers.end, row_end) if output_hidden else model.layout.n_vocab
        self.n_vocab = model.layout.n_vocab
        self.cpu = context.cpu
        self.context = context  # windows with the same context share its KV cache (kv_* apply to all of them)
        self._index = index  # its place in a shared context; None: the context is its own
        self._on_layer = on_layer
        self._ctx = context.ptr
        self._closed = False
        context.windows_open += 1
        self.compute_released_bytes = 0  # compute buffer pages given back so far (ContextSettings.release_compute)

    @property
    def takes_tokens(self) -> bool:
        """The first window takes token ids; with per-layer inputs, only the input window [0, 0) does."""
        return self.layers.start == 0 and (not self.model.layout.input_window or self.layers.end == 0)

    def forward(
        self,
        inputs: Sequence[int] | np.ndarray,
        positions: int | Sequence[int] | np.ndarray,
        *,
        seq_id: int | Sequence[int] | np.ndarray = 0,
        logits: str = "last",
    ) -> np.ndarray:
        """Run the window over a batch of tokens (first window) or hidden states (float32, n x in_width).

        positions: the first position (consecutive positions follow) or one per input row.
        seq_id: the sequence of every row, or one per row (the rows of several requests in one call; each
            sequence's rows consecutive positions).
        logits: for a window that outputs logits, "last" (the last row only), "all", or "keep": every row
            computed but left in llama.cpp's buffer, where a llama.cpp sampler reads them (returns no rows).
        Returns hidden states (n x out_width, float32) or logits (rows x n_vocab, float32).
        """
        self._check_open()
        rows = self._rows(inputs)
        n = len(rows)
        pos = np.arange(positions, positions + n, dtype=np.int32) if isinstance(positions, (int, np.integer)) \
            else np.asarray(positions, dtype=np.int32)
        if pos.shape != (n,):
            raise ValueError(f"got {n} inputs but {pos.shape[0] if pos.ndim else 1} positions")
        seqs = np.full(n, seq_id, dtype=np.int32) if isinstance(seq_id, (int, np.integer)) \
            else np.asarray(seq_id, dtype=np.int32)
        if seqs.shape != (n,):
            raise ValueError(f"got {n} inputs but {seqs.shape[0] if seqs.ndim else 1} sequence ids")
        if logits not in ("last", "all", "keep"):
            raise ValueError(f"logits must be 'last', 'all' or 'keep', not {logits!r}")
        width = self.out_width
        if not self.layers.n_layers:
            # the output-only (and the input) window holds no keys or values, yet llama.cpp checks that each
            # batch's positions continue the ones it saw last; the ring hands it the last row of each batch, at any
            # position (a batch of n_batch rows ends n_batch on, a conversation goes back): it forgets what it saw
            _ll.llama_memory_clear(_ll.llama_get_memory(self._ctx), False)
        elif self._index in (None, 0):
            # a batch at position p replaces what the cache holds from p on (a rewind the head did not send round
            # the ring: a rejected draft, a conversation going another way); a window sharing this context reuses
            # the cells the first one places, so only the first forgets
            for s in np.unique(seqs):
                first = int(pos[seqs == s].min())
                if self.kv_pos_max(int(s)) >= first:
                    self.kv_remove(int(s), first)
        out: list[np.ndarray] = []
        for i in range(0, n, self.settings.n_batch):
            j = min(n, i + self.settings.n_batch)
            if self.output_hidden or logits != "last":
                want = np.ones(j - i, dtype=np.int8)
            else:
                want = np.zeros(j - i, dtype=np.int8)
                want[-1] = j == n
            n_out = int(want.sum())
            self._decode(rows[i:j], pos[i:j], want, seqs[i:j])
            if n_out and (self.output_hidden or logits != "keep"):
                src = _ll.llama_get_embeddings(self._ctx) if self.output_hidden else _ll.llama_get_logits(self._ctx)
                # one copy out of llama.cpp's buffer (np.ctypeslib.as_array costs more than the copy here)
                raw = ctypes.string_at(ctypes.cast(src, ctypes.c_void_p).value or 0, n_out * width * 4)
                out.append(np.frombuffer(raw, dtype=np.float32).reshape(n_out, width))
        if n > 1 and self.settings.release_compute:
            self.compute_released_bytes += _native.llama_window_release_compute(self._ctx)
        if not out:
            return np.empty((0, width), dtype=np.float32)
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _rows(self, inputs: Sequence[int] | np.ndarray) -> np.ndarray:
        if self.takes_tokens:
            rows = np.asarray(inputs, dtype=np.int32)
            if rows.ndim != 1 or rows.size == 0:
                raise ValueError(f"window {self.layers} takes a non-empty 1-D sequence of token ids")
            if rows.min() < 0 or rows.max() >= self.n_vocab:
                raise ValueError(f"token ids must lie in [0, {self.n_vocab})")
            return rows
        rows = np.ascontiguousarray(inputs, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.in_width or rows.shape[0] == 0:
            raise ValueError(f"window {self.layers} takes hidden states shaped (n, {self.in_width}), got {rows.shape}")
        return rows

    def _decode(self, rows: np.ndarray, pos: np.ndarray, want: np.ndarray, seqs: np.ndarray) -> None:
        ctx, n = self.context, len(rows)
        if self._index is not None and ctx.selected != self._index:
            if _native.llama_window_select(self._ctx, self._index) != 0:
                raise EngineError(f"window {self.layers}: could not select it: {_log.take_errors() or 'see the log'}")
            ctx.selected = self._index
        batch = ctx.batch(self.in_width)
        batch.fill(rows, pos, want, seqs)
        if ctx.progress is not None:
            ctx.progress.on_layer = self._on_layer
            ctx.progress.reset()
        with on_cpu(self.cpu):
            code = _ll.llama_decode(self._ctx, batch.raw)
        if code != 0:
            err = _log.take_errors()
            raise EngineError(
                f"window {self.layers} could not compute {n} tokens at positions {pos[0]}..{pos[-1]}: "
                f"{_decode_failure(code, err, self.settings.n_ctx)}" + (f" (llama.cpp: {err})" if err else ""),
                code,
            )

    def embed(self, hidden: np.ndarray) -> np.ndarray:
        """Embeddings of one sequence's final hidden rows (n x n_embd, at most n_batch), from the output-only window
        opened with ContextSettings(embeddings=True): the output norm's rows (n x n_embd) or, with pooling, their
        pooled row (1 x n_embd), as llama.cpp computes them for a whole model."""
        self._check_open()
        rows = self._rows(hidden)
        n = len(rows)
        if self.layers.n_layers or not self.settings.embeddings or n > self.settings.n_batch:
            raise ValueError(f"embeddings come from the output-only window opened with embeddings on, for at most "
                             f"{self.settings.n_batch} rows (window {self.layers}, {n} rows)")
        _ll.llama_memory_clear(_ll.llama_get_memory(self._ctx), False)
        self._decode(rows, np.arange(n, dtype=np.int32), np.ones(n, dtype=np.int8), np.zeros(n, dtype=np.int32))
        pooled = _ll.llama_pooling_type(self._ctx) != _ll.LLAMA_POOLING_TYPE_NONE
        src = _ll.llama_get_embeddings_seq(self._ctx, 0) if pooled else _ll.llama_get_embeddings(self._ctx)
        count = (1 if pooled else n) * self.n_embd
        raw = ctypes.string_at(ctypes.cast(src, ctypes.c_void_p).value or 0, count * 4)
        return np.frombuffer(raw, dtype=np.float32).reshape(-1, self.n_embd)

    def set_logits(self, logits: np.ndarray) -> None:
        """Make this window's context hold these logits (rows x n_vocab) as if it had just computed them, for
        llama.cpp's samplers to read: the head computes the output layer once for the rows of several sequences
        and hands each sequence's context its own."""
        self._check_open()
        rows = np.ascontiguousarray(logits, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.n_vocab or not len(rows):
            raise ValueError(f"logits are shaped (n, {self.n_vocab}), got {rows.shape}")
        ptr = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        if _native.llama_window_set_logits(self._ctx, ptr, len(rows)) != 0:
            raise EngineError(f"window {self.layers}: could not hold {len(rows)} rows of logits: "
                              f"{_log.take_errors() or 'see the log'}")

    # --- KV cache --------------------------------------------------------------------------------------------

    def kv_clear(self) -> None:
        """Forget every sequence's cached keys and values."""
        self._check_open()
        _ll.llama_memory_clear(_ll.llama_get_memory(self._ctx), True)

    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """Forget positions [p0, p1) of a sequence (p1 = -1: to the end), e.g. to roll back rejected tokens."""
        self._check_open()
        if not _ll.llama_memory_seq_rm(_ll.llama_get_memory(self._ctx), seq_id, p0, p1):
            raise EngineError(f"window {self.layers}: cannot remove positions [{p0}, {p1}) of sequence {seq_id}")

    def kv_pos_max(self, seq_id: int = 0) -> int:
        """The largest cached position of a sequence, or -1 when it has none."""
        self._check_open()
        return int(_ll.llama_memory_seq_pos_max(_ll.llama_get_memory(self._ctx), seq_id))

    def state_bytes(self, seq_id: int = 0) -> int:
        """Bytes of a sequence's saved state: its KV cache for this window's layers, plus a small header."""
        self._check_open()
        return int(_ll.llama_state_seq_get_size(self._ctx, seq_id))

    # --- lifetime ------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self.context.closed:
            raise EngineError(f"window {self.layers} is closed")

    def close(self) -> None:
        """Close the window; its context goes with the last window that uses it."""
        if not self._closed:
            self._closed = True
            self.context.window_closed()

    def __repr__(self) -> str:
        kind = "hidden" if self.output_hidden else "logits"
        return f"Window({self.layers}, out={kind})"


def _decode_failure(code: int, err: str, n_ctx: int) -> str:
    """The likely cause of a llama_decode return code (llama.h), in words."""
    if "sequence positions" in err:
        return ("its KV cache does not hold the positions before these: the device and the head disagree on the "
                "conversation so far (a device restarted, or a message was lost); the head replays it on the next "
                "request")
    if code == 1:
        return f"no room in its KV cache of {n_ctx} cells: the context is full; raise n_ctx (-c)"
    if code == 2:
        return "the computation was aborted"
    if code == -1:
        return "llama.cpp refused the batch as invalid"
    return "the computation failed; the device may be out of memory (see its log, with -v)"


def one_per_context(windows: Iterable[Window | None]) -> list[Window]:
    """One window for each llama.cpp context among these: the ones whose KV methods reach every window."""
    seen: dict[int, Window] = {}
    for w in windows:
        if w is not None:
            seen.setdefault(id(w.context), w)
    return list(seen.values())
