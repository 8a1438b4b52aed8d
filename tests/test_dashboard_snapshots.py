"""Every pane of the dashboard drawn at 80x24 (over SSH) and at 160x48, from the recorded cluster of
tests/dashboard_fixture.py, compared with the SVGs in __snapshots__/ (pytest-textual-snapshot). After a deliberate
change of the drawing, look at the report, then `pytest tests/test_dashboard_snapshots.py --snapshot-update`.
The docs show these SVGs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from textual.widgets import Log, RichLog

from primaplug.head.coordinator import PlanRequest
from primaplug.tui.app import DashboardApp
from tests.dashboard_fixture import recorded_app, show_failure, show_run

SIZES = {"small": (80, 24), "large": (160, 48)}


def _nodes(app: DashboardApp) -> None:
    show_failure(app)
    app.action_tab("nodes")


def _plan(app: DashboardApp) -> None:
    app.action_tab("plan")


SCREENS: dict[str, tuple[PlanRequest, Callable[[DashboardApp], None]]] = {
    "nodes": (PlanRequest("halda"), _nodes),
    "plan_halda": (PlanRequest("halda"), _plan),
    "plan_even_two_rounds": (PlanRequest("even", rounds=2), _plan),
    "run": (PlanRequest("even"), show_run),
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("screen", SCREENS)
def test_screen(snap_compare: Callable[..., bool], gemma_path: Path, screen: str, size: str) -> None:
    request, show = SCREENS[screen]
    app = recorded_app(gemma_path, request)

    async def before(pilot: object) -> None:
        show(app)
        await pilot.pause()  # type: ignore[attr-defined]
        app.redraw()
        await pilot.pause(0.2)  # type: ignore[attr-defined]
        # the logs wrap their lines once they know their width; then their end is where the picture must look
        for log in (app.query_one("#log", RichLog), app.query_one("#transcript", Log)):
            log.scroll_end(animate=False, immediate=True)
        await pilot.pause(0.1)  # type: ignore[attr-defined]

    assert snap_compare(app, terminal_size=SIZES[size], run_before=before)


def test_light_theme(snap_compare: Callable[..., bool], gemma_path: Path) -> None:
    app = recorded_app(gemma_path, PlanRequest("even", rounds=2))

    async def before(pilot: object) -> None:
        app.action_tab("plan")
        await pilot.press("t")  # type: ignore[attr-defined]
        await pilot.pause()  # type: ignore[attr-defined]
        app.redraw()
        await pilot.pause(0.2)  # type: ignore[attr-defined]

    assert snap_compare(app, terminal_size=SIZES["small"], run_before=before)


@pytest.mark.parametrize("size", [(80, 24), (160, 45)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_no_cell_of_any_pane_is_cut(gemma_path: Path, size: tuple[int, int]) -> None:
    """Every table column is as wide as its widest cell and its header, the nodes table fits the terminal's width
    without scrolling sideways, and no pane ends a value with an ellipsis."""
    import asyncio
    import dataclasses

    from rich.text import Text
    from textual.widgets import DataTable

    from primaplug.tui.nodes import COLUMNS, NodesPane

    def width(cell: object) -> int:
        return cell.cell_len if isinstance(cell, Text) else Text.from_markup(str(cell)).cell_len

    async def scenario() -> None:
        for name, (request, show) in SCREENS.items():
            app = recorded_app(gemma_path, request)
            async with app.run_test(size=size) as pilot:
                show(app)
                await pilot.pause()
                app.redraw()
                await pilot.pause(0.2)
                if name == "nodes":  # as in a real start: rows drawn before the profiles came, then updated in place
                    nodes = app.query_one(NodesPane)
                    rows = list(nodes._rows)
                    table = nodes.query_one(DataTable)
                    table.clear(columns=True)
                    table.add_columns(*COLUMNS)
                    nodes._rows = []
                    nodes.show([dataclasses.replace(r, profile=None) for r in rows])
                    await pilot.pause()
                    nodes.show(rows)
                    await pilot.pause(0.1)
                for table in app.query(DataTable):
                    if not table.display or not table.region.width:
                        continue
                    for col in table.ordered_columns:
                        need = max([width(table.get_cell(r, col.key)) for r in table.rows] + [col.label.cell_len])
                        shown = col.get_render_width(table) - 2 * table.cell_padding
                        assert shown >= need, (name, size, str(col.label), shown, need)
                    assert table.virtual_size.width <= table.region.width, (name, size, table.virtual_size)
                assert "\u2026" not in app.export_screenshot(), (name, size)

    asyncio.run(scenario())
