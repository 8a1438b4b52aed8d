"""Plain llama-cpp-python on the whole model: the baseline every split run is checked and timed against."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import llama_cpp
import numpy as np

from primaplug.core.settings import usable_cores
from primaplug.engine import _log
from primaplug.engine.model import ContextSettings


@contextmanager
def plain_llama_forward(
    path: str | os.PathLike[str], settings: ContextSettings
) -> Iterator[Callable[[Sequence[int], int], np.ndarray]]:
    """An ordinary llama_cpp.Llama with the same context sizes, as forward(tokens, pos) -> last logits."""
    threads = settings.params().n_threads  # the windows' thread count (Llama's own default is half the cores)
    with plain_llama(path, n_ctx=settings.n_ctx, n_batch=settings.n_batch, n_ubatch=settings.n_ubatch,
                     n_threads=threads, n_threads_batch=threads, flash_attn=settings.flash_attn, logits_all=True,
                     verbose=False) as llm:

        def forward(tokens: Sequence[int], pos: int) -> np.ndarray:
            if pos == 0:
                llm.reset()
            if pos != llm.n_tokens:
                raise ValueError(f"plain Llama is at position {llm.n_tokens}, asked for {pos}")
            llm.eval(list(tokens))
            return llm.scores[llm.n_tokens - 1]

        yield forward


@contextmanager
def plain_llama(path: str | os.PathLike[str], **kwargs: Any) -> Iterator[llama_cpp.Llama]:
    """Plain llama-cpp-python on the whole model, with llama.cpp's log going where the engine sends it (not to the
    terminal), closed on exit: the reference of `run --verify` and of plain_llama_forward. Its threads default to
    the cores this process may use, as the windows' do: llama-cpp-python's own count the machine's (half of them,
    all of them for a prompt), so under `taskset` or `docker --cpuset-cpus` they would spin on the few allowed."""
    _log.install()
    kwargs.setdefault("n_threads", usable_cores())
    kwargs.setdefault("n_threads_batch", kwargs["n_threads"])
    llm = llama_cpp.Llama(os.fspath(path), **kwargs)
    try:
        yield llm
    finally:
        llm.close()


def teacher_forced_logits(llm: llama_cpp.Llama, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """The logits plain llama-cpp-python gives for each of `tokens` when fed the prompt and the tokens before it
    (one row per token: the prompt as one batch, then one token per decode, as generating decodes them), whatever
    it would have chosen itself."""
    n_vocab = llm.n_vocab()
    rows = np.empty((len(tokens), n_vocab), dtype=np.float32)
    llm.reset()
    for i, step in enumerate([list(prompt)] + [[t] for t in tokens[:-1]]):
        llm.eval(step)
        rows[i] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
    return rows


def is_eog(llm: llama_cpp.Llama, token: int) -> bool:
    """Whether a token ends a generation (end of turn, end of text), for any llama_cpp.Llama, ring or plain."""
    return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, token))
