"""What every system's runner takes (a Job) and gives back (an Outcome), and what several of them read alike."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peer_systems.rig import Proc


@dataclass(frozen=True)
class Job:
    """One run of one system on one workload."""

    workload: str
    model: Path  # the GGUF (distributed-llama converts its own file of the same shapes)
    arch: str
    n_layer: int
    prompt: str  # text: every system tokenizes it with the model's own vocabulary
    tokens: int  # greedy tokens to generate
    threads: tuple[int, ...]  # per device
    split: tuple[int, ...] | None = None  # layers per round of each device (None: the system's own placement)
    n_ctx: int = 512
    n_batch: int = 64
    logs: Path = Path(".")
    timeout_s: float = 900.0
    extra: dict[str, Any] = field(default_factory=dict)  # per system: what its search varies


@dataclass
class Outcome:
    status: str = "ok"  # ok, unsupported, oom, failed
    ttft_s: float | None = None  # the prompt's evaluation, as the system itself times it
    tpot_s: float | None = None  # first to last generated token as printed, over the steps between (stdout_tpot)
    text: bytes | None = None  # the generated text's bytes (systems that print pieces)
    token_ids: list[int] | None = None  # the generated tokens (systems that give ids)
    split: str = ""  # the placement it ran, in its own terms
    error: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def ratio_split(weights: Sequence[float], total: int, minimum: int = 1) -> list[int]:
    """`total` layers in proportion to `weights`, each at least `minimum`, largest remainders first."""
    n = len(weights)
    if total < minimum * n:
        raise ValueError(f"{total} layers cannot give {n} devices {minimum} each")
    s = sum(weights)
    raw = [minimum + (total - minimum * n) * w / s for w in weights]
    out = [int(x) for x in raw]
    for i in sorted(range(n), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def watch_first_output(proc: Proc, seen: Callable[[bytes], bool], then: Callable[[], None],
                       stop: threading.Event) -> threading.Thread:
    """Call `then` once `seen(stdout so far)` holds: the moment the first generated token shows."""

    def run() -> None:
        while not stop.is_set():
            if seen(proc.stdout):
                then()
                return
            if proc.proc.poll() is not None:
                return
            time.sleep(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def stdout_tpot(proc: Proc, tokens: int,
                has_token: Callable[[bytes], bool] = lambda c: bool(c.strip())) -> float | None:
    """TPOT as every system is timed here: from the moment its first generated token was printed to the moment its
    last was, over the steps between (each of these programs flushes its output token by token)."""
    stamps = [t for t, chunk in proc.out if has_token(chunk)]
    if tokens < 2 or len(stamps) < 2:
        return None
    return (stamps[-1] - stamps[0]) / (tokens - 1)


# llama.cpp's own timings at exit (llama_perf_context_print), in both its October 2024 and its 2026 wording
_PROMPT = re.compile(r"prompt eval time\s*=\s*([\d.]+) ms\s*/\s*(\d+) tokens")
_EVAL = re.compile(r"\beval time\s*=\s*([\d.]+) ms\s*/\s*(\d+) runs")


def llama_perf(text: str) -> tuple[float, float, int] | None:
    """(TTFT s, TPOT s, decoding steps) from llama.cpp's exit summary: the prompt's evaluation, and the mean of the
    steps after it; None when it printed none (it failed first)."""
    p, e = _PROMPT.findall(text), [m for m in _EVAL.finditer(text) if "prompt" not in
                                   text[max(0, m.start() - 7):m.start()]]
    if not p or not e:
        return None
    prompt_ms, _ = p[-1]
    eval_ms, runs = float(e[-1].group(1)), int(e[-1].group(2))
    return float(prompt_ms) / 1e3, (eval_ms / runs / 1e3) if runs else float("nan"), runs


def git_commit(src: Path) -> str:
    done = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"


def linked_libraries(binary: Path) -> list[str]:
    done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if "=>" in line]


def last_lines(text: str, n: int = 4, pattern: str = r"error|fail|abort|assert|unknown|unsupported|what\(\)") -> str:
    """The lines of a log that say what went wrong, else its last lines."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if re.search(pattern, ln, re.IGNORECASE)]
    return " | ".join((hits or lines)[-n:])[:600]
