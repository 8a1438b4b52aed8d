"""`primaplug serve`'s app over real node processes, with the official openai client as users call it: several
requests at once, each with the answer it gets alone and the answer llama-cpp-python's own server gives; a client
that leaves; the API key; /metrics; logprobs and embeddings as llama-cpp-python's server gives them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.server_helpers import SERVE_KWARGS, ThreadedServer, llama_cpp_server, openai_client, parse_prometheus, value

pytestmark = pytest.mark.multiproc
pytest.importorskip("fastapi", reason="needs primaplug[server]")
openai = pytest.importorskip("openai", reason="needs the openai client (the test extra)")

PARALLEL = 4
MAX_TOKENS = 8
LONG = 480  # tokens a request would run to if nothing stopped it (n_ctx is 512)
# four clients at once, each with its own prompt: completions and chats, streamed and not; prompts whose greedy
# tokens lead the runner-up by more than 0.2 in log-probability (llama-cpp-python's own logprobs), so that the
# rounding of one kernel against another (a batch of several rows, a prefix reused) cannot change a token
REQUESTS: list[tuple[str, bool, str]] = [
    ("completion", True, "def fibonacci(n):"),
    ("completion", False, "Water boils at"),
    ("chat", True, "How many legs does a spider have?"),
    ("chat", False, "Say hello in French."),
]


@pytest.fixture(scope="module")
def nodes(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 2, log_dir=tmp_path_factory.mktemp("node-logs")) as local:
        yield local


@pytest.fixture(scope="module")
def llm(gemma_path: Path, nodes: Any) -> Iterator[Any]:
    import primaplug

    # no chat_format: the bundled Gemma carries no template, and its tokenizer's turn markers choose gemma's
    ring = primaplug.Llama(gemma_path, nodes=nodes.addresses, scheduler="even", node_threads=1, n_parallel=PARALLEL,
                           **SERVE_KWARGS)
    assert ring.chat_format == "gemma" and ring.chat_format_fallback, ring.chat_format_reason
    try:
        yield ring
    finally:
        ring.close()


@pytest.fixture(scope="module")
def server(llm: Any) -> Iterator[ThreadedServer]:
    from primaplug.server import create_app

    with ThreadedServer(create_app(llm, alias="gemma")) as s:
        yield s


def ask(client: Any, kind: str, stream: bool, prompt: str, **extra: Any) -> tuple[str, str | None]:
    """One request through the openai client: its text and finish reason."""
    kw: dict[str, Any] = dict(model="gemma", max_tokens=MAX_TOKENS, temperature=0.0, stream=stream, **extra)
    if kind == "completion":
        r = client.completions.create(prompt=prompt, **kw)
        if not stream:
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = list(r)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = [c for c in r if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def test_concurrent_requests_get_their_own_answers(server: ThreadedServer, llm: Any, gemma_path: Path) -> None:
    """Four clients at once (streamed and not, completions and chats): each gets the answer it gets alone, which is
    the answer of llama-cpp-python's own server to the same request (its sampling defaults apply to both), and they
    really were in flight together."""
    client = openai_client(server.url)
    running: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            running.append(llm.requests_running)
            watching.wait(0.005)

    together: dict[int, tuple[str, str | None]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(REQUESTS))

    def one(i: int) -> None:
        try:
            start.wait()
            together[i] = ask(client, *REQUESTS[i])
        except BaseException as e:
            errors.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    watching.set()
    watcher.join()
    assert not errors, errors
    assert max(running) >= 2, "the requests never held sequences at the same time"

    alone = {i: ask(client, *r) for i, r in enumerate(REQUESTS)}
    assert together == alone
    reference = llama_cpp_server(gemma_path, chat_format="gemma")
    try:
        theirs = {i: ask(openai_client("http://testserver", http_client=reference), *r)
                  for i, r in enumerate(REQUESTS)}
    finally:
        reference.close()
    assert alone == theirs
    assert all(text for text, _ in alone.values())


def _events(http: Any, body: dict[str, Any]) -> list[Any]:
    """A streamed chat's server-sent events, raw: each `data:` line's JSON, and the final [DONE]."""
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_the_stream_is_llama_cpp_pythons_event_for_event(server: ThreadedServer, gemma_path: Path) -> None:
    """The same events as llama-cpp-python's own server sends for the same request: the role first, a delta per
    chunk, the finish reason, then [DONE]; /v1/models lists the alias as its server does."""
    import httpx

    body = {"model": "gemma", "messages": [{"role": "user", "content": REQUESTS[2][2]}], "temperature": 0.0,
            "max_tokens": MAX_TOKENS, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ours = _events(http, body)
        models = http.get("/v1/models").json()
    reference = llama_cpp_server(gemma_path, chat_format="gemma", model_alias="gemma")
    try:
        theirs = _events(reference, body)
        assert models == reference.get("/v1/models").json()
    finally:
        reference.close()

    def shape(events: list[Any]) -> list[Any]:  # ids and times differ; nothing else may
        return [(sorted(e), e["object"], e["model"], [(c["index"], c["delta"], c["finish_reason"], c.get("logprobs"))
                                                      for c in e["choices"]]) for e in events]

    assert shape(ours) == shape(theirs) and len(ours) > 3


def test_a_client_that_leaves_frees_its_sequence(server: ThreadedServer, llm: Any) -> None:
    """A stream closed after a few chunks, and a request that is not streamed whose client gives up: each stops
    generating and frees its sequence at once (min_tokens keeps either from ending by itself), and the next request
    is served."""
    import httpx

    body = {"model": "gemma", "prompt": "Count to one hundred:", "max_tokens": LONG, "min_tokens": LONG,
            "temperature": 0.0}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        decoded = llm.events.view.decoded_tokens
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            assert [next(events) for _ in range(3)]
            assert llm.requests_running == 1
        _wait_for(lambda: llm.requests_running == 0, 5, "the stream's sequence was not freed")
        assert llm.events.view.decoded_tokens - decoded < LONG // 2, "the stream went on generating"

        decoded = llm.events.view.decoded_tokens
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.5)
        _wait_for(lambda: llm.requests_running == 0, 5, "the abandoned request kept its sequence")
        assert llm.events.view.decoded_tokens - decoded < LONG // 2, "the abandoned request went on generating"
        metrics = parse_prometheus(http.get("/metrics").text)
    assert value(metrics, "primaplug_requests_total", endpoint="completions", outcome="disconnected") >= 2
    assert ask(openai_client(server.url), "completion", False, "The sky is")[0]


@pytest.mark.parametrize("interrupt", [False, True], ids=["default", "interrupt_requests"])
def test_a_request_waiting_for_a_sequence(llm: Any, interrupt: bool) -> None:
    """Every sequence streaming, and one more request: by default it waits and every stream runs to its end; with
    interrupt_requests (llama-cpp-python's setting) the streams stop, each with an error event that says why, and
    the waiting request is served."""
    from primaplug.server import create_app

    with ThreadedServer(create_app(llm, alias="gemma", interrupt_requests=interrupt)) as s:
        client = openai_client(s.url)
        ended: list[Any] = []

        def stream(i: int) -> None:
            chunks = []
            try:
                for c in client.completions.create(model="gemma", prompt=f"{i} little pigs went", max_tokens=24,
                                                   temperature=0.0, stream=True, extra_body={"min_tokens": 24}):
                    chunks.append(c)
                ended.append(chunks[-1].choices[0].finish_reason)
            except openai.APIError as e:
                ended.append(e)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(PARALLEL)]
        for t in threads:
            t.start()
        _wait_for(lambda: llm.requests_running == PARALLEL, 30, "the streams never held every sequence")
        assert ask(client, "completion", False, "The sky is")[0]
        for t in threads:
            t.join(60)
    assert len(ended) == PARALLEL
    if not interrupt:
        assert ended == ["length"] * PARALLEL
        return
    stopped = [e for e in ended if isinstance(e, openai.APIError)]
    assert stopped and all(e.body["code"] == "interrupted" for e in stopped), ended  # type: ignore[index]
    assert "--interrupt_requests" in stopped[0].message


def test_errors_reach_the_client(server: ThreadedServer) -> None:
    """A prompt longer than the context: llama-cpp-python's 400 (context_length_exceeded) when not streamed; an
    error event with the same message when streamed (its own server ends that stream without a word)."""
    client = openai_client(server.url)
    prompt = "the sea " * 400
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="gemma", prompt=prompt, max_tokens=4)
    assert refused.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.APIError) as failed:
        list(client.completions.create(model="gemma", prompt=prompt, max_tokens=4, stream=True))
    assert failed.value.body["code"] == "context_length_exceeded", failed.value.body  # type: ignore[index]
    assert "maximum context length is 512 tokens" in failed.value.message
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as http:  # llama-cpp-python's server answers these with 500
        answers = [http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}),
                   http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})]
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "max_tokens" in answers[0].json()["error"]["message"], answers[0].text


def test_structured_outputs_with_the_openai_clients_parse(server: ThreadedServer, llm: Any) -> None:
    """OpenAI's Structured Outputs as today's clients send them (a Pydantic model through `beta...parse`): the
    schema constrains the reply through the ring, and the client gets its object back; the same through the Python
    API; a schema no grammar can express is a 400 that names the part."""
    from typing import Literal

    from pydantic import BaseModel

    class Capital(BaseModel):
        country: Literal["France", "Italy", "Spain"]
        capital: Literal["Paris", "Rome", "Madrid"]
        is_large: bool

    client = openai_client(server.url)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    for strict in (True, False):
        schema = Capital.model_json_schema() | {"additionalProperties": False}
        r = client.chat.completions.create(model="gemma", messages=question, max_tokens=64, temperature=0.0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "Capital", "schema": schema, "strict": strict}})
        assert Capital.model_validate_json(r.choices[0].message.content), r.choices[0].message.content
    parsed = client.beta.chat.completions.parse(model="gemma", messages=question, response_format=Capital,
                                                max_tokens=64, temperature=0.0)
    assert isinstance(parsed.choices[0].message.parsed, Capital), parsed.choices[0].message.content
    direct = llm.create_chat_completion(question, max_tokens=64, temperature=0.0, response_format={
        "type": "json_schema", "json_schema": {"name": "Capital", "schema": Capital.model_json_schema()}})
    assert Capital.model_validate_json(direct["choices"][0]["message"]["content"])
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="gemma", messages=question, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "odd", "schema": {"not": {"type": "string"}}}})
    body = refused.value.body
    assert body["code"] == "invalid_json_schema" and body["param"] == "response_format", body  # type: ignore[index]
    assert "Unrecognized schema: {'not'" in body["message"], body  # type: ignore[index]


def _wait_for(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_api_key(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --api_key, a client without it gets 401 and one with it is served; /health needs no key, /metrics does.
    Without one, the environment's API_KEY (which llama-cpp-python's settings would read) is not taken for one."""
    from fastapi.testclient import TestClient

    from primaplug.server import create_app

    http = TestClient(create_app(llm, alias="gemma", api_key="sekrit"))
    with pytest.raises(openai.AuthenticationError):
        ask(openai_client("http://testserver", http_client=http), "completion", False, "Hello")
    with pytest.raises(openai.AuthenticationError):
        ask(openai_client("http://testserver", api_key="wrong", http_client=http), "chat", True, "Hello")
    assert ask(openai_client("http://testserver", api_key="sekrit", http_client=http), "completion", False, "Hi")[0]
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 401 and http.get("/v1/models").status_code == 401
    assert http.get("/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200

    monkeypatch.setenv("API_KEY", "from-the-environment")
    open_app = TestClient(create_app(llm, alias="gemma"))
    assert open_app.get("/v1/models").json()["data"][0]["id"] == "gemma"


def test_health_and_metrics(server: ThreadedServer, llm: Any) -> None:
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["n_parallel"] == PARALLEL
        before = parse_prometheus(http.get("/metrics").text)
        text, _ = ask(openai_client(server.url), "chat", True, "Tell me about rivers.")
        r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = parse_prometheus(r.text)
    ok = dict(endpoint="chat_completions", outcome="ok")
    assert value(after, "primaplug_requests_total", **ok) == value(before, "primaplug_requests_total", **ok) + 1
    assert value(after, "primaplug_generated_tokens_total") > value(before, "primaplug_generated_tokens_total")
    assert value(after, "primaplug_prompt_tokens_total") > value(before, "primaplug_prompt_tokens_total")
    assert value(after, "primaplug_time_to_first_token_seconds_count") == value(
        before, "primaplug_time_to_first_token_seconds_count") + 1
    assert value(after, "primaplug_tokens_per_second") > 0 and value(after, "primaplug_ring_ready") == 1
    assert value(after, "primaplug_parallel_sequences") == PARALLEL
    for node in nodes_of(llm):
        assert value(after, "primaplug_node_state", node=node, state="ready") == 1
        assert value(after, "primaplug_node_resident_bytes", node=node) > 0
        assert frozenset({("node", node)}) in after["primaplug_node_memory_pressure_ratio"]


def nodes_of(llm: Any) -> list[str]:
    return list(llm.events.view.nodes)


def test_logprobs_equal_llama_cpp_pythons_server(server: ThreadedServer, gemma_path: Path) -> None:
    """logprobs (completions: logprobs 3; chats: logprobs with top_logprobs 3) as llama-cpp-python's own server gives
    them (it keeps every row's logits, logits_all=True by default; the ring keeps only the rows they read)."""
    client = openai_client(server.url)
    reference = llama_cpp_server(gemma_path, chat_format="gemma")
    # two tokens: for each, llama-cpp-python sorts the whole vocabulary (262k for Gemma) in Python
    kw: dict[str, Any] = dict(model="gemma", max_tokens=2, temperature=0.0)
    chat = [{"role": "user", "content": "Say hi."}]
    try:
        theirs = openai_client("http://testserver", http_client=reference)
        got, want = ([c.completions.create(prompt="The capital of France is", logprobs=3, **kw),
                      c.chat.completions.create(messages=chat, logprobs=True, top_logprobs=3, **kw)]
                     for c in (client, theirs))
    finally:
        reference.close()
    g, w = got[0].choices[0].logprobs, want[0].choices[0].logprobs
    assert g.tokens == w.tokens and g.text_offset == w.text_offset
    assert np.allclose(g.token_logprobs, w.token_logprobs, atol=2e-3)
    for tg, tw in zip(g.top_logprobs, w.top_logprobs, strict=True):
        assert list(tg) == list(tw) and np.allclose(list(tg.values()), list(tw.values()), atol=2e-3)
    gc, wc = got[1].choices[0].logprobs.content, want[1].choices[0].logprobs.content
    assert [t.token for t in gc] == [t.token for t in wc] and len(gc) > 0
    for tg, tw in zip(gc, wc, strict=True):
        assert abs(tg.logprob - tw.logprob) < 2e-3
        assert [t.token for t in tg.top_logprobs] == [t.token for t in tw.top_logprobs]
        assert np.allclose([t.logprob for t in tg.top_logprobs], [t.logprob for t in tw.top_logprobs], atol=2e-3)


def test_embeddings_equal_llama_cpp_pythons_server(gemma_path: Path, tmp_path: Path) -> None:
    """/v1/embeddings from a ring made with embedding=True (serve --embedding) equals llama-cpp-python's own server
    with embedding=True: an input alone, and a list of inputs. For a list, the reference is each input sent alone:
    llama-cpp-python evaluates a list in one batch and answers every input after the first with other numbers than
    it gives that input alone (Gemma 3 270M: 61 apart, from the first row on, which is the BOS token's in every
    input), which is llama-cpp-python's batching, not the embedding."""
    import primaplug
    from primaplug.head.launch import LocalNodes
    from primaplug.server import create_app

    inputs = ["The sea is deep.", "Rivers run to the sea.", "Mountains are high."]
    reference = llama_cpp_server(gemma_path, embedding=True)
    try:
        theirs = openai_client("http://testserver", http_client=reference)
        want = [theirs.embeddings.create(model="gemma", input=i) for i in inputs]
    finally:
        reference.close()
    # nodes of its own: the module's ring (head A) holds the module's nodes while it lives, and a second head there
    # would be refused (test_two_heads.py)
    with LocalNodes(gemma_path, 2, log_dir=tmp_path / "logs") as nodes:
        ring = primaplug.Llama(gemma_path, nodes=nodes.addresses, scheduler="even", node_threads=1, embedding=True,
                               **SERVE_KWARGS)
        try:
            with ThreadedServer(create_app(ring, alias="gemma")) as s:
                client = openai_client(s.url)
                got = [client.embeddings.create(model="gemma", input=i) for i in inputs]
                listed = client.embeddings.create(model="gemma", input=inputs[1:])
        finally:
            ring.close()
    for g, w in zip(got, want, strict=True):
        assert len(g.data) == len(w.data) == 1 and g.usage.prompt_tokens == w.usage.prompt_tokens
        _assert_close(g.data[0].embedding, w.data[0].embedding)
    assert [d.index for d in listed.data] == [0, 1]
    assert listed.usage.prompt_tokens == sum(w.usage.prompt_tokens for w in want[1:])
    for d, w in zip(listed.data, want[1:], strict=True):
        _assert_close(d.embedding, w.data[0].embedding)


def _assert_close(got: Any, want: Any) -> None:
    """Equal to within 1e-3 of the largest value (the ring's tests' measure for logits)."""
    g, w = np.array(got), np.array(want)
    assert g.shape == w.shape, (g.shape, w.shape)
    assert np.abs(g - w).max() <= 1e-3 * np.abs(w).max(), np.abs(g - w).max()
