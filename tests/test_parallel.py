"""Many requests in flight on one ring (continuous batching, head/batching.py), over real node processes: every
request gets the tokens plain llama-cpp-python gives it alone, whatever else is in flight; steps of several requests
really travel together; a request that waits for a sequence, a stream closed early and logprobs behave as they do
in llama-cpp-python."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.ring_helpers import THREADS

pytestmark = pytest.mark.multiproc

KWARGS: dict[str, Any] = dict(n_ctx=256, n_batch=64, n_ubatch=32, n_threads=THREADS, n_threads_batch=THREADS,
                              verbose=False)
PROMPTS = [
    "The three primary colors are",
    "Once upon a time, in a village by the sea, there lived",
    "def fibonacci(n):",
    "The capital of France is Paris. The capital of Germany is",
    "Pipelined-ring parallelism splits a model into windows of layers, one per device, and",
    "Water boils at",
]
MAX_TOKENS = 10


# the second with a sliding window on alternate layers, the third, fifth and sixth with recurrent layers, the
# fourth with latent attention and grouped routing
MOE = {"qwen3moe": "Q4_K_M", "gpt-oss": "MXFP4_MOE", "qwen35moe": "Q4_K_M", "deepseek2": "Q4_K_M",
       "lfm2moe": "Q4_K_M", "qwen3next": "Q4_K_M", "minimax-m2": "Q4_K_M",
       "kimi-linear": "Q4_K_M", "deepseek32": "Q4_K_M",
       "glm-dsa": "Q4_K_M", "glm-5.2": "Q4_K_M",
       "gemma4-e2b": "Q4_K_M"}  # the last dense: each request's rows with its per-layer inputs
# the layers per node, then the head's (3, 3, 1 but where a model's shared-KV tail must be the last window's, and
# where GLM 5.2's windows must start at a layer with an indexer of its own)
IN_FLIGHT_LAYERS = {"gemma4-e2b": [2, 2, 3], "glm-5.2": [2, 4, 1]}


@pytest.fixture(scope="module")
def moe_paths(model_dir: Path) -> dict[str, Path]:
    from tests.conftest import synthetic_path

    return {arch: synthetic_path(model_dir, arch, 7, ftype) for arch, ftype in MOE.items()}


@pytest.fixture(scope="module")
def nodes(gemma_path: Path, moe_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 2, log_dir=tmp_path_factory.mktemp("node-logs"),
                    extra_args=[a for p in moe_paths.values() for a in ("--model", str(p))]) as local:
        yield local


@pytest.fixture(scope="module")
def alone(gemma_path: Path) -> dict[str, str]:
    """Each prompt's greedy completion from plain llama-cpp-python, one request at a time on a fresh cache."""
    import llama_cpp

    plain = llama_cpp.Llama(str(gemma_path), **KWARGS)
    try:
        out = {}
        for p in PROMPTS:
            plain.reset()  # no prefix reuse: each request as on a fresh sequence
            out[p] = plain.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]
        return out
    finally:
        plain.close()


def _at_once(llm: Any, prompts: list[str], stream: bool = False) -> dict[str, str]:
    """Each prompt's completion, all sent from their own threads at the same moment."""
    results: dict[str, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def one(p: str) -> None:
        try:
            start.wait()
            if stream:
                results[p] = "".join(c["choices"][0]["text"] for c in llm.create_completion(
                    p, max_tokens=MAX_TOKENS, temperature=0.0, stream=True))
            else:
                results[p] = llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("split", [{"scheduler": "even"}, {"layers": [3, 3, 3], "rounds": 2}],
                         ids=["even", "3+3+head3x2"])
def test_requests_in_flight_get_the_tokens_they_get_alone(gemma_path: Path, nodes: Any, alone: dict[str, str],
                                                          split: dict[str, Any]) -> None:
    import primaplug

    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses, node_threads=1, n_parallel=4, **split, **KWARGS)
    try:
        got = _at_once(llm, PROMPTS[:4], stream=True)
        assert got == {p: alone[p] for p in PROMPTS[:4]}
        stats = llm._batcher.stats
        # the steps of several requests went round together, and several trips were in the ring at once
        assert stats.mixed > 0 and stats.most_steps >= 2, stats
        assert stats.most_in_flight >= 2, stats
        assert llm.requests_running == 0 and llm.requests_waiting == 0
    finally:
        llm.close()


@pytest.mark.parametrize("arch", MOE)
def test_mixture_of_experts_requests_in_flight_get_what_they_get_alone(moe_paths: dict[str, Path], nodes: Any,
                                                                        arch: str) -> None:
    """Mixtures of experts (and Gemma 4 E2B, whose rows carry per-layer inputs), three requests at once over two
    nodes: each routes its own tokens to its own experts (each row its own per-layer inputs), and gets the tokens
    plain llama-cpp-python gives it alone. One trip in the ring at a time, so that their steps
    travel together whatever the timing: with a trip per device, three requests on three devices could each have
    its own trip (the suite once saw 32 trips of one step each)."""
    import llama_cpp

    import primaplug
    from primaplug.engine import read_layout

    moe_path = moe_paths[arch]
    n_vocab = read_layout(moe_path).n_vocab
    prompts = [[3 + (i * 7919 + k * 101) % (n_vocab - 3) for i in range(20 + 7 * k)] for k in range(3)]
    plain = llama_cpp.Llama(str(moe_path), **KWARGS)
    try:
        alone = {}
        for p in prompts:
            plain.reset()
            alone[tuple(p)] = plain.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]
    finally:
        plain.close()
    llm = primaplug.Llama(moe_path, nodes=nodes.addresses, node_threads=1,
                          layers=IN_FLIGHT_LAYERS.get(arch, [3, 3, 1]), n_parallel=3,
                          ring_trips=1, **KWARGS)
    try:
        start = threading.Barrier(len(prompts))

        def one(p: list[int]) -> str:
            start.wait()
            return llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = dict(zip(map(tuple, prompts), pool.map(one, prompts), strict=True))
        assert got == alone
        assert llm._batcher.stats.mixed > 0, llm._batcher.stats
    finally:
        llm.close()


def test_more_requests_than_sequences_wait_their_turn(gemma_path: Path, nodes: Any, alone: dict[str, str]) -> None:
    """Six requests on two sequences: four wait, each is served once a sequence frees, none is lost or mixed up, and
    each gets its text alone (a sequence that shares less than half of a prompt starts afresh). A later request with
    an earlier prompt finds it on the sequence that holds it (prefix reuse), as plain llama-cpp-python's second
    call of the same prompt does."""
    import primaplug

    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses, node_threads=1, scheduler="even", n_parallel=2,
                          **KWARGS)
    try:
        waited: list[int] = []
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                waited.append(llm.requests_waiting)
                watching.wait(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            got = _at_once(llm, PROMPTS)
        finally:
            watching.set()
            watcher.join()
        assert max(waited) >= 1
        assert got == alone
        again = llm.create_completion(PROMPTS[-1], max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    import llama_cpp

    plain = llama_cpp.Llama(str(gemma_path), **KWARGS)
    try:
        for _ in range(2):  # the second call reuses the first's prompt
            want = plain.create_completion(PROMPTS[-1], max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]
    finally:
        plain.close()
    assert again == want


def test_a_stream_closed_early_frees_its_sequence(gemma_path: Path, nodes: Any, alone: dict[str, str]) -> None:
    import primaplug

    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses, node_threads=1, scheduler="even", n_parallel=1,
                          **KWARGS)
    try:
        stream = llm.create_completion(PROMPTS[0], max_tokens=50, temperature=0.0, stream=True)
        next(stream)
        assert llm.requests_running == 1
        stream.close()
        assert llm.requests_running == 0
        # the one sequence serves the next request at once, with plain's text
        text = llm.create_completion(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]
        llm.reset()
        assert text == alone[PROMPTS[1]]
    finally:
        llm.close()


def test_logprobs_with_echo_equal_plain_llama_cpp(gemma_path: Path, nodes: Any) -> None:
    """logprobs need no logits_all on the ring (plain llama-cpp-python refuses them without it): the ring keeps
    logits for the rows they read, this request only; with echo, every prompt row's. (Without echo, through the
    server: tests/test_serve.py.)"""
    import llama_cpp

    import primaplug

    # a short prompt: llama-cpp-python ranks each echoed row's 262k logprobs in Python (this test alone: 20.0 s with
    # a 13-token prompt, 12.0 s with these 4 tokens)
    prompt, kw = PROMPTS[5], dict(max_tokens=4, temperature=0.0, logprobs=3, echo=True)
    plain = llama_cpp.Llama(str(gemma_path), logits_all=True, **KWARGS)
    try:
        want = plain.create_completion(prompt, **kw)["choices"][0]
    finally:
        plain.close()
    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses, node_threads=1, scheduler="even", **KWARGS)
    try:
        got = llm.create_completion(prompt, **kw)["choices"][0]
        plain_after = llm.create_completion(prompt, max_tokens=4, temperature=0.0)["choices"][0]  # logprobs off again
    finally:
        llm.close()
    assert got["text"] == want["text"] and plain_after["text"] == want["text"].removeprefix(prompt)
    g, w = got["logprobs"], want["logprobs"]
    assert g["tokens"] == w["tokens"] and g["text_offset"] == w["text_offset"]
    lp_g = np.array([x if x is not None else 0.0 for x in g["token_logprobs"]])
    lp_w = np.array([x if x is not None else 0.0 for x in w["token_logprobs"]])
    assert np.allclose(lp_g, lp_w, atol=2e-3), (lp_g, lp_w)
    for tg, tw in zip(g["top_logprobs"], w["top_logprobs"], strict=True):
        if tw is None:
            assert tg is None
            continue
        assert list(tg) == list(tw)
        assert np.allclose(list(tg.values()), list(tw.values()), atol=2e-3)


def test_embeddings_equal_plain_llama_cpp(gemma_path: Path, nodes: Any) -> None:
    """embedding=True: each input goes round the ring and the head's output-only window applies the output norm (and
    the model's pooling), as llama.cpp does for the whole model; the sequence then serves completions as before."""
    import llama_cpp

    import primaplug

    texts = ["The sky is blue because of Rayleigh scattering.", "Embeddings map text to vectors."]
    plain = llama_cpp.Llama(str(gemma_path), embedding=True, **KWARGS)
    try:
        want = [plain.create_embedding(t) for t in texts]
        want_completion = plain.create_completion(PROMPTS[0], max_tokens=4, temperature=0.0)["choices"][0]["text"]
    finally:
        plain.close()
    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses, node_threads=1, scheduler="even", embedding=True,
                          n_parallel=2, **KWARGS)
    try:
        got = [llm.create_embedding(t) for t in texts]
        completion = llm.create_completion(PROMPTS[0], max_tokens=4, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    for g, w in zip(got, want, strict=True):
        assert g["usage"] == w["usage"]
        a, b = np.array(g["data"][0]["embedding"]), np.array(w["data"][0]["embedding"])
        assert a.shape == b.shape and np.array_equal(a, b), np.abs(a - b).max()
    assert completion == want_completion
