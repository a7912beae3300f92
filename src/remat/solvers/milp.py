"""``method="milp"``: the optimal plan under a budget, by mixed-integer programming.

One model (``milp_model``) for every backend (``milp_backends``): HiGHS by default, OR-Tools
CP-SAT, or Gurobi when installed. The solver starts from the cheapest known plan that fits
(the baselines' and the LP rounding's); on the time limit the best plan found is returned
with status TIME_LIMIT and the proven bound. A budget no plan meets raises
``InfeasibleBudgetError`` carrying the smallest feasible budget, found by a second model
that minimizes the peak.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from remat.errors import InfeasibleBudgetError, SolverError
from remat.graph import Graph
from remat.schedule import Schedule
from remat.simulate import simulate
from remat.solvers import lp_round
from remat.solvers.base import SolveResult, SolverStats, SolveStatus, finish, register
from remat.solvers.milp_backends import (
    BackendResult,
    BackendStatus,
    MilpBackend,
    RelaxationTimeout,
    SolverSettings,
    backend_available,
    run_backend,
)
from remat.solvers.milp_model import MilpModel, ModelObjective, build_model, peak_lower_bound_bytes
from remat.solvers.milp_start import Candidate, baseline_candidates, without_unread

log = logging.getLogger("remat.solve")

__all__ = ["MilpBackend", "MinimumBudget", "milp", "minimum_budget"]

#: The least time handed to a solver after the warm start used up the rest of the limit.
MIN_SOLVER_TIME_S = 1.0

#: The share of ``time_limit_s`` the warm start's LP relaxation may take.
LP_TIME_SHARE = 0.5


@dataclass(frozen=True)
class MinimumBudget:
    """The smallest budget with a plan; ``proven`` is False when the time limit stopped the
    search first (then ``budget_bytes`` is feasible but maybe not the least)."""

    budget_bytes: int
    proven: bool
    schedule: Schedule
    lower_bound_bytes: int


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
) -> SolveResult:
    """The cheapest plan whose simulated peak fits ``budget_bytes`` (optimal within ``mip_gap``).

    ``backend``: a ``MilpBackend`` or "highs" (default), "cpsat", "gurobi" (if installed).
    ``time_limit_s`` covers the whole call, warm start included; an infeasible budget then
    spends up to as long again finding the smallest feasible one. ``warm_start`` starts the
    solver from the cheapest fitting plan of the baselines and of the LP rounding (and falls
    back on it when the solver finds nothing better). With ``early_proof`` (and a warm start)
    a known plan that meets a proven lower bound (each node's cost once, or the LP relaxation
    within ``mip_gap``) is returned as OPTIMAL without a search. ``threads`` is fixed so that timings
    compare (HiGHS' branch and bound is serial; CP-SAT runs that many workers).
    ``dominance`` adds the rows that make S the exact liveness of R (see ``milp_model``).

    >>> from remat.builders import chain_graph
    >>> from remat.solvers import solve
    >>> r = solve(chain_graph(4, bytes_per_node=1), 4, method="milp")
    >>> r.status.value, r.objective, r.peak_bytes <= 4
    ('optimal', 11.0, True)
    """
    started = time.perf_counter()
    backend = MilpBackend.parse(backend)
    _check_numbers(time_limit_s, mip_gap, threads)
    backend_available(backend)
    settings = SolverSettings(time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads)
    if budget_bytes < peak_lower_bound_bytes(graph):
        raise _infeasible(graph, budget_bytes, settings, backend, "below what computing some node needs")
    model = build_model(graph, budget_bytes, ModelObjective.COST, dominance=dominance)
    if model.infeasible_reason is not None:
        raise _infeasible(graph, budget_bytes, settings, backend, model.infeasible_reason)
    candidates: list[Candidate] = []
    if warm_start:
        candidates = baseline_candidates(graph, budget_bytes)
        # Every node runs at least once: a plan costing that much is optimal outright.
        proven = _proven(candidates, budget_bytes, graph.total_cost, mip_gap) if early_proof else None
        if proven is not None:
            return _finish_proven(graph, budget_bytes, proven, graph.total_cost, model, backend, started)
        try:
            relaxation = lp_round.solve_relaxation(graph, budget_bytes, time_limit_s=LP_TIME_SHARE * time_limit_s)
        except RelaxationTimeout as exc:
            log.warning("milp: %s; warm-starting from the baselines only", exc)
        else:
            if relaxation is None:
                raise _infeasible(graph, budget_bytes, settings, backend, "its LP relaxation is infeasible")
            candidates += lp_round.rounded_candidates(graph, relaxation.S)
            proven = _proven(candidates, budget_bytes, relaxation.lower_bound, mip_gap) if early_proof else None
            if proven is not None:  # the LP bound already closes the gap: no search needed
                return _finish_proven(graph, budget_bytes, proven, relaxation.lower_bound, model, backend, started)
    start = _start_vector(model, candidates, budget_bytes)
    remaining_s = max(time_limit_s - (time.perf_counter() - started), MIN_SOLVER_TIME_S)
    result = run_backend(model, backend, _with_time(settings, remaining_s), start[0] if start else None)
    if result.status is BackendStatus.INFEASIBLE:
        raise _infeasible(graph, budget_bytes, settings, backend, "the solver proved it")
    return _package(graph, budget_bytes, model, result, start[1] if start else None, backend, started)


def _proven(candidates: list[Candidate], budget_bytes: int, bound: float, mip_gap: float) -> Candidate | None:
    """The cheapest fitting candidate if ``bound`` proves it optimal within ``mip_gap``."""
    fitting = [c for c in candidates if c.peak_bytes <= budget_bytes]
    best = min(fitting, key=lambda c: (c.cost, c.peak_bytes), default=None)
    if best is None or best.cost - bound > mip_gap * abs(best.cost) + 1e-9:
        return None
    return best


def _finish_proven(graph: Graph, budget_bytes: int, best: Candidate, bound: float, model: MilpModel,
                   backend: MilpBackend, started: float) -> SolveResult:
    log.info("milp: %s (cost %g) meets the lower bound %g on %s; no search needed", best.name, best.cost, bound,
             graph.name)
    stats = SolverStats(backend=backend.value, n_variables=model.n_cols, n_constraints=model.n_rows, nodes_explored=0)
    return finish(graph, best.schedule, budget_bytes=budget_bytes, method="milp", status=SolveStatus.OPTIMAL,
                  started_s=started, claimed_objective=best.cost, lower_bound=min(bound, best.cost), stats=stats)


def _package(graph, budget_bytes, model: MilpModel, result: BackendResult, fallback: Candidate | None,
             backend: MilpBackend, started: float) -> SolveResult:
    """Decode the solver's plan (or keep the start when it is no better) and check it."""
    stats = SolverStats(backend=backend.value, n_variables=model.n_cols, n_constraints=model.n_rows,
                        nodes_explored=result.nodes, iterations=result.iterations)
    schedule, claimed = None, None
    if result.x is not None:
        try:
            schedule = model.decode(result.x)
        except ValueError as exc:
            raise SolverError(f"{backend.value} returned a solution remat cannot read as a plan: {exc}") from None
        claimed = result.objective if backend is not MilpBackend.CPSAT else schedule.cost(graph)
    if fallback is not None and (schedule is None or fallback.cost < schedule.cost(graph) - 1e-9):
        schedule, claimed = fallback.schedule, fallback.cost
    if schedule is None:
        raise SolverError(
            f"{backend.value} found no plan for graph {graph.name!r} under {budget_bytes} B within the "
            f"time limit and no baseline fits; raise time_limit_s or the budget"
        )
    optimal = result.status is BackendStatus.OPTIMAL
    status = SolveStatus.OPTIMAL if optimal else SolveStatus.TIME_LIMIT
    bound = result.bound
    if bound is not None and backend is MilpBackend.CPSAT:
        bound = _cpsat_true_bound(model, bound)
    return finish(graph, schedule, budget_bytes=budget_bytes, method="milp", status=status, started_s=started,
                  claimed_objective=claimed, lower_bound=bound, stats=stats)


def _cpsat_true_bound(model: MilpModel, bound: float) -> float:
    # CP-SAT optimizes costs rounded to integers; each computed node may be off by half a
    # unit of the scale, so the bound on true costs is looser by that much per R variable.
    from remat.solvers.milp_backends import cpsat_cost_scale

    scale, exact = cpsat_cost_scale(model.col_cost)
    if exact:
        return bound
    return bound - 0.5 / scale * float(model.col_integer.sum())


def minimum_budget(
    graph: Graph,
    *,
    backend: MilpBackend | str = MilpBackend.HIGHS,
    time_limit_s: float = 60.0,
    threads: int = 2,
) -> MinimumBudget:
    """The smallest budget under which some plan exists (the least simulated peak).

    >>> from remat.builders import chain_graph
    >>> minimum_budget(chain_graph(4, bytes_per_node=1)).budget_bytes
    3
    """
    backend = MilpBackend.parse(backend)
    _check_numbers(time_limit_s, 0.0, threads)
    backend_available(backend)
    lower = peak_lower_bound_bytes(graph)
    known = baseline_candidates(graph, lower, lowest_peak=True)
    known.append(_candidate("checkpoint_all", graph, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool))))
    best = min(known, key=lambda c: (c.peak_bytes, c.cost))
    if best.peak_bytes <= lower:
        return MinimumBudget(best.peak_bytes, True, best.schedule, lower)
    model = build_model(graph, None, ModelObjective.PEAK, peak_upper_bytes=best.peak_bytes)
    start, _why = _start_of(model, best.schedule)
    # Peaks are whole units of model.bytes_unit: an absolute gap below one unit is exact.
    settings = SolverSettings(time_limit_s=time_limit_s, mip_gap=0.0, mip_abs_gap=0.999, threads=threads,
                              label="min-budget")
    result = run_backend(model, backend, settings, start)
    if result.x is not None:
        found = _candidate("milp-peak", graph, model.decode(result.x))
        if found.peak_bytes < best.peak_bytes:
            best = found
    if result.bound is not None:  # rounded-up sizes over-count by less than a unit per live value
        slack = 0 if model.exact_units else graph.n
        lower = max(lower, graph.fixed_bytes + model.bytes_unit * (math.ceil(result.bound - 1e-6) - slack))
    proven = best.peak_bytes <= lower
    log.info("min-budget: %s needs %d B (%s)", graph.name, best.peak_bytes, "proven" if proven else "not proven")
    return MinimumBudget(best.peak_bytes, proven, best.schedule, lower)


def _candidate(name: str, graph: Graph, schedule: Schedule) -> Candidate:
    sim = simulate(graph, schedule.lower(graph))
    return Candidate(name, schedule, sim.peak_bytes, sim.total_cost)


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


def _infeasible(graph: Graph, budget_bytes: int, settings: SolverSettings, backend: MilpBackend,
                why: str) -> InfeasibleBudgetError:
    found = minimum_budget(graph, backend=backend, time_limit_s=settings.time_limit_s, threads=settings.threads)
    detail = why if found.proven else f"{why}; the smallest budget is not proven (time limit): at least {found.lower_bound_bytes} B"
    return InfeasibleBudgetError(budget_bytes=budget_bytes, min_budget_bytes=found.budget_bytes, method="milp",
                                 graph_name=graph.name, detail=detail)


def _with_time(settings: SolverSettings, time_limit_s: float) -> SolverSettings:
    return SolverSettings(time_limit_s=time_limit_s, mip_gap=settings.mip_gap, mip_abs_gap=settings.mip_abs_gap,
                          threads=settings.threads, relax=settings.relax, label=settings.label)


def _check_numbers(time_limit_s: float, mip_gap: float, threads: int) -> None:
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise ValueError(f"time_limit_s={time_limit_s!r} must be a positive number of seconds")
    if not (isinstance(mip_gap, (int, float)) and 0 <= mip_gap < 1):
        raise ValueError(f"mip_gap={mip_gap!r} must be a relative gap in [0, 1), e.g. 1e-4")
    if not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"threads={threads!r} must be a positive int")
