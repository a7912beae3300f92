"""Every promise of the README holds: its Python snippets run as written (with a small model,
loader and optimizer standing in for the reader's), and every command line in it runs (fast
ones as written, slow ones with --help)."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)

#: Command lines that take minutes (or build a virtual environment): checked with --help, or
#: against the Makefile. Every other command line of the README runs as written.
SLOW = {
    "make demo": "Makefile target",
    "make test": "Makefile target",
    "remat solve --model vgg16 --batch 256 --costs estimate --budget 60% --time-limit 30": "--help",
    "remat bench sweep": "--help",
    "remat bench max-batch": "--help",
    "python bench/spot_checks.py": "--help",
    "python bench/vs_pytorch.py": "--help",
    "python bench/holdout.py": "--help",
    "python bench/zoo.py": "--help",
    "python bench/distributed.py": "--help",
    "torchrun --nproc-per-node 2 examples/distributed.py --check --ddp": "--help",
    "torchrun --nproc-per-node 2 examples/distributed.py --check --fsdp": "--help",
    "python bench/solver_scaling.py": "--help",
    "python bench/floor_anatomy.py": "--help",
    "python bench/step_overhead.py": "--help",
    "python bench/busy_cpu.py": "--help",
    "python examples/train_loop.py --check": "--help",
}


def blocks(language: str) -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(2)) for m in BLOCK.finditer(text) if m.group(1) == language]


def command_lines() -> list[str]:
    lines = []
    for _, block in blocks(""):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line:
                lines.append(line)
    return lines


def test_the_readme_has_what_these_tests_check():
    assert len(blocks("python")) == 6
    assert "remat methods" in command_lines() and "make demo" in command_lines()


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """What the README's snippets assume the reader has: a model, a loader, an optimizer."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the backend's plan cache
    torch.manual_seed(0)
    # narrow and deep enough that activations dominate and the MILP proves its plan in seconds
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 10))
    data = TensorDataset(torch.randn(3 * 4096, 32), torch.randint(0, 10, (3 * 4096,)))
    loader = DataLoader(data, batch_size=4096, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "loader": loader, "optimizer": optimizer, "__name__": "readme"}


def test_python_snippets_run_as_written(stand_ins, capsys):
    from remat.backend import RematFallbackWarning

    (line1, optimize_snippet), (line4, scaler_snippet), (line2, backend_snippet), (line3, graph_snippet), _, _ = \
        blocks("python")
    namespace = stand_ins
    model = namespace["model"]
    before = [p.detach().clone() for p in model.parameters()]
    exec(compile(optimize_snippet, f"README.md:{line1}", "exec"), namespace)
    report = namespace["step"].report
    assert report.method == "milp" and report.predicted_peak_bytes <= report.budget_bytes
    assert report.budget_bytes == int(0.6 * report.checkpoint_all_peak_bytes)
    assert "overhead" in capsys.readouterr().out  # print(step.report)
    assert all(not p.equal(q) for p, q in zip(model.parameters(), before))  # it trained

    import torch

    # the GradScaler recipe, on this machine's CPU (CPU autocast runs float16 too)
    assert scaler_snippet.count('"cuda"') == 3
    scaler_namespace = {**namespace, "model": copy.deepcopy(model)}
    scaler_namespace["optimizer"] = torch.optim.SGD(scaler_namespace["model"].parameters(), lr=0.1)
    exec(compile(scaler_snippet.replace('"cuda"', '"cpu"'), f"README.md:{line4}", "exec"), scaler_namespace)
    assert scaler_namespace["step"].report.predicted_peak_bytes <= scaler_namespace["step"].report.budget_bytes
    assert scaler_namespace["scaler"].get_scale() > 0 and scaler_namespace["scaled_loss"].item() > 0

    # a reader's process compiles from scratch: a test that compiled an nn.Sequential with
    # another batch size in this process made dynamo compile this one with symbolic shapes
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)  # the backend planned, did not fall back
        exec(compile(backend_snippet, f"README.md:{line2}", "exec"), namespace)
    assert namespace["loss"].requires_grad and all(p.grad is not None for p in model.parameters())

    exec(compile(graph_snippet, f"README.md:{line3}", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.startswith("SolveStatus.OPTIMAL")


def test_the_model_spec_snippet_plans_from_the_command_line(tmp_path):
    """The README's own ``package.module:function`` model, saved as the file it names and run
    with the command its first line gives, from that folder."""
    [(line, snippet)] = [b for b in blocks("python") if b[1].startswith("# mymodels.py; then: ")]
    command = snippet.splitlines()[0].removeprefix("# mymodels.py; then: ")
    (tmp_path / "mymodels.py").write_text(snippet)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*_argv(command), "--json"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=600)
    assert proc.returncode == 0, f"README.md:{line}: {proc.stderr}"
    record = json.loads(proc.stdout)
    assert record["model"] == "mymodels:make" and record["batch"] == 4096
    assert record["peak_bytes"] <= record["budget_bytes"]


def _argv(line: str) -> list[str]:
    words = shlex.split(line)
    if words[0] == "remat":
        return [sys.executable, "-m", "remat.cli", *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    raise AssertionError(f"README command {line!r}: this test does not know how to run it")


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("line", command_lines())
def test_command_lines_run(line, tmp_path):
    how = SLOW.get(line)
    if how == "Makefile target":
        target = line.split()[1]
        makefile = (ROOT / "Makefile").read_text()
        recipe = makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
        assert recipe.strip(), f"make {target} has no recipe"
        if target == "demo":  # the recipe is `remat demo`: its arguments parse
            assert "remat demo" in recipe
            done = _run(_argv("remat demo --help"), tmp_path)
            assert done.returncode == 0 and "--budgets" in done.stdout
        else:
            assert "pytest" in recipe
        return
    if how == "--help":
        done = _run(_argv(line) + ["--help"], ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "usage:" in done.stdout
        return
    assert how is None
    if "bench/report.py" in line:  # it rewrites BENCHMARKS.md next to bench/: run it on a copy
        shutil.copytree(ROOT / "bench", tmp_path / "bench", ignore=shutil.ignore_patterns("plots"))
        done = _run(_argv(line), tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert (tmp_path / "BENCHMARKS.md").read_text().startswith("# Benchmarks")
        return
    done = _run(_argv(line), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    if "--out" in line:
        out = shlex.split(line)[shlex.split(line).index("--out") + 1]
        assert (tmp_path / out).exists() and (tmp_path / out).with_suffix(".png").exists()
    assert done.stdout.strip()


def test_the_ddp_snippet_runs_as_written(tmp_path, monkeypatch):
    """The DDP snippet, in a one-rank gloo group, with a model whose forward returns the loss."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from remat.backend import RematFallbackWarning

    (line, snippet), = [b for b in blocks("python") if "DDP(model)" in b[1]]

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 10))

        def forward(self, batch):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        namespace = {"__name__": "readme", "remat": __import__("remat"), "torch": torch, "DDP": DDP, "model": WithLoss(),
                     "batch": (torch.randn(4096, 32), torch.randint(0, 10, (4096,)))}
        with warnings.catch_warnings():
            warnings.simplefilter("error", RematFallbackWarning)  # planned, not fallen back
            exec(compile(snippet, f"README.md:{line}", "exec"), namespace)
        assert namespace["loss"].ndim == 0
        assert all(p.grad is not None for p in namespace["model"].parameters())
    finally:
        dist.destroy_process_group()
