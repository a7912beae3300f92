"""``method="milp"``: the cheapest plan under a budget, with a lower bound for the whole graph.

Every call returns the cheapest plan it found among:

* the baselines' plans (``milp_start``; measured once per graph, so each budget is cheap),
* the retention model's plan (``retention``): an exact MILP over op-level plans in which every
  forward value is kept or recomputed once, solved on the whole graph;
* when the best of these is more than ``EXACT_RESCUE_GAP`` above the bound, the cheapest
  known plans over the budget, then (while time is left) more of the plans the baselines
  considered, with their peaks lowered to it (``repair.lower_peak``);
* where the retention model has no plan, its plans of the graph restarted at or just after
  the bound's instant (``restart``): values computed up to three times;
* the best of these without the recomputations it does not need under the budget
  (``repair.prune``; greedy lowering and fixed recursions leave such work behind);
* on graphs of at most ``exact_max_nodes`` nodes, Checkmate's exact MILP (``milp_model``),
  started from the best of the above (above ``EXACT_ALWAYS_NODES`` nodes, a rescue of at
  most ``EXACT_RESCUE_MAX_S`` that branches only if its LP relaxation rises above the bound).

and reports the instant bound (``bounds``), a lower bound on the cost of *every* plan of the
graph, as ``lower_bound`` (raised by the exact model's relaxation or search where it proves
more), with the gap to it. The search stops as soon as the gap is within ``mip_gap``, when
the models are solved (or the rescue has ended: FEASIBLE), or at the time limit (status
TIME_LIMIT, the best plan found so far). A budget no plan meets raises
``InfeasibleBudgetError`` with the smallest budget found (``minimum_budget``), which plans:
asking for it returns a plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from remat.collector import older_objects_frozen
from remat.errors import InfeasibleBudgetError, RematError, SolverError
from remat.graph import Graph
from remat.schedule import Schedule, plan_from_order
from remat.simulate import simulate
from remat.solvers import lp_round
from remat.solvers.base import SolveResult, SolverStats, SolveStatus, finish, register, relative_gap
from remat.solvers.base import methods as registered_methods
from remat.solvers.baselines import BaselinePlan, measure_order, plans_of
from remat.solvers.bounds import CostBound
from remat.solvers.milp_backends import (
    BackendResult,
    BackendStatus,
    MilpBackend,
    RelaxationTimeout,
    SolverSettings,
    backend_available,
    run_backend,
)
from remat.solvers.milp_model import MilpModel, ModelObjective, build_model, units_are_exact
from remat.solvers.milp_start import (
    BASELINE_METHODS,
    Candidate,
    baseline_candidates,
    best_fitting,
    without_unread,
)
from remat.solvers.prepared import PreparedGraph, least_peak_plan, prepared, remember_least_peak
from remat.solvers.repair import Descent, lower_peak, prune, reshuffle
from remat.solvers.restart import restart_instants, restart_plan
from remat.solvers.retention import MODEL_GAP, RetentionSolution, solve_retention
from remat.units import format_bytes_exactly

log = logging.getLogger("remat.solve")
T = TypeVar("T")

__all__ = ["MilpBackend", "MinimumBudget", "milp", "minimum_budget"]

#: Graphs of at most this many nodes also get Checkmate's exact MILP (O(n^2) binaries): always up
#: to ``EXACT_ALWAYS_NODES`` nodes, above that only when the retention model found no plan or one
#: more than ``EXACT_RESCUE_GAP`` above the bound. The exact model's plans may compute a value
#: three times or more, which the retention model's cannot; its bound can prove what the
#: instant bound cannot (a chain's floor, where everything is recomputed from the input).
#: Above 128 nodes its relaxation alone outlasts a rescue's seconds (U-Net b32, 147 nodes, at
#: 40%: 4.4 s; those seconds give the several-instant bound's MIP what it needs to be strong
#: there, ``bounds.MULTI_EXTRA``), and where nothing else fits, its search and the exact
#: least-peak model of ``minimum_budget`` found nothing in a minute (a 158-node masked-attention
#: model 0.26% above its smallest budget: 57 s and 56 s for no plan) that the least-peak plan,
#: pruned and reshuffled in that time, improves on (1.571x -> 1.469x).
EXACT_MAX_NODES = 128
EXACT_ALWAYS_NODES = 60
EXACT_RESCUE_GAP = 0.01
#: Above ``EXACT_ALWAYS_NODES`` nodes, with a plan in hand, the exact model gets at most this
#: long, and searches only if its LP relaxation rises above the bound in hand (``_exact``).
#: Since plans over the budget are lowered and pruned, it has not found a cheaper plan on any
#: graph measured (chains and random graphs of 81-121 nodes, the paper's segmentation networks
#: of 117-147 nodes near their smallest budgets, 20-60 s each); what it gives is proofs at the
#: floors of chains, where its relaxation alone meets the optimum (chain(60): 1891 in about a
#: second, where the instant bound says 565). Elsewhere its relaxation is below the instant
#: bound (U-Net b32 at 40%: 1.045x against 1.177x, 4.4 s) and a search used up the whole time
#: limit for nothing. A graph whose sizes are not whole model units (gigabyte activations,
#: sizes rounded up) gets no rescue: its relaxation bounds nothing, so the rescue could not
#: search and would offer only the rounded relaxation's plans, for the relaxation's seconds
#: (U-Net b32 at 40%: 2 s of a 7 s budget for no plan).
EXACT_RESCUE_MAX_S = 2.5

#: The least time handed to a solver after earlier steps used up the rest of the limit.
MIN_SOLVER_TIME_S = 1.0

#: The share of ``time_limit_s`` the lower bound may take (at most ``BOUND_MAX_S``).
BOUND_TIME_SHARE = 0.15
BOUND_MAX_S = 10.0

#: A plan more than ``BOUND_MORE_GAP`` above the bound (the least-peak plan too, when only it
#: fits), with more than ``BOUND_MORE_MIN_S`` left, has the bound computed again with
#: ``BOUND_MORE_SHARE`` of the time left, beside the reshuffle (the last step of the call,
#: on a thread of its own): the several instants' growth goes on from the
#: set the first bound chose and their MIPs get most of that time. Where the gap is large the
#: MIP of a good set needs seconds to prove anything beyond its root (ResNet50 b32 at its
#: smallest budget: twenty instants cut short prove 1.298x, sixteen solved 1.383x);
#: where the gap is small this costs nothing.
BOUND_MORE_GAP = 0.05
BOUND_MORE_MIN_S = 10.0
BOUND_MORE_SHARE = 0.85
#: The first bound, found beside the known plans, goes on with its deadline program's cases
#: while they are measured where it says every plan recomputes more than this share of the
#: step (a tight budget: there one instant is weakest, and the plans far from it; at 80% of
#: checkpoint-all the bound is met at once and the known plans keep both cores) and more than
#: ``BESIDE_MORE_MIN_S`` of ``BOUND_MORE_SHARE`` of the time limit is left (``_bound_beside``).
BESIDE_MORE_ABOVE = 0.1
BESIDE_MORE_MIN_S = 2.0

#: The share of the time left the exact MILP's warm start (its LP relaxation) may take (a
#: rescue's relaxation may take all of it: see ``_exact``).
LP_TIME_SHARE = 0.5

#: When the best plan is more than ``EXACT_RESCUE_GAP`` above the bound, the peaks of the
#: ``REPAIR_STARTS`` cheapest known plans over the budget (checkpoint-all aside) are lowered to
#: it (``repair``), for at most ``REPAIR_MAX_S`` in all (and ``REPAIR_TIME_SHARE`` of the time
#: limit): near a method's smallest budget a cheap plan a little over it often beats every plan
#: that fits.
REPAIR_STARTS = 4
REPAIR_MAX_S = 5.0
REPAIR_TIME_SHARE = 0.1
#: Where nothing fits yet, or the best plan is more than ``BOUND_MORE_GAP`` above the bound,
#: the lowering gets up to ``REPAIR_FAR_MAX_S`` (and ``REPAIR_FAR_SHARE`` of the time limit):
#: a start far over the budget takes seconds to lower, and the starts share the time. Mamba
#: (float32, transformers' reference scan, 4511 nodes) at 50% of checkpoint-all with a 20 s
#: limit: 2 s lowered nothing and the call returned a chain plan at 2.9-3.8x; 6 s lower
#: Chen's greedy plan to 1.29x.
REPAIR_FAR_MAX_S = 15.0
REPAIR_FAR_SHARE = 0.3
#: ``_lowered``'s first round gives each start ``1/LOWER_ROUNDS_FIRST`` of an even share of
#: the time; each round after it twice the last.
LOWER_ROUNDS_FIRST = 4
#: With time left, ``_repair`` lowers at most ``MORE_STARTS`` further plans the baselines
#: considered, of peaks at most ``MORE_STARTS_PEAK`` times the budget.
MORE_STARTS = 32
MORE_STARTS_PEAK = 2.0

#: Where the retention model has no plan, the graphs restarted at up to ``RESTART_INSTANTS``
#: instants (``restart.restart_instants``) get at most ``RESTART_MAX_S`` in all, and
#: ``RESTART_TIME_SHARE`` of the time limit (12-layer GPT-2 at its smallest budget: 4.4 s for
#: three instants; the 24-layer one needs 6-10 s for its first plan).
RESTART_INSTANTS = 4
RESTART_MAX_S = 25.0
RESTART_TIME_SHARE = 0.4

#: A plan left above the bound loses the recomputations it does not need (``repair.prune``)
#: for at most ``PRUNE_MAX_S`` (and ``PRUNE_TIME_SHARE`` of the time limit).
PRUNE_MAX_S = 5.0
PRUNE_TIME_SHARE = 0.1

#: A plan more than ``BOUND_MORE_GAP`` above the bound with more than ``BOUND_MORE_MIN_S``
#: left is reshuffled (``repair.reshuffle``: windows of its recomputations taken back and
#: the peak lowered again) for at most ``RESHUFFLE_MAX_S`` and ``RESHUFFLE_SHARE`` of the time
#: left, while the longer bound runs: ResNet50 b32 at its smallest budget 1.481x -> 1.440x in
#: 9 s, 1.420x in 20 s.
RESHUFFLE_MAX_S = 20.0
RESHUFFLE_SHARE = 1 / 2


@dataclass(frozen=True)
class MinimumBudget:
    """The smallest budget with a plan found, its plan, and a budget below which no plan
    exists; ``proven`` when the two meet. ``exact``: whether the exact least-peak model was
    allowed to search (a call with ``exact_max_nodes`` below the graph's size does not run it)."""

    budget_bytes: int
    proven: bool
    schedule: Schedule
    lower_bound_bytes: int
    exact: bool = True


@register("milp")
def milp(
    graph: Graph,
    budget_bytes: int,
    *,
    backend: MilpBackend | str = MilpBackend.HIGHS,
    time_limit_s: float = 60.0,
    mip_gap: float = 1e-4,
    warm_start: bool = True,
    early_proof: bool = True,
    threads: int = 2,
    dominance: bool = True,
    exact_max_nodes: int = EXACT_MAX_NODES,
) -> SolveResult:
    """The cheapest plan found whose simulated peak fits ``budget_bytes``, with a lower bound
    on every plan's cost (``lower_bound``, ``gap``).

    ``time_limit_s`` covers the whole call but for the baselines' plans (measured once per
    graph; the descent's path is extended by at most ``repair.DESCENT_TIME_S`` per call); an
    infeasible budget then spends up to as long again finding the smallest feasible one. The
    search stops once the gap to the bound is at most ``mip_gap`` (the retention model's own search, once within
    ``max(mip_gap, retention.MODEL_GAP)`` of the step's cost of the model's bound).
    ``backend`` ("highs", "cpsat" or "gurobi" if installed) solves Checkmate's exact model on
    graphs of at most ``exact_max_nodes`` nodes (above ``EXACT_ALWAYS_NODES`` only when the
    retention model's plan is not within ``EXACT_RESCUE_GAP`` of the bound); the retention
    model and the bound always use HiGHS. ``warm_start`` starts the exact model from the best
    plan known (and falls back on it); with ``early_proof`` a known plan that meets the bound
    is returned at once. ``threads`` is fixed so that timings compare. ``dominance`` adds the
    rows that make S the exact liveness of R in the exact model (see ``milp_model``).

    >>> from remat.builders import chain_graph
    >>> from remat.solvers import solve
    >>> r = solve(chain_graph(4, bytes_per_node=1), 4, method="milp")
    >>> r.status.value, r.objective, r.peak_bytes <= 4
    ('optimal', 11.0, True)
    """
    started = time.perf_counter()
    deadline = started + time_limit_s
    backend = MilpBackend.parse(backend)
    _check_numbers(time_limit_s, mip_gap, threads)
    if not (isinstance(exact_max_nodes, int) and exact_max_nodes >= 0):
        raise ValueError(f"exact_max_nodes={exact_max_nodes!r} must be a non-negative int (0: never the exact model)")
    exact = graph.n <= exact_max_nodes
    if exact:
        backend_available(backend)
    prep = prepared(graph)
    settings = SolverSettings(time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads)
    if budget_bytes < prep.bounds.min_budget_bytes:
        crowded = int(np.argmax(prep.bounds.forced_bytes))
        raise _infeasible(graph, budget_bytes, settings, backend,
                          f"this budget is below the {format_bytes_exactly(prep.bounds.min_budget_bytes)} that every "
                          f"plan holds at once when it computes {graph.describe(crowded)}: the fixed bytes, that "
                          f"node's inputs, output and scratch, the outputs computed so far and the values read later "
                          f"that cannot be recomputed", exact_max_nodes=exact_max_nodes)
    if early_proof:  # computing every node once is the least any plan costs: nothing to search
        everything = baseline_candidates(graph, budget_bytes, methods=("checkpoint_all",))
        if everything and everything[0].peak_bytes <= budget_bytes:
            return _finish(graph, budget_bytes, everything[0], None, graph.total_cost, SolveStatus.OPTIMAL, started,
                           SolverStats(backend=backend.value, nodes_explored=0), "checkpoint-all fits: no search needed")
    # the baselines' plans, and those returned for earlier budgets (a sweep's plan at a larger
    # budget is never dearer than one it already returned at a smaller), while the bound is found
    bound, best = _bound_beside(
        prep, budget_bytes, lambda: best_fitting([*baseline_candidates(graph, budget_bytes), *prep.returned],
                                                 budget_bytes),
        threads=threads, multi=False, time_limit_s=min(BOUND_MAX_S, BOUND_TIME_SHARE * time_limit_s),
        go_on_until=started + BOUND_MORE_SHARE * time_limit_s)
    if not bound.feasible:
        raise _infeasible(graph, budget_bytes, settings, backend, f"at {graph.describe(bound.instant)} the values "
                          f"every plan holds there already take more than this budget", exact_max_nodes=exact_max_nodes)
    target = bound.value * (1 + mip_gap)
    if best is not None and early_proof and best.cost <= target:
        return _finish(graph, budget_bytes, best, None, bound.value, SolveStatus.OPTIMAL, started,
                       SolverStats(backend=backend.value, nodes_explored=0), "a known plan meets the bound: no search needed")
    # the retention model on the whole graph
    solved = _retention(graph, budget_bytes, bound, target, deadline, mip_gap, threads)
    if solved is not None and _cheaper(solved.cost, best):
        best = solved
    if best is None or best.cost > bound.value * (1 + max(mip_gap, EXACT_RESCUE_GAP)):
        # within the time limit, but with a second at least when nothing fits yet; the exact
        # model, if it runs, starts from the plan
        left = max(deadline - time.perf_counter(), MIN_SOLVER_TIME_S if best is None else 0.0)
        far = best is None or best.cost > bound.value * (1 + BOUND_MORE_GAP)
        repaired = _repair(graph, budget_bytes, min(REPAIR_FAR_MAX_S, REPAIR_FAR_SHARE * time_limit_s, left) if far
                           else min(REPAIR_MAX_S, REPAIR_TIME_SHARE * time_limit_s, left))
        if repaired is not None and _cheaper(repaired.cost, best):
            best = repaired
        if solved is None and bound.instant is not None:
            # the retention model has no plan: values may need a third computation, which it
            # gets in the graph restarted where the bound binds
            restarted = _restarted(graph, budget_bytes, bound.instant, target, min(
                RESTART_MAX_S, RESTART_TIME_SHARE * time_limit_s, deadline - time.perf_counter()), threads)
            if restarted is not None and _cheaper(restarted.cost, best):
                best = restarted
    if best is not None and best.cost > target:
        # drop what the plan recomputes without needing to (greedy descents and fixed
        # recursions leave such work behind; the retention model's memory is conservative)
        left = deadline - time.perf_counter()
        if left > 0:
            pruned = _pruned(graph, best, budget_bytes, min(PRUNE_MAX_S, PRUNE_TIME_SHARE * time_limit_s, left))
            if pruned is not None:
                best = pruned
    if best is None or best.cost > bound.value * (1 + max(mip_gap, EXACT_RESCUE_GAP)):
        # a gap is left (or only the least-peak plan fits, below): several instants together
        # may explain it (they cost a few seconds, so only here)
        left = deadline - time.perf_counter()
        if left > 0:
            together = prep.bounds.cost_bound(budget_bytes, threads=threads,
                                              time_limit_s=min(BOUND_MAX_S, BOUND_TIME_SHARE * time_limit_s, left))
            if together.feasible and together.value > bound.value:
                bound = together
    timed_out = time.perf_counter() >= deadline - 1e-3
    lower = bound.value
    stats = SolverStats(backend="highs", n_variables=prep.retention.n_cols)
    if exact and graph.n > EXACT_ALWAYS_NODES and best is not None:  # a rescue (see EXACT_RESCUE_MAX_S)
        exact = best.cost > bound.value * (1 + max(mip_gap, EXACT_RESCUE_GAP)) and units_are_exact(graph)
    if exact and (best is None or best.cost > target) and not timed_out:
        until, beat = deadline, None
        if graph.n > EXACT_ALWAYS_NODES and best is not None:  # a rescue: see EXACT_RESCUE_MAX_S
            until, beat = min(deadline, time.perf_counter() + EXACT_RESCUE_MAX_S), lower
        result = _exact(graph, budget_bytes, settings, backend, dominance, warm_start, best, until, beat)
        if result is not None:
            schedule, claimed, model_bound, status, stats = result
            if _cheaper(claimed, best):
                sim = simulate(graph, schedule.lower(graph))
                best = Candidate.known("milp", schedule, sim.peak_bytes, sim.total_cost)
            if model_bound is not None:
                lower = max(lower, model_bound)
            # stopped by the call's time limit, not by the rescue's own few seconds
            timed_out = (status is BackendStatus.FEASIBLE or status is BackendStatus.NO_SOLUTION) and until >= deadline
    if best is None:
        found = minimum_budget(graph, backend=backend, time_limit_s=max(deadline - time.perf_counter(), MIN_SOLVER_TIME_S),
                               threads=threads, exact_max_nodes=exact_max_nodes)
        if found.budget_bytes > budget_bytes:
            raise _infeasible(graph, budget_bytes, settings, backend, "no plan found fits", found=found)
        sim = simulate(graph, found.schedule.lower(graph))
        best = Candidate.known("min-peak plan", found.schedule, sim.peak_bytes, sim.total_cost)
        left = max(deadline - time.perf_counter(), MIN_SOLVER_TIME_S)
        pruned = _pruned(graph, best, budget_bytes, min(PRUNE_MAX_S, PRUNE_TIME_SHARE * time_limit_s, left))
        if pruned is not None:
            best = pruned
    left = deadline - time.perf_counter()
    if best.cost > lower * (1 + BOUND_MORE_GAP) and left > BOUND_MORE_MIN_S:
        # still far from the bound with time to spare: the bound goes on with most of it while
        # the plan is reshuffled
        more_s = BOUND_MORE_SHARE * left
        shuffle_s = min(RESHUFFLE_MAX_S, RESHUFFLE_SHARE * left)
        longer, shuffled = _bound_beside(
            prep, budget_bytes, lambda: _reshuffled(graph, best, budget_bytes, shuffle_s, lower * (1 + mip_gap)),
            threads=threads, time_limit_s=more_s, multi_time_s=more_s)
        if shuffled is not None:
            best = shuffled
        if longer.feasible and longer.value > lower:
            lower = longer.value
    gap = relative_gap(best.cost, lower)
    if gap is not None and gap <= mip_gap:
        status = SolveStatus.OPTIMAL
    else:
        status = SolveStatus.TIME_LIMIT if timed_out else SolveStatus.FEASIBLE
    result = _finish(graph, budget_bytes, best, None, lower, status, started, stats, best.name)
    prep.saw_plan(best)
    found = prep.minimum
    if isinstance(found, MinimumBudget) and result.peak_bytes < found.budget_bytes:
        # a plan below the smallest budget found so far: it is the smallest budget now
        _new_minimum(graph, prep, MinimumBudget(result.peak_bytes, result.peak_bytes <= found.lower_bound_bytes,
                                                result.schedule, found.lower_bound_bytes, found.exact), best)
    return result


def _bound_beside(prep: PreparedGraph, budget_bytes: int, work: Callable[[], T], *, go_on_until: float | None = None,
                  **bound_options: object) -> tuple[CostBound, T]:
    """``work()`` on the calling thread while ``prep.bounds.cost_bound(budget_bytes,
    **bound_options)`` runs on a thread of its own: (the bound, what the work returned). The
    bound runs mostly in HiGHS, which lets go of the interpreter, the work (measuring or
    reshuffling plans) in numpy and Python, so each keeps one of two cores busy.

    With ``go_on_until`` (a ``time.perf_counter()`` deadline), a bound of a tight budget (one
    that makes every plan recompute more than ``BESIDE_MORE_ABOVE`` of the step) that is done
    while the work still runs goes on refining its deadline program's cases (where the
    deadlines beat one instant), on one HiGHS thread, until the work is done or the deadline
    passes: on a graph's first call the known plans take most of the time (GPT-2 48L at its
    smallest budget: 54 s, of which the first bound had 5 s). The several instants are left to
    the later calls, which give their MIPs the time (and where the deadlines see nothing
    more, as on ResNet50, the work keeps the interpreter to itself)."""
    stop = threading.Event()

    def bound() -> CostBound:
        first = prep.bounds.cost_bound(budget_bytes, **bound_options)
        graph = prep.bounds.graph
        if go_on_until is None or stop.is_set() or not first.feasible \
                or first.value <= graph.total_cost * (1 + BESIDE_MORE_ABOVE):
            return first
        left = go_on_until - time.perf_counter()
        if left <= BESIDE_MORE_MIN_S:
            return first
        more = prep.bounds.cost_bound(budget_bytes, time_limit_s=left, threads=1, several=False, stop=stop)
        return more if more.feasible and more.value > first.value else first

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="remat-bound") as pool:
        running = pool.submit(bound)
        try:
            done = work()
        finally:
            stop.set()
        return running.result(), done


def _retention(graph: Graph, budget_bytes: int, bound: CostBound, target: float, deadline: float,
               mip_gap: float, threads: int) -> Candidate | None:
    """The retention model's plan under the budget, as a candidate (None if it has none)."""
    prep = prepared(graph)
    structure = prep.retention
    start = prep.best_retention_plan(budget_bytes)
    rows = tuple(sorted(prep.retention_rows)) + ((bound.instant,) if bound.instant is not None else ())
    def fits(solution: RetentionSolution) -> bool:  # over the model's count, within the simulator's?
        return _retention_candidate(graph, solution).peak_bytes <= budget_bytes

    result = solve_retention(structure, budget_bytes, time_limit_s=max(deadline - time.perf_counter(), MIN_SOLVER_TIME_S),
                             mip_gap=max(mip_gap, MODEL_GAP), threads=threads, start=start,
                             stop_at=target - graph.total_cost, rows=rows, accept=fits)
    if result.solution is None:
        return None
    prep.remember(result.solution, result.rows)
    return _retention_candidate(graph, result.solution)


def _retention_candidate(graph: Graph, solution: RetentionSolution) -> Candidate:
    structure = prepared(graph).retention
    order = solution.order(structure)
    # (its computations as the schedule of the order runs them: stage by stage, in id order)
    pairs = np.unique(np.asarray([s * graph.n + v for s, v in order if v <= s], dtype=np.int64))
    stages, nodes = pairs // graph.n, pairs % graph.n
    sim = simulate(graph, plan_from_order(graph, nodes.tolist()))
    if not sim.ok or sim.peak_bytes > solution.model_peak_bytes:
        # the model counts memory conservatively: a plan above it is a bug, never a plan to run
        raise SolverError(
            f"the retention model's plan for graph {graph.name!r} simulates to a peak of {sim.peak_bytes} B over "
            f"the model's {solution.model_peak_bytes} B ({len(sim.violations)} violations); please report this"
        )
    plan = BaselinePlan("retention", stages.astype(np.int32), nodes.astype(np.int32), sim.peak_bytes, sim.total_cost)
    return Candidate.of_plan("retention", graph, plan)


def _repair(graph: Graph, budget_bytes: int, time_limit_s: float) -> Candidate | None:
    """The cheapest plan found by lowering the peaks of the cheapest known plans over the
    budget (each method's cheapest, or its lowest-peak plan) to it, then, while time is left,
    those of the other plans the baselines considered (``_more_starts``), or None.
    Checkpoint-all is left out: the descent's plans are its own lowered."""
    deadline = time.perf_counter() + time_limit_s
    over = sorted((c for c in baseline_candidates(graph, budget_bytes, lowest_peak=True)
                   if c.peak_bytes > budget_bytes and c.name not in NOT_LOWERED),
                  key=lambda c: (c.cost, c.peak_bytes))[:REPAIR_STARTS]
    found = _lowered(graph, over, budget_bytes, time_limit_s)
    tried = {(round(c.cost, 6), c.peak_bytes) for c in over}
    for method, start in _more_starts(graph, budget_bytes):
        if time.perf_counter() >= deadline:
            break
        key = (round(start.cost, 6), start.peak_bytes)
        if key in tried:
            continue
        tried.add(key)
        plan = _lowered_and_pruned(graph, start, budget_bytes, deadline)
        if plan.peak_bytes <= budget_bytes:
            found.append(Candidate.of_plan(f"{method} ({start.label}) with its peak lowered", graph, plan))
    fitting = [c for c in found if c.peak_bytes <= budget_bytes]
    return min(fitting, key=lambda c: (c.cost, c.peak_bytes), default=None)


def _cheaper(cost: float, best: Candidate | None) -> bool:
    """Whether a plan of ``cost`` beats ``best`` (None: nothing yet) by more than rounding."""
    return best is None or cost < best.cost - 1e-9 * max(1.0, best.cost)


def _restarted(graph: Graph, budget_bytes: int, instant: int, target: float, time_limit_s: float,
               threads: int) -> Candidate | None:
    """The cheapest plan of the graphs restarted for the bound's ``instant``
    (``restart.restart_instants``, at most ``RESTART_INSTANTS``; ``restart.restart_plan``)
    that fits, as a candidate, or None; the time is split evenly over the instants not yet
    tried."""
    deadline = time.perf_counter() + time_limit_s
    bounds = prepared(graph).bounds
    instants = restart_instants(graph, instant, bounds, most=RESTART_INSTANTS)
    best = None
    for k, at in enumerate(instants):
        left = (deadline - time.perf_counter()) / (len(instants) - k)
        if left <= 0:
            break
        plan = restart_plan(graph, at, budget_bytes, time_limit_s=left, threads=threads, bounds=bounds,
                            stop_at=target)
        if plan is not None and plan.peak_bytes <= budget_bytes and _cheaper(plan.cost, best):
            best = Candidate.of_plan(plan.label, graph, plan)
            if best.cost <= target:
                break
    return best


def _more_starts(graph: Graph, budget_bytes: int) -> list[tuple[str, BaselinePlan]]:
    """Further plans to lower: every plan a baseline considered (but those never lowered)
    with its peak over the budget and at most ``MORE_STARTS_PEAK`` times it, the cheapest
    first, at most ``MORE_STARTS``. Which start lowers best is hard to tell beforehand: on the
    4-layer GPT-2 at its smallest budget, a plan of two checkpoints at twice the budget
    lowers to 1.406x, where each method's cheapest lowers to 1.451x at best."""
    plans = []
    for method in BASELINE_METHODS:
        if method in NOT_LOWERED or method not in registered_methods():
            continue
        try:
            plans += [(p.cost, p.peak_bytes, method, p) for p in plans_of(method, graph, budget_bytes)
                      if budget_bytes < p.peak_bytes <= MORE_STARTS_PEAK * budget_bytes]
        except RematError:  # a method that cannot plan the graph has no starts to give
            continue
    plans.sort(key=lambda x: (x[0], x[1]))
    return [(method, p) for _, _, method, p in plans[:MORE_STARTS]]


#: Plans never lowered: checkpoint-all's lowering is the descent, whose plans are known, and
#: recomputing everything leaves nothing to free.
NOT_LOWERED = ("checkpoint_all", "descent", "recompute_all")


def _lowered(graph: Graph, starts: list[Candidate], budget_bytes: int, time_limit_s: float) -> list[Candidate]:
    """Each of ``starts`` with its peak lowered towards ``budget_bytes`` (a ``repair.Descent``
    each) and pruned once it fits; a start no move lowers is left out. The descents go on in
    rounds, the cheapest start first in each: a round gives every start still over the budget
    and not stuck a slice of the time, twice the last round's, so the start that lowers
    quickest fits first whichever it is (an even split gave each too little where one start
    takes most of the time and another fits in a second: Mamba in float32 at 50%, 4 starts in
    4 s, none fitted; in rounds, 3 s fit the segments' plan at 1.47x, 4 s at 1.32x, 6 s Chen's
    greedy plan at 1.29x)."""
    deadline = time.perf_counter() + time_limit_s
    paths = [Descent(graph, known.as_plan(graph)) for known in starts]
    done: dict[int, BaselinePlan] = {}
    share = time_limit_s / (LOWER_ROUNDS_FIRST * max(len(starts), 1))
    while time.perf_counter() < deadline:
        active = [k for k, path in enumerate(paths) if k not in done and not path.stuck]
        if not active:
            break
        for k in active:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            path = paths[k]
            path.extend(budget_bytes, time_limit_s=min(share, left))
            if path.peaks[-1] <= budget_bytes:
                done[k] = prune(graph, path.plan(len(path.moves)), budget_bytes=budget_bytes,
                                time_limit_s=min(PRUNE_MAX_S, max(deadline - time.perf_counter(), 0.0) / len(active)))
        share *= 2
    found = []
    for k, known in enumerate(starts):
        plan = done[k] if k in done else paths[k].plan(len(paths[k].moves))
        if plan.peak_bytes < known.peak_bytes:
            found.append(Candidate.of_plan(f"{known.name} with its peak lowered", graph, plan))
    return found


def _lowered_and_pruned(graph: Graph, start: BaselinePlan, budget_bytes: int, deadline: float) -> BaselinePlan:
    """``start`` with its peak lowered towards the budget (``repair.lower_peak``) and, once it
    fits, pruned (``repair.prune``: the descent's greedy moves leave work behind), each step
    with the time left before ``deadline`` (pruning at most ``PRUNE_MAX_S``)."""
    plan = lower_peak(graph, start, budget_bytes=budget_bytes, time_limit_s=max(deadline - time.perf_counter(), 0.0))
    if plan.peak_bytes <= budget_bytes:
        plan = prune(graph, plan, budget_bytes=budget_bytes,
                     time_limit_s=min(PRUNE_MAX_S, max(deadline - time.perf_counter(), 0.0)))
    return plan


def _pruned(graph: Graph, known: Candidate, budget_bytes: int, time_limit_s: float) -> Candidate | None:
    """``known`` without the recomputations it does not need under the budget (``repair.prune``),
    or None when it has none to drop."""
    plan = prune(graph, known.as_plan(graph), budget_bytes=budget_bytes, time_limit_s=time_limit_s)
    return _if_cheaper(graph, known, plan, "pruned")


def _reshuffled(graph: Graph, known: Candidate, budget_bytes: int, time_limit_s: float,
                stop_at: float) -> Candidate | None:
    """``known`` reshuffled (``repair.reshuffle``), or None when nothing cheaper was found."""
    plan = reshuffle(graph, known.as_plan(graph), budget_bytes=budget_bytes, time_limit_s=time_limit_s,
                     stop_at=stop_at)
    return _if_cheaper(graph, known, plan, "reshuffled")


def _if_cheaper(graph: Graph, known: Candidate, plan: BaselinePlan, how: str) -> Candidate | None:
    """``plan``, ``known`` improved ``how``, as a candidate, or None when it costs no less."""
    if not _cheaper(plan.cost, known):
        return None
    return Candidate.of_plan(f"{known.name}, {how}", graph, plan)


def _finish(graph: Graph, budget_bytes: int, best: Candidate, claimed: float | None, lower: float,
            status: SolveStatus, started: float, stats: SolverStats, why: str) -> SolveResult:
    log.info("milp: %s on %s: cost %.6g (%.4fx), bound %.6g, %s", best.name, graph.name, best.cost,
             best.cost / graph.total_cost if graph.total_cost else 1.0, lower, why)
    return finish(graph, best.schedule, budget_bytes=budget_bytes, method="milp", status=status, started_s=started,
                  claimed_objective=best.cost if claimed is None else claimed, lower_bound=min(lower, best.cost),
                  stats=dataclasses.replace(stats, plan_from=best.name))


# ---------------------------------------------------------------------------- Checkmate's exact model
def _exact(graph: Graph, budget_bytes: int, settings: SolverSettings, backend: MilpBackend, dominance: bool,
           warm_start: bool, best: Candidate | None, deadline: float, beat: float | None = None):
    """Checkmate's MILP on the whole graph: (schedule, cost, bound, status, stats), or None when it
    finds nothing better than ``best``. The bound counts only if the model's memory units are
    exact (rounded-up sizes make the model stricter than the graph); the LP relaxation's value
    counts as one too, and proves ``best`` without a search when it meets it.

    A rescue (``beat``: the bound in hand) searches only if the relaxation rises above that
    bound: below it, the seconds a rescue has never closed a gap by branching, and the MILP's
    plans have not beaten lowered and pruned ones on any graph measured; the rounded
    relaxation's plans are still offered. With ``settings.quiet`` (a block's solve, which the
    user did not ask for) a relaxation out of time is logged at info, not as a warning."""
    model = build_model(graph, budget_bytes, ModelObjective.COST, dominance=dominance)
    if model.infeasible_reason is not None:
        return None
    rounded: list[Candidate] = []  # the rounded relaxation's plans
    relaxed = None  # the LP relaxation's value, where it bounds the graph's plans
    share = 1.0 if beat is not None else LP_TIME_SHARE  # a rescue searches only past a strong relaxation
    if warm_start:
        try:
            relaxation = lp_round.solve_relaxation(
                graph, budget_bytes, time_limit_s=max(share * (deadline - time.perf_counter()), 0.1),
                model=model if dominance else None)  # (the relaxation's own model has the dominance rows)
        except RelaxationTimeout as exc:  # (a rescue's or a block's few seconds often end it: no news there)
            (log.info if beat is not None or settings.quiet else log.warning)("milp: %s; warm-starting from the known plans only", exc)
        else:
            if relaxation is not None:
                rounded = lp_round.rounded_candidates(graph, relaxation.S)
                relaxed = relaxation.lower_bound if relaxation.exact_units else None
    candidates = ([best] if best is not None and warm_start else []) + rounded
    stats = SolverStats(backend=backend.value, n_variables=model.n_cols, n_constraints=model.n_rows)
    if best is not None and relaxed is not None and relative_gap(best.cost, relaxed) <= settings.mip_gap:
        # the relaxation alone proves the plan in hand (a chain's floor): no search to run
        return best.schedule, best.cost, relaxed, BackendStatus.OPTIMAL, stats
    if best is not None and beat is not None and (relaxed is None or relaxed <= beat * (1 + 1e-9)):
        cheaper = best_fitting(rounded, budget_bytes)
        if cheaper is None or not _cheaper(cheaper.cost, best):
            log.info("milp: the exact model's relaxation (%s) does not rise above the bound %.6g: no rescue search",
                     "timed out" if relaxed is None else f"{relaxed:.6g}", beat)
            return None
        return cheaper.schedule, cheaper.cost, relaxed, BackendStatus.FEASIBLE, stats
    start = _start_vector(model, candidates, budget_bytes)
    remaining = max(deadline - time.perf_counter(), MIN_SOLVER_TIME_S)
    # (rounded sizes: half the time for the model rounded down, below)
    share = 1.0 if model.exact_units else ROUNDED_DOWN_SHARE
    result = run_backend(model, backend, _with_time(settings, share * remaining), start[0] if start else None)
    stats = dataclasses.replace(stats, nodes_explored=result.nodes, iterations=result.iterations)
    found = None
    if result.status is not BackendStatus.INFEASIBLE and result.x is not None:
        schedule = _decoded(model, result, backend)
        claimed = result.objective if backend is not MilpBackend.CPSAT else schedule.cost(graph)
        bound = max((b for b in (_model_bound(model, result, backend), relaxed) if b is not None), default=None)
        found = schedule, claimed, bound, result.status, stats
    if not model.exact_units and deadline - time.perf_counter() > MIN_SOLVER_TIME_S:
        known = candidates + ([Candidate.known("milp", found[0], budget_bytes, found[1])] if found else [])
        found = _rounded_down(graph, budget_bytes, settings, backend, dominance, known, found, deadline)
    return found


def _decoded(model: MilpModel, result: BackendResult, backend: MilpBackend) -> Schedule:
    try:
        return model.decode(result.x)
    except ValueError as exc:
        raise SolverError(f"{backend.value} returned a solution remat cannot read as a plan: {exc}") from None


def _rounded_down(graph: Graph, budget_bytes: int, settings: SolverSettings, backend: MilpBackend, dominance: bool,
                  known: list[Candidate], found: tuple | None, deadline: float) -> tuple | None:
    """``_exact``'s answer improved by the model with sizes rounded down, where they are not whole
    units: a relaxation of the graph, so its bound holds (the model rounded up, stricter than
    the graph, proves nothing), and its plan, measured, is the graph's optimum when it fits.
    (An MLP at batch 100000 at its smallest budget: rounded up, no plan fits, and the descent's
    plan cost 1.343x; rounded down, 1.290x, the bound's value.)"""
    model = build_model(graph, budget_bytes, ModelObjective.COST, dominance=dominance, round_down=True)
    if model.infeasible_reason is not None:  # (a relaxation without plans: none fits the graph either)
        return found
    start = _start_vector(model, known, budget_bytes)
    remaining = max(deadline - time.perf_counter(), MIN_SOLVER_TIME_S)
    result = run_backend(model, backend, _with_time(settings, remaining), start[0] if start else None)
    if result.x is None:
        return found
    bound = _model_bound(model, result, backend)
    schedule = _decoded(model, result, backend)
    sim = simulate(graph, schedule.lower(graph))
    if sim.ok and sim.peak_bytes <= budget_bytes and (found is None or sim.total_cost < found[1]):
        log.info("milp: the model with sizes rounded down found a plan that fits (cost %g, peak %d B)",
                 sim.total_cost, sim.peak_bytes)
        stats = found[4] if found else SolverStats(backend=backend.value, n_variables=model.n_cols,
                                                   n_constraints=model.n_rows)
        return schedule, sim.total_cost, bound, result.status, stats
    if found is None:
        return None
    schedule, claimed, old_bound, status, stats = found
    return schedule, claimed, max((b for b in (old_bound, bound) if b is not None), default=None), status, stats


def exact_schedule(graph: Graph, budget_bytes: int, *, time_limit_s: float, threads: int = 1) -> Schedule | None:
    """Checkmate's exact model alone on a small graph (a block of a larger one): the cheapest
    schedule it finds in ``time_limit_s`` whose simulated peak fits ``budget_bytes``, or None
    (no plan fits, or none was found in time). No baselines, bounds or searches around it:
    the chain's leaf menus solve each distinct block this way at several budgets."""
    settings = SolverSettings(time_limit_s=time_limit_s, mip_gap=1e-3, threads=threads, label="block", quiet=True)
    result = _exact(graph, budget_bytes, settings, MilpBackend.HIGHS, True, True, None,
                    time.perf_counter() + time_limit_s)
    if result is None:
        return None
    schedule = result[0]
    sim = simulate(graph, schedule.lower(graph))
    return schedule if sim.ok and sim.peak_bytes <= budget_bytes else None


#: Share of the exact model's time for the model with sizes rounded up, where sizes are not
#: whole units; the rest goes to the model with them rounded down (``_rounded_down``).
ROUNDED_DOWN_SHARE = 0.5


def _model_bound(model: MilpModel, result: BackendResult, backend: MilpBackend) -> float | None:
    if result.bound is None or not model.bounds_graph:
        return None
    bound = result.bound
    if backend is MilpBackend.CPSAT:
        # CP-SAT optimizes costs rounded to integers; each computed node may be off by half a
        # unit of the scale, so the bound on true costs is looser by that much per R variable.
        from remat.solvers.milp_backends import cpsat_cost_scale

        scale, exact = cpsat_cost_scale(model.col_cost)
        if not exact:
            bound -= 0.5 / scale * float(model.col_integer.sum())
    return bound


def _start_vector(model: MilpModel, candidates: list[Candidate], budget_bytes: int):
    """The cheapest fitting candidate the model accepts as a start: (x, candidate) or None."""
    for cand in sorted((c for c in candidates if c.peak_bytes <= budget_bytes), key=lambda c: (c.cost, c.peak_bytes)):
        x, why = _start_of(model, cand.schedule)
        if x is not None:
            log.info("milp: starting from %s (cost %g, peak %d B)", cand.name, cand.cost, cand.peak_bytes)
            return x, cand
        log.debug("milp: %s is not a valid start: %s", cand.name, why)
    return None


def _start_of(model: MilpModel, schedule: Schedule):
    x, why = model.start_from(schedule)
    if x is None:  # a baseline may compute values nothing reads; the model forbids that
        x, why = model.start_from(without_unread(model.graph, schedule))
    return x, why


# ---------------------------------------------------------------------------- the smallest budget
def minimum_budget(
    graph: Graph,
    *,
    backend: MilpBackend | str = MilpBackend.HIGHS,
    time_limit_s: float = 60.0,
    threads: int = 2,
    exact_max_nodes: int = EXACT_MAX_NODES,
) -> MinimumBudget:
    """The smallest budget under which ``milp`` finds a plan: the least simulated peak among
    the baselines' plans, those plans with their peaks lowered by ``repair``, the retention
    model's least-peak plan and (on small graphs) the exact least-peak MILP. ``proven`` when
    it meets ``bounds``' smallest-budget bound or the exact model proved it. Remembered per
    graph: asking ``milp`` for this budget plans. The exact model runs only where the graph
    has at most ``exact_max_nodes`` nodes (0: never, as ``milp``'s own option says); a budget
    found without it is found again by a later call that allows it, unless it was proven.

    >>> from remat.builders import chain_graph
    >>> minimum_budget(chain_graph(4, bytes_per_node=1)).budget_bytes
    3
    """
    backend = MilpBackend.parse(backend)
    _check_numbers(time_limit_s, 0.0, threads)
    prep = prepared(graph)
    known = prep.minimum
    if isinstance(known, MinimumBudget) and (known.proven or known.exact or graph.n > exact_max_nodes):
        return known
    with older_objects_frozen():
        return _minimum_budget(graph, prep, backend, time_limit_s, threads, exact_max_nodes)


def _minimum_budget(graph: Graph, prep: PreparedGraph, backend: MilpBackend, time_limit_s: float, threads: int,
                    exact_max_nodes: int) -> MinimumBudget:
    started = time.perf_counter()
    lower = prep.bounds.min_budget_bytes
    known = baseline_candidates(graph, lower, lowest_peak=True)
    known.append(_candidate("checkpoint_all", graph, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool))))
    known += [_retention_candidate(graph, plan) for plan in prep.retention_plans]  # found at other budgets
    if prep.lowest is not None:  # the least-peak plan returned at any budget so far (the exact model's, say)
        known.append(prep.lowest)
    earlier = least_peak_plan(graph)
    if earlier is not None and _replays(graph, earlier.nodes):
        # found on this structure with other costs: the same model traced before (or planned by
        # an earlier process, whose record a command line kept)
        label = "least-peak plan of an earlier trace"
        known.append(Candidate.of_plan(label, graph, measure_order(graph, earlier.stages, earlier.nodes, label)))
    best = min(known, key=lambda c: (c.peak_bytes, c.cost))
    proven = best.peak_bytes <= lower
    if not proven:  # every method's least-peak plan lowered towards the bound (ResNet50: 24.0% -> 23.1%)
        starts = sorted((c for c in known if c.name not in NOT_LOWERED), key=lambda c: (c.peak_bytes, c.cost))
        lowered = _lowered(graph, starts, lower, min(REPAIR_MAX_S, REPAIR_TIME_SHARE * time_limit_s))
        best = min([best, *lowered], key=lambda c: (c.peak_bytes, c.cost))
        proven = best.peak_bytes <= lower
    if not proven:  # the lowest of them lowered again by moves of any size (see repair.MAX_MOVE_NODES)
        deeper = lower_peak(graph, best.as_plan(graph), budget_bytes=lower,
                            time_limit_s=min(REPAIR_MAX_S, REPAIR_TIME_SHARE * time_limit_s), max_move_nodes=graph.n)
        if deeper.peak_bytes < best.peak_bytes:
            best = Candidate.of_plan(f"{best.name}, lowered further", graph, deeper)
            proven = best.peak_bytes <= lower
    if not proven:
        result = solve_retention(prep.retention, best.peak_bytes, time_limit_s=0.5 * time_limit_s, threads=threads,
                                 minimize_peak=True, rows=tuple(prep.retention_rows))
        if result.solution is not None:
            found = _retention_candidate(graph, result.solution)
            if found.peak_bytes < best.peak_bytes or (found.peak_bytes == best.peak_bytes and found.cost < best.cost):
                best = found
            proven = best.peak_bytes <= lower
    if not proven and graph.n <= exact_max_nodes:
        backend_available(backend)
        model = build_model(graph, None, ModelObjective.PEAK, peak_upper_bytes=best.peak_bytes)
        start, _why = _start_of(model, best.schedule)
        # Peaks are whole units of model.bytes_unit: an absolute gap below one unit is exact.
        settings = SolverSettings(time_limit_s=max(time_limit_s - (time.perf_counter() - started), MIN_SOLVER_TIME_S),
                                  mip_gap=0.0, mip_abs_gap=0.999, threads=threads, label="min-budget")
        result = run_backend(model, backend, settings, start)
        if result.x is not None:
            found = _candidate("milp-peak", graph, model.decode(result.x))
            if found.peak_bytes < best.peak_bytes:
                best = found
        if result.bound is not None:  # rounded-up sizes over-count by less than a unit per live value
            slack = 0 if model.exact_units else graph.n
            lower = max(lower, graph.fixed_bytes + model.bytes_unit * (math.ceil(result.bound - 1e-6) - slack))
        proven = best.peak_bytes <= lower
    log.info("min-budget: %s needs %d B (%s; no plan below %d B)", graph.name, best.peak_bytes,
             "proven" if proven else "not proven", lower)
    return _new_minimum(graph, prep, MinimumBudget(best.peak_bytes, proven, best.schedule, lower,
                                                   graph.n <= exact_max_nodes), best)


def _replays(graph: Graph, nodes: np.ndarray) -> bool:
    """Is computing ``nodes`` in order a plan of ``graph`` the simulator accepts (a least-peak
    plan read from a file is checked before it is trusted)?"""
    if not nodes.size or int(nodes.max()) >= graph.n or int(nodes.min()) < 0:
        return False
    try:
        return simulate(graph, plan_from_order(graph, nodes.tolist())).ok
    except RematError:
        return False


def _new_minimum(graph: Graph, prep: PreparedGraph, minimum: MinimumBudget, plan: Candidate) -> MinimumBudget:
    """Make ``minimum`` ``graph``'s smallest budget, and ``plan`` (its plan) the least-peak plan
    of the graph's structure, which a later trace of the same model starts from."""
    prep.minimum = minimum
    remember_least_peak(graph, plan.as_plan(graph))
    return minimum


def _candidate(name: str, graph: Graph, schedule: Schedule) -> Candidate:
    sim = simulate(graph, schedule.lower(graph))
    return Candidate.known(name, schedule, sim.peak_bytes, sim.total_cost)


def _infeasible(graph: Graph, budget_bytes: int, settings: SolverSettings, backend: MilpBackend, why: str,
                found: MinimumBudget | None = None, *, exact_max_nodes: int = EXACT_MAX_NODES) -> InfeasibleBudgetError:
    found = found or minimum_budget(graph, backend=backend, time_limit_s=settings.time_limit_s,
                                    threads=settings.threads, exact_max_nodes=exact_max_nodes)
    detail = why if found.proven else (f"{why}; the smallest budget found is not proven the least: no plan fits "
                                       f"below {found.lower_bound_bytes} B")
    return InfeasibleBudgetError(budget_bytes=budget_bytes, min_budget_bytes=found.budget_bytes, method="milp",
                                 graph_name=graph.name, detail=detail)


def _with_time(settings: SolverSettings, time_limit_s: float) -> SolverSettings:
    return dataclasses.replace(settings, time_limit_s=time_limit_s)


def _check_numbers(time_limit_s: float, mip_gap: float, threads: int) -> None:
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise ValueError(f"time_limit_s={time_limit_s!r} must be a positive number of seconds")
    if not (isinstance(mip_gap, (int, float)) and 0 <= mip_gap < 1):
        raise ValueError(f"mip_gap={mip_gap!r} must be a relative gap in [0, 1), e.g. 1e-4")
    if not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"threads={threads!r} must be a positive int")
