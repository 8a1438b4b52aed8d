"""Which byte ranges of a file are in the page cache, and how to drop them.

Works without root: `mincore` over a read-only shared mapping of the file reports the page cache's residency
of those pages (Linux, Android, macOS), and `posix_fadvise(DONTNEED)` drops one file's clean pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)

# void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset);
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_mmap.restype = ctypes.c_void_p

# int munmap(void *addr, size_t length);
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int

# int mincore(void *addr, size_t length, unsigned char *vec);
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_mincore.restype = ctypes.c_int

PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def _check(ok: bool, what: str) -> None:
    if not ok:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} failed: {os.strerror(err)}")


def resident_bytes(path: str | os.PathLike[str], ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes of the (offset, length) ranges of the file that are in memory, counted in whole pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        base = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        _check(base not in (None, _MAP_FAILED), "mmap")
    finally:
        os.close(fd)
    try:
        total = 0
        for offset, length in ranges:
            start = offset // PAGE * PAGE
            end = min(size, offset + length)
            if end <= start:
                continue
            vec = (ctypes.c_ubyte * ((end - start + PAGE - 1) // PAGE))()
            _check(_mincore(base + start, end - start, vec) == 0, "mincore")
            total += sum(v & 1 for v in vec) * PAGE
        return total
    finally:
        _munmap(base, size)


def drop_file_cache(path: str | os.PathLike[str], ranges: Iterable[tuple[int, int]] | None = None) -> None:
    """Ask the kernel to drop the file's clean cached pages (all of them, or every page the ranges touch).

    Ranges are widened to whole pages: the kernel drops only pages that lie entirely inside the range.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in ranges if ranges is not None else [(0, 0)]:
            start = offset // PAGE * PAGE
            end = -(-(offset + length) // PAGE) * PAGE if length else 0
            os.posix_fadvise(fd, start, end - start if length else 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
