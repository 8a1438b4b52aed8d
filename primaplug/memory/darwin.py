"""Memory on macOS (docs/platforms.md, "macOS: at run time").

What a node can take without making macOS compress or swap anyone's memory: free pages, file-backed pages (the
unified buffer cache, the node's own mapped weights among them, which the kernel drops before it compresses
anything) and purgeable pages (volatile memory the kernel discards outright): Activity Monitor's "Free" plus
"Cached Files". Not inactive pages, which psutil counts (`available = inactive + free`): on macOS most of them
are other programs' anonymous memory, which must be compressed to be reclaimed. Not `kern.memorystatus_level`
either (what `memory_pressure` prints as "free percentage"): on macOS it is active + inactive + free +
speculative over total, everything but wired and compressed memory.

While the kernel reports memory pressure (kern.memorystatus_vm_pressure_level 2, warn, or 4, critical) it is
already compressing, so only free pages count then.

`darwin_view` is a pure function over `vm_stat`'s output; `read_darwin_view` gathers it.
"""

from __future__ import annotations

import re

from primaplug.memory.system import MemoryView, Run, run_command

# kern.memorystatus_vm_pressure_level: the dispatch levels xnu hands user space (1 normal, 2 warn, 4 critical)
PRESSURE_NORMAL, PRESSURE_WARN, PRESSURE_CRITICAL = 1, 2, 4


def parse_vm_stat(text: str) -> tuple[int, dict[str, int]]:
    """`vm_stat`'s output: (page size in bytes, page counts by name as printed, e.g. "Pages free")."""
    m = re.search(r"page size of (\d+) bytes", text)
    if m is None:
        raise ValueError("not vm_stat's output: no 'page size of N bytes' header")
    pages: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        key, sep, value = line.rpartition(":")
        value = value.strip().rstrip(".")
        if sep and value.isdigit():
            pages[key.strip().strip('"')] = int(value)
    return int(m.group(1)), pages


def darwin_view(vm_stat: str, total_bytes: int, pressure_level: int | None = None) -> MemoryView:
    """Available = free + file-backed + purgeable pages (free + speculative under memory pressure), at most
    `total_bytes` (hw.memsize)."""
    page, pages = parse_vm_stat(vm_stat)
    free = pages["Pages free"]  # vm_stat prints the kernel's free_count less the speculative pages
    if pressure_level in (PRESSURE_WARN, PRESSURE_CRITICAL):
        counted = free + pages.get("Pages speculative", 0)
        note = f"free + speculative pages (the kernel reports memory pressure, level {pressure_level})"
    elif "File-backed pages" in pages:  # speculative pages are file-backed ones
        counted = free + pages["File-backed pages"] + pages.get("Pages purgeable", 0)
        note = "free + file-backed + purgeable pages"
    else:  # vm_stat before OS X 10.9 printed no file-backed count
        counted = free + pages.get("Pages speculative", 0) + pages.get("Pages purgeable", 0)
        note = "free + speculative + purgeable pages (this vm_stat has no file-backed count)"
    return MemoryView(total_bytes, min(counted * page, total_bytes), "macos", note=note)


def parse_pressure_level(text: str | None) -> int | None:
    """`sysctl -n kern.memorystatus_vm_pressure_level`: 1, 2 or 4; None when it printed nothing usable."""
    value = (text or "").strip()
    return int(value) if value.isdigit() else None


def read_darwin_view(total_bytes: int, run: Run | None = None) -> MemoryView | None:
    """Memory now, from `vm_stat` and the pressure level (two commands, a few milliseconds); None when
    vm_stat cannot run."""
    run = run or run_command
    out = run(["vm_stat"])
    if out is None:
        return None
    level = parse_pressure_level(run(["sysctl", "-n", "kern.memorystatus_vm_pressure_level"]))
    return darwin_view(out, total_bytes, level)
