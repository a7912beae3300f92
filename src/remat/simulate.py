"""The simulator: the single source of truth for a plan's validity, peak memory and cost.

Accounting (the same rules the MILP uses): memory at any instant is the graph's
``fixed_bytes`` plus the bytes of every live node output. ``Compute(i)`` allocates node i's
output while its inputs are still live, and holds the node's ``temp_bytes`` of scratch
space while it runs, and its ``kept_bytes`` (step outputs of a grouped node) for good;
``Free(i)`` releases an output. The peak is the largest memory after
any step, scratch space included.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.errors import ScheduleError
from remat.graph import Graph
from remat.schedule import Plan, StepKind


@dataclass(frozen=True)
class Violation:
    """One rule a plan breaks, at one step (``step_index`` -1: at the end of the plan)."""

    step_index: int
    node: int
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class SimResult:
    """What replaying a plan shows. ``timeline_bytes[k]`` is memory right after step k."""

    peak_bytes: int
    total_cost: float
    timeline_bytes: tuple[int, ...]
    compute_counts: tuple[int, ...]
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def peak_step(self) -> int:
        """Index of the first step at which the peak is reached (-1 for an empty plan)."""
        if not self.timeline_bytes:
            return -1
        return self.timeline_bytes.index(max(self.timeline_bytes))

    def raise_if_invalid(self) -> None:
        """Raise ``ScheduleError`` listing the first violations, if there are any."""
        if self.violations:
            shown = "; ".join(v.message for v in self.violations[:5])
            more = f" (and {len(self.violations) - 5} more)" if len(self.violations) > 5 else ""
            raise ScheduleError(f"plan is invalid: {shown}{more}")


def simulate(graph: Graph, plan: Plan) -> SimResult:
    """Replay ``plan`` on ``graph`` and account for every byte.

    >>> from remat.builders import chain_graph
    >>> from remat.solvers import solve
    >>> g = chain_graph(3, bytes_per_node=1)
    >>> sim = simulate(g, solve(g, 100, method="checkpoint_all").plan)
    >>> sim.peak_bytes, sim.total_cost, sim.ok
    (5, 7.0, True)
    """
    n = graph.n
    nodes = graph.nodes
    out_bytes = graph.out_bytes
    live = [False] * n
    counts = [0] * n
    memory = graph.fixed_bytes
    peak = memory
    cost = 0.0
    timeline: list[int] = []
    violations: list[Violation] = []
    compute, free = StepKind.COMPUTE, StepKind.FREE

    def bad(k: int, node: int, message: str) -> None:
        violations.append(Violation(k, node, message))

    # The loop runs once per step of plans with tens of thousands of steps: messages are
    # formatted only when a rule is broken.
    for k, step in enumerate(plan.steps):
        i = step.node
        if not isinstance(i, int) or not 0 <= i < n:
            bad(k, -1, f"step {k} names node {i!r}, which is not in graph {graph.name!r} (0..{n - 1})")
            timeline.append(memory)
            continue
        kind = step.kind
        if kind is compute:
            node = nodes[i]
            for d in node.deps:
                if not live[d]:
                    bad(
                        k,
                        i,
                        f"step {k} computes {graph.describe(i)} but its input {graph.describe(d)} is not "
                        f"live; compute the input first or do not free it before this step",
                    )
            if live[i]:
                bad(k, i, f"step {k} computes {graph.describe(i)} while its output is still live; free it first")
            else:
                if counts[i] and not node.recomputable:
                    bad(
                        k,
                        i,
                        f"step {k} recomputes {graph.describe(i)}, which must run once per step (not "
                        f"recomputable); keep its output instead",
                    )
                memory += out_bytes[i]
                live[i] = True
            if not counts[i]:
                memory += node.kept_bytes
            if memory + node.temp_bytes > peak:
                peak = memory + node.temp_bytes
            counts[i] += 1
            cost += node.cost
        elif kind is free:
            if not live[i]:
                bad(k, i, f"step {k} frees {graph.describe(i)}, which is not live")
            else:
                live[i] = False
                memory -= out_bytes[i]
        else:
            bad(k, i, f"step {k} has unknown kind {kind!r}")
        timeline.append(memory)
        if memory > peak:
            peak = memory

    for o in graph.outputs:
        if not live[o]:
            bad(-1, o, f"output {graph.describe(o)} is not live at the end of the plan; never free an output")
    return SimResult(
        peak_bytes=peak,
        total_cost=cost,
        timeline_bytes=tuple(timeline),
        compute_counts=tuple(counts),
        violations=tuple(violations),
    )
