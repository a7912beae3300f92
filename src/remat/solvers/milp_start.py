"""Known plans the MILP starts from and falls back on: the baselines' plans.

A plan here is a ``Candidate``: a schedule with its simulated peak and cost. The MILP takes
the cheapest candidate that fits as its MIP start, returns it if the solver finds nothing
better within the time limit, and uses the lowest-peak one to bound the memory-minimizing
model.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from remat.errors import RematError, UnsupportedGraphError
from remat.graph import Graph
from remat.schedule import Schedule, stage_order
from remat.solvers.base import methods as registered_methods
from remat.solvers.baselines import BaselinePlan, in_stage_order, measure_order, plans_of

log = logging.getLogger("remat.solve")

#: The baseline methods tried, in this order, when they are registered.
BASELINE_METHODS = ("checkpoint_all", "recompute_all", "chen_sqrtn", "chen_greedy", "segments", "griewank", "nested",
                    "chain", "descent")

#: recompute_all recomputes a whole ancestry in every stage: building its plan is quadratic in
#: the node count (22 s on a 1445-node GPT-2), and on traced steps it is never the cheapest
#: plan at any budget the others meet nor the lowest peak (it holds a stage's whole ancestry
#: at once). Beyond this many nodes it is left out of the known plans.
RECOMPUTE_ALL_MAX_NODES = 400


@dataclass(frozen=True, eq=False)
class Candidate:
    """A plan from some method, with what the simulator says about it. Its schedule (n x n
    matrices) is built when first asked for: most candidates are compared, few are used."""

    name: str
    peak_bytes: int
    cost: float
    make_schedule: Callable[[], Schedule]
    #: the plan as a measured compute order, run stage by stage in id order (None when the
    #: candidate was given as a schedule): ``as_plan`` then needs no n x n matrix
    order: BaselinePlan | None = None

    @cached_property
    def schedule(self) -> Schedule:
        return self.make_schedule()

    @classmethod
    def known(cls, name: str, schedule: Schedule, peak_bytes: int, cost: float) -> Candidate:
        """A candidate whose schedule exists already."""
        return cls(name, peak_bytes, cost, lambda: schedule)

    @classmethod
    def of_plan(cls, name: str, graph: Graph, plan: BaselinePlan) -> Candidate:
        """A measured plan as a candidate (its schedule built when asked for)."""
        canonical = in_stage_order(plan.stages, plan.nodes)
        return cls(name, plan.peak_bytes, plan.cost, functools.partial(plan.schedule, graph),
                   plan if canonical else None)

    def as_plan(self, graph: Graph) -> BaselinePlan:
        """The candidate as a measured compute order (what lowering and pruning work on): its
        schedule's computations stage by stage, each stage in id order."""
        if self.order is not None:
            return BaselinePlan(self.name, self.order.stages, self.order.nodes, self.order.peak_bytes, self.order.cost)
        stages, nodes = stage_order(self.schedule.R)
        return measure_order(graph, stages, nodes, self.name)

    def compact(self, graph: Graph) -> Candidate:
        """The same plan kept as its compute order, measured (not as n x n matrices): what a
        graph's cache can hold many of."""
        return Candidate.of_plan(self.name, graph, self.as_plan(graph))


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


def baseline_candidates(graph: Graph, budget_bytes: int, *, lowest_peak: bool = False,
                        methods: tuple[str, ...] = BASELINE_METHODS) -> list[Candidate]:
    """The plan each registered baseline (of ``methods``) returns under ``budget_bytes``.

    A baseline that cannot meet the budget is skipped, unless ``lowest_peak``: then its
    least-memory plan is listed (what it would return at the smallest budget it says it can
    meet, and what the memory-minimizing model starts from).
    """
    registered = set(registered_methods())
    out: list[Candidate] = []
    for method in methods:
        if method not in registered or (method == "recompute_all" and graph.n > RECOMPUTE_ALL_MAX_NODES):
            continue
        try:
            plans = plans_of(method, graph, budget_bytes)
        except UnsupportedGraphError:
            continue
        except RematError as exc:  # a baseline's own failure must not sink the MILP
            log.warning("baseline %s failed on %s (skipped as a known plan): %s", method, graph.name, exc)
            continue
        fitting = [p for p in plans if p.peak_bytes <= budget_bytes]
        if fitting:  # what the method returns: the cheapest that fits, ties to the lower peak
            best = min(fitting, key=lambda p: (p.cost, p.peak_bytes))
        elif lowest_peak and plans:
            lowest = min(p.peak_bytes for p in plans)
            best = min((p for p in plans_of(method, graph, lowest) if p.peak_bytes <= lowest),
                       key=lambda p: (p.cost, p.peak_bytes))
        else:
            continue
        out.append(Candidate.of_plan(method, graph, best))
    return out
