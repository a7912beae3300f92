"""Coarsening is exact: expanded plans have the coarse plan's peak and cost."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from remat import Graph, Node, NodeKind, Schedule, simulate
from remat.builders import random_training_graph
from remat.coarsen import coarsen

F, B = NodeKind.FORWARD, NodeKind.BACKWARD


def with_views(g: Graph, seed: int) -> Graph:
    """Insert a zero-byte 'view' after some nodes; users of the node read the view and the node."""
    rng = np.random.default_rng(seed)
    nodes: list[Node] = []
    new_id: dict[int, int] = {}
    view_of: dict[int, int] = {}
    for i, node in enumerate(g.nodes):
        deps = set()
        for d in node.deps:
            deps.add(new_id[d])
            if d in view_of:
                deps.add(view_of[d])
        new_id[i] = len(nodes)
        nodes.append(Node(node.name, node.kind, tuple(sorted(deps)), node.out_bytes, node.cost, node.recomputable))
        if rng.random() < 0.5:
            view_of[i] = len(nodes)
            nodes.append(Node(f"view_{node.name}", node.kind, (new_id[i],), 0, 0.25))
            if rng.random() < 0.3:  # a view of a view
                nodes.append(Node(f"view2_{node.name}", node.kind, (len(nodes) - 1,), 0, 0.25))
                view_of[i] = len(nodes) - 1
    outputs = tuple(new_id[o] for o in g.outputs)
    return Graph(nodes=tuple(nodes), fixed_bytes=g.fixed_bytes, outputs=outputs, name=g.name + "_views")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 10_000), keep_p=st.floats(0, 1))
def test_expanded_plans_match_coarse_plans(n, seed, keep_p):
    fine = with_views(random_training_graph(n, seed), seed)
    c = coarsen(fine)
    assert c.coarse.n < fine.n or all(len(grp) == 1 for grp in c.groups)
    assert sorted(i for grp in c.groups for i in grp) == list(range(fine.n))
    rng = np.random.default_rng(seed)
    keep = np.tril(rng.random((c.coarse.n, c.coarse.n)) < keep_p, -1)
    plan = Schedule.from_kept(c.coarse, keep).lower(c.coarse)
    coarse_sim = simulate(c.coarse, plan)
    fine_sim = simulate(fine, c.expand(plan))
    assert coarse_sim.ok and fine_sim.ok, fine_sim.violations[:2]
    assert fine_sim.peak_bytes <= coarse_sim.peak_bytes
    # the owner is freed no later than in the coarse plan, and owners hold all the bytes
    assert max(fine_sim.timeline_bytes, default=0) == fine_sim.peak_bytes
    assert abs(fine_sim.total_cost - coarse_sim.total_cost) < 1e-9


def test_views_of_outputs_keep_the_group_an_output():
    nodes = (Node("a", F, (), 8, 1.0), Node("loss", NodeKind.LOSS, (0,), 4, 1.0),
             Node("g", B, (0, 1), 8, 1.0), Node("g_t", B, (2,), 0, 0.0))
    c = coarsen(Graph(nodes=nodes, fixed_bytes=0, outputs=(1, 3)))
    assert c.groups == ((0,), (1,), (2, 3))
    assert c.coarse.outputs == (1, 2)
    assert c.group_of == (0, 1, 2, 2)


def test_zero_byte_node_with_two_inputs_stays():
    nodes = (Node("a", F, (), 8, 1.0), Node("b", F, (), 8, 1.0), Node("z", F, (0, 1), 0, 1.0),
             Node("loss", NodeKind.LOSS, (2,), 4, 1.0, recomputable=False))
    c = coarsen(Graph(nodes=nodes, fixed_bytes=0, outputs=(3,)))
    assert c.coarse.n == 4
    assert not c.coarse.nodes[3].recomputable
