"""Which byte ranges of a file are in the page cache, and how to drop them.

Works without root: `mincore` over a read-only shared mapping of the file reports the page cache's residency
of those pages (Linux, Android, macOS); `posix_fadvise(DONTNEED)` drops one file's clean pages, and on macOS, whose
Python has no posix_fadvise, `msync(MS_INVALIDATE)` does (docs/platforms.md, "Paging advice per OS").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from primaplug.memory.advice import Libc

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


def drop_file_cache(path: str | os.PathLike[str], ranges: Iterable[tuple[int, int]] | None = None, *,
                    platform: str | None = None, libc: Libc | None = None) -> None:
    """Ask the kernel to drop the file's clean cached pages (all of them, or every page the ranges touch).

    Linux and Android: `posix_fadvise(DONTNEED)`, which leaves the pages a process maps. macOS: the paging advisor's
    release (memory/advice.py), `msync(MS_INVALIDATE)` on a mapping of the file of its own, which drops the clean
    pages from the unified buffer cache and so unmaps them from every mapping too; pages something wired stay.
    `platform` and `libc` pick the calls as advice.Advisor's do (default: this platform's). Ranges are widened to
    whole pages: the kernel drops only pages that lie entirely inside the range. OSError where nothing could drop
    them: no posix_fadvise (outside macOS), or on macOS a file that could not be mapped, or a failed msync.
    """
    from primaplug.memory.advice import Advisor, _pages, paging_platform  # advice builds on this module

    if (platform or paging_platform()) == "darwin":
        advisor = Advisor(os.fspath(path), platform="darwin", libc=libc)
        try:
            spans = [(0, advisor.size)] if ranges is None else list(ranges)
            want = sum(_pages(offset, length, advisor.size)[1] for offset, length in spans)
            if advisor.release(spans) < want:
                raise OSError(errno.ENOTSUP, f"cannot drop {os.fspath(path)} from the unified buffer cache: the file "
                                             "could not be mapped for msync(MS_INVALIDATE)")
        finally:
            advisor.close()
        return
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        raise OSError(errno.ENOTSUP, f"cannot drop {os.fspath(path)} from the page cache: this Python has no "
                                     "os.posix_fadvise")
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in ranges if ranges is not None else [(0, 0)]:
            start = offset // PAGE * PAGE
            end = -(-(offset + length) // PAGE) * PAGE if length else 0
            fadvise(fd, start, end - start if length else 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
