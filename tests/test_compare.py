"""compare_methods records every outcome instead of stopping at the first failure."""

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
    assert status[("griewank", True)].status == "not applicable"
    assert status[("recompute_all", True)].status == "no plan"
    assert status[("recompute_all", True)].note == "solver gave up"
    assert c.to_json()["runs"][0]["peak_error"] == 0.0
