"""The dashboard's logic without nodes: what the panes draw (tui/render.py), the remembered cluster, the
coordinator's planning over recorded profiles (manual and even splits scored, the other k weighed, failed and
removed nodes left out), the token clock, and the app's handling of bad input."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from primaplug.core.errors import ConfigError
from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.head.coordinator import Coordinator, PlanRequest
from primaplug.head.events import BatchDone, NodeProgress, NodeView, TokenClock
from primaplug.scheduler import alternatives, placement, solve
from primaplug.tui.config import Remembered
from primaplug.tui.render import figures, layer_map, plan_summary, state_text
from tests.dashboard_fixture import RECORD, recorded_app

DEVICES = tuple(msgspec.convert(d, DeviceProfile) for d in RECORD["measured"]["devices"])
MODEL = msgspec.convert(RECORD["measured"]["model"], ModelProfile)


def _map_rows(text: str) -> list[str]:
    return text.splitlines()[1:-1]  # the scale line and the legend left out


def test_the_layer_map_shows_each_layer_once_in_its_round_and_gpu_layers() -> None:
    plan = placement(DEVICES, MODEL, [3, 3, 2, 1], rounds=2, gpu_layers=[1, 0, 0])
    text = layer_map(plan, width=18 + 20)  # one character a layer
    rows = _map_rows(text.plain)
    label = max(len(d.name + (" (head)" if d is plan.head else "")) for d in plan.ring) + 1
    cells = [row[label:] for row in rows]
    for layer in range(MODEL.n_layer):
        owners = [i for i, c in enumerate(cells) if c[layer] in "█G"]
        assert len(owners) == 1, f"layer {layer} drawn on {owners}"
        d = plan.ring[owners[0]]
        assert any(w.start <= layer < w.end for w in d.windows)
    assert cells[0][0] == "G" and cells[0][1] == "█" and cells[0][9] == "G"  # node1's first layer of each window
    assert "rounds: 1 2" in text.plain
    wide = _map_rows(layer_map(plan, width=200).plain)
    assert len(wide[0]) > len(rows[0]), "cells widen to fill a wide pane"
    narrow = layer_map(plan, width=20).plain
    assert "layers a cell" in narrow


def test_states_are_drawn_with_their_progress_and_failures_in_red() -> None:
    assert str(state_text(NodeView(state="loading", progress=0.5))).startswith("loading ███")
    assert "50%" in str(state_text(NodeView(state="loading", progress=0.5)))
    assert str(state_text(NodeView(state="profiling", progress=1.0))) == "profiled"
    assert str(state_text(NodeView(state="ready"), serving=True)) == "serving"
    failed = state_text(NodeView(state="ready"), error="gone")
    assert str(failed) == "failed" and "red" in str(failed.style)
    assert str(state_text(None)) == "not connected"


def test_a_gpu_is_drawn_with_the_memory_the_scheduler_caps_it_by() -> None:
    """CUDA: its free VRAM. Metal (no VRAM of its own): its recommended working set, which was drawn as 0.0."""
    from primaplug.tui.render import profile_cells, profile_detail

    gib = 1 << 30
    mac = msgspec.structs.replace(DEVICES[1], os="macos", backend="metal", unified_memory=True,
                                  metal_working_set_bytes=12 * gib, vram_free_bytes=0)
    assert profile_cells(mac)[0] == f"macos {mac.cpu_count}c metal"
    detail = profile_detail("mac", "", mac, None, "", "").plain
    assert f"Metal working set {12 * gib / 1e9:.1f} GB (memory shared with the CPU)" in detail and "VRAM" not in detail
    cuda = msgspec.structs.replace(DEVICES[1], backend="cuda", vram_free_bytes=6 * gib, metal_working_set_bytes=0)
    assert profile_cells(cuda)[0].endswith(" cuda")
    assert f"VRAM {6 * gib / 1e9:.1f} GB free" in profile_detail("box", "", cuda, None, "", "").plain
    assert profile_cells(DEVICES[1])[0] == f"linux {DEVICES[1].cpu_count}c"  # the recorded devices have no GPU


def test_figures_compare_measured_with_predicted() -> None:
    text = figures(0.1, 0.02, 9, 0.025).plain
    assert "TTFT      100 ms" in text and "TPOT      20.0 ms" in text
    assert "predicted 25.0 ms  measured 0.80x" in text and "50.0 tokens/s, 10 tokens" in text
    assert "predicted -" in figures(0, 0, 0, None).plain
    drafts = figures(0.1, 0.02, 9, 0.025, drafts=(41, 52)).plain
    assert "drafts 79% kept" in drafts and len(drafts.splitlines()) == 4  # the pane's four lines
    assert max(len(line) for line in drafts.splitlines()[:1]) <= 36  # the figures column at 80x24
    assert "drafts none yet" in figures(0, 0, 0, None, drafts=(0, 0)).plain


def test_the_plan_says_whether_speculation_pays() -> None:
    from primaplug.head.planning import plan_with_speculation

    plan = placement(DEVICES, MODEL, [6, 6, 4, 2], rounds=1, gpu_layers=[0, 0, 0])
    assert "speculation" not in plan_summary(plan).plain
    cheap = plan_with_speculation(plan, plan.total_s / 50, 0, 4)
    assert cheap.speculation is not None and cheap.speculation.pays
    assert cheap.speculation.tpot_s < plan.total_s and "pays above" in plan_summary(cheap).plain
    assert cheap.describe().splitlines()[-1] == cheap.speculation.describe()
    dear = plan_with_speculation(plan, plan.total_s * 2, 0, 4)
    assert "does not pay" in plan_summary(dear).plain


def test_the_token_clock_times_the_prompt_and_each_token() -> None:
    clock = TokenClock()
    clock(BatchDone(1, 0, 12, 0.1))
    for step in range(2, 6):
        clock(BatchDone(step, 10 + step, 1, 0.01))
    assert clock.tokens == 4 and clock.ttft_s > 0 and len(clock.intervals_s) == 4
    assert clock.tpot_s == pytest.approx(sum(clock.intervals_s) / 4)
    clock.start()
    assert clock.tokens == 0 and clock.tpot_s == 0 and clock.ttft_s == 0


def test_the_remembered_cluster_round_trips_and_a_bad_file_is_set_aside(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "dashboard.json"
    Remembered(nodes=["10.0.0.2:7000"], keys="cluster.key", scheduler="manual", layers=[6, 6, 6]).save(path)
    back = Remembered.load(path)
    assert back.nodes == ["10.0.0.2:7000"] and back.keys == "cluster.key" and back.layers == [6, 6, 6]
    path.write_text(json.dumps({"nodes": ["a:1"], "from_a_newer_version": True}))
    assert Remembered.load(path).nodes == ["a:1"]
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert Remembered.load(path) == Remembered()
    assert "starting afresh" in caplog.text
    assert Remembered.load(tmp_path / "none.json") == Remembered()


def test_a_split_by_hand_is_scored_and_checked() -> None:
    plan = placement(DEVICES, MODEL, [6, 6, 6])
    assert [d.w for d in plan.ring] == [6, 6, 6, 0] and plan.total_s > 0 and plan.scheduler == "manual"
    with pytest.raises(ValueError, match="one window size per node"):
        placement(DEVICES, MODEL, [9, 9])
    with pytest.raises(ValueError, match="run 17 layers; the model has 18"):
        placement(DEVICES, MODEL, [6, 6, 5])
    with pytest.raises(ValueError, match="at least one layer"):
        placement(DEVICES, MODEL, [9, 9, 0])
    with pytest.raises(ValueError, match="must divide"):
        placement(DEVICES, MODEL, [2, 2, 2], rounds=4)


def test_the_alternatives_are_every_k_the_scheduler_weighed() -> None:
    chosen = solve(DEVICES, MODEL, latency_model="ring")
    weighed = alternatives(DEVICES, MODEL)
    assert [k for k, _ in weighed] == [1, 2, 3, 6, 9]
    best = min((p.total_s for _, p in weighed if not isinstance(p, str)))
    assert chosen.total_s == pytest.approx(best)
    assert [k for k, _ in alternatives(DEVICES, MODEL, scheduler="memory")] == [1]


def test_the_coordinator_plans_only_usable_nodes(gemma_path: Path) -> None:
    app = recorded_app(gemma_path, PlanRequest("even"))
    c = app.coordinator
    assert [d.name for d in c.choice.plan.ring[:-1]] == ["node1", "node2", "node3"]
    c.events.publish(NodeProgress("node3", "failed", 0.0, "gone"))  # the ring saw it fail
    assert c.entry("node3").error == "gone"
    assert [d.name for d in c.plan(PlanRequest("even")).plan.ring[:-1]] == ["node1", "node2"]
    c.remove("127.0.0.1:7010")
    assert [d.name for d in c.plan(PlanRequest("manual", layers=(18,))).plan.ring[:-1]] == ["node1"]
    with pytest.raises(ConfigError, match="one window size per node"):
        c.plan(PlanRequest("manual", layers=(9, 9, 0)))
    with pytest.raises(ConfigError, match="must divide"):
        c.plan(PlanRequest("even", rounds=4))
    with pytest.raises(ConfigError, match="HOST:PORT"):
        c.add("node4")
    with pytest.raises(ConfigError, match="no plan to deploy|nothing is measured"):
        Coordinator(gemma_path).plan(PlanRequest())
    c.close()


def test_bad_plan_fields_are_refused_before_any_work(gemma_path: Path) -> None:
    app = recorded_app(gemma_path, PlanRequest("even"))
    before = app.coordinator.choice

    async def scenario() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("2")
            app.query_one("#layers").value = "6,x"
            app.query_one("#scheduler").value = "manual"
            await pilot.pause(0.2)
            await pilot.press("p")
            await pilot.pause(0.2)
            assert app.coordinator.choice is before and not app.busy
            assert any("comma-separated" in str(n.message) for n in app._notifications)
            app.query_one("#layers").value = "6,6,5"
            await pilot.press("p")
            await pilot.pause(0.5)
            assert "the model has 18" in app.plan_note
            await pilot.press("3")
            app.query_one("#prompt").focus()
            await pilot.press("h", "i", "enter")  # no ring deployed: told, nothing sent
            assert app.history == [] and any("deploy" in str(n.message) for n in app._notifications)

    asyncio.run(scenario())


def test_the_cli_loads_no_textual_until_the_dashboard_runs() -> None:
    code = "import sys, primaplug.cli; assert 'textual' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "primaplug", "dashboard", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--local-nodes" in out.stdout and "--keys" in out.stdout


def test_a_node_that_does_not_answer_is_marked_failed_with_what_to_do(gemma_path: Path) -> None:
    c = Coordinator(gemma_path, ["127.0.0.1:9"], timeout_s=0.3)
    seen: list[NodeProgress] = []
    c.events.subscribe(lambda e: seen.append(e) if isinstance(e, NodeProgress) else None)
    assert c.connect() == []
    error = c.nodes["127.0.0.1:9"].error
    assert "did not answer Hello within 0.3 s" in error
    assert "primaplug node -m" in error and "--listen 127.0.0.1:9" in error
    assert [e.state for e in seen] == ["connecting", "failed"]
    c.close()


def test_the_coordinator_counts_a_draft_in_the_head_and_the_plan(gemma_path: Path) -> None:
    """The draft's memory is taken off the head's before planning, and every plan says whether drafting pays
    (the draft timed once on this device)."""
    from primaplug.head.planning import Measured

    app = recorded_app(gemma_path, PlanRequest("even"))
    assert app.coordinator.choice.plan.speculation is None
    app.coordinator.close()
    c = Coordinator(gemma_path, [n["address"] for n in RECORD["nodes"]], draft_model=gemma_path)
    assert c.plan_settings.head_reserved_bytes > gemma_path.stat().st_size
    for n in RECORD["nodes"]:
        e = c.nodes[n["address"]]
        e.own, e.name, e.facts = n["own"], n["name"], n["facts"]
    c.measured = Measured(MODEL, DEVICES, RECORD["measured"]["link_latency_s"], RECORD["measured"]["link_bps"])
    spec = c.plan(PlanRequest("even")).plan.speculation
    assert spec is not None and spec.draft_token_s > 0 and spec.trip_s == c.choice.plan.total_s
    assert c.plan(PlanRequest("even", rounds=2)).plan.speculation.draft_token_s == spec.draft_token_s  # timed once
    c.close()
