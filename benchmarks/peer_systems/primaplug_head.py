"""primaplug's head on one emulated device, a process of its own (`python -m benchmarks.peer_systems.primaplug_head`,
started by primaplug_run.py): it plans (or takes the split), deploys, and times the prompt and each greedy token.

It prints each generated token's text as it knows it (as llama-cli does), so TTFT and TPOT are timed the same way
for every system, and its result as JSON on stderr's last line. Its links go through the rig's proxy: the head asks
the proxy for each link itself (RemoteLinks), with the link of the device each sender sits on. It imports nothing of
the harness beyond that client: what it holds counts in its device's memory, as a user's head would.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.testbed.linkclient import RemoteLinks

NODE_TIMEOUT_S = 300  # the head's wait for a node's answer: an emulated device at a sixth of a core is slow
RESULT = "primaplug-result "


def _head(a: argparse.Namespace) -> None:
    """The head process: plan (or take the split), deploy, time the prompt and each greedy token."""
    import logging

    import primaplug
    from primaplug.head.planning import PlanSettings

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)
    nodes = [n for n in a.nodes.split(",") if n]  # none: the head runs every layer
    links = [(float(lat), float(mbit), name) for lat, mbit, name in (link.split(":") for link in a.links.split(","))]
    proxy = RemoteLinks(a.proxy)
    routes: dict[tuple[str, str], str] = {}

    def route(sender: str, endpoint: str) -> str:
        """The sender's device's link: the head is device 0, node i device i + 1."""
        if (sender, endpoint) not in routes:
            latency_ms, mbit, device = links[0 if sender == "head" else nodes.index(sender) + 1]
            routes[sender, endpoint] = proxy.route(endpoint, latency_ms, mbit, device)
        return routes[sender, endpoint]

    by_hand = [int(x) for x in a.split.split(",")] if a.split else []  # device order, the head first
    if by_hand:  # primaplug's order: the nodes, then the head (last in every round)
        how: dict[str, Any] = {"layers": (*by_hand[1:], by_hand[0]), "rounds": rounds(sum(by_hand), a.model)}
    else:
        how = {"scheduler": "halda", "plan_settings": PlanSettings(slow_disk_bps=400e6 / a.scale,
                                                                    latency_model="ring")}
    llm = primaplug.Llama(a.model, nodes=nodes, route=route, n_ctx=a.n_ctx, n_batch=a.n_batch,
                          n_ubatch=a.n_batch, n_threads=a.threads, node_threads=a.threads, timeout_s=NODE_TIMEOUT_S,
                          verbose=False, **how)
    try:
        prompt = llm.tokenize(a.prompt.encode(), add_bos=True, special=False)
        t0 = time.perf_counter()
        llm.eval(prompt)
        ttft = time.perf_counter() - t0
        out, stamps = [], []
        for i in range(a.tokens):
            out.append(last_token(llm))
            stamps.append(time.perf_counter())
            sys.stdout.buffer.write(_piece(llm, out[-1]))
            sys.stdout.flush()
            if i + 1 < a.tokens:
                llm.eval([out[-1]])
        plan = llm.plan
        if plan:  # the head's windows last in every round; a dropped device runs none
            windows = {d.name: d.w for d in plan.ring} | {d.name: 0 for d in plan.dropped}
            split = (" ".join(f"{d.name} {d.w}" for d in plan.ring) + f" (k = {plan.k})"
                     + "".join(f"; dropped {d.name}" for d in plan.dropped))
        else:
            names = [n.name for n in llm.cluster.nodes]
            windows = {"head": by_hand[0]} | dict(zip(names, by_hand[1:], strict=True))
            split = " ".join(f"{k} {w}" for k, w in windows.items()) + f" (k = {how['rounds']})"
        result = {"ttft_s": round(ttft, 4), "tpot_s": round((stamps[-1] - stamps[0]) / max(1, a.tokens - 1), 4),
                  "token_s": [round(b - c, 4) for b, c in zip(stamps[1:], stamps, strict=False)], "tokens": out,
                  "prompt_tokens": len(prompt), "split": split, "plan": plan.describe() if plan else "",
                  "windows": windows}
    finally:
        llm.close()
        proxy.close()
    print(RESULT + json.dumps(result), file=sys.stderr, flush=True)


def last_token(llm: Any) -> int:
    """The greedy token after the last row, from the logits in the context (llama-cpp-python fills `scores` only
    with logits_all, which would run the output layer on every row of the prompt: a user's call does not)."""
    import llama_cpp
    import numpy as np

    logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))


def _piece(llm: Any, token: int) -> bytes:
    """A token's text as llama.cpp's tools print it (llama_token_to_piece, no special tokens)."""
    import ctypes

    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llama_cpp.llama_model_get_vocab(llm.model), token, buf, len(buf), 0, False)
    return buf.raw[:n]


def rounds(per_round: int, model: str) -> int:
    from primaplug.engine import read_layout

    n_layer = read_layout(model).n_layer
    if n_layer % per_round:
        raise SystemExit(f"a split of {per_round} layers a round does not divide the model's {n_layer}")
    return n_layer // per_round


def main() -> None:
    ap = argparse.ArgumentParser(description="primaplug's head on one emulated device (benchmarks/peers.py)")
    for flag in ("--model", "--nodes", "--proxy", "--links", "--prompt"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--n-batch", type=int, default=64)
    ap.add_argument("--scale", type=float, default=1.0, help="the devices' memory and disk divided by this")
    ap.add_argument("--split", help="layers a round per device, the head's first (default: Halda plans)")
    _head(ap.parse_args())


if __name__ == "__main__":
    main()
