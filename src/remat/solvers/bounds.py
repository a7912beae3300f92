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

**Several instants together.** One instant counts each value's recomputation once. Near the
smallest budgets a plan must compute some values three times or more: on GPT-2, right after
the loss gradient nothing of the forward pass fits, so the final hidden state is recomputed
from the input for the head's weight gradient a few operations later -- and while that
gradient's 64 MiB input is still live, the layers' activations recomputed on the way cannot
stay either, so they are computed yet again for the layers' backward. Instants t_1 < ... < t_K
see this together. Per instant k and value v: ``x[k, v]`` (live at instant k) and ``r[k, v]``
(computed again after instant k and no later than instant k+1; after t_K for the last).
Any plan satisfies:

- a value read by a first computation between instants k and k+1 (or, after the last, read
  later at all) is ``x[k, v] + r[k, v] >= 1``: it stayed live, or was computed since;
- a value live at instant k+1 that existed at instant k: ``x[k+1, v] <= x[k, v] + r[k, v]``;
- each input d of a value w recomputed in window k: ``r[k, w] <= x[k, d] + r[k, d]``;
- memory at each instant, as for one instant.

Recomputations in different windows are different computations, so ``sum c_v r[k, v]`` over
all windows is at most what the plan recomputes: the program's optimum (or its LP value, or a
MIP's dual bound) plus ``graph.total_cost`` bounds every plan's cost. With one instant it is
the single instant's knapsack.

These rows alone make a weak LP: a fractionally live input serves the recomputations of two
windows at once, and the LP of two instants can fall below the LP of the first alone (12-layer
GPT-2 near its floor: 1.328x against 1.345x). So each instant k but the last also gets
``s[k, v]``, "computed again at any time after instant k", with instant k's own program on
(x[k], s[k]) and ``s[k, v] <= sum of r[j, v] over j >= k`` (what is recomputed after t_k is
recomputed in one of the windows that follow). Every plan satisfies these with its own s, so
the bound holds; and the LP of several instants is now at least the LP of each one. (A value
some later instant reads is held there by force and has no r in that window: its s is left
free.) With these rows the greedy growth below finds instants that help: U-Net b32 at 40%
1.125x -> 1.177x (five instants), ResNet50 b32 at its smallest budget 1.220x -> 1.302x.

``cost_bound`` grows the set from the best single instant, adding the instant whose LP raises
the value most, up to ``MAX_INSTANTS``, then solves the set as a MIP for a short time, and the
set joined by the tightest instants after the best one (``MULTI_EXTRA``), whose LP is too weak
for the growth to pick them but whose MIP often proves more. On the 12-layer GPT-2 at the
budget below which no plan fits (``min_budget_bytes``) the two instants named above give 1.58x
against one instant's 1.35x; ResNet50 b32 there, three give 1.35x against 1.23x.

**A first instant with deadlines.** Several instants chain their windows: a value recomputed
in window k finds its inputs live at instant k or recomputed in the same window. Where the
first instant leaves room for little more than one residual (GPT-2 at its smallest budget:
right after the loss gradient, one of the 2 MiB hidden states), that chain is the LP's
weakness: a fractionally live hidden state at each instant cuts every window's chain a little,
and neither the LP nor, in the time it has, the MIP sees what every plan does there -- run the
forward pass again after the loss gradient to reach the top layers' gradients, and once more,
layer by layer, for the activations the lower layers' gradients read, since no later instant
holds them all. So this program anchors every later instant t (a *deadline*) at one first
instant a. Columns, for the values of a's own program: ``x0[v]`` (live at a), ``s[v]``
(computed again after a) and ``e[v]`` (computed at least twice after a); per deadline t:
``sigma[t, v]`` (computed after a and before t), and, for the values a node after t reads and
what recomputing those reads, ``x[t, v]`` (live at t) and ``rho[t, v]`` (computed after t).
Any plan satisfies, with its own columns:

- a's program on (x0, s), as for one instant;
- a value read by a first computation after a and up to t: ``x0 + sigma[t] >= 1`` (live since
  a, or computed since), and a computation before t finds its inputs the same way:
  ``sigma[t, w] <= x0[d] + sigma[t, d]``; ``sigma[t, v] <= s[v]``;
- a value read after t: ``x[t] + rho[t] >= 1``, and ``rho[t, w] <= x[t, d] + rho[t, d]``;
- live at t: ``x[t, v] <= x0[v] + sigma[t, v]`` (it was live at a, or computed since);
- ``e[v] >= sigma[t, v] + rho[t, v] - 1``: a computation before t and one after it are two;
- memory at a and at each t, as for one instant; and at most one of the values larger than
  half of a's room is live at a.

Each ``s`` is a computation after a, each ``e`` a second one, so ``sum c_v (s[v] + e[v])`` is at
most what the plan recomputes: the LP value plus ``graph.total_cost`` bounds every plan's cost.
The deadline rows anchor at a, whose room is small, not at each other, so the LP keeps the
second computations: GPT-2 48L at 364.4 MB, 1.374x with several instants, 1.577x
with a at the loss gradient and eight deadlines spread over the backward pass (a 32k-column
LP, 6 s). ``cost_bound`` tries ``DEADLINE_COUNTS`` deadlines spread evenly over the nodes
after the best single instant that read its values, before the several instants.

**Cases at the first instant.** Even so the LP keeps a fraction of many hidden states live at
a (the clique row allows their fractions to sum to one), and each fraction cuts the chains that
the deadlines before a's layer would count. Every plan, though, holds at most one of the values
larger than half of a's room at a: none of them, or exactly one. So for a partition of those
values into groups the plans split into cases, "none outside group G is live at a" (a plan that
holds none of them is in every case). Each case's program is the deadline program with x0 of every large value
outside G fixed at 0; every plan is in one case, whose program it satisfies, so the least LP
value over the cases bounds every plan (each case may have its own deadlines: any deadlines
give a valid program). How the values are grouped decides how strong the cases are. A
fraction spread over values of one group still cuts chains wherever one of them *separates*
the large values before it from what comes after (no node before a reads one of those after
it: holding it at a spares recomputing everything before it, like a hidden state). So
``_cases`` starts from one case for each separator that fits a's room, and the other large
values in ``CASE_GROUPS`` groups; it solves the least case first, splits a case of many values
in halves, and gives a case of a few values deadlines where the values it holds, and those
before them, are first read after a: where a plan that kept one of them at a runs the layers
below it again (a few deadlines first, more when that case is the least again). GPT-2 48L at
364.4 MB: the unsplit LP, 1.580x with eight deadlines, keeps 0.1-0.6 MB of the
hidden states of every sixth layer at a; the other large values, as one case, are 1.691x;
each of the 100 hidden states that fit, alone, 1.621-1.695x with the same deadlines, 1.656x or
more with two deadlines below it (all 100 in 11 s), 1.661x or more with eight (64 s). (Groups
of 30 consecutive values, each about a layer, stall near 1.63x, as a fraction spread over a
layer's two hidden states cuts its chains again.) These LPs are solved with
HiGHS' presolve (2-4x faster here); their value is not HiGHS' objective but what their row
duals prove by weak duality (``_dual_bound``), which holds whatever presolve did.

**The smallest budget.** At the instant t is first computed, no plan holds less than
``fixed_bytes``, the kept bytes so far, t with its scratch and inputs, the outputs so far and
the values that cannot be recomputed but are read later; the largest over t is a budget
below which no plan exists (``min_budget_lower_bound``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from remat.graph import Graph
from remat.schedule import StepKind, plan_from_order
from remat.solvers.base import row_activity
from remat.solvers.milp_backends import quiet_highs, run_highs

log = logging.getLogger("remat.solve")

#: Instants whose knapsack LP is solved alone: all where checkpoint-all is over budget if there are at
#: most SCREEN_ALL, else the most crowded under checkpoint-all and the SCREEN_TOP whose own
#: working set is largest ...
SCREEN_ALL = 64
SCREEN_TOP = 12
#: ... plus this many spread evenly over the other instants where checkpoint-all is over budget.
SCREEN_SPREAD = 12
#: Instants whose knapsack is then solved as a MIP (its dual bound counts), best LP value first,
#: each for at most MIP_TIME_S: the LP is within 0.1% of the MIP on the models we benchmark, and
#: the MIP can take seconds to close that.
MIP_INSTANTS = 1
MIP_TIME_S = 0.5
#: The bound of several instants together (see the module): at most this many instants, the
#: next one chosen among the MULTI_TOP best single instants, those within NEIGHBOURS of the
#: chosen ones, the MULTI_TOP tightest ones (the least room left beside what every plan holds
#: there) and, in the first round only, MULTI_SPREAD spread evenly over the instants
#: checkpoint-all overfills (on the benchmark's graphs, an instant only the spread offered
#: was chosen in a first round alone, and the spread is half of a round's LPs); then a MIP
#: on the set for at most MULTI_MIP_TIME_S. It gets all of that time, the joined sets below
#: what it leaves: a set the growth chose is often solved within it, and its optimum beats a
#: larger set's dual bound cut short (MobileNet b256 at its smallest budget: seven instants
#: solved in 1.6 s prove 1.235x; given 1 s, and the joined set the other second, 1.230x).
#: With two threads or more, the first joined set's MIP runs beside it, each on one thread:
#: HiGHS' MIP gains little from a second thread (U-Net b32 at 40%: 0.5-0.7 s for the five
#: instants the growth chose and 0.9-1.2 s for nine, one after the other, 0.7-0.9 s both at
#: once; ResNet50 b32 at its smallest budget, eight and twelve: 9.4 s against 9.5 s).
MAX_INSTANTS = 8
MULTI_TOP = 12
MULTI_SPREAD = 32
NEIGHBOURS = 6
MULTI_MIP_TIME_S = 2.0
#: ... and a second MIP on the set joined by this many of the tightest instants after the best
#: single one. The LP of such sets is weak, so the growth does not find them, but their MIP is
#: strong: U-Net b32 at 40%, eleven instants have an LP of 1.130x, below five instants' 1.151x,
#: and a MIP optimum of 1.22x (5 s); the five the growth chose and four tight ones give 1.195x
#: in 2 s, against 1.177x. (More is not better within the MIP's seconds: six give 1.190x.)
#: A MIP solved with time to spare is solved again with this many more, while time is left.
MULTI_EXTRA = 4
#: The time the several instants may take in all by default, the MIP's included (within the
#: bound's own limit). The growth stops sooner when no instant raises the LP (U-Net b32 at 40%:
#: five instants, under 2 s); ResNet50 b32 at its smallest budget still gains at eight, and
#: with more time (``cost_bound(multi_time_s=...)``) its MIPs prove more: 1.267x in 8 s, 1.327x
#: in 16 s, 1.334x in 30 s.
MULTI_TIME_S = 8.0
#: The bound of a first instant and deadlines (see the module): the best single instant and
#: this many deadlines spread evenly over the nodes after it that read its values (the first
#: of them included), each count an LP, before the several instants (which use all the time
#: they are given). The first count gets DEADLINE_SHARE of the time left; a larger one comes
#: only if the last raised the bound, and only if DEADLINE_GROWTH times the last one's time
#: fits in DEADLINE_MORE_SHARE of the time left (an LP cut short proves nothing). GPT-2 48L at
#: 364.4 MB: 1.374x with several instants; 1.550x with four deadlines (1.4 s),
#: 1.577x with eight (6.3 s), 1.589x with sixteen (25 s); spread over all the nodes after it
#: instead, eight give 1.547x. Elsewhere in the benchmark these LPs take under 0.5 s and
#: prove no more than the several instants, except GPT-2 at its floor (24L, eight deadlines:
#: 1.589x in 0.4 s against one instant's 1.360x; its several instants' MIPs reach 1.650x).
DEADLINE_COUNTS = (4, 8, 16)
DEADLINE_SHARE = 0.5
DEADLINE_MORE_SHARE = 0.9
DEADLINE_GROWTH = 5.0
#: The deadline program split into cases by which large value is live at its first instant
#: (see the module): one case for each separator that fits, the other large values in
#: CASE_GROUPS groups; then, while time is left, the least case solved (a case of more than
#: CASE_LOCAL values with the deadlines of the unsplit program, and split in halves when it is
#: the least again), and a case of at most CASE_LOCAL values with the first deadline and
#: deadlines added where the values it holds, and the CASE_SPAN large values before each, are
#: first read: CASE_LOCAL_FIRST of them, then CASE_LOCAL_DEADLINES (spread evenly), then in
#: halves. It gets CASE_SHARE of the time several instants would have, and runs only where the
#: deadlines beat one instant. GPT-2 48L at 364.4 MB (100 hidden states alone and
#: the rest in one group), with ``cost_bound(time_limit_s=T, multi_time_s=T)`` after the
#: planner's two shorter calls: 1.656x for T = 15 s, 1.658x for 35 s, where the first pass over
#: the hidden states takes about 11 s; groups of 30 consecutive values instead, 1.625x and
#: 1.634x. A case not yet solved counts at the unsplit LP's value, so the first pass is kept
#: short (three local deadlines first: 1.649x in 22 s but nothing in 15 s, on an earlier trace).
CASE_GROUPS = 1
CASE_SPAN = 12
CASE_LOCAL = 64
CASE_LOCAL_FIRST = 2
CASE_LOCAL_DEADLINES = 8
CASE_SHARE = 0.75
#: Instants whose rows' ingredients a bound object keeps (``InstantBounds._piece``).
PIECES_KEPT = 128
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
    #: the instants whose program gave ``value`` together (``(instant,)`` for a single one)
    instants: tuple[int, ...] = ()

    def overhead(self, graph: Graph) -> float:
        """The bound as a multiple of computing every node once."""
        return self.value / graph.total_cost if graph.total_cost > 0 else 1.0


@dataclass(frozen=True)
class _Program:
    """The 0/1 program of a set of instants (``instants``, increasing), as arrays.

    Columns: per instant k and decision value v, ``x`` (v live at instant k) and, if v can be
    recomputed, ``r`` (v computed again after instant k and, unless k is the last, no later
    than the next instant). Rows (``row_lower <= A x <= row_upper``, CSR): needed values are
    live or recomputed, recomputations find their inputs, what is live at an instant was live
    at the one before or recomputed since, and the memory row of each instant.
    """

    instants: tuple[int, ...]
    col_cost: np.ndarray
    col_upper: np.ndarray
    starts: np.ndarray
    index: np.ndarray
    value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    feasible: bool  # False: an instant's values no plan can drop exceed the budget already
    empty: bool  # True: nothing to decide, every instant's values fit (the bound adds nothing)


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
        self._singles: dict[tuple[int, tuple[int, ...]], tuple[dict[int, float], int, float]] = {}
        # per (budget, best single instant): the set the growth chose and its LP value, so a
        # second call goes on from it; per (budget, set): a MIP's value and whether it was solved
        self._grown: dict[tuple[int, int], tuple[tuple[int, ...], float]] = {}
        self._mips: dict[tuple[int, tuple[int, ...]], tuple[float, bool]] = {}
        # per (budget, first instant, deadlines): the deadline program's LP value and its time
        self._deadline_values: dict[tuple[int, int, tuple[int, ...]], tuple[float, float]] = {}
        # per (budget, first instant): the deadlines and the cases of their program (``_cases``)
        self._case_trees: dict[tuple[int, int], tuple[tuple[int, ...], list[list]]] = {}
        self._stop: threading.Event | None = None  # the running call's (``cost_bound``)
        self._pieces: dict[int, tuple[np.ndarray, ...]] = {}  # per instant (``_piece``)

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

    def _tightest(self, instants: np.ndarray) -> np.ndarray:
        """``instants`` by the least room they leave: the most bytes every plan holds there first."""
        return instants[np.argsort(-self.forced_bytes[instants], kind="stable")]

    def forced_mask(self, t: int) -> np.ndarray:
        """The values every plan holds at instant t (its inputs, the outputs, the values that
        cannot be recomputed but are read later) and those that cost nothing to hold."""
        forced = np.zeros(self.graph.n, dtype=bool)
        forced[list(self.graph.nodes[t].deps)] = True
        forced[self.is_output] = True  # outputs are kept from their computation on
        forced[:t] |= ~self.recomputable[:t] & (self.last_user[:t] > t)
        forced[self.sizes == 0] = True  # a zero-byte value is kept for free
        return forced

    def _piece(self, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What instant t's rows take from the graph alone, kept for the next program that has
        t (the growth builds hundreds of programs from a few dozen instants): the mask of
        ``decided(t)``, its values, the recomputable ones, those read after t (or outputs'
        ancestors), and the edges between decided values into a recomputable one."""
        piece = self._pieces.get(t)
        if piece is None:
            d = self.decided(t)
            ids = np.flatnonzero(d)
            src, dst = self.edge_src, self.edge_dst
            piece = (d, ids, ids[self.recomputable[ids]], np.flatnonzero(d & (self.last_user > t)),
                     np.flatnonzero(d[src] & d[dst] & self.recomputable[dst]))
            if len(self._pieces) >= PIECES_KEPT:
                self._pieces.clear()
            self._pieces[t] = piece
        return piece

    def decided(self, t: int) -> np.ndarray:
        """The values instant t's program decides on: computed before t, read after it (or
        depended on by what is), and not held there by every plan."""
        d = np.zeros(self.graph.n, dtype=bool)
        d[:t] = self.reach[:t] > t
        return d & ~self.forced_mask(t)

    def program(self, instants: tuple[int, ...], budget_bytes: int, since: bool = True) -> _Program:
        """The 0/1 program of ``instants`` (see the module) under ``budget_bytes``; without the
        columns and rows of s (``since=False``) it is a relaxation of it (fewer rows, every
        plan still satisfies them), whose LP is weak and whose MIP is solved much faster."""
        n = self.graph.n
        ts = tuple(sorted(set(int(t) for t in instants)))
        caps = [budget_bytes - int(self.forced_bytes[t]) for t in ts]
        decide, x_col, r_col, s_col = [], [], [], []
        pieces = [self._piece(t) for t in ts]
        col = 0
        for t, (d, ids, rec, _, _) in zip(ts, pieces):
            xs = np.full(n, -1, dtype=np.int64)
            xs[ids] = col + np.arange(ids.size)
            col += ids.size
            rs = np.full(n, -1, dtype=np.int64)
            rs[rec] = col + np.arange(rec.size)
            col += rec.size
            decide.append(d)
            x_col.append(xs)
            r_col.append(rs)
            if since and t != ts[-1]:  # s[k, v]: v computed again at any time after instant k (the module)
                ss = np.full(n, -1, dtype=np.int64)
                ss[rec] = col + np.arange(rec.size)
                col += rec.size
                s_col.append(ss)
        col_cost = np.zeros(col)
        for rs in r_col:
            mine = np.flatnonzero(rs >= 0)
            col_cost[rs[mine]] = self.costs[mine]
        empty = all(int(self.sizes[d].sum()) <= cap for d, cap in zip(decide, caps))
        rows = _Rows()
        src, dst = self.edge_src, self.edge_dst
        for k, t in enumerate(ts):
            d, ids, _, later, closure = pieces[k]
            xs, rs = x_col[k], r_col[k]
            # needed: read by a first computation before the next instant (after the last
            # instant: read later at all, or an output): live here or recomputed since
            if k + 1 < len(ts):
                window = (dst > t) & (dst <= ts[k + 1]) & d[src]
                need = np.unique(src[window])
            else:
                need = later
            rows.add_any(xs[need], rs[need], 1.0, np.inf)
            # live at the next instant: live here, or recomputed since
            if k + 1 < len(ts):
                both = np.flatnonzero(d & decide[k + 1])
                rows.add_transfer(x_col[k + 1][both], xs[both], rs[both])
            # a recomputation finds its inputs live here or recomputed since
            rows.add_closure(xs[src[closure]], rs[src[closure]], rs[dst[closure]])
            if since and k + 1 < len(ts):
                self._add_since(rows, k, ts, later, xs, closure, s_col[k], r_col)
            # memory, in units of the largest value so the row is well scaled
            if ids.size:
                scale = 1.0 / float(self.sizes[ids].max())
                rows.add_row(xs[ids], self.sizes[ids] * scale, -np.inf, max(caps[k], 0) * scale)
        # a value larger than the room an instant leaves cannot be live there (the LP could
        # otherwise hold part of it)
        col_upper = np.ones(col)
        for k in range(len(ts)):
            big = np.flatnonzero(decide[k] & (self.sizes > max(caps[k], 0)))
            col_upper[x_col[k][big]] = 0.0
        starts, index, value, lower, upper = rows.arrays()
        return _Program(ts, col_cost, col_upper, starts, index, value, lower, upper,
                        feasible=min(caps, default=0) >= 0, empty=empty)

    def _add_since(self, rows: _Rows, k: int, ts: tuple[int, ...], needed: np.ndarray, xs: np.ndarray,
                   closure: np.ndarray, ss: np.ndarray, r_col: list[np.ndarray]) -> None:
        """The rows of ``s[k, .]`` (recomputed at any time after instant k): instant k's own
        program on (x[k], s[k]), and ``s[k, v] <= sum of r[j, v] over j >= k``. That sum row
        holds for a value only if every later window where a plan could still need it models
        its recomputation: one held by force at a later instant (read there) has no r there,
        and its s is left free (weaker, still valid)."""
        src, dst = self.edge_src, self.edge_dst
        rows.add_any(xs[needed], ss[needed], 1.0, np.inf)
        rows.add_closure(xs[src[closure]], ss[src[closure]], ss[dst[closure]])
        rec = np.flatnonzero(ss >= 0)
        modelled = np.ones(rec.size, dtype=bool)
        for j in range(k + 1, len(ts)):
            modelled &= ~((self.reach[rec] > ts[j]) & (r_col[j][rec] < 0))
        rec = rec[modelled]
        later = len(ts) - k
        rows.add(np.stack([ss[rec], *(r_col[j][rec] for j in range(k, len(ts)))], axis=1),
                 np.array([1.0] + [-1.0] * later), -np.inf, 0.0)

    def deadline_program(self, first: int, deadlines: tuple[int, ...], budget_bytes: int) -> _Program:
        """The 0/1 program of instant ``first`` with ``deadlines`` (later instants) under
        ``budget_bytes`` (see the module). Columns: for the values of ``first``'s own program,
        ``x0`` (live at it), ``s`` (computed again after it) and ``e`` (computed at least twice
        after it); per deadline t, ``sigma`` (computed after ``first`` and before t), and for the
        values t's later nodes need (with what recomputing them needs), ``x`` (live at t) and
        ``rho`` (computed after t)."""
        n = self.graph.n
        src, dst = self.edge_src, self.edge_dst
        ts = tuple(sorted({int(t) for t in deadlines if first < int(t) < n}))
        decide = self.decided(first)
        ids = np.flatnonzero(decide)
        rec = ids[self.recomputable[ids]]
        count = 0

        def columns(members: np.ndarray) -> np.ndarray:
            nonlocal count
            out = np.full(n, -1, dtype=np.int64)
            out[members] = count + np.arange(members.size)
            count += members.size
            return out

        x0, s, e = columns(ids), columns(rec), columns(rec)
        caps = [budget_bytes - int(self.forced_bytes[first])]
        rows = _Rows()
        # the program of ``first`` alone, on (x0, s)
        need = np.flatnonzero(decide & (self.last_user > first))
        rows.add_any(x0[need], s[need], 1.0, np.inf)
        closure = decide[src] & decide[dst] & (s[dst] >= 0)
        inputs, users = src[closure], dst[closure]
        rows.add_closure(x0[inputs], s[inputs], s[users])
        scale = 1.0 / float(self.sizes[ids].max()) if ids.size else 1.0
        rows.add_row(x0[ids], self.sizes[ids] * scale, -np.inf, max(caps[0], 0) * scale)
        big = self._big(first, budget_bytes, ids)  # no two of these fit together
        if big.size > 1:
            rows.add_row(x0[big], np.ones(big.size), -np.inf, 1.0)
        uppers: list[tuple[np.ndarray, np.ndarray, int]] = [(x0, ids, caps[0])]
        for t in ts:
            # sigma: read by a first computation up to t, so live at ``first`` or computed
            # since; a recomputation before t finds its inputs the same way
            sigma = columns(rec)
            read = np.unique(src[(dst > first) & (dst <= t) & decide[src]])
            rows.add_any(x0[read], sigma[read], 1.0, np.inf)
            rows.add_closure(x0[inputs], sigma[inputs], sigma[users])
            rows.add(np.stack([sigma[rec], s[rec]], axis=1), np.array([1.0, -1.0]), -np.inf, 0.0)
            # after t: what a later node reads, and what recomputing that reads
            alive = decide & self.decided(t)
            later = np.flatnonzero(alive & (self.last_user > t))
            held = np.flatnonzero(self._ancestors(alive, later))
            x, rho = columns(held), columns(held[self.recomputable[held]])
            rows.add_any(x[later], rho[later], 1.0, np.inf)
            linked = alive[src] & (x[dst] >= 0) & (rho[dst] >= 0)
            rows.add_closure(x[src[linked]], rho[src[linked]], rho[dst[linked]])
            rows.add_transfer(x[held], x0[held], sigma[held])
            twice = held[(sigma[held] >= 0) & (rho[held] >= 0)]
            rows.add(np.stack([e[twice], sigma[twice], rho[twice]], axis=1), np.array([1.0, -1.0, -1.0]), -1.0,
                     np.inf)
            caps.append(budget_bytes - int(self.forced_bytes[t]))
            if held.size:
                rows.add_row(x[held], self.sizes[held] * scale, -np.inf, max(caps[-1], 0) * scale)
            uppers.append((x, held, caps[-1]))
        col_cost = np.zeros(count)
        col_cost[s[rec]] = self.costs[rec]
        col_cost[e[rec]] = self.costs[rec]
        col_upper = np.ones(count)
        for cols, members, cap in uppers:  # a value larger than the room cannot be live there
            col_upper[cols[members[self.sizes[members] > max(cap, 0)]]] = 0.0
        starts, index, value, lower, upper = rows.arrays()
        return _Program((first, *ts), col_cost, col_upper, starts, index, value, lower, upper,
                        feasible=min(caps) >= 0, empty=ids.size == 0)

    def _big(self, first: int, budget_bytes: int, ids: np.ndarray) -> np.ndarray:
        """The values of ``ids`` larger than half the room at ``first``: no two of them are live
        there together."""
        return ids[2 * self.sizes[ids] > budget_bytes - int(self.forced_bytes[first])]

    def _ancestors(self, allowed: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """The ``seeds`` and every value of ``allowed`` they depend on through ``allowed``."""
        marked = np.zeros(self.graph.n, dtype=bool)
        marked[seeds] = True
        for v in range(int(seeds.max(initial=-1)), -1, -1):
            if marked[v]:
                for d in self.graph.nodes[v].deps:
                    if allowed[d]:
                        marked[d] = True
        return marked

    # ------------------------------------------------------------------ the bound
    def cost_bound(self, budget_bytes: int, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                   instants: tuple[int, ...] = (), threads: int = 2, multi: bool = True,
                   multi_time_s: float = MULTI_TIME_S, several: bool = True,
                   stop: threading.Event | None = None) -> CostBound:
        """The instant bound under ``budget_bytes``: LP relaxations at screened instants (and
        at ``instants``), then MIPs at the most promising ones, within ``time_limit_s``; then the
        best one with deadlines (the module); with ``multi``, their cases, then several instants
        together for at most ``multi_time_s`` (a quarter of it for their MIPs); with ``multi``
        and not ``several``, the cases alone, for all the time left. The single instants', the
        deadlines' and the cases' results are kept per budget, so asking first without
        ``multi`` and later with it repeats nothing.

        Every number it takes is a valid bound, so stopping early only makes it weaker: once
        ``stop`` is set, it starts nothing more and returns what it has when the LP or MIP then
        running ends (its caller stops it when the work it runs beside is done). One call at a
        time per object: the calls share what they keep.
        """
        self._stop = stop
        try:
            return self._cost_bound(budget_bytes, time_limit_s, instants, threads, multi, multi_time_s, several)
        finally:
            self._stop = None

    def _now(self) -> float:
        """The clock the time limits are checked on: past every deadline once the call's
        ``stop`` is set."""
        stop = self._stop
        return math.inf if stop is not None and stop.is_set() else time.perf_counter()

    def _cost_bound(self, budget_bytes: int, time_limit_s: float, instants: tuple[int, ...], threads: int,
                    multi: bool, multi_time_s: float, several: bool) -> CostBound:
        started = time.perf_counter()
        g = self.graph
        if budget_bytes < self.min_budget_bytes:
            t = int(np.argmax(self.forced_bytes))
            return CostBound(budget_bytes, math.inf, t, False, 0, time.perf_counter() - started)
        excess = self.checkpoint_all_instants - budget_bytes
        over = np.flatnonzero(excess > 0)
        if over.size == 0:
            return CostBound(budget_bytes, g.total_cost, None, True, 0, time.perf_counter() - started)
        deadline = started + time_limit_s
        key = (budget_bytes, tuple(instants))
        if key in self._singles:
            lp_values, best_t, best = self._singles[key]
        else:
            lp_values, best_t, best = self._single(budget_bytes, over, excess, deadline, time_limit_s, instants,
                                                   threads)
            if self._now() < deadline:  # complete: kept for a second call (``multi``)
                if len(self._singles) >= 64:
                    self._singles.clear()
                self._singles[key] = (lp_values, best_t, best)
        feasible = math.isfinite(best)
        together: tuple[int, ...] = (best_t,)
        if feasible:  # a first instant with deadlines; then, with ``multi``, several instants
            chained = self._deadlines(budget_bytes, best_t, best, deadline, threads)
            if multi and chained[0] > best * (1 + 1e-6) + 1e-9:  # cases, where deadlines see more
                until = min(deadline, time.perf_counter() + CASE_SHARE * multi_time_s) if several else deadline
                cases = self._cases(budget_bytes, best_t, chained[1][1:], chained[0], until, threads)
                chained = (max(cases, chained[0]), chained[1])
            results = [(best, together)]
            if multi and several:  # (no plan fits if the instants together leave none)
                results.append(self._several(budget_bytes, best_t, best, lp_values, excess, deadline, threads,
                                             multi_time_s))
            best, together = max([*results, chained], key=lambda pair: pair[0])  # (ties: the instants)
            feasible = math.isfinite(best)
        value = g.total_cost + best if feasible else math.inf
        log.info("bound: %s under %d B: %s at %s (%d instants, %.2f s)", g.name, budget_bytes,
                 f"{value / g.total_cost:.4f}x" if feasible and g.total_cost else ("no plan fits" if not feasible else value),
                 ", ".join(g.describe(t) for t in together), len(lp_values), time.perf_counter() - started)
        return CostBound(budget_bytes, value, best_t, feasible, len(lp_values), time.perf_counter() - started,
                         together)

    def _single(self, budget_bytes: int, over: np.ndarray, excess: np.ndarray, deadline: float, time_limit_s: float,
                instants: tuple[int, ...], threads: int) -> tuple[dict[int, float], int, float]:
        """Single instants: (LP value per instant tried, the best instant, its value, raised by
        MIPs at the best ones). Kept per budget: a second call with ``multi`` reuses it."""
        g = self.graph
        ranked = over[np.argsort(-excess[over], kind="stable")]
        top = ranked.size if ranked.size <= SCREEN_ALL else SCREEN_TOP
        # the most crowded instants, and those whose own working set (what no plan can drop)
        # is largest: a large node with large inputs makes a sharp peak of the bound
        heavy = self._tightest(over)[:SCREEN_TOP]
        chosen = list(dict.fromkeys([*ranked[:top].tolist(), *heavy.tolist()]))
        rest = np.sort(np.setdiff1d(ranked, chosen))
        if rest.size:
            chosen += list(rest[np.unique(np.linspace(0, rest.size - 1, min(SCREEN_SPREAD, rest.size)).astype(int))])
        chosen += [t for t in instants if 0 <= t < g.n]
        screen = list(dict.fromkeys(int(t) for t in chosen))
        lp_values: dict[int, float] = {}
        for t, value in zip(screen, self._relaxed(screen, budget_bytes, deadline, threads)):
            if value is None:
                break
            lp_values[t] = value
            if math.isinf(value):
                break
        if not lp_values:  # (no time at all: the first one still counts)
            lp_values[screen[0]] = _solve_program(self.program((screen[0],), budget_bytes), relax=True,
                                                  time_limit_s=time_limit_s, threads=threads)
        # the LP values are smooth in t: climb from the best one, in steps halving from the
        # spacing of the screen down to single instants
        step = max(1, int(over.size // max(1, len(lp_values))))
        best_t = max(lp_values, key=lp_values.get)
        while step >= 1 and self._now() < deadline and math.isfinite(lp_values[best_t]):
            pair = [t for t in (best_t - step, best_t + step) if 0 <= t < g.n and t not in lp_values and excess[t] > 0]
            for t, value in zip(pair, self._relaxed(pair, budget_bytes, deadline, threads)):
                if value is not None:
                    lp_values[t] = value
            moved = max(lp_values, key=lp_values.get)
            if moved == best_t:
                step //= 2
            best_t = moved
        best = lp_values[best_t]
        if math.isfinite(best):
            for t in sorted(lp_values, key=lp_values.get, reverse=True)[:MIP_INSTANTS]:
                left = min(deadline - self._now(), MIP_TIME_S)
                if left <= 0.05:
                    break
                value = _solve_program(self.program((t,), budget_bytes), relax=False, time_limit_s=left,
                                       threads=threads)
                if value > best:
                    best, best_t = value, t
        return lp_values, best_t, best

    def _relaxed(self, instants: list[int], budget_bytes: int, until: float, threads: int,
                 chosen: tuple[int, ...] = ()) -> list[float | None]:
        """The LP values of ``chosen`` joined by each of ``instants`` in turn, in order; None for
        one not started before ``until``. ``threads`` of them are solved at once, each on one
        HiGHS thread: these LPs are many and small, HiGHS' simplex is serial and highspy lets
        go of the interpreter while it runs, so two cores solve two at once (U-Net b32 at 40%
        grows its set of instants from 364 of them)."""

        def one(t: int) -> float | None:
            if self._now() > until:
                return None
            return _solve_program(self.program((*chosen, t), budget_bytes), relax=True,
                                  time_limit_s=max(until - time.perf_counter(), 0.05), threads=1)

        if threads <= 1 or len(instants) <= 1:
            return [one(t) for t in instants]
        return list(_lp_pool(threads).map(one, instants))

    def _several(self, budget_bytes: int, best_t: int, best: float, single: dict[int, float], excess: np.ndarray,
                 deadline: float, threads: int, multi_time_s: float = MULTI_TIME_S) -> tuple[float, tuple[int, ...]]:
        """The bound of several instants together, grown from the best single one: add the
        instant whose LP raises the value most (among the best single instants, the close
        neighbours of those chosen, the tightest instants and a spread over the rest), up to
        ``MAX_INSTANTS``; then short MIPs on the set and on the set joined by the tightest
        instants after the best one (``MULTI_EXTRA`` more each time one is solved with time to
        spare). The tightest are there because an instant that forces a value to be computed a
        third time is often one with little of its own to recompute, far from the best single
        one: MobileNet b256 at its smallest budget binds alone where the backward pass starts
        (1.186x) and, with the first layers' gradients at the end of the step, reaches 1.288x
        (seven instants). A second call at the same budget goes on growing the set the first
        chose, for a quarter of its time instead of three quarters, and gives the MIPs the rest
        (``milp``'s longer bound). Returns (recomputation bound, instants); ``best`` and
        ``(best_t,)`` if nothing helps."""
        n = self.graph.n
        chosen = (best_t,)
        lp = best  # the LP value of the chosen set (of one instant: the single bound)
        mip_share = MULTI_MIP_TIME_S / MULTI_TIME_S
        if (budget_bytes, best_t) in self._grown:  # a second call: the growth goes on from the set
            chosen, lp = self._grown[budget_bytes, best_t]  # chosen before, the MIPs get most of the time
            mip_share = 1.0 - mip_share
        mip_s = mip_share * multi_time_s
        searching = min(deadline, time.perf_counter() + multi_time_s - mip_s)
        over = np.flatnonzero(excess > 0)
        spread = over[np.unique(np.linspace(0, over.size - 1, min(MULTI_SPREAD, over.size)).astype(int))].tolist()
        by_room = self._tightest(over).tolist()
        tight = by_room[:MULTI_TOP]
        for round_ in range(MAX_INSTANTS - 1):
            near = {c + d for c in chosen for d in range(-NEIGHBOURS, NEIGHBOURS + 1)}
            ranked = sorted((t for t in single if t not in chosen), key=single.get, reverse=True)[:MULTI_TOP]
            pool = [t for t in dict.fromkeys([*sorted(near), *ranked, *tight, *(spread if round_ == 0 else ())])
                    if 0 <= t < n and t not in chosen and excess[t] > 0]
            found: tuple[float, int] | None = None
            for t, v in zip(pool, self._relaxed(pool, budget_bytes, searching, threads, chosen)):
                if v is not None and (found is None or v > found[0]):
                    found = (v, t)
            if found is None or found[0] <= lp * (1 + 1e-9) + 1e-9:
                break
            lp = found[0]
            chosen = tuple(sorted((*chosen, found[1])))
        if len(self._grown) >= 64:
            self._grown.clear()
        self._grown[budget_bytes, best_t] = (chosen, lp)
        # the MIPs: of the chosen set (all the time it needs), then with what it leaves, of the
        # set joined by the tightest instants after the best single one, which the LP cannot rank
        until = min(deadline, time.perf_counter() + mip_s)
        value, together = lp, chosen  # (lp is best while the set is one instant)
        later = [t for t in by_room if t > best_t and t not in chosen]
        extra = MULTI_EXTRA
        first: tuple[float, bool] | None = None  # the first joined set's MIP, when run beside the set's
        if len(chosen) > 1 and until - self._now() > 0.05:
            if later and threads >= 2:  # the two at once, one thread each (HiGHS' MIP is mostly serial)
                joined = tuple(sorted((*chosen, *later[:extra])))
                own, first = _lp_pool(2).map(
                    lambda s: self._mip(s, budget_bytes, until - time.perf_counter(), 1), (chosen, joined))
                value = max(value, own[0])
            else:
                value = max(value, self._mip(chosen, budget_bytes, until - time.perf_counter(), threads)[0])
        while later and (first is not None or until - self._now() > 0.05):
            joined = tuple(sorted((*chosen, *later[:extra])))
            if first is not None:
                (v, solved), first = first, None
            else:
                v, solved = self._mip(joined, budget_bytes, until - time.perf_counter(), threads)
            if v > value:
                value, together = v, joined
            if extra >= len(later) or not solved:
                break  # every tight instant is in, or the MIP used its time (it was not solved)
            extra += MULTI_EXTRA  # solved with time to spare: a larger set may prove more
        return value, together

    def _deadlines(self, budget_bytes: int, first: int, single: float, deadline: float,
                   threads: int) -> tuple[float, tuple[int, ...]]:
        """The LPs of ``first`` with ``DEADLINE_COUNTS`` deadlines spread evenly over the nodes
        after it that read its values, from the first of them on: (the best value, its
        instants), or (0, (first,)) if none is solved in time.
        The first count gets ``DEADLINE_SHARE`` of the time left; a larger one is tried only
        if the last raised the bound above ``single`` (the best single instant's) and, at
        ``DEADLINE_GROWTH`` times the last one's time, fits in ``DEADLINE_MORE_SHARE`` of the
        time left. Solved ones are kept per budget."""
        best, chosen = 0.0, (first,)
        # the nodes after ``first`` that read its values, the first of them included
        readers = np.unique(self.edge_dst[(self.edge_dst > first) & self.decided(first)[self.edge_src]])
        share, last_s = DEADLINE_SHARE, 0.0
        tree = self._case_trees.get((budget_bytes, first))
        for count in DEADLINE_COUNTS:
            if readers.size == 0 or (tree is not None and count > len(tree[0])):
                break  # (the cases of fewer deadlines, refined, prove more than an unsplit LP)
            spots = np.unique(np.linspace(0, readers.size - 1, count + 1)[:-1].round().astype(int))
            picks = tuple(int(t) for t in readers[spots])
            key = (budget_bytes, first, picks)
            if key in self._deadline_values:
                value, last_s = self._deadline_values[key]
            else:
                left = share * (deadline - self._now())
                if left <= 0.05 or DEADLINE_GROWTH * last_s > left:
                    break
                started = time.perf_counter()
                value, solved = _run_program(self.deadline_program(first, picks, budget_bytes), relax=True,
                                             time_limit_s=left, threads=threads, presolve=True)
                last_s = time.perf_counter() - started
                if solved:
                    if len(self._deadline_values) >= 256:
                        self._deadline_values.clear()
                    self._deadline_values[key] = (value, last_s)
            if value > best:
                best, chosen = value, (first, *picks)
            if not value > single * (1 + 1e-6) + 1e-9:
                break  # no second computation seen: more deadlines are not worth their time
            share = DEADLINE_MORE_SHARE
        return best, chosen

    def _cases(self, budget_bytes: int, first: int, picks: tuple[int, ...], value: float, deadline: float,
               threads: int) -> float:
        """The deadline program of ``first`` and ``picks`` split into cases by which value larger
        than half of ``first``'s room is live there (see the module): the least LP value over a
        partition of them, refined best-first while time is left; ``value`` (the unsplit LP's)
        if nothing is solved. The cases and their values are kept per budget and first instant,
        so a second call goes on refining them (with the deadlines of the first call)."""
        ids = np.flatnonzero(self.decided(first))
        big = self._big(first, budget_bytes, ids)
        if big.size < 2:
            return value
        # a case: [value, members, state]: no value of big outside big[members] is live at
        # ``first`` (so a plan holding none of them is in every case); state 0: its value is its
        # parent's, 1: its LP's (a small case's with a few local deadlines), 2: a small case's
        # LP with all its local deadlines
        columns = np.searchsorted(ids, big)  # x0 of ``big`` (x0 comes first in the program)

        def solved(p: _Program, members: np.ndarray, on: int = threads) -> tuple[float, bool]:
            upper = p.col_upper.copy()  # no other large value live
            upper[np.delete(columns, members)] = 0.0
            return _run_program(replace(p, col_upper=upper), relax=True, threads=on, presolve=True,
                                time_limit_s=max(deadline - time.perf_counter(), 0.05))

        if (budget_bytes, first) in self._case_trees:
            picks, cases = self._case_trees[budget_bytes, first]
            program = None  # built when a case needs it
        else:
            program = self.deadline_program(first, picks, budget_bytes)
            # holding none of them is every case's too: where that is no dearer than the
            # program itself, splitting cannot help (GPT-2 24L at its floor)
            none, ok = solved(program, np.zeros(0, dtype=np.int64))
            if not ok:
                return value
            cases = [] if none <= value * (1 + 1e-6) + 1e-9 else self._first_cases(first, budget_bytes, big, value)
            if len(self._case_trees) >= 64:
                self._case_trees.clear()
            self._case_trees[budget_bytes, first] = (picks, cases)

        def job(case: list) -> tuple[str, _Program | None]:  # what refining ``case`` takes next
            nonlocal program
            _v, members, state = case
            small = members.size <= CASE_LOCAL
            if state == 0 and not small:
                if program is None:
                    program = self.deadline_program(first, picks, budget_bytes)
                return "lp", program
            if (state == 1 and not small) or (state == 2 and members.size > 1):
                return "split", None
            if state < 2:  # deadlines where the values below and in it are read: a few, then more
                local = self._local_deadlines(first, big, members, CASE_LOCAL_DEADLINES if state else CASE_LOCAL_FIRST)
                if state and len(local) <= CASE_LOCAL_FIRST:  # the same deadlines as its last LP: no more to see
                    return "done", None
                return "lp", self.deadline_program(first, (*picks[:1], *local), budget_bytes)
            return "stop", None  # (a case that cannot rise any more)

        while cases and self._now() < deadline:
            # the least case, and while threads are free the next least ones that need an LP
            # (best-first, ``threads`` at a time: each LP is of one case, and every case's
            # value stays a bound whichever is refined first)
            ordered = sorted(cases, key=lambda c: (c[0], c[2]))
            case = ordered[0]
            kind, p = job(case)
            if kind == "split":  # in two halves (halves of a small case: their own local deadlines)
                v, members, state = case
                half, child = members.size // 2, int(members.size <= CASE_LOCAL)
                # (by identity: ``remove`` compares with ``==``, which on two cases of the same
                # value compares their member arrays and raised "truth value ... is ambiguous")
                cases[:] = [c for c in cases if c is not case]
                cases += [[v, members[:half], child], [v, members[half:], child]]
                continue
            if kind == "done":
                case[2] = 2
                continue
            if kind == "stop":
                break  # the least case cannot rise any more
            batch = [(case, p)]
            for other in ordered[1:]:
                if len(batch) >= threads:
                    break
                kind, q = job(other)
                if kind == "lp":
                    batch.append((other, q))
            results = _lp_pool(threads).map(lambda item: solved(item[1], item[0][1], 1), batch) \
                if len(batch) > 1 else [solved(p, case[1], threads)]
            stopped = False
            for (c, _p), (lp, ok) in zip(batch, results):
                if ok:
                    c[0], c[2] = max(c[0], lp), c[2] + 1
                else:
                    stopped = True
            if stopped:
                break
        return min((c[0] for c in cases), default=value)

    def _first_cases(self, first: int, budget_bytes: int, big: np.ndarray, value: float) -> list[list]:
        """The cases the search starts from: one for each value of ``big`` that fits ``first``'s
        room and separates the large values before it from what comes after it (no node before
        ``first`` reads one of them after it: holding it at ``first`` spares recomputing every
        large value before it), and the others in ``CASE_GROUPS`` groups. The LP spreads a
        fraction of a value over such separators and cuts the recomputation of the layers below
        each one a little; alone in its case, a separator cuts them whole or not at all (the
        module gives GPT-2 48L's numbers)."""
        users = self.graph.users
        room = budget_bytes - int(self.forced_bytes[first])
        alone = np.zeros(big.size, dtype=bool)
        reach = -1  # the last node before ``first`` that reads a large value seen so far
        for k, u in enumerate(big):
            alone[k] = reach <= u and self.sizes[u] <= room
            reach = max(reach, max((int(w) for w in users[int(u)] if w < first), default=-1))
        rest = np.flatnonzero(~alone)
        groups = np.array_split(rest, min(CASE_GROUPS, rest.size)) if rest.size else []
        return [[value, np.array([k]), 0] for k in np.flatnonzero(alone)] + [[value, g, 0] for g in groups]

    def _local_deadlines(self, first: int, big: np.ndarray, members: np.ndarray, count: int) -> tuple[int, ...]:
        """The first readers after ``first`` of the values ``big[members]`` and of the
        ``CASE_SPAN`` before each, at most ``count`` of them spread evenly: where a plan keeping
        one of ``big[members]`` at ``first`` needs the layers below it again."""
        users = self.graph.users
        near = np.zeros(big.size, dtype=bool)
        for k in members:
            near[max(0, int(k) - CASE_SPAN):int(k) + 1] = True
        out = set()
        for u in big[near]:
            later = [w for w in users[int(u)] if w > first]
            if later:
                out.add(min(later))
        ordered = sorted(out)
        if len(ordered) > count:
            ordered = [ordered[i] for i in np.linspace(0, len(ordered) - 1, count).round().astype(int)]
        return tuple(ordered)

    def _mip(self, instants: tuple[int, ...], budget_bytes: int, time_limit_s: float,
             threads: int) -> tuple[float, bool]:
        """The MIP of a set of instants within ``time_limit_s``: (its value or dual bound,
        whether it was solved). A solved one is not solved again, one cut short is given
        the new time (HiGHS keeps nothing between calls)."""
        key = (budget_bytes, instants)
        if key in self._mips and self._mips[key][1]:
            return self._mips[key]
        # without the rows of s: they make the LP strong enough to grow the set by, but the
        # MIP, which finds its own cuts, is solved 3-4x faster without them (ResNet50 b32 at its
        # smallest budget, twelve instants: 9.5 s against 34 s, the same optimum)
        value, solved = _run_program(self.program(instants, budget_bytes, since=False), relax=False,
                                     threads=threads, time_limit_s=time_limit_s)
        if len(self._mips) >= 256:
            self._mips.clear()
        known = self._mips.get(key, (0.0, False))[0]
        self._mips[key] = (max(value, known), solved)
        return self._mips[key]


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _lp_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads for the bound's LPs, kept for the process (HiGHS keeps its
    own state per calling thread, so its threads are reused rather than made per call)."""
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remat-bound")
        return _pools[workers]


class _Rows:
    """Rows of a sparse program built in groups: a group is an (m, a) array of columns (-1 where a
    row has no such term) with a coefficient per column of the group, and the rows' bounds."""

    def __init__(self) -> None:
        self.groups: list[tuple[np.ndarray, np.ndarray, float, float]] = []

    def add(self, cols: np.ndarray, coefs: np.ndarray, lower: float, upper: float) -> None:
        cols = np.asarray(cols, dtype=np.int64)
        if cols.shape[0]:
            self.groups.append((cols, np.broadcast_to(np.asarray(coefs, dtype=float), cols.shape), lower, upper))

    def add_any(self, x: np.ndarray, r: np.ndarray, lower: float, upper: float) -> None:
        """``x + r`` (r absent where -1) within the bounds."""
        self.add(np.stack([x, r], axis=1), np.array([1.0, 1.0]), lower, upper)

    def add_transfer(self, later: np.ndarray, x: np.ndarray, r: np.ndarray) -> None:
        """``later <= x + r``."""
        self.add(np.stack([later, x, r], axis=1), np.array([1.0, -1.0, -1.0]), -np.inf, 0.0)

    def add_closure(self, x: np.ndarray, r: np.ndarray, user: np.ndarray) -> None:
        """``user <= x + r``: a recomputed user finds its input."""
        self.add(np.stack([x, r, user], axis=1), np.array([1.0, 1.0, -1.0]), 0.0, np.inf)

    def add_row(self, cols: np.ndarray, coefs: np.ndarray, lower: float, upper: float) -> None:
        self.add(np.asarray(cols)[None, :], np.asarray(coefs)[None, :], lower, upper)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(starts, index, value, lower, upper) in CSR form."""
        counts, index, value, lower, upper = [np.zeros(0, dtype=np.int64)], [], [], [], []
        for cols, coefs, lo, hi in self.groups:
            present = cols >= 0
            counts.append(present.sum(axis=1))
            index.append(cols[present])
            value.append(coefs[present])
            lower.append(np.full(cols.shape[0], lo))
            upper.append(np.full(cols.shape[0], hi))
        starts = np.concatenate(([0], np.cumsum(np.concatenate(counts))))
        cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype))
        return starts, cat(index, np.int64), cat(value, float), cat(lower, float), cat(upper, float)


def _solve_program(p: _Program, *, relax: bool, time_limit_s: float, threads: int) -> float:
    """The least recomputation cost of program ``p`` (or a lower bound of it: the LP value, or a
    MIP's dual bound when the time runs out); ``math.inf`` if nothing fits."""
    return _run_program(p, relax=relax, time_limit_s=time_limit_s, threads=threads)[0]


def _run_program(p: _Program, *, relax: bool, time_limit_s: float, threads: int,
                 presolve: bool = False) -> tuple[float, bool]:
    """``_solve_program``'s value, and whether the program was solved (not cut short).

    A MIP is solved with HiGHS' presolve, and its value counts only with a solution the
    program's own rows accept (``_checked``): the optimum, or the best solution found when the
    time ran out. One without, and a presolved "no plan fits", are solved again without
    presolve in the time left (or count as nothing when none is left). An LP is solved with
    presolve only if asked (``presolve``): its value is then what its row duals prove
    (``_dual_bound``), and a presolved "no plan fits" is checked the same way as a MIP's."""
    if not p.feasible:
        return math.inf, True
    if p.empty:  # (also when there is nothing to decide)
        return 0.0, True
    started = time.perf_counter()
    if relax:
        value, solved, _ = _highs(p, relax=True, presolve=presolve, time_limit_s=time_limit_s, threads=threads)
        if not presolve or math.isfinite(value):
            return value, solved
        left = time_limit_s - (time.perf_counter() - started)
        if left <= 0.05:
            return 0.0, False
        return _highs(p, relax=True, presolve=False, time_limit_s=left, threads=threads)[:2]
    value, solved, x = _highs(p, relax=False, presolve=True, time_limit_s=time_limit_s, threads=threads)
    if math.isfinite(value) and _checked(p, value, x, optimal=solved):
        return value, solved
    if math.isfinite(value) and x is not None:
        log.warning("bound: HiGHS presolve gave a solution its program does not accept (%d columns); "
                    "solving again without presolve", p.col_cost.size)
    # (no plan fits is a claim the budget search acts on, so it is made without presolve)
    left = time_limit_s - (time.perf_counter() - started)
    if left <= 0.05 and math.isfinite(value):
        return 0.0, False  # no time to confirm: the trivial bound
    return _highs(p, relax=False, presolve=False, time_limit_s=max(left, 0.05), threads=threads)[:2]


#: How far a checked solution may be off its rows (memory rows are in units of the largest
#: value), and its cost off the value HiGHS states (relative; HiGHS stops at a relative gap of
#: 1e-6).
CHECK_TOLERANCE = 1e-6
CHECK_COST_TOLERANCE = 1e-5


def _checked(p: _Program, value: float, x: np.ndarray | None, *, optimal: bool = True) -> bool:
    """Whether ``x``, a MIP solution HiGHS found with dual bound ``value``, is a 0/1 point
    within every row and column bound of ``p`` that costs ``value`` (``optimal``) or at least
    ``value`` (the best one found when the time ran out).

    HiGHS' presolve makes these MIPs 4-5x faster (ResNet50 b32 at its smallest budget,
    thirteen instants: 7 s against 30 s), but it once returned a wrong optimum on such a
    program. A wrong reduction shows as a postsolved point outside the program, which this
    rejects. (A point that is feasible but not optimal would not show: tests compare the
    optimum with presolve and without on random programs for that.)"""
    if x is None or x.size != p.col_cost.size or not math.isfinite(value):
        return False
    if np.abs(x - np.round(x)).max(initial=0.0) > CHECK_TOLERANCE:
        return False
    x = np.round(x)
    if (x < 0).any() or (x > p.col_upper).any():
        return False
    rows = row_activity(p.starts, p.index, p.value, x)
    if (rows < p.row_lower - CHECK_TOLERANCE).any() or (rows > p.row_upper + CHECK_TOLERANCE).any():
        return False
    cost = float(p.col_cost @ x)
    slack = CHECK_COST_TOLERANCE * max(cost, float(p.col_cost.max()))
    return abs(cost - value) <= slack if optimal else cost >= value - slack


def _dual_bound(p: _Program, cost: np.ndarray, duals: np.ndarray) -> float:
    """The least value of ``cost @ x`` over ``p``'s LP (rows within their bounds, ``0 <= x <=
    col_upper``) that the row multipliers ``duals`` prove, by weak duality: for any y (with
    y_i >= 0 where row i has no upper bound and y_i <= 0 where it has no lower one),
    ``cost @ x = (cost - A^T y) @ x + y @ (A x)``, and each term has a least value over the box
    and the rows. Neither HiGHS' presolve nor its tolerances can make this overstate the LP:
    it holds for whatever y is given (both signs are tried, as solvers differ in convention).
    """
    counts = np.diff(p.starts)
    rows = np.repeat(np.arange(p.row_lower.size), counts)
    best = -math.inf
    for y in (duals, -duals):
        y = np.where(np.isinf(p.row_upper), np.maximum(y, 0.0), y)
        y = np.where(np.isinf(p.row_lower), np.minimum(y, 0.0), y)
        reduced = cost - np.bincount(p.index, weights=p.value * y[rows], minlength=cost.size)
        on_rows = np.where(y > 0, y * np.where(np.isinf(p.row_lower), 0.0, p.row_lower),
                           y * np.where(np.isinf(p.row_upper), 0.0, p.row_upper))
        best = max(best, float(on_rows.sum() + (np.minimum(reduced, 0.0) * p.col_upper).sum()))
    return best


def _highs(p: _Program, *, relax: bool, presolve: bool, time_limit_s: float,
           threads: int) -> tuple[float, bool, np.ndarray | None]:
    """Program ``p`` (feasible, not empty) by HiGHS: its value (see ``_solve_program``), whether
    it was solved, and a MIP's best solution (None if it has none, and for an LP)."""
    import highspy

    ncol, nrow = p.col_cost.size, p.row_lower.size
    cost_scale = 1.0 / max(1e-12, float(p.col_cost.max()))
    h = quiet_highs()
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("time_limit", float(max(time_limit_s, 0.05)))
    h.setOptionValue("presolve", "on" if presolve else "off")
    h.setOptionValue("mip_rel_gap", 1e-6)
    # no strong branching: its LPs took most of the time on the bound's MIPs and the dual
    # bound moves only as the tree closes (ResNet50 b32 at its smallest budget, twelve
    # instants: solved in 11-15 s against 19-24 s)
    h.setOptionValue("mip_pscost_minreliable", 0)
    lp = highspy.HighsLp()
    lp.num_col_ = ncol
    lp.num_row_ = nrow
    lp.col_cost_ = p.col_cost * cost_scale
    lp.col_lower_ = np.zeros(ncol)
    lp.col_upper_ = p.col_upper
    lp.row_lower_ = np.where(np.isinf(p.row_lower), -highspy.kHighsInf, p.row_lower)
    lp.row_upper_ = np.where(np.isinf(p.row_upper), highspy.kHighsInf, p.row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = p.starts.astype(np.int32)
    lp.a_matrix_.index_ = p.index.astype(np.int32)
    lp.a_matrix_.value_ = p.value
    lp.a_matrix_.num_col_ = ncol
    lp.a_matrix_.num_row_ = nrow
    if not relax:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * ncol
    h.passModel(lp)
    run_highs(h)
    status = h.getModelStatus()
    S = highspy.HighsModelStatus
    if status == S.kInfeasible:
        return math.inf, True, None
    info = h.getInfo()
    solved = status == S.kOptimal
    if relax:
        if not solved:
            return 0.0, False, None  # no proven value: the trivial bound
        if presolve:  # the value is what the row duals prove, whatever presolve did
            duals = np.asarray(h.getSolution().row_dual, dtype=float)
            if duals.size != nrow:
                return 0.0, False, None
            return max(0.0, _dual_bound(p, lp.col_cost_, duals) / cost_scale), True, None
        # the dual objective is a bound even if the primal is slightly off; never below 0
        return max(0.0, float(info.objective_function_value) / cost_scale), True, None
    bound = float(info.mip_dual_bound)
    found = info.primal_solution_status == int(highspy.SolutionStatus.kSolutionStatusFeasible)
    x = np.asarray(h.getSolution().col_value, dtype=float) if found else None
    return (max(0.0, bound / cost_scale) if math.isfinite(bound) else 0.0), solved, x
