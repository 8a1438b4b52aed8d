"""The ring's driver (head/batching.py) as pure logic: a fake ring that records every trip and answers it when the
test says, so which steps travel together, how many trips are out and what a failure reaches are checked in
milliseconds."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
import pytest

from primaplug.core.errors import NodeUnavailableError
from primaplug.head.batching import Batcher
from primaplug.wire import PROTOCOL_VERSION, Activation, KvOp, Part, RingError, window_output

pytestmark = pytest.mark.unit

N_EMBD = 4


class FakeOutput:
    """The output layer: a row's 'logits' are its hidden row plus one."""

    def forward(self, rows: np.ndarray, pos: Any, logits: str = "all") -> np.ndarray:
        return rows + 1.0


class FakeRing:
    """Nodes that turn each token into a hidden row [token, position, seq, round] when the test lets a trip back."""

    def __init__(self, rounds: int = 1) -> None:
        self.epoch, self.rounds, self.timeout_s = 1, rounds, 1.0
        self.n_embd = N_EMBD
        self.nodes: list[Any] = []
        self.local = None
        self.has_nodes = True
        self.sent: list[Activation | KvOp] = []
        self.back: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.hold = threading.Event()  # set: trips come back at once
        self.hold.set()
        self.fail_watch: BaseException | None = None

    def activation(self, step: int, parts: Any) -> Activation:
        return Activation(proto=PROTOCOL_VERSION, epoch=1, step=step, round=0, parts=tuple(parts), width=1,
                          dtype="int32")

    def enter(self, msg: Activation, rows: np.ndarray) -> tuple[Activation, np.ndarray]:
        return msg, rows  # token ids go round as they are (a model without per-layer inputs)

    def kv_op(self, step: int, seq_id: int, p0: int = 0, p1: int = -1) -> KvOp:
        return KvOp(proto=PROTOCOL_VERSION, epoch=1, step=step, op="remove", seq_id=seq_id, p0=p0, p1=p1)

    def send(self, msg: Any, rows: Any, what: str) -> None:
        self.sent.append(msg)
        if isinstance(msg, Activation):
            h = np.zeros((len(rows), N_EMBD), np.float32)
            h[:, 0] = rows[:, 0]  # the token (round 0), or what the previous round left there
            h[:, 1], h[:, 2], h[:, 3] = msg.positions(), msg.seq_ids(), msg.round
            out = window_output(msg, h, last_layer=msg.round == self.rounds - 1, n_embd=N_EMBD)
            self.back.put(out if msg.round == self.rounds - 1 else
                          (Activation(proto=1, epoch=1, step=msg.step, round=msg.round, parts=msg.parts,
                                      width=N_EMBD, dtype="float32"), h))
        else:
            self.back.put((msg, None))

    def recv(self, timeout_s: float) -> Any:
        if not self.hold.wait(timeout_s):
            return None
        try:
            return self.back.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def local_round(self, r: int, msg: Activation, rows: np.ndarray) -> tuple[Activation, np.ndarray]:
        return msg, rows

    def local_kv(self, op: Any) -> None:
        pass

    def check_hidden(self, msg: Activation) -> None:
        assert msg.dtype == "float32"

    def watch(self, now: float) -> Any:
        ring = self

        class W:
            def poll(self, now: float) -> None:
                pass

            def check(self, now: float, timeout_s: float, epoch: int, doing: str) -> None:
                if ring.fail_watch is not None:
                    raise ring.fail_watch

        return W()


def _batcher(ring: FakeRing, **kw: Any) -> Batcher:
    return Batcher(ring, FakeOutput(), n_batch=64, **kw)  # type: ignore[arg-type]


def _together(b: Batcher, calls: list[tuple[list[int], int, int]]) -> list[Any]:
    """Forward every (tokens, pos0, seq) from its own thread at once; their results (or exceptions) in order."""
    out: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        tokens, pos0, seq = calls[i]
        try:
            out[i] = b.forward(tokens, pos0, seq_id=seq)
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    return out


def _submit(b: Batcher, calls: list[tuple[list[int], int, int]], results: list[Any]) -> threading.Thread:
    t = threading.Thread(target=lambda: results.extend(_together(b, calls)))
    t.start()
    return t


def _until(cond: Any) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_steps_waiting_together_share_a_trip_and_each_gets_its_own_rows() -> None:
    ring = FakeRing()
    ring.hold.clear()  # nothing comes back until the test says
    b = _batcher(ring, trips=1)
    try:
        first: list[Any] = []
        rest: list[Any] = []
        t1 = _submit(b, [([5], 3, 0)], first)
        _until(lambda: len(ring.sent) == 1)
        t2 = _submit(b, [([6], 7, 1), ([7], 2, 2), ([8], 9, 3)], rest)  # wait while the first trip is out
        time.sleep(0.1)
        ring.hold.set()
        t1.join(5)
        t2.join(5)
        # the first went alone (nothing else waited); the other three waited for the trip out and went together
        assert [tuple(p.seq_id for p in m.parts) for m in ring.sent] == [(0,), (1, 2, 3)]
        assert b.stats.mixed == 1 and b.stats.most_steps == 3
        for (tok, pos, seq), r in zip([(5, 3, 0), (6, 7, 1), (7, 2, 2), (8, 9, 3)], first + rest, strict=True):
            assert r.shape == (1, N_EMBD) and list(r[0]) == [tok + 1, pos + 1, seq + 1, 1]  # its own row, + 1
    finally:
        ring.hold.set()
        b.close()


def test_a_trip_carries_at_most_max_rows_and_a_long_step_goes_alone() -> None:
    ring = FakeRing()
    ring.hold.clear()
    b = _batcher(ring, trips=1, max_rows=4)
    try:
        calls = [([1], 0, 0), ([1, 2, 3], 0, 1), ([1, 2], 0, 2), (list(range(10)), 0, 3), ([4], 0, 4)]
        res: list[Any] = []
        t = threading.Thread(target=lambda: res.extend(_together(b, calls)))
        t.start()
        time.sleep(0.1)
        ring.hold.set()
        t.join(5)
        assert not [r for r in res if isinstance(r, BaseException)]
        for m in ring.sent:
            assert m.n_rows <= 4 or len(m.parts) == 1, m
        assert any(m.n_rows == 10 and len(m.parts) == 1 for m in ring.sent)
    finally:
        b.close()


def test_trips_in_flight_are_capped() -> None:
    ring = FakeRing()
    ring.hold.clear()
    b = _batcher(ring, trips=2)
    try:
        res: list[Any] = []
        threads = [_submit(b, [([0], 0, 0)], res)]
        _until(lambda: len(ring.sent) == 1)
        threads.append(_submit(b, [([1], 0, 1)], res))
        _until(lambda: len(ring.sent) == 2)
        threads.append(_submit(b, [([i], 0, i) for i in range(2, 6)], res))
        time.sleep(0.2)
        assert len(ring.sent) == 2  # two trips out; the rest wait, to go together when one comes back
        ring.hold.set()
        for t in threads:
            t.join(5)
        assert b.stats.most_in_flight == 2 and sum(len(m.parts) for m in ring.sent) == 6 and len(res) == 6
        assert len(ring.sent) == 3 and len(ring.sent[2].parts) == 4
    finally:
        ring.hold.set()
        b.close()


def test_rounds_come_back_to_the_head_and_go_on() -> None:
    ring = FakeRing(rounds=3)
    b = _batcher(ring)
    try:
        r = b.forward([9, 8], 4, seq_id=1, all_rows=True)
        assert [m.round for m in ring.sent] == [0, 1, 2]
        assert r.shape == (2, N_EMBD) and list(r[:, 1]) == [5.0, 6.0]  # both rows, their positions
    finally:
        b.close()


def test_a_node_error_fails_its_trip_only_and_a_lost_node_fails_everything() -> None:
    ring = FakeRing()
    b = _batcher(ring)
    try:
        original = ring.send

        def refuse(msg: Any, rows: Any, what: str) -> None:
            ring.sent.append(msg)
            ring.back.put((RingError(proto=1, epoch=1, step=msg.step, node="n1", code="bad", message="no"), None))

        ring.send = refuse  # type: ignore[method-assign]
        with pytest.raises(Exception, match="no"):
            b.forward([1], 0, seq_id=0)
        ring.send = original  # type: ignore[method-assign]
        assert b.forward([1], 0, seq_id=0).shape == (1, N_EMBD)  # the ring goes on

        ring.hold.clear()
        ring.fail_watch = NodeUnavailableError("n2", "node n2 stopped answering")
        res = _together(b, [([1], 0, 0), ([2], 0, 1)])
        assert all(isinstance(r, NodeUnavailableError) for r in res), res
    finally:
        ring.hold.set()
        b.close()


def test_kv_operations_travel_alone_and_closing_fails_what_waits() -> None:
    ring = FakeRing()
    b = _batcher(ring)
    b.kv_remove(2, 5)
    assert isinstance(ring.sent[-1], KvOp) and ring.sent[-1].seq_id == 2 and ring.sent[-1].p0 == 5
    b.close()
    with pytest.raises(Exception, match="closed"):
        b.forward([1], 0)
    assert Part(0, 0, 1) == Part(0, 0, 1, False)


def test_one_trip_per_device_unless_a_device_streams() -> None:
    ring = FakeRing()
    ring.nodes = ["n1", "n2", "n3"]
    for streams, trips in ((False, 3), (True, 1)):
        b = _batcher(ring, streams=streams)
        try:
            assert b.trips == trips
        finally:
            b.close()
    b = _batcher(ring, trips=2, streams=True)  # asked for: as asked
    assert b.trips == 2
    b.close()
