"""Memory as the OS gives it to this process: available bytes (cgroup-aware on Linux; Android's and macOS's own
rules in memory/android.py and memory/darwin.py), total, and major faults."""

from __future__ import annotations

import logging
import os
import platform
import resource
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from primaplug.core.profiles import OsName

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryView:
    total_bytes: int  # the cgroup's limit when inside one, else physical memory
    available_bytes: int
    source: str  # "cgroup v2", "cgroup v1", "system", "android" (or "android cgroup v1/v2"), "macos", "psutil"
    note: str = ""  # how available was counted, where the rule is the platform's own

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.available_bytes

    def pressure_since(self, used_before: int) -> float:
        """Memory pressure as the paper defines it: the drop in available memory since `used_before` was
        measured, over total memory (the cgroup's limit inside one)."""
        return max(0.0, (self.used_bytes - used_before) / self.total_bytes)


# read one file by absolute path; None when it does not exist or cannot be read
Reader = Callable[[str], "str | None"]
# run one command (run_command; tests hand in recorded outputs): its stdout, or None when it could not run
Run = Callable[[list[str]], "str | None"]

# cgroup v1 writes "no limit" as the largest page-aligned 63-bit value; anything above physical memory is no limit
_V1_NO_LIMIT = 1 << 60
# where each cgroup version's memory controller is mounted (Android's: memory/android.py)
CGROUP_MOUNTS = {"cgroup v2": ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), "cgroup v1": ("/sys/fs/cgroup/memory",)}


def read_file(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def run_command(argv: list[str]) -> str | None:
    """A command's stdout; None when it could not run, took over 10 s or failed."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


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


def cgroup_memory(proc_self_cgroup: str, read: Reader, physical: int,
                  mounts: Mapping[str, tuple[str, ...]] = CGROUP_MOUNTS) -> tuple[int, int, str] | None:
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
            limit_name, usage_name, source = "memory.max", "memory.current", "cgroup v2"
        elif "memory" in controllers.split(","):
            limit_name, usage_name, source = "memory.limit_in_bytes", "memory.usage_in_bytes", "cgroup v1"
        else:
            continue
        for mount in mounts.get(source, ()):
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


def linux_kernel(platform_name: str | None = None) -> bool:
    """Whether `platform_name` (default this process's sys.platform) runs Linux's kernel, with its /proc and
    prctl: Linux, and Android, which Python calls "android" from 3.13 on and "linux" before."""
    name = sys.platform if platform_name is None else platform_name
    return name.startswith("linux") or name == "android"


def fd_path(fd: int, st: os.stat_result) -> str | None:
    """A name that opens the file held by `fd` itself, or None where there is none. Only /proc/self/fd on Linux's
    kernel (Android's too): macOS's /dev/fd/N duplicates the descriptor, so every open of it would share (and move)
    one file offset, which llama.cpp's sequential header reads do not expect."""
    if not linux_kernel():
        return None
    path = f"/proc/self/fd/{fd}"
    try:
        seen = os.stat(path)
    except OSError:
        return None
    return path if (seen.st_dev, seen.st_ino) == (st.st_dev, st.st_ino) else None


def detect_os(platform_name: str, system: str, env: Mapping[str, str], has_build_prop: bool) -> OsName:
    """Whose memory rules apply, from sys.platform, platform.system(), the environment and whether
    /system/build.prop exists: "macos", "android" (memory/android.py: is_android; HarmonyOS under Termux too), else
    "linux", whose reading (psutil's figures, cgroups where /proc shows them) also serves any other Unix."""
    if platform_name == "darwin":
        return "macos"
    from primaplug.memory.android import is_android

    return "android" if is_android(system, env, has_build_prop) else "linux"


def host_os() -> OsName:
    """detect_os for this process."""
    return detect_os(sys.platform, platform.system(), os.environ, os.path.exists("/system/build.prop"))


def linux_view(total: int, available: int, proc_self_cgroup: str, read: Reader) -> MemoryView:
    """Linux: the kernel's figures (MemTotal, MemAvailable), or the tightest cgroup limit on this process and what
    it leaves (`cgroup_memory`) when that is less."""
    limited = cgroup_memory(proc_self_cgroup, read, total)
    if limited is not None:
        limit, left, source = limited
        return MemoryView(limit, min(left, available), source)
    return MemoryView(total, available, "system")


def memory_view(os_name: OsName | None = None) -> MemoryView:
    """Memory now. Linux: MemAvailable, or what the tightest cgroup limit on this process leaves when that is
    less. Android: MemAvailable less Android's low-memory line (memory/android.py). macOS: free, file-backed and
    purgeable pages (memory/darwin.py). Where the platform's own reading fails, psutil's, and a warning."""
    os_name = os_name or host_os()
    if os_name == "android":
        from primaplug.memory.android import read_android_view

        try:
            return read_android_view()
        except (OSError, ValueError) as e:
            log.warning("memory: cannot read Android's figures (%s); using psutil's, without Android's reserve", e)
            vm = psutil.virtual_memory()
            return MemoryView(vm.total, vm.available, "psutil")
    vm = psutil.virtual_memory()
    if os_name == "macos":
        from primaplug.memory.darwin import read_darwin_view

        view = read_darwin_view(vm.total)
        if view is None:
            log.warning("memory: vm_stat did not run; using psutil's figure (inactive + free pages)")
            return MemoryView(vm.total, vm.available, "psutil")
        return view
    return linux_view(vm.total, vm.available, read_file("/proc/self/cgroup") or "", read_file)


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
