"""chain: multi-level checkpointing over the chain of blocks, chosen by a dynamic programme.

The forward pass is cut at its light cuts (``remat.cuts``: block boundaries) into a chain of
segments. A plan of the chain is a recursion in the manner of Griewank's revolve and of the
heterogeneous-chain programme of Beaumont et al. (rotor): to run the backward pass of
segments s..t from the value entering s, either

- *keep* segment s: recompute it holding its values, then do s+1..t, then s's backward; or
- *split* at s' (s < s' <= t): recompute s..s'-1 holding only what crosses the cut before s',
  do s'..t from there, drop that, then do s..s'-1 again from the start;

and a segment alone is recomputed and held while its backward runs. The original forward
pass makes the same choices at no extra cost (what it keeps, from the start of the step).
Values can be computed many times, once per level of the recursion, so this reaches far
lower budgets than one-level plans (``segments``) or uniform nested ones (``nested``) at the
least extra compute of its memory model.

The programme counts memory in ``MEMORY_LEVELS`` units of the checkpoint-all peak: what a
segment's backward needs beyond what is held for it is measured on the checkpoint-all plan's
memory profile, and held values by their bytes. It gives, for every budget of the model, the
cheapest recursion; these plans are then executed as ordinary stage schedules (each backward
stage recomputes what it reads and holds what the recursion holds there) and measured in the
simulator, which has the last word. For a budget, the plans around it are measured (a
bisection over the model's budgets on measured peaks) and the cheapest that fits is chosen.

>>> from remat.builders import chain_graph
>>> from remat.solvers import solve
>>> g = chain_graph(12, bytes_per_node=1)
>>> r = solve(g, 8, method="chain")
>>> r.peak_bytes <= 8 < solve(g, 100, method="checkpoint_all").peak_bytes
True
"""

from __future__ import annotations

import bisect
import math
import time

import numpy as np

from remat.cuts import Cut, light_cuts, pass_cuts
from remat.graph import Graph, NodeKind
from remat.schedule import order_memory
from remat.solvers.base import SolveResult, register
from remat.solvers.baselines import (
    BaselinePlan,
    StageWalk,
    chen_plan,
    considers,
    pick_cheapest,
    remembered,
)

#: At most this many segments: the programme is cubic in their number.
MAX_SEGMENTS = 128
#: Memory resolution of the programme: units of the checkpoint-all peak.
MEMORY_LEVELS = 1024
#: Plans measured around a budget beyond the bisection: the next cheaper ones of the model.
EXTRA_PROBES = 3

# hold kinds: what a recursion holds while it works below it
_CROSS, _KEEP, _LEAF = 0, 1, 2


class ChainModel:
    """The chain of a graph and the programme's plans for every budget (see the module)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        forward = graph.ids_of_kind(NodeKind.FORWARD)
        cuts = _chain_cuts(graph)
        self.cuts = cuts
        L = self.L = len(cuts)
        pos = {i: p for p, i in enumerate(forward)}
        cut_pos = [pos[c.node] for c in cuts]
        self.segment = {i: bisect.bisect_left(cut_pos, pos[i]) for i in forward}  # cut k ends segment k
        n = graph.n
        sizes = np.asarray(graph.out_bytes, dtype=np.int64)
        recomputable = np.array([node.recomputable for node in graph.nodes], dtype=bool)
        seg_of = np.full(n, -1, dtype=np.int64)
        for i, s in self.segment.items():
            seg_of[i] = s
        self.seg_of = seg_of
        members = [np.flatnonzero((seg_of == s) & recomputable) for s in range(L + 1)]
        costs = np.asarray(graph.node_arrays[3], dtype=float)
        self.f = np.array([costs[m].sum() for m in members[:L]], dtype=float)
        read_backward = np.zeros(n, dtype=bool)
        for i in forward:
            read_backward[i] = any(graph.nodes[u].kind is not NodeKind.FORWARD for u in graph.users[i])
        # what each hold keeps, as masks over the nodes
        self.cross_mask = np.zeros((L, n), dtype=bool)
        self.keep_mask = np.zeros((L, n), dtype=bool)
        self.leaf_mask = np.zeros((L, n), dtype=bool)
        for k, c in enumerate(cuts):
            self.cross_mask[k, list(c.crossing)] = True
            self.leaf_mask[k, members[k]] = True
            self.keep_mask[k] = self.cross_mask[k] | self.leaf_mask[k]
        self.always = np.ones(n, dtype=bool)
        for m in members[:L]:
            self.always[m] = False
        self.always[list(graph.outputs)] = True
        cross_bytes = np.array([c.bytes for c in cuts], dtype=np.int64)
        keep_bytes = np.array([sizes[(self.leaf_mask[k] & read_backward) | self.cross_mask[k]].sum()
                               for k in range(L)], dtype=np.int64)
        profile = order_memory(graph, np.arange(n)).astype(np.float64)  # the checkpoint-all plan's
        need = self._needs(sizes, profile)
        peak = int(profile.max())
        self.unit = max(1, math.ceil(peak / MEMORY_LEVELS))
        self.levels = MEMORY_LEVELS + 1
        self.c = np.rint(cross_bytes / self.unit).astype(np.int64)
        self.a = np.rint(keep_bytes / self.unit).astype(np.int64)
        self.need = np.ceil(need / self.unit).astype(np.int64)
        self._solve()

    # ------------------------------------------------------------------ the memory model
    def _needs(self, sizes: np.ndarray, mem: np.ndarray) -> np.ndarray:
        """Per segment (and the tail, index L): the most memory its backward stages need in the
        checkpoint-all plan (``mem``: its memory at each stage), less the forward values of
        earlier segments live then (those the recursion holds, or not, itself)."""
        graph, L, n = self.graph, self.L, self.graph.n
        last = np.array([max(graph.users[i], default=i) for i in range(n)], dtype=np.int64)
        live_from = np.zeros((L + 1, n + 1), dtype=np.float64)  # live_from[s, t]: seg-s bytes read at or after t
        chain = np.flatnonzero((self.seg_of >= 0) & (self.seg_of < L))
        np.add.at(live_from, (self.seg_of[chain], last[chain]), sizes[chain])
        live_from = np.cumsum(live_from[:, ::-1], axis=1)[:, ::-1]
        earlier = np.cumsum(live_from, axis=0) - live_from  # earlier[j, t]: segments < j
        need = np.zeros(L + 1)
        for t, s in self.stage_segments():
            need[s] = max(need[s], mem[t] - earlier[s, t])
        return need

    def stage_segments(self) -> list[tuple[int, int]]:
        """(stage, segment) of every loss and backward stage: the segment a stage works in is
        the latest one it reads a forward value of (the previous stage's when it reads none)."""
        out, seg = [], self.L
        for t, node in enumerate(self.graph.nodes):
            if node.kind is NodeKind.FORWARD:
                continue
            seg = max((self.segment[d] for d in node.deps if d in self.segment), default=seg)
            out.append((t, seg))
        return out

    # ------------------------------------------------------------------ the programme
    def _solve(self) -> None:
        """``opt[s, t][m]``: the least recomputation of the backward of segments s..t from the
        value entering s with m units free (``inf``: none fits); ``top[s][m]`` the same for
        segments s.. in the original forward pass. Levels below the least need are left out
        (``base``). Choices are recovered when a plan is asked for (``_plan``)."""
        L = self.L
        base = int(self.need.min())
        M = max(self.levels - base, 1)
        self.base = base
        need = self.need - base
        prefix = np.concatenate(([0.0], np.cumsum(self.f)))
        self.prefix = prefix
        inf = np.float32(np.inf)
        fits = [np.arange(M) >= need[s] for s in range(L + 1)]
        opt: dict[tuple[int, int], np.ndarray] = {}
        tmp = np.empty(M, dtype=np.float32)
        for length in range(L):
            for s in range(L - length):
                t = s + length
                best = np.full(M, inf, dtype=np.float32)
                if length == 0:
                    best[fits[s]] = self.f[s]
                else:
                    _add_shifted(best, opt[s + 1, t], self.a[s], self.f[s], tmp)
                    best[~fits[s]] = inf
                    for sp in range(s + 1, t + 1):
                        _add_shifted(best, opt[sp, t], self.c[sp - 1], prefix[sp] - prefix[s], tmp, opt[s, sp - 1])
                opt[s, t] = best
        top: list[np.ndarray] = [np.empty(0)] * (L + 1)
        top[L] = np.where(fits[L], np.float32(0), inf).astype(np.float32)
        for s in range(L - 1, -1, -1):
            best = np.full(M, inf, dtype=np.float32)
            _add_shifted(best, top[s + 1], self.a[s], 0.0, tmp)
            best[~fits[s]] = inf
            for sp in range(s + 1, L + 1):
                _add_shifted(best, top[sp], self.c[sp - 1], 0.0, tmp, opt[s, sp - 1])
            top[s] = best
        self.opt, self.top, self.fits = opt, top, fits
        # the model's budgets where its plan gets cheaper: the front the bisection walks
        cost = top[0].astype(np.float64)
        finite = np.flatnonzero(np.isfinite(cost))
        steps = finite[np.concatenate(([True], cost[finite][1:] < cost[finite][:-1] - 1e-9 * max(1.0, cost[finite[0]])))]
        self.front_levels = (steps + base).tolist()

    def _pick(self, s: int, t: int | None, m: int) -> int:
        """The choice ``_solve`` made at (s, t, m) of ``opt`` (of ``top`` when ``t`` is None):
        -1 to keep segment s, else the split s'. Recomputed at this one level."""
        on_top = t is None
        last = self.L if on_top else t

        def rest(a: int, k: int) -> float:  # the subproblem a..last with k more units held
            arr = self.top[a] if on_top else self.opt[a, last]
            return float(arr[m - k]) if m - k >= 0 else math.inf

        best, pick = math.inf, -1
        if self.fits[s][m] and s < last:
            best = rest(s + 1, self.a[s]) + (0.0 if on_top else float(self.f[s]))
        for sp in range(s + 1, last + 1):
            here = rest(sp, self.c[sp - 1]) + float(self.opt[s, sp - 1][m])
            if not on_top:
                here += self.prefix[sp] - self.prefix[s]
            if here < best:
                best, pick = here, sp
        return pick

    def _plan(self, level: int) -> tuple:
        """The recursion the programme chose for ``level`` units: what the forward pass keeps
        and what is held while each segment's backward runs."""
        kept: list[tuple[int, int]] = []
        held: list[tuple] = [()] * self.L
        stack: list[tuple] = []
        s, m = 0, level - self.base
        while s < self.L:  # the original forward pass
            sp = self._pick(s, None, m)
            if sp < 0:
                kept.append((_KEEP, s))
                m -= self.a[s]
                s += 1
            else:
                kept.append((_CROSS, sp - 1))
                stack.append((s, sp - 1, m, ()))
                m -= self.c[sp - 1]
                s = sp
        while stack:
            s, t, m, path = stack.pop()
            if s == t:
                held[s] = path + ((_LEAF, s),)
                continue
            sp = self._pick(s, t, m)
            if sp < 0:
                here = path + ((_KEEP, s),)
                held[s] = here
                stack.append((s + 1, t, m - self.a[s], here))
            else:
                stack.append((sp, t, m - self.c[sp - 1], path + ((_CROSS, sp - 1),)))
                stack.append((s, sp - 1, m, path))
        return tuple(kept), tuple(held)

    # ------------------------------------------------------------------ plans
    def _mask(self, holds) -> np.ndarray:
        out = np.zeros(self.graph.n, dtype=bool)
        for kind, k in holds:
            out |= (self.cross_mask, self.keep_mask, self.leaf_mask)[kind][k]
        return out

    def measure(self, index: int) -> BaselinePlan:
        """The plan of the ``index``-th budget of the front, run as a stage schedule and
        measured (remembered per graph)."""
        level = self.front_levels[index]
        plan = self._plan(level)
        return remembered(self.graph, ("chain plan", plan),
                          lambda: self._execute(plan, f"chain, {level * self.unit} B in its model"))

    def _execute(self, plan: tuple, label: str) -> BaselinePlan:
        graph = self.graph
        kept_forward, held = plan
        always = self.always | self._mask(kept_forward)
        masks = [self._mask(h) for h in held] + [np.zeros(graph.n, dtype=bool)]
        kept = always.copy()
        walk = StageWalk(graph)
        current = None
        for t, seg in self.stage_segments():
            if seg != current:  # the recursion leaves what it held for the segment before
                kept = always | (kept & masks[seg])
                current = seg
            done = np.asarray(walk.recompute_for(t, kept), dtype=np.int64)
            kept[done[masks[seg][done]]] = True
        return walk.measure(label)

    def plans_near(self, budget_bytes: int) -> list[BaselinePlan]:
        """Measured plans around ``budget_bytes``: a bisection over the model's plans (cheaper
        ones need more memory) for the cheapest whose measured peak fits, then a few cheaper
        ones, whose measured peaks need not grow with the model's."""
        if not self.front_levels:
            return []
        lo, hi = 0, len(self.front_levels) - 1
        measured: dict[int, BaselinePlan] = {}

        def peak(i: int) -> int:
            if i not in measured:
                measured[i] = self.measure(i)
            return measured[i].peak_bytes

        if peak(lo) <= budget_bytes:
            while lo < hi:  # invariant: front[lo] fits
                mid = (lo + hi + 1) // 2
                if peak(mid) <= budget_bytes:
                    lo = mid
                else:
                    hi = mid - 1
        for i in range(lo + 1, min(lo + 1 + EXTRA_PROBES, len(self.front_levels))):
            peak(i)
        return list(measured.values())


def _add_shifted(best: np.ndarray, arr: np.ndarray, k: int, const: float, tmp: np.ndarray,
                 plus: np.ndarray | None = None) -> None:
    """``best[m] = min(best[m], arr[m - k] + const (+ plus[m]))`` for every m >= k, in place."""
    k = max(int(k), 0)
    if k >= best.size:
        return
    out = tmp[k:]
    np.add(arr[:best.size - k], np.float32(const), out=out)
    if plus is not None:
        np.add(out, plus[k:], out=out)
    np.minimum(best[k:], out, out=best[k:])


def _chain_cuts(graph: Graph) -> tuple[Cut, ...]:
    """The light cuts of the forward pass (every cut of it when none stands out), the lightest
    ``MAX_SEGMENTS`` of them when there are more, in order."""
    cuts = light_cuts(graph) or pass_cuts(graph)[:-1]
    if len(cuts) > MAX_SEGMENTS:
        lightest = sorted(range(len(cuts)), key=lambda k: (cuts[k].bytes, k))[:MAX_SEGMENTS]
        cuts = tuple(cuts[k] for k in sorted(lightest))
    return tuple(cuts)


def chain_model(graph: Graph) -> ChainModel:
    """The chain model of ``graph``, built once per graph."""
    return remembered(graph, ("chain model",), lambda: ChainModel(graph))


@register("chain")
def chain(graph: Graph, budget_bytes: int) -> SolveResult:
    """Multi-level checkpointing over the chain of light cuts, chosen by a dynamic programme
    (see the module); the cheapest measured plan that fits. Raises ``InfeasibleBudgetError``
    with the lowest peak of the plans measured."""
    started = time.perf_counter()
    return pick_cheapest(graph, _chain_plans(graph, budget_bytes), budget_bytes=budget_bytes, method="chain",
                         started_s=started)


@considers("chain")
def _chain_plans(graph: Graph, budget_bytes: int) -> list[BaselinePlan]:
    model = chain_model(graph)
    plans = model.plans_near(budget_bytes)
    if not plans:  # no forward pass to cut: checkpoint every value
        plans = [chen_plan(graph, graph.ids_of_kind(NodeKind.FORWARD), "checkpoint-all")]
    return plans
