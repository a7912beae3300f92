"""Graph invariants, their error messages, derived views and fingerprints."""

import pytest

from remat import Graph, GraphError, Node, NodeKind
from remat.builders import chain_graph, graph_from_spec, random_training_graph, unet_graph

F = NodeKind.FORWARD


def node(name, deps=(), out_bytes=1, cost=1.0, kind=F, recomputable=True):
    return Node(name, kind, tuple(deps), out_bytes, cost, recomputable)


def test_users_and_totals():
    g = Graph(nodes=(node("a"), node("b", [0]), node("c", [0, 1], cost=2.5)), fixed_bytes=3, outputs=(2,))
    assert g.users == ((1, 2), (2,), ())
    assert g.total_cost == 4.5
    assert g.out_bytes == (1, 1, 1)
    assert g.describe(1) == "node 1 ('b')"


@pytest.mark.parametrize(
    "nodes, outputs, fixed, message",
    [
        ((), (), 0, "has no nodes"),
        ((node("a"), node("b", [1])), (1,), 0, "node 1 ('b'): dependency 1 is not an earlier node"),
        ((node("a"), node("b", [5])), (1,), 0, "dependency 5 is not an earlier node"),
        ((node("a"), node("a", [0])), (1,), 0, "name already used by node 0"),
        ((node("a", out_bytes=-1),), (0,), 0, "out_bytes=-1 must be a non-negative int"),
        ((node("a", out_bytes=1.5),), (0,), 0, "out_bytes=1.5 must be a non-negative int"),
        ((node("a", cost=float("nan")),), (0,), 0, "cost=nan must be a finite number >= 0"),
        ((node("a", cost=-1.0),), (0,), 0, "cost=-1.0 must be a finite number >= 0"),
        ((node("a"), node("b", [0, 0])), (1,), 0, "deps (0, 0) list a node twice"),
        ((node("a"),), (0, 0), 0, "outputs (0, 0) list a node twice"),
        ((node("a"),), (3,), 0, "output 3 is not a node id (0..0)"),
        ((node("a"),), (0,), -5, "fixed_bytes=-5 must be a non-negative int"),
        ((Node("a", "forward", (), 1, 1.0),), (0,), 0, "kind 'forward' is not a NodeKind"),
    ],
)
def test_invalid_graphs_name_the_problem(nodes, outputs, fixed, message):
    with pytest.raises(GraphError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        Graph(nodes=nodes, fixed_bytes=fixed, outputs=outputs, name="g")


def test_fingerprint_is_stable_and_sensitive():
    a, b = chain_graph(4), chain_graph(4)
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != chain_graph(5).fingerprint()
    cheaper = a.with_costs([0.5] * a.n)
    assert cheaper.fingerprint() != a.fingerprint()
    assert cheaper.fingerprint(costs=False) == a.fingerprint(costs=False)
    assert a.fingerprint() != chain_graph(4, bytes_per_node=2).fingerprint()


def test_with_costs_checks_length():
    with pytest.raises(GraphError, match="got 2 costs for 9 nodes"):
        chain_graph(4).with_costs([1.0, 2.0])


def test_chain_shape_matches_checkmate():
    g = chain_graph(3, bytes_per_node=1)
    assert [n.deps for n in g.nodes] == [(), (0,), (1,), (2,), (2, 3), (1, 4), (0, 5)]
    assert [n.kind for n in g.nodes] == [F, F, F, NodeKind.LOSS] + [NodeKind.BACKWARD] * 3
    assert g.outputs == (6,)


def test_unet_has_skip_connections_and_shrinking_levels():
    g = unet_graph(3, base_bytes=1024)
    assert g.n == 4 * 3 + 3
    # decoder at level 0 (forward id 6) reads the decoder below (5) and the skip from e_0 (0)
    assert g.nodes[6].deps == (0, 5)
    sizes = [g.nodes[k].out_bytes for k in range(4)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_random_graph_is_deterministic_and_has_training_shape():
    g1, g2 = random_training_graph(12, seed=3), random_training_graph(12, seed=3)
    assert g1.fingerprint() == g2.fingerprint()
    assert g1.fingerprint() != random_training_graph(12, seed=4).fingerprint()
    assert len(g1.ids_of_kind(NodeKind.LOSS)) == 1
    assert len(g1.ids_of_kind(NodeKind.BACKWARD)) == 12
    # every gradient node reads its forward value
    for k, b in enumerate(g1.ids_of_kind(NodeKind.BACKWARD)):
        assert (11 - k) in g1.nodes[b].deps
    assert g1.outputs[-1] == g1.n - 1


@pytest.mark.parametrize(
    "spec, n", [("chain:32", 65), ("unet:4", 19), ("random:60:7", 121), ("random:5", 11)]
)
def test_graph_specs(spec, n):
    assert graph_from_spec(spec).n == n


@pytest.mark.parametrize(
    "spec, message",
    [("chain", "not a built-in graph"), ("chain:x", "sizes must be integers"), ("tree:3", "not a built-in graph"),
     ("chain:0", "at least one layer"), ("unet:0", "depth >= 1"), ("random:0", "n_forward >= 1")],
)
def test_bad_graph_specs(spec, message):
    with pytest.raises(GraphError, match=message):
        graph_from_spec(spec)
