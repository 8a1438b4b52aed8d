"""The dashboard as the snapshot tests (and the docs' screenshots) show it: a real app over a coordinator that holds
the recorded cluster of tests/fixtures/dashboard_cluster.json (tests/fixtures/record_dashboard.py), so that
every drawing is the same on every machine. Nothing here talks to a node."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.core.windows import LayerRange
from primaplug.head.coordinator import Coordinator, PlanRequest
from primaplug.head.events import Deployed, NodeMetrics, NodeProgress
from primaplug.head.planning import Measured
from primaplug.tui.app import DashboardApp
from primaplug.tui.config import Remembered
from primaplug.wire import Status

RECORD = json.loads((Path(__file__).parent / "fixtures" / "dashboard_cluster.json").read_text())


def recorded_app(model_path: Path, request: PlanRequest | None = None) -> DashboardApp:
    """The app over the recorded cluster, its nodes profiled and `request` (default: Halda's) planned; nothing
    starts by itself."""
    request = request or PlanRequest("halda")
    c = Coordinator(model_path, [n["address"] for n in RECORD["nodes"]])
    for n in RECORD["nodes"]:
        e = c.nodes[n["address"]]
        e.own, e.name, e.facts = n["own"], n["name"], n["facts"]
    m = RECORD["measured"]
    c.measured = Measured(msgspec.convert(m["model"], ModelProfile),
                          tuple(msgspec.convert(d, DeviceProfile) for d in m["devices"]),
                          m["link_latency_s"], m["link_bps"])
    remembered = Remembered(scheduler=request.scheduler, rounds=request.rounds, layers=list(request.layers))
    app = DashboardApp(c, remembered=remembered, autostart=False, remember=False, blink=False)
    app.animation_level = "none"  # the tabs' underline slides otherwise, and a picture may catch it moving
    for n in RECORD["nodes"]:
        c.events.publish(NodeProgress(n["name"], "profiling", 1.0, "profiled"))
    c.plan(request)
    return app


def show_run(app: DashboardApp) -> None:
    """The Run pane after the recorded chat: the nodes' live figures, then one node killed."""
    c = app.coordinator
    plan = c.choice.plan if c.choice else None
    if plan is not None:
        c.events.publish(Deployed(tuple((d.name, d.windows) for d in plan.ring[:-1]), plan.head.windows, 1.5))
    for name, m in RECORD["metrics"].items():
        c.events.publish(NodeMetrics(name, msgspec.convert(m["status"], Status), m["busy_share"]))
    chat = RECORD["chat"]
    app.run_pane.add_message("user", chat["message"])
    app.run_pane.show_reply(chat["reply"])
    app.clock.t0, app.clock.first = 0.0, chat["ttft_s"]
    ends, t = [], chat["ttft_s"]
    for gap in chat["intervals_s"]:
        t += gap
        ends.append(t)
    app.clock.ends = ends
    show_failure(app)
    app.action_tab("run")


def show_failure(app: DashboardApp) -> None:
    failed = RECORD["failed"]
    entry = app.coordinator.entry(failed["node"])
    assert entry is not None
    entry.error = failed["reason"]
    app.coordinator.events.publish(NodeProgress(failed["node"], "failed", 0.0, failed["reason"]))


__all__ = ["LayerRange", "recorded_app", "show_failure", "show_run"]
