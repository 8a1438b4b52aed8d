"""`primaplug synth`: write a synthetic GGUF of a chosen architecture and size (random weights), for tests and
benchmarks."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from primaplug.cli.common import say
from primaplug.core import PrimaplugError


def byte_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        n = float(t[: len(t) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size like 1.5G, 800M or 2000000000, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return int(n)


def add_parser(sub: Any) -> None:
    from primaplug.engine.synthetic import SYNTH_NAMES

    synth = sub.add_parser("synth", help="write a synthetic GGUF of a chosen architecture and size (random weights)")
    synth.add_argument("output", help="the GGUF file to write")
    synth.add_argument("--size", type=byte_size, required=True, help="file size to aim at, e.g. 1.5G or 800M")
    synth.add_argument("--layers", type=int, default=32, help="transformer layers (default 32)")
    synth.add_argument("--arch", default="llama", choices=SYNTH_NAMES,
                       help="architecture: its real tensor names, shapes and hyper-parameters (default llama); "
                            "deepseek2-lite: deepseek2 without q LoRA, routing by softmax (DeepSeek-V2-Lite)")
    synth.add_argument("--experts", type=int, default=64, help="experts per layer of a mixture of experts (default 64)")
    synth.add_argument("--experts-used", type=int, default=8, help="experts a token is routed to (default 8)")
    synth.add_argument("--type", default="Q4_K_M",
                       help="llama.cpp quantization (default Q4_K_M; gpt-oss ships as MXFP4_MOE)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--force", action="store_true", help="overwrite an existing file")
    synth.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from primaplug.engine.synthetic import FTYPES, MOE_ARCHS, spec_for_size, write_sized_model

    if args.type not in FTYPES:
        raise PrimaplugError(f"--type must be one of {', '.join(FTYPES)}")
    out = Path(args.output)
    if out.exists() and not args.force:
        raise PrimaplugError(f"{out} exists; pass --force to overwrite it")
    if not 0 < args.experts_used <= args.experts:
        raise PrimaplugError(f"--experts-used must be between 1 and --experts ({args.experts}), "
                             f"got {args.experts_used}")
    moe = dict(arch=args.arch, n_expert=args.experts, n_expert_used=args.experts_used)
    spec = spec_for_size(args.size, args.layers, ftype=args.type, seed=args.seed, **moe)
    experts = (f", {spec.n_expert} experts of {spec.n_ff_exp} rows, {spec.n_expert_used} a token"
               if spec.arch in MOE_ARCHS else f", n_ff {spec.n_ff}")
    say(f"writing {out.name}: {args.arch}, {spec.n_layer} layers, n_embd {spec.n_embd}{experts}, "
        f"{spec.n_head} heads ({spec.n_head_kv} KV), vocab {spec.n_vocab}, {args.type}, random weights "
        f"(seed {args.seed})")
    tty, shown = sys.stderr.isatty(), [""]

    def progress(what: str, done: int, total: int) -> None:
        line = f"primaplug: [{'#' * (20 * done // max(total, 1)):<20}] {100 * done // max(total, 1):3d}% {what}"
        if line != shown[0] and (tty or done in (0, total)):
            shown[0] = line
            print(("\r\033[K" if tty else "") + line, end="" if tty else "\n", file=sys.stderr)

    t0 = time.perf_counter()
    write_sized_model(out, args.size, args.layers, ftype=args.type, seed=args.seed, progress=progress, **moe)
    if tty:
        print(file=sys.stderr)
    say(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    return 0
