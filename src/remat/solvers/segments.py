"""segments: keep only what crosses some of the forward pass's light cuts (``remat.cuts``:
block boundaries found from the graph; every cut of a uniform chain, where none stands out) and
recompute the segments between them once in the backward pass. This is what
``torch.utils.checkpoint`` on every block (or every k-th block, or every other block) of a
network does, found from the graph instead of from the model's code.

For each tier of cuts (``cut_tiers``), it tries every k-th cut at every offset (k up to
``MAX_STRIDE``) with every segment recomputed, Chen's greedy rule over the tier, and every cut
with only some segments recomputed (those that free the most bytes per unit of compute
first); it measures each plan in the simulator and returns the cheapest that fits.

>>> from remat.builders import chain_graph
>>> from remat.solvers import solve
>>> r = solve(chain_graph(9, bytes_per_node=1), 100, method="segments")
>>> r.cost, r.status.value
(19.0, 'feasible')
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterable

import numpy as np

from remat.cuts import Cut, block_cuts, cut_tiers
from remat.graph import Graph, NodeKind
from remat.solvers.base import SolveResult, register
from remat.solvers.baselines import (
    StageWalk,
    chen_plan,
    considers,
    greedy_checkpoints,
    pick_cheapest,
    remembered,
)

#: On a pass without light cuts (a uniform chain), ``segments`` and ``nested`` use every cut of
#: it, every k-th when there are more than this many (``remat.cuts.block_cuts``).
UNIFORM_MAX_CUTS = 64
#: Strides tried: every k-th cut of a tier for k = 1..MAX_STRIDE, at every offset.
MAX_STRIDE = 8
#: Thresholds of Chen's greedy rule tried per tier.
GREEDY_POINTS = 24
#: How many counts of recomputed segments are tried per tier (spread from 1 to all but one).
SUBSET_POINTS = 32


def nested_plan(graph: Graph, cuts: tuple[Cut, ...], levels: tuple[tuple[int, ...], ...], label: str):
    """Nested checkpointing over ``cuts`` (light cuts of the forward pass, in order): ``levels``
    are indices into ``cuts``, coarsest first, each a subset of the next. What crosses the
    first level's cuts is kept from the forward pass (with the values after the last cut,
    which the backward pass needs at once). When the backward pass enters a block of level l
    (between two of its cuts), what crosses the cuts of level l+1 inside the block is
    recomputed (from level l's) when first needed and held while the backward pass stays in
    the block; the values of the innermost blocks are recomputed and reused until it leaves
    them. A forward value is computed at most once per level beyond the first, and memory
    holds one block per level: plans far below the one-level plans' peaks. Remembered per
    graph.

    >>> from remat.builders import chain_graph
    >>> from remat.cuts import Cut
    >>> g = chain_graph(8, bytes_per_node=1)
    >>> cuts = tuple(Cut(i, (i,), 1) for i in range(7))
    >>> p = nested_plan(g, cuts, ((3,), (1, 3, 5)), "two levels")
    >>> p.peak_bytes < 12, p.cost > g.total_cost
    (True, True)
    """
    key = ("nested", tuple(c.node for c in cuts), levels)
    return dataclasses.replace(remembered(graph, key, lambda: _nested(graph, cuts, levels, label)), label=label)


def _nested(graph: Graph, cuts: tuple[Cut, ...], levels: tuple[tuple[int, ...], ...], label: str):
    forward = graph.ids_of_kind(NodeKind.FORWARD)
    pos = {i: p for p, i in enumerate(forward)}
    cut_pos = [pos[c.node] for c in cuts]
    segment = {i: bisect.bisect_left(cut_pos, pos[i]) for i in forward}  # cut k ends segment k
    last = len(cuts)
    always = np.zeros(graph.n, dtype=bool)
    always[list(graph.outputs)] = True
    for i, node in enumerate(graph.nodes):
        always[i] |= node.kind is not NodeKind.FORWARD or not node.recomputable or segment.get(i) == last
    for k in levels[0] if levels else ():
        always[list(cuts[k].crossing)] = True
    level_cuts = [sorted(level) for level in levels]
    inner = len(levels)  # held[l]: what level l's current block holds; the last level holds all it computed
    crossing = [{j for k in level for j in cuts[k].crossing} for level in levels[1:]] + [None]
    block: list[int | None] = [None] * inner
    held: list[set[int]] = [set() for _ in range(inner)]
    kept = always.copy()  # always, or held by some level: kept up to date as blocks change
    seg = last
    walk = StageWalk(graph)
    for t in graph.ids_of_kind(NodeKind.BACKWARD):
        deps = graph.nodes[t].deps
        seg = max((segment[d] for d in deps if d in segment), default=seg)
        for level in range(inner):  # entering another block of a level leaves those below it too
            here = bisect.bisect_left(level_cuts[level], seg)
            if here != block[level]:
                dropped = set().union(*held[level:])
                for deeper in range(level, inner):
                    block[deeper] = bisect.bisect_left(level_cuts[deeper], seg)
                    held[deeper] = set()
                still = set().union(*held[:level])
                for v in dropped:
                    kept[v] = always[v] or v in still
                break
        fresh = [i for i in walk.recompute_for(t, kept) if i in segment]
        for level in range(inner):
            new = fresh if crossing[level] is None else [i for i in fresh if i in crossing[level]]
            held[level].update(new)
            kept[new] = True
    return walk.measure(label)


def _checkpoints(cuts: list[Cut] | tuple[Cut, ...]) -> tuple[int, ...]:
    return tuple(sorted({j for c in cuts for j in c.crossing}))


def _segments(forward: tuple[int, ...], tier: tuple[Cut, ...]) -> list[tuple[int, ...]]:
    """The forward nodes from the start to the first cut of ``tier``, and between each two."""
    pos = {i: p for p, i in enumerate(forward)}
    bounds = [-1, *(pos[c.node] for c in tier)]
    return [forward[a + 1:b + 1] for a, b in zip(bounds, bounds[1:])]


@register("segments")
def segments(graph: Graph, budget_bytes: int) -> SolveResult:
    """Keep what crosses light cuts of the forward pass and recompute the segments between
    them once in the backward pass; the cheapest such plan that fits (see ``_plans``). Raises
    ``InfeasibleBudgetError`` with the lowest peak of the plans tried."""
    started = time.perf_counter()
    return pick_cheapest(graph, _plans(graph, budget_bytes), budget_bytes=budget_bytes, method="segments",
                         started_s=started)


@considers("segments")
def _plans(graph: Graph, budget_bytes: int) -> list:
    """The plans ``segments`` chooses from, the same for every budget (measured once per graph).
    Two families per tier of cuts: every k-th cut with every segment recomputed
    (``torch.utils.checkpoint`` on every k-th block; also Chen's greedy rule over the tier),
    and every cut with only some segments recomputed, those that free the most bytes per unit
    of compute first (checkpointing every other block)."""
    return remembered(graph, ("segments",), lambda: _measure_all(graph))


def _measure_all(graph: Graph) -> list:
    tried: dict[tuple[int, ...], object] = {}

    def consider(checkpoints: Iterable[int], what: str) -> None:
        key = tuple(sorted(checkpoints))
        if key not in tried:
            tried[key] = chen_plan(graph, key, what)

    forward = graph.ids_of_kind(NodeKind.FORWARD)
    in_forward = set(forward)
    consider(in_forward, "checkpoint-all")
    read_later = [any(u not in in_forward for u in graph.users[i]) for i in range(graph.n)]
    total = sum(graph.nodes[i].out_bytes for i in forward)
    for level, tier in enumerate(cut_tiers(block_cuts(graph, at_most=UNIFORM_MAX_CUTS))):
        by_node = {c.node: c for c in tier}
        for k in range(1, min(MAX_STRIDE, len(tier)) + 1):
            for offset in range(k):
                consider(_checkpoints(tier[offset::k]),
                         f"{_every(k)} cut of tier {level} from cut {offset}")
        for threshold in np.unique(np.linspace(-1, total, GREEDY_POINTS).astype(np.int64)):
            chosen = [by_node[i] for i in greedy_checkpoints(graph, by_node, int(threshold))]
            consider(_checkpoints(chosen), f"greedy cuts of tier {level} (threshold {int(threshold)} B)")
        # recompute only the segments that free the most saved bytes per unit of compute
        parts = _segments(forward, tier)
        saved = [sum(graph.nodes[i].out_bytes for i in seg if read_later[i]) for seg in parts]
        cost = [sum(graph.nodes[i].cost for i in seg) for seg in parts]
        ranked = sorted(range(len(parts)), key=lambda s: (-saved[s] / max(cost[s], 1e-12), s))
        base = set(_checkpoints(tier))
        for r in sorted({int(round(x)) for x in np.linspace(1, len(parts) - 1, min(len(parts) - 1, SUBSET_POINTS))}):
            kept = {i for s in ranked[r:] for i in parts[s]}
            consider(base | kept, f"{r} of the {len(parts)} segments of tier {level} recomputed")
    return list(tried.values())


def _every(k: int) -> str:
    """'every cut', 'every 2nd', 'every 3rd', 'every 4th', 'every 12th', 'every 21st'."""
    if k == 1:
        return "every"
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"every {k}{suffix}"


# ---------------------------------------------------------------------------- nested
#: Coarse strides tried for the outer levels of ``nested``: every a-th cut of a tier.
NESTED_STRIDES = (2, 3, 4, 6, 8, 12, 16)


@register("nested")
def nested(graph: Graph, budget_bytes: int) -> SolveResult:
    """Nested checkpointing over the light cuts (``nested_plan``): two or three levels, the
    outer ones every a-th (and b-th) cut of a tier, the inner one every cut of it, or nothing
    kept from the forward pass at all. Values are recomputed up to once per level, so it
    reaches budgets below the one-level plans (``segments``) at a higher cost; the cheapest
    plan that fits. Raises ``InfeasibleBudgetError`` with the lowest peak of the plans tried.

    >>> from remat.builders import chain_graph
    >>> from remat.solvers import solve
    >>> g = chain_graph(12, bytes_per_node=1)
    >>> solve(g, 9, method="nested").peak_bytes <= 9 < solve(g, 100, method="segments").peak_bytes
    True
    """
    started = time.perf_counter()
    return pick_cheapest(graph, _nested_plans(graph, budget_bytes), budget_bytes=budget_bytes, method="nested",
                         started_s=started)


@considers("nested")
def _nested_plans(graph: Graph, budget_bytes: int) -> list:
    """The plans ``nested`` chooses from, the same for every budget (measured once per graph)."""
    return remembered(graph, ("nested plans",), lambda: _measure_nested(graph))


def _measure_nested(graph: Graph) -> list:
    forward = graph.ids_of_kind(NodeKind.FORWARD)
    plans = {"all": chen_plan(graph, forward, "checkpoint-all")}
    tiers = cut_tiers(block_cuts(graph, at_most=UNIFORM_MAX_CUTS))
    for t, tier in enumerate(tiers):
        every = tuple(range(len(tier)))
        candidates = [(((), every), "nothing kept from the forward pass, every cut recomputed")]
        for a in NESTED_STRIDES:
            if a >= len(tier):
                continue
            for offset in sorted({0, a // 2}):
                outer = every[offset::a]
                candidates.append(((outer, every), f"{_every(a)} cut from {offset}, then every cut"))
                candidates.append((((), outer, every), f"nothing, {_every(a)} cut from {offset}, then every cut"))
                for b in (2, 3):
                    if b < a and a % b == 0:
                        middle = tuple(sorted(set(every[offset % b::b]) | set(outer)))
                        candidates.append(((outer, middle, every), f"{_every(a)}, then {_every(b)} cut from {offset}, "
                                                                      f"then every cut"))
        for levels, what in candidates:
            plans.setdefault((t, levels), nested_plan(graph, tier, levels, f"nested, tier {t}: {what}"))
    return list(plans.values())
