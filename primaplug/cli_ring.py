"""`primaplug run --nodes ...` / `--local-nodes N`: generate across node processes, stream, report timings."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llama_cpp import llama_vocab_is_eog

from primaplug.core import PrimaplugError


class _LoadBar:
    """One status line per node while the nodes load, redrawn in place on a terminal."""

    def __init__(self) -> None:
        self.last: dict[str, str] = {}
        self.tty = sys.stderr.isatty()

    def __call__(self, node: str, frac: float, what: str) -> None:
        line = f"primaplug: {node}: [{'#' * int(frac * 20):<20}] {frac * 100:3.0f}% {what}"
        if self.last.get(node) != line:
            self.last[node] = line
            print(("\r\033[K" if self.tty else "") + line, end="" if self.tty else "\n", file=sys.stderr)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


@contextlib.contextmanager
def _nodes(args: argparse.Namespace, path: Path) -> Iterator[list[str]]:
    if args.nodes:
        yield args.nodes
        return
    from primaplug.launch import LocalNodes

    with tempfile.TemporaryDirectory(prefix="primaplug-nodes-") as logs:
        t0 = time.perf_counter()
        with LocalNodes(path, args.local_nodes, log_dir=logs) as local:
            print(f"primaplug: started {args.local_nodes} local nodes in {time.perf_counter() - t0:.1f} s: "
                  + ", ".join(f"{n.name} {n.address} (pid {n.pid})" for n in local.nodes), file=sys.stderr)
            yield local.addresses
        print(f"primaplug: stopped the {args.local_nodes} local nodes", file=sys.stderr)


@contextlib.contextmanager
def _ring(args: argparse.Namespace, path: Path, llama_kwargs: dict[str, Any]) -> Iterator[Any]:
    """Nodes (given or started here) with the model deployed: a primaplug.Llama, closed on exit."""
    import primaplug

    with _nodes(args, path) as addresses:
        bar = _LoadBar()
        t0 = time.perf_counter()
        llm = primaplug.Llama(path, nodes=addresses, layers=args.layers, scheduler=args.scheduler,
                              rounds=args.rounds, plan_settings=_plan_settings(args), keys=args.keys,
                              listen=args.listen, timeout_s=args.timeout, node_gpu_layers=args.n_gpu_layers,
                              progress=bar, **llama_kwargs)
        bar.done()
        try:
            if llm.plan is not None:
                print("primaplug: " + llm.plan.describe().replace("\n", "\nprimaplug:   "), file=sys.stderr)
            c = llm.cluster
            plan = "; ".join(f"{n} {' '.join(map(str, r))}" for n, r in zip(c.nodes, c.node_ranges, strict=True))
            head = " ".join(str(r) for r in c.head_ranges if r.n_layers) or "output layer only"
            print(f"primaplug: ring of {len(c.nodes)} node(s) + head, {len(c.head_ranges)} round(s), deployed in "
                  f"{time.perf_counter() - t0:.1f} s: {plan}{'; ' if plan else ''}head {head}", file=sys.stderr)
            yield llm
        finally:
            llm.close()


def _plan_settings(args: argparse.Namespace) -> Any:
    """The planning flags; the scheduler is passed on its own (`even` plans nothing)."""
    from primaplug.planning import PlanSettings

    return PlanSettings(rounds=args.rounds, slow_disk_bps=args.slow_disk * 1e6, force_profile=args.reprofile,
                        latency_model=args.latency_model)


def plan_ring(args: argparse.Namespace, path: Path) -> int:
    """Profile every device and print the plan with its predicted time per token, without deploying."""
    from primaplug.coordinator import Cluster, ClusterSettings
    from primaplug.engine import read_layout
    from primaplug.planning import measure, plan_cluster
    from primaplug.transport import Transport, load_keys
    from primaplug.wire import ModelIdentity

    layout = read_layout(path)
    layout.check_supported()
    ps = dataclasses.replace(_plan_settings(args), scheduler=args.scheduler)
    with _nodes(args, path) as addresses:
        transport = Transport(load_keys(args.keys) if args.keys else None)
        settings = ClusterSettings(nodes=tuple(addresses), n_ctx=args.ctx_size, n_batch=args.batch_size,
                                   n_ubatch=args.ubatch_size, listen=args.listen, timeout_s=args.timeout)
        ident = ModelIdentity.of(layout, path.name)
        cluster = Cluster(transport, settings, ident)
        try:
            cluster.connect()
            said: set[str] = set()

            def say(what: str) -> None:
                if what not in said:
                    said.add(what)
                    print(f"primaplug: {what}", file=sys.stderr)

            measured = measure(cluster, path, layout, ps, say)
            print(_profiles_table(measured))
            print(plan_cluster(cluster, measured, ps).describe())
        finally:
            cluster.close()
            transport.close()
    return 0


def _profiles_table(measured: Any) -> str:
    gb = 1e9
    lines = [f"model {measured.model.name}: {measured.model.n_layer} layers of "
             f"{measured.model.layer_bytes / gb:.3f} GB, "
             f"KV {measured.model.kv_bytes_per_token_layer} B/token/layer for {measured.model.n_kv} tokens",
             f"links (measured over the ring): {measured.link_latency_s * 1000:.2f} ms, "
             f"{measured.link_bps * 8 / 1e6:.0f} Mbit/s per hop"]
    for d in measured.devices:
        flops = ", ".join(f"{q} {f / 1e9:.0f}" for q, f in d.cpu_flops.items())
        lines.append(f"  {d.name}: {d.os}/{d.backend}, {d.cpu_count} cores, CPU GFLOP/s {flops}; RAM "
                     f"{d.mem_available_bytes / gb:.2f} of {d.mem_total_bytes / gb:.2f} GB free, read "
                     f"{d.cpu_read_bps / gb:.1f} GB/s; disk {d.disk_seq_bps / 1e6:.0f} MB/s seq, "
                     f"{d.disk_rand_bps / 1e6:.0f} MB/s random" + (f"; VRAM {d.vram_free_bytes / gb:.1f} GB free"
                                                                  if d.vram_free_bytes else ""))
    return "\n".join(lines)


def _llama_kwargs(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                n_threads=args.threads or None, verbose=False, **extra)


def serve_ring(args: argparse.Namespace, path: Path) -> int:
    """llama-cpp-python's OpenAI-compatible server in front of the ring, until interrupted."""
    from primaplug.server import create_app

    kwargs = _llama_kwargs(args, chat_format=args.chat_format) if args.chat_format else _llama_kwargs(args)
    with _ring(args, path, kwargs) as llm:
        app = create_app(llm, alias=args.alias or path.name, host=args.host, port=args.port)
        import uvicorn

        print(f"primaplug: serving {args.alias or path.name} at http://{args.host}:{args.port}/v1", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def run_ring(args: argparse.Namespace, path: Path) -> int:
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    llama_kwargs = _llama_kwargs(args, seed=seed)
    sampling = dict(temp=args.temp, top_k=args.top_k, top_p=args.top_p)
    with _ring(args, path, llama_kwargs) as llm:
        tokens = _generate(llm, args.prompt, args.n_predict, sampling)
    if args.verify:
        return _verify(path, args.prompt, tokens, llama_kwargs, sampling, args.n_predict)
    return 0


def _tokens(llm: Any, prompt_tokens: list[int], n_predict: int, sampling: dict[str, Any]) -> Iterator[int]:
    """The generated token ids, up to n_predict, ending before an end-of-generation token."""
    if n_predict <= 0:
        return
    for n, tok in enumerate(llm.generate(prompt_tokens, **sampling), 1):
        if llama_vocab_is_eog(llm._model.vocab, tok):
            return
        yield tok
        if n == n_predict:  # stop before llama-cpp-python evaluates a token nobody asked for
            return


def _generate(llm: Any, prompt: str, n_predict: int, sampling: dict[str, Any]) -> list[int]:
    """Stream the completion to stdout; returns the generated token ids."""
    prompt_tokens = llm.tokenize(prompt.encode())
    if len(prompt_tokens) + n_predict > llm.n_ctx():
        raise PrimaplugError(f"prompt ({len(prompt_tokens)} tokens) plus -n {n_predict} exceeds -c {llm.n_ctx()}")
    sys.stdout.write(prompt)
    sys.stdout.flush()
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = t0
    for tok in _tokens(llm, prompt_tokens, n_predict, sampling):
        if not out:
            t_first = time.perf_counter()
        out.append(tok)
        sys.stdout.write(llm.detokenize([tok], prev_tokens=prompt_tokens + out[:-1]).decode("utf-8", "replace"))
        sys.stdout.flush()
    t_end = time.perf_counter()
    sys.stdout.write("\n")
    ttft = t_first - t0
    tpot = (t_end - t_first) / max(1, len(out) - 1)
    print(f"primaplug: prompt {len(prompt_tokens)} tokens, generated {len(out)}; TTFT {ttft * 1000:.1f} ms, "
          f"TPOT {tpot * 1000:.1f} ms, {len(out) / (t_end - t0):.1f} tokens/s", file=sys.stderr)
    return out


def _verify(path: Path, prompt: str, tokens: list[int], llama_kwargs: dict[str, Any], sampling: dict[str, Any],
            n_predict: int) -> int:
    """Generate again with plain llama-cpp-python on the whole model, same seed, and compare the tokens."""
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(str(path), **llama_kwargs)
    try:
        plain = list(_tokens(llm, llm.tokenize(prompt.encode()), n_predict, sampling))
    finally:
        llm.close()
    same = plain == tokens
    print(f"primaplug: plain llama-cpp-python on the whole model gave {'the same' if same else 'DIFFERENT'} "
          f"{len(plain)} tokens ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0 if same else 1
