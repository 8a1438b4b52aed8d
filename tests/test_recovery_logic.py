"""How a re-formed ring's windows are chosen, as pure logic: a split by hand keeps each node's share by address,
a new node gets the mean share (and the -ngl every node was given), the head keeps its windows, and a ring with
nobody left says what is short."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from primaplug.core.errors import NodeError, PrimaplugError
from primaplug.head.recovery import Replanner


def _cluster(n_layer: int = 18, rounds: int = 1, head: int = 0) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(n_layer=n_layer), rounds=rounds, head_size=head)


class _Node(SimpleNamespace):
    def __str__(self) -> str:  # as a NodeClient names itself in its NodeErrors, when its name is its address
        return self.name


def _node(address: str) -> SimpleNamespace:
    return _Node(address=address, name=address)


def test_a_split_by_hand_is_rescaled_to_the_nodes_left_by_their_shares() -> None:
    r = Replanner(by_hand={"a": 8, "b": 2, "c": 6}, gpu={"a": 8, "b": 0, "c": 2})
    split = r.split(_cluster(), [_node("a"), _node("c")])  # b lost
    nodes, sizes, gpu, how = split.nodes, split.sizes, split.gpu, split.how
    assert [n.address for n in nodes] == ["a", "c"] and sizes == [10, 8] and sum(sizes) == 18
    assert gpu == [8, 2] and "rescaled to 2 node(s)" in how


def test_the_head_keeps_its_layers_and_a_new_node_gets_the_mean_share() -> None:
    r = Replanner(by_hand={"a": 3, "b": 3})
    sizes = r.split(_cluster(n_layer=18, rounds=2, head=3), [_node("a"), _node("new")]).sizes
    assert sizes == [3, 3]  # 9 a round, 3 of them the head's
    sizes = r.split(_cluster(n_layer=18, rounds=2, head=3), [_node("a")]).sizes
    assert sizes == [6]


def test_more_nodes_than_layers_leaves_the_last_ones_out() -> None:
    r = Replanner(by_hand={"a": 1, "b": 1})
    split = r.split(_cluster(n_layer=4, rounds=2, head=0), [_node(x) for x in "abc"])
    nodes, sizes = split.nodes, split.sizes
    assert [n.address for n in nodes] == ["a", "b"] and sizes == [1, 1]


def test_no_node_left_says_which_layers_nobody_holds() -> None:
    with pytest.raises(PrimaplugError, match=r"no node is left to run the layers the head does not hold \(12 of 18\)"):
        Replanner(by_hand={"a": 6}).split(_cluster(head=2, rounds=3), [])


def test_a_node_that_joins_gets_the_gpu_layers_every_node_was_given() -> None:
    r = Replanner(by_hand={"a": 6, "b": 6, "c": 6}, gpu={"a": 4, "b": 4, "c": 4})  # -ngl 4 for every node
    split = r.split(_cluster(n_layer=18), [_node("a"), _node("new"), _node("c")])
    sizes, gpu = split.sizes, split.gpu
    assert sizes == [6, 6, 6] and gpu == [4, 4, 4]
    split = r.split(_cluster(n_layer=18, rounds=3), [_node("a"), _node("new"), _node("c")])
    sizes, gpu = split.sizes, split.gpu
    assert sizes == [2, 2, 2] and gpu == [2, 2, 2]  # clipped to its windows, like every node's

    # one that refuses them (no GPU backend) or fails to load them gets none from the next split on
    assert not r.refused(NodeError("a", "bad_assignment", "no GPU backend"))  # not a joiner: nothing changes
    assert not r.refused(NodeError("new", "busy", "a load is already running"))
    assert r.refused(NodeError("new", "bad_assignment", "this node's engine has no GPU backend"))
    gpu = r.split(_cluster(n_layer=18), [_node("a"), _node("new"), _node("c")]).gpu
    assert gpu == [4, 0, 4]
    assert not r.refused(NodeError("new", "bad_assignment", "a context too large"))  # it was given none

    # counts per node that differ name none for a node that joins; no -ngl gives none
    r = Replanner(by_hand={"a": 6, "b": 6}, gpu={"a": 4, "b": 9})
    assert r.split(_cluster(n_layer=18), [_node("a"), _node("new")]).gpu == [4, 0]
    r = Replanner(by_hand={"a": 6, "b": 6}, gpu={"a": 0, "b": 0})
    assert r.split(_cluster(n_layer=18), [_node("a"), _node("new")]).gpu == [0, 0]


def test_a_re_formed_ring_refuses_rooms_that_are_not_one_per_node_before_it_lets_any_node_go() -> None:
    from types import SimpleNamespace

    from primaplug.core import LayerRange
    from primaplug.core.errors import ConfigError
    from primaplug.head.cluster import Cluster

    cluster = SimpleNamespace(rounds=1, head_size=2, model=SimpleNamespace(n_layer=8), head_ranges=[LayerRange(6, 8)],
                              nodes=[])
    with pytest.raises(ConfigError, match="a room for each of its 2 node"):
        Cluster.reform(cluster, [_node("a"), _node("b")], [3, 3], [0, 0], rooms=[1])  # type: ignore[arg-type]
    assert cluster.nodes == []  # nothing was let go or replaced
