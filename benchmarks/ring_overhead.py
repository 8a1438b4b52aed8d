#!/usr/bin/env python3
"""Decode time per token through real node processes on loopback, against plain llama-cpp-python, measured
in the same run (paired blocks taking turns, medians), and the cost of one ring hop.

    .venv/bin/python benchmarks/ring_overhead.py [--model PATH] [--block 8] [--rounds 40] [--threads 2]
    .venv/bin/python benchmarks/ring_overhead.py --cores separate

Variants: plain llama-cpp-python on the whole model; one node holding every layer; three nodes with one round;
three nodes with two rounds (each on nodes of its own). With --cores shared (the default) every process runs on
every core, so the head and the nodes take turns on the same cores. With --cores separate the run emulates two
devices: the head (and plain llama, its baseline) on one half of the cores, the one node on the other, each with a
thread per core of its half; only plain llama and the one-node ring run (three nodes would need four devices).
Every variant decodes the same tokens (plain llama's greedy continuation) with the same thread count, in short
blocks taking turns at the same positions; ratios are paired within a round (median over rounds). The hop cost is
half the round trip of a message through a node that relays it (decode, validate, encode, send), for 1 and 512 rows
of n_embd = 4096 float32, back to back; and for 1 row sent every 5 ms, as in the ring, where the threads and cores
go idle between messages, beside the same round trip over a plain TCP socket to an echoing process (what a hop
costs without ZeroMQ's I/O threads and the node's Python).
Writes benchmarks/results/ring_overhead.json (ring_overhead_separate_cores.json with --cores separate).
Targets: one node within 5% of plain llama-cpp-python; a single-row hop under 0.5 ms.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from primaplug.cli.common import default_model

RESULTS = Path(__file__).resolve().parent / "results"


def split_cores() -> tuple[set[int], set[int]]:
    """The cores of the head's device and of the node's: each half of the cores this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--cores separate needs at least 2 cores, this process may use {len(cpus)}")
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:2 * half])


def block_time(llm, tokens: list[int]) -> float:
    """Seconds per token to decode `tokens` one by one after what `llm` has evaluated so far."""
    t0 = time.perf_counter()
    for tok in tokens:
        llm.eval([tok])
    return (time.perf_counter() - t0) / len(tokens)


def hop_cost(address: str, model: Path, rows: int, repeats: int, gap_s: float = 0.0) -> float:
    """Half the median round trip head -> relaying node -> head, for `rows` rows of 4096 float32; with `gap_s`, a
    message every gap_s seconds, as in a ring whose devices compute in between (threads and cores go idle)."""
    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.transport import ZmqTransport
    from primaplug.wire import (
        PROTOCOL_VERSION,
        Activation,
        Assignment,
        ModelIdentity,
        Part,
        WindowSpec,
        decode_ring,
        encode_ring,
    )

    layout = read_layout(model)
    t = ZmqTransport()
    client = NodeClient(t, address)
    client.hello()
    inbox = t.ring_in("127.0.0.1", 0)
    ident = ModelIdentity.of(layout, model.name)
    client.load(Assignment(epoch=1, model=ident, windows=(WindowSpec(0, 0),), successor=inbox.address, n_ctx=4096,
                           n_batch=512, n_ubatch=512))
    while client.status().state != "ready":
        time.sleep(0.05)
    out = t.ring_out(client.welcome.ring_endpoint)
    data = np.random.default_rng(0).standard_normal((rows, 4096)).astype(np.float32)
    times = []
    for step in range(repeats):
        msg = Activation(proto=PROTOCOL_VERSION, epoch=1, step=step, round=0, parts=(Part(0, 0, rows, True),),
                         width=4096, dtype="float32")
        time.sleep(gap_s)
        t0 = time.perf_counter()
        out.send(encode_ring(msg, data), 5.0)
        got, back = decode_ring(inbox.recv(5.0))
        times.append(time.perf_counter() - t0)
        assert got.step == step and back is not None and back.shape == data.shape
    client.unload()
    out.close(), inbox.close(), client.close()
    t.close()
    return statistics.median(times) / 2


TCP_ECHO = """
import socket, sys
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
n = int(sys.argv[1])
while True:
    buf = b""
    while len(buf) < n:
        got = conn.recv(1 << 20)
        if not got:
            sys.exit()
        buf += got
    conn.sendall(buf)
"""


def tcp_hop_cost(n_bytes: int, repeats: int, gap_s: float) -> float:
    """The same round trip over a plain TCP socket to an echoing process: what a hop costs without ZeroMQ's I/O
    threads (a baseline for the hop, not a transport primaplug could use: the ring is ZeroMQ, encrypted off
    loopback)."""
    import socket
    import subprocess

    echo = subprocess.Popen([sys.executable, "-c", TCP_ECHO, str(n_bytes)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(echo.stdout.readline())  # type: ignore[union-attr]
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data, times = b"x" * n_bytes, []
            for _ in range(repeats):
                time.sleep(gap_s)
                t0 = time.perf_counter()
                conn.sendall(data)
                got = 0
                while got < n_bytes:
                    got += len(conn.recv(1 << 20))
                times.append(time.perf_counter() - t0)
    finally:
        echo.kill()
        echo.wait()
    return statistics.median(times) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("--block", type=int, default=8, help="tokens per variant per round (default 8)")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of blocks (default 40)")
    ap.add_argument("--threads", type=int, default=2,
                    help="compute threads of every variant (default 2; with --cores separate: the cores of a half)")
    ap.add_argument("--cores", choices=("shared", "separate"), default="shared",
                    help="shared: every process on every core (default); separate: the head and one node on half "
                         "the cores each, as on two devices")
    args = ap.parse_args()
    separate = args.cores == "separate"
    node_cores: set[int] = set()
    if separate:
        head_cores, node_cores = split_cores()
        os.sched_setaffinity(0, head_cores)  # before any thread starts: they inherit it
        args.threads = len(head_cores)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)

    import llama_cpp

    import primaplug
    from primaplug.engine import read_layout
    from primaplug.head.launch import LocalNodes

    path = Path(args.model) if args.model else default_model()
    n_layer = read_layout(path).n_layer
    kw = dict(n_ctx=1024, n_threads=args.threads, verbose=False)
    # every ring variant has nodes of its own (1 + 3 + 3), so that the variants can take turns without redeploying
    n_nodes = 1 if separate else 7
    pin = [(lambda: os.sched_setaffinity(0, node_cores)) if separate else None] * n_nodes
    with tempfile.TemporaryDirectory() as logs, LocalNodes(path, n_nodes, log_dir=logs, preexec=pin) as local:
        plain = llama_cpp.Llama(str(path), **kw)
        prompt = plain.tokenize(b"The history of distributed computing begins with")
        tokens: list[int] = []  # plain llama's greedy continuation, fed identically to every variant
        for tok in plain.generate(prompt, temp=0.0):
            tokens.append(int(tok))
            if len(tokens) == args.block * args.rounds:
                break
        a = local.addresses
        variants = {
            "plain_llama": plain,
            "one_node": primaplug.Llama(path, nodes=a[:1], layers=[n_layer], node_threads=args.threads, **kw),
        }
        if not separate:
            variants["three_nodes_1_round"] = primaplug.Llama(path, nodes=a[1:4], scheduler="even",
                                                              node_threads=args.threads, **kw)
        if n_layer % 2 == 0 and not separate:
            variants["three_nodes_2_rounds"] = primaplug.Llama(path, nodes=a[4:7], scheduler="even", rounds=2,
                                                               node_threads=args.threads, **kw)
        for llm in variants.values():
            llm.reset()
            llm.eval(prompt)
        # the variants take turns decoding the same blocks of tokens at the same positions: drift on the machine
        # hits all of them alike, and ratios are paired within a round
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.rounds):
            block = tokens[r * args.block:(r + 1) * args.block]
            for name, llm in variants.items():
                times[name].append(block_time(llm, block))
            if (r + 1) % 10 == 0:
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1] * 1000:.2f} ms" for k, v in
                                                                   times.items()), file=sys.stderr)
        for llm in variants.values():
            llm.close()
        hops = {f"{rows}_rows_ms": round(hop_cost(a[0], path, rows, 50 if rows == 1 else 10) * 1000, 3)
                for rows in (1, 512)}
        # a message every 5 ms, as in the one-node ring (a token takes about 11 ms), against plain TCP
        hops["1_row_every_5ms_ms"] = round(hop_cost(a[0], path, 1, 100, gap_s=0.005) * 1000, 3)
    hops["plain_tcp_1_row_every_5ms_ms"] = round(tcp_hop_cost(4096 * 4 + 92, 100, gap_s=0.005) * 1000, 3)

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": path.name,
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
        "cores": args.cores,
        "threads": args.threads,
        "tokens_per_block": args.block,
        "rounds": args.rounds,
        "decode_ms_per_token_median": {k: round(v * 1000, 3) for k, v in med.items()},
        "ratio_vs_plain_paired": {k: round(statistics.median(x / y for x, y in zip(v, times["plain_llama"],
                                                                                      strict=True)), 4)
                                  for k, v in times.items()},
        "hop_n_embd_4096": hops,
    }
    out = RESULTS / ("ring_overhead_separate_cores.json" if separate else "ring_overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
