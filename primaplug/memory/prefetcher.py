"""The prefetcher of a node: runs a PrefetchPlan's actions in its own thread, and counts what it did."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from primaplug.core.budget import READ_AHEAD_SLACK
from primaplug.memory.advice import Advisor
from primaplug.memory.policy import Action, PrefetchPlan, Schedule
from primaplug.memory.residency import resident_bytes
from primaplug.memory.system import major_faults, thread_major_faults

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Switches:
    """Each part can be turned off, for ablations."""

    prefetch: bool = True
    release: bool = True
    keep: bool = True
    # a node that streams goes layer by layer (True), whole windows (False), or (None) layer by layer only where a
    # whole window would leave more than READ_AHEAD_SLACK of itself to fault in page by page (docs/memory.md)
    layers: bool | None = None
    # layer by layer: the streamed layers that fit beside the kept part at once (the fewer, the more is kept); None: a
    # window's layers and one more, so that the next window is read while the others compute
    room_layers: int | None = None
    experts: bool = True  # a streaming mixture of experts reads only the routed experts (memory/experts.py)


@dataclass
class MemoryStats:
    bytes_prefetched: int = 0
    bytes_released: int = 0
    compute_major_faults: int = 0
    tokens: int = 0

    @property
    def major_faults_per_token(self) -> float:
        return self.compute_major_faults / self.tokens if self.tokens else 0.0


class Prefetcher:
    """Call window_started(i) before window i computes and window_done(i) after its output has been sent."""

    def __init__(self, path: str, plan: PrefetchPlan, switches: Switches = Switches()) -> None:
        self.path, self.plan, self.switches = path, plan, switches
        self.schedule = Schedule(plan, prefetch=switches.prefetch, release=switches.release)
        self.advisor = Advisor(path)
        self.stats = MemoryStats()
        self._queue: queue.Queue[Action | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._tid = 0
        self._own_faults = 0  # the prefetch thread's major faults when it last went idle
        self._faults_at_start = 0
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
        self._thread.start()
        log.info("memory: %s; prefetch by %s, release by %s", plan.describe(), self.advisor.mode,
                 self.advisor.release_mode)
        # the kept part, once, with read-ahead: a streaming plan's kept fraction, or a resident plan's whole windows
        # (as plain llama.cpp populates its mapping at load). Without it, it faults in page by page on first use, at
        # a fraction of the disk's rate (docs/memory.md): a 1.9 GB model's first token took 50 s here, 3.6 s with it.
        if switches.prefetch and plan.keep and (plan.mode == "resident" or switches.keep):
            self._submit(Action("prefetch", -1))
        for a in self.schedule.first():
            self._submit(a)

    @property
    def mode(self) -> str:
        return self.advisor.mode if self.plan.mode == "stream" else "resident (no windowing)"

    def _submit(self, action: Action) -> None:
        self._idle.clear()
        self._queue.put(action)

    def _ranges(self, action: Action) -> tuple[tuple[int, int], ...]:
        if action.window < 0:
            return self.plan.keep
        if action.kind == "prefetch":
            return self.plan.prefetch_ranges(action.window)
        return self.plan.stream[action.window]

    def _read_ahead(self, window: int) -> bool:
        """Prefetch with read-ahead when little of the window is left to fault in as it computes (at most
        READ_AHEAD_SLACK). With more, page by page was faster on the emulated cluster: 16.3 s a token against
        20.5 s with read-ahead (docs/memory.md)."""
        return window < 0 or self.plan.unprefetched_bytes(window) <= READ_AHEAD_SLACK

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        while True:
            action = self._queue.get()
            if action is None:
                return
            try:
                if action.kind == "prefetch":
                    self.stats.bytes_prefetched += self.advisor.prefetch(self._ranges(action),
                                                                         sequential=self._read_ahead(action.window))
                else:
                    self.stats.bytes_released += self.advisor.release(self._ranges(action))
            except OSError as e:
                log.warning("%s of window %d failed: %s", action.kind, action.window, e)
            if self._queue.empty():
                self._own_faults = thread_major_faults()  # before idle is set: see _compute_faults
                self._idle.set()

    # --- hooks around compute -----------------------------------------------------------------------------

    def _compute_faults(self) -> int:
        """Major faults of this process so far, less the prefetch thread's own. Only the ring thread submits
        actions, so while the prefetch thread is idle its count is the one it left when it went idle; only
        while it works must its count be read from the OS, which is slower (thread_major_faults)."""
        own = self._own_faults if self._idle.is_set() else thread_major_faults(self._tid)
        return major_faults() - own

    def window_started(self, i: int) -> None:
        self._faults_at_start = self._compute_faults()
        for a in self.schedule.started(i):
            self._submit(a)

    def window_done(self, i: int, *, last_of_token: bool) -> None:
        # not below 0: the prefetch thread's own count, read a moment apart from the process's, can run ahead
        self.stats.compute_major_faults += max(0, self._compute_faults() - self._faults_at_start)
        if last_of_token:
            self.stats.tokens += 1
        for a in self.schedule.done(i):
            self._submit(a)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        return self._idle.wait(timeout_s)

    # --- measurements -------------------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes of the node's windows (kept and streamed parts) in memory now."""
        ranges = list(self.plan.keep) + [r for w in self.plan.stream for r in w]
        return resident_bytes(self.path, ranges)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        self.advisor.close()
