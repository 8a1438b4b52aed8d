"""prima.cpp (Lizonghang/prima.cpp), the system of the paper primaplug builds on: one `llama-cli` per device, rank 0
the head, joined in a ring over ZeroMQ, its own scheduler (Halda over HiGHS) on rank 0, `--prefetch` on every rank.

Built from a checkout given by path, by its README: `make USE_HIGHS=1 llama-cli`, with HiGHS where its Makefile looks
(/usr/local, where its README installs it) or, given a HiGHS checkout, built from that first and named to make
(peer_systems/builds.py keeps both builds).

Ports: a rank binds `--data-port + rank` and `--signal-port + rank`, sends to `--next`:(its own data port + the next
rank) and to `--master`:(its own data port + 0). Each rank gets data ports 100 apart, and a link proxy listens on
every port a rank sends to and forwards to the port its receiver bound: rank r's messages to rank t travel over
r's link, on one loopback address, as between devices on Wi-Fi.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from benchmarks.peer_systems import builds
from benchmarks.peer_systems.base import (
    Job,
    Outcome,
    last_lines,
    linked_libraries,
    llama_perf,
    stdout_tpot,
    watch_first_output,
)
from benchmarks.peer_systems.rig import Rig, free_port_block

NAME = "prima.cpp"
WINDOW = re.compile(r"Using window size: (\d+), GPU layers: (\d+)")
UNSUPPORTED = re.compile(r"unknown model architecture: '([^']+)'")


README_PREFIX = Path("/usr/local")  # where prima.cpp's Makefile looks for HiGHS (HIGHS_CPPFLAGS, HIGHS_LDFLAGS)
MAKE = ["make", "USE_HIGHS=1", "llama-cli"]
HIGHS = [["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_INSTALL_LIBDIR=lib",
          "-DBUILD_TESTING=OFF", "-DBUILD_EXAMPLES=OFF"],
         ["cmake", "--build", "build"],
         ["cmake", "--install", "build", "--prefix", builds.OUT]]


def binary(bin_dir: Path) -> Path:
    return bin_dir / "llama-cli"


def highs_installed(prefix: Path | None = None) -> bool:
    prefix = prefix or README_PREFIX
    return (prefix / "include" / "highs" / "Highs.h").exists() and any((prefix / "lib").glob("libhighs.so*"))


def build(src: Path, highs: Path | None, cache: Path, logs: Path) -> Path:
    """llama-cli built from the checkout `src` (cached); returns the folder that holds it. Its scheduler needs HiGHS:
    the one its README installs under /usr/local, else one built here from the HiGHS checkout `highs`."""
    command, notes = MAKE, {"highs": f"installed under {README_PREFIX}"}
    if highs is not None or not highs_installed():
        if highs is None:
            raise builds.BuildError(f"prima.cpp's scheduler needs HiGHS, which is not under {README_PREFIX}: give "
                                    "--highs DIR (a clone of ERGO-Code/HiGHS, built here once), or install it by "
                                    "prima.cpp's README")
        prefix = builds.cached("HiGHS", builds.checkout(highs), HIGHS, {}, cache, logs / "highs-build.log",
                               expect=("include/highs/Highs.h", "lib/libhighs.so"))
        command = [*MAKE, f"HIGHS_CPPFLAGS=-isystem {prefix}/include/highs",
                   f"HIGHS_LDFLAGS=-L{prefix}/lib -lhighs -Wl,-rpath,{prefix}/lib"]
        notes = {"highs": f"built from ERGO-Code/HiGHS {builds.recorded(prefix)['commit']}: "
                          + " ; ".join(" ".join(c) for c in HIGHS)}
    return builds.cached(NAME, builds.checkout(src), [command], {"llama-cli": "llama-cli"}, cache,
                         logs / "prima.cpp-build.log", notes=notes)


def build_info(bin_dir: Path) -> dict[str, str]:
    highs = any("highs" in lib for lib in linked_libraries(binary(bin_dir)))
    return builds.summary(bin_dir) | {"binary": "llama-cli", "scheduler": f"HiGHS (USE_HIGHS), "
                                      f"{builds.recorded(bin_dir)['highs']}" if highs else "none (no HiGHS)"}


def run(bin_dir: Path, rig: Rig, job: Job, on_first_token: callable) -> Outcome:  # type: ignore[valid-type]
    used = job.extra.get("devices", list(range(len(rig.devices))))  # rank r on device used[r]; 0 the head's
    n = len(used)
    data, signal = free_port_block(100 * n), free_port_block(100 * n, start=41000)
    data_port = [data + 100 * r for r in range(n)]
    signal_port = [signal + 100 * r for r in range(n)]
    for r in range(n):  # rank r's sends to rank t go over r's link
        for t in range(n):
            if t != r:
                rig.link(used[r], f"tcp://127.0.0.1:{data_port[t] + t}", listen_port=data_port[r] + t)
                rig.link(used[r], f"tcp://127.0.0.1:{signal_port[t] + t}", listen_port=signal_port[r] + t)
    procs = []
    for r, i in enumerate(used):
        argv = [str(binary(bin_dir)), "-m", str(rig.copy(i, job.model)), "-t", str(job.threads[i]), "--world", str(n),
                "--rank", str(r), "--master", "127.0.0.1", "--next", "127.0.0.1", "--data-port", str(data_port[r]),
                "--signal-port", str(signal_port[r]), "--prefetch"]
        if r == 0:
            argv += ["-c", str(job.n_ctx), "-b", str(job.n_batch), "-n", str(job.tokens), "--temp", "0",
                     "--seed", "0", "--ignore-eos", "--no-display-prompt", "-p", job.prompt]
            if job.split is not None:
                argv += ["-lw", ",".join(str(job.split[j]) for j in used)]
        procs.append(rig.spawn(i, argv, job.logs / f"rank{r}-{rig.devices[i].name}.log", name=f"rank {r}"))
    stop = threading.Event()
    head = procs[0]
    watch_first_output(head, lambda out: len(out.strip()) > 0, on_first_token, stop)
    code = head.wait(job.timeout_s)
    stop.set()
    time.sleep(0.5)
    windows = {d.name: 0 for d in rig.devices} | {
        rig.devices[i].name: (int(m.group(1)) if (m := WINDOW.search(p.text())) else 0)
        for i, p in zip(used, procs, strict=True)}
    split = " ".join(f"{k} {w}" for k, w in windows.items())
    total = sum(windows.values())
    if total:
        split += f" (k = {job.n_layer // total})" if job.n_layer % total == 0 else f" ({total} layers a round)"
    if code is None:
        return Outcome("failed", split=split, error=f"rank 0 did not finish within {job.timeout_s:.0f} s: "
                                                    f"{last_lines(head.text())}")
    perf = llama_perf(head.text())
    if code != 0 or perf is None:
        texts = "\n".join(p.text() for p in procs)
        if m := UNSUPPORTED.search(texts):
            return Outcome("unsupported", error=m.group(0))
        return Outcome("failed", split=split, error=f"rank 0 exited with status {code}: {last_lines(head.text())}")
    ttft, own_tpot, runs = perf
    tpot = stdout_tpot(head, job.tokens)
    return Outcome(ttft_s=ttft, tpot_s=tpot, text=head.stdout, split=split,
                   detail={"own_tpot_s": own_tpot, "decode_steps": runs, "windows": windows})
