"""Plans that run the forward pass again after an instant where nothing of it fits.

The retention model computes every forward value at most twice. At the smallest budgets of a
deep transformer that is not enough: at the loss gradient the logits, their softmax and its
gradient fill the budget, so nothing of the forward pass survives that instant; the final
hidden state is needed right after (the head's weight gradient), and so is every layer's
activations later, for the layers' backward. A plan must then run the forward pass again
from the input, and, since the recomputed activations of every layer cannot all stay while
the backward pass runs, compute most of them a third time.

This module gives the retention model that third computation. Take the instant ``t`` right
after node ``t`` is first computed. The *restarted graph* is the traced graph with a copy of
every value that a node after ``t`` reads and that is not live at ``t`` by force (``t``
itself, its inputs, the step outputs, values that cannot be recomputed), and of the inputs
those copies need, recursively. The copies sit right after ``t``, in id order, and every node
after ``t`` reads the copies instead of the originals. In the restarted graph the originals
are freed after their last reader up to ``t``; the copies are its "forward pass" as much as
the originals are: the retention model keeps each copy until its last reader, or frees it and
recomputes it once more. Mapped back (a copy is its original node, its computations and those
of the stages between ``t`` and ``t + 1`` run in stage ``t + 1``), a plan of the restarted
graph is a plan of the traced graph that computes a value up to three times, and the
simulator measures it like any other.

The plan space is narrower where something could stay across ``t``: every copy is computed
right after ``t``, so nothing but what must is kept there. It is offered where the retention
model has no plan at all, near the smallest budgets, at the bound's instant and the few
after it that the copies can wait for (``restart_instants``; 12-layer GPT-2 at its smallest
budget, 247.1 MB: 1.578x against 1.79x for the best lowered plan; 24-layer, 285.0 MB: 1.742x
against 1.914x). A plan the model overfills only in its own count is taken when the
simulator, run on the plan mapped back, fits it within the budget.

Its limit is the retention model's: one forward pass and one backward pass, so a value is
computed at most three times. The 48-layer GPT-2 at 364.4 MB (near its smallest budget) needs
more: the least model peak of the graph restarted there is 462 MB. Restarting the restarted
graph a second time does not help as it stands (the first restart's backward nodes become
the second graph's forward pass, where the model recomputes nothing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from remat.graph import Graph, Node, NodeKind
from remat.solvers.baselines import BaselinePlan, measure_by_stage
from remat.solvers.bounds import InstantBounds
from remat.solvers.retention import RetentionSolution, RetentionStructure, solve_retention

log = logging.getLogger("remat.solve")

#: Suffix of a copy's name in the restarted graph (names are unique in a graph).
COPY_SUFFIX = "@again"


@dataclass(frozen=True)
class Restarted:
    """The restarted graph of ``graph`` at ``instant`` (see the module). ``origin[i]`` is the
    node of ``graph`` that node i of ``restarted`` computes; ``stage[i]`` the stage of
    ``graph`` that computations in stage i of ``restarted`` belong to."""

    graph: Graph
    instant: int
    restarted: Graph
    origin: np.ndarray
    stage: np.ndarray
    copies: int


def restart_graph(graph: Graph, instant: int, bounds: InstantBounds | None = None) -> Restarted:
    """The restarted graph of ``graph`` at ``instant`` (see the module).

    >>> from remat.builders import chain_graph
    >>> r = restart_graph(chain_graph(3, bytes_per_node=1), 3)
    >>> r.copies, r.restarted.n, r.origin.tolist()
    (2, 9, [0, 1, 2, 3, 0, 1, 4, 5, 6])
    """
    n = graph.n
    bounds = bounds if bounds is not None else InstantBounds(graph)
    copies = _copied(graph, instant, bounds)
    copy_of = {v: instant + 1 + k for k, v in enumerate(copies)}
    shift = len(copies)
    nodes: list[Node] = []
    for i in range(instant + 1):
        node = graph.nodes[i]
        nodes.append(Node(node.name, NodeKind.FORWARD, node.deps, node.out_bytes, node.cost, node.recomputable,
                          node.temp_bytes, node.kept_bytes))
    for v in copies:
        node = graph.nodes[v]
        nodes.append(Node(node.name + COPY_SUFFIX, NodeKind.FORWARD, tuple(copy_of.get(d, d) for d in node.deps),
                          node.out_bytes, node.cost, True, node.temp_bytes, 0))
    for i in range(instant + 1, n):
        node = graph.nodes[i]
        deps = tuple(copy_of[d] if d in copy_of else (d + shift if d > instant else d) for d in node.deps)
        nodes.append(Node(node.name, NodeKind.BACKWARD, deps, node.out_bytes, node.cost, node.recomputable,
                          node.temp_bytes, node.kept_bytes))
    restarted = Graph(tuple(nodes), graph.fixed_bytes,
                      tuple(o + shift if o > instant else o for o in graph.outputs), f"{graph.name} restarted")
    origin = np.concatenate([np.arange(instant + 1), np.asarray(copies, dtype=np.int64),
                             np.arange(instant + 1, n)]).astype(np.int64)
    stage = np.concatenate([np.arange(instant + 1), np.full(len(copies), min(instant + 1, n - 1)),
                            np.arange(instant + 1, n)]).astype(np.int64)
    return Restarted(graph, instant, restarted, origin, stage, len(copies))


def _copied(graph: Graph, instant: int, bounds: InstantBounds) -> list[int]:
    """The values the restarted graph at ``instant`` copies, in id order (see the module)."""
    if not 0 <= instant < graph.n:
        raise ValueError(f"instant {instant!r} is not a node of graph {graph.name!r} (0..{graph.n - 1})")
    live = bounds.forced_mask(instant)  # t's inputs, outputs, values that cannot be recomputed
    live[instant] = True

    def copied(v: int) -> bool:  # (outputs are live: kept from their computation on)
        return bool(bounds.recomputable[v] and not live[v] and graph.nodes[v].out_bytes > 0)

    todo = [v for v in range(instant) if bounds.last_user[v] > instant and copied(v)]
    chosen: set[int] = set()
    while todo:
        v = todo.pop()
        if v in chosen:
            continue
        chosen.add(v)
        todo.extend(d for d in graph.nodes[v].deps if d not in chosen and copied(d))
    return sorted(chosen)


def restart_instants(graph: Graph, instant: int, bounds: InstantBounds | None = None, *,
                     most: int = 4) -> list[int]:
    """Where to restart for the bound's ``instant`` t, the latest first: t and the instants
    after it up to the one before the first node that reads a value copied at t, at most
    ``most`` of them (the latest ones, and t).

    Nothing reads a copy before that node, so the copies can wait for it; copied right after
    t they sit in memory while the nodes in between run, which at a floor are the loss's
    large gradients, each beside its input (4-layer GPT-2 at its smallest budget: restarted
    at the loss gradient 1.423x, one or two nodes later 1.367x).

    >>> from remat.builders import chain_graph
    >>> restart_instants(chain_graph(3, bytes_per_node=1), 3)  # the loss; grad_f2 reads no copy
    [4, 3]
    """
    if most < 1:
        raise ValueError(f"most={most!r} must be at least 1")
    bounds = bounds if bounds is not None else InstantBounds(graph)
    copies = set(_copied(graph, instant, bounds))
    first = next((i for i in range(instant + 1, graph.n) if copies.intersection(graph.nodes[i].deps)), instant + 1)
    later = list(range(max(instant + 1, first - most + 1), first))
    return later[::-1] + [instant]


def restart_plan(graph: Graph, instant: int, budget_bytes: int, *, time_limit_s: float, threads: int = 2,
                 mip_gap: float = 1e-3, bounds: InstantBounds | None = None,
                 stop_at: float | None = None) -> BaselinePlan | None:
    """The retention model's plan of the restarted graph at ``instant`` under ``budget_bytes``,
    as a plan of ``graph`` (measured, not yet simulated), or None if the model has none or
    the instant is the last node (nothing to restart). The search ends at a plan costing at
    most ``stop_at`` (a cost of ``graph``'s plans, e.g. its lower bound)."""
    started = time.perf_counter()
    if instant >= graph.n - 1:
        return None
    r = restart_graph(graph, instant, bounds)
    if r.copies == 0:
        return None
    structure = RetentionStructure(r.restarted)
    label = f"restart at {graph.nodes[instant].name}"
    last: list = [None, None]  # the last solution mapped, and its plan

    def plan_of(solution: RetentionSolution) -> BaselinePlan | None:
        if last[0] is not solution:
            last[:] = [solution, _mapped(r, structure, solution, label)]
        return last[1]

    def fits(solution: RetentionSolution) -> bool:  # over the model's count, within the simulator's?
        plan = plan_of(solution)
        return plan is not None and plan.peak_bytes <= budget_bytes

    # the model counts recomputations beyond computing every node of the restarted graph once
    enough = None if stop_at is None else stop_at - r.restarted.total_cost
    result = solve_retention(structure, budget_bytes, time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads,
                             accept=fits, stop_at=enough)
    plan = None if result.solution is None else plan_of(result.solution)
    if plan is None:
        log.info("restart: %s at %s under %d B: no plan (%d copies, %.2f s)", graph.name, graph.describe(instant),
                 budget_bytes, r.copies, time.perf_counter() - started)
        return None
    log.info("restart: %s at %s under %d B: %.4fx, peak %d B (%d copies, %.2f s)", graph.name,
             graph.describe(instant), budget_bytes, plan.cost / graph.total_cost if graph.total_cost else 1.0,
             plan.peak_bytes, r.copies, time.perf_counter() - started)
    return plan


def _mapped(r: Restarted, structure: RetentionStructure, solution: RetentionSolution, label: str) -> BaselinePlan | None:
    """The plan of the restarted graph ``solution`` as a plan of the traced graph (measured), or
    None if it computes a value twice in one stage (not a schedule; never seen)."""
    graph = r.graph
    order = solution.order(structure)
    stages = np.array([r.stage[s] for s, _ in order], dtype=np.int64)
    nodes = np.array([r.origin[v] for _, v in order], dtype=np.int64)
    if np.unique(stages * graph.n + nodes).size < nodes.size:
        return None
    return measure_by_stage(graph, stages, nodes, label)
