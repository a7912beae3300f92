"""A saved plan's report is rebuilt from the plan: the simulator is the truth, not the file."""

from __future__ import annotations

import copy
import json

import pytest

from remat.cost import CostModel
from remat.optimize import PlanFileError, TrainingStep, optimize
from torch_helpers import workload


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    w = workload("cnn", 4)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, "95%", method="chen_greedy", cost_model=CostModel.ESTIMATE)
    path = tmp_path_factory.mktemp("plans") / "cnn.json"
    step.save(path)
    return w, step, path


def _load(w, path):
    return TrainingStep.load(path, copy.deepcopy(w.model), w.batch, w.loss_fn)


def test_the_file_carries_what_was_measured_and_the_report_comes_back_equal(saved):
    w, step, path = saved
    record = json.loads(path.read_text())
    assert record["temp_bytes"] == [n.temp_bytes for n in step.traced.graph.nodes]
    assert any(record["temp_bytes"])  # convolutions and batch norm need scratch
    assert record["node_costs"] == [n.cost for n in step.traced.graph.nodes]
    loaded = _load(w, path)
    assert loaded.report == step.report
    assert loaded.traced.graph.fingerprint() == step.traced.graph.fingerprint()


def test_measured_scratch_reloads_onto_a_trace_that_only_estimates_it(tmp_path):
    w = workload("gpt2-tiny", 2)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, "100%", method="chen_greedy", cost_model=CostModel.PROFILE)
    assert any(n.temp_bytes for n in step.traced.graph.nodes)  # measured (dropout's random draws, ...)
    step.save(tmp_path / "gpt2.json")
    loaded = _load(w, tmp_path / "gpt2.json")
    assert loaded.report == step.report


@pytest.mark.parametrize(
    "field,value",
    [
        ("overhead", 0.5),
        ("recomputed_nodes", 0),
        ("cost_us", 1.0),
        ("checkpoint_all_peak_bytes", 1),
        ("n_nodes", 3),
        ("fixed_bytes", 0),
    ],
)
def test_a_tampered_report_field_is_refused_naming_it(saved, tmp_path, field, value):
    """load showed tampered report fields as they were written."""
    w, step, path = saved
    record = json.loads(path.read_text())
    record["report"][field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(record))
    unit = " B" if field.endswith("_bytes") else ""
    with pytest.raises(PlanFileError, match=f"{field}: the file promises {value!r}{unit}, the plan simulates to"):
        _load(w, bad)


def test_tampered_measurements_contradict_the_report(saved, tmp_path):
    w, step, path = saved
    record = json.loads(path.read_text())
    record["node_costs"] = [c * 2 for c in record["node_costs"]]
    (tmp_path / "costs.json").write_text(json.dumps(record))
    with pytest.raises(PlanFileError, match="cost_us: the file promises"):
        _load(w, tmp_path / "costs.json")
    record = json.loads(path.read_text())
    record["temp_bytes"] = record["temp_bytes"][:-1]
    (tmp_path / "short.json").write_text(json.dumps(record))
    with pytest.raises(PlanFileError, match="temp_bytes must list one value per node"):
        _load(w, tmp_path / "short.json")
    record["temp_bytes"] = [-1] * step.traced.graph.n
    (tmp_path / "negative.json").write_text(json.dumps(record))
    with pytest.raises(PlanFileError, match="temp_bytes\\[0\\] = -1 is not a non-negative number"):
        _load(w, tmp_path / "negative.json")


def test_how_the_plan_was_found_is_taken_from_the_file_but_checked(saved, tmp_path):
    w, step, path = saved
    record = json.loads(path.read_text())
    record["report"]["status"] = "splendid"
    (tmp_path / "status.json").write_text(json.dumps(record))
    with pytest.raises(PlanFileError, match="unreadable report"):
        _load(w, tmp_path / "status.json")


def test_the_report_states_the_lower_bound_and_a_saved_one_is_checked(tmp_path):
    w = workload("cnn", 4)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, "90%", method="milp", cost_model=CostModel.ESTIMATE,
                    time_limit_s=20)
    report = step.report
    assert report.lower_bound_us is not None and report.lower_bound_us <= report.cost_us
    assert report.gap == pytest.approx((report.cost_us - report.lower_bound_us) / report.cost_us)
    bound = report.lower_bound_us / report.checkpoint_all_cost_us
    assert f"no plan costs less than {bound:.3f}x (gap {report.gap:.1%})" in str(report)
    step.save(tmp_path / "plan.json")
    assert _load(w, tmp_path / "plan.json").report == report
    record = json.loads((tmp_path / "plan.json").read_text())
    for value, match in ((report.cost_us * 1.01, "its lower bound .* is above the cost its plan simulates to"),
                         ("low", "unreadable report .*lower_bound_us 'low' is not a cost"),
                         (-1.0, "unreadable report .*lower_bound_us -1.0 is not a cost")):
        record["report"]["lower_bound_us"] = value
        (tmp_path / "bad.json").write_text(json.dumps(record))
        with pytest.raises(PlanFileError, match=match):
            _load(w, tmp_path / "bad.json")
    del record["report"]["lower_bound_us"]  # a file saved before reports had the bound
    (tmp_path / "older.json").write_text(json.dumps(record))
    older = _load(w, tmp_path / "older.json").report
    assert older.lower_bound_us is None and older.gap is None and "no plan costs less" not in str(older)


def test_a_method_without_a_bound_reports_none(saved):
    w, step, path = saved  # chen_greedy proves nothing about other plans
    assert step.report.lower_bound_us is None and step.report.gap is None
    assert "no plan costs less" not in str(step.report)


@pytest.mark.parametrize("budget, message", [
    ("80%", r"budget_bytes='80%' is not a number of bytes"),
    (0.8, r"budget_bytes=0.8 is not a number of bytes"),
    (116896.9, r"is a float"),
    ("abc", r"budget 'abc' is not understood"),
    (-1, r"budget_bytes=-1 is not a number of bytes; give the budget the plan was saved with"),
])
def test_a_budget_to_load_by_must_be_a_number_of_bytes(saved, budget, message):
    """``load(budget_bytes=...)`` truncated what it was given: 0.8 became 0 B, and 116896.9
    matched a plan saved for 116896 B; a percentage raised int()'s ValueError."""
    from remat.units import BudgetError

    w, step, path = saved
    with pytest.raises(BudgetError, match=message):
        TrainingStep.load(path, copy.deepcopy(w.model), w.batch, w.loss_fn, budget_bytes=budget)
    exact = step.report.budget_bytes
    assert TrainingStep.load(path, copy.deepcopy(w.model), w.batch, w.loss_fn, budget_bytes=exact).report == step.report


def test_edited_scratch_is_refused_as_corrupt_not_as_another_steps_plan(saved, tmp_path):
    """The fingerprint covers the measured scratch: a file whose temp_bytes were edited was
    refused as made for another training step. The structure fingerprint, saved beside it,
    tells the two apart; a file saved before it (no field) still loads."""
    from remat.optimize import StalePlanError

    w, step, path = saved
    record = json.loads(path.read_text())
    assert isinstance(record["structure_fingerprint"], str)
    k = next(i for i, t in enumerate(record["temp_bytes"]) if t)
    edited = dict(record, temp_bytes=[t + 64 if i == k else t for i, t in enumerate(record["temp_bytes"])])
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(PlanFileError, match=r"made for this training step, but its measured scratch \(temp_bytes\)") as info:
        _load(w, tmp_path / "edited.json")
    assert not isinstance(info.value, StalePlanError)
    older = {key: value for key, value in record.items() if key != "structure_fingerprint"}
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert _load(w, tmp_path / "older.json").report == step.report
    (tmp_path / "older-edited.json").write_text(json.dumps(dict(edited, structure_fingerprint=None)))
    with pytest.raises(StalePlanError, match="was made for a different training step"):
        _load(w, tmp_path / "older-edited.json")
    (tmp_path / "typed.json").write_text(json.dumps(dict(record, structure_fingerprint=7)))
    with pytest.raises(PlanFileError, match="field 'structure_fingerprint' is not a str"):
        _load(w, tmp_path / "typed.json")


def test_a_plan_that_cannot_be_written_is_a_plan_file_error(saved):
    """/proc takes no new files: the error was a FileNotFoundError naming the temporary file."""
    _w, step, _path = saved
    with pytest.raises(PlanFileError, match=r"cannot save the plan to '/proc/plan.json': .* in folder '/proc'; save "
                                             r"it in a folder you can write to"):
        step.save("/proc/plan.json")
