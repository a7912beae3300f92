"""Checkmate's LP relaxation and two-phase rounding (``method="lp_round"``).

Solve the MILP with integrality dropped (its objective is a lower bound on every plan's
cost under the budget), round the keep matrix S (a deterministic sweep of thresholds, then
randomized rounding with a seeded generator), complete each rounded S with the least R that
satisfies the dependencies (``Schedule.from_kept``), and keep the cheapest plan the
simulator accepts under the budget. The MILP uses the same rounding for its MIP start.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from remat.errors import InfeasibleBudgetError
from remat.graph import Graph
from remat.schedule import Schedule
from remat.simulate import simulate
from remat.solvers.base import SolveResult, SolverStats, SolveStatus, finish, register
from remat.solvers.milp_backends import BackendStatus, MilpBackend, RelaxationTimeout, SolverSettings, run_backend
from remat.solvers.milp_model import MilpModel, ModelObjective, build_model
from remat.solvers.milp_start import Candidate, baseline_candidates, best_fitting

#: Graphs of at most this many nodes get Checkmate's relaxation (O(n^2) columns); larger ones the
#: retention model's.
EXACT_MAX_NODES = 60

log = logging.getLogger("remat.solve")

#: Thresholds of the deterministic sweep: keep S[t, i] when its LP value is at least this.
DEFAULT_THRESHOLDS = (0.99, 0.9, 0.75, 0.6, 0.5, 0.4, 0.25, 0.1, 0.01)


@dataclass(frozen=True)
class Relaxation:
    """The LP relaxation of one budget: its optimal value and the fractional keep matrix."""

    lower_bound: float
    S: np.ndarray
    n_variables: int
    n_constraints: int
    exact_units: bool  # False: sizes were rounded up, the LP is stricter than the graph (no bound)


def solve_relaxation(graph: Graph, budget_bytes: int, *, time_limit_s: float = 60.0,
                     model: MilpModel | None = None) -> Relaxation | None:
    """The LP relaxation under ``budget_bytes``, or None when even the LP is infeasible
    (then no plan fits). ``model``: the COST model of that budget when the caller has built it."""
    model = model or build_model(graph, budget_bytes, ModelObjective.COST)
    if model.infeasible_reason is not None:
        return None
    settings = SolverSettings(time_limit_s=time_limit_s, relax=True, label="lp")
    result = run_backend(model, MilpBackend.HIGHS, settings)
    if result.status is BackendStatus.INFEASIBLE or result.x is None:
        return None
    return Relaxation(float(result.objective), model.s_values(result.x), model.n_cols, model.n_rows, model.exact_units)


def rounded_keeps(
    S: np.ndarray, *, thresholds: Sequence[float] = DEFAULT_THRESHOLDS, n_samples: int = 16, seed: int = 0
) -> Iterator[np.ndarray]:
    """Boolean keep matrices from a fractional S: one per threshold, then ``n_samples``
    randomized roundings (keep with probability S[t, i]); duplicates are skipped."""
    seen: set[bytes] = set()
    rng = np.random.default_rng(seed)
    draws = (S >= thr - 1e-9 for thr in thresholds)
    samples = (rng.random(S.shape) < S for _ in range(n_samples))
    for keep in (*draws, *samples):
        key = np.packbits(keep).tobytes()
        if key not in seen:
            seen.add(key)
            yield keep


def rounded_candidates(
    graph: Graph, S: np.ndarray, *, thresholds: Sequence[float] = DEFAULT_THRESHOLDS, n_samples: int = 16, seed: int = 0
) -> list[Candidate]:
    """Every distinct plan the rounding of ``S`` gives, simulated."""
    out = []
    for k, keep in enumerate(rounded_keeps(S, thresholds=thresholds, n_samples=n_samples, seed=seed)):
        schedule = Schedule.from_kept(graph, keep)
        sim = simulate(graph, schedule.lower(graph))
        out.append(Candidate.known(f"lp_round#{k}", schedule, sim.peak_bytes, sim.total_cost))
    return out


@register("lp_round")
def lp_round(
    graph: Graph,
    budget_bytes: int,
    *,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    n_samples: int = 16,
    seed: int = 0,
    time_limit_s: float = 60.0,
    fallback: bool = True,
    exact_max_nodes: int = EXACT_MAX_NODES,
) -> SolveResult:
    """LP relaxation plus rounding. On graphs of at most ``exact_max_nodes`` nodes it is
    Checkmate's: the relaxation of the exact MILP (a lower bound), then two-phase rounding of
    its keep matrix. On larger graphs (Checkmate's relaxation has O(n^2) columns) it rounds
    the retention model's relaxation (``remat.solvers.retention``) at each threshold instead;
    ``lower_bound`` is then the instant bound of the whole graph (``remat.solvers.bounds``).

    With ``fallback`` (default) the cheapest baseline plan that fits is returned where no
    rounded plan fits or it is cheaper than every one (so lp_round is never worse than a
    baseline: on a U-Net of depth 80 at 93%, rounding gave 1.058x and descent 1.010x);
    ``stats.plan_from`` names it, and ``plan_graph``'s note says so. Without it, or if nothing
    fits, it raises ``InfeasibleBudgetError``.

    >>> from remat.builders import chain_graph
    >>> from remat.solvers import solve
    >>> r = solve(chain_graph(6, bytes_per_node=1), 6, method="lp_round")
    >>> r.peak_bytes <= 6, r.lower_bound <= r.objective
    (True, True)
    """
    started = time.perf_counter()
    if n_samples < 0:
        raise ValueError(f"n_samples={n_samples!r} must be >= 0 (randomized roundings to draw)")
    if graph.n > exact_max_nodes:
        return _retention_rounding(graph, budget_bytes, thresholds, time_limit_s, fallback, started)
    bound = _instant_bound(graph, budget_bytes, time_limit_s)
    try:
        relaxation = solve_relaxation(graph, budget_bytes, time_limit_s=time_limit_s)
    except RelaxationTimeout as exc:
        if not fallback:
            raise
        return _baseline_after_timeout(graph, budget_bytes, started, str(exc), lower_bound=bound)
    if relaxation is None:
        raise _infeasible(graph, budget_bytes, "even the LP relaxation is infeasible")
    rounded = rounded_candidates(graph, relaxation.S, thresholds=thresholds, n_samples=n_samples, seed=seed)
    stats = SolverStats(backend="highs", n_variables=relaxation.n_variables, n_constraints=relaxation.n_constraints)
    if relaxation.exact_units:
        bound = max(bound, relaxation.lower_bound)
    return _best_rounded(graph, budget_bytes, rounded, bound, stats, fallback, started)


def _instant_bound(graph: Graph, budget_bytes: int, time_limit_s: float) -> float:
    from remat.solvers.prepared import prepared

    return prepared(graph).bounds.cost_bound(budget_bytes, time_limit_s=min(10.0, 0.15 * time_limit_s)).value


def _retention_rounding(graph: Graph, budget_bytes: int, thresholds: Sequence[float], time_limit_s: float,
                        fallback: bool, started: float) -> SolveResult:
    from remat.solvers.prepared import prepared
    from remat.solvers.retention import ROUNDING_THRESHOLDS, relax_retention, round_solution

    prep = prepared(graph)
    structure = prep.retention
    bound = prep.bounds.cost_bound(budget_bytes, time_limit_s=min(10.0, 0.15 * time_limit_s))
    if not bound.feasible:
        raise _infeasible(graph, budget_bytes, f"at {graph.describe(bound.instant)} the values every plan holds "
                          f"there already take more than this budget")
    rows = sorted(prep.retention_rows | ({bound.instant} if bound.instant is not None else set()))
    relaxed = relax_retention(structure, budget_bytes, rows, deadline=started + time_limit_s)
    if relaxed.infeasible and not fallback:
        raise _infeasible(graph, budget_bytes, "the retention model's LP relaxation is infeasible")
    if relaxed.x is None and not relaxed.infeasible:
        why = (f"the LP relaxation of graph {graph.name!r} ({structure.n_cols} variables) did not finish within "
               f"{time_limit_s:g} s; raise time_limit_s")
        if not fallback:
            raise RelaxationTimeout(why)
        return _baseline_after_timeout(graph, budget_bytes, started, why, lower_bound=bound.value)
    rounded: list[Candidate] = []
    if relaxed.x is not None:
        for k, threshold in enumerate(dict.fromkeys((*thresholds, *ROUNDING_THRESHOLDS))):
            solution = round_solution(structure, relaxed.x, threshold)
            if solution.model_peak_bytes <= budget_bytes:
                order = solution.order(structure)
                schedule = Schedule.from_order(graph, [t for t, _ in order], [v for _, v in order])
                sim = simulate(graph, schedule.lower(graph))
                rounded.append(Candidate.known(f"lp_round#{k} (threshold {threshold:g})", schedule, sim.peak_bytes,
                                         sim.total_cost))
    stats = SolverStats(backend="highs", n_variables=structure.n_cols, n_constraints=len(rows))
    return _best_rounded(graph, budget_bytes, rounded, bound.value, stats, fallback, started)


def _none_fit(rounded: list[Candidate]) -> str:
    """Why no rounded plan was returned: none came out of the rounding, or none of them fits."""
    return "no rounding of the LP solution gave a plan that fits" if not rounded else \
        f"none of the {len(rounded)} rounded plans fits"


def _best_rounded(graph: Graph, budget_bytes: int, rounded: list[Candidate], lower_bound: float,
                  stats: SolverStats, fallback: bool, started: float) -> SolveResult:
    """The cheapest rounded plan that fits (with ``fallback``, or a cheaper baseline's)."""
    best = best_fitting(rounded, budget_bytes)
    source = "lp_round"
    if fallback:
        known = best_fitting(baseline_candidates(graph, budget_bytes), budget_bytes)
        if known is not None and (best is None or known.cost < best.cost - 1e-9 * max(1.0, known.cost)):
            why = _none_fit(rounded) if best is None else f"the cheapest rounded plan costs {best.cost:g}"
            (log.warning if best is None else log.info)(
                "lp_round: %s under %d B on %s; returning baseline %s (cost %g)", why, budget_bytes, graph.name,
                known.name, known.cost)
            best, source = known, known.name
    if best is None:
        raise _infeasible(graph, budget_bytes, f"{_none_fit(rounded)} the budget")
    log.info("lp_round: %s on %s: cost %g, lower bound %g", best.name, graph.name, best.cost, lower_bound)
    return finish(
        graph, best.schedule, budget_bytes=budget_bytes, method="lp_round", status=SolveStatus.FEASIBLE,
        started_s=started, claimed_objective=best.cost, lower_bound=min(lower_bound, best.cost),
        stats=dataclasses.replace(stats, plan_from=source),
    )


def _baseline_after_timeout(graph: Graph, budget_bytes: int, started: float, why: str,
                            lower_bound: float | None = None) -> SolveResult:
    """No LP solution to round in time: the cheapest fitting baseline, marked TIME_LIMIT."""
    best = best_fitting(baseline_candidates(graph, budget_bytes), budget_bytes)
    if best is None:
        raise _infeasible(graph, budget_bytes, f"{why}, and no baseline plan fits")
    log.warning("lp_round: %s; returning baseline %s", why, best.name)
    return finish(graph, best.schedule, budget_bytes=budget_bytes, method="lp_round", status=SolveStatus.TIME_LIMIT,
                  started_s=started, claimed_objective=best.cost, stats=SolverStats(backend="highs", plan_from=best.name),
                  lower_bound=None if lower_bound is None else min(lower_bound, best.cost))


def _infeasible(graph: Graph, budget_bytes: int, detail: str) -> InfeasibleBudgetError:
    # The smallest budget lp_round can promise is the least one its baseline fallback meets.
    peaks = [c.peak_bytes for c in baseline_candidates(graph, budget_bytes, lowest_peak=True)]
    return InfeasibleBudgetError(
        budget_bytes=budget_bytes, min_budget_bytes=min(peaks) if peaks else None, method="lp_round",
        graph_name=graph.name, detail=detail,
    )
