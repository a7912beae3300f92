"""The baseline methods: hand-derived plans on small chains, properties on random graphs, and
every error they raise.

Chains below are ``chain_graph(n, bytes_per_node=1)``: forward f0..f(n-1) (nodes 0..n-1), the
loss (node n), gradients g(n-1)..g0 (nodes n+1..2n), g_i reading f_i and g_(i+1) (the loss for
g_(n-1)); every node is 1 byte and costs 1, so a cost is a count of computations.
"""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import (
    Graph,
    InfeasibleBudgetError,
    NodeKind,
    Schedule,
    SolveStatus,
    UnsupportedGraphError,
    simulate,
)
from remat.builders import chain_graph, random_training_graph, unet_graph
from remat.solvers import solve
from reference import min_budget
from remat.units import format_bytes_exactly
from remat.solvers.baselines import (
    ChenVariant,
    chain_length,
    checkpoint_candidates,
    greedy_checkpoints,
    revolve_table,
    sqrtn_checkpoints,
)

BASELINES = ("checkpoint_all", "recompute_all", "chen_sqrtn", "chen_greedy", "segments", "griewank", "nested", "chain", "descent")
ANY_GRAPH = ("checkpoint_all", "recompute_all", "chen_sqrtn", "chen_greedy", "segments", "nested", "chain", "descent")
#: Methods whose candidate plans do not depend on the budget, so more budget never costs more.
BUDGET_BLIND = ("checkpoint_all", "recompute_all", "chen_sqrtn", "segments", "griewank", "nested")


def unit_chain(n):
    return chain_graph(n, bytes_per_node=1)


def forward_counts(result, n):
    return result.sim.compute_counts[:n]


# ---------------------------------------------------------------------------- hand-derived chains
@pytest.mark.parametrize("n", [1, 3, 6])
def test_checkpoint_all_chain(n):
    # n=3 on paper: f0 f1 f2 loss live (4 B), g2 allocates while f2 and the loss are live -> 5 B
    # = n+2, the peak; then f2, loss die. Each of the 2n+1 nodes runs once: cost 7 = 2n+1.
    r = solve(unit_chain(n), n + 2, method="checkpoint_all")
    assert (r.peak_bytes, r.cost) == (n + 2, 2 * n + 1)
    assert r.status is SolveStatus.OPTIMAL and r.gap == 0.0
    assert set(r.sim.compute_counts) == {1}


@pytest.mark.parametrize(("n", "cost", "counts"), [(3, 13.0, (4, 3, 2)), (4, 19.0, (5, 4, 3, 2))])
def test_recompute_all_chain(n, cost, counts):
    # Stage t keeps only node t-1. Forward + loss: n+1 computations, none repeated. Gradient
    # g_i's stage keeps g_(i+1) (or the loss) but not f_i, so it recomputes f0..f_i: i+1 nodes,
    # plus g_i itself. n=3: 4 + (4 + 3 + 2) = 13, f0 run 4 times, f1 3, f2 2.
    # n=4: 5 + (5 + 4 + 3 + 2) = 19. In general n+1 + n(n+3)/2.
    # Peak 3 B: while recomputing, the kept gradient plus f_(k-1) and f_k are live; then g_i
    # allocates next to g_(i+1) and f_i.
    g = unit_chain(n)
    r = solve(g, 3, method="recompute_all")
    assert (r.cost, r.peak_bytes) == (cost, 3)
    assert forward_counts(r, n) == counts
    assert r.cost == n + 1 + n * (n + 3) // 2
    assert min_budget(g, "recompute_all") == 3


def test_chen_sqrtn_chain9_by_hand():
    # Articulation points of the forward chain f0..f8: f1..f7 (7 candidates), k = isqrt(7) = 2,
    # checkpoints every 2nd: f2, f4, f6. The final segment f7, f8 stays live into the backward;
    # the backward recomputes f5 (from f4), f3 (from f2), f1 and f0 once: cost 19 + 4 = 23.
    # Peak: checkpoints f2 f4 f6, f7, f8, the loss and g8 = 7 B.
    # Linearized: candidates f0..f8 (9), k = 3, checkpoints f2, f5, f8. g7 recomputes f6, f7
    # (and keeps f6 for g6), g4 recomputes f3, f4, g1 recomputes f0, f1: cost 19 + 6 = 25.
    # Peak at g7: f2 f5 g8 f6 f7 g7 = 6 B.
    g = unit_chain(9)
    assert checkpoint_candidates(g, ChenVariant.ARTICULATION) == tuple(range(1, 8))
    assert sqrtn_checkpoints(checkpoint_candidates(g, ChenVariant.ARTICULATION)) == (2, 4, 6)
    assert sqrtn_checkpoints(checkpoint_candidates(g, ChenVariant.LINEARIZED)) == (2, 5, 8)
    art = solve(g, 100, method="chen_sqrtn", variant=ChenVariant.ARTICULATION)
    assert (art.cost, art.peak_bytes) == (23.0, 7)
    assert forward_counts(art, 9) == (2, 2, 1, 2, 1, 2, 1, 1, 1)
    lin = solve(g, 100, method="chen_sqrtn", variant="linearized")
    assert (lin.cost, lin.peak_bytes) == (25.0, 6)
    assert forward_counts(lin, 9) == (2, 2, 1, 2, 2, 1, 2, 2, 1)
    # AUTO: the cheaper articulation plan when 7 B fit, the linearized one at 6 B, nothing below.
    assert solve(g, 7, method="chen_sqrtn").cost == 23.0
    assert solve(g, 6, method="chen_sqrtn").cost == 25.0
    assert min_budget(g, "chen_sqrtn") == 6


def test_chen_sqrtn_chain16_checkpoints():
    # Articulation: f1..f14, k = 3 -> f3 f6 f9 f12; final segment f13..f15 kept. Recomputed once:
    # f1 f2 (+f0), f4 f5, f7 f8, f10 f11 = 9 -> cost 33 + 9 = 42.
    g = unit_chain(16)
    art = solve(g, 100, method="chen_sqrtn", variant=ChenVariant.ARTICULATION)
    assert [i for i, c in enumerate(forward_counts(art, 16)) if c == 2] == [0, 1, 2, 4, 5, 7, 8, 10, 11]
    assert art.cost == 42.0 and max(art.sim.compute_counts) == 2


def test_greedy_rule_and_threshold_extremes():
    g = unit_chain(6)
    # Running sums 1, 2, 3 > 2 -> f2 is a checkpoint; 1, 2, 3 -> f5.
    assert greedy_checkpoints(g, range(6), threshold_bytes=2) == (2, 5)
    assert greedy_checkpoints(g, range(6), threshold_bytes=-1) == tuple(range(6))
    assert greedy_checkpoints(g, range(6), threshold_bytes=6) == ()
    # Checkpointing every forward node is checkpoint-all, so a roomy budget costs the minimum.
    assert solve(g, 100, method="chen_greedy").cost == g.total_cost


def test_revolve_recurrence_closed_forms():
    t = revolve_table(12, 11).forward_steps
    for l in range(13):
        assert t[l, 0] == l * (l + 1) // 2  # no snapshots: every prefix from the input
        assert t[l, max(l - 1, 0)] == l  # a slot for every layer but the top: no recompute
        assert all(t[l, s] >= t[l, s + 1] for s in range(11))  # a slot more never hurts


def test_griewank_chain_by_hand():
    g = unit_chain(6)
    # Enough slots: nothing recomputed, the checkpoint-all cost 2n+1 = 13.
    assert solve(g, 100, method="griewank").cost == solve(g, 100, method="checkpoint_all").cost == 13
    # 0 slots (only the input, in fixed memory): g5 uses the forward pass's f5; g_i (i<5)
    # recomputes f0..f_i: 1+2+3+4+5 = 15 -> 13 + 15 = 28 = (2n+1) + n(n-1)/2, which is
    # recompute_all's cost minus n (recompute_all redoes f0..f5 for g5 too).
    none = solve(g, 100, method="griewank", slots=0)
    assert none.cost == 28.0 == solve(g, 100, method="recompute_all").cost - 6
    assert none.peak_bytes == 3
    # 1 slot: T(6,1) = 11 splits at 3: the forward pass snapshots f2; g4 recomputes f3 f4 from
    # it, g3 f3, g2 reads the snapshot, g1 recomputes f0 (snapshot) and f1, g0 reads f0.
    # Recomputations 2+1+2 = 5: cost 18; the one snapshot adds 1 B: peak 4.
    one = solve(g, 100, method="griewank", slots=1)
    assert (one.cost, one.peak_bytes) == (18.0, 4)
    assert forward_counts(one, 6) == (2, 2, 1, 3, 2, 1)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_griewank_cost_is_the_recurrence(n):
    g = unit_chain(n)
    table = revolve_table(n, n).forward_steps
    for s in range(n):
        r = solve(g, 1000, method="griewank", slots=s)
        assert r.cost == table[n, s] + n + 1  # forward steps + loss + n gradients
        assert r.peak_bytes == min(s, n - 1) + 3


def test_griewank_is_optimal_among_keep_schedules_on_chain4():
    # Try every backward keep pattern (g_i may reuse any subset of f0..f_i) and take the cheapest
    # cost per peak: revolve meets it at every budget.
    n = 4
    g = unit_chain(n)
    best = {}
    for subsets in itertools.product(*[itertools.product((0, 1), repeat=i + 1) for i in range(n)]):
        keep = np.tri(g.n, g.n, -1, dtype=bool)
        for i, subset in enumerate(subsets):
            keep[2 * n - i, : i + 1] = subset
        sim = simulate(g, Schedule.from_kept(g, keep).lower(g))
        best[sim.peak_bytes] = min(best.get(sim.peak_bytes, np.inf), sim.total_cost)
    for peak, cost in best.items():
        assert solve(g, peak, method="griewank").cost == min(c for p, c in best.items() if p <= peak)


# ---------------------------------------------------------------------------- properties
def graphs():
    return st.one_of(
        st.builds(random_training_graph, st.integers(1, 25), st.integers(0, 10_000),
                  fixed_bytes=st.integers(0, 40)),
        st.builds(unit_chain, st.integers(1, 20)),
        st.builds(lambda d: unet_graph(d, base_bytes=1024), st.integers(1, 4)),
    )


def methods_for(graph):
    """Every baseline that plans ``graph``: griewank only where the graph is shaped as a chain
    (``chain_graph``, and ``random_training_graph`` with one layer)."""
    try:
        chain_length(graph)
    except UnsupportedGraphError:
        return ANY_GRAPH
    return BASELINES


PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(graph=graphs(), data=st.data())
def test_plans_are_valid_and_fit(graph, data):
    ceiling = solve(graph, 10**12, method="checkpoint_all").peak_bytes
    for method in methods_for(graph):
        lowest = min_budget(graph, method)
        budget = data.draw(st.integers(lowest, max(lowest, ceiling)), label=f"{method} budget")
        r = solve(graph, budget, method=method)
        assert r.sim.ok and r.peak_bytes <= budget and r.method == method
        assert r.objective == r.sim.total_cost >= graph.total_cost
        assert r.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
        if method == "checkpoint_all":
            assert set(r.sim.compute_counts) == {1}
        forward = [i for i, node in enumerate(graph.nodes) if node.kind is NodeKind.FORWARD]
        if method.startswith("chen") or method == "segments":  # dropped values recomputed once, forward ones only
            assert max(r.sim.compute_counts) <= 2
        if method.startswith("chen") or method in ("segments", "nested", "chain"):
            assert all(c == 1 for i, c in enumerate(r.sim.compute_counts) if i not in forward)


@PROPERTY
@given(graph=graphs())
def test_min_budget_is_exact(graph):
    for method in methods_for(graph):
        lowest = min_budget(graph, method)
        assert solve(graph, lowest, method=method).peak_bytes <= lowest
        if lowest > 1:
            with pytest.raises(InfeasibleBudgetError) as info:
                solve(graph, lowest - 1, method=method)
            assert info.value.min_budget_bytes == lowest


@PROPERTY
@given(n=st.integers(1, 20), data=st.data())
def test_recompute_all_is_the_dearest_on_chains(n, data):
    g = unit_chain(n)
    budget = data.draw(st.integers(min_budget(g, "recompute_all"), n + 2))
    worst = solve(g, budget, method="recompute_all").cost
    for method in BASELINES:
        try:
            assert solve(g, budget, method=method).cost <= worst
        except InfeasibleBudgetError:
            pass


@PROPERTY
@given(graph=graphs(), data=st.data())
def test_more_budget_never_costs_more(graph, data):
    for method in [m for m in methods_for(graph) if m in BUDGET_BLIND]:
        lowest = min_budget(graph, method)
        top = solve(graph, 10**12, method="checkpoint_all").peak_bytes + 1
        low, high = sorted(data.draw(st.lists(st.integers(lowest, max(lowest, top)), min_size=2, max_size=2)))
        assert solve(graph, high, method=method).cost <= solve(graph, low, method=method).cost


@PROPERTY
@given(graph=graphs())
def test_chen_auto_is_the_better_variant(graph):
    roomy = 10**12
    for method in ("chen_sqrtn", "chen_greedy"):
        auto = solve(graph, roomy, method=method).cost
        variants = [solve(graph, roomy, method=method, variant=v).cost
                    for v in (ChenVariant.ARTICULATION, ChenVariant.LINEARIZED)]
        assert auto == min(variants)
        assert min_budget(graph, method) == min(
            min_budget(graph, method, variant=v) for v in (ChenVariant.ARTICULATION, ChenVariant.LINEARIZED)
        )


@pytest.mark.parametrize("method", BASELINES)
def test_values_that_must_run_once_are_never_recomputed(method):
    # f2 stands for a random op without replay: every method must keep it, whatever it drops.
    chain = unit_chain(6)
    nodes = tuple(dataclasses.replace(n, recomputable=(i != 2)) for i, n in enumerate(chain.nodes))
    g = Graph(nodes=nodes, fixed_bytes=0, outputs=chain.outputs, name="chain6_rng")
    for budget in (min_budget(g, method), 100):
        r = solve(g, budget, method=method)
        assert r.sim.ok and r.sim.compute_counts[2] == 1


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("method", BASELINES)
def test_infeasible_message_names_method_budget_and_minimum(method):
    g = unit_chain(5)
    lowest = min_budget(g, method)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, lowest - 1, method=method)
    text = str(info.value)
    assert f"method {method!r}" in text and "'chain5'" in text
    assert f"budget {format_bytes_exactly(lowest - 1)} is infeasible" in text
    assert f"can meet is {format_bytes_exactly(lowest)}" in text
    assert info.value.budget_bytes == lowest - 1 and info.value.method == method


@pytest.mark.parametrize(
    ("graph", "offender"),
    [
        (unet_graph(2, base_bytes=64), "node 3 ('f3')"),
        (random_training_graph(4, seed=3), "node"),
        (Graph(nodes=chain_graph(3).nodes[:-1], fixed_bytes=0, outputs=(5,), name="cut"), "6 nodes"),
    ],
)
def test_griewank_refuses_non_chains(graph, offender):
    with pytest.raises(UnsupportedGraphError) as info:
        solve(graph, 10**9, method="griewank")
    text = str(info.value)
    assert repr(graph.name) in text and "linear chain" in text and offender in text
    assert "chen_sqrtn" in text and "milp" in text


@pytest.mark.parametrize("method", ["chen_sqrtn", "chen_greedy"])
def test_bad_variant_is_named_with_the_choices(method):
    with pytest.raises(ValueError, match=r"variant='sqrt'.*ChenVariant.ARTICULATION.*'linearized'"):
        solve(unit_chain(4), 100, method=method, variant="sqrt")
    with pytest.raises(ValueError, match="variant=3 is not a Chen variant"):
        solve(unit_chain(4), 100, method=method, variant=3)


@pytest.mark.parametrize("slots", [-1, 1.5, True])
def test_bad_slots_is_named(slots):
    with pytest.raises(ValueError, match=rf"slots={slots!r} must be a non-negative int"):
        solve(unit_chain(4), 100, method="griewank", slots=slots)


# ---------------------------------------------------------------------------- fast paths
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_forward=st.integers(1, 14), seed=st.integers(0, 10_000), pick=st.floats(0.0, 1.0))
def test_chen_plans_built_from_the_graph_equal_the_keep_matrix_route(n_forward: int, seed: int, pick: float) -> None:
    from remat.schedule import order_peak_and_cost, plan_from_order, stage_order
    from remat.solvers.baselines import chen_keep, chen_plan

    graph = random_training_graph(n_forward, seed)
    forward = graph.ids_of_kind(NodeKind.FORWARD)
    rng = np.random.default_rng(seed)
    checkpoints = [i for i in forward if rng.random() < pick]
    direct = chen_plan(graph, checkpoints, "direct")
    via = Schedule.from_kept(graph, chen_keep(graph, checkpoints))
    stages, nodes = stage_order(via.R)
    assert direct.stages.tolist() == stages.tolist() and direct.nodes.tolist() == nodes.tolist()
    sim = simulate(graph, via.lower(graph))
    assert (direct.peak_bytes, direct.cost) == (sim.peak_bytes, sim.total_cost)
    assert order_peak_and_cost(graph, nodes.tolist()) == (sim.peak_bytes, sim.total_cost)
    assert plan_from_order(graph, nodes.tolist()).steps == via.lower(graph).steps



def test_nested_reaches_below_one_level_plans_recomputing_at_most_once_per_level():
    from remat.cuts import Cut
    from remat.solvers.segments import nested_plan

    g = unit_chain(12)
    one_level = min_budget(g, "segments")
    assert min_budget(g, "nested") < one_level
    # three levels: every value computed at most three times (the forward pass, then once per level)
    cuts = tuple(Cut(i, (i,), 1) for i in range(11))
    plan = nested_plan(g, cuts, ((), (3, 6, 9), tuple(range(11))), "three levels")
    sim = simulate(g, plan.schedule(g).lower(g))
    assert sim.ok and (sim.peak_bytes, sim.total_cost) == (plan.peak_bytes, plan.cost)
    assert max(sim.compute_counts) <= 3 and sim.peak_bytes < one_level


def test_a_revolve_schedule_deeper_than_pythons_recursion_limit_is_built():
    # a snapshot per layer, split one layer at a time: one level per layer, past the recursion
    # limit for a chain of a thousand layers (a 1000-layer chain's griewank raised RecursionError)
    import sys

    from remat.solvers.baselines import RevolveTable, _revolve_keep

    layers = sys.getrecursionlimit() + 100
    g = chain_graph(layers, bytes_per_node=1)
    split = np.zeros((layers + 1, layers), dtype=np.int64)
    split[:, 0] = np.arange(layers + 1)  # (no slot: nothing to snapshot)
    split[1:, 1:] = 1  # snapshot the lowest layer, reverse the rest with a slot less
    split[1, :] = 1
    table = RevolveTable(np.zeros_like(split), split)
    keep = _revolve_keep(g, layers, layers - 1, table)
    # the top layer's gradient (the first) keeps the whole forward pass; every other layer's
    # keeps the snapshots of the layers up to its own
    assert keep[2 * layers - (layers - 1), :layers].all()
    for layer in range(layers - 1):
        assert keep[2 * layers - layer, : layer + 1].all(), layer
