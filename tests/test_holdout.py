"""The holdout workloads build, and the holdout benchmark's report states what it measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remat.models import get_workload
from remat.models.holdout import HOLDOUT
from scripts import load_script

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_module():
    return load_script("bench/holdout.py", "bench_holdout_test")


def test_the_benchmark_runs_every_holdout_workload():
    assert set(_bench_module().MODELS) == set(HOLDOUT) == {"llama", "bert", "t5", "vit", "convnext", "gru"}


@pytest.mark.parametrize("name", sorted(HOLDOUT))
def test_holdout_workloads_build_by_spec_and_give_a_scalar_loss(name):
    w = get_workload(f"remat.models.holdout:{name}", 2)
    assert w.name == name and w.model.training
    with torch.no_grad():
        loss = w.loss_fn(w.model, *w.batch)
    assert loss.ndim == 0 and torch.isfinite(loss)


def _run(budget_bytes: int, measured: int, **extra) -> dict:
    return {"budget": "50%", "budget_bytes": budget_bytes, "method": "milp", "plan_method": "segments",
            "status": "feasible", "predicted_peak_bytes": measured, "measured_peak_bytes": measured,
            "peak_error": 0.0, "within_budget": measured <= budget_bytes, "overhead": 1.2, "solve_s": 1.0,
            "equal_to_unplanned_step": True, "bitwise_equal_to_eager": True, "max_abs_diff_to_eager": 0.0, **extra}


def test_the_report_names_whose_plan_ran_and_flags_a_plan_over_its_budget():
    record = {"batch_size": 4, "n_nodes": 100, "checkpoint_all_peak_bytes": 2**21, "eager_peak_bytes": 2**21,
              "runs": [_run(2**20, 2**20 - 1),
                       _run(2**20, 2**20 + 1, bitwise_equal_to_eager=False, max_abs_diff_to_eager=5e-9),
                       {"budget": "50%", "budget_bytes": 10, "method": "chen_greedy", "status": "infeasible",
                        "min_budget_bytes": 2**20}],
              "backend_100": {"measured_peak_bytes": 2**20, "planned_graphs": 1, "warnings": []}}
    table = _bench_module().markdown({"meta": {"command": "python bench/holdout.py"}, "models": {"toy": record}})
    assert "| milp: segments's plan |" in table
    assert "| NO |" in table and "measured above the budget in 1" in table
    assert "max abs diff 5.0e-09" in table and "infeasible: needs 1.00 MiB" in table
    assert "| toy | 2.00 | 1.00 | 1 | - |" in table
