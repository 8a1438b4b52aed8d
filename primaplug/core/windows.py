"""Layer windows and how pipelined-ring parallelism orders them.

A window is a half-open range of layers [start, end). With k rounds, each device holds k windows; a token
goes round the ring k times, and in each round every device runs one of its windows in ring order. The head
device comes last in the ring, so the model's final layer lands on it (prima.cpp does the same).
"""

from __future__ import annotations

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
