"""Lowering a plan's peak by recomputing what it holds there: a local search on compute orders.

Near the smallest budgets the plans the baselines and the retention model know cliff: the
cheapest plan that fits can cost far more than one whose peak is a few values too high. This
module takes such a plan and brings its peak down a move at a time. A move picks a value the
plan holds across its peak without reading it there, frees it after its last read before the
peak, and computes it again right before its next read (in that reader's stage), together
with every input of it that is no longer live then (recursively, back to values that are).
Of the moves that lower the peak (or, on a plateau, the number of positions at the peak), the
one adding the least compute per byte saved is taken; the search stops when the plan fits
the budget, no move helps, or time runs out.

Moves are measured as ``order_memory`` measures an order (the simulator's count, without
building the plan), so a move that lengthens an input's life past the peak, or makes a new
peak elsewhere, simply does not help. On an order sorted by stage and node (every order after
the first move) a move's memory is counted from the old order's frees, changed only where the
move changes them (``_Inserting``), instead of measuring the new order from scratch. The
plans it returns are ordinary compute orders, replayed by ``simulate`` like every other plan
before they are used.

>>> import numpy as np
>>> from remat.builders import chain_graph
>>> from remat.schedule import stage_order
>>> from remat.solvers.baselines import measure_order
>>> g = chain_graph(8, bytes_per_node=1)
>>> stages, nodes = stage_order(np.eye(g.n, dtype=bool))     # checkpoint-all
>>> start = measure_order(g, stages, nodes, "checkpoint-all")
>>> lowered = lower_peak(g, start, budget_bytes=start.peak_bytes - 3)
>>> lowered.peak_bytes <= start.peak_bytes - 3, lowered.cost > start.cost
(True, True)
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left

import numpy as np

from remat.errors import SolverError
from remat.graph import Graph, NodeKind
from remat.schedule import order_frees, order_memory, order_peak_and_cost, order_reads
from remat.solvers.base import SolveResult, register
from remat.solvers.baselines import (BaselinePlan, chen_plan, considers, in_stage_order, measure_order, pick_cheapest,
                                     remembered)

#: Values considered per move: those held across the peak, largest first; they are measured
#: in order of their least possible compute per byte saved, until none can beat the best.
CANDIDATES_PER_MOVE = 128
#: Where a move computes its value again: in the stage of its next read, or, when no such move
#: helps, in one of this many stages before it (after the peak). A stage's own node is
#: computed after the values it recomputes, so a value recomputed in the stage of its read
#: shares the memory with what the stage before computed: a small MLP in float16 at 60% of
#: checkpoint-all (every layer's backward needs its input computed again from the batch, with
#: nothing else held) needs that chain run before the input gradient's matrix product, a stage
#: early: the descent stopped at a peak of 1.64 MB, over the budget of 1.45 MB, where the
#: exact model fits 1.38 MB; now it reaches 1.38 MB. Tried at every move instead, it found the
#: same plans on the benchmark's graphs, a third slower.
EARLIER_STAGES = 1
#: A move recomputes at most this many values (the value and the inputs it needs again); the
#: smallest-budget search allows any number (``lower_peak(..., max_move_nodes=...)``): at the
#: floor of a deep GPT-2 the last value held at the loss gradient is a hidden state whose
#: recomputation runs the forward pass again from the input (12 layers: 249.2 MB -> 247.1 MB,
#: the floor no plan can go below).
MAX_MOVE_NODES = 256
#: The memory ``prune`` counts at a position it dropped (below any budget, whatever is added).
GONE = np.iinfo(np.int64).min // 2
#: The most time one call spends extending a graph's descent (method ``descent``).
DESCENT_TIME_S = 10.0


@register("descent")
def descent(graph: Graph, budget_bytes: int) -> SolveResult:
    """Checkpoint-all with its peak lowered a recomputation at a time until it fits (see the
    module): the cheapest plan of the descent that fits. The descent is remembered per graph
    and goes on where it stopped when a lower budget is asked for. Raises
    ``InfeasibleBudgetError`` with the lowest peak it reached."""
    started = time.perf_counter()
    return pick_cheapest(graph, _descent_plans(graph, budget_bytes), budget_bytes=budget_bytes, method="descent",
                         started_s=started)


@considers("descent")
def _descent_plans(graph: Graph, budget_bytes: int) -> list[BaselinePlan]:
    path: Descent = remembered(graph, ("descent",), lambda: _from_checkpoint_all(graph))
    if path.peaks[-1] > budget_bytes:
        path.extend(budget_bytes, time_limit_s=DESCENT_TIME_S)
    # costs only rise along the path: the first plan that fits is the cheapest
    last = len(path.peaks) - 1
    fitting = next((k for k, peak in enumerate(path.peaks) if peak <= budget_bytes), last)
    return [path.plan(k) for k in dict.fromkeys((fitting, last))]


def _from_checkpoint_all(graph: Graph) -> Descent:
    return Descent(graph, chen_plan(graph, graph.ids_of_kind(NodeKind.FORWARD), "checkpoint-all"))


def lower_peak(graph: Graph, plan: BaselinePlan, *, budget_bytes: int, time_limit_s: float = 10.0,
               max_moves: int = 10_000, max_move_nodes: int = MAX_MOVE_NODES) -> BaselinePlan:
    """``plan`` with its peak brought down towards ``budget_bytes`` by recomputing held values
    (see the module), each move recomputing at most ``max_move_nodes`` values. Returns the
    last plan reached: within the budget if the search got there, else the lowest peak it
    found (``plan`` itself if no move helped)."""
    path = Descent(graph, plan)
    path.extend(budget_bytes, time_limit_s=time_limit_s, max_moves=max_moves, max_move_nodes=max_move_nodes)
    return path.plan(len(path.moves))


def prune(graph: Graph, plan: BaselinePlan, *, budget_bytes: int, time_limit_s: float = 5.0) -> BaselinePlan:
    """``plan`` without the recomputations it does not need to fit ``budget_bytes``.

    A recomputation is dropped when the plan still fits without it: its readers then read the
    value's previous instance, which lives on until them. The recomputations are tried the
    dearest first, in passes, until a pass drops none or the time is up. A trial is checked
    on the pass's memory profile (the previous instance now also counts between its last read
    and the dropped position; a recomputation nothing reads always goes), and measured with
    ``order_memory`` only when the inputs read last at the dropped position, freed earlier
    without it, could make up the difference. Each pass starts from the exact profile, so one
    that drops nothing leaves no recomputation that could go on its own. Plans reached by
    adding recomputations one greedy move at a time (``lower_peak``) or by fixed recursions
    carry many a later move made unnecessary: on a 12-layer GPT-2 at its smallest budget this
    removes 5% of the step's compute. Returns ``plan`` itself when it is over the budget or
    nothing can go.

    >>> import numpy as np
    >>> from remat.builders import chain_graph
    >>> from remat.solvers.baselines import measure_order
    >>> g = chain_graph(4, bytes_per_node=1)
    >>> nodes = [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8]     # recomputes 0..2 though nothing forces it
    >>> start = measure_order(g, [0, 1, 2, 3, 4, 5, 5, 5, 5, 6, 7, 8], nodes, "wasteful")
    >>> pruned = prune(g, start, budget_bytes=100)
    >>> pruned.cost < start.cost, pruned.peak_bytes <= 100, pruned.nodes.tolist()
    (True, True, [0, 1, 2, 3, 4, 5, 6, 7, 8])
    """
    deadline = time.perf_counter() + time_limit_s
    sizes, _kept, _temp, costs = graph.node_arrays
    nodes = np.asarray(plan.nodes, dtype=np.int64)
    stages = np.asarray(plan.stages, dtype=np.int64)
    mem = order_memory(graph, nodes).astype(np.int64)  # a pass works on the plan's exact memory
    if int(mem.max()) > budget_bytes:
        return plan
    outputs = np.zeros(graph.n, dtype=bool)
    outputs[list(graph.outputs)] = True
    dropped = 0
    while time.perf_counter() < deadline:
        m = nodes.size
        reads = order_reads(graph, nodes)
        free = order_frees(graph, nodes, reads)  # last read of the instance computed at each position
        by_node = np.lexsort((np.arange(m), nodes))
        prev = np.full(m, -1, dtype=np.int64)  # the same node's previous instance
        same = nodes[by_node[1:]] == nodes[by_node[:-1]]
        prev[by_node[1:][same]] = by_node[:-1][same]
        tries = np.flatnonzero((prev >= 0) & (costs[nodes] > 0) & ~outputs[nodes])
        tries = tries[np.argsort(-costs[nodes[tries]], kind="stable")]
        keep = np.ones(m, dtype=bool)
        last_reads = _last_reads(graph, nodes, free)
        exact = _Dropping(graph, nodes, free, mem, reads)
        for k in tries.tolist():
            if time.perf_counter() >= deadline:
                break
            j = int(prev[k])
            while not keep[j]:  # dropped this pass: its own previous instance reads on
                j = int(prev[j])
            # without position k, instance j lives on to k's last read: it now also counts
            # between its own last read and k
            low = int(free[j]) + 1
            size = int(sizes[nodes[k]])
            if free[k] == k:  # read by nothing: it goes, and instance j lives no longer
                keep[k] = False
                mem[k] = GONE
                exact.drop(k, j)
                continue
            over = (int(mem[low:k].max()) + size if low < k else 0) - budget_bytes
            if over > 0:
                # inputs read last at k free earlier, which that count leaves out: measure
                # exactly when what they hold could make up the difference
                if int(sizes[nodes[last_reads.get(k, [])]].sum()) < over:
                    continue
                without = exact.without(k, j)
                if int(without.max()) > budget_bytes:
                    continue
                keep[k] = False
                exact.drop(k, j, without)
                mem[:] = without
                free[keep] = exact.free[keep]
                last_reads = _last_reads(graph, nodes, free, keep)
                continue
            keep[k] = False
            mem[low:k] += size
            mem[k] = GONE
            free[j] = max(int(free[j]), int(free[k]))
            exact.drop(k, j)
        if keep.all():
            break
        dropped += int((~keep).sum())
        nodes, stages = nodes[keep], stages[keep]
        mem = exact.memory[keep]
    if not dropped:
        return plan
    peak, cost = order_peak_and_cost(graph, nodes.tolist())
    if peak > budget_bytes:  # the count above is never below the plan's memory: a bug
        raise SolverError(f"pruning raised the plan's peak to {peak} B over the budget of {budget_bytes} B; "
                          "please report this")
    return BaselinePlan(f"{plan.label}, {dropped} recomputation(s) dropped", stages.astype(np.int32),
                        nodes.astype(np.int32), peak, cost)


def reshuffle(graph: Graph, plan: BaselinePlan, *, budget_bytes: int, time_limit_s: float = 10.0,
              stop_at: float | None = None, seed: int = 0) -> BaselinePlan:
    """``plan`` improved by perturbing it and lowering it again (an iterated local search):
    the recomputations of a random window of stages (2 to 29 stages from a random one) are
    dropped, so their values' previous instances live on and the peak rises; ``lower_peak``
    brings it back to the budget with moves of its own, ``prune`` drops what those made
    unnecessary, and the result is kept when it fits and costs less. Greedy lowering commits
    to its first moves; taking back a window of them lets it choose again with the rest of
    the plan in place. Runs until ``time_limit_s`` is up or the cost reaches ``stop_at``;
    ``seed`` makes it repeatable (for a given number of rounds). Returns ``plan`` itself when
    it is over the budget or nothing better was found.

    ResNet50 b32 at its smallest budget: the best plan of the other searches, 1.481x, becomes
    1.440x in 9 s (1.439x at 13 s, nothing more in 240 s); the 48-layer GPT-2 at its floor,
    where one round takes 3 s, 1.846x -> 1.814x in 90 s.

    >>> from remat.builders import chain_graph
    >>> g = chain_graph(12, bytes_per_node=1)
    >>> every = measure_order(g, range(g.n), range(g.n), "checkpoint-all")
    >>> start = lower_peak(g, every, budget_bytes=8)
    >>> better = reshuffle(g, start, budget_bytes=8, time_limit_s=0.5)
    >>> better.peak_bytes <= 8, better.cost <= start.cost
    (True, True)
    """
    deadline = time.perf_counter() + time_limit_s
    if plan.peak_bytes > budget_bytes:
        return plan
    rng = np.random.default_rng(seed)
    best, rounds, better = plan, 0, 0
    while time.perf_counter() < deadline and (stop_at is None or best.cost > stop_at):
        stages, nodes = np.asarray(best.stages), np.asarray(best.nodes)
        recomputed = np.flatnonzero(nodes != stages)
        if recomputed.size == 0:
            break
        rounds += 1
        first = int(stages[rng.choice(recomputed)])
        drop = recomputed[(stages[recomputed] >= first) & (stages[recomputed] < first + int(rng.integers(2, 30)))]
        keep = np.ones(nodes.size, dtype=bool)
        keep[drop] = False
        perturbed = measure_order(graph, stages[keep], nodes[keep], best.label)
        left = deadline - time.perf_counter()
        lowered = lower_peak(graph, perturbed, budget_bytes=budget_bytes, time_limit_s=max(left, 0.0))
        if lowered.peak_bytes > budget_bytes:
            continue
        lowered = prune(graph, lowered, budget_bytes=budget_bytes, time_limit_s=max(deadline - time.perf_counter(), 0.0))
        if lowered.cost < best.cost - 1e-9 * max(1.0, best.cost):
            best, better = lowered, better + 1
    if best is plan:
        return plan
    return BaselinePlan(f"{plan.label}, reshuffled ({better} of {rounds} rounds better)", best.stages, best.nodes,
                        best.peak_bytes, best.cost)


class _Dropping:
    """The exact memory and frees of an order as ``prune`` drops recomputations from it, kept
    up to date drop by drop instead of measuring the remaining order from scratch (which is
    what ``without`` gives: ``order_memory`` of the order without the dropped positions, at
    the positions left, and ``GONE`` at the others; a test compares the two). Dropping
    position k, whose node's previous kept instance is at j: k's readers read j, which now
    lives until k's last read; each input k read last is freed at its previous read."""

    def __init__(self, graph: Graph, nodes: np.ndarray, free: np.ndarray, memory: np.ndarray,
                 reads: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """``free``, ``memory``: the order's ``order_frees`` and ``order_memory``; ``reads``: its
        ``order_reads``, if the caller has them."""
        self.sizes = graph.node_arrays[0]
        self.nodes = nodes
        self.free = free.copy()
        self.memory = memory.astype(np.int64)  # exact: what order_memory measured
        m = nodes.size
        self.dropped = np.zeros(m, dtype=bool)
        reader, _value, inst = order_reads(graph, nodes) if reads is None else reads
        self.readers: list[list[int]] = [[] for _ in range(m)]  # per instance, its readers in order
        self.reads: list[list[int]] = [[] for _ in range(m)]  # per position, the instances it reads
        for r, i in zip(reader.tolist(), inst.tolist()):
            if i >= 0:
                self.readers[i].append(r)
                self.reads[r].append(i)

    def without(self, k: int, j: int) -> np.ndarray:
        """The memory once position k is dropped as well."""
        memory = self.memory.copy()
        free, sizes = self.free, self.sizes
        if free[k] > k:  # k's readers read j, which lives on from its own last read until them
            memory[free[j] + 1:k] += sizes[self.nodes[k]]
        for i in set(self.reads[k]):
            if free[i] == k:  # read last at k: now freed at its previous read
                earlier = [r for r in self.readers[i] if r != k]
                memory[(earlier[-1] if earlier else i) + 1:k] -= sizes[self.nodes[i]]
        memory[k] = GONE
        memory[self.dropped] = GONE  # (the ranges above may cross positions dropped before)
        return memory

    def drop(self, k: int, j: int, without: np.ndarray | None = None) -> None:
        """Drop position k (``without``: ``self.without(k, j)``, if already measured)."""
        self.memory = self.without(k, j) if without is None else without
        free = self.free
        if free[k] > k:
            free[j] = free[k]
        self.readers[j] += self.readers[k]
        for r in self.readers[k]:
            self.reads[r] = [j if i == k else i for i in self.reads[r]]
        for i in set(self.reads[k]):
            self.readers[i] = [r for r in self.readers[i] if r != k]
            if free[i] == k:
                free[i] = self.readers[i][-1] if self.readers[i] else i
        self.readers[k], self.reads[k] = [], []
        self.dropped[k] = True


def _last_reads(graph: Graph, nodes: np.ndarray, free: np.ndarray, keep: np.ndarray | None = None) -> dict[int, list[int]]:
    """Per position, the positions of the instances it reads last (``free``: each instance's
    last read, by position), over the positions ``keep`` marks (all by default)."""
    at = np.flatnonzero(free >= 0) if keep is None else np.flatnonzero((free >= 0) & keep)
    at = at[free[at] != at]
    out: dict[int, list[int]] = {}
    for instance, reader in zip(at.tolist(), free[at].tolist()):
        out.setdefault(reader, []).append(instance)
    return out


def descend(graph: Graph, plan: BaselinePlan, *, budget_bytes: int, time_limit_s: float = 10.0,
            max_moves: int = 10_000) -> list[BaselinePlan]:
    """Every plan the search passes through from ``plan`` (excluded) towards ``budget_bytes``,
    in order: peaks fall (or a plateau at the peak shrinks), costs rise."""
    path = Descent(graph, plan)
    path.extend(budget_bytes, time_limit_s=time_limit_s, max_moves=max_moves)
    return [path.plan(k) for k in range(1, len(path.moves) + 1)]


class Descent:
    """A plan and the moves of its descent so far, kept as what each move adds (a stage and
    the nodes it computes again there): plan k is the start plus the first k moves' additions,
    each stage in id order. ``stuck`` once no move lowers the last plan."""

    def __init__(self, graph: Graph, start: BaselinePlan) -> None:
        self.graph = graph
        self.start = start
        self.moves: list[tuple[int, np.ndarray]] = []
        self.peaks = [start.peak_bytes]
        self.costs = [start.cost]
        self.stuck = False
        self._last = (np.asarray(start.stages, dtype=np.int64), np.asarray(start.nodes, dtype=np.int64))

    def plan(self, k: int) -> BaselinePlan:
        """The plan after the first k moves (the start for k = 0)."""
        if k == 0:
            return self.start
        stages = np.concatenate([self.start.stages, *(np.full(len(a), s) for s, a in self.moves[:k])]).astype(np.int64)
        nodes = np.concatenate([self.start.nodes, *(a for _, a in self.moves[:k])]).astype(np.int64)
        by_stage = np.lexsort((nodes, stages))
        return BaselinePlan(f"{self.start.label}, peak lowered by {k} recomputation(s)",
                            stages[by_stage].astype(np.int32), nodes[by_stage].astype(np.int32),
                            self.peaks[k], self.costs[k])

    def extend(self, budget_bytes: int, *, time_limit_s: float, max_moves: int = 10**9,
               max_move_nodes: int = MAX_MOVE_NODES) -> None:
        """Go on moving until the last plan fits ``budget_bytes``, no move helps (``stuck``,
        among moves of at most ``max_move_nodes`` values), ``max_moves`` more were made or the
        time is up."""
        deadline = time.perf_counter() + time_limit_s
        search = _Search(self.graph, max_move_nodes)
        stages, nodes = self._last
        if np.any(np.diff(stages) < 0):  # every plan runs stage after stage; the search relies on it
            raise SolverError(f"the descent on graph {self.graph.name!r} was given an order not sorted by stage "
                              "(a bug in remat)")
        mem = order_memory(self.graph, nodes)
        costs = self.graph.node_arrays[3]
        made = 0
        while (not self.stuck and int(mem.max()) > budget_bytes and made < max_moves
               and time.perf_counter() < deadline):
            step = search.best_move(stages, nodes, mem, deadline)
            if step is None and time.perf_counter() < deadline:
                step = search.best_move(stages, nodes, mem, deadline, earlier=EARLIER_STAGES)
            if step is None:
                self.stuck = time.perf_counter() < deadline
                break
            stages, nodes, mem, stage, added = step
            self.moves.append((stage, added))
            self.peaks.append(max(self.graph.fixed_bytes, int(mem.max())))
            self.costs.append(float(np.cumsum(costs[nodes])[-1]))
            made += 1
        self._last = (stages, nodes)


class _Search:
    def __init__(self, graph: Graph, max_move_nodes: int = MAX_MOVE_NODES) -> None:
        self.graph = graph
        self.max_move_nodes = max_move_nodes
        self.sizes, kept, _temp, self.costs = graph.node_arrays
        self.indptr, self.indices = graph.deps_csr
        # a node that allocates step outputs for good runs once
        recomputable = np.array([node.recomputable for node in graph.nodes], dtype=bool)
        self.movable = recomputable & (self.sizes > 0) & (kept == 0)
        self.movable[list(graph.outputs)] = False
        # Python lists for the per-value walk of ``_recompute_set`` (numpy's per-element calls
        # cost more than the work there)
        self._deps_list = [self.indices[self.indptr[v]:self.indptr[v + 1]].tolist() for v in range(graph.n)]
        self._movable_list = self.movable.tolist()
        self._sized_list = (self.sizes > 0).tolist()

    def reads(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``order_reads`` of the order ``nodes``."""
        return order_reads(self.graph, nodes)

    def best_move(self, stages: np.ndarray, nodes: np.ndarray, mem: np.ndarray, deadline: float, earlier: int = 0):
        """The move with the least added compute per byte of peak saved: (stages, nodes,
        memory) after it and what it adds (stage, nodes), or None when none lowers the peak or
        the plateau at it. A move computes its value again in the stage of its next read, or
        (``earlier``) in one of that many stages before it, after the peak's."""
        m = nodes.size
        peak = int(mem.max())
        at_peak = np.flatnonzero(mem == peak)
        p = int(at_peak[0])
        reader, value, inst = self.reads(nodes)
        last_read = np.arange(m)
        np.maximum.at(last_read, inst[inst >= 0], reader[inst >= 0])
        read_at_p = set(value[reader == p].tolist())
        # instances computed before p, read after it, movable, not read by the step at p
        before = np.arange(p)
        held = before[(last_read[:p] > p) & self.movable[nodes[:p]]]
        held = np.array([i for i in held if int(nodes[i]) not in read_at_p], dtype=np.int64)
        if not held.size:
            return None
        held = held[np.argsort(-self.sizes[nodes[held]], kind="stable")][:CANDIDATES_PER_MOVE]
        # the first read of each held instance after p
        after = (reader > p) & (inst >= 0)
        next_read = np.full(m, m, dtype=np.int64)
        np.minimum.at(next_read, inst[after], reader[after])
        sorted_occurrences = np.sort(nodes * m + np.arange(m))
        occurrences = sorted_occurrences.tolist()
        last_read_list = last_read.tolist()
        # where each held value may be computed again: the stage of its next read, or one of the
        # ``earlier`` stages before it after the peak's (``places``: value index, the stage,
        # where it begins and ends in the order, the position its inputs are looked up before)
        qs = next_read[held]
        stage_values = np.unique(stages)
        p_stage = int(stages[p])
        places: list[tuple[int, int, int, int, int]] = []
        for k in range(held.size):
            q = int(qs[k])
            if q >= m:
                continue
            at = int(np.searchsorted(stage_values, stages[q]))
            for back in range(earlier + 1):
                if back and (at - back < 0 or int(stage_values[at - back]) <= p_stage):
                    break  # (the read's own stage may be the peak's: then the value is computed after p)
                stage = int(stage_values[at - back])
                lo = int(np.searchsorted(stages, stage, side="left"))
                hi = int(np.searchsorted(stages, stage, side="right"))
                places.append((k, stage, lo, hi, q if back == 0 else lo))
        # Moves are tried in order of their least compute per byte (what they add over the
        # value's bytes, the most a move can save), each set found only when it is reached: a
        # value's own cost over its bytes is a lower bound for its move's, so a heap of those
        # bounds gives the same order as finding every set first and sorting (ties by size).
        held_nodes = nodes[held].tolist()
        sizes = self.sizes[nodes[held]].astype(float).tolist()
        own = self.costs[nodes[held]].astype(float).tolist()
        heap: list[tuple[float, int, list[int] | None]] = [
            (own[k] / sizes[k], j, None) for j, (k, *_rest) in enumerate(places)]
        heapq.heapify(heap)
        best = None
        count = at_peak.size
        # an order sorted by (stage, node), as every order after a move is, takes a move's
        # values at known positions: its memory is then found from the order's own frees
        order = (_Inserting(self, stages, nodes, reader, inst, last_read, sorted_occurrences, occurrences)
                 if in_stage_order(stages, nodes) and not (inst < 0).any() else None)
        while heap:
            least_ratio, j, added = heapq.heappop(heap)
            if time.perf_counter() > deadline or (best is not None and least_ratio >= best[0][0]):
                break  # no move left can beat the best one's compute per byte saved
            k, stage, lo, hi, q = places[j]
            if added is None:  # its set is not known yet: find it, and its place in the order
                added = self._recompute_set(held_nodes[k], q, p, (lo, hi), m, last_read_list, occurrences)
                if added is not None:
                    heapq.heappush(heap, (float(self.costs[added].sum()) / sizes[k], j, added))
                continue
            moved = (order.insert(added, lo, hi) if order is not None
                     else self._inserted(stages, nodes, added, stage))
            if moved is None:
                continue
            new_stages, new_nodes, new_mem = moved
            new_peak = int(new_mem.max())
            if new_peak > peak or (new_peak == peak and int((new_mem == peak).sum()) >= count):
                continue
            extra = float(self.costs[added].sum())
            saved = peak - new_peak
            # lower peak first; on a plateau (nothing saved), fewest positions left at the peak
            key = (extra / saved, 0.0) if saved > 0 else (np.inf, extra)
            if best is None or key < best[0]:
                best = (key, new_stages, new_nodes, new_mem, stage, np.asarray(added, dtype=np.int32))
        return None if best is None else best[1:]

    def _inserted(self, stages: np.ndarray, nodes: np.ndarray, added: list[int], stage: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(stages, nodes, memory) of the order with ``added`` computed in ``stage``, sorted by
        stage and node; None if a computation then reads a value never computed before it."""
        new_stages = np.concatenate((stages, np.full(len(added), stage, dtype=np.int64)))
        new_nodes = np.concatenate((nodes, np.asarray(added, dtype=np.int64)))
        by_stage = np.lexsort((new_nodes, new_stages))
        new_stages, new_nodes = new_stages[by_stage], new_nodes[by_stage]
        if (self.reads(new_nodes)[2] < 0).any():
            return None
        return new_stages, new_nodes, order_memory(self.graph, new_nodes)

    def _recompute_set(self, v: int, q: int, p: int, stage_range: tuple[int, int], m: int, last_read: list[int],
                       occurrences: list[int]) -> list[int] | None:
        """v and the inputs it needs computed again in the stage of position q: every input
        whose latest instance before q was freed before p (an input live across p, or
        computed after it, is read where it is). None when the set grows too large, needs a
        value that cannot be recomputed, or the stage computes one of them already.

        The order is sorted by stage: the stage of q is the positions ``lo..hi-1``
        (``stage_range``). ``occurrences`` is ``node * m + position`` of every position, sorted,
        where a value's instances are found by bisection."""
        lo, hi = stage_range
        n_occ = len(occurrences)
        deps, movable, sized = self._deps_list, self._movable_list, self._sized_list
        added: list[int] = []
        todo = [v]
        seen = {v}
        while todo:
            w = todo.pop()
            k = bisect_left(occurrences, w * m + lo)
            if k < n_occ and occurrences[k] < w * m + hi:
                return None  # the stage computes w already
            added.append(w)
            if len(added) > self.max_move_nodes:
                return None
            for u in deps[w]:
                if u in seen:
                    continue
                k = bisect_left(occurrences, u * m + q) - 1  # u's latest instance before q
                if k < 0 or occurrences[k] // m != u:
                    return None
                j = occurrences[k] % m
                if j > p or last_read[j] >= p:
                    continue  # live across p, or computed after it: read where it is
                if not movable[u] and sized[u]:
                    continue  # cannot be recomputed: its life is lengthened instead
                seen.add(u)
                todo.append(u)
        return sorted(added)


class _Inserting:
    """One order sorted by (stage, node), and what ``_Search._inserted`` gives for it, found
    without measuring the new order from scratch: its frees are the old order's, shifted,
    except those of the instances a move changes. For each value the move computes again
    (at its place in the stage, by node id), the previous instance is now freed at its last
    read before that place and the new one at the last read the old one had after it (or
    by a later value of the move); an input the move reads where it is lives at least until
    that read. Memory is then counted from the frees as ``order_memory`` counts it (a test
    compares the two on random moves)."""

    def __init__(self, search: _Search, stages: np.ndarray, nodes: np.ndarray, reader: np.ndarray, inst: np.ndarray,
                 last_read: np.ndarray, sorted_occurrences: np.ndarray, occurrences: list[int]) -> None:
        """``reader``, ``inst``: the order's reads (``order_reads``, every one of an instance);
        ``last_read``: each instance's last read (its own position if none);
        ``occurrences``: ``node * m + position`` of every position, sorted (also as a list)."""
        self.search = search
        self.graph = graph = search.graph
        self.stages, self.nodes = stages, nodes
        self.m = m = nodes.size
        self.reader, self.inst = reader, inst
        self.occurrences = occurrences
        self.sizes, self.kept, self.temp, _ = graph.node_arrays
        # the frees (``order_frees``): the last read, or never for an output's last instance
        of_node = sorted_occurrences // m
        starts = np.concatenate(([True], of_node[1:] != of_node[:-1]))
        ends = np.concatenate((starts[1:], [True]))
        self.free = last_read.copy()
        last_of_output = sorted_occurrences[ends & np.isin(of_node, list(graph.outputs))] % m
        self.free[last_of_output] = -1
        self.first = np.zeros(m, dtype=bool)
        self.first[sorted_occurrences[starts] % m] = True
        self.outputs = graph.output_set
        self.deps = search._deps_list

    def _latest_before(self, u: int, position: int) -> int:
        """The position of u's latest instance before ``position`` (-1 if none)."""
        m = self.m
        k = bisect_left(self.occurrences, u * m + position) - 1
        if k < 0 or self.occurrences[k] // m != u:
            return -1
        return self.occurrences[k] % m

    def insert(self, added: list[int], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``_Search._inserted`` for ``added`` (sorted) in the stage at positions ``lo..hi-1``
        (not empty)."""
        nodes, m, free = self.nodes, self.m, self.free
        in_stage = nodes[lo:hi].tolist()
        slots = [lo + bisect_left(in_stage, a) for a in added]  # each goes before this old position
        slot_array = np.asarray(slots, dtype=np.int64)

        def new_position(old: int) -> int:  # of an old position, once the move's values are in
            return old + bisect_left(slots, old + 1)

        new_free = free + np.searchsorted(slot_array, free, side="right")
        new_free[free < 0] = -1
        added_free: list[int] = []
        position_of = {a: slots[j] + j for j, a in enumerate(added)}
        for j, a in enumerate(added):
            here = slots[j] + j
            previous = self._latest_before(a, slots[j])
            if previous < 0 or free[previous] < 0 or a in self.outputs:  # (not a move's values)
                return self.search._inserted(self.stages, nodes, added, int(self.stages[lo]))
            readers = self.reader[self.inst == previous]  # (in order of position)
            cut = int(np.searchsorted(readers, slots[j], side="left"))
            new_free[previous] = new_position(int(readers[cut - 1])) if cut else new_position(previous)
            last = new_position(int(readers[-1])) if cut < readers.size else here
            for b in added[j + 1:]:
                if a in self.deps[b]:
                    last = max(last, position_of[b])
            added_free.append(last)
            for u in self.deps[a]:
                if u in position_of:
                    continue  # a value of the move, computed before a in the stage
                j_u = self._latest_before(u, slots[j])
                if j_u < 0:
                    return None  # a never computed before a reads it
                if free[j_u] >= 0:
                    new_free[j_u] = max(int(new_free[j_u]), here)
        free_all = np.insert(new_free, slot_array, np.asarray(added_free, dtype=np.int64))
        new_nodes = np.insert(nodes, slot_array, np.asarray(added, dtype=np.int64))
        new_stages = np.insert(self.stages, slot_array, self.stages[lo])
        first = np.insert(self.first, slot_array, False)
        return new_stages, new_nodes, self._memory(new_nodes, free_all, first)

    def _memory(self, nodes: np.ndarray, free: np.ndarray, first: np.ndarray) -> np.ndarray:
        """``order_memory`` of ``nodes`` given its frees and first instances."""
        sizes = self.sizes[nodes]
        freed_here = free >= 0
        freed = np.bincount(free[freed_here], weights=sizes[freed_here], minlength=nodes.size)
        allocated = sizes + np.where(first, self.kept[nodes], 0)
        after = (self.graph.fixed_bytes + np.cumsum(allocated)
                 - np.concatenate(([0], np.cumsum(freed)[:-1])).astype(np.int64))
        return after + self.temp[nodes]
