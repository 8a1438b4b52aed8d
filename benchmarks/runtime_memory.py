#!/usr/bin/env python3
"""The memory primaplug's own processes take beside the weights: an idle `primaplug node`, one that holds windows,
and a head's imports, as anonymous memory (RssAnon: what a device's owner loses to them; mapped weights are page
cache, so a node holding windows adds its KV cache, compute buffers and what llama.cpp keeps of the model).

    .venv/bin/python benchmarks/runtime_memory.py [--model PATH] [--runs 3] [--baseline DIR]

On small devices this is most of primaplug's memory pressure (docs/peers.md: on the peers' devices, scaled down 24
times, 30 MiB is 20 points of the phone's 145 MiB). Each figure is the median of --runs fresh processes, beside the
bare interpreter's. --baseline DIR measures another checkout of primaplug (a worktree of an earlier commit) in the
same run, with the same interpreter and environment, so that a change is a difference measured side by side.
Writes benchmarks/results/runtime_memory.json. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "runtime_memory.json"
MIB = 2**20
READY_S = 60.0

HEAD = "import primaplug\nfrom primaplug.head.llama import Llama\n"
PROBE = ("\nwith open('/proc/self/status') as f:\n"
         "    print(next(int(x.split()[1]) for x in f if x.startswith('RssAnon')))")


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon"))


def _env(checkout: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if checkout is not None:  # ahead of the installed (editable) primaplug; run from it too (python -m and -c put
        # the working directory first on sys.path)
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    return env


def script(code: str, checkout: Path | None = None) -> int:
    """RssAnon of a fresh interpreter that has run `code`."""
    out = subprocess.run([sys.executable, "-c", code + PROBE], env=_env(checkout), cwd=checkout, capture_output=True,
                         text=True, check=True)
    return int(out.stdout.split()[-1]) * 1024


# a head that deploys the first half of the model's layers on the node, computes a prompt, and holds the ring until
# its stdin closes
LOADED_HEAD = """import sys
import primaplug
from primaplug.engine import read_layout
n = read_layout(sys.argv[1]).n_layer
llm = primaplug.Llama(sys.argv[1], nodes=[sys.argv[2]], layers=[n // 2, n - n // 2], n_ctx=256, verbose=False)
llm.eval(llm.tokenize(b"Pipelined-ring parallelism splits a model into windows of layers."))
print("loaded", flush=True)
sys.stdin.read()
llm.close()
"""


def node(model: Path, checkout: Path | None = None, *, profiled: bool = False, loaded: bool = False) -> int:
    """RssAnon of `primaplug node` once it says it is ready; or once a head has had it profile its device (`primaplug
    plan --reprofile`: the compute, memory and disk tests a head asks of every node), then stopped; or while it holds
    the first half of the model's layers for a head (LOADED_HEAD), after a prompt."""
    proc = subprocess.Popen([sys.executable, "-m", "primaplug", "node", "-m", str(model), "--listen", "127.0.0.1:0",
                             "--name", "probe"], env=_env(checkout), cwd=checkout, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        control = None
        deadline = time.monotonic() + READY_S
        for line in proc.stdout:
            if "ready" in line:
                control = line.split("control tcp://")[1].split()[0]
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the node did not say it was ready within {READY_S:.0f} s")
        if control is None:
            raise SystemExit(f"the node exited ({proc.wait()}) before it was ready")
        if profiled:
            subprocess.run([sys.executable, "-m", "primaplug", "plan", "-m", str(model), "--nodes", control,
                            "--reprofile"], env=_env(checkout), cwd=checkout, capture_output=True, check=True)
        if loaded:
            with subprocess.Popen([sys.executable, "-c", LOADED_HEAD, str(model), control], env=_env(checkout),
                                  cwd=checkout, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True) as head:
                assert head.stdout is not None and head.stdin is not None
                if head.stdout.readline().strip() != "loaded":
                    raise SystemExit(f"the head that loads the node's windows exited ({head.wait()})")
                time.sleep(1.0)
                held = _rss_anon(proc.pid)
                head.stdin.close()
            return held
        time.sleep(1.0)
        return _rss_anon(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure(model: Path, runs: int, checkout: Path | None) -> dict[str, float]:
    def median_mib(f) -> float:  # type: ignore[no-untyped-def]
        return round(statistics.median(f() for _ in range(runs)) / MIB, 2)

    return {"interpreter": median_mib(lambda: script("pass", checkout)),
            "idle node": median_mib(lambda: node(model, checkout)),
            "node after a profile": median_mib(lambda: node(model, checkout, profiled=True)),
            "node holding half the layers, after a prompt": median_mib(lambda: node(model, checkout, loaded=True)),
            "head imported (primaplug.head.llama.Llama)": median_mib(lambda: script(HEAD, checkout))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file the node may load (default: the bundled Gemma 3 270M)")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per figure (median; default 3)")
    ap.add_argument("--baseline", type=Path, help="another checkout of primaplug to measure in the same run")
    args = ap.parse_args()
    if not os.path.exists("/proc/self/status"):
        raise SystemExit("runtime_memory.py reads RssAnon from /proc: Linux only")
    from primaplug.cli.common import default_model

    model = Path(args.model) if args.model else default_model()
    result: dict[str, object] = {"machine": platform.machine(), "python": platform.python_version(),
                                 "runs": args.runs, "mib": measure(model, args.runs, None)}
    if args.baseline:
        base = measure(model, args.runs, args.baseline.resolve())
        result["baseline"] = {"checkout": args.baseline.name, "mib": base}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    for name, mib in result["mib"].items():  # type: ignore[union-attr]
        line = f"{name:45s} {mib:6.2f} MiB"
        if args.baseline:
            line += f"   baseline {base[name]:6.2f} MiB ({mib - base[name]:+.2f})"
        print(line)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
