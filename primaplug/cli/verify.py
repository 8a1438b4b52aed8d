"""`run --verify`: plain llama-cpp-python on the whole model against what the ring gave: the tokens, generated again
with the same seed, and the logits of every generated token, with plain fed the ring's tokens.

What the ring promises depends on the kernels its devices compute with (Cluster.kernels: each device's CPU kernels,
engine.cpu_kernels, from each node's Welcome, and whether it runs layers on a GPU):
- the CPU kernels of the head everywhere: plain's tokens and plain's logits, bit for bit;
- others anywhere (an ARM phone beside an x86 desktop, layers on a GPU): each device rounds its layers the way its
  kernels do, so plain llama-cpp-python on the head's CPU is not the reference bit for bit. The ring is held to a
  logit distance instead, measured between such rings and plain (benchmarks/mixed_cpus.py, docs/platforms.md), and
  where its greedy tokens part from plain's, to plain's top two being closer than that distance there: a near tie
  that either rounding may break."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from primaplug.cli.common import say

# the largest difference between a ring's logits and plain's, as a fraction of the row's largest |logit|, that a ring
# of mixed kernels may show: about 2.7x the largest measured, 9.1% (the bundled Gemma, 300 tokens, an emulated
# Cortex-A76 node beside x86 AVX-512 ones; plain llama-cpp-python on that ARM CPU alone was as far from the x86's;
# benchmarks/results/mixed_cpus.json, docs/platforms.md). Rings of the head's CPU kernels alone show 0.
MIXED_KERNELS_TOLERANCE = 0.25


@dataclass(frozen=True)
class RingOutput:
    """What `run` generated, for verify: the prompt's tokens, the generated ones, the logits each was drawn from
    (one row per token; None where not kept) and each device's CPU kernels by name."""

    prompt: list[int]
    tokens: list[int]
    logits: np.ndarray | None
    kernels: dict[str, str]

    @property
    def exact(self) -> bool:
        """Whether every device computes with the head's CPU kernels (plain's here), and none on a GPU."""
        head = self.kernels.get("head", "")
        return "GPU" not in head and all(k in ("", head) for k in self.kernels.values())

    def describe_kernels(self) -> str:
        groups: dict[str, list[str]] = {}
        for name, kernels in self.kernels.items():
            groups.setdefault(kernels or "unknown (an older node)", []).append(name)
        return "; ".join(f"{', '.join(names)}: {kernels}" for kernels, names in groups.items())


@dataclass(frozen=True)
class LogitDistance:
    """The ring's logits against plain's, fed the same tokens, row by row."""

    per_row: np.ndarray  # largest absolute difference of each row
    relative: np.ndarray  # the same over the row's largest |logit| (plain's), as tests/test_windows_match_llama.py
    greedy_agree: int  # rows whose largest logit is the same token on both sides

    @classmethod
    def of(cls, ring: np.ndarray, plain: np.ndarray) -> LogitDistance:
        per_row = np.abs(ring - plain).max(axis=1)
        return cls(per_row, per_row / np.maximum(np.abs(plain).max(axis=1), 1e-30),
                   int((ring.argmax(axis=1) == plain.argmax(axis=1)).sum()))

    @property
    def largest(self) -> float:
        return float(self.per_row.max()) if len(self.per_row) else 0.0

    @property
    def largest_relative(self) -> float:
        return float(self.relative.max()) if len(self.relative) else 0.0

    def describe(self) -> str:
        n = len(self.per_row)
        return (f"fed the ring's tokens, plain's logits differ from the ring's by at most {self.largest:.3g} "
                f"({self.largest_relative:.2%} of the row's largest logit; mean {float(self.per_row.mean()):.3g}), "
                f"and its greedy choice is the ring's at {self.greedy_agree} of {n} tokens")


def first_difference(a: list[int], b: list[int]) -> int | None:
    where = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if where is None and len(a) != len(b):
        where = min(len(a), len(b))
    return where


def verify(path: Path, text: str, ring: RingOutput, kwargs: dict[str, Any], sampling: dict[str, Any],
           n_predict: int) -> int:
    """Compare, say what was found, and return the exit status: 0 when the ring kept its promise."""
    from primaplug.cli.run import generated
    from primaplug.engine.reference import plain_llama, teacher_forced_logits

    t0 = time.perf_counter()
    with plain_llama(path, **kwargs) as llm:
        plain = list(generated(llm, llm.tokenize(text.encode()), n_predict, sampling))
        where = first_difference(ring.tokens, plain)

        def show(seq: list[int]) -> str:
            assert where is not None
            text = repr(llm.detokenize(seq[where : where + 1]).decode("utf-8", "replace")) if where < len(seq) \
                else "the end"
            return f"{text} ({seq[where] if where < len(seq) else '-'})"

        differ = "" if where is None else (
            f"they first differ at generated token {where + 1} of {max(len(ring.tokens), len(plain))}, where the "
            f"ring gave {show(ring.tokens)} and plain gave {show(plain)}")
        plain_rows = None
        if ring.logits is not None and ring.tokens:
            plain_rows = teacher_forced_logits(llm, ring.prompt, ring.tokens)
    elapsed = f"{time.perf_counter() - t0:.1f} s"
    distance = LogitDistance.of(ring.logits, plain_rows) if plain_rows is not None else None

    if ring.exact:
        if where is not None:
            logits = f"; {distance.describe()}" if distance is not None else ""
            say(f"plain llama-cpp-python on the whole model gave DIFFERENT tokens: {differ}{logits}")
            return 1
        if distance is not None and distance.largest > 0:
            say(f"plain llama-cpp-python on the whole model gave the same {len(plain)} tokens but DIFFERENT logits: "
                f"{distance.describe()} ({elapsed})")
            return 1
        same_logits = ", and the same logits for each" if distance is not None else ""
        say(f"plain llama-cpp-python on the whole model gave the same {len(plain)} tokens{same_logits} ({elapsed})")
        return 0

    say(f"this ring mixes kernels ({ring.describe_kernels()}): each device rounds its layers its own way, so plain "
        "llama-cpp-python on the head's CPU is not its bit-for-bit reference; it is held to logits within "
        f"{MIXED_KERNELS_TOLERANCE:.0%} of each row's largest of plain's (docs/platforms.md, \"Rings that mix CPUs\")")
    if distance is None:
        say("no logits were kept to compare: tokens only")
    else:
        say(distance.describe())
    ok = distance is None or distance.largest_relative <= MIXED_KERNELS_TOLERANCE
    if where is None:
        say(f"plain gave the same {len(plain)} tokens ({elapsed})")
    elif distance is not None and plain_rows is not None and sampling.get("temp", 0) <= 0 and where < len(plain) \
            and where < len(ring.tokens):
        # greedy: the two part where plain's choice and the ring's are closer than the rounding between them
        gap = float(plain_rows[where, plain[where]] - plain_rows[where, ring.tokens[where]])
        tie = gap <= 2 * float(distance.per_row[where])
        say(f"plain's tokens part from the ring's: {differ}; plain's logits for the two differ by {gap:.3g} there, "
            + (f"within twice the rounding distance there ({float(distance.per_row[where]):.3g}): a near tie"
               if tie else f"more than twice the rounding distance there ({float(distance.per_row[where]):.3g})"))
        ok = ok and tie
    else:
        say(f"plain's tokens part from the ring's: {differ} (sampled: a small difference in the logits can change "
            "a draw)")
    say("within the mixed-kernel promise" if ok else "OUTSIDE the mixed-kernel promise")
    return 0 if ok else 1
