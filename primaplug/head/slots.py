"""The sequences of a primaplug.Llama (its n_parallel requests in flight) and who holds them.

A request takes the free sequence whose cache holds the longest prefix of its prompt (llama.cpp's server does the
same), so a conversation that goes on finds its earlier turns still on the ring; among equals, the one free the
longest. A request waits while every sequence is busy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# the share of a sequence's cache a prompt must go on from for the cache to be reused (a continued conversation;
# not 1.0: the earlier answer, tokenized again as part of the prompt, may end in other tokens than were sampled)
CONTINUES = 0.9


class Slots:
    def __init__(self, slots: Sequence[Any]) -> None:
        self.all = list(slots)
        self.free = list(slots)  # the one free the longest first
        self.waiting = 0
        self._cond = threading.Condition()

    @property
    def size(self) -> int:
        return len(self.all)

    @property
    def running(self) -> int:
        """Sequences held by a request now."""
        return len(self.all) - len(self.free)

    def acquire(self, prompt: str | Sequence[int], tokenize: Callable[..., list[int]]) -> Any:
        """A free sequence for this prompt (waits while none is free). With several, its cache is reused only when
        the prompt goes on from (nearly) all of it: a conversation that continues. Otherwise it starts afresh, so
        that what a sequence served before, which depends on the other requests in flight, never changes how a
        prompt is evaluated (llama.cpp rounds a prompt evaluated after a cached prefix differently from the whole
        prompt at once: a near tie could change a greedy token). A Llama of one sequence reuses any common prefix,
        as llama_cpp.Llama does."""
        tokens = list(prompt) if not isinstance(prompt, str) else tokenize(prompt.encode("utf-8"), add_bos=True,
                                                                            special=True)
        with self._cond:
            self.waiting += 1
            try:
                while not self.free:
                    self._cond.wait()
            finally:
                self.waiting -= 1
            slot = max(self.free, key=lambda s: _shared(s, tokens))
            self.free.remove(slot)
        if self.size > 1 and _shared(slot, tokens) < CONTINUES * int(slot.n_tokens):
            slot.reset()
        return slot

    def release(self, slot: Any) -> None:
        with self._cond:
            self.free.append(slot)
            self._cond.notify()

    def others(self, first: Any) -> list[Any]:
        return [s for s in self.all if s is not first]


def _shared(slot: Any, tokens: Sequence[int]) -> int:
    """How many leading tokens of the prompt the slot's cache holds (max() keeps the first of equals)."""
    n = min(int(slot.n_tokens), len(tokens))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(slot.input_ids[:n]) != np.asarray(tokens[:n]))
    return int(differ[0]) if len(differ) else n
