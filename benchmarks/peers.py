#!/usr/bin/env python3
"""primaplug side by side with what a home user would run instead, on the same emulated devices, in one run
(needs root: cgroups, dropping the page cache, LXCFS).

    sudo .venv/bin/python benchmarks/peers.py --prima-cpp DIR --dllama DIR [--highs DIR] [--exo DIR] [--quick]

Systems: primaplug; prima.cpp, llama.cpp's RPC backend, distributed-llama and exo (docs/peers.md says how each
is built and started). prima.cpp and distributed-llama are checkouts of their public sources, given by path and
built here once by their own READMEs' commands (HiGHS for prima.cpp too, from a checkout of it, where it is not
installed under /usr/local); llama.cpp's RPC tools are built here from the pinned sdist's vendored llama.cpp. Each
build is cached under ~/.cache/primaplug/peers/ by its source and commands (peer_systems/builds.py), and the
results record its commit and commands. No peer's code is copied into this repository. Every system runs on the
same devices: each a cgroup (memory, disk reads, CPU) whose processes see its memory as theirs, with its own copy of
the model, the same link proxies between devices, the page cache dropped before every run, the same prompt and
number of greedy tokens; the head (each system's rank 0, client or root) is device 0, in its cgroup like the rest.

Workloads (the median of --runs runs each):
  W1  the paper's regime: a 1.9 GB llama on paper-d1-d4/24, about 1.8x the pooled memory
  W2  W1 with twice the memory
  W3  a model that fits every device with room (compute and links bound it): 4 devices with the paper's CPU
      ratios, then 8 where the system allows
  W4  a mixture of experts larger than the pooled memory (qwen3moe, 64 experts, 8 a token)
Each system gets two rows: its own placement, and the best a small search finds (each candidate run once, the
fastest run again; every system's own placement runs before any search, so each ring system tries the other's
split). Each row has every device's memory, disk reads and CPU a token, and where a step's time went (`hops`: each
device and link, from the link proxy's traces, testbed/hops.py). Writes benchmarks/results/peers.json (--quick:
peers_quick.json), peers.png, and every run's logs under benchmarks/results/peers/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import need_charts  # noqa: E402
from benchmarks.peer_systems import dllama, llama_rpc, prima_cpp, primaplug_head, primaplug_run  # noqa: E402
from benchmarks.peer_systems.base import Job, Outcome, ratio_split  # noqa: E402
from benchmarks.peer_systems.rig import Rig  # noqa: E402
from benchmarks.testbed.cgroups import CgroupUnavailableError  # noqa: E402
from benchmarks.testbed.cluster import Terminated, unwind_on_sigterm  # noqa: E402
from benchmarks.testbed.devices import PAPER_D1_D4, Device, scaled  # noqa: E402
from benchmarks.testbed.hops import breakdown  # noqa: E402
from benchmarks.testbed.view import Lxcfs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path.home() / ".cache" / "primaplug" / "bench"
SYSTEMS = ("primaplug", "prima.cpp", "llama.cpp-rpc", "distributed-llama", "exo")
# The prompt: digits, which every tokenizer here reads one byte a token. llama.cpp's SentencePiece adds a leading
# '▁' (3 byte tokens) that distributed-llama's tokenizer does not, so it gets 3 more digits: 17 tokens each.
PROMPT, DLLAMA_PROMPT = "3141592653589", "3141592653589793"


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    devices: tuple[Device, ...]
    model: str  # a key of MODELS
    tokens: int
    threads: int  # per device (one where a device has less than a core)
    more_devices: tuple[Device, ...] = ()  # a second device set, where the system allows (W3: 8 devices)


def cpu_devices(n: int) -> tuple[Device, ...]:
    """The paper's four devices with CPU shares in the ratio of their CPUs (M1, i9 laptop, i9 desktop, phone) that
    add up to 1.6 of this machine's cores (tensor parallelism computes on every device at once: shares that added up
    to more than the machine has would slow it for want of cores, not for its design); memory and disks ample.
    n = 8: each device twice, with half the share."""
    ratios = (1.0, 1.5, 2.0, 0.5)
    base = [dataclasses.replace(d, memory_mib=512, disk_mbps=500, cpus=round(1.6 * r / sum(ratios), 3))
            for d, r in zip(PAPER_D1_D4, ratios, strict=True)]
    if n == 4:
        return tuple(base)
    return tuple(dataclasses.replace(d, name=f"{d.name}-{k}", cpus=round(d.cpus / 2, 3))  # type: ignore[operator]
                 for d in base for k in "ab")


W_PAPER = tuple(scaled(PAPER_D1_D4, 24))
WORKLOADS = {
    "W1": Workload("W1", "the paper's regime: a 1.9 GB llama on paper-d1-d4/24 (about 1.8x the pooled memory)",
                   W_PAPER, "llama-1800M", tokens=5, threads=2),
    "W2": Workload("W2", "W1 with twice the memory (--memory-factor 2)",
                   tuple(dataclasses.replace(d, memory_mib=d.memory_mib * 2) for d in W_PAPER), "llama-1800M",
                   tokens=5, threads=2),
    "W3": Workload("W3", "a model that fits every device with room: 4 devices with the paper's CPU ratios (1.6 "
                   "cores in all), then 8", cpu_devices(4), "llama-fits", tokens=32, threads=1,
                   more_devices=cpu_devices(8)),
    "W4": Workload("W4", "a mixture of experts larger than the pooled memory (qwen3moe, 64 experts, 8 a token) on "
                   "paper-d1-d4/24", W_PAPER, "qwen3moe-1800M", tokens=5, threads=2),
}


def model_path(key: str) -> Path:
    """The workload's GGUF, written once (primaplug's synthetic writer, llama.cpp's quantizer) and cached."""
    from primaplug.engine.synthetic import SyntheticSpec, quantize, write_synthetic_gguf

    specs = {
        # the memory testbed's model: 32 layers, n_embd 2560, 20 heads (5 KV)
        "llama-1800M": None,
        # 8 KV heads, so that distributed-llama may run on 8 nodes
        "llama-fits": SyntheticSpec(arch="llama", n_layer=16, n_embd=1024, n_ff=3584, n_head=16, n_head_kv=8,
                                    n_vocab=4096),
        "qwen3moe-1800M": SyntheticSpec(arch="qwen3moe", n_layer=16, n_embd=1024, n_ff=3584, n_head=16, n_head_kv=4,
                                        n_vocab=4096, n_expert=64, n_expert_used=8, n_ff_exp=1024),
    }
    if specs[key] is None:
        from benchmarks.memory_testbed import model_file

        return model_file("1800M", 32)
    path = CACHE / f"peers-{key}-Q4_K_M.gguf"
    if not path.exists():
        print(f"peers: writing {path.name} (once)", file=sys.stderr, flush=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".f16.tmp")
        write_synthetic_gguf(tmp, specs[key], dtype="F16")
        quantize(tmp, path, "Q4_K_M")
        tmp.unlink()
    return path


def reference(model: Path, tokens: int) -> dict[str, Any]:
    """Plain llama-cpp-python's greedy tokens for the prompt (this machine, uncapped), with the batch sizes every
    system runs (n_batch 64, and micro-batches as large: the prompt in one step, as llama.cpp's tools take it): what a
    system that runs the same GGUF is held to. (A prompt cut into other micro-batches takes other kernels, which round
    otherwise: plain itself gives other tokens from the 20th on with n_ubatch 16 here.) Also the prompt's length."""
    import ctypes

    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=512, n_batch=64, n_ubatch=64, verbose=False)
    try:
        prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
        llm.eval(prompt)
        out = []
        for i in range(tokens):
            out.append(primaplug_head.last_token(llm))
            if i + 1 < tokens:
                llm.eval([out[-1]])
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        buf = ctypes.create_string_buffer(256)
        pieces = []
        for t in out:
            n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
            pieces.append(buf.raw[:n])
    finally:
        llm.close()
    return {"tokens": out, "text": b"".join(pieces).decode("latin-1"), "prompt_tokens": len(prompt),
            "n_batch": 64, "n_ubatch": 64}


class NoCheckoutError(Exception):
    pass


def _given(checkout: Path | None, flag: str) -> Path:
    if checkout is None:
        raise NoCheckoutError(f"no checkout given ({flag}, built here by its README)")
    return checkout


@dataclass
class Peers:
    """Where each system is, or why it is not."""

    prima: Path | None  # the checkouts given
    dllama: Path | None
    exo: Path | None
    bins: dict[str, Path] = field(default_factory=dict)  # each built peer's folder of programs
    errors: dict[str, str] = field(default_factory=dict)  # why a peer was not built

    def build(self, systems: list[str], highs: Path | None, logs: Path) -> None:
        """Each peer of `systems` built once (cached under ~/.cache/primaplug/peers/), or why it was not."""
        cache = CACHE.parent / "peers"
        for system in systems:
            try:
                if system == "llama.cpp-rpc":
                    self.bins[system] = llama_rpc.build(cache, logs / "llama.cpp-rpc-build.log")
                elif system == "prima.cpp":
                    src = _given(self.prima, "--prima-cpp DIR: a clone of Lizonghang/prima.cpp")
                    self.bins[system] = prima_cpp.build(src, highs, cache, logs)
                elif system == "distributed-llama":
                    src = _given(self.dllama, "--dllama DIR: a clone of b4rtaz/distributed-llama")
                    self.bins[system] = dllama.build(src, cache, logs)
            except NoCheckoutError as e:
                self.errors[system] = str(e)
            except Exception as e:  # noqa: BLE001 - the row says why
                self.errors[system] = f"failed: its build did not finish: {e}"

    def missing(self, system: str) -> str | None:
        return self.errors.get(system)

    def scrub(self, text: str) -> str:
        """What is committed names no path of this machine: the checkouts, this repository, the Python environment
        (where it is outside the repository) and the home folder are said as <prima.cpp>, <distributed-llama>, <exo>,
        <repo>, <venv> and ~."""
        places = [(self.prima, "<prima.cpp>"), (self.dllama, "<distributed-llama>"), (self.exo, "<exo>"),
                  (ROOT, "<repo>"), (Path(sys.prefix), "<venv>"), (Path.home(), "~")]  # a venv outside the checkout
        for path, name in places:
            if path is not None and str(path) not in ("", "/", "."):
                text = text.replace(str(Path(path).resolve()), name).replace(str(path), name)
        return text

    def scrub_logs(self, folder: Path) -> None:
        for f in folder.rglob("*"):
            if f.is_file():
                text = f.read_bytes().decode("utf-8", errors="surrogateescape")
                if (clean := self.scrub(text)) != text:
                    f.write_bytes(clean.encode("utf-8", errors="surrogateescape"))

    def build_info(self, system: str) -> dict[str, str]:
        from primaplug.engine import build as engine

        if system == "primaplug":
            from benchmarks.peer_systems.base import git_commit

            return {"commit": git_commit(ROOT), "flags": f"engine: llama-cpp-python {engine.VERSION} + patches/"}
        if system == "prima.cpp" and system in self.bins:
            return prima_cpp.build_info(self.bins[system])
        if system == "distributed-llama" and system in self.bins:
            return dllama.build_info(self.bins[system])
        if system == "llama.cpp-rpc" and system in self.bins:
            return llama_rpc.build_info(self.bins[system])
        if system == "exo" and self.exo:
            from benchmarks.peer_systems.base import git_commit

            return {"commit": git_commit(self.exo), "flags": "not built (docs/peers.md)"}
        return {"commit": "not available", "flags": ""}


def exo_reason(exo: Path | None) -> str:
    """Why exo cannot run these workloads here: it is checked, not assumed (docs/peers.md has the attempt)."""
    if exo is None:
        return "no checkout given (--exo DIR); docs/peers.md records the attempt"
    engines = sorted({p.parent.name for p in (exo / "src" / "exo" / "worker" / "engines").glob("*/__init__.py")})
    gguf = any("gguf" in p.read_text(errors="replace").lower()
               for p in (exo / "src" / "exo" / "worker" / "engines").rglob("*.py"))
    return (f"unsupported: exo's inference engines ({', '.join(engines) or 'none found'}) load MLX safetensors "
            f"models by Hugging Face id{'' if not gguf else ' (and mention GGUF)'}; none of them reads a GGUF, and "
            "its Linux build needs its Rust bindings (exo-pyo3-bindings, not on PyPI) built with cargo from "
            "crates.io, which this machine cannot reach (docs/peers.md)")


# --- one run ---------------------------------------------------------------------------------------------------


def run_once(system: str, peers: Peers, w: Workload, devices: tuple[Device, ...], job: Job, work: Path,
             meminfo: Path, model: Path) -> dict[str, Any]:
    """One run of one system: fresh cgroups, cold page cache, every device sampled; its figures and evidence."""
    job.logs.mkdir(parents=True, exist_ok=True)
    (job.logs / "links").mkdir(exist_ok=True)  # the link proxy's record of every chunk (hops.py)
    t0 = time.monotonic()
    with Rig(devices, work, meminfo, trace_dir=job.logs / "links") as rig, rig.measure() as m:
        def first() -> None:
            rig.first_token(m)

        try:
            if system == "primaplug":
                out = primaplug_run.run(rig, job, first, scale=24.0 if w.name != "W3" else 1.0)
            elif system == "prima.cpp":
                out = prima_cpp.run(peers.bins[system], rig, job, first)
            elif system == "llama.cpp-rpc":
                out = llama_rpc.run(peers.bins[system], rig, job, first)
            else:
                out = run_dllama(peers.bins[system], rig, job, first, model)
        except Exception as e:  # a harness error is recorded as the run's failure, with what it said
            out = Outcome("failed", error=f"{type(e).__name__}: {e}")
        # the OOM killer's victims: a process of the system's own killed by SIGKILL in a device whose cgroup counted
        # an OOM kill (a process that failed otherwise, then had a helper killed, is a failure: prima.cpp's abort runs
        # gdb for its backtrace, which a small device's cap kills)
        sigkilled = [(device, ended) for device, code, ended in rig.exits() if code == -9]
        finished = time.monotonic()
    devices_stats = m.summary(job.tokens, out.ttft_s, out.tpot_s)
    hops = None  # where a decoding step's wall time went: each device, the links (testbed/hops.py)
    if out.status == "ok" and m.first_at is not None and out.tpot_s is not None and job.tokens > 1:
        hops = breakdown(job.logs / "links", m.first_at, m.first_at + (job.tokens - 1) * out.tpot_s, job.tokens - 1)
    shutil.rmtree(job.logs / "links", ignore_errors=True)
    killed = [name for name, s in devices_stats.items() if s["oom_kills"]]
    victims = [(device, ended) for device, ended in sigkilled if device in killed]
    if victims and out.status != "unsupported":
        when = min((ended or finished) - t0 for _, ended in victims)
        names = ", ".join(sorted({device for device, _ in victims}))
        out.status, out.error = "oom", f"oom: {names} killed after {when:.0f} s ({out.error})"
    elif killed:
        out.error += f" (the OOM killer also killed a process in {', '.join(killed)})"
    return {"status": out.status, "ttft_s": _round(out.ttft_s), "tpot_s": _round(out.tpot_s), "split": out.split,
            "error": out.error, "text": out.text.decode("latin-1") if out.text is not None else None,
            "token_ids": out.token_ids, "devices": devices_stats, "hops": hops, "detail": out.detail,
            "logs": str(job.logs.relative_to(RESULTS)), "wall_s": round(time.monotonic() - t0, 1)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def run_dllama(bin_dir: Path, rig: Rig, job: Job, first: Callable[[], None], model: Path) -> Outcome:
    shapes = dllama.shapes_of(model)
    n = len(job.extra.get("devices", rig.devices))
    if why := dllama.unsupported(n):
        return Outcome("unsupported", error=why)
    m = dllama.write_model(shapes, model.with_suffix(".dllama.m"))
    t = dllama.write_tokenizer(model, model.with_suffix(".dllama.t"))
    djob = dataclasses.replace(job, prompt=DLLAMA_PROMPT)
    return dllama.run(bin_dir, rig, djob, first, m, t, prompt_tokens=len(DLLAMA_PROMPT) + 1)


# --- placements and the search ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    name: str  # "own" or what the candidate is
    split: tuple[int, ...] | None = None  # layers a round per device, device 0 first; None: the system's own
    extra: tuple[tuple[str, Any], ...] = ()


def candidates(system: str, devices: tuple[Device, ...], n_layer: int, layer_mib: float,
               found: dict[str, str]) -> list[Placement]:
    """The small search's candidates for a system (its own placement is run apart). `found`: the other ring
    system's own split, where known, in device order, as "a,b,c,d"; `layer_mib`: a layer's weights."""
    mem = [d.memory_mib for d in devices]
    cpu = [d.cpus or 1.0 for d in devices]
    out: list[Placement] = []
    if system in ("primaplug", "prima.cpp"):
        for k in (1, 2, 4):
            if n_layer % k == 0 and n_layer // k >= len(devices):
                out.append(Placement(f"memory-proportional, k = {k}", tuple(ratio_split(mem, n_layer // k))))
        out.append(Placement("compute-proportional, k = 1", tuple(ratio_split(cpu, n_layer))))
        mine = found.get(system)
        if system == "primaplug" and mine and "0" in mine.split(",")[1:]:
            # as a user would after reading the plan: Halda again with the dropped devices' nodes stopped (they
            # would idle there, holding their runtime's memory; prima.cpp's dropped ranks exit)
            kept = [0, *(i for i, w in enumerate(mine.split(",")) if i and w != "0")]
            out.append(Placement("its own plan on the devices it keeps (the others' nodes stopped)", None,
                                 (("devices", kept),)))
        other = found.get("prima.cpp" if system == "primaplug" else "primaplug")
        if other:
            out.append(on_devices(f"the other ring's own split ({other})", [int(x) for x in other.split(",")],
                                  head_computes=system == "prima.cpp"))
    elif system == "llama.cpp-rpc":
        # what fits: each server the layers its memory holds (a server keeps them in memory), the client the rest,
        # mapped from its file as they are (--no-repack: repacking copies them into memory)
        fit = [0] + [min(n_layer, int(0.8 * d.memory_mib / layer_mib)) for d in devices[1:]]
        while sum(fit) > n_layer:
            fit[fit.index(max(fit))] -= 1
        fit[0] = n_layer - sum(fit[1:])
        out.append(Placement("what fits each server, the rest mapped on the client", tuple(fit),
                             (("no_repack", True),)))
        out.append(Placement("compute-proportional", tuple(ratio_split(cpu, n_layer, minimum=0))))
        out.append(Placement("even", tuple(ratio_split([1.0] * len(devices), n_layer, minimum=0))))
    elif system == "distributed-llama":  # its placement is fixed (equal slices): which devices, how it waits
        every = list(range(len(devices)))
        fastest = sorted(every[1:], key=lambda i: (-(devices[i].cpus or 1.0), -devices[i].memory_mib))
        out.append(Placement("every device, blocking network (--net-turbo 0)",
                             extra=(("devices", every), ("net_turbo", False))))
        for k in (2, 1):
            out.append(Placement(f"{k} node(s): the head's device and the fastest",
                                 extra=(("devices", [0, *fastest[:k - 1]]),)))
    seen, unique = set(), []
    for p in out:
        if (p.split, repr(p.extra)) not in seen:
            seen.add((p.split, repr(p.extra)))
            unique.append(p)
    return unique


def on_devices(name: str, split: list[int], head_computes: bool) -> Placement:
    """A split with devices left out (no layer): run on the others only, the head's device always. prima.cpp's
    rank 0 takes a layer at least (its -lw refuses 0), from the device that has most."""
    split = list(split)
    if head_computes and split[0] == 0:
        split[split.index(max(split))] -= 1
        split[0] = 1
    used = [0, *(i for i in range(1, len(split)) if split[i])]
    if len(used) == len(split):
        return Placement(name, tuple(split))
    return Placement(name, tuple(split), (("devices", used),))


def split_of(row: dict[str, Any], devices: tuple[Device, ...]) -> str | None:
    """A ring system's own split as "a,b,c,d" (device order), from what it reported, for the other to try."""
    windows = row.get("detail", {}).get("windows")
    if windows:
        return ",".join(str(windows.get(d.name, 0)) for d in devices)
    return None


def median_row(system: str, placement: Placement, runs: list[dict[str, Any]], ref: dict[str, Any],
               build: dict[str, str], devices: tuple[Device, ...]) -> dict[str, Any]:
    ok = [r for r in runs if r["status"] == "ok" and r["tpot_s"] is not None]
    chosen = sorted(ok, key=lambda r: r["tpot_s"])[len(ok) // 2] if ok else runs[-1]
    row = {"system": system, "placement": placement.name, "devices": len(devices), "status": chosen["status"],
           "tpot_s": statistics.median(r["tpot_s"] for r in ok) if ok else None,
           "ttft_s": statistics.median(r["ttft_s"] for r in ok) if ok else None,
           "commit": build.get("commit", ""), "build_flags": build.get("flags", ""),
           "split": chosen["split"], "error": chosen["error"], "runs": len(runs), "runs_ok": len(ok),
           "tpot_runs_s": [r["tpot_s"] for r in runs], "ttft_runs_s": [r["ttft_s"] for r in runs],
           "memory": {name: {k: s[k] for k in ("peak_used_mib", "cap_mib", "pressure", "peak_start_mib", "oom_kills",
                                               "disk_read_mib_per_token", "cpu_ms_per_token", "used_mib_at_marks",
                                               "at_first_token", "processes_at_first_token")}
                      for name, s in chosen["devices"].items()},
           "max_pressure": max(s["pressure"] for s in chosen["devices"].values()),
           "oom_killed": sorted({n for r in runs for n, s in r["devices"].items() if s["oom_kills"]}),
           "tokens_match_plain": tokens_match(chosen, ref), "hops": chosen.get("hops"), "detail": chosen["detail"],
           "logs": chosen["logs"]}
    return row


def tokens_match(run: dict[str, Any], ref: dict[str, Any]) -> bool | None:
    """Whether a run's greedy tokens are plain llama-cpp-python's: by id where it gives ids, else by the bytes of
    their text (the pieces llama.cpp's tools print). None where it ran other weights or did not run."""
    if run["status"] != "ok":
        return None
    if run["token_ids"] is not None:
        return run["token_ids"] == ref["tokens"]
    if run["text"] is None:
        return None
    return run["text"].rstrip("\n") == ref["text"]


# --- the whole run ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # resolved: each system's processes run in their device's folder, where a relative path means nothing
    ap.add_argument("--prima-cpp", type=_checkout, help="a checkout of Lizonghang/prima.cpp (built here once, by its "
                    "README: make USE_HIGHS=1 llama-cli)")
    ap.add_argument("--highs", type=_checkout, help="a checkout of ERGO-Code/HiGHS, for prima.cpp's scheduler where "
                    "HiGHS is not installed under /usr/local (built here once, with cmake)")
    ap.add_argument("--dllama", type=_checkout, help="a checkout of b4rtaz/distributed-llama (built here once, by its "
                    "README: make dllama)")
    ap.add_argument("--exo", type=_checkout, help="a checkout of exo-explore/exo (its outcome is recorded, "
                    "docs/peers.md)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4")
    ap.add_argument("--systems", default=",".join(SYSTEMS[:4]))
    ap.add_argument("--runs", type=int, default=3, help="runs of each row; its median is reported (default 3)")
    ap.add_argument("--no-search", action="store_true", help="each system's own placement only")
    ap.add_argument("--quick", action="store_true",
                    help="W3 on 4 devices and W1, one run each, own placements only (8 minutes once built)")
    ap.add_argument("--workdir", type=Path, default=CACHE / "peers")
    ap.add_argument("--table", action="store_true",
                    help="print the results' table (markdown, as docs/peers.md and the README quote it) and exit")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads((RESULTS / ("peers_quick.json" if a.quick else "peers.json")).read_text())))
        return 0
    need_charts()
    unwind_on_sigterm()
    if a.quick:
        a.workloads, a.runs, a.no_search = "W3,W1", 1, True
    systems = [s for s in a.systems.split(",") if s]
    peers = Peers(a.prima_cpp, a.dllama, a.exo)
    peers.build(systems, a.highs, a.workdir)
    out_name = "peers_quick" if a.quick else "peers"
    logs = RESULTS / out_name
    # a run of some workloads replaces those in the results and keeps the others (each says when it ran)
    previous = RESULTS / f"{out_name}.json"
    results: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    results["about"] = {
        "command": "sudo .venv/bin/python benchmarks/peers.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {shutil.os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M"), "runs": a.runs, "prompt": PROMPT,
        "builds": {s: peers.build_info(s) for s in SYSTEMS}}
    try:
        with Lxcfs() as fs:
            for wname in a.workloads.split(","):
                shutil.rmtree(logs / wname, ignore_errors=True)
                results[wname] = workload(WORKLOADS[wname], systems, peers, a, fs.meminfo, logs / wname)
                results[wname]["ran"] = f"{time.strftime('%Y-%m-%d %H:%M')}, {results['about']['command']}"
                peers.scrub_logs(logs / wname)
                write(results, out_name, scrub=peers.scrub)
    except CgroupUnavailableError as e:
        print(f"peers: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated):
        print("peers: interrupted; processes stopped and cgroups removed", file=sys.stderr)
        return 130
    write(results, out_name, chart=True, scrub=peers.scrub)
    return 0


def _checkout(path: str) -> Path:
    return Path(path).resolve()


def workload(w: Workload, systems: list[str], peers: Peers, a: argparse.Namespace, meminfo: Path,
             logs: Path) -> dict[str, Any]:
    from primaplug.engine import read_layout

    model = model_path(w.model)
    layout = read_layout(model)
    ref = reference(model, w.tokens)
    caps = sum(d.cap_bytes for d in w.devices)
    print(f"\n{w.name}: {w.title}\n  {model.name}: {model.stat().st_size / 1e9:.2f} GB, {layout.n_layer} layers, "
          f"{model.stat().st_size / caps:.2f}x the pooled memory caps; {w.tokens} greedy tokens after a "
          f"{ref['prompt_tokens']}-token prompt", file=sys.stderr, flush=True)
    entry: dict[str, Any] = {"title": w.title, "model": {"name": model.name, "gb": round(model.stat().st_size / 1e9, 3),
                                                         "arch": layout.arch, "n_layer": layout.n_layer,
                                                         "x_pooled_caps": round(model.stat().st_size / caps, 2)},
                             "devices": [d.__dict__ | {"cap_mib": round(d.cap_bytes / 2**20, 1)} for d in w.devices],
                             "tokens": w.tokens, "reference": ref, "rows": []}
    device_sets = [w.devices] + ([w.more_devices] if w.more_devices and not a.quick else [])
    for devices in device_sets:
        found: dict[str, str] = {}  # each ring system's own split, tried by the other: on these devices only
        searches: list[tuple[int, SystemRows]] = []
        for system in SYSTEMS:
            build = peers.build_info(system)
            if system == "exo" or system not in systems or (why := peers.missing(system)):
                reason = exo_reason(peers.exo) if system == "exo" else (
                    "not asked for (--systems)" if system not in systems else
                    why if why.startswith("failed: ") else f"unsupported: {why}")
                entry["rows"].append({"system": system, "placement": "own", "devices": len(devices),
                                      "status": "failed" if reason.startswith("failed: ") else "unsupported",
                                      "tpot_s": None, "ttft_s": None,
                                      "commit": build.get("commit", ""), "split": "", "error": reason})
                continue
            rows = SystemRows(system, peers, w, devices, layout, model, ref, build, a, meminfo,
                              logs / f"{len(devices)}dev" / system.replace(".", "_"), found)
            entry["rows"].append(rows.own())
            searches.append((len(entry["rows"]), rows))
        # every system's own placement first, then the searches: each ring system tries the other's own split
        searched = [(at, rows.search()) for at, rows in searches]
        for at, more in reversed(searched):  # each after its system's own row
            entry["rows"][at:at] = more
    entry["ratios"] = ratios(entry["rows"])
    for k, v in entry["ratios"].items():
        print(f"  {k}: {v}", file=sys.stderr)
    return entry


class SystemRows:
    """One system's rows on one device set: its own placement (a.runs runs), then the search: each candidate once,
    the fastest (if it beat the own placement's median) run until it has a.runs too. `found` collects each ring
    system's own split for the other's search."""

    def __init__(self, system: str, peers: Peers, w: Workload, devices: tuple[Device, ...], layout: Any,
                 model: Path, ref: dict[str, Any], build: dict[str, str], a: argparse.Namespace, meminfo: Path,
                 logs: Path, found: dict[str, str]) -> None:
        self.system, self.peers, self.w, self.devices, self.layout = system, peers, w, devices, layout
        self.model, self.ref, self.build, self.a, self.meminfo = model, ref, build, a, meminfo
        self.logs, self.found = logs, found
        self.threads = tuple(min(w.threads, max(1, int(d.cpus or w.threads))) for d in devices)
        self.unsupported = False

    def _job(self, p: Placement, i: int) -> Job:
        tag = "own" if p.split is None and not p.extra else re.sub(r"[^a-z0-9]+", "-", p.name.lower())[:48]
        return Job(self.w.name, self.model, "", self.layout.n_layer, PROMPT, self.w.tokens, self.threads,
                   split=p.split, logs=self.logs / f"{tag}-{i}", extra=dict(p.extra))

    def _once(self, p: Placement, i: int) -> dict[str, Any]:
        r = run_once(self.system, self.peers, self.w, self.devices, self._job(p, i), self.a.workdir, self.meminfo,
                     self.model)
        print(f"  {self.system:<18} {p.name:<46} {r['status']:<11} TTFT {_s(r['ttft_s'])}  TPOT {_s(r['tpot_s'])}  "
              f"{r['split'][:60]} {r['error'][:160]}", file=sys.stderr, flush=True)
        return r

    def own(self) -> dict[str, Any]:
        own = Placement("own")
        runs = [self._once(own, 0)]
        if runs[0]["status"] != "unsupported":  # a refusal is the same every time: once is enough
            runs += [self._once(own, i) for i in range(1, self.a.runs)]
        row = median_row(self.system, own, runs, self.ref, self.build, self.devices)
        if self.system in ("primaplug", "prima.cpp") and (s := split_of(runs[0], self.devices)):
            self.found[self.system] = s
        # a system that cannot run the workload at all is not searched; distributed-llama's refusals depend on how
        # many nodes it runs on, which its search varies
        self.unsupported = row["status"] == "unsupported" and self.system != "distributed-llama"
        return row

    def search(self) -> list[dict[str, Any]]:
        if self.a.no_search or self.unsupported:
            return []
        n_layer = self.layout.n_layer
        layer_mib = sum(self.layout.layer_bytes(il) for il in range(n_layer)) / n_layer / 2**20
        tried = [(p, self._once(p, 0)) for p in candidates(self.system, self.devices, n_layer, layer_mib, self.found)]
        if not tried:
            return []
        ok = [(p, r) for p, r in tried if r["status"] == "ok"]
        best, first = min(ok, key=lambda pr: pr[1]["tpot_s"]) if ok else tried[0]
        runs = [first] + ([self._once(best, i) for i in range(1, self.a.runs)] if ok else [])
        return [median_row(self.system, best, runs, self.ref, self.build, self.devices)
                | {"placement": f"searched ({len(tried)} candidates): {best.name}",
                   "candidates": {p.name: (r["tpot_s"], r["status"]) for p, r in tried}}]


def _s(x: float | None) -> str:
    return f"{x:7.3f} s" if x is not None else "      -  "


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """primaplug's best row against the fastest peer's, for TPOT and TTFT; its largest memory pressure against the
    lowest peer's (rows that ran, on the workload's first device set)."""
    first_set = min((r["devices"] for r in rows), default=0)
    ran = [r for r in rows if r["status"] == "ok" and r["tpot_s"] is not None and r["devices"] == first_set]
    ours = [r for r in ran if r["system"] == "primaplug"]
    theirs = [r for r in ran if r["system"] != "primaplug"]
    if not ours or not theirs:
        return {"note": "no peer ran this workload: nothing to compare" if ours else "primaplug did not run"}
    best = min(ours, key=lambda r: r["tpot_s"])
    fastest = min(theirs, key=lambda r: r["tpot_s"])
    first = min(theirs, key=lambda r: r["ttft_s"])
    calm = min(theirs, key=lambda r: r["max_pressure"])
    return {"tpot_vs_fastest_peer": round(best["tpot_s"] / fastest["tpot_s"], 3),
            "fastest_peer": f"{fastest['system']} ({fastest['placement']})",
            "ttft_vs_fastest_peer": round(best["ttft_s"] / first["ttft_s"], 3),
            "fastest_peer_ttft": f"{first['system']} ({first['placement']})",
            "pressure_points_over_lowest_peer": round(100 * (best["max_pressure"] - calm["max_pressure"]), 2),
            "lowest_pressure_peer": f"{calm['system']} ({calm['placement']})",
            "tokens_match_plain": best["tokens_match_plain"]}


def table(results: dict[str, Any]) -> str:
    """Each workload's best row of every system (by TPOT; its own placement's where it is also the best), and
    primaplug's ratios: the table docs/peers.md and the README quote."""
    lines = ["| workload | system | status | TPOT s | TTFT s | largest pressure | tokens = plain | split |",
             "|---|---|---|---|---|---|---|---|"]
    for name in sorted(k for k in results if k.startswith("W")):
        rows = results[name]["rows"]
        first_set = min(r["devices"] for r in rows)
        for system in SYSTEMS:
            mine = [r for r in rows if r["system"] == system and r["devices"] == first_set]
            ran = [r for r in mine if r["status"] == "ok" and r["tpot_s"] is not None]
            r = min(ran, key=lambda r: r["tpot_s"]) if ran else (mine[0] if mine else None)
            if r is None:
                continue
            why = r["error"].removeprefix(f"{r['status']}: ").split(" (")[0][:90] if r["status"] != "ok" else ""
            match = {True: "yes", False: "no", None: "-"}[r.get("tokens_match_plain")]
            ran_ok = r["status"] == "ok" and r.get("max_pressure") is not None
            pressure = f"{100 * r['max_pressure']:.1f}%" if ran_ok else "-"
            lines.append(f"| {name} | {system} | {r['status']}{': ' + why if why else ''} | {_f(r['tpot_s'])} | "
                         f"{_f(r['ttft_s'])} | {pressure} | {match} | {r['placement']}: {r.get('split') or '-'} |")
    out = ["\n".join(lines), ""]
    for name in sorted(k for k in results if k.startswith("W")):
        out.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in results[name]["ratios"].items()))
    return "\n".join(out)


def _f(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "-"


def write(results: dict[str, Any], name: str, chart: bool = False,
          scrub: Callable[[str], str] = lambda text: text) -> None:
    RESULTS.mkdir(exist_ok=True)
    ordered = {"about": results["about"]} | {k: results[k] for k in sorted(results) if k != "about"}
    (RESULTS / f"{name}.json").write_text(scrub(json.dumps(ordered, indent=1)) + "\n")
    if chart:
        draw(results, RESULTS / f"{name}.png")
        print(f"wrote {RESULTS / name}.json and {name}.png", file=sys.stderr)


def draw(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in results if k.startswith("W")]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), squeeze=False)
    colors = dict(zip(SYSTEMS, ("#2a7", "#37c", "#c83", "#a4a", "#888"), strict=True))
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in results[name]["rows"] if r["devices"] == results[name]["rows"][0]["devices"]]
        for x, system in enumerate(SYSTEMS):
            ran = [r for r in rows if r["system"] == system and r["status"] == "ok" and r["tpot_s"]]
            if ran:
                best = min(ran, key=lambda r: r["tpot_s"])
                ax.bar(x, best["tpot_s"], color=colors[system])
                ax.text(x, best["tpot_s"], f"{best['tpot_s']:.2f}", ha="center", va="bottom", fontsize=8)
            else:
                status = next((r["status"] for r in rows if r["system"] == system), "-")
                ax.text(x, 0, status, ha="center", va="bottom", rotation=90, fontsize=8, color=colors[system])
        ax.set_xticks(range(len(SYSTEMS)), SYSTEMS, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{name}: TPOT (s), best row", fontsize=9)
    fig.suptitle("primaplug and its peers on the same emulated devices (lower is faster)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
