"""The token loop: prefill the prompt in one batch, then one token at a time, timing both."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

# forward(tokens, first_position) -> logits of the batch's last token
Forward = Callable[[Sequence[int], int], np.ndarray]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated: int = 0
    ttft_s: float = 0.0  # prompt in, first token out
    decode_s: list[float] = field(default_factory=list)  # one per token after the first

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        return sum(self.decode_s) / len(self.decode_s) if self.decode_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s else 0.0


def generate(
    forward: Forward,
    prompt: Sequence[int],
    max_tokens: int,
    sample: Callable[[np.ndarray], int],
    is_end: Callable[[int], bool],
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield up to max_tokens sampled tokens, stopping after an end-of-generation token."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    t0 = time.perf_counter()
    logits = forward(prompt, 0)
    pos = len(prompt)
    for i in range(max_tokens):
        token = sample(logits)
        now = time.perf_counter()
        if i == 0:
            stats.ttft_s = now - t0
        else:
            stats.decode_s.append(now - t0)
        stats.generated += 1
        yield token
        if is_end(token) or i == max_tokens - 1:
            return
        t0 = time.perf_counter()
        logits = forward([token], pos)
        pos += 1
