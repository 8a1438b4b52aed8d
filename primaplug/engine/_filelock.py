"""One process at a time: an exclusive `flock` on a lock file, for what the engine writes once into the cache and
other processes may write at the same moment (the engine build, ensure.py; repacked copies, repacked.py).
Standard library only: ensure.py runs before llama_cpp is imported."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold `lock` (created, with its folder, where missing) exclusively for the block; another process waits."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
