"""Throughputs of a device's memory and disk: T^cpu (RAM -> registers), the KV-cache copy, and s^disk.

Each figure is the median of a few passes over buffers larger than any CPU cache, so it is RAM or disk that is
timed, not a cache. Disk reads bypass the page cache: its pages of the file are dropped first (posix_fadvise
DONTNEED on Linux and Android, which needs no root), or the file is read with F_NOCACHE (macOS); when dropping
did not work (a tmpfs, say) the file is read with O_DIRECT, and when that fails too the result is marked.
"""

from __future__ import annotations

import logging
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from primaplug.memory.residency import drop_file_cache, resident_bytes

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
_F_NOCACHE = 48  # fcntl.h on macOS (Python's fcntl module names it only on some versions)


def _unmapped_after(n: int, dtype: type[np.generic]) -> np.ndarray:
    """n elements in an anonymous mapping of their own, unmapped as soon as the array and its views are gone.

    From malloc, a test buffer of a small device stays in the process for good: glibc's threshold for mapping a
    block rises to the size of the last mapped block freed (up to 32 MiB), so the second buffer of that size comes
    from a thread's arena, whose top malloc_trim never returns. Profiling a phone emulated at 145 MiB left 53 MiB
    resident in its node that way (benchmarks/results/LOG.md, 2026-11-28 night)."""
    m = mmap.mmap(-1, n * np.dtype(dtype).itemsize)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy asks of its own large buffers: huge pages where the OS gives them
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=dtype)


def _median_rate(nbytes: int, seconds: list[float]) -> float:
    return nbytes / max(statistics.median(seconds), 1e-9)


def memory_read_bps(size_bytes: int = 256 << 20, *, threads: int = 1, repeats: int = 5,
                    clock: Clock = time.perf_counter) -> float:
    """RAM -> register read throughput: every thread ORs its slice of a buffer together (numpy releases the GIL in
    reductions, so the threads read in parallel as llama.cpp's compute threads do)."""
    words = _unmapped_after(max(1, size_bytes // 8), np.uint64)
    words.fill(1)
    chunks = np.array_split(words, max(1, threads))
    times = []
    with ThreadPoolExecutor(len(chunks)) as pool:
        list(pool.map(np.bitwise_or.reduce, chunks))  # first touch: page faults, not reads
        for _ in range(repeats):
            t0 = clock()
            list(pool.map(np.bitwise_or.reduce, chunks))
            times.append(clock() - t0)
    return _median_rate(words.nbytes, times)


def copy_bps(size_bytes: int = 64 << 20, *, repeats: int = 5, clock: Clock = time.perf_counter) -> float:
    """Copy throughput within RAM, one thread, in bytes written per second: how fast new keys and values go into
    the F16 KV cache (llama.cpp stores one token's rows of a layer from one thread)."""
    src = _unmapped_after(max(1, size_bytes // 2), np.float16)
    src.fill(1)
    dst = _unmapped_after(len(src), np.float16)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = clock()
        np.copyto(dst, src)
        times.append(clock() - t0)
    return _median_rate(dst.nbytes, times)


# --- disk --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskSpeeds:
    seq_bps: float
    rand_bps: float
    cache_bypassed: bool  # False: the page cache could not be bypassed, so these are memory speeds


def write_test_file(path: Path, size_bytes: int) -> Path:
    """Random (incompressible) bytes, written and synced, so that reading them back must come from the disk."""
    rng = np.random.default_rng(0)
    chunk = 16 << 20
    with open(path, "wb") as f:
        _no_cache(f.fileno())
        for off in range(0, size_bytes, chunk):
            f.write(rng.integers(0, 256, size=min(chunk, size_bytes - off), dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


def random_reads(size_bytes: int, total_bytes: int, seed: int = 0) -> list[tuple[int, int]]:
    """(offset, length) pairs: lengths log-uniform over 4 KiB..1 MiB (what page faults with read-ahead ask for),
    offsets 4 KiB-aligned and uniform over the file, until total_bytes are read."""
    rng = np.random.default_rng(seed)
    reads: list[tuple[int, int]] = []
    done = 0
    while done < total_bytes:
        length = min(4096 << int(rng.integers(0, 9)), size_bytes)
        offset = int(rng.integers(0, max(1, (size_bytes - length) // 4096 + 1))) * 4096
        reads.append((offset, length))
        done += length
    return reads


def _no_cache(fd: int) -> None:
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1)


def _open_uncached(path: Path, direct: bool) -> int:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
    _no_cache(fd)
    return fd


def _drop(path: Path, span: int) -> bool:
    """Drop the file's first `span` bytes from the page cache; True when none of them is left resident."""
    if not hasattr(os, "posix_fadvise"):
        return sys.platform == "darwin"  # F_NOCACHE reads bypass the cache instead
    drop_file_cache(path, [(0, span)])
    return resident_bytes(path, [(0, span)]) <= span // 100


def _timed_reads(path: Path, reads: list[tuple[int, int]], direct: bool, clock: Clock) -> float:
    size = max(n for _, n in reads)
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    fd = _open_uncached(path, direct)
    try:
        t0 = clock()
        for offset, length in reads:
            os.preadv(fd, [view[:length]], offset)
        return clock() - t0
    finally:
        os.close(fd)
        view.release()
        buf.close()


def disk_read_speeds(path: Path, *, span: int | None = None, seq_block: int = 1 << 20, rand_total: int = 64 << 20,
                     repeats: int = 2, clock: Clock = time.perf_counter) -> DiskSpeeds:
    """Sequential and random read throughput of the file's first `span` bytes with the page cache bypassed."""
    span = min(span or os.path.getsize(path), os.path.getsize(path))
    span -= span % 4096
    seq = [(off, min(seq_block, span - off)) for off in range(0, span, seq_block)]
    rand = random_reads(span, min(rand_total, span))
    bypassed = _drop(path, span)
    direct = False
    if not bypassed and hasattr(os, "O_DIRECT"):
        try:
            _timed_reads(path, rand[:1], True, clock)
            direct = bypassed = True
        except OSError:
            pass
    if not bypassed:
        logger.warning("cannot bypass the page cache for %s: its disk figures are memory speeds", path)
    seq_times, rand_times = [], []
    for _ in range(repeats):
        _drop(path, span)
        seq_times.append(_timed_reads(path, seq, direct, clock))
        _drop(path, span)
        rand_times.append(_timed_reads(path, rand, direct, clock))
    _drop(path, span)
    return DiskSpeeds(_median_rate(span, seq_times), _median_rate(sum(n for _, n in rand), rand_times), bypassed)
