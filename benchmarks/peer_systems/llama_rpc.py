"""llama.cpp's RPC backend, what llama.cpp users reach for: `ggml-rpc-server` on every device but the first, and the
client (`llama-completion`) on the first with `--rpc`. Layers offloaded with `-ngl` go to the RPC servers, split by
`--tensor-split`; the rest stay on the client's CPU, mapped from its file. A server holds its layers in memory (it
does not map a file), so a share larger than a device's memory is killed there.

Built here, once, from the vendored llama.cpp of the pinned llama-cpp-python sdist (the engine's own source, before
primaplug's patches), with `GGML_RPC=ON`: plain upstream code, llama.cpp's default flags otherwise, except where
primaplug's engine leaves out ggml's AMX kernels (a VM that advertises AMX: primaplug/engine/build.py, NO_AMX_FLAGS),
which they kill here as they kill plain llama-cpp-python.

Its own placement: llama.cpp splits by each device's free memory, which for a CPU device is its total memory
(ggml-cpu's `get_memory` reads `sysconf`, which no cgroup changes). On real devices that is each device's RAM, so
the emulated devices' split is given as `--tensor-split` in proportion to their memory caps; the client's own share
stays on its CPU.
"""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

from benchmarks.peer_systems import builds
from benchmarks.peer_systems.base import (
    Job,
    Outcome,
    last_lines,
    llama_perf,
    ratio_split,
    stdout_tpot,
    watch_first_output,
)
from benchmarks.peer_systems.rig import Rig, free_port_block, wait_listening

NAME = "llama.cpp-rpc"
FLAGS = ["-DGGML_RPC=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release",
         "-DBUILD_SHARED_LIBS=OFF"]  # static: the cached programs need no library beside them
TARGETS = ["ggml-rpc-server", "llama-completion"]


def flags() -> list[str]:
    """FLAGS, and the engine's AMX exception where it applies."""
    from primaplug.engine import build as engine

    return FLAGS + (engine.NO_AMX_FLAGS if engine.amx_under_hypervisor() else [])


def build(cache: Path, log: Path) -> Path:
    """The RPC server and client, built once per sdist and flags (cached under `cache`); returns their bin folder."""
    from primaplug.engine import build as engine

    sdist = engine.fetch_sdist(sys.executable, sys.stderr)

    def lay_out(tree: Path) -> None:  # the sdist's vendored llama.cpp, as it is before primaplug's patches
        shutil.move(engine.unpack_source(sdist, tree.parent) / "vendor" / "llama.cpp", tree)

    source = builds.Source(f"{sdist.name} (sha256 {engine.SDIST_SHA256[:12]})", engine.VERSION, engine.SDIST_SHA256,
                           lay_out)
    commands = [["cmake", "-S", ".", "-B", "build", *flags()], ["cmake", "--build", "build", "--target", *TARGETS]]
    return builds.cached(NAME, source, commands, {f"build/bin/{t}": f"bin/{t}" for t in TARGETS}, cache, log) / "bin"


def build_info(bin_dir: Path) -> dict[str, str]:
    from primaplug.engine import build as engine

    return {"commit": f"llama.cpp vendored in llama-cpp-python {engine.VERSION} (sdist sha256 "
                      f"{engine.SDIST_SHA256[:12]})", "flags": " ".join(flags()), "binary": " ".join(TARGETS)}


def memory_split(rig: Rig, n_layer: int) -> tuple[int, ...]:
    """Its default: layers in proportion to each device's memory (the client's share stays on its CPU)."""
    return tuple(ratio_split([d.memory_mib for d in rig.devices], n_layer, minimum=0))


def run(bin_dir: Path, rig: Rig, job: Job, on_first_token: callable) -> Outcome:  # type: ignore[valid-type]
    n = len(rig.devices)
    split = job.split or memory_split(rig, job.n_layer)
    if sum(split) != job.n_layer:
        raise ValueError(f"llama.cpp's RPC split is one window per device: {split} must add up to {job.n_layer}")
    port = free_port_block(n)
    servers = []
    endpoints = []
    for i in range(1, n):
        cache = rig.folder(i) / "rpc-cache"  # -c: a server keeps tensors on its own disk, as it keeps nothing else
        servers.append(rig.spawn(i, [str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port + i),
                                     "-t", str(job.threads[i]), "-c"],
                                 job.logs / f"rpc-server-{rig.devices[i].name}.log",
                                 env={"LLAMA_CACHE": str(cache)}, name=f"rpc server {rig.devices[i].name}"))
        endpoints.append(rig.link(0, f"tcp://127.0.0.1:{port + i}", to=i).removeprefix("tcp://"))
    for i, s in enumerate(servers, start=1):
        if not wait_listening(s, port + i, 30):
            return Outcome("failed", error=f"{s.name} did not start: {last_lines(s.text())}")
    remote = split[1:]
    argv = [str(bin_dir / "llama-completion"), "-m", str(rig.copy(0, job.model)), "-t", str(job.threads[0]),
            "-c", str(job.n_ctx), "-b", str(job.n_batch), "-n", str(job.tokens), "--temp", "0", "--seed", "0",
            "--ignore-eos", "--no-display-prompt", "-no-cnv", "-p", job.prompt]
    if sum(remote):
        argv += ["--rpc", ",".join(endpoints), "-ngl", str(sum(remote)), "--tensor-split", ",".join(map(str, remote))]
    if job.extra.get("no_repack"):
        argv.append("--no-repack")
    client = rig.spawn(0, argv, job.logs / f"client-{rig.devices[0].name}.log", name="llama-completion")
    stop = threading.Event()
    watch_first_output(client, lambda out: len(out.strip()) > 0, on_first_token, stop)
    code = client.wait(job.timeout_s)
    stop.set()
    words = " ".join(f"{d.name} {w}" for d, w in zip(rig.devices, split, strict=True))
    if code is None:
        return Outcome("failed", split=words, error=f"the client did not finish within {job.timeout_s:.0f} s")
    perf = llama_perf(client.text())
    if code != 0 or perf is None:
        dead = [s.name for s in servers if s.proc.poll() is not None]
        why = f"; {', '.join(dead)} died" if dead else ""
        return Outcome("failed", split=words,
                       error=f"llama-completion exited with status {code}{why}: {last_lines(client.text())}")
    ttft, own_tpot, runs = perf
    tpot = stdout_tpot(client, job.tokens)
    return Outcome(ttft_s=ttft, tpot_s=tpot, text=client.stdout, split=words,
                   detail={"own_tpot_s": own_tpot, "decode_steps": runs})
