"""The prefetcher's policy as pure functions: which ranges, when, what is kept, what is released."""

from __future__ import annotations

import pytest

from primaplug.memory.policy import PAGE, Action, Schedule, plan_prefetch

MiB = 1 << 20
# three windows of two layers, each layer one 8 MiB tensor, page-aligned, back to back
WINDOWS = [[(w * 16 * MiB, 8 * MiB), (w * 16 * MiB + 8 * MiB, 8 * MiB)] for w in range(3)]


def test_everything_fits_means_resident_and_no_advice() -> None:
    plan = plan_prefetch(WINDOWS, 48 * MiB)
    assert plan.mode == "resident" and plan.keep_bytes == 48 * MiB
    s = Schedule(plan)
    assert s.first() == [] and all(s.started(i) == [] and s.done(i) == [] for i in range(3))


def test_two_windows_fit_prefetch_starts_with_the_previous_window() -> None:
    plan = plan_prefetch(WINDOWS, 40 * MiB)
    assert plan.mode == "stream" and plan.early
    # keep f of every tensor: f * 48 + 2 * (1 - f) * 16 <= 40  ->  f = 0.5
    assert plan.keep_fraction == pytest.approx(0.5)
    assert plan.keep_bytes + 2 * max(plan.stream_bytes) <= 40 * MiB
    assert len(plan.keep) == 6, "a part of every layer is kept"
    s = Schedule(plan)
    assert s.first() == [Action("prefetch", 0)]
    assert s.started(0) == [Action("prefetch", 1)]
    assert s.done(0) == [Action("release", 0)]
    assert s.started(2) == [Action("prefetch", 0)], "windows cycle: after the last comes the first"


def test_one_window_fits_prefetch_waits_for_the_release() -> None:
    plan = plan_prefetch(WINDOWS, 24 * MiB)
    assert plan.mode == "stream" and not plan.early
    assert plan.keep_bytes + max(plan.stream_bytes) <= 24 * MiB
    s = Schedule(plan)
    assert s.started(1) == []
    assert s.done(1) == [Action("release", 1), Action("prefetch", 2)]


def test_kept_ranges_are_never_released_and_cover_every_layer() -> None:
    plan = plan_prefetch(WINDOWS, 40 * MiB)
    streamed = {r for w in plan.stream for r in w}
    assert not streamed & set(plan.keep)
    for (off, n), (koff, kn) in zip([r for w in WINDOWS for r in w], plan.keep, strict=True):
        assert koff == off and 0 < kn < n and kn % PAGE == 0
    # kept plus streamed is every byte, exactly once
    assert sum(n for _, n in plan.keep) + sum(plan.stream_bytes) == 48 * MiB


@pytest.mark.parametrize(("prefetch", "release", "keep"),
                         [(False, True, True), (True, False, True), (True, True, False)])
def test_switches_turn_parts_off(prefetch: bool, release: bool, keep: bool) -> None:
    plan = plan_prefetch(WINDOWS, 40 * MiB, keep=keep)
    s = Schedule(plan, prefetch=prefetch, release=release)
    acts = s.first() + s.started(0) + s.done(0)
    assert any(a.kind == "prefetch" for a in acts) == prefetch
    assert any(a.kind == "release" for a in acts) == release
    assert (plan.keep_bytes > 0) == keep


def test_a_budget_smaller_than_one_window_streams_everything() -> None:
    plan = plan_prefetch(WINDOWS, 8 * MiB)
    assert plan.mode == "stream" and plan.keep_fraction == 0 and plan.keep == ()
    assert sum(plan.stream_bytes) == 48 * MiB


def test_a_prefetch_never_brings_in_more_than_the_budget_leaves() -> None:
    for budget in (8 * MiB, 24 * MiB, 40 * MiB):
        plan = plan_prefetch(WINDOWS, budget)
        for w in range(3):
            got = sum(n for _, n in plan.prefetch_ranges(w))
            assert got <= plan.prefetch_room and plan.keep_bytes + got * (2 if plan.early else 1) <= budget



def test_a_single_window_that_does_not_fit_is_streamed_whole() -> None:
    """Keeping part of a single oversized window loses to the kernel's LRU (docs/memory.md): it streams whole,
    the budget's worth prefetched after each release."""
    plan = plan_prefetch([WINDOWS[0] + WINDOWS[1]], 20 * MiB)
    assert plan.mode == "stream" and not plan.early and plan.keep_bytes == 0
    assert plan.prefetch_room == 20 * MiB and sum(n for _, n in plan.prefetch_ranges(0)) == 20 * MiB
    assert Schedule(plan).done(0) == [Action("release", 0), Action("prefetch", 0)]
    assert plan.unprefetched_bytes(0) == 12 * MiB  # what faults in as the window computes


def test_what_a_prefetch_leaves_to_fault_in() -> None:
    assert plan_prefetch(WINDOWS, 24 * MiB).unprefetched_bytes(1) == 0  # a window fits the room: none
    plan = plan_prefetch([WINDOWS[0] + WINDOWS[1]] * 2, 20 * MiB)  # two windows larger than the budget
    assert [plan.unprefetched_bytes(w) for w in range(2)] == [12 * MiB, 12 * MiB]

def test_a_single_window_without_keep_streams_it_all() -> None:
    plan = plan_prefetch([WINDOWS[0] + WINDOWS[1]], 20 * MiB, keep=False)
    assert plan.keep_bytes == 0 and sum(plan.stream_bytes) == 32 * MiB and plan.prefetch_room == 20 * MiB


def test_layer_by_layer_prefetches_as_many_layers_ahead_as_fit_whole() -> None:
    """--layer-streaming: each layer is prefetched whole (with read-ahead) as soon as it fits beside those in
    flight, in ring order, wrapping round to the next token's first; a layer done makes room for the next."""
    layers = [[r] for w in WINDOWS for r in w]  # six 8 MiB layers
    plan = plan_prefetch(layers, 20 * MiB, keep=False, unit="layer")
    assert plan.lookahead and plan.prefetch_ranges(3) == plan.stream[3]
    assert plan.unprefetched_bytes(3) == 0
    s = Schedule(plan)
    assert s.first() == [Action("prefetch", 0), Action("prefetch", 1)], "two fit in 20 MiB, a third does not"
    assert s.started(0) == []
    assert s.done(0) == [Action("release", 0), Action("prefetch", 2)]
    assert s.done(1) == [Action("release", 1), Action("prefetch", 3)]
    for i in (2, 3, 4):
        s.done(i)
    assert s.done(5) == [Action("release", 5), Action("prefetch", 1)], "the next token's layers follow"
    assert Schedule(plan, prefetch=False).first() == []


def test_layer_by_layer_keeps_room_for_the_slots_asked() -> None:
    layers = [[r] for w in WINDOWS for r in w]
    two = plan_prefetch(layers, 32 * MiB, unit="layer")
    three = plan_prefetch(layers, 32 * MiB, unit="layer", slots=3)
    assert three.keep_fraction < two.keep_fraction
    assert three.keep_bytes + 3 * max(three.stream_bytes) <= 32 * MiB


def test_a_node_goes_layer_by_layer_by_itself_only_where_whole_windows_would_fault_in() -> None:
    """--layer-streaming auto (the default): where a whole window's prefetch leaves more than READ_AHEAD_SLACK of it
    to fault in page by page (the window is larger than its room), layer by layer; where the windows' streamed
    parts fit their prefetch room, whole windows, which were faster there (docs/memory.md)."""
    from primaplug.core.budget import READ_AHEAD_SLACK
    from primaplug.device.memory import faults_in

    big = [[(il * 32 * MiB, 32 * MiB) for il in range(w * 2, w * 2 + 2)] for w in range(3)]  # 64 MiB windows
    tight = plan_prefetch(big, 40 * MiB)  # less than a window: most of it would fault in
    assert tight.unprefetched_bytes(0) > READ_AHEAD_SLACK and faults_in(tight)
    roomy = plan_prefetch(big, 160 * MiB)  # two streamed windows fit beside the kept part
    assert roomy.mode == "stream" and not faults_in(roomy)
    assert not faults_in(plan_prefetch(big, 200 * MiB))  # all resident


def test_a_smaller_stream_room_keeps_more_of_every_layer(gemma_path) -> None:
    """--stream-room: layer by layer, the streamed layers that fit beside the kept part at once; fewer than the
    default (a window's and one more) leaves more of the budget to the kept part."""
    from primaplug.core.windows import LayerRange
    from primaplug.device.memory import MemorySettings, plan_memory
    from primaplug.engine import read_layout
    from primaplug.memory.prefetcher import Switches

    layout = read_layout(gemma_path)
    windows = [LayerRange(0, 6), LayerRange(6, 12)]
    weights = sum(layout.layer_bytes(il) for il in range(12))
    budget = weights * 3 // 4

    def plan(room: int | None):  # noqa: ANN202
        memory = MemorySettings(budget_bytes=budget, switches=Switches(layers=True, room_layers=room))
        return plan_memory(layout, windows, n_ctx=256, n_batch=32, n_ubatch=32, memory=memory)

    default, two = plan(None), plan(2)
    assert default.per_layer and two.per_layer
    assert two.prefetch.keep_bytes > default.prefetch.keep_bytes
    assert two.prefetch.keep_bytes + 2 * max(two.prefetch.stream_bytes) <= budget
    assert default.prefetch.keep_bytes + 7 * max(default.prefetch.stream_bytes) <= budget
