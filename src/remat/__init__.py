"""remat: optimal tensor rematerialization for PyTorch.

Trace a training step, choose which activations to keep and which to recompute so that the
step fits a memory budget at the least extra compute, and run that plan with the same
gradients as plain PyTorch.
"""

from remat.errors import (
    GraphError,
    InfeasibleBudgetError,
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


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")

__all__ = [
    "CostModel",
    "Graph",
    "GraphError",
    "InfeasibleBudgetError",
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
