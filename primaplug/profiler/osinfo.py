"""What the operating system says about a device: its name for Halda's rules, its CPU, and its memory.

Each reading is a small function over the texts the OS gives (/proc/meminfo, cgroup files, vm_stat's output) so
that tests can feed recorded texts; `read_memory()` and friends only gather those texts on the live system.
Memory is always read fresh: unlike speeds it changes from one minute to the next.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from primaplug.core.profiles import OsName
from primaplug.memory.system import Reader, cgroup_memory, read_file


@dataclass(frozen=True)
class MemoryReading:
    total_bytes: int  # physical memory, or the cgroup's limit when that is smaller
    available_bytes: int  # d^avail
    source: str  # "meminfo", "cgroup v1", "cgroup v2", "vm_stat", "psutil"
    swap_can_bytes: int = 0  # Android: anonymous memory the OS could swap out
    swap_free_bytes: int = 0  # Android: free swap


# --- OS and CPU --------------------------------------------------------------------------------------------------


def detect_os(system: str, env: Mapping[str, str], has_build_prop: bool) -> OsName:
    """linux, android or macos. Android shows itself to Python as Linux under Termux (and as "Android" from
    Python 3.13 on); Termux sets TERMUX_VERSION and a PREFIX under com.termux, and every Android has
    /system/build.prop. HarmonyOS under Termux counts as Android, as in the paper."""
    if system == "Darwin":
        return "macos"
    if system == "Android" or has_build_prop or "TERMUX_VERSION" in env or "com.termux" in env.get("PREFIX", ""):
        return "android"
    if system == "Linux":
        return "linux"
    raise OSError(f"primaplug profiles Linux, Android and macOS devices, not {system or 'an unknown OS'}")


def current_os() -> OsName:
    return detect_os(platform.system(), os.environ, os.path.exists("/system/build.prop"))


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


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# --- memory: Linux and Android -----------------------------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per field."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"([^:]+):\s+(\d+)(?:\s+kB)?", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    return out


def linux_memory(meminfo: str, proc_self_cgroup: str | None, read: Reader) -> MemoryReading:
    """Linux: MemAvailable, or what the tightest cgroup limit leaves when that is less."""
    info = parse_meminfo(meminfo)
    total, available = info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    limited = cgroup_memory(proc_self_cgroup or "", read, total)
    if limited is not None:
        limit, left, source = limited
        return MemoryReading(min(limit, total), min(left, available), source)
    return MemoryReading(total, available, "meminfo")


def android_memory(meminfo: str) -> MemoryReading:
    """Android: MemAvailable, plus what the OS could swap out to make room (d^bytes_can_swap, d^swap_avail).

    Android swaps background apps' anonymous pages (to zram on most phones) before it kills them, so the pages
    it could swap are the anonymous ones less the locked ones: Active(anon) + Inactive(anon) - Mlocked, from
    /proc/meminfo (cheaper than the paper's walk over every process's smaps). Halda caps it by SwapFree itself
    (d^swapout = min(need, min(can, free))). On zram a swapped page still takes its compressed size in RAM;
    the paper does not discount it and neither do we."""
    info = parse_meminfo(meminfo)
    anon = info.get("Active(anon)", 0) + info.get("Inactive(anon)", 0)
    return MemoryReading(
        info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0)), "meminfo",
        swap_can_bytes=max(0, anon - info.get("Mlocked", 0)), swap_free_bytes=info.get("SwapFree", 0),
    )


# --- memory: macOS -----------------------------------------------------------------------------------------------


def macos_memory(vm_stat: str, total_bytes: int) -> MemoryReading:
    """macOS: free + inactive + purgeable + speculative pages from `vm_stat`: all of them the kernel hands out
    without compressing or swapping anything (speculative pages are clean read-ahead)."""
    m = re.search(r"page size of (\d+) bytes", vm_stat)
    page = int(m.group(1)) if m else 4096
    pages: dict[str, int] = {}
    for line in vm_stat.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip().rstrip(".").isdigit():
            pages[key.strip()] = int(value.strip().rstrip("."))
    names = ("Pages free", "Pages inactive", "Pages purgeable", "Pages speculative")
    available = sum(pages.get(n, 0) for n in names) * page
    return MemoryReading(total_bytes, min(available, total_bytes), "vm_stat")


def metal_working_set(total_bytes: int, logged: int | None = None) -> int:
    """d^avail_metal: Metal's recommendedMaxWorkingSetSize. Without pyobjc Python cannot ask Metal, so take the
    figure llama.cpp logged when it opened the Metal device, if it did; otherwise the fraction macOS grants on
    Apple silicon: about 2/3 of memory up to 36 GiB and 3/4 above (what llama.cpp reports on those machines)."""
    if logged:
        return logged
    return total_bytes * 2 // 3 if total_bytes <= 36 << 30 else total_bytes * 3 // 4


# --- live readings -----------------------------------------------------------------------------------------------


def read_memory(os_name: OsName) -> MemoryReading:
    """Memory as the OS reports it right now."""
    if os_name == "macos":
        try:
            out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True).stdout
            return macos_memory(out, psutil.virtual_memory().total)
        except (OSError, subprocess.SubprocessError):
            vm = psutil.virtual_memory()
            return MemoryReading(vm.total, vm.available, "psutil")
    meminfo = read_file("/proc/meminfo")
    if meminfo is None:
        vm = psutil.virtual_memory()
        return MemoryReading(vm.total, vm.available, "psutil")
    if os_name == "android":
        return android_memory(meminfo)
    return linux_memory(meminfo, read_file("/proc/self/cgroup"), read_file)


def cgroup_identity() -> str:
    """This process's cgroups: emulated devices on one machine differ by them (memory, CPU and disk caps), so
    they are part of the profile cache's key."""
    return (read_file("/proc/self/cgroup") or "").strip()
