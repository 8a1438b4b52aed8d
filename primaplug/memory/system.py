"""Memory as the OS gives it to this process: available bytes (cgroup-aware), total, and major faults."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class MemoryView:
    total_bytes: int  # the cgroup's limit when inside one, else physical memory
    available_bytes: int
    source: str  # "cgroup v2", "cgroup v1" or "system"

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.available_bytes

    def pressure_since(self, used_before: int) -> float:
        """Memory pressure as the paper defines it: the drop in available memory since `used_before` was
        measured, over total memory (the cgroup's limit inside one)."""
        return max(0.0, (self.used_bytes - used_before) / self.total_bytes)


# read one file by absolute path; None when it does not exist or cannot be read
Reader = Callable[[str], "str | None"]

# cgroup v1 writes "no limit" as the largest page-aligned 63-bit value; anything above physical memory is no limit
_V1_NO_LIMIT = 1 << 60


def read_file(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def file_cache_bytes(stat_text: str) -> int:
    """Page cache (active and inactive file pages) in a cgroup's memory.stat (v1: total_* with the children,
    v2: plain names)."""
    fields = dict(line.split() for line in stat_text.splitlines() if line.count(" ") == 1)
    return sum(int(fields.get("total_" + name, fields.get(name, 0))) for name in ("active_file", "inactive_file"))


def cgroup_available(limit: int, usage: int, stat_text: str) -> int:
    """What a cgroup can still use: its limit less what it uses, counting page cache as available (the kernel
    drops clean file pages before it fails an allocation), as MemAvailable does outside a cgroup. So a node's
    mapped weights are not pressure, its KV cache and buffers are: the paper's definition of memory pressure."""
    return max(0, limit - (usage - file_cache_bytes(stat_text)))


def cgroup_memory(proc_self_cgroup: str, read: Reader, physical: int) -> tuple[int, int, str] | None:
    """(limit, available, "cgroup v1"/"cgroup v2") of the tightest memory limit on this process, or None.

    A limit set on any ancestor binds as well, so the process's cgroup and every ancestor up to the mount's root
    are checked. Available is `cgroup_available`: page cache counts as available."""
    best: tuple[int, int, str] | None = None
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            mounts, limit_name, usage_name, source = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), "memory.max", \
                "memory.current", "cgroup v2"
        elif "memory" in controllers.split(","):
            mounts, limit_name, usage_name, source = ("/sys/fs/cgroup/memory",), "memory.limit_in_bytes", \
                "memory.usage_in_bytes", "cgroup v1"
        else:
            continue
        for mount in mounts:
            for level in _ancestors(rel):
                base = f"{mount}{level}".rstrip("/")
                raw = read(f"{base}/{limit_name}")
                if raw is None or raw.strip() == "max":
                    continue
                limit = int(raw.strip())
                if limit >= min(physical, _V1_NO_LIMIT):
                    continue
                usage = int((read(f"{base}/{usage_name}") or "0").strip() or 0)
                available = cgroup_available(limit, usage, read(f"{base}/memory.stat") or "")
                if best is None or available < best[1]:
                    best = (limit, available, source)
    return best


def _ancestors(rel: str) -> list[str]:
    """"/a/b" -> ["/a/b", "/a", ""]: the cgroup and its parents, relative to the mount."""
    parts = [p for p in rel.strip().split("/") if p]
    return ["/" + "/".join(parts[:i]) if i else "" for i in range(len(parts), -1, -1)]


def memory_view() -> MemoryView:
    """Memory now: MemAvailable, or what the tightest cgroup limit on this process leaves when that is less."""
    vm = psutil.virtual_memory()
    limited = cgroup_memory(read_file("/proc/self/cgroup") or "", read_file, vm.total)
    if limited is not None:
        limit, available, source = limited
        return MemoryView(limit, min(available, vm.available), source)
    return MemoryView(vm.total, vm.available, "system")


def major_faults() -> int:
    """Major page faults of this process so far, all its threads together."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def thread_major_faults(tid: int | None = None) -> int:
    """Major page faults of one thread of this process so far: the calling thread (None), or another by native id.
    0 where the OS does not count faults per thread (macOS, or no /proc).

    The calling thread's count is one system call; another's means reading /proc, which took 75 us a call in a
    node computing Gemma 270M (a lead from a throwaway probe, docs/ring.md), so the prefetcher reads it only while
    its thread is busy (Prefetcher._compute_faults)."""
    if tid is None:
        who = getattr(resource, "RUSAGE_THREAD", None)  # Linux and Android
        return resource.getrusage(who).ru_majflt if who is not None else 0
    try:
        fd = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
    except OSError:  # no per-thread counts here, or the thread has gone
        return 0
    try:
        stat = os.read(fd, 4096)
    finally:
        os.close(fd)
    return int(stat.rsplit(b")", 1)[1].split()[9])  # field 12, majflt


def rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss
