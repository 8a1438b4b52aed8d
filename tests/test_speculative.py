"""Speculative decoding on the head against plain llama-cpp-python: a draft changes how many tokens a trip round the
ring carries, never which tokens come out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import synthetic_path
from tests.ring_helpers import LLAMA_KWARGS, THREADS

KWARGS = dict(LLAMA_KWARGS, logits_all=False)
PROMPT = "The history of the Roman empire begins"
N = 40


def _plain_greedy(path: Path, **extra: Any) -> str:
    import llama_cpp

    plain = llama_cpp.Llama(str(path), **KWARGS, **extra)
    try:
        return plain(PROMPT, max_tokens=N, temperature=0.0)["choices"][0]["text"]
    finally:
        plain.close()


class Scripted:
    """A LlamaDraftModel that proposes the given continuation, with a wrong token at draft position `wrong` of every
    step (cycling through the positions when wrong is None), and runs `check` before each proposal."""

    def __init__(self, continuation: list[int], prompt_len: int, n: int, wrong: int | None,
                 check: Callable[[], None] = lambda: None, n_vocab: int = 1005) -> None:
        from llama_cpp.llama_speculative import LlamaDraftModel

        LlamaDraftModel.register(Scripted)
        self.continuation, self.prompt_len, self.n, self.wrong = continuation, prompt_len, n, wrong
        self.n_vocab = n_vocab
        self.check, self.calls = check, 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        self.check()
        at = len(input_ids) - self.prompt_len
        out = list(self.continuation[at : at + self.n])
        wrong = self.calls % self.n if self.wrong is None else self.wrong
        if wrong < len(out):
            out[wrong] = (out[wrong] + 1) % (self.n_vocab - 5) + 5  # a token the target will not choose
        self.calls += 1
        return np.array(out, dtype=np.intc)


def test_draft_equal_to_target_is_always_kept_and_changes_nothing(gemma_path: Path) -> None:
    import primaplug

    want = _plain_greedy(gemma_path)
    llm = primaplug.Llama(gemma_path, layers=[9, 9], draft_model=gemma_path, draft_min=2, **KWARGS)
    try:
        got = llm(PROMPT, max_tokens=N, temperature=0.0)["choices"][0]["text"]
        stats = llm.speculation.stats
    finally:
        llm.close()
    assert got == want
    assert stats.drafted > N // 2 and stats.accepted == stats.drafted, stats.describe()


def test_sampling_with_draft_equal_to_target_keeps_nearly_everything(gemma_path: Path) -> None:
    """Speculative sampling keeps a drafted token with probability min(1, p/q): with q = p, always, up to the
    draft computing its distribution in numpy and the target in llama.cpp's sampler chain."""
    import primaplug

    llm = primaplug.Llama(gemma_path, draft_model=gemma_path, draft_min=2, seed=3, **KWARGS)
    try:
        out = llm(PROMPT, max_tokens=N, temperature=0.8, top_k=40, top_p=0.95)["choices"][0]["text"]
        stats = llm.speculation.stats
    finally:
        llm.close()
    assert out and stats.drafted > 10
    assert stats.acceptance_rate > 0.9, stats.describe()


def test_target_probs_is_the_distribution_llama_cpp_samples_from(gemma_path: Path) -> None:
    """The p of speculative sampling comes from llama-cpp-python's own sampler chain; numpy's copy of that chain
    (the draft's q) must agree with it on a real row of logits."""
    import llama_cpp

    from primaplug.decoding import SamplingParams, draft_probs
    from primaplug.engine.speculative import target_probs

    plain = llama_cpp.Llama(str(gemma_path), **KWARGS)
    try:
        plain.eval(plain.tokenize(PROMPT.encode()))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(plain._ctx.ctx, -1),
                                       shape=(plain.n_vocab(),)).copy()
        for params in (SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
                       SamplingParams(temp=1.5, top_k=0, top_p=0.5, min_p=0.0)):
            sampler = plain._init_sampler(temp=params.temp, top_k=params.top_k, top_p=params.top_p,
                                          min_p=params.min_p)
            p = target_probs(sampler, plain._ctx.ctx, -1, plain.n_vocab())
            q = draft_probs(logits, params)
            assert p is not None and np.abs(p - q).max() < 1e-5
        assert target_probs(plain._init_sampler(temp=0.0), plain._ctx.ctx, -1, plain.n_vocab()) is None
    finally:
        plain.close()


def greedy_tokens(llm: Any, prompt: list[int]) -> list[int]:
    """N greedy tokens after the prompt, through llama-cpp-python's generate loop (where drafts go)."""
    out: list[int] = []
    for t in llm.generate(prompt, temp=0.0):
        out.append(int(t))
        if len(out) == N:
            break
    return out


def scripted_run(llm_factory: Callable[[Scripted], Any], prompt: list[int], want: list[int], wrong: int | None,
                 check: Callable[[Any], Any], n_vocab: int = 1005) -> tuple[list[int], list[tuple[int, int, Any]], Any]:
    """Generate through a Llama whose draft is Scripted; before each draft, record (positions the session says the
    ring holds, its prefix's length, check(llm)). Returns the tokens, the records and the speculation's stats."""
    box: dict[str, Any] = {}
    seen: list[tuple[int, int, Any]] = []

    def record() -> None:
        if "llm" in box:
            llm = box["llm"]
            seen.append((llm.session.held, len(llm.session.prefix), check(llm)))

    llm = box["llm"] = llm_factory(Scripted(want + [5] * 8, len(prompt), 2, wrong, record, n_vocab))
    try:
        return greedy_tokens(llm, prompt), seen, llm.speculation.stats
    finally:
        llm.close()


def _plain_tokens(path: Path) -> tuple[list[int], list[int]]:
    """The prompt's tokens, and plain llama-cpp-python's N greedy tokens after it."""
    import llama_cpp

    plain = llama_cpp.Llama(str(path), **KWARGS)
    try:
        prompt = plain.tokenize(PROMPT.encode())
        return prompt, greedy_tokens(plain, prompt)
    finally:
        plain.close()


def _held_everywhere(llm: Any) -> list[int]:
    """The positions each of the head's window contexts and each node holds."""
    from primaplug.engine import one_per_context

    local = [w.kv_pos_max() + 1 for w in one_per_context(llm._device.windows)]
    return local + [n.status().kv_positions for n in llm.cluster.nodes]


@pytest.mark.parametrize("wrong", [0, 1])
def test_a_rejected_draft_token_changes_nothing(gemma_path: Path, wrong: int) -> None:
    """Drafts of two tokens (the default most), the first or the second wrong at every step: the target rejects
    it, every window forgets the rejected positions with the next trip, and the output is plain
    llama-cpp-python's."""
    import primaplug

    prompt, want = _plain_tokens(gemma_path)
    got, seen, stats = scripted_run(
        lambda draft: primaplug.Llama(gemma_path, layers=[6, 6, 6], draft_model=draft, draft_min=2, **KWARGS),
        prompt, want, wrong, _held_everywhere)
    assert got == want
    assert len(seen) > N // 3 and all(held == [h] * len(held) for h, _, held in seen), seen
    # rewinds cost no trip: the rejected positions stay until the next trip, which starts where the prefix ends
    # (llama.cpp refuses a batch that does not continue what its cache holds: every window forgot them first)
    assert any(h > kept for h, kept, _ in seen)
    kept_per_step = 0 if wrong == 0 else 1
    assert stats.drafted > N // 3 and abs(stats.accepted - kept_per_step * stats.drafted / 2) <= 1, stats.describe()


@pytest.mark.parametrize(("arch", "ftype"), [("qwen3moe", "Q4_K_M"), ("gpt-oss", "MXFP4_MOE"), ("glm4moe", "Q4_K_M"),
                                             ("deepseek2", "Q4_K_M")])
def test_a_rejected_draft_changes_nothing_on_a_mixture_of_experts(model_dir: Path, arch: str, ftype: str) -> None:
    """The same on mixtures of experts (the experts a token routes to are chosen again when its position is computed
    again; gpt-oss's sliding window forgets positions too): each draft has a wrong token, the first or the second in
    turn, over two windows of the head."""
    path = synthetic_path(model_dir, arch, 7, ftype)
    _rejected_drafts_change_nothing(path, lambda draft: _head_windows(path, draft))


def _head_windows(path: Path, draft: Any, **extra: Any) -> Any:
    import primaplug

    return primaplug.Llama(path, layers=[3, 4], draft_model=draft, draft_min=2, **KWARGS, **extra)


def _rejected_drafts_change_nothing(path: Path, make: Callable[[Scripted], Any]) -> None:
    """A wrong token in every draft, the first or the second in turn: the tokens are plain's, and the rejected
    positions were forgotten (held past the prefix until the next trip)."""
    from primaplug.engine import read_layout

    prompt, want = _plain_tokens(path)
    got, seen, stats = scripted_run(make, prompt, want, None, _held_everywhere, n_vocab=read_layout(path).n_vocab)
    assert got == want
    assert stats.drafted > N // 3 and any(h > kept for h, kept, _ in seen), stats.describe()


def test_a_draft_of_another_vocabulary_is_refused(gemma_path: Path, model_dir: Path) -> None:
    import primaplug
    from primaplug.core.errors import ConfigError

    other = synthetic_path(model_dir, "llama", 7, "Q8_0")
    with pytest.raises(ConfigError, match="cannot draft for .*same tokenizer"):
        primaplug.Llama(gemma_path, draft_model=other, **KWARGS)
    with pytest.raises(ConfigError, match="not a file"):
        primaplug.Llama(gemma_path, draft_model=str(model_dir / "missing.gguf"), **KWARGS)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "lfm2", "lfm2moe"])
def test_a_rejected_draft_is_rolled_back_on_recurrent_layers(model_dir: Path, arch: str) -> None:
    """Qwen 3.5's gated delta-net and LFM2's short convolutions keep a state that cannot forget positions; with a
    snapshot a drafted token (n_rs_seq) every window rolls it back past the rejected tokens, and the output is plain
    llama-cpp-python's, over two windows of the head with a wrong token in every draft."""
    path = synthetic_path(model_dir, arch, 7, "Q8_0")
    _rejected_drafts_change_nothing(path, lambda draft: _head_windows(path, draft))


@pytest.mark.multiproc
def test_a_rejected_draft_is_rolled_back_on_the_nodes(model_dir: Path, tmp_path: Path) -> None:
    """The same over two real nodes: the assignment asks each window for its snapshots (Assignment.n_rs_seq), and
    the nodes roll back with the KV operation that comes before the next trip."""
    from primaplug.head.launch import LocalNodes

    path = synthetic_path(model_dir, "qwen35", 7, "Q8_0")
    with LocalNodes(path, 2, log_dir=tmp_path / "logs") as nodes:
        _rejected_drafts_change_nothing(
            path, lambda draft: _head_windows(path, draft, nodes=nodes.addresses, scheduler="even"))


def test_a_node_refuses_snapshots_no_batch_could_use(streaming_model: Path) -> None:
    """Assignment.n_rs_seq comes over the wire: a node takes 0 to a batch's tokens, and says so otherwise, before
    llama.cpp sizes its states by it."""
    import msgspec

    from primaplug.engine import read_layout
    from primaplug.node.daemon import _check_assignment
    from primaplug.wire import Assignment, ModelIdentity, WindowSpec

    layout = read_layout(streaming_model)
    a = Assignment(epoch=1, model=ModelIdentity.of(layout, "m.gguf"), windows=(WindowSpec(0, 3),),
                   successor="tcp://127.0.0.1:9", n_ctx=64, n_batch=32, n_ubatch=32)
    for n in (0, 4, 32):
        assert _check_assignment(msgspec.structs.replace(a, n_rs_seq=n), layout) == ""
    for n in (-1, 33, 2**40):
        assert "recurrent-state snapshots" in _check_assignment(msgspec.structs.replace(a, n_rs_seq=n), layout)


def test_a_draft_for_a_model_that_cannot_roll_back_is_refused(model_dir: Path) -> None:
    """Qwen3-Next's delta-net keeps no per-token snapshots in llama.cpp: refused before anything loads, saying what
    to turn off."""
    import primaplug
    from primaplug.core.errors import ConfigError

    with pytest.raises(ConfigError, match="recurrent layers.*without a draft model"):
        primaplug.Llama(synthetic_path(model_dir, "qwen3next", 7, "Q8_0"), draft_model="prompt-lookup", **KWARGS)


def test_a_draft_with_recurrent_layers_goes_back_to_the_state_it_kept(model_dir: Path) -> None:
    """A Qwen 3.5 draft drafts a token a call; when the target rejects its first token it goes back to the state it
    kept before drafting, and then proposes exactly what a draft that never saw the rejected tokens proposes; its
    own llama_decode never sees a state ahead of its positions (it failed so before)."""
    from primaplug.decoding import SamplingParams
    from primaplug.engine.speculative import GgufDraft

    path = synthetic_path(model_dir, "qwen35", 7, "Q8_0")
    greedy, rng = SamplingParams(temp=0.0), np.random.default_rng(0)
    prompt = list(range(10, 40))
    draft = GgufDraft(path, n_ctx=256, n_batch=64, n_threads=THREADS)
    try:
        assert draft.recurrent
        first, _ = draft.propose(np.array(prompt), 3, greedy, rng)
        rejected = prompt + [(first[0] + 1) % 900 + 5]  # the target chose another token than the draft's first
        again, _ = draft.propose(np.array(rejected), 3, greedy, rng)
        kept = rejected + again[:1]  # the next step keeps one drafted token
        last, _ = draft.propose(np.array(kept + [7]), 3, greedy, rng)
    finally:
        draft.close()
    for context, got in ((rejected, again), (kept + [7], last)):
        fresh = GgufDraft(path, n_ctx=256, n_batch=64, n_threads=THREADS)
        try:
            assert fresh.propose(np.array(context), 3, greedy, rng)[0] == got
        finally:
            fresh.close()


def test_batches_of_up_to_three_rows_round_as_one_row(gemma_path: Path) -> None:
    """Why a trip of up to 3 rows gives plain decoding's tokens (patch 0009, repack.cpp): plain llama-cpp-python's
    logits for a greedy continuation evaluated in batches of 2, of 3 and of 1-3 rows equal, bit for bit, those of
    one token at a time."""
    import llama_cpp

    plain = llama_cpp.Llama(str(gemma_path), **dict(KWARGS, logits_all=True))
    try:
        prompt = plain.tokenize(PROMPT.encode())
        plain.eval(prompt)
        one_by_one, out = [], []
        for _ in range(24):
            one_by_one.append(plain.scores[plain.n_tokens - 1].copy())
            out.append(int(np.argmax(one_by_one[-1])))
            plain.eval([out[-1]])
        for sizes in ([2], [3], [1, 2, 3]):
            plain.reset()
            plain.eval(prompt)
            i = 0
            while i < len(out):
                n = sizes[i % len(sizes)]
                plain.eval(out[i : i + n])
                i += n
            batched = plain.scores[len(prompt) - 1 : len(prompt) - 1 + len(out)]
            assert np.array_equal(batched, np.array(one_by_one)), f"batches of {sizes} rows round differently"
    finally:
        plain.close()
