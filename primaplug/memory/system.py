"""Memory as the OS gives it to this process: available bytes (cgroup-aware), total, and major faults."""

from __future__ import annotations

import os
import resource
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


def _cgroup_files() -> tuple[Path, Path, Path, str] | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (base / "memory.max").exists():
                return base / "memory.max", base / "memory.current", base / "memory.stat", "cgroup v2"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (base / "memory.limit_in_bytes").exists():
                return base / "memory.limit_in_bytes", base / "memory.usage_in_bytes", base / "memory.stat", "cgroup v1"
    return None


def _stat_field(fields: dict[str, str], name: str) -> int:
    return int(fields.get("total_" + name, fields.get(name, 0)))  # v1 has total_* (with children), v2 plain names


def inactive_file_bytes(stat_text: str) -> int:
    """Inactive page cache in a cgroup's memory.stat (v1: total_inactive_file, v2: inactive_file)."""
    return _stat_field(dict(line.split() for line in stat_text.splitlines() if line.count(" ") == 1), "inactive_file")


def file_cache_bytes(stat_text: str) -> int:
    """Page cache (active and inactive file pages) in a cgroup's memory.stat."""
    fields = dict(line.split() for line in stat_text.splitlines() if line.count(" ") == 1)
    return _stat_field(fields, "active_file") + _stat_field(fields, "inactive_file")


def cgroup_available(limit: int, usage: int, stat_text: str) -> int:
    """What a cgroup can still use: its limit less what it uses, counting page cache as available (the kernel
    drops clean file pages before it fails an allocation), as MemAvailable does outside a cgroup. So a node's
    mapped weights are not pressure, its KV cache and buffers are: the paper's definition of memory pressure."""
    return max(0, limit - (usage - file_cache_bytes(stat_text)))


def memory_view() -> MemoryView:
    vm = psutil.virtual_memory()
    files = _cgroup_files()
    if files is not None:
        limit_file, usage_file, stat_file, source = files
        raw = limit_file.read_text().strip()
        if raw != "max" and int(raw) < vm.total:
            limit, usage = int(raw), int(usage_file.read_text())
            stat = stat_file.read_text() if stat_file.exists() else ""
            return MemoryView(limit, min(cgroup_available(limit, usage, stat), vm.available), source)
    return MemoryView(vm.total, vm.available, "system")


def major_faults(exclude_threads: frozenset[int] = frozenset()) -> int:
    """Major page faults of this process so far, leaving out the given threads (native ids) where the OS tells
    faults per thread (Linux, Android), so that a prefetcher's own faults do not count as compute's."""
    tasks = Path("/proc/self/task")
    if exclude_threads and tasks.is_dir():
        total = 0
        for task in tasks.iterdir():
            if int(task.name) in exclude_threads:
                continue
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            total += int(stat.rsplit(")", 1)[1].split()[9])  # field 12, majflt
        return total
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss
