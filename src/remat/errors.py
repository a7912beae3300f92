"""The error tree of remat.

Every error names the offender, the rule it broke and a remedy. Catch ``RematError`` to catch
them all.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class GraphError(RematError, ValueError):
    """A graph breaks an invariant (a dependency out of order, a negative size, ...)."""


class UnsupportedGraphError(GraphError):
    """A method was asked to plan a graph whose shape it cannot handle (e.g. revolve on a DAG)."""


class ScheduleError(RematError, ValueError):
    """A schedule or plan is malformed or does not replay (an input not live, ...)."""


class MethodError(RematError, ValueError):
    """An unknown method, or an option its method does not take or a value it cannot use."""


class SolverError(RematError, RuntimeError):
    """A solver failed, is missing, or returned an answer the simulator contradicts."""


class TraceError(RematError):
    """A model, its inputs or its loss cannot be turned into a graph."""


class InfeasibleBudgetError(RematError):
    """No plan of the method fits the budget.

    ``min_budget_bytes`` is the smallest budget for which the method has a plan (None only if
    the method could not find any plan at all).
    """

    def __init__(
        self,
        *,
        budget_bytes: int,
        min_budget_bytes: int | None,
        method: str,
        graph_name: str = "graph",
        detail: str = "",
    ) -> None:
        from remat.units import format_bytes_exactly

        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = None if min_budget_bytes is None else int(min_budget_bytes)
        self.method = method
        self.graph_name = graph_name
        if self.min_budget_bytes is None:
            remedy = "no budget works for this method on this graph; try another method"
        else:
            remedy = (
                f"the smallest budget method {method!r} can meet is "
                f"{format_bytes_exactly(self.min_budget_bytes)}; raise the "
                f"budget to at least that"
            )
            if method != "milp":
                remedy += " or use method 'milp', which finds the cheapest plan at any feasible budget"
        message = (
            f"budget {format_bytes_exactly(self.budget_bytes)} is infeasible for "
            f"method {method!r} on graph {graph_name!r}: {remedy}"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message)

    def with_detail(self, detail: str) -> InfeasibleBudgetError:
        """The same refusal with ``detail`` in place of this one's."""
        return InfeasibleBudgetError(budget_bytes=self.budget_bytes, min_budget_bytes=self.min_budget_bytes,
                                     method=self.method, graph_name=self.graph_name, detail=detail)


def a_type(value: object) -> str:
    """``value``'s type with its article, for messages: "an int", "a float", "a NoneType"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def user_line(exc: BaseException) -> str:
    """`` at file.py:12`` where ``exc`` arose in the user's code: a syntax error's own place, else
    the innermost frame of its traceback outside remat and the libraries installed beside it;
    or ``""``."""
    import os
    import sysconfig
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        return f" at {os.path.basename(exc.filename)}:{exc.lineno}"
    skip = (os.path.dirname(os.path.abspath(__file__)), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"])
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and not os.path.abspath(f.filename).startswith(skip)]
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
