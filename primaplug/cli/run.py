"""`primaplug run`: generate from a prompt through primaplug.Llama (over nodes, or the head alone), stream the text,
report TTFT and TPOT, and with --verify compare the tokens with plain llama-cpp-python on the whole model."""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from primaplug.cli.common import llama_kwargs, model_path, ring_flags, ring_llama, say
from primaplug.cli.verify import RingOutput, verify
from primaplug.core import PrimaplugError, even_split


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="generate text through the ring (or the head alone, without nodes)")
    run.add_argument("-p", "--prompt", default="The three primary colors are")
    run.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    run.add_argument("--devices", type=int, default=1,
                     help="without nodes and --layers: windows the head splits the model into evenly (default 1)")
    run.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy (default 0.8)")
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=0.95)
    run.add_argument("--seed", type=int, default=None, help="sampling seed (default: drawn, and printed)")
    run.add_argument("--verify", action="store_true",
                     help="also generate with plain llama-cpp-python on the whole model and compare the tokens and "
                          "each token's logits: equal bit for bit on a ring of one CPU's kernels, within a measured "
                          "distance on one that mixes CPUs (docs/platforms.md)")
    ring_flags(run)
    run.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    path = model_path(args)
    if not (args.nodes or args.local_nodes) and not args.layers and args.devices > 1:
        from primaplug.engine import read_layout

        n_layer = read_layout(path).n_layer
        rounds = args.rounds or 1
        if rounds < 1 or n_layer % rounds:
            raise PrimaplugError(f"--rounds must divide the model's {n_layer} layers, got {rounds}")
        args.layers = even_split(n_layer // rounds, args.devices)
    # a seed is drawn when none is given, so that --verify replays the same draws
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    kwargs = llama_kwargs(args, seed=seed)
    sampling = dict(temp=args.temp, top_k=args.top_k, top_p=args.top_p)
    with ring_llama(args, path, kwargs) as llm:
        prompt = llm.tokenize(args.prompt.encode())
        n_predict = _room(prompt, args.n_predict, len(llm.input_ids))  # the n_ctx asked for (see RingLlama.eval)
        if args.verify:
            llm.keep_logits()
        tokens = _stream(llm, args.prompt, prompt, n_predict, sampling, seed)
        llm.cluster.metrics()  # each node's memory and work, shown by the event lines
        if args.verify:
            from primaplug.engine import cpu_kernels

            logits = llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].copy()
            ring = RingOutput(prompt, tokens, logits, llm.cluster.kernels(cpu_kernels()))
    if args.verify:
        return verify(path, args.prompt, ring, kwargs, sampling, n_predict)
    return 0


def _room(prompt: list[int], n_predict: int, n_ctx: int) -> int:
    """How many tokens may be generated: llama-cpp-python's rule (create_completion), with its error."""
    if len(prompt) >= n_ctx:
        raise PrimaplugError(f"Requested tokens ({len(prompt)}) exceed context window of {n_ctx}")
    if n_predict <= 0 or len(prompt) + n_predict > n_ctx:
        n_predict = n_ctx - len(prompt)
        say(f"generating at most {n_predict} tokens: the prompt's {len(prompt)} fill the rest of -c {n_ctx}")
    return n_predict


def generated(llm: Any, prompt: list[int], n_predict: int, sampling: dict[str, Any]) -> Any:
    """The token loop: llama-cpp-python's generate() and sampler, up to n_predict tokens, ending before an
    end-of-generation token. The same for the ring and for plain llama-cpp-python."""
    from primaplug.engine.reference import is_eog

    if n_predict <= 0:
        return
    for n, tok in enumerate(llm.generate(prompt, **sampling), 1):
        if is_eog(llm, tok):
            return
        yield tok
        if n == n_predict:  # stop before llama-cpp-python evaluates a token nobody asked for
            return


def _stream(llm: Any, text: str, prompt: list[int], n_predict: int, sampling: dict[str, Any], seed: int) -> list[int]:
    """Stream the completion to stdout; returns the generated token ids."""
    sys.stdout.write(text)
    sys.stdout.flush()
    out: list[int] = []
    t0 = t_first = time.perf_counter()
    for tok in generated(llm, prompt, n_predict, sampling):
        if not out:
            t_first = time.perf_counter()
        out.append(tok)
        sys.stdout.write(llm.detokenize([tok], prev_tokens=prompt + out[:-1]).decode("utf-8", "replace"))
        sys.stdout.flush()
    t_end = time.perf_counter()
    sys.stdout.write("\n")
    tpot = (t_end - t_first) / max(1, len(out) - 1)
    say(f"prompt {len(prompt)} tokens, generated {len(out)}; TTFT {(t_first - t0) * 1000:.1f} ms, "
        f"TPOT {tpot * 1000:.1f} ms, {len(out) / (t_end - t0):.1f} tokens/s (seed {seed})")
    if getattr(llm, "speculation", None) is not None:
        say(f"speculation: {llm.speculation.stats.describe()}")
    return out
