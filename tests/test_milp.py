"""The MILP method: optimal against exhaustive search, never worse than a baseline, backends
agreeing, and every error path (time limit, infeasible budget, bad options, missing Gurobi)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import InfeasibleBudgetError, SolverError, SolveStatus, solve
from remat.builders import chain_graph, random_training_graph, unet_graph
from remat.graph import Graph, Node
from remat.schedule import Schedule
from remat.simulate import simulate
from remat.solvers.lp_round import solve_relaxation
from remat.solvers.milp import MilpBackend, exact_schedule, minimum_budget
from remat.solvers.milp_model import ModelObjective, build_model, peak_lower_bound_bytes
from remat.solvers.milp_start import BASELINE_METHODS, without_unread
from reference import (SMALL_GRAPHS, assert_no_baseline_cheaper, budget_between, checkpoint_all_peak, exhaustive_min_cost,
                       exhaustive_min_peak)

HAS_GUROBI = importlib.util.find_spec("gurobipy") is not None


# ---------------------------------------------------------------------------- optimality
@pytest.mark.parametrize("graph", SMALL_GRAPHS, ids=lambda g: g.name)
def test_milp_equals_exhaustive_search(graph: Graph) -> None:
    """Optimal at the checkpoint-all peak, at the minimum, and in between; below the minimum
    both the search and the MILP find nothing."""
    top = checkpoint_all_peak(graph)
    low = exhaustive_min_peak(graph)
    found = minimum_budget(graph)
    assert found.proven and found.budget_bytes == low
    for budget in sorted({top, (top + low) // 2, (top + 3 * low) // 4, low + 1, low}):
        expected = exhaustive_min_cost(graph, budget)
        # warm_start=False: the solver alone on the model; default: with the shortcuts too
        for result in (solve(graph, budget, method="milp", warm_start=False), solve(graph, budget, method="milp")):
            assert result.status is SolveStatus.OPTIMAL
            assert result.objective == pytest.approx(expected)
            assert result.peak_bytes <= budget
            assert result.objective == result.sim.total_cost
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, low - 1, method="milp")
    assert info.value.min_budget_bytes == low


def test_milp_handles_non_recomputable_nodes() -> None:
    g = chain_graph(4, bytes_per_node=1)
    nodes = list(g.nodes)
    nodes[1] = Node(nodes[1].name, nodes[1].kind, nodes[1].deps, 1, 1.0, recomputable=False)
    g = Graph(nodes=tuple(nodes), fixed_bytes=0, outputs=g.outputs, name="chain4_rng")
    for budget in (checkpoint_all_peak(g), exhaustive_min_peak(g)):
        result = solve(g, budget, method="milp", warm_start=False)
        assert result.objective == pytest.approx(exhaustive_min_cost(g, budget))
        assert result.sim.compute_counts[1] == 1


# ---------------------------------------------------------------------------- properties
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_forward=st.integers(2, 12), seed=st.integers(0, 10_000), where=st.floats(0.0, 1.0))
def test_milp_properties_on_random_graphs(n_forward: int, seed: int, where: float) -> None:
    graph = random_training_graph(n_forward, seed)
    low = minimum_budget(graph).budget_bytes
    budget = budget_between(graph, low, where)
    result = solve(graph, budget, method="milp")
    assert result.status is SolveStatus.OPTIMAL
    assert result.objective == result.sim.total_cost and result.peak_bytes <= budget
    assert solve(graph, budget, method="milp", warm_start=False).objective == pytest.approx(result.objective)
    assert_no_baseline_cheaper(graph, budget, result.objective)
    assert result.lower_bound is not None and result.lower_bound <= result.objective + 1e-6
    relaxation = solve_relaxation(graph, budget)
    assert relaxation is not None and relaxation.lower_bound <= result.objective + 1e-6
    try:
        rounded = solve(graph, budget, method="lp_round")
    except InfeasibleBudgetError as exc:  # rounding may miss plans at the tightest budgets
        assert exc.min_budget_bytes is None or exc.min_budget_bytes > budget
    else:
        # lp_round reports the better of Checkmate's LP bound and the instant bound, both
        # below the optimum the MILP proved
        assert relaxation.lower_bound - 1e-6 <= rounded.lower_bound <= result.objective + 1e-6
        assert result.objective <= rounded.objective + 1e-9


# ---------------------------------------------------------------------------- backends
@pytest.mark.parametrize("graph", [chain_graph(4, bytes_per_node=1), random_training_graph(5, seed=7)],
                         ids=lambda g: g.name)
def test_cpsat_agrees_with_highs(graph: Graph) -> None:
    low = minimum_budget(graph).budget_bytes
    for budget in (low, (low + checkpoint_all_peak(graph)) // 2):
        highs = solve(graph, budget, method="milp", warm_start=False)
        cpsat = solve(graph, budget, method="milp", backend="cpsat", warm_start=False)
        assert cpsat.status is SolveStatus.OPTIMAL
        assert cpsat.objective == pytest.approx(highs.objective)
        assert cpsat.peak_bytes <= budget and cpsat.stats.backend == "cpsat"


def test_cpsat_without_warm_start_and_with_fractional_costs() -> None:
    g = chain_graph(3, bytes_per_node=1).with_costs([1.25, 0.5, 2.0, 1.0, 0.75, 1.5, 3.0])
    for budget in (3, 4):
        a = solve(g, budget, method="milp", warm_start=False)
        b = solve(g, budget, method="milp", backend=MilpBackend.CPSAT, warm_start=False)
        assert a.objective == pytest.approx(exhaustive_min_cost(g, budget))
        assert b.objective == pytest.approx(a.objective)


def test_backend_names_parse() -> None:
    assert MilpBackend.parse("HiGHS") is MilpBackend.HIGHS
    assert MilpBackend.parse("cpsat") is MilpBackend.CPSAT
    assert MilpBackend.parse(MilpBackend.GUROBI) is MilpBackend.GUROBI


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown MILP backend 'scip'; choose one of 'highs', 'cpsat', 'gurobi'"):
        solve(chain_graph(2, bytes_per_node=1), 4, method="milp", backend="scip")


@pytest.mark.skipif(HAS_GUROBI, reason="gurobipy is installed")
def test_missing_gurobi_says_how_to_install() -> None:
    with pytest.raises(SolverError, match=r"pip install gurobipy"):
        solve(chain_graph(2, bytes_per_node=1), 4, method="milp", backend="gurobi")


@pytest.mark.skipif(not HAS_GUROBI, reason="gurobipy is not installed")
def test_gurobi_agrees_with_highs() -> None:  # pragma: no cover - needs a Gurobi license
    g = chain_graph(4, bytes_per_node=1)
    assert solve(g, 4, method="milp", backend="gurobi").objective == solve(g, 4, method="milp").objective


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("time_limit_s", 0, "time_limit_s=0 must be a positive"), ("mip_gap", 1.5, "mip_gap=1.5 must be"),
     ("threads", 0, "threads=0 must be a positive int")],
)
def test_bad_numbers_are_refused(option: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        solve(chain_graph(2, bytes_per_node=1), 4, method="milp", **{option: value})


# ---------------------------------------------------------------------------- limits
def test_time_limit_returns_best_plan_with_bound_and_gap() -> None:
    graph = chain_graph(20)
    budget = int(0.3 * checkpoint_all_peak(graph))
    result = solve(graph, budget, method="milp", time_limit_s=2.0)
    assert result.status is SolveStatus.TIME_LIMIT
    assert result.peak_bytes <= budget and result.sim.ok
    assert result.lower_bound is not None and result.lower_bound < result.objective
    assert result.gap is not None and result.gap > 0


def test_infeasible_budget_reports_exact_minimum() -> None:
    graph = random_training_graph(6, seed=11)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, peak_lower_bound_bytes(graph) - 1, method="milp")
    low = info.value.min_budget_bytes
    assert low is not None and "smallest budget method 'milp' can meet" in str(info.value)
    assert solve(graph, low, method="milp").peak_bytes <= low
    with pytest.raises(InfeasibleBudgetError) as again:
        solve(graph, low - 1, method="milp")
    assert again.value.min_budget_bytes == low


def test_a_budget_below_what_every_plan_holds_says_so_in_plain_words() -> None:
    graph = chain_graph(6, bytes_per_node=1)
    with pytest.raises(InfeasibleBudgetError, match=r"raise the budget to at least that \(this budget is below the "
                                                    r"3 B that every plan holds at once when it computes node 7 "
                                                    r"\('grad_f5'\): the fixed bytes, that node's inputs, output and "
                                                    r"scratch, the outputs computed so far and the values read later "
                                                    r"that cannot be recomputed\)"):
        solve(graph, 2, method="milp")


def test_fixed_bytes_over_budget_is_infeasible() -> None:
    graph = chain_graph(2, bytes_per_node=1, fixed_bytes=100)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, 50, method="milp")
    assert info.value.min_budget_bytes == 103


def test_progress_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    # a budget where no baseline meets the bound: the exact model searches, and says so
    graph = chain_graph(6, bytes_per_node=1)
    with caplog.at_level(logging.INFO, logger="remat.solve"):
        solve(graph, 4, method="milp", warm_start=False)
    text = caplog.text
    assert "bound: chain6 under 4 B" in text
    assert "highs on chain6" in text and "incumbent" in text and "finished: optimal" in text
    # the retention model reports its incumbents and what it needed too
    caplog.clear()
    graph = random_training_graph(12, seed=3)
    budget = (minimum_budget(graph).budget_bytes + checkpoint_all_peak(graph)) // 2
    with caplog.at_level(logging.INFO, logger="remat.solve"):
        solve(graph, budget, method="milp", exact_max_nodes=0, early_proof=False)
    assert f"retention: {graph.name} under {budget} B" in caplog.text and "memory rows" in caplog.text


# ---------------------------------------------------------------------------- the model
def test_model_is_smaller_than_checkmate() -> None:
    graph = chain_graph(20)
    model = build_model(graph, checkpoint_all_peak(graph))
    n, m = graph.n, sum(len(node.deps) for node in graph.nodes)
    assert model.n_cols < 3 * n * n + n * m
    assert model.n_integer < n * n  # fixed entries of R and S are constants
    assert model.bytes_unit == 2**20


def test_start_from_a_plan_is_feasible_and_decodes_back() -> None:
    graph = random_training_graph(5, seed=4)
    plan = solve(graph, checkpoint_all_peak(graph), method="checkpoint_all").schedule
    model = build_model(graph, checkpoint_all_peak(graph))
    x, why = model.start_from(plan)
    assert x is not None, why
    assert model.max_violation(x) < 1e-9
    assert np.array_equal(model.decode(x).R, plan.R)
    assert model.objective_value(x) == pytest.approx(graph.total_cost)


def test_start_from_over_budget_plan_is_refused() -> None:
    graph = chain_graph(4, bytes_per_node=1)
    model = build_model(graph, 4)
    x, why = model.start_from(Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)))
    assert x is None and "violates a row" in why


def test_decode_refuses_fractional_values() -> None:
    graph = chain_graph(3, bytes_per_node=1)
    model = build_model(graph, 4)
    x = np.full(model.n_cols, 0.5)
    with pytest.raises(ValueError, match=r"is not within 1e-06 of 0 or 1"):
        model.decode(x)


def test_peak_model_minimum_matches_search() -> None:
    graph = chain_graph(3, bytes_per_node=1)
    model = build_model(graph, None, ModelObjective.PEAK)
    assert model.peak_col is not None and model.col_cost[model.peak_col] == 1.0
    assert minimum_budget(graph).budget_bytes == exhaustive_min_peak(graph) == 3


def test_unread_computations_are_dropped_from_a_start() -> None:
    graph = chain_graph(3, bytes_per_node=1)
    R = np.eye(graph.n, dtype=bool)
    R[5, 3] = True  # recompute the loss after its only reader (node 4) ran: nothing reads it
    padded = Schedule.from_compute(graph, R)
    clean = without_unread(graph, padded)
    assert not clean.R[5, 3] and np.array_equal(clean.R, np.eye(graph.n, dtype=bool))
    assert clean.cost(graph) < padded.cost(graph)
    model = build_model(graph, checkpoint_all_peak(graph))
    assert model.start_from(padded)[0] is None and model.start_from(clean)[0] is not None


def test_cpsat_reports_the_minimum_budget_too() -> None:
    # No baseline reaches this graph's minimum, so the peak-minimizing model has to run.
    graph = random_training_graph(5, seed=2)
    low = minimum_budget(graph).budget_bytes
    assert minimum_budget(graph, backend="cpsat").budget_bytes == low == 25
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, 12, method="milp", backend="cpsat")
    assert info.value.min_budget_bytes == low


def test_thread_count_can_change_between_solves() -> None:
    graph = chain_graph(5, bytes_per_node=1)
    costs = {threads: solve(graph, 4, method="milp", threads=threads, warm_start=False).objective
             for threads in (2, 1, 3)}
    assert len(set(costs.values())) == 1


def test_byte_exact_budgets_with_megabyte_sizes() -> None:
    # U-Net sizes share no common factor, so the model works in single bytes (values ~1e6):
    # the plan at the minimum must fit to the byte and one byte less must be infeasible.
    graph = unet_graph(3)
    found = minimum_budget(graph)
    assert found.proven and build_model(graph, found.budget_bytes).bytes_unit == 1
    assert solve(graph, found.budget_bytes, method="milp", warm_start=False).peak_bytes <= found.budget_bytes
    with pytest.raises(InfeasibleBudgetError):
        solve(graph, found.budget_bytes - 1, method="milp")


def test_a_plan_meeting_a_lower_bound_needs_no_search(caplog: pytest.LogCaptureFixture) -> None:
    graph = chain_graph(10)
    with caplog.at_level(logging.INFO, logger="remat.solve"):
        result = solve(graph, checkpoint_all_peak(graph), method="milp")
    assert result.status is SolveStatus.OPTIMAL and result.objective == graph.total_cost
    assert result.lower_bound == graph.total_cost and result.stats.nodes_explored == 0
    assert "no search needed" in caplog.text and "highs on" not in caplog.text


@pytest.mark.parametrize("reported", [-1.23e8, float("nan"), float("-inf")])
def test_a_bound_below_computing_every_node_once_is_replaced_by_that(reported: float) -> None:
    from remat.solvers.base import finish

    graph = chain_graph(4)
    schedule = Schedule.from_compute(graph, np.eye(graph.n, dtype=bool))
    result = finish(graph, schedule, budget_bytes=2**40, method="milp", status=SolveStatus.TIME_LIMIT,
                    started_s=0.0, lower_bound=reported)
    assert result.lower_bound == graph.total_cost and result.gap == 0.0


def _rescaled(graph: Graph, *, bytes_factor: int = 1, extra_bytes: int = 0, cost_factor: float = 1.0) -> Graph:
    nodes = tuple(Node(n.name, n.kind, n.deps, n.out_bytes * bytes_factor + extra_bytes, n.cost * cost_factor,
                       n.recomputable) for n in graph.nodes)
    return Graph(nodes=nodes, fixed_bytes=graph.fixed_bytes * bytes_factor, outputs=graph.outputs,
                 name=graph.name + "_rescaled")


@pytest.mark.parametrize("graph", [g for g in SMALL_GRAPHS if len(set(g.out_bytes)) > 1], ids=lambda g: g.name)
def test_gigabyte_sizes_round_up_and_still_find_the_optimum(graph: Graph) -> None:
    """Each original byte becomes F = 2**32 + 1 bytes, plus one byte per value: the gcd is 1, so
    the unit grows and sizes round up. A plan fits F*k + n bytes exactly when it fits k
    originally (at most n values are live), so the optimum must be the original one."""
    factor = 2**32 + 1
    big = _rescaled(graph, bytes_factor=factor, extra_bytes=1)
    model = build_model(big, 2**62)
    assert not model.exact_units and max(model.size_units) <= 2**20 + 1
    top, low = checkpoint_all_peak(graph), exhaustive_min_peak(graph)
    for budget in sorted({top, (top + low) // 2, low}):
        expected = exhaustive_min_cost(graph, budget)
        slack = big.n * model.bytes_unit  # what rounding up may over-count
        result = solve(big, budget * factor + big.n + slack, method="milp")
        assert result.status is SolveStatus.OPTIMAL
        assert result.objective == pytest.approx(expected)


def test_costs_of_ten_million_are_scaled_for_highs() -> None:
    """A batch of 256 VGG16 images has node costs up to 2e7 us: HiGHS' dual simplex failed on
    them unscaled ("excessive dual values")."""
    graph = random_training_graph(4, seed=1)
    big = _rescaled(graph, cost_factor=1.7e7)
    budget = (checkpoint_all_peak(graph) + exhaustive_min_peak(graph)) // 2
    expected = exhaustive_min_cost(graph, budget) * 1.7e7
    for method in ("milp", "lp_round"):
        result = solve(big, budget, method=method)
        assert result.objective == pytest.approx(expected) or method == "lp_round"
        assert result.lower_bound is not None and result.lower_bound <= result.objective * (1 + 1e-9)


def _grouped_small_graphs() -> list[Graph]:
    from remat.coarsen import coarsen

    out = []
    for g in (chain_graph(4, bytes_per_node=1), random_training_graph(3, seed=1), random_training_graph(3, seed=12),
              random_training_graph(4, seed=3), random_training_graph(4, seed=10), random_training_graph(4, seed=18)):
        c = coarsen(g, max_nodes=max(3, (2 * g.n) // 3)).coarse
        out.append(Graph(nodes=c.nodes, fixed_bytes=c.fixed_bytes, outputs=c.outputs, name=g.name + "_grouped"))
    return out


@pytest.mark.parametrize("graph", _grouped_small_graphs(), ids=lambda g: g.name)
def test_milp_equals_exhaustive_search_on_grouped_graphs(graph: Graph) -> None:
    """Grouped graphs carry scratch bytes and kept bytes (gradients grouped with the backward
    ops around them): the MILP's memory rows must count both exactly as the simulator does."""
    assert any(n.temp_bytes or n.kept_bytes for n in graph.nodes)
    top = checkpoint_all_peak(graph)
    low = exhaustive_min_peak(graph)
    assert minimum_budget(graph).budget_bytes == low
    for budget in sorted({top, (top + low) // 2, low}):
        result = solve(graph, budget, method="milp", warm_start=False)
        assert result.status is SolveStatus.OPTIMAL
        assert result.objective == pytest.approx(exhaustive_min_cost(graph, budget))
    with pytest.raises(InfeasibleBudgetError):
        solve(graph, low - 1, method="milp")


def test_milp_says_which_plan_it_returned():
    """milp weighs every baseline's plans against its models': the result says which one it
    returned, and reports of a run label a baseline's plan by its baseline."""
    from remat.compare import plan_source
    from remat.planning import plan_graph

    graph = chain_graph(12, bytes_per_node=1)
    everything = solve(graph, 10**9, method="milp")  # checkpoint-all fits
    assert everything.stats.plan_from == "checkpoint_all"
    planned = plan_graph(graph, 10**9, "milp")
    assert plan_source(planned, "milp") == "checkpoint_all"
    tight = solve(graph, 6, method="milp")
    assert tight.stats.plan_from in (*BASELINE_METHODS, "retention", "milp")
    own = plan_graph(graph, 6, "milp")
    expected = own.result.stats.plan_from if own.result.stats.plan_from in BASELINE_METHODS else "milp"
    assert plan_source(own, "milp") == expected


def test_highs_banner_never_reaches_stdout():
    """HiGHS prints its banner when a process builds its first instance, before any option can be
    set: remat's tables and JSON on stdout must not start with it."""
    import subprocess
    import sys

    script = (f"import sys; sys.path[:0] = {sys.path!r}\n"
              "from remat import solve\n"
              "from remat.builders import chain_graph\n"
              "from reference import budget_between, checkpoint_all_peak\n"
              "g = chain_graph(8)\n"
              "print(solve(g, budget_between(g, checkpoint_all_peak(g) // 2, 0.5), method='milp').status.value)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() in ("optimal", "feasible"), run.stdout


def test_the_exact_model_as_a_rescue_gets_a_few_seconds_and_still_proves_a_chain_s_floor(monkeypatch) -> None:
    import time

    import remat.solvers.milp as milp_module
    from remat.solvers.prepared import clear

    seen = []
    real = milp_module._exact

    def spy(*args):
        seen.append((args[7], time.perf_counter()))  # the deadline handed over, and when
        return real(*args)

    monkeypatch.setattr(milp_module, "_exact", spy)
    from remat.solvers.bounds import InstantBounds

    # the single-instant bound alone: the bound of several instants, given the seconds, can
    # prove a chain's floor too (60 nodes: 1885 of 1891), which would leave nothing to rescue
    single = InstantBounds.cost_bound
    monkeypatch.setattr(InstantBounds, "cost_bound", lambda self, budget, **kw: single(self, budget, **{**kw, "multi": False}))
    # 121 nodes, above EXACT_ALWAYS_NODES: the exact model is a rescue of a plan in hand. The
    # rescue's seconds are raised here: that its default suffices is a speed claim, which the
    # benchmark measures; on a loaded machine the relaxation alone can take longer
    monkeypatch.setattr(milp_module, "EXACT_RESCUE_MAX_S", 20.0)
    g = chain_graph(60)
    floor = minimum_budget(g).budget_bytes
    clear()
    r = solve(g, floor, method="milp", time_limit_s=60)
    (deadline, at), = seen
    assert deadline <= at + milp_module.EXACT_RESCUE_MAX_S + 1e-6
    # what it is still there for: at a chain's floor everything is recomputed from the input,
    # which a single instant does not see (it proves 1.49x) and the exact model's relaxation
    # proves by itself
    assert r.status is SolveStatus.OPTIMAL and r.cost == r.lower_bound == 1891.0
    # where the rescue's seconds run out, the call's time limit did not: FEASIBLE, not TIME_LIMIT
    seen.clear()
    monkeypatch.setattr(milp_module, "EXACT_RESCUE_MAX_S", 0.5)
    clear()
    middle = solve(g, floor * 3, method="milp", time_limit_s=60)
    assert seen and middle.gap > 0.01 and middle.status is SolveStatus.FEASIBLE
    # on small graphs it has the whole time limit
    seen.clear()
    clear()
    small = chain_graph(12)
    started = time.perf_counter()
    solve(small, minimum_budget(small).budget_bytes, method="milp", time_limit_s=60, early_proof=False)
    assert seen and seen[0][0] >= started + 59
    # above EXACT_MAX_NODES there is no exact model: a plan in hand and its gap are returned
    seen.clear()
    clear()
    large = chain_graph(70)  # 141 nodes
    assert milp_module.EXACT_MAX_NODES < large.n
    r = solve(large, minimum_budget(large).budget_bytes, method="milp", time_limit_s=60)
    assert not seen and r.gap > 0.01 and r.status is SolveStatus.FEASIBLE


#: The rescue threshold the two tests below run under (``milp.EXACT_RESCUE_GAP`` is 1%; the bound
#: of their graph proves 564-568 against its best plan's 570, 0.35-1.05%, with more or less time).
RESCUE_GAP = 0.001


def test_a_rescue_searches_only_past_a_relaxation_above_the_bound_in_hand(monkeypatch) -> None:
    import remat.solvers.milp as milp_module
    from remat.solvers.prepared import clear

    rescues, searches = [], []
    real_exact, real_search = milp_module._exact, milp_module.run_backend

    def exact(*args):
        rescues.append(args[8])  # the bound the rescue must beat
        return real_exact(*args)

    def search(*args, **kwargs):
        searches.append(args)
        return real_search(*args, **kwargs)

    monkeypatch.setattr(milp_module, "_exact", exact)
    monkeypatch.setattr(milp_module, "run_backend", search)
    monkeypatch.setattr(milp_module, "EXACT_RESCUE_GAP", RESCUE_GAP)  # (see RESCUE_GAP)
    g = random_training_graph(35, seed=1)  # 71 nodes: a rescue
    floor = 90  # its smallest budget (minimum_budget, which takes a while to find it)
    clear()
    r = solve(g, floor, method="milp", time_limit_s=30)
    (beat,) = rescues
    assert beat is not None and r.lower_bound == pytest.approx(beat) and r.gap > RESCUE_GAP
    # the exact model's relaxation is below the instant bound: no branching could close the gap
    # in a rescue's seconds, so none is started, and the call is not reported as timed out
    assert solve_relaxation(g, floor).lower_bound < beat
    assert searches == [] and r.status is SolveStatus.FEASIBLE


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 14), seed=st.integers(0, 10_000), shuffle=st.booleans())
def test_a_candidate_given_as_an_order_is_the_order_its_schedule_runs(n, seed, shuffle) -> None:
    """``Candidate.as_plan`` of a plan given as a compute order is the order its schedule runs
    (stage by stage, in id order), whether it keeps the order (in that order already) or
    builds the schedule (not in that order: the stages' computations shuffled)."""
    from remat.schedule import stage_order
    from remat.solvers.baselines import BaselinePlan, measure_order
    from remat.solvers.milp_start import Candidate
    from remat.solvers.repair import lower_peak

    g = random_training_graph(n, seed=seed)
    start = measure_order(g, range(g.n), range(g.n), "checkpoint-all")
    plan = lower_peak(g, start, budget_bytes=start.peak_bytes * 2 // 3)
    stages, nodes = np.asarray(plan.stages), np.asarray(plan.nodes)
    if shuffle:  # each stage's recomputations in reverse id order (its own node stays last)
        by = np.lexsort((np.where(nodes == stages, 1, 0), -nodes, stages))
        stages, nodes = stages[by], nodes[by]
    given_plan = BaselinePlan("lowered", stages, nodes, plan.peak_bytes, plan.cost)
    candidate = Candidate.of_plan("lowered", g, given_plan)
    runs = stage_order(candidate.schedule.R)
    mine = candidate.as_plan(g)
    assert (candidate.order is not None) == bool(np.array_equal(stages, runs[0]) and np.array_equal(nodes, runs[1]))
    np.testing.assert_array_equal(mine.stages, runs[0])
    np.testing.assert_array_equal(mine.nodes, runs[1])
    assert (mine.label, mine.peak_bytes, mine.cost) == ("lowered", plan.peak_bytes, plan.cost)


def test_no_rescue_where_the_model_rounds_sizes_up(monkeypatch) -> None:
    """A graph whose sizes are not whole model units gets no rescue: the relaxation of its
    rounded-up model bounds nothing, so the rescue could not search. The same graph with
    exact units is rescued at the same budget, and both plan as well."""
    import remat.solvers.milp as milp_module
    from remat.solvers.milp_model import units_are_exact
    from remat.solvers.prepared import clear

    rescues = []
    real_exact = milp_module._exact
    monkeypatch.setattr(milp_module, "_exact", lambda *args: rescues.append(args[8]) or real_exact(*args))
    monkeypatch.setattr(milp_module, "EXACT_RESCUE_GAP", RESCUE_GAP)  # (see RESCUE_GAP)
    unit = 2**18  # sizes up to 8 units of this: past MAX_SIZE_UNITS once their gcd is 1 byte
    exact = random_training_graph(35, seed=1, bytes_unit=unit)  # 71 nodes: a rescue
    nodes = list(exact.nodes)
    i = next(k for k, node in enumerate(nodes) if node.out_bytes and k not in exact.output_set)
    nodes[i] = dataclasses.replace(nodes[i], out_bytes=nodes[i].out_bytes + 1)
    rounded = Graph(nodes=tuple(nodes), fixed_bytes=exact.fixed_bytes, outputs=exact.outputs, name="rounded")
    assert units_are_exact(exact) and not units_are_exact(rounded)
    results = []
    for g in (exact, rounded):
        clear()
        rescues.clear()
        results.append(solve(g, 90 * unit + 1, method="milp", time_limit_s=30))
        assert len(rescues) == (1 if g is exact else 0) and results[-1].gap > RESCUE_GAP
    assert results[0].cost == results[1].cost


def test_exact_schedule_alone_finds_the_known_optima_and_says_none_below_them(caplog):
    # twelve unit nodes: the exact model's optimum is 31 at a budget of 8 (test_chain's table)
    g = chain_graph(12, bytes_per_node=1)
    with caplog.at_level(logging.WARNING, logger="remat"):
        schedule = exact_schedule(g, 8, time_limit_s=10)
        assert schedule is not None and schedule.cost(g) == 31.0
        assert simulate(g, schedule.lower(g)).peak_bytes <= 8
        assert exact_schedule(g, 2, time_limit_s=10) is None  # below what any plan needs
    assert not caplog.records, "a block's solve is internal: nothing to warn the user about"


def test_a_plan_returned_for_a_smaller_budget_serves_a_larger_one(monkeypatch) -> None:
    """Plans returned earlier are candidates at every later budget they fit: with the searches
    finding nothing at the larger budget, the plan returned at the smaller one is returned
    (never the least-peak fallback), so a sweep never pays more at a larger budget."""
    import remat.solvers.milp as milp_module
    from remat.solvers.prepared import clear, prepared

    clear()
    graph = random_training_graph(10, seed=4)
    floor = minimum_budget(graph, exact_max_nodes=0).budget_bytes
    small = solve(graph, floor, method="milp", exact_max_nodes=0, time_limit_s=10)
    kept = prepared(graph).returned
    assert [(c.peak_bytes, c.cost) for c in kept] == [(small.peak_bytes, small.objective)]
    assert kept[0].name.endswith("(returned for an earlier budget)")
    for name in ("_retention", "_repair", "_restarted", "_pruned", "_reshuffled"):
        monkeypatch.setattr(milp_module, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(milp_module, "baseline_candidates", lambda *args, **kwargs: [])
    larger = solve(graph, floor + floor // 4, method="milp", exact_max_nodes=0, time_limit_s=10)
    assert larger.stats.plan_from == kept[0].name and larger.objective == small.objective
    # checkpoint-all peaks higher but costs less: kept too, after it; a plan seen again is not
    from remat.solvers.milp_start import baseline_candidates

    everything, = baseline_candidates(graph, 10**12, methods=("checkpoint_all",))
    prepared(graph).saw_plan(everything)
    prepared(graph).saw_plan(kept[0])
    assert [(c.peak_bytes, c.cost) for c in prepared(graph).returned] == [
        (small.peak_bytes, small.objective), (everything.peak_bytes, graph.total_cost)]


@pytest.mark.parametrize("second_misreports", [False, True])
def test_a_misreported_exact_solution_is_solved_again_without_presolve_then_without_the_start(
        monkeypatch, second_misreports):
    """HiGHS 1.16 was seen to report, given a start, an objective its solution does not have:
    the exact model is solved again from the start without presolve, then (if that misreports
    too) from scratch; the result's objective is its solution's."""
    import remat.solvers.milp_backends as backends

    graph = chain_graph(3, bytes_per_node=1)
    model = build_model(graph, checkpoint_all_peak(graph), ModelObjective.COST)
    real = backends._run_highs_once
    calls = []

    def misreporting(model_, settings_, start, presolve=True):
        result = real(model_, settings_, start, presolve=presolve)
        calls.append((start is not None, presolve))
        if start is not None and (presolve or second_misreports):
            return dataclasses.replace(result, objective=model_.objective_value(result.x) - 1.0)
        return result

    monkeypatch.setattr(backends, "_run_highs_once", misreporting)
    start, why = model.start_from(Schedule.from_kept(graph, np.tril(np.ones((graph.n, graph.n), dtype=bool), -1)))
    assert start is not None, why
    settings_ = backends.SolverSettings(time_limit_s=10, label="test")
    result = backends._run_highs(model, settings_, start)
    assert calls == [(True, True), (True, False)] + ([(False, True)] if second_misreports else [])
    assert result.x is not None
    assert result.objective == pytest.approx(model.objective_value(result.x))


def test_planning_leaves_the_objects_made_before_it_out_of_collections(monkeypatch) -> None:
    """While a method plans, the objects that existed before are frozen out of the garbage
    collector's passes, and thawed after it returns or raises; a process that froze objects
    itself is left as it is."""
    import gc

    from remat.solvers import base

    seen = []

    def method(graph, budget_bytes):
        seen.append(gc.get_freeze_count())
        if budget_bytes == 1:
            raise SolverError("no plan")
        return base._REGISTRY["checkpoint_all"](graph, budget_bytes)

    monkeypatch.setitem(base._REGISTRY, "watching", method)
    graph = chain_graph(4)
    gc.unfreeze()
    before = len(gc.get_objects())
    solve(graph, 2**40, method="watching")
    with pytest.raises(SolverError):
        solve(graph, 1, method="watching")
    assert seen[0] >= before and seen[1] > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # the process's own freeze
    try:
        frozen = gc.get_freeze_count()
        calls = []
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        solve(graph, 2**40, method="watching")
        assert calls == []
        # (frozen objects freed while it plans, such as a cache's entries, leave the count)
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        monkeypatch.undo()
        gc.unfreeze()


@pytest.mark.parametrize("far", [True, False])
def test_the_lowering_gets_more_time_where_the_plan_in_hand_is_far_from_the_bound(monkeypatch, far) -> None:
    """A start far over the budget takes seconds to lower and the starts share the time: where
    nothing fits yet or the best plan is more than ``BOUND_MORE_GAP`` above the bound, the
    repair gets ``REPAIR_FAR_SHARE`` of the time limit (at most ``REPAIR_FAR_MAX_S``), else
    ``REPAIR_TIME_SHARE`` (at most ``REPAIR_MAX_S``)."""
    import remat.solvers.milp as milp_module
    from remat.solvers.prepared import clear

    clear()
    graph = random_training_graph(10, seed=4)
    floor = minimum_budget(graph, exact_max_nodes=0).budget_bytes
    given: list[float] = []

    def spy(graph_, budget_bytes, time_limit_s):
        given.append(time_limit_s)
        return None

    monkeypatch.setattr(milp_module, "_repair", spy)
    monkeypatch.setattr(milp_module, "_retention", lambda *args, **kwargs: None)
    if far:  # nothing known fits
        monkeypatch.setattr(milp_module, "baseline_candidates", lambda *args, **kwargs: [])
    else:  # a plan in hand more than 1% above the bound counts as near
        monkeypatch.setattr(milp_module, "BOUND_MORE_GAP", 1e9)
    limit = 20.0
    result = solve(graph, floor, method="milp", exact_max_nodes=0, time_limit_s=limit)
    assert simulate(graph, result.plan).peak_bytes <= floor
    assert len(given) == 1, "the repair runs once, before the restarted graphs and the exact model"
    if far:
        assert given[0] == pytest.approx(min(milp_module.REPAIR_FAR_MAX_S, milp_module.REPAIR_FAR_SHARE * limit), rel=0.05)
    else:
        assert given[0] == pytest.approx(min(milp_module.REPAIR_MAX_S, milp_module.REPAIR_TIME_SHARE * limit))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=6, max_value=14), st.integers(min_value=0, max_value=10**6), st.floats(0.0, 1.0))
def test_the_lowered_starts_are_valid_plans_each_below_its_start_and_a_descent_that_fits_is_kept(n, seed, where):
    """``_lowered`` runs the starts' descents in rounds: every plan it returns simulates to
    the peak and cost it claims, is below its start, and fits the budget wherever the descent
    of that start alone, given the whole time, fits it."""
    from remat.solvers.milp import _lowered
    from remat.solvers.milp_start import baseline_candidates
    from remat.solvers.repair import lower_peak

    graph = random_training_graph(n, seed=seed)
    floor = minimum_budget(graph, exact_max_nodes=0).budget_bytes
    budget = int(floor + where * (checkpoint_all_peak(graph) - floor))
    starts = [c for c in baseline_candidates(graph, budget, lowest_peak=True) if c.peak_bytes > budget][:4]
    found = _lowered(graph, starts, budget, 30.0)
    by_name = {c.name: c for c in starts}
    for c in found:
        start = by_name[c.name.removesuffix(" with its peak lowered")]
        sim = simulate(graph, c.as_plan(graph).schedule(graph).lower(graph))
        assert sim.ok and sim.peak_bytes == c.peak_bytes and sim.total_cost == pytest.approx(c.cost)
        assert c.peak_bytes < start.peak_bytes
    for start in starts:
        alone = lower_peak(graph, start.as_plan(graph), budget_bytes=budget, time_limit_s=30.0)
        if alone.peak_bytes <= budget:
            assert any(c.name.startswith(start.name) and c.peak_bytes <= budget for c in found)


def test_a_least_peak_plan_kept_on_disk_plans_the_stated_smallest_budget_in_a_later_process(tmp_path):
    """The smallest budget comes from time-limited searches: stated by one process, it was refused
    by the next (which found a larger one in its time). Kept on disk (as the command line does)
    and read back into a cold planner, it plans at once; a file that is not such a record, or
    whose order is not a plan of the graph, is not used."""
    import json

    from remat.backend_cache import load_least_peak, store_least_peak
    from remat.coarsen import fold_aliases
    from remat.solvers import prepared

    # (the exact least-peak search proves 85 MiB in seconds; in 0.05 s the search finds 86 MiB)
    graph = fold_aliases(random_training_graph(16, seed=2, bytes_unit=2**20)).coarse
    prepared.clear()
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(graph, 1, method="milp", time_limit_s=30)
    stated = caught.value.min_budget_bytes
    store_least_peak(tmp_path)
    (key,) = [p.stem for p in tmp_path.glob("*.json")]
    assert key == graph.fingerprint(costs=False)
    (tmp_path / "junk.json").write_text("not json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "remat.least_peak_plan", "stages": [0],
                                                     "nodes": [0]}))  # (no peak: malformed)
    prepared.clear()  # (a new process)
    assert load_least_peak(tmp_path) == 1
    assert minimum_budget(graph, time_limit_s=0.05).budget_bytes <= stated
    result = solve(graph, stated, method="milp", time_limit_s=0.5)
    assert result.peak_bytes <= stated
    # an order that is not a plan of the graph (a node before its inputs) is ignored
    record = json.loads((tmp_path / f"{key}.json").read_text())
    record["nodes"] = record["nodes"][::-1]
    prepared.clear()
    assert prepared.add_least_peak_record(key, record)
    from remat.solvers.milp import _replays

    assert not _replays(graph, np.asarray(record["nodes"]))
    assert minimum_budget(graph, time_limit_s=0.05).budget_bytes >= graph.fixed_bytes  # (plans without it)
    prepared.clear()


def _mlp_with_rounded_units() -> Graph:
    """The built-in MLP at batch 100000, traced on the meta device, with costs of its own (so the
    optima do not depend on this machine's rates): its sizes are not whole memory units."""
    import torch

    from remat.coarsen import fold_aliases
    from remat.cost import CostModel
    from remat.models import get_workload
    from remat.trace import trace

    with torch.device("meta"):
        w = get_workload("mlp", 100000)
    g = fold_aliases(trace(w.model, w.batch, w.loss_fn, cost_model=CostModel.ESTIMATE, name="mlp").graph).coarse
    return dataclasses.replace(g, nodes=tuple(dataclasses.replace(n, cost=1.0 + n.out_bytes / 1e6) for n in g.nodes))


def test_sizes_that_are_not_whole_units_still_give_the_optimum_at_the_smallest_budget():
    """Rounded up, the exact model had no plan at the smallest budget (each live value counted up
    to a unit more) and the descent's plan came back 5% dearer than the optimum, which a budget
    0.1% larger found at the same peak. The model with sizes rounded down is a relaxation: its
    plan, measured, fits, so it is the optimum, and its bound holds."""
    from remat.solvers.milp_model import units_are_exact

    g = _mlp_with_rounded_units()
    assert not units_are_exact(g)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, 1, method="milp", time_limit_s=10)
    floor = info.value.min_budget_bytes
    at, above = (solve(g, b, method="milp", time_limit_s=10) for b in (floor, floor + floor // 1000))
    assert at.peak_bytes <= floor and above.peak_bytes <= floor
    assert at.cost == pytest.approx(above.cost) and at.status is SolveStatus.OPTIMAL
    assert at.lower_bound <= at.cost * (1 + 1e-9)


def test_a_model_rounded_down_bounds_the_graph_and_only_cost_models_round_down():
    g = _mlp_with_rounded_units()
    up = build_model(g, 10**8, ModelObjective.COST)
    down = build_model(g, 10**8, ModelObjective.COST, round_down=True)
    assert not up.bounds_graph and down.bounds_graph and down.rounded_down
    assert all(d <= u for d, u in zip(down.size_units, up.size_units)) and down.size_units != up.size_units
    with pytest.raises(ValueError, match="round_down is for COST models"):
        build_model(g, None, ModelObjective.PEAK, round_down=True)
