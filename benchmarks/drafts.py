"""Draft models for the speculative-decoding benchmarks: a smaller copy of a GGUF, made by llama.cpp's own quantizer.

Only one real model is available offline (Gemma 3 270M); requantizing it to a smaller type gives a draft that
shares its vocabulary and mostly agrees with it, and is cheaper to run on the head.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from benchmarks.memory_testbed import CACHE


def _llama_cpp_constant(prefix: str, name: str) -> int:
    import llama_cpp

    value = getattr(llama_cpp, prefix + name, None)
    if value is None:
        raise ValueError(f"unknown llama.cpp type {name!r} ({prefix}{name} is not in llama_cpp)")
    return int(value)


def requantized_draft(path: str | os.PathLike[str], ftype: str = "Q2_K", embeddings: str | None = "Q4_0") -> Path:
    """`path` requantized to `ftype` (a llama.cpp file type: "Q2_K", "Q3_K_S", ...), made once and cached under
    ~/.cache/primaplug/bench/. `embeddings` is the type of the token embeddings (a ggml type; None: as `ftype`
    leaves them): llama.cpp keeps Gemma's Q8_0 embeddings, which are also its output layer (tied) and most of the
    time a token takes, and whose rows of 640 fit no K-quant (blocks of 256)."""
    import llama_cpp

    src = Path(path)
    out = CACHE / f"{src.stem}-draft-{ftype}{f'-embd-{embeddings}' if embeddings else ''}.gguf"
    if out.exists():
        return out
    print(f"writing {out.name} (once; llama.cpp's quantizer)", file=sys.stderr)
    CACHE.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _llama_cpp_constant("LLAMA_FTYPE_MOSTLY_", ftype)
    if embeddings:
        params.token_embedding_type = _llama_cpp_constant("GGML_TYPE_", embeddings)
    params.allow_requantize = True  # the source is already quantized
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not requantize {src} to {ftype} (see its log above)")
    tmp.rename(out)
    return out
