"""Which bytes of a node's windows to keep, prefetch and release: a pure plan, and the events that drive it.

A node runs its windows in a cycle (one per round). When they all fit in its memory budget, everything stays
resident and nothing is advised per token. Otherwise each window's bytes are split: a fraction of every tensor
(hence of every layer, FlexInfer's finding) is kept resident for good, and the rest is streamed: prefetched
before the window runs and released after it has run, so the kernel never evicts the next window's prefetched
pages to make room (the paper's prefetch-release conflict).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from primaplug.core.budget import kept_fraction, slack_fraction

PAGE = mmap.PAGESIZE
Ranges = tuple[tuple[int, int], ...]  # (offset, length) in the file


@dataclass(frozen=True)
class Action:
    kind: Literal["prefetch", "release"]
    window: int


@dataclass(frozen=True)
class PrefetchPlan:
    mode: Literal["resident", "stream"]
    budget_bytes: int
    keep: Ranges  # resident for good, never released
    stream: tuple[Ranges, ...]  # per window: prefetched before it runs, released after
    early: bool  # whether the next window's prefetch starts when the current one starts (two fit at once)
    keep_fraction: float
    unit: str = "window"  # what one entry of `stream` is: a window, or a layer when a node streams layer by layer

    @property
    def lookahead(self) -> bool:
        """Layer by layer, a device prefetches as many layers ahead as fit beside the kept part (Schedule), each
        whole and with read-ahead; whole windows prefetch one window ahead, as much of it as prefetch_room."""
        return self.mode == "stream" and self.unit == "layer"

    @property
    def prefetch_room(self) -> int:
        """Bytes one prefetch may bring in: a window's streamed part, or what is left of the budget when that
        does not fit (the rest of the window then faults in as it computes)."""
        room = self.budget_bytes - self.keep_bytes
        return max(0, room // 2 if self.early else room)

    def unprefetched_bytes(self, window: int) -> int:
        """What of the window's streamed part a prefetch cannot bring in (it faults in as the window computes)."""
        return 0 if self.lookahead else max(0, self.stream_bytes[window] - self.prefetch_room)

    def prefetch_ranges(self, window: int) -> Ranges:
        if self.lookahead:  # the schedule asks for a layer only once it fits whole
            return self.stream[window]
        out, left = [], self.prefetch_room
        for off, n in self.stream[window]:
            if left <= 0:
                break
            take = min(n, left // PAGE * PAGE)
            if take > 0:
                out.append((off, take))
            left -= take
        return tuple(out)

    @property
    def stream_bytes(self) -> list[int]:
        return [sum(n for _, n in w) for w in self.stream]

    @property
    def keep_bytes(self) -> int:
        return sum(n for _, n in self.keep)

    def describe(self) -> str:
        if self.mode == "resident":
            return f"all windows fit in {self.budget_bytes >> 20} MiB: kept resident, no windowing"
        sizes = self.stream_bytes
        each = ", ".join(f"{b >> 20} MiB" for b in sizes) if len(sizes) <= 4 else \
            f"{len(sizes)} x {sum(sizes) // len(sizes) >> 20} MiB"
        when = "as many layers ahead as fit" if self.lookahead else \
            f"when the previous {self.unit} {'starts' if self.early else 'is released'}"
        return (f"streaming {each} per {self.unit}, keeping {self.keep_fraction:.0%} of every layer "
                f"({self.keep_bytes >> 20} MiB) within {self.budget_bytes >> 20} MiB, prefetch {when}")


def _split(ranges: Sequence[tuple[int, int]], fraction: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Keep the first `fraction` of each range (cut at a page boundary), stream the rest."""
    keep, stream = [], []
    for off, n in ranges:
        cut = (off + int(n * fraction)) // PAGE * PAGE if fraction > 0 else off
        cut = min(max(cut, off), off + n)
        if cut > off:
            keep.append((off, cut - off))
        if off + n > cut:
            stream.append((cut, off + n - cut))
    return keep, stream


def plan_prefetch(windows: Sequence[Sequence[tuple[int, int]]], budget_bytes: int, *,
                  keep: bool = True, unit: str = "window", slots: int | None = None) -> PrefetchPlan:
    """Plan for windows (or layers: `unit`) given as their tensors' byte ranges, within a budget for weights.

    With keep, the kept fraction is the largest that still leaves room for two streamed units at once
    (so the next can be prefetched while the current runs), or else for one, and at least room_slack beside it
    (core/budget.py: what else the node's memory holds must fit there). A single window that does not fit
    keeps nothing: keeping as much of it as the budget holds and letting the rest fault in was tried on the
    emulated cluster and ran 1.65x slower in a one-off run (docs/memory.md): the kernel cannot tell kept pages
    from the streamed ones faulting in beside them and evicts both. A node plans such a window layer by
    layer instead (device/memory.py: faults_in), releasing each layer as soon as it is done.
    `slots`: the streamed units the kept fraction leaves room for, instead of two (or one).
    """
    # sizes in whole pages: the kernel keeps and drops whole pages, and a layer's tensors rarely start on one
    # (with a layer per unit the rounding came to some 30 pages over the budget)
    sizes = [sum(-(-(off + n) // PAGE) - off // PAGE for off, n in w) * PAGE for w in windows]
    total = sum(sizes)
    if total <= budget_bytes or not windows:
        return PrefetchPlan("resident", budget_bytes, tuple(r for w in windows for r in w), tuple(() for _ in windows),
                            early=False, keep_fraction=1.0)
    largest = max(sizes)
    early = budget_bytes >= 2 * largest
    fraction = 0.0
    if keep:
        slots = slots or (2 if early else 1)
        fraction = min(kept_fraction(budget_bytes, total, largest, slots), slack_fraction(budget_bytes, total))
    kept: list[tuple[int, int]] = []
    streamed: list[Ranges] = []
    for w in windows:
        k, s = _split(w, fraction)
        kept += k
        streamed.append(tuple(s))
    return PrefetchPlan("stream", budget_bytes, tuple(kept), tuple(streamed), early, fraction, unit)


class Schedule:
    """Turns "window i starts" / "window i is done" into prefetch and release actions, cycling over the windows."""

    def __init__(self, plan: PrefetchPlan, *, prefetch: bool = True, release: bool = True) -> None:
        self.plan, self.prefetch, self.release = plan, prefetch, release
        self.n = len(plan.stream)
        # lookahead: the units asked for and not yet done, in order, and the next unit to ask for
        self._ahead: list[int] = []
        self._cursor = 0

    def _fill(self) -> list[Action]:
        """Lookahead: ask for the next units, in ring order, while they fit whole beside those in flight."""
        if not self.prefetch:
            return []
        sizes = self.plan.stream_bytes
        room = self.plan.budget_bytes - self.plan.keep_bytes - sum(sizes[u] for u in self._ahead)
        acts = []
        while len(self._ahead) < self.n and sizes[self._cursor] <= room:
            acts.append(Action("prefetch", self._cursor))
            self._ahead.append(self._cursor)
            room -= sizes[self._cursor]
            self._cursor = self._next(self._cursor)
        return acts

    def _next(self, i: int) -> int:
        return (i + 1) % self.n

    def first(self) -> list[Action]:
        """Before the first token: bring in the first window (everything, when it all fits)."""
        if self.plan.mode == "resident" or not self.prefetch:
            return []
        return self._fill() if self.plan.lookahead else [Action("prefetch", 0)]

    def started(self, i: int) -> list[Action]:
        if self.plan.mode == "resident" or not self.prefetch or not self.plan.early or self.n == 1 or \
                self.plan.lookahead:
            return []
        return [Action("prefetch", self._next(i))]

    def done(self, i: int) -> list[Action]:
        if self.plan.mode == "resident":
            return []
        acts = [Action("release", i)] if self.release else []
        if self.plan.lookahead:
            if i in self._ahead:
                self._ahead.remove(i)
            return acts + self._fill()
        if self.prefetch and (not self.plan.early or self.n == 1):
            acts.append(Action("prefetch", self._next(i)))
        return acts
