"""Planning methods. ``solve(graph, budget_bytes, method=...)`` dispatches by name."""

from remat.solvers.base import (
    SolveResult,
    SolverStats,
    SolveStatus,
    finish,
    methods,
    register,
    solve,
)

__all__ = ["SolveResult", "SolveStatus", "SolverStats", "finish", "methods", "register", "solve"]
