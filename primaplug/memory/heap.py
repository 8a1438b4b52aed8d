"""The process's own heap: giving back what it frees. glibc's malloc keeps freed memory for reuse, which on a small
device is memory the apps people use do not get back.

Two habits of glibc do it (neither applies to macOS or Android's allocators, where these calls do nothing):
- the threshold above which a block gets a mapping of its own, freed to the OS when the block is, rises to the size
  of the last such block freed (up to 32 MiB), so that blocks of that size then come from the heap and stay there;
- a thread's heap keeps its free top, which malloc_trim does not return (it returns whole free pages inside it).
"""

from __future__ import annotations

from primaplug.memory.residency import _libc

M_MMAP_THRESHOLD = -3  # malloc.h's mallopt parameter
MMAP_THRESHOLD = 128 << 10  # glibc's own default, fixed: every larger block is mapped, and unmapped when freed


def map_large_blocks() -> bool:
    """Keep every block above 128 KiB in a mapping of its own, for good (the threshold no longer rises): a node's
    profile of the W1 model in a thread, then a trim, left 7 MiB more anonymous memory with the rising threshold, 5-6
    with it fixed (a one-off on the 2-core machine, benchmarks/results/LOG.md). It changes the allocator for the whole
    process: a node's (`primaplug node`), and a head's once it connects to its nodes, even inside a user's program,
    since a ring's messages are such blocks, and libzmq's I/O thread allocates the ones that arrive: that thread's heap
    kept its free top (the second habit above). False where there is no glibc."""
    mallopt = getattr(_libc, "mallopt", None)
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS: llama.cpp's buffers of a large context or batch stay in the
    process's RSS after they are freed, by 50-100 MiB on Gemma 3 270M, and the device's owner gets that memory back
    only when the process releases it; a prompt's temporaries, a profile's calibration likewise. About 0.1 ms once
    little is free."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
