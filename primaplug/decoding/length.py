"""How many tokens to draft: the number that makes the most tokens per second, from the measured acceptance rate,
the measured cost of a drafted token and of a trip round the ring carrying n rows.

With a per-token acceptance rate a, a step that drafts n tokens yields E(n) = (1 - a^(n+1)) / (1 - a) tokens
(the kept ones, then the target's own token) and costs n drafted tokens plus one trip of n + 1 rows, T(n + 1).
A ring trip costs nearly the same for one row or eight (every link and every layer's weights once): T(r) =
trip + (r - 1) * row, row being only the compute of one more row. So n grows with a and with trip / draft cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from primaplug.core.errors import ConfigError

ASSUMED_ACCEPTANCE = 0.7  # what a plan assumes before anything is measured (Leviathan et al. report 0.6-0.8)
# every this many steps, a step tries the other regime: none while drafting pays (a trip of one row: without it every
# trip has the same rows, and the cost of a further row cannot be told), one drafted token while it does not. That
# probe costs the draft catching up with everything since it last ran, so while drafting keeps not paying, the
# probes come ever more rarely (the gap doubles, up to _PROBE_MAX steps)
_PROBE_EVERY, _PROBE_MAX = 32, 1024


def check_draft_length(draft_min: int, draft_max: int) -> None:
    """Refuse draft bounds that make no sense, before anything is loaded."""
    if draft_max < 1 or not 0 <= draft_min <= draft_max:
        raise ConfigError(f"the drafted tokens a trip must satisfy 0 <= draft_min <= draft_max and draft_max >= 1 "
                          f"(--draft-min, --draft-max); got {draft_min} and {draft_max}")


def expected_tokens(acceptance: float, n: int) -> float:
    """Tokens one step yields when it drafts n tokens, each kept with probability `acceptance`."""
    if acceptance >= 1.0:
        return n + 1.0
    return (1.0 - acceptance ** (n + 1)) / (1.0 - acceptance)


def _best(acceptance: float, draft_s: float, trip_s: float, row_s: float, n_min: int, n_max: int) -> tuple[int, float]:
    """(n, seconds per token) minimising the time per token, over n_min..n_max drafted tokens."""
    best = (n_min, float("inf"))
    for n in range(n_min, n_max + 1):
        per_token = (n * draft_s + trip_s + n * row_s) / expected_tokens(acceptance, n)
        if per_token < best[1] - 1e-12:
            best = (n, per_token)
    return best


class DraftLength:
    """Chooses each step's draft length and learns from what happened (decaying averages, so it follows a
    conversation that turns from copying to free writing)."""

    def __init__(self, n_min: int, n_max: int, *, decay: float = 0.9) -> None:
        if not 0 <= n_min <= n_max:
            raise ValueError(f"the draft length must satisfy 0 <= draft_min <= draft_max, got {n_min} and {n_max}")
        self.n_min, self.n_max, self.decay = n_min, n_max, decay
        self._kept, self._decided = 2 * ASSUMED_ACCEPTANCE, 2.0  # a prior worth two tokens
        self._draft = [0.0, 0.0]  # decayed (seconds, tokens) of drafting
        self._trips: list[tuple[int, float]] = []  # recent (rows, seconds) of trips
        # the first probe comes early: until a one-row trip is timed, a further row seems to cost nothing
        self._steps, self._next_probe, self._gap = 0, 2, _PROBE_EVERY

    @property
    def acceptance(self) -> float:
        return self._kept / self._decided

    @property
    def draft_token_s(self) -> float | None:
        return self._draft[0] / self._draft[1] if self._draft[1] else None

    def trip_cost(self) -> tuple[float, float] | None:
        """(seconds of a one-row trip, seconds of each further row), fitted to the recent trips."""
        if not self._trips:
            return None
        n = len(self._trips)
        mean_r, mean_s = sum(r for r, _ in self._trips) / n, sum(s for _, s in self._trips) / n
        var = sum((r - mean_r) ** 2 for r, _ in self._trips)
        row_s = max(0.0, sum((r - mean_r) * (s - mean_s) for r, s in self._trips) / var) if var else 0.0
        return max(mean_s - row_s * (mean_r - 1), 1e-6), row_s

    def choose(self) -> int:
        """The number of tokens to draft now."""
        draft_s, trip = self.draft_token_s, self.trip_cost()
        if draft_s is None or trip is None:
            return self.n_max  # until costs are measured
        n, _ = _best(self.acceptance, draft_s, trip[0], trip[1], self.n_min, self.n_max)
        self._steps += 1
        if n > 0 and self._gap > _PROBE_EVERY:  # drafting pays again: probe at the usual pace
            self._gap, self._next_probe = _PROBE_EVERY, self._steps + _PROBE_EVERY
        if self._steps < self._next_probe:
            return n
        if n == 0:
            self._gap = min(2 * self._gap, _PROBE_MAX)
        self._next_probe = self._steps + self._gap
        return min(1, self.n_max) if n == 0 else self.n_min

    def decided(self, kept: bool) -> None:
        self._kept = self._kept * self.decay + kept
        self._decided = self._decided * self.decay + 1.0

    def drafted(self, tokens: int, seconds: float) -> None:
        if tokens:
            self._draft = [self._draft[0] * self.decay + seconds, self._draft[1] * self.decay + tokens]

    def trip(self, rows: int, seconds: float) -> None:
        self._trips = [*self._trips[-31:], (rows, seconds)]


@dataclass(frozen=True)
class SpeculationEstimate:
    """Whether drafting is expected to pay on a ring, before anything runs: from the draft's measured speed and the
    ring's predicted trip."""

    draft_token_s: float
    trip_s: float  # the plan's predicted time per token without speculation (one row round the ring)
    row_s: float  # the predicted cost of one more row in a trip (the ring's compute for one token)
    n: int  # the draft length that pays most at the assumed acceptance
    tpot_s: float  # the predicted time per token at the assumed acceptance
    break_even: float | None  # the acceptance rate above which drafting pays (None: at no rate)
    acceptance: float = ASSUMED_ACCEPTANCE

    @property
    def pays(self) -> bool:
        return self.break_even is not None and self.break_even < self.acceptance

    def describe(self) -> str:
        head = (f"speculation: a drafted token costs {self.draft_token_s * 1e3:.1f} ms, a trip round the ring "
                f"{self.trip_s * 1e3:.1f} ms (+{self.row_s * 1e3:.2f} ms a row)")
        if self.break_even is None:
            return f"{head}: drafting does not pay on this ring at any acceptance rate"
        verdict = "pays" if self.pays else "does not pay"
        return (f"{head}: it pays above {self.break_even:.0%} acceptance; at {self.acceptance:.0%}, {self.n} drafted "
                f"tokens a step give {self.tpot_s * 1e3:.1f} ms/token against {self.trip_s * 1e3:.1f} ({verdict})")


def estimate(draft_token_s: float, trip_s: float, row_s: float, n_min: int, n_max: int,
             acceptance: float = ASSUMED_ACCEPTANCE) -> SpeculationEstimate:
    """Predict what speculation does on a ring whose one-row trip takes trip_s."""
    n, tpot = _best(acceptance, draft_token_s, trip_s, row_s, max(n_min, 1), max(n_max, 1))
    break_even = next((a / 100 for a in range(101)
                       if _best(a / 100, draft_token_s, trip_s, row_s, 1, max(n_max, 1))[1] < trip_s), None)
    return SpeculationEstimate(draft_token_s, trip_s, row_s, n, tpot, break_even, acceptance)
