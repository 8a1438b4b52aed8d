"""Speculative decoding over real node processes: rejected drafts are forgotten on every node, and `serve` streams
the same text to the official openai client with a draft as without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_speculative import KWARGS, N, _held_everywhere, _plain_tokens, scripted_run

pytestmark = pytest.mark.multiproc


def test_rejections_on_a_ring_of_nodes(gemma_path: Path, tmp_path: Path) -> None:
    """The wrong token moves through every draft position; each node's cache holds exactly the positions the
    head's session says the ring holds, at every step, and the tokens are plain llama-cpp-python's."""
    import primaplug
    from primaplug.head.launch import LocalNodes

    prompt, want = _plain_tokens(gemma_path)
    with LocalNodes(gemma_path, 2, log_dir=tmp_path) as local:
        got, seen, stats = scripted_run(
            lambda draft: primaplug.Llama(gemma_path, nodes=local.addresses, layers=[6, 6, 6], node_threads=1,
                                          draft_model=draft, draft_min=2, **KWARGS),
            prompt, want, None, _held_everywhere)
    assert got == want
    assert len(seen) > N // 3 and all(held == [h] * 3 for h, _, held in seen), seen  # 2 nodes and the head
    assert 0 < stats.accepted < stats.drafted


def test_serve_streams_the_same_text_with_a_draft(gemma_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="needs primaplug[server]")
    openai = pytest.importorskip("openai", reason="needs the openai client (the test extra)")
    from fastapi.testclient import TestClient

    import primaplug
    from primaplug.head.launch import LocalNodes
    from primaplug.server import create_app

    def streamed(llm: Any) -> str:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                               http_client=TestClient(create_app(llm, alias="gemma")))
        stream = client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Write about the sea."}], temperature=0.0,
            max_tokens=32, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    kwargs = dict(KWARGS, chat_format="gemma")
    with LocalNodes(gemma_path, 2, log_dir=tmp_path) as local:
        results = []
        for draft in (None, gemma_path):
            llm = primaplug.Llama(gemma_path, nodes=local.addresses, scheduler="even", node_threads=1,
                                  draft_model=draft, **kwargs)
            try:
                results.append(streamed(llm))
                if draft is not None:
                    assert llm.speculation.stats.accepted > 0, llm.speculation.stats.describe()
            finally:
                llm.close()
    assert results[0] and results[1] == results[0]
