"""Speculative decoding on the head: a draft proposes tokens, the ring verifies them all in one trip.

`Speculation` is what llama-cpp-python's `generate` calls as its `draft_model`: each step it asks the draft for
as many tokens as pay (decoding.DraftLength), remembers them with the distribution each was drawn from, and
RingLlama.sample verifies them against the target (speculative sampling when sampling, equality when greedy).
A draft is a GGUF the head runs itself (`GgufDraft`) or any llama-cpp-python LlamaDraftModel, such as its
LlamaPromptLookupDecoding, which proposes deterministically.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as _ll
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from primaplug.core.errors import ConfigError, EngineError
from primaplug.core.settings import DRAFT_MAX, DRAFT_MIN
from primaplug.decoding import DraftLength, SamplingParams, SpeculationStats, draft_probs
from primaplug.engine.layout import read_layout

VOCAB_SLACK = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE: a draft's vocabulary may differ by this much
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class GgufDraft:
    """A small GGUF model on the head that drafts: it keeps its own KV cache of the conversation and extends it.

    It drafts as many tokens as it is asked for. llama.cpp also stops a greedy draft at a token the draft gives less
    than --draft-p-min (0.75); here the length follows the measured acceptance and costs (decoding.DraftLength)
    instead: on a ring, where a trip costs many drafted tokens, stopping at every uncertain token drafts too little.

    A draft with recurrent layers (Qwen 3.5, LFM2) cannot forget the tokens it drafted one by one: before drafting
    it keeps its sequence's state (llama_state_seq_get_data: the recurrent states and the attention cache), and
    goes back to it when the target kept fewer than it drafted. That costs a copy of the sequence's state a step
    (the attention layers' cache grows with the conversation), against a trip round the ring.
    """

    def __init__(self, path: str | os.PathLike[str], *, n_ctx: int, n_batch: int, n_threads: int) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ConfigError(f"the draft model {self.path} is not a file: pass a GGUF path (--model-draft)")
        self.recurrent = read_layout(self.path).has_recurrent_layers
        self.llm = llama_cpp.Llama(self.path, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, verbose=False)
        self._kept: tuple[ctypes.Array[ctypes.c_uint8], int] | None = None  # a recurrent draft's state, positions
        self.n_vocab = self.llm.n_vocab()
        self.extra_s = 0.0  # the last proposal's catching up beyond one batch

    def check_vocab(self, target_vocab: Any, target_name: str) -> None:
        """Raise ConfigError unless the draft's tokens are the target's (same ids, same text), as llama.cpp asks."""
        check_vocab(self.llm._model.vocab, target_vocab, self.path, target_name)

    def propose(self, context: np.ndarray, n: int, params: SamplingParams, rng: np.random.Generator,
                prefill: tuple[int, int] = (0, 0)) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to n tokens to follow `context`, and (when sampling) the distribution each was drawn from.

        prefill: the positions [start, end) the target evaluated in one batch last (a prompt). The draft catches
        up in the batches the target used where it can (a prompt in one; a trip's at most 3 rows, which llama.cpp
        computes as it computes one): the same batches round the same, so a draft equal to the target that drafts
        every step agrees with it token for token."""
        llm, ctx = self.llm, [int(t) for t in context]
        held = llm.input_ids[: llm.n_tokens]
        m = int(np.argmin(np.append(held[: len(ctx)] == ctx[: len(held)], False))) if len(held) else 0
        at = llm.n_tokens = self._rewind(min(m, len(ctx) - 1))  # Llama.eval forgets positions from n_tokens on
        catch_up = [ctx[a:b] for a, b in _pieces(at, len(ctx), prefill)]
        t0 = time.perf_counter()
        for piece in catch_up[:-1]:
            llm.eval(piece)
        # a step that follows a step which drafted catches up one batch; more is the price of having skipped
        # drafting (or a new prompt), not of a drafted token: DraftLength must not count it as one
        self.extra_s = time.perf_counter() - t0
        llm.eval(catch_up[-1])
        if self.recurrent:
            self._keep()
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(n):
            logits = np.ctypeslib.as_array(_ll.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(self.n_vocab,))
            if params.greedy:
                tok = int(np.argmax(logits))
            else:
                q = draft_probs(logits, params)
                tok = int(rng.choice(len(q), p=q))
                qs.append(q)
            tokens.append(tok)
            if i + 1 < n:
                llm.eval([tok])
        return tokens, (None if params.greedy else qs)

    def _rewind(self, at: int) -> int:
        """Where the draft's context goes on from, at `at` or before: a recurrent draft goes back to the state it
        kept, or, when that lies past `at`, to nothing (Llama.eval then clears its sequence)."""
        if not self.recurrent or at >= self.llm.n_tokens:
            return at
        if self._kept is not None and self._kept[1] <= at:
            data, pos = self._kept
            ctx = self.llm._ctx.ctx
            if _ll.llama_state_seq_set_data(ctx, data, len(data), 0) != len(data):
                raise EngineError("the draft could not go back to the state it kept (llama_state_seq_set_data)")
            return pos
        return 0

    def _keep(self) -> None:
        ctx = self.llm._ctx.ctx
        data = (ctypes.c_uint8 * _ll.llama_state_seq_get_size(ctx, 0))()
        n = _ll.llama_state_seq_get_data(ctx, data, len(data), 0)
        self._kept = (data, self.llm.n_tokens) if n == len(data) else None

    def close(self) -> None:
        self.llm.close()


def _pieces(at: int, end: int, prefill: tuple[int, int]) -> list[tuple[int, int]]:
    """The batches [start, stop) that evaluate positions at..end: the target's last prefill in one, and what
    followed in one trip's batch (at most 3 rows after a step that drafted); after steps that did not draft, the
    stretch in one batch and the last token alone."""
    out: list[tuple[int, int]] = []
    for stop in (prefill[0], prefill[1]):
        if at < stop <= end:
            out.append((at, stop))
            at = stop
    if end - at > 3:  # drafting was skipped for a while: one batch, then the last token as the target ran it
        out.append((at, end - 1))
        at = end - 1
    if at < end:
        out.append((at, end))
    return out


def check_vocab(draft_vocab: Any, target_vocab: Any, draft_name: str, target_name: str) -> None:
    """The draft must speak the target's tokens: the same vocabulary type, BOS and EOS, a size within
    VOCAB_SLACK, and the same text for every token both have."""
    def fail(why: str) -> ConfigError:
        return ConfigError(f"the draft model {draft_name} cannot draft for {target_name}: {why}. Use a draft of the "
                           "same model family (the same tokenizer), e.g. a smaller or more quantized sibling")

    if _ll.llama_vocab_type(draft_vocab) != _ll.llama_vocab_type(target_vocab):
        raise fail("its tokenizer is of another type")
    nd, nt = _ll.llama_vocab_n_tokens(draft_vocab), _ll.llama_vocab_n_tokens(target_vocab)
    if abs(nd - nt) > VOCAB_SLACK:
        raise fail(f"its vocabulary has {nd} tokens, the target's {nt}")
    for what, get in (("BOS", _ll.llama_vocab_bos), ("EOS", _ll.llama_vocab_eos)):
        if get(draft_vocab) != get(target_vocab):
            raise fail(f"its {what} token is {get(draft_vocab)}, the target's {get(target_vocab)}")
    for t in range(min(nd, nt)):
        a, b = _ll.llama_vocab_get_text(draft_vocab, t), _ll.llama_vocab_get_text(target_vocab, t)
        if a != b:
            raise fail(f"token {t} is {a!r} in the draft but {b!r} in the target")


@dataclass
class Drafted:
    """The tokens drafted for positions start, start + 1, ..., and the distribution each was drawn from."""

    start: int
    tokens: list[int]
    qs: list[np.ndarray] | None  # None: drawn deterministically (greedy, or a prompt lookup)


class Speculation(LlamaDraftModel):
    """The draft side of one head: what to draft, how much, and what happened to it (`stats`)."""

    def __init__(self, source: GgufDraft | LlamaDraftModel, *, n_min: int = DRAFT_MIN, n_max: int = DRAFT_MAX,
                 n_vocab: int) -> None:
        self.source = source
        self.length = DraftLength(n_min, n_max)
        self.stats = SpeculationStats()
        self.n_vocab = n_vocab
        self.params = SamplingParams(temp=0.0)
        self.rng = np.random.default_rng()
        self.pending: Drafted | None = None
        self.prefill = (0, 0)  # the positions the target evaluated in one batch last

    def start(self, params: SamplingParams, seed: int | None) -> None:
        """A new generation: its sampler settings, and the random draws of its speculative sampling."""
        self.params, self.rng, self.pending = params, np.random.default_rng(seed), None

    def reset_stats(self) -> None:
        self.stats = SpeculationStats()

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        n = self.length.choose()
        tokens: list[int] = []
        qs: list[np.ndarray] | None = None
        t0 = time.perf_counter()
        if n > 0:
            if isinstance(self.source, GgufDraft):
                tokens, qs = self.source.propose(input_ids, n, self.params, self.rng, self.prefill)
            else:
                tokens = [int(t) for t in np.asarray(self.source(input_ids))[:n]]
            # a draft with a few more tokens than the target: what follows one of those goes
            cut = next((i for i, t in enumerate(tokens) if not 0 <= t < self.n_vocab), len(tokens))
            tokens, qs = tokens[:cut], (qs[:cut] if qs is not None else None)
        seconds = time.perf_counter() - t0
        extra = self.source.extra_s if isinstance(self.source, GgufDraft) and tokens else 0.0
        self.length.drafted(len(tokens), seconds - extra)
        self.stats.draft_s += seconds
        self.pending = Drafted(len(input_ids), tokens, qs) if tokens else None
        return np.array(tokens, dtype=np.intc)

    def at(self, pos: int) -> tuple[int, np.ndarray | None] | None:
        """The token drafted for position pos and its distribution, if one is waiting to be verified there."""
        d = self.pending
        if d is None or not d.start <= pos < d.start + len(d.tokens):
            return None
        i = pos - d.start
        return d.tokens[i], (d.qs[i] if d.qs is not None else None)

    def decided(self, kept: bool) -> None:
        self.length.decided(kept)
        self.stats.drafted += 1
        self.stats.accepted += kept
        if not kept:
            self.pending = None  # the rest was drafted after a token the target did not take

    def verified(self, rows: int, seconds: float, carried_draft: bool) -> None:
        """A trip of `rows` rows round the ring took `seconds` (rows - 1 of them drafted when carried_draft)."""
        self.length.trip(rows, seconds)
        if carried_draft:
            self.stats.steps += 1
            self.stats.verify_s += seconds

    def close(self) -> None:
        if isinstance(self.source, GgufDraft):
            self.source.close()


def target_probs(sampler: Any, ctx: Any, idx: int, n_vocab: int) -> np.ndarray | None:
    """The distribution llama-cpp-python's sampler chain would draw the token at output row `idx` from: every
    sampler of the chain but its final `dist` applied to the row's logits, then softmax. None when the chain does
    not end in `dist` (greedy or mirostat: those are verified by drawing and comparing)."""
    chain = sampler.sampler
    n = _ll.llama_sampler_chain_n(chain)
    if n == 0 or _ll.llama_sampler_name(_ll.llama_sampler_chain_get(chain, n - 1)) != b"dist":
        return None
    logits = np.ctypeslib.as_array(_ll.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))
    data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
    data["id"] = np.arange(n_vocab, dtype=np.int32)
    data["logit"] = logits
    arr = _ll.llama_token_data_array(data=data.ctypes.data_as(_ll.llama_token_data_p), size=n_vocab, selected=-1,
                                     sorted=False)
    for i in range(n - 1):
        _ll.llama_sampler_apply(_ll.llama_sampler_chain_get(chain, i), ctypes.byref(arr))
    kept = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_uint8)),
                                 shape=(arr.size * _TOKEN_DATA.itemsize,)).view(_TOKEN_DATA)
    x = kept["logit"].astype(np.float64)
    top = x.max()
    w = np.where(np.isfinite(x), np.exp(x - top), 0.0)
    p = np.zeros(n_vocab)
    p[kept["id"]] = w / w.sum()
    return p


PROMPT_LOOKUP = "prompt-lookup"  # --model-draft's name for llama-cpp-python's LlamaPromptLookupDecoding


def open_speculation(draft: str | os.PathLike[str] | LlamaDraftModel, *, target: Any, n_ctx: int, n_batch: int,
                     n_threads: int, n_min: int = DRAFT_MIN, n_max: int = DRAFT_MAX) -> Speculation:
    """The speculation for a head whose model is `target` (engine Model): a GGUF path is loaded and its
    vocabulary checked against the target's; "prompt-lookup" drafts from the conversation itself; a LlamaDraftModel
    is used as it is."""
    source = _source(draft, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, n_max=n_max)
    if isinstance(source, GgufDraft):
        try:
            source.check_vocab(target._vocab, os.path.basename(target.path))
        except BaseException:
            source.close()
            raise
    return Speculation(source, n_min=n_min, n_max=n_max, n_vocab=target.layout.n_vocab)


def _source(draft: Any, *, n_ctx: int, n_batch: int, n_threads: int, n_max: int) -> GgufDraft | LlamaDraftModel:
    if draft == PROMPT_LOOKUP:
        return LlamaPromptLookupDecoding(num_pred_tokens=max(1, n_max))
    if isinstance(draft, (str, os.PathLike)):
        return GgufDraft(draft, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
    if isinstance(draft, LlamaDraftModel):
        return draft
    raise ConfigError(f"draft_model must be a GGUF path, {PROMPT_LOOKUP!r} or a llama_cpp LlamaDraftModel, "
                      f"not {type(draft).__name__}")


def measure_draft(draft: Any, *, n_ctx: int, n_batch: int, n_threads: int) -> float:
    """Seconds a drafted token costs on this device, for a plan made before anything is deployed."""
    source = _source(draft, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, n_max=8)
    try:
        context = source.llm.tokenize(b"The ring verifies what the head drafts.") if isinstance(source, GgufDraft) \
            else list(range(1, 33))
        return draft_token_seconds(source, context)
    finally:
        if isinstance(source, GgufDraft) and source is not draft:
            source.close()


def draft_token_seconds(source: GgufDraft | LlamaDraftModel, context: list[int], tokens: int = 8) -> float:
    """What drafting one token costs on this device, measured: a GGUF draft decodes `tokens` tokens after
    `context` (once first, so that the context is in its cache); any other draft is timed on that context."""
    ids = np.asarray(context, dtype=np.intc)
    if isinstance(source, GgufDraft):
        greedy, rng = SamplingParams(temp=0.0), np.random.default_rng(0)
        source.propose(ids, 1, greedy, rng)
        t0 = time.perf_counter()
        source.propose(ids, tokens, greedy, rng)
        return (time.perf_counter() - t0) / tokens
    t0 = time.perf_counter()
    out = source(ids)
    return (time.perf_counter() - t0) / max(1, len(out))
