"""Paging advice over a model file's byte ranges: populate (prefetch) and release, per platform.

Linux and Android: prefetch and release act on llama.cpp's own mapping of the file, found in /proc/self/maps, so
that populating fills its page tables (MADV_POPULATE_READ) and releasing unmaps its pages (MADV_DONTNEED) before
the file range is dropped from the page cache (posix_fadvise DONTNEED). Kernels before 5.14 (most Android phones)
have no MADV_POPULATE_READ: the first refusal switches prefetch to reading the range.

macOS has neither /proc/self/maps, MADV_POPULATE_READ nor posix_fadvise. Prefetch reads the range (pread), which
fills the unified buffer cache that llama.cpp's mapping pages from, with read-ahead turned off for this file
(F_RDAHEAD) so that nothing past the range comes in; release calls msync(MS_INVALIDATE) on a mapping of the file
of its own, which drops the range's clean pages from that cache, llama.cpp's mapping included (xnu flushes the
pages of the file's VM object; `vmtouch -e` evicts files this way). `mode` and `release_mode` say which is used.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from primaplug.memory.residency import _MAP_FAILED, PAGE, _libc, _mmap, _munmap
from primaplug.memory.system import linux_kernel

log = logging.getLogger(__name__)

MADV_RANDOM = 1  # the same on Linux and macOS
MADV_SEQUENTIAL = 2
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+; macOS has no such advice
EINVAL = 22
MS_INVALIDATE = 0x2  # <sys/mman.h> on macOS
F_RDAHEAD = 45  # <sys/fcntl.h> on macOS: read-ahead on (1) or off (0) for one descriptor

READ_CHUNK = 1 << 20


# int madvise(void *addr, size_t length, int advice);
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int

# int msync(void *addr, size_t length, int flags);
_msync = _libc.msync
_msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_msync.restype = ctypes.c_int


class Libc:
    """The C calls the Advisor makes, each returning the C result (tests hand in a fake). mmap and munmap are
    residency.py's."""

    def madvise(self, addr: int, length: int, advice: int) -> int:
        return _madvise(addr, length, advice)

    def mmap_shared(self, fd: int, length: int) -> int | None:
        """A read-only shared mapping of the whole file: its address, or None."""
        addr = _mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        return None if addr in (None, _MAP_FAILED) else addr

    def munmap(self, addr: int, length: int) -> int:
        return _munmap(addr, length)

    def msync(self, addr: int, length: int, flags: int) -> int:
        return _msync(addr, length, flags)

    def fcntl(self, fd: int, cmd: int, arg: int) -> int:
        try:  # the stdlib's: fcntl is variadic, which ctypes cannot call portably (arm64 macOS)
            return fcntl.fcntl(fd, cmd, arg)
        except OSError:
            return -1

    def errno(self) -> int:
        return ctypes.get_errno()


def paging_platform(name: str | None = None) -> str:
    """"linux" (Linux, and Android, which Python 3.13+ calls "android"), "darwin", or "other"; default this one."""
    name = name or sys.platform
    if linux_kernel(name):
        return "linux"
    return "darwin" if name == "darwin" else "other"


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


def _pread_into(fd: int, view: memoryview, pos: int) -> int:
    """Read into `view` at file offset `pos`: os.preadv where it exists (macOS 11+ too), else os.pread."""
    preadv = getattr(os, "preadv", None)
    if preadv is not None:
        try:
            return preadv(fd, [view], pos)
        except NotImplementedError:  # a macOS build of Python running on macOS 10.x
            pass
    data = os.pread(fd, len(view), pos)
    view[: len(data)] = data
    return len(data)


def read_range(fd: int, buf: memoryview, start: int, length: int) -> int:
    """Read [start, start + length) of a file through `buf`, as large reads as it holds (into the page cache, the
    data itself unused); returns the bytes read (fewer at the end of the file)."""
    pos, end = start, start + length
    while pos < end:
        got = _pread_into(fd, buf[: min(len(buf), end - pos)], pos)
        if got <= 0:
            break
        pos += got
    return pos - start


class Advisor:
    """Prefetch and release ranges of one model file for the process that maps it.

    `platform` ("linux", "darwin" or "other"; default this one, paging_platform()) and `libc` (Libc) pick the
    calls, so that each platform's path runs anywhere in tests."""

    def __init__(self, path: str, *, platform: str | None = None, libc: Libc | None = None) -> None:
        self.path = path
        self.platform = platform or paging_platform()
        self.libc = libc or Libc()
        self.size = os.path.getsize(path)
        self.fd = os.open(path, os.O_RDONLY)
        self._buf = bytearray(READ_CHUNK)
        self._own: int | None = None  # macOS: our mapping of the file, for msync
        self._fadvise = getattr(os, "posix_fadvise", None)
        self.mapping: list[tuple[int, int, int]] = []
        self.populate = False
        self.readahead_bytes = 2 * readahead_kb(path) * 1024
        if self.platform == "linux":
            self.mapping = find_mapping(path)
            self.populate = bool(self.mapping)
            self.mode = ("madvise(MADV_POPULATE_READ) on llama.cpp's mapping" if self.populate
                         else "pread of the range into the page cache")
            self.release_mode = ("madvise(MADV_DONTNEED) + posix_fadvise(DONTNEED)" if self.mapping
                                 else "posix_fadvise(DONTNEED) only (mapped pages stay)")
            for addr, _, n in self.mapping:  # no readahead around faults: the prefetcher reads windows
                self.libc.madvise(addr, n, MADV_RANDOM)
        elif self.platform == "darwin":
            rdahead_off = self.libc.fcntl(self.fd, F_RDAHEAD, 0) == 0
            self.mode = "pread of the range into the unified buffer cache" + (
                " (read-ahead off for this file: F_RDAHEAD)" if rdahead_off else " (read-ahead on)")
            self._own = self.libc.mmap_shared(self.fd, self.size) if self.size else None
            self.release_mode = ("msync(MS_INVALIDATE) on a mapping of the file: drops the range's clean pages "
                                 "from the unified buffer cache, llama.cpp's mapping included"
                                 if self._own is not None else "none (the file could not be mapped)")
        else:
            self.mode = "pread of the range into the page cache"
            self.release_mode = ("posix_fadvise(DONTNEED) only (mapped pages stay)" if self._fadvise
                                 else "none (this OS has no call to drop file pages)")
        if self._fadvise is None and self.platform == "linux":
            self.release_mode = "madvise(MADV_DONTNEED) only (no posix_fadvise here)"

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
                    self.libc.madvise(addr, ahead, MADV_SEQUENTIAL)
                ok = self._populate(addr, n_bytes)
                if ahead:
                    self.libc.madvise(addr, ahead, MADV_RANDOM)
                pos += n_bytes
                if not ok:
                    self._read(start, length)
                    break
            if not pieces:
                self._read(start, length)
            done += length
        return done

    def _populate(self, addr: int, n_bytes: int) -> bool:
        if self.libc.madvise(addr, n_bytes, MADV_POPULATE_READ) != 0 and self.libc.errno() == EINVAL:
            self.populate = False  # kernel older than 5.14: read instead
            self.mode = "pread of the range into the page cache (no MADV_POPULATE_READ)"
            log.info("prefetch falls back to reading: this kernel has no MADV_POPULATE_READ")
            return False
        return True

    def _read(self, start: int, length: int) -> None:
        read_range(self.fd, memoryview(self._buf), start, length)

    def release(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Unmap and drop the ranges' pages, as far as this platform can; returns the bytes released."""
        done = 0
        for off, n in ranges:
            start, length = _pages(off, n, self.size)
            if not length:
                continue
            for addr, n_bytes in _mapped(self.mapping, start, length):
                self.libc.madvise(addr, n_bytes, MADV_DONTNEED)
            if self._own is not None:
                if self.libc.msync(self._own + start, length, MS_INVALIDATE) != 0:
                    err = self.libc.errno()
                    raise OSError(err, f"msync(MS_INVALIDATE) of {self.path} failed: {os.strerror(err)}")
            elif self._fadvise is not None:
                self._fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)
            elif not self.mapping:
                continue  # nothing could be dropped: count nothing
            done += length
        return done

    def close(self) -> None:
        if self._own is not None:
            self.libc.munmap(self._own, self.size)
            self._own = None
        os.close(self.fd)
