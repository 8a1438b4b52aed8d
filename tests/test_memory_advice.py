"""Advisor.prefetch with read-ahead: the range comes in whole, nothing past it, and the mapping is random again."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

from primaplug.memory.advice import Advisor
from primaplug.memory.residency import resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ is Linux's")
MIB = 1 << 20


def _vm_flags(path: Path) -> list[str]:
    """VmFlags of every mapping of the file in this process (smaps: `rr` random read, `sr` sequential read)."""
    flags, ours = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(maxsplit=1)[0] and not line.split(maxsplit=1)[0].endswith(":"):
            ours = line.rstrip().endswith(str(path))
        elif ours and line.startswith("VmFlags:"):
            flags.append(line)
    return flags


@pytest.mark.parametrize("sequential", [True, False])
def test_prefetch_brings_in_the_range_and_no_more(tmp_path: Path, sequential: bool) -> None:
    path = tmp_path / "weights.bin"
    with path.open("wb") as f:
        f.write(os.urandom(96 * MIB))
        f.flush()
        os.fsync(f.fileno())  # written back, so that it can leave the page cache
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
        assert resident_bytes(path, [(0, 96 * MIB)]) < MIB, "the file stayed cached; cannot measure"
        advisor = Advisor(str(path))
        assert advisor.populate, "no mapping found: the test maps the file itself"
        want = [(8 * MIB, 20 * MIB), (30 * MIB, 10 * MIB)]
        assert advisor.prefetch(want, sequential=sequential) == 30 * MIB
        assert resident_bytes(path, want) == 30 * MIB
        # read-ahead is advised on the ranges only, so it does not run on through the file
        beyond = resident_bytes(path, [(40 * MIB, 56 * MIB)])
        assert beyond <= 64 * 1024, f"{beyond} bytes read past the prefetched ranges"
        flags = _vm_flags(path)
        assert flags and all(" rr" in f and " sr" not in f for f in flags), flags  # random again, everywhere
        advisor.close()
    finally:
        mapping.close()
        os.close(fd)
