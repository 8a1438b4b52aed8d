"""Shared by the ring tests: plain llama-cpp-python on the whole model, and greedy decoding with all logits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Compute threads per process. `make test` runs two workers on two cores, and ggml's threads spin at the barriers
# between a graph's ops: two threads a process beside the other worker's wait out a time slice at each barrier (a
# synthetic model's streamed test took 0.9 s alone and 17 s beside two busy cores). Tests of the threads
# themselves (test_engine_affinity, test_ring's idle nodes) set their own.
THREADS = 1

# the sizes every ring test uses, for the ring and for plain llama-cpp-python alike
LLAMA_KWARGS: dict[str, Any] = dict(n_ctx=256, n_batch=64, n_ubatch=32, n_threads=THREADS, n_threads_batch=THREADS,
                                    logits_all=True, verbose=False)


def greedy_scores(llm: Any, prompt: Sequence[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Evaluate the prompt, then `steps` greedy tokens; returns the tokens and every logit row computed."""
    llm.reset()
    llm.eval(list(prompt))
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens, np.array(llm.scores[: llm.n_tokens])


def assert_same(ring: tuple[list[int], np.ndarray], plain: tuple[list[int], np.ndarray]) -> None:
    assert ring[0] == plain[0], "greedy tokens differ from plain llama-cpp-python"
    scale = float(np.abs(plain[1]).max(axis=1, keepdims=True).min())
    diff = np.abs(ring[1] - plain[1]).max(axis=1) / np.abs(plain[1]).max(axis=1)
    assert diff.max() <= 1e-3, f"logits differ by up to {diff.max():.2e} of the row's largest (scale {scale})"


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll `condition` until it holds; fail naming `what` after timeout_s (a bound on a hang, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)
