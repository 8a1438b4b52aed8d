"""primaplug on the emulated devices, as a user deploys it: a `primaplug node` daemon on every device but the first,
and the head on the first device, in its cgroup with its own model copy, a process of its own (primaplug_head.py),
running that device's windows itself as prima.cpp's rank 0 does.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from benchmarks.peer_systems.base import Job, Outcome, last_lines, watch_first_output
from benchmarks.peer_systems.primaplug_head import NODE_TIMEOUT_S, RESULT
from benchmarks.peer_systems.rig import Rig

NAME = "primaplug"


def run(rig: Rig, job: Job, on_first_token: Any, *, scale: float = 1.0) -> Outcome:
    from primaplug.head.launch import LocalNodes

    used = job.extra.get("devices", list(range(len(rig.devices))))  # the head on used[0], nodes on the rest
    if len({job.threads[i] for i in used}) != 1:
        raise ValueError(f"primaplug's nodes take one thread count: got {job.threads}")

    def node_setup(i: int):  # noqa: ANN202
        enter = rig.preexec(i)
        cache = str(rig.folder(i) / "cache")

        def setup() -> None:
            enter()
            os.environ["PRIMAPLUG_CACHE"] = cache  # its repacked copy on its own disk, as its model copy is

        return setup

    nodes = LocalNodes([rig.copy(i, job.model) for i in used[1:]], len(used) - 1, log_dir=job.logs,
                       preexec=[node_setup(i) for i in used[1:]], names=[rig.devices[i].name for i in used[1:]],
                       start_timeout_s=120)
    try:
        nodes.start()
        for i, node in zip(used[1:], nodes.nodes, strict=True):
            rig.watch(node.proc, i)
        assert rig.proxy is not None
        links = ",".join(f"{rig.devices[i].link_latency_ms}:{rig.devices[i].link_mbit}:{rig.devices[i].name}"
                         for i in used)
        argv = [sys.executable, "-m", "benchmarks.peer_systems.primaplug_head", "--model", str(rig.copy(0, job.model)),
                "--nodes", ",".join(nodes.addresses), "--proxy", rig.proxy.control, "--links", links,
                "--prompt", job.prompt, "--tokens", str(job.tokens), "--threads", str(job.threads[0]),
                "--n-ctx", str(job.n_ctx), "--n-batch", str(job.n_batch), "--scale", str(scale)]
        if job.split is not None:
            argv += ["--split", ",".join(str(job.split[i]) for i in used)]
        head = rig.spawn(0, argv, job.logs / f"head-{rig.devices[0].name}.log",
                         env={"PRIMAPLUG_CACHE": str(rig.folder(0) / "cache"), "PYTHONPATH": os.getcwd()},
                         name="primaplug head")
        stop = threading.Event()
        watch_first_output(head, lambda out: len(out) > 0, on_first_token, stop)
        code, dead = _wait_head(head, nodes, job.timeout_s)
        stop.set()
        if dead:
            return Outcome("failed", error=f"{dead} while the head waited on it (stopped here: the head would wait "
                                           f"its {NODE_TIMEOUT_S} s for the node's answer): {last_lines(head.text())}")
        lines = [ln for ln in bytes(head.err).decode(errors="replace").splitlines() if ln.startswith(RESULT)]
        if code is None:
            return Outcome("failed", error=f"the head did not finish within {job.timeout_s:.0f} s: "
                                           f"{last_lines(head.text())}")
        if code != 0 or not lines:
            exits = " ".join(nodes.exits(2))
            return Outcome("failed", error=f"the head exited with status {code}: {last_lines(head.text())} {exits}")
        r = json.loads(lines[-1].removeprefix(RESULT))
        windows = {d.name: 0 for d in rig.devices} | {rig.devices[0].name if k == "head" else k: w
                                                     for k, w in r["windows"].items()}
        return Outcome(ttft_s=r["ttft_s"], tpot_s=r["tpot_s"], token_ids=r["tokens"], text=head.stdout,
                       split=r["split"], detail={"plan": r["plan"], "token_s": r["token_s"], "windows": windows})
    finally:
        nodes.stop()


def _wait_head(head: Any, nodes: Any, timeout_s: float) -> tuple[int | None, str]:
    """The head's exit status (None past timeout_s), or, where a node died first (an OOM kill, say), what ended it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = head.wait(1.0)
        if code is not None:
            return code, ""
        for node in nodes.nodes:
            if node.proc.poll() is not None:
                head.stop()
                return head.proc.returncode, f"node {node.name} exited with status {node.proc.returncode}"
    return None, ""
