"""A row rounds the same whatever batch it is decoded in (patch 0010): the head can batch the decode rows of several
sequences (one or a few rows each) into one llama_decode and hand each sequence the logits that decoding it alone
gives, bit for bit; and llama_window_set_logits hands a sequence's context rows of logits computed elsewhere.

Plain llama-cpp-python's low-level API on the bundled Gemma model, no primaplug code but the binding of
llama_window_set_logits."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from tests.ring_helpers import THREADS

N_CTX_SEQ = 256  # every sequence's share of a context's cache (llama.cpp splits n_ctx between the sequences)
N_BATCH = 64
N_SEQ = 8
PROMPTS = [
    "The history of the Roman empire begins",
    "def fibonacci(n):",
    "Pipelined-ring parallelism splits a model into windows of layers, and each device runs its own",
    "Once upon a time",
    "The capital of France is",
    "import numpy as np\nx =",
    "Rain fell on the quiet town all night, and by morning",
    "1, 2, 3, 5, 8,",
]
# trips: (the sequences in one llama_decode, rows for each): 1, 2, 3, 4, 8 and 15 rows in all, one row or a
# speculative-style trip of 2-3 rows per sequence. [1, 3, 6] are not consecutive ids: llama.cpp's split for
# separate caches (split_equal, sequential) then makes one micro-batch per sequence, which must round the same too
TRIPS: list[tuple[list[int], int]] = [
    ([0], 1),
    ([0, 1], 1),
    ([0, 1, 2], 1),
    ([0, 1, 2, 3], 1),
    ([0, 1], 2),
    (list(range(8)), 1),
    ([0, 1, 2, 3], 2),
    ([0, 1, 2, 3, 4], 3),
    ([1, 3, 6], 1),
    (list(range(7)), 2),
    ([0, 1, 2, 3, 4], 3),
]


def _ll() -> Any:
    from llama_cpp import llama_cpp as ll

    return ll


@contextmanager
def _model(path: Path) -> Iterator[Any]:
    ll = _ll()
    ll.llama_backend_init()
    params = ll.llama_model_default_params()  # repacked weights (use_extra_bufts), as plain llama-cpp-python
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    assert model
    try:
        yield model
    finally:
        ll.llama_model_free(model)


def _params(n_seq: int, n_ctx: int | None = None, n_batch: int = N_BATCH) -> Any:
    ll = _ll()
    p = ll.llama_context_default_params()
    p.n_ctx = n_ctx or N_CTX_SEQ * n_seq
    p.n_batch = p.n_ubatch = n_batch
    p.n_seq_max = n_seq
    p.kv_unified = False  # llama.cpp's default: a cache per sequence
    p.n_threads = p.n_threads_batch = THREADS
    p.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama_cpp.Llama and primaplug's windows
    return p


@contextmanager
def _context(model: Any, params: Any) -> Iterator[Any]:
    ll = _ll()
    ctx = ll.llama_init_from_model(model, params)
    assert ctx
    try:
        yield ctx
    finally:
        ll.llama_free(ctx)


def _n_vocab(model: Any) -> int:
    ll = _ll()
    return int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model)))


def _tokenize(model: Any, text: str) -> list[int]:
    ll = _ll()
    vocab = ll.llama_model_get_vocab(model)
    raw = text.encode()
    buf = (ll.llama_token * (len(raw) + 8))()
    n = ll.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
    assert 0 < n <= len(buf)
    return list(buf[:n])


def _decode(ctx: Any, rows: Sequence[tuple[int, int, int, bool]]) -> None:
    """One llama_decode of rows (token, position, seq_id, wants logits)."""
    ll = _ll()
    batch = ll.llama_batch_init(len(rows), 0, 1)
    try:
        for i, (tok, pos, seq, out) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, out
        batch.n_tokens = len(rows)
        assert ll.llama_decode(ctx, batch) == 0
    finally:
        ll.llama_batch_free(batch)


def _logits(ctx: Any, i: int, n_vocab: int) -> np.ndarray:
    ptr = _ll().llama_get_logits_ith(ctx, i)
    assert ptr
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()


def _prompt_rows(prompt: list[int], seq: int) -> list[tuple[int, int, int, bool]]:
    return [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]


def _alone(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """A sequence decoded alone in its own context: the prompt in one batch (as the batched context does too),
    then its greedy continuation one token at a time. Returns the tokens and the logits after the prompt and
    after each token."""
    n_vocab = _n_vocab(model)
    with _context(model, _params(1)) as ctx:
        _decode(ctx, _prompt_rows(prompt, 0))
        rows = [_logits(ctx, -1, n_vocab)]
        tokens: list[int] = []
        for step in range(steps):
            tokens.append(int(np.argmax(rows[-1])))
            _decode(ctx, [(tokens[-1], len(prompt) + step, 0, True)])
            rows.append(_logits(ctx, -1, n_vocab))
    return tokens, rows


def test_rows_of_several_sequences_round_as_each_alone(gemma_path: Path) -> None:
    """The decode rows of up to 8 sequences in one llama_decode (1 to 15 rows in all, 1-3 per sequence) give each
    sequence's logits bit for bit as decoding it alone one token at a time. Without patch 0010 a batch of 4 or more
    rows takes llamafile's sgemm (Q5_0, Q8_0 here) and the repacked weights' gemm (Q4_K), which round differently
    (from the first trip of 4 rows on)."""
    with _model(gemma_path) as model:
        n_vocab = _n_vocab(model)
        prompts = [_tokenize(model, text) for text in PROMPTS]
        steps = [sum(n for seqs, n in TRIPS if s in seqs) for s in range(N_SEQ)]
        alone = [_alone(model, prompts[s], steps[s]) for s in range(N_SEQ)]

        with _context(model, _params(N_SEQ)) as ctx:
            for s, prompt in enumerate(prompts):  # each prompt alone, one batch each
                _decode(ctx, _prompt_rows(prompt, s))
                assert np.array_equal(_logits(ctx, -1, n_vocab), alone[s][1][0]), f"prompt of sequence {s}"
            done = [0] * N_SEQ  # tokens of its greedy continuation each sequence has decoded
            mismatches = []
            for trip, (seqs, n) in enumerate(TRIPS):
                rows = [(alone[s][0][done[s] + j], len(prompts[s]) + done[s] + j, s, True)
                        for s in seqs for j in range(n)]
                _decode(ctx, rows)
                for i, (s, j) in enumerate((s, j) for s in seqs for j in range(n)):
                    want = alone[s][1][done[s] + j + 1]
                    if not np.array_equal(_logits(ctx, i, n_vocab), want):
                        mismatches.append(f"trip {trip} ({len(rows)} rows): sequence {s} row {j}")
                for s in seqs:
                    done[s] += n
            assert not mismatches, "rows round differently in a batch than alone:\n" + "\n".join(mismatches)


def test_set_logits_rows_are_read_as_decoded_ones(gemma_path: Path) -> None:
    """llama_window_set_logits: llama_get_logits_ith(-k) and llama_get_logits return the rows given, and a greedy
    sampler picks the argmax of the last one, on a plain context and on an output-only window context; a window
    that outputs its hidden state keeps no logits and says so."""
    ll = _ll()
    from primaplug.engine import _native

    with _model(gemma_path) as model:
        n_vocab = _n_vocab(model)
        n_layer = int(ll.llama_model_n_layer(model))
        rng = np.random.default_rng(0)
        plain = ll.llama_init_from_model(model, _params(4))
        output_only = _native.llama_init_window_from_model(model, _params(1), n_layer, n_layer, False)
        hidden = _native.llama_init_window_from_model(model, _params(1), 0, 1, True)
        assert plain and output_only and hidden
        try:
            _decode(plain, _prompt_rows(_tokenize(model, PROMPTS[0]), 0))  # a decode's rows are replaced
            for ctx in (plain, output_only):
                for n_rows in (1, 3, 2):
                    given = rng.standard_normal((n_rows, n_vocab), dtype=np.float32)
                    given[-1, 1234 + n_rows] = 100.0  # the last row's argmax
                    rows = given.copy()
                    ptr = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                    assert _native.llama_window_set_logits(ctx, ptr, n_rows) == 0
                    rows[:] = 0  # the context holds a copy
                    for k in range(1, n_rows + 1):
                        assert np.array_equal(_logits(ctx, -k, n_vocab), given[n_rows - k])
                        assert np.array_equal(_logits(ctx, n_rows - k, n_vocab), given[n_rows - k])
                    got = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(n_rows, n_vocab))
                    assert np.array_equal(got, given)
                    smpl = ll.llama_sampler_init_greedy()
                    try:
                        assert ll.llama_sampler_sample(smpl, ctx, -1) == 1234 + n_rows
                    finally:
                        ll.llama_sampler_free(smpl)
                # wrong row counts are refused, the rows held stay
                assert _native.llama_window_set_logits(ctx, ptr, 0) == -1
                assert _native.llama_window_set_logits(ctx, ptr, N_BATCH + 1) == -1
                assert _native.llama_window_set_logits(ctx, None, 1) == -1
                assert np.array_equal(_logits(ctx, -1, n_vocab), given[-1])
            one = np.ones(n_vocab, dtype=np.float32)
            assert _native.llama_window_set_logits(
                hidden, one.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1) == -1
        finally:
            for ctx in (plain, output_only, hidden):
                if ctx:
                    ll.llama_free(ctx)
