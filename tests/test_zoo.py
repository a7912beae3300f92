"""The model zoo benchmark: its architectures build, a few of them plan and run bitwise equal to
eager PyTorch (float32 and bfloat16 autocast), LayerDrop is refused with its remedy, and the
report states what it measured."""

from __future__ import annotations

import math

import pytest
import torch

from scripts import load_script

pytest.importorskip("transformers")


def _zoo():
    return load_script("bench/zoo.py", "bench_zoo_test")


@pytest.mark.parametrize("name", sorted(load_script("bench/zoo.py", "bench_zoo_test").ARCHITECTURES))
def test_every_architecture_builds_in_training_mode_and_gives_a_scalar_loss(name):
    torch.manual_seed(0)
    model, batch, loss_fn = _zoo().ARCHITECTURES[name][1]()
    assert model.training
    with torch.no_grad():
        loss = loss_fn(model, *batch)
    assert loss.ndim == 0 and math.isfinite(float(loss))


@pytest.mark.parametrize("name, precision", [("swin", "float32"), ("gpt-neox", "bfloat16"), ("mixtral", "float32")])
def test_planned_steps_are_bitwise_eager_and_within_their_budget(name, precision):
    row = _zoo().measure(name, precision, time_limit_s=5.0)
    assert "refused" not in row, row.get("refused")
    assert row["bitwise"], row["mismatches"]
    assert row["within_budget"] and abs(row["peak_error"]) <= _zoo().PEAK_TOLERANCE
    assert row["budget_bytes"] < row["checkpoint_all_peak_bytes"] and row["overhead"] >= 1.0


def test_layer_drop_is_a_refusal_row_that_names_the_setting():
    row = _zoo().measure("wav2vec2-layerdrop", "float32", time_limit_s=5.0)
    assert "config.layerdrop=0.1" in row["refused"] and "set it to 0.0" in row["refused"]
    table = _zoo().markdown({"meta": {}, "rows": {"wav2vec2-layerdrop/float32": row}})
    assert "| wav2vec2-layerdrop |" in table and "refused: " in table
    assert "Refused, with the reason shown: wav2vec2-layerdrop." in table


def _row(**extra) -> dict:
    return {"model": "swin", "precision": "float32", "n_nodes": 10, "checkpoint_all_peak_bytes": 4 * 2**20,
            "budget_bytes": 2**21, "predicted_peak_bytes": 2**21, "measured_peak_bytes": 2**21, "peak_error": 0.0,
            "within_budget": True, "overhead": 1.1, "gap": 0.01, "bitwise": True, "max_abs_diff": 0.0,
            "mismatches": [], **extra}


def test_the_report_flags_a_stated_minimum_a_difference_and_a_peak_over_the_budget():
    rows = {"swin/float32": _row(stated_minimum=True),
            "swin/bfloat16": _row(precision="bfloat16", bitwise=False, max_abs_diff=3e-3, measured_peak_bytes=2**21 + 2**17,
                                  peak_error=1 / 16, within_budget=False)}
    table = _zoo().markdown({"meta": {"torch": "x", "transformers": "y", "time_limit_s": 20.0}, "rows": rows})
    assert "| 2.00\\* |" in table
    assert "max abs diff 3.0e-03" in table and "| NO |" in table
    assert "2 planned steps: 1 bitwise equal to eager PyTorch" in table
    assert "OVER the 2% bar" in table and "measured above the budget in 1" in table
    assert "(torch x, transformers y," in table  # (a record without the CPU kernels it ran on)
    kernels = {"torch": "x", "transformers": "y", "time_limit_s": 20.0, "kernels": "AVX512"}
    assert "(torch x with AVX512 CPU kernels, transformers y," in _zoo().markdown({"meta": kernels, "rows": rows})


def test_a_row_measured_with_other_cpu_kernels_is_measured_again(monkeypatch, tmp_path):
    """Which CPU kernels run (AVX2, AVX512, ...) decides whether two runs of an op round alike,
    so a row stored from other kernels is measured again; one from these is kept."""
    import json

    zoo = _zoo()
    versions = zoo._versions()
    assert versions["kernels"] == torch.backends.cpu.get_cpu_capability()
    out = tmp_path / "zoo.json"
    other = {**versions, "kernels": "OTHER"}
    out.write_text(json.dumps({"meta": {}, "rows": {
        "swin/float32": {**_row(), "versions": versions, "time_limit_s": 5.0},
        "swin/bfloat16": {**_row(precision="bfloat16"), "versions": other, "time_limit_s": 5.0}}}))
    measured = []
    monkeypatch.setattr(zoo, "measure", lambda name, precision, limit: measured.append((name, precision)) or _row())
    results = zoo.run(["swin"], ["float32", "bfloat16"], 5.0, out, fresh=False)
    assert measured == [("swin", "bfloat16")]
    assert results["rows"]["swin/bfloat16"]["versions"] == versions and results["meta"]["kernels"] == versions["kernels"]


@pytest.mark.parametrize("argv, message", [
    (["--models", "nope"], "unknown model(s) nope"),
    (["--precisions", "float16"], "unknown precision"),
    (["--time-limit", "0"], "--time-limit must be a positive number of seconds"),
])
def test_usage_errors_exit_2_naming_the_problem(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        _zoo().main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
