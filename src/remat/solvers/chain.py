"""chain: multi-level checkpointing over the chain of blocks, chosen by a dynamic programme.

The forward pass is cut at its light cuts (``remat.cuts``: block boundaries) into a chain of
segments. A plan of the chain is a recursion in the manner of Griewank's revolve and of the
heterogeneous-chain programme of Beaumont et al. (rotor): to run the backward pass of
segments s..t from the value entering s, either

- *keep* segment s: recompute it holding its values, then do s+1..t, then s's backward; or
- *split* at s' (s < s' <= t): recompute s..s'-1 holding only what crosses the cut before s',
  do s'..t from there, drop that, then do s..s'-1 again from the start; or, where segment
  s'-1's own backward reads what crosses that cut (a chain whose every gradient reads its
  layer's output), keep it held into s..s'-1 until that backward has read it (``_solve``);
  or, in a second programme whose plans are offered beside the first's (``frees_cuts``),
  drop it as soon as s' is computed from it, when s'..t never go back to it (s' kept, or
  alone holding all of its values): revolve frees a checkpoint so;

and a segment alone (a *leaf*) is recomputed while its backward runs, holding what one
option of its menu holds (``ChainModel._leaf_menus``: all of it, part of it, or what the
exact model of the segment's own block holds after each stage). The original forward
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
import copy
import itertools
import logging
import math
import time

import numpy as np

from remat.cuts import Cut, block_cuts
from remat.errors import SolverError
from remat.graph import Graph, Node, NodeKind
from remat.schedule import order_memory
from remat.solvers.base import SolveResult, register
from remat.solvers.baselines import (
    BaselinePlan,
    StageWalk,
    _forward_mask,
    chen_plan,
    considers,
    pick_cheapest,
    remembered,
)

#: At most this many segments: the programme is cubic in their number.
MAX_SEGMENTS = 128
#: Memory resolution of the programme: units of the checkpoint-all peak.
MEMORY_LEVELS = 4096
#: Plans measured around a budget beyond the bisection: the next cheaper ones of the model.
EXTRA_PROBES = 3
#: Most options of a leaf's menu (the segment's backward holding part of its values).
MENU_OPTIONS = 16
#: Budgets at which the exact model solves each distinct segment's leaf for its menu.
EXACT_MENU_LEVELS = 8
#: Largest segment (forward and backward nodes) the exact model solves for a menu.
EXACT_MENU_MAX_NODES = 120
#: Time limit of one exact solve of a segment, and of all of a model's (the segments that
#: repeat most are solved first).
EXACT_MENU_SOLVE_S = 1.5
EXACT_MENU_TOTAL_S = 12.0
#: Budgets within this share above the least peak of the model's plans get the exact options.
REFINE_MARGIN = 0.03

log = logging.getLogger("remat.solve")

# hold kinds: what a recursion holds while it works below it; _MENU: a leaf's menu option
_CROSS, _KEEP, _LEAF, _MENU = 0, 1, 2, 3
# what a split does with its cut while the segments after it run: hold it (and drop it after),
# keep it held below the split for its segment's backward (``held_cuts``), or drop it as soon
# as the next segment is computed from it (``frees_cuts``)
_HOLD, _HOLD_BELOW, _DROP = 0, 1, 2
# a model's menus, numbered: a plan names menu options by position, so its measurement is
# remembered under its menus' number (the exact options depend on how long solves took)
_MENUS = itertools.count()


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
        self._stage_segments = self._walk_stage_segments()
        self._segment_of_stage = np.full(n, -1, dtype=np.int64)
        self._stages_of: list[list[int]] = [[] for _ in range(L + 1)]
        self._stage_rank = np.full(n, -1, dtype=np.int64)  # a stage's position among its segment's
        for t, s in self._stage_segments:
            self._segment_of_stage[t] = s
            self._stage_rank[t] = len(self._stages_of[s])
            self._stages_of[s].append(t)
        members = self.members = [np.flatnonzero((seg_of == s) & recomputable) for s in range(L + 1)]
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
        own_bytes = self._own_bytes(sizes)
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
        self.own = own_bytes // self.unit  # (rounded down: neither a need nor what is freed is undercounted)
        self.held_cuts = frozenset(np.flatnonzero(own_bytes > 0).tolist())
        self._need_bytes, self._sizes, self._profile = need, sizes, profile
        self._keys = [_segment_key(graph, members[s], self._stages_of[s]) for s in range(L)]
        self.exact = False  # whether the menus have the exact options yet (``refine``)
        self.menus_id = next(_MENUS)
        self._offered: dict[int, list[tuple[float, float, np.ndarray]]] = {}  # options measured, per segment
        # per segment: what the other segments' stages recompute while its leaf's options are measured
        self._leaf_others: dict[int, tuple[list[int], list[int]]] = {}
        self._base: dict[int, tuple[float, float]] = {}  # the whole leaf's need and cost, per segment
        self.menus = self._leaf_menus(exact=False)
        self.frees_cuts = False
        self._solve()
        self._solve_restart()
        # the programme without held cuts too: its choices, measured, are sometimes cheaper
        # (the 2-layer GPT-2 at its smallest budget: 1.298x against 1.311x)
        self._dropping: ChainModel | None = None
        self._freeing: ChainModel | None = None
        if self.held_cuts:
            dropping = copy.copy(self)
            dropping.held_cuts = frozenset()
            dropping._solve()
            dropping._solve_restart()
            self._dropping = dropping
        self._freeing = self._cut_freeing()

    def _cut_freeing(self) -> ChainModel:
        """This programme with splits that drop their cut as soon as the next segment is
        computed from it (``frees_cuts``). Its plans are offered beside this one's: on a
        chain of unit layers they cost what revolve's do (32 layers at 4 units: 180 against
        305, and 3 units plan where nothing fitted), but on a transformer layer, whose
        backward reads far more than its cut, its model counts those splits too cheaply and
        chose worse plans near the smallest budgets (GPT-2 48L at 5% above it: 1.621x against
        1.603x; 8 and 12 layers at it: no plan fitted)."""
        freeing = copy.copy(self)
        freeing.frees_cuts = True
        freeing._dropping = freeing._freeing = None
        freeing._solve()
        freeing._solve_restart()
        return freeing

    def refine(self) -> None:
        """Add the exact options to the leaves' menus and solve the programme again (once;
        ``plans_near`` does it for budgets near the least peak of the model's plans)."""
        if self.exact:
            return
        self._plain = copy.copy(self)  # the programme without them (its tables are replaced below, not changed)
        self._plain._dropping = None  # (its plans come once, with this model's)
        self._plain._freeing = None
        self.exact = True
        self.menus_id = next(_MENUS)
        self.menus = self._leaf_menus(exact=True)
        self._solve()
        self._solve_restart()
        self._freeing = self._cut_freeing()  # (with the exact options too)

    # ------------------------------------------------------------------ the memory model
    def _own_bytes(self, sizes: np.ndarray) -> np.ndarray:
        """Per cut k, the bytes of what segment k's backward reads of the forward pass where all
        of it crosses cut k and no later stage reads it (0 elsewhere): held from a split at
        the cut, segment k's backward then computes nothing again and frees it (a chain
        whose every gradient reads its layer's output)."""
        graph, L = self.graph, self.L
        crossing = [set(c.crossing) for c in self.cuts]
        reads: list[set[int]] = [set() for _ in range(L + 1)]  # forward values each segment's stages read
        readers: dict[int, set[int]] = {}  # the segments whose stages read each value
        for t, seg in self.stage_segments():
            for d in graph.nodes[t].deps:
                readers.setdefault(d, set()).add(seg)
                if graph.nodes[d].kind is NodeKind.FORWARD:
                    reads[seg].add(d)
        outputs = set(graph.outputs)
        out = np.zeros(L, dtype=np.int64)
        for k in range(L):
            r = reads[k]
            if r and r <= crossing[k] and all(graph.nodes[v].recomputable and readers[v] == {k} and v not in outputs
                                              for v in r):
                out[k] = int(sizes[list(r)].sum())
        return out

    def _needs(self, sizes: np.ndarray, mem: np.ndarray) -> np.ndarray:
        """Per segment (and the tail, index L): the most memory its backward stages need in the
        checkpoint-all plan (``mem``: its memory at each stage), less the forward values of
        earlier segments live then (those the recursion holds, or not, itself)."""
        graph, L, n = self.graph, self.L, self.graph.n
        last = self._last = np.array([max(graph.users[i], default=i) for i in range(n)], dtype=np.int64)
        live_from = np.zeros((L + 1, n + 1), dtype=np.float64)  # live_from[s, t]: seg-s bytes read at or after t
        chain = np.flatnonzero((self.seg_of >= 0) & (self.seg_of < L))
        np.add.at(live_from, (self.seg_of[chain], last[chain]), sizes[chain])
        live_from = np.cumsum(live_from[:, ::-1], axis=1)[:, ::-1]
        earlier = np.cumsum(live_from, axis=0) - live_from  # earlier[j, t]: segments < j
        self._earlier = earlier
        need = np.zeros(L + 1)
        for t, s in self.stage_segments():
            need[s] = max(need[s], mem[t] - earlier[s, t])
        return need

    # ------------------------------------------------------------------ leaf menus
    def _leaf_menus(self, *, exact: bool) -> list[list[tuple[int, float, np.ndarray]]]:
        """Per segment, the options of its leaf: ``(need in units, extra cost, held)``, the
        whole leaf first (its need, 0, every member), then cheaper-in-memory ones, fewest
        units last. ``held`` is over the segment's members (``self.members[s]``): one row
        (what the leaf holds of what its backward recomputes) or one row per backward stage
        of the segment (what is held after that stage, computed in it if it was not).

        A leaf holds every value of its segment while the segment's backward runs; near the
        smallest budgets that alone overflows (a transformer layer's backward holds its MLP's
        and attention's activations). The options hold less, from two sources:

        - *prefixes*: one row leaving out a growing prefix of the segment's values, the
          cheapest to recompute per byte first (a backward stage reading a value left out
          recomputes it from what is held, and drops it again);
        - *exact*: the exact model (Checkmate's MILP) on the segment's own forward and
          backward nodes at ``EXACT_MENU_LEVELS`` budgets; a solution's rows are what it
          holds after each backward stage. These recompute a value once for several stages,
          drop it once its last reader in the block has run, and keep an expensive value
          while recomputing cheap ones around it, which a single row cannot.

        Each option is measured as a plan (this segment's leaf, every other value kept);
        the menu keeps the options that need less memory than every cheaper one. Segments
        with the same structure (the layers of a deep model) are measured and solved once;
        their needs differ by what the segment's position adds (gradients computed by
        then), so an option's need is the segment's own need plus the option's measured
        difference. The exact options (``exact``) cost seconds: ``refine`` adds them when
        a budget needs them."""
        L, keys, need = self.L, self._keys, self._need_bytes
        first: dict[tuple, int] = {}
        for s in range(L):
            first.setdefault(keys[s], s)
        # exact options for the segments that repeat, the costliest classes first, while the
        # time allows (a solve serves every segment of its class)
        weight: dict[tuple, float] = {}
        count: dict[tuple, int] = {}
        for s in range(L):
            weight[keys[s]] = weight.get(keys[s], 0.0) + float(self.f[s])
            count[keys[s]] = count.get(keys[s], 0) + 1
        deadline = time.perf_counter() + EXACT_MENU_TOTAL_S if exact else -math.inf
        options: dict[tuple, list[tuple[float, float, np.ndarray]]] = {}
        for key in sorted(first, key=lambda k: (-weight[k], first[k])):
            options[key] = self._measure_options(first[key], deadline if count[key] > 1 else -math.inf)
        menus: list[list[tuple[int, float, np.ndarray]]] = []
        for s in range(L):
            menu = [(int(self.need[s]), 0.0, np.ones(self.members[s].size, dtype=bool))]
            for delta, extra, held in options[keys[s]]:
                units = int(math.ceil((need[s] + delta) / self.unit))
                if units < menu[-1][0]:  # (options a unit apart in bytes may share one)
                    menu.append((units, extra, held))
            menus.append(menu)
        return menus

    def _measure_options(self, s: int, deadline: float) -> list[tuple[float, float, np.ndarray]]:
        """The options of segment ``s``'s leaf beyond the whole one: ``(need difference in
        bytes, extra cost, held)``, Pareto-efficient, fewest bytes last (exact solves only
        until ``deadline``)."""
        sizes, _kept, _temp, costs = self.graph.node_arrays
        members = self.members[s]
        if members.size < 2 or MENU_OPTIONS < 1:
            return []
        if s not in self._offered:  # the prefixes, measured once
            self._offered[s] = []
            valued = np.flatnonzero(sizes[members] > 0)
            order = valued[np.lexsort((valued, costs[members[valued]] / sizes[members[valued]]))]
            for k in np.unique(np.linspace(1, order.size, min(order.size, 2 * MENU_OPTIONS)).round().astype(int)):
                held = np.ones(members.size, dtype=bool)
                held[order[:k]] = False
                self._offer(s, held)
        for rows in self._exact_rows(s, deadline):
            self._offer(s, rows)
        out = self._offered[s]
        # cheaper options that need as little are better: keep the front only
        front: list[tuple[float, float, np.ndarray]] = []
        for option in sorted(out, key=lambda o: (o[1], o[0])):
            if not front or option[0] < front[-1][0]:
                front.append(option)
        if len(front) > MENU_OPTIONS:  # spread over the front, its least need kept
            keep = np.unique(np.linspace(0, len(front) - 1, MENU_OPTIONS).round().astype(int))
            front = [front[k] for k in keep]
        return front

    def _offer(self, s: int, held: np.ndarray) -> None:
        """Measure ``held`` as an option of segment ``s``'s leaf; keep it if it needs less than
        the whole leaf."""
        if s not in self._base:
            self._base[s] = self._measure_leaf(s, np.ones(self.members[s].size, dtype=bool))
        base_need, base_cost = self._base[s]
        need, cost = self._measure_leaf(s, held)
        if need < base_need - 0.5 * self.unit:
            self._offered[s].append((need - base_need, cost - base_cost, held))

    def _exact_rows(self, s: int, deadline: float) -> list[np.ndarray]:
        """The exact model's holds for segment ``s``'s leaf (one row per backward stage of the
        segment) at ``EXACT_MENU_LEVELS`` budgets between the least any plan of the block
        needs and what it needs holding everything; none if the block has more than
        ``EXACT_MENU_MAX_NODES`` nodes or the time is out."""
        from remat.solvers.milp import exact_schedule  # (milp imports the baselines, which load this module)
        from remat.solvers.milp_model import peak_lower_bound_bytes

        if time.perf_counter() >= deadline or EXACT_MENU_LEVELS < 1:
            return []
        block = self._leaf_graph(s)
        if block is None:
            return []
        m, stages = self.members[s].size, len(self._stages_of[s])
        lead = block.n - m - stages  # the values read from outside come first
        low = peak_lower_bound_bytes(block)
        high = int(order_memory(block, np.arange(block.n)).max())
        out: list[np.ndarray] = []
        # from the most room down, until a budget has no plan (or none found in time)
        for budget in np.linspace(high, low, EXACT_MENU_LEVELS + 1)[1:].astype(np.int64).tolist():
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                schedule = exact_schedule(block, int(budget), time_limit_s=min(EXACT_MENU_SOLVE_S, left))
            except SolverError as exc:  # a block's solve is an extra: the menu goes without it
                log.info("chain: the exact model of %s at %d B failed (%s); its menu keeps the prefixes",
                         block.name, budget, exc)
                break
            if schedule is None:
                break
            live = np.asarray(schedule.S)
            rows = np.zeros((stages, m), dtype=bool)
            rows[:-1] = live[lead + m + 1:lead + m + stages, lead:lead + m]  # held after stage k: live entering k + 1
            out.append(rows)
        return out

    def _leaf_graph(self, s: int) -> Graph | None:
        """Segment ``s``'s block: the values it reads from outside first (not recomputable, at no
        cost: live when the block starts, freed after their last reader in it unless read after
        it), then its members (forward) and backward stages, in order; what a later stage reads
        is an output. None if the block has more than ``EXACT_MENU_MAX_NODES`` nodes. (Counted as
        fixed bytes instead, the incoming gradients and the layer's input stayed for the whole
        block: a transformer layer's least-memory options needed 8-10 MB more than its plans.)"""
        graph = self.graph
        own = self.members[s].tolist() + list(self._stages_of[s])
        if len(own) > EXACT_MENU_MAX_NODES or not self._stages_of[s]:
            return None
        inside = set(own)
        outside = sorted({d for v in own for d in graph.nodes[v].deps if d not in inside})
        ids = outside + own
        index = {v: k for k, v in enumerate(ids)}
        lead, m, first = len(outside), self.members[s].size, min(own)
        nodes, outputs = [], []
        for k, v in enumerate(ids):
            node = graph.nodes[v]
            # read by a node outside the block once it has begun (between its stages, or after
            # it): held to its end, as the block cannot see when
            read_later = v in graph.outputs or any(u not in inside and u > first for u in graph.users[v])
            if k < lead:
                nodes.append(Node(node.name, NodeKind.FORWARD, (), node.out_bytes, 0.0, False, 0, 0))
            else:
                nodes.append(Node(node.name, NodeKind.FORWARD if k < lead + m else NodeKind.BACKWARD,
                                  tuple(index[d] for d in node.deps), node.out_bytes, node.cost, node.recomputable,
                                  node.temp_bytes, node.kept_bytes))
            if read_later and (k < lead or k >= lead + m):
                outputs.append(k)
        if not any(k >= lead + m for k in outputs):
            outputs.append(len(ids) - 1)
        return Graph(tuple(nodes), 0, tuple(outputs), f"{graph.name} segment {s}")

    def _measure_leaf(self, s: int, held: np.ndarray) -> tuple[float, float]:
        """Need (bytes, as ``_needs`` counts it) and cost of the plan that keeps every value
        but segment ``s``'s, whose backward recomputes them holding ``held`` (an option's)."""
        masks = [np.zeros(self.graph.n, dtype=bool)] * (self.L + 1)
        rows: list = [None] * (self.L + 1)
        always = ~self.leaf_mask[s] | self.always
        if s not in self._leaf_others:  # the other segments' stages hold ``always`` alone: one walk for every option
            others = StageWalk(self.graph)
            self._walk_stages(others, always, masks, rows, segment=s, inside=False)
            self._leaf_others[s] = others.recomputations()
        if held.ndim == 1:
            masks[s] = self._held_mask(s, held)
        else:
            rows[s] = held
        walk = StageWalk(self.graph)
        walk.record(*self._leaf_others[s])
        self._walk_stages(walk, always, masks, rows, segment=s, inside=True)
        plan = walk.measure("leaf option")
        mem = order_memory(self.graph, np.asarray(plan.nodes, dtype=np.int64))
        stages = np.asarray(plan.stages, dtype=np.int64)
        mine = self._segment_of_stage[stages] == s
        if not mine.any():
            return 0.0, float(plan.cost)
        return float((mem[mine] - self._earlier[s, stages[mine]]).max()), float(plan.cost)

    def _held_mask(self, s: int, held: np.ndarray) -> np.ndarray:
        """Segment ``s``'s members that a one-row ``held`` marks, as a mask over the nodes."""
        out = np.zeros(self.graph.n, dtype=bool)
        out[self.members[s][held]] = True
        return out

    def _walk(self, always: np.ndarray, masks: list[np.ndarray], rows: list, label: str) -> BaselinePlan:
        """Run the backward pass as a stage schedule and measure it. ``always`` stays held;
        entering segment s's stages, what is held for it (``masks[s]``) stays of what was
        held; a stage recomputes what it reads and lacks, and holds what of that is in
        ``masks[s]``. Where s is a leaf whose option holds by stage (``rows[s]``), the
        segment's members held after each stage are its row, computed in it if they were
        not held."""
        walk = StageWalk(self.graph)
        self._walk_stages(walk, always, masks, rows)
        return walk.measure(label)

    def _walk_stages(self, walk: StageWalk, always: np.ndarray, masks: list[np.ndarray], rows: list, *,
                     segment: int | None = None, inside: bool = True) -> None:
        """``_walk``'s stages recorded in ``walk``; with ``segment``, only its stages
        (``inside``) or only the others'. (What a segment's stages hold comes from what was
        held entering it, which is ``always`` again wherever the segment before holds nothing
        for it beyond it, as the other segments do while a leaf's option is measured.)"""
        kept = always.copy()
        current = None
        for t, seg in self.stage_segments():
            if seg != current:  # the recursion leaves what it held for the segment before
                kept = always | (kept & masks[seg])
                current = seg
            if segment is not None and (seg == segment) != inside:
                continue
            if rows[seg] is None:
                done = np.asarray(walk.recompute_for(t, kept), dtype=np.int64)
                kept[done[masks[seg][done]]] = True
                continue
            mine = self.members[seg]
            want = mine[rows[seg][self._stage_rank[t]]]
            done = np.asarray(walk.recompute_for(t, kept, also=want[~kept[want]].tolist()), dtype=np.int64)
            kept[done[masks[seg][done]]] = True
            kept[mine] = kept[mine] & masks[seg][mine]  # (a held cut's values it reads stay)
            kept[want] = True

    def stage_segments(self) -> list[tuple[int, int]]:
        """(stage, segment) of every loss and backward stage: the segment a stage works in is
        the latest one it reads a forward value of (the previous stage's when it reads none)."""
        return self._stage_segments

    def _walk_stage_segments(self) -> list[tuple[int, int]]:
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
        (``base``). Choices are recovered when a plan is asked for (``_plan``).

        At a cut whose segment's backward reads only what crosses it (``held_cuts``), a split
        may instead keep what crosses it held below it: segment s'-1's backward then runs at
        once, computing nothing, and frees what it read; then s..s'-2 as ``opt`` (``_held``).
        (On Checkmate's chains, where every gradient reads its layer's output, dropping it
        cost a recomputation at every level: 32 layers at 20% of checkpoint-all, 121 units
        where keeping it costs 115, revolve's plan 111.)

        With ``frees_cuts``, a split may also drop its cut as soon as s' is computed from it,
        when s'..t run once from there (s' kept, or alone holding all of its values: ``once``)."""
        L = self.L
        base = int(min([self.need.min(), *(o[0] for menu in self.menus for o in menu)]))
        M = max(self.levels - base, 1)
        self.base = base
        need = self.need - base
        prefix = np.concatenate(([0.0], np.cumsum(self.f)))
        self.prefix = prefix
        inf = np.float32(np.inf)
        fits = [np.arange(M) >= need[s] for s in range(L + 1)]
        # rows[s][t - s] is opt[s, t]: from the last segment back, each s for every t at once
        # (a split at s' adds opt[s', t] for all t >= s' in one step; opt[s, s' - 1] is final by
        # then, its own splits being before s'), the same sums and minima as one (s, t) at a time
        self.M = M
        rows: list[np.ndarray] = [np.empty((0, M), dtype=np.float32)] * L
        once: list[np.ndarray] = [np.empty((0, M), dtype=np.float32)] * L
        for s in range(L - 1, -1, -1):
            here = np.full((L - s, M), inf, dtype=np.float32)
            whole = here[0, max(self.menus[s][0][0] - base, 0):]  # (the menu's first option holds it all)
            np.minimum(whole, np.float32(max(self.f[s], 0.0)), out=whole)
            if s + 1 < L:
                _add_shifted(here[1:], rows[s + 1], self.a[s], self.f[s])  # keep s
                here[1:, ~fits[s]] = inf
            if self.frees_cuts:
                once[s] = here.copy()  # s..t run once from the value entering s: kept, or whole alone
            for need_o, extra, _held in self.menus[s][1:]:  # s alone: a leaf, holding part of it
                leaf = here[0, max(need_o - base, 0):]
                np.minimum(leaf, np.float32(max(self.f[s] + extra, 0.0)), out=leaf)
            for sp in range(s + 1, L):  # split at sp
                k = sp - 1
                left = self._left(s, k, here[k - s], here[k - 1 - s] if k > s else None)
                _add_shifted(here[sp - s:], rows[sp], self.c[k], prefix[sp] - prefix[s], left)
                if self.frees_cuts:  # or drop the cut once sp is computed from it
                    _add_shifted(here[sp - s:], once[sp], 0, prefix[sp] - prefix[s], here[k - s])
            rows[s] = here
        self.opt = {(s, t): rows[s][t - s] for s in range(L) for t in range(s, L)}
        self.once = {(s, t): once[s][t - s] for s in range(L) for t in range(s, L)} if self.frees_cuts else {}
        self.fits = fits
        self.top = self._spine(np.where(fits[L], np.float32(0), inf).astype(np.float32), paid=False)
        self.front_levels = self._front(self.top[0])

    def _spine(self, tail: np.ndarray, *, paid: bool) -> list[np.ndarray]:
        """``out[s][m]``: the least recomputation of segments s.. and then the tail (whose own
        is ``tail[m]``) with m units free, keeping segment s or splitting after it as ``opt``
        does; ``paid``: whether running segments forward counts (not in the original forward
        pass, which runs anyway)."""
        L, M = self.L, tail.size
        out: list[np.ndarray] = [np.empty(0)] * L + [tail]
        onces: list[np.ndarray] = [np.empty(0)] * L + [tail]  # s.. once from the value entering s
        for s in range(L - 1, -1, -1):
            best = np.full(M, np.float32(np.inf), dtype=np.float32)
            _add_shifted(best, out[s + 1], self.a[s], self.f[s] if paid else 0.0)
            best[~self.fits[s]] = np.inf
            onces[s] = best.copy() if self.frees_cuts else best
            for sp in range(s + 1, L + 1):
                k = sp - 1
                left = self._left(s, k, self.opt[s, k], self.opt[s, k - 1] if k > s else None, forced=not paid)
                forward = self.prefix[sp] - self.prefix[s] if paid else 0.0
                _add_shifted(best, out[sp], self.c[k], forward, left)
                if self.frees_cuts:  # the cut dropped once sp is computed from it
                    _add_shifted(best, onces[sp], 0, forward, self.opt[s, k])
            out[s] = best
        return out

    def _left(self, s: int, k: int, dropped: np.ndarray, below: np.ndarray | None, *,
              forced: bool = False) -> np.ndarray:
        """What segments s..k cost below a split at cut ``k``, for every m: dropping what
        crosses it (``dropped``: ``opt[s, k]``) or, at a held cut, the cheaper of that and
        keeping it (``forced``: only keeping it; the original forward pass's cuts stay held
        to their last reader), its units not free: k's backward at once, then s..k-1 (whose
        ``opt`` is ``below``) with what it read freed."""
        if k not in self.held_cuts:
            return dropped
        out = np.full_like(dropped, np.inf) if forced else dropped.copy()
        start = self._held_need(k) + int(self.c[k])
        if start >= out.size:
            return out
        if below is None:
            out[start:] = np.minimum(out[start:], 0.0)
        else:
            m = np.arange(start, out.size)
            np.minimum(out[start:], below[self._freed(m - self.c[k], k)], out=out[start:])
        return out

    def _held(self, s: int, k: int, m: int) -> float:
        """``_left``'s cost of keeping cut k held below a split there, s..k with m units free
        beside it."""
        if m < self._held_need(k):
            return math.inf
        return 0.0 if k == s else float(self.opt[s, k - 1][self._freed(m, k)])

    def _held_need(self, k: int) -> int:
        """The units segment k's backward needs beside its held cut's values (the programme's
        levels, from ``base``)."""
        return max(int(self.need[k] - self.own[k] - self.base), 0)

    def _freed(self, m, k: int):
        """The units free for the segments before k once k's backward has freed its held cut's
        values, with ``m`` free beside them (a number or an array of them)."""
        return np.minimum(m + self.own[k], self.M - 1)

    def _front(self, cost: np.ndarray) -> list[int]:
        """The model's budgets (levels) where ``cost`` gets cheaper: the front the bisection walks."""
        cost = cost.astype(np.float64)
        finite = np.flatnonzero(np.isfinite(cost))
        if not finite.size:
            return []
        steps = finite[np.concatenate(([True], cost[finite][1:] < cost[finite][:-1] - 1e-9 * max(1.0, cost[finite[0]])))]
        return (steps + self.base).tolist()

    # ------------------------------------------------------------------ restart
    def _solve_restart(self) -> None:
        """The programme's plans whose forward pass keeps nothing but what the loss reads.

        Near the smallest budgets the loss gradient's stages fill the budget (a language
        model's logits, their log-softmax and its gradient), so no value of the chain may
        stay across them, not even the value entering the tail. Such a plan runs the
        loss's own stages first (part 1), then, from the first stage that reads a dropped
        forward value (part 2, the head's weight gradient), the whole recursion from the
        step's input: the chain from segment 0 with the tail as its last segment, whose
        values are recomputed once and held while its backward runs. ``restart[m]`` is its
        least recomputation with m units free (part 1 needing its own memory alone);
        ``restart_levels`` the front the bisection walks (empty when there is no chain)."""
        graph, L, n = self.graph, self.L, self.graph.n
        sizes, mem, tail = self._sizes, self._profile, self.members[L]
        self.restart_levels: list[int] = []
        forward = _forward_mask(graph)
        loss_reads = np.zeros(n, dtype=bool)
        for i in graph.ids_of_kind(NodeKind.LOSS):
            loss_reads[list(graph.nodes[i].deps)] = True
        droppable = forward & ~loss_reads & ~self.always
        droppable[tail] = forward[tail] & ~loss_reads[tail]
        droppable[list(graph.outputs)] = False
        self.tail_dropped = droppable & (self.seg_of == L)
        part2 = next((t for t, _seg in self.stage_segments() if droppable[list(graph.nodes[t].deps)].any()), None)
        if L == 0 or part2 is None:
            return
        live_dropped = np.zeros(n + 1)
        ids = np.flatnonzero(droppable)
        np.add.at(live_dropped, self._last[ids], sizes[ids])
        live_dropped = np.cumsum(live_dropped[::-1])[::-1]  # dropped bytes read at or after t
        first_stage = min(t for t, _seg in self.stage_segments())
        need1 = max((mem[t] - live_dropped[t] for t in range(first_stage, part2)), default=0.0)
        need2 = max((mem[t] - self._earlier[L, t] for t, seg in self.stage_segments() if seg == L and t >= part2),
                    default=0.0)
        self.part2 = part2
        base, M = self.base, self.levels - self.base
        units1 = int(math.ceil(need1 / self.unit)) - base
        units2 = int(math.ceil(need2 / self.unit)) - base
        inf = np.float32(np.inf)
        tail_cost = np.float32(graph.node_arrays[3][self.tail_dropped].sum())
        # ext[s]: segments s..L from the value entering s, the tail last
        self.ext = self._spine(np.where(np.arange(M) >= units2, tail_cost, inf).astype(np.float32), paid=True)
        self.restart = self.ext[0].copy()
        self.restart[:max(units1, 0)] = inf
        self.restart_levels = self._front(self.restart)

    def _restart_plan(self, level: int) -> tuple:
        """The restarted recursion for ``level`` units: what is held while each segment's
        backward runs, the tail's included (its last entry)."""
        return self._spine_plan(level, restart=True)

    def _pick(self, s: int, t: int, m: int) -> tuple[int, int]:
        """The choice ``_solve`` made at (s, t, m) of ``opt``: ``(-1, _HOLD)`` to keep segment s,
        else the split s' and what becomes of the cut before it (``_HOLD``, ``_HOLD_BELOW``,
        ``_DROP``). Recomputed at this one level."""
        return self._choose(s, t, m, lambda a: self.opt[a, t], paid=True)

    def _choose(self, s: int, last: int, m: int, table, *, paid: bool) -> tuple[int, int]:
        """The choice at (s, m) of a programme over segments s..last whose subproblem a..last
        is ``table(a)`` (``paid`` as in ``_spine``; ``last`` is ``L`` for a spine, whose last
        subproblem is the tail): ``(-1, _HOLD)`` to keep segment s, else the split s' and what
        becomes of its cut: held while s'.. run (``_HOLD``), held below the split too (as
        ``_left`` chooses, ``_HOLD_BELOW``), or, with ``frees_cuts``, dropped once s' is
        computed from it (``_DROP``: s' kept, or alone holding all of it, or the tail)."""

        def rest(a: int, k: int) -> float:  # the subproblem a..last with k more units held
            return float(table(a)[m - k]) if m - k >= 0 else math.inf

        def once(sp: int) -> float:  # sp..last run once from the value entering sp
            if last < self.L:
                return float(self.once[sp, last][m])
            if sp == last:
                return rest(sp, 0)
            return rest(sp + 1, self.a[sp]) + (float(self.f[sp]) if paid else 0.0) if self.fits[sp][m] else math.inf

        best, pick = math.inf, (-1, _HOLD)
        if self.fits[s][m] and s < last:
            best = rest(s + 1, self.a[s]) + (float(self.f[s]) if paid else 0.0)
        for sp in range(s + 1, last + 1):
            k = sp - 1
            kept = k in self.held_cuts
            dropped = float(self.opt[s, k][m])
            options = []
            if paid or not kept:
                options.append((rest(sp, self.c[k]) + dropped, _HOLD))
            if kept:
                below = self._held(s, k, m - int(self.c[k])) if m >= self.c[k] else math.inf
                options.append((rest(sp, self.c[k]) + below, _HOLD_BELOW))
            if self.frees_cuts:
                options.append((once(sp) + dropped, _DROP))
            for here, mode in options:
                if paid:
                    here += self.prefix[sp] - self.prefix[s]
                if here < best:
                    best, pick = here, (sp, mode)
        return pick

    def _plan(self, level: int) -> tuple:
        """The recursion the programme chose for ``level`` units: what the forward pass keeps
        and what is held while each segment's backward runs."""
        return self._spine_plan(level, restart=False)

    def _spine_plan(self, level: int, *, restart: bool) -> tuple:
        """The recursion chosen for ``level`` units along its spine, segments 0.. from the step's
        input (the choices of ``top``, or with ``restart`` of ``ext``, the tail its last
        subproblem), then below it (``_unwind``): (what the original forward pass keeps, what
        is held while each segment's backward runs). The original pass's holds are kept by the
        plan from the start; the restarted spine's are held for the segments below them, and
        for the tail (the last entry of the second)."""
        L = self.L
        table = self.ext if restart else self.top
        kept: list[tuple[int, int]] = []
        held: list[tuple] = [()] * (L + 1 if restart else L)
        stack: list[tuple] = []
        s, m, path = 0, level - self.base, ()
        while s < L:
            sp, mode = self._choose(s, L, m, table.__getitem__, paid=restart)
            if mode == _DROP:  # s..sp-1 later; sp kept now (or the tail), from the cut, dropped
                stack.append((s, sp - 1, m, path, False))
                s = sp
                if s == L:
                    break
            keep = sp < 0 or mode == _DROP
            if not keep:
                keep_cut = mode == _HOLD_BELOW
                stack.append((s, sp - 1, m - self.c[sp - 1] if keep_cut else m, path, keep_cut))
            hold = (_KEEP, s) if keep else (_CROSS, sp - 1)
            if restart:
                path = path + (hold,)
                if keep:
                    held[s] = path
            else:
                kept.append(hold)
            if keep:
                m -= self.a[s]
                s += 1
            else:
                m -= self.c[sp - 1]
                s = sp
        if restart:
            held[L] = path
        self._unwind(stack, held)
        return tuple(kept), tuple(held)

    def _unwind(self, stack: list[tuple], held: list[tuple]) -> None:
        """Fill ``held`` with what the recursions on ``stack`` (segments s..t, m units free,
        the holds above them, whether cut t is held for t's backward) hold for each segment's
        backward."""
        while stack:
            s, t, m, path, held_t = stack.pop()
            if held_t:  # t's backward at once, reading what crosses cut t (held), then s..t-1
                held[t] = path + ((_CROSS, t), (_LEAF, t))
                if s < t:
                    stack.append((s, t - 1, int(self._freed(m, t)), path, False))
                continue
            if s == t:
                held[s] = path + (self._leaf_option(s, m),)
                continue
            sp, mode = self._pick(s, t, m)
            if mode == _DROP:  # s..sp-1 later; sp now, from the cut, which is dropped
                stack.append((s, sp - 1, m, path, False))
                if sp == t:
                    held[sp] = path + ((_LEAF, sp),)
                    continue
                s = sp
            if sp < 0 or mode == _DROP:
                here = path + ((_KEEP, s),)
                held[s] = here
                stack.append((s + 1, t, m - self.a[s], here, False))
            else:
                keep_cut = mode == _HOLD_BELOW
                stack.append((sp, t, m - self.c[sp - 1], path + ((_CROSS, sp - 1),), False))
                stack.append((s, sp - 1, m - self.c[sp - 1] if keep_cut else m, path, keep_cut))

    def _leaf_option(self, s: int, m: int) -> tuple:
        """The hold of segment s's leaf with m units free: its cheapest option that fits."""
        fitting = [(max(self.f[s] + extra, 0.0), o) for o, (need_o, extra, _held) in enumerate(self.menus[s])
                   if need_o - self.base <= m]
        o = min(fitting)[1] if fitting else 0
        return (_LEAF, s) if o == 0 else (_MENU, (s, o))

    # ------------------------------------------------------------------ plans
    def _mask(self, holds) -> np.ndarray:
        """What ``holds`` hold, as a mask over the nodes (a leaf option holding by stage: none
        of its own; ``_rows`` gives them)."""
        out = np.zeros(self.graph.n, dtype=bool)
        for kind, k in holds:
            if kind == _MENU:
                held = self.menus[k[0]][k[1]][2]
                if held.ndim == 1:
                    out |= self._held_mask(k[0], held)
            else:
                out |= (self.cross_mask, self.keep_mask, self.leaf_mask)[kind][k]
        return out

    def _rows(self, holds):
        """The rows of the leaf option holding by stage at the end of ``holds``, if any."""
        if holds and holds[-1][0] == _MENU:
            held = self.menus[holds[-1][1][0]][holds[-1][1][1]][2]
            if held.ndim == 2:
                return held
        return None

    def measure(self, index: int) -> BaselinePlan:
        """The plan of the ``index``-th budget of the front, run as a stage schedule and
        measured (remembered per graph)."""
        level = self.front_levels[index]
        plan = self._plan(level)
        return remembered(self.graph, ("chain plan", self.menus_id, plan),
                          lambda: self._execute(plan, f"chain, {level * self.unit} B in its model"))

    def measure_restart(self, index: int) -> BaselinePlan:
        """The restarted plan of the ``index``-th budget of its front, measured (remembered)."""
        level = self.restart_levels[index]
        plan = self._restart_plan(level)
        return remembered(self.graph, ("chain restart plan", self.menus_id, plan),
                          lambda: self._execute(plan, f"chain restarted after the loss, {level * self.unit} B in its model",
                                                restart=True))

    def _execute(self, plan: tuple, label: str, *, restart: bool = False) -> BaselinePlan:
        graph = self.graph
        kept_forward, held = plan
        always = self.always | self._mask(kept_forward)
        masks = [self._mask(h) for h in held]
        if restart:  # the tail's values are dropped after the forward pass and held once recomputed
            always &= ~self.tail_dropped
            masks[self.L] |= self.tail_dropped
        else:
            masks.append(np.zeros(graph.n, dtype=bool))
        rows = [self._rows(h) for h in held] + [None] * (self.L + 1 - len(held))
        return self._walk(always, masks, rows, label)

    def plans_near(self, budget_bytes: int) -> list[BaselinePlan]:
        """Measured plans around ``budget_bytes``: a bisection over the model's plans (cheaper
        ones need more memory) for the cheapest whose measured peak fits, then a few cheaper
        ones, whose measured peaks need not grow with the model's. Within ``REFINE_MARGIN``
        of the least peak of the model's plans, the menus get their exact options
        (``refine``) and the refined model's plans around the budget are added; once
        refined, both models' plans are (the refined programme's choices, measured, are not
        always cheaper: GPT-2 48L at 370 MB 1.747x against 1.766x, at 400 MB 1.578x against
        1.569x)."""
        plans = self._near(budget_bytes)
        if self.exact:
            return plans + self._plain._near(budget_bytes)
        least = min((p.peak_bytes for p in plans), default=None)
        if least is not None and budget_bytes <= (1 + REFINE_MARGIN) * least:
            self.refine()
            plans += self._near(budget_bytes)
        return plans

    def _near(self, budget_bytes: int) -> list[BaselinePlan]:
        """``plans_near``'s bisections of both fronts (and of the programme without held cuts,
        where there are any)."""
        plans = (_bisect_front(self.front_levels, self.measure, budget_bytes)
                 + _bisect_front(self.restart_levels, self.measure_restart, budget_bytes))
        return plans + [plan for other in (self._dropping, self._freeing) if other is not None
                        for plan in other._near(budget_bytes)]


def _bisect_front(levels: list[int], measure, budget_bytes: int) -> list[BaselinePlan]:
    """``ChainModel.plans_near`` over one front of the model (``measure(i)``: its i-th plan)."""
    if not levels:
        return []
    lo, hi = 0, len(levels) - 1
    measured: dict[int, BaselinePlan] = {}

    def peak(i: int) -> int:
        if i not in measured:
            measured[i] = measure(i)
        return measured[i].peak_bytes

    if peak(lo) <= budget_bytes:
        while lo < hi:  # invariant: front[lo] fits
            mid = (lo + hi + 1) // 2
            if peak(mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
    for i in range(lo + 1, min(lo + 1 + EXTRA_PROBES, len(levels))):
        peak(i)
    return list(measured.values())


def _add_shifted(best: np.ndarray, arr: np.ndarray, k: int, const: float, plus: np.ndarray | None = None) -> None:
    """``best[..., m] = min(best[..., m], arr[..., m - k] + const (+ plus[m]))`` for every
    m >= k, in place (one row, or rows alike)."""
    k = max(int(k), 0)
    size = best.shape[-1]
    if k >= size:
        return
    out = np.add(arr[..., :size - k], np.float32(const))
    if plus is not None:
        np.add(out, plus[k:], out=out)
    np.minimum(best[..., k:], out, out=best[..., k:])


def _segment_key(graph: Graph, members: np.ndarray, stages: list[int]) -> tuple:
    """What makes two segments' leaf menus the same: their members' and backward stages'
    operations (names without their numbers), kinds and sizes, their dependencies inside the
    segment by position (members, then stages) and outside it by size, and how many later
    nodes read each. Costs are left out (profiled costs differ a little between identical
    layers; the simulator measures the plan in the end)."""
    if not members.size:
        return ()
    ids = members.tolist() + list(stages)
    inside = {int(i): k for k, i in enumerate(ids)}
    key = []
    for i in ids:
        node = graph.nodes[i]
        deps = tuple(inside[d] if d in inside else -graph.nodes[d].out_bytes - 1 for d in node.deps)
        key.append((node.name.rstrip("0123456789_"), node.kind.value, node.out_bytes, node.temp_bytes,
                    deps, len(graph.users[i])))
    return (members.size, tuple(key))


def _chain_cuts(graph: Graph) -> tuple[Cut, ...]:
    """The block boundaries of the forward pass (``block_cuts``), the lightest ``MAX_SEGMENTS``
    of them when there are more, in order."""
    cuts = block_cuts(graph, at_most=MAX_SEGMENTS)
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
    """The model's plans around ``budget_bytes``, and the recursion that keeps every segment
    whole: checkpoint-all. The programme counts a held cut's crossing values in full at every
    level that holds it, so where values cross many cuts (a U-Net's skip connections cross
    every cut up to their reader) it counts that plan far above its peak and never offers it:
    U-Net of depth 8 at checkpoint-all's peak got 1.5x, depth 80 9.6x. (Counting only what a
    level adds undercounts instead: nor does the programme count the forward values a
    recomputation holds while it runs, and GPT-2 48L's plans then measured up to 21 MB above
    their level near its smallest budget, where the count in full measures within 1 MB.)"""
    everything = chen_plan(graph, graph.ids_of_kind(NodeKind.FORWARD), "checkpoint-all")
    return [*chain_model(graph).plans_near(budget_bytes), everything]
