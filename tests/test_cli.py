"""The command line: exit codes, JSON fields, tables, sweeps and every usage error."""

import json

import pytest

from remat.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_solve_json_has_the_documented_fields(capsys):
    code, out, _ = run(capsys, "solve", "--graph", "chain:8", "--budget", "100%", "--method", "checkpoint_all", "--json")
    assert code == 0
    record = json.loads(out)
    for key in ("method", "status", "budget_bytes", "peak_bytes", "cost", "overhead", "solve_s"):
        assert key in record
    assert record["peak_bytes"] <= record["budget_bytes"]
    assert record["overhead"] == 1.0 and record["method"] == "checkpoint_all"


def test_solve_table(capsys):
    code, out, _ = run(capsys, "solve", "--graph", "unet:3", "--budget", "2GiB", "--method", "checkpoint_all")
    assert code == 0
    assert "unet3" in out and "overhead" in out and "1.000x" in out


def test_infeasible_budget_exits_1_and_names_the_minimum(capsys):
    code, _, err = run(capsys, "solve", "--graph", "chain:8", "--budget", "50%", "--method", "checkpoint_all")
    assert code == 1
    assert "infeasible" in err and "smallest budget method 'checkpoint_all' can meet is 10.00 MiB" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["solve", "--budget", "1GiB"], "say what to plan"),
        (["solve", "--graph", "chain:x", "--budget", "1GiB"], "sizes must be integers"),
        (["solve", "--graph", "chain:4", "--budget", "lots", "--method", "checkpoint_all"], "not understood"),
        (["solve", "--graph", "chain:4", "--budget", "1GiB", "--method", "magic"], "unknown method 'magic'"),
        (["sweep", "--graph", "chain:4", "--budgets", "10%:90%:x"], "COUNT must be an integer"),
        (["sweep", "--graph", "chain:4", "--budgets", "10%:90%:0"], "COUNT must be at least 1"),
        (["sweep", "--graph", "chain:4", "--budgets", ","], "lists no budget"),
        (["sweep", "--graph", "chain:4", "--methods", "checkpoint_all,nope"], "unknown method 'nope'"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err


def test_argparse_errors_exit_2(capsys):
    code, _, err = run(capsys, "solve", "--graph", "chain:4")
    assert code == 2 and "--budget" in err
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "invalid choice" in err


def test_methods_lists_the_registry(capsys):
    code, out, _ = run(capsys, "methods")
    assert code == 0 and "checkpoint_all" in out.split()


def test_sweep_writes_json_and_plot(capsys, tmp_path):
    out_json = tmp_path / "s.json"
    code, out, _ = run(capsys, "sweep", "--graph", "chain:6", "--methods", "checkpoint_all",
                       "--budgets", "50%,100%", "--out", str(out_json))
    assert code == 0
    payload = json.loads(out_json.read_text())
    points = payload["points"]
    assert [p["budget_fraction"] for p in points] == pytest.approx([0.5, 1.0], abs=0.01)
    assert points[0]["result"] is None and points[0]["min_budget_bytes"] == payload["checkpoint_all_peak_bytes"]
    assert points[1]["result"]["overhead"] == 1.0
    png = out_json.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "overhead by budget" in out


def test_solve_model_run_json_reports_measured_peak_and_gradients(capsys):
    code, out, _ = run(capsys, "solve", "--model", "mlp", "--batch", "256", "--costs", "estimate", "--budget", "90%",
                       "--method", "chen_greedy", "--run", "--json")
    assert code == 0
    record = json.loads(out)
    assert record["method"] == "chen_greedy" and record["peak_bytes"] <= record["budget_bytes"]
    assert record["measured_peak_bytes"] == record["predicted_peak_bytes"]
    assert record["bitwise_equal"] is True and record["n_nodes"] > record["n_nodes_reduced"]


def test_solve_model_infeasible_exits_1(capsys):
    code, _, err = run(capsys, "solve", "--model", "mlp", "--costs", "estimate", "--budget", "1KiB",
                       "--method", "checkpoint_all")
    assert code == 1 and "needs at least" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["solve", "--model", "resnet9000", "--budget", "50%", "--method", "checkpoint_all"], "unknown workload 'resnet9000'"),
        (["solve", "--model", "mlp", "--graph", "chain:3", "--budget", "50%"], "not both"),
        (["solve", "--graph", "chain:3", "--budget", "50%", "--method", "checkpoint_all", "--run"], "--run needs --model"),
        (["solve", "--model", "nosuchpkg.mod:make", "--budget", "50%"], "cannot be imported"),
    ],
)
def test_model_usage_errors(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_demo_writes_table_json_and_plot(capsys, tmp_path):
    out_json = tmp_path / "demo.json"
    code, out, _ = run(capsys, "demo", "--model", "mlp", "--batch", "16", "--costs", "estimate", "--budgets", "100%,60%",
                       "--methods", "checkpoint_all,chen_greedy", "--out", str(out_json))
    assert code == 0
    record = json.loads(out_json.read_text())
    assert len(record["runs"]) == 4
    ran = [r for r in record["runs"] if r["measured_peak_bytes"] is not None]
    assert ran and all(r["bitwise_equal"] and abs(r["peak_error"]) <= 0.02 for r in ran)
    assert out_json.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "bitwise equal" in out and "eager PyTorch peak" in out
