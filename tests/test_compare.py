"""compare_methods records every outcome instead of stopping at the first failure."""

import re

import pytest

from remat import compare as compare_mod
from remat.cost import CostModel
from remat.errors import SolverError
from remat.models import get_workload


@pytest.fixture(scope="module")
def workload():
    return get_workload("mlp", 64)


def test_outcomes_of_every_kind(workload, monkeypatch):
    real = compare_mod.plan_graph

    def flaky(graph, budget, method, **options):
        if method == "recompute_all":
            raise SolverError("solver gave up; raise time_limit_s")
        return real(graph, budget, method, **options)

    monkeypatch.setattr(compare_mod, "plan_graph", flaky)
    c = compare_mod.compare_methods(workload, ["100%", "1KiB"], ["checkpoint_all", "griewank", "recompute_all"],
                                    cost_model=CostModel.ESTIMATE)
    status = {(r.method, r.budget_bytes == c.checkpoint_all_peak_bytes): r for r in c.runs}
    assert status[("checkpoint_all", True)].bitwise_equal is True
    assert status[("checkpoint_all", True)].peak_error == 0.0
    assert status[("checkpoint_all", False)].status == "infeasible"
    assert "needs at least" in status[("checkpoint_all", False)].note
    least = re.search(r"\((\d+) B: a budget of exactly that plans\)", status[("checkpoint_all", False)].note)
    assert least is not None and int(least.group(1)) == c.checkpoint_all_peak_bytes  # exact, not rounded
    assert status[("griewank", True)].status == "not applicable"
    assert status[("recompute_all", True)].status == "no plan"
    assert status[("recompute_all", True)].note == "solver gave up"
    assert c.to_json()["runs"][0]["peak_error"] == 0.0


def test_the_label_says_whose_plan_ran(workload, monkeypatch):
    """lp_round's row read "lp_round optimal" while plan_graph had handed back a full-graph
    baseline's plan."""
    import dataclasses

    real = compare_mod.plan_graph

    def substituted(graph, budget, method, **options):
        planned = real(graph, budget, "segments")
        result = dataclasses.replace(planned.result, method=method)
        note = f"segments on the full graph is cheaper at {planned.overhead:.4f}x: {method} on the grouped graph costs more"
        return dataclasses.replace(planned, result=result, note=note)

    monkeypatch.setattr(compare_mod, "plan_graph", substituted)
    c = compare_mod.compare_methods(workload, ["100%"], ["lp_round"], cost_model=CostModel.ESTIMATE)
    (run,) = c.runs
    assert run.method == "lp_round" and run.plan_method == "segments"
    assert run.label == "lp_round: segments's plan"
    assert c.to_json()["runs"][0]["label"] == "lp_round: segments's plan"
    monkeypatch.setattr(compare_mod, "plan_graph", real)
    (own,) = compare_mod.compare_methods(workload, ["100%"], ["chen_greedy"], cost_model=CostModel.ESTIMATE).runs
    assert own.label == "chen_greedy" and own.plan_method == "chen_greedy"


def test_the_demo_table_labels_rows_by_what_ran():
    from scripts import load_script

    demo = load_script("bench/demo_gpt2.py", "bench_demo_gpt2_test")
    run = {"method": "lp_round", "budget_bytes": 2**20, "status": "optimal", "predicted_peak_bytes": 2**20,
           "measured_peak_bytes": 2**20, "overhead": 1.0, "solve_s": 1.0, "gap": 0.0, "bitwise_equal": True,
           "peak_error": 0.0, "note": "checkpoint_all on the full graph is cheaper at 1.0000x: lp_round on the graph ..."}
    results = {"command": "python bench/demo_gpt2.py", "machine": "test",
               "comparison": {"n_nodes": 10, "n_nodes_reduced": 8, "batch_size": 2, "eager_peak_bytes": 2**20,
                              "checkpoint_all_peak_bytes": 2**20, "fixed_bytes": 0, "runs": [run]}}
    table = demo.markdown(results)
    assert "| lp_round: checkpoint_all's plan | optimal |" in table
    assert "| lp_round | optimal |" not in table
