"""Draft models for the speculative-decoding benchmarks: a smaller copy of a GGUF, made by llama.cpp's own quantizer.

Only one real model is available offline (Gemma 3 270M); requantizing it to a smaller type gives a draft that
shares its vocabulary and mostly agrees with it, and is cheaper to run on the head.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any

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


def truncated_draft(target: str | os.PathLike[str], layers: int, noise: float = 0.0, seed: int = 0,
                    folder: Path = CACHE) -> Path:
    """The first `layers` layers of `target` with its embedding and output layer, their bytes copied as they are:
    the draft of a synthetic target written with shallow_layers=layers (engine/synthetic.py), whose later layers
    barely change what it predicts. `noise` > 0 adds Gaussian noise to the output layer's weights (written F16),
    `noise` times their own spread: the fewer of the target's choices the draft then makes, the knob that sets how
    often its drafts are accepted. Made once and cached in `folder` (default ~/.cache/primaplug/bench/)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    src = Path(target)
    out = folder / f"{src.stem}-first{layers}{f'-noise{noise:g}' if noise else ''}.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out.with_suffix(".tmp"), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = layers if field.name == gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch) else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]

    def data(t: Any) -> Any:
        if t.name != "output.weight" or not noise:
            return t.data
        w = dequantize(t.data, t.tensor_type)
        rng = np.random.default_rng(seed)
        return (w + noise * float(w.std()) * rng.standard_normal(w.shape, dtype=np.float32)).astype(np.float16)

    arrays = [(t, data(t)) for t in kept]
    for t, a in arrays:  # a quantized tensor's data is its bytes, shaped as such; gguf takes it with its type
        writer.add_tensor_info(t.name, a.shape, a.dtype, a.nbytes, t.tensor_type if a is t.data else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, a in arrays:
        writer.write_tensor_data(a)
    writer.close()
    out.with_suffix(".tmp").rename(out)
    return out
