"""Repacked copies: a model's weights in the layout llama.cpp's CPU kernels want, on disk, mapped like the file.

Plain llama.cpp repacks Q4_0, Q4_K, Q5_K, Q6_K, Q2_K, Q8_0, IQ4_NL and MXFP4 matrices at load (x86 AVX2/AVX-512,
ARM NEON/i8mm) into anonymous memory, and runs faster kernels on them that round differently from the
non-repacked ones. A window must run the same kernels to give the same tokens, but it cannot copy its weights
into anonymous memory: that is memory pressure (the OS cannot reclaim it for other apps) and a streamed window
must stay file-backed.

So each device writes, once, a copy of the GGUF file holding its layers' weights already repacked (patches/0008
maps them as llama.cpp's CPU_REPACK buffers, LLAMA_WINDOW_PLACEMENT_CPU_REPACKED). The repacked form of a
tensor has its exact size, so the copy keeps every offset of the original: the layout, the byte ranges, the
prefetcher and the mapping work on it unchanged. It is page cache (reclaimable), costs disk, not memory, and is
sparse: only the parts a device runs are written.

llama.cpp loads a model from one file, so a GPU layer's weights are read from the copy too, as the model file has
them (raw; the GPU backend copies them into VRAM at load). A layer's bytes in a copy have one form for good: every
process of the machine maps the same copy, and one running a layer on its CPU must never see it rewritten raw
because another loads that layer on a GPU (or the other way round). So each set of GPU layers has a copy of its
own (`-gpu<hash>` in its name), in which those layers are raw and every other layer repacked; a device without GPU
layers uses the plain one.

The repacked bytes come from llama.cpp itself: the missing layers are loaded with repacking on, a few hundred MB
at a time, and every weight it repacked is written out (llama_model_repacked_tensors). So the choice of which
tensors repack, and how, stays llama.cpp's, on this CPU and this build. llama.cpp holds what it repacks in anonymous
memory, so a layer larger than a load's share (a mixture of experts') is loaded once per part of its weights,
llama.cpp told to repack only that part (patches/0024): a build holds at most about `chunk_bytes`, or the largest
weight where that is larger. The copy is named by the model's identity and by the engine (the CPU backend library
and the CPU features it saw), so another build or CPU writes its own.

A node's copy of layers it fetched (store/copy.py) is its own file, not the user's: there the layers are repacked in
place (repack_in_place), and the node keeps one copy on disk. Repacking only moves bits, which engine/unrepack.py
undoes exactly, so the node still hands peers, and its own checks, the file's bytes. The record of which layers
are repacked there, and under which layout, is the caller's (RepackedForms).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from llama_cpp import llama_cpp as _ll

from primaplug.core.errors import EngineError
from primaplug.core.settings import cache_root
from primaplug.engine import _native
from primaplug.engine._filelock import exclusive
from primaplug.engine.layout import (
    INPUT,
    OUTPUT,
    REPACKABLE,
    ModelLayout,
    TensorSpan,
    layer_of_unit,
    unit_tensors,
    units_for,
)
from primaplug.engine.unrepack import RepackLayout, layout_for, repacks, undo_range

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]  # (fraction done, what is being done)
Room = Callable[[], int]  # the memory available now, in bytes

FORMAT = 1  # of the manifest beside each copy
CHUNK_BYTES = 256 << 20  # layers repacked per load while building (default): the anonymous memory a build takes
# the parts of a copy, each written whole: "blk.N" (a CPU layer, repacked), "blk.N.raw" (a GPU layer: the GPU
# backend takes the file's bytes), and the tensors outside layers


def default_dir() -> Path:
    return cache_root() / "repacked"


@functools.cache
def engine_fingerprint() -> str:
    """What decides the repacked bytes: the CPU backend library's code and the CPU features llama.cpp sees."""
    h = hashlib.sha256()
    with open(_native.ggml_cpu_path(), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(_ll.llama_print_system_info() or b"")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class RepackedCopy:
    path: str  # the copy to map instead of the model file
    repacked: frozenset[str]  # names of the tensors stored repacked in it, among those asked for
    repacked_bytes: int
    built_bytes: int  # written by this call (0 when everything was there)


class RepackedForms(Protocol):
    """A file whose CPU layers are repacked in place: for each unit stored repacked, its repacked tensors, each with
    the key of the RepackLayout it was repacked under (a unit that is not there holds the file's bytes)."""

    forms: dict[str, dict[str, str]]
    lock: contextlib.AbstractContextManager[object]  # held while a unit's form changes (readers wait for it)

    def save(self) -> None: ...


def needs_copy(layout: ModelLayout, cpu_layers: Iterable[int], output: bool) -> bool:
    """Whether any weight these CPU layers (or the output layer) run might be repacked."""
    units = units_for(layout, cpu_layers, (), output)
    return any(t.type_name in REPACKABLE for u in units if u != INPUT for t in unit_tensors(layout, u))


def _runs_on_cpu(unit: str) -> bool:
    """A CPU layer or the output layer: the units whose weights llama.cpp may repack."""
    return unit == OUTPUT or (unit.startswith("blk.") and not unit.endswith(".raw"))


def repacked_copy(layout: ModelLayout, cpu_layers: Iterable[int], gpu_layers: Iterable[int] = (), *, output: bool,
                  cache_dir: Path | None = None, progress: Progress | None = None,
                  chunk_bytes: int = CHUNK_BYTES, room: Room | None = None) -> RepackedCopy:
    """The repacked copy of `layout`'s model holding these layers (and the output layer), written first for
    whatever it lacks, `chunk_bytes` of layers at a time (a larger layer in parts of its weights). `room`: the
    memory available now; a build whose largest load would not fit is refused before it starts (EngineError).
    Safe against other processes doing the same (one writes, the others wait)."""
    folder = cache_dir or default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    units = units_for(layout, cpu_layers, gpu_layers, output)
    path = copy_path(layout, gpu_layers, folder)
    with exclusive(path.with_suffix(".lock")):
        manifest = _read_manifest(path, layout)
        missing = [u for u in units if u not in manifest["units"]]
        built = 0
        if missing:
            built = _build(layout, path, manifest, missing, progress or (lambda _f, _w: None), chunk_bytes, room)
    names = frozenset(n for u in units for n in manifest["units"][u])
    sizes = {t.name: t.nbytes for u in units for t in unit_tensors(layout, u)}
    return RepackedCopy(os.fspath(path), names, sum(sizes[n] for n in names), built)


def can_repack_in_place(layout: ModelLayout, cpu_layers: Iterable[int], output: bool) -> bool:
    """Whether every weight of these units this engine may repack can be put back exactly (engine/unrepack.py)."""
    units = [u for u in units_for(layout, cpu_layers, (), output) if _runs_on_cpu(u)]
    return all(layout_for(t) is not None for u in units for t in unit_tensors(layout, u) if repacks(t))


def repack_in_place(layout: ModelLayout, forms: RepackedForms, cpu_layers: Iterable[int],
                    gpu_layers: Iterable[int] = (), *, output: bool, progress: Progress | None = None,
                    chunk_bytes: int = CHUNK_BYTES, room: Room | None = None) -> RepackedCopy:
    """Repack these CPU layers (and the output layer) in `layout`'s own file, and put its GPU layers back as the
    model file has them: the file then serves as its own repacked copy. Only for a file the caller owns and no other
    process maps (a node's fetched copy); can_repack_in_place must hold. The caller's record is saved after each
    change, so that a crash leaves at worst pieces whose hash fails and which are fetched again."""
    units = units_for(layout, cpu_layers, gpu_layers, output)
    fd = os.open(layout.path, os.O_RDWR)
    built = 0
    # a unit in parts holds the lock from its first part's writes to its record (the lock is reentrant):
    # until then its bytes are part repacked, part the file's, and nothing says which
    unit_held = contextlib.ExitStack()
    try:
        for unit in [u[:-4] for u in units if u.endswith(".raw") and u[:-4] in forms.forms]:
            with forms.lock:
                undo_in_place(layout, fd, unit, forms.forms.pop(unit))
                forms.save()
        missing = [u for u in units if _runs_on_cpu(u) and u not in forms.forms]
        total = sum(t.nbytes for u in missing for t in unit_tensors(layout, u))
        keys: dict[str, str] = {}
        loads = list(_loads(layout, missing, chunk_bytes))
        _check_room(layout, loads, room)
        for load in loads:
            (progress or (lambda _f, _w: None))(built / max(total, 1), f"repacking {load.describe()} for this CPU "
                                                                       "in place (once)")
            spans = load.spans(layout)
            if load.only is not None:
                unit_held.enter_context(forms.lock)

            def record(new: dict[str, str], load: _Load = load) -> None:  # under the lock, after the writes
                keys.update(new)
                if not load.completes:
                    return
                os.fsync(fd)
                for u in load.completes:
                    forms.forms[u] = {t.name: keys[t.name] for t in unit_tensors(layout, u) if t.name in keys}
                forms.save()
                keys.clear()

            _repack(layout, load.units, spans, fd, in_place=True, lock=forms.lock, written=record, only=load.only)
            if load.completes:
                unit_held.close()
            built += sum(t.nbytes for t in spans.values())
    finally:
        unit_held.close()
        os.close(fd)
    names = frozenset(n for u in units for n in forms.forms.get(u, ()))
    sizes = {t.name: t.nbytes for u in units for t in unit_tensors(layout, u)}
    return RepackedCopy(layout.path, names, sum(sizes[n] for n in names), built)


def undo_in_place(layout: ModelLayout, fd: int, unit: str, tensors: dict[str, str]) -> None:
    """Put a unit's repacked tensors back as the model file has them (`tensors`: name -> layout key)."""
    for t in unit_tensors(layout, unit):
        key = tensors.get(t.name)
        if key is None:
            continue
        lay = layout_for(t)
        if lay is None or lay.key != key:
            raise EngineError(f"{t.name} was repacked by another engine or CPU; it cannot be put back")
        for o, raw in _undone(t, lay, lambda off, n: _pread_all(fd, off, n)):
            os.pwrite(fd, raw.tobytes(), o)


def _pread_all(fd: int, offset: int, n: int) -> np.ndarray:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise EngineError(f"the model file ended at byte {offset + len(data)}, inside a tensor: is it truncated?")
    return np.frombuffer(data, np.uint8)


def copy_path(layout: ModelLayout, gpu_layers: Iterable[int] = (), folder: Path | None = None) -> Path:
    """Where the copy for a device with these GPU layers lives: one per set of GPU layers (the module's
    docstring says why), the plain one without."""
    gpu = sorted(set(gpu_layers))
    variant = f"-gpu{hashlib.sha256(repr(gpu).encode()).hexdigest()[:8]}" if gpu else ""
    # named after the file itself: a node reads its model through /proc/self/fd/N (node/files.py), the head by name
    return (folder or default_dir()) / f"{Path(os.path.realpath(layout.path)).stem}-{_key(layout)}{variant}.gguf"


def _key(layout: ModelLayout) -> str:
    # the header names the model's shape, not its weights: a file written again (a new quantization under the same
    # name) gets a new modification time, and so a new copy
    mtime = os.stat(layout.path).st_mtime_ns
    return hashlib.sha256(f"{layout.identity}|{mtime}|{engine_fingerprint()}".encode()).hexdigest()[:16]


def _read_manifest(path: Path, layout: ModelLayout) -> dict:
    fresh = {"format": FORMAT, "model": layout.identity, "engine": engine_fingerprint(), "units": {},
             "source": os.path.realpath(layout.path), "mtime": os.stat(layout.path).st_mtime_ns}
    try:
        manifest = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        manifest = None
    valid = (isinstance(manifest, dict) and path.exists() and os.path.getsize(path) == layout.file_size
             and all(manifest.get(k) == fresh[k] for k in ("format", "model", "engine")))
    if not valid:  # none yet, or unreadable: start again (a crash mid-build leaves units out of the manifest)
        with open(path, "wb") as f:
            f.truncate(layout.file_size)  # sparse: only the parts written take disk
            with open(layout.path, "rb") as src:
                f.write(src.read(layout.data_offset))  # metadata and tensor table, as in the original
        manifest = fresh
        _remove_stale(path)
    return manifest


def _remove_stale(current: Path) -> None:
    """Delete the copies of model files that are gone or were written again since. A process still mapping one
    keeps its pages: an unlinked file is freed once unmapped."""
    for manifest_path in current.parent.glob("*.json"):
        copy = manifest_path.with_suffix(".gguf")
        if copy == current:
            continue
        try:
            manifest = json.loads(manifest_path.read_text())
            stale = os.stat(manifest["source"]).st_mtime_ns != manifest["mtime"]
        except FileNotFoundError:
            stale = True
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if stale:
            for p in (copy, manifest_path, copy.with_suffix(".lock")):
                with contextlib.suppress(OSError):
                    p.unlink()


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    os.replace(tmp, path.with_suffix(".json"))


def _build(layout: ModelLayout, path: Path, manifest: dict, missing: list[str], progress: Progress,
           chunk_bytes: int, room: Room | None) -> int:
    total = sum(t.nbytes for u in missing for t in unit_tensors(layout, u))
    free = shutil.disk_usage(path.parent).free
    if total + (64 << 20) > free:
        raise EngineError(
            f"the repacked copy of this device's layers needs {total / 2**30:.2f} GiB in {path.parent}, which has "
            f"{free / 2**30:.2f} GiB free. Free some space, or set PRIMAPLUG_CACHE to a folder on a disk with room")
    loads = list(_loads(layout, missing, chunk_bytes))
    _check_room(layout, loads, room)
    t0, done = time.perf_counter(), 0
    what = _describe(missing)
    log.info("writing the repacked copy of %s to %s (%.0f MiB, once)", what, path, total / 2**20)
    fd_out = os.open(path, os.O_WRONLY)
    fd_in = os.open(layout.path, os.O_RDONLY)
    try:
        repacked: set[str] = set()  # across the parts of a unit loaded in parts
        for load in loads:
            progress(done / max(total, 1), f"repacking {load.describe()} for this CPU into {path.name} (once)")
            spans = load.spans(layout)
            # llama.cpp repacks only what CPU layers and the output layer multiply by; a tied lm_head's repacked
            # copy of the token embedding is reported too, but the file's embedding must stay as it is
            cpu = {t.name: t for u in load.units if _runs_on_cpu(u) for t in unit_tensors(layout, u) if t.name in spans}
            # a load of weights this CPU repacks none of would be a model load for nothing: Gemma 3 270M through a
            # 1 MiB budget on an AVX-512 Xeon was 110 loads of 0.6 s, copying every byte as it is
            if any(repacks(t) for t in cpu.values()):
                repacked.update(_repack(layout, load.units, cpu, fd_out, only=load.only))
            for name, span in spans.items():
                if name not in repacked:
                    _copy_range(fd_in, fd_out, span.offset, span.nbytes)
            os.fsync(fd_out)
            for span in spans.values():  # building is not running: leave memory as it was
                _drop_cache(fd_in, span.offset, span.nbytes)
                _drop_cache(fd_out, span.offset, span.nbytes)
            for u in load.completes:  # a unit in parts is listed once all of them are written
                # a copy's layers never change form (copy_path); a copy written before that rule may list the other
                manifest["units"].pop(u[:-4] if u.endswith(".raw") else f"{u}.raw", None)
                manifest["units"][u] = sorted(t.name for t in unit_tensors(layout, u) if t.name in repacked)
            if load.completes:
                _write_manifest(path, manifest)
                repacked.clear()
            done += sum(s.nbytes for s in spans.values())
    finally:
        os.close(fd_in)
        os.close(fd_out)
    log.info("repacked copy of %s written in %.1f s", what, time.perf_counter() - t0)
    progress(1.0, f"repacked copy of {what} written")
    return total


@dataclass(frozen=True)
class _Load:
    """One load of a build: whole units, or one part of one unit's weights (`only`)."""

    units: list[str]
    only: frozenset[str] | None = None  # the weights of units[0] this load repacks; None: every weight of its units
    completes: tuple[str, ...] = ()  # the units whose every weight is written once this load is

    def spans(self, layout: ModelLayout) -> dict[str, TensorSpan]:
        return {t.name: t for u in self.units for t in unit_tensors(layout, u)
                if self.only is None or t.name in self.only}

    def describe(self) -> str:
        return _describe(self.units) + (f" ({len(self.only)} of its weights)" if self.only is not None else "")


def _loads(layout: ModelLayout, units: list[str], chunk_bytes: int) -> Iterator[_Load]:
    """Units grouped so that each load repacks at most about chunk_bytes; a unit larger than that is loaded in
    parts of its weights (_parts)."""
    chunk: list[str] = []
    size = 0
    for u in units:
        tensors = unit_tensors(layout, u)
        n = sum(t.nbytes for t in tensors)
        if chunk and size + n > chunk_bytes:
            yield _Load(chunk, completes=tuple(chunk))
            chunk, size = [], 0
        parts = _parts(tensors, chunk_bytes) if n > chunk_bytes else []
        if len(parts) > 1:
            yield from (_Load([u], part, (u,) if i == len(parts) - 1 else ()) for i, part in enumerate(parts))
            continue
        chunk.append(u)
        size += n
    if chunk:
        yield _Load(chunk, completes=tuple(chunk))


def _check_room(layout: ModelLayout, loads: list[_Load], room: Room | None) -> None:
    """Refuse, before anything is loaded or written, a build whose largest load would not fit in the memory
    available now: the OS would kill the process, or crowd out the apps people use."""
    if room is None or not loads:
        return

    def need(load: _Load) -> int:
        spans = load.spans(layout)
        return sum(t.nbytes for u in load.units if _runs_on_cpu(u) for t in unit_tensors(layout, u)
                   if t.name in spans and t.type_name in REPACKABLE)

    largest = max(loads, key=need)
    available = room()
    if need(largest) > available:
        weight = max(largest.spans(layout).values(), key=lambda t: t.nbytes)
        raise EngineError(
            f"writing the repacked copy of {largest.describe()} (once) takes {need(largest) / 2**20:.0f} MiB of "
            f"memory at once, and this device has {available / 2**20:.0f} MiB available (a weight is repacked whole: "
            f"the largest here, {weight.name}, is {weight.nbytes / 2**20:.0f} MiB). Free memory on this device, or "
            "give it other layers, or none (--layers)")


def _parts(tensors: list[TensorSpan], chunk_bytes: int) -> list[frozenset[str]]:
    """A unit's weights in file order, in parts of at most chunk_bytes, or of the largest weight where that is
    larger: the memory a part takes is bounded by that weight anyway, and each part costs a load."""
    chunk_bytes = max([chunk_bytes, *(t.nbytes for t in tensors)])
    parts: list[frozenset[str]] = []
    part: list[str] = []
    size = 0
    for t in tensors:
        if part and size + t.nbytes > chunk_bytes:
            parts.append(frozenset(part))
            part, size = [], 0
        part.append(t.name)
        size += t.nbytes
    if part:
        parts.append(frozenset(part))
    return parts


def _repack(layout: ModelLayout, units: list[str], spans: dict[str, TensorSpan], fd_out: int, *,
            in_place: bool = False, lock: contextlib.AbstractContextManager[object] | None = None,
            written: Callable[[dict[str, str]], None] = lambda _keys: None,
            only: frozenset[str] | None = None) -> dict[str, str]:
    """Load these units with llama.cpp's repacking on (of only these weights, where `only` names some) and write
    each weight it repacked into the copy; returns their names, each with its RepackLayout's key when `in_place`
    (each is checked to undo exactly, before any is written over the file's bytes). The writes, and then
    `written(keys)`, happen under `lock`."""
    n_all = layout.n_layer_all
    placement = (ctypes.c_uint8 * (n_all + 1))()
    for u in filter(_runs_on_cpu, units):
        placement[n_all if u == OUTPUT else int(u[4:])] = _native.LLAMA_WINDOW_PLACEMENT_CPU
    if not any(placement):
        return {}  # raw units only
    got: list[tuple[TensorSpan, memoryview]] = []

    def on_tensor(name: bytes, data: int, size: int, _user: object) -> None:
        span = spans.get(name.decode())
        if span is None or span.nbytes != size:  # not ours, or a tied lm_head's copy of the token embedding
            return
        got.append((span, memoryview((ctypes.c_char * size).from_address(data)).cast("B")))

    callback = _native.llama_repacked_tensor_callback(on_tensor)
    ptr = _native.load_for_windows(layout.path, placement, repack=True, purpose="to repack it", repack_only=only,
                                   vocab=False)
    try:
        _native.llama_model_repacked_tensors(ptr, callback, None)
        keys = {span.name: _check_undo(span, mv, fd_out) if in_place else "" for span, mv in got}
        with lock or contextlib.nullcontext():
            for span, mv in got:  # the views live as long as the model
                offset = 0
                while offset < span.nbytes:
                    offset += os.pwrite(fd_out, mv[offset:], span.offset + offset)
            written(keys)
    finally:
        _ll.llama_model_free(ptr)
    return keys


_SLICE = 8 << 20  # bytes undone at a time (whole tiles are read around each slice)


def _undone(span: TensorSpan, lay: RepackLayout, read: Callable[[int, int], Any]) -> Iterator[tuple[int, np.ndarray]]:
    """A repacked tensor's bytes as the model file has them, _SLICE at a time: (file offset, bytes)."""
    for o in range(span.offset, span.end, _SLICE):
        yield o, undo_range(span, lay, read, o, min(span.end, o + _SLICE))


def _check_undo(span: TensorSpan, repacked: memoryview, fd: int) -> str:
    """The key of the layout that undoes this tensor's repacked bytes into the file's, checked on every byte."""
    lay = layout_for(span)
    if lay is None:
        raise EngineError(f"llama.cpp repacked {span.name} ({span.type_name}), which engine/unrepack.py cannot undo")
    data = np.frombuffer(repacked, np.uint8)
    for o, mine in _undone(span, lay, lambda off, n: data[off - span.offset:off - span.offset + n]):
        if not np.array_equal(mine, _pread_all(fd, o, mine.size)):
            raise EngineError(f"{span.name} ({span.type_name}): its repacked bytes do not undo into the file's; "
                              "it is not repacked in place")
    return lay.key


def _copy_range(fd_in: int, fd_out: int, offset: int, n: int) -> None:
    for o in range(offset, offset + n, _SLICE):
        os.pwrite(fd_out, _pread_all(fd_in, o, min(offset + n - o, _SLICE)), o)


def _drop_cache(fd: int, offset: int, n: int) -> None:
    if hasattr(os, "posix_fadvise"):  # not on macOS
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)


def _describe(units: list[str]) -> str:
    layers = sorted({il for u in units if (il := layer_of_unit(u)) is not None})
    parts = []
    if len(layers) == 1:
        parts.append(f"layer {layers[0]}")
    elif layers:
        contiguous = layers[-1] - layers[0] + 1 == len(layers)
        parts.append(f"layers {layers[0]}-{layers[-1]}" if contiguous else
                     f"{len(layers)} layers between {layers[0]} and {layers[-1]}")
    parts += [u for u in units if u in (INPUT, OUTPUT)]
    return ", ".join(parts) or "the model's small tensors"
