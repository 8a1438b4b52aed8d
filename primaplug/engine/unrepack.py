"""Repacking undone: a repacked weight's bytes back as the model file holds them.

llama.cpp's CPU repacking (engine/repacked.py) only moves bits: it interleaves the blocks of 4, 8 or 16 rows and
rearranges their scales, and flips Q4_0's nibbles by a constant. So a node can keep one copy of its layers, repacked,
and still hand a peer the file's bytes, or check them against the manifest's hashes (store/copy.py).

The layout is not written down here, type by type: it is learned from llama.cpp's own repacking (patches/0021,
ggml_cpu_repack_bytes) of a probe of PROBE_ROWS rows of the weight's type and row length. With the probe's bits
numbered, log2(bits) probes tell where each bit goes; random probes then check that repacking is that permutation
and a constant, nothing else. Where it is not (a future repacking that converts values), there is no RepackLayout and
the caller keeps the file's bytes beside the repacked ones.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from primaplug.engine import _log, _native
from primaplug.engine.ggml_types import block, type_id
from primaplug.engine.layout import REPACKABLE, TensorSpan

PROBE_ROWS = 16  # a multiple of every row group llama.cpp interleaves (4, 8 or 16 rows)
_CHECKS = 3  # random probes that must repack as the learned permutation says


@dataclass(frozen=True, eq=False)
class RepackLayout:
    """How this engine repacks the weights of one type and row length: a permutation of bits and a constant, over
    tiles of `rows` rows. `key` names it, so that bytes repacked under another layout are never undone with this."""

    rows: int
    tile_bytes: int
    key: str
    byte_src: np.ndarray  # repacked bytes that are whole raw bytes (xor byte_xor) ...
    byte_dst: np.ndarray  # ... and where they go
    byte_xor: np.ndarray
    part_out: np.ndarray  # repacked bytes whose bits go to several raw bytes
    part_in: np.ndarray  # the raw bytes they make
    bit_src: np.ndarray  # bits, numbered within part_out ...
    bit_dst: np.ndarray  # ... and within part_in
    bit_xor: np.ndarray

    def undo(self, data: bytes | np.ndarray) -> np.ndarray:
        """The raw bytes of whole tiles of repacked bytes."""
        rep = np.frombuffer(data, np.uint8) if isinstance(data, bytes | bytearray | memoryview) else data
        if rep.size % self.tile_bytes:
            raise ValueError(f"{rep.size} bytes are not whole tiles of {self.tile_bytes}")
        rep = rep.reshape(-1, self.tile_bytes)
        raw = np.empty_like(rep)
        raw[:, self.byte_dst] = rep[:, self.byte_src] ^ self.byte_xor
        if self.part_out.size:
            bits = np.unpackbits(rep[:, self.part_out], axis=1, bitorder="little")
            out = np.empty((rep.shape[0], 8 * self.part_in.size), np.uint8)
            out[:, self.bit_dst] = bits[:, self.bit_src] ^ self.bit_xor
            raw[:, self.part_in] = np.packbits(out, axis=1, bitorder="little")
        return raw.reshape(-1)


def layout_for(span: TensorSpan) -> RepackLayout | None:
    """How this engine repacks this tensor's type and row length; None where it repacks none such, or not by
    moving bits alone."""
    if span.type_name not in REPACKABLE or not span.shape:
        return None
    rows = span.nbytes // _row_bytes(span.type_name, span.shape[0])
    found = learn(span.type_name, span.shape[0])
    return found if found is not None and rows % found.rows == 0 else None


def repacks(span: TensorSpan) -> bool:
    """Whether this engine repacks weights of this tensor's type and row length at all (on this CPU)."""
    if span.type_name not in REPACKABLE or not span.shape:
        return False
    return _probe(span.type_name, span.shape[0]) is not None


def undo_range(span: TensorSpan, layout: RepackLayout, read: object, start: int, end: int) -> np.ndarray:
    """The raw bytes [start, end) of a repacked tensor (file offsets), read whole tiles at a time with
    `read(offset, n)`."""
    t0 = span.offset + (start - span.offset) // layout.tile_bytes * layout.tile_bytes
    t1 = span.offset + -(-(end - span.offset) // layout.tile_bytes) * layout.tile_bytes
    raw = layout.undo(read(t0, t1 - t0))  # type: ignore[operator]
    return raw[start - t0:end - t0]


def _row_bytes(type_name: str, ne0: int) -> int:
    per_block, size = block(type_name)
    return ne0 // per_block * size


def _repack(tid: int, ne0: int, src: np.ndarray) -> np.ndarray | None:
    dst = np.empty_like(src)
    rc = _native.ggml_cpu_repack_bytes(tid, ne0, PROBE_ROWS, src.ctypes.data, dst.ctypes.data, src.nbytes)
    return dst if rc == 0 else None


@functools.cache
def _probe(type_name: str, ne0: int) -> np.ndarray | None:
    """The repacked bytes of a probe of zeros: the constant part of the layout; None where nothing is repacked."""
    _log.install()  # llama.cpp logs each repacking: to the engine's log, not stderr
    if ne0 % block(type_name)[0]:
        return None
    return _repack(type_id(type_name), ne0, np.zeros(PROBE_ROWS * _row_bytes(type_name, ne0),
                                                                        np.uint8))


@functools.cache
def learn(type_name: str, ne0: int) -> RepackLayout | None:
    """Learn the layout from the engine (a few ms; kept for the process)."""
    const = _probe(type_name, ne0)
    if const is None:
        return None
    tid = type_id(type_name)
    probe_bytes = const.size
    n_bits = 8 * probe_bytes
    c_bits = np.unpackbits(const, bitorder="little")
    index = np.arange(n_bits, dtype=np.int64)
    src = np.zeros(n_bits, np.int64)  # the raw bit each repacked bit is
    for k in range((n_bits - 1).bit_length()):
        out = _repack(tid, ne0, np.packbits(((index >> k) & 1).astype(np.uint8), bitorder="little"))
        assert out is not None
        src |= (np.unpackbits(out, bitorder="little") ^ c_bits).astype(np.int64) << k
    if not np.array_equal(np.sort(src), index):
        return None
    rng = np.random.default_rng(0)
    for _ in range(_CHECKS):
        x = rng.integers(0, 256, probe_bytes, dtype=np.uint8)
        out = _repack(tid, ne0, x)
        if out is None or not np.array_equal(np.unpackbits(out, bitorder="little"),
                                             np.unpackbits(x, bitorder="little")[src] ^ c_bits):
            return None
    rows = _tile_rows(src, c_bits, n_bits // PROBE_ROWS)
    return _layout(src, c_bits, rows, rows * probe_bytes // PROBE_ROWS,
                   hashlib.sha256(src.tobytes() + c_bits.tobytes() + type_name.encode()).hexdigest()[:16])


def _tile_rows(src: np.ndarray, c_bits: np.ndarray, row_bits: int) -> int:
    """The fewest rows the permutation repeats over (it never moves a bit out of its tile)."""
    j = np.arange(src.size)
    for rows in (1, 2, 4, 8):
        tile = rows * row_bits
        if (np.array_equal(src // tile, j // tile) and np.array_equal(src % tile, np.tile(src[:tile], src.size // tile))
                and np.array_equal(c_bits, np.tile(c_bits[:tile], src.size // tile))):
            return rows
    return PROBE_ROWS


def _layout(src_all: np.ndarray, c_all: np.ndarray, rows: int, tile_bytes: int, key: str) -> RepackLayout:
    src, c_bits = src_all[:8 * tile_bytes], c_all[:8 * tile_bytes]
    by_byte = src.reshape(-1, 8)
    whole = (by_byte[:, 0] % 8 == 0) & np.all(by_byte == by_byte[:, :1] + np.arange(8), axis=1)
    out_whole = np.flatnonzero(whole)
    c_bytes = np.packbits(c_bits, bitorder="little")
    part_out = np.flatnonzero(~whole)
    part_in = np.unique(by_byte[part_out] // 8) if part_out.size else np.zeros(0, np.int64)
    in_pos = np.full(tile_bytes, -1, np.int64)
    in_pos[part_in] = np.arange(part_in.size)
    bits_out = (part_out[:, None] * 8 + np.arange(8)).reshape(-1)
    return RepackLayout(
        rows=rows, tile_bytes=tile_bytes, key=key,
        byte_src=out_whole, byte_dst=by_byte[out_whole, 0] // 8, byte_xor=c_bytes[out_whole],
        part_out=part_out, part_in=part_in,
        bit_src=np.arange(bits_out.size), bit_dst=in_pos[src[bits_out] // 8] * 8 + src[bits_out] % 8,
        bit_xor=c_bits[bits_out])
