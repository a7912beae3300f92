"""What planning one graph under many budgets computes only once.

A sweep, a maximum-batch search or a recompile asks the same graph for plan after plan. The
parts that do not depend on the budget (the retention model's structure, the ingredients of
the lower bounds, every candidate plan a baseline has measured, the retention plans found so
far, the smallest budget) are kept per graph, keyed by the graph's fingerprint, for the last
few graphs planned. Everything here is derived from the graph alone, so a cached value is
the value a fresh computation would give: caching changes how long planning takes, never
which plan it returns for a budget, except that plans found for earlier budgets can serve
as starting points of the search.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from functools import cached_property
from typing import TYPE_CHECKING

from remat.graph import Graph

if TYPE_CHECKING:
    from remat.solvers.bounds import InstantBounds
    from remat.solvers.milp_start import Candidate
    from remat.solvers.retention import RetentionSolution, RetentionStructure

#: How many graphs keep their prepared state (least recently planned dropped first).
CACHED_GRAPHS = 4


class PreparedGraph:
    """Budget-independent state of one graph (see the module docstring)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        #: measured baseline plans by (method, what identifies the plan)
        self.measured: dict[tuple, object] = {}
        #: plans of the retention model found so far, and the stages whose memory rows they needed
        self.retention_plans: list[RetentionSolution] = []
        self.retention_rows: set[int] = set()
        #: the smallest budget once found (see ``remat.solvers.milp.minimum_budget``)
        self.minimum: object | None = None
        #: the plan of least simulated peak any call returned so far: a candidate of the
        #: smallest-budget search (a plan the exact model found at one budget may reach below
        #: every baseline's)
        self.lowest: Candidate | None = None

    @cached_property
    def bounds(self) -> InstantBounds:
        from remat.solvers.bounds import InstantBounds

        return InstantBounds(self.graph)

    @cached_property
    def retention(self) -> RetentionStructure:
        from remat.solvers.retention import RetentionStructure

        return RetentionStructure(self.graph)

    def remember(self, solution: RetentionSolution, rows: tuple[int, ...] = ()) -> None:
        """Keep a retention plan (a start for later budgets) and the rows it needed."""
        self.retention_rows.update(rows)
        if all(solution.cost != s.cost or solution.model_peak_bytes != s.model_peak_bytes
               for s in self.retention_plans):
            self.retention_plans.append(solution)

    def saw_plan(self, plan: Candidate) -> None:
        """Note a plan returned for some budget (kept if its peak is the least seen)."""
        if self.lowest is None or (plan.peak_bytes, plan.cost) < (self.lowest.peak_bytes, self.lowest.cost):
            self.lowest = plan

    def best_retention_plan(self, budget_bytes: int) -> RetentionSolution | None:
        """The cheapest retention plan found so far whose model peak fits the budget."""
        fitting = [s for s in self.retention_plans if s.model_peak_bytes <= budget_bytes]
        return min(fitting, key=lambda s: (s.cost, s.model_peak_bytes), default=None)


_CACHE: OrderedDict[str, PreparedGraph] = OrderedDict()
_LOCK = threading.Lock()


def prepared(graph: Graph) -> PreparedGraph:
    """The prepared state of ``graph`` (created on first use)."""
    key = graph.fingerprint()
    with _LOCK:
        state = _CACHE.get(key)
        if state is None:
            state = _CACHE[key] = PreparedGraph(graph)
            while len(_CACHE) > CACHED_GRAPHS:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
        return state


def clear() -> None:
    """Forget every prepared graph (tests use it to measure cold starts)."""
    with _LOCK:
        _CACHE.clear()
