"""Undoing llama.cpp's CPU repacking (engine/unrepack.py): learned from the engine, exact on every type it repacks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from primaplug.engine import TensorSpan, _native
from primaplug.engine.layout import REPACKABLE
from primaplug.engine.unrepack import PROBE_ROWS, layout_for, learn, repacks, undo_range


def _span(type_name: str, ne0: int, rows: int) -> TensorSpan:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return TensorSpan("blk.0.ffn_up.weight", type_name, (ne0, rows), 4096, rows * ne0 // block * size, 0)


def _repack(span: TensorSpan, raw: np.ndarray) -> np.ndarray:
    out = np.empty_like(raw)
    rc = _native.ggml_cpu_repack_bytes(int(GGMLQuantizationType[span.type_name]), span.shape[0], span.shape[1],
                                       raw.ctypes.data, out.ctypes.data, raw.nbytes)
    assert rc == 0
    return out


def test_every_type_this_cpu_repacks_is_undone_exactly() -> None:
    rng = np.random.default_rng(7)
    done = []
    for type_name in sorted(REPACKABLE):
        for ne0 in (256, 2048, 640):
            span = _span(type_name, ne0, 3 * PROBE_ROWS)
            if not repacks(span):
                continue
            assert learn(type_name, ne0) is not None, f"{type_name} x {ne0}: repacked, but not by moving bits alone"
            lay = layout_for(span)
            assert lay is not None and PROBE_ROWS % lay.rows == 0
            raw = rng.integers(0, 256, span.nbytes, dtype=np.uint8)
            repacked = _repack(span, raw)
            assert not np.array_equal(repacked, raw)  # it does move them
            assert np.array_equal(lay.undo(repacked), raw), f"{type_name} x {ne0}"
            # a range inside the tensor, as a piece of the file cuts it
            a, b = span.offset + 1000, span.end - 333
            part = undo_range(span, lay, lambda off, n, r=repacked, o=span.offset: r[off - o:off - o + n], a, b)
            assert np.array_equal(part, raw[a - span.offset:b - span.offset])
            done.append(type_name)
    if not done:
        pytest.skip("this CPU's llama.cpp repacks no weight type (no AVX2, NEON dotprod or RVV): nothing to undo")


def test_a_type_it_does_not_repack_has_no_layout() -> None:
    assert layout_for(_span("F32", 256, 16)) is None
    assert not repacks(_span("Q4_0", 256, 16)) or layout_for(_span("Q4_0", 256, 12)) is None  # rows not whole tiles
