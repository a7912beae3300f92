"""From a graph and a budget to a checked plan for that graph.

``plan_graph`` reduces the graph, solves the smaller problem with the chosen method, expands
the plan back and replays it in the simulator on the original graph. This is the path
``optimize``, the benchmarks and the compiler backend use.

Folding zero-byte aliases (``remat.coarsen.fold_aliases``) is exact and always on: every
method then plans the whole folded graph, the MILP included (its retention model and lower
bound scale to thousands of nodes). Grouping runs of operations into one node
(``max_nodes=...``) is still available but not exact: a grouped graph has fewer plans, so the
baselines also run on the full graph and the cheapest plan wins, and the reported lower
bound is always the full graph's (``remat.solvers.bounds``), never the grouped problem's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from remat.coarsen import Coarsening, fold_aliases, group_folded
from remat.collector import older_objects_frozen
from remat.errors import InfeasibleBudgetError, MethodError, RematError, SolverError, UnsupportedGraphError
from remat.graph import Graph
from remat.schedule import Plan
from remat.simulate import SimResult, simulate
from remat.solvers import SolveResult, solve
from remat.solvers.base import SolveStatus, relative_gap

log = logging.getLogger("remat.solve")


@dataclass(frozen=True)
class GraphPlan:
    """A plan for ``graph``: the solver's result (on the reduced graph when reduced), the
    expanded plan and its simulation on ``graph`` itself.

    ``result.lower_bound`` and ``result.gap`` hold for ``graph`` itself (for a grouped solve
    too); ``note`` explains any substitution.
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
    def lower_bound(self) -> float | None:
        """The least any plan of ``graph`` can cost under the budget, in its cost unit: the
        solver's bound, between computing every node once and this plan's own cost (None when
        the method proves none)."""
        bound = self.result.lower_bound
        if bound is None or not math.isfinite(bound):
            return None
        return min(max(float(bound), self.graph.total_cost), self.sim.total_cost)

    @property
    def solved_nodes(self) -> int:
        """How many nodes the solver's graph had."""
        return self.result.graph.n

    @property
    def exact(self) -> bool:
        """True unless the solver saw a grouped graph (then its optimum is the grouped one's)."""
        return self.coarsening is None or self.coarsening.exact


def plan_graph(graph: Graph, budget_bytes: int, method: str = "milp", *, reduce: bool = True,
               max_nodes: int | None = None, **options: object) -> GraphPlan:
    """Solve ``graph`` under ``budget_bytes`` with ``method`` and check the plan.

    ``reduce`` folds zero-byte aliases first (exact). ``max_nodes`` groups the folded graph
    down to at most that many nodes before solving (not exact; None, the default: never).
    Raises ``InfeasibleBudgetError`` as ``solve`` does, with the smallest budget any tried
    plan needs.

    >>> from remat.builders import chain_graph
    >>> p = plan_graph(chain_graph(6), 2**40, method="checkpoint_all")
    >>> p.sim.peak_bytes <= 2**40, p.overhead
    (True, 1.0)
    """
    if max_nodes is not None and (not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1):
        raise MethodError(f"max_nodes={max_nodes!r} must be a positive int, or None (no grouping)")
    with older_objects_frozen():  # (folding and checking the plan make garbage too)
        return _plan_graph(graph, budget_bytes, method, reduce, max_nodes, options)


#: Methods that hand back a baseline's plan where theirs is costlier or none fits (their
#: ``stats.plan_from`` names it, and the result's note says so); milp weighs baselines as plans of
#: its own and is not noted.
FALLS_BACK = ("lp_round",)
#: The options ``plan_graph`` takes for every method, besides each method's own.
PLAN_OPTIONS = ("reduce", "max_nodes")


def check_method(method: str, options: Mapping[str, object]) -> None:
    """Refuse, before any work, an unknown ``method`` or an option it does not take or a value it
    cannot use (``threads=0``, an uninstalled MILP backend): the method plans a two-node graph
    with ``options``, as ``plan_graph`` would call it (the methods check their options' values
    when they run). Raises ``MethodError``; the tiny graph's own outcome is ignored."""
    from remat.builders import chain_graph

    backend = options.get("backend")
    if isinstance(backend, str):  # (a missing package is the solver's error when it runs)
        from remat.solvers.milp_backends import MilpBackend, backend_available

        try:
            backend_available(MilpBackend.parse(backend))
        except (SolverError, ValueError) as exc:
            raise MethodError(f"method {method!r}: {exc}") from None
    try:  # (solve refuses an unknown method with the same error)
        plan_graph(chain_graph(2, bytes_per_node=1), 10**6, method, **options)
    except MethodError as exc:
        text = str(exc)
        if "its options are:" in text:
            text += f"; and every method's: {', '.join(PLAN_OPTIONS)}"
        raise MethodError(text) from None
    except RematError:
        pass  # (about the tiny graph it was tried on, not about the options)
    except (ValueError, TypeError) as exc:  # (a value out of range, checked when the method runs)
        raise MethodError(f"method {method!r}: {exc}") from None


def _plan_graph(graph: Graph, budget_bytes: int, method: str, reduce: bool, max_nodes: int | None,
                options: dict[str, object]) -> GraphPlan:
    started = time.perf_counter()
    folded = fold_aliases(graph) if reduce else None
    coarse = folded if folded is None or max_nodes is None else group_folded(folded, max_nodes)
    target = coarse.coarse if coarse is not None else graph
    if coarse is None or coarse.exact:
        result = _solved(graph, coarse, budget_bytes, method, options)
        checked = _checked(graph, coarse, result, method, budget_bytes)
        source = result.stats.plan_from
        if method in FALLS_BACK and source not in (None, method):  # (lp_round: no rounding fit, or was cheaper)
            note = f"{method} returned baseline {source}'s plan, cheaper than its own (or the only one that fits)"
            return dataclasses.replace(checked, note=note)
        return checked
    grouped: GraphPlan | None = None
    infeasible: InfeasibleBudgetError | None = None
    failure: SolverError | None = None
    try:
        grouped = _checked(graph, coarse, _solved(graph, coarse, budget_bytes, method, options), method, budget_bytes)
    except InfeasibleBudgetError as exc:
        infeasible = exc
    except SolverError as exc:  # e.g. a time limit with no plan found on the grouped graph
        failure = exc
    best, smallest = _best_full_graph_baseline(graph, folded, budget_bytes)
    # a grouped solve's bound is the grouped problem's: report the full graph's instead
    bound = _full_graph_bound(folded.coarse, budget_bytes)
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
        chosen = best
    elif grouped is not None:
        note = f"solved on the graph grouped from {coarse.fine.n} to {target.n} nodes; no baseline on the full graph is cheaper"
        status = grouped.result.status if grouped.result.status is SolveStatus.TIME_LIMIT else SolveStatus.FEASIBLE
        chosen = grouped
    else:
        if infeasible is None:
            assert failure is not None
            raise failure
        if smallest is not None and (infeasible.min_budget_bytes is None or smallest < infeasible.min_budget_bytes):
            raise InfeasibleBudgetError(budget_bytes=budget_bytes, min_budget_bytes=smallest, method=method, graph_name=graph.name,
                                        detail="the smallest budget of the baselines on the full graph") from infeasible
        raise infeasible
    lower = min(bound, chosen.sim.total_cost)
    gap = relative_gap(chosen.sim.total_cost, lower)
    if gap is not None and gap <= 1e-9:
        status = SolveStatus.OPTIMAL
    result = dataclasses.replace(chosen.result, method=method, status=status, lower_bound=lower, gap=gap,
                                 solve_s=time.perf_counter() - started)
    return dataclasses.replace(chosen, result=result, note=note)


def _solved(graph: Graph, coarse: Coarsening | None, budget_bytes: int, method: str,
            options: dict[str, object]) -> SolveResult:
    """``solve`` on the graph ``coarse`` reduces ``graph`` to. A method's ``UnsupportedGraphError``
    counts and numbers that graph's nodes, not ``graph``'s (which ``step.report`` counts): it
    says which graph it counted."""
    target = coarse.coarse if coarse is not None else graph
    try:
        return solve(target, budget_bytes, method=method, **options)
    except UnsupportedGraphError as exc:
        if target.n == graph.n:
            raise
        how = ("after folding zero-byte views into the values they alias" if coarse.exact
               else "after grouping neighbouring ops (max_nodes)")
        raise UnsupportedGraphError(f"{exc} (nodes counted {how}: {target.n}, of the graph's {graph.n})") from None


def _full_graph_bound(graph: Graph, budget_bytes: int) -> float:
    """The instant bound of the (folded) full graph, in its cost unit."""
    from remat.solvers.prepared import prepared

    return prepared(graph).bounds.cost_bound(budget_bytes).value


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
