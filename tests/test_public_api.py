"""The public API: everything in __all__ resolves, the public names stay the functions, a budget
means the same everywhere, and planning alone does not import torch."""

import json
import subprocess
import sys

import pytest

import remat
from remat.builders import chain_graph


def test_every_public_name_resolves():
    for name in remat.__all__:
        assert getattr(remat, name) is not None, name


def test_unknown_attribute_is_an_attribute_error():
    try:
        remat.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no attribute 'no_such_thing'" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_planning_does_not_import_torch():
    code = (
        "import sys, remat\n"
        "from remat.builders import chain_graph\n"
        "remat.solve(chain_graph(4), 2**40, method='chen_sqrtn')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trace_and_optimize_stay_the_functions_after_every_submodule_is_imported():
    # a fresh process: importing a submodule binds it to the package attribute of the same name
    code = (
        "import importlib, inspect, pkgutil, torch\n"
        "import remat\n"
        "for m in pkgutil.walk_packages(remat.__path__, 'remat.'):\n"
        "    importlib.import_module(m.name)\n"
        "from remat import optimize, trace\n"
        "assert inspect.isfunction(optimize) and inspect.isfunction(trace), (optimize, trace)\n"
        "assert remat.optimize is optimize and remat.trace is trace\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
        "batch = (torch.randn(3, 4), torch.randn(3, 1))\n"
        "def loss_fn(model, x, y):\n"
        "    return torch.nn.functional.mse_loss(model(x), y)\n"
        "for _ in range(2):\n"
        "    step = remat.optimize(model, batch, loss_fn, '100%', method='checkpoint_all', cost_model=None)\n"
        "    assert step(*batch).ndim == 0\n"
        "    assert remat.trace(model, batch, loss_fn, cost_model=None).graph.n > 0\n"
        "from remat.optimize import TrainingStep\n"
        "assert isinstance(step, TrainingStep) and isinstance(step, remat.TrainingStep)\n"
        "assert importlib.import_module('remat.optimize').optimize is optimize\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_budget_error_is_public_and_a_value_error():
    assert issubclass(remat.BudgetError, ValueError) and issubclass(remat.BudgetError, remat.RematError)


def test_method_error_is_public_a_value_error_and_what_an_unknown_method_raises():
    assert issubclass(remat.MethodError, ValueError) and issubclass(remat.MethodError, remat.RematError)
    with pytest.raises(remat.MethodError, match=r"unknown method 'checkmate' \(did you mean 'milp'\?\)"):
        remat.solve(chain_graph(2), 1, method="checkmate")


# ---------------------------------------------------------------------------- one budget everywhere
BAD_BUDGETS = [
    ("150%", r"percentage in \(0%, 100%\]"),
    ("1e400", "not a finite number"),
    (float("nan"), r"must be in \(0, 1\]"),
    (None, "give exactly one of budget="),
]


@pytest.mark.parametrize("budget, message", BAD_BUDGETS)
def test_a_bad_budget_is_the_same_error_in_optimize_and_the_backend(budget, message):
    import torch

    def never(model, x):
        raise AssertionError("checked before tracing")

    with pytest.raises(remat.BudgetError, match=message):
        remat.optimize(torch.nn.Linear(2, 1), (torch.randn(2, 2),), never, budget)
    with pytest.raises(remat.BudgetError, match=message):
        remat.backend(budget)


@pytest.mark.parametrize("limit", [0, -5, float("nan")])
def test_a_bad_time_limit_fails_when_the_backend_is_made(limit):
    with pytest.raises(remat.BudgetError, match="must be a positive, finite number of seconds"):
        remat.backend(0.6, method="milp", time_limit_s=limit)


def test_a_fraction_is_a_fraction_in_the_backend_and_the_cli(capsys):
    from remat.cli import main

    assert remat.backend(0.6).budget.fraction == remat.backend("0.6").budget.fraction == 0.6
    outcomes = []
    for budget in ("0.6", "60%"):
        code = main(["solve", "--graph", "chain:8", "--budget", budget, "--method", "chen_greedy", "--json"])
        outcomes.append((code, capsys.readouterr()))
    (code, got), (_, want) = outcomes
    assert code == 0 and json.loads(got.out)["budget_bytes"] == json.loads(want.out)["budget_bytes"]
