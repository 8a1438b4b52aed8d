"""The dashboard driven as a user drives it (Textual's Pilot), against real node processes on loopback: it
connects, profiles and plans by itself; deploy, chat (the text equals plain llama-cpp-python's), a node killed
mid-chat turns red with its reason, a node started later is added by address, a key is handled while a token is
being computed, and quitting stops the nodes it started."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from primaplug.head.coordinator import Coordinator
from primaplug.head.events import BatchDone, Event
from primaplug.head.launch import LocalNodes
from primaplug.tui.app import DashboardApp
from primaplug.tui.config import Remembered

pytestmark = pytest.mark.multiproc
SIZE = (100, 32)
MESSAGE = "The three primary colors are"


async def until(pilot: object, done: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            app = pilot.app  # type: ignore[attr-defined]
            log = "\n".join(str(line.text) for line in app.query_one("#log").lines[-12:])
            raise AssertionError(f"timed out waiting for {what}; busy: {app.busy!r}; log:\n{log}")
        await pilot.pause(0.1)  # type: ignore[attr-defined]


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRIMAPLUG_CONFIG", str(tmp_path / "config"))
    return tmp_path / "config"


def plain_reply(path: Path, chat_format: str | None, max_tokens: int) -> str:
    """Plain llama-cpp-python's answer to MESSAGE: in the chat format given, or (None) its continuation as text."""
    from primaplug.engine.reference import plain_llama

    with plain_llama(path, n_ctx=4096, n_batch=512, n_ubatch=512, verbose=False, chat_format=chat_format) as llm:
        if chat_format is None:
            return llm.create_completion(MESSAGE, temperature=0, max_tokens=max_tokens, seed=0)["choices"][0]["text"]
        out = llm.create_chat_completion([{"role": "user", "content": MESSAGE}], temperature=0,
                                         max_tokens=max_tokens, seed=0)
    return out["choices"][0]["message"]["content"] or ""


async def chat(app: DashboardApp, pilot: object, text: str, max_tokens: int) -> None:
    await pilot.press("3")  # type: ignore[attr-defined]
    app.query_one("#max-tokens").value = str(max_tokens)  # type: ignore[attr-defined]
    app.query_one("#prompt").focus()
    before = len(app.history)
    await pilot.press(*text, "enter")  # type: ignore[attr-defined]
    await until(pilot, lambda: len(app.history) > before, "the message to be sent", 10)


def test_local_nodes_plan_deploy_chat_equals_plain_and_quit_stops_them(gemma_path: Path, config_dir: Path) -> None:
    """`primaplug dashboard --local-nodes 2`: the nodes start, are profiled and planned without a key pressed; an
    even plan deploys with per-node progress; the chat's reply is plain llama-cpp-python's; the cluster is
    remembered; quitting stops the local nodes."""
    coordinator = Coordinator(gemma_path, [], timeout_s=3.0)
    app = DashboardApp(coordinator, local_nodes=2, remembered=Remembered(scheduler="halda"), blink=False)
    said_text_mode = False

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: coordinator.choice is not None and not app.busy, "the first plan")
            assert [e.name for e in coordinator.usable()] == ["node1", "node2"]
            assert coordinator.measured is not None and len(coordinator.measured.devices) == 3
            assert coordinator.choice.plan.scheduler == "halda" and coordinator.choice.alternatives
            table = app.query_one("#node-table")
            assert [str(table.get_row(k)[2]) for k in ("head", *coordinator.nodes)] == ["idle", "profiled", "profiled"]
            await pilot.press("2")
            app.query_one("#scheduler").value = "even"  # planning again follows the choice
            await until(pilot, lambda: coordinator.choice.plan.scheduler == "even" and not app.busy, "the even plan")
            await pilot.press("d")
            await until(pilot, lambda: coordinator.llm is not None and not app.busy, "the deployment")
            await pilot.pause(0.5)  # a redraw
            progress = str(app.query_one("#deploy-progress").render())
            assert "node1" in progress and "node2" in progress and "ready" in progress and "100%" in progress
            await chat(app, pilot, MESSAGE, 24)
            await until(pilot, lambda: not app.generating, "the reply")
            assert app.clock.tokens > 0 and app.clock.tpot_s > 0
            await pilot.pause(0.5)
            assert "TPOT" in str(app.query_one("#figures").render())
            assert app.history[-1] == {"role": "assistant", "content": app.reply}
            nonlocal said_text_mode
            said_text_mode = any(str(line.text).startswith("each message is continued as text")
                                 for line in app.query_one("#log").lines)
            pids = [n.pid for n in app.local.nodes]  # type: ignore[union-attr]
            await pilot.press("escape", "q")
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        # the model carries no chat template and none was given: the message is continued as text
        assert app.reply == plain_reply(gemma_path, None, 24)
        assert said_text_mode
        saved = Remembered.load()
        assert saved.local_nodes == 2 and saved.nodes == [] and saved.scheduler == "even"

    run(scenario)


def test_a_node_killed_mid_chat_turns_red_and_one_started_later_is_added(gemma_path: Path, config_dir: Path) -> None:
    """Nodes started by hand: one killed while a reply streams turns red in place with its reason, and the reply goes
    on over the ring re-formed without it; a node started later is added by its address (a), and the ring goes on
    with it once the dead one is removed (x) and the plan is made again."""
    with tempfile.TemporaryDirectory() as logs, LocalNodes(gemma_path, 2, log_dir=logs) as first:
        coordinator = Coordinator(gemma_path, first.addresses, timeout_s=2.0)
        app = DashboardApp(coordinator, remembered=Remembered(scheduler="even"), blink=False)

        async def scenario() -> None:
            async with app.run_test(size=SIZE) as pilot:
                await until(pilot, lambda: coordinator.choice is not None and not app.busy, "the first plan")
                await pilot.press("2", "d")
                await until(pilot, lambda: coordinator.llm is not None and not app.busy, "the deployment")
                victim = first.nodes[1]
                killed = threading.Event()

                def kill_after_a_few_tokens(event: Event) -> None:
                    if isinstance(event, BatchDone) and event.n_tokens == 1 and event.step > 4 and not killed.is_set():
                        killed.set()
                        os.kill(victim.pid, signal.SIGKILL)
                coordinator.events.subscribe(kill_after_a_few_tokens)
                await chat(app, pilot, MESSAGE, 24)
                await until(pilot, lambda: not app.generating, "the reply to end", 60)
                assert killed.is_set()
                transcript = app.run_pane.transcript
                assert "[the reply stopped" not in transcript and app.reply  # it went on without node2
                assert [r.lost for r in coordinator.llm.reforms] == [("node2",)]
                app.redraw()
                shown = app.run_pane._shown["nodes"]  # the Run pane's node table: (name, view, failed) rows
                assert [name for name, _, failed in shown if failed] == ["node2"]
                await pilot.press("escape", "1")
                await pilot.pause(0.3)
                state = app.query_one("#node-table").get_row(victim.address)[2]
                assert str(state) == "failed" and "red" in str(state.style)
                app.query_one("#node-table").move_cursor(row=2)
                await pilot.pause(0.2)
                assert "node2" in str(app.query_one("#node-detail").render())

                with LocalNodes(gemma_path, 1, log_dir=logs, names=["late"]) as late:
                    await pilot.press("a", *late.addresses[0], "enter")
                    await until(pilot, lambda: coordinator.entry("late") is not None and not app.busy, "the late node")
                    await pilot.press("x")  # the cursor is on node2, the dead one
                    await until(pilot, lambda: victim.address not in coordinator.nodes and not app.busy, "removal")
                    await pilot.press("2", "p")
                    await until(pilot, lambda: not app.busy, "the new plan")
                    assert [d.name for d in coordinator.choice.plan.ring[:-1]] == ["node1", "late"]
                    await pilot.press("d")
                    await until(pilot, lambda: coordinator.llm is not None and not app.busy, "the redeployment")
                    await chat(app, pilot, MESSAGE, 8)
                    await until(pilot, lambda: not app.generating, "the reply on the new ring")
                    assert app.reply and "[the reply stopped" not in app.run_pane.transcript
                    await pilot.press("escape", "q")
            saved = Remembered.load()
            assert first.addresses[0] in saved.nodes and victim.address not in saved.nodes

        run(scenario)


def test_a_key_is_handled_while_a_token_is_computed(gemma_path: Path, config_dir: Path) -> None:
    """The ring runs in a worker: with the generating thread held inside a token's batch, a key switches the pane."""
    with tempfile.TemporaryDirectory() as logs, LocalNodes(gemma_path, 1, log_dir=logs) as local:
        coordinator = Coordinator(gemma_path, local.addresses, chat_format="gemma")  # a chat in a format given
        app = DashboardApp(coordinator, remembered=Remembered(scheduler="even"), remember=False, blink=False)
        inside, release = threading.Event(), threading.Event()

        def hold(event: Event) -> None:  # runs in the generating thread, inside Session.eval
            if isinstance(event, BatchDone) and event.n_tokens == 1 and not inside.is_set():
                inside.set()
                release.wait(30)

        async def scenario() -> None:
            async with app.run_test(size=SIZE) as pilot:
                await until(pilot, lambda: coordinator.choice is not None and not app.busy, "the first plan")
                await pilot.press("2", "d")
                await until(pilot, lambda: coordinator.llm is not None and not app.busy, "the deployment")
                coordinator.events.subscribe(hold)
                await chat(app, pilot, MESSAGE, 16)
                await until(pilot, inside.is_set, "a token's batch", 30)
                await pilot.press("escape", "1")
                await pilot.pause(0.1)
                handled = app.query_one("TabbedContent").active == "nodes"
                still_generating = app.generating
                release.set()
                await until(pilot, lambda: not app.generating, "the reply")
                assert handled and still_generating
                assert app.reply == plain_reply(gemma_path, "gemma", 16)
                await pilot.press("q")

        try:
            run(scenario)
        finally:
            release.set()
