"""The retention model: op-level plans of whole traced graphs by mixed-integer programming.

Checkmate's MILP has O(n^2) binaries: it cannot be solved for the thousands of operations of a
real training step. The retention model restricts the plan space instead of the graph. Every
value computed before the backward pass begins (forward and loss) makes one of three choices:

* **keep**: it stays live from its computation to its last reader, recomputed never;
* **recompute at stage s**: it is freed after its last reader in the forward pass and computed
  once more at the start of backward stage s, where it lives until its last reader;
* neither, if nothing after the forward pass needs it.

Stage s is one of a few candidates: the stage of its first backward reader, or a stage at
which a value that reads it may be recomputed (snapped to the next block boundary of the
backward pass, within ``WINDOW`` of them), so a recomputation can run in the same stage as
its inputs'. Backward values are computed once and freed at their last reader. Every choice
is a plan remat can run: stage t recomputes the values chosen for it, in id order, then
computes node t; values are freed at their last use (``Schedule.lower``). Every forward value
is computed at most twice; what the model cannot express is a value computed three times.

Variables, per value v: ``keep[v]`` and ``by[v, k]``, "recomputed at or before the k-th
candidate stage" (monotone in k). Rows: kept or recomputed by the first backward reader (if
any); not both; ``by[w, k] <= keep[d] + by[d, k']`` for each input d of w (the input is live
when w is recomputed: kept, or recomputed by then; the cumulative form is what makes the LP
relaxation tight); memory at stage t. Memory is counted per stage, conservatively: a value
counts in every stage from its computation to the last stage that may read it, so the
model's memory is never below what the simulator measures for the plan. The memory rows are
added lazily: solve with the rows of the most crowded stages, then add the rows of stages the
solution overfills, until none does (a handful of rows on every model we benchmark).

The objective is the recomputation cost. The model's optimum is not the graph's optimum (the
plan space is restricted): bounds for the whole graph come from ``remat.solvers.bounds``.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from remat.cuts import light_cuts
from remat.graph import Graph, NodeKind
from remat.solvers.base import row_activity

log = logging.getLogger("remat.solve")

#: Candidate recomputation stages of a value, besides its first backward reader: at most this
#: many block boundaries of the backward pass before that reader.
WINDOW = 8
#: Memory rows added per round (``_overfilled``).
ROWS_PER_ROUND = 12
#: Rounds of adding memory rows before giving up (each round solves the model again).
MAX_ROUNDS = 30
#: How far a binary may sit from 0 or 1 and still be read as one.
BINARY_TOLERANCE = 1e-6
#: Relative gap at which the least-peak model stops (its peak is the smallest budget found).
PEAK_GAP = 1e-4
#: ``milp`` stops searching the model within this share of the step's whole cost of the model's
#: own bound: the model's optimum is not the graph's (the gap reported is to the whole graph's
#: bound), and the last fraction of a percent is where the time goes: on a 24-layer GPT-2 at
#: 40% of its peak, a 0.05% gap took 8-11 s, 0.1% 1.7 s, for a plan 0.03% of the step dearer,
#: far below what step times can show.
MODEL_GAP = 1e-3


@dataclass(frozen=True)
class RetentionSolution:
    """A plan of the retention model: the recomputation stage of each value (-1: none)."""

    recompute_at: np.ndarray  # per value of the structure's ``values``
    keep: np.ndarray  # bool per value
    cost: float  # recomputation cost (model units = graph units)
    model_peak_bytes: int  # the model's (conservative) peak

    def order(self, structure: RetentionStructure) -> list[tuple[int, int]]:
        """``(stage, node)`` computations in order: each stage's recomputations (id order),
        then the stage's own node."""
        by_stage: dict[int, list[int]] = {}
        for v, s in zip(structure.values.tolist(), self.recompute_at.tolist()):
            if s >= 0:
                by_stage.setdefault(s, []).append(v)
        out: list[tuple[int, int]] = []
        for t in range(structure.graph.n):
            out += [(t, v) for v in sorted(by_stage.get(t, ()))]
            out.append((t, t))
        return out


class RetentionStructure:
    """The budget-independent part of the retention model of one graph.

    >>> from remat.builders import chain_graph
    >>> s = RetentionStructure(chain_graph(4, bytes_per_node=1))
    >>> s.values.tolist(), s.n_cols > 0
    ([0, 1, 2], True)
    """

    def __init__(self, graph: Graph, *, window: int = WINDOW) -> None:
        self.graph = graph
        n, users = graph.n, graph.users
        self.backward_start = next((i for i, node in enumerate(graph.nodes) if node.kind is NodeKind.BACKWARD), n)
        bwd = self.backward_start
        outputs = graph.output_set
        reaches = [False] * n  # some node of the backward pass depends on it
        for v in range(n - 1, -1, -1):
            reaches[v] = v >= bwd or any(reaches[u] for u in users[v])
        values = [v for v in range(bwd) if reaches[v] and v not in outputs and graph.nodes[v].out_bytes > 0]
        self.values = np.asarray(values, dtype=np.int64)
        index = {v: q for q, v in enumerate(values)}
        self.index = index
        boundaries = sorted({bwd} | {c.node + 1 for c in light_cuts(graph, NodeKind.BACKWARD) if c.node + 1 < n})

        def snap(s: int) -> int:  # the latest block boundary at or before stage s
            k = bisect.bisect_right(boundaries, s) - 1
            return boundaries[k] if k >= 0 else s

        first_reader: list[int | None] = []
        candidates: list[list[int]] = [[] for _ in values]
        for q in range(len(values) - 1, -1, -1):
            v = values[q]
            node = graph.nodes[v]
            first = next((u for u in users[v] if u >= bwd), None)
            first_reader.append(first)
            if not node.recomputable:
                continue
            limit = first if first is not None else n
            stages: set[int] = set()
            for w in users[v]:
                if w in index:
                    stages.update(snap(s) for s in candidates[index[w]] if snap(s) < limit)
            ordered = sorted(stages)[-window:]
            if first is not None:
                ordered.append(first)
            candidates[q] = ordered
        first_reader.reverse()
        self.first_reader = first_reader
        self.candidates = [np.asarray(c, dtype=np.int64) for c in candidates]
        self.last_forward = np.array([max((u for u in users[v] if u < bwd), default=v) for v in values], dtype=np.int64)
        last = []
        for q, v in enumerate(values):
            end = max((u for u in users[v] if u >= bwd), default=-1)
            for w in users[v]:
                if w in index and candidates[index[w]]:
                    end = max(end, candidates[index[w]][-1])
            last.append(end)
        self.last_need = np.asarray(last, dtype=np.int64)
        self._columns()

    # ------------------------------------------------------------------ layout
    def _columns(self) -> None:
        """Column numbers: keep[q] (or -1 when keeping is pointless), then by[q, k]."""
        keep_col, by_start = [], []
        col = 0
        for q in range(self.values.size):
            # keeping is a choice only if something may read the value after the forward pass
            useful = bool(self.last_need[q] > self.last_forward[q])
            keep_col.append(col if useful else -1)
            col += 1 if useful else 0
            by_start.append(col)
            col += self.candidates[q].size
        self.keep_col = np.asarray(keep_col, dtype=np.int64)
        self.by_start = np.asarray(by_start, dtype=np.int64)
        self.n_cols = col

    def by_col(self, q: int, k: int) -> int:
        return int(self.by_start[q] + k)

    def latest_candidate(self, q: int, stage: int) -> int:
        """Index of value q's latest candidate stage at or before ``stage`` (-1: none)."""
        return int(np.searchsorted(self.candidates[q], stage, side="right")) - 1

    @cached_property
    def costs(self) -> np.ndarray:
        """Objective: value q's cost on its last ``by`` column (recomputed at all)."""
        c = np.zeros(self.n_cols)
        for q, v in enumerate(self.values.tolist()):
            if self.candidates[q].size:
                c[self.by_col(q, self.candidates[q].size - 1)] = self.graph.nodes[v].cost
        return c

    # ------------------------------------------------------------------ rows that never change
    @cached_property
    def structure_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(starts, index, value, lower, upper) of the rows that do not depend on the budget."""
        rows: list[tuple[list[int], list[float], float, float]] = []
        g = self.graph
        for q, v in enumerate(self.values.tolist()):
            kc, cand = int(self.keep_col[q]), self.candidates[q]
            last = self.by_col(q, cand.size - 1) if cand.size else -1
            for k in range(1, cand.size):  # recomputed by an earlier stage -> by every later one
                rows.append(([self.by_col(q, k), self.by_col(q, k - 1)], [1.0, -1.0], 0.0, math.inf))
            if kc >= 0 and last >= 0:  # kept or recomputed, not both
                rows.append(([kc, last], [1.0, 1.0], -math.inf, 1.0))
            if self.first_reader[q] is not None:  # the first backward reader finds it live
                cols = [c for c in (kc, last) if c >= 0]
                rows.append((cols, [1.0] * len(cols), 1.0, math.inf))
            for k, s in enumerate(cand.tolist()):
                for d in g.nodes[v].deps:
                    qd = self.index.get(d)
                    if qd is None:
                        continue  # live whenever needed (see ``constant_memory``)
                    cols, vals = [self.by_col(q, k)], [1.0]
                    if self.keep_col[qd] >= 0:
                        cols.append(int(self.keep_col[qd]))
                        vals.append(-1.0)
                    kd = self.latest_candidate(qd, s)
                    if kd >= 0:
                        cols.append(self.by_col(qd, kd))
                        vals.append(-1.0)
                    rows.append((cols, vals, -math.inf, 0.0))
        starts = np.zeros(len(rows) + 1, dtype=np.int64)
        starts[1:] = np.cumsum([len(r[0]) for r in rows])
        index = np.fromiter((c for r in rows for c in r[0]), dtype=np.int64, count=int(starts[-1]))
        value = np.fromiter((x for r in rows for x in r[1]), dtype=float, count=int(starts[-1]))
        return starts, index, value, np.array([r[2] for r in rows]), np.array([r[3] for r in rows])

    # ------------------------------------------------------------------ memory
    @cached_property
    def live_terms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(column, first stage, last stage, bytes): the column adds its bytes to every stage
        in between. ``keep[q]`` covers the stages after its last forward reader; ``by[q, k]``
        the stages from its candidate to the next candidate (the last one: to the value's last
        possible reader)."""
        cols, first, last, size = [], [], [], []
        for q, v in enumerate(self.values.tolist()):
            b = self.graph.nodes[v].out_bytes
            end = int(self.last_need[q])
            if self.keep_col[q] >= 0 and end > self.last_forward[q]:
                cols.append(int(self.keep_col[q]))
                first.append(int(self.last_forward[q]) + 1)
                last.append(end)
                size.append(b)
            cand = self.candidates[q].tolist()
            for k, s in enumerate(cand):
                stop = cand[k + 1] - 1 if k + 1 < len(cand) else max(end, s)
                cols.append(self.by_col(q, k))
                first.append(s)
                last.append(stop)
                size.append(b)
        return (np.asarray(cols, dtype=np.int64), np.asarray(first, dtype=np.int64),
                np.asarray(last, dtype=np.int64), np.asarray(size, dtype=np.int64))

    @cached_property
    def scratch_terms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(column, stage, scratch bytes): a recomputation at stage s holds its node's scratch
        there (by[q, k] - by[q, k-1] is 1 exactly when q is recomputed at its k-th stage)."""
        cols, stages, size = [], [], []
        for q, v in enumerate(self.values.tolist()):
            temp = self.graph.nodes[v].temp_bytes
            if not temp:
                continue
            for k, s in enumerate(self.candidates[q].tolist()):
                cols.append(self.by_col(q, k))
                stages.append(s)
                size.append(temp)
                if k:
                    cols.append(self.by_col(q, k - 1))
                    stages.append(s)
                    size.append(-temp)
        return np.asarray(cols, dtype=np.int64), np.asarray(stages, dtype=np.int64), np.asarray(size, dtype=np.int64)

    @cached_property
    def constant_memory(self) -> np.ndarray:
        """Memory at each stage whatever the choices: fixed bytes, kept bytes so far, the
        stage's scratch, every value outside the model from its computation to its last
        reader (step outputs: to the end), and the model's values during the forward pass.

        A value outside the model that a recomputed value reads (it cannot be recomputed) is
        counted up to the last stage that may read it."""
        g, n = self.graph, self.graph.n
        diff = np.zeros(n + 1, dtype=np.int64)
        in_model = np.zeros(n, dtype=bool)
        in_model[self.values] = True
        extend = np.full(n, -1, dtype=np.int64)  # last stage a recomputation may read it
        for q, v in enumerate(self.values.tolist()):
            if self.candidates[q].size:
                for d in g.nodes[v].deps:
                    if not in_model[d]:
                        extend[d] = max(extend[d], int(self.candidates[q][-1]))
        users = g.users
        for v, node in enumerate(g.nodes):
            b = node.out_bytes
            if not b:
                continue
            if in_model[v]:
                end = int(self.last_forward[self.index[v]])
            elif v in g.output_set:
                end = n - 1
            else:
                end = max(users[v][-1] if users[v] else v, int(extend[v]))
            diff[v] += b
            diff[end + 1] -= b
        kept = np.cumsum([node.kept_bytes for node in g.nodes], dtype=np.int64)
        temp = np.array([node.temp_bytes for node in g.nodes], dtype=np.int64)
        return g.fixed_bytes + np.cumsum(diff)[:n] + kept + temp

    def memory(self, x: np.ndarray) -> np.ndarray:
        """The model's memory at every stage for column values ``x`` (fractional allowed)."""
        n = self.graph.n
        cols, first, last, size = self.live_terms
        diff = np.zeros(n + 1)
        weight = x[cols] * size
        np.add.at(diff, first, weight)
        np.add.at(diff, last + 1, -weight)
        out = self.constant_memory + np.cumsum(diff)[:n]
        s_cols, s_stage, s_size = self.scratch_terms
        if s_cols.size:
            np.add.at(out, s_stage, x[s_cols] * s_size)
        return out

    def memory_row(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Columns and byte coefficients of the memory at stage t (the constant part aside)."""
        cols, first, last, size = self.live_terms
        on = (first <= t) & (t <= last)
        c, v = cols[on], size[on].astype(float)
        s_cols, s_stage, s_size = self.scratch_terms
        if s_cols.size:
            at = s_stage == t
            c = np.concatenate([c, s_cols[at]])
            v = np.concatenate([v, s_size[at].astype(float)])
        if c.size:
            c, inverse = np.unique(c, return_inverse=True)
            v = np.bincount(inverse, weights=v)
        return c, v

    # ------------------------------------------------------------------ solutions
    def solution(self, x: np.ndarray) -> RetentionSolution:
        """Read a 0/1 column vector as a plan; ``ValueError`` names a column that is not."""
        off = np.abs(x - np.round(x))
        if off.size and off.max() > BINARY_TOLERANCE:
            raise ValueError(f"column {int(off.argmax())} = {x[off.argmax()]!r} is not within {BINARY_TOLERANCE} of 0 or 1")
        b = np.round(x) > 0.5
        at = np.full(self.values.size, -1, dtype=np.int64)
        keep = np.zeros(self.values.size, dtype=bool)
        for q in range(self.values.size):
            if self.keep_col[q] >= 0:
                keep[q] = b[self.keep_col[q]]
            on = np.flatnonzero(b[self.by_start[q]:self.by_start[q] + self.candidates[q].size])
            if on.size:
                at[q] = self.candidates[q][on[0]]
        return self.solution_of(keep, at)

    def solution_of(self, keep: np.ndarray, recompute_at: np.ndarray) -> RetentionSolution:
        """The plan that keeps ``keep`` and recomputes each value at ``recompute_at`` (-1:
        not), with its cost and model peak."""
        sol = RetentionSolution(recompute_at.copy(), keep.copy(), 0.0, 0)
        x = self.columns_of(sol)
        return RetentionSolution(sol.recompute_at, sol.keep, float(self.costs @ x),
                                 int(math.ceil(self.memory(x).max() - 1e-6)))

    def columns_of(self, solution: RetentionSolution) -> np.ndarray:
        """The 0/1 column vector of a solution (the inverse of ``solution``)."""
        x = np.zeros(self.n_cols)
        for q in range(self.values.size):
            if self.keep_col[q] >= 0 and solution.keep[q]:
                x[self.keep_col[q]] = 1.0
            s = int(solution.recompute_at[q])
            if s >= 0:
                k = int(np.searchsorted(self.candidates[q], s))
                x[self.by_start[q] + k:self.by_start[q] + self.candidates[q].size] = 1.0
        return x

    def violation(self, x: np.ndarray) -> float:
        """Largest violation of a budget-independent row by ``x`` (0 when it satisfies all)."""
        starts, index, value, lower, upper = self.structure_rows
        if not lower.size:
            return 0.0
        activity = row_activity(starts, index, value, x)
        return float(max(np.max(lower - activity, initial=0.0), np.max(activity - upper, initial=0.0)))


# ---------------------------------------------------------------------------- solving
@dataclass(frozen=True)
class RetentionResult:
    """What one solve of the retention model gave: the best plan (None if none was found),
    whether the model proved it optimal (for the model, not the graph), the model's own lower
    bound, the memory rows it needed and the work done."""

    solution: RetentionSolution | None
    optimal: bool
    infeasible: bool
    model_bound: float | None
    rows: tuple[int, ...]
    rounds: int
    nodes: int
    solve_s: float


def solve_retention(structure: RetentionStructure, budget_bytes: int, *, time_limit_s: float = 60.0,
                    mip_gap: float = 1e-4, threads: int = 2, start: RetentionSolution | None = None,
                    stop_at: float | None = None, rows: tuple[int, ...] = (),
                    minimize_peak: bool = False,
                    accept: Callable[[RetentionSolution], bool] | None = None) -> RetentionResult:
    """The cheapest plan of the retention model whose model memory fits ``budget_bytes``
    (``minimize_peak``: the plan of least model peak, budget ignored).

    ``mip_gap`` is relative to the step's whole cost (``graph.total_cost``), as ``milp``'s is:
    the search stops when no plan of the model can be cheaper by more than that. ``start`` is
    a plan known to fit (a MIP start); ``stop_at`` ends the search as soon as a plan costs at
    most that much recomputation (e.g. when it meets a bound for the whole graph); ``rows``
    are stages whose memory rows to include from the start. ``accept`` is asked about a MIP
    plan that overfills a stage in the model's count (which never counts less than the
    simulator): if it says the plan fits (it simulated within the budget), the plan is taken
    as if it fit the model, saving the round that would add that stage's row.
    """
    started = time.perf_counter()
    deadline = started + time_limit_s
    g = structure.graph
    if structure.n_cols == 0:
        peak = int(structure.constant_memory.max())
        fits = minimize_peak or peak <= budget_bytes
        sol = RetentionSolution(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), 0.0, peak) if fits else None
        return RetentionResult(sol, fits, not fits, 0.0 if fits else None, (), 0, 0, time.perf_counter() - started)
    constant = structure.constant_memory
    if not minimize_peak and np.any(constant > budget_bytes):
        return RetentionResult(None, False, True, None, (), 0, 0, time.perf_counter() - started)
    # start from the given rows and the stage the model's values cannot change
    chosen = list(dict.fromkeys([*(int(t) for t in rows if 0 <= t < g.n), int(np.argmax(constant))]))
    # 1. rows from the LP relaxation: cheap, and its solution overfills the stages that matter
    lp = relax_retention(structure, budget_bytes, chosen, deadline=deadline, threads=threads,
                         minimize_peak=minimize_peak)
    rounds = lp.rounds
    if lp.infeasible:
        return RetentionResult(None, False, True, None, tuple(chosen), rounds, 0, time.perf_counter() - started)
    # 2. the MIP on those rows, started from the best of ``start`` and the rounded LP; a
    # solution that overfills another stage adds its row and goes again
    enough = stop_at  # a plan costing this much ends the search
    slack = mip_gap * g.total_cost  # the model's gap, in cost units
    if lp.x is not None:
        if minimize_peak:
            rounded = min((round_solution(structure, lp.x, t) for t in ROUNDING_THRESHOLDS),
                          key=lambda s: (s.model_peak_bytes, s.cost))
        else:
            rounded = best_rounding(structure, lp.x, budget_bytes)[0]
        fits = rounded is not None
        if fits and (start is None or _better(rounded, start, minimize_peak)):
            start = rounded
        # the LP is often integral or nearly: a rounded plan that meets the target (or the LP
        # value itself, a bound for the model) needs no MIP
        if fits and not minimize_peak and (
                (stop_at is not None and rounded.cost <= stop_at + 1e-9 * max(1.0, stop_at))
                or rounded.cost <= lp.value + slack + 1e-9):
            optimal = rounded.cost <= lp.value + slack + 1e-9
            log.info("retention: %s under %d B: the rounded LP plan (recomputation %g%s), %d memory rows, "
                     "%d rounds, %.2f s", g.name, budget_bytes, rounded.cost, ", model optimum" if optimal else "",
                     len(chosen), rounds, time.perf_counter() - started)
            return RetentionResult(rounded, optimal, False, lp.value, tuple(chosen), rounds, 0,
                                   time.perf_counter() - started)
        if not minimize_peak:
            # most columns are integral in the LP: the MIP over the fractional ones alone (the
            # others fixed at their LP values) is small and usually lands within the gap; so
            # does any plan within the gap of the LP's value, a bound for the model
            enough = lp.value + slack if stop_at is None else max(stop_at, lp.value + slack)
            found = _fixed_integral(structure, budget_bytes, chosen, lp.x, threads=threads, mip_gap=mip_gap,
                                    deadline=deadline, stop_at=enough, accept=accept)
            rounds += 1
            if found is not None and found.cost <= enough + 1e-9 * max(1.0, enough):
                optimal = found.cost <= lp.value + slack + 1e-9
                log.info("retention: %s under %d B: the LP's fractional columns solved alone (recomputation %g, "
                         "model's LP bound %g), %d memory rows, %d rounds, %.2f s", g.name, budget_bytes, found.cost,
                         lp.value, len(chosen), rounds, time.perf_counter() - started)
                return RetentionResult(found, optimal, False, lp.value, tuple(chosen), rounds, 0,
                                       time.perf_counter() - started)
            if found is not None and (start is None or _better(found, start, minimize_peak)):
                start = found
    best: RetentionSolution | None = None
    optimal, bound, nodes = False, None, 0
    start_x = structure.columns_of(start) if start is not None else None
    while time.perf_counter() < deadline:
        rounds += 1
        mip = _solve(structure, budget_bytes, chosen, relax=False, threads=threads, mip_gap=mip_gap,
                     time_limit_s=max(deadline - time.perf_counter(), 0.1), start=start_x,
                     stop_at=enough, minimize_peak=minimize_peak)
        nodes += mip.nodes
        if mip.infeasible:
            return RetentionResult(best, False, best is None, bound, tuple(chosen), rounds, nodes,
                                   time.perf_counter() - started)
        if mip.x is None:
            break
        added = _overfilled(structure, mip.x, budget_bytes, chosen, mip.peak)
        if added and not (accept is not None and not minimize_peak and accept(structure.solution(mip.x))):
            chosen += added
            continue
        best = structure.solution(mip.x)
        optimal, bound = mip.optimal, mip.bound
        if lp.value is not None and not minimize_peak and best.cost <= lp.value + slack + 1e-9:
            optimal, bound = True, max(bound if bound is not None else -math.inf, lp.value)  # within the LP's gap
        break
    if best is None and start is not None and (minimize_peak or start.model_peak_bytes <= budget_bytes):
        best = start
    log.info("retention: %s under %d B: %s, %d memory rows, %d rounds, %d nodes, %.2f s", g.name, budget_bytes,
             "no plan" if best is None else f"recomputation {best.cost:g}{' (model optimum)' if optimal else ''}",
             len(chosen), rounds, nodes, time.perf_counter() - started)
    return RetentionResult(best, optimal, False, bound, tuple(chosen), rounds, nodes, time.perf_counter() - started)


#: Time the MIP over the LP's fractional columns may take in all (``_fixed_integral``).
FIXED_MIP_S = 3.0


def _fixed_integral(structure: RetentionStructure, budget_bytes: int, rows: list[int], x: np.ndarray, *,
                    threads: int, mip_gap: float, deadline: float, stop_at: float | None = None,
                    accept: Callable[[RetentionSolution], bool] | None = None) -> RetentionSolution | None:
    """The best plan of the model with every column the LP solution ``x`` sets to 0 or 1 fixed
    there (the MIP over its fractional columns; an LP-guided neighbourhood search), or None if
    it finds none that fits every stage in the time (or that ``accept`` takes, see
    ``solve_retention``). Stops at a plan costing at most ``stop_at``; stages its plans
    overfill are added to ``rows`` (in place) and it goes again.
    """
    fixed = np.where(x <= BINARY_TOLERANCE, 0.0, np.where(x >= 1 - BINARY_TOLERANCE, 1.0, np.nan))
    until = min(deadline, time.perf_counter() + FIXED_MIP_S)
    while time.perf_counter() < until - 0.05:
        run = _solve(structure, budget_bytes, rows, relax=False, threads=threads,
                     time_limit_s=until - time.perf_counter(), mip_gap=mip_gap, fixed=fixed, stop_at=stop_at)
        if run.x is None:
            return None
        added = _overfilled(structure, run.x, budget_bytes, rows, None)
        if not added or (accept is not None and accept(structure.solution(run.x))):
            return structure.solution(run.x)
        rows += added
    return None


@dataclass(frozen=True)
class Relaxed:
    """The retention model's LP relaxation with enough memory rows that its solution fits every
    stage: ``x`` (None if the time ran out first), the rows, the LP value (recomputation cost;
    not a bound for the graph, whose plans the model does not all contain)."""

    x: np.ndarray | None
    infeasible: bool
    value: float | None
    rounds: int


def relax_retention(structure: RetentionStructure, budget_bytes: int, rows: list[int], *, deadline: float,
                    threads: int = 2, minimize_peak: bool = False) -> Relaxed:
    """Solve the LP relaxation, adding the memory rows its solution overfills (to ``rows``, in
    place) until it fills no stage over the budget."""
    rounds, x, value = 0, None, None
    # one model, its rows added as found: each round starts from the last one's basis
    model = _model(structure, budget_bytes, rows, relax=True, threads=threads, minimize_peak=minimize_peak)
    while rounds < MAX_ROUNDS and time.perf_counter() < deadline:
        rounds += 1
        lp = _run(model, structure, budget_bytes, rows, relax=True, threads=threads,
                  time_limit_s=max(deadline - time.perf_counter(), 0.1), minimize_peak=minimize_peak)
        if lp.infeasible:
            return Relaxed(None, True, None, rounds)
        if lp.x is None:
            break
        added = _overfilled(structure, lp.x, budget_bytes, rows, lp.peak)
        if not added and not minimize_peak:
            # the plans rounded from it overfill the stages an integral plan will: their rows too
            fits, tried = best_rounding(structure, lp.x, budget_bytes)
            if fits is None:
                added = _overfilled(structure, structure.columns_of(min(tried, key=lambda s: s.model_peak_bytes)),
                                    budget_bytes, rows, None)
        if not added:
            x, value = lp.x, float(structure.costs @ lp.x)
            break
        rows += added
        _add_memory_rows(model, structure, budget_bytes, added, minimize_peak)
    return Relaxed(x, False, value, rounds)


def round_solution(structure: RetentionStructure, x: np.ndarray, threshold: float = 0.5) -> RetentionSolution:
    """A plan of the model from fractional columns: keep a value whose keep column is at least
    ``threshold``, else recompute it at the first candidate stage its column reaches
    ``threshold`` (keeping wins a tie between the two), then repair the rows the rounding
    broke: a value read at its first backward reader and neither kept nor recomputed is
    recomputed there (kept if it cannot be); an input that a recomputation needs is
    recomputed at its latest stage not after it (kept if it has none). Thresholds near 1
    keep less and recompute later: plans that need less memory. Its memory may still exceed
    a budget: check ``model_peak_bytes``."""
    n_values = structure.values.size
    keep = np.zeros(n_values, dtype=bool)
    at = np.full(n_values, -1, dtype=np.int64)
    for q in range(n_values):
        kc = structure.keep_col[q]
        cand = structure.candidates[q]
        by = x[structure.by_start[q]:structure.by_start[q] + cand.size]
        keep_value = x[kc] if kc >= 0 else 0.0
        on = np.flatnonzero(by >= threshold - 1e-9)
        if kc >= 0 and keep_value >= threshold - 1e-9 and (not on.size or keep_value >= by[-1]):
            keep[q] = True
        elif on.size:
            at[q] = cand[on[0]]
        elif cand.size and by[-1] > 1e-9:  # recomputed in part: recomputed, as late as it may be
            at[q] = cand[-1]
        if structure.first_reader[q] is not None and not keep[q] and at[q] < 0:
            if cand.size:
                at[q] = cand[-1]
            else:
                keep[q] = True
    g = structure.graph
    for q in range(n_values - 1, -1, -1):  # users before their inputs: a repair only moves inputs
        if at[q] < 0:
            continue
        for d in g.nodes[int(structure.values[q])].deps:
            qd = structure.index.get(d)
            if qd is None or keep[qd] or 0 <= at[qd] <= at[q]:
                continue
            k = structure.latest_candidate(qd, int(at[q]))
            if k >= 0:
                at[qd] = structure.candidates[qd][k]
            else:
                keep[qd] = True
                at[qd] = -1
    return structure.solution_of(keep, at)


#: Thresholds the LP relaxation is rounded at (``round_solution``): the usual 0.5, and ones
#: that keep only what the LP keeps whole (less memory, a little more recomputation).
ROUNDING_THRESHOLDS = (0.5, 0.9, 0.999)


def best_rounding(structure: RetentionStructure, x: np.ndarray, budget_bytes: int
                  ) -> tuple[RetentionSolution | None, list[RetentionSolution]]:
    """The cheapest rounding of ``x`` (at ``ROUNDING_THRESHOLDS``) whose model memory fits, and
    every rounding tried."""
    tried = [round_solution(structure, x, threshold) for threshold in ROUNDING_THRESHOLDS]
    fitting = [s for s in tried if s.model_peak_bytes <= budget_bytes]
    return min(fitting, key=lambda s: (s.cost, s.model_peak_bytes), default=None), tried


def _better(a: RetentionSolution, b: RetentionSolution, minimize_peak: bool) -> bool:
    key = (lambda s: (s.model_peak_bytes, s.cost)) if minimize_peak else (lambda s: (s.cost, s.model_peak_bytes))
    return key(a) < key(b)


def _overfilled(structure: RetentionStructure, x: np.ndarray, budget_bytes: int, chosen: list[int],
                peak: float | None) -> list[int]:
    """Stages (not yet rows) whose model memory exceeds the budget (or, minimizing the peak,
    the solution's peak), the most overfilled first."""
    memory = structure.memory(x)
    cap = peak if peak is not None else budget_bytes
    over = memory - cap
    over[chosen] = -np.inf
    worst = np.flatnonzero(over > max(1e-6 * cap, 0.5))
    if not worst.size:
        return []
    # overfilled stages come in runs (a stretch of the backward pass holding the same values):
    # the most overfilled stage of each run first, the most overfilled runs first (a plan
    # overfilling three stretches of ResNet50 b32's backward pass needed four MIPs when the
    # rows all went to the worst one), then one row per neighbourhood of the rest
    runs = np.split(worst, np.flatnonzero(np.diff(worst) > 2) + 1)
    heads = sorted((int(r[np.argmax(over[r])]) for r in runs), key=lambda t: -over[t])
    picked: list[int] = []
    for t in [*heads, *worst[np.argsort(-over[worst], kind="stable")].tolist()]:
        if all(abs(t - p) > 2 for p in picked):
            picked.append(t)
        if len(picked) == ROWS_PER_ROUND:
            break
    return picked


@dataclass(frozen=True)
class _Run:
    x: np.ndarray | None
    infeasible: bool
    optimal: bool
    bound: float | None
    nodes: int
    peak: float | None  # the peak variable's value (minimize_peak), in bytes


@dataclass
class _Model:
    """A HiGHS model of the retention structure with some stages' memory rows."""

    h: object
    scale: float  # objective scale (recomputation cost times it is the objective)
    mem_unit: float  # memory rows are in units of this many bytes
    col_cost: np.ndarray
    n_cols: int
    peak_col: int  # the peak column (minimize_peak), else n_cols


def _model(structure: RetentionStructure, budget_bytes: int, stages: list[int], *, relax: bool, threads: int,
           mip_gap: float = 1e-4, minimize_peak: bool = False, fixed: np.ndarray | None = None,
           presolve: bool = True) -> _Model:
    """The model with the structure's rows and the memory rows of ``stages``, options set but
    the time limit."""
    import highspy

    from remat.solvers.milp_backends import objective_scale, quiet_highs

    starts, index, value, lower, upper = structure.structure_rows
    n_cols = structure.n_cols + (1 if minimize_peak else 0)
    mem_unit = float(max(structure.graph.out_bytes, default=1) or 1)  # memory rows in units of the largest value
    peak_col = structure.n_cols
    rows = _memory_rows(structure, budget_bytes, stages, mem_unit, minimize_peak)
    row_starts = np.concatenate([starts, rows[0][1:] + int(starts[-1])])
    scale = objective_scale(structure.costs)
    col_upper = np.ones(n_cols)
    if minimize_peak:  # the peak column alone is the objective
        col_cost = np.concatenate([np.zeros(structure.n_cols), [1.0]])
        col_upper[peak_col] = highspy.kHighsInf
    else:
        col_cost = structure.costs * scale
    h = quiet_highs()
    h.setOptionValue("threads", int(threads))
    if not presolve:
        h.setOptionValue("presolve", "off")
    if minimize_peak:
        h.setOptionValue("mip_rel_gap", PEAK_GAP)
    else:  # the objective is the recomputation cost alone; the gap meant is on the whole step's cost
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", float(mip_gap * structure.graph.total_cost * scale))
    h.setOptionValue("mip_feasibility_tolerance", 1e-7)
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = row_starts.size - 1
    lp.col_cost_ = col_cost
    col_lower = np.zeros(n_cols)
    if fixed is not None:  # columns fixed at 0 or 1 (NaN: free)
        pinned = np.flatnonzero(~np.isnan(fixed))
        col_lower[pinned] = col_upper[pinned] = fixed[pinned]
    lp.col_lower_ = col_lower
    lp.col_upper_ = col_upper
    rl, ru = np.concatenate([lower, rows[3]]), np.concatenate([upper, rows[4]])
    lp.row_lower_ = np.where(np.isinf(rl), -highspy.kHighsInf, rl)
    lp.row_upper_ = np.where(np.isinf(ru), highspy.kHighsInf, ru)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = row_starts.astype(np.int32)
    lp.a_matrix_.index_ = np.concatenate([index, rows[1]]).astype(np.int32)
    lp.a_matrix_.value_ = np.concatenate([value, rows[2]]).astype(float)
    lp.a_matrix_.num_col_ = n_cols
    lp.a_matrix_.num_row_ = lp.num_row_
    if not relax:
        kinds = [highspy.HighsVarType.kInteger] * structure.n_cols
        if minimize_peak:
            kinds.append(highspy.HighsVarType.kContinuous)
        lp.integrality_ = kinds
    h.passModel(lp)
    return _Model(h, scale, mem_unit, col_cost, n_cols, peak_col)


def _memory_rows(structure: RetentionStructure, budget_bytes: int, stages: list[int], mem_unit: float,
                 minimize_peak: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The memory rows of ``stages`` in CSR form: starts (from 0), columns, coefficients, lower
    and upper bounds (in ``mem_unit``; minimizing the peak, each row less the peak column)."""
    constant = structure.constant_memory
    starts, cols_all, coef_all, upper = [0], [], [], []
    for t in stages:
        cols, coef = structure.memory_row(t)
        coef = coef / mem_unit
        if minimize_peak:
            cols = np.concatenate([cols, [structure.n_cols]])
            coef = np.concatenate([coef, [-1.0]])
            upper.append(-float(constant[t]) / mem_unit)
        else:
            upper.append(float(budget_bytes - constant[t]) / mem_unit)
        cols_all.append(cols)
        coef_all.append(coef)
        starts.append(starts[-1] + cols.size)
    empty = np.zeros(0)
    return (np.asarray(starts, dtype=np.int64), np.concatenate(cols_all) if cols_all else empty.astype(np.int64),
            np.concatenate(coef_all) if coef_all else empty, np.full(len(stages), -math.inf), np.asarray(upper))


def _add_memory_rows(model: _Model, structure: RetentionStructure, budget_bytes: int, stages: list[int],
                     minimize_peak: bool) -> None:
    """Add the memory rows of ``stages`` to ``model`` (a solved LP keeps its basis: the next
    run starts from it)."""
    import highspy

    starts, cols, coef, lower, upper = _memory_rows(structure, budget_bytes, stages, model.mem_unit, minimize_peak)
    model.h.addRows(len(stages), np.where(np.isinf(lower), -highspy.kHighsInf, lower), upper, int(cols.size),
                    starts[:-1].astype(np.int32), cols.astype(np.int32), coef.astype(float))


def _solve(structure: RetentionStructure, budget_bytes: int, stages: list[int], *, relax: bool, threads: int,
           time_limit_s: float, mip_gap: float = 1e-4, start: np.ndarray | None = None,
           stop_at: float | None = None, minimize_peak: bool = False,
           fixed: np.ndarray | None = None, presolve: bool | None = None) -> _Run:
    """Build and run the model (``_model``, ``_run``). ``presolve`` None: HiGHS' presolve for
    the LP, the least-peak MIP (ResNet50 b32: 17 s against 30 s without) and a MIP with columns
    fixed (``_fixed_integral``: presolve removes them), not for a MIP of the recomputation cost.
    Given a start, HiGHS solved that faster without presolve in every case measured (GPT-2 of 4
    and 12 layers, MobileNet b256, U-Net b32 from 80% of the checkpoint-all peak to the
    smallest budget: 0.03-2.2 s against 0.11-2.6 s, the same plans or cheaper ones but once),
    and with it was seen to return wrong solutions (see ``_run``); without a start too:
    ResNet50 b32 at 40%, whose MIPs are solved at the root, spent 0.9 s of each 1.3-1.5 s in
    presolve (0.6-0.7 s each without it)."""
    if presolve is None:
        presolve = relax or minimize_peak or fixed is not None
    model = _model(structure, budget_bytes, stages, relax=relax, threads=threads, mip_gap=mip_gap,
                   minimize_peak=minimize_peak, fixed=fixed, presolve=presolve)
    return _run(model, structure, budget_bytes, stages, relax=relax, threads=threads, time_limit_s=time_limit_s,
                mip_gap=mip_gap, start=start, stop_at=stop_at, minimize_peak=minimize_peak, fixed=fixed,
                presolve=presolve)


def _run(model: _Model, structure: RetentionStructure, budget_bytes: int, stages: list[int], *, relax: bool,
         threads: int, time_limit_s: float, mip_gap: float = 1e-4, start: np.ndarray | None = None,
         stop_at: float | None = None, minimize_peak: bool = False, fixed: np.ndarray | None = None,
         presolve: bool = True) -> _Run:
    """Run ``model`` (built by ``_model`` with these arguments) for at most ``time_limit_s``."""
    import highspy

    from remat.solvers.milp_backends import run_highs

    h, scale, mem_unit, col_cost = model.h, model.scale, model.mem_unit, model.col_cost
    n_cols, peak_col = model.n_cols, model.peak_col
    h.setOptionValue("time_limit", float(max(time_limit_s, 0.05)))
    if start is not None and not relax:
        x0 = start
        if minimize_peak:
            x0 = np.concatenate([start, [float(structure.memory(start).max()) / mem_unit]])
        h.setSolution(n_cols, np.arange(n_cols, dtype=np.int32), np.asarray(x0, dtype=float))
    if stop_at is not None and not relax and not minimize_peak:
        target = stop_at * scale

        def on_interrupt(event) -> None:
            if event.data_out.mip_primal_bound <= target + 1e-9 * max(1.0, abs(target)):
                event.data_in.user_interrupt = True

        h.cbMipInterrupt.subscribe(on_interrupt)
    if not relax:
        from remat.solvers.milp_backends import Progress

        progress = Progress("retention")
        unit = mem_unit if minimize_peak else 1.0 / scale

        def on_improve(event) -> None:
            out = event.data_out
            progress.incumbent(out.objective_function_value * unit, out.mip_dual_bound * unit, out.running_time)

        def on_log(event) -> None:
            out = event.data_out
            progress.tick(out.mip_primal_bound * unit, out.mip_dual_bound * unit, out.running_time)

        h.cbMipImprovingSolution.subscribe(on_improve)
        h.cbMipLogging.subscribe(on_log)
    run_started = time.perf_counter()
    run_highs(h)
    status = h.getModelStatus()
    S = highspy.HighsModelStatus
    if status == S.kInfeasible:
        return _Run(None, True, False, None, 0, None)
    info = h.getInfo()
    has_x = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value, dtype=float) if has_x else None
    peak = None
    if x is not None and minimize_peak:
        peak = float(x[peak_col]) * mem_unit
        x = x[:structure.n_cols]
    if relax:
        return _Run(x if status == S.kOptimal else None, False, status == S.kOptimal, None, 0, peak)
    if start is not None and x is not None and not minimize_peak:
        reported = float(info.objective_function_value)
        actual = float(col_cost @ x)
        if abs(reported - actual) > 1e-6 * max(1.0, abs(actual)):
            # HiGHS 1.16 with presolve, given a start, was seen to report an improved objective
            # (even "optimal", above the true optimum) with the start's values as the solution,
            # its improving-solution callback's included (12-layer GPT-2 at 40%, U-Net b32 at
            # 80%). Such a MIP is solved without presolve from its start, then from scratch if
            # that disagrees too; handled here, nothing for the user to do
            again = "from the start without presolve" if presolve else "without the start"
            log.info("retention: HiGHS reported objective %g for a solution whose objective is %g; solving again "
                     "%s", reported / scale, actual / scale, again)
            left = max(time_limit_s - (time.perf_counter() - run_started), 0.1)
            if presolve:
                return _solve(structure, budget_bytes, stages, relax=False, threads=threads, time_limit_s=left,
                              mip_gap=mip_gap, start=start, stop_at=stop_at, minimize_peak=minimize_peak,
                              fixed=fixed, presolve=False)
            return _solve(structure, budget_bytes, stages, relax=False, threads=threads, time_limit_s=left,
                          mip_gap=mip_gap, start=None, stop_at=stop_at, minimize_peak=minimize_peak)
    bound = float(info.mip_dual_bound)
    bound = bound / scale if math.isfinite(bound) and not minimize_peak else None
    return _Run(x, False, status == S.kOptimal, bound, int(info.mip_node_count), peak)
