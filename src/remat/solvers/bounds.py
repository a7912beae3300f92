"""Lower bounds that hold for the whole traced graph: on a plan's cost under a budget, and on
the smallest budget any plan meets.

The plan space is the one of every remat method (Checkmate's): nodes are computed for the
first time in id order (stage t computes node t for the first time), and the step outputs
(loss, gradients) are computed once and kept. Any plan can recompute anything else, any
number of times.

**The instant bound.** Take any such plan and the instant right after it first computes node
t. At that instant memory holds ``fixed_bytes``, the kept bytes of every node up to t, t's
scratch, t itself, its inputs and the outputs so far, plus whatever else the plan keeps: call
that set L. Any earlier value v that is still needed (a node after t reads it, or v is an
output) is either in L or computed again after the instant; call the recomputed set Rec. A
value in Rec is computed from inputs that are live at that moment: each input was in L or
was itself recomputed after the instant, so Rec is closed under "input not in L". Each
value in Rec costs at least one computation beyond the first, so the plan costs at least
``graph.total_cost + cost(Rec)``. The cheapest (L, Rec) that fits the budget at the instant
is a small knapsack with closure constraints (two binaries per value): its optimum, or any
lower bound of it (its LP relaxation, a MIP's dual bound), plus ``graph.total_cost`` is a
lower bound on every plan's cost, and the largest over instants is the bound reported. An
instant whose knapsack has no solution proves that no plan fits the budget at all.

The bound ignores everything between instants (when the recomputations happen, what they
hold while they run), so it never exceeds the optimum; on the transformers and CNNs we
benchmark it binds where the forward pass meets the backward (the loss gradient, the first
backward activation) and comes within a few percent of the best plans found.

**The smallest budget.** At the instant t is first computed, no plan holds less than
``fixed_bytes``, the kept bytes so far, t with its scratch and inputs, the outputs so far and
the values that cannot be recomputed but are read later; the largest over t is a budget
below which no plan exists (``min_budget_lower_bound``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from remat.graph import Graph
from remat.schedule import StepKind, plan_from_order
from remat.solvers.milp_backends import quiet_highs, run_highs

log = logging.getLogger("remat.solve")

#: Instants whose knapsack LP is solved: all where checkpoint-all is over budget if there are at
#: most SCREEN_ALL, else the most crowded under checkpoint-all and the SCREEN_TOP whose own
#: working set is largest ...
SCREEN_ALL = 64
SCREEN_TOP = 12
#: ... plus this many spread evenly over the other instants where checkpoint-all is over budget.
SCREEN_SPREAD = 12
#: Instants whose knapsack is then solved as a MIP (its dual bound counts), best LP value first,
#: each for at most MIP_TIME_S: the LP is within 0.1% of the MIP on the models we benchmark, and
#: the MIP (presolve off, see ``_solve_knapsack``) can take seconds to close that.
MIP_INSTANTS = 1
MIP_TIME_S = 0.5
#: Default time for one bound: LPs first, the MIPs with what is left.
DEFAULT_TIME_LIMIT_S = 10.0


@dataclass(frozen=True)
class CostBound:
    """A lower bound on the cost of every plan of ``graph`` under ``budget_bytes``.

    ``value`` is in the graph's cost unit (``graph.total_cost`` at least); ``math.inf`` when an
    instant proves that no plan fits (``feasible`` is then False). ``instant`` is the node at
    whose first computation the bound binds (None if no instant is over budget).
    """

    budget_bytes: int
    value: float
    instant: int | None
    feasible: bool
    instants_tried: int
    solve_s: float

    def overhead(self, graph: Graph) -> float:
        """The bound as a multiple of computing every node once."""
        return self.value / graph.total_cost if graph.total_cost > 0 else 1.0


@dataclass(frozen=True)
class _Knapsack:
    """The knapsack of one instant, as arrays over its decision values ``ids``."""

    t: int
    ids: np.ndarray  # decision values (earlier nodes still needed, not forced live)
    sizes: np.ndarray
    costs: np.ndarray
    needed: np.ndarray  # bool: must be live or recomputed (read after t, or an output)
    recomputable: np.ndarray  # bool
    edges: np.ndarray  # (k, 2) local indices (input, user) of closure rows
    forced_bytes: int  # held at the instant whatever the plan decides


class InstantBounds:
    """Budget-independent ingredients of the instant bound for one graph (build once, ask for
    many budgets).

    >>> from remat.builders import chain_graph
    >>> g = chain_graph(6, bytes_per_node=1)
    >>> b = InstantBounds(g)
    >>> b.cost_bound(10**6).value == g.total_cost, b.min_budget_bytes <= 5
    (True, True)
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        n = graph.n
        users = graph.users
        self.sizes = np.asarray(graph.out_bytes, dtype=np.int64)
        self.costs = np.asarray(graph.costs, dtype=float)
        self.recomputable = np.array([node.recomputable for node in graph.nodes], dtype=bool)
        self.is_output = np.zeros(n, dtype=bool)
        self.is_output[list(graph.outputs)] = True
        # reach[v]: the largest id of v or any node that depends on v, directly or not
        reach = np.arange(n)
        last_user = np.full(n, -1)
        for v in range(n - 1, -1, -1):
            if users[v]:
                last_user[v] = users[v][-1]
                reach[v] = max(reach[v], max(reach[u] for u in users[v]))
        self.reach = reach
        self.last_user = last_user
        src, dst = [], []
        for w, node in enumerate(graph.nodes):
            for d in node.deps:
                src.append(d)
                dst.append(w)
        self.edge_src = np.asarray(src, dtype=np.int64)
        self.edge_dst = np.asarray(dst, dtype=np.int64)
        kept = np.cumsum([node.kept_bytes for node in graph.nodes], dtype=np.int64)
        temp = np.array([node.temp_bytes for node in graph.nodes], dtype=np.int64)
        inputs = np.array([sum(int(self.sizes[d]) for d in node.deps) for node in graph.nodes], dtype=np.int64)
        # fixed, kept so far, the node with its scratch and its inputs: held at its instant
        self.instant_base = graph.fixed_bytes + kept + temp + self.sizes + inputs

    # ------------------------------------------------------------------ the smallest budget
    @cached_property
    def forced_bytes(self) -> np.ndarray:
        """``forced_bytes[t]``: what every plan holds right after it first computes t: fixed,
        kept so far, t with its scratch and inputs, the outputs so far and the values that
        cannot be recomputed but are read later."""
        g, n = self.graph, self.graph.n
        # outputs stay live from their computation to the end; a non-recomputable value from
        # its computation to its last reader (the instants strictly between count here)
        must = np.zeros(n + 1, dtype=np.int64)
        for v in range(n):
            if self.sizes[v] == 0:
                continue
            if self.is_output[v]:
                end = n - 1
            elif not self.recomputable[v] and self.last_user[v] > v:
                end = int(self.last_user[v]) - 1
            else:
                continue
            if end > v:
                must[v + 1] += self.sizes[v]
                must[end + 1] -= self.sizes[v]
        held = np.cumsum(must)[:n]
        # an input of t that must stay live anyway is counted once
        overlap = np.zeros(n, dtype=np.int64)
        for t, node in enumerate(g.nodes):
            for d in node.deps:
                if self.sizes[d] and (self.is_output[d] or (not self.recomputable[d] and self.last_user[d] > t)):
                    overlap[t] += self.sizes[d]
        return self.instant_base + held - overlap

    @cached_property
    def min_budget_bytes(self) -> int:
        """No plan fits a budget below this (the largest of ``forced_bytes``)."""
        return int(self.forced_bytes.max()) if self.graph.n else self.graph.fixed_bytes

    # ------------------------------------------------------------------ screening
    @cached_property
    def checkpoint_all_instants(self) -> np.ndarray:
        """Memory right after each node's (first and only) computation under checkpoint-all,
        scratch included: an instant where this fits the budget has a bound of zero."""
        g = self.graph
        plan = plan_from_order(g, list(range(g.n)))
        memory = g.fixed_bytes
        out = np.zeros(g.n, dtype=np.int64)
        for step in plan.steps:
            node = g.nodes[step.node]
            if step.kind is StepKind.COMPUTE:
                memory += node.out_bytes + node.kept_bytes
                out[step.node] = memory + node.temp_bytes
            else:
                memory -= node.out_bytes
        return out

    def knapsack(self, t: int) -> _Knapsack:
        """The decision values of instant t and the rows between them."""
        n = self.graph.n
        ids = np.arange(t)
        still_needed = (self.reach[:t] > t) | self.is_output[:t]
        forced = np.zeros(n, dtype=bool)
        forced[list(self.graph.nodes[t].deps)] = True
        forced[self.is_output] = True  # outputs are kept from their computation on
        forced[:t] |= ~self.recomputable[:t] & (self.last_user[:t] > t)
        # a zero-byte value is kept for free, so it never needs recomputing
        decide = still_needed & ~forced[:t] & (self.sizes[:t] > 0)
        ids = ids[decide]
        local = np.full(n, -1, dtype=np.int64)
        local[ids] = np.arange(ids.size)
        mask = (self.edge_dst < t) & (local[self.edge_dst] >= 0) & (local[self.edge_src] >= 0)
        edges = np.stack([local[self.edge_src[mask]], local[self.edge_dst[mask]]], axis=1)
        needed = (self.last_user[ids] > t) | self.is_output[ids]
        return _Knapsack(
            t=t,
            ids=ids,
            sizes=self.sizes[ids],
            costs=self.costs[ids],
            needed=needed,
            recomputable=self.recomputable[ids],
            edges=edges,
            forced_bytes=int(self.forced_bytes[t]),
        )

    # ------------------------------------------------------------------ the bound
    def cost_bound(self, budget_bytes: int, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                   instants: tuple[int, ...] = (), threads: int = 2) -> CostBound:
        """The instant bound under ``budget_bytes``: LP relaxations at screened instants (and
        at ``instants``), then MIPs at the most promising ones, within ``time_limit_s``.

        Every number it takes is a valid bound, so stopping early only makes it weaker.
        """
        started = time.perf_counter()
        g = self.graph
        if budget_bytes < self.min_budget_bytes:
            t = int(np.argmax(self.forced_bytes))
            return CostBound(budget_bytes, math.inf, t, False, 0, time.perf_counter() - started)
        excess = self.checkpoint_all_instants - budget_bytes
        over = np.flatnonzero(excess > 0)
        if over.size == 0:
            return CostBound(budget_bytes, g.total_cost, None, True, 0, time.perf_counter() - started)
        ranked = over[np.argsort(-excess[over], kind="stable")]
        top = ranked.size if ranked.size <= SCREEN_ALL else SCREEN_TOP
        # the most crowded instants, and those whose own working set (what no plan can drop)
        # is largest: a large node with large inputs makes a sharp peak of the bound
        heavy = over[np.argsort(-self.forced_bytes[over], kind="stable")][:SCREEN_TOP]
        chosen = list(dict.fromkeys([*ranked[:top].tolist(), *heavy.tolist()]))
        rest = np.sort(np.setdiff1d(ranked, chosen))
        if rest.size:
            chosen += list(rest[np.unique(np.linspace(0, rest.size - 1, min(SCREEN_SPREAD, rest.size)).astype(int))])
        chosen += [t for t in instants if 0 <= t < g.n]
        lp_values: dict[int, float] = {}
        deadline = started + time_limit_s
        for t in dict.fromkeys(int(t) for t in chosen):
            if time.perf_counter() > deadline and lp_values:
                break
            value = _solve_knapsack(self.knapsack(t), budget_bytes, relax=True, time_limit_s=time_limit_s,
                                    threads=threads)
            lp_values[t] = value
            if math.isinf(value):
                break
        # the LP values are smooth in t: climb from the best one, in steps halving from the
        # spacing of the screen down to single instants
        step = max(1, int(over.size // max(1, len(lp_values))))
        best_t = max(lp_values, key=lp_values.get)
        while step >= 1 and time.perf_counter() < deadline and math.isfinite(lp_values[best_t]):
            for t in (best_t - step, best_t + step):
                if 0 <= t < g.n and t not in lp_values and excess[t] > 0 and time.perf_counter() < deadline:
                    lp_values[t] = _solve_knapsack(self.knapsack(t), budget_bytes, relax=True,
                                                   time_limit_s=time_limit_s, threads=threads)
            moved = max(lp_values, key=lp_values.get)
            if moved == best_t:
                step //= 2
            best_t = moved
        best = lp_values[best_t]
        if math.isfinite(best):
            for t in sorted(lp_values, key=lp_values.get, reverse=True)[:MIP_INSTANTS]:
                left = min(deadline - time.perf_counter(), MIP_TIME_S)
                if left <= 0.05:
                    break
                value = _solve_knapsack(self.knapsack(t), budget_bytes, relax=False, time_limit_s=left,
                                        threads=threads)
                if value > best:
                    best, best_t = value, t
        feasible = math.isfinite(best)
        value = g.total_cost + best if feasible else math.inf
        log.info("bound: %s under %d B: %s at %s (%d instants, %.2f s)", g.name, budget_bytes,
                 f"{value / g.total_cost:.4f}x" if feasible and g.total_cost else ("no plan fits" if not feasible else value),
                 g.describe(best_t), len(lp_values), time.perf_counter() - started)
        return CostBound(budget_bytes, value, best_t, feasible, len(lp_values), time.perf_counter() - started)


def _solve_knapsack(k: _Knapsack, budget_bytes: int, *, relax: bool, time_limit_s: float, threads: int) -> float:
    """The least recomputation cost of instant ``k.t`` (or a lower bound of it: the LP value, or
    a MIP's dual bound when the time runs out); ``math.inf`` if nothing fits."""
    import highspy

    capacity = budget_bytes - k.forced_bytes
    if capacity < 0:
        return math.inf
    m = k.ids.size
    if m == 0 or int(k.sizes.sum()) <= capacity:
        return 0.0
    # columns: x (live at the instant) 0..m-1, r (recomputed after it) m..2m-1
    col_cost = np.concatenate([np.zeros(m), k.costs])
    upper = np.concatenate([np.ones(m), k.recomputable.astype(float)])
    rows_index: list[np.ndarray] = []
    rows_value: list[np.ndarray] = []
    lower: list[np.ndarray] = []
    upper_rows: list[np.ndarray] = []
    need = np.flatnonzero(k.needed)
    # needed: x_v + r_v >= 1
    rows_index.append(np.stack([need, need + m], axis=1))
    rows_value.append(np.ones((need.size, 2)))
    lower.append(np.ones(need.size))
    upper_rows.append(np.full(need.size, np.inf))
    # closure: x_d + r_d - r_w >= 0 for each input d of a recomputed w
    d, w = k.edges[:, 0], k.edges[:, 1]
    rows_index.append(np.stack([d, d + m, w + m], axis=1))
    rows_value.append(np.tile([1.0, 1.0, -1.0], (d.size, 1)))
    lower.append(np.zeros(d.size))
    upper_rows.append(np.full(d.size, np.inf))
    # memory: sum of sizes of what stays live, in MiB so the row is well scaled
    scale = 1.0 / max(1.0, float(k.sizes.max()))
    index = np.concatenate([r.ravel() for r in rows_index] + [np.arange(m)])
    value = np.concatenate([r.ravel() for r in rows_value] + [k.sizes * scale])
    starts = np.concatenate([[0], np.cumsum(np.concatenate([np.full(need.size, 2), np.full(d.size, 3), [m]]))])
    row_lower = np.concatenate(lower + [[-np.inf]])
    row_upper = np.concatenate(upper_rows + [[capacity * scale]])
    cost_scale = 1.0 / max(1e-12, float(k.costs.max(initial=0.0))) if k.costs.size else 1.0
    h = quiet_highs()
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("time_limit", float(max(time_limit_s, 0.05)))
    # HiGHS presolve once returned a wrong "optimal" on such a model: the bound must be safe
    h.setOptionValue("presolve", "off")
    h.setOptionValue("mip_rel_gap", 1e-6)
    lp = highspy.HighsLp()
    lp.num_col_ = 2 * m
    lp.num_row_ = row_lower.size
    lp.col_cost_ = col_cost * cost_scale
    lp.col_lower_ = np.zeros(2 * m)
    lp.col_upper_ = upper
    lp.row_lower_ = np.where(np.isinf(row_lower), -highspy.kHighsInf, row_lower)
    lp.row_upper_ = np.where(np.isinf(row_upper), highspy.kHighsInf, row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = starts.astype(np.int32)
    lp.a_matrix_.index_ = index.astype(np.int32)
    lp.a_matrix_.value_ = value.astype(float)
    lp.a_matrix_.num_col_ = 2 * m
    lp.a_matrix_.num_row_ = row_lower.size
    if not relax:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * (2 * m)
    h.passModel(lp)
    run_highs(h)
    status = h.getModelStatus()
    S = highspy.HighsModelStatus
    if status == S.kInfeasible:
        return math.inf
    info = h.getInfo()
    if relax:
        if status != S.kOptimal:
            return 0.0  # no proven value: the trivial bound
        # the dual objective is a bound even if the primal is slightly off; never below 0
        return max(0.0, float(info.objective_function_value) / cost_scale)
    bound = float(info.mip_dual_bound)
    return max(0.0, bound / cost_scale) if math.isfinite(bound) else 0.0
