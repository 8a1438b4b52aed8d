"""The ring's latency model (scheduler/ring.py): the prefetch policy it mirrors, its optimum against exhaustive
search, and what it changes in a plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from primaplug.memory.policy import PAGE, plan_prefetch
from primaplug.scheduler import solve
from primaplug.scheduler.halda import valid_rounds
from primaplug.scheduler.latency import platform
from primaplug.scheduler.ring import best_placement, gpu_layers, predict_ring, stream_bytes
from tests.test_scheduler_halda import device, model, random_instance


@pytest.mark.parametrize(("budget", "window", "k", "read", "faulted"), [
    (100, 60, 3, 120, 0),  # a third of every layer kept (60), 40 streamed per window, all prefetched
    (50, 60, 1, 60, 10),  # one window larger than the budget: all of it read, 10 fault in as it computes
    (130, 60, 3, 150, 0),  # two windows fit at once: a sixth kept, 50 streamed per window, prefetched early
    (200, 60, 3, 0, 0),  # everything fits: resident, nothing read
])
def test_stream_bytes_by_hand(budget: int, window: int, k: int, read: int, faulted: int) -> None:
    r, f = stream_bytes(np.array(budget * PAGE), np.array(window * PAGE), k)
    assert (float(r) / PAGE, float(f) / PAGE) == pytest.approx((read, faulted))


def test_stream_bytes_follows_the_prefetch_plan() -> None:
    """The closed form is what plan_prefetch plans for k windows of one tensor each, to a page per window."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        k = int(rng.integers(1, 9))
        window = int(rng.integers(1, 400)) * PAGE
        budget = int(rng.integers(0, k * 500)) * PAGE
        plan = plan_prefetch([[(i * window, window)] for i in range(k)], budget)
        streamed = plan.stream_bytes
        read = sum(streamed)
        faulted = sum(max(0, s - plan.prefetch_room) for s in streamed)
        r, f = stream_bytes(np.array(budget), np.array(window), k)
        assert float(r) == pytest.approx(read, abs=2 * k * PAGE), (k, window // PAGE, budget // PAGE, plan.describe())
        assert float(f) == pytest.approx(faulted, abs=4 * k * PAGE), (k, window // PAGE, budget // PAGE)


def test_time_is_the_longer_of_the_chain_and_the_busiest_device() -> None:
    # a head that holds its share, and two devices that stream: their disks overlap, the chain does not
    devices = [device("head", ram_gb=3), device("a", ram_gb=1, disk=1e8), device("b", ram_gb=1, disk=1e8)]
    p = platform(devices, model(12, layer_gb=0.5), slow_disk_bps=1e6)
    pred = predict_ring(p, 2, [1, 2, 3], [0, 0, 0])
    chain = (pred.compute_s + pred.memory_s + pred.network_s + pred.fault_s).sum()
    assert float(pred.total_s) == pytest.approx(max(chain, float(pred.own_s.max())))
    assert pred.read_bytes[0] == 0 and pred.read_bytes[1] > 0 and pred.read_bytes[2] > pred.read_bytes[1]
    assert pred.disk_s[2] == pytest.approx(pred.read_bytes[2] / 1e8)
    # the head runs the output layer even with no layer of its own, and still passes the token on
    empty = predict_ring(p, 2, [0, 3, 3], [0, 0, 0])
    assert empty.compute_s[0] > 0 and empty.network_s[0] > 0


def exhaustive_ring(p, least: int = 1) -> float:  # noqa: ANN001
    """The least ring-model time over every valid k and every split (the head w >= 0, the others >= `least`),
    GPU layers as the model places them."""
    best = np.inf
    for k in valid_rounds(p.n_layer, p.n_devices):
        per_round = p.n_layer // k
        ws = []
        for cuts in itertools.combinations_with_replacement(range(per_round + 1), p.n_devices - 1):
            w = np.diff((0, *cuts, per_round))  # the head's share first, then the others' in any order
            if (w[1:] >= least).all():
                ws.append(w)
        for w in ws:
            for perm in set(itertools.permutations(w[1:])):
                wv = np.array((w[0], *perm))
                best = min(best, float(predict_ring(p, k, wv, gpu_layers(p, k, wv)).total_s))
    return best


@pytest.mark.parametrize(("seed", "relays"), [(0, False), (1, False), (2, False), (3, False), (4, True), (5, True)])
def test_best_placement_matches_exhaustive_search(seed: int, relays: bool) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(8):
        devices, m = random_instance(rng, int(rng.integers(1, 5)))
        p = platform(devices, m, slow_disk_bps=2e8)
        optimum = exhaustive_ring(p, least=0 if relays else 1)
        found = [best_placement(p, k, relays=relays) for k in valid_rounds(p.n_layer, p.n_devices)]
        found = [f for f in found if f is not None]
        if not np.isfinite(optimum):
            assert not found
            continue
        best = min(found, key=lambda f: f.objective_s)
        assert best.objective_s == pytest.approx(optimum, rel=1e-9)
        assert best.objective_s == pytest.approx(
            float(predict_ring(p, best.k, np.array(best.w), np.array(best.n)).total_s), rel=1e-12)


def test_halda_spreads_streaming_over_disks_under_the_ring_model() -> None:
    """Two equal devices that must stream: the paper's sum is indifferent to who streams and piles the overflow
    on one; the ring model splits it, since the two disks then read side by side."""
    devices = [device("head", ram_gb=0.4, disk=3e7), device("a", ram_gb=0.8, disk=1.2e8),
               device("b", ram_gb=0.8, disk=1.21e8)]
    m = model(32, layer_gb=0.1, n_kv=512, output_bytes=10_000_000)
    paper = solve(devices, m, latency_model="paper", slow_disk_bps=1e7)
    ring = solve(devices, m, latency_model="ring", slow_disk_bps=1e7)
    assert ring.latency_model == "ring" and paper.latency_model == "paper"
    a, b = ring.device("a"), ring.device("b")
    assert max(d.w for d in paper.devices) >= 3 * min(d.w for d in paper.devices[1:])  # piled on the faster disk
    assert abs(a.w - b.w) <= 1 and a.disk_bytes > 0 and b.disk_bytes > 0
    # scored by the ring model, the paper's plan is slower than the ring's
    p = platform(devices, m, slow_disk_bps=1e7)
    paper_w = [d.w for d in paper.devices]
    as_ring = predict_ring(p, paper.k, paper_w, gpu_layers(p, paper.k, np.array(paper_w)))
    assert ring.total_s < float(as_ring.total_s)
    text = ring.describe()
    # both stream layer by layer, and the rooms the ring's timing gives them beat each node's own rule
    assert "round by round" in text and "rooms chosen from the ring's timing" in text
    assert ring.rooms is not None and ring.total_s == ring.rooms.tpot_s < ring.rooms.own_rule_s


def test_ring_plan_may_leave_the_head_without_layers() -> None:
    # a head with a slow disk and little memory is best left to embed, sample and run the output layer
    devices = [device("head", ram_gb=0.35, disk=2e7), device("a", ram_gb=4, disk=2e9),
               device("b", ram_gb=4, disk=2e9)]
    plan = solve(devices, model(16, layer_gb=0.3), latency_model="ring", slow_disk_bps=1e7)
    assert plan.head.w == 0 and plan.head.windows and all(r.n_layers == 0 for r in plan.head.windows)
    assert sum(d.w for d in plan.devices) * plan.k == 16


def test_unknown_latency_model_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown latency model"):
        solve([device("head")], model(4), latency_model="nope")  # type: ignore[arg-type]


def test_a_head_alone_has_no_hops() -> None:
    # nodes a hair faster than the head, on the same machine: moving every layer to one would add two hops a
    # round; the ring model knows the head alone sends nothing, so the nodes are dropped
    devices = [device("head", flops=1e11), device("a", flops=1.001e11), device("b", flops=1.001e11)]
    plan = solve(devices, model(12, layer_gb=0.01), latency_model="ring")
    assert [d.name for d in plan.devices] == ["head"] and plan.head.network_s == 0
    assert {d.name for d in plan.dropped} == {"a", "b"}


def test_what_cannot_be_placed_under_the_ring_model_is_a_clear_error() -> None:
    from primaplug.core import PlacementInfeasibleError

    # too little memory behind slow disks: the same check as the paper's model
    with pytest.raises(PlacementInfeasibleError, match="400 MB/s") as e:
        solve([device("head", ram_gb=3, disk=1e8), device("b", ram_gb=3, disk=2e8)], model(24, layer_gb=0.5),
              latency_model="ring")
    assert e.value.shortfall_bytes > 0
    # a slow-disk node must run a layer in each of 4 rounds but holds only about two: no placement with k = 4
    devices = [device("head", ram_gb=16), device("slow", ram_gb=1.3, disk=5e7)]
    with pytest.raises(PlacementInfeasibleError, match="no placement with k = 4 keeps every device with a slow disk"):
        solve(devices, model(12), latency_model="ring", rounds=4)
    assert solve(devices, model(12), latency_model="ring", rounds=2).k == 2  # two layers fit it


def test_a_streaming_mixture_of_experts_is_priced_by_the_experts_its_tokens_choose() -> None:
    """A model whose layers are 90% routed experts, 1 of 8 a token: a device whose windows do not fit reads the
    rest of its layers as a window and only the chosen experts the hot set lacks; the same layers dense read
    everything streamed. Where all fits, nothing is read either way."""
    gb = 1 << 30
    devices = [device("head", ram_gb=8), device("a", ram_gb=2.5, disk=1e8)]
    dense = platform(devices, model(12, layer_gb=0.5), slow_disk_bps=1e6)
    moe = platform(devices, model(12, layer_gb=0.5, layer_expert_bytes=int(0.45 * gb), expert_token_share=1 / 8),
                   slow_disk_bps=1e6)
    w, n = [0, 12], [0, 0]
    d, m = predict_ring(dense, 1, w, n), predict_ring(moe, 1, w, n)
    assert d.read_bytes[1] > 0 and 0 < m.read_bytes[1] < d.read_bytes[1] / 3, (d.read_bytes, m.read_bytes)
    # by hand: the rest (12 x 0.05 GB) fits beside the working set, so it reads only the chosen experts it lacks
    kv = 12 * (moe.layer_kv_bytes - moe.layer_bytes)
    budget = moe.ram_cap[1] - moe.ram_fixed(1)[1] - kv - 0.05 * moe.ram_total[1]
    rest = 12 * (moe.layer_bytes - moe.expert_bytes)
    hit = (budget - rest) / (12 * moe.expert_bytes)
    assert float(m.read_bytes[1]) == pytest.approx(12 * moe.expert_bytes / 8 * (1 - hit), rel=1e-6)
    assert float(m.fault_s[1]) == pytest.approx(float(m.read_bytes[1]) / 1e8)  # read on the token's path
    assert float(predict_ring(moe, 1, [6, 6], n).total_s) <= float(m.total_s)
    roomy = platform([device("head"), device("a", ram_gb=16)], model(12, layer_gb=0.5,
                     layer_expert_bytes=int(0.45 * gb), expert_token_share=1 / 8), slow_disk_bps=1e6)
    assert predict_ring(roomy, 1, w, n).read_bytes[1] == 0


@pytest.mark.parametrize("latency_model", ["paper", "ring"])
def test_a_plan_for_a_mixture_of_experts_says_how_it_priced_a_layer(latency_model: str) -> None:
    """The plan carries a mixture of experts' layer three ways (all its bytes, a token's, the working set) and the
    dashboard's Plan pane shows them; a dense model's plan has none."""
    from primaplug.tui.render import plan_summary

    gb = 1 << 30
    devices = [device("head", ram_gb=8), device("a", ram_gb=2.5, disk=1e8)]
    moe = model(12, layer_gb=0.5, layer_expert_bytes=int(0.45 * gb), expert_token_share=1 / 8)
    plan = solve(devices, moe, latency_model=latency_model)
    assert plan.experts is not None and plan.experts == moe.experts
    assert plan.experts.token_bytes == round(moe.layer_bytes - moe.layer_expert_bytes * 7 / 8)
    assert "a token uses 12.5% of those" in plan_summary(plan).plain
    assert solve(devices, model(12), latency_model=latency_model).experts is None


@pytest.mark.parametrize("latency_model", ["ring", "paper"])
def test_the_shared_kv_tail_is_the_heads_last_window(latency_model: str) -> None:
    """Gemma 4 E2B/E4B: the last layers that share keys and values run in one window, the head's last, under both
    latency models, even where the head is the slowest device and would otherwise hold no layer; a split by hand
    that cuts them is refused saying so. Its per-layer inputs make each hop dearer by half of them on average."""
    from primaplug.scheduler import placement

    devices = [device("head", ram_gb=2, flops=3e10), device("a", ram_gb=8), device("b", ram_gb=8)]
    m = model(35, layer_gb=0.05, tail_layers=22, per_layer_input_bytes=4 * 256 * 35)
    assert m.hidden_bytes == 4 * 1024 + 2 * 256 * 35
    plan = solve(devices, m, latency_model=latency_model)
    assert plan.head.w >= 22 and plan.head.windows[-1].end == 35
    assert solve(devices, model(35, layer_gb=0.05), latency_model=latency_model).head.w < 22  # no tail: fewer
    with pytest.raises(ValueError, match="last 22 layers share keys and values"):
        placement(devices, m, [10, 10, 15])
    assert placement(devices, m, [7, 6, 22]).head.w == 22


def test_windows_start_only_where_they_may() -> None:
    """GLM 5.2: a layer sharing an earlier layer's indexer cannot start a window. The ring's model plans around those
    layers (every k whose rounds may start where they must); the paper's sum and the baselines, which cannot, say so;
    a split by hand that starts a window there is refused."""
    from primaplug.core.errors import PlacementInfeasibleError
    from primaplug.scheduler import placement

    barred = tuple(il for il in range(78) if il >= 2 and (il - 2) % 4)  # GLM 5.2's 78 layers
    # no device holds the model alone, and none may stream it from its disk: the ring splits it three ways
    devices = [device(name, ram_gb=2.0, disk=1e6, flops=f) for name, f in (("head", 1e11), ("a", 2e11), ("b", 3e11))]
    m = model(78, layer_gb=0.05, barred_starts=barred)
    plan = solve(devices, m, latency_model="ring")
    starts = {r.start for d in plan.devices for r in d.windows if r.n_layers}
    assert starts and not starts & set(barred) and len(starts) > 1
    assert sum(d.w for d in plan.devices) * plan.k == 78
    for kw in ({"latency_model": "paper"}, {"scheduler": "memory", "latency_model": "ring"}):
        with pytest.raises(PlacementInfeasibleError, match="only Halda under the ring's latency model"):
            solve(devices, m, **kw)
    with pytest.raises(ValueError, match=r"starts a window at layer 20.*\(0, 1, 2, 6, 10, 14, ...\)"):
        placement(devices, m, [20, 20, 38])
    assert placement(devices, m, [22, 20, 36]).k == 1


def test_an_even_split_leaves_the_tail_to_the_head_and_starts_windows_where_they_may() -> None:
    """The even split by hand (the CLI's `--scheduler even` and the dashboard's, one rule): Gemma 4 E2B's shared-KV
    tail to the head, the rest evenly to the nodes; GLM 5.2's boundaries moved down to layers with their own
    indexer. What it gives is a placement the scorer takes."""
    from primaplug.core.windows import even_sizes
    from primaplug.scheduler import placement

    assert even_sizes(7, 2) == [3, 4, 0]
    assert even_sizes(35, 2, tail=22) == [6, 7, 22]
    assert even_sizes(36, 2, rounds=2, tail=22) == [9, 9, 0]  # two rounds cannot leave it to the head: refused later
    barred = tuple(il for il in range(78) if il >= 2 and (il - 2) % 4)  # GLM 5.2's 78 layers
    assert even_sizes(78, 3, barred=barred) == [26, 24, 28, 0]
    devices = [device(name, ram_gb=8) for name in ("head", "a", "b")]
    assert placement(devices, model(35, layer_gb=0.05, tail_layers=22), even_sizes(35, 2, tail=22)).head.w == 22
    assert placement(devices[:3], model(78, layer_gb=0.05, barred_starts=barred),
                     even_sizes(78, 2, barred=barred)).k == 1
