"""The process's own heap: giving back what it frees. glibc's malloc keeps freed memory for reuse, which on a small
device is memory the apps people use do not get back.

Two habits of glibc do it (neither applies to macOS or Android's allocators, where these calls do nothing):
- the threshold above which a block gets a mapping of its own, freed to the OS when the block is, rises to the size
  of the last such block freed (up to 32 MiB), so that blocks of that size then come from the heap and stay there;
- a thread's heap keeps its free top, which malloc_trim does not return (it returns whole free pages inside it).
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # malloc.h's mallopt parameter
MMAP_THRESHOLD = 128 << 10  # glibc's own default, fixed: every larger block is mapped, and unmapped when freed


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def map_large_blocks() -> bool:
    """Keep every block above 128 KiB in a mapping of its own, for good (the threshold no longer rises): a node's
    profile in a thread left 34 MiB of anonymous memory after trimming with the rising threshold, 28 with it fixed
    (the W1 model's node, a one-off on the 2-core machine). For a process of its own (`primaplug node`): it changes
    the allocator for the whole process. False where there is no glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS: llama.cpp's buffers of a large context or batch stay in the
    process's RSS after they are freed, by 50-100 MiB on Gemma 3 270M, and the device's owner gets that memory back
    only when the process releases it; a prompt's temporaries, a profile's calibration likewise. About 0.1 ms once
    little is free."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
