"""Speculative decoding's arithmetic (primaplug.decoding): speculative sampling keeps the target's distribution,
the draft's distribution follows llama.cpp's chain, and the draft length follows acceptance and costs."""

from __future__ import annotations

import numpy as np
import pytest

from primaplug.core.errors import ConfigError
from primaplug.decoding import (
    DraftLength,
    SamplingParams,
    accept_or_resample,
    check_draft_length,
    draft_probs,
    estimate,
    expected_tokens,
)

N = 40_000


def _chi2_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    """Pearson's chi-square against p, at a 1e-4 significance over a few categories (no scipy needed):
    the critical value for 7 degrees of freedom is 29.9."""
    expected = p * counts.sum()
    stat = float((((counts - expected) ** 2) / expected).sum())
    return stat < 29.9


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_speculative_sampling_keeps_the_target_distribution(deterministic: bool) -> None:
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.ones(8))  # the target
    q = rng.dirichlet(np.ones(8) * 0.3)  # a poor draft
    counts = np.zeros(8)
    kept = 0
    for _ in range(N):
        if deterministic:
            token, qq = 2, None  # a prompt lookup always proposes the same token here
        else:
            token, qq = int(rng.choice(8, p=q)), q
        out, ok = accept_or_resample(p, qq, token, rng)
        counts[out] += 1
        kept += ok
    assert _chi2_ok(counts, p), (counts / N, p)
    # and it kept what theory says: sum_x min(p, q), or p(2) for the deterministic draft
    want = p[2] if deterministic else float(np.minimum(p, q).sum())
    assert abs(kept / N - want) < 0.01


def test_a_draft_equal_to_the_target_is_always_kept() -> None:
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(50))
    assert all(accept_or_resample(p, p, int(rng.choice(50, p=p)), rng)[1] for _ in range(2000))


def test_a_rejected_token_is_never_the_drafted_one() -> None:
    rng = np.random.default_rng(2)
    p, q = np.array([0.1, 0.6, 0.3]), np.array([0.8, 0.1, 0.1])
    for _ in range(500):
        out, ok = accept_or_resample(p, q, 0, rng)
        assert ok or out != 0


def test_draft_probs_follows_llama_cpp_chain() -> None:
    logits = np.array([5.0, 4.0, 3.0, 1.0, 0.0, -1.0])
    greedy = draft_probs(logits, SamplingParams(temp=0.0))
    assert greedy.tolist() == [1, 0, 0, 0, 0, 0]
    top2 = draft_probs(logits, SamplingParams(temp=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert np.count_nonzero(top2) == 2 and top2[0] == pytest.approx(1 / (1 + np.exp(-1)))
    everything = draft_probs(logits, SamplingParams(temp=2.0, top_k=0, top_p=1.0, min_p=0.0))
    z = np.exp(logits / 2.0)
    assert np.allclose(everything, z / z.sum())
    # min_p keeps tokens at least min_p times as likely as the top one (on the raw logits)
    kept = draft_probs(logits, SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.3))
    assert np.count_nonzero(kept) == 2


def test_draft_length_grows_with_acceptance_and_cheap_drafts() -> None:
    length = DraftLength(0, 8)
    assert length.choose() == 8  # nothing measured yet
    for _ in range(30):
        length.drafted(4, 4 * 0.002)  # 2 ms a drafted token
        length.trip(5, 0.050)
        length.trip(1, 0.046)  # a trip costs 46 ms, 1 ms a further row
    for _ in range(40):
        length.decided(True)
    chosen = [length.choose() for _ in range(64)]
    assert chosen.count(8) == 62 and chosen.count(0) == 2  # and a trip of one row now and then, to time it
    for _ in range(60):
        length.decided(False)
    assert length.choose() == 0  # nothing is kept: drafting does not pay
    probes = [length.choose() for _ in range(64 + 128 + 256)]
    # but it tries a token now and then, ever more rarely while that does not pay
    at = [i for i, n in enumerate(probes) if n]
    assert len(at) == 3 and [b - a for a, b in zip(at, at[1:], strict=False)] == [64, 128], at


def test_draft_length_stops_when_drafting_costs_more_than_a_trip() -> None:
    length = DraftLength(0, 8)
    for _ in range(10):
        length.drafted(2, 2 * 0.030)
        length.trip(1, 0.010)
        length.decided(True)
    assert length.choose() == 0


def test_estimate_says_where_speculation_pays() -> None:
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5
    cheap = estimate(draft_token_s=0.002, trip_s=0.050, row_s=0.001, n_min=0, n_max=4)
    assert cheap.pays and cheap.n == 4 and cheap.tpot_s < 0.050 and cheap.break_even < 0.1
    dear = estimate(draft_token_s=0.060, trip_s=0.050, row_s=0.010, n_min=0, n_max=4)
    assert not dear.pays and dear.break_even is None and "does not pay" in dear.describe()
    with pytest.raises(ValueError, match="draft_min"):
        DraftLength(3, 2)
    for bad in ((3, 2), (0, 0), (-1, 2)):
        with pytest.raises(ConfigError, match=r"0 <= draft_min <= draft_max and draft_max >= 1 .*--draft-min"):
            check_draft_length(*bad)
    check_draft_length(0, 1)
