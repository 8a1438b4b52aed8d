"""A node killed while `serve` streams, with the official openai client: the stream ends with an error event the
client raises (never a silent cut), and from then on a request gets a 503 with the reason at once, as /health
does."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.server_helpers import SERVE_KWARGS, ThreadedServer, openai_client

pytestmark = pytest.mark.multiproc
pytest.importorskip("fastapi", reason="needs primaplug[server]")
openai = pytest.importorskip("openai", reason="needs the openai client (the test extra)")


def test_a_node_killed_mid_stream_reaches_the_client(gemma_path: Path, tmp_path: Path) -> None:
    import httpx

    import primaplug
    from primaplug.head.launch import LocalNodes
    from primaplug.server import create_app

    with LocalNodes(gemma_path, 2, log_dir=tmp_path) as local:
        llm = primaplug.Llama(gemma_path, nodes=local.addresses, scheduler="even", node_threads=1, n_parallel=2,
                              chat_format="gemma", timeout_s=2.0, **SERVE_KWARGS)
        try:
            with ThreadedServer(create_app(llm, alias="gemma")) as server:
                client = openai_client(server.url)
                stream = client.chat.completions.create(
                    model="gemma", messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=400,
                    temperature=0.0, stream=True, extra_body={"min_tokens": 400})
                received = []
                with pytest.raises(openai.APIError) as failed:
                    for chunk in stream:
                        received.append(chunk)
                        if len(received) == 3:
                            os.kill(local.nodes[1].pid, signal.SIGKILL)
                assert len(received) >= 3 and not isinstance(failed.value, openai.APIConnectionError)
                assert local.nodes[1].name in failed.value.message, failed.value.message
                assert failed.value.body["code"] == "node_unavailable", failed.value.body  # type: ignore[index]
                assert all(c.choices[0].finish_reason is None for c in received if c.choices)

                with httpx.Client(base_url=server.url, timeout=30) as http:
                    took = []
                    t0 = time.monotonic()
                    health = http.get("/health")
                    took.append(time.monotonic() - t0)
                    assert health.status_code == 503 and health.json()["status"] == "unavailable"
                    assert local.nodes[1].name in health.json()["error"]["message"]
                    for stream_it in (True, False):
                        t0 = time.monotonic()
                        with pytest.raises(openai.InternalServerError) as refused:
                            client.completions.create(model="gemma", prompt="Hello", max_tokens=4, stream=stream_it)
                        took.append(time.monotonic() - t0)
                        assert refused.value.status_code == 503
                        assert "no ring is ready" in refused.value.message
                        assert local.nodes[1].name in refused.value.message
                    # at once: no longer than asking a silent node once (1 s), whatever the ring's timeout
                    assert max(took) < 1.5, took
                    assert http.get("/metrics").status_code == 200
        finally:
            llm.close()
