"""Provides the Plan pane: the scheduler, rounds and split to plan with, and the plan drawn before anything loads
(layer map, predicted time per token per device, dropped devices, the other numbers of rounds weighed), then each
node's load progress once it is deployed."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, Select, Static

from primaplug.head.coordinator import PLANNERS, PlanChoice, PlanRequest
from primaplug.head.events import NodeView
from primaplug.tui.render import alternatives_table, bar, dropped_text, layer_map, plan_summary, prediction_table

HINTS = {
    "halda": "Halda: profiles, links and prima.cpp's scheduler; drops devices that would slow the ring",
    "memory": "exo's rule: layers in proportion to each device's memory (one round)",
    "compute": "Galaxy's rule: layers in proportion to compute speed (one round)",
    "even": "the same number of layers on every node, the head runs only the output layer (and the last layers "
            "where they share keys and values)",
    "manual": "a split typed in: layers per round of each node in ring order, then optionally the head's",
}


class PlanPane(Vertical):
    """The plan's controls and drawing; the app reads `request` and sets the choice and deploy progress."""

    DEFAULT_CSS = """
    PlanPane #plan-controls { height: 1; }
    PlanPane #plan-controls Label { padding: 0 1 0 1; }
    PlanPane #scheduler { width: 14; }
    PlanPane #rounds { width: 6; }
    PlanPane #layers { width: 14; }
    PlanPane #ngl { width: 5; }
    PlanPane Button { margin: 0 0 0 1; min-width: 8; }
    PlanPane #plan-hint { color: $text-muted; height: 1; }
    PlanPane #plan-body { height: 1fr; }
    PlanPane .section { color: $text-accent; text-style: bold; margin-top: 1; }
    """

    def __init__(self, request: PlanRequest, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._initial = request
        self._shown: tuple[object, ...] = ()  # what is drawn: the plan is drawn again only when it changes

    def compose(self) -> ComposeResult:
        r = self._initial
        with Horizontal(id="plan-controls"):
            yield Select([(p, p) for p in PLANNERS], value=r.scheduler, allow_blank=False, id="scheduler",
                         compact=True)
            yield Label("k")
            yield Input(str(r.rounds or ""), placeholder="auto", id="rounds", compact=True, type="integer")
            yield Label("split")
            yield Input(",".join(map(str, r.layers)), placeholder="6,6,6", id="layers", compact=True)
            yield Label("gpu")
            yield Input(str(r.gpu_layers or ""), placeholder="0", id="ngl", compact=True, type="integer")
            yield Button("Plan", id="plan-button", compact=True)
            yield Button("Deploy", id="deploy-button", compact=True, variant="primary")
        yield Static(HINTS[r.scheduler], id="plan-hint")
        with VerticalScroll(id="plan-body"):
            yield Static(id="plan-summary")
            yield Static("layer map", classes="section")
            yield Static(id="layer-map")
            yield Static("predicted time per token, ms", classes="section")
            yield Static(id="prediction")
            yield Static(id="dropped")
            yield Static("other numbers of rounds", classes="section", id="alternatives-title")
            yield Static(id="alternatives")
            yield Static("deploying", classes="section", id="deploy-title")
            yield Static(id="deploy-progress")

    def on_select_changed(self, event: Select.Changed) -> None:
        self.query_one("#plan-hint", Static).update(HINTS.get(str(event.value), ""))

    @property
    def request(self) -> PlanRequest:
        """The plan asked for by the controls; raises ValueError saying which field is wrong."""
        scheduler = str(self.query_one("#scheduler", Select).value)
        rounds_text = self.query_one("#rounds", Input).value.strip()
        layers_text = self.query_one("#layers", Input).value.strip()
        gpu_text = self.query_one("#ngl", Input).value.strip()
        try:
            layers = tuple(int(x) for x in layers_text.replace(" ", ",").split(",") if x)
        except ValueError:
            raise ValueError(f"the split is layers per node, comma-separated (6,6,6); got {layers_text!r}") from None
        if scheduler == "manual" and not layers:
            raise ValueError("a manual plan needs a split: layers per round of each node, e.g. 6,6,6")
        rounds = int(rounds_text) if rounds_text else None
        if rounds is not None and rounds < 1:
            raise ValueError("k, the number of rounds, is 1 or more (empty: the scheduler's choice)")
        return PlanRequest(scheduler=scheduler, rounds=rounds, layers=layers, gpu_layers=int(gpu_text or 0))

    def show(self, choice: PlanChoice | None, width: int, note: str = "") -> None:
        """Draw a plan (or say why there is none yet)."""
        if self._shown == (choice, width, note):
            return
        self._shown = (choice, width, note)
        summary = self.query_one("#plan-summary", Static)
        if choice is None:
            summary.update(Text(note or "no plan yet: the nodes are profiled first (Nodes, 1), then press p here",
                                style="dim"))
            for part in ("#layer-map", "#prediction", "#dropped", "#alternatives"):
                self.query_one(part, Static).update("")
            return
        plan = choice.plan
        summary.update(Group(plan_summary(plan), Text(note, style="red")) if note else plan_summary(plan))
        self.query_one("#layer-map", Static).update(layer_map(plan, width=max(30, width - 4)))
        self.query_one("#prediction", Static).update(prediction_table(plan))
        self.query_one("#dropped", Static).update(dropped_text(plan))
        alts = self.query_one("#alternatives", Static)
        alts.update(alternatives_table(plan, choice.alternatives) if choice.alternatives else
                    Text(f"{plan.scheduler} plans {plan.k} round(s) as asked; Halda weighs every k", style="dim"))

    def show_deploy(self, rows: Sequence[tuple[str, NodeView | None]], deployed: bool, busy: str) -> None:
        """Each node's load progress while the plan deploys, and the outcome."""
        key = (tuple(rows), deployed, busy)
        if getattr(self, "_deploy_shown", None) == key:
            return
        self._deploy_shown = key
        out = Text()
        if not rows and not busy:
            out.append("not deployed: press d to deploy this plan", style="dim")
        for name, view in rows:
            state = view.state if view else "waiting"
            progress = 1.0 if state == "ready" else view.progress if view else 0.0
            style = "red" if state == "failed" else "green" if state == "ready" else ""
            out.append(f"{name:<16} {bar(progress, 20)} {progress:4.0%} {state}", style=style)
            if view and view.message and state != "ready":
                out.append(f"  {view.message}", style="dim")
            out.append("\n")
        if busy:
            out.append(busy, style="yellow")
        elif deployed:
            out.append("deployed: chat in Run (3)", style="green")
        self.query_one("#deploy-progress", Static).update(out)
