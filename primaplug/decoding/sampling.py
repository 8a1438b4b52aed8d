"""A seeded sampler over one row of logits: temperature, top-k, top-p; temperature 0 is greedy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults; temperature <= 0 means greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(np.argmax(logits))
        if 0 < p.top_k < len(logits):
            ids = np.argpartition(logits, -p.top_k)[-p.top_k :]  # O(n): the vocabulary can be 262k
            ids = ids[np.argsort(logits[ids])[::-1]]
        else:
            ids = np.argsort(logits)[::-1]
        z = logits[ids].astype(np.float64) / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
        return int(self._rng.choice(ids, p=probs))
