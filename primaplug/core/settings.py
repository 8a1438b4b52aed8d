"""The settings a run shares, and their defaults, defined once.

`primaplug.Llama`, the `run`, `plan` and `serve` commands and the node daemon all take their defaults from here:
the CLI builds its flags' defaults from `RunSettings()`, and `primaplug.Llama` fills the llama_cpp.Llama arguments a
caller leaves out from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# How long a silent node may take before the head (or a node's send to its successor) gives up on it. A node is
# probed on its control channel after PROBE_AFTER_S of ring silence, so a slow but alive node is not cut off.
TIMEOUT_S = 5.0
PROBE_AFTER_S = 0.5
# The largest message a socket takes; a peer that sends more is disconnected before it is held in memory. A ring
# frame is at most n_batch x n_embd floats (2048 rows of a 70B model's 8192: 64 MiB); control messages are small.
MAX_RING_MESSAGE_BYTES = 128 * 2**20
MAX_CONTROL_MESSAGE_BYTES = 16 * 2**20
LOAD_TIMEOUT_S = 600.0  # a node loading (or profiling) its windows from a slow disk
# A node that hears nothing from any head (no control request, no ring message) for this long frees its windows and
# goes idle: its head has gone. A running head asks each node for its status at least every second.
HEAD_SILENCE_S = 300.0
# While a head runs, it asks every node of its ring for a status this often (its heartbeat): a node that restarted,
# went silent or came back is noticed between requests, and a node knows its head is still there.
HEARTBEAT_S = 1.0
# A node belongs to the head that deployed it while that head keeps speaking (node/owner.py): another head is refused
# until the holder closes (it lets its nodes go) or has been silent this long (ten heartbeats: it died, or its network
# went away). A head refused by a holder already silent for HELD_WAIT_AFTER_S waits out the rest of the lease.
HEAD_LEASE_S = 10.0
HELD_WAIT_AFTER_S = 3.0
# A node asked to stop (SIGTERM, SIGINT, Shutdown) frees its windows and exits; whatever it is doing (a load, a
# window's compute, a send to a successor that is gone), the process ends within this many seconds.
STOP_DEADLINE_S = 10
DEFAULT_PORT = 7000  # a node's control port; its ring listens on the next one
# `primaplug node --wake-lock` (node/wakelock.py; docs/platforms.md): hold Termux's wake lock while the node runs.
# auto: under Termux only, going on without it when it cannot be had; on: required; off: never.
WAKE_LOCK_MODES = ("auto", "on", "off")
DEFAULT_WAKE_LOCK = "auto"
# Discovery (`node --advertise`, `--nodes auto`; docs/discovery.md). mDNS answers come within a fraction of a
# second; DISCOVER_S leaves room for a busy Wi-Fi. A node found proves it holds the cluster key by answering a Hello
# over CurveZMQ within PROVE_TIMEOUT_S (one with another key never answers); one that failed is asked again after
# PROVE_RETRY_S. An announcement outlives a node killed without saying goodbye by at most ADVERTISE_TTL_S.
DISCOVER_S = 3.0
PROVE_TIMEOUT_S = 2.0
PROVE_RETRY_S = 30.0
ADVERTISE_TTL_S = 120

# At most two drafted tokens a trip by default (llama.cpp's --draft-max is 16). Up to 14 keep greedy output the
# tokens plain llama.cpp gives without a draft (a trip of at most 15 rows goes through the one-row kernels, patch
# 0010); 2 is the default because longer drafts were slower on the emulated cluster (docs/speculative.md).
DRAFT_MAX, DRAFT_MIN = 2, 0  # --draft-max, --draft-min

# The most rows one trip round the ring carries when it mixes several requests' steps (continuous batching).
# Below 16 rows llama.cpp multiplies every row with the kernel it uses for a lone row (patch 0010), and each
# sequence attends over a cache of its own (llama.cpp's per-sequence KV streams), so every request gets the tokens it
# gets alone, whatever else is in flight; a larger step (a prompt) travels alone.
EXACT_BATCH_ROWS = 15
MAX_PARALLEL = 256  # sequences a llama.cpp context may hold (LLAMA_MAX_SEQ)


@dataclass(frozen=True)
class RunSettings:
    """What the head runs with. Context and batch sizes follow llama.cpp's own tools (`llama-cli`: 4096 tokens of
    context, batches of 512); `n_ctx` 0 means the model's training context, as in llama_cpp.Llama.

    A default of 4096, not llama_cpp.Llama's 512: a split model exists for long conversations, and a node's KV
    cache takes memory only as tokens fill it (patch 0007), so a large default costs nothing until it is used.
    """

    n_ctx: int = 4096  # positions each sequence may hold
    # sequences every window's KV cache holds: requests in flight at once (llama.cpp's --parallel); each takes
    # n_ctx positions of cache, counted in every device's memory plan
    n_parallel: int = 1
    # trips in the ring at once when several requests are in flight; 0: one per device of the ring, so that every
    # device can work on another request's step at the same moment (pipeline parallelism), or one when a device
    # streams its windows (one streamed window then serves every request waiting at it)
    ring_trips: int = 0
    n_batch: int = 512  # tokens per batch sent round the ring
    n_ubatch: int = 512  # tokens per compute step inside llama.cpp
    n_threads: int = 0  # the head's compute threads; 0: head_threads() decides
    node_threads: int = 0  # each node's compute threads; 0: all its cores
    timeout_s: float = TIMEOUT_S
    listen: str = "127.0.0.1"  # where the head receives the ring's output


def allowed_cpus() -> list[int] | None:
    """The cores this thread may run on (its affinity mask, which containers and taskset narrow), or None where the
    OS does not say (macOS)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def usable_cores() -> int:
    """How many cores this process may run on (allowed_cpus), where os.cpu_count() counts the machine's. One compute
    thread per core means one per these: more would spin at ggml's barriers while another waits for a core."""
    cpus = allowed_cpus()
    return len(cpus) if cpus else os.cpu_count() or 1


def head_threads(n_threads: int, has_nodes: bool) -> int:
    """The head's compute threads. Alone, it uses every core; beside nodes it leaves half the cores to them (on one
    machine they share the cores; on several, the head also samples and runs the output layer between rounds)."""
    if n_threads > 0:
        return n_threads
    cores = usable_cores()
    return max(1, cores // 2) if has_nodes else cores


def cache_root() -> Path:
    """Where primaplug keeps what it writes once and reuses (device profiles, repacked copies of models):
    $PRIMAPLUG_CACHE, else $XDG_CACHE_HOME/primaplug, else ~/.cache/primaplug. The engine build keeps its sdist,
    wheels and logs there too, by the same rule written again in engine/build.py (cache_location), which must run
    before anything is installed; tests/test_build_engine.py holds the two equal."""
    base = os.environ.get("PRIMAPLUG_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "primaplug"


def config_root() -> Path:
    """Where primaplug keeps what a user chose (the dashboard's last cluster): $PRIMAPLUG_CONFIG, else
    $XDG_CONFIG_HOME/primaplug, else ~/.config/primaplug."""
    base = os.environ.get("PRIMAPLUG_CONFIG")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "primaplug"
