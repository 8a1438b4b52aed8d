"""Where an emulated device's memory goes, over a run: each device cgroup's anonymous memory, kernel memory and
page cache, sampled in a thread, with marks ("deployed", "prompt", "token 1", ...), and at the end the node
process's anonymous memory by mapping (/proc/PID/smaps).

The node's memory pressure (memory/system.py) is the growth of its cgroup's usage less page cache since the node
started, over the cap: this separates that growth into the node's own memory (anonymous: heap, llama.cpp's
buffers, the KV cache) and the kernel's (page tables, slab, sockets), and shows the page cache beside it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.testbed.cgroups import Cgroup
from primaplug.memory.system import file_cache_bytes

MIB = 1 << 20


def _stat(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.count(" ") == 1)}


def _sample_or_gone(d: Path) -> dict[str, int]:
    """sample_group, or zeros for a group that is gone: another run's clean_stale() may remove a device's group in the
    moment it is empty (its processes ended), and a measurement then ends with what it saw, rather than failing."""
    try:
        return sample_group(d)
    except FileNotFoundError:
        return {"usage": 0, "anon": 0, "file": 0, "kernel": 0, "shmem": 0}


def sample_group(d: Path) -> dict[str, int]:
    """One cgroup's memory now, in bytes: usage, anon (rss), file (page cache, as the node counts it:
    memory/system.py: file_cache_bytes), kernel, shmem; v1 or v2."""
    text = (d / "memory.stat").read_text()
    s, file = _stat(text), file_cache_bytes(text)
    if (d / "memory.usage_in_bytes").exists():  # v1: total_* count the children
        kmem = d / "memory.kmem.usage_in_bytes"
        return {"usage": int((d / "memory.usage_in_bytes").read_text()), "anon": s.get("total_rss", 0),
                "file": file, "kernel": int(kmem.read_text()) if kmem.exists() else 0,
                "shmem": s.get("total_shmem", 0)}
    return {"usage": int((d / "memory.current").read_text()), "anon": s.get("anon", 0), "file": file,
            "kernel": s.get("kernel", s.get("slab", 0) + s.get("pagetables", 0) + s.get("kernel_stack", 0)),
            "shmem": s.get("shmem", 0)}


def anon_by_mapping(smaps: str, top: int = 6) -> dict[str, Any]:
    """A process's anonymous memory (its /proc/PID/smaps) by where it lives, in MiB: the brk heap, files' private
    pages (libraries' data), other anonymous mappings (malloc arenas, llama.cpp's buffers, thread stacks), the
    largest of these with their sizes."""
    out = {"heap": 0, "libraries": 0, "anonymous mappings": 0, "other": 0}
    maps: list[tuple[int, int]] = []  # (anonymous bytes, mapping size)
    name, size = "", 0
    for line in smaps.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            size, name = int(head[2], 16) - int(head[1], 16), head[3]
            continue
        if line.startswith("Anonymous:"):
            n = int(line.split()[1]) * 1024
            if not n:
                continue
            if name == "[heap]":
                out["heap"] += n
            elif name.startswith("/"):
                out["libraries"] += n
            elif name == "":
                out["anonymous mappings"] += n
                maps.append((n, size))
            else:
                out["other"] += n
    maps.sort(reverse=True)
    res = {k: round(v / MIB, 2) for k, v in out.items()}
    res["largest anonymous mappings (resident MiB / size MiB)"] = [
        f"{n / MIB:.1f} / {s / MIB:.1f}" for n, s in maps[:top]]
    return res


class MemoryWatch:
    """Samples the devices' cgroups every `interval_s` from start() to stop() (`with MemoryWatch(...) as watch:`
    does both); `mark(name)` records a sample under a name. `summary()`: per device, the marks and the largest usage
    less page cache, in MiB."""

    def __init__(self, groups: Sequence[Cgroup], interval_s: float = 0.25) -> None:
        self.groups = list(groups)
        self.dirs = [g.memory_dir() for g in groups]
        self.names = [g.name for g in groups]
        self.interval_s = interval_s
        self.marks: list[tuple[str, float, list[dict[str, int]]]] = []
        self.peak_used = [0] * len(self.dirs)
        self.series: list[tuple[float, list[int]]] = []  # (time.monotonic(), each device's usage less page cache)
        self.cpu_series: list[tuple[float, list[float | None]]] = []  # (time.monotonic(), each device's CPU seconds)
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memwatch", daemon=True)

    def _sample(self) -> list[dict[str, int]]:
        now = [_sample_or_gone(d) for d in self.dirs]
        for i, s in enumerate(now):
            self.peak_used[i] = max(self.peak_used[i], s["usage"] - s["file"])
        t = time.monotonic()
        self.series.append((t, [s["usage"] - s["file"] for s in now]))
        self.cpu_series.append((t, [g.cpu_seconds() for g in self.groups]))
        return now

    def cpu_at(self, t: float) -> list[float | None]:
        """Each device's CPU seconds at time.monotonic() t, between the samples around it (a straight line)."""
        after = next((i for i, (when, _) in enumerate(self.cpu_series) if when >= t), len(self.cpu_series) - 1)
        (t1, c1), (t0, c0) = self.cpu_series[after], self.cpu_series[max(0, after - 1)]
        f = 0.0 if t1 <= t0 else min(1.0, max(0.0, (t - t0) / (t1 - t0)))
        return [None if a is None or b is None else a + f * (b - a) for a, b in zip(c0, c1, strict=True)]

    def peak_since(self, t: float) -> list[int]:
        """Each device's largest usage less page cache sampled from time.monotonic() t on."""
        rows = [used for when, used in self.series if when >= t] or [self.series[-1][1]]
        return [max(col) for col in zip(*rows, strict=True)]

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> MemoryWatch:
        self.mark("started")
        self._thread.start()
        return self

    def mark(self, name: str) -> None:
        self.marks.append((name, round(time.monotonic() - self._t0, 2), self._sample()))

    def processes(self) -> dict[str, dict[str, Any]]:
        """Each device's node processes' anonymous memory by mapping, now."""
        out = {}
        for name, d in zip(self.names, self.dirs, strict=True):
            out[name] = {}
            for pid in (d / "cgroup.procs").read_text().split():
                try:
                    out[name][pid] = anon_by_mapping(Path(f"/proc/{pid}/smaps").read_text())
                except OSError:  # gone
                    continue
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> MemoryWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, name in enumerate(self.names):
            rows = [{"mark": m, "t_s": t, **{k: round(v / MIB, 2) for k, v in s[i].items()},
                     "used": round((s[i]["usage"] - s[i]["file"]) / MIB, 2)} for m, t, s in self.marks]
            out[name] = {"marks": rows, "peak_used_mib": round(self.peak_used[i] / MIB, 2)}
        return out


def growth(summary: dict[str, Any], cap_bytes: int) -> dict[str, float]:
    """From the first mark to the last: the growth of usage less page cache, and of its parts, as shares of the
    cap (what the node's memory pressure measures, split into the node's own anonymous memory, the kernel's and
    shared memory)."""
    first, last = summary["marks"][0], summary["marks"][-1]
    cap = cap_bytes / MIB
    return {k: round((last[k] - first[k]) / cap, 4) for k in ("used", "anon", "kernel", "shmem")} | \
        {"peak_used_over_start": round((summary["peak_used_mib"] - first["used"]) / cap, 4)}
