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

#: The modules whose code decides which plan a graph and a budget get.
_PLANNER_SOURCES = ("graph.py", "schedule.py", "simulate.py", "coarsen.py", "cuts.py", "planning.py")


@functools.cache
def planner_version() -> str:
    """A short digest of the planning code (this package and the modules it plans with): results
    stored by a benchmark or a plan cache under another digest came from other code.

    >>> len(planner_version())
    12
    """
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in [*sorted(root.glob("*.py")), *(root.parent / name for name in _PLANNER_SOURCES)]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
