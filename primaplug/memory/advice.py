"""Paging advice over a model file's byte ranges: populate (prefetch) and release, per platform.

Prefetch and release act on llama.cpp's own mapping of the file, found in /proc/self/maps (Linux, Android), so
that populating fills its page tables and releasing unmaps its pages before the file range is dropped from the
page cache. Where that mapping cannot be found (macOS), prefetch reads the range (which fills the page cache)
and release can only drop what no mapping holds. `mode` says which is in use.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from primaplug.memory.residency import PAGE, _libc

log = logging.getLogger(__name__)

MADV_RANDOM = 1
MADV_SEQUENTIAL = 2
MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+
EINVAL = 22

# int madvise(void *addr, size_t length, int advice);
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int

READ_CHUNK = 1 << 20


def find_mapping(path: str) -> list[tuple[int, int, int]]:
    """This process's mappings of the file as (address, file offset, length), or [] where none is found.

    llama.cpp maps the whole file, then unmaps the parts before the first and after the last tensor it uses,
    so its mapping usually starts past offset 0 and may come in pieces.
    """
    real = os.path.realpath(path)
    regions = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    regions.append((lo, int(parts[2], 16), hi - lo))
    except OSError:
        return []
    return regions


def _mapped(regions: list[tuple[int, int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The (address, length) pieces of file range [start, start + length) that the regions map."""
    out = []
    for addr, off, n in regions:
        lo, hi = max(start, off), min(start + length, off + n)
        if hi > lo:
            out.append((addr + lo - off, hi - lo))
    return out


def readahead_kb(path: str, default: int = 128) -> int:
    """The read-ahead size of the disk holding `path` (Linux: /sys/class/bdi), else `default` (the kernel's)."""
    dev = os.stat(path).st_dev
    try:
        return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())
    except (OSError, ValueError):
        return default


def _pages(offset: int, length: int, limit: int) -> tuple[int, int]:
    start = offset // PAGE * PAGE
    end = min(limit, -(-(offset + length) // PAGE) * PAGE)
    return start, max(0, end - start)


class Advisor:
    """Prefetch and release ranges of one model file for the process that maps it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = os.path.getsize(path)
        self.fd = os.open(path, os.O_RDONLY)
        self.mapping = find_mapping(path)
        self.populate = bool(self.mapping) and sys.platform.startswith("linux")
        self.mode = ("madvise(MADV_POPULATE_READ) on llama.cpp's mapping" if self.populate
                     else "pread of the range into the page cache")
        self.release_mode = ("madvise(MADV_DONTNEED) + posix_fadvise(DONTNEED)" if self.mapping
                             else "posix_fadvise(DONTNEED) only (mapped pages stay)")
        self.readahead_bytes = 2 * readahead_kb(path) * 1024
        for addr, _, n in self.mapping:  # no readahead around faults: the prefetcher reads windows
            _madvise(addr, n, MADV_RANDOM)
        self._buf = bytearray(READ_CHUNK)

    def prefetch(self, ranges: Iterable[tuple[int, int]], *, sequential: bool = False) -> int:
        """Bring the ranges into memory; returns the bytes asked for. Blocks (call it from a thread).

        `sequential` lets the kernel read ahead in large requests while the ranges are populated (advised
        MADV_SEQUENTIAL, then MADV_RANDOM again). Under MADV_RANDOM populating reads one page per request, which
        held prefetch below a throttled disk's rate (docs/memory.md). Read-ahead runs up to two read-ahead
        windows past the page that started it, so the prefetch's last `readahead_bytes` are read page by page:
        it never brings in what was not asked for, which would go over the node's budget.
        """
        spans = [_pages(off, n, self.size) for off, n in ranges]
        ahead_until = sum(n for _, n in spans) - self.readahead_bytes if sequential else 0
        done = 0
        for start, length in spans:
            pieces = _mapped(self.mapping, start, length) if self.populate else []
            pos = done
            for addr, n_bytes in pieces:
                ahead = max(0, min(n_bytes, ahead_until - pos)) // PAGE * PAGE
                if ahead:
                    _madvise(addr, ahead, MADV_SEQUENTIAL)
                ok = self._populate(addr, n_bytes)
                if ahead:
                    _madvise(addr, ahead, MADV_RANDOM)
                pos += n_bytes
                if not ok:
                    self._read(start, length)
                    break
            if not pieces:
                self._read(start, length)
            done += length
        return done

    def _populate(self, addr: int, n_bytes: int) -> bool:
        if _madvise(addr, n_bytes, MADV_POPULATE_READ) != 0 and ctypes.get_errno() == EINVAL:
            self.populate = False  # kernel older than 5.14: read instead
            self.mode = "pread of the range into the page cache (no MADV_POPULATE_READ)"
            log.info("prefetch falls back to reading: this kernel has no MADV_POPULATE_READ")
            return False
        return True

    def _read(self, start: int, length: int) -> None:
        view = memoryview(self._buf)
        pos, end = start, start + length
        while pos < end:
            got = os.preadv(self.fd, [view[: min(READ_CHUNK, end - pos)]], pos)
            if got <= 0:
                break
            pos += got

    def release(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Unmap and drop the ranges' pages; returns the bytes released."""
        done = 0
        for off, n in ranges:
            start, length = _pages(off, n, self.size)
            for addr, n_bytes in _mapped(self.mapping, start, length):
                _madvise(addr, n_bytes, MADV_DONTNEED)
            os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)
            done += length
        return done

    def close(self) -> None:
        os.close(self.fd)
