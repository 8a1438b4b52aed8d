"""The emulated devices of one run, the same for every system: each device a cgroup (memory cap, disk read cap, CPU
share) whose processes see its memory as theirs (testbed/view.py), its own copy of every file it reads, and its
link to the others through the link proxy. Processes are started in a device with `spawn`; what each prints is kept,
timestamped, and logged to a file. `Rig.measure` samples every device from before anything starts to the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.testbed import cgroups
from benchmarks.testbed.cluster import copy_model
from benchmarks.testbed.devices import Device
from benchmarks.testbed.linkproxy import LinkProxy
from benchmarks.testbed.memwatch import MemoryWatch
from benchmarks.testbed.view import enter_view

MiB = 1 << 20
# a device's CPU share enforced over 2 ms (cgroups.Caps.cpu_period_us): a small share is a slow CPU, not a fast one
# that stops, at the time scale of a token (tens of ms); every system here runs under the same
CPU_PERIOD_US = 2000


class Proc:
    """A process started in a device: its stdout kept as bytes with the time each piece arrived, stderr and stdout
    both written to `log` as they come (a peer's own words are the evidence of what it did)."""

    def __init__(self, argv: Sequence[str], log: Path, preexec: Callable[[], None], *, cwd: Path | None = None,
                 env: dict[str, str] | None = None, name: str = "", device: str = "") -> None:
        self.name, self.argv, self.log, self.device = name or Path(argv[0]).name, list(argv), log, device
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")  # noqa: SIM115
        self._log.write(f"$ {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                     env={**os.environ, **(env or {})}, preexec_fn=preexec, start_new_session=True)
        self.out: list[tuple[float, bytes]] = []
        self.err = bytearray()
        self.ended: float | None = None  # when its stdout closed (it exited, or was killed)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True)]
        for t in self._threads:
            t.start()

    def _pump(self, stream: Any, is_out: bool) -> None:
        while chunk := stream.read1(65536):
            now = time.monotonic()
            with self._lock:
                if is_out:
                    self.out.append((now, chunk))
                else:
                    self.err += chunk
                self._log.write(chunk)
                self._log.flush()
        if is_out:
            self.ended = time.monotonic()

    @property
    def stdout(self) -> bytes:
        with self._lock:
            return b"".join(c for _, c in self.out)

    def text(self) -> str:
        """Everything it printed, stdout and stderr, as text."""
        with self._lock:
            return (b"".join(c for _, c in self.out) + bytes(self.err)).decode(errors="replace")

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float) -> bool:
        """Until `predicate(everything printed so far)` holds (True), or the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.text()):
                return True
            if self.proc.poll() is not None:
                time.sleep(0.2)  # what it printed last
                return predicate(self.text())
            time.sleep(0.05)
        return False

    def wait(self, timeout_s: float) -> int | None:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        for t in self._threads:
            t.join(5)
        return code

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM its process group, then SIGKILL what is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for t in self._threads:
            t.join(5)
        self._log.close()

    def tail(self, lines: int = 6) -> str:
        return "\n".join(self.text().rstrip().splitlines()[-lines:])


@dataclass
class Measure:
    """Per device, over one run: peak memory in use less page cache, the OOM killer's count, disk bytes read and CPU
    time used (at the start, at the first generated token, at the end)."""

    names: list[str]
    caps: list[int]
    watch: MemoryWatch
    oom_before: list[int]
    read_start: list[int]
    read_first: list[int] | None = None
    read_end: list[int] | None = None
    cpu_first: list[float | None] | None = None
    cpu_end: list[float | None] | None = None
    oom_after: list[int] = field(default_factory=list)
    first_at: float | None = None  # time.monotonic() of the first generated token
    first_processes: dict[str, dict[str, Any]] = field(default_factory=dict)  # each device's processes' memory then

    def summary(self, tokens: int, ttft_s: float | None = None, tpot_s: float | None = None) -> dict[str, Any]:
        """Per device. `pressure` is the paper's (Δ available memory over total memory, page cache aside) while the
        model runs: the peak of usage less page cache from the prompt's start (the first token less the TTFT) to the
        end, over the cap, from an empty cgroup (the system's own processes, their runtime included). Start-up
        (profiling, loading) is in `peak_start_mib`, not in the pressure. CPU time a token counts from the first
        token to the last (its time from the TPOT, its CPU between the watch's samples around it): the processes'
        exit stays out."""
        running = self.watch.peak_since(self.first_at - (ttft_s or 0.0) - 0.25) if self.first_at else None
        cpu_last = (self.watch.cpu_at(self.first_at + (tokens - 1) * tpot_s)
                    if self.first_at is not None and tpot_s is not None and tokens > 1 else self.cpu_end)
        out = {}
        for i, name in enumerate(self.names):
            peak = running[i] if running else self.watch.peak_used[i]
            rows = self.watch.summary()[name]["marks"]
            decoded = max(1, tokens - 1)
            per_token = (None if self.read_first is None or self.read_end is None
                         else round((self.read_end[i] - self.read_first[i]) / decoded / MiB, 2))
            cpu = (None if self.cpu_first is None or cpu_last is None or self.cpu_first[i] is None
                   or cpu_last[i] is None else round(1000 * (cpu_last[i] - self.cpu_first[i]) / decoded, 2))
            out[name] = {"peak_used_mib": round(peak / MiB, 1), "cap_mib": round(self.caps[i] / MiB, 1),
                         "pressure": round(peak / self.caps[i], 4),
                         "peak_start_mib": round(self.watch.peak_used[i] / MiB, 1),
                         "oom_kills": self.oom_after[i] - self.oom_before[i] if self.oom_after else 0,
                         "disk_read_mib": round((self.read_end or self.read_start)[i] / MiB - self.read_start[i] / MiB,
                                                1),
                         "disk_read_mib_per_token": per_token,
                         "cpu_ms_per_token": cpu,
                         "used_mib_at_marks": {r["mark"]: r["used"] for r in rows},
                         # what the usage is made of at the first token: the processes' anonymous memory (by
                         # process and mapping) and the kernel's
                         "at_first_token": {k: r[k] for r in rows if r["mark"] == "first token"
                                            for k in ("used", "anon", "kernel", "shmem")},
                         "processes_at_first_token": self.first_processes.get(name, {})}
        return out


class Rig:
    """The emulated devices for one run: `with Rig(devices, work, meminfo) as rig:` makes the cgroups (after
    removing what an interrupted run left), drops the page cache and starts the link proxy (recording every message
    in `trace_dir`, if given); on exit every process started with `spawn` is stopped and the cgroups removed. Device
    0 is where each system's head runs."""

    def __init__(self, devices: Sequence[Device], work: Path, meminfo: Path, *, drop_caches: bool = True,
                 trace_dir: Path | None = None) -> None:
        self.devices, self.work, self.meminfo, self.drop = list(devices), work, meminfo, drop_caches
        self.trace_dir = trace_dir
        self.groups: list[cgroups.Cgroup] = []
        self.proxy: LinkProxy | None = None
        self.procs: list[Proc] = []
        self.others: list[tuple[subprocess.Popen[Any], int, float]] = []  # started elsewhere: (process, device, when)

    def __enter__(self) -> Rig:
        try:
            cgroups.clean_stale()
            disk = cgroups.block_device(self.work if self.work.exists() else self.work.parent)
            for d in self.devices:
                caps = cgroups.Caps(memory_bytes=d.cap_bytes, read_bps=d.read_bps, cpus=d.cpus,
                                    cpu_period_us=CPU_PERIOD_US)
                self.groups.append(cgroups.Cgroup(d.name, caps, disk).create())
            if self.drop:
                cgroups.drop_caches()
            self.proxy = LinkProxy(self.trace_dir)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        for g in self.groups:
            g.remove()
        self.groups = []

    def folder(self, i: int) -> Path:
        d = self.work / self.devices[i].name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def copy(self, i: int, path: Path) -> Path:
        """Device i's own copy of a file (devices that shared one would share its page cache)."""
        return copy_model(path, self.folder(i) / path.name)

    def preexec(self, i: int) -> Callable[[], None]:
        group, meminfo = self.groups[i], self.meminfo

        def setup() -> None:
            group.preexec()
            enter_view(meminfo)

        return setup

    def spawn(self, i: int, argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None,
              name: str = "") -> Proc:
        """Start a program on device i: in its cgroup, seeing its memory, in its folder."""
        p = Proc(argv, log, self.preexec(i), cwd=self.folder(i), env=env, name=name, device=self.devices[i].name)
        self.procs.append(p)
        return p

    def watch(self, proc: subprocess.Popen[Any], i: int) -> None:
        """A process started on device i by other means than `spawn` (primaplug's nodes, by its own launcher): its
        exit is read with the others' (an OOM kill is told apart from a failure by it)."""
        self.others.append((proc, i, time.monotonic()))

    def exits(self) -> list[tuple[str, int, float | None]]:
        """(device, exit code, when its output ended, if known) of every process that has exited."""
        out = [(p.device, p.proc.returncode, p.ended) for p in self.procs if p.proc.poll() is not None]
        return out + [(self.devices[i].name, p.returncode, None) for p, i, _ in self.others if p.poll() is not None]

    def link(self, sender: int, endpoint: str, listen_port: int = 0, to: int | None = None) -> str:
        """The endpoint device `sender` connects to for `endpoint`: through its link (latency, bandwidth). `to`: the
        device that answers there (a server), named in the link's trace."""
        assert self.proxy is not None
        d = self.devices[sender]
        label = d.name if to is None else f"{d.name}>{self.devices[to].name}"
        return self.proxy.route(endpoint, d.link_latency_ms, d.link_mbit, listen_port, label)

    @contextlib.contextmanager
    def measure(self) -> Iterator[Measure]:
        m = Measure([d.name for d in self.devices], [d.cap_bytes for d in self.devices],
                    MemoryWatch(self.groups, interval_s=0.1), [g.oom_kills() for g in self.groups],
                    [g.read_bytes() for g in self.groups])
        m.watch.start()
        try:
            yield m
        finally:
            m.watch.mark("end")
            m.watch.stop()
            m.read_end = [g.read_bytes() for g in self.groups]
            m.cpu_end = [g.cpu_seconds() for g in self.groups]
            m.oom_after = [g.oom_kills() for g in self.groups]

    def first_token(self, m: Measure) -> None:
        """Mark the first generated token: disk bytes and CPU time per token count from here."""
        m.read_first = [g.read_bytes() for g in self.groups]
        m.cpu_first = [g.cpu_seconds() for g in self.groups]
        m.first_at = time.monotonic()
        m.watch.mark("first token")
        m.first_processes = m.watch.processes()


def listening(port: int) -> bool:
    """Whether something listens on TCP `port` of this machine (read from /proc/net/tcp, without connecting: a peer
    that takes its first connection for its root's would be confused by a probe)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def wait_listening(proc: Proc, port: int, timeout_s: float) -> bool:
    """Until `proc` listens on `port` (True), or exits, or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if listening(port):
            return True
        if proc.proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def free_port_block(n: int, start: int = 21000, stop: int = 60000, step: int = 997) -> int:
    """A base port b such that b .. b + n - 1 are all free on 127.0.0.1 (for peers that derive ports from one)."""
    for base in range(start, stop - n, step):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("0.0.0.0", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports between {start} and {stop}")
