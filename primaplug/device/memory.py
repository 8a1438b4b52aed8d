"""A device's memory plan for its windows: how much their weights may use, and whether they stay resident or
stream. One rule for nodes and the head."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from primaplug.core.budget import EXPERT_WORKING_LAYERS, MARGIN, READ_AHEAD_SLACK
from primaplug.core.errors import WindowRangeError
from primaplug.core.windows import LayerRange
from primaplug.engine import ModelLayout
from primaplug.memory.policy import PrefetchPlan, plan_prefetch
from primaplug.memory.prefetcher import Switches
from primaplug.memory.system import MemoryView, memory_view
from primaplug.profiler.model import compute_buffer_layers_bytes


@dataclass(frozen=True)
class MemorySettings:
    budget_bytes: int | None = None  # for the windows' weights; None: what the OS says is available, less the rest
    switches: Switches = Switches()


@dataclass(frozen=True)
class ExpertPlan:
    """A streaming mixture of experts: its routed experts are read as tokens choose them (memory/experts.py),
    and kept, the most used first, within budget_bytes; the prefetch plan covers the rest of each layer."""

    budget_bytes: int  # for the hot set
    total_bytes: int  # the device's whole budget for weights, the rest of the layers' included
    slices: dict[int, tuple[tuple[int, int], ...]]  # per layer: ModelLayout.expert_slices
    n_expert: int
    n_used: int


@dataclass(frozen=True)
class MemoryPlan:
    prefetch: PrefetchPlan  # whole windows, or layers when per_layer; without the routed experts when experts
    per_layer: bool  # a streaming device going layer by layer (--layer-streaming, or where whole windows fault in)
    experts: ExpertPlan | None = None

    def describe(self) -> str:
        if self.experts is None:
            return self.prefetch.describe()
        return (f"routed experts read as tokens choose them, the most used kept within "
                f"{self.experts.budget_bytes >> 20} MiB; the rest of each layer: {self.prefetch.describe()}")


def cpu_parts(windows: Sequence[LayerRange], gpu_layers: Collection[int]) -> list[LayerRange]:
    """Each window's layers that run on the CPU: what it takes of the device's RAM. llama.cpp holds a GPU layer's
    weights and KV cache (offload_kqv) in VRAM, and reads its weights from the mapping only once, at load. A window's
    GPU layers are its first ones (docs/gpu.md), so its CPU part is one range (empty when all are on the GPU)."""
    gpu = set(gpu_layers)
    parts = []
    for w in windows:
        n = sum(1 for il in range(w.start, w.end) if il in gpu)
        if any(il not in gpu for il in range(w.start, w.start + n)):
            on_gpu = sorted(il for il in range(w.start, w.end) if il in gpu)
            raise WindowRangeError(f"GPU layers {on_gpu} of window {w} are not its first {n} layers: a window "
                                   "runs its first layers on the GPU and the rest on the CPU")
        parts.append(LayerRange(w.start + n, w.end))
    return parts


def reserved_bytes(layout: ModelLayout, windows: list[LayerRange], n_ctx: int, n_batch: int, n_ubatch: int,
                   n_rs_seq: int = 0) -> int:
    """What windows need besides weights: their KV cache (and recurrent states, with their n_rs_seq snapshots) and
    their llama.cpp compute buffers. A window gives its buffer's pages back after a prompt
    (ContextSettings.release_compute), and the windows run one at a time, so one buffer sized for a micro-batch is
    resident at most, beside what a one-token decode touches in the others."""
    kv = sum(layout.cache_bytes(il, n_ctx, n_rs_seq=n_rs_seq) for w in windows for il in range(w.start, w.end))
    if not windows:
        return kv
    one_row = compute_buffer_layers_bytes(layout, n_ctx, 1, 1)
    return kv + compute_buffer_layers_bytes(layout, n_ctx, n_batch, n_ubatch) + (len(windows) - 1) * one_row


def weights_budget(view: MemoryView, reserved: int) -> int:
    """Available memory, less what is `reserved` besides the windows' weights and a margin: what the windows'
    weights may use."""
    return view.available_bytes - reserved - int(MARGIN * view.total_bytes)


def plan_memory(layout: ModelLayout, windows: list[LayerRange], *, n_ctx: int, n_batch: int, n_ubatch: int,
                memory: MemorySettings | None = None, extra_reserved: int = 0,
                extra_weights: int = 0, n_rs_seq: int = 0) -> MemoryPlan:
    """The plan for a device's windows: `windows` are the CPU parts (cpu_parts) of those with CPU layers, the
    layers whose weights and KV cache take RAM. `extra_reserved` is anonymous memory beside theirs (the head's
    output context's buffer), `extra_weights` mapped weights beside theirs (the head's output layer)."""
    memory = memory or MemorySettings()
    view = memory_view()
    reserved = reserved_bytes(layout, windows, n_ctx, n_batch, n_ubatch, n_rs_seq) + extra_reserved
    budget = memory.budget_bytes if memory.budget_bytes is not None else \
        weights_budget(view, reserved + extra_weights)
    sw = memory.switches
    plan = plan_prefetch([layout.window_ranges(r) for r in windows], budget, keep=sw.keep)
    if plan.mode == "stream" and layout.n_expert and sw.experts:
        return _plan_experts(layout, windows, budget, keep=sw.keep)
    per_layer = plan.mode == "stream" and (sw.layers if sw.layers is not None else faults_in(plan))
    if per_layer:  # one unit per layer (device/windows.py: PrefetchHooks)
        # room for a window's layers ahead beside the one computing: a device reads the next window while the
        # others compute, rather than only once its own has run
        slots = sw.room_layers or max(r.n_layers for r in windows) + 1
        plan = plan_prefetch([layout.window_ranges(LayerRange(il, il + 1)) for r in windows
                              for il in range(r.start, r.end)], budget, keep=sw.keep, unit="layer", slots=slots)
    return MemoryPlan(plan, per_layer)


def faults_in(plan: PrefetchPlan) -> bool:
    """Whether whole windows would leave more than READ_AHEAD_SLACK of some window to fault in as it computes:
    page by page, at a fraction of the disk's rate (benchmarks/disk_reads.py), where layer by layer reads every
    streamed byte ahead, whole and with read-ahead."""
    return any(plan.unprefetched_bytes(i) > READ_AHEAD_SLACK for i in range(len(plan.stream)))


def _plan_experts(layout: ModelLayout, windows: list[LayerRange], budget: int, *, keep: bool) -> MemoryPlan:
    """A mixture of experts that does not fit: the rest of its layers is planned as any window, within the budget
    less a working set of experts (one layer's chosen experts for a token and the next layer's predicted ones);
    what that plan leaves of the budget holds the experts' hot set."""
    layers = [il for r in windows for il in range(r.start, r.end)]
    slices = {il: s for il in layers if (s := layout.expert_slices(il))}
    working = EXPERT_WORKING_LAYERS * layout.n_expert_used * max(map(layout.expert_bytes, slices), default=0)
    rest = plan_prefetch([layout.window_ranges(r, experts=False) for r in windows], max(0, budget - working),
                         keep=keep)
    used = sum(n for _, n in rest.keep) if rest.mode == "resident" else rest.budget_bytes
    experts = ExpertPlan(max(working, budget - used), budget, slices, layout.n_expert, layout.n_expert_used)
    return MemoryPlan(rest, per_layer=False, experts=experts)
