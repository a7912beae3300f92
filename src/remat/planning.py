"""From a graph and a budget to a checked plan for that graph.

``plan_graph`` coarsens the graph (exactly: zero-byte aliases fold into their owner), solves
the smaller problem with the chosen method, expands the plan back and replays it in the
simulator on the original graph. This is the path ``optimize`` and the compiler backend use.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.coarsen import Coarsening, coarsen
from remat.errors import SolverError
from remat.graph import Graph
from remat.schedule import Plan
from remat.simulate import SimResult, simulate
from remat.solvers import SolveResult, solve


@dataclass(frozen=True)
class GraphPlan:
    """A plan for ``graph``: the solver's result (on the coarse graph when coarsened), the
    expanded plan and its simulation on ``graph`` itself."""

    graph: Graph
    result: SolveResult
    coarsening: Coarsening | None
    plan: Plan
    sim: SimResult

    @property
    def overhead(self) -> float:
        return self.sim.total_cost / self.graph.total_cost if self.graph.total_cost > 0 else 1.0


def plan_graph(graph: Graph, budget_bytes: int, method: str = "milp", *, reduce: bool = True,
               **options: object) -> GraphPlan:
    """Solve ``graph`` under ``budget_bytes`` with ``method`` and check the plan.

    ``reduce`` folds zero-byte aliases first (exact; the MILP's size grows with n^2).
    Raises ``InfeasibleBudgetError`` as ``solve`` does.

    >>> from remat.builders import chain_graph
    >>> p = plan_graph(chain_graph(6), 2**40, method="checkpoint_all")
    >>> p.sim.peak_bytes <= 2**40, p.overhead
    (True, 1.0)
    """
    coarse = coarsen(graph) if reduce else None
    target = coarse.coarse if coarse is not None else graph
    result = solve(target, budget_bytes, method=method, **options)
    plan = coarse.expand(result.plan) if coarse is not None else result.plan
    sim = simulate(graph, plan)
    if not sim.ok or sim.peak_bytes > budget_bytes or abs(sim.total_cost - result.cost) > 1e-6 * max(1.0, result.cost):
        raise SolverError(
            f"the plan of method {method!r} does not carry over to graph {graph.name!r} (peak "
            f"{sim.peak_bytes} B, cost {sim.total_cost} vs {result.cost}, "
            f"{len(sim.violations)} violations); please report this"
        )
    return GraphPlan(graph=graph, result=result, coarsening=coarse, plan=plan, sim=sim)
