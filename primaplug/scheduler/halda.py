"""Halda (prima.cpp, Algorithm 1): layer windows and GPU layers per device that minimise the latency model.

For given device sets and a number of rounds k, the fixed-k ILP (Eqs. 6-10) is linear. Written as below (see
FixedKSolver), its constraint matrix is that of a flow from one source (sum(w) = W) through one node per device,
so it is totally unimodular: with integer bounds the LP's vertex optimum is integral, and HiGHS's simplex solves
each ILP exactly in a fraction of a millisecond (its branch and bound took ~6 ms; it stays as a fallback).
highspy is imported only when a solver is built (import_highspy), so importing this module loads no solver.
docs/halda.md records how the paper's ambiguities were decided and where this departs from the paper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from primaplug.core.errors import ConfigError
from primaplug.scheduler.latency import (
    FREE,
    M2,
    M4,
    MACOS_METAL,
    SET_NAMES,
    DeviceSet,
    Platform,
    assign_sets,
    set_coefficients,
)


def apportion(weights: Sequence[float] | np.ndarray, total: int, minimum: int = 1) -> np.ndarray:
    """Split `total` into integers: `minimum` each, the rest in proportion to `weights` (largest remainder)."""
    wts = np.maximum(np.asarray(weights, dtype=float), 0.0)
    spare = total - minimum * len(wts)
    if spare < 0:
        raise ValueError(f"cannot give {len(wts)} devices {minimum} of {total} layers each")
    if not np.isfinite(wts).all() or wts.sum() <= 0:
        wts = np.ones(len(wts))
    quota = spare * wts / wts.sum()
    share = np.floor(quota).astype(np.int64)
    order = np.argsort(-(quota - share), kind="stable")
    share[order[: spare - int(share.sum())]] += 1
    return share + minimum


def valid_rounds(n_layer: int, n_devices: int) -> list[int]:
    """The paper's K_L: the divisors k of L (k < L) with W = L/k >= the number of devices (every w_m >= 1)."""
    return [k for k in range(1, n_layer + 1)
            if n_layer % k == 0 and (k < n_layer or n_layer == 1) and n_layer // k >= n_devices]


def gpu_layer_cap(p: Platform, k: int) -> np.ndarray:
    """GPU layers per window each device's VRAM holds with k rounds (Eqs. 34-36)."""
    return np.maximum(p.vram_room(k), 0) // (k * p.layer_kv_bytes)


@dataclass(frozen=True)
class Solution:
    """One placement: k rounds, w[m] layers per window on device m, n[m] of them on its GPU."""

    k: int
    w: tuple[int, ...]
    n: tuple[int, ...]
    objective_s: float  # predicted time per token (exact for the sets the placement belongs to)


def import_highspy() -> Any:
    """highspy, Halda's LP solver, imported on first use: importing the scheduler (and the head) must not load it.
    ConfigError where it is not installed (pyproject leaves it out on Termux/Android), saying what plans without it."""
    try:
        import highspy
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == "highspy"
        why = "is not installed" if missing else f"cannot be imported ({e})"
        raise ConfigError(
            f"Halda (the default scheduler) needs highspy, its LP solver, which {why} here: "
            "`pip install highspy`, or plan with `--scheduler even|memory|compute` or `--layers` "
            "(primaplug.Llama: scheduler= or layers=)"
        ) from e
    return highspy


class FixedKSolver:
    """The fixed-k ILP for one device list, built once in HiGHS and re-solved with new costs and bounds.

    Columns per device m: w_m (layers per window), n_m (of them on the GPU) and the CPU layers x_m = w_m - n_m
    split in three: x1 (those that fit in RAM), x2 (the one layer that crosses the RAM limit, charged for its
    overflowing part) and x3 (each charged k b' / s^disk). Rows: sum(w) = W and w_m - n_m - x1 - x2 - x3 = 0.
    The disk time of Linux, Android and macOS-without-Metal devices, max(0, overflow) / s^disk, is convex in x,
    so the LP charges exactly the overflow and those devices need no set (M1/M3 versus M4) fixed in advance;
    the set is an input only for Metal devices (M2 versus M4, a jump) and for devices that must not spill.
    """

    def __init__(self, p: Platform) -> None:
        self._hs = highspy = import_highspy()
        self.p = p
        m = p.n_devices
        self._cols = np.arange(5 * m, dtype=np.int32)
        self._rows = np.arange(m + 1, dtype=np.int32)
        self._metal = p.kind == MACOS_METAL
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        lp = highspy.HighsLp()
        lp.num_col_ = 5 * m
        lp.num_row_ = m + 1
        lp.col_cost_ = np.zeros(5 * m)
        lp.col_lower_ = np.zeros(5 * m)
        lp.col_upper_ = np.ones(5 * m)
        lp.row_lower_ = np.zeros(m + 1)  # row 0's bounds (W) are set per solve; the others stay 0
        lp.row_upper_ = np.zeros(m + 1)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.r_[np.arange(0, 2 * m, 2), 2 * m + np.arange(4 * m + 1)].astype(np.int32)
        lp.a_matrix_.index_ = np.r_[np.column_stack([np.zeros(m), 1 + np.arange(m)]).ravel(),
                                    np.tile(1 + np.arange(m), 4)].astype(np.int32)
        lp.a_matrix_.value_ = np.r_[np.ones(2 * m), -np.ones(4 * m)]
        h.passModel(lp)
        self._h = h
        self._zero = np.zeros(m, dtype=np.int64)
        self._zero_f = np.zeros(m)
        self._by_k: dict[int, dict[str, np.ndarray]] = {}
        self._by_sets: dict[tuple[int, bytes], tuple[np.ndarray, np.ndarray, float, float]] = {}

    def ilp_sets(self, sets: np.ndarray, forced: np.ndarray) -> np.ndarray:
        """The part of a set assignment the ILP takes as input: Metal devices' sets and the devices that must
        not spill (M4); FREE for the others, whose set the ILP chooses."""
        p = self.p
        return np.where(self._metal | p.slow_disk | forced, sets, FREE)

    def _round_constants(self, k: int) -> dict[str, np.ndarray]:
        """What the ILP's bounds and disk costs need that depends on k only (cached: Algorithm 1 asks again)."""
        cached = self._by_k.get(k)
        if cached is not None:
            return cached
        p = self.p
        per_round = p.n_layer // k  # W
        per_window = k * p.layer_kv_bytes
        room = p.ram_cap - p.ram_fixed(k)
        # what spills is re-read each token at the layer's stream share (a mixture of experts: its chosen experts)
        share = p.stream_share
        s = np.where(p.disk_bps > 0, p.disk_bps, np.inf) / share
        # the head may overflow by as much as re-reads its one input row at no cost: it reads that row from disk
        # anyway (the max in Eqs. 15-17)
        room_free = room + np.where(p.head, p.lookup_bytes / share if share < 1 else p.lookup_bytes, 0)
        fit_free = (room_free // per_window).astype(np.int64)
        c = {
            "W": np.int64(per_round),
            "full": np.full(p.n_devices, per_round, dtype=np.int64),
            # most layers per window that fit (CPU layers; all layers on Metal)
            "fit": np.minimum(room // per_window, per_round),
            "spill": np.maximum(-((-(room + 1)) // per_window), 1),  # fewest that overflow
            "n_hi": np.minimum(gpu_layer_cap(p, k), per_round),
            "x1_free": np.clip(fit_free, 0, per_round),
            "x2_free": (fit_free >= 0).astype(np.int64),
            "x2_cost": np.where(fit_free >= 0, (per_window * (fit_free + 1) - room_free) / s, 0.0),
            "x3_cost": per_window / s,
            # a device that overflows even with no layer on its CPU pays that much whatever the placement
            "overflow_s": np.where(fit_free < 0, -room_free / s, 0.0),
        }
        self._by_k[k] = c
        return c

    def _costs(self, k: int, sets: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
        """Section 2.5's a, b, sum(c) and kappa for the ILP sets, non-Metal devices charged as M4 (their disk
        time is in the x2 and x3 columns)."""
        key = (k, sets.tobytes())
        cached = self._by_sets.get(key)
        if cached is None:
            a, b, c, kappa = set_coefficients(self.p, np.where(self._metal, sets, M4), k)
            cached = self._by_sets[key] = (a, b, float(c.sum()), kappa)
        return cached

    def _model(self, k: int, sets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float] | None:
        """Costs, integer bounds and constant of the fixed-k ILP; None when its bounds already rule it out."""
        c = self._round_constants(k)
        metal = self._metal
        m4 = sets == M4
        free = ~metal & ~m4  # Linux, Android, macOS without Metal: may spill, the LP prices the overflow
        zero = self._zero
        full = c["full"]
        # Metal: the set bounds w (Eqs. 28, 31); M2's disk time is in a
        w_lo = np.where(metal & (sets == M2), c["spill"], 1)
        w_lo = np.where(self.p.head, np.maximum(w_lo, self.p.tail_layers), w_lo)  # the shared-KV tail: the head's
        w_hi = np.where(metal & m4, c["fit"], full)
        x1_hi = np.where(free, c["x1_free"], np.where(metal, full, c["fit"]))
        x2_hi = np.where(free, c["x2_free"], zero)
        x3_hi = np.where(free, full, zero)
        n_hi = c["n_hi"]
        w_hi = np.minimum(w_hi, n_hi + x1_hi + x2_hi + x3_hi)
        per_round = int(c["W"])
        if (w_lo > w_hi).any() or (x1_hi < 0).any() or w_lo.sum() > per_round or w_hi.sum() < per_round:
            return None
        a, b, c_sum, kappa = self._costs(k, sets)
        cost = np.concatenate([k * a, k * b, self._zero_f, np.where(free, c["x2_cost"], 0.0),
                               np.where(free, c["x3_cost"], 0.0)])
        lower = np.concatenate([w_lo, zero, zero, zero, zero]).astype(float)
        upper = np.concatenate([w_hi, n_hi, x1_hi, x2_hi, x3_hi]).astype(float)
        constant = k * c_sum + kappa + float(np.where(free, c["overflow_s"], 0.0).sum())
        return cost, lower, upper, constant

    def solve(self, k: int, sets: np.ndarray, *, integer: bool = False) -> Solution | None:
        """The fixed-k ILP's optimum for the ILP sets `sets` (see ilp_sets); None when it is infeasible.

        `integer=True` runs HiGHS's branch and bound instead of the LP (the same optimum, slower).
        """
        model = self._model(k, sets)
        if model is None:
            return None
        cost, lower, upper, constant = model
        m = self.p.n_devices
        per_round = float(self.p.n_layer // k)
        h = self._h
        h.changeColsCost(5 * m, self._cols, cost)
        h.changeColsBounds(5 * m, self._cols, lower, upper)
        h.changeRowBounds(0, per_round, per_round)
        x = self._run(integer)
        if x is not None and np.abs(x - np.rint(x)).max() > 1e-6 and not integer:
            x = self._run(True)  # a non-integral vertex would mean a numerical slip: let branch and bound decide
        if x is None:
            return None
        x = np.rint(x)
        value = float(cost @ x) + constant
        return Solution(k, tuple(int(v) for v in x[:m]), tuple(int(v) for v in x[m:2 * m]), value)

    def _run(self, integer: bool) -> np.ndarray | None:
        h, hs = self._h, self._hs
        if integer:
            h.changeColsIntegrality(len(self._cols), self._cols,
                                    np.array([hs.HighsVarType.kInteger] * len(self._cols)))
        try:
            h.run()
            if h.getModelStatus() != hs.HighsModelStatus.kOptimal:
                return None
            return np.array(h.getSolution().col_value)
        finally:
            if integer:
                h.changeColsIntegrality(len(self._cols), self._cols,
                                        np.array([hs.HighsVarType.kContinuous] * len(self._cols)))

    def best_over_rounds(self, rounds: Sequence[int], sets: np.ndarray, *, integer: bool = False
                         ) -> Solution | None:
        """Algorithm 1, lines 10-12: the fixed-k ILP for every k, the best by predicted time per token.

        A placement with k rounds maps onto one with k' rounds for every divisor k' of k (each window of k'
        rounds joins k/k' windows: same layers, same memory, same disk bytes) that costs (k - k') sum(xi) less.
        So k is skipped when a divisor k' was infeasible, or when T(k') + (k - k') sum(xi) cannot beat the best.
        """
        xi_sum = float(self.p.xi.sum())
        best: Solution | None = None
        solved: dict[int, Solution | None] = {}
        for k in sorted(rounds):
            below = [solved[j] for j in solved if k % j == 0]
            feasible = [s for s in below if s is not None]
            if len(feasible) < len(below):
                continue
            if best is not None and any(s.objective_s + (k - s.k) * xi_sum >= best.objective_s for s in feasible):
                continue
            found = solved[k] = self.solve(k, sets, integer=integer)
            if found is not None and (best is None or found.objective_s < best.objective_s):
                best = found
        return best


@dataclass(frozen=True)
class HaldaResult:
    """Halda's answer for one device list, with how it got there."""

    solution: Solution
    sets: tuple[DeviceSet, ...]
    iterations: int
    forced: tuple[int, ...]  # devices that calibration moved into M4


def initial_windows(p: Platform) -> np.ndarray:
    """Algorithm 1, line 1: W = L layers in proportion to memory budgets (d^avail; d^avail_metal with Metal;
    d^avail + d^swapout on Android), at least one each."""
    return apportion(p.ram_cap, p.n_layer)


def _calibration_target(p: Platform, sol: Solution, sets: np.ndarray, forced: np.ndarray) -> int | None:
    """Algorithm 1, lines 13-14: when a GPU has room for one more layer per window while a device whose set the
    ILP takes as input (Metal) overflows its RAM, the one of those with the slowest disk, else None."""
    n = np.asarray(sol.n)
    free_gpu = p.gpu & (gpu_layer_cap(p, sol.k) - n >= 1)
    movable = np.flatnonzero((p.kind == MACOS_METAL) & (sets == M2) & ~forced)
    if not free_gpu.any() or movable.size == 0:
        return None
    return int(movable[np.argmin(p.disk_bps[movable])])


def halda(p: Platform, *, rounds: Sequence[int] | None = None, max_iterations: int | None = None,
          solver: FixedKSolver | None = None, integer: bool = False) -> HaldaResult | None:
    """Algorithm 1 on the devices of `p` (all of them, head first), then a search over Metal devices' sets:
    None when no placement satisfies the constraints for any k.

    `rounds`: the k to consider (default: the paper's K_L); `integer`: solve each ILP by branch and bound.
    """
    rounds = [k for k in (rounds or valid_rounds(p.n_layer, p.n_devices))
              if p.n_layer % k == 0 and p.n_layer // k >= p.n_devices]
    if not rounds:
        return None
    solver = solver or FixedKSolver(p)
    k, w, n = 1, initial_windows(p), np.zeros(p.n_devices, dtype=np.int64)
    forced = np.zeros(p.n_devices, dtype=bool)
    previous: np.ndarray | None = None
    best: Solution | None = None
    best_sets = np.full(p.n_devices, M4)
    repaired = False
    iterations = 0
    while iterations < (max_iterations or 2 * p.n_devices + 4):
        iterations += 1
        sets = solver.ilp_sets(assign_sets(p, k, w, n, forced), forced)
        if previous is not None and np.array_equal(sets, previous):
            break
        previous = sets
        found = solver.best_over_rounds(rounds, sets, integer=integer)
        if found is None:
            if best is not None or repaired:
                break
            # the memory-proportional start gave sets that admit no placement (a Metal device that must
            # overflow, or fit, where it cannot): take the sets of the best placement without RAM limits there
            repaired = True
            relaxed = solver.best_over_rounds(rounds, np.where(p.slow_disk | forced, M4, FREE), integer=integer)
            if relaxed is None:
                break
            k, w, n = relaxed.k, np.asarray(relaxed.w), np.asarray(relaxed.n)
            continue
        if best is None or found.objective_s < best.objective_s:
            best, best_sets = found, sets
        k, w, n = found.k, np.asarray(found.w), np.asarray(found.n)
        target = _calibration_target(p, found, sets, forced)
        if target is not None:
            forced[target] = True
    if best is None:
        return None
    best, best_sets = _metal_search(p, solver, rounds, best, best_sets, forced, integer)
    final = assign_sets(p, best.k, np.asarray(best.w), np.asarray(best.n))
    return HaldaResult(best, tuple(SET_NAMES[i] for i in final), iterations,
                       tuple(int(i) for i in np.flatnonzero(forced)))


def _metal_search(p: Platform, solver: FixedKSolver, rounds: Sequence[int], best: Solution, best_sets: np.ndarray,
                  forced: np.ndarray, integer: bool) -> tuple[Solution, np.ndarray]:
    """Flip one Metal device at a time between M2 and M4 while that lowers the predicted time.

    Algorithm 1 never leaves the sets it starts from (each ILP's answer belongs to the sets it was solved for);
    for the other devices the ILP itself picks the set, for Metal devices this local search does.
    """
    metal = np.flatnonzero((p.kind == MACOS_METAL) & ~p.slow_disk & ~forced)
    for _ in range(len(metal) + 1):
        improved = False
        for i in metal:
            sets = best_sets.copy()
            sets[i] = M4 if sets[i] == M2 else M2
            found = solver.best_over_rounds(rounds, sets, integer=integer)
            if found is not None and found.objective_s < best.objective_s:
                best, best_sets, improved = found, sets, True
        if not improved:
            break
    return best, best_sets
