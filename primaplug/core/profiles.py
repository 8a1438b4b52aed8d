"""What the planner knows about a device and a model: the inputs of Halda's latency model.

These are plain values (msgspec structs, so a node can send its profile over the wire unchanged). The
profiler (`primaplug/profiler/`) measures them; the scheduler (`primaplug/scheduler/`) reads them. Symbols in
the comments are those of the prima.cpp paper's appendix A.3 (see docs/halda.md). Units are in the names:
bytes, seconds (`_s`), bytes per second (`_bps`), FLOP per second (`flops`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

OsName = Literal["linux", "android", "macos"]
Backend = Literal["cpu", "cuda", "metal"]

# the quantization types the profilers measure and the latency model sums over (the paper's set Q)
QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16", "F32")


class DeviceProfile(msgspec.Struct, frozen=True, kw_only=True):
    """One device as Halda sees it. Times that depend on the model (KV copy, host<->device copy of a hidden
    state) are derived from the throughputs here and the model's byte counts."""

    name: str
    os: OsName
    backend: Backend = "cpu"  # the GPU backend the node's engine was built with, "cpu" when none
    cpu_count: int = 1
    # compute: FLOP/s per quantization type (s^{cpu,q}, s^{gpu,q}); a type missing from gpu_flops has no GPU kernel
    cpu_flops: dict[str, float] = msgspec.field(default_factory=dict)
    gpu_flops: dict[str, float] = msgspec.field(default_factory=dict)
    # memory -> registers read throughput (T^cpu, T^gpu)
    cpu_read_bps: float = 0.0
    gpu_read_bps: float = 0.0
    # copies: within CPU memory (KV copy), RAM -> VRAM and back (t^{ram-vram}, t^{vram-ram}): latency + bytes/bps
    kv_copy_cpu_bps: float = 0.0
    kv_copy_gpu_bps: float = 0.0
    h2d_bps: float = 0.0
    d2h_bps: float = 0.0
    copy_latency_s: float = 0.0
    unified_memory: bool = False  # I^UMA: GPU and CPU share memory (Apple silicon)
    # disk reads with the page cache bypassed (s^disk): sequential (Linux, Android) and random (macOS)
    disk_seq_bps: float = 0.0
    disk_rand_bps: float = 0.0
    # memory as the OS gives it
    mem_total_bytes: int = 0
    mem_available_bytes: int = 0  # d^avail (MemAvailable, or what the cgroup leaves)
    swap_can_bytes: int = 0  # Android: used memory the OS could swap out (d^{bytes_can_swap})
    swap_free_bytes: int = 0  # Android: free swap (d^{swap_avail})
    metal_working_set_bytes: int = 0  # d^avail_metal: Metal's recommended maximum working set
    vram_free_bytes: int = 0  # d^avail_cuda
    # the link to the next device in the ring (measured at deploy time; 0 until then): t^comm = latency + bytes/bps
    link_latency_s: float = 0.0
    link_bps: float = 0.0

    @property
    def has_gpu(self) -> bool:
        return self.backend != "cpu"


class ExpertBytes(msgspec.Struct, frozen=True):
    """A mixture of experts' layer three ways: all its bytes (what memory and disk hold), the bytes one token uses
    (what it computes on and, where the layer streams, reads), and the working set a streaming node keeps for its
    tokens' chosen experts (core/budget.py: EXPERT_WORKING_LAYERS layers' worth; its budget's rest keeps the most
    used experts)."""

    layer_bytes: int
    expert_bytes: int  # of layer_bytes, the routed experts'
    token_share: float  # of the routed experts, the share one token uses (n_expert_used / n_expert)

    @property
    def unused_bytes(self) -> float:
        """Of a layer, the routed experts one token does not choose: what it neither computes on nor reads."""
        return self.expert_bytes * (1.0 - self.token_share)

    @property
    def token_bytes(self) -> int:
        return round(self.layer_bytes - self.unused_bytes)

    @property
    def working_bytes(self) -> int:
        from primaplug.core.budget import EXPERT_WORKING_LAYERS

        return round(EXPERT_WORKING_LAYERS * self.token_share * self.expert_bytes)

    def describe(self) -> str:
        gb = 1e9
        return (f"a mixture of experts: each layer {self.layer_bytes / gb:.3f} GB in memory and on disk, of which "
                f"{self.expert_bytes / gb:.3f} GB routed experts; a token uses {self.token_share:.1%} of those, "
                f"{self.token_bytes / gb:.3f} GB a layer, read as chosen where it streams, within a working set of "
                f"{self.working_bytes / gb:.3f} GB beside the hot experts")


class ModelProfile(msgspec.Struct, frozen=True, kw_only=True):
    """One model, for one context and batch size, as Halda sees it (from the GGUF header alone)."""

    name: str
    n_layer: int  # L
    n_vocab: int  # V
    n_embd: int  # e: a hidden state is 4e bytes
    layer_bytes: int  # b: weight bytes of one transformer layer (the mean when layers differ)
    input_bytes: int  # b_i: the token embedding matrix (one row of it is read per token)
    output_bytes: int  # b_o: output norm and lm_head
    # the head's anonymous copy of a tied lm_head, repacked at load as plain llama.cpp does (ModelLayout)
    output_copy_bytes: int = 0
    # FLOPs per token of one layer and of the output layer, by the quantization type of the weights (f^q, f^q_out)
    layer_flops: dict[str, float]
    output_flops: dict[str, float]
    kv_bytes_per_token_layer: int  # 2(h_k e_k + h_v e_v): one token's K and V in one layer (F16)
    n_kv: int  # tokens the KV cache is planned for (the context size)
    compute_buffer_cpu_bytes: int  # c^cpu
    compute_buffer_gpu_bytes: int  # c^gpu
    # The engine opens one llama.cpp context per window, and each has its own compute buffer: the two above are one
    # window of layers (hidden state out) at n_kv and the planned n_ubatch. A window gives its CPU buffer's pages
    # back after a prompt and the windows run one at a time, so a device holds c^cpu once, plus, for each further
    # window, what a one-token decode touches (the field below); GPU buffers are paid per window. The head also
    # runs the output-only context, whose buffer holds a micro-batch of logits (n_ubatch x V floats: 512 MiB for
    # Gemma 3 at n_ubatch 512) and is paid once.
    compute_buffer_output_bytes: int = 0
    compute_buffer_row_bytes: int = 0  # c^cpu of a one-token micro-batch
    # a mixture of experts: of layer_bytes, its routed experts' (memory and disk hold them all), and the share of
    # them one token uses (n_expert_used / n_expert): what a node reading only the chosen experts reads
    layer_expert_bytes: int = 0
    expert_token_share: float = 0.0
    # recurrent layers (gated delta-net, short convolutions): the state a layer keeps, on average over the layers,
    # for one sequence; planning multiplies it by the sequences and the snapshots a draft needs (n_rs_seq)
    state_bytes_layer: int = 0
    # Gemma 4 E2B/E4B: the per-layer inputs of one token (float32) that travel: the head computes them and keeps
    # those of its own last window (the shared-KV tail); each hop carries those of the layers after its window
    per_layer_input_bytes: int = 0
    # the last layers that must share one window, the head's last (Gemma 4's shared KV and the layers it reads)
    tail_layers: int = 0
    # layers no window may start at (GLM 5.2's with a shared indexer: ModelLayout.barred_starts)
    barred_starts: tuple[int, ...] = ()

    @property
    def hidden_bytes(self) -> int:
        """One hidden state on the wire (float32 row); with per-layer inputs, a hop's mean: each carries those of
        the layers after its window, from all of them (the head's first hop) to none (the last), half on average."""
        return 4 * self.n_embd + self.per_layer_input_bytes // 2

    @property
    def experts(self) -> ExpertBytes | None:
        """A mixture of experts' layer three ways, or None for a dense model."""
        if not self.layer_expert_bytes or not self.expert_token_share:
            return None
        return ExpertBytes(self.layer_bytes, self.layer_expert_bytes, self.expert_token_share)

    @property
    def layer_bytes_with_kv(self) -> int:
        """b': one layer's weights plus its KV cache for n_kv tokens (and its recurrent states)."""
        return self.layer_bytes + self.kv_bytes_per_token_layer * self.n_kv + self.state_bytes_layer
