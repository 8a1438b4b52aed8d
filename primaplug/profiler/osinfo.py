"""What the operating system says about a device: its name for Halda's rules, its CPU, and its memory.

Which OS, and how much memory is available, are the node's own readings (primaplug/memory/system.py: host_os,
memory_view, with Android's and macOS's rules in memory/android.py and memory/darwin.py), so that Halda plans a
device with the memory its node then budgets; this module adds what only the profile needs (the CPU's name,
Android's swap figures, Metal's working set). Each reading is a small function over the texts the OS gives, so that
tests can feed recorded texts. Memory is always read fresh: unlike speeds it changes from one minute to the next.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from primaplug.core.profiles import OsName
from primaplug.memory.android import parse_meminfo
from primaplug.memory.system import host_os, linux_kernel, memory_view, read_file


@dataclass(frozen=True)
class MemoryReading:
    total_bytes: int  # physical memory, or the cgroup's limit when that is smaller
    available_bytes: int  # d^avail: memory_view()'s, what the node budgets with
    source: str  # memory_view()'s: "system", "cgroup v1/v2", "android" ("android cgroup v1/v2"), "macos", "psutil"
    swap_can_bytes: int = 0  # Android: anonymous memory the OS could swap out
    swap_free_bytes: int = 0  # Android: free swap


# --- OS and CPU --------------------------------------------------------------------------------------------------


def current_os() -> OsName:
    """linux, android or macos, as the node's memory rules tell them (memory/system.py: host_os); Halda's latency
    model knows no other OS, so any other is refused."""
    if sys.platform != "darwin" and not linux_kernel():
        raise OSError(f"primaplug profiles Linux, Android and macOS devices, not {platform.system() or sys.platform}")
    return host_os()


def cpu_model(cpuinfo: str | None, fallback: str) -> str:
    """The CPU's name from /proc/cpuinfo: x86 "model name"; ARM boards say "Hardware" or only "CPU part"."""
    fields: dict[str, str] = {}
    for line in (cpuinfo or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Hardware", "Processor", "cpu model"):
        if key in fields:
            return fields[key]
    if "CPU part" in fields:
        return f"arm implementer {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
    return fallback


def current_cpu_model(os_name: OsName) -> str:
    fallback = platform.processor() or platform.machine()
    if os_name == "macos":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5, check=False).stdout.strip()
            return out or fallback
        except (OSError, subprocess.SubprocessError):
            return fallback
    return cpu_model(read_file("/proc/cpuinfo"), fallback)


# --- memory ------------------------------------------------------------------------------------------------------


def android_swap(meminfo: str) -> tuple[int, int]:
    """Android: (d^bytes_can_swap, d^swap_avail), what the OS could swap out to make room, and free swap.

    Android swaps background apps' anonymous pages (to zram on most phones) before it kills them, so the pages
    it could swap are the anonymous ones less the locked ones: Active(anon) + Inactive(anon) - Mlocked, from
    /proc/meminfo (cheaper than the paper's walk over every process's smaps). Halda caps it by SwapFree itself
    (d^swapout = min(need, min(can, free))). On zram a swapped page still takes its compressed size in RAM;
    the paper does not discount it and neither do we."""
    info = parse_meminfo(meminfo)
    anon = info.get("Active(anon)", 0) + info.get("Inactive(anon)", 0)
    return max(0, anon - info.get("Mlocked", 0)), info.get("SwapFree", 0)


def metal_working_set(total_bytes: int, logged: int | None = None) -> int:
    """d^avail_metal: Metal's recommendedMaxWorkingSetSize. Without pyobjc Python cannot ask Metal, so take the
    figure llama.cpp logged when it opened the Metal device, if it did; otherwise the fraction macOS grants on
    Apple silicon: about 2/3 of memory up to 36 GiB and 3/4 above (what llama.cpp reports on those machines)."""
    if logged:
        return logged
    return total_bytes * 2 // 3 if total_bytes <= 36 << 30 else total_bytes * 3 // 4


# --- live readings -----------------------------------------------------------------------------------------------


def read_memory(os_name: OsName) -> MemoryReading:
    """Memory as the OS reports it right now, counted as the node counts it (memory_view), and on Android the swap
    figures Halda adds."""
    view = memory_view(os_name)
    if os_name != "android":
        return MemoryReading(view.total_bytes, view.available_bytes, view.source)
    can, free = android_swap(read_file("/proc/meminfo") or "")
    return MemoryReading(view.total_bytes, view.available_bytes, view.source, can, free)


# the files that hold a cgroup's caps: v1 per controller, v2 in the one hierarchy
_CAP_FILES = {"memory": ("memory.limit_in_bytes",), "cpu": ("cpu.cfs_quota_us", "cpu.cfs_period_us"),
              "blkio": ("blkio.throttle.read_bps_device",), "": ("memory.max", "cpu.max", "io.max")}


def cgroup_identity(read: Callable[[str], str | None] = read_file) -> str:
    """This process's cgroups and their caps: emulated devices on one machine differ by them (memory, CPU and disk
    caps), so they are part of the profile cache's key; a group whose caps change is another device, measured
    again, though its path is the same."""
    groups = (read("/proc/self/cgroup") or "").strip()
    caps = []
    for line in groups.splitlines():
        _, controllers, rel = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        for controller in controllers.split(",") if controllers else [""]:
            base = f"/sys/fs/cgroup/{controller}{rel}" if controller else f"/sys/fs/cgroup{rel}"
            for name in _CAP_FILES.get(controller, ()):
                value = read(f"{base.rstrip('/')}/{name}")
                if value is not None:
                    caps.append(f"{name}={' '.join(value.split())}")
    return groups + ("\n" + ";".join(caps) if caps else "")
