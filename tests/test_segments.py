"""Light cuts (remat.cuts) and the segments method: block boundaries found from the graph, and
the plans that keep them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import InfeasibleBudgetError, NodeKind
from remat.builders import chain_graph, random_training_graph, unet_graph
from remat.cuts import Cut, block_cuts, cut_tiers, light_cuts, pass_cuts
from remat.solvers import solve
from reference import transformer_like

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def block_outputs(blocks: int) -> list[int]:
    return [1 + 3 * k for k in range(1, blocks + 1)]


def test_light_cuts_are_the_block_boundaries():
    g = transformer_like(5)
    hs = block_outputs(5)[:-1]  # the last block's output is followed by the output node only
    assert [c.node for c in light_cuts(g)] == hs
    assert all(c.crossing == (0, h) and c.bytes == 1 + 4 for c, h in zip(light_cuts(g), hs))
    # the backward pass has its own: the gradient of each block output
    backward = light_cuts(g, NodeKind.BACKWARD)
    assert [g.nodes[c.node].name for c in backward] == [f"grad_f{h}" for h in (16, 13, 10, 7, 4)]


def test_articulation_points_miss_them_and_segments_reach_lower():
    # Chen's candidates cannot cut at the block boundaries (the mask bridges them), so its least
    # peak stays above what keeping the boundaries needs.
    g = transformer_like(8)
    lowest = {}
    for method in ("chen_sqrtn", "chen_greedy", "segments"):
        with pytest.raises(InfeasibleBudgetError) as info:
            solve(g, 1, method=method)
        lowest[method] = info.value.min_budget_bytes
    assert lowest["segments"] < min(lowest["chen_sqrtn"], lowest["chen_greedy"])


def test_checkpoint_every_block_by_hand():
    # 6 blocks, cuts after h1..h5; at the least budget segments keeps what crosses every cut
    # (the mask and h1..h5) and recomputes the rest of every segment but the final one (which
    # stays live): h0, a and b of block 0, a and b of blocks 1..4. Cost: total + 3 + 4 x 2.
    g = transformer_like(6)
    r = solve(g, 10**9, method="segments")
    assert r.cost == g.total_cost  # a roomy budget: nothing recomputed
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, 1, method="segments")
    least = solve(g, info.value.min_budget_bytes, method="segments")
    counts = least.sim.compute_counts
    recomputed = [i for i, c in enumerate(counts) if c > 1]
    assert recomputed == [1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15]
    assert least.cost == g.total_cost + 11
    assert max(counts) == 2


def test_some_segments_recomputed_between_the_extremes():
    # A budget between "keep every boundary" and checkpoint-all: only some blocks recomputed,
    # cheaper than recomputing them all.
    g = transformer_like(6)
    top = solve(g, 10**9, method="checkpoint_all").peak_bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, 1, method="segments")
    low = info.value.min_budget_bytes
    mid = solve(g, (low + top) // 2, method="segments")
    assert g.total_cost < mid.cost < g.total_cost + 10


@PROPERTY
@given(seed=st.integers(0, 10_000), n=st.integers(1, 25), kind=st.sampled_from([NodeKind.FORWARD, NodeKind.BACKWARD]))
def test_crossing_is_what_the_pass_reads_later(seed, n, kind):
    g = random_training_graph(n, seed=seed)
    ids = g.ids_of_kind(kind)
    cuts = pass_cuts(g, kind)
    assert [c.node for c in cuts] == list(ids)
    for p, cut in enumerate(cuts):
        later = set(ids[p + 1:])
        expected = tuple(j for j in ids[: p + 1] if any(u in later for u in g.users[j]))
        assert cut.crossing == expected
        assert cut.bytes == sum(g.nodes[j].out_bytes for j in expected)
    light = light_cuts(g, kind)
    assert set(light) <= set(cuts[1:-1])
    for c in light:  # a local minimum of the crossing bytes
        p = ids.index(c.node)
        assert cuts[p - 1].bytes >= c.bytes < cuts[p + 1].bytes


def test_cut_tiers_are_nested_and_distinct():
    cuts = tuple(Cut(i, (i,), b) for i, b in enumerate([5, 3, 3, 8, 1, 9, 2]))
    tiers = cut_tiers(cuts)
    assert all(set(a) < set(b) for a, b in zip(tiers, tiers[1:]))
    assert tiers[-1] == cuts and cut_tiers(()) == []


@pytest.mark.parametrize(("graph", "least", "cost"), [(chain_graph(12, bytes_per_node=1), 7, 32.0),
                                                     (unet_graph(3, base_bytes=8), 33, 26.0)], ids=["chain12", "unet3"])
def test_graphs_without_light_cuts_use_every_cut(graph, least, cost):
    # A chain's crossing bytes are flat and a U-Net's rise then fall: no cut stands out, so every
    # cut of the pass is a candidate boundary, and segments reaches below checkpoint-all's peak
    # (it used to plan nothing else). On the chain it finds the exact optimum at its least budget
    # (test_chain's known optimum: 32 at 7).
    assert light_cuts(graph) == ()
    assert block_cuts(graph) == pass_cuts(graph)[:-1]
    r = solve(graph, 10**9, method="segments")
    assert r.cost == graph.total_cost
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, 1, method="segments")
    assert info.value.min_budget_bytes == least < solve(graph, 10**9, method="checkpoint_all").peak_bytes
    low = solve(graph, least, method="segments")
    assert low.peak_bytes <= least and low.cost == cost and max(low.sim.compute_counts) == 2


def test_every_cut_of_a_long_uniform_chain_is_thinned_evenly():
    g = chain_graph(200, bytes_per_node=1)
    cuts = block_cuts(g, at_most=64)
    assert len(cuts) <= 64 and cuts[0].node == 0 and cuts[-1].node >= 190
    assert len({b.node - a.node for a, b in zip(cuts, cuts[1:])}) == 1
