"""What planning one graph under many budgets computes only once.

A sweep, a maximum-batch search or a recompile asks the same graph for plan after plan. The
parts that do not depend on the budget (the retention model's structure, the ingredients of
the lower bounds, every candidate plan a baseline has measured, the retention plans found so
far, the smallest budget) are kept per graph, keyed by the graph's fingerprint, for the last
few graphs planned. Everything here is derived from the graph alone, so a cached value is
the value a fresh computation would give: caching changes how long planning takes, never
which plan it returns for a budget, except that plans found for earlier budgets can serve
as starting points of the search, and a plan returned for an earlier budget is returned for
a later one it fits when the search finds nothing cheaper (so a sweep never pays more at a
larger budget than at a smaller one planned before it).

Profiled costs differ from one trace of a model to the next, so a second trace is a new graph
to that cache. The least-peak plan found for a graph is therefore also kept by its structure
alone (``Graph.fingerprint(costs=False)``): the smallest-budget search on a graph of the same
structure starts from it, and the smallest budget an error stated for one trace plans on the
next, whatever the time-limited searches find there.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from functools import cached_property
from typing import TYPE_CHECKING

from remat.graph import Graph

if TYPE_CHECKING:
    from remat.solvers.baselines import BaselinePlan
    from remat.solvers.bounds import InstantBounds
    from remat.solvers.milp_start import Candidate
    from remat.solvers.retention import RetentionSolution, RetentionStructure

#: How many graphs keep their prepared state (least recently planned dropped first).
CACHED_GRAPHS = 4
#: How many returned plans a graph keeps (those no other returned plan beats in both peak and
#: cost; beyond this many, the ones of highest peak are dropped).
RETURNED_PLANS = 16


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
        #: the plans calls returned so far that no other returned plan beats in both peak and
        #: cost, by increasing peak, as compact compute orders: candidates at every later
        #: budget they fit, and the first is a candidate of the smallest-budget search (a plan
        #: the exact model found at one budget may reach below every baseline's)
        self.returned: list[Candidate] = []

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
        """Note a plan returned for some budget: kept, as its compute order, unless a plan
        returned before is no dearer and peaks no higher."""
        if any(_dominates(kept, plan) for kept in self.returned):
            return
        compact = plan.compact(self.graph)
        if not compact.name.endswith(_EARLIER):
            compact = dataclasses.replace(compact, name=compact.name + _EARLIER)
        if any(_dominates(kept, compact) for kept in self.returned):
            return
        frontier = [kept for kept in self.returned if not _dominates(compact, kept)] + [compact]
        self.returned = sorted(frontier, key=lambda c: (c.peak_bytes, c.cost))[:RETURNED_PLANS]

    @property
    def lowest(self) -> Candidate | None:
        """The returned plan of least peak (the cheapest of those), or None."""
        return self.returned[0] if self.returned else None

    def best_retention_plan(self, budget_bytes: int) -> RetentionSolution | None:
        """The cheapest retention plan found so far whose model peak fits the budget."""
        fitting = [s for s in self.retention_plans if s.model_peak_bytes <= budget_bytes]
        return min(fitting, key=lambda s: (s.cost, s.model_peak_bytes), default=None)


_EARLIER = " (returned for an earlier budget)"


def _dominates(a: Candidate, b: Candidate) -> bool:
    return a.peak_bytes <= b.peak_bytes and a.cost <= b.cost


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


#: The least-peak plan found per graph structure, for the last this many structures.
LEAST_PEAK_STRUCTURES = 16
_LEAST_PEAK: OrderedDict[str, BaselinePlan] = OrderedDict()


def least_peak_plan(graph: Graph) -> BaselinePlan | None:
    """The plan of least peak found so far on a graph of ``graph``'s structure (its costs may
    differ: re-measure it on ``graph``), or None."""
    with _LOCK:
        return _LEAST_PEAK.get(graph.fingerprint(costs=False))


def remember_least_peak(graph: Graph, plan: BaselinePlan) -> None:
    """Keep ``plan`` as its structure's least-peak plan unless one of no higher peak is kept."""
    _keep_least_peak(graph.fingerprint(costs=False), plan, recent=True)


def _keep_least_peak(key: str, plan: BaselinePlan, *, recent: bool) -> None:
    """Keep ``plan`` under the structure ``key`` unless one of no higher peak is kept there;
    ``recent``: the structure is the most recently planned (kept longest)."""
    with _LOCK:
        kept = _LEAST_PEAK.get(key)
        if kept is None or plan.peak_bytes < kept.peak_bytes:
            _LEAST_PEAK[key] = plan
        if recent:
            _LEAST_PEAK.move_to_end(key)
        while len(_LEAST_PEAK) > LEAST_PEAK_STRUCTURES:
            _LEAST_PEAK.popitem(last=False)


def least_peak_records() -> dict[str, dict]:
    """The least-peak plans kept, by structure fingerprint, as plain data (``stages``, ``nodes``:
    the compute order; ``peak_bytes``): what a command line saves so that the smallest budget
    it stated plans in the next process too (``add_least_peak_record``)."""
    with _LOCK:
        return {key: {"stages": plan.stages.tolist(), "nodes": plan.nodes.tolist(), "peak_bytes": int(plan.peak_bytes)}
                for key, plan in _LEAST_PEAK.items()}


def add_least_peak_record(key: str, record: dict) -> bool:
    """Keep a record of ``least_peak_records`` as the least-peak plan of the structure ``key``
    (unless one of no higher peak is kept). Its order is measured on the first graph of that
    structure that asks for it; a malformed record is ignored (False)."""
    import numpy as np

    from remat.solvers.baselines import BaselinePlan

    try:
        stages = np.asarray(record["stages"], dtype=np.int32)
        nodes = np.asarray(record["nodes"], dtype=np.int32)
        peak = int(record["peak_bytes"])
    except (KeyError, TypeError, ValueError):
        return False
    if stages.ndim != 1 or stages.shape != nodes.shape or not nodes.size or nodes.min() < 0 or peak <= 0:
        return False
    _keep_least_peak(key, BaselinePlan("least-peak plan of an earlier run", stages, nodes, peak, float("nan")),
                     recent=False)
    return True


def clear() -> None:
    """Forget every prepared graph and least-peak plan (tests use it to measure cold starts)."""
    with _LOCK:
        _CACHE.clear()
        _LEAST_PEAK.clear()
