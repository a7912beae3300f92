"""remat: optimal tensor rematerialization for PyTorch.

Trace a training step, choose which activations to keep and which to recompute so that the
step fits a memory budget at the least extra compute, and run that plan with the same
gradients as plain PyTorch.
"""

import sys
import types

from remat.errors import (
    GraphError,
    InfeasibleBudgetError,
    MethodError,
    RematError,
    ScheduleError,
    SolverError,
    TraceError,
    UnsupportedGraphError,
)
from remat.graph import Graph, Node, NodeKind
from remat.schedule import Plan, Schedule, Step, StepKind
from remat.simulate import SimResult, Violation, simulate
from remat.solvers import SolveResult, SolverStats, SolveStatus, methods, solve
from remat.units import BudgetError

__version__ = "0.1.0"

# The PyTorch front end loads on first use, so that planning on graphs never imports torch.
_LAZY = {
    "trace": "remat.trace",
    "TracedStep": "remat.trace",
    "optimize": "remat.optimize",
    "TrainingStep": "remat.optimize",
    "CostModel": "remat.cost",
    "measure_peak": "remat.memory",
    "plan_graph": "remat.planning",
    "backend": "remat.backend",
}
#: Public functions that share their name with the submodule defining them.
_SHADOWED = frozenset({"trace", "optimize"})


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'remat' has no attribute {name!r}")


class _Package(types.ModuleType):
    """The ``remat`` package. Importing a submodule binds it to the package attribute of the
    same name; for ``remat.trace`` and ``remat.optimize`` that would replace the public
    function with its module (``remat.optimize(...)`` would then fail once anything had imported
    ``remat.optimize`` the module). The functions stay; the modules remain importable
    (``from remat.optimize import TrainingStep``, ``importlib.import_module``)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "BudgetError",
    "CostModel",
    "Graph",
    "GraphError",
    "InfeasibleBudgetError",
    "MethodError",
    "Node",
    "NodeKind",
    "Plan",
    "RematError",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "SolveResult",
    "SolveStatus",
    "SolverError",
    "SolverStats",
    "Step",
    "StepKind",
    "TraceError",
    "TracedStep",
    "TrainingStep",
    "UnsupportedGraphError",
    "Violation",
    "backend",
    "measure_peak",
    "methods",
    "optimize",
    "plan_graph",
    "simulate",
    "solve",
    "trace",
]
