#!/usr/bin/env python3
"""Time per token through the dashboard against `primaplug run`, on the same ring, in one run.

    .venv/bin/python benchmarks/dashboard_overhead.py [--model PATH] [--nodes 3] [--tokens 128] [--repeats 8]

Starts N local node processes once; both variants deploy the same even split onto them (the head runs only the
output layer) with the same head threads, and generate greedily from the same words, taking turns:

- run: `primaplug run --nodes ... --scheduler even --temp 0 -n TOKENS` as a subprocess, its TPOT read from what it
  prints ((last token - first token) / (tokens - 1));
- dashboard: the Textual app, headless (Textual's Pilot, so it draws every frame as on a terminal, at 80x24),
  deployed with its Deploy key and chatting through its prompt; its TPOT is the mean interval between generated
  tokens (head/events.py: TokenClock), the figure it shows.

Each repeat pairs a run with a dashboard chat right after it; the ratio is the median of the paired ratios
(dashboard / run), so that the machine's drift between repeats cancels. Target: within 3%.
Writes benchmarks/results/dashboard_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from primaplug.cli.common import default_model
from primaplug.head.coordinator import Coordinator
from primaplug.head.launch import LocalNodes
from primaplug.tui.app import DashboardApp
from primaplug.tui.config import Remembered

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = "The three primary colors are"


def run_tpot(model: Path, nodes: list[str], tokens: int) -> float:
    out = subprocess.run([sys.executable, "-m", "primaplug", "run", "-m", str(model), "--nodes", ",".join(nodes),
                          "--scheduler", "even", "--temp", "0", "-n", str(tokens), "-p", WORDS],
                         capture_output=True, text=True, timeout=600)
    m = re.search(r"generated (\d+); TTFT [\d.]+ ms, TPOT ([\d.]+) ms", out.stderr)
    if out.returncode or not m:
        raise SystemExit(f"primaplug run failed:\n{out.stderr[-2000:]}")
    return float(m.group(2)) / 1e3


async def dashboard_tpots(model: Path, nodes: list[str], tokens: int, repeats: int) -> list[float]:
    """One dashboard, deployed once; a new chat per repeat (each replies to the same words)."""
    coordinator = Coordinator(model, nodes)
    app = DashboardApp(coordinator, remembered=Remembered(scheduler="even"), remember=False, blink=False)
    out = []

    async def until(pilot, done, timeout_s: float = 300) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                log = "\n".join(str(line.text) for line in app.query_one("#log").lines[-10:])
                raise SystemExit(f"the dashboard did not get there; busy: {app.busy!r}; its log:\n{log}")
            await pilot.pause(0.05)

    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: coordinator.choice is not None and not app.busy)
        await pilot.press("2", "d")
        await until(pilot, lambda: coordinator.llm is not None and not app.busy)
        await pilot.press("3")
        app.query_one("#max-tokens").value = str(tokens)
        for _ in range(repeats):
            await pilot.press("escape", "n")
            app.query_one("#prompt").focus()
            await pilot.press(*WORDS, "enter")
            await until(pilot, lambda: app.history and app.history[-1]["role"] == "assistant")
            out.append(app.clock.tpot_s)
            print(f"  dashboard: TPOT {out[-1] * 1e3:.2f} ms ({app.clock.tokens + 1} tokens)", flush=True)
        await pilot.press("escape", "q")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    model = args.model or default_model()
    runs: list[float] = []
    dash: list[float] = []
    with tempfile.TemporaryDirectory() as logs, LocalNodes(model, args.nodes, log_dir=logs) as local:
        for _ in range(args.repeats):  # taking turns: a run, then a dashboard chat, so drift hits both
            runs.append(run_tpot(model, local.addresses, args.tokens))
            print(f"  run: TPOT {runs[-1] * 1e3:.2f} ms", flush=True)
            dash += asyncio.run(dashboard_tpots(model, local.addresses, args.tokens, 1))
    ratio = statistics.median(d / r for d, r in zip(dash, runs, strict=True))
    result = {
        "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} cores",
        "model": model.name, "nodes": args.nodes, "tokens": args.tokens, "repeats": args.repeats,
        "run_tpot_s": runs, "dashboard_tpot_s": dash,
        "median_run_tpot_s": statistics.median(runs), "median_dashboard_tpot_s": statistics.median(dash),
        "paired_ratios": [d / r for d, r in zip(dash, runs, strict=True)],
        "dashboard_over_run": ratio, "target": "within 3% (0.97 to 1.03)",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dashboard_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"TPOT: run {statistics.median(runs) * 1e3:.2f} ms, dashboard {statistics.median(dash) * 1e3:.2f} ms "
          f"(medians of {args.repeats}); dashboard / run = {ratio:.3f}, the median of the paired ratios (target "
          "within 3%)")


if __name__ == "__main__":
    main()
