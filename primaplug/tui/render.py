"""Provides what the dashboard's panes show, as Rich renderables made from the head's data: a node's state and
profile, the plan's layer map, its predicted time per token, the alternatives, the live figures.

Pure functions of their arguments (no widget, no I/O), so each is tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from primaplug.core.profiles import DeviceProfile
from primaplug.head.events import NodeView
from primaplug.scheduler import Plan

MIB = 2**20
GB = 1e9
# one colour per round of the layer map, repeated when there are more rounds
ROUND_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
# "taken": another head took the node over (--take-over); this head waits to take it back
STATE_STYLES = {"failed": "bold red", "left": "dim", "ready": "green", "serving": "bold green",
                "loading": "yellow", "profiling": "yellow", "connecting": "yellow", "taken": "bold magenta"}


def bar(fraction: float, width: int = 10) -> str:
    """A progress bar of block characters."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def state_text(view: NodeView | None, *, serving: bool = False, error: str = "") -> Text:
    """A node's state in words, with a bar while it profiles or loads; red when it failed."""
    if error or (view is not None and view.state == "failed"):
        return Text("failed", style=STATE_STYLES["failed"])
    if view is None:
        return Text("not connected", style="dim")
    state = "serving" if serving and view.state == "ready" else view.state
    if state == "profiling" and view.progress >= 1.0:
        state = "profiled"
    if state in ("loading", "profiling") and 0 < view.progress < 1:
        return Text(f"{state} {bar(view.progress, 6)} {view.progress:3.0%}", style=STATE_STYLES[state])
    return Text(state, style=STATE_STYLES.get(state, ""))


def best_flops(flops: dict[str, float]) -> str:
    """The fastest quantization type's GFLOP/s."""
    if not flops:
        return "-"
    return f"{max(flops.values()) / 1e9:.0f}"


def gpu_memory_bytes(p: DeviceProfile) -> int:
    """What the device's GPU may hold, as the scheduler caps it: CUDA's free VRAM, or Metal's recommended working
    set (in the memory it shares with the CPU)."""
    return p.metal_working_set_bytes if p.backend == "metal" else p.vram_free_bytes


def profile_cells(p: DeviceProfile | None) -> tuple[str, str, str, str]:
    """(OS, cores and GPU backend, RAM free/total GB, disk seq/random MB/s, the best CPU GFLOP/s) of a profile, for
    the nodes table; the GPU's memory is in the detail (profile_detail)."""
    if p is None:
        return ("-", "-", "-", "-")
    gpu = f" {p.backend}" if p.backend != "cpu" else ""
    return (f"{p.os} {p.cpu_count}c{gpu}", f"{p.mem_available_bytes / GB:.1f}/{p.mem_total_bytes / GB:.1f}",
            f"{p.disk_seq_bps / 1e6:.0f}/{p.disk_rand_bps / 1e6:.0f}", best_flops(p.cpu_flops))


def profile_detail(name: str, address: str, p: DeviceProfile | None, view: NodeView | None, facts: str,
                   error: str) -> Text:
    """Everything known of one device, for the detail box under the nodes table."""
    out = Text()
    out.append(f"{name}", style="bold")
    out.append(f"  {address}  {facts}\n" if address else f"  {facts}\n")
    message = error or (view.message if view else "")
    if message:
        out.append(message + "\n", style="red" if error or (view and view.state == "failed") else "")
    if p is None:
        out.append("not profiled yet: press p to profile the cluster", style="dim")
        return out
    out.append("CPU GFLOP/s: " + (", ".join(f"{q} {f / 1e9:.0f}" for q, f in p.cpu_flops.items()) or "-") + "\n")
    if p.gpu_flops:
        out.append(f"{p.backend} GFLOP/s: " + ", ".join(f"{q} {f / 1e9:.0f}" for q, f in p.gpu_flops.items()) + "\n")
    out.append(f"RAM {p.mem_available_bytes / GB:.2f} of {p.mem_total_bytes / GB:.2f} GB free, read "
               f"{p.cpu_read_bps / GB:.1f} GB/s; disk {p.disk_seq_bps / 1e6:.0f} MB/s sequential, "
               f"{p.disk_rand_bps / 1e6:.0f} MB/s random")
    if p.backend == "metal" and p.metal_working_set_bytes:
        out.append(f"; Metal working set {p.metal_working_set_bytes / GB:.1f} GB"
                   + (" (memory shared with the CPU)" if p.unified_memory else ""))
    elif p.vram_free_bytes:
        out.append(f"; VRAM {p.vram_free_bytes / GB:.1f} GB free")
    out.append(f"\nlink to the next device: {p.link_latency_s * 1e3:.2f} ms, {p.link_bps * 8 / 1e6:.0f} Mbit/s")
    return out


def layer_map(plan: Plan, width: int = 60) -> Text:
    """Devices (in ring order) against layers: each layer a cell coloured by the round it runs in, 'G' where it
    runs on the GPU, '·' where the device does not run it; cells widen to fill the width, and many layers share
    a cell when they do not fit it."""
    names = [d.name + (" (head)" if d is plan.head else "") for d in plan.ring]
    label = max(len(n) for n in names) + 1
    room = max(8, width - label - 1)
    per_cell = max(1, -(-plan.n_layer // room))  # layers a cell
    n_cells = -(-plan.n_layer // per_cell)
    cell_w = max(1, min(4, room // n_cells))  # characters a cell
    out = Text()
    last = str(plan.n_layer - 1)
    out.append(" " * label + "layer 0".ljust(max(8, n_cells * cell_w - len(last))) + last + "\n", style="dim")
    for d, name in zip(plan.ring, names, strict=True):
        out.append(name.ljust(label))
        for c in range(n_cells):
            layers = range(c * per_cell, min(plan.n_layer, (c + 1) * per_cell))
            hit = next(((r, w) for r, w in enumerate(d.windows) for layer in layers if w.start <= layer < w.end), None)
            if hit is None:
                out.append("·" * cell_w, style="dim")
                continue
            r, w = hit
            gpu = any(w.start <= layer < w.start + min(d.n, w.n_layers) for layer in layers)
            out.append(("G" if gpu else "█") * cell_w, style=ROUND_STYLES[r % len(ROUND_STYLES)])
        out.append("\n")
    legend = Text("rounds: ", style="dim")
    for r in range(plan.k):
        legend.append(f"{r + 1} ", style=ROUND_STYLES[r % len(ROUND_STYLES)])
    legend.append(f"· G on the GPU · {per_cell} layers a cell" if per_cell > 1 else "· G on the GPU", style="dim")
    out.append_text(legend)
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def plan_summary(plan: Plan) -> Text:
    out = Text()
    out.append(f"{plan.scheduler}: {plan.k} round(s) over {len(plan.devices)} device(s), predicted ")
    out.append(f"{_ms(plan.total_s)} ms/token", style="bold")
    if rooms := plan.describe_rooms():
        out.append(f" (round by round)\n{rooms}")
    elif plan.latency_model == "ring":
        out.append(f" (the token's path {_ms(plan.chain_s)} ms; the busiest device's own time, disk reads "
                   "overlapping the others)")
    if plan.experts is not None:
        out.append("\n" + plan.experts.describe())
    if plan.speculation is not None:
        out.append("\n" + plan.speculation.describe(), style="green" if plan.speculation.pays else "yellow")
    return out


def prediction_table(plan: Plan) -> Table:
    """Predicted time per token, split into compute, memory, disk and network per device, in ring order."""
    t = Table(box=None, padding=(0, 1), header_style="bold", expand=False)
    for col in ("device", "windows", "gpu", "compute", "memory", "disk", "net", "total ms"):
        t.add_column(col, justify="left" if col in ("device", "windows") else "right")
    for d in plan.ring:
        windows = " ".join(str(w) for w in d.windows if w.n_layers) or ("output layer" if d is plan.head else "-")
        t.add_row(d.name + (" (head)" if d is plan.head else ""), windows,
                  str(d.n), _ms(d.compute_s), _ms(d.memory_s), _ms(d.disk_s), _ms(d.network_s), _ms(d.total_s))
    return t


def dropped_text(plan: Plan) -> Text:
    out = Text()
    for d in plan.dropped:
        out.append(f"dropped {d.name}: ", style="yellow")
        out.append(d.reason + "\n")
    return out


def alternatives_table(chosen: Plan, alternatives: Sequence[tuple[int, Plan | str]]) -> Table:
    """The other numbers of rounds the scheduler weighed, with their predicted time per token."""
    t = Table(box=None, padding=(0, 1), header_style="bold")
    t.add_column("k", justify="right")
    t.add_column("ms/token", justify="right")
    t.add_column("devices", justify="right")
    t.add_column("")
    for k, alt in alternatives:
        if isinstance(alt, str):
            t.add_row(str(k), "-", "-", Text(alt, style="dim"))
        else:
            mark = Text("chosen", style="bold green") if k == chosen.k else Text("")
            t.add_row(str(k), _ms(alt.total_s), str(len(alt.devices)), mark)
    return t


def figures(ttft_s: float, tpot_s: float, tokens: int, predicted_s: float | None,
            drafts: tuple[int, int] | None = None) -> Text:
    """TTFT, TPOT measured against predicted, tokens per second, and with a draft the share of drafted tokens kept
    (drafts: kept, decided)."""
    out = Text()
    rows = [("TTFT", f"{ttft_s * 1e3:.0f} ms" if ttft_s else "-", ""),
            ("TPOT", f"{tpot_s * 1e3:.1f} ms" if tpot_s else "-", "bold"),
            ("predicted", f"{predicted_s * 1e3:.1f} ms" if predicted_s else "-", ""),
            ("speed", f"{1 / tpot_s:.1f} tokens/s" if tpot_s else "-", "")]
    for label, value, style in rows:
        out.append(f"{label:<10}", style="dim")
        out.append(value, style=style)
        if label == "predicted" and predicted_s and tpot_s:
            out.append(f"  measured {tpot_s / predicted_s:.2f}x", style="dim")
        if label == "speed" and tpot_s:
            out.append(f", {tokens + 1} tokens", style="dim")
        if label == "TTFT" and drafts is not None:  # on this line: the figures keep their four lines
            kept, decided = drafts
            out.append("  drafts ", style="dim")  # short: the figures column is narrow at 80 columns
            out.append(f"{kept / decided:.0%} kept" if decided else "none yet")
        out.append("\n")
    out.rstrip()
    return out


def node_metrics_table(rows: Sequence[tuple[str, NodeView | None, bool]]) -> Table:
    """Per node, live: state, busy share, resident MiB, page faults per token, MiB prefetched and released,
    memory pressure. rows: (name, view, failed)."""
    t = Table(box=None, padding=(0, 1), header_style="bold")
    for col in ("node", "state", "busy", "resident", "faults/tok", "prefetched", "released", "pressure"):
        t.add_column(col, justify="left" if col in ("node", "state") else "right")
    for name, view, failed in rows:
        m = view.metrics if view else None
        style = "bold red" if failed else ""
        state = state_text(view, error="failed" if failed else "")
        if m is None or not m.memory_mode:
            t.add_row(Text(name, style=style), state, f"{view.busy_share:.0%}" if view and m else "-", "-", "-", "-",
                      "-", "-")
            continue
        t.add_row(Text(name, style=style), state, f"{view.busy_share:.0%}" if view else "-",
                  f"{m.resident_bytes / MIB:.0f} MiB", f"{m.major_faults_per_token:.0f}",
                  f"{m.bytes_prefetched / MIB:.0f} MiB", f"{m.bytes_released / MIB:.0f} MiB",
                  f"{m.memory_pressure:.1%}")
    return t
