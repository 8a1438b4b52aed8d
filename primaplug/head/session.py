"""A session: the one place that owns a conversation on the ring.

It holds the prefix (the tokens whose keys and values the ring's caches hold for its sequence, position by
position), applies the failure policy, and publishes what it does. Several sessions share one ring, each on a
sequence of its own (seq_id): their batches go to the ring's driver (head/batching.py), which sends them round
together. llama-cpp-python's prefix
reuse, speculative decoding's rollback and recovery onto a new ring all go through it:

- eval(tokens, pos0): rewinds to pos0 first when the prefix is longer, then sends the tokens in batches of n_batch;
- rewind(pos): forget positions pos and after. It costs no trip: the ring's caches keep those positions until the
  next batch, which starts at pos, and every window forgets from a batch's first position on before computing it
  (engine Window.forward). A rejected draft is rewound for free, in the trip that carries the next one;
- replay(ring): rebuild the prefix on another ring (a new assignment), then carry on there.

Failure policy: when a batch or a KV operation fails, the ring's caches are in an unknown state. The error goes
to the caller; the prefix up to the last batch that completed is kept, and the next call first clears the ring
and replays that prefix onto it, so the conversation goes on where it was if the ring works again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from primaplug.core.errors import NodeUnavailableError, PrimaplugError
from primaplug.head.events import BatchDone, Events, NodeProgress, SessionChanged

log = logging.getLogger(__name__)

# output(rows of logits (or hidden states), position of the first row): what the caller does with a batch's result
Output = Callable[[np.ndarray, int], None]


class Ring(Protocol):
    """What a session needs of the ring (head/batching.py: Batcher)."""

    epoch: int

    def forward(self, tokens: Sequence[int], pos0: int, *, seq_id: int = 0, all_rows: bool = False,
                hidden: bool = False) -> np.ndarray: ...

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None: ...


class Session:
    def __init__(self, ring: Ring, *, n_batch: int, events: Events | None = None, seq_id: int = 0) -> None:
        if n_batch < 1:
            raise PrimaplugError(f"n_batch must be at least 1, got {n_batch}")
        self.ring = ring
        self.n_batch = n_batch
        self.events = events or Events()
        self.seq_id = seq_id
        self.prefix: list[int] = []
        self.held = 0  # positions the ring's caches hold: the prefix, then what a rewind left for the next batch
        self._steps = itertools.count(1)
        self._stale = False  # a failure left the ring's caches unknown: clear and replay before going on

    @property
    def n_past(self) -> int:
        """Positions the ring's caches hold for this session."""
        return len(self.prefix)

    @property
    def epoch(self) -> int:
        """The assignment the session's ring runs."""
        return self.ring.epoch

    def eval(self, tokens: Sequence[int], pos0: int, *, all_rows: bool = False, hidden: bool = False,
             output: Output | None = None) -> None:
        """Evaluate `tokens` at positions pos0, pos0 + 1, ...: the prefix is rewound to pos0 first (a conversation
        that goes another way from there), which must not lie past its end. `output` gets each batch's logits
        (hidden: its hidden states after the last layer): every row with all_rows, else the batch's last row."""
        if pos0 > len(self.prefix):
            raise PrimaplugError(f"cannot evaluate from position {pos0}: the ring holds {len(self.prefix)} positions")
        self._recover()
        self.rewind(pos0)
        for i in range(0, len(tokens), self.n_batch):
            batch = [int(t) for t in tokens[i : i + self.n_batch]]
            p = pos0 + i
            step = next(self._steps)
            t0 = time.perf_counter()
            try:
                out = self.ring.forward(batch, p, seq_id=self.seq_id, all_rows=all_rows, hidden=hidden)
            except BaseException as e:
                self._failed(f"step {step} ({len(batch)} token(s) at position {p}): {e}", e)
                raise
            self.prefix.extend(batch)
            self.held = len(self.prefix)
            self.events.publish(BatchDone(step, p, len(batch), time.perf_counter() - t0))
            if output is not None:
                output(out, p + len(batch) - len(out))

    def rewind(self, pos: int) -> None:
        """Forget positions pos, pos + 1, ... (nothing to do when the prefix ends before pos); the devices forget
        them when the next batch, which starts at pos, reaches them."""
        if pos < 0:
            raise PrimaplugError(f"cannot rewind to position {pos}")
        self._recover()
        if pos >= len(self.prefix):
            return
        del self.prefix[pos:]
        self.events.publish(SessionChanged("rewind", pos))

    def clear(self) -> None:
        """Forget the whole conversation, on every device."""
        try:
            self.ring.kv_remove(self.seq_id, 0)
        except BaseException as e:
            self._failed(f"clearing the caches: {e}", e)
            raise
        self.prefix.clear()
        self.held = 0
        self._stale = False
        self.events.publish(SessionChanged("clear", 0))

    def replay(self, ring: Ring | None = None) -> None:
        """Rebuild the prefix's keys and values on `ring` (default: the session's own ring, after a failure) and go
        on there: the new ring's caches are cleared, then the prefix goes round it in batches."""
        if ring is not None:
            self.ring = ring
        prefix, t0 = list(self.prefix), time.perf_counter()
        try:
            self.clear()
            self.eval(prefix, 0)
        except BaseException:
            self.prefix, self._stale = prefix, True  # still to rebuild: the next call tries again
            raise
        self.events.publish(SessionChanged("replay", len(self.prefix),
                                           f"{len(prefix)} tokens in {time.perf_counter() - t0:.2f} s"))

    def _failed(self, what: str, error: BaseException) -> None:
        self._stale = True
        if isinstance(error, NodeUnavailableError):  # the node that went silent is named: show it as failed
            self.events.publish(NodeProgress(error.node, "failed", 0.0, str(error)))
        log.warning("the ring failed at %s; the next request first replays the %d positions before it", what,
                    len(self.prefix))
        self.events.publish(SessionChanged("failed", len(self.prefix), what))

    def _recover(self) -> None:
        if self._stale:
            log.info("replaying %d positions onto the ring after a failure", len(self.prefix))
            self.replay()
