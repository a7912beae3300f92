"""Reference answers for solver tests: exhaustive search over every plan of a small graph,
judged by the simulator, and the small graphs it finishes on quickly."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from remat import Graph, InfeasibleBudgetError, Schedule, simulate, solve
from remat.builders import chain_graph, random_training_graph, training_graph, unet_graph


def checkpoint_all_peak(graph: Graph) -> int:
    return simulate(graph, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)).lower(graph)).peak_bytes


def transformer_like(blocks: int, *, width: int = 4, hidden: int = 16):
    """A residual stack that every block also reads a shared mask from (node 0), as attention
    does. Block k: ``a = f(h)``, ``b = g(a, mask)``, ``h' = h + b``. The mask ties every block
    together, so no h is an articulation point of the forward graph."""
    deps, sizes = [(), ()], [1, width]  # mask, h0
    h = 1
    for _ in range(blocks):
        a, b = len(deps), len(deps) + 1
        deps += [(h,), (a, 0), (h, b)]
        sizes += [hidden, hidden, width]
        h = b + 1
    deps.append((h,))
    sizes.append(width)
    return training_graph(deps, sizes, [1.0] * len(deps), name=f"transformer{blocks}")


def min_budget(graph, method, **options):
    """The smallest budget ``method`` says it can meet (budget 1 B fits no plan here)."""
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, 1, method=method, **options)
    return info.value.min_budget_bytes


def budget_between(graph: Graph, low: int, where: float) -> int:
    """The budget ``where`` of the way from ``low`` (a smallest budget) to checkpoint-all's peak."""
    return low + int(where * (checkpoint_all_peak(graph) - low))


def assert_no_baseline_cheaper(graph: Graph, budget: int, objective: float) -> None:
    """No baseline method plans ``graph`` under ``budget`` for less than ``objective``."""
    from remat.solvers.milp_start import BASELINE_METHODS

    for method in BASELINE_METHODS:
        try:
            other = solve(graph, budget, method=method)
        except Exception:  # noqa: BLE001 - a baseline that cannot plan this budget is fine
            continue
        assert objective <= other.objective + 1e-9, method


def exhaustive_search(graph: Graph, budget_bytes: int, *, any_plan: bool = False) -> float | None:
    """Exhaustive search over every compute matrix R, judged by the simulator.

    Returns the least cost of a plan whose peak fits ``budget_bytes`` (None if none), or with
    ``any_plan`` the cost of the first fitting plan found.

    Depth-first over stages; stage t picks a subset of the earlier recomputable non-output
    nodes, cheapest subsets first. Pruned by (a) cost: spent so far plus the remaining
    diagonal reaches the best found; (b) memory: in any completion an instance lives at least
    until its last read among the stages decided so far, so a prefix whose lifetimes overflow
    the budget has no completion that fits; (c) dominance: an extra computation that nothing
    reads before its node is computed again can be dropped at no more cost or memory, so an
    extra computation not read yet lives at least to the end of the prefix. Every
    complete R that survives is judged by the simulator itself.
    """
    n, costs, sizes = graph.n, graph.costs, graph.out_bytes
    deps = [node.deps for node in graph.nodes]
    outputs = graph.output_set
    movable = [i for i, node in enumerate(graph.nodes) if node.recomputable and i not in outputs]
    remaining = [sum(costs[t:]) for t in range(n + 1)]
    options = []
    for t in range(n):
        cands = [i for i in movable if i < t]
        subsets = [s for k in range(len(cands) + 1) for s in itertools.combinations(cands, k)]
        options.append(sorted(subsets, key=lambda s: sum(costs[i] for i in s)))
    best = [math.inf]

    def prefix_fits(order: list[int], extra: list[bool]) -> bool:
        last: dict[int, int] = {}
        end: list[int] = []
        read: list[bool] = []
        for p, v in enumerate(order):
            for d in deps[v]:
                end[last[d]], read[last[d]] = p, True
            if v in last and extra[last[v]] and not read[last[v]] and v not in outputs:
                return False
            last[v] = p
            end.append(p)
            read.append(False)
        diff = [0] * (len(order) + 1)
        for q, v in enumerate(order):
            # (c) again: an extra computation not read yet is read later, so it lives on
            stop = len(order) - 1 if extra[q] and not read[q] and last[v] == q else end[q]
            diff[q] += sizes[v]
            diff[stop + 1] -= sizes[v]
        live = graph.fixed_bytes
        for p in range(len(order)):
            live += diff[p]
            if live > budget_bytes:
                return False
        return True

    def visit(t: int, order: list[int], extra: list[bool], rows: list[tuple], cost: float) -> None:
        if cost + remaining[t] >= best[0] - 1e-9 or (any_plan and best[0] < math.inf):
            return
        if t == n:
            R = np.zeros((n, n), dtype=bool)
            for s, row in enumerate(rows):
                R[s, [*row, s]] = True
            sim = simulate(graph, Schedule.from_compute(graph, R).lower(graph))
            if sim.ok and sim.peak_bytes <= budget_bytes:
                best[0] = sim.total_cost
            return
        for subset in options[t]:
            o = [*order, *subset, t]
            e = [*extra, *([True] * len(subset)), False]
            if prefix_fits(o, e):
                visit(t + 1, o, e, [*rows, subset], cost + sum(costs[i] for i in subset) + costs[t])

    visit(0, [], [], [], 0.0)
    return None if best[0] == math.inf else best[0]


def exhaustive_min_cost(graph: Graph, budget_bytes: int) -> float | None:
    return exhaustive_search(graph, budget_bytes)


def exhaustive_min_peak(graph: Graph) -> int:
    """The least budget some plan meets: feasibility searches upward from what computing
    the largest node with its inputs needs."""
    budget = graph.fixed_bytes + max(
        node.out_bytes + sum(graph.out_bytes[d] for d in node.deps) for node in graph.nodes
    )
    while exhaustive_search(graph, budget, any_plan=True) is None:
        budget += 1
    return budget


#: Every graph here has at most 9 nodes; the random seeds are those whose exhaustive search
#: finishes in well under a second (some 9-node graphs, e.g. seed 2, take minutes).
SMALL_GRAPHS = [
    *(chain_graph(k, bytes_per_node=1) for k in (1, 2, 3, 4)),
    unet_graph(1, base_bytes=4096),
    random_training_graph(2, seed=3),
    *(random_training_graph(3, seed=s) for s in (0, 2, 10)),
    *(random_training_graph(4, seed=s) for s in (0, 1, 8, 10)),
    random_training_graph(4, seed=3, fixed_bytes=5),
]


