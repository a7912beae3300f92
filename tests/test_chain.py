"""The chain method: multi-level checkpointing over the light cuts, chosen by a dynamic programme."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import InfeasibleBudgetError
from remat.builders import chain_graph, random_training_graph, unet_graph
from remat.simulate import simulate
from remat.solvers import solve
from remat.solvers.chain import ChainModel, chain_model
from reference import min_budget, transformer_like

PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def graphs():
    return st.one_of(
        st.builds(lambda n, seed: random_training_graph(n, seed=seed), st.integers(2, 24), st.integers(0, 10**6)),
        st.builds(lambda n: chain_graph(n, bytes_per_node=1), st.integers(1, 24)),
        st.builds(transformer_like, st.integers(1, 10)),
        st.builds(lambda d: unet_graph(d, base_bytes=1024), st.integers(1, 4)),
    )


@PROPERTY
@given(graph=graphs(), data=st.data())
def test_every_plan_is_what_the_simulator_measures(graph, data):
    model = chain_model(graph)
    assert model.front_levels, "checkpoint-all's peak is a budget of the model: some plan fits it"
    picks = data.draw(st.lists(st.integers(0, len(model.front_levels) - 1), min_size=1, max_size=4))
    for index in picks:
        plan = model.measure(index)
        sim = simulate(graph, plan.schedule(graph).lower(graph))
        assert sim.ok, sim.errors
        assert (sim.peak_bytes, sim.total_cost) == (plan.peak_bytes, plan.cost)
        forward = [i for i, node in enumerate(graph.nodes) if node.kind.value == "forward"]
        assert all(c == 1 for i, c in enumerate(sim.compute_counts) if i not in forward)


@PROPERTY
@given(graph=graphs())
def test_the_model_costs_more_as_its_budget_shrinks(graph):
    model = ChainModel(graph)
    levels = np.asarray(model.front_levels) - model.base
    costs = model.top[0][levels]
    assert np.all(np.diff(levels) > 0) and np.all(np.diff(costs) < 0)


@pytest.mark.parametrize(("budget", "optimum"), [(7, 32.0), (8, 31.0), (10, 29.0), (14, 25.0)])
def test_known_optima_on_a_chain(budget, optimum):
    # Twelve unit nodes: the exact MILP's optimum at these budgets (checked by test_milp's solver).
    g = chain_graph(12, bytes_per_node=1)
    assert solve(g, budget, method="milp").cost == optimum
    r = solve(g, budget, method="chain")
    assert r.cost == optimum and r.peak_bytes <= budget


def test_reaches_below_one_level_plans_and_costs_less_than_nested():
    g = chain_graph(24, bytes_per_node=1)
    assert min_budget(g, "chain") < min_budget(g, "nested") < min_budget(g, "segments")
    budget = min_budget(g, "nested")
    assert solve(g, budget, method="chain").cost <= solve(g, budget, method="nested").cost


def test_milp_takes_the_chain_plan_where_it_is_the_cheapest_known():
    g = chain_graph(24, bytes_per_node=1)
    budget = min_budget(g, "chain")
    r = solve(g, budget, method="milp", time_limit_s=5)
    assert r.peak_bytes <= budget and r.cost <= solve(g, budget, method="chain").cost


def test_the_smallest_budget_it_states_plans():
    g = transformer_like(12)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, 1, method="chain")
    lowest = info.value.min_budget_bytes
    assert "method 'chain'" in str(info.value)
    assert solve(g, lowest, method="chain").peak_bytes <= lowest
