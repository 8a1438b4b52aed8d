"""Real resource caps for emulated devices: one cgroup per device with a memory cap, a disk read cap and a
CPU share, on cgroup v1 (memory, blkio, cpu controllers) or v2 (memory.max, io.max, cpu.max).

Everything made here is named `primaplug-testbed-*`, so `clean_stale()` can remove what an earlier run left
behind. Needs root (or a delegated cgroup); `CgroupUnavailableError` says why when the caps cannot be made.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "primaplug-testbed-"


class CgroupUnavailableError(RuntimeError):
    """The caps cannot be created here; the message says why and what to do."""


def _own_path(controller: str | None) -> str:
    """This process's cgroup path for a v1 controller, or the v2 path when controller is None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller is None and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
    raise CgroupUnavailableError(f"this process is in no cgroup with the {controller or 'v2'} controller")


def version() -> int:
    """1 or 2: which hierarchy holds the memory controller here."""
    if (ROOT / "memory").is_dir() and (ROOT / "memory" / "memory.limit_in_bytes").exists():
        return 1
    if (ROOT / "cgroup.controllers").exists():
        return 2
    raise CgroupUnavailableError("no cgroup memory controller is mounted under /sys/fs/cgroup")


def block_device(path: str | os.PathLike[str]) -> str:
    """'MAJ:MIN' of the whole disk holding `path` (throttles apply to disks, not partitions)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / dev
    if (sys_dev / "partition").exists():
        dev = (sys_dev.resolve().parent / "dev").read_text().strip()
    if not sys_dev.exists():
        raise CgroupUnavailableError(f"{path} is not on a block device ({dev}): its reads cannot be throttled")
    return dev


@dataclass(frozen=True)
class Caps:
    memory_bytes: int | None = None
    read_bps: int | None = None  # disk reads, page faults of mmaps included
    cpus: float | None = None  # CPU time as a number of cores (0.5 = half a core)
    # the CFS period the CPU share is enforced over. The kernel's 100 ms lets a device of a tenth of a core compute
    # 10 ms at a whole core's speed, then stop for 90: bursts shorter than its quota run as fast as on any device.
    # A short period makes a small share a slower CPU at the time scale of one token (at least 1 ms of quota).
    cpu_period_us: int = 100_000

    @property
    def period_us(self) -> int:
        """The period, lengthened where the share would leave a quota under the kernel's least (1 ms)."""
        return max(self.cpu_period_us, math.ceil(1000 / self.cpus)) if self.cpus else self.cpu_period_us


@dataclass
class Cgroup:
    """One emulated device's caps. `preexec()` moves the calling process in (use in a child before exec)."""

    name: str
    caps: Caps
    disk: str | None  # MAJ:MIN for the read cap
    dirs: list[Path] = field(default_factory=list)

    def create(self) -> Cgroup:
        try:
            if version() == 1:
                self._create_v1()
            else:
                self._create_v2()
        except PermissionError as e:
            self.remove()
            raise CgroupUnavailableError(f"cannot create cgroup {self.name} ({e}): the testbed needs root") from None
        except OSError as e:
            self.remove()
            raise CgroupUnavailableError(f"cannot set up cgroup {self.name}: {e}") from None
        return self

    def _create_v1(self) -> None:
        c = self.caps
        for controller, needed in (("memory", c.memory_bytes), ("blkio", c.read_bps), ("cpu", c.cpus)):
            if needed is None:
                continue
            d = self._v1_group(controller)
            if controller == "memory":
                (d / "memory.limit_in_bytes").write_text(str(c.memory_bytes))
                if (d / "memory.memsw.limit_in_bytes").exists():  # no swap either
                    (d / "memory.memsw.limit_in_bytes").write_text(str(c.memory_bytes))
            elif controller == "blkio":
                (d / "blkio.throttle.read_bps_device").write_text(f"{self.disk} {c.read_bps}")
            else:
                period = c.period_us
                (d / "cpu.cfs_period_us").write_text(str(period))
                (d / "cpu.cfs_quota_us").write_text(str(int(period * c.cpus)))  # type: ignore[operator]
        if self.cpu_seconds() is None and (ROOT / "cpuacct").is_dir():  # CPU time counted, capped or not
            self._v1_group("cpuacct")

    def _v1_group(self, controller: str) -> Path:
        d = ROOT / controller / _own_path(controller).lstrip("/") / (PREFIX + self.name)
        d.mkdir(exist_ok=True)
        self.dirs.append(d)
        return d

    def _create_v2(self) -> None:
        # v2 forbids processes in inner groups: make the caps a sibling of this process's own group
        parent = ROOT / _own_path(None).lstrip("/")
        parent = parent.parent if parent != ROOT else parent
        wanted = {"memory", "io", "cpu"}
        available = set((parent / "cgroup.controllers").read_text().split())
        if not wanted <= available:
            raise CgroupUnavailableError(f"cgroup {parent} lacks the controllers {sorted(wanted - available)}")
        (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
        d = parent / (PREFIX + self.name)
        d.mkdir(exist_ok=True)
        self.dirs.append(d)
        c = self.caps
        if c.memory_bytes is not None:
            (d / "memory.max").write_text(str(c.memory_bytes))
            (d / "memory.swap.max").write_text("0")
        if c.read_bps is not None:
            (d / "io.max").write_text(f"{self.disk} rbps={c.read_bps}")
        if c.cpus is not None:
            (d / "cpu.max").write_text(f"{int(c.period_us * c.cpus)} {c.period_us}")

    def add(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def preexec(self) -> None:
        self.add(os.getpid())

    def memory_dir(self) -> Path:
        for d in self.dirs:
            if (d / "memory.limit_in_bytes").exists() or (d / "memory.max").exists():
                return d
        raise CgroupUnavailableError(f"cgroup {self.name} has no memory cap")

    def set_memory(self, nbytes: int) -> None:
        """Change the memory cap now (the kernel reclaims down to it)."""
        d = self.memory_dir()
        v1 = (d / "memory.limit_in_bytes").exists()
        if (v1 and (d / "memory.memsw.limit_in_bytes").exists()
                and nbytes > int((d / "memory.limit_in_bytes").read_text())):
            (d / "memory.memsw.limit_in_bytes").write_text(str(nbytes))  # memsw >= limit, so raise it first
        (d / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(nbytes))
        if v1 and (d / "memory.memsw.limit_in_bytes").exists():
            (d / "memory.memsw.limit_in_bytes").write_text(str(nbytes))

    def working_set_bytes(self) -> int:
        """Memory in use less page cache: what the node counts as used (primaplug/memory/system.py)."""
        from primaplug.memory.system import file_cache_bytes

        d = self.memory_dir()
        usage = d / ("memory.usage_in_bytes" if (d / "memory.usage_in_bytes").exists() else "memory.current")
        return int(usage.read_text()) - file_cache_bytes((d / "memory.stat").read_text())

    def memory_peak_bytes(self) -> int | None:
        for d in self.dirs:
            for f in ("memory.max_usage_in_bytes", "memory.peak"):
                if (d / f).exists():
                    return int((d / f).read_text())
        return None

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this group (its own count, not a guess)."""
        d = self.memory_dir()
        for f in ("memory.oom_control", "memory.events"):  # v1, v2
            if (d / f).exists():
                return _stat_value((d / f).read_text(), "oom_kill")
        return 0

    def cpu_seconds(self) -> float | None:
        """CPU time this group's processes have used so far (None where no controller counts it)."""
        for d in self.dirs:
            if (d / "cpuacct.usage").exists():  # v1: nanoseconds
                return int((d / "cpuacct.usage").read_text()) / 1e9
            if (d / "cpu.stat").exists() and "usage_usec" in (text := (d / "cpu.stat").read_text()):  # v2
                return _stat_value(text, "usage_usec") / 1e6
        return None

    def read_bytes(self) -> int:
        """Bytes this group has read from its disk so far (page faults of mmaps included)."""
        for d in self.dirs:
            if (d / "blkio.throttle.io_service_bytes").exists():  # v1: "MAJ:MIN Read N" lines
                return sum(int(n) for dev, op, n in (line.split() for line in
                                                     (d / "blkio.throttle.io_service_bytes").read_text().splitlines()
                                                     if line.count(" ") == 2) if dev == self.disk and op == "Read")
            if (d / "io.stat").exists():  # v2: "MAJ:MIN rbytes=N wbytes=N ..."
                for line in (d / "io.stat").read_text().splitlines():
                    dev, *fields = line.split()
                    if dev == self.disk:
                        return _stat_value("\n".join(f.replace("=", " ") for f in fields), "rbytes")
                return 0
        raise CgroupUnavailableError(f"cgroup {self.name} has no disk cap, so no count of its reads")

    def remove(self) -> None:
        """Move any process left inside back to the parent, then delete the groups."""
        for d in self.dirs:
            _remove_dir(d)
        self.dirs.clear()


def _stat_value(text: str, key: str) -> int:
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def _remove_dir(d: Path) -> None:
    if not d.exists():
        return
    parent_procs = d.parent / "cgroup.procs"
    for _ in range(50):
        try:
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # the process has exited meanwhile
                    parent_procs.write_text(pid)
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)  # the kernel frees a group a moment after its last process leaves
    raise CgroupUnavailableError(f"could not remove {d}: processes are still inside")


def clean_stale() -> list[Path]:
    """Remove the testbed cgroups an earlier, interrupted run left behind, empty ones only (a group with
    processes inside belongs to a run still going); returns what was removed."""
    removed = []
    for d in ROOT.rglob(PREFIX + "*"):
        try:
            if d.is_dir() and not (d / "cgroup.procs").read_text().split():
                d.rmdir()
                removed.append(d)
        except OSError:
            pass
    return removed


def drop_caches() -> None:
    """Empty the page cache, so a run starts with every model copy on disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError as e:
        raise CgroupUnavailableError(f"cannot drop the page cache ({e}): the testbed needs root") from None
