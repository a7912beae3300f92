"""Baseline strategies (placeholder while the module is written)."""
from __future__ import annotations
import time
import numpy as np
from remat.graph import Graph
from remat.schedule import Schedule
from remat.solvers.base import SolveStatus, finish, fits_or_raise, register


@register("checkpoint_all")
def checkpoint_all(graph: Graph, budget_bytes: int) -> "SolveResult":
    started = time.perf_counter()
    sched = Schedule.from_compute(graph, np.eye(graph.n, dtype=bool))
    result = finish(graph, sched, budget_bytes=budget_bytes, method="checkpoint_all",
                    status=SolveStatus.FEASIBLE, started_s=started, check_budget=False)
    return fits_or_raise(graph, result, budget_bytes=budget_bytes, method="checkpoint_all",
                         min_budget_bytes=result.peak_bytes)
