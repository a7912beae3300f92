"""Shared helpers for the torch-facing tests: traced workloads (cached per session), eager
references, plan runners and plan generators. Kept small so the whole torch test set runs in
well under four minutes on two cores."""

from __future__ import annotations

import functools

import numpy as np
import torch

import remat
from remat.cost import CostModel
from remat.errors import InfeasibleBudgetError, UnsupportedGraphError
from remat.execute import PlannedStep, build_module
from remat import verify
from remat.memory import MemoryReport
from remat.verify import StepState
from remat.models import Workload, get_workload
from remat.schedule import Plan, Schedule
from remat.scratch import ScratchModel
from remat.trace import TracedStep, trace

# One intra-op thread: these tests compare values and bytes, not speed, and on a shared
# two-core machine OpenMP threads waiting for a busy core made single steps 100x slower.
torch.set_num_threads(1)

#: (workload name, batch size): small, but large enough that activations matter.
WORKLOADS = (("mlp", 256), ("cnn", 4), ("gpt2-tiny", 2))
BASELINES = ("checkpoint_all", "recompute_all", "chen_sqrtn", "chen_greedy", "segments", "griewank", "nested", "chain", "descent")
#: Measured peak must be this close to the simulated one (relative).
PEAK_RTOL = 0.02

#: worst relative |measured - simulated| peak seen in this session, by test label
WORST_PEAK_DIFF: dict[str, float] = {}


@functools.lru_cache(maxsize=None)
def workload(name: str, batch_size: int) -> Workload:
    return get_workload(name, batch_size, seed=0)


@functools.lru_cache(maxsize=None)
def traced(name: str, batch_size: int) -> TracedStep:
    """Deterministic costs (FLOP estimate) and measured kernel scratch, so that the profiler's
    measured peak of an executed plan can be compared with the simulated one."""
    w = workload(name, batch_size)
    return trace(w.model, w.batch, w.loss_fn, cost_model=CostModel.ESTIMATE, scratch=ScratchModel.MEASURE)


def eager_step(w: Workload, seed: int = 0) -> StepState:
    return verify.eager_step(w.model, w.batch, w.loss_fn, seed=seed)[0]


def planned_step(w: Workload, t: TracedStep, step: PlannedStep, seed: int = 0) -> tuple[StepState, MemoryReport]:
    """Run ``step`` once, measured by torch.profiler's allocation events, on a fresh copy of
    the model."""
    return verify.planned_step(w.model, w.batch, t, step, seed=seed)


def assert_same_step(got: StepState, want: StepState, label: str) -> None:
    assert torch.equal(got.loss, want.loss), f"{label}: loss {got.loss} != eager {want.loss}"
    assert got.grads.keys() == want.grads.keys()
    for k, g in want.grads.items():
        if g is None:
            assert got.grads[k] is None, f"{label}: {k} has a gradient but eager has none"
        else:
            assert got.grads[k] is not None and torch.equal(got.grads[k], g), f"{label}: gradient of {k} differs"
    for k, b in want.buffers.items():
        assert torch.equal(got.buffers[k], b), f"{label}: buffer {k} differs"
    assert torch.equal(got.rng_state, want.rng_state), f"{label}: random generator ends in another state"


def assert_peak_matches(step: PlannedStep, report: MemoryReport, label: str) -> None:
    simulated = step.sim.peak_bytes
    diff = abs(report.peak_bytes - simulated) / simulated
    WORST_PEAK_DIFF[label] = diff
    assert diff <= PEAK_RTOL, (
        f"{label}: measured peak {report.peak_bytes} B vs simulated {simulated} B ({diff:.2%})"
    )


def random_plans(t: TracedStep, count: int, seed: int) -> list[tuple[str, Plan]]:
    """Recomputing plans from random keep matrices (keep probability drawn per plan)."""
    g = t.graph
    rng = np.random.default_rng(seed)
    plans = []
    for k in range(count):
        p = float(rng.uniform(0.05, 0.9))
        plans.append((f"random{k}(p={p:.2f})", Schedule.from_kept(g, rng.random((g.n, g.n)) < p).lower(g)))
    return plans


def baseline_plans(t: TracedStep, budgets_per_method: int = 3) -> list[tuple[str, Plan]]:
    """Every baseline that applies to the graph at budgets from its least feasible one up to
    checkpoint-all's peak."""
    g = t.graph
    top = remat.solve(g, 10**15, method="checkpoint_all").peak_bytes
    plans = []
    for method in BASELINES:
        try:
            remat.solve(g, 1, method=method)
            low = 1
        except InfeasibleBudgetError as exc:
            low = exc.min_budget_bytes
        except UnsupportedGraphError:
            continue  # griewank plans linear chains only
        if low is None:
            continue
        budgets = sorted({int(low + (max(top, low) - low) * f) for f in np.linspace(0, 1, budgets_per_method)})
        for budget in budgets:
            result = remat.solve(g, budget, method=method)
            plans.append((f"{method}@{budget}", result.plan))
    return plans


def compiled(t: TracedStep, plan: Plan) -> PlannedStep:
    return build_module(t, plan)
