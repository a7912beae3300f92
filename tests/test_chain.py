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
from remat.builders import training_graph
from remat.graph import NodeKind
from remat.solvers import chain as chain_module
from remat.solvers import prepared
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


def assert_plans_measured(graph, model, data):
    """Plans of both fronts at drawn budgets of the model: the simulator's peak and cost are the
    plan's, and only forward values are computed more than once."""
    assert model.front_levels, "checkpoint-all's peak is a budget of the model: some plan fits it"
    picks = data.draw(st.lists(st.integers(0, len(model.front_levels) - 1), min_size=1, max_size=4))
    plans = [model.measure(i) for i in picks]
    plans += [model.measure_restart(i % len(model.restart_levels)) for i in picks if model.restart_levels]
    forward = {i for i, node in enumerate(graph.nodes) if node.kind.value == "forward"}
    for plan in plans:
        sim = simulate(graph, plan.schedule(graph).lower(graph))
        assert sim.ok, sim.errors
        assert (sim.peak_bytes, sim.total_cost) == (plan.peak_bytes, plan.cost)
        assert all(c == 1 for i, c in enumerate(sim.compute_counts) if i not in forward)


@PROPERTY
@given(graph=graphs(), data=st.data())
def test_every_plan_is_what_the_simulator_measures(graph, data):
    model = chain_model(graph)
    assert_plans_measured(graph, model, data)
    assert_plans_measured(graph, model._freeing, data)  # (splits that free their cut)


@PROPERTY
@given(graph=graphs(), data=st.data())
def test_refined_plans_are_what_the_simulator_measures(graph, data):
    model = ChainModel(graph)
    model.refine()
    assert model.exact and all(menu[0][1] == 0.0 for menu in model.menus)
    assert_plans_measured(graph, model, data)
    assert model._freeing.exact and model._freeing.frees_cuts
    assert_plans_measured(graph, model._freeing, data)


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


@pytest.mark.parametrize("layers", [5, 8, 12, 32])
@pytest.mark.parametrize("budget", [3, 4, 5, 6, 8])
def test_on_checkmate_chains_it_costs_what_revolve_costs(layers, budget):
    """Revolve is optimal on a chain of unit layers. The programme reached its costs only once a
    split could drop its cut as soon as the next segment is computed from it (the rest never
    going back to it): chain:32 at 4 units cost 305 against revolve's 180, chain:5 at 4 units 15
    against 14, and 3 units fitted nothing where revolve plans."""
    g = chain_graph(layers, bytes_per_node=1)
    revolve = solve(g, budget, method="griewank")
    r = solve(g, budget, method="chain")
    assert r.peak_bytes <= budget and r.cost <= revolve.cost


@pytest.mark.parametrize(("fraction", "before"), [(0.2, 121.0), (0.15, 149.0)])
def test_a_cut_its_own_segment_reads_stays_held_below_the_split(fraction, before):
    """On Checkmate's chain every gradient reads its layer's output, the value crossing the cut
    after it: a split keeps it held for that backward instead of computing it again below."""
    g = chain_graph(32, bytes_per_node=1)
    model = chain_model(g)
    assert model.held_cuts == frozenset(range(model.L))
    budget = int(fraction * solve(g, 2**60, method="checkpoint_all").peak_bytes)
    r = solve(g, budget, method="chain")
    assert r.peak_bytes <= budget and r.cost < before  # dropping it: 121 and 149
    assert r.cost >= solve(g, budget, method="griewank").cost  # (revolve's 111 and 130: see the module)


@PROPERTY
@given(graphs())
def test_a_held_cut_holds_all_its_segments_backward_reads_and_nothing_later_reads_it(graph):
    """Held below a split, a cut's values are all its segment's backward reads of the forward
    pass (it computes nothing again) and no other backward stage reads them (they are freed
    after it)."""
    model = ChainModel(graph)
    stages = model.stage_segments()
    for k in model.held_cuts:
        mine = {d for t, seg in stages if seg == k for d in graph.nodes[t].deps
                if graph.nodes[d].kind is NodeKind.FORWARD}
        others = {d for t, seg in stages if seg != k for d in graph.nodes[t].deps}
        assert mine and mine <= set(model.cuts[k].crossing) and not mine & others
        assert model.own[k] * model.unit <= sum(graph.nodes[v].out_bytes for v in mine)


def test_reaches_below_one_level_plans_and_costs_less_than_nested():
    g = chain_graph(24, bytes_per_node=1)
    assert min_budget(g, "chain") < min_budget(g, "nested") < min_budget(g, "segments")
    budget = min_budget(g, "nested")
    assert solve(g, budget, method="chain").cost <= solve(g, budget, method="nested").cost


@pytest.mark.parametrize("graph", [unet_graph(8), unet_graph(40), chain_graph(12), random_training_graph(30, seed=3)],
                         ids=["unet8", "unet40", "chain12", "random30"])
def test_at_checkpoint_all_s_peak_it_recomputes_nothing(graph):
    """Keeping every segment whole is a plan of the recursion; where values cross many cuts (a
    U-Net's skips) the programme's count alone put it far above its peak (1.5x on unet:8)."""
    top = solve(graph, 2**60, method="checkpoint_all").peak_bytes
    r = solve(graph, top, method="chain")
    assert r.peak_bytes <= top and r.cost == pytest.approx(graph.total_cost)


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


def mlp_stack(blocks: int, *, head_bytes: int = 0):
    """A residual stack of MLP-like blocks: a costly wide matmul, two cheap wide elementwise
    values (an activation function's parts), a costly narrow projection, the residual add.
    Each gradient reads its node's value and inputs, so a block's backward holds its wide
    values unless it recomputes them. ``head_bytes``: a final layer norm and logits of that
    size, which the loss reads (a language model's head)."""
    deps, sizes, costs = [()], [4], [1.0]
    h = 0
    for _ in range(blocks):
        a = len(deps)
        deps += [(h,), (a,), (a + 1,), (a + 2,), (h, a + 3)]
        sizes += [16, 16, 16, 4, 4]
        costs += [10.0, 1.0, 1.0, 10.0, 1.0]
        h = a + 4
    saved = [(i, *d) for i, d in enumerate(deps)]
    if head_bytes:  # the logits' gradient reads the logits alone, as log-softmax's does
        deps += [(h,), (h + 1,)]
        sizes += [4, head_bytes]
        costs += [1.0, 10.0]
        saved += [(h + 1, h), (h + 2,)]
    return training_graph(deps, sizes, costs, saved=saved, name=f"mlp{blocks}-{head_bytes}")


def test_leaf_menus_are_fronts_of_held_subsets():
    model = ChainModel(mlp_stack(8))
    assert any(len(menu) > 1 for menu in model.menus)
    for s, menu in enumerate(model.menus):
        need, extra, held = menu[0]
        assert (need, extra) == (model.need[s], 0.0) and held.all() and held.shape == model.members[s].shape
        for (need_a, extra_a, _), (need_b, extra_b, held_b) in zip(menu, menu[1:]):
            assert need_b < need_a and extra_b > extra_a
            # one row for every backward stage, or one row for all, over the segment's members
            assert held_b.shape[-1] == model.members[s].size
            assert held_b.ndim == 1 or held_b.shape[0] == len(model._stages_of[s])


def test_exact_options_hold_by_stage_and_cost_no_more(monkeypatch):
    g = mlp_stack(8)
    model = ChainModel(g)
    assert not any(option[2].ndim == 2 for menu in model.menus for option in menu), "exact options wait for refine"
    model.refine()
    by_stage = [(s, o) for s, menu in enumerate(model.menus) for o, option in enumerate(menu) if option[2].ndim == 2]
    assert by_stage, "the repeated blocks get the exact model's options"
    # a plan holding by stage is what the simulator measures
    s, o = by_stage[-1]
    held = [()] * model.L
    held[s] = ((chain_module._MENU, (s, o)),)
    kept = tuple((chain_module._KEEP, k) for k in range(model.L) if k != s)  # s's own values recomputed
    plan = model._execute((kept, tuple(held)), "segment s holding by stage")
    assert plan.cost > g.total_cost
    sim = simulate(g, plan.schedule(g).lower(g))
    assert sim.ok and (sim.peak_bytes, sim.total_cost) == (plan.peak_bytes, plan.cost)
    low = min_budget(g, "chain")
    prepared.clear()
    monkeypatch.setattr(chain_module, "EXACT_MENU_LEVELS", 0)
    prefixes_only = min_budget(g, "chain")
    costs = {b: solve(g, b, method="chain").cost for b in (prefixes_only, prefixes_only + 8)}
    monkeypatch.undo()
    prepared.clear()
    assert low <= prefixes_only
    assert all(solve(g, b, method="chain").cost <= cost for b, cost in costs.items())


def test_leaf_menus_reach_lower_budgets_at_no_more_cost(monkeypatch):
    g = mlp_stack(8)
    low = min_budget(g, "chain")
    prepared.clear()
    monkeypatch.setattr(chain_module, "MENU_OPTIONS", 0)
    without = min_budget(g, "chain")
    whole_leaves = solve(g, without, method="chain")
    monkeypatch.undo()
    prepared.clear()
    assert low < without
    assert solve(g, low, method="chain").peak_bytes <= low
    assert solve(g, without, method="chain").cost <= whole_leaves.cost


def test_restarted_plans_hold_nothing_of_the_chain_across_the_loss():
    g = mlp_stack(8, head_bytes=96)
    model = ChainModel(g)
    assert model.restart_levels
    restarted = [model.measure_restart(i) for i in range(len(model.restart_levels))]
    for plan in restarted:
        sim = simulate(g, plan.schedule(g).lower(g))
        assert sim.ok and (sim.peak_bytes, sim.total_cost) == (plan.peak_bytes, plan.cost)
    kept_through = [model.measure(i) for i in range(len(model.front_levels))]
    assert min(p.peak_bytes for p in restarted) < min(p.peak_bytes for p in kept_through)
    # the least-peak restarted plan runs the forward pass again after the loss's stages
    least = min(restarted, key=lambda p: p.peak_bytes)
    loss = g.ids_of_kind(NodeKind.LOSS)[0]
    again = {int(i) for s, i in zip(least.stages, least.nodes) if s > loss and g.nodes[int(i)].kind is NodeKind.FORWARD}
    assert 0 in again
    low = min_budget(g, "chain")
    assert low == least.peak_bytes and solve(g, low, method="chain").peak_bytes <= low


def test_the_smallest_budgets_refine_the_menus_and_the_largest_do_not():
    g = mlp_stack(8)
    prepared.clear()  # (models are remembered per graph: another test may have refined this one)
    model = chain_model(g)
    top = solve(g, 10**9, method="checkpoint_all").peak_bytes
    model.plans_near(top)
    assert not model.exact and top > (1 + chain_module.REFINE_MARGIN) * min(p.peak_bytes for p in model.plans_near(top))
    with pytest.raises(InfeasibleBudgetError):
        solve(g, 1, method="chain")
    assert model.exact


def test_identical_segments_are_measured_once(monkeypatch):
    calls = []
    measure = ChainModel._measure_options
    monkeypatch.setattr(ChainModel, "_measure_options", lambda self, s, deadline: calls.append(s) or measure(self, s, deadline))
    model = ChainModel(mlp_stack(12))
    assert len(calls) < model.L / 2


def test_models_with_different_menus_do_not_share_measurements(monkeypatch):
    # plans name menu options by position; the exact options depend on the solves, so two
    # models of one graph may number them differently
    g = mlp_stack(8)
    first = ChainModel(g)
    first.refine()
    monkeypatch.setattr(chain_module, "EXACT_MENU_LEVELS", 0)  # prefixes alone, refined or not
    second = ChainModel(g)
    second.refine()

    def same(a, b):
        return len(a) == len(b) and all(x[2].shape == y[2].shape and np.array_equal(x[2], y[2]) for x, y in zip(a, b))

    assert not all(same(a, b) for a, b in zip(first.menus, second.menus))
    for model in (first, second):
        for i in range(len(model.front_levels)):
            fresh = model._execute(model._plan(model.front_levels[i]), "run again")
            assert (model.measure(i).peak_bytes, model.measure(i).cost) == (fresh.peak_bytes, fresh.cost)


def test_a_failing_block_solve_leaves_the_prefix_options(monkeypatch, caplog):
    from remat.errors import SolverError
    from remat.solvers import milp

    def broken(*args, **kwargs):
        raise SolverError("the backend is gone")

    monkeypatch.setattr(milp, "exact_schedule", broken)
    g = mlp_stack(8)
    model = ChainModel(g)
    before = [[(need, extra) for need, extra, _ in menu] for menu in model.menus]
    with caplog.at_level("INFO", logger="remat.solve"):
        model.refine()
    assert [[(need, extra) for need, extra, _ in menu] for menu in model.menus] == before
    assert "the backend is gone" in caplog.text


def test_a_leafs_block_reads_its_outside_values_as_inputs_freed_after_their_last_reader():
    """The exact model of a segment's leaf sees the values the block reads from outside (the
    segment's input, the incoming gradients) as leading inputs, live from the start and freed
    after their last reader there, not as bytes fixed for the whole block."""
    g = mlp_stack(8)
    model = ChainModel(g)
    s = next(k for k in range(model.L) if model._leaf_graph(k) is not None and model._stages_of[k])
    block = model._leaf_graph(s)
    own = model.members[s].tolist() + list(model._stages_of[s])
    lead = block.n - len(own)
    outside = sorted({d for v in own for d in g.nodes[v].deps if d not in set(own)})
    assert block.fixed_bytes == 0 and lead == len(outside) > 0
    assert [n.name for n in block.nodes] == [g.nodes[v].name for v in outside + own]
    for node, v in zip(block.nodes[:lead], outside):
        assert (node.deps, node.cost, node.recomputable, node.out_bytes) == ((), 0.0, False, g.nodes[v].out_bytes)
    # freed once read, they leave room: the block's least budget is below what counting them as
    # fixed bytes gives (the exact model of both)
    as_fixed = _block_with_fixed_outside(g, own, outside)
    assert min_budget(block, "milp") < min_budget(as_fixed, "milp")


def _block_with_fixed_outside(g, own, outside):
    from remat.graph import Graph, Node

    index = {v: k for k, v in enumerate(own)}
    nodes = [Node(g.nodes[v].name, g.nodes[v].kind, tuple(index[d] for d in g.nodes[v].deps if d in index),
                  g.nodes[v].out_bytes, g.nodes[v].cost, g.nodes[v].recomputable) for v in own]
    outputs = tuple(k for k, v in enumerate(own) if g.nodes[v].kind is not NodeKind.FORWARD
                    and (v in g.outputs or any(u not in index for u in g.users[v])))
    return Graph(tuple(nodes), sum(g.nodes[v].out_bytes for v in outside), outputs or (len(own) - 1,), "as fixed")


def _below(model: ChainModel, opt: dict, s: int, k: int, M: int) -> np.ndarray:
    """What segments s..k cost below a split at cut k, level by level: dropping what crosses
    the cut, or, at a cut whose segment's backward reads only what crosses it, keeping it
    (its units held): k's backward at once, then s..k-1 with what it read freed."""
    out = opt[s, k].copy()
    if k not in model.held_cuts:
        return out
    c, own = int(model.c[k]), int(model.own[k])
    leaf = max(int(model.need[k] - own - model.base), 0)  # k's backward, beside the cut
    for m in range(M):
        if m - c >= leaf:
            out[m] = min(out[m], 0.0 if k == s else opt[s, k - 1][min(m - c + own, M - 1)])
    return out


def _one_pair_at_a_time(model: ChainModel) -> dict[tuple[int, int], np.ndarray]:
    """The programme's table as its recurrence reads, one (s, t) at a time, shortest first
    (with ``frees_cuts``, a split may drop its cut once the next segment is computed from it)."""
    L, base = model.L, model.base
    M = model.levels - base if model.levels > base else 1
    need = model.need - base
    inf = np.float32(np.inf)
    opt: dict[tuple[int, int], np.ndarray] = {}
    once: dict[tuple[int, int], np.ndarray] = {}  # s..t run once from the value entering s
    for length in range(L):
        for s in range(L - length):
            t = s + length
            best = np.full(M, inf, dtype=np.float32)
            if length == 0:
                for o, (need_o, extra, _held) in enumerate(model.menus[s]):
                    k = max(need_o - base, 0)
                    best[k:] = np.minimum(best[k:], np.float32(max(model.f[s] + extra, 0.0)))
                    if o == 0:  # alone, holding all of it
                        once[s, t] = best.copy()
            else:
                for k, arr, const, plus in [(model.a[s], opt[s + 1, t], model.f[s], None)] + [
                        (model.c[sp - 1], opt[sp, t], model.prefix[sp] - model.prefix[s], _below(model, opt, s, sp - 1, M))
                        for sp in range(s + 1, t + 1)] + [
                        (0, once[sp, t], model.prefix[sp] - model.prefix[s], opt[s, sp - 1])  # the cut dropped
                        for sp in range(s + 1, t + 1) if model.frees_cuts]:
                    k = max(int(k), 0)
                    if k < M:
                        shifted = arr[:M - k] + np.float32(const)
                        if plus is not None:
                            shifted = shifted + plus[k:]
                        best[k:] = np.minimum(best[k:], shifted)
                    if plus is None:  # (after keeping s: levels below its need fit nothing)
                        best[np.arange(M) < need[s]] = inf
                        once[s, t] = best.copy()  # (kept: the first option)
            opt[s, t] = best
    return opt


@PROPERTY
@given(graphs())
def test_the_programme_solved_a_segment_at_a_time_is_its_recurrence(graph):
    """The table is filled for every end t of a first segment s at once: each entry equals the
    recurrence solved pair by pair, for the programme and for the one whose splits may free
    their cut."""
    built = ChainModel(graph)
    assert not built.frees_cuts and built._freeing.frees_cuts
    for model in (built, built._freeing):
        expected = _one_pair_at_a_time(model)
        assert set(model.opt) == set(expected)
        for key, row in expected.items():
            np.testing.assert_array_equal(model.opt[key], row, err_msg=str(key))


@PROPERTY
@given(graphs(), st.data())
def test_a_leaf_option_measured_on_its_own_stages_is_the_whole_walk(graph, data):
    """A leaf option's measurement walks only the leaf's own stages (the others' are walked once
    per segment): its need and cost are those of the whole walk, for one hold and for a hold
    per backward stage."""
    model = ChainModel(graph)
    with_stages = [s for s in range(model.L) if model.members[s].size and model._stages_of[s]]
    if not with_stages:
        return
    s = data.draw(st.sampled_from(with_stages))
    m, stages = model.members[s].size, len(model._stages_of[s])
    bits = data.draw(st.lists(st.booleans(), min_size=m * stages, max_size=m * stages))
    for held in (np.array(bits[:m], dtype=bool), np.array(bits, dtype=bool).reshape(stages, m)):
        masks = [np.zeros(graph.n, dtype=bool)] * (model.L + 1)
        rows: list = [None] * (model.L + 1)
        if held.ndim == 1:
            masks[s] = model._held_mask(s, held)
        else:
            rows[s] = held
        plan = model._walk(~model.leaf_mask[s] | model.always, masks, rows, "whole walk")
        mem = chain_module.order_memory(graph, np.asarray(plan.nodes, dtype=np.int64))
        mine = model._segment_of_stage[np.asarray(plan.stages)] == s
        need = float((mem[mine] - model._earlier[s, np.asarray(plan.stages)[mine]]).max()) if mine.any() else 0.0
        assert model._measure_leaf(s, held) == (need, float(plan.cost))
