#!/usr/bin/env python3
"""How fast a node's ways of paging in a range come in from a throttled disk, and why (issue 32, needs root:
cgroups and dropping the page cache).

    sudo .venv/bin/python benchmarks/disk_reads.py [--mib 192] [--disk-mbps 125] [--memory-mib 256]

A file of --mib random bytes is written once beside the testbed's cache (the disk the model copies live on). Each
way of reading it runs in a fresh child process after the page cache is dropped, under four conditions: no cap;
the disk capped at --disk-mbps (the testbed's blkio/io throttle); memory capped at --memory-mib (the whole range
fits); both. The ways:
- pread in requests of 4 KiB, 64 KiB, 1 MiB and 4 MiB, one thread; 1 MiB from 4 threads (memory/experts.py's
  reads); 16 MiB, one thread;
- the file mapped: MADV_POPULATE_READ over the range under MADV_RANDOM (the prefetcher's default: a page per
  request), under MADV_SEQUENTIAL (read-ahead), and touching a byte a page under MADV_NORMAL (page faults with
  the kernel's read-ahead).
Also, for each condition, what the block layer saw: requests and bytes read (/sys/block/<dev>/stat), so the
average request size tells page-sized reads from merged ones. Writes benchmarks/results/disk_reads.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.testbed.cgroups import Caps, Cgroup, block_device, drop_caches  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path.home() / ".cache" / "primaplug" / "bench"
MiB = 1 << 20
PAGE = mmap.PAGESIZE
MADV_SEQUENTIAL, MADV_RANDOM, MADV_POPULATE_READ = 2, 1, 22

WAYS = ("pread-4K", "pread-64K", "pread-1M", "pread-4M", "pread-16M", "pread-1M-x4", "populate-random",
        "populate-sequential", "fault-normal")


def read(way: str, path: str, length: int) -> None:
    """One way of bringing [0, length) of the file into the page cache (the child's job): `pread`s through
    primaplug's own loop (memory/advice.py: read_range, as the expert reads use it), or the file mapped."""
    from primaplug.memory.advice import read_range

    fd = os.open(path, os.O_RDONLY)
    try:
        if way.startswith("pread-") and way.endswith("-x4"):
            part = length // 4
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: read_range(fd, memoryview(bytearray(MiB)), i * part, part), range(4)))
        elif way.startswith("pread-"):
            size = {"4K": 4096, "64K": 64 * 1024, "1M": MiB, "4M": 4 * MiB, "16M": 16 * MiB}[way.split("-")[1]]
            read_range(fd, memoryview(bytearray(size)), 0, length)
        else:
            _read_mapped(way, fd, length)
    finally:
        os.close(fd)


def _read_mapped(way: str, fd: int, length: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    if way == "fault-normal":
        for off in range(0, length, PAGE):
            ctypes.string_at(addr + off, 1)
    else:
        libc.madvise(addr, length, MADV_RANDOM if way == "populate-random" else MADV_SEQUENTIAL)
        if libc.madvise(addr, length, MADV_POPULATE_READ) != 0:
            raise OSError(ctypes.get_errno(), "MADV_POPULATE_READ")


def _disk_stat(dev: str) -> tuple[int, int]:
    """(read requests completed, bytes read) of the block device MAJ:MIN, from its sysfs stat."""
    sys_dev = Path("/sys/dev/block") / dev
    stat = sys_dev / "stat"
    fields = stat.read_text().split()
    return int(fields[0]), int(fields[2]) * 512


def run_one(way: str, path: Path, length: int, caps: Caps, disk: str) -> dict[str, Any]:
    drop_caches()
    group = Cgroup(f"reads-{os.getpid()}", caps, disk).create() if (caps.read_bps or caps.memory_bytes) else None
    try:
        n0, b0 = _disk_stat(disk)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--child", way, str(path), str(length)], check=True,
                       preexec_fn=group.preexec if group else None)
        dt = time.perf_counter() - t0
        n1, b1 = _disk_stat(disk)
    finally:
        if group:
            group.remove()
    requests, nbytes = n1 - n0, b1 - b0
    return {"way": way, "seconds": round(dt, 3), "mb_per_s": round(length / dt / 1e6, 1), "requests": requests,
            "bytes_read": nbytes, "kib_per_request": round(nbytes / max(requests, 1) / 1024, 1)}


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        read(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=192, help="bytes read per run, MiB")
    ap.add_argument("--disk-mbps", type=float, default=125.0, help="the throttled condition's disk cap, MB/s")
    ap.add_argument("--memory-mib", type=int, default=256, help="the memory-capped condition's cap, MiB")
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of " + ", ".join(WAYS))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("disk_reads: needs root (cgroups, dropping the page cache): sudo .venv/bin/python "
              "benchmarks/disk_reads.py", file=sys.stderr)
        return 2
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"reads-{args.mib}M.bin"
    length = args.mib * MiB
    if not path.exists() or path.stat().st_size != length:
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
            f.flush()
            os.fsync(f.fileno())
    disk = block_device(path)
    conditions = {
        "uncapped": Caps(),
        "disk capped": Caps(read_bps=int(args.disk_mbps * 1e6)),
        "memory capped": Caps(memory_bytes=args.memory_mib * MiB),
        "both": Caps(read_bps=int(args.disk_mbps * 1e6), memory_bytes=args.memory_mib * MiB),
    }
    results: dict[str, list[dict[str, Any]]] = {}
    for name, caps in conditions.items():
        results[name] = []
        for way in args.ways.split(","):
            r = run_one(way, path, length, caps, disk)
            results[name].append(r)
            print(f"{name:14s} {way:20s} {r['mb_per_s']:8.1f} MB/s  {r['requests']:7d} requests, "
                  f"{r['kib_per_request']:7.1f} KiB each", flush=True)
    out = {"host": platform.node(), "kernel": platform.release(), "mib": args.mib, "disk_mbps": args.disk_mbps,
           "memory_mib": args.memory_mib, "disk": disk, "results": results}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "disk_reads.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
