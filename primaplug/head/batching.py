"""Continuous batching on the pipelined ring: many requests' steps in flight at once.

Each request (a primaplug.Llama sequence, head/session.py) hands its batches here and waits for their logits. One
thread, the ring's driver, owns the ring (head/ring.py): it

- groups the steps that wait at the same round into one trip (their rows travel and compute as one batch: every
  window runs them in one llama.cpp call, each row on its own sequence's cache), up to EXACT_BATCH_ROWS rows so that
  each row comes out as it does alone (core/settings.py says why); a longer step (a prompt) travels alone;
- keeps up to `trips` trips in the ring at once, so that different devices compute different requests' steps at
  the same moment (pipeline parallelism), and runs the head's own window of a round when a trip comes back;
- after a trip's last round, runs the output layer once for the rows of all its steps and hands each request its
  rows of logits;
- holds a new trip back for a moment while requests it has just answered are still sampling their next token, so
  that they go round together instead of one behind the other (never longer than HOLD_S, never for a lone request);
- watches the nodes while trips are out (RingHead.watch): a node that stops answering fails every step in
  flight, each with the error, and each session replays its prefix on its next call (head/session.py).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from primaplug.core.errors import NodeError, PrimaplugError
from primaplug.core.settings import EXACT_BATCH_ROWS, PROBE_AFTER_S
from primaplug.head.ring import RingHead, Watch
from primaplug.wire import Activation, KvOp, Part, RingError

if TYPE_CHECKING:
    from primaplug.engine import Window

log = logging.getLogger(__name__)

# How long a trip waits for the requests answered last to send their next step (a share of a trip's time, at most
# this): sampling takes a millisecond or two; a request that has ended is told (Batcher.idle) and not waited for.
HOLD_S = 0.02
HOLD_SHARE = 0.25


@dataclass
class TripStats:
    """What went round the ring: trips, how many carried several requests' steps, and the most steps in one."""

    trips: int = 0
    steps: int = 0
    mixed: int = 0  # trips that carried the steps of more than one request
    most_steps: int = 0
    most_in_flight: int = 0  # the most trips in the ring at one moment


@dataclass(eq=False)
class _Step:
    """One request's batch (or KV operation) on its way round the ring."""

    seq_id: int
    pos0: int
    rows: np.ndarray  # token ids (n x 1, int32) before round 0, hidden rows after
    all_rows: bool = False  # logits (or hidden rows) of every row, or of the last one only
    hidden: bool = False  # the final hidden rows instead of logits (embeddings)
    kv: KvOp | None = None  # a KV operation instead of a batch
    round: int = 0  # the round it waits for
    result: np.ndarray | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


@dataclass(eq=False)
class _Trip:
    round: int
    steps: list[_Step]
    what: str
    sent: float


class Batcher:
    """The ring's driver thread and the queue into it. `output` is the head's output-only window (None for a ring
    that only returns hidden rows, such as a profiling ring)."""

    def __init__(self, ring: RingHead, output: Window | None, *, n_batch: int, trips: int = 0,
                 max_rows: int = EXACT_BATCH_ROWS, streams: bool = False) -> None:
        self.ring = ring
        self.output = output
        self.n_batch = n_batch
        self.max_rows = max(1, min(max_rows, n_batch))
        devices = len(ring.nodes) + (ring.local is not None and any(w is not None for w in ring.local.windows))
        # trips 0: one per device, so that each can work on another request's step, unless a device streams its
        # windows: requests a round apart then make it page two windows in every round, where one trip carrying
        # both streams each window once (measured: 5x slower with two trips, benchmarks/results/LOG.md)
        self.trips = trips or (1 if streams else max(1, devices))
        self._queue: queue.SimpleQueue[_Step | int | None] = queue.SimpleQueue()
        self._waiting: list[_Step] = []
        self._out: dict[int, _Trip] = {}
        self._sampling: dict[int, float] = {}  # sequence -> until when a trip waits for its next step
        self._trip_s = 0.0  # a trip's time, decaying average
        self._steps = itertools.count(1)
        self._watch: Watch | None = None
        self._heard = 0.0
        self._closed = False
        self.stats = TripStats()
        self._thread = threading.Thread(target=self._run, name="primaplug-ring", daemon=True)
        self._thread.start()

    @property
    def epoch(self) -> int:
        return self.ring.epoch

    @property
    def busy(self) -> bool:
        """Steps are in the ring or waiting: the driver's watch asks the nodes for their status meanwhile."""
        return bool(self._out or self._waiting)

    # --- what sessions call (any thread) ------------------------------------------------------------------------

    def forward(self, tokens: Sequence[int] | np.ndarray, pos0: int, *, seq_id: int = 0, all_rows: bool = False,
                hidden: bool = False) -> np.ndarray:
        """Logits (rows x n_vocab) of the batch's last row, or of every row (all_rows), after it went round the
        ring with whatever other requests' steps wait with it; hidden: the final hidden rows instead."""
        rows = np.asarray(tokens, dtype=np.int32).reshape(-1, 1)
        if not 0 < len(rows) <= self.n_batch:
            raise PrimaplugError(f"a batch holds 1 to {self.n_batch} tokens, got {len(rows)}")
        if not hidden and self.output is None:
            raise PrimaplugError("this ring has no output layer: ask for hidden rows")
        return self._wait(_Step(seq_id, pos0, rows, all_rows, hidden))

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Forget positions [p0, p1) of a sequence on every device (p1 = -1: to the end)."""
        self._wait(_Step(seq_id, p0, np.empty((0, 1), np.int32), kv=self.ring.kv_op(0, seq_id, p0, p1)))

    def idle(self, seq_id: int) -> None:
        """The sequence's request has ended: trips do not wait for its next step."""
        self._queue.put(seq_id)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def _wait(self, step: _Step) -> np.ndarray:
        if self._closed:
            raise PrimaplugError("the ring is closed")
        self._queue.put(step)
        while not step.done.wait(0.5):
            if not self._thread.is_alive():  # closed between the check above and the put: nobody will answer
                step.fail(PrimaplugError("the ring was closed"))
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    # --- the driver thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not self._out and not self._waiting
            if not self._take(None if idle else 0.0):
                break
            try:
                self._launch()
                if self._out:
                    self._receive()
                elif self._waiting and not self._take(0.0005):  # held for requests still sampling: look again
                    break
            except BaseException as e:  # the ring itself failed (a node is gone): every step in flight fails
                self._fail_all(e)
        self._fail_all(PrimaplugError("the ring was closed"))

    def _take(self, timeout: float | None) -> bool:
        """Take what sessions sent (waiting up to timeout for the first); False once closed."""
        try:
            item = self._queue.get(timeout=timeout) if timeout != 0.0 else self._queue.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, int):
                self._sampling.pop(item, None)
            else:
                self._sampling.pop(item.seq_id, None)
                self._waiting.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True

    def _launch(self) -> None:
        """Send trips while the ring has room: the latest round first (finish what is under way)."""
        while self._waiting and len(self._out) < self.trips:
            r = max(s.round for s in self._waiting)
            if r == 0 and self._hold():
                return
            steps = self._group(r)
            for s in steps:
                self._waiting.remove(s)
            try:
                self._send(r, steps)
            except BaseException as e:  # the first node did not take it: neither waiting nor out, fail it here
                for s in steps:
                    s.fail(e)
                raise

    def _hold(self) -> bool:
        """Whether a trip into round 0 waits for requests that are still sampling their next token."""
        now = time.monotonic()
        self._sampling = {q: t for q, t in self._sampling.items() if t > now}
        return bool(self._sampling) and sum(len(s.rows) for s in self._waiting if s.kv is None) < self.max_rows

    def _group(self, r: int) -> list[_Step]:
        """Steps waiting at round r that travel together: in arrival order, up to max_rows rows; a KV operation or a
        step longer than that travels alone."""
        group: list[_Step] = []
        n = 0
        for s in self._waiting:
            if s.round != r:
                continue
            alone = s.kv is not None or len(s.rows) > self.max_rows
            if group and (alone or n + len(s.rows) > self.max_rows):
                if alone:
                    continue
                break
            group.append(s)
            n += len(s.rows)
            if alone:
                break
        return group

    def _send(self, r: int, steps: list[_Step]) -> None:
        # llama.cpp computes sequences in one micro-batch only when their ids are consecutive (with per-sequence
        # caches): in id order they split into fewer
        steps.sort(key=lambda s: s.seq_id)
        step = next(self._steps)
        ring = self.ring
        kv = steps[0].kv
        if kv is not None:
            op = ring.kv_op(step, kv.seq_id, kv.p0, kv.p1)
            if not ring.has_nodes:
                ring.local_kv(op)
                self._answer(steps[0], np.empty(0, np.float32))
                return
            self._go(_Trip(0, steps, f"kv remove of sequence {kv.seq_id} from position {kv.p0}", 0.0), op, None)
            return
        parts = tuple(Part(s.seq_id, s.pos0, len(s.rows), s.all_rows or s.hidden) for s in steps)
        st = self.stats
        st.trips, st.steps, st.mixed = st.trips + 1, st.steps + len(steps), st.mixed + (len(steps) > 1)
        st.most_steps = max(st.most_steps, len(steps))
        rows = np.concatenate([s.rows for s in steps]) if len(steps) > 1 else steps[0].rows
        msg = ring.activation(step, parts)
        if r:  # hidden rows, back from the head's window of the round before
            msg = msgspec.structs.replace(msg, round=r, width=rows.shape[1], dtype="float32",
                                          per_layer=rows.shape[1] - ring.n_embd)
        else:
            msg, rows = ring.enter(msg, rows)
        n = len(rows)
        what = (f"{'prefill' if n > len(steps) else 'decode'} of {n} row(s) of "
                f"{'sequence ' + str(steps[0].seq_id) if len(steps) == 1 else f'{len(steps)} sequences'}"
                f" at position {steps[0].pos0}" + (f", round {r + 1}/{ring.rounds}" if ring.rounds > 1 else ""))
        trip = _Trip(r, steps, what, time.monotonic())
        if not ring.has_nodes:  # the head runs every window: the whole trip, now
            try:
                assert ring.local is not None
                with ring.local.awake():
                    for rr in range(r, ring.rounds):
                        msg, rows = ring.local_round(rr, msgspec.structs.replace(msg, round=rr), rows)
                self._finish(trip, msg, rows)
            except BaseException as e:
                for s in steps:
                    s.fail(e)
            return
        self._go(trip, msg, rows)

    def _go(self, trip: _Trip, msg: Activation | KvOp, rows: np.ndarray | None) -> None:
        trip.sent = time.monotonic()
        if not self._out:
            self._heard, self._watch = trip.sent, self.ring.watch(trip.sent)
        self.ring.send(msg, rows, trip.what)
        self._out[msg.step] = trip
        self.stats.most_in_flight = max(self.stats.most_in_flight, len(self._out))

    def _receive(self) -> None:
        got = self.ring.recv(0.0005 if self._waiting else 0.002)
        now = time.monotonic()
        if got is None:
            if now - self._heard > PROBE_AFTER_S and self._watch is not None:
                self._watch.poll(now)
                doing = "; ".join(t.what for t in self._out.values())
                self._watch.check(now, self.ring.timeout_s, self.epoch, f"step(s) {doing}")
            return
        self._heard, self._watch = now, self.ring.watch(now)
        msg, rows = got
        trip = self._out.pop(msg.step, None)
        if trip is None:
            log.debug("dropped a ring message of step %d, which no trip waits for", msg.step)
            return
        try:
            if isinstance(msg, RingError):
                raise NodeError(msg.node, msg.code, f"{msg.message} (during {trip.what})")
            if isinstance(msg, KvOp):
                self.ring.local_kv(msg)
                self._answer(trip.steps[0], np.empty(0, np.float32))
                return
            assert isinstance(msg, Activation) and rows is not None
            msg, rows = self.ring.local_round(trip.round, msg, rows)
            if trip.round + 1 < self.ring.rounds:  # back in line for the next round, where others may join it
                for s, part_rows in zip(trip.steps, _split(msg, rows), strict=True):
                    s.rows, s.round = part_rows, trip.round + 1
                    self._waiting.append(s)
                return
            self._finish(trip, msg, rows)
        except BaseException as e:
            for s in trip.steps:
                s.fail(e)

    def _finish(self, trip: _Trip, msg: Activation, rows: np.ndarray) -> None:
        """The trip's last round is done: the output layer once for every step that wants logits."""
        self.ring.check_hidden(msg)
        per_step = _split(msg, rows)
        want = [i for i, s in enumerate(trip.steps) if not s.hidden]
        if want:
            assert self.output is not None
            hidden = np.concatenate([per_step[i] for i in want]) if len(want) > 1 else per_step[want[0]]
            logits = self.output.forward(hidden, 0, logits="all")
            start = 0
            for i in want:
                n = len(per_step[i])
                per_step[i] = logits[start : start + n]
                start += n
        took = time.monotonic() - trip.sent
        self._trip_s = took if not self._trip_s else 0.8 * self._trip_s + 0.2 * took
        for s, out in zip(trip.steps, per_step, strict=True):
            self._answer(s, out)

    def _answer(self, s: _Step, result: np.ndarray) -> None:
        if s.kv is None:  # it will likely send its next step as soon as it has sampled
            self._sampling[s.seq_id] = time.monotonic() + min(HOLD_S, HOLD_SHARE * self._trip_s)
        s.result = result
        s.done.set()

    def _fail_all(self, error: BaseException) -> None:
        for trip in self._out.values():
            for s in trip.steps:
                s.fail(error)
        for s in self._waiting:
            s.fail(error)
        self._out.clear()
        self._waiting.clear()
        self._sampling.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:  # closed meanwhile: the loop must still see it
                self._queue.put(None)
                return
            if isinstance(item, _Step):
                item.fail(error)


def _split(msg: Activation, rows: np.ndarray) -> list[np.ndarray]:
    """Each part's rows."""
    bounds = np.cumsum([p.n_rows for p in msg.parts])[:-1]
    return list(np.split(rows, bounds))
