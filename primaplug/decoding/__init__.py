"""Speculative decoding's arithmetic, pure: verifying a drafted token (speculative sampling), the draft's own
distribution, how many tokens to draft, and whether drafting pays on a ring (`estimate`).

Nothing here runs a model: the head's llama.cpp side (engine/speculative.py) drafts and verifies with these.
"""

from primaplug.decoding.length import (
    DraftLength,
    SpeculationEstimate,
    check_draft_length,
    estimate,
    expected_tokens,
)
from primaplug.decoding.sampling import SamplingParams, accept_or_resample, draft_probs
from primaplug.decoding.stats import SpeculationStats

__all__ = [
    "DraftLength",
    "SamplingParams",
    "SpeculationEstimate",
    "SpeculationStats",
    "accept_or_resample",
    "check_draft_length",
    "draft_probs",
    "estimate",
    "expected_tokens",
]
