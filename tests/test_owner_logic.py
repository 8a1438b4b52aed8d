"""A node belongs to one head at a time (node/owner.py): the rules, without processes (the last test: a node daemon
in a thread). The same rules against real node processes and real heads are in test_two_heads.py."""

from __future__ import annotations

import time

import pytest

from primaplug.head.identity import Head
from primaplug.node.owner import Ownership
from primaplug.wire import HeadTag

A = HeadTag(id="aaaaaaaa00000000", name="primaplug serve (pid 1) on box", address="tcp://127.0.0.1:9000")
B = HeadTag(id="bbbbbbbb00000000", name="primaplug run (pid 2) on box")


def test_a_free_node_is_anyones_and_then_its_holders() -> None:
    o = Ownership(lease_s=30)
    assert o.holder() is None and o.refusal(A, "load windows", take_over=False) == ""
    o.claim(A, "n1")
    h = o.holder()
    assert h is not None and h.head == A and h.lease_s == 30
    assert o.refusal(A, "load windows", take_over=False) == ""  # its own holder, again
    why = o.refusal(B, "load windows", take_over=False)
    for part in ("belongs to head aaaaaaaa", A.name, "tcp://127.0.0.1:9000", "may not load windows", "--take-over",
                 "has been silent for 30 s"):
        assert part in why, (part, why)
    assert o.refusal(None, "load windows", take_over=False) != ""  # a request that names no head is another head


def test_take_over_makes_the_taker_the_holder() -> None:
    o = Ownership(lease_s=30)
    o.claim(A, "n1")
    assert o.refusal(B, "free its windows", take_over=True) == ""
    o.claim(B, "n1")
    assert o.holder().head == B  # type: ignore[union-attr]
    assert "belongs to head bbbbbbbb" in o.refusal(A, "load windows", take_over=False)  # A cannot take it back


def test_only_the_holder_lets_go_and_only_its_word_keeps_the_lease() -> None:
    o = Ownership(lease_s=0.3)
    o.claim(A, "n1")
    o.release(B, "n1")  # not B's to let go
    assert o.holder() is not None
    end = time.monotonic() + 0.6
    while time.monotonic() < end:  # B's requests (its status polls) keep nothing alive; A's do
        o.heard(B)
        o.heard(A)
        time.sleep(0.05)
    assert o.holder() is not None and o.holder().head == A  # type: ignore[union-attr]
    served = HeadTag(id=A.id, name=A.name, served=5)
    o.heard(served)
    assert o.holder().head.served == 5  # type: ignore[union-attr]  # what it did, as it last said
    o.release(A, "n1")
    assert o.holder() is None and o.refusal(B, "load windows", take_over=False) == ""


def test_a_silent_holder_lapses() -> None:
    o = Ownership(lease_s=0.2)
    o.claim(A, "n1")
    assert o.refusal(B, "load windows", take_over=False) != ""
    time.sleep(0.3)
    assert o.holder() is None and o.refusal(B, "load windows", take_over=False) == ""
    o.heard(A)  # nobody took it meanwhile: the holder that speaks again (after a long compute, say) still has it
    assert o.holder() is not None and o.holder().head == A  # type: ignore[union-attr]
    time.sleep(0.3)
    o.claim(B, "n1")  # lapsed again, and taken
    o.heard(A)
    assert o.holder().head == B  # type: ignore[union-attr]


def test_ring_traffic_is_the_holders_word() -> None:
    o = Ownership(lease_s=0.3)
    o.claim(A, "n1")
    end = time.monotonic() + 0.6
    while time.monotonic() < end:
        o.heard_holder()
        time.sleep(0.05)
    assert o.holder() is not None


@pytest.mark.parametrize("argv, program", [(["/usr/bin/primaplug", "serve", "--port", "1"], "primaplug serve"),
                                           (["/x/primaplug/__main__.py", "run"], "primaplug run"),
                                           (["/v/pytest/__main__.py", "-q"], "pytest"), (["bench.py"], "bench.py")])
def test_a_head_names_itself_for_people(monkeypatch: pytest.MonkeyPatch, argv: list[str], program: str) -> None:
    monkeypatch.setattr("sys.argv", argv)
    a, b = Head(), Head()
    assert a.name.startswith(f"{program} (pid ") and a.id != b.id and len(a.id) == 16
    assert a.tag().id == a.id


def test_a_head_refused_by_a_silent_holder_waits_out_its_lease(gemma_path) -> None:  # noqa: ANN001
    """A holder that stopped speaking was likely killed (it could not let its nodes go): a head it refuses after
    HELD_WAIT_AFTER_S of its silence waits out the rest of its lease and goes ahead; one refused sooner is refused."""
    from primaplug.core import NodeHeldError
    from primaplug.core.settings import HELD_WAIT_AFTER_S
    from primaplug.head import NodeClient
    from tests.inproc_nodes import InprocNodes

    with InprocNodes([gemma_path], 1, lease_s=HELD_WAIT_AFTER_S + 1) as nodes:
        t = nodes.head_transport()
        a, b = NodeClient(t, nodes.addresses[0]), NodeClient(t, nodes.addresses[0])
        try:
            a.unload()  # an unload is a head's use of the node: it is A's now
            with pytest.raises(NodeHeldError, match=f"belongs to head {a.head.id[:8]}"):
                b.unload()  # A spoke just now
            time.sleep(HELD_WAIT_AFTER_S + 0.2)  # A is silent from here on
            b.unload()  # refused by a holder silent for 3 s: waits out the last second of the lease, then goes ahead
            holder = b.status().holder
            assert holder is not None and holder.head.id == b.head.id
        finally:
            a.close(), b.close()
            t.close()


def test_a_head_taken_over_while_it_loads_is_told_at_once(gemma_path) -> None:  # noqa: ANN001
    """A head waiting for its windows to load on a node that another head takes over meanwhile is told so, naming
    that head: the node loads the other head's windows, and waiting for its own would last the whole load timeout
    (with it, a heartbeat's re-forming held off every later one for ten minutes)."""
    from primaplug.core import NodeHeldError
    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.head.cluster import Cluster, ClusterSettings
    from primaplug.head.identity import Head
    from primaplug.wire import Assignment, ModelIdentity, WindowSpec
    from tests.inproc_nodes import InprocNodes
    from tests.ring_helpers import wait_until

    model = ModelIdentity.of(read_layout(gemma_path), gemma_path.name)
    with InprocNodes([gemma_path], 1) as nodes:
        t = nodes.head_transport()
        cluster = Cluster(t, ClusterSettings(nodes=tuple(nodes.addresses), load_timeout_s=30), model)
        other = NodeClient(t, nodes.addresses[0], head=Head(take_over=True))
        try:
            cluster.connect()
            a = Assignment(epoch=cluster.epoch, model=model, windows=(WindowSpec(0, 18),),
                           successor="tcp://127.0.0.1:9", n_ctx=64, n_batch=16, n_ubatch=16, n_threads=1)
            cluster.nodes[0].load(a)
            wait_until(lambda: other.status().state == "ready", "the first head's windows load")
            other.unload()  # on purpose: the first head's windows are gone before its wait saw them ready
            with pytest.raises(NodeHeldError, match=f"was taken over by head {other.head.id[:8]}"):
                cluster._wait_loaded(a.epoch)
        finally:
            other.close()
            cluster.close()
            t.close()
