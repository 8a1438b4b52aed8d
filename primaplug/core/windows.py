"""Layer windows and how pipelined-ring parallelism orders them.

A window is a half-open range of layers [start, end). With k rounds, each device holds k windows; a token
goes round the ring k times, and in each round every device runs one of its windows in ring order. The head
device comes last in the ring, so the model's final layer lands on it (prima.cpp does the same).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from primaplug.core.errors import WindowRangeError


@dataclass(frozen=True, order=True)
class LayerRange:
    """Layers [start, end) of a model."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise WindowRangeError(f"[{self.start}, {self.end}) is not a layer range: need 0 <= start <= end")

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def check_within(self, n_layer: int) -> None:
        """Raise WindowRangeError unless this window lies within [0, n_layer]."""
        if self.end > n_layer:
            raise WindowRangeError(
                f"window [{self.start}, {self.end}) is outside the model's layers [0, {n_layer}); "
                f"windows must satisfy 0 <= start <= end <= {n_layer}"
            )

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def even_split(n_layer: int, n_parts: int) -> list[int]:
    """Split n_layer layers into n_parts sizes that differ by at most one (the larger ones last)."""
    if n_parts < 1 or n_parts > n_layer:
        raise WindowRangeError(f"cannot split {n_layer} layers into {n_parts} non-empty parts")
    base, extra = divmod(n_layer, n_parts)
    return [base + (1 if i >= n_parts - extra else 0) for i in range(n_parts)]


def snap_sizes(sizes: Sequence[int], n_layer: int, barred: Sequence[int] = ()) -> list[int]:
    """Layers per device of one round (in ring order) with each boundary a barred start would take (a layer no window
    may start at: GLM 5.2's sharing an indexer) moved down to the nearest layer a window may start at (a device may
    be left with none: a relay)."""
    barred_set, ends, prev = set(barred), [], 0
    for end in itertools.accumulate(sizes):
        while end > prev and end < n_layer and end in barred_set:
            end -= 1
        ends.append(max(end, prev))
        prev = ends[-1]
    return [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def even_sizes(n_layer: int, n_nodes: int, rounds: int = 1, tail: int = 0, barred: Sequence[int] = ()) -> list[int]:
    """An even split by hand: each node's layers per round, then the head's (0: the output layer only). The last
    `tail` layers, which must share one window (Gemma 4's shared KV), go to the head, the others evenly to the
    nodes; with one round, no window starts at a barred layer (snap_sizes)."""
    if tail and rounds == 1 and n_layer - tail >= n_nodes:
        return [*even_split(n_layer - tail, n_nodes), tail]
    sizes = even_split(n_layer // rounds, n_nodes)
    return [*(snap_sizes(sizes, n_layer, barred) if rounds == 1 else sizes), 0]


def ring_windows(sizes: Sequence[int], rounds: int, n_layer: int) -> list[list[LayerRange]]:
    """The windows of each device, given each device's window size per round.

    sizes[i] is device i's layers per round, in ring order (the head last). Returns, per device, its
    `rounds` windows in the order it runs them. The sizes times the rounds must cover n_layer exactly.
    """
    if rounds < 1:
        raise WindowRangeError(f"rounds must be at least 1, got {rounds}")
    if any(s < 0 for s in sizes):
        raise WindowRangeError(f"window sizes must not be negative: {list(sizes)}")
    if sum(sizes) * rounds != n_layer:
        raise WindowRangeError(
            f"window sizes {list(sizes)} over {rounds} round(s) cover {sum(sizes) * rounds} layers, "
            f"the model has {n_layer}"
        )
    per_device: list[list[LayerRange]] = [[] for _ in sizes]
    layer = 0
    for _ in range(rounds):
        for device, size in enumerate(sizes):
            per_device[device].append(LayerRange(layer, layer + size))
            layer += size
    return per_device


def execution_order(per_device: Sequence[Sequence[LayerRange]]) -> list[LayerRange]:
    """The order in which a token visits the windows: round by round, device by device round the ring."""
    rounds = {len(ws) for ws in per_device}
    if len(rounds) != 1:
        raise WindowRangeError("every device must hold the same number of windows (one per round)")
    return [ws[r] for r in range(rounds.pop()) for ws in per_device]


def check_cover(windows: Sequence[LayerRange], n_layer: int) -> None:
    """Raise WindowRangeError unless the windows, in order, chain through layers [0, n_layer)."""
    layer = 0
    for w in windows:
        if w.start != layer:
            raise WindowRangeError(
                f"window {w} does not continue from layer {layer}: windows in ring order must chain "
                f"[0, a), [a, b), ... up to {n_layer}"
            )
        layer = w.end
    if layer != n_layer:
        raise WindowRangeError(f"the windows end at layer {layer}, the model has {n_layer} layers")
