"""What every solver returns, the method registry and ``solve()``.

A solver is a pure function ``(graph, budget_bytes, **options) -> SolveResult`` registered
under a method name. Solvers build their schedule and hand it to ``finish()``, which lowers
it, replays it in the simulator and refuses anything the simulator contradicts.
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from remat.collector import older_objects_frozen
from remat.errors import InfeasibleBudgetError, MethodError, SolverError
from remat.graph import Graph
from remat.units import MAX_BUDGET_BYTES
from remat.schedule import Plan, Schedule
from remat.simulate import SimResult, simulate

log = logging.getLogger("remat.solve")

#: Relative tolerance between a solver's claimed objective and the simulated cost.
OBJECTIVE_RTOL = 1e-6


class SolveStatus(enum.Enum):
    OPTIMAL = "optimal"  # proven optimal (within mip_gap for the MILP)
    FEASIBLE = "feasible"  # a valid plan under the budget, optimality not claimed
    INFEASIBLE = "infeasible"  # no plan under the budget (solvers raise instead of returning it)
    TIME_LIMIT = "time_limit"  # the time limit hit; the best plan found is returned
    ERROR = "error"


@dataclass(frozen=True)
class SolverStats:
    """Numbers a solver reports about its own work; None where it does not apply."""

    backend: str | None = None
    n_variables: int | None = None
    n_constraints: int | None = None
    nodes_explored: int | None = None
    iterations: int | None = None
    #: where the returned plan came from, for solvers that weigh several sources (``milp``: a
    #: baseline's name such as "segments", "retention" or "milp" for its exact model)
    plan_from: str | None = None


@dataclass(frozen=True)
class SolveResult:
    """A plan for one graph under one budget, checked by the simulator.

    ``objective`` equals ``sim.total_cost``; ``lower_bound`` is a proven bound on the best
    cost under the budget, when the method has one (``gap`` = relative distance to it).
    """

    graph: Graph
    method: str
    status: SolveStatus
    budget_bytes: int
    schedule: Schedule
    plan: Plan
    sim: SimResult
    objective: float
    lower_bound: float | None
    gap: float | None
    solve_s: float
    stats: SolverStats = SolverStats()

    @property
    def peak_bytes(self) -> int:
        return self.sim.peak_bytes

    @property
    def cost(self) -> float:
        return self.sim.total_cost

    @property
    def overhead(self) -> float:
        """Cost over the cost of computing every node once (checkpoint-all)."""
        base = self.graph.total_cost
        return self.cost / base if base > 0 else 1.0

    def summary(self) -> dict[str, object]:
        """A JSON-ready record (the CLI's ``--json`` and the benchmarks use it)."""
        return {
            "graph": self.graph.name,
            "n_nodes": self.graph.n,
            "method": self.method,
            "status": self.status.value,
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "fixed_bytes": self.graph.fixed_bytes,
            "cost": self.cost,
            "overhead": self.overhead,
            "objective": self.objective,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "solve_s": self.solve_s,
            "recomputed_nodes": int(sum(c > 1 for c in self.sim.compute_counts)),
            "backend": self.stats.backend,
        }


def row_activity(starts: np.ndarray, index: np.ndarray, value: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``A @ x`` for the sparse matrix ``A`` in CSR form (row ``i`` holds ``value[k] * x[index[k]]``
    for ``k`` in ``starts[i]:starts[i + 1]``); 0 for an empty row.

    >>> import numpy as np
    >>> row_activity(np.array([0, 2, 2, 3]), np.array([0, 1, 1]), np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0]))
    array([3., 0., 3.])
    """
    out = np.zeros(len(starts) - 1)
    filled = np.diff(starts) > 0
    if filled.any():  # (reduceat would give an empty row the next row's first term)
        out[filled] = np.add.reduceat(value * x[index], starts[:-1][filled])
    return out


def relative_gap(objective: float, bound: float | None) -> float | None:
    if bound is None or not math.isfinite(bound):
        return None
    return max(0.0, (objective - bound) / max(abs(objective), 1e-12))


def finish(
    graph: Graph,
    schedule: Schedule,
    *,
    budget_bytes: int,
    method: str,
    status: SolveStatus,
    started_s: float,
    claimed_objective: float | None = None,
    lower_bound: float | None = None,
    stats: SolverStats = SolverStats(),
    check_budget: bool = True,
) -> SolveResult:
    """Lower, simulate and package a solver's schedule; refuse one the simulator rejects.

    ``started_s`` is the ``time.perf_counter()`` reading taken when the solve began.
    """
    schedule.check_shape(graph)
    plan = schedule.lower(graph)
    sim = simulate(graph, plan)
    if not sim.ok:
        raise SolverError(
            f"method {method!r} produced an invalid plan for graph {graph.name!r} (a bug in the "
            f"method; please report it): {'; '.join(v.message for v in sim.violations[:3])}"
        )
    if claimed_objective is not None and not math.isclose(
        claimed_objective, sim.total_cost, rel_tol=OBJECTIVE_RTOL, abs_tol=1e-9
    ):
        raise SolverError(
            f"method {method!r} claims objective {claimed_objective!r} but the simulator counts "
            f"cost {sim.total_cost!r} for its plan on graph {graph.name!r}"
        )
    if check_budget and sim.peak_bytes > budget_bytes:
        raise SolverError(
            f"method {method!r} returned a plan with simulated peak {sim.peak_bytes} B over the "
            f"budget {budget_bytes} B on graph {graph.name!r}"
        )
    objective = sim.total_cost
    if lower_bound is not None and not lower_bound >= graph.total_cost:
        # every node runs at least once: a solver's weaker (or NaN) bound is replaced by that
        lower_bound = graph.total_cost
    return SolveResult(
        graph=graph,
        method=method,
        status=status,
        budget_bytes=int(budget_bytes),
        schedule=schedule,
        plan=plan,
        sim=sim,
        objective=objective,
        lower_bound=lower_bound,
        gap=relative_gap(objective, lower_bound),
        solve_s=time.perf_counter() - started_s,
        stats=stats,
    )


def fits_or_raise(graph: Graph, result: SolveResult | None, *, budget_bytes: int, method: str,
                  min_budget_bytes: int | None, detail: str = "") -> SolveResult:
    """Return ``result`` if it fits the budget, else raise ``InfeasibleBudgetError``."""
    if result is not None and result.peak_bytes <= budget_bytes:
        return result
    raise InfeasibleBudgetError(
        budget_bytes=budget_bytes,
        min_budget_bytes=min_budget_bytes,
        method=method,
        graph_name=graph.name,
        detail=detail,
    )


SolverFn = Callable[..., SolveResult]
_REGISTRY: dict[str, SolverFn] = {}


def register(name: str) -> Callable[[SolverFn], SolverFn]:
    """Register a solver under ``name`` (a decorator)."""

    def wrap(fn: SolverFn) -> SolverFn:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return wrap


def methods() -> tuple[str, ...]:
    """The names of every registered method."""
    _load_builtin()
    return tuple(sorted(_REGISTRY))


def solve(graph: Graph, budget_bytes: int, method: str = "milp", **options: object) -> SolveResult:
    """Find a plan for ``graph`` whose simulated peak is at most ``budget_bytes``.

    Raises ``InfeasibleBudgetError`` (with the smallest budget the method can meet) when no
    plan of the method fits.

    >>> from remat.builders import chain_graph
    >>> g = chain_graph(8, bytes_per_node=1)
    >>> r = solve(g, budget_bytes=7, method="chen_sqrtn")
    >>> r.peak_bytes <= 7, r.overhead > 1.0
    (True, True)
    """
    _load_builtin()
    if method not in _REGISTRY:
        raise MethodError(unknown_method(method))
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive int (bytes)")
    if budget_bytes > MAX_BUDGET_BYTES:
        raise ValueError(f"budget_bytes={budget_bytes!r} is more bytes than any memory holds (at most 2**60, 1 EiB); "
                         f"to plan without recomputing anything, give the checkpoint-all peak")
    fn = _REGISTRY[method]
    _check_options(method, fn, options)
    log.debug("solving %s (%d nodes) with %s under %d B", graph.name, graph.n, method, budget_bytes)
    with older_objects_frozen():
        return fn(graph, budget_bytes, **options)


def _check_options(method: str, fn: SolverFn, options: dict[str, object]) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
                or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name not in ("graph", "budget_bytes"))]
    for name, value in options.items():
        if name not in accepted:
            listed = ", ".join(accepted) if accepted else "none"
            raise MethodError(f"method {method!r} has no option {name!r}; its options are: {listed}")
        default = params[name].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise MethodError(f"option {name}={value!r} of method {method!r} must be True or False")
        if (isinstance(default, (int, float)) and not isinstance(default, bool)
                and (isinstance(value, bool) or not isinstance(value, numbers.Real))):
            raise MethodError(f"option {name}={value!r} of method {method!r} must be a number (default {default!r})")


#: Other names users know the methods by (papers', other libraries').
_KNOWN_AS = {"revolve": "griewank", "treeverse": "griewank", "checkmate": "milp", "ilp": "milp", "mip": "milp",
             "lp": "lp_round", "rotor": "chain", "rockmate": "chain", "chen": "chen_sqrtn' or 'chen_greedy",
             "sqrt": "chen_sqrtn", "none": "checkpoint_all", "all": "recompute_all"}


def unknown_method(method: object) -> str:
    """The message for a method name that is not registered: the methods, and the one meant
    where the name is another name of it or a near miss."""
    import difflib

    _load_builtin()
    known = sorted(_REGISTRY)
    name = str(method).strip().lower()
    meant = _KNOWN_AS.get(name) or next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.75)), None)
    hint = f" (did you mean '{meant}'?)" if meant else ""
    return f"unknown method {method!r}{hint}; choose one of: {', '.join(known)}"


def _load_builtin() -> None:
    # Importing the solver modules registers them; done lazily to keep import cheap.
    import remat.solvers.baselines  # noqa: F401
    import remat.solvers.chain  # noqa: F401
    import remat.solvers.repair  # noqa: F401
    import remat.solvers.segments  # noqa: F401

    try:
        import remat.solvers.milp  # noqa: F401
    except ModuleNotFoundError as exc:  # pragma: no cover - only while the module is absent
        if exc.name != "remat.solvers.milp":
            raise
