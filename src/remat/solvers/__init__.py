"""Planning methods. ``solve(graph, budget_bytes, method=...)`` dispatches by name."""

import functools
import hashlib
from pathlib import Path

from remat.solvers.base import (
    SolveResult,
    SolverStats,
    SolveStatus,
    finish,
    methods,
    register,
    solve,
)

__all__ = ["SolveResult", "SolveStatus", "SolverStats", "finish", "methods", "planner_version", "register", "solve"]

#: Beside this package: the modules whose code decides the graph a traced step becomes and the
#: plan a graph gets.
_PLANNER_SOURCES = ("graph.py", "schedule.py", "simulate.py", "coarsen.py", "cuts.py", "planning.py", "trace.py",
                    "trace_errors.py", "fx_graph.py", "batch_norm.py", "eager_ops.py", "cost.py", "scratch.py")


@functools.cache
def planner_version() -> str:
    """A short digest of the code that turns a training step into a graph and a graph into a
    plan (this package, the tracer, the cost and scratch models, the built-in workloads):
    results stored by a benchmark or a plan cache under another digest came from other code.

    >>> len(planner_version())
    12
    """
    root = Path(__file__).resolve().parent
    package = root.parent
    digest = hashlib.sha256()
    sources = [*sorted(root.glob("*.py")), *(package / name for name in _PLANNER_SOURCES),
               *sorted((package / "models").glob("*.py"))]
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
