"""Memory on Android, as a Termux process can read it (docs/platforms.md, "Android (Termux): at run time").

Android kills apps from user space (lmkd) long before MemAvailable reaches 0, and Termux, with the node under it,
is an app. A node therefore leaves Android's own "low memory" line free: the level at which ActivityManager tells
every app that memory is low (`ActivityManager.MemoryInfo.lowMemory`) and lmkd starts killing cached apps. Above
it Android kills nothing to make room, so the node is not killed for memory, and the foreground app keeps what any
app may take.

The line comes from the levels ActivityManager hands lmkd (`sys.lmk.minfree_levels`, "pages:oom_score_adj,...").
That property did not show in the recorded adb `getprop` dumps of Android 11 and 16 phones, and an app sees less
than adb; where it is missing the levels are computed as AOSP's ProcessList.updateOomLevels computes them.

Everything here is a pure function over what the OS prints (tests feed recorded readings); `read_android_view`
only gathers those texts.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass

from primaplug.memory.system import MemoryView, Reader, Run, cgroup_memory, read_file, run_command

log = logging.getLogger(__name__)

# ProcessList.java (frameworks/base, services/core/java/com/android/server/am): the oom_score_adj classes
PERCEPTIBLE_APP_ADJ = 200  # a foreground service: Termux while its notification shows
HOME_APP_ADJ = 600
CACHED_APP_MIN_ADJ = 900
# the six lmkd slots, and their minfree levels in KiB for small (HVGA, <512 MB) and large devices
OOM_ADJ = (0, 100, 200, 250, 900, 950)
MIN_FREE_LOW_KIB = (12288, 18432, 24576, 36864, 43008, 49152)
MIN_FREE_HIGH_KIB = (73728, 92160, 110592, 129024, 147456, 184320)

# Android's memory cgroups: v1 under /dev/memcg, v2 unified under /sys/fs/cgroup
ANDROID_CGROUP_MOUNTS = {"cgroup v1": ("/dev/memcg",), "cgroup v2": ("/sys/fs/cgroup",)}

GETPROP = "/system/bin/getprop"  # Termux's PATH may leave /system/bin out


def is_termux(env: Mapping[str, str]) -> bool:
    """Termux sets TERMUX_VERSION, and a PREFIX (also TERMUX__PREFIX, in recent versions) under com.termux."""
    return "TERMUX_VERSION" in env or any("com.termux" in env.get(k, "") for k in ("PREFIX", "TERMUX__PREFIX"))


def is_android(system: str, env: Mapping[str, str], has_build_prop: bool) -> bool:
    """Python 3.13+ says "Android" (platform.system()); older ones say Linux, so look at what Android sets: its
    ANDROID_ROOT/ANDROID_DATA in the environment of every app process, /system/build.prop, or Termux itself."""
    return (system == "Android" or has_build_prop or is_termux(env)
            or ("ANDROID_ROOT" in env and "ANDROID_DATA" in env))


@dataclass(frozen=True)
class LmkLevels:
    """lmkd's minfree levels: (oom_score_adj, bytes) in ascending order, and where they came from."""

    levels: tuple[tuple[int, int], ...]
    source: str

    def mem_level(self, adj: int) -> int:
        """ProcessList.getMemLevel: the level of the first slot whose adj is at least `adj`, else the last one."""
        for slot_adj, level in self.levels:
            if adj <= slot_adj:
                return level
        return self.levels[-1][1]

    def low_memory_bytes(self) -> int:
        """Where ActivityManager.MemoryInfo.lowMemory turns true: home + (cached - home) / 2 (ProcessList
        .getMemoryInfo), with home and cached the levels of HOME_APP_ADJ and CACHED_APP_MIN_ADJ."""
        home, cached = self.mem_level(HOME_APP_ADJ), self.mem_level(CACHED_APP_MIN_ADJ)
        return home + (cached - home) // 2


def parse_minfree_levels(value: str, page_size: int) -> LmkLevels | None:
    """`sys.lmk.minfree_levels` ("18432:0,23040:100,...": minfree in pages, then oom_score_adj, as lmkd's
    cmd_target writes it), or None when the value is empty or not of that form."""
    pairs = []
    for item in value.strip().split(","):
        m = re.fullmatch(r"\s*(\d+):(-?\d+)\s*", item)
        if m is None:
            return None
        pairs.append((int(m.group(2)), int(m.group(1)) * page_size))
    return LmkLevels(tuple(sorted(pairs)), "sys.lmk.minfree_levels") if pairs else None


def default_levels(total_bytes: int, is_64bit: bool) -> LmkLevels:
    """The levels AOSP's ProcessList.updateOomLevels computes for this much memory, without a vendor's
    config_lowMemoryKillerMinFreeKbytes overrides: interpolated between the small and large tables by memory
    (350 MB to 700 MB; the display's size only matters below 700 MB, where it can only raise the levels, so it
    is left out), and on 64-bit the two cached slots raised by 3/2 and 7/4."""
    total_mb = total_bytes // (1 << 20)
    scale = min(1.0, max(0.0, (total_mb - 350) / (700 - 350)))
    levels = []
    for i, adj in enumerate(OOM_ADJ):
        low, high = MIN_FREE_LOW_KIB[i], MIN_FREE_HIGH_KIB[i]
        if is_64bit:
            high = high * 3 // 2 if i == 4 else high * 7 // 4 if i == 5 else high
        levels.append((adj, int(low + (high - low) * scale) * 1024))
    return LmkLevels(tuple(levels), "AOSP defaults" + (" (64-bit)" if is_64bit else " (32-bit)"))


def parse_getprop(text: str) -> dict[str, str]:
    """`getprop`'s dump, one "[name]: [value]" a line."""
    return dict(re.findall(r"^\[([^\]]+)\]: \[(.*)\]$", text, flags=re.MULTILINE))


def lmk_levels(props: Mapping[str, str], total_bytes: int, page_size: int, machine: str) -> LmkLevels:
    """The levels from the properties when they are readable, else AOSP's defaults. 64-bit as ActivityManager
    decides it (Build.SUPPORTED_64_BIT_ABIS, that is ro.product.cpu.abilist64), else from the machine."""
    levels = parse_minfree_levels(props.get("sys.lmk.minfree_levels", ""), page_size)
    if levels is not None:
        return levels
    abis = props.get("ro.product.cpu.abilist64")
    is_64bit = bool(abis.strip()) if abis is not None else machine in ("aarch64", "arm64", "x86_64")
    return default_levels(total_bytes, is_64bit)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per field."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"([^:]+):\s+(\d+)(\s+kB)?\s*$", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def android_view(meminfo: str, levels: LmkLevels) -> MemoryView:
    """Available = MemAvailable (the kernel's estimate; MemFree + Cached, as ActivityManager counts availMem,
    on kernels before 3.14) less Android's low-memory line."""
    info = parse_meminfo(meminfo)
    if "MemTotal" not in info:
        raise ValueError("not a /proc/meminfo: no MemTotal line")
    kernel = info["MemAvailable"] if "MemAvailable" in info else info.get("MemFree", 0) + info.get("Cached", 0)
    line = levels.low_memory_bytes()
    what = "MemAvailable" if "MemAvailable" in info else "MemFree + Cached"
    return MemoryView(info["MemTotal"], max(0, kernel - line), "android",
                      note=f"{what} less Android's low-memory line, {line >> 20} MiB ({levels.source})")


_levels: LmkLevels | None = None  # ActivityManager sets them once a boot (and again if the display changes)


def read_android_view(read: Reader = read_file, run: Run | None = None) -> MemoryView:
    """Memory now, on Android: the levels are read once a process (one `getprop`), /proc/meminfo every time; a
    memory cgroup limit, where Android set one and lets the app read it, is honoured as on Linux."""
    global _levels
    meminfo = read("/proc/meminfo")
    if meminfo is None:
        raise OSError("cannot read /proc/meminfo")
    if _levels is None:
        total = parse_meminfo(meminfo).get("MemTotal", 0)
        getprop = (run or run_command)([GETPROP if os.path.exists(GETPROP) else "getprop"])
        _levels = lmk_levels(parse_getprop(getprop or ""), total, mmap.PAGESIZE, platform.machine())
        log.info("memory: Android's low-memory line is %d MiB (%s)", _levels.low_memory_bytes() >> 20,
                 _levels.source)
    view = android_view(meminfo, _levels)
    limited = cgroup_memory(read("/proc/self/cgroup") or "", read, view.total_bytes, ANDROID_CGROUP_MOUNTS)
    if limited is not None:
        limit, available, source = limited
        return MemoryView(limit, min(available, view.available_bytes), f"android {source}", note=view.note)
    return view
