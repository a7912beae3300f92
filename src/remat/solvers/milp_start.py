"""Known plans the MILP starts from and falls back on: the baselines' plans.

A plan here is a ``Candidate``: a schedule with its simulated peak and cost. The MILP takes
the cheapest candidate that fits as its MIP start, returns it if the solver finds nothing
better within the time limit, and uses the lowest-peak one to bound the memory-minimizing
model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from remat.errors import InfeasibleBudgetError, RematError, UnsupportedGraphError
from remat.graph import Graph
from remat.schedule import Schedule
from remat.solvers.base import methods, solve

log = logging.getLogger("remat.solve")

#: The baseline methods tried, in this order, when they are registered.
BASELINE_METHODS = ("checkpoint_all", "recompute_all", "chen_sqrtn", "chen_greedy", "segments", "griewank")

#: recompute_all recomputes a whole ancestry in every stage: building its plan is quadratic in
#: the node count (22 s on a 1445-node GPT-2), and on traced steps it is never the cheapest
#: plan at any budget the others meet nor the lowest peak (it holds a stage's whole ancestry
#: at once). Beyond this many nodes it is left out of the known plans.
RECOMPUTE_ALL_MAX_NODES = 400


@dataclass(frozen=True)
class Candidate:
    """A plan from some method, with what the simulator says about it."""

    name: str
    schedule: Schedule
    peak_bytes: int
    cost: float


def best_fitting(candidates: Iterable[Candidate], budget_bytes: int) -> Candidate | None:
    """The cheapest candidate within the budget (ties: lower peak), or None."""
    fitting = [c for c in candidates if c.peak_bytes <= budget_bytes]
    return min(fitting, key=lambda c: (c.cost, c.peak_bytes), default=None)


def without_unread(graph: Graph, schedule: Schedule) -> Schedule:
    """The same plan minus every extra computation that nothing reads before its node is
    computed again: no more cost and no more memory (each stage's own node and outputs stay).

    The MILP's dominance rows forbid such computations, so a baseline plan must lose them
    before it can be a MIP start.
    """
    R = np.array(schedule.R, dtype=bool)
    while True:
        unread = _unread_extras(graph, R)
        if not unread:
            return Schedule.from_compute(graph, R)
        for t, i in unread:
            R[t, i] = False


def _unread_extras(graph: Graph, R: np.ndarray) -> list[tuple[int, int]]:
    last: dict[int, tuple[int, int]] = {}
    read: dict[tuple[int, int], bool] = {}
    for t in range(graph.n):
        for i in (int(i) for i in np.flatnonzero(R[t, : t + 1])):
            for d in graph.nodes[i].deps:
                if d in last:
                    read[last[d]] = True
            last[i] = (t, i)
            read[(t, i)] = False
    return [(t, i) for (t, i), was_read in read.items() if not was_read and t != i and i not in graph.output_set]


def baseline_candidates(graph: Graph, budget_bytes: int, *, lowest_peak: bool = False) -> list[Candidate]:
    """The plan of every registered baseline under ``budget_bytes``.

    A baseline that cannot meet the budget is skipped, unless ``lowest_peak``: then it is
    asked again at the smallest budget it says it can meet, so that the list holds each
    baseline's least-memory plan (what the memory-minimizing model starts from).
    """
    registered = set(methods())
    out: list[Candidate] = []
    for method in BASELINE_METHODS:
        if method not in registered or (method == "recompute_all" and graph.n > RECOMPUTE_ALL_MAX_NODES):
            continue
        result = _try(graph, budget_bytes, method)
        if isinstance(result, InfeasibleBudgetError):
            if not lowest_peak or result.min_budget_bytes is None:
                continue
            result = _try(graph, result.min_budget_bytes, method)
        if result is None or isinstance(result, InfeasibleBudgetError):
            continue
        out.append(Candidate(method, result.schedule, result.peak_bytes, result.cost))
    return out


def _try(graph: Graph, budget_bytes: int, method: str):
    try:
        return solve(graph, budget_bytes, method=method)
    except InfeasibleBudgetError as exc:
        return exc
    except UnsupportedGraphError:
        return None
    except RematError as exc:  # a baseline's own failure must not sink the MILP
        log.warning("baseline %s failed on %s (skipped as a MIP start): %s", method, graph.name, exc)
        return None
