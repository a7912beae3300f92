"""Plans that run the forward pass again after the instant where the bound binds (``restart``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remat.solvers.milp as milp_module
from remat import simulate
from remat.builders import chain_graph, random_training_graph, training_graph
from remat.graph import Graph
from remat.schedule import stage_order
from remat.solvers.baselines import measure_order
from remat.solvers.bounds import InstantBounds
from remat.solvers.prepared import clear, prepared
from remat.solvers.repair import lower_peak
from remat.solvers.restart import COPY_SUFFIX, restart_graph, restart_instants, restart_plan


def head_heavy(layers: int) -> Graph:
    """A transformer-like chain: per layer a large inner value and a small hidden state, then
    logits far larger than anything else (what binds at the floor of GPT-2)."""
    deps, sizes, costs = [[]], [1], [1.0]
    for _ in range(layers):
        h = len(deps) - 1
        deps += [[h], [h, h + 1]]
        sizes += [4, 1]
        costs += [4.0, 1.0]
    deps.append([len(deps) - 1])
    sizes.append(24)
    costs.append(6.0)
    return training_graph(deps, sizes, costs, name=f"head_heavy{layers}", loss_bytes=1,
                          param_grads=list(range(0, len(deps), 2)))


def test_the_restarted_chain_by_hand() -> None:
    g = chain_graph(3, bytes_per_node=1)  # f0 f1 f2 loss grad_f2 grad_f1 grad_f0
    r = restart_graph(g, 3)
    # at the loss f2 is live (its input); f0 and f1 are read later: copied right after it
    assert r.copies == 2
    assert [node.name for node in r.restarted.nodes] == [
        "f0", "f1", "f2", "loss", "f0" + COPY_SUFFIX, "f1" + COPY_SUFFIX, "grad_f2", "grad_f1", "grad_f0"]
    assert r.restarted.nodes[5].deps == (4,)  # the copy of f1 reads the copy of f0
    assert r.restarted.nodes[7].deps == (5, 6)  # grad_f1 reads the copy of f1
    assert r.restarted.nodes[6].deps == (2, 3)  # grad_f2 reads f2 and the loss, live at the instant
    assert r.origin.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6]
    assert r.stage.tolist() == [0, 1, 2, 3, 4, 4, 4, 5, 6]
    assert r.restarted.outputs == (8,)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_forward=st.integers(3, 9), seed=st.integers(0, 10_000), where=st.floats(0.0, 1.0),
       room=st.integers(0, 3))
def test_restart_plans_are_plans_of_the_graph_measured_as_the_simulator_measures(
        n_forward: int, seed: int, where: float, room: int) -> None:
    g = random_training_graph(n_forward, seed)
    bounds = InstantBounds(g)
    instant = min(int(where * (g.n - 1)), g.n - 2)
    r = restart_graph(g, instant, bounds)
    live = bounds.forced_mask(instant)
    live[instant] = True
    for i, node in enumerate(r.restarted.nodes):
        origin = g.nodes[int(r.origin[i])]
        assert (node.out_bytes, node.cost, node.temp_bytes) == (origin.out_bytes, origin.cost, origin.temp_bytes)
        if i > instant + r.copies:  # after the instant: reads copies, later nodes, or what is live there
            for d, d_origin in zip(node.deps, origin.deps):
                assert r.origin[d] == d_origin
                assert d > instant or live[d_origin]
    budget = bounds.min_budget_bytes + room
    plan = restart_plan(g, instant, budget, time_limit_s=5, bounds=bounds)
    if plan is None:
        return
    sim = simulate(g, plan.schedule(g).lower(g))
    assert sim.ok, sim.violations[:3]
    assert sim.peak_bytes == plan.peak_bytes
    assert sim.total_cost == pytest.approx(plan.cost)
    assert plan.cost >= g.total_cost


@settings(max_examples=40, deadline=None)
@given(n_forward=st.integers(3, 12), seed=st.integers(0, 10_000), where=st.floats(0.0, 1.0),
       most=st.integers(1, 5))
def test_restart_instants_wait_for_the_first_reader_of_a_copy(n_forward: int, seed: int, where: float,
                                                              most: int) -> None:
    g = random_training_graph(n_forward, seed)
    bounds = InstantBounds(g)
    instant = min(int(where * (g.n - 1)), g.n - 2)
    instants = restart_instants(g, instant, bounds, most=most)
    assert instants[-1] == instant and len(instants) <= most
    assert instants == sorted(set(instants), reverse=True)  # the latest first, each once
    r = restart_graph(g, instant, bounds)
    copied = set(int(v) for v in r.origin[instant + 1:instant + 1 + r.copies])
    latest = instants[0]
    # no node up to the latest instant reads a copied value: the copies could wait for it
    assert all(not copied.intersection(g.nodes[i].deps) for i in range(instant + 1, latest + 1))
    if len(instants) < most and latest + 1 < g.n and copied:
        assert copied.intersection(g.nodes[latest + 1].deps)  # ... and no longer


def test_restart_instants_check_their_count_and_instant() -> None:
    g = chain_graph(3, bytes_per_node=1)
    with pytest.raises(ValueError, match="most=0 must be at least 1"):
        restart_instants(g, 3, most=0)
    with pytest.raises(ValueError, match=r"instant 9 is not a node of graph 'chain3' \(0\.\.6\)"):
        restart_instants(g, 9)
    with pytest.raises(ValueError, match="instant -1 is not a node"):
        restart_graph(g, -1)


def test_milp_asks_the_restarted_graph_where_the_retention_model_has_no_plan(monkeypatch) -> None:
    clear()
    g = head_heavy(8)
    floor = prepared(g).bounds.min_budget_bytes
    asked = []

    def spy(graph, instant, budget_bytes, **kwargs):
        plan = restart_plan(graph, instant, budget_bytes, **kwargs)
        asked.append((instant, plan))
        return plan

    monkeypatch.setattr(milp_module, "restart_plan", spy)
    result = milp_module.milp(g, floor, exact_max_nodes=0, time_limit_s=10)
    assert asked, "the retention model has no plan at the floor: the restarted graph must be asked"
    instant = prepared(g).bounds.cost_bound(floor, multi=False).instant
    assert [at for at, _ in asked] == restart_instants(g, instant, most=milp_module.RESTART_INSTANTS)
    assert asked[-1][0] == instant  # the bound's instant, after those the copies can wait for
    plans = [plan for _, plan in asked if plan is not None]
    assert plans and all(plan.peak_bytes <= floor for plan in plans)
    assert result.peak_bytes <= floor and result.objective <= min(plan.cost for plan in plans) + 1e-9
    exact = milp_module.milp(g, floor, time_limit_s=30)
    assert result.objective >= exact.objective - 1e-9  # never below the optimum


def test_the_smallest_budget_search_may_recompute_long_chains_in_one_move() -> None:
    g = chain_graph(12, bytes_per_node=1)
    stages, nodes = stage_order(np.eye(g.n, dtype=bool))
    start = measure_order(g, stages, nodes, "checkpoint-all")
    floor = InstantBounds(g).min_budget_bytes
    short = lower_peak(g, start, budget_bytes=floor, max_move_nodes=1)
    long = lower_peak(g, start, budget_bytes=floor, max_move_nodes=g.n)
    assert short.peak_bytes > floor  # one value at a time gets stuck above the floor
    assert long.peak_bytes == floor
