"""Two heads on the same real node processes: a node belongs to one head at a time. A second head is refused with
the holder named and leaves the first undisturbed; with take_over it runs, the first reports its nodes taken (event,
ring_problem, 503 with the reason) and never loads over them, and answers with its old text once they are let go.
Every head here is closed before the next test's heads use the nodes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ring_helpers import wait_until
from tests.server_helpers import SERVE_KWARGS, ThreadedServer, openai_client

pytestmark = pytest.mark.multiproc

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def nodes(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 2, log_dir=tmp_path_factory.mktemp("node-logs")) as local:
        yield local


def head(gemma_path: Path, nodes: Any, **extra: Any) -> Any:
    import primaplug

    return primaplug.Llama(gemma_path, nodes=nodes.addresses, scheduler="even", node_threads=1, **SERVE_KWARGS,
                           **extra)


def complete(llm: Any) -> str:
    return llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"]


def served(server: ThreadedServer) -> str:
    """A greedy completion through `serve`'s app, as the openai client asks for it."""
    r = openai_client(server.url).completions.create(model="gemma", prompt=PROMPT, max_tokens=8, temperature=0.0)
    return r.choices[0].text


def loads(nodes: Any) -> list[int]:
    """Assignments each node has loaded so far (its log says each one)."""
    return [len(re.findall(r"assignment \d+ loaded in", n.log())) for n in nodes.nodes]


def test_a_second_head_is_refused_naming_the_holder(gemma_path: Path, nodes: Any) -> None:
    from primaplug.core import NodeHeldError

    a = head(gemma_path, nodes)
    try:
        before = complete(a)
        # the nodes hear what the head has served with its next request (its heartbeat, every second)
        wait_until(lambda: all(c.status().holder.head.served == 1 for c in a.cluster.nodes), "the nodes hear of A's "
                   "request")
        loaded = loads(nodes)
        with pytest.raises(NodeHeldError) as refused:
            head(gemma_path, nodes)
        message = str(refused.value)
        for part in (f"belongs to head {a.head.id[:8]}", a.head.name, a.cluster.ring_in.address, "since ",
                     "served 1 request(s)", "--take-over"):
            assert part in message, (part, message)
        assert loads(nodes) == loaded, "the refused head loaded something"
        assert complete(a) == before and not a.reforms and a.ring_problem() is None
    finally:
        a.close()
    for n in nodes.nodes:  # A let them go as it closed: free at once for the next head
        assert "let go by head" in n.log()


def test_a_head_that_takes_over_is_reported_and_the_nodes_come_back(gemma_path: Path, nodes: Any) -> None:
    from primaplug.core import NodeError
    from primaplug.server import create_app

    loaded = loads(nodes)
    seen: list[Any] = []
    a = head(gemma_path, nodes)
    a.events.subscribe(seen.append)
    try:
        before = complete(a)
        with ThreadedServer(create_app(a, alias="gemma")) as server:
            served_before = served(server)
            b = head(gemma_path, nodes, take_over=True)
            try:
                assert b.head.take_over is False  # taken once: a re-forming of B's never takes over again
                wait_until(lambda: a.ring_problem() is not None, "A notices its nodes were taken")
                problem = a.ring_problem()
                assert "taken over by another head" in problem and f"head {b.head.id[:8]}" in problem, problem
                taken = [e for e in seen if getattr(e, "state", "") == "taken"]
                assert sorted(e.node for e in taken) == ["node1", "node2"], taken
                assert a.events.view.nodes["node1"].state == "taken"
                with pytest.raises(NodeError) as failed:
                    complete(a)
                assert failed.value.code == "taken" and f"head {b.head.id[:8]}" in str(failed.value)
                health = httpx.get(f"{server.url}/health")
                assert health.status_code == 503 and "taken over" in health.text, health.text
                assert complete(b) == before  # the same model, greedy: B answers as A did
            finally:
                b.close()
            wait_until(lambda: a.ring_problem() is None and complete(a) == before, "A takes its nodes back and "
                       "answers as before", timeout_s=30)
            assert "let go by the head that took them" in a.reforms[-1].why, a.reforms[-1]
            assert served(server) == served_before
    finally:
        a.close()
    # A deployed, B deployed, A deployed again: one load per node per head, none fought over
    assert [n - m for n, m in zip(loads(nodes), loaded, strict=True)] == [3, 3]


def test_the_dashboard_is_refused_then_takes_over(gemma_path: Path, nodes: Any) -> None:
    """The dashboard's coordinator is one head: profiling nodes another head holds is refused with it named, and its
    take-over (T) profiles, plans and deploys anyway; that head reports the nodes taken until the dashboard quits."""
    from primaplug.core import NodeHeldError
    from primaplug.head.coordinator import Coordinator, PlanRequest

    a = head(gemma_path, nodes)
    coordinator = Coordinator(gemma_path, nodes.addresses, **{k: SERVE_KWARGS[k] for k in ("n_ctx", "n_batch")})
    try:
        before = complete(a)
        with pytest.raises(NodeHeldError, match=f"belongs to head {a.head.id[:8]}"):
            coordinator.profile()
        assert coordinator.events.view.nodes["node1"].state == "taken"  # shown as held by another head, not failed
        llm = coordinator.take_over(lambda: (coordinator.connect(), coordinator.profile(),
                                             coordinator.plan(PlanRequest(scheduler="even")), coordinator.deploy())[-1])
        assert coordinator.head.take_over is False and llm.head is coordinator.head
        assert complete(llm) == before
        wait_until(lambda: a.ring_problem() is not None, "A notices the dashboard took its nodes")
    finally:
        coordinator.close()
    try:
        wait_until(lambda: a.ring_problem() is None and complete(a) == before, "A takes its nodes back", timeout_s=30)
    finally:
        a.close()
