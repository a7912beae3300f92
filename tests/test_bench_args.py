"""The scripts of bench/ and examples/ check their arguments as the `remat` command does: bad
usage exits with status 2 and one line (``script.py: error: ...`` naming the option), never a
traceback, never silently something else, and before any work starts (each script's work is
replaced here by a function that fails the test if it is called). Every option has a help text
that states its default, and a run that measured nothing leaves the stored results as they were."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import ROOT, load_script

#: script -> (module name in sys.modules, the functions that do its work)
SCRIPTS = {
    "bench/budget_sweep.py": ("bench_budget_sweep", ("run",)),
    "bench/busy_cpu.py": ("bench_busy_cpu", ("measure",)),
    "bench/cuda_check.py": ("bench_cuda_check", ("check_model",)),
    "bench/demo_gpt2.py": ("bench_demo_gpt2", ("run",)),
    "bench/distributed.py": ("bench_distributed", ("measure_engine",)),
    "bench/floor_anatomy.py": ("bench_floor_anatomy", ("anatomy",)),
    "bench/holdout.py": ("bench_holdout", ("check_model",)),
    "bench/max_batch.py": ("bench_max_batch", ("run",)),
    "bench/report.py": ("bench_report", ("render",)),
    "bench/solver_scaling.py": ("bench_solver_scaling", ("run",)),
    "bench/spot_checks.py": ("bench_spot_checks", ("check_model",)),
    "bench/step_overhead.py": ("bench_step_overhead", ("measure",)),
    "bench/vs_pytorch.py": ("bench_vs_pytorch", ("workloads", "measure_model")),
    "bench/zoo.py": ("bench_zoo", ("run",)),
    "examples/distributed.py": ("example_distributed", ()),
    "examples/train_loop.py": ("example_train_loop", ()),
}


def script(path: str):
    return load_script(path, SCRIPTS[path][0])


@pytest.fixture(autouse=True)
def torch_state(monkeypatch):
    """What a script's main sets for the process (threads, dynamo's settings) is put back."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    settings = [(torch._dynamo.config, "recompile_limit"), (torch._dynamo.config, "fail_on_recompile_limit_hit"),
                (torch._functorch.config, "enable_autograd_cache"), (torch._inductor.config, "fx_graph_cache")]
    before = [getattr(config, name) for config, name in settings]
    threads = torch.get_num_threads()
    monkeypatch.delenv("RANK", raising=False)  # (examples/distributed.py: not under torchrun)
    yield
    torch.set_num_threads(threads)
    for (config, name), value in zip(settings, before):
        setattr(config, name, value)


def no_work(monkeypatch, path: str):
    """The script, its work replaced by a failure: a check that comes after the work started fails."""
    module = script(path)
    for name in SCRIPTS[path][1]:
        def started(*args, _name=name, **kwargs):
            raise AssertionError(f"{path}: {_name}() started before the arguments were checked")

        monkeypatch.setattr(module, name, started)
    return module


def refused(capsys, main, argv: list[str], prog: str, option: str) -> str:
    """``main(argv)`` exits 2 with one line, ``prog: error: ...``, that names ``option``."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert done.value.code == 2, (done.value.code, captured.err)
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert option in lines[0], (option, lines[0])
    return lines[0]


BAD_USAGE = [
    # 1. tracebacks
    ("bench/holdout.py", ["--time-limit", "0"], "--time-limit"),
    ("bench/holdout.py", ["--time-limit", "-1"], "--time-limit"),
    ("bench/demo_gpt2.py", ["--batch", "0"], "--batch"),
    ("bench/demo_gpt2.py", ["--time-limit", "0"], "--time-limit"),
    ("bench/spot_checks.py", ["--batch", "-3"], "--batch"),
    ("bench/spot_checks.py", ["--time-limit", "0"], "--time-limit"),
    ("bench/distributed.py", ["--time-limit-s", "0", "--quick"], "--time-limit-s"),
    ("bench/distributed.py", ["--method", "foo", "--quick"], "--method"),
    # 2. accepted silently, or checked after long work
    ("bench/spot_checks.py", ["--batch", "0"], "--batch"),
    ("bench/cuda_check.py", ["--device", "cpu", "--time-limit-s", "0"], "--time-limit-s"),
    ("bench/cuda_check.py", ["--device", "cpu", "--time-limit-s", "-1"], "--time-limit-s"),
    ("bench/cuda_check.py", ["--device", "cpu", "--method", "foo"], "--method"),
    ("bench/vs_pytorch.py", ["--variants", "nosuch"], "--variants"),
    ("bench/vs_pytorch.py", ["--rounds", "0"], "--rounds"),
    ("bench/vs_pytorch.py", ["--method", "foo", "--quick"], "--method"),
    ("bench/vs_pytorch.py", ["--time-limit-s", "-1", "--quick"], "--time-limit-s"),
    # 3. exit 1
    ("bench/vs_pytorch.py", ["--models", "nosuch"], "--models"),
    # the same gaps elsewhere: 0 read as "not given", empty lists, infinite time limits, negative deadlines
    ("bench/cuda_check.py", ["--device", "cpu", "--rounds", "0"], "--rounds"),
    ("bench/cuda_check.py", ["--device", "cpu", "--deadline-s", "-1"], "--deadline-s"),
    ("bench/cuda_check.py", ["--device", "cpu", "--models", ","], "--models"),
    ("bench/distributed.py", ["--rounds", "0", "--quick"], "--rounds"),
    ("bench/distributed.py", ["--engines", ",", "--quick"], "--engines"),
    ("bench/vs_pytorch.py", ["--variants", ","], "--variants"),
    ("bench/vs_pytorch.py", ["--models", ","], "--models"),
    ("bench/holdout.py", ["--models", ","], "--models"),
    ("bench/spot_checks.py", ["--models", ","], "--models"),
    ("bench/zoo.py", ["--models", ","], "--models"),
    ("bench/zoo.py", ["--precisions", ","], "--precisions"),
    ("bench/zoo.py", ["--time-limit", "inf"], "--time-limit"),
    ("bench/solver_scaling.py", ["--time-limit", "inf"], "--time-limit"),
    ("bench/budget_sweep.py", ["--time-limit", "inf", "--models", "mlp:2"], "--time-limit"),
    ("bench/max_batch.py", ["--time-limit", "inf", "--models", "mlp"], "--time-limit"),
    ("bench/busy_cpu.py", ["--busy", "0"], "--busy"),
    ("bench/busy_cpu.py", ["--budgets", "0.5,1.5"], "--budgets"),
]
if not torch.cuda.is_available():  # ('cuda-free' was accepted, then remat.backend raised a traceback)
    BAD_USAGE.append(("examples/train_loop.py", ["--model", "mlp", "--budget", "cuda-free"], "--budget"))


@pytest.mark.parametrize("path, argv, option", BAD_USAGE)
def test_bad_usage_is_one_line_and_exit_2_before_any_work(capsys, monkeypatch, tmp_path, path, argv, option):
    module = no_work(monkeypatch, path)
    if path in ("bench/cuda_check.py", "bench/vs_pytorch.py", "bench/holdout.py", "bench/spot_checks.py",
                "bench/zoo.py", "bench/solver_scaling.py", "bench/budget_sweep.py", "bench/max_batch.py",
                "bench/busy_cpu.py"):
        argv = [*argv, "--out", str(tmp_path / "out.json")]  # (nothing is written to bench/results)
    refused(capsys, module.main, argv, Path(path).name, option)
    assert not (tmp_path / "out.json").exists()


def test_busy_cpu_names_each_option_on_its_own(capsys, monkeypatch):
    """5. --time-limit 0 blamed the default --budgets ("--budgets must be fractions ... and
    --time-limit positive"); --rounds and --busy were named together."""
    busy = no_work(monkeypatch, "bench/busy_cpu.py")
    line = refused(capsys, busy.main, ["--time-limit", "0"], "busy_cpu.py", "--time-limit")
    assert "--budgets" not in line and "0.4,0.5,0.7" not in line
    assert "--busy" not in refused(capsys, busy.main, ["--rounds", "0"], "busy_cpu.py", "--rounds")
    assert "--rounds" not in refused(capsys, busy.main, ["--busy", "-2"], "busy_cpu.py", "--busy")


def test_floor_anatomy_lists_solver_scalings_workloads(capsys, monkeypatch, tmp_path):
    """6. It suggested `bench/solver_scaling.py --workloads gpt2-3L`, which that script refuses."""
    anatomy = no_work(monkeypatch, "bench/floor_anatomy.py")
    scaling = tmp_path / "solver_scaling.json"
    scaling.write_text(json.dumps({"workloads": {"gpt2-2L": {}}}))
    monkeypatch.setattr(anatomy, "SCALING", scaling)
    line = refused(capsys, anatomy.main, ["--workload", "gpt2-3L"], "floor_anatomy.py", "--workload")
    assert "solver_scaling.py --workloads gpt2-3L" not in line
    assert "gpt2-2L" in line and "gpt2-48L" in line


@pytest.mark.parametrize("argv, option", [
    (["--budget", "abc"], "--budget"),
    (["--budget", "150%"], "--budget"),
    (["--method", "foo"], "--method"),
    (["--atol", "-1"], "--atol"),
    (["--atol", "nan"], "--atol"),
    (["--steps", "0"], "--steps"),
    (["--batch", "0"], "--batch"),
    (["--seq", "1"], "--seq"),
    (["--layers", "0"], "--layers"),
    (["--width", "30"], "--width"),
    (["--vocab", "0"], "--vocab"),
    (["--threads", "0"], "--threads"),
    (["--bogus"], "--bogus"),
])
def test_distributed_example_checks_its_options_before_torchrun(capsys, argv, option):
    """7. It printed the whole usage before each error, and said "run me with torchrun" before
    it looked at the options."""
    example = script("examples/distributed.py")
    line = refused(capsys, example.main, ["--fsdp", *argv], "distributed.py", option)
    assert "torchrun" not in line
    # good options, outside torchrun: the one line that says how to run it
    with pytest.raises(SystemExit) as done:
        example.main(["--fsdp"])
    assert done.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "distributed.py: error: run me with torchrun, e.g. torchrun --nproc-per-node 2 examples/distributed.py --ddp"]


def test_replots_of_a_missing_file_are_one_line(capsys, monkeypatch, tmp_path):
    """--replot / --plot-only of a results file that is not there: a traceback before."""
    missing = tmp_path / "missing.json"
    distributed = no_work(monkeypatch, "bench/distributed.py")
    monkeypatch.setattr(distributed, "QUICK_RESULTS", missing)
    refused(capsys, distributed.main, ["--replot", "--quick"], "distributed.py", "--replot")
    vs = no_work(monkeypatch, "bench/vs_pytorch.py")
    refused(capsys, vs.main, ["--replot", "--out", str(missing)], "vs_pytorch.py", "--replot")
    overhead = no_work(monkeypatch, "bench/step_overhead.py")
    monkeypatch.setattr(overhead, "RESULTS", missing)
    refused(capsys, overhead.main, ["--replot"], "step_overhead.py", "--replot")
    scaling = no_work(monkeypatch, "bench/solver_scaling.py")
    refused(capsys, scaling.main, ["--plot-only", "--out", str(missing)], "solver_scaling.py", "--plot-only")
    assert not missing.exists()


def test_step_overhead_refuses_a_results_file_it_would_lose_before_any_work(capsys, monkeypatch, tmp_path):
    """A run keeps the stored rows of the models it does not measure: a file it cannot read is
    refused before measuring, and left as it is."""
    overhead = no_work(monkeypatch, "bench/step_overhead.py")
    bad = tmp_path / "step_overhead.json"
    monkeypatch.setattr(overhead, "RESULTS", bad)
    for text in ("{not json", '{"models": {}}'):
        bad.write_text(text)
        line = refused(capsys, overhead.main, ["--models", "gpt2-tiny"], "step_overhead.py", "results file")
        assert "is not a results file of step_overhead.py" in line and bad.read_text() == text


def stored_meta(path: Path) -> dict:
    return json.loads(path.read_text())["meta"]


def test_vs_pytorch_run_that_measures_nothing_keeps_the_stored_provenance(capsys, monkeypatch, tmp_path):
    """4. A run that measured nothing rewrote "command", "started" and "finished" of the results."""
    vs = script("bench/vs_pytorch.py")
    out = tmp_path / "vs.json"
    meta = {"command": "python bench/vs_pytorch.py --models gpt2-d0", "started": "2026-01-01 00:00:00",
            "finished": "2026-01-01 01:00:00", "rounds": 5, "threads": 1}
    out.write_text(json.dumps({"format": "remat.results", "meta": meta, "results": []}))
    before = out.read_text()
    monkeypatch.setattr(vs, "workloads", lambda args: [vs.Workload("tiny", {}, None, (), None, [])])
    monkeypatch.setattr(vs, "measure_model", lambda *args: print("  nothing to measure"))
    assert vs.main(["--models", "resnet50", "--variants", "eager", "--rounds", "3", "--out", str(out)]) == 0
    assert out.read_text() == before


def test_cuda_check_run_that_measures_nothing_keeps_the_stored_provenance(capsys, monkeypatch, tmp_path):
    cuda_check = script("bench/cuda_check.py")
    out = tmp_path / "check.json"
    meta = {"command": "python bench/cuda_check.py --device cpu --quick", "measured": "2026-01-01 00:00"}
    out.write_text(json.dumps({"meta": meta, "models": {"gpt2@8": {"variants": {}}}}))
    before = out.read_text()
    monkeypatch.setattr(cuda_check, "check_model", lambda *args: print("gpt2@8: done already"))
    monkeypatch.setattr(cuda_check, "markdown", lambda results: results["meta"]["command"])
    assert cuda_check.main(["--device", "cpu", "--quick", "--models", "gpt2", "--out", str(out)]) == 0
    assert out.read_text() == before
    assert meta["command"] in capsys.readouterr().out


class Captured(Exception):
    """Raised where a script parses its command line: its parser was taken."""


def parser_of(monkeypatch, path: str) -> argparse.ArgumentParser:
    """The parser the script's main builds (taken where it starts parsing, before any work)."""
    seen = {}

    def capture(self, args=None, namespace=None):
        seen.setdefault("parser", self)
        raise Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(Captured):
        script(path).main([])
    return seen["parser"]


@pytest.mark.parametrize("path", sorted(SCRIPTS))
def test_every_option_has_help_that_states_its_default(monkeypatch, path):
    """8. demo_gpt2's --batch and --threads, floor_anatomy's --out had no help; examples/
    distributed.py's options stated no default."""
    parser = parser_of(monkeypatch, path)
    assert parser.prog == Path(path).name  # (the name every error line starts with)
    parser.format_help()  # (every help text formats)
    for action in parser._actions:
        if not action.option_strings or "-h" in action.option_strings:
            continue
        assert action.help and action.help != argparse.SUPPRESS, (path, action.option_strings)
        if action.nargs != 0:  # (an option that takes a value)
            assert "default" in action.help, (path, action.option_strings, action.help)


def test_busy_cpu_models_help_reads_right(monkeypatch):
    """8. "comma-separated subset of gpt2-tiny (default all)"."""
    parser = parser_of(monkeypatch, "bench/busy_cpu.py")
    models = next(a for a in parser._actions if "--models" in a.option_strings)
    assert "subset of gpt2-tiny" not in models.help and "default all" not in models.help


@pytest.mark.parametrize("path, argv, option", [
    ("bench/holdout.py", ["--time-limit", "0"], "--time-limit"),
    ("bench/vs_pytorch.py", ["--models", "nosuch"], "--models"),  # (it re-executes itself first)
    ("examples/distributed.py", ["--budget", "abc"], "--budget"),
])
def test_run_as_a_command_bad_usage_is_one_line(path, argv, option):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, str(ROOT / path), *argv], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", done.stderr
    assert lines[0].startswith(f"{Path(path).name}: error: ") and option in lines[0], lines[0]
