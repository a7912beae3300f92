"""Every method on one real model: plan, run, measure, and check against plain PyTorch.

This is what ``remat demo`` and ``remat solve --model ... --run`` show: for each method and
budget, the predicted peak (simulator), the measured peak of a real step, the compute
overhead, and whether loss and gradients are bitwise those of eager PyTorch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from remat.coarsen import coarsen
from remat.cost import CostModel
from remat.errors import InfeasibleBudgetError, SolverError, UnsupportedGraphError
from remat.execute import build_module
from remat.models import Workload
from remat.planning import GraphPlan, plan_graph
from remat.schedule import Schedule
from remat.simulate import simulate
from remat.trace import TracedStep, trace
from remat.units import format_bytes, parse_budget
from remat.verify import compare, eager_step, planned_step

log = logging.getLogger("remat.compare")

#: How ``plan_graph``'s note says a full-graph baseline's plan replaced the method's own.
_SUBSTITUTED = re.compile(r"(\w+) on the full graph is cheaper")


@dataclass(frozen=True)
class MethodRun:
    """One method at one budget. ``status`` is the solver's status, or ``infeasible`` /
    ``not applicable`` when the method has no plan (``note`` says why). ``plan_method`` is the
    method whose plan ran: ``plan_graph`` hands back a baseline's plan on the full graph when
    it is cheaper than what ``method`` found on the grouped graph (``label`` shows both)."""

    method: str
    budget_bytes: int
    status: str
    plan_method: str | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    overhead: float | None = None
    solve_s: float | None = None
    gap: float | None = None
    bitwise_equal: bool | None = None
    max_abs_diff: float | None = None
    note: str = ""
    #: where ``status`` is ``infeasible``: the smallest budget the method plans (None: none)
    min_budget_bytes: int | None = None

    @property
    def label(self) -> str:
        """``"lp_round"``, or ``"lp_round: segments' plan"`` when another method's plan ran."""
        if self.plan_method is None or self.plan_method == self.method:
            return self.method
        return f"{self.method}: {self.plan_method}'s plan"

    @property
    def peak_error(self) -> float | None:
        """Relative difference of measured and predicted peak."""
        if self.measured_peak_bytes is None or not self.predicted_peak_bytes:
            return None
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes


@dataclass(frozen=True)
class Comparison:
    workload: str
    batch_size: int
    n_nodes: int
    n_nodes_reduced: int
    fixed_bytes: int
    checkpoint_all_peak_bytes: int
    checkpoint_all_cost_us: float
    eager_peak_bytes: int
    runs: tuple[MethodRun, ...]

    def to_json(self) -> dict[str, object]:
        record = asdict(self)
        record["runs"] = [{**asdict(r), "label": r.label, "peak_error": r.peak_error} for r in self.runs]
        return record


def compare_methods(
    workload: Workload,
    budgets: Sequence[int | str],
    methods: Sequence[str],
    *,
    cost_model: CostModel = CostModel.PROFILE,
    options: dict[str, dict[str, object]] | None = None,
    run: bool = True,
    on_run: Callable[[MethodRun], None] | None = None,
    traced: TracedStep | None = None,
) -> Comparison:
    """Trace ``workload`` once, then plan it with every method at every budget; with ``run``,
    execute each plan once and compare it with an eager step.

    Budgets are bytes or strings (``"60%"`` of the checkpoint-all peak, ``"64MiB"``).
    """
    traced = traced or trace(workload.model, workload.batch, workload.loss_fn, cost_model=cost_model)
    graph = traced.graph
    reference = simulate(graph, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)).lower(graph))
    want, eager_memory = eager_step(workload.model, workload.batch, workload.loss_fn)
    runs: list[MethodRun] = []
    for budget_text in budgets:
        budget = parse_budget(budget_text, reference.peak_bytes)
        for method in methods:
            outcome = _one(workload, traced, budget, method, (options or {}).get(method, {}), run, want)
            runs.append(outcome)
            if on_run is not None:
                on_run(outcome)
    return Comparison(
        workload=workload.name,
        batch_size=int(workload.batch[0].shape[0]) if workload.batch and workload.batch[0].dim() else 1,
        n_nodes=graph.n,
        n_nodes_reduced=coarsen(graph).coarse.n,
        fixed_bytes=graph.fixed_bytes,
        checkpoint_all_peak_bytes=reference.peak_bytes,
        checkpoint_all_cost_us=graph.total_cost,
        eager_peak_bytes=eager_memory.peak_bytes,
        runs=tuple(runs),
    )


def plan_source(planned_graph: GraphPlan, method: str) -> str:
    """The method whose plan ``planned_graph`` holds: ``method``, the full-graph baseline
    ``plan_graph`` substituted (its note starts with that baseline's name), or the baseline
    whose plan the solver itself found cheapest (``SolverStats.plan_from``)."""
    from remat.solvers.milp_start import BASELINE_METHODS

    match = _SUBSTITUTED.match(planned_graph.note or "")
    if match:
        return match.group(1)
    source = planned_graph.result.stats.plan_from
    return source if source in BASELINE_METHODS else method


def _one(workload: Workload, traced: TracedStep, budget: int, method: str, options: dict[str, object],
         run: bool, want) -> MethodRun:
    try:
        planned_graph = plan_graph(traced.graph, budget, method, **options)
    except InfeasibleBudgetError as exc:
        least = exc.min_budget_bytes
        note = "no budget works for this method" if least is None else \
            f"needs at least {format_bytes(least)} ({least} B: a budget of exactly that plans)"
        return MethodRun(method, budget, "infeasible", note=note, min_budget_bytes=least)
    except UnsupportedGraphError as exc:
        return MethodRun(method, budget, "not applicable", note=str(exc).split(";")[0])
    except SolverError as exc:  # e.g. a time limit with no plan found and no baseline that fits
        log.warning("%s @ %d B: %s", method, budget, exc)
        return MethodRun(method, budget, "no plan", note=str(exc).split(";")[0])
    result = planned_graph.result
    fields = dict(
        method=method, budget_bytes=budget, status=result.status.value, plan_method=plan_source(planned_graph, method),
        predicted_peak_bytes=planned_graph.sim.peak_bytes, overhead=planned_graph.overhead,
        solve_s=result.solve_s, gap=result.gap,
    )
    if not run:
        return MethodRun(**fields, note=planned_graph.note)
    step = build_module(traced, planned_graph.plan)
    got, memory = planned_step(workload.model, workload.batch, traced, step)
    agreement = compare(got, want)
    log.info("%s @ %d B: measured %d B, predicted %d B, bitwise %s", method, budget, memory.peak_bytes,
             planned_graph.sim.peak_bytes, agreement.bitwise)
    return MethodRun(**fields, measured_peak_bytes=memory.peak_bytes, bitwise_equal=agreement.bitwise,
                     max_abs_diff=agreement.max_abs_diff,
                     note="; ".join([*agreement.mismatches[:2], *([planned_graph.note] if planned_graph.note else [])]))
