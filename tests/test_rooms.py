"""Rooms chosen from the ring's timing (scheduler/rooms.py): the per-round model by hand, the node's policy it mirrors,
where rooms pay and where each node's own rule stays, and how a plan's room reaches a node (Assignment.stream_room)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from primaplug.core.budget import ROOM_SLACK
from primaplug.core.errors import ConfigError
from primaplug.device import MemorySettings
from primaplug.memory.policy import PAGE, plan_prefetch
from primaplug.memory.prefetcher import Switches
from primaplug.node.deployment import planned_room
from primaplug.scheduler import solve
from primaplug.scheduler.latency import platform
from primaplug.scheduler.rooms import GAIN, PAGE_BY_PAGE, Turn, choose_rooms, layer_turn, round_s
from tests.test_scheduler_halda import device, model

MB = 1e6


def test_a_round_is_the_turns_or_the_busiest_disk_by_hand() -> None:
    a = Turn(0.1, 0.01, need_bytes=100 * MB, room_bytes=60 * MB, disk_bps=100 * MB)  # 40 MB left to its turn: 0.4 s
    b = Turn(0.3, 0.01)  # holds its windows: its compute
    assert round_s([a, b]) == pytest.approx(1.0)  # a's disk reads 100 MB a round: 1 s, longer than the turns' 0.72
    small = Turn(0.1, 0.01, need_bytes=20 * MB, room_bytes=60 * MB, disk_bps=100 * MB)
    assert round_s([small, b]) == pytest.approx(0.42)  # all of it read ahead: the turns, 0.1 + 0.3 + the hops
    tight = Turn(0.1, 0.01, need_bytes=50 * MB, room_bytes=10 * MB, disk_bps=100 * MB)
    assert round_s([tight, b]) == pytest.approx(0.4 + 0.3 + 0.02)  # 40 MB in its own turn: 0.4 s of it


@pytest.mark.parametrize(("budget_layers", "room"), [(5.0, 1), (5.0, 2), (3.5, 3), (9.5, 4)])
def test_the_model_keeps_what_the_node_keeps(budget_layers: float, room: int) -> None:
    """layer_turn's kept fraction and room are plan_prefetch's with slots = room (the node's plan, layer by layer),
    room_slack included; what it reads ahead is what Schedule's lookahead fits."""
    layer, layers, per_window = 16384 * PAGE, 12, 3
    budget = int(budget_layers * layer)
    plan = plan_prefetch([[(i * layer, layer)] for i in range(layers)], budget, unit="layer", slots=room)
    turn, _ = layer_turn(Turn(0.0, 0.0, disk_bps=100 * MB), budget, layers, per_window, layer, room)
    kept = 1 - turn.need_bytes / (per_window * layer)
    assert kept == pytest.approx(plan.keep_fraction, abs=2 * PAGE / layer)
    streamed = (1 - plan.keep_fraction) * layer
    ahead = min(layers, int((budget - plan.keep_bytes) // streamed))  # Schedule's lookahead: whole layers that fit
    assert turn.room_bytes == pytest.approx(ahead * streamed, rel=1e-3)


def test_no_room_for_a_layer_reads_it_page_by_page_and_the_slack_binds_small_rooms() -> None:
    layer = 64 * MB
    base = Turn(0.0, 0.0, disk_bps=100 * MB)
    paged, _ = layer_turn(base, 0.5 * layer, 8, 4, layer, 1)  # half a layer of budget
    assert paged.room_bytes == 0 and paged.disk_bps == pytest.approx(100 * MB * PAGE_BY_PAGE)
    # a budget of 6 of 8 layers: room for one layer would keep 71% of each and hold 18 MB, under ROOM_SLACK, so the
    # node keeps less (68%), and the plan never sends such a room (choose_rooms)
    tight, bound = layer_turn(base, 6 * layer, 8, 4, layer, 1)
    kept = (6 * layer - ROOM_SLACK) / (8 * layer)
    assert bound and tight.need_bytes == pytest.approx(4 * layer * (1 - kept))
    roomy, bound = layer_turn(base, 6 * layer, 8, 4, layer, 4)  # keeps half of each, and holds 4 x 32 MB
    assert not bound and roomy.room_bytes >= ROOM_SLACK


@pytest.mark.parametrize("seed", range(5))
def test_the_rooms_search_is_exact(seed: int) -> None:
    """_best_rooms against every combination of options: the shortest round, found over bounds on the disks."""
    import itertools

    from primaplug.scheduler.rooms import _best_rooms

    rng = np.random.default_rng(seed)
    options = []
    for _ in range(4):
        n = int(rng.integers(1, 6))
        options.append([(r, Turn(float(rng.uniform(0, 0.5)), 0.01, need_bytes=float(rng.uniform(0, 300)) * MB,
                                 room_bytes=float(rng.uniform(0, 200)) * MB, disk_bps=float(rng.uniform(30, 130)) * MB))
                        for r in range(n)])
    rooms, best = _best_rooms(options)
    brute = min(round_s([o[i][1] for o, i in zip(options, pick, strict=True)])
                for pick in itertools.product(*(range(len(o)) for o in options)))
    assert best == pytest.approx(brute, rel=1e-12)
    assert round_s([dict(o)[r] for o, r in zip(options, rooms, strict=True)]) == pytest.approx(best, rel=1e-12)


def two_disks() -> tuple[list, object]:
    """Two equal nodes that must stream, their disks taking turns (tests/test_scheduler_ring.py's instance)."""
    devices = [device("head", ram_gb=0.4, disk=3e7), device("a", ram_gb=0.8, disk=1.2e8),
               device("b", ram_gb=0.8, disk=1.21e8)]
    return devices, model(32, layer_gb=0.1, n_kv=512, output_bytes=10_000_000)


def test_rooms_pay_where_disks_take_turns_and_the_plan_sends_them() -> None:
    devices, m = two_disks()
    plan = solve(devices, m, latency_model="ring", slow_disk_bps=1e7)
    p = platform(devices, m, slow_disk_bps=1e7)
    w = np.array([d.w for d in plan.devices])
    chosen = choose_rooms(p, plan.k, w, np.zeros_like(w))
    assert any(chosen.rooms) and chosen.tpot_s < chosen.own_rule_s * (1 - GAIN)
    assert tuple(d.room for d in plan.devices) == chosen.rooms and plan.head.room == 0
    assert plan.total_s == pytest.approx(chosen.tpot_s)
    from primaplug.tui.render import plan_summary

    for text in (plan.describe(), plan_summary(plan).plain):  # `primaplug plan` and the dashboard's Plan pane
        assert "round by round" in text and "rooms chosen from the ring's timing" in text, text
        assert all(f"{d.name} {d.room}" in text for d in plan.devices if d.room)


def test_devices_that_fit_keep_their_own_rule() -> None:
    devices = [device("head", ram_gb=8, disk=3e7), device("a", ram_gb=8, disk=1.2e8), device("b", ram_gb=8, disk=1e8)]
    m = model(32, layer_gb=0.1, n_kv=512, output_bytes=10_000_000)
    plan = solve(devices, m, latency_model="ring")
    assert plan.rooms is not None and not any(plan.rooms.rooms)
    assert plan.rooms.tpot_s == plan.rooms.own_rule_s
    assert "rooms chosen" not in plan.describe()
    assert plan.total_s == pytest.approx(max(plan.chain_s, max(d.compute_s + d.memory_s + d.disk_s
                                                                  for d in plan.devices)))


def test_a_plans_room_reaches_the_node_unless_its_own_flags_say_otherwise() -> None:
    assert planned_room(None, 0) == MemorySettings()
    got = planned_room(MemorySettings(budget_bytes=5), 2)
    assert got.switches.layers is True and got.switches.room_layers == 2 and got.budget_bytes == 5
    for flags in (Switches(layers=False), Switches(layers=True), Switches(room_layers=3)):  # set for comparisons
        mine = MemorySettings(switches=flags)
        assert planned_room(mine, 2) is mine


def test_stream_rooms_by_hand_are_one_count_per_node(streaming_model) -> None:  # noqa: ANN001
    import primaplug

    nodes = ["127.0.0.1:9", "127.0.0.1:10"]
    for rooms, extra in (([1], {"layers": [4, 4]}), ([1, -1], {"layers": [4, 4]}), ([1, 2], {})):
        with pytest.raises(ConfigError, match="stream_rooms is one count of layers"):
            primaplug.Llama(streaming_model, nodes=nodes, stream_rooms=rooms, **extra)


def test_a_node_refuses_a_room_no_window_could_use(streaming_model) -> None:  # noqa: ANN001
    from primaplug.engine import read_layout
    from primaplug.node.daemon import _check_assignment
    from primaplug.wire import Assignment, ModelIdentity, WindowSpec

    layout = read_layout(streaming_model)
    a = Assignment(epoch=1, model=ModelIdentity.of(layout, "m.gguf"), windows=(WindowSpec(0, 3), WindowSpec(4, 6)),
                   successor="tcp://127.0.0.1:9", n_ctx=64, n_batch=32, n_ubatch=32)
    for room in (0, 1, 4):
        assert _check_assignment(msgspec.structs.replace(a, stream_room=room), layout) == ""
    for room in (-1, 5, 2**40):
        assert "a room of" in _check_assignment(msgspec.structs.replace(a, stream_room=room), layout)


def test_a_re_planned_ring_sends_the_rooms_of_its_new_plan() -> None:
    from types import SimpleNamespace

    from primaplug.head.planning import Measured, PlanSettings
    from primaplug.head.recovery import Replanner

    devices, m = two_disks()
    settings = PlanSettings(latency_model="ring", slow_disk_bps=1e7)
    plan = solve(devices, m, latency_model="ring", slow_disk_bps=1e7)
    assert any(d.room for d in plan.devices)
    cluster = SimpleNamespace(model=SimpleNamespace(n_layer=32, identity="x"), rounds=plan.k, head_size=plan.head.w)
    nodes = [SimpleNamespace(name=d.name, address=d.name) for d in devices[1:]]
    split = Replanner(Measured(m, tuple(devices), 4e-3, 5e7), settings).split(cluster, nodes)  # type: ignore[arg-type]
    assert split.sizes == [plan.device(n.name).w for n in split.nodes]
    assert split.rooms == [plan.device(n.name).room for n in split.nodes] and any(split.rooms)
    assert "rooms chosen from the ring's timing" in split.how
    # a split by hand sends none: each node keeps its own rule
    assert Replanner(by_hand={"a": 8, "b": 8}).split(cluster, nodes).rooms == [0, 0]  # type: ignore[arg-type]


def test_a_head_that_streams_is_bounded_by_its_disk_as_a_node_is() -> None:
    """The head's windows stream as a node's do: its disk's reading a token bounds the round-by-round prediction
    (on the memory testbed, a head given 4 streamed layers on a 29 MB/s disk was predicted 5.8 s a token for 7.3 s
    of reading, and took 7.9)."""
    from primaplug.scheduler.ring import predict_ring

    devices, m = two_disks()
    p = platform(devices, m, slow_disk_bps=1e7)
    w = np.array([8, 12, 12])
    assert p.head[0]
    pred = predict_ring(p, 1, w, np.zeros_like(w))
    assert pred.disk_s[0] > 1.0  # the head reads on its slow disk: 0.4 GB of memory for 0.8 GB of layers
    chosen = choose_rooms(p, 1, w, np.zeros_like(w))
    assert chosen.own_rule_s >= pred.disk_s[0] and chosen.tpot_s >= pred.disk_s[0]
