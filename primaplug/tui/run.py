"""Provides the Run pane: a chat through the ring (the model's chat template, streamed), its settings, the live
figures (TTFT, TPOT against the plan's prediction, a TPOT sparkline), each node's live metrics, and the log."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Label, Log, RichLog, Sparkline, Static

from primaplug.head.events import NodeView
from primaplug.tui.render import figures, node_metrics_table


class ChatSettings:
    """The sampling settings of the chat's next request, as typed (defaults: greedy, 128 tokens, seed 0)."""

    def __init__(self, temperature: float = 0.0, max_tokens: int = 128, seed: int = 0) -> None:
        self.temperature, self.max_tokens, self.seed = temperature, max_tokens, seed


class RunPane(Vertical):
    """The chat, the figures, the node metrics and the log; the app appends to the chat and sets the figures."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._shown: dict[str, object] = {}  # what each part shows: a part is drawn again only when it changes

    DEFAULT_CSS = """
    RunPane #run-top { height: 2fr; }
    RunPane #chat-settings { height: 1; }
    RunPane #chat-settings Label { padding: 0 1; }
    RunPane #chat-settings Input { width: 7; }
    RunPane #transcript { height: 1fr; border: round $primary-darken-2; }
    RunPane #side { width: 36; padding-left: 1; }
    RunPane #figures { height: 4; }
    RunPane Sparkline { height: 3; margin-top: 1; }
    RunPane #node-metrics { height: auto; max-height: 7; }
    RunPane RichLog { height: 1fr; min-height: 4; border-top: solid $primary-darken-2; }
    """

    def compose(self) -> ComposeResult:
        with Horizontal(id="run-top"):
            with Vertical(id="chat-col"):
                with Horizontal(id="chat-settings"):
                    yield Label("temp")
                    yield Input("0", id="temperature", compact=True, type="number")
                    yield Label("max")
                    yield Input("128", id="max-tokens", compact=True, type="integer")
                    yield Label("seed")
                    yield Input("0", id="seed", compact=True, type="integer")
                yield Log(id="transcript", highlight=False)
                yield Input(placeholder="message the model, Enter sends", id="prompt",
                            compact=True)
            with Vertical(id="side"):
                yield Static(figures(0, 0, 0, None), id="figures")
                yield Sparkline([], id="tpot-spark")
        yield Static(id="node-metrics")
        yield RichLog(id="log", wrap=True, markup=False, max_lines=2000)

    @property
    def settings(self) -> ChatSettings:
        """The settings typed; raises ValueError naming the one that is not a number."""
        values = {}
        for name, cast in (("temperature", float), ("max-tokens", int), ("seed", int)):
            text = self.query_one(f"#{name}", Input).value.strip()
            try:
                values[name] = cast(text) if text else None
            except ValueError:
                raise ValueError(f"{name} must be a number, got {text!r}") from None
        return ChatSettings(values["temperature"] if values["temperature"] is not None else 0.0,
                            values["max-tokens"] or 128, values["seed"] if values["seed"] is not None else 0)

    def add_message(self, role: str, text: str = "") -> None:
        """A message in the transcript: the user's, or an error; the assistant's streams in with show_reply().
        The transcript is a Log (lines drawn as they scroll into view): appending to it never lays the screen
        out again, which a growing widget would do for every frame of a streaming reply."""
        log = self.query_one("#transcript", Log)
        gap = "\n" if log.line_count else ""
        if role == "user":
            log.write(f"{gap}> {text}\n\n")
            self._shown["reply"] = 0
        else:
            log.write(f"\n[{text}]\n")

    def show_reply(self, text: str) -> None:
        """Draw the assistant's reply as far as it has streamed."""
        shown = int(self._shown.get("reply") or 0)  # type: ignore[call-overload]
        if len(text) > shown:
            self.query_one("#transcript", Log).write(text[shown:])
            self._shown["reply"] = len(text)

    def clear_chat(self) -> None:
        self.query_one("#transcript", Log).clear()
        self._shown["reply"] = 0

    @property
    def transcript(self) -> str:
        return "\n".join(self.query_one("#transcript", Log).lines)

    def show_figures(self, ttft_s: float, tpot_s: float, tokens: int, predicted_s: float | None,
                     intervals_s: Sequence[float], drafts: tuple[int, int] | None = None) -> None:
        if self._shown.get("figures") == (ttft_s, tpot_s, tokens, predicted_s, drafts):
            return
        self._shown["figures"] = (ttft_s, tpot_s, tokens, predicted_s, drafts)
        # a fixed height: no layout of the screen for each frame while a reply streams
        self.query_one("#figures", Static).update(figures(ttft_s, tpot_s, tokens, predicted_s, drafts),
                                                  layout=False)
        self.query_one(Sparkline).data = [t * 1e3 for t in intervals_s[-120:]]

    def show_nodes(self, rows: Sequence[tuple[str, NodeView | None, bool]]) -> None:
        before = self._shown.get("nodes")
        if before == tuple(rows):
            return
        self._shown["nodes"] = tuple(rows)
        same_height = isinstance(before, tuple) and len(before) == len(rows)
        self.query_one("#node-metrics", Static).update(node_metrics_table(rows) if rows else
                                                        Text("no ring deployed", style="dim"), layout=not same_height)

    def log(self, line: str, style: str = "") -> None:
        self.query_one(RichLog).write(Text(line, style=style))
