"""Halda against exhaustive search, device selection, the baselines, infeasible input and layer coverage."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from primaplug.core import ConfigError, PlacementInfeasibleError
from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.scheduler import solve
from primaplug.scheduler.baselines import compute_proportional, memory_proportional
from primaplug.scheduler.halda import FixedKSolver, apportion, gpu_layer_cap, halda, valid_rounds
from primaplug.scheduler.latency import M4, Platform, assign_sets, platform, predict

GB = 10**9


def model(n_layer: int = 12, layer_gb: float = 0.5, **kw: object) -> ModelProfile:
    return ModelProfile(**{
        "name": "m", "n_layer": n_layer, "n_vocab": 1000, "n_embd": 1024, "layer_bytes": int(layer_gb * GB),
        "input_bytes": 100_000_000, "output_bytes": 200_000_000, "layer_flops": {"Q4_K": 1e9, "F32": 1e7},
        "output_flops": {"Q4_K": 5e8}, "kv_bytes_per_token_layer": 2048, "n_kv": 4096,
        "compute_buffer_cpu_bytes": 100_000_000, "compute_buffer_gpu_bytes": 150_000_000, **kw})


def device(name: str, os: str = "linux", backend: str = "cpu", *, flops: float = 1e11, ram_gb: float = 8,
           disk: float = 2e9, vram_gb: float = 0, gpu_flops: float = 0, metal_gb: float = 0) -> DeviceProfile:
    gpu = backend != "cpu"
    return DeviceProfile(
        name=name, os=os, backend=backend, cpu_flops={"Q4_K": flops, "F32": flops / 3},
        gpu_flops={"Q4_K": gpu_flops} if gpu else {}, cpu_read_bps=2e10, gpu_read_bps=2e11 if gpu else 0,
        kv_copy_cpu_bps=5e9, kv_copy_gpu_bps=5e10 if gpu else 0, h2d_bps=1e10 if backend == "cuda" else 0,
        d2h_bps=1e10 if backend == "cuda" else 0, copy_latency_s=2e-5, unified_memory=backend == "metal",
        disk_seq_bps=disk, disk_rand_bps=disk / 2, mem_available_bytes=int(ram_gb * GB),
        vram_free_bytes=int(vram_gb * GB), metal_working_set_bytes=int(metal_gb * GB),
        link_latency_s=4e-3, link_bps=5e7)


def random_instance(rng: np.random.Generator, n_devices: int, n_layer: int = 12,
                    moe: bool = False) -> tuple[list, ModelProfile]:
    """Heterogeneous devices (every OS and backend, GPUs, tight memory, slow disks) and a small model (`moe`: most
    of each layer routed experts, of which a token uses an eighth or fewer)."""
    layer_gb = rng.uniform(0.2, 1.0)
    experts = dict(layer_expert_bytes=int(rng.uniform(0.5, 0.95) * layer_gb * GB),
                   expert_token_share=float(rng.choice([1 / 8, 1 / 16, 8 / 128]))) if moe else {}
    m = model(n_layer, layer_gb=layer_gb, n_kv=int(rng.choice([512, 4096])),
              output_bytes=int(rng.uniform(0.05, 0.5) * GB), **experts)
    devices = []
    for i in range(n_devices):
        os = str(rng.choice(["linux", "android", "macos", "macos"]))
        backend = "cpu"
        if os == "macos" and rng.random() < 0.6:
            backend = "metal"
        elif os == "linux" and rng.random() < 0.5:
            backend = "cuda"
        flops = 10 ** rng.uniform(10, 11.5)
        devices.append(device(
            f"d{i}", os, backend, flops=flops, ram_gb=rng.uniform(0.5, 8), disk=10 ** rng.uniform(8, 9.7),
            vram_gb=rng.uniform(0.5, 6) if backend == "cuda" else 0, metal_gb=rng.uniform(1, 8),
            gpu_flops=flops * 10 ** rng.uniform(0.5, 1.5)))
    return devices, m


def exhaustive(p: Platform) -> tuple[float, tuple[int, tuple[int, ...], tuple[int, ...]] | None]:
    """The best (k, w, n) over every valid k, every split w >= 1 of W = L/k and every n within VRAM, scored by
    the latency model with each device's set taken from its own memory use; as in Halda, a device with a slow
    disk must not spill."""
    best: tuple[float, tuple | None] = (np.inf, None)
    for k in valid_rounds(p.n_layer, p.n_devices):
        per_round = p.n_layer // k
        cap = gpu_layer_cap(p, k)
        ws, ns = [], []
        for cuts in itertools.combinations(range(1, per_round), p.n_devices - 1):
            w = np.diff((0, *cuts, per_round))
            for n in itertools.product(*(range(min(wi, c) + 1) for wi, c in zip(w, cap, strict=True))):
                ws.append(w)
                ns.append(n)
        w, n = np.array(ws), np.array(ns)
        pred = predict(p, k, w, n)
        total = np.where((pred.overflows & p.slow_disk).any(axis=1), np.inf, pred.total_s)
        i = int(np.argmin(total))
        if total[i] < best[0]:
            best = (float(total[i]), (k, tuple(w[i]), tuple(n[i])))
    return best


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "experts"])
@pytest.mark.parametrize("seed", range(6))
def test_halda_matches_exhaustive_search(seed: int, moe: bool) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(12):
        devices, m = random_instance(rng, int(rng.integers(1, 5)), moe=moe)
        p = platform(devices, m)
        optimum, arg = exhaustive(p)
        result = halda(p)
        if not np.isfinite(optimum):
            assert result is None, "halda found a placement where none satisfies the constraints"
            continue
        assert result is not None, f"halda found nothing; exhaustive search found {arg}"
        s = result.solution
        assert s.objective_s == pytest.approx(optimum, rel=1e-9), (s, arg)
        # the ILP's objective is the latency model's prediction for the placement it returns
        assert s.objective_s == pytest.approx(float(predict(p, s.k, np.array(s.w), np.array(s.n)).total_s), rel=1e-9)
        assert list(result.sets) == [("M1", "M2", "M3", "M4")[i] for i in assign_sets(p, s.k, np.array(s.w),
                                                                                       np.array(s.n))]


def test_lp_and_branch_and_bound_agree() -> None:
    # the ILP's constraint matrix is totally unimodular: the LP's vertex is the integer optimum
    rng = np.random.default_rng(7)
    for _ in range(20):
        devices, m = random_instance(rng, int(rng.integers(2, 5)), n_layer=24)
        p = platform(devices, m)
        solver = FixedKSolver(p)
        sets = solver.ilp_sets(np.full(p.n_devices, M4), p.slow_disk)
        for k in valid_rounds(p.n_layer, p.n_devices):
            lp, ip = solver.solve(k, sets), solver.solve(k, sets, integer=True)
            assert (lp is None) == (ip is None)
            if lp is not None:
                assert lp.objective_s == pytest.approx(ip.objective_s, rel=1e-9)


def test_one_round_is_never_slower_in_the_model() -> None:
    # k rounds cost (k - 1) more messages and copies for the same layers and memory, so Halda's k is 1 ...
    devices = [device("head", backend="cuda", vram_gb=3, gpu_flops=2e12), device("a", ram_gb=2),
               device("b", "macos", "metal", metal_gb=3, gpu_flops=1e12)]
    m = model(24)
    best = solve(devices, m)
    assert best.k == 1
    # ... unless the caller asks for rounds: the same devices with k = 4, predicted slower
    four = solve(devices, m, rounds=4)
    assert four.k == 4 and all(len(d.windows) == 4 for d in four.devices)
    assert four.total_s > best.total_s


def test_a_device_that_only_slows_the_cluster_is_dropped() -> None:
    # the model (24 x 0.51 GB) needs both strong devices' RAM; the old laptop's CPU is 40 times slower
    strong = [device("head", flops=2e11, ram_gb=8), device("b", flops=2e11, ram_gb=8)]
    weak = device("old-laptop", flops=5e9, ram_gb=2, disk=3e8)
    plan = solve([*strong, weak], model(24))
    assert [d.name for d in plan.devices] == ["head", "b"]
    assert [d.name for d in plan.dropped] == ["old-laptop"]
    assert "layer per window" in plan.dropped[0].reason
    full = solve([*strong, weak], model(24), scheduler="memory")
    assert plan.total_s < full.total_s


def test_a_weak_device_that_saves_disk_reloads_is_kept() -> None:
    # appendix A.7's shape: two fast devices that cannot hold the model and must reload layers from their SSDs,
    # and a weak CPU with RAM to spare; the weak device's compute costs less than the reloads it saves
    fast = [device("head", flops=3e11, ram_gb=6, disk=1.5e9), device("b", flops=3e11, ram_gb=6, disk=1.5e9)]
    weak = device("weak", flops=2e10, ram_gb=12, disk=2e8)
    m = model(40, layer_gb=0.45)
    without = solve(fast, m)
    assert without.disk_s > 1.0
    plan = solve([*fast, weak], m)
    assert "weak" in [d.name for d in plan.devices] and not plan.dropped
    assert plan.device("weak").w > 1 and plan.device("weak").disk_s == 0.0
    assert plan.total_s < 0.7 * without.total_s


def test_memory_proportional_baseline() -> None:
    devices = [device("head", ram_gb=8), device("gpu", backend="cuda", ram_gb=4, vram_gb=4, gpu_flops=1e12),
               device("phone", "android", ram_gb=4)]
    m = model(12, layer_gb=0.5)
    w, n = memory_proportional(platform(devices, m))
    # budgets 8, 4 + 4 (VRAM), 4 GB: one layer each, the other 9 in proportion 8:8:4 = 3.6, 3.6, 1.8:
    # floors 3, 3, 1 and the two largest remainders (.8 of the phone, then .6 of the head) get one more
    assert w.tolist() == [5, 4, 3] and sum(w) == 12
    # the GPU holds floor((4e9 - c^gpu 0.15e9) / b') of its 4 layers, b' = 0.5e9 + 2048 * 4096 bytes
    assert n.tolist() == [0, 4, 0]
    plan = solve(devices, m, scheduler="memory")
    assert plan.scheduler == "memory" and plan.k == 1 and [d.w for d in plan.devices] == [5, 4, 3]


def test_compute_proportional_baseline_migrates_what_does_not_fit() -> None:
    fast_small = device("head", flops=4e11, ram_gb=2.5)
    slow_big = device("big", flops=1e11, ram_gb=16)
    m = model(12, layer_gb=0.5)
    p = platform([fast_small, slow_big], m)
    w, n = compute_proportional(p)
    # speed 4:1 gives 1 + 8 and 1 + 2 = 9 and 3; the head holds (2.5e9 - 0.1e9 - head extras 0.2001e9) // b'
    # = 4 layers, so 5 move to "big", which has room
    assert w.tolist() == [4, 8] and n.tolist() == [0, 0]
    assert not predict(p, 1, w, n).overflows.any()


def test_compute_baseline_spreads_what_nobody_holds_over_the_cpus() -> None:
    devices = [device("head", flops=2e11, ram_gb=2), device("b", flops=1e11, ram_gb=2)]
    m = model(12, layer_gb=0.5)
    w, _ = compute_proportional(platform(devices, m))
    assert sum(w) == 12 and w[0] > w[1]


def test_too_little_memory_behind_slow_disks_is_infeasible() -> None:
    devices = [device("head", ram_gb=3, disk=1e8), device("b", ram_gb=3, disk=2e8)]
    m = model(24, layer_gb=0.5)
    for scheduler in ("halda", "memory", "compute"):
        with pytest.raises(PlacementInfeasibleError) as e:
            solve(devices, m, scheduler=scheduler)
        err = e.value
        # 24 layers of 0.508 GB need ~12.2 GB; 3 GB each minus buffers holds 5 + 5 layers
        assert err.shortfall_bytes == 14 * m.layer_bytes_with_kv
        assert "hold 10 of them" in str(err) and "400 MB/s" in str(err) and "shorter context" in str(err)
    # a fast disk anywhere makes it feasible: that device streams the rest
    plan = solve([devices[0], device("ssd", ram_gb=3, disk=3e9)], m)
    assert plan.device("ssd").disk_s > 0 and plan.device("head").disk_s < 0.01


def test_a_slow_head_without_room_for_a_layer_is_infeasible() -> None:
    with pytest.raises(PlacementInfeasibleError, match="the head 'head' cannot hold one layer") as e:
        solve([device("head", ram_gb=0.4, disk=1e8), device("b", ram_gb=16)], model(12))
    assert e.value.shortfall_bytes > 0


def test_a_slow_device_without_room_for_a_layer_is_dropped() -> None:
    plan = solve([device("head", ram_gb=16), device("tiny", ram_gb=0.3, disk=5e7)], model(12))
    assert [d.name for d in plan.dropped] == ["tiny"] and "does not hold one layer" in plan.dropped[0].reason


def test_more_devices_than_layers() -> None:
    devices = [device(f"d{i}", flops=1e11 * (1 + i), ram_gb=16) for i in range(6)]
    plan = solve(devices, model(4))
    assert plan.devices[0].name == "d0" and len(plan.devices) <= 4
    with pytest.raises(PlacementInfeasibleError, match="6 devices but only 4 layers"):
        solve(devices, model(4), scheduler="memory")


@pytest.mark.parametrize("scheduler", ["halda", "memory", "compute"])
def test_every_layer_is_assigned_exactly_once(scheduler: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(40):
        n_layer = int(rng.choice([12, 24, 36, 40, 80]))
        devices, m = random_instance(rng, int(rng.integers(1, 9)), n_layer)
        try:
            plan = solve(devices, m, scheduler=scheduler)
        except PlacementInfeasibleError:
            continue
        layers = [layer for _, window in plan.windows_in_order() for layer in range(window.start, window.end)]
        assert layers == list(range(n_layer))
        assert sum(len(d.windows) for d in plan.devices) == plan.k * len(plan.devices)
        assert plan.k * sum(d.w for d in plan.devices) == n_layer
        assert all(0 <= d.n <= d.w and all(r.n_layers == d.w for r in d.windows) for d in plan.devices)
        placed = {d.name for d in plan.devices} | {d.name for d in plan.dropped}
        assert placed == {d.name for d in devices} and plan.head.name == devices[0].name


def test_the_head_runs_last_in_each_round() -> None:
    # each device holds 4 of the 12 layers (with 2 windows' compute buffers) and its disk is too slow to spill
    devices = [device(name, ram_gb=2.5, disk=1e8) for name in ("head", "a", "b")]
    plan = solve(devices, model(12), rounds=2)
    assert [d.w for d in plan.devices] == [2, 2, 2]
    order = plan.windows_in_order()
    assert [name for name, _ in order] == ["a", "b", "head", "a", "b", "head"]
    assert order[2][1].end == 6 and order[-1][1].end == 12
    assert plan.device("head").windows[0].start == plan.device("b").windows[0].end


def test_plan_totals_and_description() -> None:
    devices = [device("head", backend="cuda", ram_gb=8, vram_gb=4, gpu_flops=2e12),
               device("mac", "macos", "metal", metal_gb=4, gpu_flops=1e12), device("phone", "android", ram_gb=3)]
    plan = solve(devices, model(24))
    p = platform([d for d in devices if d.name in {x.name for x in plan.devices}], model(24))
    pred = predict(p, plan.k, np.array([d.w for d in plan.devices]), np.array([d.n for d in plan.devices]))
    assert plan.total_s == pytest.approx(float(pred.total_s))
    assert plan.total_s == pytest.approx(plan.compute_s + plan.memory_s + plan.disk_s + plan.network_s)
    text = plan.describe()
    assert "plan by halda" in text and "(head)" in text and f"{plan.total_s * 1e3:.1f} ms/token" in text
    for d in plan.devices:
        assert d.name in text and str(d.windows[0]) in text


def test_apportion_is_proportional_with_a_minimum() -> None:
    # 1 each, then 7 as 1.75, 1.75, 3.5: floors 1, 1, 3 and the two largest remainders (.75, .75) get one more
    assert apportion([1, 1, 2], 10).tolist() == [3, 3, 4]
    assert apportion([0, 0], 5).tolist() == [3, 2]  # no weights: even; a tie goes to the earlier device
    assert apportion([3, 1], 4, minimum=0).tolist() == [3, 1]


def test_bad_requests() -> None:
    devices = [device("head"), device("head")]
    with pytest.raises(ValueError, match="unique"):
        solve(devices, model())
    with pytest.raises(ValueError, match="unknown scheduler"):
        solve(devices[:1], model(), scheduler="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must divide"):
        solve(devices[:1], model(12), rounds=5)


def test_importing_the_scheduler_loads_no_solver() -> None:
    code = "import sys, primaplug.scheduler; assert 'highspy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_halda_without_highspy_says_how_to_plan_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Termux leaves highspy out (pyproject's marker): planning with Halda says what to install or use instead,
    and the schedulers that need no solver still plan."""
    monkeypatch.setitem(sys.modules, "highspy", None)  # `import highspy` now raises ModuleNotFoundError
    devices = [device("head"), device("n1")]
    with pytest.raises(ConfigError, match=r"Halda .* needs highspy, .* is not installed here: `pip install highspy`, "
                                          r"or plan with `--scheduler even\|memory\|compute` or `--layers`") as raised:
        solve(devices, model())
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)
    assert solve(devices, model(), scheduler="memory").scheduler == "memory"
