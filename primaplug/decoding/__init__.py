"""Turning logits into tokens: samplers and the token loop. Pure over token ids and logits."""

from primaplug.decoding.generate import GenerationStats, generate
from primaplug.decoding.sampling import Sampler, SamplingParams

__all__ = ["GenerationStats", "Sampler", "SamplingParams", "generate"]
