"""Timing a generation the same way for every run: greedy tokens after a prompt of fixed ids."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def prompt_tokens(n: int) -> list[int]:
    """The prompt every testbed run uses: the same ids for the baseline and the ring."""
    return [3 + (7 * i) % 250 for i in range(n)]


def time_greedy(llm: Any, prompt: int, tokens: int, after_prompt: Callable[[], None] | None = None) -> dict[str, Any]:
    """TTFT (the prompt's evaluation), TPOT (median over the decoded tokens) and the tokens, for a
    llama_cpp.Llama (or primaplug.Llama) made with logits_all=True: llama-cpp-python 0.3 fills `scores` only then.
    `after_prompt` runs between the prompt and the first decoded token (to read counters before decoding)."""
    t0 = time.perf_counter()
    llm.eval(prompt_tokens(prompt))
    ttft = time.perf_counter() - t0
    if after_prompt is not None:
        after_prompt()
    out, times = [], []
    for _ in range(tokens):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        t0 = time.perf_counter()
        llm.eval([out[-1]])
        times.append(time.perf_counter() - t0)
    return {"ttft_s": round(ttft, 3), "tpot_s": round(statistics.median(times), 3),
            "token_s": [round(t, 3) for t in times], "tokens": out}


def time_generation(llm: Any, prompt: Sequence[int], tokens: int) -> dict[str, Any]:
    """`tokens` greedy tokens through llama-cpp-python's own loop (`Llama.generate`, where a draft model plugs in),
    from a cleared context. TTFT: the call to the first token (the prompt's evaluation and one sample). TPOT over
    the whole generation, (last token's time - first token's) / (tokens - 1), as speculative decoding yields
    tokens in bursts (a median per token would hide its slow steps)."""
    llm.reset()  # no prefix reuse: every run evaluates its whole prompt
    out: list[int] = []
    stamps: list[float] = []
    t0 = time.perf_counter()
    gen = llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0)
    for tok in gen:
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) == tokens:
            break
    gen.close()
    decode = stamps[-1] - stamps[0]
    return {"ttft_s": round(stamps[0] - t0, 4), "tpot_s": round(decode / max(1, tokens - 1), 4),
            "decode_s": round(decode, 4), "tokens": out}
