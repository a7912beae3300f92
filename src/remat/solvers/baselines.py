"""The baseline strategies Checkmate compares against: checkpoint_all, recompute_all,
chen_sqrtn and chen_greedy (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost")
and griewank (revolve, Griewank & Walther 2000; linear chains only).

Each builds keep matrices (``keep[t, i]``: stage t reuses i's live value rather than
recompute it), completes them with ``Schedule.from_kept`` and measures every candidate plan in
the simulator. It returns its cheapest candidate that fits the budget, or raises
``InfeasibleBudgetError`` with its candidates' lowest peak: the least budget *that method*
can meet (the MILP may meet less).

>>> from remat.builders import chain_graph
>>> from remat.solvers import solve
>>> g = chain_graph(4, bytes_per_node=1)
>>> [solve(g, 100, method=m).cost for m in ("checkpoint_all", "recompute_all", "griewank")]
[9.0, 19.0, 9.0]
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from remat.errors import UnsupportedGraphError
from remat.graph import Graph, NodeKind
from remat.schedule import Schedule, least_compute, order_peak_and_cost, stage_order
from remat.solvers.base import SolveResult, SolveStatus, finish, fits_or_raise, register
from remat.solvers.prepared import prepared

log = logging.getLogger("remat.solve.baselines")

#: chen_greedy: thresholds tried first (spread over all), then per zoom around a focus, and zooms.
GREEDY_GRID_POINTS = 40
GREEDY_REFINE_POINTS = 16
GREEDY_REFINE_ROUNDS = 2
#: chen_greedy: beyond this many forward nodes, thresholds come from a grid, not every run sum.
GREEDY_EXACT_MAX_NODES = 2000


class ChenVariant(enum.Enum):
    """Which forward nodes Chen's methods may choose as checkpoints."""

    ARTICULATION = "articulation"  # articulation points of the undirected forward graph
    LINEARIZED = "linearized"  # every forward node, the topological order read as a chain
    AUTO = "auto"  # try both, return the cheapest plan that fits


@dataclass(frozen=True)
class BaselinePlan:
    """One plan a baseline considered: its computations in order (``nodes[k]`` in stage
    ``stages[k]``) and what they cost and need, measured without building the plan
    (``order_peak_and_cost``); the plan a method returns is replayed by ``simulate``."""

    label: str  # what the plan is, for errors and logs
    stages: np.ndarray
    nodes: np.ndarray
    peak_bytes: int
    cost: float

    def schedule(self, graph: Graph) -> Schedule:
        return Schedule.from_order(graph, self.stages, self.nodes)


# ---------------------------------------------------------------------------- shared machinery
def measure_order(graph: Graph, stages: Sequence[int], nodes: Sequence[int], label: str) -> BaselinePlan:
    """Measure the plan that computes ``nodes[k]`` in stage ``stages[k]``."""
    peak, cost = order_peak_and_cost(graph, list(nodes))
    return BaselinePlan(label, np.asarray(stages, dtype=np.int32), np.asarray(nodes, dtype=np.int32), peak, cost)


def in_stage_order(stages: np.ndarray, nodes: np.ndarray) -> bool:
    """Whether the computations ``nodes[k]`` in stages ``stages[k]`` are what a schedule's
    ``stage_order`` gives: stage by stage, each stage in id order, none twice (their (stage,
    node) pairs strictly increase) and none after its stage."""
    stages, nodes = np.asarray(stages), np.asarray(nodes)
    return bool(not np.any(nodes > stages)
                and np.all((stages[1:] > stages[:-1]) | ((stages[1:] == stages[:-1]) & (nodes[1:] > nodes[:-1]))))


def measure_by_stage(graph: Graph, stages: Sequence[int], nodes: Sequence[int], label: str) -> BaselinePlan:
    """Measure the plan computing ``nodes[k]`` in stage ``stages[k]``, listed in any order: each
    stage runs its recomputations in id order, then its own node (the stage's id is its largest)."""
    by_stage = np.lexsort((nodes, stages))
    return measure_order(graph, np.asarray(stages)[by_stage], np.asarray(nodes)[by_stage], label)


def measure_kept(graph: Graph, keep: np.ndarray, label: str) -> BaselinePlan:
    """Measure what ``Schedule.from_kept(graph, keep)`` runs."""
    stages, nodes = stage_order(least_compute(graph, keep))
    return measure_order(graph, stages.tolist(), nodes.tolist(), label)


def pick_cheapest(graph: Graph, candidates: Sequence[BaselinePlan], *, budget_bytes: int, method: str,
          started_s: float, status: SolveStatus = SolveStatus.FEASIBLE,
          lower_bound: float | None = None) -> SolveResult:
    """The cheapest candidate under the budget, or ``InfeasibleBudgetError`` with the lowest peak."""
    fitting = [c for c in candidates if c.peak_bytes <= budget_bytes]
    if not fitting:
        lowest = min(candidates, key=lambda c: c.peak_bytes)
        tried = f"{len(candidates)} candidate plans tried; " if len(candidates) > 1 else ""
        fits_or_raise(graph, None, budget_bytes=budget_bytes, method=method,
                      min_budget_bytes=lowest.peak_bytes,
                      detail=f"{tried}the lowest-peak plan is {lowest.label}")
    # Ties in cost go to the lower peak: the same work with more headroom.
    best = min(fitting, key=lambda c: (c.cost, c.peak_bytes))
    log.debug("%s on %s: chose %s (cost %g, peak %d B)", method, graph.name, best.label,
              best.cost, best.peak_bytes)
    return finish(graph, best.schedule(graph), budget_bytes=budget_bytes, method=method, status=status,
                  started_s=started_s, claimed_objective=best.cost, lower_bound=lower_bound)


#: method name -> the plans that method considers under a budget (its default options)
_PLANS: dict[str, Callable[[Graph, int], list[BaselinePlan]]] = {}


def considers(method: str) -> Callable:
    """Register the function that lists the plans ``method`` chooses from under a budget."""

    def wrap(fn: Callable[[Graph, int], list[BaselinePlan]]) -> Callable:
        _PLANS[method] = fn
        return fn

    return wrap


def plans_of(method: str, graph: Graph, budget_bytes: int) -> list[BaselinePlan]:
    """The plans baseline ``method`` (default options) chooses from under ``budget_bytes``: its
    result is the cheapest that fits. Measured plans are remembered per graph, so asking
    again (another budget) costs little. ``UnsupportedGraphError`` as the method raises it."""
    if method not in _PLANS:
        import remat.solvers.chain  # noqa: F401 - registers its plans
        import remat.solvers.repair  # noqa: F401 - registers its plans
        import remat.solvers.segments  # noqa: F401 - registers its plans

    return _PLANS[method](graph, budget_bytes)


def remembered(graph: Graph, key: tuple, make: Callable[[], object]):
    """``make()``, computed once per graph and ``key`` (see ``remat.solvers.prepared``)."""
    memo = prepared(graph).measured
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _keep_through_forward(graph: Graph) -> np.ndarray:
    """A keep matrix whose non-backward stages reuse every earlier value; backward rows empty.

    The forward pass never recomputes here. To drop a value, a method does not keep it in the
    backward stage that needs it: lowering then frees it after its last forward read.
    """
    keep = np.zeros((graph.n, graph.n), dtype=bool)
    for t, node in enumerate(graph.nodes):
        if node.kind is not NodeKind.BACKWARD:
            keep[t, :t] = True
    return keep


def _always_kept(graph: Graph) -> np.ndarray:
    """Values ``from_kept`` keeps whatever the keep matrix says: outputs and non-recomputables
    (a fresh array the caller may change)."""

    def make() -> np.ndarray:
        forced = np.zeros(graph.n, dtype=bool)
        forced[list(graph.outputs)] = True
        forced[[i for i, node in enumerate(graph.nodes) if not node.recomputable]] = True
        return forced

    return remembered(graph, ("always kept",), make).copy()


class StageWalk:
    """A plan built the way Chen's, the chain's and the nested schedules build theirs: every
    node computed once in its own stage, plus what backward stages recompute of the values
    their policy did not keep. ``recompute_for`` records one stage's recomputations; the
    policy (which values stay held afterwards) is the caller's."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.stages: list[int] = list(range(graph.n))
        self.nodes: list[int] = list(range(graph.n))

    def recompute_for(self, t: int, kept: np.ndarray, also: Iterable[int] = ()) -> list[int]:
        """Record that stage t recomputes, in id order, what it needs and ``kept`` lacks (the
        walk of ``from_kept``), and return those nodes (none if t reads only kept values).
        ``also``: values to compute in the stage besides (to hold them for later stages),
        with what they need."""
        also = list(also)
        if not also and all(kept[d] for d in self.graph.nodes[t].deps):
            return []
        done = [i for i in sorted(_computed_in_stage(self.graph, t, kept, also)) if i != t]
        self.stages += [t] * len(done)
        self.nodes += done
        return done

    def recomputations(self) -> tuple[list[int], list[int]]:
        """The (stages, nodes) recorded so far beyond each node's own computation."""
        n = self.graph.n
        return self.stages[n:], self.nodes[n:]

    def record(self, stages: list[int], nodes: list[int]) -> None:
        """Record recomputations another walk of this graph found (its ``recomputations``)."""
        self.stages += stages
        self.nodes += nodes

    def measure(self, label: str) -> BaselinePlan:
        return measure_by_stage(self.graph, self.stages, self.nodes, label)


def _computed_in_stage(graph: Graph, t: int, kept: np.ndarray, also: Iterable[int] = ()) -> set[int]:
    """The nodes ``from_kept`` computes in stage t given the row ``kept`` (its own walk), and
    those ``also`` lists with what they need."""
    computed, need = {t, *also}, [t, *also]
    while need:
        for d in graph.nodes[need.pop()].deps:
            if not kept[d] and d not in computed:
                computed.add(d)
                need.append(d)
    return computed


def _chen_reused(graph: Graph, checkpoints: set[int]) -> np.ndarray:
    """What the first backward stage of Chen's schedule reuses: checkpoints, every value that
    is not a forward value, the final segment (forward values after the last checkpoint: the
    backward needs them at once, dropping them would only recompute them), outputs and
    non-recomputable values."""
    reused = _always_kept(graph) | ~_forward_mask(graph)
    reused[list(checkpoints)] = True
    reused[max(checkpoints, default=-1) + 1:] = True
    return reused


def _backward_ids(graph: Graph) -> np.ndarray:
    return remembered(graph, ("backward ids",), lambda: np.asarray(graph.ids_of_kind(NodeKind.BACKWARD), dtype=np.int64))


def _forward_mask(graph: Graph) -> np.ndarray:
    return remembered(graph, ("forward mask",), lambda: np.array(
        [node.kind is NodeKind.FORWARD for node in graph.nodes], dtype=bool))


def chen_keep(graph: Graph, checkpoints: Iterable[int]) -> np.ndarray:
    """Keep matrix of Chen's schedule. Backward stages reuse what ``_chen_reused`` lists and
    forward values an earlier backward stage recomputed: Chen's "recompute each segment once",
    where ``from_kept`` alone would redo a segment's prefix for every gradient in it.
    ``chen_plan`` measures the same schedule without the n x n matrix."""
    keep = _keep_through_forward(graph)
    reused = _chen_reused(graph, set(checkpoints))
    for t, node in enumerate(graph.nodes):
        if node.kind is NodeKind.BACKWARD:
            keep[t, :t] = reused[:t]
            reused[list(_computed_in_stage(graph, t, reused))] = True
    return keep


def chen_plan(graph: Graph, checkpoints: Iterable[int], label: str) -> BaselinePlan:
    """The plan of ``Schedule.from_kept(graph, chen_keep(graph, checkpoints))``, measured, built
    straight from the graph in O(nodes + edges) and remembered per graph."""
    key = tuple(sorted(set(checkpoints)))

    def make() -> BaselinePlan:
        reused = _chen_reused(graph, set(key))
        # Only a backward stage reading a value not reused recomputes anything; reused values
        # only grow along the walk, so the others compute their own node alone.
        indptr, indices = graph.deps_csr
        backward = _backward_ids(graph)
        # per node: does it read a value not reused? (a row per node; a sentinel ends the last)
        flags = np.append(~reused[indices], False)
        reads_dropped = np.logical_or.reduceat(flags, np.minimum(indptr[:-1], flags.size - 1)) & (np.diff(indptr) > 0)
        walk = StageWalk(graph)
        for t in backward[reads_dropped[backward]].tolist():
            reused[walk.recompute_for(t, reused)] = True
        return walk.measure(label)

    return dataclasses.replace(remembered(graph, ("chen", key), make), label=label)


# ---------------------------------------------------------------------------- checkpoint_all
@register("checkpoint_all")
def checkpoint_all(graph: Graph, budget_bytes: int) -> SolveResult:
    """Keep every value until its last use. Its cost, ``graph.total_cost``, is the least any
    plan has, so a plan that fits is OPTIMAL.

    >>> from remat.builders import chain_graph
    >>> r = checkpoint_all(chain_graph(3, bytes_per_node=1), budget_bytes=5)
    >>> r.peak_bytes, r.cost, r.status.value
    (5, 7.0, 'optimal')
    """
    started = time.perf_counter()
    return pick_cheapest(graph, _checkpoint_all_plans(graph, budget_bytes), budget_bytes=budget_bytes,
                         method="checkpoint_all", started_s=started, status=SolveStatus.OPTIMAL,
                         lower_bound=graph.total_cost)


@considers("checkpoint_all")
def _checkpoint_all_plans(graph: Graph, budget_bytes: int) -> list[BaselinePlan]:
    every = list(range(graph.n))
    return [remembered(graph, ("checkpoint_all",),
                        lambda: measure_order(graph, every, every, "checkpoint-all (every value kept)"))]


# ---------------------------------------------------------------------------- recompute_all
@register("recompute_all")
def recompute_all(graph: Graph, budget_bytes: int) -> SolveResult:
    """Checkmate's checkpoint-last-node strategy: stage t reuses only node t-1's value (and the
    outputs and non-recomputable values, always kept) and recomputes all else it needs from
    scratch. Quadratic cost on a chain. Its peak is low on chains, but on a graph with skip
    connections a stage holds a whole ancestry at once and can peak above checkpoint-all.

    >>> from remat.builders import chain_graph
    >>> recompute_all(chain_graph(3, bytes_per_node=1), budget_bytes=10).cost
    13.0
    """
    started = time.perf_counter()
    return pick_cheapest(graph, _recompute_all_plans(graph, budget_bytes), budget_bytes=budget_bytes,
                         method="recompute_all", started_s=started)


@considers("recompute_all")
def _recompute_all_plans(graph: Graph, budget_bytes: int) -> list[BaselinePlan]:
    keep = np.eye(graph.n, k=-1, dtype=bool)
    return [remembered(graph, ("recompute_all",),
                        lambda: measure_kept(graph, keep, "recompute-all (only the previous node's value kept)"))]


# ---------------------------------------------------------------------------- Chen et al. 2016
def _variants(variant: object) -> tuple[ChenVariant, ...]:
    """The variants to try; the CLI may pass the value string instead of the Enum."""
    try:
        chosen = ChenVariant(variant.lower() if isinstance(variant, str) else variant)
    except ValueError:
        choices = ", ".join(f"ChenVariant.{v.name} ({v.value!r})" for v in ChenVariant)
        raise ValueError(f"variant={variant!r} is not a Chen variant; use one of: {choices}") from None
    if chosen is ChenVariant.AUTO:
        return (ChenVariant.ARTICULATION, ChenVariant.LINEARIZED)
    return (chosen,)


def checkpoint_candidates(graph: Graph, variant: ChenVariant) -> tuple[int, ...]:
    """The forward nodes Chen's methods may checkpoint, in topological order. LINEARIZED: all.
    ARTICULATION: the articulation points of the undirected forward graph (removing one cuts
    the graph in two), Chen's choice for graphs with a single path through them.

    >>> from remat.builders import chain_graph
    >>> checkpoint_candidates(chain_graph(5), ChenVariant.ARTICULATION)
    (1, 2, 3)
    """
    forward = graph.ids_of_kind(NodeKind.FORWARD)
    if variant is ChenVariant.LINEARIZED:
        return forward

    def articulation() -> tuple[int, ...]:
        in_forward = set(forward)
        undirected = nx.Graph()
        undirected.add_nodes_from(forward)
        undirected.add_edges_from((d, i) for i in forward for d in graph.nodes[i].deps if d in in_forward)
        return tuple(sorted(nx.articulation_points(undirected)))

    return remembered(graph, ("articulation",), articulation)


def _chen_candidate(graph: Graph, checkpoints: Sequence[int], what: str) -> BaselinePlan:
    shown = checkpoints if len(checkpoints) <= 8 else f"{len(checkpoints)} nodes"
    return chen_plan(graph, checkpoints, f"{what}, checkpoints {shown}")


def sqrtn_checkpoints(candidates: Sequence[int]) -> tuple[int, ...]:
    """Every k-th of the ``len(candidates)`` candidates, k = floor(sqrt(len)), as Checkmate does.

    >>> sqrtn_checkpoints(range(1, 8))
    (2, 4, 6)
    """
    k = math.isqrt(len(candidates))
    return tuple(c for idx, c in enumerate(candidates) if k and (idx + 1) % k == 0)


@register("chen_sqrtn")
def chen_sqrtn(graph: Graph, budget_bytes: int, *, variant: ChenVariant | str = ChenVariant.AUTO
               ) -> SolveResult:
    """Chen's sqrt(n) checkpointing: checkpoint every sqrt(k)-th of the k candidate nodes.
    ``variant`` (``ChenVariant``) picks the candidates; AUTO returns the cheaper fitting plan.

    >>> from remat.builders import chain_graph
    >>> r = chen_sqrtn(chain_graph(9, bytes_per_node=1), 100, variant=ChenVariant.ARTICULATION)
    >>> r.cost, r.peak_bytes
    (23.0, 7)
    """
    started = time.perf_counter()
    return pick_cheapest(graph, _chen_sqrtn_plans(graph, budget_bytes, variant), budget_bytes=budget_bytes,
                         method="chen_sqrtn", started_s=started)


@considers("chen_sqrtn")
def _chen_sqrtn_plans(graph: Graph, budget_bytes: int, variant: ChenVariant | str = ChenVariant.AUTO
                      ) -> list[BaselinePlan]:
    return [_chen_candidate(graph, sqrtn_checkpoints(checkpoint_candidates(graph, v)), f"{v.value} sqrt(n)")
            for v in _variants(variant)]


def greedy_checkpoints(graph: Graph, candidates: Iterable[int], threshold_bytes: int
                       ) -> tuple[int, ...]:
    """Chen's greedy rule: walk the forward nodes in order, adding up their bytes; a candidate
    reached while the sum since the last checkpoint exceeds ``threshold_bytes`` becomes a
    checkpoint and restarts the sum.

    >>> from remat.builders import chain_graph
    >>> greedy_checkpoints(chain_graph(6, bytes_per_node=1), range(6), threshold_bytes=2)
    (2, 5)
    """
    allowed = set(candidates)
    total, chosen = 0, []
    for i in graph.ids_of_kind(NodeKind.FORWARD):
        total += graph.nodes[i].out_bytes
        if i in allowed and total > threshold_bytes:
            chosen.append(i)
            total = 0
    return tuple(chosen)


def _greedy_thresholds(graph: Graph) -> np.ndarray:
    """Every threshold at which the greedy rule can change its mind: -1 (checkpoint every
    candidate) and each distinct byte sum of a run of consecutive forward nodes."""
    sizes = [graph.nodes[i].out_bytes for i in graph.ids_of_kind(NodeKind.FORWARD)]
    prefix = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    if len(prefix) > GREEDY_EXACT_MAX_NODES:  # the m^2 run sums would not fit: a value grid
        return np.unique(np.concatenate(([-1], np.linspace(0, prefix[-1], 4096).astype(np.int64))))
    runs = prefix[None, :] - prefix[:, None]
    return np.unique(np.concatenate(([-1], runs[np.triu_indices(len(prefix), 1)])))


def _spread(lo: int, hi: int, count: int) -> list[int]:
    """At most ``count`` integers spread evenly over ``lo..hi`` inclusive, ends included."""
    if hi < lo:
        return []
    return sorted({int(round(x)) for x in np.linspace(lo, hi, min(count, hi - lo + 1))})


class _GreedySearch:
    """Thresholds tried for one variant, memoized by the checkpoint set they produce."""

    def __init__(self, graph: Graph, variant: ChenVariant) -> None:
        self.graph = graph
        self.variant = variant
        self.candidates = checkpoint_candidates(graph, variant)
        self.thresholds = remembered(graph, ("greedy thresholds",), lambda: _greedy_thresholds(graph))
        self.tried: dict[int, BaselinePlan] = {}  # threshold index -> plan
        self.plans: dict[tuple[int, ...], BaselinePlan] = {}  # checkpoint set -> plan

    def run(self, indices: Iterable[int]) -> None:
        for idx in indices:
            if idx in self.tried:
                continue
            threshold = int(self.thresholds[idx])
            checkpoints = remembered(self.graph, ("greedy", self.variant, threshold),
                                      lambda: greedy_checkpoints(self.graph, self.candidates, threshold))
            if checkpoints not in self.plans:
                what = f"{self.variant.value} greedy (threshold {threshold} B)"
                self.plans[checkpoints] = _chen_candidate(self.graph, checkpoints, what)
            self.tried[idx] = self.plans[checkpoints]

    def zoom(self, key: Callable[[BaselinePlan], object], where: Callable[[BaselinePlan], bool]) -> None:
        """Try more thresholds between the best tried one (by ``key`` among ``where``) and its
        tried neighbours."""
        for _ in range(GREEDY_REFINE_ROUNDS):
            pool = [idx for idx, c in self.tried.items() if where(c)]
            if not pool:
                return
            focus = min(pool, key=lambda idx: (key(self.tried[idx]), idx))
            below = max((i for i in self.tried if i < focus), default=focus)
            above = min((i for i in self.tried if i > focus), default=focus)
            self.run(_spread(below + 1, above - 1, GREEDY_REFINE_POINTS))


@register("chen_greedy")
def chen_greedy(graph: Graph, budget_bytes: int, *, variant: ChenVariant | str = ChenVariant.AUTO
                ) -> SolveResult:
    """Chen's greedy checkpointing, searched over its memory threshold: a spread of the
    thresholds at which the rule changes, zooms around the lowest-peak one (independent of the
    budget, so every budget reports the same minimum), then around the cheapest that fits.

    >>> from remat.builders import chain_graph
    >>> r = chen_greedy(chain_graph(16, bytes_per_node=1), budget_bytes=8)
    >>> r.peak_bytes <= 8 < 18
    True
    """
    started = time.perf_counter()
    return pick_cheapest(graph, _chen_greedy_plans(graph, budget_bytes, variant), budget_bytes=budget_bytes,
                         method="chen_greedy", started_s=started)


@considers("chen_greedy")
def _chen_greedy_plans(graph: Graph, budget_bytes: int, variant: ChenVariant | str = ChenVariant.AUTO
                       ) -> list[BaselinePlan]:
    searches = [_GreedySearch(graph, v) for v in _variants(variant)]
    for search in searches:
        search.run(_spread(0, len(search.thresholds) - 1, GREEDY_GRID_POINTS))
        search.zoom(key=lambda c: c.peak_bytes, where=lambda c: True)
    for search in searches:
        search.zoom(key=lambda c: c.cost, where=lambda c: c.peak_bytes <= budget_bytes)
    return [plan for search in searches for plan in search.plans.values()]


# ---------------------------------------------------------------------------- Griewank (revolve)
def chain_length(graph: Graph) -> int:
    """The layer count L of a linear training chain (``chain_graph``'s shape: forward nodes
    0..L-1 each reading the one before, the loss L, gradient node 2L-i reading node 2L-i-1 and
    forward node i); ``UnsupportedGraphError`` naming the first offending node otherwise.

    >>> from remat.builders import chain_graph
    >>> chain_length(chain_graph(4))
    4
    """
    def refuse(reason: str) -> UnsupportedGraphError:
        return UnsupportedGraphError(
            f"method 'griewank' (revolve) needs a linear chain training step, but graph "
            f"{graph.name!r} is not one: {reason}; use method 'chen_sqrtn', 'chen_greedy' or "
            f"'milp', which plan any graph"
        )

    if graph.n % 2 == 0:
        raise refuse(f"it has {graph.n} nodes, and a chain of L layers has 2L+1")
    layers = graph.n // 2
    for t, node in enumerate(graph.nodes):
        if t < layers:
            kind, deps = NodeKind.FORWARD, (t - 1,) if t else ()
        elif t == layers:
            kind, deps = NodeKind.LOSS, (t - 1,)
        else:
            kind, deps = NodeKind.BACKWARD, tuple(sorted({t - 1, 2 * layers - t}))
        if node.kind is not kind or tuple(node.deps) != deps:
            raise refuse(
                f"{graph.describe(t)} is {node.kind.value} reading {tuple(node.deps)} where a "
                f"chain has a {kind.value} node reading {deps}"
            )
    return layers


@dataclass(frozen=True)
class RevolveTable:
    """``forward_steps[l, s]``: the fewest forward computations (first forward pass included)
    that produce the gradients of l chain layers from the value below them with s snapshot
    slots; ``split[l, s]``: the layer to snapshot first (``l``: none)."""

    forward_steps: np.ndarray
    split: np.ndarray


def revolve_table(steps: int, slots: int) -> RevolveTable:
    """Solve the revolve recurrence for every ``l <= steps`` and ``s <= slots``.

    A gradient of layer i needs layer i's *output*, so reversing l layers above a base value
    with s free slots costs T(l, s) forward steps, where T(0, s) = 0 and
    T(l, s) = min( l + T(l-1, s),                         advance to the top, snapshot nothing
                   min_{1<=j<l, s>=1} j + T(l-j, s-1) + T(j-1, s) )
    (advance j layers, snapshot layer j, reverse the l-j layers above it with one slot less,
    use the snapshot for layer j's gradient, then reverse the j-1 below with the slot back).
    T(l, 0) = l(l+1)/2 and T(l, s) = l once s >= l-1. Ties go to fewer snapshots.

    >>> t = revolve_table(6, 2)
    >>> [int(t.forward_steps[6, s]) for s in range(3)]
    [21, 11, 9]
    """
    kind = np.int32 if steps < 60_000 else np.int64  # (T <= l(l+1)/2; half the memory traffic)
    cost = np.zeros((steps + 1, slots + 1), dtype=kind)
    split = np.zeros((steps + 1, slots + 1), dtype=kind)
    # Row l needs only rows below it, so each row is solved for every slot count at once (a
    # 1000-layer chain: 10^3 array operations, not 10^6).
    for l in range(1, steps + 1):
        cost[l], split[l] = l + cost[l - 1], l
        if l >= 2 and slots >= 1:
            cost[l, l - 1:], split[l, l - 1:] = l, 1  # (s >= l - 1: snapshot every layer, l steps)
            m = min(slots, l - 2)  # (the slot counts below that)
            if m >= 1:
                j = np.arange(1, l)
                options = j[:, None] + cost[l - j, :m] + cost[j - 1, 1:m + 1]  # [j - 1, s - 1]
                best = np.argmin(options, axis=0)  # (the first least: the lowest split)
                least = options[best, np.arange(m)]
                better = least < cost[l, 1:m + 1]
                cost[l, 1:m + 1][better] = least[better]
                split[l, 1:m + 1][better] = best[better] + 1
    return RevolveTable(forward_steps=cost, split=split)


def _revolve_keep(graph: Graph, layers: int, slots: int, table: RevolveTable) -> np.ndarray:
    """Keep matrix of the revolve schedule: each gradient stage reuses the loss, the gradients
    and the snapshots held; the first also every forward value (the forward pass just ran)."""
    keep = _keep_through_forward(graph)

    def reuse(layer: int, snapshots: frozenset[int] | None) -> None:
        t = 2 * layers - layer  # the stage of that layer's gradient
        keep[t, layers:t] = True
        keep[t, :layers] = snapshots is None
        keep[t, sorted(snapshots or ())] = True

    # Reversals still to do: layers base+1..base+l, top first, with s slots; ``live``: the
    # snapshots held (base among them). Each layer's stage is its own row of ``keep``, so the
    # order they are done in does not matter: a stack, not recursion, which a chain of a
    # thousand layers with as many slots took past Python's recursion limit.
    todo: list[tuple[int, int, int, frozenset[int], frozenset[int] | None]] = [(-1, layers, slots, frozenset(), None)]
    while todo:
        base, l, s, live, first = todo.pop()
        while l > 0:
            j = int(table.split[l, s])
            if j == l:
                reuse(base + l, first)
            else:
                todo.append((base + j, l - j, s - 1, live | {base + j}, first))
                reuse(base + j, live | {base + j})
            l, first = j - 1, live
    return keep


@register("griewank")
def griewank(graph: Graph, budget_bytes: int, *, slots: int | None = None) -> SolveResult:
    """Revolve (Griewank & Walther 2000): optimal binomial checkpointing of a linear chain.

    Refuses any graph that is not a linear training chain (``UnsupportedGraphError``). For
    each number of snapshot slots s (0 .. L-1, or only ``slots`` if given) the schedule is the
    one with the fewest forward steps by ``revolve_table``'s recurrence. Cost model: the
    recurrence counts steps, i.e. assumes uniform per-layer costs and sizes when it picks the
    splits; the simulator then measures each schedule's actual cost and peak (s + 3 nodes on a
    uniform chain), and the cheapest that fits is returned. The input is a free snapshot (it is
    in ``fixed_bytes``): s = 0 recomputes each gradient's prefix from it, L(L+1)/2 steps.
    Unlike classic revolve, a gradient here reads its layer's output, so a snapshot of layer j
    also serves j's gradient and reversal needs no extra "taping" step.

    >>> from remat.builders import chain_graph
    >>> griewank(chain_graph(6, bytes_per_node=1), 100, slots=1).cost
    18.0
    """
    started = time.perf_counter()
    return pick_cheapest(graph, _griewank_plans(graph, budget_bytes, slots), budget_bytes=budget_bytes,
                         method="griewank", started_s=started)


@considers("griewank")
def _griewank_plans(graph: Graph, budget_bytes: int, slots: int | None = None) -> list[BaselinePlan]:
    layers = chain_length(graph)
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
        raise ValueError(f"slots={slots!r} must be a non-negative int (snapshot slots), or None to search")
    # More than L-1 slots change nothing: with L-1 every layer but the top is already a snapshot.
    most = layers - 1 if slots is None else min(slots, layers - 1)
    table = remembered(graph, ("revolve table",), lambda: revolve_table(layers, layers - 1))

    def measured(s: int) -> BaselinePlan:
        return remembered(graph, ("revolve", s), lambda: measure_kept(
            graph, _revolve_keep(graph, layers, s, table), f"revolve with {s} snapshot slots"))

    if slots is not None:
        return [measured(most)]
    counts = _slot_counts(most)
    plans = [measured(s) for s in counts]
    # More slots: a higher peak and fewer recomputations. Between the most slots tried that fit
    # and the next count tried, bisect for the most that fit.
    fit = [k for k in range(len(counts) - 1) if plans[k].peak_bytes <= budget_bytes < plans[k + 1].peak_bytes]
    if fit:
        low, high = counts[fit[-1]], counts[fit[-1] + 1]
        while high - low > 1:
            middle = (low + high) // 2
            plans.append(measured(middle))
            low, high = (middle, high) if plans[-1].peak_bytes <= budget_bytes else (low, middle)
    return plans


#: Chains of up to this many layers try every slot count; longer ones try 0..ALL_SLOTS_UP_TO
#: and then about SLOT_GROWTH times more at each step (a 800-layer chain: 92 counts, not 800;
#: measuring all of them took most of a minute), and bisect between the two around the budget.
ALL_SLOTS_UP_TO = 64
SLOT_GROWTH = 1.1


def _slot_counts(most: int) -> list[int]:
    """The slot counts ``griewank`` measures for every budget (see ``ALL_SLOTS_UP_TO``).

    >>> _slot_counts(3), len(_slot_counts(799)), _slot_counts(799)[-1]
    ([0, 1, 2, 3], 92, 799)
    """
    counts = list(range(min(most, ALL_SLOTS_UP_TO) + 1))
    while counts[-1] < most:
        counts.append(min(most, max(counts[-1] + 1, int(counts[-1] * SLOT_GROWTH))))
    return counts
