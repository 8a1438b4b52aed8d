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


def _cgroup_files() -> tuple[Path, Path, str] | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (base / "memory.max").exists():
                return base / "memory.max", base / "memory.current", "cgroup v2"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (base / "memory.limit_in_bytes").exists():
                return base / "memory.limit_in_bytes", base / "memory.usage_in_bytes", "cgroup v1"
    return None


def memory_view() -> MemoryView:
    vm = psutil.virtual_memory()
    files = _cgroup_files()
    if files is not None:
        limit_file, usage_file, source = files
        raw = limit_file.read_text().strip()
        if raw != "max" and int(raw) < vm.total:
            limit, usage = int(raw), int(usage_file.read_text())
            return MemoryView(limit, max(0, min(limit - usage, vm.available)), source)
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
