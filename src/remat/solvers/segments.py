"""segments: keep only what crosses some of the forward pass's light cuts (``remat.cuts``:
block boundaries found from the graph) and recompute the segments between them once in the
backward pass. This is what ``torch.utils.checkpoint`` on every block (or every k-th block, or
every other block) of a network does, found from the graph instead of from the model's code.

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

import time
from collections.abc import Iterable

import numpy as np

from remat.cuts import Cut, cut_tiers, light_cuts
from remat.graph import Graph, NodeKind
from remat.solvers.base import SolveResult, register
from remat.solvers.baselines import chen_plan, considers, greedy_checkpoints, pick_cheapest, remembered

#: Strides tried: every k-th cut of a tier for k = 1..MAX_STRIDE, at every offset.
MAX_STRIDE = 8
#: Thresholds of Chen's greedy rule tried per tier.
GREEDY_POINTS = 24
#: How many counts of recomputed segments are tried per tier (spread from 1 to all but one).
SUBSET_POINTS = 32


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
    for level, tier in enumerate(cut_tiers(light_cuts(graph))):
        by_node = {c.node: c for c in tier}
        for k in range(1, min(MAX_STRIDE, len(tier)) + 1):
            for offset in range(k):
                consider(_checkpoints(tier[offset::k]), f"every {k}-th cut of tier {level} from cut {offset}")
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
