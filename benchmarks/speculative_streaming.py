#!/usr/bin/env python3
"""Speculative decoding on a ring that streams: the memory testbed's devices and a model larger than their memory,
with and without a draft, at chosen acceptance rates (needs root: cgroups).

    sudo .venv/bin/python benchmarks/speculative_streaming.py [--rounds 4] [--tokens 24] [--noise 0.05,0.2,0.35]

No offline draft agrees with a synthetic target, so this writes a target that has one: the memory testbed's llama
(32 layers, 1.9 GB Q4_K_M) written with its layers past the first `--shallow` adding `--deep-scale` times as much to
the residual stream (engine/synthetic.py: shallow_layers, deep_scale), so that those first layers with the output
layer, copied as they are, make a draft (benchmarks/drafts.py: truncated_draft) that mostly agrees with it. Noise
added to the draft's output layer (`--noise`, in units of its weights' spread) lowers the agreement: the knob that
sets the acceptance rate.

First, uncapped, plain llama-cpp-python measures each draft's agreement: the share of the target's greedy tokens
that the draft, given the same context, predicts. Then on the testbed (the ring at k = --rounds, windows chosen by
the ring's latency model as in memory_testbed.py, the head this uncapped process running the output layer and the
draft): the ring without a draft, then with each draft; TPOT over the whole generation, the speculation's acceptance
rate (accepted over drafted tokens), TPOT against the ring without a draft, and whether the tokens are its tokens.
Writes benchmarks/results/speculative_streaming.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import memory_testbed as mt  # noqa: E402
from benchmarks import need_charts  # noqa: E402
from benchmarks.drafts import truncated_draft  # noqa: E402
from benchmarks.testbed.cluster import Testbed, testbed_script  # noqa: E402
from benchmarks.testbed.devices import load_devices  # noqa: E402
from benchmarks.testbed.timing import prompt_tokens, time_generation  # noqa: E402
from primaplug.core.settings import DRAFT_MAX  # noqa: E402


def agreement(target: Path, draft: Path, prompt: list[int], tokens: list[int], threads: int) -> float:
    """The share of the target's greedy `tokens` (after `prompt`) that the draft predicts from the same context."""
    import numpy as np

    from primaplug.engine.reference import plain_llama

    with plain_llama(draft, n_ctx=512, n_threads=threads, n_threads_batch=threads, logits_all=True,
                     verbose=False) as llm:
        llm.eval(prompt + tokens[:-1])
        guesses = [int(np.argmax(llm.scores[len(prompt) - 1 + i])) for i in range(len(tokens))]
    return sum(g == t for g, t in zip(guesses, tokens, strict=True)) / len(tokens)


def target_tokens(target: Path, prompt: list[int], n: int, threads: int) -> list[int]:
    from primaplug.engine.reference import plain_llama

    with plain_llama(target, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False) as llm:
        return [int(t) for t in itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), n)]


def ring(tb: Testbed, model: Path, sizes: list[int], rounds: int, draft: Path | None, *, prompt: list[int],
         tokens: int, draft_max: int, threads: int) -> dict[str, Any]:
    import primaplug

    spec = {} if draft is None else {"draft_model": str(draft), "draft_max": draft_max}
    llm = primaplug.Llama(model, nodes=tb.addresses, route=tb.route, layers=[*sizes, 0], rounds=rounds, n_ctx=512,
                          n_batch=64, n_ubatch=16, n_threads=threads, node_threads=threads, timeout_s=120,
                          verbose=False, **spec)
    try:
        timed = time_generation(llm, prompt, tokens)
        s = getattr(llm, "speculation", None)
        if s is not None:
            timed["speculation"] = {"drafted": s.stats.drafted, "accepted": s.stats.accepted, "steps": s.stats.steps,
                                    "draft_s": round(s.stats.draft_s, 3), "verify_s": round(s.stats.verify_s, 3)}
            timed["acceptance_rate"] = round(s.stats.acceptance_rate, 3)
        return timed
    finally:
        llm.close()


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = list(runs)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.bar(names, [runs[n]["tpot_s"] for n in names], color=["#888"] + ["#3b7dd8"] * (len(names) - 1))
    ax.bar_label(bars, [f"{runs[n].get('tpot_vs_no_draft', 1.0):.2f}x" for n in names], fontsize=8)
    ax.set_ylabel("time per output token (s), lower is better")
    ax.set_title(f"speculative decoding on a ring that streams ({results['model']['x_caps']:.2f}x the caps, "
                 f"k = {results['rounds']}); labels: TPOT / no draft's", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mt.add_testbed_args(ap)
    ap.add_argument("--shallow", type=int, default=2, help="the target's layers that the draft copies (default 2)")
    ap.add_argument("--deep-scale", type=float, default=0.002,
                    help="how much the target's later layers add to the residual stream (default 0.002)")
    ap.add_argument("--noise", default="0.05,0.2,0.35",
                    help="the drafts' output-layer noise, in units of its weights' spread (default 0.05,0.2,0.35)")
    ap.add_argument("--rounds", type=int, default=4, help="k, the rounds a token takes (default 4)")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens a run (default 24)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--draft-max", type=int, default=DRAFT_MAX, help=f"default {DRAFT_MAX}, primaplug's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calibrate", action="store_true", help="only the drafts' agreement, uncapped (no root)")
    ap.add_argument("--workdir", default=str(mt.CACHE / "testbed"))
    a = ap.parse_args()
    need_charts()

    target = mt.model_file(a.size, a.layers, shallow=a.shallow, deep_scale=a.deep_scale)
    prompt = prompt_tokens(a.prompt)
    print(f"{target.name}: the target's greedy tokens (plain llama-cpp-python, uncapped)", file=sys.stderr)
    reference = target_tokens(target, prompt, a.tokens, a.threads)
    drafts: dict[str, dict[str, Any]] = {}
    for noise in (float(x) for x in a.noise.split(",")):
        path = truncated_draft(target, a.shallow, noise)
        drafts[f"draft, noise {noise:g}"] = d = {"path": path, "noise": noise,
                                                 "agreement": agreement(target, path, prompt, reference, a.threads)}
        print(f"  {path.name}: {path.stat().st_size / 1e6:.0f} MB, agrees on {d['agreement']:.0%} of the target's "
              "tokens", file=sys.stderr)
    if a.calibrate:
        return 0
    devices = load_devices(a.devices)
    runs: dict[str, Any] = {}
    with testbed_script("speculative_streaming"), Testbed(devices, target, Path(a.workdir)) as tb:
        p, sizes = mt.running_windows(tb, devices, target, a.rounds)
        kw = dict(prompt=prompt, tokens=a.tokens, draft_max=a.draft_max, threads=a.threads)
        runs["no draft"] = base = ring(tb, target, sizes, a.rounds, None, **kw)
        print(f"  no draft: TPOT {base['tpot_s']:.2f} s", file=sys.stderr)
        for name, d in drafts.items():
            runs[name] = r = ring(tb, target, sizes, a.rounds, d["path"], **kw)
            r |= {"agreement": round(d["agreement"], 3), "tpot_vs_no_draft": round(r["tpot_s"] / base["tpot_s"], 3),
                  "same_tokens": r["tokens"] == base["tokens"]}
            print(f"  {name}: TPOT {r['tpot_s']:.2f} s ({r['tpot_vs_no_draft']:.2f}x), acceptance "
                  f"{r['acceptance_rate']:.0%}, agreement {d['agreement']:.0%}, same tokens {r['same_tokens']}",
                  file=sys.stderr)
    caps = sum(d.cap_bytes for d in devices)
    results = {
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {a.threads} threads",
        "model": {"name": target.name, "gb": target.stat().st_size / 1e9, "x_caps": target.stat().st_size / caps,
                  "shallow_layers": a.shallow, "deep_scale": a.deep_scale},
        "devices": [dataclasses.asdict(d) for d in devices], "rounds": a.rounds, "layers_per_round": sizes,
        "predicted_tpot_s": round(mt.predicted_tpot(p, a.rounds, sizes), 3), "draft_max": a.draft_max,
        "tokens": a.tokens, "prompt": a.prompt, "reference_tokens_plain": reference,
        "drafts": {n: {"file": d["path"].name, "mb": round(d["path"].stat().st_size / 1e6, 1), "noise": d["noise"],
                       "agreement": round(d["agreement"], 3)} for n, d in drafts.items()},
        "ring_without_draft_equals_plain": base["tokens"] == reference,
        "runs": runs,
    }
    mt.RESULTS.mkdir(exist_ok=True)
    (mt.RESULTS / "speculative_streaming.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, mt.RESULTS / "speculative_streaming.png")
    print(f"wrote {mt.RESULTS}/speculative_streaming.json and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
