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

__all__ = [
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
    "UnsupportedGraphError",
    "Violation",
    "methods",
    "simulate",
    "solve",
]
