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
- replay(ring): rebuild the prefix on another ring (a new assignment), then carry on there. The prefix goes round
  in the batches it first went round in (a batch of 16 rows or more rounds differently from the same rows split
  otherwise, core/settings.py EXACT_BATCH_ROWS), but for runs of smaller ones, joined up to 15 rows (each row of such
  a batch is computed as alone), so the rebuilt caches hold the same numbers and the conversation goes on with the
  tokens it would have had.

Failure policy: when a batch or a KV operation fails, the ring's caches are in an unknown state. With a `reform`
(head/recovery.py), a node's loss or restart re-forms the ring from the devices left (re-plan, deploy under a new
assignment), the prefix is replayed onto it, and the call goes on there: the caller sees nothing but the time it
took. Without one, or when the ring cannot be re-formed, the error goes to the caller; the prefix up to the last
batch that completed is kept, and the next call first clears the ring and replays that prefix onto it, so the
conversation goes on where it was if the ring works again. A session also notices, at its next call, that another
session re-formed the ring, and replays its own prefix there first.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from primaplug.core.errors import NodeError, NodeUnavailableError, PrimaplugError, RecurrentRewindError
from primaplug.core.settings import EXACT_BATCH_ROWS
from primaplug.head.events import BatchDone, Events, NodeProgress, SessionChanged

log = logging.getLogger(__name__)

# output(rows of logits (or hidden states), position of the first row): what the caller does with a batch's result
Output = Callable[[np.ndarray, int], None]
# a call re-forms the ring at most this many times before its error goes to the caller
MAX_REFORMS = 3


class Ring(Protocol):
    """What a session needs of the ring (head/batching.py: Batcher)."""

    epoch: int

    def forward(self, tokens: Sequence[int], pos0: int, *, seq_id: int = 0, all_rows: bool = False,
                hidden: bool = False) -> np.ndarray: ...

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None: ...


class Reform(Protocol):
    """What re-forms the ring when a node is lost (head/recovery.py: Recovery)."""

    def current(self) -> Ring:
        """The ring sessions run on now."""
        ...

    def __call__(self, failed: Ring, error: BaseException) -> Ring:
        """The ring to go on with after `failed` raised `error`: a new one, or `failed` itself when it works (a
        message lost in a short network drop). Raises when the ring cannot be re-formed."""
        ...


def recoverable(error: BaseException) -> bool:
    """Whether an error may be a lost or restarted node (worth re-forming the ring), not a request's own fault."""
    return isinstance(error, NodeUnavailableError | NodeError)


def coalesce(batches: Sequence[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The batches a replay sends: each batch of EXACT_BATCH_ROWS rows or more as it went; runs of smaller ones that
    follow on from each other (decoded tokens, verified drafts) joined up to EXACT_BATCH_ROWS rows, which computes
    every row as it was computed alone (core/settings.py), in one trip instead of one a token."""
    out: list[tuple[int, list[int]]] = []
    for p, batch in batches:
        small = len(batch) <= EXACT_BATCH_ROWS
        if out and small and out[-1][0] + len(out[-1][1]) == p and len(out[-1][1]) + len(batch) <= EXACT_BATCH_ROWS:
            out[-1] = (out[-1][0], out[-1][1] + list(batch))
        else:
            out.append((p, list(batch)))
    return out


class Session:
    """`rewindable` False: the model has recurrent layers (gated delta-net, short convolutions), whose state cannot
    forget positions. A rewind may then only clear the conversation (llama-cpp-python evaluates the prompt anew then,
    as it does on such a model alone), or, with `rollback` snapshots a token (ContextSettings.n_rs_seq), forget up to
    that many of the last batch's tokens once before the next batch: a rejected draft. A replay joins small batches
    as for any model: their layers compute each row of up to EXACT_BATCH_ROWS as alone too (the logits bit for
    bit, LOG.md)."""

    def __init__(self, ring: Ring, *, n_batch: int, events: Events | None = None, seq_id: int = 0,
                 reform: Reform | None = None, rewindable: bool = True, rollback: int = 0) -> None:
        if n_batch < 1:
            raise PrimaplugError(f"n_batch must be at least 1, got {n_batch}")
        self.ring = ring
        self.rewindable = rewindable
        self.rollback = rollback
        self._rolled_back = False  # a recurrent state rolled back since the last batch (llama.cpp allows one)
        self.n_batch = n_batch
        self.events = events or Events()
        self.seq_id = seq_id
        self.reform = reform
        self._reformed = ring  # the ring the session last took from `reform` (replay(ring) may move it elsewhere)
        self.prefix: list[int] = []
        # the batches the prefix went round in, (first position, tokens): a replay sends the same ones; the last may
        # run past the prefix (a rewind)
        self.batches: list[tuple[int, list[int]]] = []
        self.held = 0  # positions the ring's caches hold: the prefix, then what a rewind left for the next batch
        self._steps = itertools.count(1)
        self._stale = False  # a failure left the ring's caches unknown: clear and replay before going on
        self._depth = 0  # calls of this session under way (a replay evaluates inside the call that re-formed)
        self._reforms = 0  # re-formings during the outermost call

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
        with self._call():
            self.rewind(pos0)  # and, after a failure, rebuild what comes before pos0
            for i in range(0, len(tokens), self.n_batch):
                batch = [int(t) for t in tokens[i : i + self.n_batch]]
                p = pos0 + i
                step = next(self._steps)
                t0 = time.perf_counter()
                out = self._on_ring(f"step {step} ({len(batch)} token(s) at position {p})", lambda ring, b=batch, p=p:
                                    ring.forward(b, p, seq_id=self.seq_id, all_rows=all_rows, hidden=hidden))
                self.prefix.extend(batch)
                self.batches.append((p, batch))
                self._rolled_back = False
                self.held = len(self.prefix)
                self.events.publish(BatchDone(step, p, len(batch), time.perf_counter() - t0))
                if output is not None:
                    output(out, p + len(batch) - len(out))

    def can_rewind(self, pos: int) -> bool:
        """Whether the ring can forget positions pos and after: always, but on recurrent layers only all of them
        (pos 0), none (pos at the prefix's end or past it), or the last batch's last `rollback` tokens at most, once
        (the states' snapshots are those of the last batch's tokens)."""
        if self.rewindable or not 0 < pos < len(self.prefix):
            return True
        return (self.rollback > 0 and not self._rolled_back and bool(self.batches) and self.batches[-1][0] < pos
                and len(self.prefix) - pos <= self.rollback)

    def rewind(self, pos: int) -> None:
        """Forget positions pos, pos + 1, ... (nothing to do when the prefix ends before pos); the devices forget
        them when the next batch, which starts at pos, reaches them."""
        if pos < 0:
            raise PrimaplugError(f"cannot rewind to position {pos}")
        if not self.can_rewind(pos):
            raise RecurrentRewindError(pos, len(self.prefix))
        with self._call():
            self._follow()
            if pos < len(self.prefix):
                self._rolled_back = not self.rewindable and pos > 0
                del self.prefix[pos:]
                while self.batches and self.batches[-1][0] >= pos:  # one partly kept stays: a replay rewinds after it
                    self.batches.pop()
                self.events.publish(SessionChanged("rewind", pos))
            self._recover()  # after a failure, only what is kept is rebuilt

    def clear(self) -> None:
        """Forget the whole conversation, on every device."""
        with self._call():
            self._follow()
            self._on_ring("clearing the caches", lambda ring: ring.kv_remove(self.seq_id, 0))
        self.prefix.clear()
        self.batches.clear()
        self.held = 0
        self._stale = False
        self.events.publish(SessionChanged("clear", 0))

    def replay(self, ring: Ring | None = None) -> None:
        """Rebuild the prefix's keys and values on `ring` (default: the session's own ring, after a failure) and go
        on there: the new ring's caches are cleared, then the prefix goes round it in the batches it first went
        round in, and positions past it are rewound."""
        if ring is not None:
            self.ring = ring
        prefix, batches, t0 = list(self.prefix), list(self.batches), time.perf_counter()
        try:
            with self._call():
                self._stale = False
                self.clear()
                for p, batch in coalesce(batches):
                    self.eval(batch, p)
                self.rewind(len(prefix))
        except BaseException:
            self.prefix, self.batches, self._stale = prefix, batches, True  # still to rebuild: the next call tries
            raise
        self.events.publish(SessionChanged("replay", len(self.prefix),
                                           f"{len(prefix)} tokens in {time.perf_counter() - t0:.2f} s"))

    # --- failures ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Counts the re-formings of one call from outside (a replay inside it is part of the same call)."""
        if not self._depth:
            self._reforms = 0
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _follow(self) -> None:
        """Another session re-formed the ring: this one's prefix must be rebuilt there before it goes on."""
        if self.reform is not None and self.reform.current() is not self._reformed:
            self.ring = self._reformed = self.reform.current()
            self._stale = True

    def _on_ring(self, what: str, call: Callable[[Ring], Any]) -> Any:
        """call(ring) on the session's ring; when it fails for a node's loss, the ring is re-formed, the prefix
        replayed onto it, and the call made again there."""
        while True:
            ring = self.ring
            try:
                return call(ring)
            except BaseException as e:
                moved = self.reform is not None and self.reform.current() is not self._reformed
                if self.reform is None or not (moved or recoverable(e)) or self._reforms >= MAX_REFORMS:
                    self._failed(f"{what}: {e or type(e).__name__}", e, reforming=False)
                    raise
                self._reforms += 1
                if not moved:
                    self._failed(f"{what}: {e}", e, reforming=True)
                self.ring = self._reformed = self.reform(ring, e)
                self._stale = True
                self._recover()

    def _failed(self, what: str, error: BaseException, reforming: bool) -> None:
        self._stale = True
        if isinstance(error, NodeUnavailableError):  # the node that went silent is named: show it as failed
            self.events.publish(NodeProgress(error.node, "failed", 0.0, str(error)))
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C or SIGTERM (cli.Terminated): no failure of the ring's
            log.info("interrupted at %s; the next request first replays the %d positions before it", what,
                     len(self.prefix))
        else:
            then = "the ring is re-formed and" if reforming else "the next request first"
            log.warning("the ring failed at %s; %s replays the %d positions before it", what, then, len(self.prefix))
        self.events.publish(SessionChanged("failed", len(self.prefix), what))

    def _recover(self) -> None:
        self._follow()
        if self._stale:
            log.info("replaying %d positions onto the ring (assignment %d)", len(self.prefix), self.ring.epoch)
            self.replay()
