"""llama-cpp-python's own OpenAI-compatible server, serving a ring of real node processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ring_helpers import LLAMA_KWARGS

pytestmark = pytest.mark.multiproc


BODY = {"model": "gemma", "messages": [{"role": "user", "content": "Name three primary colors."}],
        "temperature": 0.0, "max_tokens": 24, "stream": True}


def _streamed_text(client: Any) -> str:
    """The chat completion BODY asks for, streamed by the server and joined."""
    with client.stream("POST", "/v1/chat/completions", json=BODY) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])


def test_openai_server_streams_the_same_chat_completion(gemma_path: Path, tmp_path: Path) -> None:
    """The server's sampling defaults are its own (repeat_penalty 1.1, top_k 40, ...), so the reference is plain
    llama-cpp-python behind the same server and the same request."""
    pytest.importorskip("fastapi", reason="needs primaplug[server]")
    import llama_cpp
    from fastapi.testclient import TestClient

    import primaplug
    from primaplug.head.launch import LocalNodes
    from primaplug.server import create_app

    kwargs = dict(LLAMA_KWARGS, logits_all=False, chat_format="gemma")
    plain = llama_cpp.Llama(str(gemma_path), **kwargs)
    try:
        want = _streamed_text(TestClient(create_app(plain, alias="gemma")))
    finally:
        plain.close()

    with LocalNodes(gemma_path, 2, log_dir=tmp_path) as local:
        llm = primaplug.Llama(gemma_path, nodes=local.addresses, scheduler="even", node_threads=1, **kwargs)
        try:
            client = TestClient(create_app(llm, alias="gemma"))
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["gemma"]
            assert _streamed_text(client) == want
            r = client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        finally:
            llm.close()
