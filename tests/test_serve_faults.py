"""`serve` through a node's loss, its restart and a new node, with the official openai client: a stream that loses a
node mid-way ends with the text of an uninterrupted run; the node restarted on its port, and a node that appears
later, join the ring between requests; every answer is the same text, and /health stays ready throughout."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server_helpers import SERVE_KWARGS, ThreadedServer, openai_client

pytestmark = pytest.mark.multiproc
pytest.importorskip("fastapi", reason="needs primaplug[server]")
openai = pytest.importorskip("openai", reason="needs the openai client (the test extra)")
ASK = dict(model="gemma", messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=32,
           temperature=0.0, extra_body={"min_tokens": 32})


def _wait_for(what: str, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.1)


def test_serve_survives_a_lost_node_its_restart_and_a_new_node(gemma_path: Path, tmp_path: Path) -> None:
    import httpx

    import primaplug
    from primaplug.head.launch import LocalNodes
    from primaplug.server import create_app

    later: list[str] = []  # what discovery would report: nodes that may join
    with LocalNodes(gemma_path, 2, log_dir=tmp_path / "first") as local:
        llm = primaplug.Llama(gemma_path, nodes=local.addresses, scheduler="even", node_threads=1, n_parallel=2,
                              chat_format="gemma", timeout_s=2.0, node_candidates=lambda: list(later),
                              **SERVE_KWARGS)
        try:
            with ThreadedServer(create_app(llm, alias="gemma")) as server, \
                    httpx.Client(base_url=server.url, timeout=30) as http:
                client = openai_client(server.url)
                expected = client.chat.completions.create(**ASK).choices[0].message.content
                assert expected

                # a node killed while the answer streams: the stream goes on, with the same text
                victim = local.nodes[1]
                text, finish = [], None
                for chunk in client.chat.completions.create(**ASK, stream=True):
                    if chunk.choices:
                        text.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                    if len(text) == 3:
                        os.kill(victim.pid, signal.SIGKILL)
                assert "".join(text) == expected and finish == "length"
                (lost,) = llm.reforms
                assert lost.lost == (victim.name,) and [n.name for n in llm.cluster.nodes] == ["node1"]
                assert http.get("/health").json()["status"] == "ok"

                # it restarts on its port: it joins between requests, and answers are the same
                with LocalNodes(gemma_path, 1, log_dir=tmp_path / "again", names=["node2"],
                                node_args=[["--listen", victim.address]]):
                    _wait_for("the restarted node to join", lambda: len(llm.reforms) == 2)
                    assert llm.reforms[1].joined == ("node2",)
                    assert [n.name for n in llm.cluster.nodes] == ["node1", "node2"]
                    assert client.chat.completions.create(**ASK).choices[0].message.content == expected

                    # a node found later (discovery's addresses) joins too
                    with LocalNodes(gemma_path, 1, log_dir=tmp_path / "new", names=["node3"]) as new:
                        later.extend(new.addresses)
                        _wait_for("the new node to join", lambda: len(llm.reforms) == 3)
                        assert [n.name for n in llm.cluster.nodes] == ["node1", "node2", "node3"]
                        assert client.chat.completions.create(**ASK).choices[0].message.content == expected
                        assert http.get("/health").json()["status"] == "ok"
                        assert http.get("/metrics").status_code == 200
        finally:
            llm.close()


def test_serve_says_what_is_short_when_no_node_is_left(gemma_path: Path, tmp_path: Path) -> None:
    import httpx

    import primaplug
    from primaplug.head.launch import LocalNodes
    from primaplug.server import create_app

    with LocalNodes(gemma_path, 1, log_dir=tmp_path) as local:
        llm = primaplug.Llama(gemma_path, nodes=local.addresses, scheduler="even", node_threads=1,
                              chat_format="gemma", timeout_s=2.0, **SERVE_KWARGS)
        try:
            with ThreadedServer(create_app(llm, alias="gemma")) as server, \
                    httpx.Client(base_url=server.url, timeout=30) as http:
                os.kill(local.nodes[0].pid, signal.SIGKILL)
                _wait_for("the heartbeat to find the ring broken", lambda: llm.ring_problem() is not None)
                health = http.get("/health")
                assert health.status_code == 503
                assert "no node is left to run the layers the head does not hold" in health.json()["error"]["message"]
                with pytest.raises(openai.InternalServerError) as refused:
                    openai_client(server.url).completions.create(model="gemma", prompt="Hello", max_tokens=4)
                assert refused.value.status_code == 503 and "start a node" in refused.value.message
        finally:
            llm.close()
