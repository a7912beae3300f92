"""From a graph and a budget to a checked plan for that graph.

``plan_graph`` reduces the graph, solves the smaller problem with the chosen method, expands
the plan back and replays it in the simulator on the original graph. This is the path
``optimize``, the benchmarks and the compiler backend use.

Reduction has two levels (``remat.coarsen``). Folding zero-byte aliases is exact and always
on. The MILP and its LP relaxation grow with the square of the node count, so for them the
folded graph is also grouped down to ``max_nodes`` nodes (runs of neighbouring operations
computed and kept as one, like the layers of the Checkmate paper). A grouped graph has fewer
plans than the full one, so its optimum can cost more than the full graph's; to never do
worse than a baseline, the baselines also run on the full (folded) graph and the cheapest
plan wins. ``GraphPlan.note`` says which one did.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from remat.coarsen import Coarsening, fold_aliases, group_folded
from remat.errors import InfeasibleBudgetError, SolverError, UnsupportedGraphError
from remat.graph import Graph
from remat.schedule import Plan
from remat.simulate import SimResult, simulate
from remat.solvers import SolveResult, solve
from remat.solvers.base import SolveStatus, relative_gap

log = logging.getLogger("remat.solve")

#: Methods whose model grows with n^2: they solve a grouped graph of at most this many nodes.
GROUPED_METHODS = ("milp", "lp_round")
DEFAULT_MAX_NODES = 150


@dataclass(frozen=True)
class GraphPlan:
    """A plan for ``graph``: the solver's result (on the reduced graph when reduced), the
    expanded plan and its simulation on ``graph`` itself.

    When the graph was grouped, ``result.lower_bound`` and ``result.gap`` are those of the
    grouped problem, not bounds for ``graph``; ``note`` explains any substitution.
    """

    graph: Graph
    result: SolveResult
    coarsening: Coarsening | None
    plan: Plan
    sim: SimResult
    note: str = ""

    @property
    def overhead(self) -> float:
        return self.sim.total_cost / self.graph.total_cost if self.graph.total_cost > 0 else 1.0

    @property
    def solved_nodes(self) -> int:
        """How many nodes the solver's graph had."""
        return self.result.graph.n

    @property
    def exact(self) -> bool:
        """True unless the solver saw a grouped graph (then its optimum is the grouped one's)."""
        return self.coarsening is None or self.coarsening.exact


def plan_graph(graph: Graph, budget_bytes: int, method: str = "milp", *, reduce: bool = True,
               max_nodes: int | None | str = "auto", **options: object) -> GraphPlan:
    """Solve ``graph`` under ``budget_bytes`` with ``method`` and check the plan.

    ``reduce`` folds zero-byte aliases first (exact). ``max_nodes`` bounds the graph the solver
    sees by grouping (``"auto"``: ``DEFAULT_MAX_NODES`` for the MILP and ``lp_round``, no
    grouping for the baselines; None: never group). Raises ``InfeasibleBudgetError`` as
    ``solve`` does, with the smallest budget any tried plan needs.

    >>> from remat.builders import chain_graph
    >>> p = plan_graph(chain_graph(6), 2**40, method="checkpoint_all")
    >>> p.sim.peak_bytes <= 2**40, p.overhead
    (True, 1.0)
    """
    if max_nodes == "auto":
        max_nodes = DEFAULT_MAX_NODES if method in GROUPED_METHODS else None
    elif max_nodes is not None and (not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1):
        raise ValueError(f"max_nodes={max_nodes!r} must be a positive int, None (no grouping) or 'auto'")
    started = time.perf_counter()
    folded = fold_aliases(graph) if reduce else None
    coarse = folded if folded is None or max_nodes is None else group_folded(folded, max_nodes)
    target = coarse.coarse if coarse is not None else graph
    if coarse is None or coarse.exact:
        result = solve(target, budget_bytes, method=method, **options)
        return _checked(graph, coarse, result, method, budget_bytes)
    grouped: GraphPlan | None = None
    infeasible: InfeasibleBudgetError | None = None
    failure: SolverError | None = None
    try:
        grouped = _checked(graph, coarse, solve(target, budget_bytes, method=method, **options), method, budget_bytes)
    except InfeasibleBudgetError as exc:
        infeasible = exc
    except SolverError as exc:  # e.g. a time limit with no plan found on the grouped graph
        failure = exc
    best, smallest = _best_full_graph_baseline(graph, folded, budget_bytes)
    if best is not None and (grouped is None or best.sim.total_cost < grouped.sim.total_cost - 1e-9 * max(1.0, best.sim.total_cost)):
        if grouped is None:
            why = f"no plan of the graph grouped to {target.n} nodes was found ({infeasible or failure})"
            status = SolveStatus.FEASIBLE
        else:
            why = (f"{method} on the graph grouped to {target.n} nodes costs {grouped.overhead:.4f}x "
                   f"({grouped.result.status.value})")
            status = grouped.result.status if grouped.result.status is SolveStatus.TIME_LIMIT else SolveStatus.FEASIBLE
        note = f"{best.result.method} on the full graph is cheaper at {best.overhead:.4f}x: {why}"
        log.info("%s: %s", graph.name, note)
        # the grouped bound does not bound the full graph; computing every node once does
        gap = relative_gap(best.sim.total_cost, graph.total_cost)
        if gap is not None and gap <= 1e-9:
            status = SolveStatus.OPTIMAL
        result = dataclasses.replace(best.result, method=method, status=status, lower_bound=graph.total_cost,
                                     gap=gap, solve_s=time.perf_counter() - started)
        return dataclasses.replace(best, result=result, note=note)
    if grouped is None:
        if infeasible is None:
            assert failure is not None
            raise failure
        if smallest is not None and (infeasible.min_budget_bytes is None or smallest < infeasible.min_budget_bytes):
            raise InfeasibleBudgetError(budget_bytes=budget_bytes, min_budget_bytes=smallest, method=method, graph_name=graph.name,
                                        detail="the smallest budget of the baselines on the full graph") from infeasible
        raise infeasible
    note = f"solved on the graph grouped from {coarse.fine.n} to {target.n} nodes; no baseline on the full graph is cheaper"
    result = dataclasses.replace(grouped.result, solve_s=time.perf_counter() - started)
    return dataclasses.replace(grouped, result=result, note=note)


def _best_full_graph_baseline(graph: Graph, folded: Coarsening, budget_bytes: int
                              ) -> tuple[GraphPlan | None, int | None]:
    """The cheapest baseline plan of the alias-folded graph ``folded`` that fits (checked on
    ``graph``), and the smallest budget a baseline said it needs when it does not fit."""
    from remat.solvers.milp_start import BASELINE_METHODS

    best: GraphPlan | None = None
    smallest: int | None = None
    for name in BASELINE_METHODS:
        try:
            candidate = _checked(graph, folded, solve(folded.coarse, budget_bytes, method=name), name, budget_bytes)
        except InfeasibleBudgetError as exc:
            if exc.min_budget_bytes is not None:
                smallest = exc.min_budget_bytes if smallest is None else min(smallest, exc.min_budget_bytes)
            continue
        except (UnsupportedGraphError, SolverError) as exc:
            log.debug("baseline %s on %s: %s", name, graph.name, exc)
            continue
        if best is None or candidate.sim.total_cost < best.sim.total_cost:
            best = candidate
    return best, smallest


def _checked(graph: Graph, coarse: Coarsening | None, result: SolveResult, method: str, budget_bytes: int) -> GraphPlan:
    plan = coarse.expand(result.plan) if coarse is not None else result.plan
    sim = simulate(graph, plan)
    if not sim.ok or sim.peak_bytes > budget_bytes or abs(sim.total_cost - result.cost) > 1e-6 * max(1.0, result.cost):
        raise SolverError(
            f"the plan of method {method!r} does not carry over to graph {graph.name!r} (peak "
            f"{sim.peak_bytes} B, cost {sim.total_cost} vs {result.cost}, "
            f"{len(sim.violations)} violations); please report this"
        )
    return GraphPlan(graph=graph, result=result, coarsening=coarse, plan=plan, sim=sim)
