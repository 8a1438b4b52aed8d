"""Compute speed per quantization type (s^{cpu,q}, s^{gpu,q}), timed on real llama.cpp work.

A small synthetic llama model (two layers, n_embd 1024, written once into the cache folder) is quantized by
llama.cpp's own quantizer to each type, and layer 0 of each copy runs as a one-layer window over a batch of
tokens. Layer 0 is all of one type: Q4_K_M and Q5_K_M give Q6_K only to attn_v and ffn_down of the *last* of two
layers (llama.cpp's use_more_bits). A layer also has F32 work (norms, RoPE, softmax) and F16 attention (it reads
the F16 KV cache), so every timing is a sum over types, t_i = sum_q f_iq / s_q, with f_iq counted by the model
profiler; the speeds solve that linear system. Each type dominates its own file, so the system is well
conditioned, and the speeds are consistent with how the latency model adds up a layer's time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from primaplug.core.profiles import QUANT_TYPES
from primaplug.engine.layout import read_layout
from primaplug.profiler.model import kv_cells, layer_flops

# the calibration model: big enough that matmuls dominate, small enough to write and load in a second or two
CALIBRATION = {"arch": "llama", "n_layer": 2, "n_embd": 1024, "n_ff": 2816, "n_head": 8, "n_head_kv": 2,
               "n_vocab": 512, "seed": 0}
_TAG = "calib-v1-llama-2x1024x2816"
# the llama.cpp file type that makes layer 0 of the calibration model all of one measured type
FTYPE = {"F32": "F32", "F16": "F16", "Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K": "Q5_K_M", "Q4_K": "Q4_K_M"}
# every layer has F32 operations and F16 attention, so these two are always measured
ALWAYS = ("F32", "F16")

# (paths, n_tokens, repeats, gpu) -> median seconds of one forward pass over n_tokens, per path
Timer = Callable[[Sequence[Path], int, int, bool], list[float]]


def types_to_measure(types: Sequence[str]) -> tuple[str, ...]:
    unknown = set(types) - set(QUANT_TYPES)
    if unknown:
        raise ValueError(f"no calibration for {sorted(unknown)}: measured types are {', '.join(QUANT_TYPES)} "
                         "(normalise a model's types with primaplug.profiler.normalise_type)")
    return tuple(q for q in QUANT_TYPES if q in types or q in ALWAYS)


def calibration_models(folder: Path, types: Sequence[str]) -> dict[str, Path]:
    """The calibration model in each type, written (once) into `folder`. Files appear under their final name
    only when complete, so an interrupted run never leaves a half-written model behind."""
    from primaplug.engine.synthetic import SyntheticSpec, quantize, write_synthetic_gguf

    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"{_TAG}-F32.gguf"
    if not src.exists():
        tmp = _tmp(src)
        write_synthetic_gguf(tmp, SyntheticSpec(**CALIBRATION))  # type: ignore[arg-type]
        os.replace(tmp, src)
    out = {}
    for q in types_to_measure(types):
        path = folder / f"{_TAG}-{q}.gguf"
        if q != "F32" and not path.exists():
            tmp = _tmp(path)
            quantize(src, tmp, FTYPE[q])
            os.replace(tmp, path)
        out[q] = src if q == "F32" else path
    return out


def _tmp(path: Path) -> Path:
    # one name per process: emulated devices on one machine may share a cache folder and profile at once
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def time_layers(paths: Sequence[Path], n_tokens: int, repeats: int, gpu: bool) -> list[float]:
    """Median seconds of layer 0 of each file over a batch of n_tokens, on the CPU or, with gpu, on the engine's
    GPU. The files take turns pass by pass (after two warm-up rounds), so that a burst of other work on the device
    slows every type alike instead of one."""
    from primaplug.engine import ContextSettings, Model

    tokens = 3 + np.arange(n_tokens) % (int(CALIBRATION["n_vocab"]) - 3)
    settings = ContextSettings(n_ctx=n_tokens, n_batch=n_tokens, n_ubatch=n_tokens)
    times: list[list[float]] = [[] for _ in paths]
    with contextlib.ExitStack() as stack:
        models = [stack.enter_context(Model(p, [(0, 1)], output=False, gpu_layers=[0] if gpu else (), vocab=False))
                  for p in paths]
        windows = [m.window(0, 1, settings=settings) for m in models]
        for r in range(repeats + 2):
            for i, window in enumerate(windows):
                window.kv_clear()
                t0 = time.perf_counter()
                window.forward(tokens, 0)
                if r >= 2:
                    times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def forward_flops(path: Path, n_tokens: int) -> dict[str, float]:
    """FLOPs of one pass of layer 0 over n_tokens, by type (llama.cpp attends over the whole padded cache)."""
    per_token = layer_flops(read_layout(path), 0, kv_cells(n_tokens))
    return {q: f * n_tokens for q, f in per_token.items()}


def solve_speeds(flops: Mapping[str, Mapping[str, float]], seconds: Mapping[str, float]) -> dict[str, float]:
    """FLOP/s per type from timings of files that mix types: solve t_i = sum_q f_iq / s_q.

    flops[i][q]: FLOPs of type q in file i (file i is named after the type that dominates it); seconds[i]: its
    time. Types without a file of their own are counted as the file's own type. Should noise make the solution
    unphysical (a speed <= 0), each file's speed falls back to its total FLOPs over its time."""
    names = [q for q in QUANT_TYPES if q in flops]
    matrix = np.zeros((len(names), len(names)))
    for i, own in enumerate(names):
        for q, f in flops[own].items():
            matrix[i, names.index(q) if q in names else i] += f
    t = np.array([seconds[q] for q in names])
    try:
        inverse = np.linalg.solve(matrix, t)
        if np.all(np.isfinite(inverse)) and np.all(inverse > 0):
            return {q: float(1.0 / x) for q, x in zip(names, inverse, strict=True)}
    except np.linalg.LinAlgError:
        pass
    return {q: float(matrix[i].sum() / t[i]) for i, q in enumerate(names)}


def measure_flops(folder: Path, types: Sequence[str], *, gpu: bool = False, n_tokens: int = 64, repeats: int = 11,
                  timer: Timer = time_layers) -> dict[str, float]:
    """FLOP/s per requested type (plus F32 and F16) on the CPU or the engine's GPU."""
    models = calibration_models(folder, types)
    flops = {q: forward_flops(p, n_tokens) for q, p in models.items()}
    seconds = dict(zip(models, timer(list(models.values()), n_tokens, repeats, gpu), strict=True))
    return solve_speeds(flops, seconds)


@contextlib.contextmanager
def engine_log() -> Iterator[list[str]]:
    """Collect the lines llama.cpp logs meanwhile. The engine sends them to `primaplug.llama`, INFO lines at DEBUG;
    while collecting, that logger takes DEBUG records but passes on to its parents only what it passed before."""
    lines: list[str] = []
    log = logging.getLogger("primaplug.llama")
    before = log.getEffectiveLevel()

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            if record.levelno >= before and log.parent is not None:
                log.parent.handle(record)

    handler, level, propagate = _Collect(logging.DEBUG), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
