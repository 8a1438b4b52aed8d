"""Provides the Nodes pane: one row per device (the head, then each node by address) with its state and profile,
the selected device's whole profile below, and the line where a node is added by address."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Input, Static

from primaplug.core.profiles import DeviceProfile
from primaplug.head.events import NodeView
from primaplug.tui.render import profile_cells, profile_detail, state_text

# units in the headers, each column as wide as its content (update_width), narrow enough for 80 columns: a device's
# GPU's backend is beside its OS, its memory in its detail below the table
COLUMNS = ("node", "address", "state", "OS", "RAM GB", "disk MB/s", "GFLOP/s")


@dataclass(frozen=True)
class NodeRow:
    """What the pane shows of one device: `key` is its address ("head" for this device)."""

    key: str
    name: str
    address: str
    facts: str
    error: str
    view: NodeView | None
    profile: DeviceProfile | None
    serving: bool = False


class NodesPane(Vertical):
    """The table of devices and the selected one's detail; the app sets `rows`, and reads `selected`."""

    DEFAULT_CSS = """
    NodesPane DataTable { height: 1fr; }
    NodesPane #node-detail { height: auto; max-height: 8; border-top: solid $primary-darken-2; }
    NodesPane #add-node.hidden { display: none; }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._rows: list[NodeRow] = []

    def compose(self) -> ComposeResult:
        yield DataTable(id="node-table", cursor_type="row")
        yield Input(placeholder="HOST:PORT of a node's control port (Enter adds it, Esc cancels)", id="add-node",
                    classes="hidden", compact=True)
        yield Static(id="node-detail")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)

    @property
    def selected(self) -> NodeRow | None:
        table = self.query_one(DataTable)
        if not self._rows or table.cursor_row is None or table.cursor_row >= len(self._rows):
            return None
        return self._rows[table.cursor_row]

    def show(self, rows: Sequence[NodeRow]) -> None:
        """Redraw the table from `rows`, keeping the cursor on the same device."""
        table = self.query_one(DataTable)
        keys = [r.key for r in rows]
        cells = [self._cells(r) for r in rows]
        if keys != [r.key for r in self._rows]:
            chosen = self.selected.key if self.selected else None
            table.clear()
            for r, c in zip(rows, cells, strict=True):
                table.add_row(*c, key=r.key)
            if chosen in keys:
                table.move_cursor(row=keys.index(chosen))
        else:
            for r, c, old in zip(rows, cells, [self._cells(o) for o in self._rows], strict=True):
                for col, (new, was) in enumerate(zip(c, old, strict=True)):
                    if new != was:
                        table.update_cell(r.key, table.ordered_columns[col].key, new, update_width=True)
        self._rows = list(rows)
        self._show_detail()

    def _show_detail(self) -> None:
        r = self.selected
        detail = self.query_one("#node-detail", Static)
        if r is None:
            detail.update(Text("no nodes yet: press a to add one by address (HOST:PORT), or start the dashboard "
                               "with --local-nodes N", style="dim"))
            return
        detail.update(profile_detail(r.name, r.address, r.profile, r.view, r.facts, r.error))

    def on_data_table_row_highlighted(self, _: DataTable.RowHighlighted) -> None:
        self._show_detail()

    @staticmethod
    def _cells(r: NodeRow) -> tuple[Text | str, ...]:
        failed = bool(r.error) or (r.view is not None and r.view.state == "failed")
        name = Text(r.name, style="bold red" if failed else "bold" if r.key == "head" else "")
        return (name, r.address or "this device", state_text(r.view, serving=r.serving, error=r.error),
                *profile_cells(r.profile))
