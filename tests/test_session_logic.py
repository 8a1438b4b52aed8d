"""The session's bookkeeping and the events it adds up to, as pure logic: a fake ring that records what it is asked
and fails when told, so the failure policy, the step numbering and the view are checked in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from primaplug.core.errors import NodeUnavailableError, PrimaplugError
from primaplug.core.windows import LayerRange
from primaplug.head.events import (
    BatchDone,
    ClusterView,
    Deployed,
    Events,
    NodeProgress,
    SessionChanged,
    apply,
)
from primaplug.head.session import Session


@dataclass
class FakeRing:
    """Keeps, position by position, what a ring's caches would hold; fails the calls it is told to."""

    epoch: int = 7
    held: list[int] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)
    fail_next: int = 0

    def _maybe_fail(self) -> None:
        if self.fail_next:
            self.fail_next -= 1
            self.held = [-1] * len(self.held)  # the caches are in an unknown state
            raise NodeUnavailableError("node2", "node node2 stopped answering")

    def forward(self, tokens, pos0: int, *, seq_id: int = 0, all_rows: bool = False,
                hidden: bool = False) -> np.ndarray:
        self.calls.append(("forward", pos0, len(tokens)))
        self._maybe_fail()
        # every window forgets what it holds from a batch's first position on (engine Window.forward)
        assert pos0 <= len(self.held), f"a batch at {pos0} on caches holding {len(self.held)} positions"
        self.held[pos0:] = [int(t) for t in tokens]
        return np.zeros((len(tokens) if all_rows else 1, 4), np.float32)

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        self.calls.append(("remove", p0))
        self._maybe_fail()
        del self.held[p0:]


def _session(n_batch: int = 4) -> tuple[Session, FakeRing, list]:
    ring, events = FakeRing(), Events()
    seen: list = []
    events.subscribe(seen.append)
    return Session(ring, n_batch=n_batch, events=events), ring, seen  # type: ignore[arg-type]


def test_batches_steps_and_output_positions() -> None:
    session, ring, seen = _session()
    rows: list[tuple[int, int]] = []
    session.eval(list(range(10)), 0, output=lambda h, pos: rows.append((len(h), pos)))
    assert ring.held == list(range(10)) and session.n_past == 10
    assert [c[1:] for c in ring.calls] == [(0, 4), (4, 4), (8, 2)]  # n_batch 4
    assert rows == [(1, 3), (1, 7), (1, 9)]  # each batch's last row, at its own position
    assert [type(e) for e in seen] == [BatchDone] * 3 and seen[-1].pos0 == 8
    session.eval([5], 10, all_rows=True, output=lambda h, pos: rows.append((len(h), pos)))
    assert rows[-1] == (1, 10)


def test_eval_rewinds_to_its_position_first() -> None:
    session, ring, _ = _session()
    session.eval([1, 2, 3, 4, 5, 6], 0)
    session.rewind(2)  # a rejected draft: no trip; the caches keep the positions until the next batch
    assert ring.held == [1, 2, 3, 4, 5, 6] and session.prefix == [1, 2] and session.held == 6
    session.eval([9, 9], 2)  # the conversation goes on from position 2 another way
    assert ring.held == [1, 2, 9, 9] and session.prefix == [1, 2, 9, 9] and session.held == 4
    assert not any(c[0] == "remove" for c in ring.calls)
    session.eval([7], 4)
    assert ring.held == [1, 2, 9, 9, 7]
    session.rewind(10)  # past the end: nothing to do, nothing sent
    assert ring.calls[-1][0] == "forward"
    with pytest.raises(PrimaplugError, match="the ring holds 5 positions"):
        session.eval([1], 6)
    session.eval([8], 3)  # from the middle: rewinds first
    assert ring.held == session.prefix == [1, 2, 9, 8]
    with pytest.raises(PrimaplugError, match="cannot rewind to position -1"):
        session.rewind(-1)


def test_a_failure_raises_then_the_next_call_replays_the_prefix() -> None:
    session, ring, seen = _session()
    session.eval(list(range(6)), 0)
    ring.fail_next = 1
    with pytest.raises(NodeUnavailableError):
        session.eval([6], 6)
    assert session.prefix == list(range(6))  # what completed is kept, what failed is not
    assert [e.what for e in seen if isinstance(e, SessionChanged)] == ["failed"]
    session.eval([6], 6)  # clears the ring, replays the prefix, then goes on
    assert ring.held == list(range(7))
    assert [e.what for e in seen if isinstance(e, SessionChanged)] == ["failed", "clear", "replay"]


def test_a_replay_that_fails_keeps_the_whole_prefix_to_rebuild() -> None:
    session, ring, _ = _session()
    session.eval(list(range(10)), 0)
    ring.fail_next = 1
    with pytest.raises(NodeUnavailableError):
        session.eval([10], 10)
    ring.fail_next = 1  # the clear before the replay fails too
    with pytest.raises(NodeUnavailableError):
        session.eval([10], 10)
    assert session.prefix == list(range(10))
    session.eval([10], 10)
    assert ring.held == list(range(11))


def test_replay_moves_the_session_to_a_new_ring() -> None:
    session, old, _ = _session()
    session.eval(list(range(9)), 0)
    new = FakeRing(epoch=8)
    session.replay(new)  # type: ignore[arg-type]
    assert session.ring is new and session.epoch == 8 and new.held == list(range(9))
    assert new.calls == [("remove", 0), ("forward", 0, 4), ("forward", 4, 4), ("forward", 8, 1)]
    assert len(old.calls) == 3  # nothing more was sent to the old ring


def test_the_view_adds_the_events_up() -> None:
    view = ClusterView()
    for e in (NodeProgress("n1", "loading", 0.5, "mapping"), NodeProgress("n2", "connected"),
              Deployed((("n1", (LayerRange(0, 9),)), ("n2", (LayerRange(9, 18),))), (LayerRange(18, 18),), 1.5),
              BatchDone(1, 0, 10, 0.2), BatchDone(2, 10, 1, 0.03), BatchDone(3, 11, 1, 0.01),
              SessionChanged("rewind", 5)):
        view = apply(view, e)
    assert view.deployed and view.nodes["n1"].state == "ready" and view.nodes["n1"].windows == (LayerRange(0, 9),)
    assert view.prompt_tokens == 10 and view.decoded_tokens == 2 and view.tpot_s == pytest.approx(0.02)
    assert view.n_past == 5
    assert ClusterView().nodes == {}  # views are values: applying events never changed the first one


def test_a_failing_subscriber_does_not_stop_the_others() -> None:
    events, seen = Events(), []
    events.subscribe(lambda e: 1 / 0)
    stop = events.subscribe(seen.append)
    events.publish(NodeProgress("n1", "connected"))
    stop()
    events.publish(NodeProgress("n2", "connected"))
    assert len(seen) == 1 and set(events.view.nodes) == {"n1", "n2"}


def test_a_replay_joins_small_batches_that_follow_on_and_keeps_large_ones() -> None:
    from primaplug.head.session import coalesce

    prompt = (0, list(range(20)))  # 16 rows or more: as it went (it rounds differently split otherwise)
    decoded = [(20 + i, [i]) for i in range(17)]  # one token a batch
    draft = (37, [7, 8, 9])  # a verified draft, then a rewind into it: the next batch starts inside
    after = (38, [5])
    got = coalesce([prompt, *decoded, draft, after])
    assert got == [prompt, (20, list(range(15))), (35, [15, 16, 7, 8, 9]), (38, [5])]
    assert all(len(b) <= 15 for p, b in got[1:])


def test_a_replay_after_decoding_sends_a_trip_per_fifteen_tokens() -> None:
    session, ring, _ = _session(n_batch=64)
    session.eval(list(range(20)), 0)
    for i in range(20, 40):
        session.eval([i], i)
    new = FakeRing(epoch=8)
    session.replay(new)  # type: ignore[arg-type]
    assert new.held == list(range(40))
    assert new.calls == [("remove", 0), ("forward", 0, 20), ("forward", 20, 15), ("forward", 35, 5)]


def test_after_a_failure_a_call_that_goes_another_way_rebuilds_only_what_it_keeps() -> None:
    session, ring, _ = _session()
    session.eval(list(range(10)), 0)
    ring.fail_next = 1
    with pytest.raises(NodeUnavailableError):
        session.eval([10], 10)
    ring.calls.clear()
    session.eval([7, 7], 2)  # a new request sharing 2 positions: the batch that held them is replayed, not all 10
    assert ring.held == [0, 1, 7, 7]
    assert ring.calls == [("remove", 0), ("forward", 0, 4), ("forward", 2, 2)]


def test_a_session_on_recurrent_layers_only_clears_or_goes_on() -> None:
    """Recurrent layers cannot forget part of a conversation: a rewind into it is refused saying what to do (the
    ring's llama-cpp-python front then evaluates anew) and changes nothing; a clear, a replay and going on work."""
    from primaplug.core.errors import RecurrentRewindError

    ring = FakeRing()
    session = Session(ring, n_batch=64, rewindable=False)  # type: ignore[arg-type]
    session.eval(list(range(20)), 0)
    for i in range(20, 24):
        session.eval([i], i)
    session.rewind(24)  # nothing to forget
    with pytest.raises(RecurrentRewindError, match="without a draft model"):
        session.rewind(10)
    assert session.n_past == 24 and ring.held == list(range(24))
    new = FakeRing(epoch=8)
    session.replay(new)  # type: ignore[arg-type]
    assert new.held == list(range(24))
    assert new.calls == [("remove", 0), ("forward", 0, 20), ("forward", 20, 4)]
    session.eval([5, 6], 0)  # a rewind to the start clears, then evaluates anew
    assert new.held == [5, 6]


def test_a_session_with_snapshots_forgets_the_last_batchs_tokens_once() -> None:
    """With `rollback` snapshots a token (n_rs_seq), recurrent layers forget up to that many of the last batch's
    tokens (a rejected draft), once before the next batch; never a token of an earlier batch."""
    from primaplug.core.errors import RecurrentRewindError

    ring = FakeRing()
    session = Session(ring, n_batch=64, rewindable=False, rollback=3)  # type: ignore[arg-type]
    session.eval(list(range(20)), 0)
    session.eval([20, 21, 22, 23], 20)  # a token and three drafted
    assert not session.can_rewind(20)  # four back: more than the snapshots
    assert not session.can_rewind(19)  # into the batch before
    session.rewind(22)  # two rejected
    assert session.n_past == 22
    assert not session.can_rewind(21)  # once: the snapshots are spent until the next batch
    session.eval([22, 23], 22)
    assert session.can_rewind(23) and not session.can_rewind(21)
    with pytest.raises(RecurrentRewindError):
        session.rewind(21)
    assert session.n_past == 24
