"""Provides the dashboard app: three panes (Nodes, Plan, Run) over one `Coordinator`.

Attributes down, messages up: the head publishes events on its bus (any thread); a subscriber posts each one to
the app as a message, and a timer redraws the panes from the coordinator's state and the `ClusterView` a few times
a second, so a fast ring never floods the screen. Everything that talks to a node runs in a thread worker, one
cluster command at a time; the watcher has its own worker and connections. Keys are bound on the app and shown
in the footer for the pane they act on (`check_action`).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Button, Footer, Header, Input, Select, Static, TabbedContent, TabPane

from primaplug.core.errors import ConfigError, PrimaplugError
from primaplug.head.coordinator import Coordinator, PlanRequest
from primaplug.head.events import (
    BatchDone,
    Deployed,
    Event,
    NodeMetrics,
    NodeProgress,
    NodeView,
    Notice,
    Planned,
    Reformed,
    SessionChanged,
    TokenClock,
)
from primaplug.head.launch import LocalNodes
from primaplug.tui.config import Remembered
from primaplug.tui.nodes import NodeRow, NodesPane
from primaplug.tui.plan import PlanPane
from primaplug.tui.run import RunPane

log = logging.getLogger(__name__)
REFRESH_S = 0.2  # how often the panes are redrawn from the latest state
# The ring's thread returns from native code (a ZeroMQ receive, llama.cpp) several times a token and must take
# the interpreter lock back; while the UI thread draws, it waits up to the switch interval for it (5 ms by
# default, as long as a small model's token). A shorter interval hands it back sooner
# (benchmarks/dashboard_overhead.py).
SWITCH_INTERVAL_S = 0.0005
# while a reply streams, each frame drawn and each node asked takes CPU time from the ring on a device that is also
# a node: draw at most this often then, and ask the nodes this many times less often (the ring itself finds a
# node that stops answering)
STREAMING_REFRESH_S = 0.5
WATCH_S = 1.0  # how often the watcher asks each node how it is
DISCOVERED_S = 1.0  # how often the nodes that advertise themselves are looked at (--nodes auto)
STREAMING_WATCH_EVERY = 5


class HeadEvent(Message):
    """An event of the head's bus, posted from whichever thread published it."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event


class ChatText(Message):
    """The end of the assistant's reply (with the error that ended it, if one did); the text itself is drawn as
    it grows, by the redraws."""

    def __init__(self, error: str = "") -> None:
        super().__init__()
        self.error = error


class DashboardApp(App[None]):
    """`primaplug dashboard`: see the cluster, its plan and its speed; deploy, chat and watch it live."""

    TITLE = "primaplug"
    CSS = """
    TabbedContent { height: 1fr; }
    #busy { height: 1; background: $boost; color: $text-warning; padding: 0 1; }
    #busy.idle { color: $text-muted; }
    """
    BINDINGS = [
        Binding("1", "tab('nodes')", "Nodes", show=False),
        Binding("2", "tab('plan')", "Plan", show=False),
        Binding("3", "tab('run')", "Run", show=False),
        Binding("a", "add_node", "Add"),
        Binding("x", "remove_node", "Remove"),
        Binding("c", "connect", "Connect"),
        Binding("r", "reprofile", "Reprofile"),
        Binding("p", "plan", "Plan"),
        Binding("d", "deploy", "Deploy"),
        # on purpose only: deploy on nodes another head holds (that head waits and takes them back after)
        Binding("T", "take_over", "Take over", show=False),
        Binding("s", "stop_chat", "Stop"),
        Binding("n", "new_chat", "New chat"),
        Binding("t", "toggle_theme", "Theme"),
        Binding("escape", "leave_input", "Leave input"),
        Binding("q", "quit", "Quit"),
    ]
    # which pane each key acts in (the others are global)
    PANE_ACTIONS = {"add_node": "nodes", "remove_node": "nodes", "connect": "nodes", "reprofile": "nodes",
                    "plan": "plan", "deploy": "plan", "stop_chat": "run", "new_chat": "run"}

    def __init__(self, coordinator: Coordinator, *, local_nodes: int = 0, remembered: Remembered | None = None,
                 autostart: bool = True, remember: bool = True, blink: bool = True,
                 discovered: Callable[[], list[str]] | None = None) -> None:
        """`local_nodes`: start that many nodes on this machine (and stop them on quit). `autostart`: connect,
        profile and plan as soon as the app starts, and watch the nodes (off in snapshot tests, which show
        recorded profiles). `remember`: save the cluster to the config directory when it changes. `discovered`:
        the addresses of the nodes of this cluster there now (discovery's Browser.addresses, --nodes auto); each
        new one is added as if typed in (a)."""
        super().__init__()
        self.coordinator = coordinator
        self.remembered = remembered or Remembered()
        self.autostart, self.remember, self.blink = autostart, remember, blink
        self.n_local = local_nodes
        self.local: LocalNodes | None = None
        self._logs: tempfile.TemporaryDirectory[str] | None = None
        self.busy = ""  # the cluster command under way, "" when none
        self.generating = False
        self.clock = TokenClock()
        self.history: list[dict[str, str]] = []
        self._streaming = False  # a reply is being drawn into the transcript
        self._reply_text = ""
        self._stop_chat = threading.Event()
        self._quitting = threading.Event()
        self._watcher_done = threading.Event()
        self._dirty = True
        self._busy_line = ""
        self._drawn_at = 0.0
        self._unsubscribe: list[Callable[[], None]] = []
        self.plan_note = ""
        self.discovered = discovered
        self._added_discovered: set[str] = set()  # each address found is added once (x removes it for good)

    # --- layout ----------------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        r = self.remembered
        request = PlanRequest(scheduler=r.scheduler, rounds=r.rounds, layers=tuple(r.layers), gpu_layers=r.gpu_layers)
        yield Header(show_clock=False, icon="◎")
        with TabbedContent(initial="nodes"):
            with TabPane("1 Nodes", id="nodes"):
                yield NodesPane()
            with TabPane("2 Plan", id="plan"):
                yield PlanPane(request)
            with TabPane("3 Run", id="run"):
                yield RunPane()
        yield Static("", id="busy", classes="idle")
        yield Footer()

    @property
    def nodes_pane(self) -> NodesPane:
        return self.query_one(NodesPane)

    @property
    def plan_pane(self) -> PlanPane:
        return self.query_one(PlanPane)

    @property
    def run_pane(self) -> RunPane:
        return self.query_one(RunPane)

    def on_mount(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        c = self.coordinator
        self.sub_title = c.path.name
        self.run_pane.log("each message is continued as text: the model carries no chat template (a base model's "
                          "file, or one that lost it); --chat-format chats in a format" if c.text_mode else
                          f"chat format: {c.chat_format!r} (--chat-format)" if c.chat_format else
                          "chat format: the model's own template")
        if not self.blink:
            for i in self.query(Input):
                i.cursor_blink = False
        events = self.coordinator.events
        self._unsubscribe = [events.subscribe(self._on_bus), events.subscribe(self.clock)]
        self.set_interval(REFRESH_S, self._redraw)
        self._redraw()
        if self.n_local:
            # spawned from the main thread: a node stops when the thread that started it ends (PR_SET_PDEATHSIG)
            self._logs = tempfile.TemporaryDirectory(prefix="primaplug-dashboard-")
            self.local = LocalNodes(self.coordinator.path, self.n_local, log_dir=self._logs.name)
            self.local.spawn()
        if self.autostart:
            self._background("starting", self._start)
            self._watch()
        if self.discovered is not None:
            self.set_interval(DISCOVERED_S, self._add_discovered)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        self._quitting.set()
        self._stop_chat.set()
        for stop in self._unsubscribe:
            stop()
        stopped = not self.autostart or self._watcher_done.wait(self.coordinator.timeout_s + 3.0)
        self.coordinator.close(timeout_s=10.0, watcher_stopped=stopped)
        if self.local is not None:
            self.local.stop()
        if self._logs is not None:
            self._logs.cleanup()

    # --- redrawing -------------------------------------------------------------------------------------------

    def _node_rows(self) -> list[NodeRow]:
        c, view = self.coordinator, self.coordinator.events.view
        profiles = {d.name: d for d in c.measured.devices} if c.measured else {}
        head_name = c.measured.devices[0].name if c.measured else "head"
        head_state = "ready" if c.llm is not None else "idle"
        rows = [NodeRow("head", head_name, "", "this device", "", NodeView(state=head_state),
                        profiles.get(head_name), self.generating)]
        for e in list(c.nodes.values()):
            rows.append(NodeRow(e.address, e.label, e.address, e.facts, e.error,
                                view.nodes.get(e.label) or view.nodes.get(e.address), profiles.get(e.name),
                                self.generating))
        return rows

    def redraw(self) -> None:
        """Draw the pane on screen now (tests and screenshots: the timer would draw it within REFRESH_S)."""
        self._dirty, self._drawn_at = True, 0.0
        self._redraw()

    def _redraw(self) -> None:
        """Draw the pane on screen (and the status line) from the latest state, when anything changed."""
        if self._quitting.is_set() or not self._dirty:
            return
        now = time.monotonic()
        if self.generating and now - self._drawn_at < STREAMING_REFRESH_S:
            return
        self._dirty, self._drawn_at = False, now
        c = self.coordinator
        rows = self._node_rows()
        active = self.query_one(TabbedContent).active
        deploying = self.busy.startswith("deploying")
        plan = c.llm.plan if c.llm is not None else c.choice.plan if deploying and c.choice else None
        names = {d.name for d in plan.ring[:-1]} if plan is not None else set()
        ring = [r for r in rows[1:] if r.name in names]
        if active == "nodes":
            self.nodes_pane.show(rows)
        elif active == "plan":
            self.plan_pane.show(c.choice, self.size.width, self.plan_note)
            self.plan_pane.show_deploy([(r.name, r.view) for r in ring], c.llm is not None,
                                       self.busy if deploying else "")
        else:
            spec = c.llm.speculation.stats if c.llm is not None and c.llm.speculation is not None else None
            self.run_pane.show_figures(self.clock.ttft_s, self.clock.tpot_s, self.clock.tokens, self.predicted_s,
                                       self.clock.intervals_s, (spec.accepted, spec.drafted) if spec else None)
            self.run_pane.show_nodes([(r.name, r.view, bool(r.error) or (r.view is not None and
                                                                         r.view.state == "failed"))
                                      for r in (ring or rows[1:])])
            if self._streaming:
                self.run_pane.show_reply(self._reply_text)
        busy = self.query_one("#busy", Static)
        line = self.busy or self._ring_line() or c.events.view.notice or "ready"
        if line != self._busy_line:
            self._busy_line = line
            busy.update(line, layout=False)
            busy.set_class(not self.busy, "idle")

    @property
    def predicted_s(self) -> float | None:
        """The predicted time per token of the ring deployed, else of the plan chosen."""
        c = self.coordinator
        plan = c.llm.plan if c.llm is not None and c.llm.plan is not None else c.choice.plan if c.choice else None
        return plan.total_s if plan is not None else None

    def _ring_line(self) -> str:
        c = self.coordinator
        if c.llm is None or c.llm.plan is None:
            return ""
        p = c.llm.plan
        return (f"ring deployed: {p.scheduler}, {p.k} round(s), {len(p.devices) - 1} node(s) + head; predicted "
                f"{p.total_s * 1e3:.1f} ms/token" + (" - generating" if self.generating else ""))

    def _on_bus(self, event: Event) -> None:
        """Called in the publishing thread. What changes a number only marks the panes for the next redraw; what
        the log tells is posted to the app. A message per token would wake the UI thread per token, and the
        generating thread would wait for the interpreter lock behind it."""
        self._dirty = True
        if not isinstance(event, BatchDone | NodeMetrics):
            self.post_message(HeadEvent(event))

    def on_head_event(self, message: HeadEvent) -> None:
        event, say = message.event, self.run_pane.log
        match event:
            case NodeProgress(state="failed"):
                say(f"{event.node} failed: {event.message}", "bold red")
            case NodeProgress(state="left" | "connected"):
                say(f"{event.node} {event.state}: {event.message}")
            case Notice():
                say(event.message)
            case Planned():
                say(event.description.splitlines()[1] if "\n" in event.description else event.description)
            case Deployed() if not event.nodes:
                say("deployed: the head runs every layer itself", "green")
            case Deployed():
                say(f"deployed in {event.seconds:.1f} s: " + "; ".join(
                    f"{n} {' '.join(map(str, r))}" for n, r in event.nodes), "green")
            case SessionChanged(what="failed"):
                say(f"the ring failed at {event.detail}", "red")
            case SessionChanged(what="replay"):
                say(f"replayed the conversation onto the ring: {event.detail}")
            case Reformed():
                say(f"ring re-formed in {event.seconds:.1f} s: {event.why}; {event.plan}", "yellow")

    # --- running commands ------------------------------------------------------------------------------------

    def _background(self, what: str, job: Callable[[], Any]) -> bool:
        """Run a cluster command in a thread worker, unless one is under way (then say so)."""
        if self.busy:
            self.notify(f"wait: {self.busy}", severity="warning")
            return False
        self.busy = what
        self._dirty = True
        self._run_job(what, job)
        return True

    @work(thread=True, group="cluster", exit_on_error=False)
    def _run_job(self, what: str, job: Callable[[], Any]) -> None:
        error = ""
        try:
            job()
        except PrimaplugError as e:
            error = str(e)
        except Exception as e:  # shown, never a crash of the dashboard
            log.exception("%s failed", what)
            error = f"{type(e).__name__}: {e}"
        if not self._quitting.is_set():
            self.call_from_thread(self._job_done, what, error)

    def _job_done(self, what: str, error: str) -> None:
        self.busy = ""
        self._dirty = True
        if error:
            self.run_pane.log(f"{what} failed: {error}", "bold red")
            self.notify(error, title=f"{what} failed", severity="error", timeout=12)
            if what.startswith("planning"):
                self.plan_note = error

    def _start(self) -> None:
        """Start-up: wait for the local nodes, connect, profile and plan what the user last asked for."""
        c = self.coordinator
        if self.local is not None:
            self._set_busy(f"starting {self.n_local} local node(s)")
            for n in self.local.wait_ready():
                c.add(n.address)
        if not c.nodes:
            self._say("no nodes yet: waiting for nodes of this cluster to advertise themselves (node --advertise); "
                      "or press a (Nodes) to add one by HOST:PORT" if self.discovered is not None else
                      "no nodes yet: press a (Nodes) to add one by HOST:PORT, or start the dashboard with "
                      "--local-nodes N")
            return
        self._set_busy("connecting")
        if not c.connect():
            self._say("no node can be used yet: see each one's reason in Nodes, then press c to connect again")
            return
        self._profile_and_plan(force=False)

    def _profile_and_plan(self, force: bool) -> None:
        c = self.coordinator
        self._set_busy("profiling the devices and the links (cached per device)" if not force else
                       "re-profiling every device")
        c.profile(force=force)
        self._set_busy("planning")
        self._make_plan()

    def _make_plan(self) -> None:
        try:
            request = self.call_from_thread(lambda: self.plan_pane.request)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.plan_note = ""
        self.coordinator.plan(request)
        self._remember()

    def _set_busy(self, what: str) -> None:
        self.busy, self._dirty = what, True

    def _say(self, line: str) -> None:
        self.coordinator.events.publish(Notice(line))

    def _remember(self) -> None:
        if not self.remember:
            return
        c, r = self.coordinator, self.remembered
        local = {n.address for n in self.local.nodes} if self.local else set()
        r.nodes = [a for a in c.nodes if a not in local and a not in self._added_discovered]
        r.local_nodes, r.keys = self.n_local, c.keys
        if c.choice is not None:
            q = c.choice.request
            r.scheduler, r.rounds, r.layers, r.gpu_layers = q.scheduler, q.rounds, list(q.layers), q.gpu_layers
        r.save()

    def _add_discovered(self) -> None:
        """Add the nodes found since the last look (--nodes auto), as if typed in: connect, profile, plan."""
        if self.discovered is None or self.busy or self._quitting.is_set():
            return  # a command under way: they are added at the next look
        new = [a for a in self.discovered() if a not in self._added_discovered and a not in self.coordinator.nodes]
        if not new:
            return
        for address in new:
            self.coordinator.add(address)
            self._added_discovered.add(address)

        def job() -> None:
            if self.coordinator.connect():
                self._profile_and_plan(force=False)
        self._background(f"adding {', '.join(new)} (found on the network)", job)

    @work(thread=True, group="watch", exit_on_error=False)
    def _watch(self) -> None:
        """Ask the nodes how they are, every WATCH_S, until the app quits."""
        try:
            ticks = 0
            while not self._quitting.wait(WATCH_S):
                ticks += 1
                if self.generating and ticks % STREAMING_WATCH_EVERY:
                    continue
                try:
                    self.coordinator.watch()
                except Exception:  # the watcher must outlive any one node's odd answer
                    log.exception("watching the nodes")
        finally:
            self._watcher_done.set()

    # --- actions ---------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "leave_input":
            return isinstance(self.focused, Input)
        pane = self.PANE_ACTIONS.get(action)
        if pane is None:
            return True
        try:
            return self.query_one(TabbedContent).active == pane
        except Exception:
            return True

    def action_tab(self, pane: str) -> None:
        self.query_one(TabbedContent).active = pane
        if pane == "run":  # the chat is what one comes to Run for: type at once
            self.query_one("#prompt", Input).focus()
        self.refresh_bindings()

    def on_tabbed_content_tab_activated(self, _: TabbedContent.TabActivated) -> None:
        self._dirty = True  # the pane now shown is drawn afresh
        self.refresh_bindings()

    def action_leave_input(self) -> None:
        if isinstance(self.focused, Input):
            if self.focused.id == "add-node":
                self.focused.add_class("hidden")
            self.set_focus(None)
        self.refresh_bindings()

    async def action_quit(self) -> None:
        self._quitting.set()  # no redraw from here on: the widgets are about to go
        self._stop_chat.set()
        self.exit()

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def action_add_node(self) -> None:
        box = self.query_one("#add-node", Input)
        box.remove_class("hidden")
        box.value = ""
        box.focus()

    def action_remove_node(self) -> None:
        row = self.nodes_pane.selected
        if row is None or row.key == "head":
            self.notify("select a node (not the head) to remove", severity="warning")
            return

        def job() -> None:
            self.coordinator.remove(row.key)
            self._remember()
        self._background(f"removing {row.name}", job)

    def action_connect(self) -> None:
        def job() -> None:
            if self.coordinator.connect():
                self._profile_and_plan(force=False)
        self._background("connecting", job)

    def action_reprofile(self) -> None:
        self._background("re-profiling", lambda: self._profile_and_plan(force=True))

    def action_plan(self) -> None:
        try:
            self.plan_pane.request  # noqa: B018  (checks the fields before any work starts)
        except ValueError as e:
            self.notify(str(e), title="cannot plan", severity="error")
            return
        self._background("planning", self._make_plan)

    def action_deploy(self) -> None:
        if self.coordinator.choice is None:
            self.notify("no plan to deploy yet: press p to plan", severity="warning")
            return
        if self.generating:
            self.notify("a reply is streaming: stop it (s, in Run) before deploying again", severity="warning")
            return
        self._background("deploying the plan", lambda: self.coordinator.deploy())

    def action_take_over(self) -> None:
        """Take the nodes from the head that holds them (its refusal named it), profile, plan and deploy."""
        if self.generating:
            self.notify("a reply is streaming: stop it (s, in Run) first", severity="warning")
            return

        def job() -> None:
            c = self.coordinator
            c.take_over(lambda: (c.connect(), self._profile_and_plan(force=False), c.deploy()))
        self._background("taking the nodes over", job)

    def action_stop_chat(self) -> None:
        if self.generating:
            self._stop_chat.set()

    def action_new_chat(self) -> None:
        if self.generating:
            self.notify("a reply is streaming: stop it first (s)", severity="warning")
            return
        self.history.clear()
        self.run_pane.clear_chat()
        self.clock.start()
        self._dirty = True

    # --- widgets' messages -----------------------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "add-node":
            address = event.value.strip()
            event.input.add_class("hidden")
            self.set_focus(self.query_one("#node-table"))
            if not address:
                return
            try:
                self.coordinator.add(address)
            except PrimaplugError as e:
                self.notify(str(e), severity="error")
                return

            def job() -> None:
                self._remember()
                if self.coordinator.connect():
                    self._profile_and_plan(force=False)
            self._background(f"adding {address}", job)
        elif event.input.id == "prompt":
            self._send(event.value)
        elif event.input.id in ("rounds", "layers", "ngl"):
            self.action_plan()

    def on_select_changed(self, event: Select.Changed) -> None:
        c = self.coordinator
        changed = c.choice is None or c.choice.request.scheduler != event.value
        if event.select.id == "scheduler" and changed and c.measured is not None and not self.busy:
            self.action_plan()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "plan-button":
            self.action_plan()
        elif event.button.id == "deploy-button":
            self.action_deploy()

    # --- the chat --------------------------------------------------------------------------------------------

    def _send(self, text: str) -> None:
        text = text.strip()
        if not text:
            return
        if self.coordinator.llm is None:
            self.notify("no ring is deployed: plan it (2) and deploy it (d) first", severity="warning")
            return
        if self.generating or self.busy:
            self.notify(f"wait: {self.busy or 'a reply is streaming'}", severity="warning")
            return
        try:
            settings = self.run_pane.settings
        except ValueError as e:
            self.notify(str(e), severity="error")
            return
        self.query_one("#prompt", Input).value = ""
        self.run_pane.add_message("user", text)
        self.history.append({"role": "user", "content": text})
        self._reply_text = ""
        self._streaming = True
        self.generating = True
        self._stop_chat.clear()
        self.clock.start()
        self._chat(list(self.history), settings.temperature, settings.max_tokens, settings.seed)

    @work(thread=True, group="chat", exit_on_error=False)
    def _chat(self, messages: list[dict[str, str]], temperature: float, max_tokens: int, seed: int) -> None:
        error = ""
        try:
            for piece in self.coordinator.chat(messages, temperature=temperature, max_tokens=max_tokens, seed=seed,
                                               stop=self._stop_chat):
                self._reply_text += piece  # drawn by the next redraw (one str concatenation: no lock needed)
        except PrimaplugError as e:
            error = str(e)
        except Exception as e:
            log.exception("the chat failed")
            error = f"{type(e).__name__}: {e}"
        self.post_message(ChatText(error))

    def on_chat_text(self, message: ChatText) -> None:
        self.generating = False
        self._dirty = True
        self.run_pane.show_reply(self._reply_text)
        self._streaming = False
        if message.error:
            self.run_pane.add_message("error", f"the reply stopped: {message.error}")
            self.run_pane.log(f"chat failed: {message.error}", "bold red")
            self.history.pop()  # the request did not complete: it can be sent again
        else:
            self.history.append({"role": "assistant", "content": self._reply_text})

    @property
    def reply(self) -> str:
        """The last assistant reply, as streamed (tests read it)."""
        return self._reply_text

