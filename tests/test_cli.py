"""The command line: exit codes, JSON fields, tables, sweeps and every usage error."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import remat
from remat.cli import build_parser, main


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
        (["sweep", "--graph", "chain:4", "--budgets", "10%:90%:0"], "COUNT is how many budgets LOW to HIGH, both included, so at least 2"),
        (["sweep", "--graph", "chain:4", "--budgets", ","], "lists no budget"),
        (["sweep", "--graph", "chain:4", "--budgets", "10%:20%"], "a range is LOW:HIGH:COUNT, e.g. 30%:100%:8"),
        (["sweep", "--graph", "chain:4", "--methods", "checkpoint_all,nope"], "unknown method 'nope'"),
        (["sweep", "--graph", "chain:4", "--methods", "milp,chen_greedy,milp"],
         "--methods lists 'milp' more than once; list each method once (e.g. --methods milp,chen_greedy)"),
        # what the user wrote is printed as it is: rich's markup and emoji codes are not read in it
        (["solve", "--graph", "chain:4", "--budget", "1GiB", "--method", "[/]"], "unknown method '[/]'"),
        (["solve", "--graph", "chain:4", "--budget", "1GiB", "--method", "[red]milp"], "unknown method '[red]milp'"),
        (["solve", "--graph", "chain:4", "--budget", "1GiB", "--method", ":fire:"], "unknown method ':fire:'"),
        (["sweep"], "say what to plan: --graph chain:32 (or unet:4, random:60:7)\n"),  # (sweep has no --model)
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err


def test_a_sweep_names_its_files_as_given_and_solves_a_budget_listed_twice_once(capsys, tmp_path):
    out = tmp_path / "exp[v2]" / "s.json"
    out.parent.mkdir()
    code, stdout, err = run(capsys, "sweep", "--graph", "chain:8", "--methods", "checkpoint_all",
                            "--budgets", "100%,1.0,90%", "--out", str(out))
    assert code == 0 and f"wrote {out} and {out.with_suffix('.png')}" in stdout.replace("\n", "")
    assert "read back" not in err  # (the second 100% was once "read back" from the first, in a fresh file)
    assert len(json.loads(out.read_text())["results"]) == 2


def test_argparse_errors_exit_2(capsys):
    code, _, err = run(capsys, "solve", "--graph", "chain:4")
    assert code == 2 and "--budget" in err
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "invalid choice" in err


def test_methods_lists_the_registry_with_a_line_on_each(capsys):
    from remat.cli import METHOD_SUMMARIES
    from remat.solvers import methods

    code, out, _ = run(capsys, "methods")
    lines = out.splitlines()
    assert code == 0 and [line.split()[0] for line in lines] == list(methods())
    assert set(METHOD_SUMMARIES) == set(methods())  # (a new method needs its line)
    assert all(line.endswith(METHOD_SUMMARIES[line.split()[0]]) for line in lines)


def _sweep_points(path):
    """The sweep's points in the order they were stored."""
    return [entry["result"] for entry in json.loads(path.read_text())["results"]]


def test_sweep_writes_json_and_plot(capsys, tmp_path):
    out_json = tmp_path / "s.json"
    code, out, _ = run(capsys, "sweep", "--graph", "chain:6", "--methods", "checkpoint_all",
                       "--budgets", "50%,100%", "--out", str(out_json))
    assert code == 0
    payload = json.loads(out_json.read_text())
    (graph,) = payload["meta"]["graphs"].values()
    points = _sweep_points(out_json)
    assert [p["budget_fraction"] for p in points] == pytest.approx([0.5, 1.0], abs=0.01)
    assert points[0]["result"] is None and points[0]["min_budget_bytes"] == graph["checkpoint_all_peak_bytes"]
    assert points[1]["result"]["overhead"] == 1.0
    png = out_json.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "overhead by budget" in out


def test_sweep_table_shows_the_smallest_feasible_budget(capsys, tmp_path):
    code, out, _ = run(capsys, "sweep", "--graph", "chain:6", "--methods", "checkpoint_all,chen_sqrtn",
                       "--budgets", "50%,100%", "--out", str(tmp_path / "s.json"))
    assert code == 0
    point = _sweep_points(tmp_path / "s.json")[0]
    assert point["result"] is None and point["min_budget_bytes"] > point["budget_bytes"]
    assert "needs 100.0%" in out and " - " not in out


def test_sweep_resumes_from_its_json(capsys, tmp_path, monkeypatch):
    import remat.sweep

    argv = ["sweep", "--graph", "unet:3", "--methods", "checkpoint_all,chen_greedy", "--budgets", "60%,100%",
            "--out", str(tmp_path / "s.json")]
    assert run(capsys, *argv)[0] == 0
    first = _sweep_points(tmp_path / "s.json")

    def no_solving(*args, **kwargs):
        raise AssertionError("a stored point was solved again")

    monkeypatch.setattr(remat.sweep, "_solve_point", no_solving)
    code, out, err = run(capsys, *argv)
    assert code == 0 and "4 of 4 points read back" in err
    assert _sweep_points(tmp_path / "s.json") == first
    # other options are other points: solved, and the stored ones stay
    monkeypatch.undo()
    code, _, err = run(capsys, *argv[:-2], "--time-limit", "5", "--methods", "chen_greedy,lp_round",
                       "--out", str(tmp_path / "s.json"))
    assert code == 0 and "2 of 4 points read back" in err
    assert len(_sweep_points(tmp_path / "s.json")) == 6


def test_sweep_solves_a_damaged_entry_of_its_json_again(capsys, tmp_path, caplog):
    """A results file that is valid JSON with one entry damaged (its result gone, or not an
    object with an overhead) stopped every rerun with a KeyError or TypeError traceback: that
    point is solved again, with a warning naming the file, and the entry replaced."""
    path = tmp_path / "s.json"
    argv = ["sweep", "--graph", "chain:8", "--methods", "checkpoint_all,chen_sqrtn", "--budgets", "50%:100%:2",
            "--out", str(path)]
    assert run(capsys, *argv)[0] == 0
    first = _sweep_points(path)
    data = json.loads(path.read_text())
    del data["results"][1]["result"]
    data["results"][2]["result"]["result"] = "oops"
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="remat.sweep"):
        code, _, err = run(capsys, *argv)
    assert code == 0 and "2 of 4 points read back" in err
    assert any("is damaged (the stored point has a result without an overhead and a status); solving it again"
               in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    def plans(points):
        return [(p["method"], p["budget_bytes"], p["min_budget_bytes"], p["result"] and p["result"]["overhead"])
                for p in points]

    assert plans(_sweep_points(path)) == plans(first)
    code, _, err = run(capsys, *argv)
    assert code == 0 and "4 of 4 points read back" in err


def test_sweep_solves_an_entry_with_impossible_numbers_again(capsys, tmp_path, caplog):
    """An entry whose result says cost 'abc' and a peak of -7 B was read back as it was."""
    path = tmp_path / "s.json"
    argv = ["sweep", "--graph", "chain:8", "--methods", "checkpoint_all", "--budgets", "100%,1GB", "--out", str(path)]
    assert run(capsys, *argv)[0] == 0
    data = json.loads(path.read_text())
    data["results"][0]["result"]["result"].update(cost="abc", peak_bytes=-7)
    data["results"][1]["result"]["result"]["peak_bytes"] = 10**15  # (above its budget)
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="remat.sweep"):
        code, _, err = run(capsys, *argv)
    assert code == 0 and "read back" not in err
    messages = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(messages) == 2
    assert "a peak (-7) that is not a number of bytes within the budget" in messages[0]
    assert "a cost ('abc') that is not a positive number" in messages[0]
    assert "a peak (1000000000000000)" in messages[1]


def test_sweep_budget_ranges_are_checked(capsys):
    for budgets, message in (("50%:100%:1", "COUNT is how many budgets LOW to HIGH, both included, so at least 2"),
                             ("30%:100%:100000", "at most 500 budgets")):
        code, _, err = run(capsys, "sweep", "--graph", "chain:8", "--budgets", budgets)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"remat {remat.__version__}"


def _interruptible(argv: list[str]) -> subprocess.Popen:
    """Start ``argv`` with Ctrl-C delivered as a terminal would. A child inherits its parent's
    blocked signals and an ignored SIGINT across exec (Python then never installs its handler);
    code that ran earlier in this test process may have left either, so the child starts with
    SIGINT unblocked and at its default."""

    def reset() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=reset)


def _ctrl_c(proc: subprocess.Popen) -> str:
    """Send Ctrl-C to ``proc`` and check it left at once with exit code 130: its stderr."""
    try:
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        stopped_s = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130 and stopped_s < 3.0, (proc.returncode, stopped_s, err[-1000:])
    return err


def test_sweep_stops_at_ctrl_c_keeps_what_it_solved_and_resumes(tmp_path):
    out = tmp_path / "s.json"
    # the exact MILP at 25% of a 59-node chain runs into its time limit (two minutes): Ctrl-C
    # lands inside HiGHS
    argv = ["sweep", "--graph", "chain:29", "--methods", "checkpoint_all,chen_sqrtn,milp", "--budgets", "25%,20%",
            "--time-limit", "120", "--out", str(out)]
    proc = _interruptible([sys.executable, "-m", "remat.cli", *argv])
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and len(_sweep_points(out)) >= 2):  # then the MILP at 50% runs
            assert proc.poll() is None and time.monotonic() < deadline, "no point written while sweeping"
            time.sleep(0.05)
        time.sleep(0.5)
    except BaseException:
        proc.kill()
        raise
    err = _ctrl_c(proc)
    assert "Traceback" not in err and "run the same command again to resume" in err
    kept = _sweep_points(out)
    assert len(kept) == 2
    # a rerun solves only what is missing
    import remat.sweep
    from remat.builders import graph_from_spec
    from remat.sweep import ResultStore, sweep

    solved = []
    real = remat.sweep._solve_point
    graph = graph_from_spec("chain:29")
    budgets = [int(f * remat.sweep.checkpoint_all_peak(graph)) for f in (0.25, 0.2)]
    remat.sweep._solve_point = lambda *a: solved.append(a[1:3]) or remat.sweep.SweepPoint(a[1], a[2], 0.0, None)
    try:
        points = sweep(graph, ["checkpoint_all", "chen_sqrtn", "milp"], budgets,
                       options={"milp": {"time_limit_s": 120.0}}, store=ResultStore(out))
    finally:
        remat.sweep._solve_point = real
    assert len(points) == 6 and len(solved) == 6 - len(kept)


def test_solve_stops_at_ctrl_c_inside_the_solver():
    # the exact MILP at 25% of a 59-node chain runs into its time limit (two minutes)
    argv = ["solve", "--graph", "chain:29", "--budget", "25%", "--method", "milp", "--time-limit", "120"]
    proc = _interruptible([sys.executable, "-m", "remat.cli", *argv])
    time.sleep(4.0)  # imports, then the MILP (which alone takes far longer than this)
    if proc.poll() is not None:
        proc.kill()
        pytest.fail("the solve ended before it could be interrupted")
    err = _ctrl_c(proc)
    assert "Traceback" not in err and "interrupted" in err


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield [name], sub
                for more, subsub in _subcommands(sub):
                    yield [name, *more], subsub


def test_every_help_works(capsys):
    commands = [[]] + [path for path, _ in _subcommands(build_parser())]
    assert ["solve"] in commands and ["sweep"] in commands and len(commands) >= 6
    for path in commands:
        code = main([*path, "--help"])
        out = capsys.readouterr().out
        assert code == 0, path
        assert out.startswith("usage: remat") and "--help" in out, path


@pytest.mark.parametrize("command", [["solve"], ["sweep"], ["demo"], ["bench", "sweep"], ["bench", "max-batch"]])
def test_every_option_that_takes_a_value_states_its_default(capsys, command):
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0
    entries = [" ".join(entry.split()) for entry in re.split(r"\n(?=  -)", out.split("\noptions:\n", 1)[1])]
    valued = [entry for entry in entries if re.match(r"(-\w, )?--[\w-]+ [A-Z{]", entry)]
    assert len(valued) >= 5, out
    for entry in valued:
        assert "default" in entry, entry
    if command == ["demo"]:
        assert any(e.startswith("--time-limit TIME_LIMIT seconds the MILP / LP search may take (positive; default 20)")
                   for e in entries)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["solve", "--graph", "chain:4", "--budget", "50%", "--time-limit", "0"],
         "time limit 0 s must be a positive, finite number of seconds; e.g. 60 (or leave the option out"),
        (["solve", "--graph", "chain:4", "--budget", "50%", "--time-limit", "-5"], "time limit -5 s must be a positive"),
        (["solve", "--graph", "chain:4", "--budget", "50%", "--time-limit", "nan"], "time limit nan s must be"),
        (["solve", "--graph", "chain:4", "--budget", "50%", "--time-limit", "soon"], "'soon' is not a number of seconds"),
        (["solve", "--graph", "chain:4", "--budget", "1e400"], "'1e400' is not a finite number"),
        (["solve", "--graph", "chain:4", "--budget", "150%"], "percentage in (0%, 100%]"),
        (["solve", "--graph", "chain:4", "--budget", "50%", "--backend", "foo"], "invalid choice: 'foo'"),
        (["solve", "--model", "mlp", "--batch", "0", "--budget", "50%"], "0 must be at least 1"),
        (["solve", "--model", "mlp", "--batch", "x", "--budget", "50%"], "'x' is not a whole number"),
        (["sweep", "--graph", "chain:4", "--methods", ""], "--methods '' lists no method"),
        (["sweep", "--graph", "chain:4", "--methods", " , "], "lists no method"),
        (["demo", "--methods", ""], "--methods '' lists no method"),
        (["demo", "--budgets", "60%,lots"], "'lots' is not understood"),
        (["sweep", "--graph", "chain:4", "--budgets", "10%:200%:3"], "percentage in (0%, 100%]"),
        (["sweep", "--graph", "chain:4", "--budgets", "80%:40%:3"], "80% is above 40%; write 40%:80%:3"),
        (["solve", "--graph", "chain:4", "--budget", "50%", "--batch", "4"],
         "--batch applies to --model only; --graph chain:4 has its own sizes and costs: drop --batch"),
        (["solve", "--graph", "chain:4", "--budget", "50%", "--batch", "4", "--costs", "estimate"],
         "--batch and --costs apply to --model"),
        (["solve", "--graph", "chain:4", "--budget", "50%", "--unknown"],
         "remat solve: error: unrecognized arguments: --unknown (see `remat solve --help`)"),
        (["methods", "--verbose-ish"], "remat methods: error: unrecognized arguments: --verbose-ish"),
        (["bench", "sweep", "--bogus-option"],
         "remat bench sweep: error: unrecognized arguments: --bogus-option (see `remat bench sweep --help`)"),
    ],
)
def test_bad_usage_exits_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_model_spec_that_is_not_a_factory_is_bad_usage(capsys):
    code, _, err = run(capsys, "solve", "--model", "os.path:join", "--budget", "50%", "--costs", "estimate")
    assert code == 2 and "--model 'os.path:join': calling it with the batch size failed (TypeError" in err
    assert "Traceback" not in err


def test_an_out_path_that_is_a_folder_is_told_to_name_a_file_in_it(capsys, tmp_path):
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", str(tmp_path))
    assert code == 2 and f"e.g. --out {tmp_path / 'results.json'}" in err, err


def test_a_model_factory_that_fails_is_named_with_the_line_that_raised(capsys, tmp_path, monkeypatch):
    (tmp_path / "failing_factory.py").write_text("def make(batch_size):\n    raise RuntimeError('no data here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, "solve", "--model", "failing_factory:make", "--budget", "50%", "--costs", "estimate")
    assert code == 2 and ("--model 'failing_factory:make': calling it with the batch size failed at "
                          "failing_factory.py:2 (RuntimeError: no data here)") in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_model_module_in_the_current_directory_is_imported(capsys, tmp_path, monkeypatch):
    """README: `cd` to the folder of mymodels.py, then `remat solve --model mymodels:make`; the
    `remat` script's sys.path has its own folder first, not the current one, and the module
    could not be imported. The current directory is searched for that import only."""
    (tmp_path / "mymodels_in_cwd.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "from remat.models import Workload\n"
        "def make(batch_size):\n"
        "    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))\n"
        "    batch = (torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,)))\n"
        "    return Workload('mlp16', model, batch, lambda m, x, y: F.cross_entropy(m(x), y))\n")
    monkeypatch.chdir(tmp_path)
    path = [entry for entry in sys.path if entry not in ("", ".", str(tmp_path))]  # (as the script's)
    monkeypatch.setattr(sys, "path", path)
    monkeypatch.delitem(sys.modules, "mymodels_in_cwd", raising=False)
    code, out, err = run(capsys, "solve", "--model", "mymodels_in_cwd:make", "--batch", "4", "--costs", "estimate",
                         "--budget", "100%", "--method", "checkpoint_all", "--json")
    assert code == 0, err
    assert json.loads(out)["model"] == "mymodels_in_cwd:make"
    assert sys.path == path  # (taken off again)
    code, _, err = run(capsys, "solve", "--model", "no_such_module_in_cwd:make", "--budget", "50%")
    _one_line_usage_error(code, err)
    assert "module 'no_such_module_in_cwd' cannot be imported" in err
    assert "that it is in the current directory or on PYTHONPATH" in err and sys.path == path


def test_out_and_plot_paths_are_checked_before_any_work(capsys, tmp_path):
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", str(tmp_path / "r.png"))
    assert code == 2 and "must end in .json" in err and not (tmp_path / "r.png").exists()
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", str(tmp_path / "r.json"),
                       "--plot", str(tmp_path / "x.txt"))
    assert code == 2 and "'.txt' is not one matplotlib writes" in err and not (tmp_path / "r.json").exists()
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", str(tmp_path / "r.json"),
                       "--plot", str(tmp_path / "g"))  # (it said "'none' is not one matplotlib writes")
    _one_line_usage_error(code, err)
    assert f"--plot {str(tmp_path / 'g')!r} has no extension" in err and "'none'" not in err
    assert ".png, .pdf or .svg (or .avif, .eps" in err and f"e.g. --plot {tmp_path / 'g.png'}" in err
    assert not (tmp_path / "r.json").exists()
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path))
    _one_line_usage_error(code, err)
    assert f"is a folder; give a file in it, e.g. --plot {tmp_path / 'r.png'}" in err
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", str(tmp_path / "r.json"),
                       "--plot", str(tmp_path / "r.json"))
    assert code == 2 and "must end in" not in err and "is not one matplotlib writes" in err
    code, _, err = run(capsys, "demo", "--out", str(tmp_path / "d.png"))
    assert code == 2 and "must end in .json" in err
    code, out, _ = run(capsys, "sweep", "--graph", "chain:4", "--methods", "checkpoint_all", "--budgets", "100%",
                       "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.svg"))
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["format"] == "remat.results"
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def test_sweep_refuses_an_out_file_it_did_not_write(capsys, tmp_path):
    (tmp_path / "r.json").write_text('{"points": []}')
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", str(tmp_path / "r.json"))
    assert code == 2 and "is not a remat results file" in err
    assert (tmp_path / "r.json").read_text() == '{"points": []}'


def test_estimated_costs_trace_on_the_meta_device(capsys, monkeypatch):
    import importlib

    trace_module = importlib.import_module("remat.trace")  # remat.trace is the function
    devices = []
    real = trace_module.trace

    def spy(model, batch, *args, **kwargs):
        devices.append({t.device.type for t in [*model.parameters(), *batch]})
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(trace_module, "trace", spy)
    code, out, err = run(capsys, "solve", "--model", "cnn", "--batch", "4", "--costs", "estimate", "--budget", "80%",
                         "--method", "chen_greedy", "--json")
    assert code == 0 and devices == [{"meta"}]
    assert "on the meta device" in err and "no tensor is allocated" in err
    assert "kernel scratch memory is not counted" in err
    record = json.loads(out)
    assert record["traced_on"] == "meta" and record["peak_bytes"] <= record["budget_bytes"]


def test_paper_scale_model_with_estimated_costs_answers_quickly_without_allocating(capsys):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    code, _, err = run(capsys, "solve", "--model", "vgg16", "--batch", "256", "--costs", "estimate",
                       "--budget", "30%", "--method", "chen_greedy")
    assert code == 1 and "vgg16 at batch 256 needs at least" in err and "of checkpoint-all" in err
    assert time.monotonic() - started < 60
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 2 * 2**20  # a real batch of 256 images and VGG16's activations would be > 17 GB


def test_python_m_remat_is_the_remat_command():
    """`python -m remat` failed: "No module named remat.__main__"."""
    done = subprocess.run([sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: remat ") and "solve" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "-m", "remat", "solve", "--graph", "chain:4", "--budget", "lots"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("remat solve: error: ") and "not understood" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "remat", "solve", "--graph", "chain:8", "--budget", "50%",
                           "--method", "checkpoint_all"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("no plan fits: "), done.stderr


def test_json_output_is_only_json(capsys):
    # native solver code writes to file descriptor 1; --json must stay parseable
    code = [sys.executable, "-m", "remat.cli", "solve", "--graph", "chain:6", "--budget", "60%", "--method", "milp",
            "--json"]
    done = subprocess.run(code, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["method"] == "milp"


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
    # (the method's smallest budget, not the model's: another method may plan below it)
    assert "with method 'checkpoint_all', mlp at batch" in err


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
    assert "tracing" not in err  # (refused before any work is announced)


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


# ---------------------------------------------------------------- bad usage found by a new user
ROOT = Path(__file__).resolve().parents[1]


def _one_line_usage_error(code, err):
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.fixture
def a_file(tmp_path):
    """An existing regular file, used as if it were a folder."""
    path = tmp_path / "F"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--graph", "chain:8", "--methods", "milp", "--budgets", "50%", "--out", "{F}/x.json"],
        ["sweep", "--graph", "chain:8", "--methods", "milp", "--budgets", "50%", "--out", "{F}/sub/x.json"],
        ["sweep", "--graph", "chain:8", "--methods", "milp", "--budgets", "50%", "--out", "{tmp}/ok.json",
         "--plot", "{F}/p.png"],
        ["demo", "--model", "mlp", "--batch", "2", "--costs", "estimate", "--methods", "checkpoint_all",
         "--budgets", "100%", "--out", "{F}/d.json"],
        ["bench", "sweep", "--out", "{F}/x.json", "--models", "mlp", "--batch", "2", "--budgets", "60%",
         "--methods", "checkpoint_all", "--no-report"],
        ["bench", "sweep", "--out", "{tmp}/b.json", "--plots", "{F}/plots", "--models", "mlp", "--batch", "2",
         "--budgets", "60%", "--methods", "checkpoint_all", "--no-report"],
        ["bench", "max-batch", "--out", "{F}/x.json", "--models", "mlp", "--methods", "checkpoint_all",
         "--memory", "1GB", "--no-report"],
    ],
    ids=["sweep-out", "sweep-out-deeper", "sweep-plot", "demo-out", "bench-sweep-out", "bench-sweep-plots",
         "bench-max-batch-out"],
)
def test_unwritable_output_paths_are_refused_before_any_work(capsys, tmp_path, a_file, argv):
    argv = [a.format(F=a_file, tmp=tmp_path) for a in argv]
    started = time.monotonic()
    code, out, err = run(capsys, *argv)
    _one_line_usage_error(code, err)
    assert str(a_file) in err and "is a file, not a folder" in err, err
    assert "tracing" not in err and out == "" and time.monotonic() - started < 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["F"]  # nothing written, nothing made


def test_an_out_path_where_no_file_can_be_created_is_refused(capsys, tmp_path):
    if not Path("/proc/self").exists():
        pytest.skip("needs /proc")
    code, _, err = run(capsys, "sweep", "--graph", "chain:8", "--methods", "milp", "--budgets", "50%",
                       "--out", "/proc/x.json")
    _one_line_usage_error(code, err)
    assert "--out '/proc/x.json': cannot create a file in '/proc'" in err and "give a path in a folder" in err
    code, _, err = run(capsys, "sweep", "--graph", "chain:8", "--out", str(tmp_path / "dir.json" / "x.json"),
                       "--plot", str(tmp_path))
    _one_line_usage_error(code, err)
    assert "is not one matplotlib writes" in err or "is a folder" in err


def test_bench_plot_only_without_its_results_file_is_bad_usage(capsys, tmp_path):
    missing = tmp_path / "does-not-exist.json"
    code, _, err = run(capsys, "bench", "sweep", "--plot-only", "--out", str(missing), "--plots",
                       str(tmp_path / "plots"), "--no-report")
    _one_line_usage_error(code, err)
    assert f"--plot-only redraws the plots from --out '{missing}', which does not exist" in err
    assert "without --plot-only" in err and not missing.exists()


@pytest.mark.parametrize(
    "options, message",
    [
        ('{"milp": {"bogus": 1}}', "--options: method 'milp' has no option 'bogus'; its options are: backend"),
        ('{"nope": {}}', "--options: unknown method 'nope'; choose from"),
        ('{"milp": {"threads": 0}}', "--options: method 'milp': threads=0 must be a positive int"),
        ('{"milp": {"max_nodes": 0}}', "--options: max_nodes=0 must be a positive int"),
        ('{"chen_greedy": {"time_limit_s": 5}}', "method 'chen_greedy' has no option 'time_limit_s'"),
    ],
)
def test_bench_sweep_checks_solver_options_before_tracing(capsys, tmp_path, options, message):
    out = tmp_path / "b.json"
    code, stdout, err = run(capsys, "bench", "sweep", "--options", options, "--models", "mlp", "--batch", "2",
                            "--budgets", "60%", "--methods", "milp", "--out", str(out), "--no-report")
    _one_line_usage_error(code, err)
    assert message in err and stdout == "" and not out.exists()


def test_bench_sweep_options_plan_graph_keywords_are_accepted(capsys, tmp_path):
    out = tmp_path / "b.json"
    code, _, err = run(capsys, "bench", "sweep", "--options", '{"chen_greedy": {"max_nodes": 40}}', "--models",
                       "mlp", "--batch", "2", "--budgets", "100%", "--methods", "chen_greedy", "--out", str(out),
                       "--plots", str(tmp_path), "--no-report")
    assert code == 0, err
    (point,) = json.loads(out.read_text())["points"]
    assert point["options"] == {"max_nodes": 40}


@pytest.mark.parametrize("budgets", ["150%", "60%,150%", "1.5", "-10%", "2GiB"])
def test_bench_budgets_are_read_as_remat_sweep_reads_them(capsys, tmp_path, budgets):
    code, stdout, err = run(capsys, "bench", "sweep", "--budgets", budgets, "--models", "mlp", "--batch", "2",
                            "--methods", "checkpoint_all", "--out", str(tmp_path / "b.json"), "--no-report")
    _one_line_usage_error(code, err)
    assert stdout == "" and not (tmp_path / "b.json").exists()
    if budgets.endswith("150%"):  # the library's text, as `remat sweep --budgets 150%` says it
        assert "budget '150%' must be a percentage in (0%, 100%]" in err
        code, _, sweep_err = run(capsys, "sweep", "--graph", "chain:4", "--budgets", budgets)
        assert code == 2 and sweep_err.strip().split("'150%'")[1] in err
    if budgets == "2GiB":
        assert "is a size in bytes" in err and "a percentage ('60%') of each model's checkpoint-all peak" in err


def test_bench_budgets_take_a_range_like_remat_sweep(capsys, tmp_path):
    out = tmp_path / "b.json"
    code, _, err = run(capsys, "bench", "sweep", "--budgets", "50%:100%:3", "--models", "mlp", "--batch", "2",
                       "--methods", "checkpoint_all", "--out", str(out), "--plots", str(tmp_path), "--no-report")
    assert code == 0, err
    assert sorted(p["fraction"] for p in json.loads(out.read_text())["points"]) == [0.5, 0.75, 1.0]


def test_an_uninstalled_milp_backend_is_bad_usage(capsys):
    import importlib.util

    if importlib.util.find_spec("gurobipy") is not None:
        pytest.skip("gurobipy is installed")
    code, _, err = run(capsys, "solve", "--graph", "chain:32", "--budget", "40%", "--backend", "gurobi")
    _one_line_usage_error(code, err)
    assert "--backend gurobi: MILP backend 'gurobi' needs the Python package 'gurobipy'" in err
    assert "pip install gurobipy" in err and "--backend highs" in err
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--backend", "gurobi", "--out", "x.json")
    _one_line_usage_error(code, err)


def test_infeasible_solve_with_json_prints_a_json_status(capsys):
    code, out, err = run(capsys, "solve", "--graph", "chain:8", "--budget", "10%", "--json")
    assert code == 1 and "no plan fits" in err and len(err.strip().splitlines()) == 1
    record = json.loads(out)
    assert record["status"] == "infeasible" and record["method"] == "milp" and record["graph"] == "chain8"
    assert record["budget_bytes"] == int(0.1 * record["checkpoint_all_peak_bytes"])
    assert record["min_budget_bytes"] > record["budget_bytes"]
    assert f"({record['min_budget_bytes']} B)" in err


def test_infeasible_model_solve_with_json_prints_a_json_status(capsys):
    code, out, err = run(capsys, "solve", "--model", "mlp", "--costs", "estimate", "--budget", "1KiB",
                         "--method", "checkpoint_all", "--json")
    assert code == 1 and "needs at least" in err
    record = json.loads(out)
    assert record["status"] == "infeasible" and record["model"] == "mlp" and record["budget_bytes"] == 1024
    assert record["min_budget_bytes"] == record["checkpoint_all_peak_bytes"]


def test_infeasible_solve_and_run_with_json_prints_a_json_status(capsys):
    code, out, err = run(capsys, "solve", "--model", "mlp", "--batch", "16", "--costs", "estimate", "--budget",
                         "60%", "--method", "checkpoint_all", "--run", "--json")
    assert code == 1 and err.strip().splitlines()[-1].startswith("no plan fits"), err
    record = json.loads(out)
    assert record["status"] == "infeasible" and record["method"] == "checkpoint_all"
    assert record["min_budget_bytes"] == record["checkpoint_all_peak_bytes"] > record["budget_bytes"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "remat: error: unrecognized arguments: --bogus"),
        (["--bogus", "solve"], "unrecognized arguments: --bogus"),
        (["solve", "--bogus"], "remat solve: error: unrecognized arguments: --bogus (see `remat solve --help`)"),
        (["solve", "--graph", "chain:4", "--bogus", "x"], "remat solve: error: unrecognized arguments: --bogus x"),
        (["solve", "--graph", "chain:32", "--budget", "-10%"], "budget '-10%' must be positive"),
        (["sweep", "--graph", "chain:32", "--budgets", "-10%,50%"], "budget '-10%' must be positive"),
        (["solve", "--graph", "chain:32", "--budget", "40%", "--time-limit", "-1e3"], "time limit -1e3 s must be"),
    ],
)
def test_usage_messages_name_the_real_problem(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    _one_line_usage_error(code, err)
    assert message in err, err
    assert "required: COMMAND" not in err and "expected one argument" not in err


@pytest.mark.parametrize("memory", ["abc", "60%", "0.6", "-1GB"])
def test_max_batch_memory_messages_list_only_what_memory_accepts(capsys, tmp_path, memory):
    code, _, err = run(capsys, "bench", "max-batch", "--memory", memory, "--models", "mlp", "--out",
                       str(tmp_path / "m.json"), "--no-report")
    _one_line_usage_error(code, err)
    assert f"--memory {memory!r}" in err and "16GB" in err, err
    assert "a fraction (0.6)" not in err and "or a percentage ('60%')" not in err


def test_sweep_table_never_shows_needs_at_or_below_the_budget(capsys, tmp_path):
    # unet:8 at 100%: recompute_all needs 5714242 B against a budget of 5713218 B (100.018%)
    code, out, _ = run(capsys, "sweep", "--graph", "unet:8", "--methods", "recompute_all,checkpoint_all",
                       "--budgets", "100%", "--out", str(tmp_path / "s.json"))
    assert code == 0
    point = _sweep_points(tmp_path / "s.json")[0]
    assert point["method"] == "recompute_all" and point["min_budget_bytes"] > point["budget_bytes"]
    # above 100% no percentage is a budget one can ask for ('100.02%' was refused): bytes
    assert "needs 100.0" not in out and f"({point['min_budget_bytes']} B)" in out


def test_sweep_runs_every_method_by_default():
    from remat.cli_args import default_sweep_methods
    from remat.solvers import methods

    assert sorted(default_sweep_methods().split(",")) == sorted(methods())
    assert "descent" in default_sweep_methods().split(",")
    args = build_parser().parse_args(["sweep", "--graph", "chain:4"])
    assert args.methods is None or sorted(args.methods.split(",")) == sorted(methods())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "abc"], "argument --budget: budget 'abc' is not understood"),
        (["--budget", "150%"], "budget '150%' must be a percentage in (0%, 100%]"),
        (["--budget", "-10%"], "budget '-10%' must be positive"),
        (["--method", "nope"], "argument --method: unknown method 'nope'; choose from"),
        (["--batch", "0"], "argument --batch: 0 must be at least 1"),
        (["--steps", "x"], "argument --steps: 'x' is not a whole number"),
    ],
)
def test_train_loop_example_refuses_bad_usage_in_one_line(argv, message):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_loop.py"), "--model", "mlp", *argv],
                          capture_output=True, text=True, timeout=120)
    _one_line_usage_error(done.returncode, done.stderr)
    assert message in done.stderr and done.stdout == ""


# ---------------------------------------------------------------- --threads, --graph sizes, -v after the command
@pytest.mark.parametrize("threads", ["0", "-1"])
@pytest.mark.parametrize("experiment", ["sweep", "max-batch"])
def test_bench_threads_below_one_is_bad_usage(capsys, tmp_path, experiment, threads):
    """torch.set_num_threads(0) raised a RuntimeError traceback (exit code 1) after tracing."""
    out = tmp_path / "b.json"
    code, stdout, err = run(capsys, "bench", experiment, "--threads", threads, "--models", "mlp:4", "--out", str(out),
                            "--no-report")
    _one_line_usage_error(code, err)
    assert (f"remat bench {experiment}: error: argument --threads: {threads} is not a usable number of threads; "
            f"give --threads at least 1 (see") in err, err
    assert stdout == "" and not out.exists()


@pytest.mark.parametrize("script, least", [("busy_cpu", 2), ("demo_gpt2", 1), ("holdout", 1), ("spot_checks", 1),
                                           ("step_overhead", 1), ("vs_pytorch", 1), ("zoo", 1)])
def test_every_bench_scripts_threads_option_refuses_too_few_in_one_line(script, least):
    for threads in ("0", "-3", str(least - 1)):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--threads", threads],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        _one_line_usage_error(done.returncode, done.stderr)
        assert f"argument --threads: {threads} is not a usable number of threads" in done.stderr, done.stderr
        assert f"give --threads at least {least}" in done.stderr


def test_threads_options_share_one_argument_type():
    """Every --threads of the command and of bench/ is read by ``thread_count`` (no plain int)."""
    sources = [ROOT / "src" / "remat" / "cli_args.py", *sorted((ROOT / "bench").glob("*.py"))]
    declared = [(path.name, line) for path in sources for line in path.read_text().splitlines()
                if re.search(r"add_argument\(\s*\"--threads\"", line)]
    assert len(declared) >= 8, declared
    assert all("type=thread_count(" in line for _, line in declared), declared


@pytest.mark.parametrize("spec, message", [
    ("unet:100000", "the depth D must be at most 1000 (4003 nodes; larger graphs take too long or too much memory "
                    "to plan); e.g. unet:1000"),
    ("chain:801", "the layer count N must be at most 800 (1601 nodes"),
    ("random:2001:7", "the forward node count N must be at most 2000 (4001 nodes; larger graphs take too long or too "
                      "much memory to plan); e.g. random:2000:7"),
    ("random:99999999999999999999", "must be at most 2000"),
    ("chain:0", "graph 'chain:0': the layer count N must be at least 1; e.g. chain:8"),
    ("unet:-4", "graph 'unet:-4': the depth D must be at least 1"),
    ("random:-1:3", "the forward node count N must be at least 1"),
    ("random:30:7:1", "is not a built-in graph; use chain:N (N up to 800), unet:D (D up to 1000) or random:N:SEED "
                      "(N up to 2000"),
])
@pytest.mark.parametrize("command", [["solve", "--budget", "50%"], ["sweep"]])
def test_graph_sizes_are_checked_before_any_work(capsys, tmp_path, command, spec, message):
    """unet:100000 asked numpy for 149 GiB (a traceback, exit code 1)."""
    out = tmp_path / "s.json"
    started = time.monotonic()
    code, stdout, err = run(capsys, *command, "--graph", spec, *(["--out", str(out)] if command == ["sweep"] else []))
    _one_line_usage_error(code, err)
    assert f"argument --graph: graph {spec!r}" in err and message in err, err
    assert stdout == "" and not out.exists() and time.monotonic() - started < 10


def test_the_largest_graph_sizes_are_accepted_and_documented(capsys):
    from remat.builders import graph_from_spec
    from remat.cli_args import GRAPH_SIZES

    for kind, (_, most, (a, b)) in GRAPH_SIZES.items():
        args = build_parser().parse_args(["solve", "--graph", f"{kind}:{most}", "--budget", "50%"])
        assert args.graph == f"{kind}:{most}"
        assert graph_from_spec(args.graph).n == a * most + b
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["sweep", "--graph", f"{kind}:{most + 1}"])
        assert exc.value.code == 2
        assert f"at most {most}" in capsys.readouterr().err
    for command in ("solve", "sweep"):
        assert main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert ("N is at most 800 for chain and 2000 for random, D at most 1000: larger graphs take too long or too "
                "much memory to plan") in text


VERBOSE_COMMANDS = [["solve", "--graph", "chain:8", "--budget", "50%"], ["sweep", "--graph", "chain:8"], ["demo"],
                    ["methods"], ["bench", "sweep", "--models", "mlp"]]


@pytest.mark.parametrize("command", VERBOSE_COMMANDS, ids=lambda c: c[0])
def test_verbosity_flags_work_before_and_after_the_command(command):
    def verbosity(*argv):
        return build_parser().parse_args(list(argv)).verbose

    assert verbosity(*command) == 0
    assert verbosity("-vv", *command) == 2 and verbosity("-v", *command) == 1
    assert verbosity(*command, "-vv") == 2 and verbosity(*command, "-v") == 1
    assert verbosity(*command, "--verbose") == 1 and verbosity(*command[:1], "-v", *command[1:]) == 1
    assert verbosity("-v", *command, "-v") == 2  # counted wherever given
    if command[0] == "bench":  # (the benchmark's own options do not see it)
        assert build_parser().parse_args([*command, "-vv", "--no-report"]).options == [*command[2:], "--no-report"]


def test_verbosity_after_the_command_runs_and_is_in_every_help(capsys):
    code, out, err = run(capsys, "solve", "--graph", "chain:8", "--budget", "100%", "--method", "checkpoint_all",
                         "-vv", "--json")
    assert code == 0 and json.loads(out)["method"] == "checkpoint_all", err
    code, _, err = run(capsys, "bench", "sweep", "-vv", "--threads", "0", "--no-report")
    _one_line_usage_error(code, err)
    for path in [[]] + [path for path, _ in _subcommands(build_parser())]:
        assert main([*path, "--help"]) == 0
        text = capsys.readouterr().out
        assert "-v, --verbose" in text and "log progress (-vv for debug)" in text, path
    assert main(["bench", "--help"]) == 0
    assert "--no-report, and -v/-vv as before the command" in " ".join(capsys.readouterr().out.split())


def test_the_smallest_budget_stated_by_one_run_plans_in_the_next(capsys, tmp_path, monkeypatch):
    """The smallest budget comes from time-limited searches: stated by one run, it was refused by
    the next (which found a larger one in its time). The command line keeps the least-peak plan
    under $XDG_CACHE_HOME/remat/least-peak, and the next run plans that budget at once."""
    from remat.solvers import prepared

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prepared.clear()
    # (random:16:2: the exact least-peak search proves 85 MiB in seconds; in half a second, 86 MiB)
    code, out, err = run(capsys, "solve", "--graph", "random:16:2", "--budget", "1", "--time-limit", "30", "--json")
    assert code == 1, err
    stated = json.loads(out)["min_budget_bytes"]
    assert len(list((tmp_path / "remat" / "least-peak").glob("*.json"))) == 1
    prepared.clear()  # (a new process)
    code, out, err = run(capsys, "solve", "--graph", "random:16:2", "--budget", str(stated), "--time-limit", "0.5",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["peak_bytes"] <= stated
    prepared.clear()


def test_a_smallest_budget_shows_alike_in_every_row_of_a_sweep(capsys, tmp_path):
    """recompute_all on unet:8 needs 100.018% of checkpoint-all's peak: the rows below 100%
    said 'needs 100.0%', the 100% row 'needs 100.02%' (which, asked for, is refused: a budget
    above 100% needs no planning). Every row shows the bytes."""
    code, out, _ = run(capsys, "sweep", "--graph", "unet:8", "--methods", "recompute_all", "--budgets", "30%:100%:8",
                       "--out", str(tmp_path / "s.json"))
    least = _sweep_points(tmp_path / "s.json")[0]["min_budget_bytes"]
    assert code == 0 and out.count(f"({least} B)") == 8 and "needs 100." not in out


def test_estimated_costs_use_rates_kept_in_the_user_cache(capsys, monkeypatch, tmp_path):
    """Measured per process, the machine rates moved from run to run and every absolute cost
    with them; the command line keeps them under $XDG_CACHE_HOME/remat/rates."""
    from remat import cost

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ("solve", "--model", "mlp", "--costs", "estimate", "--budget", "100%", "--method", "checkpoint_all",
            "--json")
    cost._RATES.clear()
    code, out, err = run(capsys, *argv)
    [path] = (tmp_path / "remat" / "rates").glob("cpu-*threads-torch*.json")
    assert code == 0 and f"rates, measured, kept in {path}" in err.replace("\n", "")
    first = json.loads(out)["cost"]
    cost._RATES.clear()  # (a new process)
    code, out, err = run(capsys, *argv)
    assert code == 0 and f"rates, read from {path}" in err.replace("\n", "")
    assert json.loads(out)["cost"] == first
    # the costs are the file's: halved rates and a doubled overhead double every node's cost
    rates = json.loads(path.read_text())
    rates["cpu"].update(matmul_flops_per_us=rates["cpu"]["matmul_flops_per_us"] / 2,
                        bytes_per_us=rates["cpu"]["bytes_per_us"] / 2, op_overhead_us=rates["cpu"]["op_overhead_us"] * 2)
    path.write_text(json.dumps(rates))
    cost._RATES.clear()
    code, out, _ = run(capsys, *argv)
    assert code == 0 and json.loads(out)["cost"] == pytest.approx(2 * first, rel=1e-9)
    cost._RATES.clear()


def test_an_infeasible_json_record_goes_to_stdout_in_a_real_process(tmp_path):
    """Printed inside the planning activity, which points file descriptor 1 at stderr (for
    native libraries' banners), the record went to stderr and stdout stayed empty."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for extra in ([], ["--model", "mlp", "--costs", "estimate"]):
        target = extra or ["--graph", "chain:8"]
        proc = subprocess.run([sys.executable, "-m", "remat.cli", "solve", *target, "--budget", "1KiB" if extra
                               else "10%", "--method", "checkpoint_all", "--json"], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 1, proc.stderr
        assert json.loads(proc.stdout)["status"] == "infeasible", (target, proc.stdout, proc.stderr)


def test_a_budget_beyond_any_memory_is_a_usage_error(capsys):
    for budget in ("9223372036854775808", "1e300TB"):
        code, _, err = run(capsys, "solve", "--graph", "chain:8", "--budget", budget, "--method", "lp_round")
        _one_line_usage_error(code, err)
        assert "more bytes than any memory holds" in err


def test_a_batch_that_cannot_be_allocated_is_one_line(capsys, monkeypatch):
    import remat.models

    def allocate(name, batch, **options):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 12799999999872 bytes.\nmore detail")

    monkeypatch.setattr(remat.models, "get_workload", allocate)
    code, out, err = run(capsys, "solve", "--model", "mlp", "--batch", "99999999999", "--budget", "50%")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: out of memory: [enforce fail") and "--costs estimate" in err
    assert "more detail" not in err


def test_a_range_of_mixed_units_says_what_each_end_is(capsys):
    code, _, err = run(capsys, "sweep", "--graph", "chain:6", "--budgets", "0.3:1:3")
    _one_line_usage_error(code, err)
    assert ("0.3 is a fraction (30% of the peak) and 1 is 1 byte (a whole number is bytes; 100% is the whole peak), "
            "so LOW is above HIGH; write both ends alike, e.g. 30%:100%:3") in err


def test_a_needed_percentage_shown_is_rounded_up_so_that_it_plans(capsys, tmp_path):
    """chain:16 with chen_sqrtn needs 44.43% of its peak: shown as 44.4%, asking for it failed."""
    from remat.cli import _percent_at_least
    from remat.units import parse_budget

    for least, reference in ((8388608, 18874368), (999, 1000), (1, 3), (5714242, 5713218)):
        for digits in (1, 2, 3):
            text = _percent_at_least(least, reference, digits)
            value = float(text[:-1])
            assert value >= 100 * least / reference - 1e-9
            if value <= 100:
                assert parse_budget(text, reference) >= least and value - 10**-digits < 100 * least / reference
    code, _, _ = run(capsys, "sweep", "--graph", "chain:16", "--budgets", "30%,60%", "--methods", "chen_sqrtn",
                     "--out", str(tmp_path / "s.json"))
    shown = json.loads((tmp_path / "s.json").read_text())
    assert code == 0 and shown
    text = _percent_at_least(8388608, 18874368, 1)
    assert text == "44.5%"
    code, _, err = run(capsys, "solve", "--graph", "chain:16", "--budget", text, "--method", "chen_sqrtn")
    assert code == 0, err


def test_an_empty_results_file_is_a_new_one(capsys, tmp_path):
    out = tmp_path / "touched.json"
    out.write_text("")
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--budgets", "50%,100%", "--methods", "checkpoint_all",
                       "--out", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["results"]
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--out", ".json")
    _one_line_usage_error(code, err)
    assert "e.g. --out results.json" in err


@pytest.mark.parametrize("argv", [["methods"], ["solve", "--graph", "chain:8", "--budget", "50%", "--json"],
                                  ["solve", "--graph", "chain:8", "--budget", "1B", "--json"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(argv):
    """`remat methods | head -1`: the pipe closes before the output is written; that ended in a
    BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "remat.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # (the reader went away)
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 1 and "Traceback" not in err and "BrokenPipe" not in err


def test_output_that_cannot_be_written_is_one_line():
    """A full disk (/dev/full): one error line, not a traceback."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "remat.cli", "methods"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "error: could not finish: [Errno 28] No space left on device"]


def test_a_plot_format_that_needs_latex_is_refused_up_front(capsys, tmp_path, monkeypatch):
    """matplotlib writes .pgf through a TeX system: without one the sweep ended in a traceback
    after planning, and its table was not printed."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, _, err = run(capsys, "sweep", "--graph", "chain:4", "--methods", "chen_sqrtn", "--budgets", "60%",
                       "--out", str(tmp_path / "s.json"), "--plot", str(tmp_path / "p.pgf"))
    assert code == 2 and "matplotlib writes .pgf through" in err and "use .png, .pdf or .svg" in err


@pytest.mark.parametrize(("source", "said"), [
    ("raise ImportError('inner')\n", "(ImportError: inner)"),
    ("def f(:\n", "(SyntaxError: "),
    ("x = 1 / 0\n", "(ZeroDivisionError: division by zero)"),
])
def test_a_model_module_that_fails_to_import_is_named_as_such(capsys, tmp_path, monkeypatch, source, said):
    """It said 'calling it with the batch size failed', though nothing had been called."""
    name = f"broken_{abs(hash(source))}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, "solve", "--model", f"{name}:f", "--budget", "50%")
    assert code == 2 and f"importing module '{name}' failed at {name}.py:1 " in err and said in err
    assert "calling it" not in err and len(err.strip().splitlines()) == 1


def test_demo_checks_a_reversed_range_before_tracing(capsys, monkeypatch):
    import remat.compare

    def never(*args, **kwargs):
        raise AssertionError("traced before the usage error")

    monkeypatch.setattr(remat.compare, "compare_methods", never)
    code, _, err = run(capsys, "demo", "--model", "mlp", "--budgets", "100%:50%:3")
    assert code == 2 and "the range runs from LOW to HIGH, and 100% is above 50%" in err
    code, _, err = run(capsys, "demo", "--out", "x.txt")
    assert code == 2 and "--plot" not in err and "must end in .json" in err


def test_options_a_method_does_not_take_are_named_as_ignored(capsys):
    code, _, err = run(capsys, "solve", "--graph", "chain:8", "--budget", "50%", "--method", "chain", "--backend",
                       "highs", "--time-limit", "3")
    assert code == 0 and ("note: method 'chain' ignores --time-limit (which milp and lp_round take) and --backend "
                          "(which milp takes)") in err
    code, _, err = run(capsys, "solve", "--graph", "chain:8", "--budget", "50%", "--method", "milp", "--backend",
                       "highs", "--time-limit", "3")
    assert code == 0 and "ignores" not in err


def test_a_bare_number_budget_that_fits_no_plan_says_how_to_ask_for_a_percentage(capsys):
    """`--budget 60` is 60 bytes (as documented); the refusal said nothing of 60%, which
    `remat.optimize(budget="60")` says (the same rule: units.percent_meant)."""
    hint = "(--budget 60 is read as 60 bytes; for 60% of the checkpoint-all peak write --budget 60%)"
    code, out, err = run(capsys, "solve", "--graph", "chain:16", "--budget", "60", "--method", "chen_sqrtn")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("no plan fits: budget 60 B is infeasible") and hint in err
    code, out, err = run(capsys, "solve", "--graph", "chain:16", "--budget", "60", "--method", "chen_sqrtn", "--json")
    assert code == 1 and json.loads(out)["status"] == "infeasible" and hint in err
    for model in ([], ["--run"]):
        code, _, err = run(capsys, "solve", "--model", "mlp", "--batch", "4", "--costs", "estimate", "--budget", "60",
                           "--method", "checkpoint_all", *model)
        assert code == 1 and err.strip().splitlines()[-1].startswith("no plan fits: ") and hint in err, err
    for budget in ("60B", "1KiB", "101"):  # (bytes said as such, or more than a percentage)
        code, _, err = run(capsys, "solve", "--graph", "chain:16", "--budget", budget, "--method", "chen_sqrtn")
        assert code == 1 and "is read as" not in err, err


def test_bare_number_budgets_that_fit_no_plan_in_a_sweep_or_demo_are_noted(capsys, tmp_path):
    code, _, err = run(capsys, "sweep", "--graph", "chain:8", "--methods", "checkpoint_all", "--budgets",
                       "30,60,100%,1GiB", "--out", str(tmp_path / "s.json"))
    assert code == 0 and ("note: --budgets '30,60,100%,1GiB' reads 30 and 60 as bytes; for percentages of the "
                          "checkpoint-all peak write --budgets 30%,60%,100%,1GiB") in err, err
    code, _, err = run(capsys, "sweep", "--graph", "chain:8", "--methods", "checkpoint_all", "--budgets", "30:100:3",
                       "--out", str(tmp_path / "r.json"))
    assert code == 0 and "reads 30 and 100 as bytes" in err and "write --budgets 30%:100%:3" in err, err
    code, _, err = run(capsys, "sweep", "--graph", "chain:8", "--methods", "checkpoint_all", "--budgets", "50%,100%",
                       "--out", str(tmp_path / "p.json"))
    assert code == 0 and "note:" not in err, err
    code, _, err = run(capsys, "demo", "--model", "mlp", "--batch", "4", "--costs", "estimate", "--methods",
                       "checkpoint_all", "--budgets", "60,100%", "--out", str(tmp_path / "d.json"))
    assert code == 0 and ("note: --budgets '60,100%' reads 60 as bytes; for percentages of the checkpoint-all peak "
                          "write --budgets 60%,100%") in err, err
