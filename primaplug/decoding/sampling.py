"""Speculative sampling (Leviathan et al., 2023): a drafted token is kept with probability min(1, p(x) / q(x)), p the
target's distribution and q the draft's; otherwise a token is drawn from max(0, p - q), renormalised. The tokens
that come out follow p exactly, whatever q is; the closer q is to p, the more drafted tokens are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """The sampler settings of one generation, as llama-cpp-python's `generate` takes them."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


def draft_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a draft samples its token from: llama.cpp's chain (top-k, top-p, min-p on the raw logits,
    then the temperature) applied to one row of logits; one-hot on the argmax when greedy. Any q keeps the output's
    distribution exact; this one follows the target's so that most drafted tokens are kept."""
    logits = np.asarray(logits, dtype=np.float64)
    q = np.zeros(len(logits))
    if params.greedy:
        q[int(np.argmax(logits))] = 1.0
        return q
    keep = np.arange(len(logits))
    if 0 < params.top_k < len(logits):
        keep = np.argpartition(-logits, params.top_k - 1)[: params.top_k]
    keep = keep[np.argsort(-logits[keep], kind="stable")]
    x = logits[keep]
    raw = np.exp(x - x[0])
    raw /= raw.sum()
    if params.top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(raw), params.top_p)) + 1
        keep, x, raw = keep[:n], x[:n], raw[:n]
    if params.min_p > 0.0:
        n = max(1, int(np.sum(raw >= params.min_p * raw[0])))
        keep, x = keep[:n], x[:n]
    z = np.exp((x - x[0]) / params.temp)
    q[keep] = z / z.sum()
    return q


def accept_or_resample(p: np.ndarray, q: np.ndarray | None, token: int,
                       rng: np.random.Generator) -> tuple[int, bool]:
    """Verify a drafted `token`: (token, True) when it is kept, else (a token drawn from the residual, False).

    p: the target's distribution at this position; q: the distribution the draft drew `token` from (None: the
    draft chose it deterministically, q one-hot on it, as a prompt lookup does).
    """
    p = np.asarray(p, dtype=np.float64)
    q_token = 1.0 if q is None else float(q[token])
    if q_token <= 0.0:
        raise ValueError(f"the draft proposed token {token}, which its own distribution gives no probability")
    if rng.random() * q_token < p[token]:  # u < p(x) / q(x), without dividing
        return token, True
    residual = p.copy()
    if q is None:
        residual[token] = 0.0
    else:
        residual = np.maximum(residual - q, 0.0)
    total = residual.sum()
    if total <= 1e-12:  # p and q agree up to rounding: the residual is empty, so p itself is the right law
        residual, total = p, p.sum()
    return int(rng.choice(len(p), p=residual / total)), False
